//! The bulk lane: large data RDMA-written in chunks into the peer's bulk ring, in order with
//! the messages.

use super::*;

impl MsgPipe {
    pub(super) fn on_bulk_chunk(&mut self, imm: u32) -> Result<()> {
        self.on_bulk_chunk_at((imm & IMM_LEN) as u64, imm & IMM_WRAPPED != 0, 0)
    }

    /// A bulk chunk of `len` bytes arrived in the bulk ring; once read, it also releases the
    /// polled frame that announced it (`frame_end`, 0 if none).
    pub(super) fn on_bulk_chunk_at(&mut self, len: u64, wrapped: bool, frame_end: u64) -> Result<()> {
        let ring = self
            .bulk_ring
            .as_ref()
            .ok_or_else(|| VerbsError::Protocol("bulk chunk on a pipe without a bulk ring".into()))?;
        let before = self.bulk_rx.received();
        let off = self.bulk_rx.on_chunk(len, wrapped).map_err(fc_err)?;
        if len == 0 || off + len > ring.len() as u64 {
            return Err(VerbsError::Protocol(format!("bulk chunk of {len} bytes at {off} outside the ring")));
        }
        self.stats.buffer_bytes += self.bulk_rx.received() - before;
        let end_pos = self.bulk_rx.received();
        self.msgs.push_back((off as usize, len as usize));
        let store = ChunkStore::Ring { base: ring.as_ptr(), end_pos, lane: Lane::Bulk, frame_end };
        self.inbox.push_back(Chunk { store, left: 1 });
        Ok(())
    }

    /// Whether bulk chunks from now on carry the [`SendFlags::streaming`] hint (the software
    /// provider then writes them into the peer's ring with non-temporal stores), and bulk
    /// copies ([`MsgPipe::try_send_bulk_copy`] and the framed ones) store with them. Which is
    /// faster depends on whether the two CPUs share a cache, so callers measure: see
    /// [`crate::datapath::AdaptiveCrossover`].
    pub fn set_bulk_streaming(&mut self, on: bool) {
        self.bulk_streaming = on;
    }

    /// Largest chunk [`MsgPipe::try_send_bulk`] takes (a quarter of the peer's bulk ring); 0 if
    /// the peer has no bulk ring.
    pub fn bulk_chunk_max(&self) -> usize {
        if self.peer_bulk.is_some() {
            self.bulk_tx.max_chunk() as usize
        } else {
            0
        }
    }

    /// Offers one bulk chunk: `data` (registered memory of this pipe's protection domain, at
    /// most [`MsgPipe::bulk_chunk_max`] bytes) is RDMA-written into the peer's bulk ring and
    /// delivered in order with the messages, as [`Lane::Bulk`]. `Ok(None)` if the ring has no
    /// room now (call [`MsgPipe::progress`] and retry). `Ok(Some(token))`: `data` must stay
    /// untouched until [`MsgPipe::take_user_completion`] reports the token.
    pub fn try_send_bulk(&mut self, data: Sge) -> Result<Option<u64>> {
        self.try_send_bulk_framed(&[], data, &[])
    }

    /// Most bytes [`MsgPipe::try_send_bulk_framed`] carries around a chunk's data.
    pub fn bulk_frame_max(&self) -> usize {
        self.send_pool.buf_size()
    }

    /// A bulk chunk of `head`, then `data`, then `tail`, written as one: the framing bytes
    /// (copied before this returns, at most [`MsgPipe::bulk_frame_max`] together) let a layer
    /// above send its own records with the data, so a transfer needs no message next to its
    /// chunk. (A message ahead of a chunk holds the chunk back on transports that place a
    /// send's data only when the target takes it, as the software provider does: an RDMA
    /// write never overtakes an earlier send.) `data` may be empty when framing is not; the
    /// rest as [`MsgPipe::try_send_bulk`], `Ok(None)` also when no staging buffer is free.
    pub fn try_send_bulk_framed(&mut self, head: &[u8], data: Sge, tail: &[u8]) -> Result<Option<u64>> {
        self.check_failed()?;
        let max = self.bulk_chunk_max();
        let frame = head.len() + tail.len();
        let total = frame + data.length as usize;
        if total == 0 || total > max || frame > self.bulk_frame_max() {
            return Err(VerbsError::invalid(format!(
                "bulk chunk of {total} bytes, {frame} of them framing (1 to {max}, framing at most {}; \
                 0 means the peer has no bulk ring)",
                self.bulk_frame_max()
            )));
        }
        if !self.staged_flushed()? {
            return Ok(None);
        }
        let credit = matches!(self.strategy, FlowStrategy::Credit { .. });
        if credit && !self.credits.can_send_data() {
            self.stats.blocked += 1;
            return Ok(None);
        }
        let Some(place) = self.bulk_tx.reserve(total as u64) else {
            self.stats.blocked += 1;
            return Ok(None);
        };
        let mut sges: smallvec::SmallVec<[Sge; 3]> = smallvec::SmallVec::new();
        let mut staging = None;
        if frame > 0 {
            let Some(mut b) = self.send_pool.try_acquire() else {
                // Freed as earlier transfers complete.
                self.bulk_tx.unreserve();
                self.stats.blocked += 1;
                return Ok(None);
            };
            b.push(head);
            b.push(tail);
            let all = b.sge();
            if !head.is_empty() {
                sges.push(Sge { length: head.len() as u32, ..all });
            }
            if data.length > 0 {
                sges.push(data);
            }
            if !tail.is_empty() {
                sges.push(Sge { addr: all.addr + head.len() as u64, length: tail.len() as u32, lkey: all.lkey });
            }
            staging = Some(b.into_index());
        } else {
            sges.push(data);
        }
        let peer = self.peer_bulk.as_ref().expect("bulk_chunk_max checked");
        let polled = matches!(self.strategy, FlowStrategy::Polled { .. });
        let wr = if polled {
            // Announced by a frame written after it (`note_bulk_chunk`).
            SendWr::write(0, &sges, peer.addr + place.offset, peer.rkey)
        } else {
            let imm = bulk_imm(total as u32, place.wrapped);
            SendWr::write_with_imm(0, &sges, peer.addr + place.offset, peer.rkey, imm)
        };
        // The chunk's buffers are free once the provider wrote them out: the ring's flow
        // control says when the peer has read the chunk.
        let wr =
            SendWr { flags: SendFlags { streaming: self.bulk_streaming, inject_complete: true, ..wr.flags }, ..wr };
        let posted = if polled {
            // Posted with the frame that announces it (`note_bulk_chunk`), in one call.
            self.check_failed().map(|()| {
                let mut wr = wr;
                let token = self.tag_user(&mut wr);
                self.held_chunk = Some(wr);
                self.user_posted();
                token
            })
        } else {
            self.post_user(wr)
        };
        match posted {
            Ok(token) => {
                if credit {
                    self.credits.on_send_bare();
                }
                if polled {
                    let noted = self.note_bulk_chunk(total as u32, place.wrapped);
                    // Posted alone if its frame could not go now (no room in the ring).
                    let alone = self.post_held_chunk();
                    noted.and(alone)?;
                }
                if let Some(index) = staging {
                    self.bulk_staging.push((token, index));
                }
                self.stats.transfers += 1;
                Ok(Some(token))
            }
            Err(e) => {
                self.bulk_tx.unreserve();
                if let Some(index) = staging {
                    self.send_pool.release_index(index)?;
                }
                Err(e)
            }
        }
    }

    /// Whether [`MsgPipe::try_send_bulk_copy`] can store into the peer's bulk ring (the
    /// software provider between processes of one host; not across hosts or on a NIC).
    pub fn bulk_copies(&self) -> bool {
        self.bulk_window.is_some()
    }

    /// The largest bulk chunk the peer's ring has room for now (0 without a bulk lane).
    pub fn bulk_room(&self) -> usize {
        if self.peer_bulk.is_some() {
            self.bulk_tx.largest_chunk() as usize
        } else {
            0
        }
    }

    /// Copies the front of `data` into the peer's bulk ring (plain stores unless
    /// [`MsgPipe::set_bulk_streaming`] asked for streaming ones) and announces it
    /// as one bulk chunk (in order with the messages, as [`Lane::Bulk`]); returns how many
    /// bytes it took: as many as the ring has room for, at most [`MsgPipe::bulk_chunk_max`],
    /// 0 if none now (call [`MsgPipe::progress`] and retry). `data` is free again when this
    /// returns, as a socket's nonblocking write needs, at the cost of the stores on this CPU
    /// (the receiver copies out as from any chunk). Refused where [`MsgPipe::bulk_copies`] is
    /// false.
    pub fn try_send_bulk_copy(&mut self, data: &[u8]) -> Result<usize> {
        self.check_failed()?;
        if self.bulk_window.is_none() {
            return Err(VerbsError::invalid("bulk copies need the peer's bulk ring mapped (bulk_copies)"));
        }
        if data.is_empty() {
            return Ok(0);
        }
        let len = data.len().min(self.bulk_copy_room()?);
        if len == 0 {
            return Ok(0);
        }
        self.store_bulk_chunk(&[&data[..len]], len, false)?;
        Ok(len)
    }

    /// Copies `head`, `data` and `tail` into the peer's bulk ring as one bulk chunk, as
    /// [`MsgPipe::try_send_bulk_copy`] does, whole or not at all: `Ok(false)` if the ring has
    /// no room for all of it now. For a layer above that frames its records around the data
    /// ([`MsgPipe::try_send_bulk_framed`]'s chunk, without its registration, staging buffer,
    /// posted write and completion: what a small chunk's latency is made of).
    pub fn try_send_bulk_copy_framed(&mut self, head: &[u8], data: &[u8], tail: &[u8]) -> Result<bool> {
        Ok(self.try_send_bulk_copy_timed(head, data, tail, false)?.is_some())
    }

    /// [`MsgPipe::try_send_bulk_copy_framed`], returning how long the stores into the peer's
    /// ring took if `timed` (zero if not), or `None` if there was no room: what the stores
    /// chosen ([`MsgPipe::set_bulk_streaming`]) cost, without the pipe's own steps around them.
    pub fn try_send_bulk_copy_timed(
        &mut self,
        head: &[u8],
        data: &[u8],
        tail: &[u8],
        timed: bool,
    ) -> Result<Option<Duration>> {
        self.check_failed()?;
        let total = head.len() + data.len() + tail.len();
        if self.bulk_window.is_none() || total == 0 || total > self.bulk_chunk_max() {
            return Err(VerbsError::invalid(format!(
                "bulk copy of {total} bytes (1 to {}; needs the peer's bulk ring mapped: bulk_copies)",
                self.bulk_chunk_max()
            )));
        }
        if self.bulk_copy_room()? < total {
            return Ok(None);
        }
        self.store_bulk_chunk(&[head, data, tail], total, timed).map(Some)
    }

    /// The largest chunk a bulk copy may store now: 0 while staged messages are ahead of it,
    /// while its announcement could not go, or while the ring is full (counted as blocked).
    fn bulk_copy_room(&mut self) -> Result<usize> {
        if !self.staged_flushed()? {
            return Ok(0);
        }
        let polled = matches!(self.strategy, FlowStrategy::Polled { .. });
        let credit = matches!(self.strategy, FlowStrategy::Credit { .. });
        if !polled && self.outstanding >= self.strategy.send_slots() {
            if let Err(e) = self.poll_completions() {
                return Err(self.fail(e));
            }
        }
        let announceable = if polled {
            self.ring_tx.has_room_for_max() && (self.direct_now() || self.outstanding < self.strategy.send_slots())
        } else {
            self.outstanding < self.strategy.send_slots() && (!credit || self.credits.can_send_data())
        };
        let room = if announceable { self.bulk_tx.largest_chunk() as usize } else { 0 };
        if room == 0 {
            self.stats.blocked += 1;
        }
        Ok(room)
    }

    /// Stores `parts` (`len` bytes together, which [`MsgPipe::bulk_copy_room`] said fit) into
    /// the peer's bulk ring and announces them as one chunk.
    fn store_bulk_chunk(&mut self, parts: &[&[u8]], len: usize, timed: bool) -> Result<Duration> {
        let place = self.bulk_tx.reserve(len as u64).expect("bulk_copy_room said it fits");
        let window = self.bulk_window.as_ref().expect("bulk_copy_room implies the window");
        let started = timed.then(Instant::now);
        let stored = if self.bulk_streaming {
            window.write_streaming(place.offset as usize, parts)
        } else {
            window.write(place.offset as usize, parts)
        };
        let took = started.map_or(Duration::ZERO, |t| t.elapsed());
        if let Err(st) = stored {
            self.bulk_tx.unreserve();
            return Err(
                self.fail(VerbsError::PeerUnreachable(format!("bulk copy into the peer's ring failed: {st:?}")))
            );
        }
        if matches!(self.strategy, FlowStrategy::Polled { .. }) {
            self.note_bulk_chunk(len as u32, place.wrapped)?;
        } else {
            // A write with immediate of no bytes: the chunk's arrival, as a posted chunk's.
            let peer = self.peer_bulk.as_ref().expect("a window implies the peer's ring");
            let imm = bulk_imm(len as u32, place.wrapped);
            let wr = SendWr::write_with_imm(0, &[], peer.addr + place.offset, peer.rkey, imm);
            if let Err(e) = self.post_inline_counted(wr) {
                return Err(self.fail(e));
            }
            if matches!(self.strategy, FlowStrategy::Credit { .. }) {
                self.credits.on_send_bare();
            }
        }
        self.stats.transfers += 1;
        Ok(took)
    }

    /// Whether nothing staged is left ahead of a bulk chunk (flushing it if need be): the
    /// lanes share one order, so staged messages go first.
    fn staged_flushed(&mut self) -> Result<bool> {
        if !self.coalescer.is_empty() {
            self.flush()?;
        }
        Ok(self.coalescer.is_empty())
    }

    /// Announces a bulk chunk just written (polled strategy): a note alone in the next frame,
    /// written after the chunk's data, so that the receiver finds the data placed.
    pub(super) fn note_bulk_chunk(&mut self, len: u32, wrapped: bool) -> Result<()> {
        let ack = self.ring_rx.ack_due();
        let note = fc::BulkNote { len, wrapped }.encode();
        let rec = Record { kind: RecordKind::Bulk, credits: 0, len: note.len() as u32, ack };
        // The coalescer is empty (a bulk chunk waits until it is), so the note is taken.
        if !self.coalescer.push(rec, &note, usize::MAX) {
            return Err(VerbsError::Protocol("bulk note behind staged messages".into()));
        }
        self.ring_rx.acked_to(ack);
        self.coalescer.seal();
        self.flush_frames()
    }
}

/// The immediate that announces a bulk chunk of `len` bytes (strategies other than polled).
fn bulk_imm(len: u32, wrapped: bool) -> u32 {
    len | IMM_BULK | if wrapped { IMM_WRAPPED } else { 0 }
}
