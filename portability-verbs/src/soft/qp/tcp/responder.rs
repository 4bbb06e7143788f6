//! The TCP transport's responder: requests taken in sequence order, checked as the ring
//! transport checks them, placed into receives and registered memory, answered.

use super::*;

impl QpInner {
    /// Refuses request `f`: a nak, and everything after it dropped until it comes again.
    pub(super) fn refuse(&self, t: &mut TcpSide, f: &Frame, code: NakCode) {
        t.ack_due = None; // implied by the nak
        let mut nak = Frame::new(Kind::Nak, f.seq);
        nak.nak = Some(code);
        t.push(nak);
        t.dropping_until = Some(f.seq);
        t.reading = Some((Placement::discard(f.data_len() as usize), Then::Nothing));
    }

    pub(super) fn respond(&self, core: &mut QpCore, t: &mut TcpSide, f: Frame, out: &mut Out) {
        if let Some(s) = t.dropping_until {
            if f.seq != s {
                t.reading = Some((Placement::discard(f.data_len() as usize), Then::Nothing));
                return;
            }
            t.dropping_until = None;
        }
        if f.seq != t.expect_seq {
            return self.protocol_failure(core, t, out, &format!("request {} where {} was due", f.seq, t.expect_seq));
        }
        let keys = self.keys(core);
        let len = f.len as u64;
        match f.kind {
            Kind::Send => {
                let Some(wr) = self.take_receive(core) else {
                    return self.refuse_not_ready(core, t, &f);
                };
                if len > wr.capacity() {
                    return self.fail_receive(core, t, &f, &wr, WcStatus::LocLenErr, NakCode::InvalidRequest, out);
                }
                let mut dests = smallvec::SmallVec::<[Dest; 4]>::new();
                let mut left = len;
                for s in &wr.sg_list {
                    if left == 0 {
                        break;
                    }
                    let n = left.min(s.length as u64);
                    if !keys.check(s.lkey, s.addr, n, AccessFlags::LOCAL_WRITE, self.pd) {
                        drop(keys);
                        return self.fail_receive(core, t, &f, &wr, WcStatus::LocProtErr, NakCode::OperationError, out);
                    }
                    dests.push(Dest::Mem(s.addr, n as usize));
                    left -= n;
                }
                t.expect_seq = t.expect_seq.wrapping_add(1);
                let then = Then::Receive { wr, opcode: WcOpcode::Recv, imm: f.imm(), len: f.len, seq: f.seq };
                t.reading = Some((Placement::new(dests), then));
            }
            Kind::Write => {
                let refused = self.refusal(core, &keys, &f, AccessFlags::REMOTE_WRITE, len);
                drop(keys);
                if let Some(code) = refused {
                    t.expect_seq = t.expect_seq.wrapping_add(1);
                    return self.refuse(t, &f, code);
                }
                let then = if f.flags & FLAG_IMM != 0 {
                    let Some(wr) = self.take_receive(core) else {
                        return self.refuse_not_ready(core, t, &f);
                    };
                    Then::Receive { wr, opcode: WcOpcode::RecvRdmaWithImm, imm: f.imm(), len: f.len, seq: f.seq }
                } else {
                    Then::Ack { seq: f.seq, lazy: f.flags & FLAG_LAZY_ACK != 0 }
                };
                t.expect_seq = t.expect_seq.wrapping_add(1);
                t.reading = Some((Placement::write_to(f.raddr, f.len as usize, true), then));
            }
            Kind::ReadReq => {
                let refused = self.refusal(core, &keys, &f, AccessFlags::REMOTE_READ, len);
                drop(keys);
                t.expect_seq = t.expect_seq.wrapping_add(1);
                if let Some(code) = refused {
                    return self.refuse(t, &f, code);
                }
                t.ack_due = None;
                let mut resp = Frame::new(Kind::ReadResp, f.seq);
                resp.len = f.len;
                t.push(resp);
                t.tx.push_mem(f.raddr, f.len as usize, f.rkey, AccessFlags::REMOTE_READ);
            }
            _ => {
                // Compare-and-swap, fetch-and-add.
                t.expect_seq = t.expect_seq.wrapping_add(1);
                let refused = if f.raddr.is_multiple_of(8) {
                    self.refusal(core, &keys, &f, AccessFlags::REMOTE_ATOMIC, 8)
                } else {
                    Some(NakCode::InvalidRequest)
                };
                drop(keys);
                if let Some(code) = refused {
                    return self.refuse(t, &f, code);
                }
                let cas = f.kind == Kind::CmpSwap;
                let ran = crate::soft::peer::with_atomic_lock(
                    &self.ctx.ctrl().header().atomic_lock,
                    self.ctx.lock_tag,
                    || {
                        // SAFETY: 8 aligned bytes of a live registration granting remote atomics
                        // (checked above under our lock, which holds off deregistration); every
                        // atomic on this context's memory runs under this lock.
                        let word = unsafe { &*(f.raddr as usize as *const std::sync::atomic::AtomicU64) };
                        let old = word.load(std::sync::atomic::Ordering::Acquire);
                        let new = if cas {
                            if old == f.operand {
                                f.swap
                            } else {
                                old
                            }
                        } else {
                            old.wrapping_add(f.operand)
                        };
                        word.store(new, std::sync::atomic::Ordering::Release);
                        old
                    },
                );
                match ran {
                    Ok(old) => {
                        t.ack_due = None;
                        let mut resp = Frame::new(Kind::AtomicResp, f.seq);
                        resp.operand = old;
                        t.push(resp);
                    }
                    Err(_) => self.refuse(t, &f, NakCode::OperationError),
                }
            }
        }
    }

    /// Why a one-sided request `f` of `len` bytes needing `need` is refused, if it is: the
    /// queue pair's access flags (an invalid request, as IBA has it), then the key, bounds,
    /// rights and protection domain (an access error). A zero-byte read or write names no
    /// memory: no key is checked (IBA C9-88).
    pub(super) fn refusal(
        &self,
        core: &QpCore,
        keys: &crate::soft::keys::LocalKeys,
        f: &Frame,
        need: AccessFlags,
        len: u64,
    ) -> Option<NakCode> {
        if !core.access.contains(need) {
            return Some(NakCode::InvalidRequest);
        }
        if len == 0 || keys.remote(f.rkey, f.raddr, len, need, self.pd) {
            return None;
        }
        Some(NakCode::AccessError)
    }

    /// A send that the receive `wr` cannot take (too long, or its memory refused): the receive
    /// completes with `status`, the requester is refused with `code`, the queue pair fails.
    #[allow(clippy::too_many_arguments)]
    fn fail_receive(
        &self,
        core: &mut QpCore,
        t: &mut TcpSide,
        f: &Frame,
        wr: &RecvWr,
        status: WcStatus,
        code: NakCode,
        out: &mut Out,
    ) {
        out.push((false, self.recv_wc(wr.wr_id, status, WcOpcode::Recv, f.len, None, t.peer.qpn)));
        self.count_consumed(1);
        self.refuse(t, f, code);
        self.fail(core, t, out);
    }

    /// No receive for request `f`: a receiver-not-ready nak carrying our timer.
    pub(super) fn refuse_not_ready(&self, core: &QpCore, t: &mut TcpSide, f: &Frame) {
        t.ack_due = None;
        let mut nak = Frame::new(Kind::Nak, f.seq);
        nak.nak = Some(NakCode::ReceiverNotReady);
        nak.imm = core.min_rnr_timer as u32;
        t.push(nak);
        t.dropping_until = Some(f.seq);
        t.reading = Some((Placement::discard(f.data_len() as usize), Then::Nothing));
    }

    /// Takes the receive the next message fills (our queue's, or the shared one's).
    pub(super) fn take_receive(&self, core: &mut QpCore) -> Option<RecvWr> {
        match &self.srq {
            None => core.rq.pop_front(),
            Some(s) => s.queue.lock().expect("srq lock").pop_front(),
        }
    }

    pub(super) fn finish(&self, core: &mut QpCore, t: &mut TcpSide, then: Then, out: &mut Out) {
        match then {
            Then::Nothing => {}
            Then::Ack { seq, lazy } => t.ack(seq, lazy),
            Then::Receive { wr, opcode, imm, len, seq } => {
                self.count_consumed(1);
                out.push((false, self.recv_wc(wr.wr_id, WcStatus::Success, opcode, len, imm, t.peer.qpn)));
                t.ack(seq, false);
            }
            Then::ReadDone => self.complete_front(core, t, WcStatus::Success),
        }
    }

    /// Puts back the receive that a message cut short had taken, so that it is flushed (or
    /// filled later) rather than lost.
    pub(super) fn restore_receive(&self, core: &mut QpCore, t: &mut TcpSide) {
        if let Some((_, Then::Receive { wr, .. })) = t.reading.take() {
            match &self.srq {
                None => core.rq.push_front(wr),
                Some(s) => s.queue.lock().expect("srq lock").push_front(wr),
            }
        }
    }
}
