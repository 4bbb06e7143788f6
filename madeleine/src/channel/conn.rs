//! A connection to one peer on one channel: its pipe and what was taken out of it, the
//! sending and receiving sides, and the records read in place.

use super::*;
use crate::protocol::released;
use crate::wait::Sleeper;

/// Inline bytes of a received record: small ones (the latency-critical case) without a heap
/// allocation.
pub(super) type InlineBytes = SmallVec<[u8; 64]>;

/// A record taken out of the pipe before its reader came (a pipe message may hold records of
/// several messages, and a sender draining the pipe to free the peer's window takes them all):
/// the slow path, one extra copy.
pub(super) enum Incoming {
    /// A record, with an inline fragment's bytes.
    Rec(Record, InlineBytes),
    /// Bulk-lane bytes taken out of the pipe before their unpacker came (so that the records
    /// behind them could be seen).
    BulkData(Vec<u8>),
}

/// The connection's next record as its reader sees it: in place in the pipe's receive buffer
/// (the fast path) or from the queue of records taken out before.
pub(super) enum Next<'a> {
    /// A record and its inline bytes (empty for records without).
    Rec(Record, &'a [u8]),
    /// Bulk-lane bytes (seen only when draining past them).
    BulkData(&'a [u8]),
}

impl Incoming {
    pub(super) fn view(&self) -> Next<'_> {
        match self {
            Incoming::Rec(r, d) => Next::Rec(*r, d),
            Incoming::BulkData(d) => Next::BulkData(d),
        }
    }

    pub(super) fn owned(n: Next<'_>) -> Incoming {
        match n {
            Next::Rec(r, d) => Incoming::Rec(r, InlineBytes::from_slice(d)),
            Next::BulkData(d) => Incoming::BulkData(d.to_vec()),
        }
    }
}

/// Why taking a record out of the pipe failed (recorded as the connection's failure).
pub(super) enum Broken {
    Protocol(String),
    Lost(String),
    /// The peer's `Bye`: it closed its end, everything it sent before was read.
    Closed,
}

pub(super) fn lost(e: portability_verbs::VerbsError) -> Broken {
    Broken::Lost(e.to_string())
}

/// Moves the read position of the pipe's front message to `next` (of `len` bytes), releasing
/// the message once every record of it was read.
pub(super) fn step_past(
    pipe: &mut MsgPipe,
    front_at: &mut usize,
    next: usize,
    len: usize,
) -> std::result::Result<(), Broken> {
    if next >= len {
        *front_at = 0;
        pipe.pop_front().map_err(lost)
    } else {
        *front_at = next;
        Ok(())
    }
}

/// Takes the first `n` bytes of the pipe's front bulk chunk (of `len` bytes), releasing it
/// once all are taken.
pub(super) fn take_from_front(pipe: &mut MsgPipe, n: usize, len: usize) -> std::result::Result<(), Broken> {
    if n >= len { pipe.pop_front() } else { pipe.consume_front(n) }.map_err(lost)
}

pub(super) struct ConnIo {
    pub(super) pipe: MsgPipe,
    /// Records taken out of the pipe before their reader came; they come before the pipe's.
    pub(super) incoming: VecDeque<Incoming>,
    /// Where the next record of the pipe's front message starts (records before it were
    /// read in place).
    pub(super) front_at: usize,
    /// How many of our rendezvous the peer said it read, as last looked at.
    pub(super) rdv_released: u32,
    pub(super) failed: Option<MadError>,
    /// The peer said `Bye` and everything before it was read: nothing more comes.
    pub(super) closed: bool,
    /// Bytes of an announced bulk pack still in the pipe's bulk lane.
    pub(super) bulk_left: u64,
    /// What our timed copies out of the bulk lane cost (one copy in
    /// [`crate::protocol::SMALL_PACK_SAMPLE`]), reported to the peer, whose stores into the
    /// lane they judge; the bytes at the last report; copies so far.
    pub(super) copy_out: CopyOut,
    pub(super) copy_out_reported: u64,
    pub(super) copies_out: u32,
}

/// Timed bytes of copies out of the bulk lane between two reports to the peer.
const COPY_OUT_REPORT: u64 = 64 * 1024;

/// `One` messages of at least this many bytes stay in the pipe until their unpack, which
/// copies them straight into the application's buffer: smaller ones are copied out at once,
/// a copy cheaper than taking the connection's lock again.
pub(super) const ONE_IN_PLACE_MIN: usize = 2048;

/// What [`ConnIo::take_one`] found at the head of the connection.
pub(super) enum OneMsg {
    /// A `One` message, taken: its sequence number and modes (its bytes were copied out).
    Taken(u32, Modes),
    /// A `One` message of this many bytes, left at the head of the connection for its unpack
    /// ([`ConnIo::take_left_one`]).
    Left(u32, Modes, usize),
    /// Nothing arrived.
    Nothing,
    /// Something else: the general path reads it.
    Other,
}

impl ConnIo {
    /// The path of the commonest message, one small pack (a `One` record, alone in its pipe
    /// message): if it opens the connection's next pipe message with nothing queued before it,
    /// copies its bytes into `body` and releases it, or, from [`ONE_IN_PLACE_MIN`] bytes on,
    /// leaves it there for its unpack. Anything else, a malformed `One` included, is left for
    /// the general path (which reports what is wrong with it).
    #[inline]
    pub(super) fn take_one(&mut self, body: &mut Vec<u8>) -> OneMsg {
        if !self.incoming.is_empty()
            || self.failed.is_some()
            || self.closed
            || self.bulk_left != 0
            || self.front_at != 0
        {
            return OneMsg::Other;
        }
        let (seq, modes, data) = match self.pipe.front() {
            Ok(Some((Lane::Message, m))) => match wire::decode_one_record(m) {
                Some(Ok((seq, modes))) => (seq, modes, &m[wire::ONE_HEADER..]),
                _ => return OneMsg::Other,
            },
            Ok(None) => return OneMsg::Nothing,
            _ => return OneMsg::Other,
        };
        if data.len() >= ONE_IN_PLACE_MIN {
            return OneMsg::Left(seq, modes, data.len());
        }
        body.clear();
        copy::extend_vec(body, data);
        // Releasing a message read in place cannot fail; were it to, the general path would
        // read the message again and report it.
        if self.pipe.pop_front().is_err() {
            return OneMsg::Other;
        }
        OneMsg::Taken(seq, modes)
    }

    /// Takes the `One` record [`ConnIo::take_one`] left at the head of the connection (in the
    /// pipe, or in the record queue if a sender drained the pipe since), copying its bytes into
    /// `out` if given (its length is the record's: the unpack checked). Returns the bytes'
    /// length. The connection failing or closing after the record arrived does not stop it:
    /// it was received before.
    pub(super) fn take_left_one(&mut self, mut out: Option<&mut [u8]>) -> std::result::Result<usize, Broken> {
        fn copy_out(out: Option<&mut [u8]>, data: &[u8]) -> Option<usize> {
            match out {
                Some(out) if out.len() != data.len() => return None,
                Some(out) => copy_slice(out, data),
                None => {}
            }
            Some(data.len())
        }
        if self.incoming.is_empty() && self.front_at == 0 && self.bulk_left == 0 {
            // Where `take_one` saw it.
            if let Ok(Some((Lane::Message, m))) = self.pipe.front() {
                if let Some(Ok(_)) = wire::decode_one_record(m) {
                    let taken = copy_out(out.as_deref_mut(), &m[wire::ONE_HEADER..]);
                    if let Some(len) = taken {
                        self.pipe.pop_front().map_err(lost)?;
                        return Ok(len);
                    }
                }
            }
        }
        let take = |n: Next<'_>| match n {
            Next::Rec(Record::One { .. }, data) => copy_out(out, data),
            _ => None,
        };
        let got = match self.incoming.pop_front() {
            Some(inc) => take(inc.view()),
            None => self.next_in_pipe(Pump::StopAtBulk, take)?.ok().flatten(),
        };
        got.ok_or_else(|| Broken::Protocol("the message begun is no longer at the head of its connection".into()))
    }

    /// Takes a bulk pack whole in one step where it can: the next record, in place, is the
    /// `Bulk` record of a pack of `out.len()` bytes whose data lies whole in the same chunk,
    /// and `fits(modes)` accepts it; its data is copied into `out`, and the message's `End`
    /// is taken too if it follows in the chunk (its pack count returned). `Ok(None)` (nothing
    /// taken) otherwise: the general path reads the pack record by record, and reports what
    /// is wrong with it.
    pub(super) fn take_whole_bulk(
        &mut self,
        out: &mut [u8],
        fits: impl FnOnce(Modes) -> bool,
    ) -> std::result::Result<Option<Option<u32>>, Broken> {
        if !self.incoming.is_empty() || self.bulk_left != 0 || self.failed.is_some() || self.closed {
            return Ok(None);
        }
        let sample = self.times_next_copy_out();
        let Ok(Some((Lane::Bulk, m))) = self.pipe.front() else { return Ok(None) };
        // (A `Bulk` record's data starts where the next record would.)
        let Ok((Record::Bulk { modes, total }, _, data)) = wire::decode_in_chunk(m, 0) else { return Ok(None) };
        if total != out.len() as u64 || data + out.len() > m.len() || !fits(modes) {
            return Ok(None);
        }
        let data_end = data + out.len();
        let timed = sample.then(std::time::Instant::now);
        copy_slice(out, &m[data..data_end]);
        let took = timed.map(|t| t.elapsed());
        let (end, taken) = match wire::decode_in_chunk(m, data_end) {
            Ok((Record::End { packs }, _, next)) => (Some(packs), next),
            _ => (None, data_end),
        };
        let len = m.len();
        take_from_front(&mut self.pipe, taken, len)?;
        self.copied_out(out.len(), took);
        Ok(Some(end))
    }

    /// Whether the next copy out of the bulk lane is one of those timed for
    /// [`ConnIo::copied_out`].
    #[inline]
    pub(super) fn times_next_copy_out(&self) -> bool {
        self.copies_out.is_multiple_of(crate::protocol::SMALL_PACK_SAMPLE)
    }

    /// Counts a copy of `bytes` out of the bulk lane, timed (`took`) one in
    /// [`crate::protocol::SMALL_PACK_SAMPLE`] (whether the next is: `copies_out`), and tells
    /// the peer what the timed ones cost every [`COPY_OUT_REPORT`] bytes of them. A report
    /// that cannot go fails the pipe, which the next call on it says; the bytes copied out
    /// were received all the same.
    pub(super) fn copied_out(&mut self, bytes: usize, took: Option<std::time::Duration>) {
        self.copies_out = self.copies_out.wrapping_add(1);
        let Some(took) = took else { return };
        self.copy_out.add(bytes, took);
        if self.copy_out.bytes - self.copy_out_reported >= COPY_OUT_REPORT {
            self.copy_out_reported = self.copy_out.bytes;
            if let Err(e) = self.pipe.report_copy_out(self.copy_out.word()) {
                log::debug!("madeleine: a copy-out report to the peer failed: {e}");
            }
        }
    }

    /// If the next record is the message's `End` and already here (queued, or next in the
    /// pipe message being read), takes it and returns its pack count. Never waits or polls.
    pub(super) fn end_follows(&mut self) -> std::result::Result<Option<u32>, Broken> {
        if let Some(Incoming::Rec(Record::End { packs }, _)) = self.incoming.front() {
            let packs = *packs;
            self.incoming.pop_front();
            return Ok(Some(packs));
        }
        if !self.incoming.is_empty() || self.bulk_left > 0 {
            return Ok(None);
        }
        if self.pipe.peek_lane() == Some(Lane::Bulk) {
            // Records after a pack's data in its last chunk.
            let Ok(Some((_, m))) = self.pipe.front() else { return Ok(None) };
            let (rec, _, next) = wire::decode_in_chunk(m, 0).map_err(|e| Broken::Protocol(e.to_string()))?;
            let Record::End { packs } = rec else { return Ok(None) };
            let len = m.len();
            take_from_front(&mut self.pipe, next, len)?;
            return Ok(Some(packs));
        }
        if self.front_at == 0 {
            return Ok(None);
        }
        // Mid-message, so the pipe's front is that message (no progress is driven); a broken
        // pipe is left for the next read to report.
        let Ok(Some((Lane::Message, m))) = self.pipe.front() else { return Ok(None) };
        let (rec, _, next) = wire::decode_one(m, self.front_at).map_err(|e| Broken::Protocol(e.to_string()))?;
        let Record::End { packs } = rec else { return Ok(None) };
        let len = m.len();
        step_past(&mut self.pipe, &mut self.front_at, next, len)?;
        Ok(Some(packs))
    }

    /// The peer's release count, read and checked (see [`released`]) against `issued`, the
    /// connection's count of rendezvous its packers took.
    pub(super) fn released(&mut self, issued: &AtomicU32) -> std::result::Result<u32, Broken> {
        let now = self.pipe.peer_released() as u32;
        // The issued count is read after the release that may count our latest rendezvous.
        std::sync::atomic::fence(Ordering::Acquire);
        self.rdv_released =
            released(self.rdv_released, now, issued.load(Ordering::Acquire)).map_err(|e| Broken::Protocol(e.0))?;
        Ok(now)
    }

    /// Takes the next record out of the pipe in place and hands it to `f` (`Err(f)` back if
    /// nothing is there now, or with `Pump::StopAtBulk` if bulk-lane data comes next).
    pub(super) fn next_in_pipe<R, F: FnOnce(Next<'_>) -> R>(
        &mut self,
        how: Pump,
        f: F,
    ) -> std::result::Result<Result<R, F>, Broken> {
        loop {
            let ConnIo { pipe, bulk_left, front_at, .. } = self;
            let (lane, m) = match pipe.front() {
                Ok(Some(x)) => x,
                Ok(None) => return Ok(Err(f)),
                Err(e) => return Err(lost(e)),
            };
            if *bulk_left > 0 {
                if lane != Lane::Bulk {
                    return Err(Broken::Protocol("bulk pack data missing".into()));
                }
                if how == Pump::StopAtBulk {
                    return Ok(Err(f));
                }
                // A chunk may end with records after its pack's data.
                let (n, len) = ((m.len() as u64).min(*bulk_left) as usize, m.len());
                *bulk_left -= n as u64;
                let r = f(Next::BulkData(&m[..n]));
                take_from_front(pipe, n, len)?;
                return Ok(Ok(r));
            }
            if lane == Lane::Bulk {
                // Bulk bytes nobody announced are records: a chunk that carries its pack's
                // announcement (and maybe the message's End), read in place like a message.
                let len = m.len();
                let (rec, data, next) = wire::decode_in_chunk(m, 0).map_err(|e| Broken::Protocol(e.to_string()))?;
                match rec {
                    Record::Bulk { total: 0, .. } => return Err(Broken::Protocol("empty bulk pack".into())),
                    Record::Bulk { total, .. } => *bulk_left = total,
                    _ => {}
                }
                let r = f(Next::Rec(rec, &m[data]));
                take_from_front(pipe, next, len)?;
                return Ok(Ok(r));
            }
            let len = m.len();
            if *front_at >= len {
                // An empty message.
                step_past(pipe, front_at, len, len)?;
                continue;
            }
            let (rec, data, next) = wire::decode_one(m, *front_at).map_err(|e| Broken::Protocol(e.to_string()))?;
            match rec {
                Record::Bye => {
                    step_past(pipe, front_at, next, len)?;
                    return Err(Broken::Closed);
                }
                Record::Bulk { total: 0, .. } => return Err(Broken::Protocol("empty bulk pack".into())),
                Record::Bulk { total, .. } => *bulk_left = total,
                _ => {}
            }
            let r = f(Next::Rec(rec, &m[data]));
            step_past(pipe, front_at, next, len)?;
            return Ok(Ok(r));
        }
    }
}

/// How far [`Conn::pump`] goes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Pump {
    /// Stop at bulk-lane data: its unpacker copies it straight from the pipe.
    StopAtBulk,
    /// Take everything out, bulk data too (for a waiter that must see what lies behind it).
    Drain,
}

/// A connection to one peer on one channel.
pub(crate) struct Conn {
    pub(super) peer: usize,
    /// The pipe and what was taken out of it, held briefly (never across a wait).
    pub(super) io: Token<ConnIo>,
    /// Claimed by a packer for the whole message.
    pub(super) send_side: Token<SendSide>,
    /// Claimed by an unpacker for the whole message.
    pub(super) recv_side: Token<RecvSide>,
    pub(super) next_rdv: AtomicU32,
    pub(super) max_msg: usize,
    /// The largest pipe message while the peer reads behind us (a stream): at most the largest
    /// frame of the pipe's default polled ring (32 KiB), so that the packs of Madeleine's
    /// larger frames then take the bulk lane, where the sender runs ahead and the crossover
    /// chooses its stores (decision 025). `max_msg` for the other strategies.
    pub(super) stream_max_msg: usize,
    /// Largest bulk-lane chunk (0: no bulk lane).
    pub(super) bulk_chunk: usize,
    /// Most record bytes a bulk chunk carries around its data.
    pub(super) bulk_frame: usize,
    /// Whether this process stores into the peer's bulk ring itself (one host:
    /// [`MsgPipe::bulk_copies`]).
    pub(super) bulk_copies: bool,
    /// Packs of at least this many bytes go by rendezvous (zero-copy), as probed or configured
    /// (large packs may go so below it while the bulk lane is measured slow: `SendSide`).
    pub(super) threshold: usize,
    /// The pipe's completion queue, for waiters to sleep on without the pipe's lock.
    pub(super) cq: CompletionQueue,
    /// The peer's reports of messages of ours it unpacked differently than we packed them.
    pub(super) notices: NoticeBoard,
    /// The claim words of offers, ours and the peer's.
    pub(super) claims: super::offer::ClaimWords,
    /// Messages received from the peer so far (wrapping; for the offers' policy).
    pub(super) received: AtomicU32,
    /// Our offers the peer claimed, and those we withdrew (for the log and the tests).
    pub(super) offers_claimed: AtomicU32,
    pub(super) offers_withdrawn: AtomicU32,
}

/// How long a closing connection waits for its peer's `Bye` (see [`Conn`]'s drop).
const BYE_LINGER: std::time::Duration = std::time::Duration::from_secs(1);

impl Drop for Conn {
    /// Tells the peer this end is closed (a `Bye` after everything sent before), so that a
    /// receive of its waiting for more from us fails at once instead of timing out; then
    /// lingers until the peer's `Bye` (or a failure, at most [`BYE_LINGER`]), reading and
    /// dropping what it still sends, when the peer is across a network: a rank that left while
    /// a peer still wrote to it (the acknowledgements of our last messages) would fail that
    /// peer's writes, which complete only once answered. SPMD programs close their channels in
    /// the same order, so the wait is the time the peer takes to get there.
    fn drop(&mut self) {
        let peer = self.peer;
        let io = self.io.get_mut();
        if io.failed.is_some() || io.closed {
            return;
        }
        let sent = io.pipe.try_send(&Record::Bye.header()).and_then(|taken| {
            io.pipe.flush()?;
            Ok(taken && io.pipe.staged() == 0)
        });
        if !matches!(sent, Ok(true)) {
            log::debug!("madeleine: could not tell rank {peer} that this end closed: {sent:?}");
            return;
        }
        if !io.pipe.qp().over_network() {
            return; // on one host every write of the peer's landed when it was posted
        }
        let deadline = std::time::Instant::now() + BYE_LINGER;
        loop {
            match io.next_in_pipe(Pump::Drain, |_| ()) {
                Ok(Ok(())) => continue,
                Ok(Err(_)) => {
                    if std::time::Instant::now() >= deadline {
                        log::debug!("madeleine: rank {peer} did not close its end within {BYE_LINGER:?}");
                        return;
                    }
                    if io.pipe.progress().is_err() {
                        return;
                    }
                    std::thread::yield_now();
                }
                // The peer's Bye, or the connection's end.
                Err(_) => return,
            }
        }
    }
}

impl Conn {
    pub(crate) fn establish(s: &Resources, peer: usize, conn: cm::Connection) -> Result<Conn> {
        let bulk_ring = match s.cfg.strategy {
            FlowStrategy::Credit { .. } => 0,
            _ => s.cfg.bulk_ring_bytes,
        };
        let options = PipeOptions { bulk_ring, ..PipeOptions::default() };
        let cq = conn.cq;
        let mut pipe = MsgPipe::establish_with(conn.qp, cq.clone(), &s.pd, s.cfg.strategy, options, s.cfg.timeout)?;
        let crossover = crate::probe::rendezvous_crossover(&mut pipe, s, peer, s.cfg.rendezvous_threshold)?;
        let claims = super::offer::ClaimWords::exchange(&mut pipe, s, peer)?;
        let (max_msg, stream_max_msg) = match s.cfg.strategy {
            FlowStrategy::Polled { .. } => {
                let max_msg = s.cfg.strategy.max_message().min(crate::config::FRAME_MAX);
                (max_msg, FlowStrategy::POLLED.max_message().min(max_msg))
            }
            other => (other.max_message(), other.max_message()),
        };
        let threshold = crossover.probed();
        log::debug!("madeleine: rank {peer}: rendezvous from {threshold} bytes");
        Ok(Conn {
            peer,
            notices: pipe.notice_board(),
            threshold,
            max_msg,
            stream_max_msg,
            bulk_chunk: pipe.bulk_chunk_max(),
            bulk_frame: pipe.bulk_frame_max().min(pipe.bulk_chunk_max() / 2),
            bulk_copies: pipe.bulk_copies(),
            io: Token::new(ConnIo {
                pipe,
                incoming: VecDeque::new(),
                front_at: 0,
                rdv_released: 0,
                failed: None,
                closed: false,
                bulk_left: 0,
                copy_out: CopyOut::default(),
                copy_out_reported: 0,
                copies_out: 0,
            }),
            send_side: Token::new(SendSide::new(max_msg, crossover)),
            recv_side: Token::new(RecvSide::default()),
            next_rdv: AtomicU32::new(0),
            cq,
            claims,
            received: AtomicU32::new(0),
            offers_claimed: AtomicU32::new(0),
            offers_withdrawn: AtomicU32::new(0),
        })
    }

    #[inline]
    pub(super) fn io(&self) -> Claim<'_, ConnIo> {
        self.io.hold()
    }

    /// The limits the sending side's decisions take, for a message sent while the peer reads
    /// behind us (`behind`, see [`Conn::peer_behind`]) or not.
    #[inline]
    pub(super) fn limits(&self, behind: bool) -> Limits {
        let max_msg = if behind { self.stream_max_msg } else { self.max_msg };
        Limits { threshold: self.threshold, max_msg, bulk_chunk: self.bulk_chunk }
    }

    /// Whether a pack of `len` bytes goes as a pipe message only while the peer keeps up
    /// (more than fits a message while it reads behind us, not more than fits one otherwise).
    #[inline]
    pub(super) fn frame_while_caught_up(&self, len: usize) -> bool {
        self.limits(true).too_large_for_a_message(len) && !self.limits(false).too_large_for_a_message(len)
    }

    /// Whether the peer has yet to acknowledge messages of ours: it reads behind us, as in a
    /// stream (in a ping-pong its reply acknowledged all we sent).
    pub(super) fn peer_behind(&self) -> bool {
        self.io().pipe.unacknowledged() > 0
    }

    /// The sender's error for the peer's latest mismatch report: which message of ours it
    /// unpacked, and what differed.
    #[cold]
    pub(super) fn reported_mismatch(&self) -> MadError {
        let w = self.notices.read();
        let why = match Mismatch::from_words([w[0], w[1], w[2]]) {
            Some(m) => m.describe(),
            None => format!("a report it could not read ({w:x?})"),
        };
        MadError::Mismatch {
            rank: self.peer,
            why: format!("rank {} unpacked message {} from this rank otherwise: {why}", self.peer, w[3] as u32),
        }
    }

    #[cold]
    pub(super) fn out_of_sequence(&self, e: crate::protocol::recv::OutOfSequence) -> MadError {
        MadError::Protocol { rank: self.peer, why: format!("message {} where {} was due", e.got, e.due) }
    }

    pub(super) fn lost(&self, why: impl std::fmt::Display) -> MadError {
        MadError::PeerLost { rank: self.peer, why: why.to_string() }
    }

    /// Hands the connection's next record to `f`: the oldest record taken out before, else
    /// the next one in the pipe's front message, in place (no copy, no queue: the path of
    /// small messages). `Ok(Err(f))` if none is there now, or (with `Pump::StopAtBulk`) if
    /// bulk-lane data comes next, which its unpacker copies straight from the pipe. Errors
    /// fail the connection, but records received before stay readable.
    pub(super) fn next_with<R, F: FnOnce(Next<'_>) -> R>(
        &self,
        io: &mut ConnIo,
        how: Pump,
        f: F,
    ) -> Result<Result<R, F>> {
        if let Some(inc) = io.incoming.pop_front() {
            return Ok(Ok(f(inc.view())));
        }
        self.check_open(io)?;
        match io.next_in_pipe(how, f) {
            Ok(r) => Ok(r),
            Err(b) => Err(self.fail(io, b)),
        }
    }

    /// The error of a connection that failed or that its peer closed, if it did.
    pub(super) fn check_open(&self, io: &ConnIo) -> Result<()> {
        if let Some(e) = &io.failed {
            return Err(self.lost(e));
        }
        if io.closed {
            return Err(MadError::PeerClosed { rank: self.peer });
        }
        Ok(())
    }

    /// Records why the connection broke (or that its peer closed it); returns the error for
    /// the caller.
    pub(super) fn fail(&self, io: &mut ConnIo, b: Broken) -> MadError {
        let make = |b: &Broken| match b {
            Broken::Protocol(why) => MadError::Protocol { rank: self.peer, why: why.clone() },
            Broken::Lost(why) => self.lost(why),
            Broken::Closed => MadError::PeerClosed { rank: self.peer },
        };
        match b {
            Broken::Closed => io.closed = true,
            _ => io.failed = Some(make(&b)),
        }
        make(&b)
    }

    /// Fails the connection if `e` says the peer broke the protocol (every later call on it
    /// gets the error too: what follows a malformed record cannot be trusted); returns `e`.
    /// Not with the connection's lock held.
    pub(super) fn poison(&self, e: MadError) -> MadError {
        if let MadError::Protocol { why, .. } = &e {
            let mut io = self.io();
            if io.failed.is_none() {
                io.failed = Some(MadError::Protocol { rank: self.peer, why: why.clone() });
            }
        }
        e
    }

    /// Takes everything the pipe received out of it, into the record queue (bulk data too),
    /// so that the peer's window opens and what lies behind it is seen.
    pub(super) fn pump(&self, io: &mut ConnIo) -> Result<()> {
        self.check_open(io)?;
        loop {
            match io.next_in_pipe(Pump::Drain, Incoming::owned) {
                Ok(Ok(inc)) => io.incoming.push_back(inc),
                Ok(Err(_)) => return Ok(()),
                Err(b) => return Err(self.fail(io, b)),
            }
        }
    }

    /// Waits until the request of ours behind `token` (a zero-copy read, an offer's
    /// withdrawal) completed: `Ok` with its outcome, `Err` if it was not seen completing
    /// within the wait's timeout (`waiting` names it then, `what` names a failed request).
    /// Completions are polled even once the pipe failed (its queue pair then flushes every
    /// request).
    pub(super) fn wait_user(&self, token: u64, p: &Patience, waiting: &'static str, what: &str) -> Result<Result<()>> {
        let mut w = Waiter::new(p, waiting);
        let mut polls = 0u32;
        loop {
            polls = polls.wrapping_add(1);
            {
                let mut io = self.io();
                // Mostly a look at the completion queue; now and then a whole pass, so that a
                // long read does not hold the pipe's flow control up.
                if polls.is_multiple_of(16) {
                    let _ = io.pipe.progress();
                }
                match io.pipe.settle_user(token) {
                    Some(WcStatus::Success) => return Ok(Ok(())),
                    // A request flushed by the pipe's failure: the failure says why.
                    Some(st) => {
                        let why = io.pipe.failure().map_or_else(|| format!("{what} failed: {st:?}"), str::to_owned);
                        return Ok(Err(self.lost(why)));
                    }
                    None => {}
                }
            }
            w.pause_on(&[self])?;
        }
    }

    /// Waits until the pipe requests behind `tokens` (bulk chunks of ours) completed.
    pub(super) fn wait_tokens(&self, tokens: &mut Vec<u64>, p: &Patience) -> Result<()> {
        let mut w = Waiter::new(p, "waiting for bulk data to leave");
        while !tokens.is_empty() {
            {
                let mut io = self.io();
                let _ = io.pipe.progress();
                let mut failed = None;
                tokens.retain(|&t| match io.pipe.take_user_completion(t) {
                    Some(WcStatus::Success) => false,
                    Some(st) => {
                        failed = Some(st);
                        false
                    }
                    None => true,
                });
                if let Some(st) = failed {
                    return Err(self.lost(format!("bulk transfer failed: {st:?}")));
                }
                if let Some(f) = io.pipe.failure() {
                    return Err(self.lost(f));
                }
            }
            if !tokens.is_empty() {
                w.pause()?;
            }
        }
        Ok(())
    }

    /// Sends one pipe message and sees it handed to the transport (nothing left staged: the
    /// sender may stop progressing this connection afterwards), draining what arrives meanwhile
    /// so two ends sending at once never block each other.
    #[inline]
    pub(super) fn send_msg(&self, msg: &[u8], p: &Patience) -> Result<()> {
        let mut io = self.io();
        let mut accepted = false;
        if io.failed.is_none() && !io.closed {
            // The usual case: the pipe takes the message and hands it to the transport at once.
            accepted = io.pipe.try_send(msg).map_err(|e| self.lost(e))?;
            if accepted {
                if io.pipe.staged() == 0 {
                    // Handed to the transport already (not coalesced behind earlier ones).
                    return Ok(());
                }
                io.pipe.flush().map_err(|e| self.lost(e))?;
                if io.pipe.staged() == 0 {
                    return Ok(());
                }
            }
        }
        drop(io);
        self.send_msg_waiting(msg, p, accepted)
    }

    /// Sends the pipe message `head` + `body` straight from the two if it can leave at once
    /// so ([`MsgPipe::try_send_gathered`]); false: nothing sent (join them and
    /// [`Conn::send_msg`], which also reports a closed or failed connection).
    #[inline]
    pub(super) fn try_send_gathered(&self, head: &[u8], body: &[u8]) -> Result<bool> {
        let mut io = self.io();
        if io.failed.is_some() || io.closed {
            return Ok(false);
        }
        io.pipe.try_send_gathered(head, body).map_err(|e| self.lost(e))
    }

    /// [`Conn::send_msg`] once the message could not leave at once (`accepted`: the pipe took
    /// it already).
    #[inline(never)]
    pub(super) fn send_msg_waiting(&self, msg: &[u8], p: &Patience, mut accepted: bool) -> Result<()> {
        let mut w = None;
        loop {
            {
                let mut io = self.io();
                self.check_open(&io)?;
                if !accepted {
                    accepted = io.pipe.try_send(msg).map_err(|e| self.lost(e))?;
                }
                if accepted {
                    io.pipe.flush().map_err(|e| self.lost(e))?;
                    if io.pipe.staged() == 0 {
                        return Ok(());
                    }
                }
                // Received data frees our peer's send window only once taken out of the pipe.
                let _ = self.pump(&mut io);
            }
            w.get_or_insert_with(|| Waiter::new(p, "sending a message")).pause()?;
        }
    }
}

impl Sleeper for Conn {
    /// The completion queue to sleep on.
    fn cq(&self) -> &CompletionQueue {
        &self.cq
    }

    /// Readies the pipe for a sleep on `cq` (see `MsgPipe::prepare_sleep`); false if
    /// something arrived meanwhile, or the pipe failed (the next poll tells): do not sleep.
    fn prepare_sleep(&self) -> bool {
        matches!(self.io().pipe.prepare_sleep(), Ok(true))
    }
}
