//! What the library knows of a program's stream socket: a candidate (not yet connected or
//! listening, still the kernel's) or an accelerated connection.

use std::ffi::c_int;
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;

use sockets_compat::SdpStream;

/// A TCP socket the program made, not yet connected or listening.
#[derive(Clone, Copy, Debug)]
pub struct Candidate {
    pub domain: c_int,
}

/// An accelerated connection, shared by the descriptors `dup` made of it (the last one closed
/// closes it).
pub struct Connected {
    pub stream: SdpStream,
    pub domain: c_int,
    /// What `getsockname` and `getpeername` report.
    pub local: SocketAddr,
    pub peer: SocketAddr,
    /// `O_NONBLOCK` as the program set it (the eventfd's own flag is never changed).
    pub nonblocking: AtomicBool,
}
