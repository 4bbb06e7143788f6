//! Socket addresses between C and Rust: the kernel's name of a socket; the conversions live
//! in [`sockets_compat::sockaddr`].

use std::ffi::c_int;
use std::net::SocketAddr;

use libc::{sockaddr, socklen_t};
pub use sockets_compat::sockaddr::{addr_from, addr_to, sockaddr_of};

use crate::real::real;

/// The kernel's name for a socket of ours.
pub unsafe fn kernel_name(fd: c_int) -> Option<SocketAddr> {
    // SAFETY: zeroed storage; the kernel fills at most its size.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as socklen_t;
    // SAFETY: as above.
    if unsafe { (real().getsockname)(fd, &mut ss as *mut _ as *mut sockaddr, &mut len) } != 0 {
        return None;
    }
    // SAFETY: filled by the kernel.
    unsafe { addr_from(&ss as *const _ as *const sockaddr, len) }
}
