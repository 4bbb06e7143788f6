//! The receive path: stream bytes straight from the pipe, queued bytes, RDMA reads of the
//! peer's SrcAvails (held or waited for).

use super::*;

impl Conn {
    /// Whether the pipe's next item is stream bytes a reader with `room` bytes of buffer takes
    /// straight from the pipe ([`Conn::read_in_place`]): bulk-lane bytes, or a well-formed Data
    /// message of at most `room` bytes (anything else `pump` takes, and fails on if malformed).
    /// `None` when nothing has arrived.
    pub(super) fn front_is_direct(&mut self, room: usize) -> Option<bool> {
        match self.pipe.front() {
            Ok(Some((Lane::Bulk, _))) => Some(true),
            Ok(Some((Lane::Message, bytes))) => Some(self.proto.next_data(bytes).is_some_and(|(_, d)| d.len() <= room)),
            Ok(None) => None,
            // Taken (and failed on) by `pump`.
            Err(_) => Some(false),
        }
    }

    /// One nonblocking read attempt.
    pub(super) fn try_read(&mut self, buf: &mut [u8]) -> io::Result<ReadStep> {
        if self.read_shut {
            return Ok(ReadStep::Got(0));
        }
        let direct = self.read_in_place(buf)?;
        if direct > 0 {
            return Ok(ReadStep::Got(direct));
        }
        // Stream bytes already queued go first, without taking in more behind them (that
        // would queue those too, and a reader keeping up with its writer would never get back
        // to copying straight from the pipe).
        let queued = matches!(self.proto.rx().front(), Some(RxItem::Bytes(..)));
        let pumped = if queued { Ok(()) } else { self.pump_until(Some(buf.len())) };
        if pumped.is_ok() && self.proto.rx().is_empty() && !self.proto.eof() && self.pipe.peek_lane().is_some() {
            // Control taken in, stream bytes next: straight from the pipe, unless `buf` is held.
            let direct = self.read_in_place(buf)?;
            return Ok(if direct > 0 { ReadStep::Got(direct) } else { ReadStep::BufferHeld });
        }
        // Bytes that arrived before a failure are still delivered, then the error.
        match self.proto.rx_front_mut() {
            Some(RxItem::Bytes(..)) => {
                // As much as is queued, across messages, as a TCP read returns; not into held
                // pages (a plain copy would fault there, with our lock held).
                let Some(mut n) = self.proto.read_queued(buf, |d| protect::overlaps(d.as_ptr() as usize, d.len()))
                else {
                    return Ok(ReadStep::BufferHeld);
                };
                if n < buf.len() && pumped.is_ok() {
                    // The queue ran dry: what follows in the pipe, straight from it.
                    n += self.read_in_place(&mut buf[n..])?;
                }
                Ok(ReadStep::Got(n))
            }
            Some(RxItem::Src(src)) => {
                pumped?;
                let (a, done) = (src.advert, src.done);
                let n = (buf.len() as u64).min((a.len - done) as u64) as usize;
                // Receiving writes the buffer: a send still reading it (AZ-SDP returned before
                // the peer took it) or a receive still landing in it must finish first, as a
                // store of the application's would wait in the fault handler.
                if protect::overlaps(buf.as_ptr() as usize, n) {
                    if self.sending_from(&buf[..n]) {
                        // Our own write of this buffer, which the peer may take only after a
                        // read of its own that waits for us the same way: take the data aside
                        // now (answering the peer), to be copied in once the buffer is free.
                        if !self.claim_front()? {
                            return Ok(ReadStep::Nothing); // moved: its SrcAvailUpdate is coming
                        }
                        self.read_aside(n)?;
                    }
                    return Ok(ReadStep::BufferHeld);
                }
                if !self.claim_front()? {
                    return Ok(ReadStep::Nothing); // moved: its SrcAvailUpdate is coming
                }
                // An AZ-SDP receiver holds the whole pages and lets their read land later;
                // the unaligned head is read at once.
                let (head, middle) = if self.effective_design() == Design::AzSdp && n >= self.config.az_hold_min {
                    whole_pages(buf.as_ptr() as usize, n)
                } else {
                    (n, 0)
                };
                let end = done + (head + middle) as u32;
                let answer = (end == a.len).then_some(end);
                if head > 0 {
                    let dst = &mut buf[..head];
                    let token =
                        self.post_read(dst, a.addr + done as u64, a.rkey, false, answer.filter(|_| middle == 0))?;
                    self.wait_read(token)?;
                }
                if middle > 0 {
                    let dst = &mut buf[head..head + middle];
                    let hold = !self.peeking && self.rx_holds.may_hold();
                    let token = self.post_read(dst, a.addr + done as u64 + head as u64, a.rkey, hold, answer)?;
                    if !hold {
                        self.wait_read(token)?;
                    }
                }
                self.proto.consume_front_src(end);
                Ok(ReadStep::Got(head + middle))
            }
            None => {
                if !self.ended_by_peer {
                    pumped?;
                }
                Ok(if self.proto.eof() { ReadStep::Got(0) } else { ReadStep::Nothing })
            }
        }
    }

    /// One peek attempt: the stream's next bytes copied into `buf` and left to be read
    /// (`Some(0)` at its end), or `None` if none have arrived. Bytes still in the pipe or
    /// behind a SrcAvail are read into a private buffer first and queued in front of the rest.
    pub(super) fn peek_now(&mut self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        if self.read_shut {
            return Ok(Some(0));
        }
        if !matches!(self.proto.rx().front(), Some(RxItem::Bytes(..))) {
            let mut taken = vec![0u8; buf.len()];
            self.peeking = true;
            let step = self.try_read(&mut taken);
            self.peeking = false;
            match step? {
                ReadStep::Got(0) => return Ok(Some(0)),
                ReadStep::Got(n) => {
                    taken.truncate(n);
                    self.proto.push_front_bytes(taken);
                }
                ReadStep::Nothing | ReadStep::BufferHeld => return Ok(None),
            }
        }
        Ok(Some(self.proto.peek_queued(buf)))
    }

    /// Whether an AZ-SDP write of ours still holds part of `buf`.
    pub(super) fn sending_from(&self, buf: &[u8]) -> bool {
        self.proto.sends().iter().any(|o| match &o.what {
            Sending::Held { hold, .. } => hold_meets(hold, buf),
            _ => false,
        })
    }

    /// Reads the next `n` bytes of the SrcAvail at the front into a private buffer, queued as
    /// stream bytes ahead of the rest of it, answering the peer if that ends the SrcAvail.
    pub(super) fn read_aside(&mut self, n: usize) -> io::Result<()> {
        let Some(RxItem::Src(src)) = self.proto.rx().front() else { return Ok(()) };
        let (a, done) = (src.advert, src.done);
        let mut aside = vec![0u8; n];
        let end = done + n as u32;
        let token = self.post_read(&mut aside, a.addr + done as u64, a.rkey, false, (end == a.len).then_some(end))?;
        self.wait_read(token)?;
        self.proto.consume_front_src(end);
        self.proto.push_front_bytes(aside);
        Ok(())
    }

    /// The buffer-copy fast path: while nothing is queued, copies whole Data messages and
    /// bulk-lane bytes straight from the pipe's receive buffers and bulk ring into `buf` (one
    /// copy, no queue, no allocation), as many as fit. Anything else (control, a SrcAvail, a
    /// message larger than what is left of `buf`, a malformed one) is left to `pump`. Returns
    /// the bytes copied.
    pub(super) fn read_in_place(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut n = 0;
        while self.proto.rx().is_empty() && !self.proto.eof() && self.failed.is_none() {
            let Ok(Some((lane, bytes))) = self.pipe.front() else { break };
            if lane == Lane::Bulk {
                // Bulk-lane bytes: as many as fit, the rest left in the ring for the next read.
                let k = bytes.len().min(buf.len() - n);
                if k == 0 || protect::overlaps(buf[n..].as_ptr() as usize, k) {
                    break;
                }
                copy_slice(&mut buf[n..n + k], &bytes[..k]);
                let whole = k == bytes.len();
                n += k;
                let r = if whole { self.pipe.pop_front() } else { self.pipe.consume_front(k) };
                r.map_err(|e| self.fail_verbs(e))?;
                continue;
            }
            // Anything but the next Data message is left to `pump` (which fails on a bad one).
            let Some((h, d)) = self.proto.next_data(bytes) else { break };
            if d.len() > buf.len() - n || protect::overlaps(buf[n..].as_ptr() as usize, d.len()) {
                break;
            }
            self.proto.took_data(&h);
            copy_slice(&mut buf[n..n + d.len()], d);
            n += d.len();
            self.pipe.pop_front().map_err(|e| self.fail_verbs(e))?;
        }
        Ok(n)
    }

    /// Starts an RDMA read of peer memory into `dst`; with `hold`, `dst` (whole pages) stays
    /// inaccessible until the read completes. The token to wait on: [`READ_DONE`] if the read
    /// completed before this returned.
    pub(super) fn post_read(
        &mut self,
        dst: &mut [u8],
        addr: u64,
        rkey: u32,
        hold: bool,
        answer: Option<u32>,
    ) -> io::Result<u64> {
        let rt = runtime()?;
        // SAFETY: `dst` stays mapped until the read completes: a synchronous read waits for
        // it, an AZ-SDP read relies on the contract in the module docs; a failed socket drops
        // the registration only after its QP is down.
        let reg = unsafe { rt.regcache.get_raw(dst.as_ptr() as u64, dst.len() as u64, AccessFlags::LOCAL_WRITE) }
            .map_err(verbs_io)?;
        let sge = Sge { addr: dst.as_ptr() as u64, length: dst.len() as u32, lkey: reg.lkey() };
        let wr = SendWr::read(0, &[sge], addr, rkey);
        let token = if self.reads.is_empty() {
            // Nothing of ours ahead of it: the provider may carry it out now (the software
            // provider does), with no completion to collect and nothing to hold.
            match self.pipe.post_user_completing(wr).map_err(|e| self.fail_verbs(e))? {
                Some(token) => token,
                None => {
                    drop(reg);
                    if let Some(n) = answer {
                        self.answer_read(n)?;
                    }
                    return Ok(READ_DONE);
                }
            }
        } else {
            self.pipe.post_user(wr).map_err(|e| self.fail_verbs(e))?
        };
        self.reads.push_back(PendingRead { token, hold: None, _reg: reg, answer, ran_into: false });
        if hold {
            // Protect only what is still in flight once the application gets control back: the
            // data landing before the pages close is harmless (the caller has not returned), and
            // a read already complete needs no hold. A read that is merely queued (the software
            // provider runs it once the peer has taken our earlier messages) is waited for as
            // long as protecting and opening the pages would cost: a hold is worth it only for
            // a longer wait, and data landing in held pages costs an extra copy there.
            let budget = hold_cost(dst.len());
            let start = Instant::now();
            loop {
                self.complete_reads()?;
                if !self.reads.iter().any(|r| r.token == token) || start.elapsed() >= budget {
                    break;
                }
                std::hint::spin_loop();
            }
            if let Some(r) = self.reads.iter_mut().find(|r| r.token == token) {
                // SAFETY: whole pages of the caller's buffer; the provider writes them like DMA,
                // and our own code copies into held memory only after the hold is gone
                // (`BufferHeld`).
                let h = unsafe { protect::protect(dst.as_ptr() as usize, dst.len(), Protection::None) };
                r.hold = Some(h.map_err(verbs_io)?);
            }
        }
        Ok(token)
    }

    /// Waits until the read `token` (and every read before it) has completed.
    pub(super) fn wait_read(&mut self, token: u64) -> io::Result<()> {
        let (mut deadline, mut polls) = (None, 0u32);
        loop {
            self.complete_reads()?;
            if !self.reads.iter().any(|r| r.token == token) {
                return Ok(());
            }
            // The clock only once the read is slow (the software provider's usually is not).
            polls = polls.wrapping_add(1);
            if !polls.is_multiple_of(64) {
                std::hint::spin_loop();
                continue;
            }
            let deadline = *deadline.get_or_insert_with(|| Instant::now() + SETUP_TIMEOUT);
            if Instant::now() > deadline {
                return Err(self.fail(io::ErrorKind::TimedOut, "an RDMA read did not complete".into()));
            }
            std::hint::spin_loop();
        }
    }

    /// Notes that the application came back to `buf` while receive holds on it had not landed.
    pub(super) fn ran_into_holds(&mut self, buf: &[u8]) {
        for r in self.reads.iter_mut() {
            if r.hold.as_ref().is_some_and(|h| hold_meets(h, buf)) {
                r.ran_into = true;
            }
        }
    }

    /// Waits until every read in flight has completed.
    pub(super) fn finish_reads(&mut self) -> io::Result<()> {
        match self.reads.back() {
            Some(r) => self.wait_read(r.token),
            None => Ok(()),
        }
    }
}

/// What holding `len` bytes of whole pages costs (`mprotect` to close them and again to open
/// them: about 2 us a call plus 80 ns a page on the VMs we measured): an AZ-SDP receive waits
/// this long for a queued read before it protects the buffer and returns.
pub(super) fn hold_cost(len: usize) -> Duration {
    let pages = len.div_ceil(portability_verbs::page_size()) as u64;
    Duration::from_nanos(2 * (2000 + 80 * pages))
}

/// Whether `hold` covers a byte of `buf`.
pub(super) fn hold_meets(hold: &ProtectedRange, buf: &[u8]) -> bool {
    let start = buf.as_ptr() as usize;
    hold.addr() < start + buf.len() && start < hold.addr() + hold.len()
}
