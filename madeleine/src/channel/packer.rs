//! Building a message: `Packer` and its packs (inline, bulk lane, rendezvous, deferred),
//! `PendingSend`.

use super::*;

/// A pack queued behind a `SendMode::Later` pack (sent at `end_packing`, in order).
pub(super) enum Deferred<'p> {
    Borrowed(&'p [u8], Modes),
    Owned(Vec<u8>, Modes),
    /// A pack of [`Packer::pack_later`]: the application may still write it, through
    /// [`Packer::later_mut`] with this number, until `end_packing` reads it.
    Mutable(u32, &'p mut [u8], Modes),
}

impl Deferred<'_> {
    pub(super) fn is_later(&self) -> bool {
        match self {
            Deferred::Borrowed(_, m) | Deferred::Owned(_, m) => m.send == SendMode::Later,
            Deferred::Mutable(..) => true,
        }
    }
}

/// A pack made with [`Packer::pack_later`], to write through [`Packer::later_mut`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaterPack(u32);

/// A rendezvous the receiver has still to read: its registration (and, for a copied buffer,
/// the copy) must live until the receiver released it.
pub(super) struct Held<'p> {
    pub(super) id: u32,
    pub(super) _reg: Registration<'p>,
    pub(super) _copy: Option<Box<[u8]>>,
}

/// A message being packed. Buffers packed `Later` or `Cheaper` stay borrowed until
/// [`Packer::end_packing`].
pub struct Packer<'p> {
    pub(super) ch: &'p Channel,
    pub(super) conn: &'p Conn,
    /// The connection's sending side, held until the message is complete (with the state of
    /// the message being packed).
    pub(super) tx: Claim<'p, SendSide>,
    /// What `Later`, rendezvous and bulk packs need, allocated by the first of them: a
    /// message of small packs never touches it, and the packer stays small enough to move
    /// cheaply (it is returned by value on every message).
    pub(super) more: ColdDrop<Option<Box<PackerMore<'p>>>>,
    /// Zero-copy packs the receiver has still to read (outside `more`: a message of one
    /// rendezvous pack, the commonest large message, allocates nothing for it).
    pub(super) rdv: ColdDrop<Held1<'p>>,
    /// The message's first pack, its record header appended but not its bytes
    /// (`SendSide::gathers`): sent from here if the message is that pack alone, else joined
    /// to the message by the next step ([`Packer::join_held`]).
    pub(super) held: Option<&'p [u8]>,
}

impl std::fmt::Debug for Packer<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Packer").finish_non_exhaustive()
    }
}

/// A pack offered (`protocol::offer`): what a withdrawal sends instead.
pub(super) struct Offered<'p> {
    pub(super) id: u32,
    pub(super) buf: &'p [u8],
    pub(super) modes: Modes,
}

/// Rendezvous packs held until the receiver released them, one without allocating.
pub(super) type Held1<'p> = SmallVec<[Held<'p>; 1]>;

/// A packer's state for its rarer packs.
#[derive(Default)]
pub(super) struct PackerMore<'p> {
    pub(super) deferred: Vec<Deferred<'p>>,
    /// Bulk chunks of borrowed buffers still being written, and their registrations.
    pub(super) bulk_tokens: Vec<u64>,
    pub(super) bulk_regs: Vec<Registration<'p>>,
    /// A borrowed bulk pack not sent yet: the next pack, `flush` or `end_packing` sends it,
    /// `end_packing` with the message's `End` in its last chunk.
    pub(super) pending_bulk: Option<(&'p [u8], Modes)>,
    /// Bytes of the bulk packs above that the crossover times, and how long their hand-over
    /// took so far (the wait for their chunks is added when it is over).
    pub(super) timed: (usize, std::time::Duration),
    /// The message ends with `end_packing_nowait`: packs still to send go zero-copy rather
    /// than through the bulk lane, whose ring only the receiver's reads empty.
    pub(super) nowait: bool,
    /// `pack_later` packs so far (their numbers).
    pub(super) later: u32,
}

impl<'p> Packer<'p> {
    pub(super) fn more(&mut self) -> &mut PackerMore<'p> {
        self.more.get_or_insert_with(Box::default)
    }

    pub(super) fn has_deferred(&self) -> bool {
        self.more.as_ref().is_some_and(|m| !m.deferred.is_empty())
    }

    pub(super) fn has_rdv(&self) -> bool {
        !self.rdv.is_empty()
    }

    /// Adds `buf` to the message with the given modes.
    #[inline]
    pub fn pack(&mut self, buf: &'p [u8], send: SendMode, recv: RecvMode) -> Result<()> {
        let modes = Modes { send, recv };
        self.join_held();
        self.tx.packs += 1;
        if send != SendMode::Later && self.fits_now(buf.len()) {
            if self.tx.gathers(buf.len(), modes) {
                // Its bytes go from `buf` at the message's end, unless more packs follow.
                self.tx.append_inline_header(buf.len(), modes);
                self.held = Some(buf);
                return Ok(());
            }
            // The path of small packs: copied into the message being filled, nothing else.
            self.append_inline(buf, modes);
            return Ok(());
        }
        self.pack_other(buf, modes)
    }

    /// Appends the bytes of the pack held back by `pack` to the message being filled: any
    /// step other than ending a message of that pack alone needs them there.
    #[inline]
    pub(super) fn join_held(&mut self) {
        if let Some(held) = self.held.take() {
            self.tx.join(held);
        }
    }

    /// Packs what does not go whole into the message being filled now.
    #[inline(never)]
    pub(super) fn pack_other(&mut self, buf: &'p [u8], modes: Modes) -> Result<()> {
        let send = modes.send;
        // A borrowed pack larger than a pipe message waits for the message's end too: how the
        // message ends decides how it goes (`end_packing_nowait` must not leave it waiting for
        // room in the receiver's bulk ring), and it is the packer's until then anyway.
        let large = self.limits().too_large_for_a_message(buf.len());
        if send == SendMode::Later || large || self.has_deferred() {
            // Read at end_packing; what follows a Later pack waits behind it, in order.
            self.more().deferred.push(match send {
                SendMode::Safer => Deferred::Owned(buf.to_vec(), modes),
                _ => Deferred::Borrowed(buf, modes),
            });
            return Ok(());
        }
        self.emit_borrowed(buf, modes)
    }

    /// Packs `buf` with `SendMode::Later`, keeping it writable until the message ends: the
    /// packer holds the buffer's mutable borrow, and [`Packer::later_mut`] hands it back to
    /// write (a header's count filled in after the body was packed, say). What the buffer
    /// holds at `end_packing` is what the receiver gets, whichever way the pack travels
    /// (inline, bulk lane, zero-copy). (`pack(buf, SendMode::Later, ..)` takes a shared
    /// borrow instead: the buffer is read at `end_packing` too, but cannot change before.)
    pub fn pack_later(&mut self, buf: &'p mut [u8], recv: RecvMode) -> Result<LaterPack> {
        self.join_held();
        self.tx.packs += 1;
        let more = self.more();
        let id = more.later;
        more.later += 1;
        more.deferred.push(Deferred::Mutable(id, buf, Modes { send: SendMode::Later, recv }));
        Ok(LaterPack(id))
    }

    /// The buffer of a pack made with [`Packer::pack_later`] on this packer, to write until
    /// `end_packing` (`MadError::Invalid` for a pack of another packer).
    pub fn later_mut(&mut self, pack: LaterPack) -> Result<&mut [u8]> {
        let found = self.more.as_mut().and_then(|m| {
            m.deferred.iter_mut().find_map(|d| match d {
                Deferred::Mutable(id, b, _) if *id == pack.0 => Some(&mut **b),
                _ => None,
            })
        });
        found.ok_or_else(|| MadError::Invalid(format!("{pack:?} is not a pack of this message")))
    }

    /// Packs a copy of `buf` (`SendMode::Safer`): `buf` is free as soon as this returns, so it
    /// need not outlive the packer.
    pub fn pack_safer(&mut self, buf: &[u8], recv: RecvMode) -> Result<()> {
        let modes = Modes { send: SendMode::Safer, recv };
        self.join_held();
        self.tx.packs += 1;
        if self.fits_now(buf.len()) {
            self.append_inline(buf, modes);
            return Ok(());
        }
        if self.has_deferred() {
            self.more().deferred.push(Deferred::Owned(buf.to_vec(), modes));
            return Ok(());
        }
        self.emit(buf, modes)
    }

    /// Sends a pack whose buffer lives as long as the packer (`Later`/`Cheaper` packs may be
    /// read until `end_packing`).
    pub(super) fn emit_borrowed(&mut self, buf: &'p [u8], modes: Modes) -> Result<()> {
        self.send_pending(false)?;
        let route = match self.route(buf.len()) {
            Route::Bulk if self.more.as_ref().is_some_and(|m| m.nowait) => Route::Rendezvous,
            route => route,
        };
        if modes.send != SendMode::Safer && route == Route::Bulk {
            // Held back by one pack: if it is the last, the message's End rides in its chunk.
            self.more().pending_bulk = Some((buf, modes));
            return Ok(());
        }
        self.emit_by(buf, modes, route)
    }

    /// Sends the pending bulk pack, if any (`end`: as the message's last, with its `End`).
    pub(super) fn send_pending(&mut self, end: bool) -> Result<()> {
        let Some((buf, modes)) = self.more.as_mut().and_then(|m| m.pending_bulk.take()) else { return Ok(()) };
        // SAFETY: `buf` is borrowed for 'p, the packer's life; `finish` waits until every
        // chunk written from it completed before the registration is dropped.
        let (reg, tokens, took) = unsafe { self.send_bulk(buf, modes, end) }?;
        let more = self.more();
        more.bulk_tokens.extend(tokens);
        more.bulk_regs.extend(reg);
        if !took.is_zero() {
            more.timed.0 += buf.len();
            more.timed.1 += took;
        }
        Ok(())
    }

    /// Sends a pack whose buffer may be reused as soon as this returns.
    pub(super) fn emit(&mut self, buf: &[u8], modes: Modes) -> Result<()> {
        self.send_pending(false)?;
        let route = self.route(buf.len());
        self.emit_by(buf, modes, route)
    }

    pub(super) fn emit_by(&mut self, buf: &[u8], modes: Modes, route: Route) -> Result<()> {
        match route {
            Route::Rendezvous => self.rendezvous(buf, modes),
            Route::Bulk => {
                // SAFETY: `buf` outlives this call, which waits for its chunks before returning
                // and dropping the registration.
                let (_reg, mut tokens, took) = unsafe { self.send_bulk(buf, modes, false) }?;
                let waiting = (!took.is_zero()).then(std::time::Instant::now);
                self.conn.wait_tokens(&mut tokens, self.ch.res.patience())?;
                if let Some(t) = waiting {
                    self.timed_copy(buf.len(), took + t.elapsed());
                }
                Ok(())
            }
            Route::Inline => self.inline(buf, modes),
        }
    }

    /// How a pack of `len` bytes travels (see `SendSide::route`).
    pub(super) fn route(&mut self, len: usize) -> Route {
        self.tx.mid_packs |= self.conn.frame_while_caught_up(len);
        let limits = self.limits();
        self.tx.route(len, &limits, std::time::Instant::now)
    }

    /// The limits of the message being packed.
    #[inline]
    pub(super) fn limits(&self) -> Limits {
        self.conn.limits(self.tx.behind)
    }

    /// Tells the crossover that handing `bytes` of bulk packs over took `took`: from their
    /// first chunk's copy until their last chunk completed (a chunk the provider could not
    /// write at once is written later, while the packer waits for it, and that time is part
    /// of what copying costs).
    pub(super) fn timed_copy(&mut self, bytes: usize, took: std::time::Duration) {
        self.tx.crossover.on_copy(bytes, took, std::time::Instant::now());
    }

    /// Writes `buf` as a bulk pack: its `Bulk` record, with the records packed before it,
    /// leads its first chunk, and with `end` the message's `End` closes its last, so a message
    /// of bulk packs travels as bulk chunks alone (no pipe message that the next message's
    /// chunks would have to wait behind). Returns its registration, the chunks' tokens and the
    /// time their hand-over took so far, for the crossover (zero for a pack it does not time).
    /// A pack the crossover does not time, to a peer whose ring this process maps (one host),
    /// is stored into the ring before this returns: no registration, no tokens (a posted
    /// write's registration lookup, staging buffer and completion cost more than an 8 KiB
    /// copy).
    ///
    /// # Safety
    /// `buf` must stay mapped and unchanged, and the registration alive, until every token
    /// completed.
    pub(super) unsafe fn send_bulk<'r>(
        &mut self,
        buf: &[u8],
        modes: Modes,
        end: bool,
    ) -> Result<(Option<Registration<'r>>, Vec<u64>, std::time::Duration)>
    where
        'p: 'r,
    {
        let reg: Option<Registration<'r>> = if self.conn.bulk_copies && buf.len() < AdaptiveCrossover::MIN_PACK {
            None
        } else {
            // SAFETY: the caller keeps `buf` mapped for as long as the registration lives.
            Some(unsafe { self.ch.res.regcache.get_raw(buf.as_ptr() as u64, buf.len() as u64, AccessFlags::NONE) }?)
        };
        if self.tx.agg.len() + 2 * wire::HEADER > self.conn.bulk_frame {
            self.flush_agg()?;
        }
        Record::Bulk { modes, total: buf.len() as u64 }.encode(&mut self.tx.agg);
        let mut tail = SmallVec::<[u8; wire::HEADER]>::new();
        if end {
            tail.extend_from_slice(&Record::End { packs: self.tx.packs }.header());
        }
        let large = buf.len() >= AdaptiveCrossover::MIN_PACK;
        // Large packs, and a sample of the smaller ones stored straight into the peer's ring,
        // are timed for their crossover.
        let timed =
            large || (reg.is_none() && buf.len() >= self.tx.small_crossover.min_pack() && self.tx.sample_small_pack());
        let head = std::mem::take(&mut self.tx.agg);
        let tokens = self.bulk_chunks(&head, buf, reg.as_ref(), &tail, timed);
        self.tx.agg = head;
        self.tx.agg.clear();
        self.tx.flushed = true;
        match tokens {
            Ok((tokens, took, reader)) if !large => {
                // Stored already: what the stores took, with what the reader's copies out
                // take, is the figure of the stores chosen.
                if !took.is_zero() {
                    self.tx.small_crossover.on_copy_read(buf.len(), took, reader, std::time::Instant::now());
                }
                Ok((reg, tokens, std::time::Duration::ZERO))
            }
            Ok((tokens, took, _)) => Ok((reg, tokens, took)),
            Err(e) => {
                // Chunks posted before the failure may still be read from `buf` (a timeout
                // leaves the pipe working): keep the registration for good rather than let its
                // memory go while a transfer might use it, as a dropped packer does.
                std::mem::forget(reg);
                Err(e)
            }
        }
    }

    /// Writes `head`, `buf` (registered as `reg`; stored by this process without one) and
    /// `tail` into the peer's bulk ring, chunk by chunk (`head` in the first, `tail` in the
    /// last), waiting for ring space (while draining what arrives, so two ends sending at once
    /// never block each other). Returns the chunks' tokens (`buf` is in use until they
    /// complete), and, if `timed`, the time the hand-over took for its crossover (zero
    /// otherwise) with the reader's latest copy-out report: for posted chunks the copies into
    /// the ring and the waits for room in it, so that while packs follow each other it is the
    /// pace at which the receiver drains the ring, which the stores chosen also change; for
    /// stored ones the stores alone (the reader's copies are counted from its reports).
    pub(super) fn bulk_chunks(
        &self,
        head: &[u8],
        buf: &[u8],
        reg: Option<&Registration<'_>>,
        tail: &[u8],
        timed: bool,
    ) -> Result<(Vec<u64>, std::time::Duration, u64)> {
        let max = self.conn.bulk_chunk;
        let crossover =
            if buf.len() >= AdaptiveCrossover::MIN_PACK { &self.tx.crossover } else { &self.tx.small_crossover };
        let streaming = crossover.stores() == Stores::Streaming;
        // Copies straight into the peer's ring are timed alone (their stores), posted chunks
        // from the first to the last.
        let started = (timed && reg.is_some()).then(std::time::Instant::now);
        let (mut stores_took, mut reader) = (std::time::Duration::ZERO, 0);
        let mut tokens = Vec::with_capacity(if reg.is_some() { buf.len().div_ceil(max) + 1 } else { 0 });
        let mut w = Waiter::new(self.ch.res.patience(), "waiting for room in the peer's bulk ring");
        let (mut off, mut head, mut tail_sent) = (0, head, false);
        while off < buf.len() || !tail_sent {
            let n = (max - head.len()).min(buf.len() - off);
            let last = off + n == buf.len();
            let tail_here = if last && head.len() + n + tail.len() <= max { tail } else { &[][..] };
            let piece = &buf[off..off + n];
            loop {
                {
                    let mut io = self.conn.io();
                    let sent = match reg {
                        Some(reg) => {
                            io.pipe.set_bulk_streaming(streaming);
                            let sge = Sge { addr: piece.as_ptr() as u64, length: n as u32, lkey: reg.lkey() };
                            io.pipe.try_send_bulk_framed(head, sge, tail_here).map(|t| t.map(|t| tokens.push(t)))
                        }
                        None => {
                            io.pipe.set_bulk_streaming(streaming);
                            reader = io.pipe.peer_copy_out();
                            let stored = io.pipe.try_send_bulk_copy_timed(head, piece, tail_here, timed);
                            stored.map(|took| took.map(|t| stores_took += t))
                        }
                    };
                    if sent.map_err(|e| self.conn.lost(e))?.is_some() {
                        break;
                    }
                    io.pipe.progress().map_err(|e| self.conn.lost(e))?;
                    let _ = self.conn.pump(&mut io);
                }
                w.pause()?;
            }
            off += n;
            head = &[];
            tail_sent = last && (tail.is_empty() || !tail_here.is_empty());
        }
        Ok((tokens, started.map_or(stores_took, |t| t.elapsed()), reader))
    }

    /// Whether a pack of `len` bytes goes inline, whole, into the message being filled, with
    /// nothing ahead of it (no deferred pack, no held-back bulk pack): the common case, which
    /// `pack` takes without the general path's steps.
    #[inline]
    pub(super) fn fits_now(&mut self, len: usize) -> bool {
        self.tx.mid_packs |= self.conn.frame_while_caught_up(len);
        self.more.as_ref().is_none_or(|m| m.deferred.is_empty() && m.pending_bulk.is_none())
            && self.tx.fits_whole(len, &self.limits())
    }

    /// Appends a whole inline pack to the message being filled (the caller checked it fits).
    #[inline]
    pub(super) fn append_inline(&mut self, buf: &[u8], modes: Modes) {
        self.tx.append_inline(buf, modes);
    }

    pub(super) fn inline(&mut self, buf: &[u8], modes: Modes) -> Result<()> {
        let limits = self.limits();
        if self.tx.fits_message(buf.len(), &limits) {
            // The usual case: the whole pack fits the pipe message being filled.
            self.append_inline(buf, modes);
            return Ok(());
        }
        let mut off = 0;
        loop {
            match self.tx.inline_step(buf.len() - off, &limits) {
                InlineStep::Flush => self.flush()?,
                InlineStep::Fragment { n, last } => {
                    self.tx.append_fragment(&buf[off..off + n], modes, last, buf.len() as u64);
                    off += n;
                    if last {
                        return Ok(());
                    }
                }
            }
        }
    }

    pub(super) fn rendezvous(&mut self, buf: &[u8], modes: Modes) -> Result<()> {
        let (addr, len, copy) = if modes.send == SendMode::Safer {
            let c: Box<[u8]> = buf.into();
            (c.as_ptr() as u64, c.len() as u64, Some(c))
        } else {
            (buf.as_ptr() as u64, buf.len() as u64, None)
        };
        // SAFETY: the memory is either `buf`, borrowed for 'p (the packer's life, and the
        // packer waits for the receiver's release before it ends), or the copy held next to the
        // registration for as long as the registration lives.
        let reg: Registration<'p> = unsafe { self.ch.res.regcache.get_raw(addr, len, AccessFlags::REMOTE_READ) }?;
        // (Relaxed: the peer's release of it comes only after our record went out; a waiter
        // reads the count with a fence before this counter.)
        let id = self.conn.next_rdv.fetch_add(1, Ordering::Relaxed);
        let rec = Record::Rdv { modes, len, addr, rkey: reg.rkey(), id, offer: false };
        if self.tx.needs_flush_for(&rec, &self.limits()) {
            self.flush()?;
        }
        rec.encode(&mut self.tx.agg);
        self.rdv.push(Held { id, _reg: reg, _copy: copy });
        Ok(())
    }

    /// Offers the message's last pack, if it is a bulk pack the connection's policy offers
    /// (`protocol::offer`): its record goes with the message instead of its bytes.
    pub(super) fn offer_last_pack(&mut self) -> Result<Option<Offered<'p>>> {
        let Some(&(buf, modes)) = self.more.as_ref().and_then(|m| m.pending_bulk.as_ref()) else { return Ok(None) };
        let received = self.conn.received.load(Ordering::Relaxed);
        if !self.conn.claims.can_offer() || !self.tx.offers.offers(buf.len(), received) {
            return Ok(None);
        }
        self.more().pending_bulk = None;
        // SAFETY: `buf` is borrowed for 'p, the packer's life, and the packer waits for the
        // receiver's release, or withdraws the offer, before it ends (`settle_offer`).
        let reg: Registration<'p> =
            unsafe { self.ch.res.regcache.get_raw(buf.as_ptr() as u64, buf.len() as u64, AccessFlags::REMOTE_READ) }?;
        let id = self.conn.next_rdv.fetch_add(1, Ordering::Relaxed);
        let rec =
            Record::Rdv { modes, len: buf.len() as u64, addr: buf.as_ptr() as u64, rkey: reg.rkey(), id, offer: true };
        if self.tx.needs_flush_for(&rec, &self.limits()) {
            self.flush()?;
        }
        rec.encode(&mut self.tx.agg);
        self.rdv.push(Held { id, _reg: reg, _copy: None });
        Ok(Some(Offered { id, buf, modes }))
    }

    /// Waits until the receiver claimed the offer, at most the session's offer patience; then
    /// withdraws it and copies the pack through the bulk lane if the receiver had not. A
    /// claimed offer is read: its release is waited for with the message's other rendezvous.
    pub(super) fn settle_offer(&mut self, o: Offered<'p>) -> Result<()> {
        let deadline = std::time::Instant::now() + self.ch.res.cfg.offer_patience;
        // Polls, yields to a receiver that shares our CPU (or, in a coroutine, to the
        // scheduler) as any wait does.
        let mut w = Waiter::new(self.ch.res.patience(), "offering a pack to its receiver");
        for polls in 1u32.. {
            self.conn.take_released(&mut self.rdv)?;
            if !self.rdv.iter().any(|h| h.id == o.id) {
                // Claimed, read and released.
                self.tx.offers.settled(o.id, Outcome::Claimed);
                self.conn.offers_claimed.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            // The clock now and then (a read costs as much as a poll here): the patience is
            // tens of microseconds, a poll a few tens of nanoseconds.
            if polls.is_multiple_of(8) && std::time::Instant::now() >= deadline {
                break;
            }
            w.pause()?;
        }
        let outcome = self.withdraw(o.id)?;
        self.tx.offers.settled(o.id, outcome);
        match outcome {
            Outcome::Claimed => {
                self.conn.offers_claimed.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Outcome::Withdrawn => {
                log::debug!("madeleine: rank {} did not claim offer {} in time: copied", self.conn.peer, o.id);
                self.conn.offers_withdrawn.fetch_add(1, Ordering::Relaxed);
                self.rdv.retain(|h| h.id != o.id);
                // SAFETY: `buf` outlives this call, which waits for its chunks before
                // returning and dropping the registration.
                let (_reg, mut tokens, _) = unsafe { self.send_bulk(o.buf, o.modes, false) }?;
                self.conn.wait_tokens(&mut tokens, self.ch.res.patience())
            }
        }
    }

    /// Swaps the peer's claim word to say that we withdrew offer `id`, unless the peer claimed
    /// it first: who won.
    pub(super) fn withdraw(&mut self, id: u32) -> Result<Outcome> {
        let last = self.tx.offers.last();
        let conn = self.conn;
        let wr = conn
            .claims
            .withdraw_request(id, last)
            .ok_or_else(|| MadError::Invalid("an offer to a peer without a claim word".into()))?;
        let posted = conn.io().pipe.post_user_completing(wr).map_err(|e| conn.lost(e))?;
        if let Some(token) = posted {
            conn.wait_user(token, self.ch.res.patience(), "withdrawing an offer", "withdrawing an offer")??;
        }
        conn.claims.withdraw_outcome(id, last).map_err(|b| MadError::Protocol { rank: conn.peer, why: b.0 })
    }

    /// Hands what was packed so far to the network without ending the message (packs are
    /// otherwise aggregated until a pipe message is full or `end_packing`).
    pub fn flush(&mut self) -> Result<()> {
        self.join_held();
        // Packs deferred only for their size go now; a `Later` pack, and what follows it,
        // waits for end_packing.
        while let Some(more) = self.more.as_mut() {
            let Some(&Deferred::Borrowed(b, m)) = more.deferred.first().filter(|d| !d.is_later()) else { break };
            more.deferred.remove(0);
            self.emit_borrowed(b, m)?;
        }
        self.send_pending(false)?;
        self.flush_agg()
    }

    /// Sends the aggregated records as one pipe message.
    pub(super) fn flush_agg(&mut self) -> Result<()> {
        if self.tx.agg.is_empty() {
            return Ok(());
        }
        self.tx.flushed = true;
        self.conn.send_msg(&self.tx.agg, self.ch.res.patience())?;
        self.tx.agg.clear();
        Ok(())
    }

    /// Completes the message: sends what was deferred, then waits until the receiver has read
    /// every zero-copy pack (after this the buffers are free). A last pack from 16 KiB below
    /// the rendezvous threshold that answers the peer may go as an offer: read by the
    /// receiver if it claims it within the session's `offer_patience`, else copied.
    #[inline]
    pub fn end_packing(mut self) -> Result<()> {
        self.finish()
    }

    /// Completes the message like [`Packer::end_packing`], but returns without waiting for
    /// the receiver to read the packs that went zero-copy: the returned [`PendingSend`] keeps
    /// their buffers borrowed until it completes ([`PendingSend::wait`], or dropping it).
    /// The connection is free for the next message at once, so a sender can keep several
    /// zero-copy messages in flight (as `MPI_Isend` does) instead of paying a round trip per
    /// message. It never waits for the receiver to receive: packs (`Cheaper` or `Later`) too
    /// large for a pipe message go zero-copy here, whatever the threshold (the bulk lane's
    /// ring would fill until the receiver read it), so ranks that each send before they
    /// receive never wait for each other. Small packs are copied before this returns, as by
    /// `end_packing`. (A `Safer` pack larger than a pipe message is copied through the bulk
    /// lane by `pack_safer` itself, which may wait for room there: use `Cheaper` for large
    /// packs of a nonblocking send.)
    pub fn end_packing_nowait(mut self) -> Result<PendingSend<'p>> {
        if let Some(more) = self.more.as_mut() {
            more.nowait = true;
        }
        self.finish_with(false)?;
        Ok(PendingSend { ch: self.ch, conn: self.conn, rdv: ColdDrop::new(self.rdv.take()) })
    }

    #[inline]
    pub(super) fn finish(&mut self) -> Result<()> {
        self.finish_with(true)
    }

    /// Completes the message; with `wait_reads`, also waits for the receiver to read its
    /// zero-copy packs.
    #[inline]
    pub(super) fn finish_with(&mut self, wait_reads: bool) -> Result<()> {
        if self.tx.finished {
            return Ok(());
        }
        self.tx.finished = true;
        if self.more.is_none() && self.rdv.is_empty() && self.tx.framing(false) == Framing::One {
            // The commonest message: one small pack, all here, nothing else to wait for.
            self.send_one()?;
            self.tx.message_sent(self.conn.received.load(Ordering::Relaxed));
            return Ok(());
        }
        self.finish_other(wait_reads)
    }

    /// Sends a message of one inline pack, whole: its bytes behind a `One` header written over
    /// the second half of its `Inline` header.
    #[inline]
    pub(super) fn send_one(&mut self) -> Result<()> {
        let patience = self.ch.res.patience();
        if let Some(held) = self.held.take() {
            // Straight from the application's buffer where the pipe can; else joined.
            if !self.conn.try_send_gathered(self.tx.one_message_head(held.len()), held)? {
                self.conn.send_msg(self.tx.one_message_joined(held), patience)?;
            }
            self.tx.agg.clear();
            return Ok(());
        }
        self.conn.send_msg(self.tx.one_message(), patience)?;
        self.tx.agg.clear();
        Ok(())
    }

    /// Completes any other message.
    #[inline(never)]
    pub(super) fn finish_other(&mut self, wait_reads: bool) -> Result<()> {
        if self.tx.framing(self.has_rdv()) != Framing::One {
            self.join_held();
        }
        let deferred = self.more.as_mut().map(|m| std::mem::take(&mut m.deferred)).unwrap_or_default();
        for d in deferred {
            match d {
                Deferred::Borrowed(b, m) => self.emit_borrowed(b, m)?,
                Deferred::Owned(v, m) => self.emit(&v, m)?,
                // Read from here on: the application's writes are over (the packer ends).
                Deferred::Mutable(_, b, m) => self.emit_borrowed(b, m)?,
            }
        }
        let offered = if wait_reads { self.offer_last_pack()? } else { None };
        if self.more.as_ref().is_some_and(|m| m.pending_bulk.is_some()) {
            // The last pack is bulk: the message ends in its last chunk.
            self.send_pending(true)?;
        } else {
            // Every record in one pipe message (a pack that did not fit whole would have
            // flushed): the message goes whole, whatever its size. The receiver then copies
            // its inline packs twice (out of the pipe, then into the unpacks' buffers), which
            // still costs less than taking its records one by one from the pipe: 0.1-0.3 us
            // less one way from 256 B to 4 KiB (stack_bench, window and rdma strategies). A
            // rendezvous travels whole too (its record is all there is to copy): the receiver
            // goes from one read to the next without two more trips to the pipe.
            match self.tx.framing(self.has_rdv()) {
                Framing::One => self.send_one()?,
                Framing::Whole => self.tx.close_whole(),
                Framing::End => {
                    if self.tx.end_needs_flush(&self.limits()) {
                        self.flush()?;
                    }
                    self.tx.append_end();
                }
            }
        }
        self.flush()?;
        let (mut tokens, timed) = self
            .more
            .as_mut()
            .map(|m| (std::mem::take(&mut m.bulk_tokens), std::mem::take(&mut m.timed)))
            .unwrap_or_default();
        if !tokens.is_empty() {
            let waiting = std::time::Instant::now();
            self.conn.wait_tokens(&mut tokens, self.ch.res.patience())?;
            if timed.0 > 0 {
                self.timed_copy(timed.0, timed.1 + waiting.elapsed());
            }
        }
        if let Some(more) = self.more.as_mut() {
            more.bulk_regs.clear();
        }
        if let Some(offered) = offered {
            self.settle_offer(offered)?;
        }
        if wait_reads && self.has_rdv() {
            let (conn, patience) = (self.conn, self.ch.res.patience());
            conn.wait_released(&mut self.rdv, patience)?;
        }
        self.tx.message_sent(self.conn.received.load(Ordering::Relaxed));
        Ok(())
    }
}

impl Conn {
    /// Drops from `rdv` the zero-copy packs the receiver has read (its release count covers
    /// them: one load). If some are left, takes what arrived out of the pipe: a failure or the
    /// peer's close shows there, and the peer's messages must keep flowing meanwhile.
    pub(super) fn take_released(&self, rdv: &mut Held1<'_>) -> Result<()> {
        let mut io = self.io();
        let mut take = |io: &mut ConnIo| match io.released(&self.next_rdv) {
            Ok(n) => {
                rdv.retain(|h| !is_released(n, h.id));
                Ok(rdv.is_empty())
            }
            Err(b) => Err(self.fail(io, b)),
        };
        if take(&mut io)? {
            return Ok(());
        }
        let pumped = self.pump(&mut io);
        // A receiver may read our packs, release them and close at once: its release counts
        // even when its Bye (or a failure) came right behind.
        if take(&mut io)? {
            return Ok(());
        }
        pumped
    }

    /// Waits until the receiver has read every zero-copy pack in `rdv`.
    pub(super) fn wait_released(&self, rdv: &mut Held1<'_>, p: &Patience) -> Result<()> {
        let mut w = Waiter::new(p, "waiting for the receiver to read zero-copy packs");
        loop {
            self.take_released(rdv)?;
            if rdv.is_empty() {
                return Ok(());
            }
            w.pause()?;
        }
    }
}

/// A message whose packing ended with [`Packer::end_packing_nowait`]: sent, but its zero-copy
/// packs may still be read by the receiver, so their buffers stay borrowed until it
/// completes. Dropping it waits as [`PendingSend::wait`] does (and logs a failure).
///
/// Leaking one (`std::mem::forget`) ends the borrow while the receiver may still read the
/// buffers: what it then gets is unspecified (as with a leaked [`Packer`]).
///
/// Several messages in flight from one buffer, the connection free in between:
/// ```no_run
/// # fn f(ch: &madeleine::Channel) -> madeleine::Result<()> {
/// use madeleine::{RecvMode, SendMode};
/// let buf = vec![7u8; 1 << 20];
/// let mut pending = std::collections::VecDeque::new();
/// for _ in 0..100 {
///     if pending.len() == 8 {
///         pending.pop_front().map_or(Ok(()), madeleine::PendingSend::wait)?;
///     }
///     let mut p = ch.begin_packing(1)?;
///     p.pack(&buf, SendMode::Cheaper, RecvMode::Cheaper)?;
///     pending.push_back(p.end_packing_nowait()?);
/// }
/// for sent in pending {
///     sent.wait()?;
/// }
/// # Ok(())
/// # }
/// ```
/// The buffer stays borrowed until the message completes:
/// ```compile_fail,E0502
/// # fn f(ch: &madeleine::Channel) -> madeleine::Result<()> {
/// use madeleine::{RecvMode, SendMode};
/// let mut buf = vec![7u8; 1 << 20];
/// let mut p = ch.begin_packing(1)?;
/// p.pack(&buf, SendMode::Cheaper, RecvMode::Cheaper)?;
/// let pending = p.end_packing_nowait()?;
/// buf[0] = 1; // the receiver may still be reading `buf`
/// pending.wait()
/// # }
/// ```
#[must_use = "dropping a pending send waits for the receiver's reads; wait() reports their outcome"]
pub struct PendingSend<'p> {
    pub(super) ch: &'p Channel,
    pub(super) conn: &'p Conn,
    /// The zero-copy packs not read yet, with their registrations (and copies).
    pub(super) rdv: ColdDrop<Held1<'p>>,
}

impl std::fmt::Debug for PendingSend<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingSend").finish_non_exhaustive()
    }
}

impl PendingSend<'_> {
    /// Whether the receiver has read every zero-copy pack of the message (after one pass over
    /// what arrived; it never waits). An error means it never will: the connection failed.
    pub fn is_complete(&mut self) -> Result<bool> {
        if !self.rdv.is_empty() {
            self.conn.take_released(&mut self.rdv).inspect_err(|_| self.abandon())?;
        }
        Ok(self.rdv.is_empty())
    }

    /// Waits until the receiver has read every zero-copy pack of the message (the session's
    /// timeout bounds the wait); the buffers are free once this returns.
    pub fn wait(mut self) -> Result<()> {
        self.wait_reads()
    }

    pub(super) fn wait_reads(&mut self) -> Result<()> {
        if self.rdv.is_empty() {
            return Ok(());
        }
        self.conn.wait_released(&mut self.rdv, self.ch.res.patience()).inspect_err(|_| self.abandon())
    }

    /// After a failure: keeps the registrations for good rather than let memory the receiver
    /// might still read go (as a dropped packer does).
    pub(super) fn abandon(&mut self) {
        std::mem::forget(self.rdv.take());
    }
}

impl Drop for PendingSend<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.wait_reads() {
            log::error!("madeleine: a dropped pending send to rank {} failed: {e}", self.conn.peer);
        }
    }
}

impl Drop for Packer<'_> {
    #[inline]
    fn drop(&mut self) {
        if !self.tx.finished {
            self.finish_dropped();
        }
    }
}

impl Packer<'_> {
    /// A message must not be left half-sent, nor a borrowed buffer released while the
    /// receiver may still read it.
    #[cold]
    pub(super) fn finish_dropped(&mut self) {
        if let Err(e) = self.finish() {
            log::error!("madeleine: completing a dropped message to rank {} failed: {e}", self.conn.peer);
            std::mem::forget(self.rdv.take());
            if let Some(more) = self.more.as_mut() {
                std::mem::forget(std::mem::take(&mut more.bulk_regs));
            }
        }
    }
}

/// What the record of a pack said, once checked.
pub(super) enum Got {
    /// An inline pack: its first fragment's bytes are copied; more follow unless `last`.
    Inline { copied: usize, last: bool },
    /// A rendezvous or bulk record.
    Other(Record),
}
