//! The send side of each design: BSDP copies (Data messages or the bulk lane), ZSDP
//! advertises and waits, AZ-SDP advertises a protected buffer and returns.

use super::*;

impl SdpStream {
    /// BSDP: copies `buf` into Data messages, or, from the bulk threshold on where the
    /// provider can store into the peer's bulk ring, straight into that ring; may send part of
    /// it (nonblocking, or timed out after some progress).
    pub(super) fn write_copy(&self, buf: &[u8], nonblocking: bool, deadline: &Deadline) -> io::Result<usize> {
        let (bulk, copies) = {
            let c = self.lock();
            let bulk = buf.len() >= c.config.bulk_min && c.pipe.bulk_chunk_max() > 0;
            (bulk, bulk && c.pipe.bulk_copies())
        };
        if bulk && !nonblocking && !copies {
            let chunk = self.lock().pipe.bulk_chunk_max();
            return self.write_bulk(buf, chunk, deadline);
        }
        let mut pacer = Pacer::default();
        let mut sent = 0;
        while sent < buf.len() {
            let progressed = {
                let mut c = self.lock();
                let n = if copies {
                    c.bulk_copy(&buf[sent..])?
                } else {
                    let chunk = (buf.len() - sent).min(c.max_payload());
                    if c.try_send(&Message::Data(&buf[sent..sent + chunk]))? {
                        chunk
                    } else {
                        0
                    }
                };
                if n > 0 {
                    sent += n;
                    true
                } else {
                    c.pump()?;
                    false
                }
            };
            if !progressed {
                if nonblocking {
                    break;
                }
                match pacer.pause(deadline, "writing") {
                    // A partial write, as a timed-out socket write reports it (the bytes
                    // accepted are the caller's answer, never an error).
                    Err(e) if sent > 0 && e.kind() == io::ErrorKind::TimedOut => break,
                    other => other?,
                }
            } else {
                pacer = Pacer::default();
            }
        }
        if sent == 0 {
            let mut c = self.lock();
            c.flush_pipe()?;
            if c.ready.as_ref().is_some_and(|r| r.active) {
                ready::poke(); // the application waits for the descriptor next
            }
            return Err(io::ErrorKind::WouldBlock.into());
        }
        if !nonblocking {
            // No kernel drives the transport after we return: hand the coalesced tail over now.
            self.drain_staged(deadline)?;
        } else {
            self.lock().flush_pipe()?;
        }
        Ok(sent)
    }

    /// BSDP, large writes: `buf` is RDMA-written, `chunk` bytes at a time, into the peer's
    /// bulk ring (in order with the messages: the chunks are stream bytes), and the call
    /// returns once every chunk written has completed (the buffer is the caller's again). On
    /// the software provider a chunk completes when the peer's process takes it in (any call
    /// on its socket), so a write can wait for a reader, as a TCP write does once the buffers
    /// are full. A write timeout stops starting chunks, for a partial write as TCP reports
    /// it; chunks started and still not taken in after as long again fail the socket (the
    /// buffer cannot be handed back with a transfer from it pending), like an unanswered
    /// ZSDP write.
    pub(super) fn write_bulk(&self, buf: &[u8], chunk: usize, deadline: &Deadline) -> io::Result<usize> {
        let rt = runtime()?;
        // SAFETY: `buf` stays borrowed (mapped, unchanged) until this returns, and it returns
        // only after every chunk written from it completed, or with the queue pair in error.
        let reg = unsafe { rt.regcache.get_raw(buf.as_ptr() as u64, buf.len() as u64, AccessFlags::NONE) }
            .map_err(verbs_io)?;
        let write_timeout = self.lock().write_timeout;
        let mut tokens = VecDeque::new();
        let (mut sent, mut end) = (0, buf.len());
        let (mut pacer, mut polls) = (Pacer::default(), 0u32);
        let result = loop {
            match self.lock().bulk_step(&buf[sent..end], reg.lkey(), chunk, &mut tokens) {
                Ok(0) if sent == end && tokens.is_empty() => break Ok(sent),
                Ok(0) => {
                    // The clock every 64th poll only (a tenth of the loop's time otherwise).
                    polls = polls.wrapping_add(1);
                    if !polls.is_multiple_of(64) {
                        pacer.pause(&Deadline::never(), "writing")?;
                        continue;
                    }
                    let now = Instant::now();
                    if sent < end && deadline.get().is_some_and(|d| now >= d) {
                        if sent == 0 {
                            break Err(io::Error::new(io::ErrorKind::TimedOut, "timed out writing"));
                        }
                        end = sent; // a partial write: finish the chunks started, start no more
                    } else if deadline.get().zip(write_timeout).is_some_and(|(d, t)| now >= d + t) {
                        let why = "the peer did not take bulk data in within twice the write timeout";
                        break Err(self.lock().fail(io::ErrorKind::TimedOut, why.into()));
                    } else {
                        pacer.pause(&Deadline::never(), "writing")?;
                    }
                }
                Ok(n) => {
                    sent += n;
                    pacer = Pacer::default();
                }
                Err(e) => break Err(e),
            }
        };
        if result.is_err() && !tokens.is_empty() {
            // Nothing may read `buf` once we return: stop the queue pair first.
            let _ = self.lock().pipe.qp().modify(portability_verbs::QpTransition::Error);
        }
        drop(reg);
        result
    }

    /// AZ-SDP: the unaligned head and tail go as Data, the whole pages between as a SrcAvail
    /// of the read-only-protected buffer; returns without waiting for the receiver.
    pub(super) fn write_async(&self, buf: &[u8], deadline: &Deadline) -> io::Result<usize> {
        let (head, middle) = whole_pages(buf.as_ptr() as usize, buf.len().min(u32::MAX as usize & !0xfff));
        if middle == 0 {
            return self.write_copy(buf, false, deadline);
        }
        if head > 0 {
            let n = self.write_copy(&buf[..head], false, deadline)?;
            if n < head {
                return Ok(n);
            }
        }
        match self.advertise_held(&buf[head..head + middle], deadline) {
            Ok(()) => {}
            Err(e) if head > 0 && e.kind() == io::ErrorKind::TimedOut => return Ok(head),
            Err(e) => return Err(e),
        }
        let tail = &buf[head + middle..];
        if tail.is_empty() {
            return Ok(buf.len());
        }
        match self.write_copy(tail, false, deadline) {
            Ok(n) => Ok(head + middle + n),
            Err(e) if e.kind() == io::ErrorKind::TimedOut => Ok(head + middle),
            Err(e) => Err(e),
        }
    }

    /// Protects `pages` read-only, advertises them and returns; RdmaRdCompl releases them.
    pub(super) fn advertise_held(&self, pages: &[u8], deadline: &Deadline) -> io::Result<()> {
        let rt = runtime()?;
        let mut pacer = Pacer::default();
        loop {
            {
                let mut c = self.lock();
                c.pump()?;
                if c.proto.sends().len() < c.config.az_max_outstanding {
                    break;
                }
            }
            // RdmaRdCompl arrives as a message.
            let what = "waiting for an outstanding SrcAvail to be read";
            pacer.pause_on(deadline, what, Some(&self.cq), || self.prepare_sleep())?;
        }
        let (addr, len) = (pages.as_ptr() as usize, pages.len());
        // SAFETY: the pages stay mapped until the receiver answers, by the AZ-SDP contract
        // (module docs); a failed socket drops the registration only after its QP is down.
        let reg =
            unsafe { rt.regcache.get_raw(addr as u64, len as u64, AccessFlags::REMOTE_READ) }.map_err(verbs_io)?;
        let advert = Advert { len: len as u32, rkey: reg.rkey(), addr: addr as u64 };
        // The same buffer sent before is usually still read-only: hold it again for the price
        // of an `mprotect` that changes nothing.
        let lazy = {
            let mut c = self.lock();
            let i = c.lazy.iter().position(|l| l.addr() == addr && l.len() == len);
            let lazy = i.and_then(|i| c.lazy.remove(i));
            if let Some(l) = &lazy {
                c.note_faults(l.faults());
            }
            lazy
        };
        let hold = match lazy {
            Some(lazy) => lazy.reprotect(),
            // SAFETY: whole pages of the caller's buffer; our own code reads them only (BSDP
            // copies) and the provider reaches them like DMA, so nothing in the progress path
            // faults.
            None => unsafe { protect::protect(addr, len, Protection::ReadOnly) },
        }
        .map_err(verbs_io)?;
        // If this fails the socket has failed; the hold is dropped with the error.
        self.send_advert(advert, Sending::Held { hold, reg, waited_since: None, lost: false }, deadline)
    }

    /// Sends a SrcAvail for `advert` as soon as flow control admits it, queueing `what` under
    /// its number to await the answer, and hands it to the transport. An AZ-SDP advert puts
    /// the socket under the engine's watch (nobody waits for its answer).
    pub(super) fn send_advert(&self, advert: Advert, what: Sending, deadline: &Deadline) -> io::Result<()> {
        let watched = matches!(what, Sending::Held { .. });
        let mut pending = Some(what);
        let mut pacer = Pacer::default();
        loop {
            {
                let mut c = self.lock();
                c.check_writable()?;
                c.advertise(advert, &mut pending)?;
                if pending.is_none() {
                    if watched {
                        self.watch(&mut c);
                    }
                    break;
                }
                c.pump()?;
            }
            pacer.pause(deadline, "sending a SrcAvail")?;
        }
        self.drain_staged(deadline)
    }

    /// ZSDP: advertise the registered buffer and wait until the receiver has read it.
    pub(super) fn write_zcopy(&self, buf: &[u8], timeout: Option<Duration>) -> io::Result<usize> {
        let rt = runtime()?;
        let buf = &buf[..buf.len().min(u32::MAX as usize)];
        let reg = rt.regcache.get(buf, AccessFlags::REMOTE_READ).map_err(verbs_io)?;
        let advert = Advert { len: buf.len() as u32, rkey: reg.rkey(), addr: buf.as_ptr() as u64 };
        let mut deadline = Deadline::after(timeout);
        self.lock().zcopy_answer = None;
        self.send_advert(advert, Sending::Waited, &deadline)?;
        let mut cancelled = false;
        let mut pacer = Pacer::default();
        loop {
            {
                let mut c = self.lock();
                let pumped = c.pump();
                if let Some(n) = c.zcopy_answer.take() {
                    if n == 0 {
                        // Nothing was read before the cancel: the write timed out, the socket
                        // is as it was before it.
                        return Err(io::Error::new(io::ErrorKind::WouldBlock, "the receiver read nothing in time"));
                    }
                    return Ok(n as usize);
                }
                if let Err(e) = pumped {
                    // The buffer may still be read by a peer we no longer hear: make sure the
                    // queue pair is down before the registration (and `buf`) is let go.
                    c.abort_locally();
                    return Err(e);
                }
            }
            if deadline.passed() {
                if cancelled {
                    // The peer answers neither the advertisement nor its cancellation: the
                    // connection is dropped so the buffer can no longer be read.
                    let mut c = self.lock();
                    c.abort_locally();
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the receiver did not answer a cancelled SrcAvail",
                    ));
                }
                cancelled = true;
                // Marked first: the answer (for fewer bytes now) may come at once.
                self.lock().proto.cancel_oldest();
                self.send_control(Message::SrcAvailCancel)?;
                deadline = Deadline::after(timeout);
            }
            pacer.pause_on(&Deadline::never(), "waiting for RdmaRdCompl", Some(&self.cq), || self.prepare_sleep())?;
        }
    }
}

impl Conn {
    /// One step of a bulk write: starts the next chunk of `rest` (registered under `lkey`) if
    /// the peer's ring has room; otherwise takes in what arrived (the peer may be writing to
    /// us too, and its chunks must not wait for ours) and collects the chunks completed, in
    /// order, from `tokens`. Returns the bytes started.
    /// BSDP: stores the front of `rest` into the peer's bulk ring (the bytes are free when it
    /// returns); how many it took, 0 if the ring has no room now.
    pub(super) fn bulk_copy(&mut self, rest: &[u8]) -> io::Result<usize> {
        self.check_writable()?;
        self.pipe.try_send_bulk_copy(rest).map_err(|e| self.fail_verbs(e))
    }

    pub(super) fn bulk_step(
        &mut self,
        rest: &[u8],
        lkey: u32,
        chunk: usize,
        tokens: &mut VecDeque<u64>,
    ) -> io::Result<usize> {
        if !rest.is_empty() {
            self.check_writable()?;
            let n = rest.len().min(chunk);
            let sge = Sge { addr: rest.as_ptr() as u64, length: n as u32, lkey };
            match self.pipe.try_send_bulk(sge) {
                Ok(Some(t)) => {
                    tokens.push_back(t);
                    return Ok(n);
                }
                Ok(None) => {}
                Err(e) => return Err(self.fail_verbs(e)),
            }
        }
        self.pump()?;
        while let Some(&t) = tokens.front() {
            match self.pipe.take_user_completion(t) {
                None => break,
                Some(WcStatus::Success) => _ = tokens.pop_front(),
                Some(st) => return Err(self.fail(io::ErrorKind::ConnectionReset, format!("bulk write failed: {st:?}"))),
            }
        }
        Ok(0)
    }
}
