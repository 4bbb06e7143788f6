//! Socket addresses between C and Rust: what the preload library and the EXS C API both
//! read from and write to their callers.

use std::ffi::c_int;
use std::net::SocketAddr;

use libc::{sockaddr, socklen_t};

/// A socket address from C.
///
/// # Safety
/// `addr` is null or points to `len` readable bytes.
pub unsafe fn addr_from(addr: *const sockaddr, len: socklen_t) -> Option<SocketAddr> {
    if addr.is_null() {
        return None;
    }
    // SAFETY: the caller's address of `len` bytes, read by its family.
    unsafe {
        match (*addr).sa_family as c_int {
            libc::AF_INET if len as usize >= std::mem::size_of::<libc::sockaddr_in>() => {
                let a = &*(addr as *const libc::sockaddr_in);
                let ip = std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
                Some(SocketAddr::new(ip.into(), u16::from_be(a.sin_port)))
            }
            libc::AF_INET6 if len as usize >= std::mem::size_of::<libc::sockaddr_in6>() => {
                let a = &*(addr as *const libc::sockaddr_in6);
                let ip = std::net::Ipv6Addr::from(a.sin6_addr.s6_addr);
                Some(SocketAddr::new(ip.into(), u16::from_be(a.sin6_port)))
            }
            _ => None,
        }
    }
}

/// Writes `a` for C as `getsockname` does: truncated to `*len`, `*len` set to its full size.
/// An IPv4 address on an IPv6 socket is written mapped.
///
/// # Safety
/// `out` and `len` are null or `len` points to a length and `out` to that many writable bytes.
pub unsafe fn addr_to(a: SocketAddr, domain: c_int, out: *mut sockaddr, len: *mut socklen_t) {
    if out.is_null() || len.is_null() {
        return;
    }
    // SAFETY: zeroed sockaddr storage is valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let size = match (a, domain) {
        (SocketAddr::V4(v4), libc::AF_INET) => {
            // SAFETY: sockaddr_storage holds a sockaddr_in.
            let s = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in) };
            s.sin_family = libc::AF_INET as _;
            s.sin_port = v4.port().to_be();
            s.sin_addr.s_addr = u32::from(*v4.ip()).to_be();
            std::mem::size_of::<libc::sockaddr_in>()
        }
        _ => {
            let v6 = match a {
                SocketAddr::V4(v4) => std::net::SocketAddrV6::new(v4.ip().to_ipv6_mapped(), v4.port(), 0, 0),
                SocketAddr::V6(v6) => v6,
            };
            // SAFETY: sockaddr_storage holds a sockaddr_in6.
            let s = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in6) };
            s.sin6_family = libc::AF_INET6 as _;
            s.sin6_port = v6.port().to_be();
            s.sin6_addr.s6_addr = v6.ip().octets();
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    // SAFETY: the caller's buffer of `*len` bytes.
    unsafe {
        let n = (*len as usize).min(size);
        std::ptr::copy_nonoverlapping(&ss as *const _ as *const u8, out as *mut u8, n);
        *len = size as socklen_t;
    }
}

/// `a` as C's `sockaddr_storage` and its length.
pub fn sockaddr_of(a: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: zeroed sockaddr storage is valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match a {
        SocketAddr::V4(v4) => {
            // SAFETY: sockaddr_storage holds a sockaddr_in.
            let s = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in) };
            s.sin_family = libc::AF_INET as _;
            s.sin_port = v4.port().to_be();
            s.sin_addr.s_addr = u32::from(*v4.ip()).to_be();
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            // SAFETY: sockaddr_storage holds a sockaddr_in6.
            let s = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in6) };
            s.sin6_family = libc::AF_INET6 as _;
            s.sin6_port = v6.port().to_be();
            s.sin6_addr.s6_addr = v6.ip().octets();
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}
