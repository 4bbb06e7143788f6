//! The ring transport: queue pairs whose peer is a process of this host (or this process).
//!
//! Each queue pair owns a segment with its state and an inbound ring. The peer's requester writes
//! records (sends, writes-with-immediate) into that ring; our responder consumes them when a
//! completion queue is polled or a receive is posted (`responder`). One-sided operations (RDMA
//! write, read, atomics, and the data of large writes-with-immediate) are carried out by the
//! requester itself on the responder's registered memory, after checking the responder's
//! published keys (`requester`): the responder's CPU takes no part, as with a NIC, except that
//! a polling responder may push the back half of a large read (`assist`).
//!
//! Ordering: a one-sided request waits until every earlier ring record has been consumed, so
//! the responder sees effects in order, as an RC responder processes packets in PSN order.

mod requester;
mod responder;

use super::*;

pub(in crate::soft::qp) use requester::cancel_from;

pub(in crate::soft::qp) struct Remote {
    pub(in crate::soft::qp) info: SoftEndpoint,
    pub(in crate::soft::qp) peer: Arc<PeerCtx>,
    /// Shared with the windows onto the peer's memory (they read its state).
    pub(in crate::soft::qp) seg: Arc<Segment>,
    pub(in crate::soft::qp) ring_bytes: usize,
    /// The peer queue pair itself when it lives in this process: a requester waiting for its
    /// records to be consumed can run the responder's side itself.
    pub(in crate::soft::qp) local: Option<std::sync::Weak<QpInner>>,
}

impl Remote {
    pub(in crate::soft::qp) fn seg(&self) -> QpSeg<'_> {
        QpSeg(&self.seg)
    }
    pub(in crate::soft::qp) fn ring(&self) -> RingView {
        RingView { base: self.seg().ring(), bytes: self.ring_bytes }
    }
    /// True once the peer queue pair is in error or destroyed: as a responder it answers
    /// nothing more.
    pub(in crate::soft::qp) fn peer_qp_gone(&self) -> bool {
        qp_seg_gone(&self.seg)
    }
}

pub(in crate::soft::qp) struct RnrTrack {
    pub(in crate::soft::qp) start: u64,
    pub(in crate::soft::qp) naks: u32,
    pub(in crate::soft::qp) last: Instant,
}

/// A ring mapped in this process, with bounds-checked access to its record words.
#[derive(Clone, Copy)]
pub(in crate::soft::qp) struct RingView {
    pub(in crate::soft::qp) base: *mut u8,
    pub(in crate::soft::qp) bytes: usize,
}

impl RingView {
    pub(in crate::soft::qp) fn check(&self, off: usize) {
        assert!(
            off.is_multiple_of(wire::RECORD_ALIGN) && off + wire::RECORD_ALIGN <= self.bytes,
            "record offset outside the ring"
        );
    }
    /// The publish word of the record at `off`.
    pub(in crate::soft::qp) fn publish(&self, off: usize) -> &AtomicU64 {
        self.check(off);
        // SAFETY: in bounds (checked), 8-byte aligned (the ring is page-aligned plus a multiple of
        // 64 bytes), in a mapping that outlives the view's users; any bits are a valid AtomicU64.
        unsafe { &*(self.base.add(off) as *const AtomicU64) }
    }
    /// The status word of the record at `off`.
    pub(in crate::soft::qp) fn status(&self, off: usize) -> &AtomicU32 {
        self.check(off);
        // SAFETY: as for `publish`, 4 bytes at a 4-aligned offset inside the header.
        unsafe { &*(self.base.add(off + wire::STATUS_OFFSET) as *const AtomicU32) }
    }
    /// Writes the decoded fields of a header (from byte 8 of a record; a send's stop before
    /// its status word and payload).
    pub(in crate::soft::qp) fn write_fields(&self, off: usize, h: &RecordHeader) {
        self.check(off);
        let b = h.encode();
        // SAFETY: at most 32 bytes at off+8, inside the record's first line, which is inside
        // the ring (checked above).
        unsafe { crate::copy::copy_bytes(self.base.add(off + 8), b.as_ptr(), h.fields_len()) };
    }
    /// Copies the decoded fields of the header at `off`.
    pub(in crate::soft::qp) fn read_fields(&self, off: usize) -> [u8; FIELDS_BYTES] {
        self.check(off);
        let mut b = [0u8; FIELDS_BYTES];
        // SAFETY: as in `write_fields`.
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(off + 8), b.as_mut_ptr(), FIELDS_BYTES) };
        b
    }
    /// Pointer to the payload of the record with header `h` at `off`.
    pub(in crate::soft::qp) fn payload(&self, off: usize, h: &RecordHeader) -> *mut u8 {
        assert!(off + h.record_size() <= self.bytes, "record outside the ring");
        self.base.wrapping_add(off + h.header_bytes())
    }
}

impl QpInner {
    pub(in crate::soft::qp) fn ring(&self) -> RingView {
        RingView { base: QpSeg(&self.seg).ring(), bytes: self.ring_bytes }
    }

    pub(in crate::soft::qp) fn header(&self) -> &crate::soft::layout::QpHeader {
        QpSeg(&self.seg).header()
    }

    pub(in crate::soft::qp) fn connect(&self, info: &SoftEndpoint) -> Result<Remote> {
        if !info.ring_bytes.is_power_of_two() || (info.ring_bytes as usize) < 8192 {
            return Err(VerbsError::Protocol(format!("peer ring of {} bytes is not a valid ring", info.ring_bytes)));
        }
        if self.ctx.ctrl().bell(0).is_none() {
            unreachable!("control segment always has doorbells");
        }
        let peer = self.ctx.peer(info)?;
        if peer.ctrl().bell(info.send_cq_bell as usize).is_none()
            || peer.ctrl().bell(info.recv_cq_bell as usize).is_none()
            || peer.ctrl().rq(info.rq_slot as usize).is_none()
        {
            return Err(VerbsError::Protocol("peer endpoint names slots out of range".into()));
        }
        let fd = peer.fetch(info.qp_fd).map_err(|e| VerbsError::PeerUnreachable(e.to_string()))?;
        let ring_bytes = info.ring_bytes as usize;
        let seg = Arc::new(Segment::map_fetched(fd, &qp_name(info.ctx_id, info.qpn), RING_OFFSET + ring_bytes)?);
        let local = if peer.same_process { local_qp(info.ctx_id, info.qpn) } else { None };
        let remote = Remote { info: *info, peer, seg, ring_bytes, local };
        let h = remote.seg().header();
        if h.magic.load(Ordering::Acquire) != QP_MAGIC || h.qpn.load(Ordering::Relaxed) != info.qpn {
            return Err(VerbsError::Protocol("peer queue-pair segment does not match its endpoint".into()));
        }
        Ok(remote)
    }

    /// Checks peer liveness and the peer QP's state; fails the connection if it is gone.
    pub(in crate::soft::qp) fn check_peer(&self, core: &mut QpCore, out: &mut Out) {
        let Some(r) = &core.remote else { return };
        let peer_qp_gone = r.peer_qp_gone();
        let peer_alive = r.peer.alive();
        let peer_qpn = r.info.qpn;
        if peer_qp_gone || !peer_alive {
            // What the peer sent before it went, and what it consumed of ours, still counts.
            self.progress_inbound(core, out);
            if !self.reap(core, out) {
                return;
            }
            self.retire(core, out);
        }
        let outstanding = core.sq.iter().any(|e| !matches!(e.stage, SqStage::Done(_)));
        // A dead process fails the connection at once. A live peer whose QP broke is noticed
        // only by a request that needs it, as a real responder would (transport retries run out).
        let gone = !peer_alive || (peer_qp_gone && outstanding);
        if gone && core.state != QpState::Error {
            log::debug!("QP {}: peer QP {peer_qpn} is gone; moving to error", self.qpn);
            // The oldest outstanding request timed out; the rest are flushed.
            if let Some(e) = core.sq.iter_mut().find(|e| !matches!(e.stage, SqStage::Done(_))) {
                e.stage = SqStage::Done(WcStatus::RetryExcErr);
            }
            self.enter_error(core, out);
        }
    }

    /// Makes the peer's death wake sleepers of both queues (`on`), or stops it. A peer in this
    /// process has no pidfd to watch: it cannot die while we run.
    pub(in crate::soft::qp) fn watch_peer(&self, peer: &PeerCtx, on: bool) {
        if let Some(pidfd) = peer.pidfd() {
            for cq in [&self.send_cq, &self.recv_cq] {
                if on {
                    cq.watch(pidfd)
                } else {
                    cq.unwatch(pidfd)
                }
            }
        }
    }
}
