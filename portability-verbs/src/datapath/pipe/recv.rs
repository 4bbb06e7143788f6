//! Receiving: buffers and ring chunks taken in, polled frames found, and messages read in
//! place (`front`, `consume_front`, `pop_front`).

use super::*;

impl MsgPipe {
    /// Posts message buffer `index` (receive buffers live by index: always posted or holding
    /// received messages, never in the pool's free list).
    pub(super) fn post_data_recv(&mut self, index: u32) -> Result<()> {
        let pool = self.recv_pool.as_ref().ok_or_else(|| VerbsError::Protocol("no message buffers".into()))?;
        let sge = pool.sge_full_of(index)?;
        self.qp.post_recv(&[RecvWr::new(wr_id(TAG_DATA_RECV, index as u64), &[sge])])
    }

    /// Posts the receive buffers read since the last call, in one request list.
    pub(super) fn post_freed(&mut self) -> Result<()> {
        if self.freed.is_empty() {
            return Ok(());
        }
        let pool = self.recv_pool.as_ref().ok_or_else(|| VerbsError::Protocol("no message buffers".into()))?;
        let mut wrs: smallvec::SmallVec<[RecvWr; 8]> = smallvec::SmallVec::new();
        for &index in &self.freed {
            wrs.push(RecvWr::new(wr_id(TAG_DATA_RECV, index as u64), &[pool.sge_full_of(index)?]));
        }
        if let FlowStrategy::Credit { .. } = self.strategy {
            for _ in 0..self.freed.len() {
                self.credits.on_buffer_freed();
            }
        }
        self.freed.clear();
        self.qp.post_recv(&wrs)
    }

    pub(super) fn on_data_recv(&mut self, index: u32, len: usize) -> Result<()> {
        let pool = self.recv_pool.as_ref().ok_or_else(|| VerbsError::Protocol("data receive on a ring pipe".into()))?;
        let (base, buf_size) = (pool.sge_full_of(index)?.addr as *const u8, pool.buf_size());
        if len > buf_size {
            return Err(VerbsError::Protocol(format!("{len}-byte receive in a {buf_size}-byte buffer")));
        }
        // SAFETY: the receive completed, so the buffer is ours (no transfer targets it until it
        // is reposted) and `len` bytes of it lie inside it (checked above). Parsing keeps only
        // validated ranges, never re-reading a header.
        let bytes = unsafe { std::slice::from_raw_parts(base, len) };
        let credit = matches!(self.strategy, FlowStrategy::Credit { .. });
        let mut left = 0u32;
        let mut grant = None;
        for r in fc::records(bytes) {
            let (rec, range) = r.map_err(fc_err)?;
            if credit {
                // One message per buffer, each paid for with one credit.
                if grant.replace(rec.credits).is_some() {
                    return Err(fc_err(FcError::BadRecord("a credit-based buffer holds exactly one record")));
                }
            }
            match rec.kind {
                RecordKind::Data => {
                    self.msgs.push_back((range.start, range.len()));
                    left += 1;
                }
                RecordKind::Credit => {}
                RecordKind::Setup => return Err(VerbsError::Protocol("setup record after setup".into())),
                RecordKind::Bulk => return Err(VerbsError::Protocol("bulk note outside a polled frame".into())),
            }
        }
        if credit {
            let grant =
                grant.ok_or_else(|| fc_err(FcError::BadRecord("a credit-based buffer holds exactly one record")))?;
            self.credits.on_receive(grant).map_err(fc_err)?;
        }
        self.stats.buffer_bytes += buf_size as u64;
        if left == 0 {
            // A credit message: its buffer is free at once.
            self.repost(index)?;
        } else {
            self.inbox.push_back(Chunk { store: ChunkStore::Buf { index, base }, left });
        }
        Ok(())
    }

    pub(super) fn repost(&mut self, index: u32) -> Result<()> {
        if let FlowStrategy::Credit { .. } = self.strategy {
            self.credits.on_buffer_freed();
        }
        self.post_data_recv(index)
    }

    pub(super) fn on_ring_chunk(&mut self, imm: u32) -> Result<()> {
        let ring =
            self.ring.as_ref().ok_or_else(|| VerbsError::Protocol("ring chunk on a pipe without a ring".into()))?;
        if imm & IMM_BULK != 0 {
            return Err(VerbsError::Protocol("message-ring chunk flagged as bulk".into()));
        }
        let (len, wrapped) = ((imm & IMM_LEN) as u64, imm & IMM_WRAPPED != 0);
        let before = self.ring_rx.received();
        let off = self.ring_rx.on_chunk(len, wrapped).map_err(fc_err)?;
        if off + len > ring.len() as u64 {
            return Err(VerbsError::Protocol("ring chunk past the ring".into()));
        }
        // SAFETY: the ring accounting placed the chunk inside our ring (checked above), in
        // space the sender may not reuse until we acknowledge it. Parsing keeps only validated
        // ranges, never re-reading a header.
        let bytes = unsafe { std::slice::from_raw_parts(ring.as_ptr().add(off as usize) as *const u8, len as usize) };
        let mut left = 0u32;
        for r in fc::records(bytes) {
            let (rec, range) = r.map_err(fc_err)?;
            if rec.kind != RecordKind::Data {
                return Err(VerbsError::Protocol("non-data record in a ring chunk".into()));
            }
            if rec.ack != 0 {
                self.ring_tx.on_ack(rec.ack).map_err(fc_err)?;
            }
            self.msgs.push_back((off as usize + range.start, range.len()));
            left += 1;
        }
        self.stats.buffer_bytes += self.ring_rx.received() - before;
        let end_pos = self.ring_rx.received();
        if left == 0 {
            self.ring_rx.consume_to(end_pos);
        } else {
            let store = ChunkStore::Ring { base: ring.as_ptr(), end_pos, lane: Lane::Message, frame_end: 0 };
            self.inbox.push_back(Chunk { store, left });
        }
        Ok(())
    }

    /// Takes in the frames that arrived whole in our ring (polled strategy), at most `limit`;
    /// returns how many. (A reader asks for one: it reads that frame's messages before
    /// looking at the ring again.)
    #[inline]
    pub(super) fn poll_frames(&mut self, limit: usize) -> Result<usize> {
        let words = self.ring_words;
        if words.len == 0 {
            return Err(VerbsError::Protocol("polled pipe without a ring".into()));
        }
        for n in 0..limit {
            let before = self.ring_rx.received();
            let Some(frame) = fc::poll_frame(&mut self.ring_rx, &words).map_err(fc_err)? else { return Ok(n) };
            self.stats.buffer_bytes += self.ring_rx.received() - before;
            self.take_frame(words.base, frame)?;
        }
        Ok(limit)
    }

    /// Queues a frame's messages, or the bulk chunk it announces (alone in its frame).
    pub(super) fn take_frame(&mut self, base: *const u8, frame: fc::FrameAt) -> Result<()> {
        let at = frame.body_off as usize;
        // SAFETY: `poll_frame` found the frame whole inside our ring, in space the sender may
        // not reuse until we acknowledge it. Parsing keeps only validated ranges, never
        // re-reading a header.
        let body = unsafe { std::slice::from_raw_parts(base.add(at), frame.body_len) };
        if self.nothing_received() {
            if let Some(hdr) = body.first_chunk::<RECORD_HEADER>() {
                let rec = Record::decode(hdr).map_err(fc_err)?;
                if rec.kind == RecordKind::Data && RECORD_HEADER + rec.len as usize == body.len() {
                    if rec.ack != 0 {
                        self.ring_tx.on_ack(rec.ack).map_err(fc_err)?;
                    }
                    let (off, len) = (at + RECORD_HEADER, rec.len as usize);
                    self.lone = Some(LoneFrame { off, len, end_pos: frame.end_pos });
                    return Ok(());
                }
            }
        }
        let (mut left, mut bulk) = (0u32, None);
        for r in fc::records(body) {
            let (rec, range) = r.map_err(fc_err)?;
            if bulk.is_some() {
                return Err(VerbsError::Protocol("a record after a bulk note in one frame".into()));
            }
            if rec.ack != 0 {
                self.ring_tx.on_ack(rec.ack).map_err(fc_err)?;
            }
            match rec.kind {
                RecordKind::Data => {
                    self.msgs.push_back((at + range.start, range.len()));
                    left += 1;
                }
                RecordKind::Bulk if left == 0 => bulk = Some(fc::BulkNote::decode(&body[range]).map_err(fc_err)?),
                kind => return Err(VerbsError::Protocol(format!("{kind:?} record in a polled frame"))),
            }
        }
        match bulk {
            Some(note) => self.on_bulk_chunk_at(note.len as u64, note.wrapped, frame.end_pos),
            None if left > 0 => {
                let store = ChunkStore::Ring { base, end_pos: frame.end_pos, lane: Lane::Message, frame_end: 0 };
                self.inbox.push_back(Chunk { store, left });
                Ok(())
            }
            None => Err(VerbsError::Protocol("an empty polled frame".into())),
        }
    }

    /// Reads the next message in place: `f` sees its bytes. `Ok(None)` if none is there now.
    /// After a failure, messages received before it are still returned, then the error. (On a
    /// pipe whose peer sends bulk chunks, use [`MsgPipe::recv_lane`].)
    pub fn recv_with<R>(&mut self, f: impl FnOnce(&[u8]) -> R) -> Result<Option<R>> {
        self.recv_lane(|_, b| f(b))
    }

    /// Whether something is there to read or has begun arriving in a polled ring: a look
    /// of a few loads, without driving progress (what a reader that just took a message
    /// asks before it spends an empty [`MsgPipe::front`], whose look drives some of the
    /// pipe's other work). A message that arrives otherwise is found by `front` only.
    #[inline]
    pub fn arrived(&self) -> bool {
        !self.nothing_received() || self.frame_begun()
    }

    /// Polled strategy: whether the next frame has begun arriving in our ring (two loads at
    /// most; false for the other strategies).
    #[inline]
    fn frame_begun(&self) -> bool {
        matches!(self.strategy, FlowStrategy::Polled { .. }) && fc::frame_begun(&self.ring_rx, &self.ring_words)
    }

    /// Whether a received message or chunk is waiting (without driving progress), and by
    /// which lane.
    pub fn peek_lane(&self) -> Option<Lane> {
        if self.lone.is_some() {
            return Some(Lane::Message);
        }
        self.inbox.front().map(|c| match c.store {
            ChunkStore::Buf { .. } => Lane::Message,
            ChunkStore::Ring { lane, .. } => lane,
        })
    }

    /// Reads the next message or bulk chunk in place: `f` sees its lane and bytes.
    pub fn recv_lane<R>(&mut self, f: impl FnOnce(Lane, &[u8]) -> R) -> Result<Option<R>> {
        let Some((lane, bytes)) = self.front()? else { return Ok(None) };
        let r = f(lane, bytes);
        self.pop_front()?;
        Ok(Some(r))
    }

    /// The next message or bulk chunk and its lane, in place and left in the pipe (so a
    /// reader may take it apart across several calls; [`MsgPipe::pop_front`] releases it).
    /// Drives progress if nothing is there. `Ok(None)` if nothing arrived. After a failure,
    /// messages received before it are still returned, then the error.
    #[inline]
    pub fn front(&mut self) -> Result<Option<(Lane, &[u8])>> {
        // A polled ring is looked at even after a failure: frames the peer stored before it
        // are its last words (a Close before it left), readable like any earlier message.
        if self.nothing_received() && !self.polled_arrivals() && self.failed.is_none() && self.progress_due() {
            // A failure found now still leaves earlier messages readable, those in the ring
            // too (the pass may have found it before looking there).
            if let Err(e) = self.progress() {
                if self.nothing_received() && !self.polled_arrivals() {
                    return Err(e);
                }
            }
        }
        if let Some(lone) = self.lone {
            // SAFETY: the frame lies whole in our ring (`take_frame`), in space the sender may
            // not reuse until we acknowledge it, which happens only in `pop_front`.
            let bytes = unsafe { std::slice::from_raw_parts(self.ring_words.base.add(lone.off), lone.len) };
            return Ok(Some((Lane::Message, bytes)));
        }
        let (Some(chunk), Some(&(off, len))) = (self.inbox.front(), self.msgs.front()) else {
            self.check_failed()?;
            return Ok(None);
        };
        let (base, lane) = match &chunk.store {
            ChunkStore::Buf { base, .. } => (*base, Lane::Message),
            ChunkStore::Ring { base, lane, .. } => (*base, *lane),
        };
        // SAFETY: the bytes lie in a receive buffer we own until it is reposted, or in ring
        // space the sender may not reuse until we acknowledge it; both happen only in
        // `pop_front`, which needs the `&mut self` this borrow holds.
        Ok(Some((lane, unsafe { std::slice::from_raw_parts(base.add(off), len) })))
    }

    /// Polled strategy: whether frames arrived, looking at the ring alone (a full progress
    /// pass, with its completion-queue poll, is for when nothing did: off the path from a
    /// message's arrival to its reader). A bad frame fails the pipe; the frames before it
    /// stay readable, and the caller's progress reports the failure once they are read.
    #[inline]
    pub(super) fn polled_arrivals(&mut self) -> bool {
        if self.reap_wake || !self.frame_begun() {
            return false;
        }
        match self.poll_frames(1) {
            Ok(n) => n > 0,
            Err(e) => {
                let _ = self.fail(e);
                !self.nothing_received()
            }
        }
    }

    /// Whether a [`MsgPipe::front`] that found nothing drives a full progress pass. A polled
    /// pipe has looked at its ring already; the pass's other work (completions,
    /// acknowledgements, batched frames, the peer's sleep) is done on every
    /// [`PROGRESS_EVERY`]-th empty look, so that a reader spinning for a message finds it
    /// within a ring poll of its arrival rather than within a whole pass (about 500
    /// instructions against 100). The looks in between still take the peer's offer of a
    /// shared copy ([`QueuePair::help_peer`]): a zero-copy sender waits here for the reads of
    /// its buffers, and its receiver waited 0.1-0.5 us longer per 64 KiB read (230 ns to be
    /// helped on average, against 100) when only the passes took it.
    #[inline]
    pub(super) fn progress_due(&mut self) -> bool {
        if !matches!(self.strategy, FlowStrategy::Polled { .. }) || self.reap_wake {
            return true;
        }
        self.empty_fronts = self.empty_fronts.wrapping_add(1);
        if self.empty_fronts.is_multiple_of(PROGRESS_EVERY) {
            return true;
        }
        self.qp.help_peer();
        false
    }

    /// Marks the first `n` bytes of the message [`MsgPipe::front`] returned as read: `front`
    /// returns the rest from then on, and [`MsgPipe::pop_front`] still releases it (a stream
    /// reader takes a large message or bulk chunk in as many pieces as its reads ask for).
    pub fn consume_front(&mut self, n: usize) -> Result<()> {
        let front = match &mut self.lone {
            Some(lone) => Some((&mut lone.off, &mut lone.len)),
            None => self.msgs.front_mut().map(|(off, len)| (off, len)),
        };
        let Some((off, len)) = front else {
            return Err(VerbsError::invalid("consume_front with no message there"));
        };
        if n > *len {
            return Err(VerbsError::invalid(format!("consume_front of {n} bytes of a {len}-byte message")));
        }
        *off += n;
        *len -= n;
        self.stats.received_bytes += n as u64;
        Ok(())
    }

    /// Releases the message [`MsgPipe::front`] returned: once every message of its chunk is
    /// read, acknowledges its ring space, or hands its receive buffer back to the transport
    /// (at the next progress). Does nothing if nothing is there.
    #[inline]
    pub fn pop_front(&mut self) -> Result<()> {
        if let Some(lone) = self.lone.take() {
            self.stats.received += 1;
            self.stats.received_bytes += lone.len as u64;
            self.ring_rx.consume_to(lone.end_pos);
            if self.ring_rx.needs_ack() {
                // A reader that keeps finding frames may not pass through `progress`.
                self.ack_now(Lane::Message)?;
            }
            return Ok(());
        }
        // (`msgs` holds a range for every message left in `inbox`'s chunks.)
        let Some(chunk) = self.inbox.front_mut() else { return Ok(()) };
        let Some((_, len)) = self.msgs.pop_front() else { return Ok(()) };
        chunk.left -= 1;
        self.stats.received += 1;
        self.stats.received_bytes += len as u64;
        if chunk.left == 0 {
            let store = chunk.store;
            self.inbox.pop_front();
            match store {
                // Posted again by the next progress: off the path from a message's arrival to
                // its reader's reply.
                ChunkStore::Buf { index, .. } => self.freed.push(index),
                ChunkStore::Ring { end_pos, lane: Lane::Message, .. } => {
                    self.ring_rx.consume_to(end_pos);
                    if self.ring_rx.needs_ack() && matches!(self.strategy, FlowStrategy::Polled { .. }) {
                        // A reader that keeps finding frames may not pass through `progress`.
                        self.ack_now(Lane::Message)?;
                    }
                }
                ChunkStore::Ring { end_pos, lane: Lane::Bulk, frame_end, .. } => {
                    self.bulk_rx.consume_to(end_pos);
                    if frame_end != 0 {
                        self.ring_rx.consume_to(frame_end);
                        if self.ring_rx.needs_ack() && matches!(self.strategy, FlowStrategy::Polled { .. }) {
                            self.ack_now(Lane::Message)?;
                        }
                    }
                    if self.bulk_rx.needs_ack() {
                        // Nor through it a reader of chunks whose sender stores them itself
                        // (`try_send_bulk_copy`): that sender waits for no completion either.
                        self.ack_now(Lane::Bulk)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Whether nothing received waits to be read.
    #[inline]
    fn nothing_received(&self) -> bool {
        self.lone.is_none() && self.inbox.is_empty()
    }

    /// Acknowledges what was read of a ring now rather than at the next `progress`.
    #[cold]
    fn ack_now(&mut self, lane: Lane) -> Result<()> {
        self.write_ack(lane).map_err(|e| self.fail(e))
    }

    /// Receives the next message into a vector, waiting at most `timeout`.
    pub fn recv(&mut self, timeout: Duration) -> Result<Vec<u8>> {
        let mut backoff = Backoff::new(Spin::For(Duration::MAX));
        loop {
            if let Some(v) = self.recv_with(|b| b.to_vec())? {
                return Ok(v);
            }
            self.flush()?;
            pause(&mut backoff, timeout)?;
        }
    }
}
