//! The software provider's TCP transport: verbs between processes that cannot share memory
//! (other hosts, other PID namespaces, or any pair when `PV_SOFT_TRANSPORT=tcp`).
//!
//! - `frame`: the wire format (sans-IO, validated decoding).
//! - `link`: one connection's byte movement: gathered writes from registered memory, bodies
//!   read straight into their destination.
//! - `engine`: the per-process progress thread that accepts connections and drives responders.
//!
//! What a requester and a responder decide (ordering, checks, acknowledgements, retries) is
//! the queue pair's, in `soft::qp::tcp`.

pub(crate) mod engine;
pub mod frame;
pub(crate) mod link;
