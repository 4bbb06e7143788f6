//! The Extended Sockets API (Open Group ES-API, as UNH-EXS runs it in user space over RC queue
//! pairs): sockets whose sends and receives start at once and complete as events on an event
//! queue, over memory the application registered, so that data moves by RDMA straight
//! between the two applications' buffers.
//!
//! - [`wire`]: control messages, immediates, handshake data (sans-IO).
//! - [`proto`]: one connection's decisions (sans-IO).

pub mod proto;
pub mod wire;

/// The largest small message a slot may be set up to hold.
pub const SMALL_MAX_LIMIT: usize = 4096;
