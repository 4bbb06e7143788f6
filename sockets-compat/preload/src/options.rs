//! The state of accelerated sockets: `shutdown`, their names, their options.

use std::ffi::{c_int, c_void};
use std::io;
use std::net::Shutdown;
use std::time::Duration;

use libc::{sockaddr, socklen_t};

use crate::addr::addr_to;
use crate::guard::Inside;
use crate::real::real;
use crate::{connected, errno_of, fail, set_errno};

#[no_mangle]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    let Some(c) = connected(fd) else {
        // SAFETY: the caller's arguments, passed on.
        return unsafe { (real().shutdown)(fd, how) };
    };
    let how = match how {
        libc::SHUT_RD => Shutdown::Read,
        libc::SHUT_WR => Shutdown::Write,
        libc::SHUT_RDWR => Shutdown::Both,
        _ => {
            set_errno(libc::EINVAL);
            return -1;
        }
    };
    let _in = Inside::enter();
    match c.stream.shutdown(how) {
        Ok(()) => 0,
        Err(e) => fail(&e),
    }
}

/// `getsockname` (`peer` false) or `getpeername` of `fd`: what the table recorded for an
/// accelerated connection, else the C library's.
unsafe fn name(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, peer: bool) -> c_int {
    match connected(fd) {
        Some(c) => {
            // SAFETY: the caller's buffer.
            unsafe { addr_to(if peer { c.peer } else { c.local }, c.domain, addr, len) };
            0
        }
        // SAFETY: the caller's arguments, passed on.
        None if peer => unsafe { (real().getpeername)(fd, addr, len) },
        // SAFETY: as above.
        None => unsafe { (real().getsockname)(fd, addr, len) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn getsockname(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // SAFETY: forwarded contract.
    unsafe { name(fd, addr, len, false) }
}

#[no_mangle]
pub unsafe extern "C" fn getpeername(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // SAFETY: forwarded contract.
    unsafe { name(fd, addr, len, true) }
}

/// Writes an option's value for `getsockopt`: truncated to `*len`, `*len` set to its size.
unsafe fn option_out(bytes: &[u8], val: *mut c_void, len: *mut socklen_t) {
    if val.is_null() || len.is_null() {
        return;
    }
    // SAFETY: the caller's buffer of `*len` bytes.
    unsafe {
        let n = (*len as usize).min(bytes.len());
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), val as *mut u8, n);
        *len = n as socklen_t;
    }
}

fn timeval_of(t: Option<Duration>) -> [u8; std::mem::size_of::<libc::timeval>()] {
    let t = t.unwrap_or_default();
    let tv = libc::timeval { tv_sec: t.as_secs() as _, tv_usec: t.subsec_micros() as _ };
    // SAFETY: a plain C struct's bytes.
    unsafe { std::mem::transmute(tv) }
}

#[no_mangle]
pub unsafe extern "C" fn getsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    let Some(c) = connected(fd) else {
        // SAFETY: the caller's arguments, passed on.
        return unsafe { (real().getsockopt)(fd, level, name, val, len) };
    };
    let _in = Inside::enter();
    let int = |v: c_int| v.to_ne_bytes().to_vec();
    let bytes = match (level, name) {
        (libc::SOL_SOCKET, libc::SO_ERROR) => int(c.stream.take_error().ok().flatten().map_or(0, |e| errno_of(&e))),
        (libc::SOL_SOCKET, libc::SO_TYPE) => int(libc::SOCK_STREAM),
        (libc::SOL_SOCKET, libc::SO_DOMAIN) => int(c.domain),
        (libc::SOL_SOCKET, libc::SO_PROTOCOL) => int(libc::IPPROTO_TCP),
        (libc::SOL_SOCKET, libc::SO_RCVBUF | libc::SO_SNDBUF) => int(2 << 20),
        (libc::SOL_SOCKET, libc::SO_RCVTIMEO) => timeval_of(c.stream.read_timeout().ok().flatten()).to_vec(),
        (libc::SOL_SOCKET, libc::SO_SNDTIMEO) => timeval_of(c.stream.write_timeout().ok().flatten()).to_vec(),
        (libc::SOL_SOCKET, libc::SO_LINGER) => vec![0u8; std::mem::size_of::<libc::linger>()],
        (libc::IPPROTO_TCP, libc::TCP_NODELAY) => int(c.stream.nodelay().unwrap_or(true) as c_int),
        (libc::IPPROTO_TCP, libc::TCP_MAXSEG) => int(65483),
        // No segments, no retransmissions: a zeroed `struct tcp_info` of the size asked (at most
        // 512 bytes; the struct is about 240).
        // SAFETY: the caller's length.
        (libc::IPPROTO_TCP, libc::TCP_INFO) if !len.is_null() => vec![0u8; (unsafe { *len } as usize).min(512)],
        _ => int(0),
    };
    // SAFETY: the caller's buffer.
    unsafe { option_out(&bytes, val, len) };
    0
}

#[no_mangle]
pub unsafe extern "C" fn setsockopt(fd: c_int, level: c_int, name: c_int, val: *const c_void, len: socklen_t) -> c_int {
    let Some(c) = connected(fd) else {
        // SAFETY: the caller's arguments, passed on.
        return unsafe { (real().setsockopt)(fd, level, name, val, len) };
    };
    let _in = Inside::enter();
    let timeout = || -> Option<Option<Duration>> {
        if val.is_null() || (len as usize) < std::mem::size_of::<libc::timeval>() {
            return None;
        }
        // SAFETY: the caller's timeval.
        let tv = unsafe { *(val as *const libc::timeval) };
        let d = Duration::from_secs(tv.tv_sec.max(0) as u64) + Duration::from_micros(tv.tv_usec.max(0) as u64);
        Some((!d.is_zero()).then_some(d))
    };
    let r = match (level, name) {
        (libc::SOL_SOCKET, libc::SO_RCVTIMEO) => match timeout() {
            Some(t) => c.stream.set_read_timeout(t),
            None => Err(io::Error::from_raw_os_error(libc::EINVAL)),
        },
        (libc::SOL_SOCKET, libc::SO_SNDTIMEO) => match timeout() {
            Some(t) => c.stream.set_write_timeout(t),
            None => Err(io::Error::from_raw_os_error(libc::EINVAL)),
        },
        (libc::IPPROTO_TCP, libc::TCP_NODELAY) if !val.is_null() && len as usize >= 4 => {
            // SAFETY: the caller's int.
            c.stream.set_nodelay(unsafe { *(val as *const c_int) } != 0)
        }
        // Other options (buffer sizes, keep-alive, ...) have no SDP meaning: accepted.
        _ => Ok(()),
    };
    match r {
        Ok(()) => 0,
        Err(e) => fail(&e),
    }
}
