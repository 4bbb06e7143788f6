//! Channels, connections, and the packing and unpacking of messages.

use std::cell::{Cell, UnsafeCell};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;

use portability_verbs::copy::{self, copy_slice};
use portability_verbs::datapath::{
    AdaptiveCrossover, FlowStrategy, Lane, MsgPipe, NoticeBoard, PipeOptions, Registration, Stores,
};
use portability_verbs::{cm, AccessFlags, CompletionQueue, SendWr, Sge, WcStatus};
use smallvec::SmallVec;

use crate::session::SessionInner;
use crate::wait::{Patience, Waiter};
use crate::wire::{self, Modes, Record};
use crate::{MadError, RecvMode, Result, SendMode};

/// Inline bytes of a received record: small ones (the latency-critical case) without a heap
/// allocation.
type InlineBytes = SmallVec<[u8; 64]>;

/// A record taken out of the pipe before its reader came (a pipe message may hold records of
/// several messages, and a sender draining the pipe to free the peer's window takes them all):
/// the slow path, one extra copy.
enum Incoming {
    /// A record, with an inline fragment's bytes.
    Rec(Record, InlineBytes),
    /// Bulk-lane bytes taken out of the pipe before their unpacker came (so that the records
    /// behind them could be seen).
    BulkData(Vec<u8>),
}

/// The connection's next record as its reader sees it: in place in the pipe's receive buffer
/// (the fast path) or from the queue of records taken out before.
enum Next<'a> {
    /// A record and its inline bytes (empty for records without).
    Rec(Record, &'a [u8]),
    /// Bulk-lane bytes (seen only when draining past them).
    BulkData(&'a [u8]),
}

impl Incoming {
    fn view(&self) -> Next<'_> {
        match self {
            Incoming::Rec(r, d) => Next::Rec(*r, d),
            Incoming::BulkData(d) => Next::BulkData(d),
        }
    }

    fn owned(n: Next<'_>) -> Incoming {
        match n {
            Next::Rec(r, d) => Incoming::Rec(r, InlineBytes::from_slice(d)),
            Next::BulkData(d) => Incoming::BulkData(d.to_vec()),
        }
    }
}

/// Why taking a record out of the pipe failed (recorded as the connection's failure).
enum Broken {
    Protocol(String),
    Lost(String),
    /// The peer's `Bye`: it closed its end, everything it sent before was read.
    Closed,
}

fn lost(e: portability_verbs::VerbsError) -> Broken {
    Broken::Lost(e.to_string())
}

/// Moves the read position of the pipe's front message to `next` (of `len` bytes), releasing
/// the message once every record of it was read.
fn step_past(pipe: &mut MsgPipe, front_at: &mut usize, next: usize, len: usize) -> std::result::Result<(), Broken> {
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
fn take_from_front(pipe: &mut MsgPipe, n: usize, len: usize) -> std::result::Result<(), Broken> {
    if n >= len { pipe.pop_front() } else { pipe.consume_front(n) }.map_err(lost)
}

/// Reads the peer's release count (how many of our rendezvous it has read, in the order we
/// issued them: see [`Unpacker::release`]) and checks it: it never goes back from `seen`, the
/// count we last read, nor past `issued`, the rendezvous our packers took so far (all
/// counted in wrapping u32, as the ids are). Anything else is a broken peer.
fn released(seen: u32, now: u32, issued: u32) -> std::result::Result<u32, Broken> {
    if now.wrapping_sub(seen) > issued.wrapping_sub(seen) {
        return Err(Broken::Protocol(format!(
            "released {now} rendezvous, {} of them after {seen} when only {issued} were issued",
            now.wrapping_sub(seen)
        )));
    }
    Ok(now)
}

/// Whether rendezvous `id` is among the first `released` (wrapping: the ids within 2^31
/// below the count).
#[inline]
fn is_released(released: u32, id: u32) -> bool {
    released.wrapping_sub(id).wrapping_sub(1) < 1 << 31
}

struct ConnIo {
    pipe: MsgPipe,
    /// Records taken out of the pipe before their reader came; they come before the pipe's.
    incoming: VecDeque<Incoming>,
    /// Where the next record of the pipe's front message starts (records before it were
    /// read in place).
    front_at: usize,
    /// How many of our rendezvous the peer said it read, as last looked at.
    rdv_released: u32,
    failed: Option<MadError>,
    /// The peer said `Bye` and everything before it was read: nothing more comes.
    closed: bool,
    /// Bytes of an announced bulk pack still in the pipe's bulk lane.
    bulk_left: u64,
}

/// What [`ConnIo::take_one`] found at the head of the connection.
enum OneMsg {
    /// A `One` message, taken: its sequence number and modes (its bytes were copied out).
    Taken(u32, Modes),
    /// Nothing arrived.
    Nothing,
    /// Something else: the general path reads it.
    Other,
}

impl ConnIo {
    /// The path of the commonest message, one small pack (a `One` record, alone in its pipe
    /// message): if it opens the connection's next pipe message with nothing queued before it,
    /// copies its bytes into `body` and releases it. Anything else, a malformed `One` included,
    /// is left for the general path (which reports what is wrong with it).
    #[inline]
    fn take_one(&mut self, body: &mut Vec<u8>) -> OneMsg {
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
        body.clear();
        copy::extend_vec(body, data);
        // Releasing a message read in place cannot fail; were it to, the general path would
        // read the message again and report it.
        if self.pipe.pop_front().is_err() {
            return OneMsg::Other;
        }
        OneMsg::Taken(seq, modes)
    }

    /// If the next record is the message's `End` and already here (queued, or next in the
    /// pipe message being read), takes it and returns its pack count. Never waits or polls.
    fn end_follows(&mut self) -> std::result::Result<Option<u32>, Broken> {
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
    fn released(&mut self, issued: &AtomicU32) -> std::result::Result<u32, Broken> {
        let now = self.pipe.peer_released() as u32;
        // The issued count is read after the release that may count our latest rendezvous.
        std::sync::atomic::fence(Ordering::Acquire);
        self.rdv_released = released(self.rdv_released, now, issued.load(Ordering::Acquire))?;
        Ok(now)
    }

    /// Takes the next record out of the pipe in place and hands it to `f` (`Err(f)` back if
    /// nothing is there now, or with `Pump::StopAtBulk` if bulk-lane data comes next).
    fn next_in_pipe<R, F: FnOnce(Next<'_>) -> R>(
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
enum Pump {
    /// Stop at bulk-lane data: its unpacker copies it straight from the pipe.
    StopAtBulk,
    /// Take everything out, bulk data too (for a waiter that must see what lies behind it).
    Drain,
}

/// A lock around state, taken two ways: claimed for a whole message (one direction of a
/// connection, with its next sequence number and a buffer kept between messages: no
/// allocation, no thread-local lookup on a message's path), waiting as any blocking call
/// does; or held for a short critical section that never waits inside (the connection's
/// pipe), spinning. Unlike a `MutexGuard`, a claim may be released on another thread than
/// the one that took it, which coroutines migrating between `may` workers need; and its
/// release is a plain store where a mutex's is an atomic exchange (the pipe is locked on
/// every poll of a waiting receiver).
pub(crate) struct Token<T> {
    busy: std::sync::atomic::AtomicBool,
    state: UnsafeCell<T>,
}

// SAFETY: `state` is reached only through a `Claim`, and `busy` admits one claim at a time
// (acquire on claim, release on drop), as a lock does.
unsafe impl<T: Send> Sync for Token<T> {}

impl<T> Token<T> {
    fn new(state: T) -> Token<T> {
        Token { busy: std::sync::atomic::AtomicBool::new(false), state: UnsafeCell::new(state) }
    }

    /// The state, through the only reference there is (no claim needed).
    fn get_mut(&mut self) -> &mut T {
        self.state.get_mut()
    }

    /// Takes the token for a short critical section (one that never waits inside): spins,
    /// yielding the CPU now and then (the holder may be a preempted thread).
    #[inline]
    fn hold(&self) -> Claim<'_, T> {
        match self.try_claim() {
            Some(c) => c,
            None => self.hold_contended(),
        }
    }

    #[inline(never)]
    fn hold_contended(&self) -> Claim<'_, T> {
        let mut polls = 0u32;
        loop {
            if let Some(c) = self.try_claim() {
                return c;
            }
            polls = polls.wrapping_add(1);
            if portability_verbs::spin_yields(polls) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    #[inline]
    fn try_claim(&self) -> Option<Claim<'_, T>> {
        self.busy.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).ok().map(|_| Claim { t: self })
    }

    /// Claims, yielding (coroutines) or spinning then napping (threads) while another holds it.
    #[inline]
    fn claim(&self, p: Patience) -> Result<Claim<'_, T>> {
        match self.try_claim() {
            Some(c) => Ok(c),
            None => self.claim_slow(p),
        }
    }

    #[inline(never)]
    fn claim_slow(&self, p: Patience) -> Result<Claim<'_, T>> {
        let mut w = Waiter::new(p, "waiting for a connection held by another sender or receiver");
        loop {
            if let Some(c) = self.try_claim() {
                return Ok(c);
            }
            w.pause()?;
        }
    }
}

/// A held [`Token`], giving access to its state; released on drop.
pub(crate) struct Claim<'a, T> {
    t: &'a Token<T>,
}

impl<T> std::ops::Deref for Claim<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: this claim is the only one (see `Token`).
        unsafe { &*self.t.state.get() }
    }
}

impl<T> std::ops::DerefMut for Claim<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: this claim is the only one (see `Token`), and `&mut self` the only borrow.
        unsafe { &mut *self.t.state.get() }
    }
}

impl<T> Drop for Claim<'_, T> {
    fn drop(&mut self) {
        self.t.busy.store(false, Ordering::Release);
    }
}

/// The sending direction of a connection, held by a packer for a whole message.
pub(crate) struct SendSide {
    /// Sequence number of the next message.
    seq: u32,
    /// Records of the pipe message being filled.
    agg: Vec<u8>,
    /// Copy or zero-copy for large packs, from the probe and the copies timed since.
    crossover: AdaptiveCrossover,
    // The message being packed (here rather than in the `Packer`, which is returned by value
    // on every message and so stays a few words).
    /// Packs so far.
    packs: u32,
    /// Part of the message was handed to the network already (it cannot go as one `Whole`).
    flushed: bool,
    /// Modes of the last pack appended whole inline (a message of that pack alone goes as
    /// one `One` record).
    inline_modes: Modes,
    /// `end_packing` ran (or the packer was dropped).
    finished: bool,
    /// The last word of the peer's latest mismatch report that was returned to a packer.
    notice_seen: u64,
}

/// The receiving direction of a connection, held by an unpacker for a whole message.
pub(crate) struct RecvSide {
    /// Sequence number of the next message.
    seq: u32,
    /// The records of a message that came whole, taken out of the pipe at once.
    body: Vec<u8>,
    // The message being unpacked (here rather than in the `Unpacker`, which is returned by
    // value on every message and so stays a few words).
    /// Unpacks so far.
    unpacks: u32,
    /// The message's `End` (its pack count), once taken.
    end: Option<u32>,
    /// The message, if it came whole (its records are in `body`).
    whole: Option<WholeMsg>,
    /// `end_unpacking` ran (or the unpacker was dropped).
    finished: bool,
    /// The id of the sender's next rendezvous (they come in the order it issued them)...
    rdv_next: u32,
    /// ...and how many we told it we read ([`Unpacker::release`]).
    rdv_released: u32,
    /// Mismatches reported to the sender so far (the count in each notice)...
    notices: u32,
    /// ...the last of them about this message (sequence number).
    told: Option<u32>,
}

/// A connection to one peer on one channel.
pub(crate) struct Conn {
    peer: usize,
    /// The pipe and what was taken out of it, held briefly (never across a wait).
    io: Token<ConnIo>,
    /// Claimed by a packer for the whole message.
    send_side: Token<SendSide>,
    /// Claimed by an unpacker for the whole message.
    recv_side: Token<RecvSide>,
    next_rdv: AtomicU32,
    max_msg: usize,
    /// Largest bulk-lane chunk (0: no bulk lane).
    bulk_chunk: usize,
    /// Most record bytes a bulk chunk carries around its data.
    bulk_frame: usize,
    /// Packs of at least this many bytes go by rendezvous (zero-copy), as probed or configured
    /// (large packs may go so below it while the bulk lane is measured slow: `SendSide`).
    threshold: usize,
    /// The pipe's completion queue, for waiters to sleep on without the pipe's lock.
    cq: CompletionQueue,
    /// The peer's reports of messages of ours it unpacked differently than we packed them.
    notices: NoticeBoard,
}

impl Drop for Conn {
    /// Tells the peer this end is closed (a `Bye` after everything sent before), so that a
    /// receive of its waiting for more from us fails at once instead of timing out. Best
    /// effort: nothing is waited for, and a pipe with no room now sends nothing.
    fn drop(&mut self) {
        let io = self.io.get_mut();
        if io.failed.is_some() || io.closed {
            return;
        }
        let sent = io.pipe.try_send(&Record::Bye.header()).and_then(|taken| {
            io.pipe.flush()?;
            Ok(taken && io.pipe.staged() == 0)
        });
        if !matches!(sent, Ok(true)) {
            log::debug!("madeleine: could not tell rank {} that this end closed: {sent:?}", self.peer);
        }
    }
}

impl Conn {
    pub(crate) fn establish(s: &SessionInner, peer: usize, conn: cm::Connection) -> Result<Conn> {
        let bulk_ring = match s.cfg.strategy {
            FlowStrategy::Credit { .. } => 0,
            _ => s.cfg.bulk_ring_bytes,
        };
        let options = PipeOptions { bulk_ring, ..PipeOptions::default() };
        let cq = conn.cq;
        let mut pipe = MsgPipe::establish_with(conn.qp, cq.clone(), &s.pd, s.cfg.strategy, options, s.cfg.timeout)?;
        let crossover = crate::probe::rendezvous_crossover(&mut pipe, s, peer, s.cfg.rendezvous_threshold)?;
        let max_msg = s.cfg.strategy.max_message();
        let threshold = crossover.probed();
        log::debug!("madeleine: rank {peer}: rendezvous from {threshold} bytes");
        Ok(Conn {
            peer,
            notices: pipe.notice_board(),
            threshold,
            max_msg,
            bulk_chunk: pipe.bulk_chunk_max(),
            bulk_frame: pipe.bulk_frame_max().min(pipe.bulk_chunk_max() / 2),
            io: Token::new(ConnIo {
                pipe,
                incoming: VecDeque::new(),
                front_at: 0,
                rdv_released: 0,
                failed: None,
                closed: false,
                bulk_left: 0,
            }),
            send_side: Token::new(SendSide {
                seq: 0,
                agg: Vec::with_capacity(max_msg),
                crossover,
                packs: 0,
                flushed: false,
                inline_modes: Modes { send: SendMode::Safer, recv: RecvMode::Express },
                finished: true,
                notice_seen: 0,
            }),
            recv_side: Token::new(RecvSide {
                seq: 0,
                body: Vec::new(),
                unpacks: 0,
                end: None,
                whole: None,
                finished: true,
                rdv_next: 0,
                rdv_released: 0,
                notices: 0,
                told: None,
            }),
            next_rdv: AtomicU32::new(0),
            cq,
        })
    }

    #[inline]
    fn io(&self) -> Claim<'_, ConnIo> {
        self.io.hold()
    }

    /// The completion queue to sleep on.
    pub(crate) fn cq(&self) -> &CompletionQueue {
        &self.cq
    }

    /// Readies the pipe for a sleep on [`Conn::cq`] (see `MsgPipe::prepare_sleep`); false if
    /// something arrived meanwhile, or the pipe failed (the next poll tells): do not sleep.
    pub(crate) fn prepare_sleep(&self) -> bool {
        matches!(self.io().pipe.prepare_sleep(), Ok(true))
    }

    /// The sender's error for the peer's latest mismatch report: which message of ours it
    /// unpacked, and what differed.
    #[cold]
    fn reported_mismatch(&self) -> MadError {
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
    fn out_of_sequence(&self, seq: u32, due: u32) -> MadError {
        MadError::Protocol { rank: self.peer, why: format!("message {seq} where {due} was due") }
    }

    fn lost(&self, why: impl std::fmt::Display) -> MadError {
        MadError::PeerLost { rank: self.peer, why: why.to_string() }
    }

    /// Hands the connection's next record to `f`: the oldest record taken out before, else
    /// the next one in the pipe's front message, in place (no copy, no queue: the path of
    /// small messages). `Ok(Err(f))` if none is there now, or (with `Pump::StopAtBulk`) if
    /// bulk-lane data comes next, which its unpacker copies straight from the pipe. Errors
    /// fail the connection, but records received before stay readable.
    fn next_with<R, F: FnOnce(Next<'_>) -> R>(&self, io: &mut ConnIo, how: Pump, f: F) -> Result<Result<R, F>> {
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
    fn check_open(&self, io: &ConnIo) -> Result<()> {
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
    fn fail(&self, io: &mut ConnIo, b: Broken) -> MadError {
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
    fn poison(&self, e: MadError) -> MadError {
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
    fn pump(&self, io: &mut ConnIo) -> Result<()> {
        self.check_open(io)?;
        loop {
            match io.next_in_pipe(Pump::Drain, Incoming::owned) {
                Ok(Ok(inc)) => io.incoming.push_back(inc),
                Ok(Err(_)) => return Ok(()),
                Err(b) => return Err(self.fail(io, b)),
            }
        }
    }

    /// Waits until the pipe requests behind `tokens` (bulk chunks of ours) completed.
    fn wait_tokens(&self, tokens: &mut Vec<u64>, p: Patience) -> Result<()> {
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
    fn send_msg(&self, msg: &[u8], p: Patience) -> Result<()> {
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

    /// [`Conn::send_msg`] once the message could not leave at once (`accepted`: the pipe took
    /// it already).
    #[inline(never)]
    fn send_msg_waiting(&self, msg: &[u8], p: Patience, mut accepted: bool) -> Result<()> {
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

/// A communication context with a connection to every other process of the session.
pub struct Channel {
    session: Arc<SessionInner>,
    id: u32,
    conns: Vec<Option<Arc<Conn>>>,
    next_source: AtomicUsize,
}

impl Channel {
    pub(crate) fn new(session: Arc<SessionInner>, id: u32, conns: Vec<Option<Arc<Conn>>>) -> Channel {
        Channel { session, id, conns, next_source: AtomicUsize::new(0) }
    }

    /// The channel's number (channels are numbered in creation order from 1).
    pub fn id(&self) -> u32 {
        self.id
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.session.cfg.rank
    }

    /// Number of processes.
    pub fn size(&self) -> usize {
        self.session.cfg.size
    }

    #[inline]
    fn conn(&self, rank: usize) -> Result<&Conn> {
        match self.conns.get(rank) {
            Some(Some(c)) => Ok(c),
            _ => Err(self.no_conn(rank)),
        }
    }

    #[cold]
    fn no_conn(&self, rank: usize) -> MadError {
        MadError::Invalid(format!("no connection to rank {rank} (size {}, self {})", self.size(), self.rank()))
    }

    /// Starts a message to `dest`. Other senders to `dest` on this channel wait until
    /// `end_packing`: a message is packed atomically.
    #[inline]
    pub fn begin_packing(&self, dest: usize) -> Result<Packer<'_>> {
        let conn = self.conn(dest)?;
        let mut tx = conn.send_side.claim(self.session.cfg.patience())?;
        let reported = conn.notices.last_word();
        if reported != tx.notice_seen {
            tx.notice_seen = reported;
            return Err(conn.reported_mismatch());
        }
        let SendSide { seq, agg, packs, flushed, finished, .. } = &mut *tx;
        (*packs, *flushed, *finished) = (0, false, false);
        agg.clear();
        agg.reserve(conn.max_msg);
        Record::Begin { seq: *seq }.encode(agg);
        Ok(Packer { ch: self, conn, tx, more: None, rdv: SmallVec::new() })
    }

    /// Waits until every process of the session reached this call on this channel (an empty
    /// message gathered by rank 0 and answered). Call it when no other message is in flight on
    /// the channel, for example before tearing a session down.
    pub fn barrier(&self) -> Result<()> {
        if self.rank() == 0 {
            for r in 1..self.size() {
                self.begin_unpacking_from(r)?.end_unpacking()?;
            }
            for r in 1..self.size() {
                self.begin_packing(r)?.end_packing()?;
            }
        } else if self.size() > 1 {
            self.begin_packing(0)?.end_packing()?;
            self.begin_unpacking_from(0)?.end_unpacking()?;
        }
        Ok(())
    }

    /// Packs of at least this many bytes to `rank` go by rendezvous (zero-copy): the session's
    /// setting, or what the connection's probe chose (`usize::MAX`: never, copying through
    /// the bulk lane is faster to that peer). Without a setting, packs of at least
    /// [`AdaptiveCrossover::MIN_PACK`] also go zero-copy while the sender's copies into the
    /// bulk lane run slower than the probe's reads (a trial copy now and then).
    pub fn rendezvous_threshold(&self, rank: usize) -> Result<usize> {
        Ok(self.conn(rank)?.threshold)
    }

    /// Takes the next message from any sender (each caller gets a different message; messages
    /// of one sender arrive in order).
    pub fn begin_unpacking(&self) -> Result<Unpacker<'_>> {
        let mut w = Waiter::new(self.session.cfg.patience(), "waiting for a message");
        let conns: SmallVec<[&Conn; 8]> = self.conns.iter().flatten().map(|c| &**c).collect();
        loop {
            if let Some(u) = self.try_begin_unpacking()? {
                return Ok(u);
            }
            w.pause_on(&conns)?;
        }
    }

    /// Takes the next message from any sender if one has begun arriving, without waiting:
    /// `Ok(None)` if none has (or every sender with one is being read by another thread). For
    /// event loops that poll several channels or do their own work between looks, where
    /// [`Channel::begin_unpacking`] would block; the sources are looked at in turn from call
    /// to call, so a busy one does not hide the others.
    pub fn try_begin_unpacking(&self) -> Result<Option<Unpacker<'_>>> {
        let n = self.conns.len();
        let start = self.next_source.fetch_add(1, Ordering::Relaxed);
        let mut open = false;
        for k in 0..n {
            let Some(conn) = self.conns[(start + k) % n].as_deref() else { continue };
            // Not holding the claim between looks: a thread waiting for this source only may
            // take it.
            let Some(mut rx) = conn.recv_side.try_claim() else {
                open = true;
                continue;
            };
            match self.try_begin(conn, &mut rx) {
                Ok(true) => {
                    return Ok(Some(Unpacker { ch: self, conn, rx, pending: Vec::new(), note: Cell::new(None) }))
                }
                Ok(false) => open = true,
                // A sender that closed its end has no more to give; the others may.
                Err(MadError::PeerClosed { .. }) => {}
                Err(e) => return Err(conn.poison(e)),
            }
        }
        if !open && n > 1 {
            return Err(MadError::AllPeersClosed);
        }
        Ok(None)
    }

    /// Takes the next message from `source`; fails with [`MadError::PeerClosed`] once `source`
    /// closed its end and what it sent before was read.
    #[inline]
    pub fn begin_unpacking_from(&self, source: usize) -> Result<Unpacker<'_>> {
        let conn = self.conn(source)?;
        // Claimed once for the whole wait: whoever else wants this source's next message
        // would wait behind us anyway.
        let mut rx = conn.recv_side.claim(self.session.cfg.patience())?;
        if !self.try_begin(conn, &mut rx).map_err(|e| conn.poison(e))? {
            let mut w = Waiter::new(self.session.cfg.patience(), "waiting for a message");
            loop {
                w.pause_on(&[conn])?;
                if self.try_begin(conn, &mut rx).map_err(|e| conn.poison(e))? {
                    break;
                }
            }
        }
        Ok(Unpacker { ch: self, conn, rx, pending: Vec::new(), note: Cell::new(None) })
    }

    /// Takes the next message from `source` if it has begun arriving, without waiting:
    /// `Ok(None)` if it has not, or if another unpacker (of another thread, or an unfinished
    /// one of this thread) is reading from `source` now. Errors as
    /// [`Channel::begin_unpacking_from`]: a bad rank, a failed connection, a dead peer, a peer
    /// that closed its end ([`MadError::PeerClosed`], once what it sent before was read).
    pub fn try_begin_unpacking_from(&self, source: usize) -> Result<Option<Unpacker<'_>>> {
        let conn = self.conn(source)?;
        let Some(mut rx) = conn.recv_side.try_claim() else { return Ok(None) };
        if self.try_begin(conn, &mut rx).map_err(|e| conn.poison(e))? {
            return Ok(Some(Unpacker { ch: self, conn, rx, pending: Vec::new(), note: Cell::new(None) }));
        }
        Ok(None)
    }

    /// Takes the start of the connection's next message into `rx` if it has begun arriving
    /// (`false` if nothing is there yet): its records follow, or it came whole.
    #[inline]
    fn try_begin(&self, conn: &Conn, rx: &mut RecvSide) -> Result<bool> {
        let mut io = conn.io();
        let (seq, whole) = match io.take_one(&mut rx.body) {
            OneMsg::Taken(seq, modes) => (seq, WholeMsg { at: 0, taken: 0, packs: 1, single: Some(modes) }),
            OneMsg::Nothing => return Ok(false),
            OneMsg::Other => return self.try_begin_other(conn, rx, io),
        };
        drop(io);
        if seq != rx.seq {
            return Err(conn.out_of_sequence(seq, rx.seq));
        }
        (rx.unpacks, rx.end, rx.whole, rx.finished) = (0, None, Some(whole), false);
        Ok(true)
    }

    /// [`Channel::try_begin`] for anything but a message of one small pack.
    #[inline(never)]
    fn try_begin_other(&self, conn: &Conn, rx: &mut RecvSide, mut io: Claim<'_, ConnIo>) -> Result<bool> {
        /// What the next record says (small and plain: it travels back through the record
        /// reader's results on every message).
        #[derive(Clone, Copy)]
        enum Start {
            Begin(u32),
            Whole(u32, u32),
            One(u32, Modes),
            Other,
        }
        let body = &mut rx.body;
        let got = conn.next_with(&mut io, Pump::StopAtBulk, |n| match n {
            Next::Rec(Record::Begin { seq }, _) => Start::Begin(seq),
            // A small message, taken out of the pipe at once: its unpacks need no lock.
            Next::Rec(Record::Whole { seq, packs }, data) => {
                body.clear();
                copy::extend_vec(body, data);
                Start::Whole(seq, packs)
            }
            Next::Rec(Record::One { seq, modes }, data) => {
                body.clear();
                copy::extend_vec(body, data);
                Start::One(seq, modes)
            }
            _ => Start::Other,
        })?;
        let (seq, whole) = match got {
            Err(_) => return Ok(false),
            Ok(Start::Begin(seq)) => (seq, None),
            Ok(Start::Whole(seq, packs)) => (seq, Some(WholeMsg { at: 0, taken: 0, packs, single: None })),
            Ok(Start::One(seq, modes)) => (seq, Some(WholeMsg { at: 0, taken: 0, packs: 1, single: Some(modes) })),
            Ok(Start::Other) => {
                return Err(MadError::Protocol { rank: conn.peer, why: "data outside a message".into() })
            }
        };
        drop(io);
        if seq != rx.seq {
            return Err(conn.out_of_sequence(seq, rx.seq));
        }
        (rx.unpacks, rx.end, rx.whole, rx.finished) = (0, None, whole, false);
        Ok(true)
    }
}

/// How a pack travels.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Route {
    /// Copied into pipe messages.
    Inline,
    /// Copied through the bulk lane.
    Bulk,
    /// Read by the receiver from the sender's memory (zero-copy).
    Rendezvous,
}

/// A pack queued behind a `SendMode::Later` pack (sent at `end_packing`, in order).
enum Deferred<'p> {
    Borrowed(&'p [u8], Modes),
    Owned(Vec<u8>, Modes),
    /// A pack of [`Packer::pack_later`]: the application may still write it, through
    /// [`Packer::later_mut`] with this number, until `end_packing` reads it.
    Mutable(u32, &'p mut [u8], Modes),
}

impl Deferred<'_> {
    fn is_later(&self) -> bool {
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
struct Held<'p> {
    id: u32,
    _reg: Registration<'p>,
    _copy: Option<Box<[u8]>>,
}

/// A message being packed. Buffers packed `Later` or `Cheaper` stay borrowed until
/// [`Packer::end_packing`].
pub struct Packer<'p> {
    ch: &'p Channel,
    conn: &'p Conn,
    /// The connection's sending side, held until the message is complete (with the state of
    /// the message being packed).
    tx: Claim<'p, SendSide>,
    /// What `Later`, rendezvous and bulk packs need, allocated by the first of them: a
    /// message of small packs never touches it, and the packer stays small enough to move
    /// cheaply (it is returned by value on every message).
    more: Option<Box<PackerMore<'p>>>,
    /// Zero-copy packs the receiver has still to read (outside `more`: a message of one
    /// rendezvous pack, the commonest large message, allocates nothing for it).
    rdv: Held1<'p>,
}

/// Rendezvous packs held until the receiver released them, one without allocating.
type Held1<'p> = SmallVec<[Held<'p>; 1]>;

/// A packer's state for its rarer packs.
#[derive(Default)]
struct PackerMore<'p> {
    deferred: Vec<Deferred<'p>>,
    /// Bulk chunks of borrowed buffers still being written, and their registrations.
    bulk_tokens: Vec<u64>,
    bulk_regs: Vec<Registration<'p>>,
    /// A borrowed bulk pack not sent yet: the next pack, `flush` or `end_packing` sends it,
    /// `end_packing` with the message's `End` in its last chunk.
    pending_bulk: Option<(&'p [u8], Modes)>,
    /// Bytes of the bulk packs above that the crossover times, and how long their hand-over
    /// took so far (the wait for their chunks is added when it is over).
    timed: (usize, std::time::Duration),
    /// The message ends with `end_packing_nowait`: packs still to send go zero-copy rather
    /// than through the bulk lane, whose ring only the receiver's reads empty.
    nowait: bool,
    /// `pack_later` packs so far (their numbers).
    later: u32,
}

impl<'p> Packer<'p> {
    fn more(&mut self) -> &mut PackerMore<'p> {
        self.more.get_or_insert_with(Box::default)
    }

    fn has_deferred(&self) -> bool {
        self.more.as_ref().is_some_and(|m| !m.deferred.is_empty())
    }

    fn has_rdv(&self) -> bool {
        !self.rdv.is_empty()
    }

    /// Adds `buf` to the message with the given modes.
    #[inline]
    pub fn pack(&mut self, buf: &'p [u8], send: SendMode, recv: RecvMode) -> Result<()> {
        let modes = Modes { send, recv };
        self.tx.packs += 1;
        if send != SendMode::Later && self.fits_now(buf.len()) {
            // The path of small packs: copied into the message being filled, nothing else.
            self.append_inline(buf, modes);
            return Ok(());
        }
        self.pack_other(buf, modes)
    }

    /// Packs what does not go whole into the message being filled now.
    #[inline(never)]
    fn pack_other(&mut self, buf: &'p [u8], modes: Modes) -> Result<()> {
        let send = modes.send;
        // A borrowed pack larger than a pipe message waits for the message's end too: how the
        // message ends decides how it goes (`end_packing_nowait` must not leave it waiting for
        // room in the receiver's bulk ring), and it is the packer's until then anyway.
        let large = buf.len() > self.conn.max_msg - 3 * wire::HEADER;
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
    fn emit_borrowed(&mut self, buf: &'p [u8], modes: Modes) -> Result<()> {
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
    fn send_pending(&mut self, end: bool) -> Result<()> {
        let Some((buf, modes)) = self.more.as_mut().and_then(|m| m.pending_bulk.take()) else { return Ok(()) };
        // SAFETY: `buf` is borrowed for 'p, the packer's life; `finish` waits until every
        // chunk written from it completed before the registration is dropped.
        let (reg, tokens, took) = unsafe { self.send_bulk(buf, modes, end) }?;
        let more = self.more();
        more.bulk_tokens.extend(tokens);
        more.bulk_regs.push(reg);
        if !took.is_zero() {
            more.timed.0 += buf.len();
            more.timed.1 += took;
        }
        Ok(())
    }

    /// Sends a pack whose buffer may be reused as soon as this returns.
    fn emit(&mut self, buf: &[u8], modes: Modes) -> Result<()> {
        self.send_pending(false)?;
        let route = self.route(buf.len());
        self.emit_by(buf, modes, route)
    }

    fn emit_by(&mut self, buf: &[u8], modes: Modes, route: Route) -> Result<()> {
        match route {
            Route::Rendezvous => self.rendezvous(buf, modes),
            Route::Bulk => {
                // SAFETY: `buf` outlives this call, which waits for its chunks before returning
                // and dropping the registration.
                let (_reg, mut tokens, took) = unsafe { self.send_bulk(buf, modes, false) }?;
                let waiting = (!took.is_zero()).then(std::time::Instant::now);
                self.conn.wait_tokens(&mut tokens, self.ch.session.cfg.patience())?;
                if let Some(t) = waiting {
                    self.timed_copy(buf.len(), took + t.elapsed());
                }
                Ok(())
            }
            Route::Inline => self.inline(buf, modes),
        }
    }

    /// How a pack of `len` bytes travels: by rendezvous from the connection's crossover on,
    /// else by the bulk lane if it is more than fits one pipe message, else inline.
    fn route(&mut self, len: usize) -> Route {
        let large = len >= AdaptiveCrossover::MIN_PACK.min(self.conn.threshold);
        // (Packs from the probed threshold on always go zero-copy: no clock read for them.)
        let crossover = &mut self.tx.crossover;
        if large && (len >= crossover.probed() || crossover.zero_copy(len, std::time::Instant::now())) {
            Route::Rendezvous
        } else if self.conn.bulk_chunk > 0 && len > self.conn.max_msg - 3 * wire::HEADER {
            Route::Bulk
        } else {
            Route::Inline
        }
    }

    /// Tells the crossover that handing `bytes` of bulk packs over took `took`: from their
    /// first chunk's copy until their last chunk completed (a chunk the provider could not
    /// write at once is written later, while the packer waits for it, and that time is part
    /// of what copying costs).
    fn timed_copy(&mut self, bytes: usize, took: std::time::Duration) {
        self.tx.crossover.on_copy(bytes, took, std::time::Instant::now());
    }

    /// Writes `buf` as a bulk pack: its `Bulk` record, with the records packed before it,
    /// leads its first chunk, and with `end` the message's `End` closes its last, so a message
    /// of bulk packs travels as bulk chunks alone (no pipe message that the next message's
    /// chunks would have to wait behind). Returns its registration, the chunks' tokens and the
    /// time their hand-over took so far, for the crossover (zero for a pack it does not time).
    ///
    /// # Safety
    /// `buf` must stay mapped and unchanged, and the registration alive, until every token
    /// completed.
    unsafe fn send_bulk<'r>(
        &mut self,
        buf: &[u8],
        modes: Modes,
        end: bool,
    ) -> Result<(Registration<'r>, Vec<u64>, std::time::Duration)>
    where
        'p: 'r,
    {
        // SAFETY: the caller keeps `buf` mapped for as long as the registration lives.
        let reg: Registration<'r> =
            unsafe { self.ch.session.regcache.get_raw(buf.as_ptr() as u64, buf.len() as u64, AccessFlags::NONE) }?;
        if self.tx.agg.len() + 2 * wire::HEADER > self.conn.bulk_frame {
            self.flush_agg()?;
        }
        Record::Bulk { modes, total: buf.len() as u64 }.encode(&mut self.tx.agg);
        let mut tail = SmallVec::<[u8; wire::HEADER]>::new();
        if end {
            tail.extend_from_slice(&Record::End { packs: self.tx.packs }.header());
        }
        let head = std::mem::take(&mut self.tx.agg);
        let tokens = self.bulk_chunks(&head, buf, &reg, &tail);
        self.tx.agg = head;
        self.tx.agg.clear();
        self.tx.flushed = true;
        match tokens {
            Ok((tokens, took)) => Ok((reg, tokens, took)),
            Err(e) => {
                // Chunks posted before the failure may still be read from `buf` (a timeout
                // leaves the pipe working): keep the registration for good rather than let its
                // memory go while a transfer might use it, as a dropped packer does.
                std::mem::forget(reg);
                Err(e)
            }
        }
    }

    /// Writes `head`, `buf` (registered as `reg`) and `tail` into the peer's bulk ring, chunk
    /// by chunk (`head` in the first, `tail` in the last), waiting for ring space (while
    /// draining what arrives, so two ends sending at once never block each other). Returns
    /// the chunks' tokens (`buf` is in use until they complete) and the time the hand-over
    /// took for a pack the crossover times (zero otherwise): the copies into the ring and the
    /// waits for room in it, so that while packs follow each other it is the pace at which
    /// the receiver drains the ring, which the stores chosen also change.
    fn bulk_chunks(
        &self,
        head: &[u8],
        buf: &[u8],
        reg: &Registration<'_>,
        tail: &[u8],
    ) -> Result<(Vec<u64>, std::time::Duration)> {
        let max = self.conn.bulk_chunk;
        let started = (buf.len() >= AdaptiveCrossover::MIN_PACK).then(std::time::Instant::now);
        let streaming = self.tx.crossover.stores() == Stores::Streaming;
        let mut tokens = Vec::with_capacity(buf.len().div_ceil(max) + 1);
        let mut w = Waiter::new(self.ch.session.cfg.patience(), "waiting for room in the peer's bulk ring");
        let (mut off, mut head, mut tail_sent) = (0, head, false);
        while off < buf.len() || !tail_sent {
            let n = (max - head.len()).min(buf.len() - off);
            let last = off + n == buf.len();
            let tail_here = if last && head.len() + n + tail.len() <= max { tail } else { &[][..] };
            let piece = &buf[off..off + n];
            let sge = Sge { addr: piece.as_ptr() as u64, length: n as u32, lkey: reg.lkey() };
            loop {
                {
                    let mut io = self.conn.io();
                    io.pipe.set_bulk_streaming(streaming);
                    let sent = io.pipe.try_send_bulk_framed(head, sge, tail_here).map_err(|e| self.conn.lost(e))?;
                    if let Some(t) = sent {
                        tokens.push(t);
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
        Ok((tokens, started.map_or(std::time::Duration::ZERO, |t| t.elapsed())))
    }

    /// Whether a pack of `len` bytes goes inline, whole, into the message being filled, with
    /// nothing ahead of it (no deferred pack, no held-back bulk pack): the common case, which
    /// `pack` takes without the general path's steps.
    #[inline]
    fn fits_now(&self, len: usize) -> bool {
        self.more.as_ref().is_none_or(|m| m.deferred.is_empty() && m.pending_bulk.is_none())
            && len < self.conn.threshold
            && self.tx.agg.len() + wire::HEADER + len <= self.conn.max_msg
    }

    /// Appends a whole inline pack to the message being filled (the caller checked it fits).
    #[inline]
    fn append_inline(&mut self, buf: &[u8], modes: Modes) {
        let rec = Record::Inline { modes, len: buf.len() as u32, last: true, total: buf.len() as u64 };
        self.tx.agg.extend_from_slice(&rec.header());
        copy::extend_vec(&mut self.tx.agg, buf);
        self.tx.inline_modes = modes;
    }

    fn inline(&mut self, buf: &[u8], modes: Modes) -> Result<()> {
        if self.tx.agg.len() + wire::HEADER + buf.len() <= self.conn.max_msg {
            // The usual case: the whole pack fits the pipe message being filled.
            self.append_inline(buf, modes);
            return Ok(());
        }
        let total = buf.len() as u64;
        let mut off = 0;
        loop {
            // A record header must fit, and some data too unless little is left.
            let fits_header = self.tx.agg.len() + wire::HEADER <= self.conn.max_msg;
            let room = self.conn.max_msg.saturating_sub(self.tx.agg.len() + wire::HEADER);
            if !fits_header || room < 64.min(buf.len() - off) {
                self.flush()?;
                continue;
            }
            let n = room.min(buf.len() - off);
            let last = off + n == buf.len();
            Record::Inline { modes, len: n as u32, last, total }.encode(&mut self.tx.agg);
            self.tx.agg.extend_from_slice(&buf[off..off + n]);
            off += n;
            if last {
                return Ok(());
            }
        }
    }

    fn rendezvous(&mut self, buf: &[u8], modes: Modes) -> Result<()> {
        let (addr, len, copy) = if modes.send == SendMode::Safer {
            let c: Box<[u8]> = buf.into();
            (c.as_ptr() as u64, c.len() as u64, Some(c))
        } else {
            (buf.as_ptr() as u64, buf.len() as u64, None)
        };
        // SAFETY: the memory is either `buf`, borrowed for 'p (the packer's life, and the
        // packer waits for the receiver's release before it ends), or the copy held next to the
        // registration for as long as the registration lives.
        let reg: Registration<'p> = unsafe { self.ch.session.regcache.get_raw(addr, len, AccessFlags::REMOTE_READ) }?;
        // (Relaxed: the peer's release of it comes only after our record went out; a waiter
        // reads the count with a fence before this counter.)
        let id = self.conn.next_rdv.fetch_add(1, Ordering::Relaxed);
        let rec = Record::Rdv { modes, len, addr, rkey: reg.rkey(), id };
        if self.tx.agg.len() + rec.encoded_len() > self.conn.max_msg {
            self.flush()?;
        }
        rec.encode(&mut self.tx.agg);
        self.rdv.push(Held { id, _reg: reg, _copy: copy });
        Ok(())
    }

    /// Hands what was packed so far to the network without ending the message (packs are
    /// otherwise aggregated until a pipe message is full or `end_packing`).
    pub fn flush(&mut self) -> Result<()> {
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
    fn flush_agg(&mut self) -> Result<()> {
        if self.tx.agg.is_empty() {
            return Ok(());
        }
        self.tx.flushed = true;
        self.conn.send_msg(&self.tx.agg, self.ch.session.cfg.patience())?;
        self.tx.agg.clear();
        Ok(())
    }

    /// Completes the message: sends what was deferred, then waits until the receiver has read
    /// every zero-copy pack (after this the buffers are free).
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
        Ok(PendingSend { ch: self.ch, conn: self.conn, rdv: std::mem::take(&mut self.rdv) })
    }

    #[inline]
    fn finish(&mut self) -> Result<()> {
        self.finish_with(true)
    }

    /// Completes the message; with `wait_reads`, also waits for the receiver to read its
    /// zero-copy packs.
    #[inline]
    fn finish_with(&mut self, wait_reads: bool) -> Result<()> {
        if self.tx.finished {
            return Ok(());
        }
        self.tx.finished = true;
        if self.more.is_none() && self.rdv.is_empty() && self.tx.packs == 1 && !self.tx.flushed {
            // The commonest message: one small pack, all here, nothing else to wait for.
            self.send_one()?;
            self.tx.seq = self.tx.seq.wrapping_add(1);
            return Ok(());
        }
        self.finish_other(wait_reads)
    }

    /// Sends a message of one inline pack, whole: its bytes behind a `One` header written over
    /// the second half of its `Inline` header.
    #[inline]
    fn send_one(&mut self) -> Result<()> {
        let at = 2 * wire::HEADER - wire::ONE_HEADER;
        debug_assert!(matches!(
            wire::decode_one(&self.tx.agg, wire::HEADER),
            Ok((Record::Inline { last: true, .. }, _, n)) if n == self.tx.agg.len()
        ));
        let one = Record::one_header(self.tx.seq, self.tx.inline_modes);
        self.tx.agg[at..2 * wire::HEADER].copy_from_slice(&one);
        self.tx.flushed = true;
        self.conn.send_msg(&self.tx.agg[at..], self.ch.session.cfg.patience())?;
        self.tx.agg.clear();
        Ok(())
    }

    /// Completes any other message.
    #[inline(never)]
    fn finish_other(&mut self, wait_reads: bool) -> Result<()> {
        let deferred = self.more.as_mut().map(|m| std::mem::take(&mut m.deferred)).unwrap_or_default();
        for d in deferred {
            match d {
                Deferred::Borrowed(b, m) => self.emit_borrowed(b, m)?,
                Deferred::Owned(v, m) => self.emit(&v, m)?,
                // Read from here on: the application's writes are over (the packer ends).
                Deferred::Mutable(_, b, m) => self.emit_borrowed(b, m)?,
            }
        }
        if self.more.as_ref().is_some_and(|m| m.pending_bulk.is_some()) {
            // The last pack is bulk: the message ends in its last chunk.
            self.send_pending(true)?;
        } else if !self.tx.flushed {
            // Every record in one pipe message (a pack that did not fit whole would have
            // flushed): the message goes whole, whatever its size. The receiver then copies
            // its inline packs twice (out of the pipe, then into the unpacks' buffers), which
            // still costs less than taking its records one by one from the pipe: 0.1-0.3 us
            // less one way from 256 B to 4 KiB (stack_bench, window and rdma strategies). A
            // rendezvous travels whole too (its record is all there is to copy): the receiver
            // goes from one read to the next without two more trips to the pipe.
            if self.tx.packs == 1 && !self.has_rdv() {
                self.send_one()?;
            } else {
                // One Whole record instead of Begin .. End.
                let whole = Record::Whole { seq: self.tx.seq, packs: self.tx.packs };
                whole.write_header((&mut self.tx.agg[..wire::HEADER]).try_into().expect("a Begin header"));
            }
        } else {
            if self.tx.agg.len() + wire::HEADER > self.conn.max_msg {
                self.flush()?;
            }
            Record::End { packs: self.tx.packs }.encode(&mut self.tx.agg);
        }
        self.flush()?;
        let (mut tokens, timed) = self
            .more
            .as_mut()
            .map(|m| (std::mem::take(&mut m.bulk_tokens), std::mem::take(&mut m.timed)))
            .unwrap_or_default();
        if !tokens.is_empty() {
            let waiting = std::time::Instant::now();
            self.conn.wait_tokens(&mut tokens, self.ch.session.cfg.patience())?;
            if timed.0 > 0 {
                self.timed_copy(timed.0, timed.1 + waiting.elapsed());
            }
        }
        if let Some(more) = self.more.as_mut() {
            more.bulk_regs.clear();
        }
        if wait_reads && self.has_rdv() {
            let (conn, patience) = (self.conn, self.ch.session.cfg.patience());
            conn.wait_released(&mut self.rdv, patience)?;
        }
        self.tx.seq = self.tx.seq.wrapping_add(1);
        Ok(())
    }
}

impl Conn {
    /// Drops from `rdv` the zero-copy packs the receiver has read (its release count covers
    /// them: one load). If some are left, takes what arrived out of the pipe: a failure or the
    /// peer's close shows there, and the peer's messages must keep flowing meanwhile.
    fn take_released(&self, rdv: &mut Held1<'_>) -> Result<()> {
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
    fn wait_released(&self, rdv: &mut Held1<'_>, p: Patience) -> Result<()> {
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
    ch: &'p Channel,
    conn: &'p Conn,
    /// The zero-copy packs not read yet, with their registrations (and copies).
    rdv: Held1<'p>,
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

    fn wait_reads(&mut self) -> Result<()> {
        if self.rdv.is_empty() {
            return Ok(());
        }
        self.conn.wait_released(&mut self.rdv, self.ch.session.cfg.patience()).inspect_err(|_| self.abandon())
    }

    /// After a failure: keeps the registrations for good rather than let memory the receiver
    /// might still read go (as a dropped packer does).
    fn abandon(&mut self) {
        std::mem::forget(std::mem::take(&mut self.rdv));
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
    fn finish_dropped(&mut self) {
        if let Err(e) = self.finish() {
            log::error!("madeleine: completing a dropped message to rank {} failed: {e}", self.conn.peer);
            std::mem::forget(std::mem::take(&mut self.rdv));
            if let Some(more) = self.more.as_mut() {
                std::mem::forget(std::mem::take(&mut more.bulk_regs));
            }
        }
    }
}

/// What the record of a pack said, once checked.
enum Got {
    /// An inline pack: its first fragment's bytes are copied; more follow unless `last`.
    Inline { copied: usize, last: bool },
    /// A rendezvous or bulk record.
    Other(Record),
}

/// Why a whole message is malformed.
const WHOLE_HOLDS: &str = "a whole message holds complete inline packs and rendezvous only";

/// Why waiting for zero-copy reads failed.
struct ReadsFailed {
    error: MadError,
    /// Every read completed (in error or not): none writes into its buffer any more.
    settled: bool,
}

/// A zero-copy read in flight (RECEIVE_CHEAPER), kept until `end_unpacking`.
struct PendingRead<'u> {
    tokens: ReadTokens,
    _reg: Registration<'u>,
}

/// The posted requests of one zero-copy read still to complete (none where the provider
/// carried it out at post; one but for reads over 1 GiB).
type ReadTokens = SmallVec<[u64; 1]>;

/// Bytes of one read request: a rendezvous pack larger than this is read in several (an SGE
/// carries at most 2^31 bytes; smaller in tests, to reach the multi-request path).
const READ_CHUNK: usize = if cfg!(test) { 4096 } else { 1 << 30 };

/// A message being unpacked. Buffers unpacked `RecvMode::Cheaper` stay borrowed until
/// [`Unpacker::end_unpacking`].
pub struct Unpacker<'u> {
    ch: &'u Channel,
    conn: &'u Conn,
    /// The connection's receiving side, held until the message is complete (with the state
    /// of the message being unpacked).
    rx: Claim<'u, RecvSide>,
    /// Zero-copy reads still in flight (none on the software provider, whose reads complete
    /// at post).
    pending: Vec<PendingRead<'u>>,
    /// The first mismatch found in the message, and the message's sequence number (reported
    /// to the sender by [`Unpacker::report`]).
    note: Cell<Option<(Mismatch, u32)>>,
}

/// What differs between a message as packed and as unpacked: found by the receiver, reported
/// to it as [`MadError::Mismatch`] and to the sender, out of band, as a pipe notice (see
/// [`Mismatch::words`]), which the sender's next `begin_packing` to that rank returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mismatch {
    /// The receiver asked for more packs than the sender packed.
    ExtraUnpack { packs: u32 },
    /// The receiver unpacked fewer packs than the sender packed.
    Count { packs: u32, unpacks: u32 },
    /// Pack `pack` was `sent` bytes, unpacked into `asked`.
    Size { pack: u32, sent: u64, asked: u64 },
    /// Pack `pack` was sent with other modes than unpacked.
    Modes { pack: u32, sent: Modes, asked: Modes },
}

impl Mismatch {
    fn describe(&self) -> String {
        match *self {
            Mismatch::ExtraUnpack { packs } => format!("the sender packed {packs} items, the receiver asked for more"),
            Mismatch::Count { packs, unpacks } => {
                format!("the sender packed {packs} items, the receiver unpacked {unpacks}")
            }
            Mismatch::Size { pack, sent, asked } => format!("pack {pack} has {sent} bytes, unpacked into {asked}"),
            Mismatch::Modes { pack, sent, asked } => format!("pack {pack} was sent {sent:?}, unpacked {asked:?}"),
        }
    }

    /// The notice's first words: kind and pack, what was sent, what was asked.
    fn words(&self) -> [u64; 3] {
        let (kind, pack, sent, asked) = match *self {
            Mismatch::ExtraUnpack { packs } => (1, 0, packs as u64, 0),
            Mismatch::Count { packs, unpacks } => (2, 0, packs as u64, unpacks as u64),
            Mismatch::Size { pack, sent, asked } => (3, pack, sent, asked),
            Mismatch::Modes { pack, sent, asked } => (4, pack, sent.code() as u64, asked.code() as u64),
        };
        [kind << 32 | pack as u64, sent, asked]
    }

    /// The mismatch a notice's words describe (None if they are not one: a bad peer).
    fn from_words(w: [u64; 3]) -> Option<Mismatch> {
        let (kind, pack) = (w[0] >> 32, w[0] as u32);
        let modes = |x: u64| u8::try_from(x).ok().and_then(Modes::from_code);
        Some(match kind {
            1 => Mismatch::ExtraUnpack { packs: u32::try_from(w[1]).ok()? },
            2 => Mismatch::Count { packs: u32::try_from(w[1]).ok()?, unpacks: u32::try_from(w[2]).ok()? },
            3 => Mismatch::Size { pack, sent: w[1], asked: w[2] },
            4 => Mismatch::Modes { pack, sent: modes(w[1])?, asked: modes(w[2])? },
            _ => return None,
        })
    }
}

/// A message that came whole (its packs' records are in the receiving side's buffer): how
/// far they were unpacked.
#[derive(Clone, Copy)]
struct WholeMsg {
    at: usize,
    /// Records taken (by unpacks, matching or not).
    taken: u32,
    packs: u32,
    /// A `One` message: the pack's modes (the buffer holds its bytes alone).
    single: Option<Modes>,
}

impl<'u> Unpacker<'u> {
    /// The sender's rank.
    pub fn source(&self) -> usize {
        self.conn.peer
    }

    /// The receiver's error for `m`, noted for the sender ([`Unpacker::report`]).
    fn mismatch(&self, m: Mismatch) -> MadError {
        if self.note.get().is_none() {
            self.note.set(Some((m, self.rx.seq)));
        }
        MadError::Mismatch { rank: self.conn.peer, why: m.describe() }
    }

    /// Where an unpacker's error leaves the API: a mismatch is told to the sender (the
    /// message's sequence number and what differs, in the pipe's notice slot: out of band, so
    /// that it reaches the sender whatever it does next); a protocol error fails the
    /// connection.
    fn report(&mut self, e: MadError) -> MadError {
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
    fn next_record_with<R>(&self, how: Pump, f: impl FnOnce(Next<'_>) -> R) -> Result<R> {
        let mut w = Waiter::new(self.ch.session.cfg.patience(), "waiting for message data");
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
    fn take_next(&mut self, buf: &mut [u8], asked: Modes) -> Result<Got> {
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
    fn take_pack(&mut self, buf: &mut [u8], asked: Modes) -> Result<Got> {
        if let Some(packs) = self.rx.end {
            return Err(self.mismatch(Mismatch::ExtraUnpack { packs }));
        }
        let mut w = Waiter::new(self.ch.session.cfg.patience(), "waiting for message data");
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
    fn take_rdv(&mut self, r: Record, asked: Modes, len: usize) -> Result<Got> {
        let Record::Rdv { modes, len: sent_len, id, .. } = r else { unreachable!("a rendezvous record") };
        self.note_rdv(id)?;
        self.check(modes, sent_len, asked, len)?;
        Ok(Got::Other(r))
    }

    /// Takes the next pack of a message that came whole: an inline pack is copied into `buf`
    /// (all of it), a rendezvous record is returned for its read.
    fn take_whole_pack(&mut self, buf: &mut [u8], asked: Modes) -> Result<Got> {
        let mut w = self.rx.whole.expect("a whole message");
        let whole_pack = Got::Inline { copied: buf.len(), last: true };
        if let Some(sent) = w.single {
            if w.taken == 1 {
                return Err(self.mismatch(Mismatch::ExtraUnpack { packs: 1 }));
            }
            self.rx.whole = Some(WholeMsg { taken: 1, ..w });
            self.check(sent, self.rx.body.len() as u64, asked, buf.len())?;
            copy_slice(buf, &self.rx.body);
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

    /// The pack count of a message that came whole, checked against its records; counts the
    /// packs nobody unpacked into `extra`, and the rendezvous among them into `unread`.
    fn whole_end(&self, w: &WholeMsg, extra: &mut u32, unread: &mut Vec<u32>) -> Result<u32> {
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
                Record::Rdv { id, .. } => unread.push(id),
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
    fn read_bulk(&mut self, buf: &mut [u8]) -> Result<()> {
        let mut off = 0;
        let mut w = Waiter::new(self.ch.session.cfg.patience(), "waiting for bulk data");
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
                            copy_slice(&mut buf[off..off + n], &m[..n]);
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
            }
            if !progressed {
                w.pause_on(&[self.conn])?;
            }
        }
        Ok(())
    }

    fn bad(&self, why: &str) -> MadError {
        MadError::Protocol { rank: self.conn.peer, why: why.into() }
    }

    /// Extracts the next pack into `buf`; with `RecvMode::Express` the data is there when this
    /// returns, with `RecvMode::Cheaper` after `end_unpacking`.
    #[inline]
    pub fn unpack(&mut self, buf: &'u mut [u8], send: SendMode, recv: RecvMode) -> Result<()> {
        let modes = Modes { send, recv };
        if self.take_single(buf, modes) {
            return Ok(());
        }
        self.unpack_into(buf, modes).map_err(|e| self.report(e))
    }

    /// The unpack of a message of one small pack that matches it (the commonest message):
    /// copies it out, or returns `false` for the general path (which also reports mismatches).
    #[inline]
    fn take_single(&mut self, buf: &mut [u8], modes: Modes) -> bool {
        let rx = &mut *self.rx;
        match rx.whole {
            Some(w @ WholeMsg { single: Some(sent), taken: 0, .. }) if sent == modes && rx.body.len() == buf.len() => {
                rx.unpacks += 1;
                rx.whole = Some(WholeMsg { taken: 1, ..w });
                copy_slice(buf, &rx.body);
                true
            }
            _ => false,
        }
    }

    /// Extracts the next pack (which must have been packed `RecvMode::Express`) into `buf`;
    /// `buf` need not outlive the unpacker.
    pub fn unpack_express(&mut self, buf: &mut [u8], send: SendMode) -> Result<()> {
        // SAFETY-free: an Express unpack completes before returning, so the borrow may end here.
        let modes = Modes { send, recv: RecvMode::Express };
        if self.take_single(buf, modes) {
            return Ok(());
        }
        self.unpack_now(buf, modes).map_err(|e| self.report(e))
    }

    fn unpack_into(&mut self, buf: &'u mut [u8], modes: Modes) -> Result<()> {
        if modes.recv == RecvMode::Express {
            return self.unpack_now(buf, modes);
        }
        self.rx.unpacks += 1;
        match self.take_next(buf, modes)? {
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

    fn unpack_now(&mut self, buf: &mut [u8], modes: Modes) -> Result<()> {
        self.rx.unpacks += 1;
        match self.take_next(buf, modes)? {
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
    fn note_rdv(&mut self, id: u32) -> Result<()> {
        let due = self.rx.rdv_next;
        if id != due {
            return Err(self.bad(&format!("rendezvous {id} where {due} was due")));
        }
        self.rx.rdv_next = due.wrapping_add(1);
        Ok(())
    }

    /// After a read of the message's last pack, all reads done: releases the sender's
    /// zero-copy buffers now rather than at `end_unpacking` (a sender waiting for them, or
    /// streaming with a bounded number of pending sends, goes on that much sooner).
    fn release_if_last(&mut self) -> Result<()> {
        let last = match self.rx.whole {
            Some(w) => w.taken == w.packs,
            None => self.rx.end == Some(self.rx.unpacks),
        };
        if last && self.pending.is_empty() {
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
    fn release(&mut self) -> Result<()> {
        let n = self.rx.rdv_next;
        if n == self.rx.rdv_released {
            return Ok(());
        }
        self.rx.rdv_released = n;
        self.conn.io().pipe.release_to(n as u64).map_err(|e| self.conn.lost(e))
    }

    /// Copies the rest of a pack that goes by copy (inline fragments or bulk data) into `buf`.
    fn complete_copy(&mut self, buf: &mut [u8], got: Got) -> Result<()> {
        match got {
            Got::Inline { copied, last } => self.copy_fragments(buf, copied, last),
            Got::Other(_) => self.read_bulk(buf),
        }
    }

    fn check(&self, sent: Modes, sent_len: u64, asked: Modes, len: usize) -> Result<()> {
        let pack = self.rx.unpacks;
        if sent != asked {
            return Err(self.mismatch(Mismatch::Modes { pack, sent, asked }));
        }
        if sent_len != len as u64 {
            return Err(self.mismatch(Mismatch::Size { pack, sent: sent_len, asked: len as u64 }));
        }
        Ok(())
    }

    fn unexpected(&self, r: Record) -> MadError {
        match r {
            Record::End { packs } => self.mismatch(Mismatch::ExtraUnpack { packs }),
            _ => MadError::Protocol { rank: self.conn.peer, why: "record out of place".into() },
        }
    }

    /// Copies an inline pack's further fragments into `buf` (the first `off` bytes are there).
    fn copy_fragments(&mut self, buf: &mut [u8], mut off: usize, mut last: bool) -> Result<()> {
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
    fn start_read<'b>(&self, buf: &'b mut [u8], addr: u64, rkey: u32) -> Result<(ReadTokens, Registration<'b>)>
    where
        'u: 'b,
    {
        if buf.is_empty() {
            return Err(MadError::Protocol { rank: self.conn.peer, why: "empty rendezvous".into() });
        }
        // SAFETY: `buf` is borrowed for 'b, which the registration does not outlive; the read
        // completes before the registration is dropped (waited for in `wait_read` or
        // `end_unpacking`).
        let reg = unsafe {
            self.ch.session.regcache.get_raw(buf.as_ptr() as u64, buf.len() as u64, AccessFlags::LOCAL_WRITE)
        }?;
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
    fn wait_reads(&self, tokens: &[u64]) -> std::result::Result<(), ReadsFailed> {
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

    /// Waits until the read behind `token` completed: `Ok` with its outcome, `Err` if it was
    /// not seen completing within the timeout. Completions are polled even once the pipe
    /// failed (its queue pair then flushes every request).
    fn wait_read(&self, token: u64) -> Result<Result<()>> {
        let mut w = Waiter::new(self.ch.session.cfg.patience(), "waiting for a zero-copy read");
        let mut polls = 0u32;
        loop {
            polls = polls.wrapping_add(1);
            {
                let mut io = self.conn.io();
                // Mostly a look at the completion queue; now and then a whole pass, so that a
                // long read does not hold the pipe's flow control up.
                if polls.is_multiple_of(16) {
                    let _ = io.pipe.progress();
                }
                match io.pipe.settle_user(token) {
                    Some(WcStatus::Success) => return Ok(Ok(())),
                    // A read flushed by the pipe's failure: the failure says why.
                    Some(st) => {
                        let why =
                            io.pipe.failure().map_or_else(|| format!("zero-copy read failed: {st:?}"), str::to_owned);
                        return Ok(Err(self.conn.lost(why)));
                    }
                    None => {}
                }
            }
            w.pause_on(&[self.conn])?;
        }
    }

    /// Completes the message: waits for `RecvMode::Cheaper` data, checks that the sender packed
    /// exactly what was unpacked, and tells the sender its zero-copy buffers are free.
    #[inline]
    pub fn end_unpacking(mut self) -> Result<()> {
        let rx = &mut *self.rx;
        if !rx.finished
            && rx.rdv_next == rx.rdv_released
            && self.pending.is_empty()
            && rx.unpacks == 1
            && matches!(rx.whole, Some(WholeMsg { single: Some(_), taken: 1, .. }))
        {
            // A message of one small pack, unpacked: nothing to wait for or check.
            rx.finished = true;
            rx.seq = rx.seq.wrapping_add(1);
            return Ok(());
        }
        self.finish().map_err(|e| self.report(e))
    }

    fn finish(&mut self) -> Result<()> {
        if self.rx.finished {
            return Ok(());
        }
        self.rx.finished = true;
        // Every read is waited for even past a failed one (each keeps its registration until
        // it completed); one not seen completing keeps it for good, and so do the reads after
        // it, not waited for (the pipe is stuck: each would wait out the timeout again).
        let mut result = Ok(());
        let mut pending = std::mem::take(&mut self.pending).into_iter();
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
        let packs = match (&self.rx.whole, self.rx.end) {
            (Some(w), _) => self.whole_end(w, &mut extra, &mut unread)?,
            (None, Some(packs)) => packs,
            (None, None) => self.find_end(&mut extra, &mut unread)?,
        };
        for id in unread {
            self.note_rdv(id)?;
        }
        self.release()?;
        let counted = if packs != self.rx.unpacks || extra > 0 {
            Err(self.mismatch(Mismatch::Count { packs, unpacks: self.rx.unpacks }))
        } else {
            Ok(())
        };
        self.rx.seq = self.rx.seq.wrapping_add(1);
        counted
    }

    /// Reads up to the message's `End`, counting the packs nobody unpacked (`extra`) and the
    /// rendezvous among them (`unread`, whose senders must be released all the same).
    fn find_end(&self, extra: &mut u32, unread: &mut Vec<u32>) -> Result<u32> {
        loop {
            let step = self.next_record_with(Pump::Drain, |n| match n {
                Next::Rec(Record::End { packs }, _) => Ok(Some(packs)),
                Next::Rec(Record::Bulk { .. }, _) => {
                    *extra += 1;
                    Ok(None)
                }
                Next::BulkData(_) => Ok(None),
                Next::Rec(Record::Rdv { id, .. }, _) => {
                    *extra += 1;
                    unread.push(id); // release the sender even though nobody reads it
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
    fn finish_dropped(&mut self) {
        if let Err(e) = self.finish().map_err(|e| self.report(e)) {
            log::error!("madeleine: completing a dropped unpack from rank {} failed: {e}", self.conn.peer);
            std::mem::forget(std::mem::take(&mut self.pending));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the sender reads of a report is what the receiver found; words no receiver
    /// writes are refused, not misread.
    #[test]
    fn mismatch_reports_round_trip_and_bad_words_are_refused() {
        let m = |send, recv| Modes { send, recv };
        for x in [
            Mismatch::ExtraUnpack { packs: 3 },
            Mismatch::Count { packs: 2, unpacks: 1 },
            Mismatch::Size { pack: 7, sent: 1 << 40, asked: 5 },
            Mismatch::Modes {
                pack: 1,
                sent: m(SendMode::Later, RecvMode::Cheaper),
                asked: m(SendMode::Safer, RecvMode::Express),
            },
        ] {
            assert_eq!(Mismatch::from_words(x.words()), Some(x));
        }
        assert_eq!(Mismatch::from_words([9 << 32, 0, 0]), None);
        assert_eq!(Mismatch::from_words([1 << 32, 1 << 33, 0]), None);
        assert_eq!(Mismatch::from_words([4 << 32, 200, 0]), None);
    }
    use crate::{Session, SessionConfig};
    use std::time::Duration;

    /// Runs `f(rank, channel)` on three ranks (threads, each with its own session).
    fn trio(tag: &str, f: impl Fn(usize, &Channel) + Sync) {
        let dir = std::env::temp_dir().join(format!("mad-unit-{tag}-{}", std::process::id()));
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|rank| {
                    let (dir, f) = (dir.clone(), &f);
                    s.spawn(move || {
                        let mut cfg = SessionConfig::new(rank, 3, dir);
                        cfg.timeout = Duration::from_secs(10);
                        cfg.wait_limit = Some(Duration::from_secs(10));
                        let session = Session::new(cfg).unwrap();
                        let ch = session.channel().unwrap();
                        f(rank, &ch);
                        // Keep the session up until everyone is done with it.
                        let ctl = session.channel().unwrap();
                        if rank == 0 {
                            for r in [1, 2] {
                                ctl.begin_unpacking_from(r).unwrap().end_unpacking().unwrap();
                            }
                        } else {
                            ctl.begin_packing(0).unwrap().end_packing().unwrap();
                        }
                    })
                })
                .collect();
            for h in hs {
                h.join().unwrap();
            }
        });
        let _ = std::fs::remove_dir_all(dir);
    }

    fn encoded(recs: &[(Record, &[u8])]) -> Vec<u8> {
        let mut m = Vec::new();
        for (r, d) in recs {
            r.encode(&mut m);
            m.extend_from_slice(d);
        }
        m
    }

    /// What a peer sending `raw` as one pipe message does to rank 0's connection to it: the
    /// error rank 0 gets, after which its connection to rank 2 must still carry messages.
    fn malformed(tag: &str, raw: Vec<u8>, unpacks: usize) -> MadError {
        let got = std::sync::Mutex::new(None);
        trio(tag, |rank, ch| match rank {
            0 => {
                let r = (|| {
                    let mut u = ch.begin_unpacking_from(1)?;
                    for _ in 0..unpacks {
                        let mut b = [0u8; 8];
                        u.unpack_express(&mut b, SendMode::Cheaper)?;
                    }
                    u.end_unpacking()
                })();
                *got.lock().unwrap() = Some(r.expect_err("malformed data accepted"));
                // The connection stays failed...
                assert!(ch.begin_unpacking_from(1).is_err());
                // ...and the others work.
                let mut u = ch.begin_unpacking_from(2).unwrap();
                let mut b = [0u8; 4];
                u.unpack_express(&mut b, SendMode::Safer).unwrap();
                u.end_unpacking().unwrap();
                assert_eq!(b, [1, 2, 3, 4]);
            }
            1 => ch.conn(0).unwrap().send_msg(&raw, ch.session.cfg.patience()).unwrap(),
            _ => {
                let mut p = ch.begin_packing(0).unwrap();
                p.pack_safer(&[1, 2, 3, 4], RecvMode::Express).unwrap();
                p.end_packing().unwrap();
            }
        });
        got.into_inner().unwrap().unwrap()
    }

    const EXPRESS: Modes = Modes { send: SendMode::Cheaper, recv: RecvMode::Express };

    #[test]
    fn malformed_peer_data_fails_that_connection_only() {
        let cases: Vec<(&str, Vec<u8>, usize)> = vec![
            ("unknown-tag", vec![9; 16], 0),
            ("short-header", vec![1, 0, 0], 0),
            (
                "fragment-past-message",
                {
                    let mut m = encoded(&[(Record::Begin { seq: 0 }, &[])]);
                    Record::Inline { modes: EXPRESS, len: 64, last: true, total: 64 }.encode(&mut m);
                    m.extend_from_slice(&[0; 8]);
                    m
                },
                1,
            ),
            (
                "fragments-short-of-pack",
                encoded(&[
                    (Record::Begin { seq: 0 }, &[]),
                    (Record::Inline { modes: EXPRESS, len: 4, last: true, total: 8 }, &[0; 4]),
                    (Record::End { packs: 1 }, &[]),
                ]),
                1,
            ),
            ("data-outside-a-message", encoded(&[(Record::End { packs: 0 }, &[])]), 0),
            ("wrong-sequence-number", encoded(&[(Record::Begin { seq: 7 }, &[])]), 0),
            ("one-pack-wrong-sequence-number", encoded(&[(Record::One { seq: 7, modes: EXPRESS }, &[0; 8])]), 0),
            ("one-pack-bad-modes", vec![8, 0xff, 0, 0, 0, 0, 0, 0, 1, 2, 3], 0),
            ("one-pack-short-header", vec![8, 0, 0, 0, 0], 0),
            (
                "fragment-in-a-whole-message",
                encoded(&[
                    (Record::Whole { seq: 0, packs: 1 }, &[]),
                    (Record::Inline { modes: EXPRESS, len: 4, last: false, total: 8 }, &[0; 4]),
                ]),
                1,
            ),
            (
                "bulk-in-a-whole-message",
                encoded(&[(Record::Whole { seq: 0, packs: 1 }, &[]), (Record::Bulk { modes: EXPRESS, total: 8 }, &[])]),
                1,
            ),
            (
                "rendezvous-out-of-order-in-a-whole-message",
                encoded(&[
                    (Record::Whole { seq: 0, packs: 1 }, &[]),
                    (Record::Rdv { modes: EXPRESS, len: 8, addr: 0x1000, rkey: 1, id: 3 }, &[]),
                ]),
                1,
            ),
            (
                "unread-rendezvous-out-of-order-in-a-whole-message",
                encoded(&[
                    (Record::Whole { seq: 0, packs: 1 }, &[]),
                    (Record::Rdv { modes: EXPRESS, len: 8, addr: 0x1000, rkey: 1, id: 3 }, &[]),
                ]),
                0,
            ),
            (
                "whole-message-pack-count-off",
                encoded(&[
                    (Record::Whole { seq: 0, packs: 2 }, &[]),
                    (Record::Inline { modes: EXPRESS, len: 8, last: true, total: 8 }, &[0; 8]),
                ]),
                1,
            ),
            (
                "bulk-not-last",
                encoded(&[
                    (Record::Begin { seq: 0 }, &[]),
                    (Record::Bulk { modes: EXPRESS, total: 8 }, &[]),
                    (Record::End { packs: 1 }, &[]),
                ]),
                1,
            ),
            // Rendezvous come numbered from 0 in the order their sender issued them.
            (
                "rendezvous-out-of-order",
                encoded(&[
                    (Record::Begin { seq: 0 }, &[]),
                    (Record::Rdv { modes: EXPRESS, len: 8, addr: 0x1000, rkey: 1, id: 5 }, &[]),
                    (Record::End { packs: 1 }, &[]),
                ]),
                1,
            ),
            // The tag a `Fin` had.
            ("retired-tag", vec![5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], 0),
        ];
        for (tag, raw, unpacks) in cases {
            let e = malformed(tag, raw, unpacks);
            assert!(matches!(e, MadError::Protocol { rank: 1, .. }), "{tag}: {e}");
        }
    }

    #[test]
    fn release_counts_may_only_move_forward_up_to_what_was_issued() {
        assert_eq!(released(0, 0, 0).ok(), Some(0));
        assert_eq!(released(0, 2, 3).ok(), Some(2));
        assert_eq!(released(2, 3, 3).ok(), Some(3));
        assert!(released(0, 4, 3).is_err(), "past what was issued");
        assert!(released(2, 1, 3).is_err(), "back");
        assert!(released(0, 1, 0).is_err(), "nothing issued");
        // Across the wrap of the counters.
        assert_eq!(released(u32::MAX - 1, 1, 2).ok(), Some(1));
        assert!(released(u32::MAX - 1, 3, 2).is_err());
        assert!(is_released(3, 2) && !is_released(3, 3) && !is_released(3, 4));
        assert!(is_released(1, u32::MAX) && is_released(0, u32::MAX) && !is_released(u32::MAX, u32::MAX));
    }

    /// A peer that says it read rendezvous we never issued fails that connection only.
    #[test]
    fn a_release_count_past_what_was_issued_fails_that_connection_only() {
        trio("release-past", |rank, ch| match rank {
            0 => {
                // Rank 1 said it read 5 before we issued any: our first rendezvous sees it.
                let buf = vec![3u8; 4096];
                let mut p = ch.begin_packing(1).unwrap();
                p.tx.packs += 1;
                p.emit_by(&buf, Modes { send: SendMode::Cheaper, recv: RecvMode::Cheaper }, Route::Rendezvous).unwrap();
                let e = p.end_packing().expect_err("a release of rendezvous never issued accepted");
                assert!(matches!(e, MadError::Protocol { rank: 1, .. }), "{e}");
                let mut p = ch.begin_packing(2).unwrap();
                p.pack_safer(&[1, 2, 3, 4], RecvMode::Express).unwrap();
                p.end_packing().unwrap();
            }
            1 => {
                ch.conn(0).unwrap().io().pipe.release_to(5).unwrap();
                // Rank 0's message still comes. Left unfinished (forgotten): finishing it would
                // release the rendezvous in it, overwriting the bogus count before rank 0 looked.
                if let Ok(u) = ch.begin_unpacking_from(0) {
                    std::mem::forget(u);
                }
            }
            _ => {
                let mut u = ch.begin_unpacking_from(0).unwrap();
                let mut b = [0u8; 4];
                u.unpack_express(&mut b, SendMode::Safer).unwrap();
                u.end_unpacking().unwrap();
                assert_eq!(b, [1, 2, 3, 4]);
            }
        });
    }

    /// A rendezvous pack longer than one read request is read in several (`READ_CHUNK`, 4 KiB
    /// in unit tests), each from its own part of the sender's buffer; one to memory the sender
    /// never registered fails, every request of it waited for.
    #[test]
    fn rendezvous_packs_are_read_in_requests_of_read_chunk_bytes() {
        let len = 5 * READ_CHUNK / 2;
        let body: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
        let cheaper = Modes { send: SendMode::Cheaper, recv: RecvMode::Cheaper };
        trio("read-chunks", |rank, ch| match rank {
            1 => {
                for _ in 0..2 {
                    let mut p = ch.begin_packing(0).unwrap();
                    p.tx.packs += 1;
                    p.emit_by(&body, cheaper, Route::Rendezvous).unwrap();
                    p.end_packing().unwrap();
                }
            }
            0 => {
                for _ in 0..2 {
                    let mut got = vec![0u8; len];
                    let mut u = ch.begin_unpacking_from(1).unwrap();
                    u.unpack(&mut got, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
                    u.end_unpacking().unwrap();
                    assert!(got == body, "a chunked read differs");
                }
                let mut got = vec![0u8; len];
                let r = (|| {
                    let mut u = ch.begin_unpacking_from(2)?;
                    u.unpack(&mut got, SendMode::Cheaper, RecvMode::Cheaper)?;
                    u.end_unpacking()
                })();
                assert!(matches!(r, Err(MadError::PeerLost { rank: 2, .. })), "{r:?}");
                // Every request of the failed read was waited for, not only the first.
                assert_eq!(ch.conn(2).unwrap().io().pipe.user_unsettled(), 0);
            }
            _ => {
                let rdv = Record::Rdv { modes: cheaper, len: len as u64, addr: 0x10000, rkey: 0xdead, id: 0 };
                let raw = encoded(&[(Record::Whole { seq: 0, packs: 1 }, &[]), (rdv, &[])]);
                ch.conn(0).unwrap().send_msg(&raw, ch.session.cfg.patience()).unwrap();
            }
        });
    }

    #[test]
    fn a_rendezvous_to_memory_the_peer_never_registered_fails_that_connection_only() {
        let rdv = Record::Rdv { modes: EXPRESS, len: 8, addr: 0x1000, rkey: 0xdead, id: 0 };
        let raw = encoded(&[(Record::Begin { seq: 0 }, &[]), (rdv, &[]), (Record::End { packs: 1 }, &[])]);
        let e = malformed("unknown-buffer", raw, 1);
        assert!(matches!(e, MadError::PeerLost { rank: 1, .. }), "{e}");
        let raw = encoded(&[(Record::Whole { seq: 0, packs: 1 }, &[]), (rdv, &[])]);
        let e = malformed("unknown-buffer-whole", raw, 1);
        assert!(matches!(e, MadError::PeerLost { rank: 1, .. }), "{e}");
    }
}
