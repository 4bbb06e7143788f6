//! Taking a message apart: `Unpacker`, its checks against the packs as sent, zero-copy reads.

use super::*;

/// Why a whole message is malformed.
pub(super) const WHOLE_HOLDS: &str = "a whole message holds complete inline packs and rendezvous only";

/// Why waiting for zero-copy reads failed.
pub(super) struct ReadsFailed {
    pub(super) error: MadError,
    /// Every read completed (in error or not): none writes into its buffer any more.
    pub(super) settled: bool,
}

/// A rendezvous of the message that nobody read: its id, and its modes and length if it is
/// an offer.
pub(super) struct Unread {
    pub(super) id: u32,
    pub(super) offer: Option<(Modes, u64)>,
}

/// A zero-copy read in flight (RECEIVE_CHEAPER), kept until `end_unpacking`.
pub(super) struct PendingRead<'u> {
    pub(super) tokens: ReadTokens,
    pub(super) _reg: Registration<'u>,
}

/// The posted requests of one zero-copy read still to complete (none where the provider
/// carried it out at post; one but for reads over 1 GiB).
pub(super) type ReadTokens = SmallVec<[u64; 1]>;

/// Bytes of one read request: a rendezvous pack larger than this is read in several (an SGE
/// carries at most 2^31 bytes; smaller in tests, to reach the multi-request path).
pub(super) const READ_CHUNK: usize = if cfg!(test) { 4096 } else { 1 << 30 };

/// A message being unpacked. Buffers unpacked `RecvMode::Cheaper` stay borrowed until
/// [`Unpacker::end_unpacking`].
pub struct Unpacker<'u> {
    pub(super) ch: &'u Channel,
    pub(super) conn: &'u Conn,
    /// The connection's receiving side, held until the message is complete (with the state
    /// of the message being unpacked).
    pub(super) rx: Claim<'u, RecvSide>,
    /// Zero-copy reads still in flight (none on the software provider, whose reads complete
    /// at post).
    pub(super) pending: ColdDrop<Vec<PendingRead<'u>>>,
    /// The first mismatch found in the message, and the message's sequence number (reported
    /// to the sender by [`Unpacker::report`]).
    pub(super) note: Cell<Option<(Mismatch, u32)>>,
}

impl std::fmt::Debug for Unpacker<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Unpacker").finish_non_exhaustive()
    }
}

impl<'u> Unpacker<'u> {
    /// The sender's rank.
    pub fn source(&self) -> usize {
        self.conn.peer
    }

    /// The receiver's error for `m`, noted for the sender ([`Unpacker::report`]).
    pub(super) fn mismatch(&self, m: Mismatch) -> MadError {
        if self.note.get().is_none() {
            self.note.set(Some((m, self.rx.seq)));
        }
        MadError::Mismatch { rank: self.conn.peer, why: m.describe() }
    }

    /// Where an unpacker's error leaves the API: a mismatch is told to the sender (the
    /// message's sequence number and what differs, in the pipe's notice slot: out of band, so
    /// that it reaches the sender whatever it does next); a protocol error fails the
    /// connection.
    pub(super) fn report(&mut self, e: MadError) -> MadError {
        // The first mismatch of a message is the one the sender hears of.
        if let Some((m, seq)) = self.note.get().filter(|&(_, seq)| self.rx.told != Some(seq)) {
            let count = self.rx.notices.wrapping_add(1);
            (self.rx.notices, self.rx.told) = (count, Some(seq));
            let [w0, w1, w2] = m.words();
            let told = self.conn.io().pipe.notice_to([w0, w1, w2, (count as u64) << 32 | seq as u64]);
            if let Err(why) = told {
                log::debug!("madeleine: could not tell rank {} of a mismatch: {why}", self.conn.peer);
            }
        }
        self.conn.poison(e)
    }

    /// Waits for the next record of this message and hands it to `f` (`how` says whether the
    /// pipe may be drained past bulk data, which only `end_unpacking` skipping unread packs
    /// wants).
    pub(super) fn next_record_with<R>(&self, how: Pump, f: impl FnOnce(Next<'_>) -> R) -> Result<R> {
        let mut w = Waiter::new(self.ch.res.patience(), "waiting for message data");
        let mut f = f;
        loop {
            match self.conn.next_with(&mut self.conn.io(), how, f)? {
                Ok(r) => return Ok(r),
                Err(back) => f = back,
            }
            w.pause_on(&[self.conn])?;
        }
    }

    /// Takes the next pack's record, from the message's records if it came whole, else from
    /// the pipe (see [`Unpacker::take_pack`], [`Unpacker::take_whole_pack`]).
    #[inline]
    pub(super) fn take_next(&mut self, buf: &mut [u8], asked: Modes) -> Result<Got> {
        if self.rx.whole.is_some() {
            self.take_whole_pack(buf, asked)
        } else {
            self.take_pack(buf, asked)
        }
    }

    /// Takes the next pack's record, checking it against the unpack's modes and length; an
    /// inline pack's first fragment is copied into `buf` straight from the pipe. If the
    /// message's `End` is next and already here, takes it too (one trip to the connection
    /// fewer for `end_unpacking`).
    pub(super) fn take_pack(&mut self, buf: &mut [u8], asked: Modes) -> Result<Got> {
        if let Some(packs) = self.rx.end {
            return Err(self.mismatch(Mismatch::ExtraUnpack { packs }));
        }
        if buf.len() > self.conn.stream_max_msg {
            // A bulk pack whole in one chunk, with the message's End behind it: one step
            // instead of one per record and one for the data.
            let mut io = self.conn.io();
            match io.take_whole_bulk(buf, |sent| sent == asked) {
                Ok(Some(end)) => {
                    self.rx.end = end;
                    return Ok(Got::Inline { copied: buf.len(), last: true });
                }
                Ok(None) => {}
                Err(b) => return Err(self.conn.fail(&mut io, b)),
            }
        }
        let mut w = Waiter::new(self.ch.res.patience(), "waiting for message data");
        let this = &*self;
        let mut f = |n: Next<'_>| match n {
            Next::Rec(Record::Inline { modes, total, last, .. }, data) => {
                this.check(modes, total, asked, buf.len())?;
                // The decoder checked that a fragment is no longer than its pack.
                buf[..data.len()].copy_from_slice(data);
                Ok(Got::Inline { copied: data.len(), last })
            }
            // Checked once taken (its id counts even if the unpack does not match).
            Next::Rec(r @ Record::Rdv { .. }, _) => Ok(Got::Other(r)),
            Next::Rec(r @ Record::Bulk { modes, total }, _) => {
                this.check(modes, total, asked, buf.len())?;
                Ok(Got::Other(r))
            }
            // Taken: its count is the message's, and the unpacker's end must not look further.
            Next::Rec(Record::End { packs }, _) => Ok(Got::Other(Record::End { packs })),
            Next::Rec(r, _) => Err(this.unexpected(r)),
            Next::BulkData(_) => Err(this.bad("bulk data out of place")),
        };
        let conn = self.conn;
        loop {
            {
                let mut io = conn.io();
                match conn.next_with(&mut io, Pump::StopAtBulk, f)? {
                    Ok(got) => {
                        let got = got?;
                        if matches!(got, Got::Inline { last: true, .. } | Got::Other(Record::Rdv { .. })) {
                            self.rx.end = io.end_follows().map_err(|b| conn.fail(&mut io, b))?;
                        }
                        drop(io);
                        match got {
                            Got::Other(r @ Record::Rdv { .. }) => return self.take_rdv(r, asked, buf.len()),
                            Got::Other(r @ Record::End { packs }) => {
                                self.rx.end = Some(packs);
                                return Err(self.unexpected(r));
                            }
                            got => return Ok(got),
                        }
                    }
                    Err(back) => f = back,
                }
            }
            w.pause_on(&[conn])?;
        }
    }

    /// A rendezvous record taken for an unpack of `len` bytes: counts its id (it must be the
    /// one the sender issued next), then checks it against the unpack. A mismatch leaves the
    /// id counted, so the sender is released at `end_unpacking` as for any pack left unread
    /// and the connection goes on.
    pub(super) fn take_rdv(&mut self, r: Record, asked: Modes, len: usize) -> Result<Got> {
        let Record::Rdv { modes, len: sent_len, id, offer, .. } = r else { unreachable!("a rendezvous record") };
        self.note_rdv(id)?;
        if let Err(e) = self.check(modes, sent_len, asked, len) {
            if offer {
                self.settle_unread_offer(id, modes, sent_len)?;
            }
            return Err(e);
        }
        Ok(Got::Other(r))
    }

    /// Claims the sender's offer `id` before reading it (`protocol::offer`): `Withdrawn` if the
    /// sender took it back first (its bytes follow through the bulk lane).
    pub(super) fn claim(&mut self, id: u32) -> Result<Outcome> {
        if !self.conn.claims.takes_offers() {
            return Err(self.bad("an offer, though this end told the sender it takes none"));
        }
        let outcome = self.conn.claims.claim(id, self.rx.claim_word)?.map_err(|b| self.bad(&b.0))?;
        self.rx.claim_word = outcome.word(id);
        Ok(outcome)
    }

    /// Copies the bytes of a withdrawn offer into `buf` (the unpack it matched): the `Bulk`
    /// record the sender sent after its withdrawal, then its data.
    pub(super) fn take_withdrawn(&mut self, buf: &mut [u8], asked: Modes) -> Result<()> {
        self.take_withdrawn_record(asked, buf.len() as u64)?;
        self.read_bulk(buf)
    }

    /// Takes the `Bulk` record a withdrawal sends, which must be that of the offer (`modes`,
    /// `len`); its data comes next.
    pub(super) fn take_withdrawn_record(&self, modes: Modes, len: u64) -> Result<()> {
        self.next_record_with(Pump::StopAtBulk, |n| match n {
            Next::Rec(Record::Bulk { modes: m, total }, _) if m == modes && total == len => Ok(()),
            _ => Err(self.withdrawn_bytes_missing()),
        })?
    }

    #[cold]
    pub(super) fn withdrawn_bytes_missing(&self) -> MadError {
        self.bad("a withdrawn offer not followed by its bytes")
    }

    /// An offer nobody reads (an unpack that did not match it, or no unpack): claimed all the
    /// same, so that its sender, released with the message, does not withdraw it meanwhile;
    /// or, withdrawn already, its bytes taken out of the connection.
    pub(super) fn settle_unread_offer(&mut self, id: u32, modes: Modes, len: u64) -> Result<()> {
        if self.claim(id)? == Outcome::Claimed {
            return Ok(());
        }
        self.take_withdrawn_record(modes, len)?;
        // Its bytes, drained chunk by chunk (each at most what is left of them).
        let mut left = len;
        while left > 0 {
            left -= self.next_record_with(Pump::Drain, |n| match n {
                Next::BulkData(d) => Ok(d.len() as u64),
                _ => Err(self.withdrawn_bytes_missing()),
            })??;
        }
        Ok(())
    }

    /// Takes the next pack of a message that came whole: an inline pack is copied into `buf`
    /// (all of it), a rendezvous record is returned for its read.
    pub(super) fn take_whole_pack(&mut self, buf: &mut [u8], asked: Modes) -> Result<Got> {
        let mut w = self.rx.whole.expect("a whole message");
        let whole_pack = Got::Inline { copied: buf.len(), last: true };
        if let Some(sent) = w.single {
            if w.taken == 1 {
                return Err(self.mismatch(Mismatch::ExtraUnpack { packs: 1 }));
            }
            self.rx.whole = Some(WholeMsg { taken: 1, in_pipe: None, ..w });
            let len = w.single_len(self.rx.body.len());
            let checked = self.check(sent, len as u64, asked, buf.len());
            if w.in_pipe.is_some() {
                // Taken out of the pipe even if the unpack does not match it.
                self.take_left_one(checked.is_ok().then_some(&mut *buf))?;
            }
            checked?;
            if w.in_pipe.is_none() {
                copy_slice(buf, &self.rx.body);
            }
            return Ok(whole_pack);
        }
        if w.at == self.rx.body.len() {
            return Err(self.mismatch(Mismatch::ExtraUnpack { packs: w.packs }));
        }
        let decoded = wire::decode_one(&self.rx.body, w.at);
        if let Ok((_, _, next)) = decoded {
            // Taken even if the unpack does not match it (as a pack read from the pipe is).
            w.at = next;
            w.taken += 1;
            self.rx.whole = Some(w);
        }
        let (rec, data, _) = decoded.map_err(|e| self.bad(&e.to_string()))?;
        match rec {
            Record::Inline { modes, len, last: true, total } if len as u64 == total => {
                self.check(modes, total, asked, buf.len())?;
                copy_slice(buf, &self.rx.body[data]);
                Ok(whole_pack)
            }
            Record::Rdv { .. } => self.take_rdv(rec, asked, buf.len()),
            _ => Err(self.bad(WHOLE_HOLDS)),
        }
    }

    /// Takes the `One` record its message left at the head of the connection (copying it into
    /// `out` if given); a failure fails the connection.
    pub(super) fn take_left_one(&self, out: Option<&mut [u8]>) -> Result<()> {
        let mut io = self.conn.io();
        match io.take_left_one(out) {
            Ok(_) => Ok(()),
            Err(b) => Err(self.conn.fail(&mut io, b)),
        }
    }

    /// The pack count of a message that came whole, checked against its records; counts the
    /// packs nobody unpacked into `extra`, and the rendezvous among them into `unread`.
    pub(super) fn whole_end(&self, w: &WholeMsg, extra: &mut u32, unread: &mut Vec<Unread>) -> Result<u32> {
        if w.single.is_some() {
            *extra = 1 - w.taken;
            return Ok(1);
        }
        let mut at = w.at;
        let body = &self.rx.body;
        while at < body.len() {
            let (rec, _, next) = wire::decode_one(body, at).map_err(|e| self.bad(&e.to_string()))?;
            match rec {
                Record::Inline { last: true, len, total, .. } if len as u64 == total => {}
                Record::Rdv { id, offer, modes, len, .. } => {
                    unread.push(Unread { id, offer: offer.then_some((modes, len)) })
                }
                _ => return Err(self.bad(WHOLE_HOLDS)),
            }
            *extra += 1;
            at = next;
        }
        if w.taken.checked_add(*extra) != Some(w.packs) {
            return Err(self.bad("a whole message's pack count does not match its packs"));
        }
        Ok(w.packs)
    }

    /// Copies a bulk pack's bytes into `buf`: straight from the pipe's bulk lane, or from what
    /// a drain took out of it first.
    pub(super) fn read_bulk(&mut self, buf: &mut [u8]) -> Result<()> {
        let mut off = 0;
        let mut w = Waiter::new(self.ch.res.patience(), "waiting for bulk data");
        while off < buf.len() {
            let mut progressed = false;
            {
                let mut io = self.conn.io();
                if let Some(Incoming::BulkData(d)) = io.incoming.front() {
                    if d.len() > buf.len() - off {
                        return Err(self.bad("bulk data longer than its pack"));
                    }
                    copy_slice(&mut buf[off..off + d.len()], d);
                    off += d.len();
                    io.incoming.pop_front();
                    continue;
                }
                if !io.incoming.is_empty() || io.bulk_left == 0 {
                    return Err(self.bad("bulk data missing"));
                }
                if let Some(e) = &io.failed {
                    return Err(self.conn.lost(e));
                }
                let sample = io.times_next_copy_out();
                let mut copied = None;
                let ConnIo { pipe, bulk_left, .. } = &mut *io;
                let mut bad = false;
                let got = match pipe.front() {
                    Ok(Some((lane, m))) => {
                        // The pack's data; records may follow it in the same chunk.
                        let (n, len) = ((m.len() as u64).min(*bulk_left) as usize, m.len());
                        if lane != Lane::Bulk || n > buf.len() - off {
                            bad = true;
                            Ok(())
                        } else {
                            let timed = sample.then(std::time::Instant::now);
                            copy_slice(&mut buf[off..off + n], &m[..n]);
                            copied = Some((n, timed.map(|t| t.elapsed())));
                            off += n;
                            *bulk_left -= n as u64;
                            progressed = true;
                            if n == len {
                                pipe.pop_front()
                            } else {
                                pipe.consume_front(n)
                            }
                        }
                    }
                    Ok(None) => Ok(()),
                    Err(e) => Err(e),
                };
                match got {
                    Ok(_) if bad => {
                        let e = self.bad("bulk data out of place");
                        io.failed = Some(self.bad("bulk data out of place"));
                        return Err(e);
                    }
                    Ok(_) => {}
                    Err(e) => {
                        io.failed = Some(self.conn.lost(&e));
                        return Err(self.conn.lost(e));
                    }
                }
                if let Some((n, took)) = copied {
                    io.copied_out(n, took);
                }
            }
            if !progressed {
                w.pause_on(&[self.conn])?;
            }
        }
        Ok(())
    }

    pub(super) fn bad(&self, why: &str) -> MadError {
        MadError::Protocol { rank: self.conn.peer, why: why.into() }
    }

    /// Extracts the next pack into `buf`; with `RecvMode::Express` the data is there when this
    /// returns, with `RecvMode::Cheaper` after `end_unpacking`.
    #[inline]
    pub fn unpack(&mut self, buf: &'u mut [u8], send: SendMode, recv: RecvMode) -> Result<()> {
        let modes = Modes { send, recv };
        if let Some(done) = self.take_single(buf, modes) {
            return done;
        }
        self.unpack_into(buf, modes).map_err(|e| self.report(e))
    }

    /// The unpack of a message of one small pack that matches it (the commonest message):
    /// copies it out, or returns `None` for the general path (which also reports mismatches).
    #[inline]
    pub(super) fn take_single(&mut self, buf: &mut [u8], modes: Modes) -> Option<Result<()>> {
        let rx = &mut *self.rx;
        let w = match rx.whole {
            Some(w @ WholeMsg { single: Some(sent), taken: 0, .. })
                if sent == modes && w.single_len(rx.body.len()) == buf.len() =>
            {
                w
            }
            _ => return None,
        };
        rx.unpacks += 1;
        rx.whole = Some(WholeMsg { taken: 1, in_pipe: None, ..w });
        if w.in_pipe.is_none() {
            copy_slice(buf, &rx.body);
            return Some(Ok(()));
        }
        // Straight from the pipe.
        Some(self.take_left_one(Some(buf)).map_err(|e| self.report(e)))
    }

    /// Extracts the next pack (which must have been packed `RecvMode::Express`) into `buf`;
    /// `buf` need not outlive the unpacker.
    pub fn unpack_express(&mut self, buf: &mut [u8], send: SendMode) -> Result<()> {
        // SAFETY-free: an Express unpack completes before returning, so the borrow may end here.
        let modes = Modes { send, recv: RecvMode::Express };
        if let Some(done) = self.take_single(buf, modes) {
            return done;
        }
        self.unpack_now(buf, modes).map_err(|e| self.report(e))
    }

    pub(super) fn unpack_into(&mut self, buf: &'u mut [u8], modes: Modes) -> Result<()> {
        if modes.recv == RecvMode::Express {
            return self.unpack_now(buf, modes);
        }
        self.rx.unpacks += 1;
        match self.take_next(buf, modes)? {
            Got::Other(Record::Rdv { id, offer: true, .. }) if self.claim(id)? == Outcome::Withdrawn => {
                self.take_withdrawn(buf, modes)?;
                self.release_if_last()
            }
            Got::Other(Record::Rdv { addr, rkey, .. }) => {
                let (tokens, reg) = self.start_read(buf, addr, rkey)?;
                if !tokens.is_empty() {
                    self.pending.push(PendingRead { tokens, _reg: reg });
                    return Ok(());
                }
                // Done at post: the buffer's registration may go now.
                drop(reg);
                self.release_if_last()
            }
            got => self.complete_copy(buf, got),
        }
    }

    pub(super) fn unpack_now(&mut self, buf: &mut [u8], modes: Modes) -> Result<()> {
        self.rx.unpacks += 1;
        match self.take_next(buf, modes)? {
            Got::Other(Record::Rdv { id, offer: true, .. }) if self.claim(id)? == Outcome::Withdrawn => {
                self.take_withdrawn(buf, modes)?;
                self.release_if_last()
            }
            Got::Other(Record::Rdv { addr, rkey, .. }) => {
                let (tokens, reg) = self.start_read(buf, addr, rkey)?;
                if let Err(f) = self.wait_reads(&tokens) {
                    if !f.settled {
                        std::mem::forget(reg);
                    }
                    return Err(f.error);
                }
                drop(reg);
                self.release_if_last()
            }
            got => self.complete_copy(buf, got),
        }
    }

    /// Checks that rendezvous `id` is the one the sender issued next, and counts it.
    pub(super) fn note_rdv(&mut self, id: u32) -> Result<()> {
        self.rx.note_rdv(id).map_err(|e| self.bad(&format!("rendezvous {} where {} was due", e.got, e.due)))
    }

    /// After a read of the message's last pack, all reads done: releases the sender's
    /// zero-copy buffers now rather than at `end_unpacking` (a sender waiting for them, or
    /// streaming with a bounded number of pending sends, goes on that much sooner).
    pub(super) fn release_if_last(&mut self) -> Result<()> {
        if self.rx.read_last() && self.pending.is_empty() {
            self.release()?;
        }
        Ok(())
    }

    /// Tells the sender that every rendezvous of its we have seen was read (or will never be:
    /// packs nobody unpacked), so that it may reuse their buffers. Rendezvous come and are
    /// finished in the order the sender issued them (a message is unpacked whole before the
    /// next begins), so one count says it: written into the sender's slot, one store, where
    /// a `Fin` message per message cost both ends a pipe message (0.05-0.07 us of the
    /// receiver's 0.5 us between two 64 KiB reads, and the sender a frame to parse).
    pub(super) fn release(&mut self) -> Result<()> {
        let n = self.rx.rdv_next;
        if n == self.rx.rdv_released {
            return Ok(());
        }
        self.rx.rdv_released = n;
        self.conn.io().pipe.release_to(n as u64).map_err(|e| self.conn.lost(e))
    }

    /// Copies the rest of a pack that goes by copy (inline fragments or bulk data) into `buf`.
    pub(super) fn complete_copy(&mut self, buf: &mut [u8], got: Got) -> Result<()> {
        match got {
            Got::Inline { copied, last } => self.copy_fragments(buf, copied, last),
            Got::Other(_) => self.read_bulk(buf),
        }
    }

    #[inline]
    pub(super) fn check(&self, sent: Modes, sent_len: u64, asked: Modes, len: usize) -> Result<()> {
        self.rx.check(sent, sent_len, asked, len).map_err(|m| self.mismatch(m))
    }

    pub(super) fn unexpected(&self, r: Record) -> MadError {
        match r {
            Record::End { packs } => self.mismatch(Mismatch::ExtraUnpack { packs }),
            _ => MadError::Protocol { rank: self.conn.peer, why: "record out of place".into() },
        }
    }

    /// Copies an inline pack's further fragments into `buf` (the first `off` bytes are there).
    pub(super) fn copy_fragments(&mut self, buf: &mut [u8], mut off: usize, mut last: bool) -> Result<()> {
        while !last {
            let broken = || MadError::Protocol { rank: self.conn.peer, why: "broken fragment sequence".into() };
            last = self.next_record_with(Pump::StopAtBulk, |n| match n {
                Next::Rec(Record::Inline { last, total, .. }, data)
                    if total == buf.len() as u64 && off + data.len() <= buf.len() =>
                {
                    buf[off..off + data.len()].copy_from_slice(data);
                    off += data.len();
                    Ok(last)
                }
                _ => Err(broken()),
            })??;
        }
        if off != buf.len() {
            return Err(MadError::Protocol { rank: self.conn.peer, why: "fragments do not add up to the pack".into() });
        }
        Ok(())
    }

    /// Reads a rendezvous pack into `buf`: the requests still to complete, with the
    /// registration that must outlive them.
    pub(super) fn start_read<'b>(
        &self,
        buf: &'b mut [u8],
        addr: u64,
        rkey: u32,
    ) -> Result<(ReadTokens, Registration<'b>)>
    where
        'u: 'b,
    {
        if buf.is_empty() {
            return Err(MadError::Protocol { rank: self.conn.peer, why: "empty rendezvous".into() });
        }
        // SAFETY: `buf` is borrowed for 'b, which the registration does not outlive; the read
        // completes before the registration is dropped (waited for in `wait_read` or
        // `end_unpacking`).
        let reg =
            unsafe { self.ch.res.regcache.get_raw(buf.as_ptr() as u64, buf.len() as u64, AccessFlags::LOCAL_WRITE) }?;
        let mut tokens = ReadTokens::new();
        let mut io = self.conn.io();
        let mut remote = addr;
        for c in buf.chunks(READ_CHUNK) {
            let s = Sge { addr: c.as_ptr() as u64, length: c.len() as u32, lkey: reg.lkey() };
            match io.pipe.post_user_completing(SendWr::read(0, &[s], remote, rkey)) {
                Ok(t) => tokens.extend(t),
                Err(e) => {
                    drop(io);
                    // Requests posted before may still be writing into `buf`: the registration
                    // must outlive them (kept for good if they cannot be seen completing).
                    if let Err(ReadsFailed { settled: false, .. }) = self.wait_reads(&tokens) {
                        std::mem::forget(reg);
                    }
                    return Err(self.conn.lost(e));
                }
            }
            remote += s.length as u64;
        }
        Ok((tokens, reg))
    }

    /// Waits for every read behind `tokens`, even past a failed one: a read that has not
    /// completed may still write into its buffer, whose registration must outlive it. The
    /// first failure is returned once all completed, or at once if one cannot be seen
    /// completing (`settled: false`, after the timeout: keep the registration for good).
    pub(super) fn wait_reads(&self, tokens: &[u64]) -> std::result::Result<(), ReadsFailed> {
        let mut first = None;
        for &t in tokens {
            match self.wait_read(t) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => first = first.or(Some(e)),
                Err(e) => return Err(ReadsFailed { error: first.unwrap_or(e), settled: false }),
            }
        }
        first.map_or(Ok(()), |error| Err(ReadsFailed { error, settled: true }))
    }

    /// Waits until the read behind `token` completed (see [`Conn::wait_user`]).
    pub(super) fn wait_read(&self, token: u64) -> Result<Result<()>> {
        self.conn.wait_user(token, self.ch.res.patience(), "waiting for a zero-copy read", "zero-copy read")
    }

    /// Completes the message: waits for `RecvMode::Cheaper` data, checks that the sender packed
    /// exactly what was unpacked, and tells the sender its zero-copy buffers are free.
    #[inline]
    pub fn end_unpacking(mut self) -> Result<()> {
        if self.pending.is_empty() && self.rx.end_single() {
            // A message of one small pack, unpacked: nothing to wait for or check.
            self.conn.received.store(self.rx.seq, Ordering::Relaxed);
            return Ok(());
        }
        self.finish().map_err(|e| self.report(e))
    }

    pub(super) fn finish(&mut self) -> Result<()> {
        if self.rx.finished {
            return Ok(());
        }
        self.rx.finished = true;
        // Every read is waited for even past a failed one (each keeps its registration until
        // it completed); one not seen completing keeps it for good, and so do the reads after
        // it, not waited for (the pipe is stuck: each would wait out the timeout again).
        let mut result = Ok(());
        let mut pending = self.pending.take().into_iter();
        while let Some(p) = pending.next() {
            match self.wait_reads(&p.tokens) {
                Ok(()) => {}
                Err(ReadsFailed { error, settled: true }) => result = result.and(Err(error)),
                Err(ReadsFailed { error, settled: false }) => {
                    std::mem::forget(p);
                    pending.for_each(std::mem::forget);
                    result = result.and(Err(error));
                    break;
                }
            }
        }
        result?;
        // The End record, or what the sender packed beyond our unpacks.
        let mut extra = 0u32;
        let mut unread = Vec::new();
        if let Some(w @ WholeMsg { in_pipe: Some(_), .. }) = self.rx.whole {
            // A `One` message nobody unpacked: out of the pipe with it.
            self.rx.whole = Some(WholeMsg { in_pipe: None, ..w });
            self.take_left_one(None)?;
        }
        let packs = match (&self.rx.whole, self.rx.end) {
            (Some(w), _) => self.whole_end(w, &mut extra, &mut unread)?,
            (None, Some(packs)) => packs,
            (None, None) => self.find_end(&mut extra, &mut unread)?,
        };
        for Unread { id, offer } in unread {
            self.note_rdv(id)?;
            if let Some((modes, len)) = offer {
                self.settle_unread_offer(id, modes, len)?;
            }
        }
        self.release()?;
        let counted = self.rx.check_end(packs, extra).map_err(|m| self.mismatch(m));
        self.rx.next_message();
        self.conn.received.store(self.rx.seq, Ordering::Relaxed);
        counted
    }

    /// Reads up to the message's `End`, counting the packs nobody unpacked (`extra`) and the
    /// rendezvous among them (`unread`, whose senders must be released all the same).
    pub(super) fn find_end(&self, extra: &mut u32, unread: &mut Vec<Unread>) -> Result<u32> {
        loop {
            let step = self.next_record_with(Pump::Drain, |n| match n {
                Next::Rec(Record::End { packs }, _) => Ok(Some(packs)),
                Next::Rec(Record::Bulk { .. }, _) => {
                    *extra += 1;
                    Ok(None)
                }
                Next::BulkData(_) => Ok(None),
                Next::Rec(Record::Rdv { id, offer, modes, len, .. }, _) => {
                    *extra += 1;
                    // Release the sender even though nobody reads it.
                    unread.push(Unread { id, offer: offer.then_some((modes, len)) });
                    Ok(None)
                }
                Next::Rec(Record::Inline { last, .. }, _) => {
                    *extra += last as u32;
                    Ok(None)
                }
                Next::Rec(Record::Begin { .. } | Record::Whole { .. } | Record::One { .. } | Record::Bye, _) => Err(()),
            })?;
            match step {
                Ok(Some(n)) => return Ok(n),
                Ok(None) => {}
                Err(()) => return Err(MadError::Protocol { rank: self.conn.peer, why: "message without end".into() }),
            }
        }
    }
}

impl Drop for Unpacker<'_> {
    #[inline]
    fn drop(&mut self) {
        if !self.rx.finished {
            self.finish_dropped();
        }
    }
}

impl Unpacker<'_> {
    /// An unpack must not leave the sender's buffers held or the connection mid-message.
    #[cold]
    pub(super) fn finish_dropped(&mut self) {
        if let Err(e) = self.finish().map_err(|e| self.report(e)) {
            log::error!("madeleine: completing a dropped unpack from rank {} failed: {e}", self.conn.peer);
            std::mem::forget(self.pending.take());
        }
    }
}
