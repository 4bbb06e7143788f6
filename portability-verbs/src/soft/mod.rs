//! The software provider: verbs semantics on any Linux machine, between threads of one process
//! and between processes of one host.
//!
//! - Control state, queue-pair rings and provider-allocated memory live in memfd segments that
//!   peers reach with `pidfd_getfd` (nothing is named in `/dev/shm`).
//! - Two-sided traffic goes through the receiver's inbound ring (one copy in, one out for small
//!   messages; the receiver pulls large sends straight from the sender's memory, one copy).
//! - One-sided operations are carried out by the requester on the responder's memory, checked
//!   against the responder's published keys: plain loads and stores for provider-allocated
//!   segments and same-process memory, cross-memory attach for other user memory, and
//!   `/proc/PID/mem` where a page is protected. A large pull by cross-memory attach offers its
//!   back half to the peer, whose polling thread pushes it meanwhile (`assist`): the copy a NIC
//!   would make without either CPU is then shared by both instead of made by one.
//! - Waiting: busy polling needs no syscalls; a sleeper arms its queue's doorbell and producers
//!   signal its eventfd only then.
//! - Between processes that cannot share memory (another host or PID namespace, see `host`),
//!   or when asked, queue pairs carry the same verbs as frames over TCP (`tcp`), answered by a
//!   per-process progress thread as a NIC would.

mod assist;
mod backstop;
mod cq;
mod ctx;
mod dma;
mod host;
mod keys;
mod layout;
mod peer;
mod qp;
mod segment;
pub mod tcp;
pub mod wire;

pub use assist::{counts as shared_copies, SharedCopies};
/// The completion queue of software queue pairs.
pub(crate) type CqInner = cq::Cq<QpInner>;
pub use crate::os::page_size;
pub(crate) use ctx::CtxInner;
pub use ctx::SoftConfig;
pub use host::identity as host_identity;
pub use peer::SoftWindow;
pub(crate) use qp::{QpInner, SrqInner};

use std::sync::Arc;

use crate::error::{Result, VerbsError};
use crate::types::AccessFlags;

/// Opens a software context whose deregistrations wait out its queue pairs' lock holders.
pub(crate) fn open_context(config: SoftConfig) -> Result<Arc<CtxInner>> {
    CtxInner::open(config, qp::wait_for_lock_holders)
}

/// Memory behind a software registration.
pub(crate) enum SoftBacking {
    /// Caller's memory (the caller keeps it alive, see `register_raw`).
    Borrowed,
    /// An owned heap buffer.
    Owned(Box<[u8]>),
    /// A provider segment, mapped directly by peers.
    Segment(segment::Segment),
}

/// A software memory registration.
pub(crate) struct SoftMr {
    pub ctx: Arc<CtxInner>,
    pub key: u32,
    pub addr: u64,
    pub len: usize,
    backing: SoftBacking,
}

impl SoftMr {
    pub fn register(
        ctx: &Arc<CtxInner>,
        pd: u32,
        addr: u64,
        len: usize,
        access: AccessFlags,
        backing: SoftBacking,
    ) -> Result<SoftMr> {
        let seg = match &backing {
            SoftBacking::Segment(s) => Some(s),
            _ => None,
        };
        let key = ctx.register(addr, len as u64, access, pd, seg)?;
        Ok(SoftMr { ctx: ctx.clone(), key, addr, len, backing })
    }

    pub fn alloc(ctx: &Arc<CtxInner>, pd: u32, len: usize, access: AccessFlags) -> Result<SoftMr> {
        if len == 0 {
            return Err(VerbsError::invalid("cannot allocate an empty region"));
        }
        let seg = segment::Segment::create(ctx.id, len)?;
        let addr = seg.ptr() as u64;
        Self::register(ctx, pd, addr, len, access, SoftBacking::Segment(seg))
    }

    /// True when peers reach this region with plain loads and stores.
    pub fn is_shared_segment(&self) -> bool {
        matches!(self.backing, SoftBacking::Segment(_))
    }

    /// Replaces the u64 at `offset` by `op(old)` under this context's atomic lock, the one
    /// every peer's atomic on our memory takes; returns `old`.
    pub fn local_atomic(&self, offset: usize, op: impl FnOnce(u64) -> u64) -> Result<u64> {
        let addr = self.addr as usize + offset;
        if offset.checked_add(8).is_none_or(|e| e > self.len) || !addr.is_multiple_of(8) {
            return Err(VerbsError::invalid(format!(
                "local atomic at offset {offset} of a {}-byte region (8 aligned bytes inside it)",
                self.len
            )));
        }
        let tag = self.ctx.lock_tag;
        peer::with_atomic_lock(&self.ctx.ctrl().header().atomic_lock, tag, || {
            // SAFETY: 8 aligned bytes inside this live registration (checked above); every
            // writer of them that is not the owner's plain code runs under the same lock.
            let word = unsafe { &*(addr as *const std::sync::atomic::AtomicU64) };
            let old = word.load(std::sync::atomic::Ordering::Acquire);
            word.store(op(old), std::sync::atomic::Ordering::Release);
            old
        })
        .map_err(|st| VerbsError::InvalidState(format!("the context's atomic lock is stuck ({st:?})")))
    }
}

impl Drop for SoftMr {
    fn drop(&mut self) {
        if !self.ctx.deregister(self.key) {
            // A peer may still be copying into it: never hand the memory back to the allocator.
            match std::mem::replace(&mut self.backing, SoftBacking::Borrowed) {
                SoftBacking::Owned(b) => std::mem::forget(b),
                SoftBacking::Segment(s) => std::mem::forget(s),
                SoftBacking::Borrowed => {}
            }
        }
    }
}
