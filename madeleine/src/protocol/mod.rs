//! Madeleine's decisions as plain state with no I/O, driven by the channel (`crate::channel`,
//! which moves the bytes through the pipe) and tested here in memory: a sender's state fills
//! pipe messages that a receiver's state takes apart, with no pipe in between.
//!
//! - [`send`]: how a pack travels (inline, bulk lane, rendezvous; the crossover asked with the
//!   time passed in), how packs are aggregated into pipe messages and fragmented, how a message
//!   is framed (`One`, `Whole`, or `Begin` .. `End`) and numbered.
//! - [`recv`]: which message is due, the checks of each unpack against its pack, the end of
//!   a message and its pack count.
//! - [`release`]: rendezvous ids and the release count that frees the sender's buffers.
//! - [`offer`]: rendezvous a blocking sender may withdraw, their claim word and which packs
//!   are offered.
//! - [`mismatch`]: what differs between a message as packed and as unpacked, and its report.

pub(crate) mod mismatch;
pub(crate) mod offer;
pub(crate) mod recv;
pub(crate) mod release;
pub(crate) mod send;

pub(crate) use mismatch::Mismatch;
pub(crate) use offer::OfferPolicy;
pub(crate) use recv::{RecvSide, WholeMsg};
pub(crate) use release::{is_released, released};
pub(crate) use send::{Framing, InlineStep, Limits, Route, SendSide, SMALL_PACK_SAMPLE};

#[cfg(test)]
mod tests;
