//! The ring transport's requester: records placed in the peer's ring, one-sided operations
//! carried out on the peer's memory, and what the peer consumed turned into completions.

use super::*;

impl QpInner {
    /// The polled message path's request: an inline RDMA write with nothing ahead of it in the
    /// send queue (empty, so no ring record of ours waits to be placed first). It is carried
    /// out now and reported at once (the general path would queue it, find it done and retire
    /// it at once). None, with nothing done: take the general path.
    #[inline]
    pub(in crate::soft::qp) fn post_write_at_once(&self, core: &mut QpCore, wr: &SendWr) -> Option<Result<()>> {
        if wr.opcode != WrOpcode::RdmaWrite
            || !wr.flags.inline
            || !core.sq.is_empty()
            || core.state != QpState::ReadyToSend
        {
            return None;
        }
        if let Err(e) = self.check_send(core, wr) {
            return Some(Err(e));
        }
        let stage = self.run_one_sided(core, wr, &Inline::Borrowed);
        self.report_at_once(core, wr.wr_id, wr.byte_len() as u32, wr.flags.signaled, stage);
        Some(Ok(()))
    }

    /// Reports an RDMA write carried out at post time with an empty send queue, as retiring it
    /// would: a success only if `signaled` (straight to the completion queue: nothing is
    /// queued ahead of it); a failure always, and it fails the queue pair.
    pub(in crate::soft::qp) fn report_at_once(
        &self,
        core: &mut QpCore,
        wr_id: u64,
        byte_len: u32,
        signaled: bool,
        stage: SqStage,
    ) {
        if stage != SqStage::Done(WcStatus::Success) {
            self.fail_at_once(core, wr_id, WrOpcode::RdmaWrite, byte_len, stage);
        } else if signaled {
            let opcode = WrOpcode::RdmaWrite.completion_opcode();
            let wc = WorkCompletion {
                wr_id,
                status: WcStatus::Success,
                opcode,
                byte_len,
                imm: None,
                qp_num: self.qpn,
                src_qp: 0,
            };
            // Under our lock: per-QP completion order across threads.
            self.send_cq.push(std::iter::once(wc));
        }
    }

    /// An RDMA write of `parts` put end to end, inline, carried out now if nothing is queued
    /// ahead of it: what [`QpInner::post_send`] would do with the same write over SGEs naming
    /// the parts, with no request to build and walk (the polled message path's frames), through
    /// the same checks as any one-sided request, and reported at once. None, with nothing done:
    /// post it as a request.
    #[inline]
    pub fn write_inline_list_at_once(
        &self,
        wr_id: u64,
        parts: &[&[u8]],
        remote_addr: u64,
        rkey: u32,
        signaled: bool,
    ) -> Option<Result<()>> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if len > self.caps.max_inline_data as usize {
            return Some(Err(VerbsError::invalid(format!(
                "{len} inline bytes over max_inline_data {}",
                self.caps.max_inline_data
            ))));
        }
        let mut core = self.core.lock();
        if !core.sq.is_empty() || core.state != QpState::ReadyToSend || core.tcp.is_some() {
            return None;
        }
        let stage = match self.remote_write_access(&core, rkey, remote_addr, len as u64) {
            Ok(None) => SqStage::Done(WcStatus::Success),
            // SAFETY: the parts are caller memory, valid during this call.
            Ok(Some(access)) => SqStage::Done(unsafe { access.write_parts(parts) }.err().unwrap_or(WcStatus::Success)),
            Err(st) => SqStage::Done(st),
        };
        self.report_at_once(&mut core, wr_id, len as u32, signaled, stage);
        Some(Ok(()))
    }

    /// A window onto `len` bytes at `remote_addr` of the connected peer's region `rkey`, for
    /// writes with plain stores (see [`crate::soft::peer::SoftWindow`]); None where the region is
    /// not in a provider segment. Checked as an RDMA write is: a refusal is an error.
    pub fn map_remote_write(
        &self,
        remote_addr: u64,
        len: u64,
        rkey: u32,
    ) -> Result<Option<crate::soft::peer::SoftWindow>> {
        let core = self.core.lock();
        if !matches!(core.state, QpState::ReadyToSend) {
            return Err(VerbsError::InvalidState(format!("mapping a peer's memory in {:?} (needs RTS)", core.state)));
        }
        if core.tcp.is_some() {
            return Ok(None); // the peer's memory is on another host
        }
        let refused = |st: WcStatus| {
            VerbsError::invalid(format!(
                "peer refused a window of {len} bytes at {remote_addr:#x} key {rkey:#x}: {st:?}"
            ))
        };
        let r = self.peer_grants(&core, AccessFlags::REMOTE_WRITE).map_err(refused)?;
        r.peer.window(rkey, remote_addr, len, r.info.pd, r.seg.clone()).map_err(refused)
    }

    /// Carries out waiting requests in order, as far as ring space and ordering allow.
    pub(in crate::soft::qp) fn execute(&self, core: &mut QpCore, out: &mut Out) {
        while core.exec_next < core.sq.len() && core.state == QpState::ReadyToSend {
            let idx = core.exec_next;
            let Some(pending) = core.sq[idx].waiting.take() else {
                core.exec_next += 1; // already finished (flushed)
                continue;
            };
            match self.start_with_retry(core, &pending.0, &pending.1, out) {
                None => {
                    core.sq[idx].waiting = Some(pending);
                    return;
                }
                Some(stage) => {
                    core.sq[idx].stage = stage;
                    self.account_started(core, stage, out);
                }
            }
        }
    }

    /// Starts a request; if the ring is full or ordering holds it back, harvests what the peer
    /// consumed (only harvested space is reused: its status words are still to be read) and
    /// tries once more. None: it must wait.
    pub(in crate::soft::qp) fn start_with_retry(
        &self,
        core: &mut QpCore,
        wr: &SendWr,
        inline: &Inline,
        out: &mut Out,
    ) -> Option<SqStage> {
        if let Some(stage) = self.start(core, wr, inline) {
            return Some(stage);
        }
        let before = (core.reaped, core.in_ring_data);
        if !self.reap(core, out) || (core.reaped, core.in_ring_data) == before {
            return None;
        }
        self.start(core, wr, inline)
    }

    /// Starts one request: places its ring record, or carries out a one-sided operation. None
    /// if it cannot start now (ring full, or ordering behind earlier records).
    pub(in crate::soft::qp) fn start(&self, core: &mut QpCore, wr: &SendWr, inline: &Inline) -> Option<SqStage> {
        match wr.opcode {
            WrOpcode::Send | WrOpcode::SendWithImm => self.start_send(core, wr, inline),
            WrOpcode::RdmaWriteWithImm => {
                if core.in_ring_data > 0 && !self.wwi_is_ring_inline(core, wr) {
                    return None; // its data placement must follow earlier records
                }
                self.start_write_imm(core, wr, inline)
            }
            _ => {
                if core.in_ring_data > 0 {
                    return None; // one-sided requests follow earlier ring records
                }
                Some(self.run_one_sided(core, wr, inline))
            }
        }
    }

    /// True when a write-with-immediate goes through the ring with its data: small, and the
    /// target is user memory of another process (one record beats a cross-memory-attach call).
    /// Into memory we reach with plain stores (provider segments, same-process memory) the data
    /// is stored directly and only a notification goes through the ring: no copy left for the
    /// responder, and nothing for later one-sided requests to wait for.
    pub(in crate::soft::qp) fn wwi_is_ring_inline(&self, core: &QpCore, wr: &SendWr) -> bool {
        let Some(r) = &core.remote else {
            return false;
        };
        wr.byte_len() as usize <= self.ctx.config.copy_threshold && !r.peer.stores_directly(wr.rkey)
    }

    /// Places a record in the peer's ring: `fill` writes the payload. Returns the stage, or
    /// None if the ring has no room now.
    pub(in crate::soft::qp) fn place_record(
        &self,
        core: &mut QpCore,
        header: RecordHeader,
        fill: impl FnOnce(*mut u8) -> Result<(), WcStatus>,
    ) -> Option<SqStage> {
        let r = core.remote.as_ref()?;
        let ring = r.ring();
        let ring_bytes = r.ring_bytes;
        let size = header.record_size();
        if size > wire::max_record(ring_bytes) {
            return Some(SqStage::Done(WcStatus::LocQpOpErr));
        }
        let placement = wire::place(core.produced, core.reaped, ring_bytes, size)?;
        // `place` keeps the record inside the ring and clear of unconsumed bytes.
        let payload = ring.payload(placement.at, &header);
        // Its lines in the peer's ring, last read by the peer's CPU, asked for at once.
        crate::copy::prefetch_for_write(payload, header.payload_len());
        if let Err(st) = fill(payload) {
            return Some(SqStage::Done(st));
        }
        ring.status(placement.at).store(status::OK, Ordering::Relaxed);
        ring.write_fields(placement.at, &header);
        let start = core.produced + (placement.advance - size) as u64;
        if let Some(pad_at) = placement.pad_at {
            let pad = RecordHeader {
                kind: RecordKind::Pad,
                flags: 0,
                sge_count: 0,
                len: (ring_bytes - pad_at) as u32,
                imm: 0,
                rkey: 0,
                raddr: 0,
            };
            ring.write_fields(pad_at, &pad);
            // Record first (at 0), then the pad that leads the consumer to it.
            ring.publish(placement.at).store(wire::publish_word(start), Ordering::Release);
            ring.publish(pad_at).store(wire::publish_word(core.produced), Ordering::Release);
        } else {
            ring.publish(placement.at).store(wire::publish_word(start), Ordering::Release);
        }
        core.produced += placement.advance as u64;
        r.peer.ring_bell(r.info.recv_cq_bell);
        let target_placed = header.kind != RecordKind::WriteImmNotify;
        Some(SqStage::InRing { start, end: core.produced, off: placement.at, target_placed })
    }

    pub(in crate::soft::qp) fn start_send(&self, core: &mut QpCore, wr: &SendWr, inline: &Inline) -> Option<SqStage> {
        let len = wr.byte_len() as u32;
        let flags = if wr.opcode == WrOpcode::SendWithImm { wire::FLAG_IMM } else { 0 };
        let mut h =
            RecordHeader { kind: RecordKind::SendInline, flags, sge_count: 0, len, imm: wr.imm, rkey: 0, raddr: 0 };
        let is_inline = !matches!(inline, Inline::No);
        let keys = self.keys(core);
        if !is_inline && !keys.check_all(&wr.sg_list, AccessFlags::NONE, self.pd) {
            return Some(SqStage::Done(WcStatus::LocProtErr));
        }
        if is_inline || len as usize <= self.ctx.config.copy_threshold {
            return self.place_record(core, h, |dst| self.gather_into(&keys, dst, inline, &wr.sg_list));
        }
        let count = wr.sg_list.iter().filter(|s| s.length > 0).count();
        if count > wire::MAX_DESC {
            return Some(SqStage::Done(WcStatus::LocQpOpErr));
        }
        h.kind = RecordKind::SendDescriptors;
        h.sge_count = count as u16;
        self.place_record(core, h, |dst| {
            for (i, s) in wr.sg_list.iter().filter(|s| s.length > 0).enumerate() {
                let d = Descriptor { addr: s.addr, len: s.length, key: s.lkey }.encode();
                // SAFETY: `dst` has room for sge_count descriptors (the record was sized so).
                unsafe { std::ptr::copy_nonoverlapping(d.as_ptr(), dst.add(i * wire::DESC_BYTES), wire::DESC_BYTES) };
            }
            Ok(())
        })
    }

    /// Copies a request's data (inline bytes, or its checked local SGEs) to `dst`.
    pub(in crate::soft::qp) fn gather_into(
        &self,
        keys: &LocalKeys,
        dst: *mut u8,
        inline: &Inline,
        sges: &[Sge],
    ) -> Result<(), WcStatus> {
        let need = match inline {
            Inline::Owned(data) => {
                // SAFETY: `dst` has room for the whole message (the record was sized by its length).
                unsafe { crate::copy::copy_bytes(dst, data.as_ptr(), data.len()) };
                return Ok(());
            }
            Inline::Borrowed => None,
            Inline::No => Some(AccessFlags::NONE),
        };
        self.each_local_piece(keys, sges, need, |off, addr, len| {
            // SAFETY: the piece is a checked local registration, or inline caller memory valid
            // during post_send; `dst` has room for the sum of the SGE lengths.
            if unsafe { local_copy(dst.add(off), addr as *const u8, len) } {
                Ok(())
            } else {
                Err(WcStatus::LocProtErr)
            }
        })
    }

    /// Walks a local SGE list, calling `f(message_offset, address, length)` for each piece.
    /// With `need`, each piece is first checked against `keys` (which keeps it registered
    /// throughout); without, the SGEs are inline caller memory and are not looked up.
    pub(in crate::soft::qp) fn each_local_piece(
        &self,
        keys: &LocalKeys,
        sges: &[Sge],
        need: Option<AccessFlags>,
        mut f: impl FnMut(usize, usize, usize) -> Result<(), WcStatus>,
    ) -> Result<(), WcStatus> {
        let mut off = 0usize;
        for s in sges {
            if let Some(need) = need {
                if !keys.check(s.lkey, s.addr, s.length as u64, need, self.pd) {
                    return Err(WcStatus::LocProtErr);
                }
            }
            f(off, s.addr as usize, s.length as usize)?;
            off += s.length as usize;
        }
        Ok(())
    }

    pub(in crate::soft::qp) fn start_write_imm(
        &self,
        core: &mut QpCore,
        wr: &SendWr,
        inline: &Inline,
    ) -> Option<SqStage> {
        let len = wr.byte_len() as u32;
        let keys = self.keys(core);
        if matches!(inline, Inline::No) && !keys.check_all(&wr.sg_list, AccessFlags::NONE, self.pd) {
            return Some(SqStage::Done(WcStatus::LocProtErr));
        }
        let header = |kind| RecordHeader {
            kind,
            flags: wire::FLAG_IMM,
            sge_count: 0,
            len,
            imm: wr.imm,
            rkey: wr.rkey,
            raddr: wr.remote_addr,
        };
        if self.wwi_is_ring_inline(core, wr) {
            let h = header(RecordKind::WriteImmInline);
            return self.place_record(core, h, |dst| self.gather_into(&keys, dst, inline, &wr.sg_list));
        }
        // Room for the notification first, so the data is written exactly once.
        let r = core.remote.as_ref()?;
        let h = header(RecordKind::WriteImmNotify);
        wire::place(core.produced, core.reaped, r.ring_bytes, h.record_size())?;
        if let SqStage::Done(st) = self.run_one_sided(core, wr, inline) {
            if !st.is_success() {
                return Some(SqStage::Done(st));
            }
        }
        self.place_record(core, h, |_| Ok(()))
    }

    /// The responder's first checks of a one-sided request: a live peer queue pair that grants
    /// `need` remote rights. The peer's state and rights are read, not its key table.
    #[inline]
    pub(in crate::soft::qp) fn peer_grants<'c>(
        &self,
        core: &'c QpCore,
        need: AccessFlags,
    ) -> Result<&'c Remote, WcStatus> {
        let Some(r) = &core.remote else {
            return Err(WcStatus::RetryExcErr);
        };
        if r.peer_qp_gone() {
            // No answer comes: the requester's retries run out.
            return Err(WcStatus::RetryExcErr);
        }
        let peer_qp_access = AccessFlags::from_bits_truncate(r.seg().header().access.load(Ordering::Relaxed));
        if !peer_qp_access.contains(need) {
            return Err(WcStatus::RemInvReqErr);
        }
        Ok(r)
    }

    /// The checked destination of an RDMA write of `len` bytes from inline data: None for a
    /// zero-byte write, which names no memory.
    #[inline]
    pub(in crate::soft::qp) fn remote_write_access<'c>(
        &self,
        core: &'c QpCore,
        rkey: u32,
        remote_addr: u64,
        len: u64,
    ) -> Result<Option<crate::soft::peer::RemoteAccess<'c>>, WcStatus> {
        let r = self.peer_grants(core, AccessFlags::REMOTE_WRITE)?;
        if len == 0 {
            return Ok(None);
        }
        r.peer.access(rkey, remote_addr, len, AccessFlags::REMOTE_WRITE, r.info.pd).map(Some)
    }

    /// Carries out a one-sided request on the peer's memory; returns its final stage.
    pub(in crate::soft::qp) fn run_one_sided(&self, core: &QpCore, wr: &SendWr, inline: &Inline) -> SqStage {
        let (need_remote, need_local) = match wr.opcode {
            WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm => (AccessFlags::REMOTE_WRITE, AccessFlags::NONE),
            WrOpcode::RdmaRead => (AccessFlags::REMOTE_READ, AccessFlags::LOCAL_WRITE),
            _ => (AccessFlags::REMOTE_ATOMIC, AccessFlags::LOCAL_WRITE),
        };
        let r = match self.peer_grants(core, need_remote) {
            Ok(r) => r,
            Err(st) => return SqStage::Done(st),
        };
        let keys = self.keys(core);
        if matches!(inline, Inline::No) && !keys.check_all(&wr.sg_list, need_local, self.pd) {
            return SqStage::Done(WcStatus::LocProtErr);
        }
        let len = wr.byte_len();
        if wr.opcode.is_atomic() && !wr.remote_addr.is_multiple_of(8) {
            return SqStage::Done(WcStatus::RemInvReqErr);
        }
        if len == 0 && !wr.opcode.is_atomic() {
            // A zero-byte read or write names no memory: the responder checks neither key nor
            // address (IBA C9-88), which makes it a keep-alive or a completion fence.
            return SqStage::Done(WcStatus::Success);
        }
        let access = match r.peer.access(wr.rkey, wr.remote_addr, len, need_remote, r.info.pd) {
            Ok(a) => a,
            Err(st) => return SqStage::Done(st),
        };
        let result = match wr.opcode {
            WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm => match inline {
                // SAFETY: inline bytes are ours.
                Inline::Owned(d) => unsafe { access.write_from(0, d.as_ptr(), d.len(), false) },
                // SAFETY (both arms): the pieces are checked local registrations, or inline SGEs
                // naming caller memory valid during post_send.
                Inline::Borrowed => self.each_local_piece(&keys, &wr.sg_list, None, |off, addr, len| unsafe {
                    access.write_from(off, addr as *const u8, len, false)
                }),
                Inline::No => {
                    self.each_local_piece(&keys, &wr.sg_list, Some(AccessFlags::NONE), |off, addr, len| unsafe {
                        access.write_from(off, addr as *const u8, len, wr.flags.streaming)
                    })
                }
            },
            WrOpcode::RdmaRead => {
                let one_piece = wr.sg_list.len() == 1;
                self.each_local_piece(&keys, &wr.sg_list, Some(AccessFlags::LOCAL_WRITE), |off, addr, len| {
                    let dst = addr as *mut u8;
                    // SAFETY (both): the piece is a checked local registration with LOCAL_WRITE.
                    let shared = one_piece
                        .then(|| unsafe { self.pull_shared(r, &access, dst, len, wr.rkey, need_remote) })
                        .flatten();
                    shared.unwrap_or_else(|| unsafe { access.read_into(off, dst, len) })
                })
            }
            WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => {
                let (cmp_add, swap, cas) = (wr.compare_add, wr.swap, wr.opcode == WrOpcode::AtomicCmpAndSwp);
                access
                    .atomic(|old| {
                        if cas {
                            if old == cmp_add {
                                swap
                            } else {
                                old
                            }
                        } else {
                            old.wrapping_add(cmp_add)
                        }
                    })
                    .and_then(|old| {
                        let s = wr.sg_list[0];
                        let bytes = old.to_ne_bytes();
                        let writable = keys.check(s.lkey, s.addr, 8, AccessFlags::LOCAL_WRITE, self.pd);
                        // SAFETY: checked local registration of 8 writable bytes.
                        let copied = writable && unsafe { local_copy(s.addr as usize as *mut u8, bytes.as_ptr(), 8) };
                        copied.then_some(()).ok_or(WcStatus::LocProtErr)
                    })
            }
            _ => Err(WcStatus::GeneralErr),
        };
        SqStage::Done(match result {
            Ok(()) => WcStatus::Success,
            Err(st) => st,
        })
    }

    /// True if a pull of `len` bytes by cross-memory attach (a read, or a large send's data) is
    /// worth sharing with the peer.
    pub(in crate::soft::qp) fn worth_sharing(&self, len: usize) -> bool {
        let min = self.ctx.config.assist_min;
        min > 0 && len >= min
    }

    /// Pulls the whole `len` bytes of `access` (registered in the peer under `key` with `need`)
    /// into `dst`, offering the back half to the peer (see `assist`): the peer's polling thread
    /// pushes it while we copy the front half, or we copy it too. None (nothing copied) if the
    /// range is not in another process's user memory or too short to be worth sharing.
    ///
    /// # Safety
    /// `dst` must be valid for writes of `len` bytes (a checked local registration).
    pub(in crate::soft::qp) unsafe fn pull_shared(
        &self,
        r: &Remote,
        access: &crate::soft::peer::RemoteAccess<'_>,
        dst: *mut u8,
        len: usize,
        key: u32,
        need: AccessFlags,
    ) -> Option<Result<(), WcStatus>> {
        let src = access.cross_process_addr().filter(|_| self.worth_sharing(len) && len == access.len())?;
        // Jobs of one queue pair are sequential (its lock), so a plain load and store do (a
        // lost update would only lose one job's lesson).
        let share = self.copier_share.load(Ordering::Relaxed);
        let split = assist::split_point(len as u64, share);
        let job = assist::Job { src, dst: dst as u64, len: len as u64, split, key, need: need.bits() };
        let id = self.assist_jobs.fetch_add(1, Ordering::Relaxed) + 1;
        let offer = assist::open(r.seg().assist(), id, &job);
        let split = split as usize;
        let started = Instant::now();
        // SAFETY: the front part of the caller's range.
        let front = unsafe { access.read_into(0, dst, split) };
        let front_took = started.elapsed();
        // Settled whatever the front's outcome: no helper write may land after we return.
        let back = offer.settle(ASSIST_TIMEOUT, || r.peer.alive());
        if let (Ok(()), Ok((Back::Helper, waited))) = (&front, &back) {
            self.copier_share.store(assist::next_share(share, front_took, *waited), Ordering::Relaxed);
        }
        Some(front.and_then(|()| match back.map(|(b, _)| b) {
            Ok(Back::Helper) => Ok(()),
            // SAFETY: the back part of the caller's range.
            Ok(Back::Copier | Back::HelperFailed) => unsafe { access.read_into(split, dst.add(split), len - split) },
            Err(Stuck::HelperGone | Stuck::TimedOut) => Err(WcStatus::RetryExcErr),
            Err(Stuck::Corrupt) => Err(WcStatus::RemOpErr),
        }))
    }

    /// Pushes the back half of a shared copy our peer offers now, if it offers one (one load
    /// of the assist line when it does not).
    #[inline]
    pub(crate) fn help_peer(&self) {
        if let Some(taken) = assist::try_take(QpSeg(&self.seg).assist()) {
            self.help(taken);
        }
    }

    /// Pushes the back half of a copy our peer offered (see `assist`), if it names memory we
    /// registered for it; reports the outcome on the line either way.
    pub(in crate::soft::qp) fn help(&self, taken: assist::Taken<'_>) {
        let peer = self.helper_peer.lock().expect("helper peer lock").clone();
        let job = taken.job;
        let (off, len) = job.back();
        // Never waits for a deregistration (we hold no queue-pair lock here): it may itself wait
        // for the copier's access to end, which waits for us. The copier then copies the half
        // itself.
        let keys = self.ctx.try_local_keys();
        let ok = peer.zip(keys).is_some_and(|(p, keys)| {
            let need = AccessFlags::from_bits_truncate(job.need);
            let src = job.src.checked_add(off);
            let fits = src.is_some_and(|src| keys.check(job.key, src, len, need, self.pd));
            // SAFETY: the source range was checked against our registration of it, which `keys`
            // keeps registered until the copy is done.
            fits && unsafe { p.push(job.dst.wrapping_add(off), (job.src + off) as usize as *const u8, len as usize) }
                .is_ok()
        });
        taken.finish(ok);
    }

    /// Requester side: learn which records the peer consumed, detect receiver-not-ready and a
    /// dead peer, run what was waiting.
    pub(in crate::soft::qp) fn progress_outbound(&self, core: &mut QpCore, out: &mut Out) {
        if self.reap(core, out) {
            self.execute(core, out);
        }
        self.retire(core, out);
    }

    /// Turns the records the peer consumed into finished requests and watches the head record
    /// for receiver-not-ready. Returns false if the QP went to error.
    pub(in crate::soft::qp) fn reap(&self, core: &mut QpCore, out: &mut Out) -> bool {
        if core.in_ring > 0 {
            let Some(r) = &core.remote else { return true };
            if let Some(target) = r.local.as_ref().and_then(std::sync::Weak::upgrade) {
                // Same process: do the responder's work now rather than wait for its thread.
                target.drive_inbound();
            }
            let consumed = r.seg().consumer().consumed.load(Ordering::Acquire);
            core.reaped = consumed;
            let ring = r.ring();
            let mut error = None;
            for e in core.sq.iter_mut() {
                let SqStage::InRing { start, end, off, target_placed } = e.stage else {
                    if matches!(e.stage, SqStage::Waiting) {
                        break;
                    }
                    continue;
                };
                if end > consumed {
                    // Not consumed: receiver-not-ready if it heads the ring and no receive waits.
                    core.head_waits = core.head_waits.wrapping_add(1);
                    let probe = core.head_waits.is_multiple_of(64);
                    let taken = r.seg().consumer().taking.load(Ordering::Acquire) > start;
                    if probe && start == consumed && !taken {
                        let rq = r.peer.ctrl().rq(r.info.rq_slot as usize).expect("validated at connect");
                        let empty = rq.posted.load(Ordering::Acquire) <= rq.consumed.load(Ordering::Acquire);
                        if empty {
                            let timer =
                                rnr_timer_duration(r.seg().header().min_rnr_timer.load(Ordering::Relaxed) as u8);
                            let now = Instant::now();
                            let t = core.rnr.get_or_insert(RnrTrack { start, naks: 0, last: now });
                            if t.start != start {
                                *t = RnrTrack { start, naks: 0, last: now };
                            }
                            if now.duration_since(t.last) >= timer {
                                t.naks += 1;
                                t.last = now;
                            }
                            if core.rts.rnr_retry != 7 && t.naks > core.rts.rnr_retry as u32 && cancel_from(r, start) {
                                e.stage = SqStage::Done(WcStatus::RnrRetryExcErr);
                                error = Some(());
                            }
                        }
                    }
                    break;
                }
                let st = status_of(ring.status(off).load(Ordering::Acquire));
                e.stage = SqStage::Done(st);
                core.in_ring -= 1;
                core.in_ring_data -= target_placed as usize;
                if !st.is_success() {
                    error = Some(());
                    break;
                }
            }
            if error.is_some() {
                self.fail_sending(core, out);
                return false;
            }
        }
        true
    }

    /// Whether a periodic pass should reap. With only unsignaled requests in flight nobody
    /// waits for their completions: reaping them reads the peer's consumed count, a line the
    /// peer writes on every message, and doing that on every periodic pass (about once per
    /// message in a ping-pong) costs a cache miss here and makes the peer's next write of it
    /// wait for the line to come back. They are still retired on every `PERIODIC_REAP_EVERY`th
    /// pass (which also probes for receiver-not-ready and errors), when the queue is half
    /// full, and when a request needs ring space or a queue slot.
    pub(in crate::soft::qp) fn periodic_reap_due(&self, core: &mut QpCore) -> bool {
        if core.in_ring == 0 {
            return false;
        }
        core.quiet_passes += 1;
        if core.quiet_passes >= PERIODIC_REAP_EVERY || core.sq.len() * 2 >= self.caps.max_send_wr as usize {
            core.quiet_passes = 0;
            // Rare enough to probe receiver-not-ready on every one.
            core.head_waits = u32::MAX;
            return true;
        }
        false
    }
}

/// Cancel handshake, rare half: cancels the peer's records from ring position `pos` on.
/// Returns true if the record at `pos` was not taken (so it never will be); false if the
/// consumer had already taken it (it will complete normally).
pub(in crate::soft::qp) fn cancel_from(r: &Remote, pos: u64) -> bool {
    let cancel = &r.seg().header().cancel_from;
    if cancel.load(Ordering::Relaxed) == 0 {
        cancel.store(pos + 1, Ordering::Relaxed);
    }
    os::sleeper_barrier();
    r.seg().consumer().taking.load(Ordering::Acquire) <= pos
}
