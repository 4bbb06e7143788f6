//! Reading and writing on accelerated descriptors: the `read`, `recv`, `write`, `send`
//! families and `sendfile`.

use std::ffi::{c_int, c_void};
use std::io;
use std::sync::atomic::Ordering;
use std::time::Duration;

use libc::{iovec, msghdr, off_t, size_t, sockaddr, socklen_t, ssize_t};

use crate::guard::Inside;
use crate::real::real;
use crate::signals::{handlers_restart, pending_for, Blocked};
use crate::table::Connected;
use crate::{connected, fail};

/// How long a blocking receive polls before it waits on the descriptor (where a signal
/// interrupts it): a wake-up costs tens of microseconds, a poll a fraction of one.
const RECEIVE_SPIN: Duration = Duration::from_micros(50);

/// One receive attempt that never waits.
fn receive_once(c: &Connected, buf: &mut [u8], peek: bool) -> io::Result<usize> {
    if peek {
        c.stream.try_peek(buf)
    } else {
        c.stream.try_read(buf)
    }
}

/// A blocking receive as the kernel's: polls a while, then waits on the descriptor `fd` (the
/// socket's readiness eventfd), where a signal ends the wait with `EINTR` (the program's
/// handler has run; `SA_RESTART` does not restart socket waits with a timeout, and a program
/// that wants the retry loops). `SO_RCVTIMEO` ends it with `EAGAIN`.
fn receive_blocking(c: &Connected, fd: c_int, buf: &mut [u8], peek: bool) -> io::Result<usize> {
    let start = std::time::Instant::now();
    let limit = c.stream.read_timeout()?;
    let mut polls = 0u32;
    loop {
        match receive_once(c, buf, peek) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            other => return other,
        }
        polls = polls.wrapping_add(1);
        if !polls.is_multiple_of(64) || start.elapsed() < RECEIVE_SPIN {
            if polls.is_multiple_of(256) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            continue;
        }
        let wait_ms = match limit {
            None => -1,
            Some(t) => match t.checked_sub(start.elapsed()) {
                Some(left) => left.as_millis().clamp(1, i32::MAX as u128) as c_int,
                None => return Err(io::ErrorKind::WouldBlock.into()),
            },
        };
        c.stream.about_to_wait();
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd; `poll` is not intercepted.
        if unsafe { libc::poll(&mut p, 1, wait_ms) } < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) && (limit.is_some() || !handlers_restart()) {
                return Err(e);
            }
        }
    }
}

fn receive(c: &Connected, fd: c_int, buf: &mut [u8], flags: c_int) -> ssize_t {
    let _in = Inside::enter();
    let peek = flags & libc::MSG_PEEK != 0;
    let dontwait = flags & libc::MSG_DONTWAIT != 0 || c.nonblocking.load(Ordering::Relaxed);
    let got = if dontwait { receive_once(c, buf, peek) } else { receive_blocking(c, fd, buf, peek) };
    let got = got.map(|mut n| {
        // MSG_WAITALL: the rest too, unless the stream ends, fails or a signal comes (the
        // bytes so far are returned; the error, if any, comes next time).
        if flags & libc::MSG_WAITALL != 0 && !peek && !dontwait {
            while n > 0 && n < buf.len() {
                match receive_blocking(c, fd, &mut buf[n..], false) {
                    Ok(0) | Err(_) => break,
                    Ok(k) => n += k,
                }
            }
        }
        n
    });
    match got {
        Ok(n) => n as ssize_t,
        Err(e) => fail(&e),
    }
}

/// A blocking send as the kernel's: all of `buf`, unless a signal comes while it waits for
/// room (then the bytes sent so far, or `EINTR` if none and a handler does not ask for
/// `SA_RESTART`), `SO_SNDTIMEO` passes (the bytes so far, or `EAGAIN`) or the connection
/// fails (the bytes so far; the error comes next time). What fits at once goes without
/// touching the signal mask; the rest waits with the program's signals blocked, looking for
/// pending ones, which are delivered before the call returns.
fn transmit_blocking(c: &Connected, buf: &[u8]) -> io::Result<usize> {
    let mut n = match c.stream.try_write(buf) {
        Ok(n) if n == buf.len() => return Ok(n),
        Ok(n) => n,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
        Err(e) => return Err(e),
    };
    loop {
        let blocked = Blocked::new();
        let mask: *const libc::sigset_t = blocked.previous_mask();
        let signalled = std::cell::Cell::new(false);
        let r = c.stream.write_or_stop(&buf[n..], &|| {
            signalled.set(pending_for(mask));
            signalled.get()
        });
        drop(blocked); // a signal that stopped the write runs its handler now
        match r {
            Ok(k) => {
                n += k;
                // All of it, or stopped by a signal or the timeout after some bytes (the
                // kernel reports them); a write that took part for another reason goes on.
                if n == buf.len() || k == 0 || signalled.get() || c.stream.write_timeout()?.is_some() {
                    return Ok(n);
                }
            }
            Err(_) if n > 0 => return Ok(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                if c.stream.write_timeout()?.is_some() || !handlers_restart() {
                    return Err(e);
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// Sends `buf`: all of it on a blocking socket (as the kernel does), what fits otherwise.
/// `EPIPE` raises `SIGPIPE` unless `MSG_NOSIGNAL`.
fn transmit(c: &Connected, buf: &[u8], flags: c_int) -> ssize_t {
    let _in = Inside::enter();
    let dontwait = flags & libc::MSG_DONTWAIT != 0;
    let blocking = !dontwait && !c.nonblocking.load(Ordering::Relaxed);
    let sent = if blocking { transmit_blocking(c, buf) } else { c.stream.try_write(buf) };
    match sent {
        Ok(n) => n as ssize_t,
        Err(e) => {
            if e.kind() == io::ErrorKind::BrokenPipe && flags & libc::MSG_NOSIGNAL == 0 {
                // SAFETY: signals this thread, as the kernel does on EPIPE.
                unsafe { libc::pthread_kill(libc::pthread_self(), libc::SIGPIPE) };
            }
            fail(&e)
        }
    }
}

/// The caller's buffer as a slice (empty for a null pointer).
unsafe fn slice_mut<'a>(buf: *mut c_void, n: size_t) -> &'a mut [u8] {
    if buf.is_null() || n == 0 {
        return &mut [];
    }
    // SAFETY: the caller's buffer of `n` bytes.
    unsafe { std::slice::from_raw_parts_mut(buf as *mut u8, n) }
}

unsafe fn slice<'a>(buf: *const c_void, n: size_t) -> &'a [u8] {
    if buf.is_null() || n == 0 {
        return &[];
    }
    // SAFETY: the caller's buffer of `n` bytes.
    unsafe { std::slice::from_raw_parts(buf as *const u8, n) }
}

#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    match connected(fd) {
        // SAFETY: the caller's buffer.
        Some(c) => receive(&c, fd, unsafe { slice_mut(buf, n) }, 0),
        // SAFETY: the caller's arguments, passed on.
        None => unsafe { (real().read)(fd, buf, n) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    match connected(fd) {
        // SAFETY: the caller's buffer.
        Some(c) => receive(&c, fd, unsafe { slice_mut(buf, n) }, flags),
        // SAFETY: the caller's arguments, passed on.
        None => unsafe { (real().recv)(fd, buf, n, flags) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> ssize_t {
    match connected(fd) {
        Some(c) => {
            // A connected stream socket reports no source address.
            if !len.is_null() {
                // SAFETY: the caller's length.
                unsafe { *len = 0 };
            }
            // SAFETY: the caller's buffer.
            receive(&c, fd, unsafe { slice_mut(buf, n) }, flags)
        }
        // SAFETY: the caller's arguments, passed on.
        None => unsafe { (real().recvfrom)(fd, buf, n, flags, addr, len) },
    }
}

/// Reads into the first non-empty buffer of `iov` (a short read, as readv may return).
unsafe fn receive_vec(c: &Connected, fd: c_int, iov: *const iovec, cnt: c_int, flags: c_int) -> ssize_t {
    if iov.is_null() || cnt <= 0 {
        return 0;
    }
    // SAFETY: the caller's array of `cnt` iovecs.
    let iovs = unsafe { std::slice::from_raw_parts(iov, cnt as usize) };
    match iovs.iter().find(|v| v.iov_len > 0) {
        // SAFETY: the caller's buffer.
        Some(v) => receive(c, fd, unsafe { slice_mut(v.iov_base, v.iov_len) }, flags),
        None => 0,
    }
}

/// Writes the buffers of `iov` in turn, stopping at a short write.
unsafe fn transmit_vec(c: &Connected, iov: *const iovec, cnt: c_int, flags: c_int) -> ssize_t {
    if iov.is_null() || cnt <= 0 {
        return 0;
    }
    // SAFETY: the caller's array of `cnt` iovecs.
    let iovs = unsafe { std::slice::from_raw_parts(iov, cnt as usize) };
    let mut total: ssize_t = 0;
    for v in iovs.iter().filter(|v| v.iov_len > 0) {
        // SAFETY: the caller's buffer.
        let n = transmit(c, unsafe { slice(v.iov_base, v.iov_len) }, flags);
        if n < 0 {
            return if total > 0 { total } else { n };
        }
        total += n;
        if (n as usize) < v.iov_len {
            break;
        }
    }
    total
}

#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    match connected(fd) {
        // SAFETY: forwarded contract.
        Some(c) => unsafe { receive_vec(&c, fd, iov, cnt, 0) },
        // SAFETY: the caller's arguments, passed on.
        None => unsafe { (real().readv)(fd, iov, cnt) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    match connected(fd) {
        Some(c) if !msg.is_null() => {
            // SAFETY: the caller's message header.
            unsafe {
                (*msg).msg_namelen = 0;
                (*msg).msg_controllen = 0;
                (*msg).msg_flags = 0;
                receive_vec(&c, fd, (*msg).msg_iov, (*msg).msg_iovlen as c_int, flags)
            }
        }
        // SAFETY: the caller's arguments, passed on.
        _ => unsafe { (real().recvmsg)(fd, msg, flags) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    match connected(fd) {
        // SAFETY: the caller's buffer.
        Some(c) => transmit(&c, unsafe { slice(buf, n) }, 0),
        // SAFETY: the caller's arguments, passed on.
        None => unsafe { (real().write)(fd, buf, n) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    match connected(fd) {
        // SAFETY: the caller's buffer.
        Some(c) => transmit(&c, unsafe { slice(buf, n) }, flags),
        // SAFETY: the caller's arguments, passed on.
        None => unsafe { (real().send)(fd, buf, n, flags) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    n: size_t,
    flags: c_int,
    addr: *const sockaddr,
    len: socklen_t,
) -> ssize_t {
    match connected(fd) {
        // A connected stream socket ignores the address (Linux does, or says EISCONN).
        // SAFETY: the caller's buffer.
        Some(c) => transmit(&c, unsafe { slice(buf, n) }, flags),
        // SAFETY: the caller's arguments, passed on.
        None => unsafe { (real().sendto)(fd, buf, n, flags, addr, len) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    match connected(fd) {
        // SAFETY: forwarded contract.
        Some(c) => unsafe { transmit_vec(&c, iov, cnt, 0) },
        // SAFETY: the caller's arguments, passed on.
        None => unsafe { (real().writev)(fd, iov, cnt) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    match connected(fd) {
        // SAFETY: the caller's message header.
        Some(c) if !msg.is_null() => unsafe { transmit_vec(&c, (*msg).msg_iov, (*msg).msg_iovlen as c_int, flags) },
        // SAFETY: the caller's arguments, passed on.
        _ => unsafe { (real().sendmsg)(fd, msg, flags) },
    }
}

unsafe fn sendfile_any(out: c_int, input: c_int, off: *mut off_t, n: size_t, sixty_four: bool) -> ssize_t {
    let r = real();
    let Some(c) = connected(out) else {
        // SAFETY: the caller's arguments, passed on.
        return unsafe {
            if sixty_four {
                (r.sendfile64)(out, input, off, n)
            } else {
                (r.sendfile)(out, input, off, n)
            }
        };
    };
    let mut buf = vec![0u8; n.min(1 << 20)];
    // SAFETY: reads the caller's file into our buffer, at its offset if given.
    let got = unsafe {
        if off.is_null() {
            (r.read)(input, buf.as_mut_ptr() as *mut c_void, buf.len())
        } else {
            libc::pread(input, buf.as_mut_ptr() as *mut c_void, buf.len(), *off)
        }
    };
    if got <= 0 {
        return got;
    }
    let sent = transmit(&c, &buf[..got as usize], 0);
    if sent > 0 && !off.is_null() {
        // SAFETY: the caller's offset.
        unsafe { *off += sent as off_t };
    } else if sent > 0 && sent < got {
        // Read more than was sent: put the file position back.
        // SAFETY: the caller's file.
        unsafe { libc::lseek(input, (sent - got) as off_t, libc::SEEK_CUR) };
    }
    sent
}

#[no_mangle]
pub unsafe extern "C" fn sendfile(out: c_int, input: c_int, off: *mut off_t, n: size_t) -> ssize_t {
    // SAFETY: forwarded contract.
    unsafe { sendfile_any(out, input, off, n, false) }
}

#[no_mangle]
pub unsafe extern "C" fn sendfile64(out: c_int, input: c_int, off: *mut off_t, n: size_t) -> ssize_t {
    // SAFETY: forwarded contract.
    unsafe { sendfile_any(out, input, off, n, true) }
}
