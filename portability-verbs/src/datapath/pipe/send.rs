//! Sending: messages offered to flow control, inline or staged sends, polled frames (stored
//! through the window onto the peer's ring or posted), coalesced flushes, and the sleep
//! handshake of the polled strategy.

use super::*;

/// Frames of at most this many bytes (one cache line, [`fc::FRAME_ALIGN`]) are put together
/// before they are stored ([`MsgPipe::write_frame_inline`]).
const SMALL_FRAME: usize = fc::FRAME_ALIGN as usize;

impl MsgPipe {
    /// Offers a message; `Ok(false)` if flow control holds it back now (call
    /// [`MsgPipe::progress`] and retry). The bytes are copied before it returns.
    pub fn try_send(&mut self, msg: &[u8]) -> Result<bool> {
        self.check_failed()?;
        if msg.len() > self.strategy.max_message() {
            return Err(VerbsError::invalid(format!(
                "message of {} bytes over the pipe's {} (larger data goes by rendezvous)",
                msg.len(),
                self.strategy.max_message()
            )));
        }
        if self.outstanding >= self.strategy.send_slots() {
            // The send window looks full, perhaps only because its completions were not taken
            // (a polled reader's passes do not look): take them before holding the message
            // back, or staging it for a flush only a later call would make.
            if let Err(e) = self.poll_completions() {
                return Err(self.fail(e));
            }
        }
        let accepted = match self.strategy {
            FlowStrategy::Credit { .. } => {
                if !self.credits.can_send_data()
                    || self.outstanding >= self.strategy.send_slots()
                    || self.send_pool.stats().in_use >= self.send_pool.capacity()
                {
                    false
                } else {
                    let grant = self.credits.on_send();
                    let rec = Record { kind: RecordKind::Data, credits: grant, len: msg.len() as u32, ack: 0 };
                    self.send_record(rec, msg)?;
                    true
                }
            }
            FlowStrategy::Window { window, .. } => {
                let rec = Record { kind: RecordKind::Data, credits: 0, len: msg.len() as u32, ack: 0 };
                // The first N/W segments go straight to the transport; what comes while they are
                // outstanding is coalesced and sent as one segment at the next completion.
                let pool_free = self.send_pool.stats().in_use < self.send_pool.capacity();
                if pool_free && self.outstanding < self.strategy.straight_sends() && self.coalescer.is_empty() {
                    self.send_record(rec, msg)?;
                    true
                } else {
                    // Queued behind outstanding segments: coalesce until a completion.
                    self.coalescer.push(rec, msg, window)
                }
            }
            FlowStrategy::Rdma { coalesce, .. } => {
                // The acknowledgement rides on the record only if the record is taken.
                let ack = self.ring_rx.ack_due();
                let rec = Record { kind: RecordKind::Data, credits: 0, len: msg.len() as u32, ack };
                let max = coalesce.max(RECORD_HEADER + msg.len());
                let taken = if self.coalescer.push(rec, msg, max) {
                    if self.outstanding == 0 || self.coalescer.len() >= coalesce {
                        self.flush_ring()?;
                    }
                    true
                } else {
                    self.flush_ring()?;
                    self.coalescer.push(rec, msg, max)
                };
                if taken {
                    self.ring_rx.acked_to(ack);
                }
                taken
            }
            FlowStrategy::Polled { coalesce, .. } => {
                let ack = self.ring_rx.ack_due();
                let rec = Record { kind: RecordKind::Data, credits: 0, len: msg.len() as u32, ack };
                // Alone in its frame, straight from the caller's bytes, unless earlier messages
                // wait or it is large; then batched (what waits goes first).
                let taken = if self.coalescer.is_empty() && self.write_frame_inline(rec, [&[], msg, &[]])? {
                    true
                } else {
                    let max = coalesce.max(RECORD_HEADER + msg.len());
                    let pushed = self.coalescer.push(rec, msg, max);
                    self.flush_frames()?;
                    pushed || self.coalescer.push(rec, msg, max)
                };
                if taken {
                    self.ring_rx.acked_to(ack);
                }
                taken
            }
        };
        if accepted {
            self.stats.sent += 1;
        } else {
            self.stats.blocked += 1;
        }
        Ok(accepted)
    }

    /// Sends the message `head` then `body` as one frame written straight from the two (no
    /// copy of ours into a message) where it can leave at once so: the polled strategy, nothing
    /// staged ahead of it, room in the ring, and the frame stored through the window or small
    /// enough to post inline. `Ok(false)` otherwise, nothing sent: join the two and
    /// [`MsgPipe::try_send`] (for a layer whose messages are its own header before the
    /// application's bytes, and which would copy those bytes into its message only to have
    /// them copied out again).
    pub fn try_send_gathered(&mut self, head: &[u8], body: &[u8]) -> Result<bool> {
        self.check_failed()?;
        let len = head.len() + body.len();
        if len > self.strategy.max_message() {
            return Err(VerbsError::invalid(format!(
                "message of {len} bytes over the pipe's {}",
                self.strategy.max_message()
            )));
        }
        if !matches!(self.strategy, FlowStrategy::Polled { .. }) || !self.coalescer.is_empty() {
            return Ok(false);
        }
        let ack = self.ring_rx.ack_due();
        let rec = Record { kind: RecordKind::Data, credits: 0, len: len as u32, ack };
        if !self.write_frame_inline(rec, [&[], head, body, &[]])? {
            return Ok(false);
        }
        self.ring_rx.acked_to(ack);
        self.stats.sent += 1;
        Ok(true)
    }

    /// Sends one record (credit and window strategies): inline when it is small (the
    /// transport gathers header and payload at post: no staging buffer to take and give back,
    /// no key checks, no copy of ours), else from a staging buffer.
    pub(super) fn send_record(&mut self, rec: Record, payload: &[u8]) -> Result<()> {
        let len = RECORD_HEADER + payload.len();
        if len <= self.inline_max {
            let header = rec.encode();
            let sges = [
                Sge { addr: header.as_ptr() as u64, length: RECORD_HEADER as u32, lkey: 0 },
                Sge { addr: payload.as_ptr() as u64, length: payload.len() as u32, lkey: 0 },
            ];
            let sges = if payload.is_empty() { &sges[..1] } else { &sges[..] };
            self.post_inline_counted(SendWr::send(0, sges))?;
            self.stats.transfers += 1;
            return Ok(());
        }
        let mut b = self.send_pool.try_acquire().ok_or_else(|| VerbsError::Exhausted("pipe send pool".into()))?;
        b.push(&rec.encode());
        b.push(payload);
        self.post_staged(b)
    }

    /// Posts an inline request (a send, or a frame's write) in the send window: signaled once
    /// every `SIGNAL_EVERY`, or when it fills the window.
    #[inline]
    pub(super) fn post_inline_counted(&mut self, wr: SendWr) -> Result<()> {
        self.post_counted(|qp, wr_id, signaled| {
            let mut wr = wr.inline(true).signaled(signaled).inject_complete(true);
            wr.wr_id = wr_id;
            qp.post_send(&[wr])
        })
    }

    /// Posts one inline send with `post(qp, wr_id, signaled)`, signaled as
    /// [`MsgPipe::post_inline_counted`] says.
    #[inline]
    pub(super) fn post_counted(&mut self, post: impl FnOnce(&QueuePair, u64, bool) -> Result<()>) -> Result<()> {
        let before = self.signals;
        let (covers, signaled) = self.signals.inline_post(self.outstanding, self.strategy.straight_sends());
        if let Err(e) = post(&self.qp, wr_id(TAG_INLINE_SEND, covers as u64), signaled) {
            self.signals = before;
            return Err(e);
        }
        self.outstanding += 1;
        Ok(())
    }

    /// Writes one record as a frame of its own, inline from the caller's bytes (polled
    /// strategy): `parts` are the frame's, its first and last left empty for the framing
    /// written here, the record's payload between them. False if it is too large to go
    /// inline, or the ring or the send window has no room now.
    #[inline]
    pub(super) fn write_frame_inline<const N: usize>(&mut self, rec: Record, parts: [&[u8]; N]) -> Result<bool> {
        let body = RECORD_HEADER + parts.iter().map(|p| p.len()).sum::<usize>();
        let written = fc::frame_written(body);
        let direct = self.direct_now();
        if !direct && (written > self.inline_max || self.outstanding >= self.strategy.send_slots()) {
            return Ok(false);
        }
        let reserved = fc::frame_reserved(body);
        let Some(place) = self.ring_tx.reserve(reserved) else { return Ok(false) };
        let Some((peer_addr, rkey)) = self.peer_ring.as_ref().map(|p| (p.addr, p.rkey)) else {
            self.ring_tx.unreserve();
            return Err(VerbsError::Protocol("a frame before setup".into()));
        };
        let (word, pad) = fc::frame_framing(self.ring_tx.sent() - reserved, body);
        if direct && written <= SMALL_FRAME && !crate::protect::any_active() {
            // A frame of one cache line: put together in registers and stored with one copy
            // (and its closing word), not a store per part. (Under a protection hold a payload
            // may not be readable: the window's copies report that rather than fault.) The
            // layout is `fc::encode_frame`'s, written out here: through that general function
            // a message cost the pipe 819-964 instructions instead of 691 (callgrind).
            let mut frame = [0u8; SMALL_FRAME];
            frame[..8].copy_from_slice(&word);
            frame[8..8 + RECORD_HEADER].copy_from_slice(&rec.encode());
            let mut at = 8 + RECORD_HEADER;
            for part in &parts[1..N - 1] {
                // SAFETY: the parts end at `8 + body`, inside the frame's `written - 8` bytes
                // before its closing word (`written <= SMALL_FRAME`); `part` is the caller's.
                unsafe { crate::copy::copy_bytes(frame.as_mut_ptr().add(at), part.as_ptr(), part.len()) };
                at += part.len();
            }
            frame[written - 8..written].copy_from_slice(&word);
            let window = self.ring_window.as_ref().expect("direct_now checked");
            let stored = window.write_small(place.offset as usize, &frame[..written]);
            self.frame_stored(stored)?;
            return Ok(true);
        }
        // Written from its parts, with no staging copy: the publish word and the record header
        // from one small array, the payload from where it lies, the padding and the closing
        // word from another.
        let mut head = [0u8; 8 + RECORD_HEADER];
        head[..8].copy_from_slice(&word);
        head[8..].copy_from_slice(&rec.encode());
        let mut tail = [0u8; 16];
        tail[pad.len()..pad.len() + 8].copy_from_slice(&word);
        let mut parts = parts;
        (parts[0], parts[N - 1]) = (&head, &tail[..pad.len() + 8]);
        let parts = &parts;
        if direct {
            let window = self.ring_window.as_ref().expect("direct_now checked");
            let stored = window.write(place.offset as usize, parts);
            self.frame_stored(stored)?;
            return Ok(true);
        }
        let addr = peer_addr + place.offset;
        let posted =
            self.post_counted(|qp, wr_id, signaled| qp.post_write_inline_list(wr_id, parts, addr, rkey, signaled));
        if let Err(e) = posted {
            self.ring_tx.unreserve();
            return Err(e);
        }
        self.stats.transfers += 1;
        self.after_frame()?;
        Ok(true)
    }

    /// Writes what is coalesced as one frame from a staging buffer (polled strategy), if the
    /// ring, the send window and the staging pool have room.
    pub(super) fn flush_frames(&mut self) -> Result<()> {
        let direct = self.direct_now();
        if self.coalescer.is_empty() || (!direct && self.outstanding >= self.strategy.send_slots()) {
            return Ok(());
        }
        let body = self.coalescer.len();
        let reserved = fc::frame_reserved(body);
        let Some(place) = self.ring_tx.reserve(reserved) else {
            return Ok(()); // no ring space until the peer acknowledges
        };
        if direct {
            let (word, pad) = fc::frame_framing(self.ring_tx.sent() - reserved, body);
            let window = self.ring_window.as_ref().expect("direct_now checked");
            let stored = window.write(place.offset as usize, &[&word, self.coalescer.bytes(), pad, &word]);
            self.coalescer.clear();
            return self.frame_stored(stored);
        }
        let Some(mut b) = self.send_pool.try_acquire() else {
            self.ring_tx.unreserve();
            return Ok(());
        };
        let (word, pad) = fc::frame_framing(self.ring_tx.sent() - reserved, body);
        b.push(&word);
        b.push(self.coalescer.bytes());
        b.push(pad);
        b.push(&word);
        self.coalescer.clear();
        let peer = self.peer_ring.as_ref().ok_or_else(|| VerbsError::Protocol("a frame before setup".into()))?;
        let sge = b.sge();
        let inline = sge.length as usize <= self.inline_max;
        let id = staged_wr_id(b.into_index(), self.signals.unsignaled() + 1);
        // Its staging buffer is free once the provider wrote it out (the ring's flow control,
        // not this completion, says when the peer has read it).
        let wr = SendWr::write(id, &[sge], peer.addr + place.offset, peer.rkey).inline(inline).inject_complete(true);
        match self.held_chunk.take() {
            // The bulk chunk this frame announces goes first, in the same call.
            Some(chunk) => self.qp.post_send(&[chunk, wr])?,
            None => self.qp.post_send(&[wr])?,
        }
        self.signals.signaled_post();
        self.outstanding += 1;
        self.stats.transfers += 1;
        self.after_frame()
    }

    /// After a frame is written (polled strategy): answers the peer if it said it sleeps. The
    /// barrier orders the frame's stores before the read of the peer's word, as the peer orders
    /// its word before its last look at the ring ([`MsgPipe::prepare_sleep`]): one of the two
    /// sees the other. (That holds where a write lands when posted, as the software provider's
    /// into provider memory do; elsewhere the sleeper's bounded sleep is the backstop.) It is
    /// the asymmetric pair's cheap half ([`crate::os::producer_barrier`]): a full fence here
    /// waits until the frame's line has come over from the reader's cache, a cross-core round
    /// trip on every frame (decision 002: streams between threads about 8% faster without it,
    /// between processes no change measured).
    #[inline]
    pub(super) fn after_frame(&mut self) -> Result<()> {
        crate::os::producer_barrier();
        self.answer_peer_sleep()
    }

    /// Whether the next frame goes through the window onto the peer's ring: there is one, and
    /// nothing posted on the queue pair is in flight (a frame stored now could overtake it: a
    /// bulk chunk, say, that the frame announces).
    #[inline]
    pub(super) fn direct_now(&self) -> bool {
        self.ring_window.is_some() && self.outstanding == 0 && self.user_in_flight == 0
    }

    /// After a frame's store through the window: counts it and does what follows every frame
    /// ([`MsgPipe::after_frame`]). A refusal (the peer deregistered its ring, or its queue
    /// pair stopped answering) fails the pipe, as a failed write's completion would.
    #[inline]
    pub(super) fn frame_stored(&mut self, stored: std::result::Result<(), WcStatus>) -> Result<()> {
        if let Err(st) = stored {
            self.ring_tx.unreserve();
            return Err(self.fail(VerbsError::PeerUnreachable(format!("pipe frame write failed: {st:?}"))));
        }
        self.stats.transfers += 1;
        self.after_frame()
    }

    /// Maps the peer's ring for frames written with plain stores, if the provider can. A
    /// refusal only leaves frames posted: what the peer named is checked again by each write,
    /// whose failure then fails the pipe.
    pub(super) fn map_peer_ring(&mut self) -> Result<()> {
        let Some(peer) = &self.peer_ring else { return Ok(()) };
        let ring = self.ring_tx.max_chunk() * 4;
        self.ring_window = match self.qp.map_remote_write(peer.addr, ring, peer.rkey) {
            Ok(w) => w,
            Err(e) => {
                log::debug!("pipe: frames go as posted writes, the peer's ring does not map: {e}");
                None
            }
        };
        Ok(())
    }

    /// True if frames go into the peer's ring with plain stores while nothing posted is in
    /// flight (polled strategy, a provider that maps the peer's ring, and
    /// [`PipeOptions::posted_frames`] not set).
    pub fn direct_frames(&self) -> bool {
        self.ring_window.is_some()
    }

    /// If the peer said it sleeps waiting at a ring position we have written past, raises a
    /// completion for it (a zero-byte write-with-immediate), once per announcement.
    #[inline]
    pub(super) fn answer_peer_sleep(&mut self) -> Result<()> {
        let said = self.ack_mr.read_u64(ACK_SLEEP);
        if !self.sleep.answer(said, self.ring_tx.sent()) {
            return Ok(());
        }
        let (addr, rkey) = self.peer_acks.ok_or_else(|| VerbsError::Protocol("a wake-up before setup".into()))?;
        self.post_inline_counted(SendWr::write_with_imm(0, &[], addr, rkey, IMM_WAKE))?;
        self.stats.control += 1;
        Ok(())
    }

    /// Call before sleeping on [`MsgPipe::cq`]; `Ok(false)`: a message arrived meanwhile, do
    /// not sleep. Under the polled strategy messages raise no completion: this tells the peer
    /// we sleep (an RDMA write into its acknowledgement slots) and takes a last look at the
    /// ring; the peer then raises a completion for any frame we have not seen. A sleeper that
    /// skips it still wakes at the end of its sleep, but every message then costs a whole
    /// sleep. (What was already received before the call is not looked at: call it after a
    /// look that found nothing.)
    pub fn prepare_sleep(&mut self) -> Result<bool> {
        if let FlowStrategy::Polled { .. } = self.strategy {
            // Frames this call takes in count as arrivals, those of its first pass too: the
            // caller looked before calling and found nothing.
            let before = self.ring_rx.received();
            self.progress()?;
            if !self.coalescer.is_empty() {
                // Messages of ours wait for the send window (completions the peer releases by
                // taking an earlier wake-up): sleeping now could leave both ends asleep.
                return Ok(false);
            }
            let received = self.ring_rx.received();
            // An announcement at this position that the peer has not answered still stands:
            // not posted again (a sleeper woken by something else, again and again, would
            // otherwise post a write per sleep, faster than their completions come back).
            if self.sleep_standing != Some(received) {
                let (addr, rkey) = self.peer_acks.ok_or_else(|| VerbsError::Protocol("sleep before setup".into()))?;
                let word = self.sleep.announce(received);
                self.ack_mr.write(ACK_SLEEP_SRC, &word.to_ne_bytes());
                let sge = self.ack_mr.sge(ACK_SLEEP_SRC, 8);
                // Mostly unsignaled: a completion of our own would end the sleep it announces
                // (and, raised while the queue is still armed from the last sleep, the next one
                // too).
                if let Err(e) = self.post_inline_counted(SendWr::write(0, &[sge], addr + ACK_SLEEP as u64, rkey)) {
                    return Err(self.fail(e));
                }
                self.stats.control += 1;
                self.sleep_standing = Some(received);
            }
            // The expensive half of the pair whose cheap half follows every frame's store
            // (`after_frame`).
            crate::os::sleeper_barrier();
            self.progress()?;
            self.reap_wake = true;
            return Ok(self.ring_rx.received() == before);
        }
        Ok(true)
    }

    pub(super) fn post_staged(&mut self, b: PoolBuf) -> Result<()> {
        let sge = b.sge();
        let id = staged_wr_id(b.into_index(), self.signals.unsignaled() + 1);
        self.qp.post_send(&[SendWr::send(id, &[sge]).inline(sge.length <= 64)])?;
        self.signals.signaled_post();
        self.outstanding += 1;
        self.stats.transfers += 1;
        Ok(())
    }

    /// Sends what is coalesced (window: one segment; RDMA: one chunk if the ring has room).
    pub fn flush(&mut self) -> Result<()> {
        self.check_failed()?;
        match self.strategy {
            FlowStrategy::Rdma { .. } => self.flush_ring(),
            FlowStrategy::Polled { .. } => self.flush_frames(),
            FlowStrategy::Window { .. } => self.flush_window(),
            FlowStrategy::Credit { .. } => Ok(()),
        }
    }

    pub(super) fn flush_window(&mut self) -> Result<()> {
        if self.coalescer.is_empty() || self.outstanding >= self.strategy.send_slots() {
            return Ok(());
        }
        let Some(mut b) = self.send_pool.try_acquire() else { return Ok(()) };
        b.push(self.coalescer.bytes());
        self.coalescer.clear();
        self.post_staged(b)
    }

    pub(super) fn flush_ring(&mut self) -> Result<()> {
        if self.coalescer.is_empty() || self.outstanding >= self.strategy.send_slots() {
            return Ok(());
        }
        let len = self.coalescer.len() as u64;
        let Some(place) = self.ring_tx.reserve(len) else {
            return Ok(()); // no ring space until the peer acknowledges
        };
        let peer = self.peer_ring.as_ref().expect("set up");
        let (addr, rkey) = (peer.addr + place.offset, peer.rkey);
        let Some(mut b) = self.send_pool.try_acquire() else {
            // A shared pool ran dry: give the ring space back and retry at the next progress.
            self.ring_tx.unreserve();
            return Ok(());
        };
        b.push(self.coalescer.bytes());
        self.coalescer.clear();
        let imm = len as u32 | if place.wrapped { 1 << 31 } else { 0 };
        let sge = b.sge();
        let id = staged_wr_id(b.into_index(), self.signals.unsignaled() + 1);
        self.qp.post_send(&[SendWr::write_with_imm(id, &[sge], addr, rkey, imm)])?;
        self.signals.signaled_post();
        self.outstanding += 1;
        self.stats.transfers += 1;
        Ok(())
    }

    /// Sends, driving progress until flow control admits the message or `timeout` passes.
    /// Admitted may mean staged behind a full send window: keep driving the pipe until
    /// [`MsgPipe::staged`] is 0 before going idle.
    pub fn send(&mut self, msg: &[u8], timeout: Duration) -> Result<()> {
        let mut backoff = Backoff::new(Spin::For(Duration::MAX));
        loop {
            if self.try_send(msg)? {
                return Ok(());
            }
            self.progress()?;
            pause(&mut backoff, timeout)?;
        }
    }
}
