//! # sockets-compat
//!
//! Sockets Direct Protocol stream sockets over `portability-verbs`, with `std::net` semantics:
//! [`SdpListener`] and [`SdpStream`] behave like `TcpListener` and `TcpStream` (a byte stream,
//! partial reads, EOF after shutdown, errors when the peer dies, nonblocking mode), while the
//! bytes travel as SDP messages ([`wire`]) over the verbs layer.
//!
//! Send designs: BSDP (buffer copy through pre-registered buffers with the data-path flow
//! control), ZSDP (synchronous zero-copy: SrcAvail, the receiver's RDMA read, RdmaRdCompl) and
//! AZ-SDP (asynchronous zero-copy: the buffer is memory-protected until the transfer completes,
//! so `write` and `read` return at once; see [`stream`] for the contract).

#![warn(missing_debug_implementations)]

pub mod discovery;
mod engine;
pub mod exs;
pub mod proto;
pub mod sockaddr;
pub mod stream;
mod verbs_runtime;
pub mod wire;

pub use stream::{ReadyState, SdpConfig, SdpListener, SdpStream};
pub use wire::Design;
