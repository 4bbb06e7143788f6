//! The hand-made synchronization primitives of `portability-verbs`, in a crate of their own so
//! that their loom model tests build without the rest of the stack:
//! `RUSTFLAGS="--cfg loom" cargo test -p pv-sync --release` explores every interleaving (and
//! every outcome the memory model allows) of the scenarios each module's `loom_tests` spells
//! out. Built normally, the atomics are `std`'s and nothing here costs more than the code it
//! replaced.
//!
//! - [`spin`]: a spin lock whose unlock is a plain store.
//! - [`stack`]: a lock-free stack of indices (a tagged Treiber stack), the buffer pool's free list.
//! - [`copyline`]: the line through which a copy's back half is offered to a helper (a seqlock
//!   and a compare-and-swap), the software provider's shared copies.
//! - [`slot`]: a slot publishing a range and its level to lock-free readers (a seqlock), the
//!   memory-protection hold table's entry.

#![warn(missing_debug_implementations)]

mod atomic;
pub mod copyline;
pub mod slot;
pub mod spin;
pub mod stack;

pub use slot::{RangeSlot, Snapshot};
pub use spin::{SpinGuard, SpinLock};
pub use stack::IndexStack;
