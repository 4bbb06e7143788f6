//! The TCP transport's requester: requests started in order as frames, kept until answered,
//! completed by cumulative acknowledgements and responses, rewound after a receiver-not-ready
//! nak.

use super::*;

impl QpInner {
    /// Posts send-queue requests on a TCP queue pair.
    pub(in crate::soft::qp) fn tcp_post_send(&self, core: &mut QpCore, wrs: &[SendWr]) -> Result<()> {
        let mut out = Out::new();
        let mut result = Ok(());
        let mut side = core.tcp.take();
        for wr in wrs {
            if let Err(e) = self.check_send(core, wr) {
                result = Err(e);
                break;
            }
            let Some(entry) = self.admit(core, wr) else { continue };
            let inline = inline_copy(wr);
            core.sq.push_back(entry);
            let idx = core.sq.len() - 1;
            // Nothing waits ahead of it: it starts now, kept only as its resend needs.
            match side.as_mut() {
                Some(t) if core.exec_next == idx && self.can_start(core, t) => {
                    self.tcp_start(core, t, idx, wr.clone(), inline, &mut out)
                }
                _ => {
                    let inline =
                        inline.map_or(crate::soft::qp::Inline::No, |v| crate::soft::qp::Inline::Owned(v.into_vec()));
                    core.sq[idx].waiting = Some(Box::new((wr.clone(), inline)));
                }
            }
        }
        // Only what posting needs: start the requests and write. Reading is for polls and
        // the engine (a read here would be a wasted system call per message in a stream).
        if let Some(mut t) = side {
            if t.conn.is_some() {
                self.tcp_execute(core, &mut t, &mut out);
                self.flush(core, &mut t, &mut out);
            } else if t.gone {
                self.fail_waiting_after_loss(core, &mut t, &mut out);
            }
            if core.tcp.is_none() {
                core.tcp = Some(t);
            }
        }
        self.end_post(core, &mut out);
        result
    }

    /// Whether a request may start now (else it waits for the connection, a rewind, or room).
    pub(super) fn can_start(&self, core: &QpCore, t: &TcpSide) -> bool {
        core.state == QpState::ReadyToSend && t.conn.is_some() && t.rnr.is_none() && t.tx.queued() < TX_LIMIT
    }

    /// Starts waiting requests in order while the connection takes them.
    pub(super) fn tcp_execute(&self, core: &mut QpCore, t: &mut TcpSide, out: &mut Out) {
        while core.exec_next < core.sq.len() && self.can_start(core, t) {
            let idx = core.exec_next;
            let Some(pending) = core.sq[idx].waiting.take() else {
                core.exec_next += 1;
                continue;
            };
            let (wr, inline) = *pending;
            let inline = match inline {
                crate::soft::qp::Inline::Owned(v) => Some(InlineBytes::from_vec(v)),
                _ => None,
            };
            self.tcp_start(core, t, idx, wr, inline, out);
        }
    }

    /// Starts the request at `idx` (the next to start): checks its local memory, sends its
    /// frame, keeps it until answered.
    pub(super) fn tcp_start(
        &self,
        core: &mut QpCore,
        t: &mut TcpSide,
        idx: usize,
        wr: SendWr,
        inline: Option<InlineBytes>,
        out: &mut Out,
    ) {
        let need_local = match wr.opcode {
            WrOpcode::RdmaRead | WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => AccessFlags::LOCAL_WRITE,
            _ => AccessFlags::NONE,
        };
        if inline.is_none() && !self.keys(core).check_all(&wr.sg_list, need_local, self.pd) {
            core.sq[idx].stage = SqStage::Done(WcStatus::LocProtErr);
            core.exec_next += 1;
            return self.fail(core, t, out);
        }
        let s = Sent { seq: t.next_seq, wr, inline };
        t.next_seq = t.next_seq.wrapping_add(1);
        emit(t, &s);
        t.sent.push_back(s);
        core.sq[idx].stage = SqStage::OnWire;
        core.exec_next += 1;
    }

    /// A piggybacked acknowledgement: every request up to `seq` is done (reads and atomics
    /// among them were answered before it, in stream order).
    pub(super) fn acknowledged(&self, core: &mut QpCore, t: &mut TcpSide, seq: u32, out: &mut Out) {
        let why = "a read or atomic acknowledged without its data";
        self.complete_acknowledged(core, t, out, |s| !seq_before(seq, s), why);
    }

    /// Completes the sends and writes at the head of `sent` whose sequence `done` accepts (an
    /// acknowledgement covers them, or a later request's answer). A read or atomic among them
    /// never got its own answer: a protocol failure (`why`), and false.
    fn complete_acknowledged(
        &self,
        core: &mut QpCore,
        t: &mut TcpSide,
        out: &mut Out,
        done: impl Fn(u32) -> bool,
        why: &str,
    ) -> bool {
        while let Some(s) = t.sent.front() {
            if !done(s.seq) {
                return true;
            }
            if !matches!(
                s.wr.opcode,
                WrOpcode::Send | WrOpcode::SendWithImm | WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm
            ) {
                self.protocol_failure(core, t, out, why);
                return false;
            }
            self.complete_front(core, t, WcStatus::Success);
        }
        true
    }

    /// Completes the writes at the head of `sent` that asked to complete once their buffers
    /// are free ([`crate::SendFlags::inject_complete`]): called when everything queued was
    /// written to the socket, so no frame reads the caller's memory any more. In posting
    /// order: a request ahead of them that waits for its answer (a send the receiver may
    /// refuse and have sent again, a read, an atomic, a plain write) holds them back. Their
    /// acknowledgement, later, finds them gone.
    pub(super) fn complete_injected(&self, core: &mut QpCore, t: &mut TcpSide) {
        debug_assert!(t.tx.is_empty());
        while let Some(s) = t.sent.front() {
            // (A write with immediate takes a receive at the target, which may refuse it for
            // want of one and have it sent again from its buffer: it waits for its answer.)
            if !(s.wr.opcode == WrOpcode::RdmaWrite && s.wr.flags.inject_complete) || t.rnr.is_some() {
                return;
            }
            self.complete_front(core, t, WcStatus::Success);
        }
    }

    /// Whether request `seq` was sent and is no longer kept: a write completed at injection
    /// (answers to every other request complete it, and come once).
    fn was_injected(&self, t: &TcpSide, seq: u32) -> bool {
        seq_before(seq, t.next_seq) && t.sent.front().is_none_or(|s| seq_before(seq, s.seq))
    }

    pub(super) fn on_response(&self, core: &mut QpCore, t: &mut TcpSide, f: Frame, out: &mut Out) {
        // Everything before it is done: only sends and writes are answered that way.
        if !self.complete_acknowledged(core, t, out, |s| seq_before(s, f.seq), "a read or atomic left unanswered") {
            return;
        }
        if f.kind == Kind::Nak && self.was_injected(t, f.seq) {
            // The target refused a write that completed when it was written to the socket: the
            // caller was told it succeeded, so the queue pair must fail (as when the
            // connection breaks after such a completion).
            log::error!("QP {}: the target refused a write completed at injection ({:?})", self.qpn, f.nak);
            return self.fail(core, t, out);
        }
        let Some(s) = t.sent.front() else {
            // Answers to requests flushed meanwhile; nothing else is acceptable.
            if f.kind == Kind::Ack {
                return;
            }
            return self.protocol_failure(core, t, out, &format!("a {:?} for no request", f.kind));
        };
        if s.seq != f.seq {
            if f.kind == Kind::Ack {
                return; // an ack for requests already completed by a later answer
            }
            return self.protocol_failure(
                core,
                t,
                out,
                &format!("an answer for request {} where {} is due", f.seq, s.seq),
            );
        }
        let opcode = s.wr.opcode;
        match f.kind {
            Kind::Ack => {
                if matches!(opcode, WrOpcode::RdmaRead | WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd) {
                    return self.protocol_failure(core, t, out, "a read or atomic acknowledged without its data");
                }
                self.complete_front(core, t, WcStatus::Success);
            }
            Kind::ReadResp => {
                if opcode != WrOpcode::RdmaRead || f.len as u64 != s.wr.byte_len() {
                    return self.protocol_failure(core, t, out, "a read response that does not match its request");
                }
                let keys = self.keys(core);
                let ok = keys.check_all(&s.wr.sg_list, AccessFlags::LOCAL_WRITE, self.pd);
                drop(keys);
                if !ok {
                    t.reading = Some((Placement::discard(f.len as usize), Then::Nothing));
                    self.complete_front(core, t, WcStatus::LocProtErr);
                    return self.fail(core, t, out);
                }
                let dests: smallvec::SmallVec<[Dest; 4]> =
                    s.wr.sg_list.iter().map(|g| Dest::Mem(g.addr, g.length as usize)).collect();
                t.reading = Some((Placement::new(dests), Then::ReadDone));
            }
            Kind::AtomicResp => {
                if !opcode.is_atomic() {
                    return self.protocol_failure(core, t, out, "an atomic response to another request");
                }
                let g = s.wr.sg_list[0];
                let keys = self.keys(core);
                let bytes = f.operand.to_ne_bytes();
                // SAFETY: 8 bytes of a checked local registration with local write.
                let ok = keys.check(g.lkey, g.addr, 8, AccessFlags::LOCAL_WRITE, self.pd)
                    && unsafe { local_copy(g.addr as usize as *mut u8, bytes.as_ptr(), 8) };
                drop(keys);
                self.complete_front(core, t, if ok { WcStatus::Success } else { WcStatus::LocProtErr });
                if !ok {
                    self.fail(core, t, out);
                }
            }
            _ => match f.nak.expect("decoded naks carry a code") {
                NakCode::ReceiverNotReady => {
                    let naks = match &t.rnr {
                        Some(r) if r.seq == f.seq => r.naks + 1,
                        _ => 1,
                    };
                    if core.rts.rnr_retry != 7 && naks > core.rts.rnr_retry as u32 {
                        self.complete_front(core, t, WcStatus::RnrRetryExcErr);
                        return self.fail(core, t, out);
                    }
                    let timer = rnr_timer_duration(f.imm as u8);
                    t.rnr = Some(Rnr { seq: f.seq, naks, resend_at: Some(Instant::now() + timer) });
                    t.set_urgent(true);
                }
                code => {
                    let st = match code {
                        NakCode::InvalidRequest => status::REM_INV_REQ,
                        NakCode::AccessError => status::REM_ACCESS,
                        _ => status::REM_OP,
                    };
                    self.complete_front(core, t, status_of(st));
                    self.fail(core, t, out);
                }
            },
        }
    }

    /// The request at the head of `sent` finished with `st`.
    pub(super) fn complete_front(&self, core: &mut QpCore, t: &mut TcpSide, st: WcStatus) {
        if t.sent.pop_front().is_none() {
            return;
        }
        if t.rnr.is_some() && st.is_success() {
            t.rnr = None;
            t.set_urgent(false);
        }
        if let Some(e) = core.sq.iter_mut().find(|e| e.stage == SqStage::OnWire) {
            e.stage = SqStage::Done(st);
        }
    }
}

/// A request's inline data, copied out of the caller's memory (valid during the post only).
pub(super) fn inline_copy(wr: &SendWr) -> Option<InlineBytes> {
    if !wr.flags.inline || wr.opcode == WrOpcode::RdmaRead || wr.opcode.is_atomic() {
        return None;
    }
    let mut v = InlineBytes::with_capacity(wr.byte_len() as usize);
    for s in &wr.sg_list {
        // SAFETY: inline SGEs name caller memory valid for the duration of post_send, during
        // which this runs.
        v.extend_from_slice(unsafe { std::slice::from_raw_parts(s.addr as usize as *const u8, s.length as usize) });
    }
    Some(v)
}

/// Queues the frame of a request, its data gathered from where it is.
pub(super) fn emit(t: &mut TcpSide, s: &Sent) {
    let wr = &s.wr;
    let mut f = Frame::new(Kind::Send, s.seq);
    f.raddr = wr.remote_addr;
    f.rkey = wr.rkey;
    let carries_data = match wr.opcode {
        WrOpcode::Send | WrOpcode::SendWithImm | WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm => {
            f.kind = if matches!(wr.opcode, WrOpcode::Send | WrOpcode::SendWithImm) { Kind::Send } else { Kind::Write };
            if matches!(wr.opcode, WrOpcode::SendWithImm | WrOpcode::RdmaWriteWithImm) {
                f.flags = FLAG_IMM;
                f.imm = wr.imm;
            }
            true
        }
        WrOpcode::RdmaRead => {
            f.kind = Kind::ReadReq;
            false
        }
        WrOpcode::AtomicCmpAndSwp => {
            f.kind = Kind::CmpSwap;
            f.operand = wr.compare_add;
            f.swap = wr.swap;
            false
        }
        WrOpcode::AtomicFetchAndAdd => {
            f.kind = Kind::FetchAdd;
            f.operand = wr.compare_add;
            false
        }
    };
    if wr.opcode == WrOpcode::RdmaWrite && wr.flags.inject_complete {
        // Completed once in the socket (`complete_injected`): its acknowledgement is no news.
        f.flags |= FLAG_LAZY_ACK;
    }
    f.len = if wr.opcode.is_atomic() { 0 } else { wr.byte_len() as u32 };
    t.push(f);
    if carries_data {
        match &s.inline {
            Some(bytes) => t.tx.push_bytes(bytes),
            None => {
                for g in &wr.sg_list {
                    t.tx.push_mem(g.addr, g.length as usize, g.lkey, AccessFlags::NONE);
                }
            }
        }
    }
}
