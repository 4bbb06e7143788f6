//! # portability-verbs
//!
//! A verbs-shaped portability layer for RDMA: protection domains, registered memory with keys,
//! completion queues, reliable-connected queue pairs with send/receive, RDMA read/write,
//! write-with-immediate and atomics — with two providers behind one API:
//!
//! - the **software provider** (default): runs on any Linux machine, between threads of one
//!   process and between processes of one host (shared memory, cross-memory attach);
//! - the **hardware provider** (cargo feature `hardware`): rdma-core's libibverbs.
//!
//! Verbs semantics are kept exactly (in-order reliable delivery, receiver-not-ready retries, key
//! and bounds checks at the target, flush on error, CQ overrun reporting), because every upper
//! layer and the hardware provider rely on them.
//!
//! ```no_run
//! use portability_verbs::*;
//! let ctx = Context::open_default()?;
//! let pd = ctx.alloc_pd()?;
//! let cq = ctx.create_cq(256)?;
//! let a = pd.create_qp(&QpInit::new(&cq))?;
//! let b = pd.create_qp(&QpInit::new(&cq))?;
//! a.connect_to(b.endpoint())?;
//! b.connect_to(a.endpoint())?;
//! let mr = pd.register(vec![0u8; 4096].into_boxed_slice(), AccessFlags::ALL)?;
//! b.post_recv(&[RecvWr::new(1, &[mr.sge(0, 2048)])])?;
//! a.post_send(&[SendWr::send(2, &[mr.sge(2048, 64)])])?;
//! let mut wc = [WorkCompletion::EMPTY; 4];
//! let n = cq.poll_blocking(&mut wc, std::time::Duration::from_secs(1))?;
//! # Ok::<(), VerbsError>(())
//! ```

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
#![warn(missing_debug_implementations)]

pub mod cm;
pub mod copy;
pub mod cores;
pub mod datapath;
pub mod endpoint;
pub mod env;
pub mod error;
#[cfg(feature = "hardware")]
mod hw;
pub mod os;
pub mod protect;
pub mod soft;
pub mod types;
mod verbs;
pub mod wait;

/// The stack's hand-made synchronization primitives (model-checked with loom).
pub use pv_sync as sync;

pub use endpoint::{EndpointInfo, HwEndpoint, SoftEndpoint};
pub use error::{Result, VerbsError};
pub use soft::SoftConfig;
pub use types::*;
pub use verbs::*;
pub use wait::{spin_yields, wait_any, wait_any_or};
