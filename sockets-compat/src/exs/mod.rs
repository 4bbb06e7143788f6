//! The Extended Sockets API (Open Group ES-API, as UNH-EXS runs it in user space over RC queue
//! pairs): sockets whose connect, accept, send, receive and close start at once and complete
//! as [`Event`]s on an [`EventQueue`], over [`Memory`] the application registered, so that
//! data moves by RDMA straight between the two applications' buffers.
//!
//! ```no_run
//! use sockets_compat::exs::{EventQueue, ExsSocket, Memory, SocketKind};
//! # fn main() -> Result<(), sockets_compat::exs::ExsError> {
//! let q = EventQueue::new(64)?;
//! let s = ExsSocket::new(SocketKind::SeqPacket)?;
//! s.connect("10.0.0.2:7000", &q, 1)?;
//! let ev = q.dequeue(1, None).pop().expect("no timeout");
//! assert_eq!(ev.outcome, Ok(0));
//! let buf = Memory::alloc(4096)?;
//! buf.write(0, b"hello");
//! s.send(&q, 2, &buf, 0, 5)?;
//! let ev = q.dequeue(1, None).pop().expect("no timeout");
//! assert_eq!((ev.req, ev.outcome), (2, Ok(5)));
//! # Ok(()) }
//! ```
//!
//! How the bytes travel: `recv` advertises its buffer to the peer; `send` RDMA-writes into the
//! oldest advertisement, then says so in a note; a small message travels inside a control
//! message (into the advertised buffer, or ahead of any advertisement), and a stream's bytes go into the receiver's stream buffer
//! (copied once) — see [`proto`] for the ordering rules that keep all of it in order.
//!
//! - [`wire`]: control messages, write notes, handshake data (sans-IO).
//! - [`proto`]: one connection's decisions (sans-IO).
//! - `conn`: the driver between the protocol and the connection's message pipe; `engine`: progress and the
//!   completion thread; `queue`, [`memory`], [`socket`]: the API objects.

mod conn;
mod engine;
mod error;
pub mod memory;
pub mod proto;
pub mod queue;
pub mod socket;
pub mod wire;

pub use error::{ExsError, ExsResult};
pub use memory::Memory;
pub use queue::{EventKind, QueueStatus, MAX_CAPACITY};

/// A completed operation (see [`queue::Event`]).
pub type Event = queue::Event<ExsSocket>;
/// An event queue (`exs_qhandle_t`; see [`queue::EventQueue`]).
pub type EventQueue = queue::EventQueue<ExsSocket>;
pub use socket::{ExsSocket, Tunable, FIRST_SOCKET_ID};
pub use wire::SocketKind;

/// The largest small message a control message may be set up to carry.
pub const SMALL_MAX_LIMIT: usize = 4096;

/// Opens the verbs device and starts the completion thread (`exs_init`); every other call
/// does it on first use.
pub fn init() -> ExsResult<()> {
    crate::verbs_runtime::runtime().map_err(ExsError::io)?;
    engine::start()
}
