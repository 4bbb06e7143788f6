//! Layouts of the shared segments: what a peer process sees of a device context (its published
//! key table, receive-queue counters and completion doorbells) and of a queue pair (its state and
//! inbound ring).
//!
//! Only atomics live here, so any bit pattern a peer writes is a valid value. The owner keeps its
//! authoritative state privately and publishes a mirror: a peer that scribbles on a segment can
//! only mislead its own accesses.

use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64};

use super::segment::Segment;

/// Memory regions per context.
pub const MR_SLOTS: usize = 4096;
/// Receive queues (own or shared) per context.
pub const RQ_SLOTS: usize = 1024;
/// Completion-queue doorbells per context.
pub const BELL_SLOTS: usize = 1024;

const LINE: usize = 64;
const MR_TABLE: usize = LINE;
const RQ_TABLE: usize = MR_TABLE + MR_SLOTS * LINE;
const BELL_TABLE: usize = RQ_TABLE + RQ_SLOTS * LINE;
/// Bytes of a context's control segment.
pub const CTRL_BYTES: usize = BELL_TABLE + BELL_SLOTS * LINE;

/// First line of a control segment.
#[repr(C, align(64))]
pub struct CtrlHeader {
    /// Identifies a control segment.
    pub magic: AtomicU64,
    /// Lock that makes atomics targeting this context atomic with respect to each other:
    /// holder's tag (pid in the high half) or 0.
    pub atomic_lock: AtomicU64,
}

/// Magic of a control segment.
pub const CTRL_MAGIC: u64 = 0x5056_4354_524c_0001;

/// A published memory-region entry. Peers validate an rkey against it with the protocol of
/// [`super::mr`]: `key` is written last at registration and cleared first at deregistration,
/// `inuse` counts peer accesses in progress, which deregistration waits out.
#[repr(C, align(64))]
pub struct MrEntry {
    /// The current key, or 0 when free.
    pub key: AtomicU32,
    /// Access flags.
    pub access: AtomicU32,
    /// Protection domain.
    pub pd: AtomicU32,
    /// Descriptor number of the provider segment holding the region, or -1 for user memory.
    pub seg_fd: AtomicI32,
    /// Start address in the owner.
    pub addr: AtomicU64,
    /// Length.
    pub len: AtomicU64,
    /// Provider segment id (0 for user memory).
    pub seg_id: AtomicU64,
    /// Offset of the region in its segment.
    pub seg_off: AtomicU64,
    /// Peer accesses in progress.
    pub inuse: AtomicU32,
}

/// Counters of one receive queue: how many receives were ever posted and consumed. A producer
/// reads them to tell receiver-not-ready without the consumer's help.
#[repr(C, align(64))]
pub struct RqCounters {
    /// Receives posted so far.
    pub posted: AtomicU64,
    /// Receives consumed (or flushed) so far.
    pub consumed: AtomicU64,
}

/// A completion queue's doorbell: the owner arms it before sleeping; whoever produces work for
/// that queue disarms it and signals the eventfd.
#[repr(C, align(64))]
pub struct Bell {
    /// 1 while the owner sleeps or is about to.
    pub armed: AtomicU32,
    /// The owner's eventfd descriptor number.
    pub eventfd: AtomicI32,
    /// Bumped at each reuse of the slot, so cached descriptors of peers are refreshed.
    pub generation: AtomicU32,
}

/// Typed view of a control segment.
pub struct Ctrl<'a>(pub &'a Segment);

impl<'a> Ctrl<'a> {
    /// The header line.
    #[inline]
    pub fn header(&self) -> &'a CtrlHeader {
        self.0.at(0)
    }
    /// Memory-region entry `i`, or None when out of range.
    #[inline]
    pub fn mr(&self, i: usize) -> Option<&'a MrEntry> {
        (i < MR_SLOTS).then(|| self.0.at(MR_TABLE + i * LINE))
    }
    /// Receive-queue counters `i`, or None when out of range.
    #[inline]
    pub fn rq(&self, i: usize) -> Option<&'a RqCounters> {
        (i < RQ_SLOTS).then(|| self.0.at(RQ_TABLE + i * LINE))
    }
    /// Doorbell `i`, or None when out of range.
    #[inline]
    pub fn bell(&self, i: usize) -> Option<&'a Bell> {
        (i < BELL_SLOTS).then(|| self.0.at(BELL_TABLE + i * LINE))
    }
}

/// First line of a queue-pair segment.
#[repr(C, align(64))]
pub struct QpHeader {
    /// Identifies a QP segment.
    pub magic: AtomicU64,
    /// State, as [`qp_state_code`] encodes it.
    pub state: AtomicU32,
    /// QP number.
    pub qpn: AtomicU32,
    /// Remote operations the QP accepts (access flags bits).
    pub access: AtomicU32,
    /// Protection domain.
    pub pd: AtomicU32,
    /// Receiver-not-ready timer code.
    pub min_rnr_timer: AtomicU32,
    /// Written by the peer (the producer) only: 1 + the ring position from which its records
    /// are cancelled (0: none). See the cancel handshake in `qp.rs`.
    pub cancel_from: AtomicU64,
}

/// Second line of a queue-pair segment: the inbound ring's consumer position.
#[repr(C, align(64))]
pub struct RingConsumer {
    /// Ring bytes consumed so far (monotonic).
    pub consumed: AtomicU64,
    /// 1 + the ring position of the record the consumer is taking (monotonic).
    pub taking: AtomicU64,
}

pub use pv_sync::copyline::AssistLine;

/// Magic of a queue-pair segment (its low bits change with the segment's format).
pub const QP_MAGIC: u64 = 0x5056_5150_5347_0003;
/// Offset of the inbound ring in a queue-pair segment.
pub const RING_OFFSET: usize = 3 * LINE;

/// Typed view of a queue-pair segment.
pub struct QpSeg<'a>(pub &'a Segment);

impl<'a> QpSeg<'a> {
    /// Header line.
    #[inline]
    pub fn header(&self) -> &'a QpHeader {
        self.0.at(0)
    }
    /// Consumer line.
    #[inline]
    pub fn consumer(&self) -> &'a RingConsumer {
        self.0.at(LINE)
    }
    /// Shared-copy line.
    #[inline]
    pub fn assist(&self) -> &'a AssistLine {
        self.0.at(2 * LINE)
    }
    /// Base of the ring.
    #[inline]
    pub fn ring(&self) -> *mut u8 {
        self.0.ptr().wrapping_add(RING_OFFSET)
    }
}

/// Shared encoding of queue-pair states (the value 5 marks a destroyed QP).
pub fn qp_state_code(s: crate::QpState) -> u32 {
    match s {
        crate::QpState::Reset => 0,
        crate::QpState::Init => 1,
        crate::QpState::ReadyToReceive => 2,
        crate::QpState::ReadyToSend => 3,
        crate::QpState::Error => 4,
    }
}
/// State code of a destroyed queue pair.
pub const QP_DESTROYED: u32 = 5;

/// True once the queue pair whose segment `seg` is went into error or was destroyed.
#[inline]
pub fn qp_seg_gone(seg: &Segment) -> bool {
    let state = QpSeg(seg).header().state.load(std::sync::atomic::Ordering::Acquire);
    state == qp_state_code(crate::types::QpState::Error) || state == QP_DESTROYED
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_one_line_each() {
        assert_eq!(std::mem::size_of::<MrEntry>(), 64);
        assert_eq!(std::mem::size_of::<RqCounters>(), 64);
        assert_eq!(std::mem::size_of::<Bell>(), 64);
        assert_eq!(std::mem::size_of::<QpHeader>(), 64);
        assert_eq!(std::mem::size_of::<AssistLine>(), 64);
    }
}
