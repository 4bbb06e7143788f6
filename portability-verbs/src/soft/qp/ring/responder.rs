//! The ring transport's responder: records consumed from our ring into posted receives.

use super::*;

impl QpInner {
    /// Responder side: consume records from our ring into posted receives.
    pub(in crate::soft::qp) fn progress_inbound(&self, core: &mut QpCore, out: &mut Out) {
        if !matches!(core.state, QpState::ReadyToReceive | QpState::ReadyToSend) || core.inbound_dead {
            return;
        }
        let ring = self.ring();
        let mut consumed_any = false;
        for _ in 0..64 {
            let off = wire::ring_offset(core.cons_head, self.ring_bytes);
            // `off` is a record boundary: we only ever advance by validated record sizes.
            if ring.publish(off).load(Ordering::Acquire) != wire::publish_word(core.cons_head) {
                break;
            }
            let fields = ring.read_fields(off);
            let h = match RecordHeader::decode(&fields, off, self.ring_bytes) {
                Ok(h) => h,
                Err(e) => {
                    log::error!("QP {}: malformed record from the peer: {e}; moving to error", self.qpn);
                    self.enter_error(core, out);
                    return;
                }
            };
            if h.kind == RecordKind::Pad {
                core.cons_head += h.len as u64;
                consumed_any = true;
                continue;
            }
            // The receive to fill: looked at in place (it leaves the queue only once used); one
            // of a shared receive queue is taken out, and put back if unused.
            let mut from_srq = None;
            let recv = match &self.srq {
                None => core.rq.front(),
                Some(s) => {
                    from_srq = s.queue.lock().expect("srq lock").pop_front();
                    from_srq.as_ref()
                }
            };
            let Some(recv) = recv else {
                break; // receiver not ready
            };
            // Cancel handshake, hot half: announce the take, then look for a cancel. The
            // producer's half (`cancel_from`) stores the cancel, runs a membarrier, then reads
            // `taking`: one of the two sides always sees the other.
            let consumer = QpSeg(&self.seg).consumer();
            consumer.taking.store(core.cons_head + 1, Ordering::Relaxed);
            os::producer_barrier();
            let cancel = self.header().cancel_from.load(Ordering::Acquire);
            if cancel != 0 && cancel - 1 <= core.cons_head {
                consumer.taking.store(core.cons_head, Ordering::Relaxed);
                self.put_back_receive(from_srq);
                core.inbound_dead = true;
                break;
            }
            // The decoder checked that the record lies inside the ring.
            let payload = ring.payload(off, &h);
            let (result, keep_receive) = self.deliver_record(core, &h, payload, recv);
            let src_qp = core.remote.as_ref().map(|r| r.info.qpn).unwrap_or(0);
            let imm = (h.flags & wire::FLAG_IMM != 0).then_some(h.imm);
            let opcode = if matches!(h.kind, RecordKind::WriteImmInline | RecordKind::WriteImmNotify) {
                WcOpcode::RecvRdmaWithImm
            } else {
                WcOpcode::Recv
            };
            let (code, local_status) = match result {
                Ok(()) => (status::OK, WcStatus::Success),
                Err(code) => {
                    ring.status(off).store(code, Ordering::Release);
                    (code, if code == status::REM_INV_REQ { WcStatus::LocLenErr } else { WcStatus::LocProtErr })
                }
            };
            if keep_receive {
                self.put_back_receive(from_srq);
            } else {
                let wr_id = recv.wr_id;
                if self.srq.is_none() {
                    core.rq.pop_front();
                }
                self.count_consumed(1);
                out.push((false, self.recv_wc(wr_id, local_status, opcode, h.len, imm, src_qp)));
            }
            core.cons_head += h.record_size() as u64;
            consumed_any = true;
            if keep_receive {
                continue;
            }
            if code != status::OK {
                QpSeg(&self.seg).consumer().consumed.store(core.cons_head, Ordering::Release);
                self.enter_error(core, out);
                return;
            }
        }
        if consumed_any {
            QpSeg(&self.seg).consumer().consumed.store(core.cons_head, Ordering::Release);
            if let Some(r) = &core.remote {
                r.peer.ring_bell(r.info.send_cq_bell);
            }
        }
    }

    /// Leaves an unused receive at the head of its queue: our own queue's is still there; one
    /// `taken` from the shared queue goes back to its front.
    pub(in crate::soft::qp) fn put_back_receive(&self, taken: Option<RecvWr>) {
        if let (Some(s), Some(wr)) = (&self.srq, taken) {
            s.queue.lock().expect("srq lock").push_front(wr);
        }
    }

    /// Carries out one claimed record. Returns the record status code (Err for failures) and
    /// whether the receive goes back unused (the requester could not supply its data).
    pub(in crate::soft::qp) fn deliver_record(
        &self,
        core: &QpCore,
        h: &RecordHeader,
        payload: *const u8,
        recv: &RecvWr,
    ) -> (Result<(), u32>, bool) {
        let keys = self.keys(core);
        match h.kind {
            RecordKind::SendInline => {
                if h.len as u64 > recv.capacity() {
                    return (Err(status::REM_INV_REQ), false);
                }
                (
                    self.scatter(&keys, recv, h.len as usize, |dst, off, n| {
                        // SAFETY: `off + n <= len` and the payload holds `len` bytes inside the ring.
                        if unsafe { local_copy(dst, payload.add(off), n) } {
                            Ok(())
                        } else {
                            Err(status::REM_ACCESS)
                        }
                    }),
                    false,
                )
            }
            RecordKind::SendDescriptors => {
                if h.len as u64 > recv.capacity() {
                    return (Err(status::REM_INV_REQ), false);
                }
                let mut raw = [0u8; wire::MAX_DESC * wire::DESC_BYTES];
                let n = h.payload_len();
                // SAFETY: the payload holds `n` descriptor bytes inside the ring.
                unsafe { std::ptr::copy_nonoverlapping(payload, raw.as_mut_ptr(), n) };
                let descs = match wire::decode_descriptors(&raw[..n], h.len) {
                    Ok(d) => d,
                    Err(_) => return (Err(status::REM_INV_REQ), false),
                };
                let Some(r) = &core.remote else {
                    return (Err(status::REM_OP), true);
                };
                let res = self.pull_descriptors(&keys, r, &descs, recv);
                match res {
                    Ok(()) => (Ok(()), false),
                    // The requester's own memory failed it: its local protection error; our
                    // receive was not consumed.
                    Err(_) => (Err(status::REM_OP), true),
                }
            }
            RecordKind::WriteImmInline => {
                if !core.access.contains(AccessFlags::REMOTE_WRITE) {
                    return (Err(status::REM_ACCESS), false);
                }
                if h.len == 0 {
                    return (Ok(()), false); // names no memory: no key to check (IBA C9-88)
                }
                if !keys.remote(h.rkey, h.raddr, h.len as u64, AccessFlags::REMOTE_WRITE, self.pd) {
                    return (Err(status::REM_ACCESS), false);
                }
                // SAFETY: the destination is a live registration with remote write (checked
                // against `keys`); the payload holds `len` bytes inside the ring.
                let placed = unsafe { local_copy(h.raddr as usize as *mut u8, payload, h.len as usize) };
                (placed.then_some(()).ok_or(status::REM_ACCESS), false)
            }
            RecordKind::WriteImmNotify => (Ok(()), false),
            RecordKind::Pad => (Ok(()), true),
        }
    }

    /// Copies the requester's descriptors into our receive SGEs, one copy.
    pub(in crate::soft::qp) fn pull_descriptors(
        &self,
        keys: &LocalKeys,
        r: &Remote,
        descs: &[Descriptor],
        recv: &RecvWr,
    ) -> Result<(), u32> {
        let total: usize = descs.iter().map(|d| d.len as usize).sum();
        // Walk source and destination lists together.
        let mut si = 0usize;
        let mut s_off = 0usize;
        let mut accesses = Vec::with_capacity(descs.len());
        for d in descs {
            let a =
                r.peer.access(d.key, d.addr, d.len as u64, AccessFlags::NONE, r.info.pd).map_err(|_| status::REM_OP)?;
            accesses.push(a);
        }
        self.scatter(keys, recv, total, |dst, _off, mut n| {
            if let ([d], [a]) = (descs, &accesses[..]) {
                // SAFETY: `dst` is a checked receive SGE with room for `n` bytes (all of `a`'s
                // range, or `pull_shared` declines).
                if let Some(done) = unsafe { self.pull_shared(r, a, dst, n, d.key, AccessFlags::NONE) } {
                    return done.map_err(|_| status::REM_OP);
                }
            }
            let mut dst = dst;
            while n > 0 {
                let a = &accesses[si];
                let take = (a.len() - s_off).min(n);
                // SAFETY: `dst` is inside a checked receive SGE with room for `n` bytes.
                unsafe { a.read_into(s_off, dst, take) }.map_err(|_| status::REM_OP)?;
                // SAFETY: advancing within the same checked SGE.
                dst = unsafe { dst.add(take) };
                n -= take;
                s_off += take;
                if s_off == a.len() {
                    si += 1;
                    s_off = 0;
                }
            }
            Ok(())
        })
    }

    /// Scatters `len` bytes into a receive's SGEs: `copy(dst, message_offset, n)` fills each piece.
    pub(in crate::soft::qp) fn scatter(
        &self,
        keys: &LocalKeys,
        recv: &RecvWr,
        len: usize,
        mut copy: impl FnMut(*mut u8, usize, usize) -> Result<(), u32>,
    ) -> Result<(), u32> {
        let mut off = 0usize;
        for s in &recv.sg_list {
            if off == len {
                break;
            }
            let n = (s.length as usize).min(len - off);
            if !keys.check(s.lkey, s.addr, n as u64, AccessFlags::LOCAL_WRITE, self.pd) {
                return Err(status::REM_OP);
            }
            copy(s.addr as usize as *mut u8, off, n)?;
            off += n;
        }
        Ok(())
    }

    /// Runs the responder side if no other thread is on this queue pair.
    pub(in crate::soft::qp) fn drive_inbound(&self) {
        let Some(mut core) = self.core.try_lock() else {
            return;
        };
        let mut out = Out::new();
        self.progress_inbound(&mut core, &mut out);
        self.publish_peek(&core);
        self.deliver(&out); // under the lock: per-QP completion order across threads
        drop(core);
    }
}
