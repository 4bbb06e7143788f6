//! # madeleine
//!
//! The Madeleine pack/unpack messaging API over `portability-verbs`, for multithreaded
//! distributed programs. A [`Session`] is this process's membership in a group of processes; a
//! [`Channel`] is an independent communication context with a connection to every other
//! process. A message is built with [`Channel::begin_packing`], [`Packer::pack`] and
//! [`Packer::end_packing`], and taken apart in the same order with
//! [`Channel::begin_unpacking`], [`Unpacker::unpack`] and [`Unpacker::end_unpacking`]. The
//! application says how it uses each piece of data (the modes) and the library picks the
//! cheapest correct way to move it:
//!
//! | mode | contract |
//! |---|---|
//! | `SendMode::Safer` | the buffer may be modified as soon as `pack` returns |
//! | `SendMode::Later` | the buffer is read no earlier than `end_packing`: changes before it are sent |
//! | `SendMode::Cheaper` | the buffer may be read any time until `end_packing` returns; do not modify it |
//! | `RecvMode::Express` | the data is in the buffer when `unpack` returns |
//! | `RecvMode::Cheaper` | the data is guaranteed only after `end_unpacking` |
//!
//! The borrow checker enforces the buffer rules: a buffer packed `Later` or `Cheaper` stays
//! borrowed by the [`Packer`] until `end_packing`; [`Packer::pack_later`] takes the buffer's
//! mutable borrow, and [`Packer::later_mut`] lends it back for writing until then (SEND_LATER
//! as Madeleine meant it: a header's count filled in after the body was packed); a buffer unpacked `Cheaper` stays borrowed by
//! the [`Unpacker`] until `end_unpacking`. [`Packer::end_packing_nowait`] ends a message without
//! waiting for the receiver to read its zero-copy packs: the [`PendingSend`] it returns keeps
//! those buffers borrowed until it completes, and the connection takes the next message meanwhile.
//!
//! Small packs are copied and aggregated into flow-controlled pipe messages (the static-buffer
//! path); large ones go zero-copy from the user's memory (registered through the registration
//! cache) by rendezvous: the receiver RDMA-reads them. Sender/receiver mismatches of sizes, modes
//! or pack counts are detected and reported as [`MadError::Mismatch`] on both sides: to the
//! receiver by the unpack (or `end_unpacking`) that found it, to the sender by its next
//! [`Channel::begin_packing`] to that rank (once, naming the message and what differed); the
//! connection goes on.
//!
//! Blocking waits yield to the `may` scheduler inside a coroutine; on an OS thread they poll
//! while the thread has a CPU to itself and sleep on completion events while more threads are
//! ready to run than there are CPUs ([`Spin::Adaptive`], the default of
//! [`SessionConfig::spin`]), or spin for a fixed time ([`Spin::For`]). The library never calls `may::config()` and never requires coroutines.

#![warn(missing_debug_implementations)]

mod channel;
mod config;
mod pmix;
mod probe;
mod protocol;
pub mod rendezvous;
mod resources;
mod session;
mod wait;
pub mod wire;

pub use channel::{Channel, LaterPack, Packer, PendingSend, Unpacker};
pub use config::SessionConfig;
pub use session::Session;
pub use wait::Spin;

use portability_verbs::VerbsError;

/// How the library may read a packed buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SendMode {
    /// Copied (or otherwise captured) before `pack` returns.
    Safer,
    /// Read no earlier than `end_packing`.
    Later,
    /// Read any time until `end_packing` returns (the default, allows zero-copy).
    Cheaper,
}

/// When an unpacked buffer holds its data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RecvMode {
    /// When `unpack` returns.
    Express,
    /// After `end_unpacking` (allows several large transfers at once).
    Cheaper,
}

/// Errors of the Madeleine layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MadError {
    /// From the verbs layer.
    #[error(transparent)]
    Verbs(#[from] VerbsError),
    /// The receiver's unpacks do not match the sender's packs.
    #[error("pack/unpack mismatch with rank {rank}: {why}")]
    Mismatch {
        /// The peer.
        rank: usize,
        /// What differs.
        why: String,
    },
    /// A peer sent a malformed message; its connection is failed.
    #[error("malformed message from rank {rank}: {why}")]
    Protocol {
        /// The peer.
        rank: usize,
        /// What is wrong.
        why: String,
    },
    /// The connection to a peer is broken (it died or failed).
    #[error("connection to rank {rank} failed: {why}")]
    PeerLost {
        /// The peer.
        rank: usize,
        /// Why.
        why: String,
    },
    /// The peer closed its end of the channel (dropped it, or its session) after everything
    /// it sent was read: no more messages come from it, and none can go to it.
    #[error("rank {rank} closed its end of the channel")]
    PeerClosed {
        /// The peer.
        rank: usize,
    },
    /// A receive from any sender, when every other process closed its end of the channel.
    #[error("every other rank closed its end of the channel: no message can come")]
    AllPeersClosed,
    /// Bad session configuration or arguments.
    #[error("invalid: {0}")]
    Invalid(String),
    /// A wait ran out of time.
    #[error("timed out: {0}")]
    Timeout(String),
}

/// Result alias of this crate.
pub type Result<T, E = MadError> = std::result::Result<T, E>;
