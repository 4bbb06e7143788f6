//! One connection's driver: the thin code between [`Proto`] and the connection's message pipe.
//! It sends the control messages the protocol decides as pipe messages, posts its data writes
//! on the pipe's queue pair, each followed by its note, feeds the protocol what arrives, copies
//! what it says to copy, and turns its completions into events on the queues the operations
//! named.
//!
//! Why a pipe rather than SENDs into posted slots: on one host the pipe stores a message
//! straight into the peer's ring, where the peer's poll finds it (no request, no receive, no
//! completion); across hosts and on hardware it writes it with one RDMA write. A data write
//! posted before a message is placed before it (the pipe posts its frames behind requests in
//! flight), so a note needs no immediate.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use portability_verbs::datapath::pipe::{Lane, MsgPipe};
use portability_verbs::sync::{SpinGuard, SpinLock};
use portability_verbs::{CompletionQueue, MemoryRegion, SendWr, Sge, WcStatus};

use super::engine::{self, Progress};
use super::error::{ExsError, ExsResult};
use super::memory::InFlight;
use super::proto::{Action, CopySrc, Done, Errno, LoneReply, OpKind, Piece, Proto, ProtoConfig, Record};
use super::queue::{Event, EventKind, EventQueue, LastHandle};
use super::wire::{self, Advert, Control, Hello, Message, WriteNote, DATA_OVERHEAD, HEADER};

/// Data writes a connection keeps in flight at most (more wait in its backlog).
const WRITE_DEPTH: usize = 256;
/// Send requests a connection's queue pair holds: its data writes and the pipe's own.
pub(crate) const SEND_DEPTH: u32 = 2 * WRITE_DEPTH as u32;
/// How long bytes wait for an advertisement after a rejection before they go into the peer's
/// stream buffer after all ([`Proto::ring_waiting`]): a receiver with receives waiting
/// advertises them again within microseconds.
const RING_WAIT: Duration = Duration::from_micros(50);
/// How long a closed connection waits for the peer's Close before it is torn down.
const LINGER: Duration = Duration::from_secs(10);

/// Where an operation reports: a queue, and the socket `S` its event names.
pub(crate) struct Op<S> {
    pub(crate) req: u64,
    pub(crate) kind: EventKind,
    /// The queue and the socket the event names; `None` for the close of a socket the
    /// application dropped.
    pub(crate) target: Option<(EventQueue<S>, S)>,
    pub(crate) hold: Option<InFlight>,
}

/// What waits for room in the pipe or the send queue, in order.
enum Pending {
    /// An action of the protocol's.
    Action(Action),
    /// The note of a data write already posted.
    Note(WriteNote),
}

/// A data write in flight: the pipe's token, and the send it belongs to.
struct WriteInFlight {
    token: u64,
    send: u64,
}

struct State<S> {
    proto: Proto,
    pipe: MsgPipe,
    /// Our stream buffer (SOCK_STREAM with one).
    ring: Option<MemoryRegion>,
    /// Operations in flight, by token (a slab: tokens are reused once reported).
    ops: Vec<Option<Op<S>>>,
    free_ops: Vec<u64>,
    live_ops: usize,
    backlog: VecDeque<Pending>,
    writes: VecDeque<WriteInFlight>,
    inline_max: u32,
    /// Where a control message is encoded (kept for its capacity).
    msg: Vec<u8>,
    /// Our Close left in a pipe message that may still be in flight.
    close_in_flight: bool,
    closing_since: Option<Instant>,
    /// Since when the protocol's bytes wait for an advertisement ([`RING_WAIT`]), and how many
    /// it had answered then.
    ring_wait: Option<(Instant, u64)>,
    /// Queues whose last handle an operation's report released, dropped once the lock is let
    /// go ([`EventQueue::release`]).
    last_queues: Vec<LastHandle<S>>,
}

/// A connected EXS socket's transport; its events name sockets `S` (the sockets are built on
/// connections, so a connection is generic over them instead of naming them).
pub(crate) struct Conn<S> {
    /// A spin lock, not a `Mutex`: nothing waits while holding it, and its release is a plain
    /// store, where a `Mutex`'s is an atomic read-modify-write (a full barrier on x86, taken
    /// at every operation's start and every poll).
    state: SpinLock<State<S>>,
    cq: CompletionQueue,
    finished: AtomicBool,
}

impl<S> Conn<S> {
    /// Takes over an established pipe; `ring` is our stream buffer, if any.
    pub(crate) fn new(
        pipe: MsgPipe,
        ring: Option<MemoryRegion>,
        ours: &Hello,
        peer: Hello,
        adv_credits: u32,
        inline_max: u32,
    ) -> ExsResult<Conn<S>> {
        let largest = wire::message_max(peer.small_max).max(wire::message_max(ours.small_max));
        if largest > pipe.strategy().max_message() {
            return Err(ExsError::System(
                format!("control messages of {largest} bytes over a pipe of {}", pipe.strategy().max_message()),
                libc::EINVAL,
            ));
        }
        let cfg = ProtoConfig {
            kind: ours.kind,
            msg_credits: ours.msg_credits,
            small_max: ours.small_max,
            ring_len: ours.ring_len,
            adv_credits,
            peer,
        };
        let cq = pipe.cq().clone();
        let state = State {
            proto: Proto::new(cfg),
            pipe,
            ring,
            ops: Vec::new(),
            free_ops: Vec::new(),
            live_ops: 0,
            backlog: VecDeque::new(),
            writes: VecDeque::new(),
            inline_max,
            msg: Vec::with_capacity(largest),
            close_in_flight: false,
            closing_since: None,
            ring_wait: None,
            last_queues: Vec::new(),
        };
        Ok(Conn { state: SpinLock::new(state), cq, finished: AtomicBool::new(false) })
    }

    fn lock(&self) -> SpinGuard<'_, State<S>> {
        self.state.lock()
    }

    pub(crate) fn cq(&self) -> CompletionQueue {
        self.cq.clone()
    }

    /// Done: closed and answered, or failed, with every operation reported.
    pub(crate) fn finished(&self) -> bool {
        self.finished.load(Ordering::Acquire)
    }

    /// Starts an operation: `f` hands it to the protocol under `token`; an error it returns
    /// is the call's (and the operation never happened).
    pub(crate) fn start(&self, op: Op<S>, f: impl FnOnce(&mut Proto, u64) -> Result<(), Errno>) -> ExsResult<()> {
        self.start_locked(self.lock(), op, f)
    }

    /// Starts a send of `len` bytes at `addr` (registered with `lkey`). A ping-pong's reply
    /// ([`Proto::post_lone_send`]) is sent at once, without queueing the protocol's actions
    /// and carrying them out: the turnaround between a message's arrival and its reply is
    /// what a ping-pong's latency is made of.
    pub(crate) fn start_send(&self, op: Op<S>, addr: u64, len: u64, lkey: u32) -> ExsResult<()> {
        let mut s = self.lock();
        if s.backlog.is_empty() {
            let token = s.next_token();
            if let Some(reply) = s.proto.post_lone_send(token, addr, len, lkey) {
                s.insert_op(token, op);
                s.send_lone(reply);
                self.check_finished(&s);
                unlock(s);
                return Ok(());
            }
        }
        self.start_locked(s, op, |p, token| p.post_send(token, addr, len, lkey))
    }

    fn start_locked(
        &self,
        mut s: SpinGuard<'_, State<S>>,
        op: Op<S>,
        f: impl FnOnce(&mut Proto, u64) -> Result<(), Errno>,
    ) -> ExsResult<()> {
        let token = s.next_token();
        if op.kind == EventKind::Close && s.closing_since.is_none() {
            s.closing_since = Some(Instant::now());
        }
        f(&mut s.proto, token).map_err(ExsError::Connection)?;
        // A receive's advertisement may wait for the call that usually follows (a send on this
        // connection, or a wait that polls it) to leave in the same message: only while an
        // application thread drives progress (otherwise nothing would send it before the
        // completion thread's next look).
        let hold_open = op.kind == EventKind::Recv && engine::app_drives();
        s.insert_op(token, op);
        s.run(hold_open);
        self.check_finished(&s);
        unlock(s);
        Ok(())
    }

    /// Takes what arrived and what completed, and carries out what follows; true if anything
    /// happened. Skips a connection another thread is driving.
    pub(crate) fn progress(&self) -> bool {
        let Some(mut guard) = self.state.try_lock() else { return false };
        let any = guard.take_arrivals();
        if !any && guard.quiet() {
            // Nothing arrived and nothing waits (what a busy poll finds between messages): the
            // rest of the pass has nothing to do.
            unlock(guard);
            return false;
        }
        let s = &mut *guard;
        if !s.writes.is_empty() || !s.backlog.is_empty() || s.close_in_flight {
            // Completions of our writes, room in the ring: a whole pass of the pipe.
            if let Err(e) = s.pipe.progress() {
                s.pipe_failed(&e);
            }
            s.take_write_completions();
            if s.close_in_flight && s.pipe.idle() {
                s.close_in_flight = false;
                s.proto.on_close_delivered();
            }
        }
        if !s.backlog.is_empty() || any || s.proto.has_actions() {
            s.run(false);
        }
        s.bound_ring_wait();
        if s.closing_since.is_some_and(|t| t.elapsed() > LINGER) && !s.proto.peer_closed() && s.proto.closed() {
            s.proto.fail(libc::ETIMEDOUT);
            s.run(false);
        }
        self.check_finished(s);
        unlock(guard);
        any
    }

    /// Readies the pipe for a sleep on the completion queue (see `MsgPipe::prepare_sleep`):
    /// false if the sleep should not happen (something arrived, or another thread drives the
    /// connection).
    pub(crate) fn prepare_sleep(&self) -> bool {
        let Some(mut s) = self.state.try_lock() else { return false };
        if s.proto.failure().is_some() {
            return true;
        }
        match s.pipe.prepare_sleep() {
            Ok(quiet) => quiet && s.pipe.peek_lane().is_none(),
            Err(e) => {
                s.pipe_failed(&e);
                false
            }
        }
    }

    fn check_finished(&self, s: &State<S>) {
        let done = s.live_ops == 0 && (s.proto.failure().is_some() || (s.proto.closed() && s.proto.peer_closed()));
        if done && !self.finished.swap(true, Ordering::AcqRel) {
            log::debug!("EXS connection finished");
        }
    }
}

fn errno_of(status: WcStatus) -> Errno {
    match status {
        WcStatus::RemAccessErr | WcStatus::RemInvReqErr | WcStatus::LocLenErr => libc::EPROTO,
        WcStatus::LocProtErr => libc::EFAULT,
        _ => libc::ECONNRESET,
    }
}

impl<S: Send + 'static> Progress for Conn<S> {
    fn progress(&self) -> bool {
        Conn::progress(self)
    }
    fn finished(&self) -> bool {
        Conn::finished(self)
    }
    fn prepare_sleep(&self) -> bool {
        Conn::prepare_sleep(self)
    }
    fn cq(&self) -> CompletionQueue {
        Conn::cq(self)
    }
}

impl<S> State<S> {
    /// The pipe failed (the peer vanished or broke the pipe's protocol): so does the
    /// connection, after the data writes that completed before the failure are reported.
    /// (A peer that takes our last message, closes and exits acknowledges that message's
    /// writes just before its connection ends: its sends are done, not failed.)
    fn pipe_failed(&mut self, e: &portability_verbs::VerbsError) {
        if self.proto.failure().is_none() {
            log::debug!("EXS connection failed: {e}");
            self.take_write_completions();
        }
        let errno = match e {
            portability_verbs::VerbsError::Protocol(_) => libc::EPROTO,
            _ => libc::ECONNRESET,
        };
        self.proto.fail(errno);
    }

    /// The token the next operation gets (the first free slot of `ops`).
    fn next_token(&self) -> u64 {
        self.free_ops.last().copied().unwrap_or(self.ops.len() as u64)
    }

    /// Keeps an operation that started under `token` (from [`State::next_token`]).
    fn insert_op(&mut self, token: u64, op: Op<S>) {
        if token as usize == self.ops.len() {
            self.ops.push(Some(op));
        } else {
            self.free_ops.pop();
            let free = self.ops[token as usize].replace(op);
            debug_assert!(free.is_none());
            // A `None` needs no drop (forgetting it spares the call of the slot's drop code).
            std::mem::forget(free);
        }
        self.live_ops += 1;
    }

    /// Sends a ping-pong's reply, then reports its send. What the pipe cannot take so (it has
    /// no room now, or cannot gather) is carried out as the protocol's actions would have been.
    fn send_lone(&mut self, r: LoneReply) {
        match send_fill(&mut self.pipe, r.offer.as_ref().map(|(g, ad)| (*g, ad)), r.grant, r.fill, r.truncated) {
            Ok(true) => self.report(r.done),
            Ok(false) => {
                let [send, done] = r.actions();
                self.backlog.push_back(Pending::Action(send));
                self.backlog.push_back(Pending::Action(done));
                self.run(false);
            }
            Err(e) => {
                self.pipe_failed(&e);
                let errno = self.proto.failure().unwrap_or(libc::ECONNRESET);
                self.report(Done { outcome: Err(errno), ..r.done });
                // The other operations' failures, which the protocol queued.
                self.run(false);
            }
        }
    }

    /// Whether nothing waits to be done: no write in flight, no step or action waiting, no
    /// wait for advertisements, no close under way.
    fn quiet(&self) -> bool {
        self.writes.is_empty()
            && self.backlog.is_empty()
            && !self.close_in_flight
            && !self.proto.has_actions()
            && self.ring_wait.is_none()
            && !self.proto.ring_waiting()
            && self.closing_since.is_none()
    }

    /// Ends the protocol's wait for advertisements once none was answered for [`RING_WAIT`].
    fn bound_ring_wait(&mut self) {
        if !self.proto.ring_waiting() {
            self.ring_wait = None;
            return;
        }
        let answered = self.proto.ads_answered();
        match self.ring_wait {
            Some((since, at)) if at == answered => {
                if since.elapsed() >= RING_WAIT {
                    self.ring_wait = None;
                    self.proto.resume_ring();
                    self.run(false);
                }
            }
            _ => self.ring_wait = Some((Instant::now(), answered)),
        }
    }

    /// Feeds the protocol every message that arrived; true if any did.
    fn take_arrivals(&mut self) -> bool {
        if self.proto.failure().is_some() {
            // Nothing more is taken: every operation has been reported failed.
            return false;
        }
        let mut any = false;
        loop {
            let r = match self.pipe.front() {
                Ok(Some((Lane::Message, bytes))) => {
                    any = true;
                    match Message::decode(bytes) {
                        Ok(Message::Written(note)) => self.proto.on_write_note(note),
                        Ok(Message::Records(b)) => self.proto.on_control(b, &mut |dst, data| {
                            // SAFETY: the protocol places a small message inside the buffer of
                            // the receive it completes, which lies in a registered region the
                            // receive holds (checked when it started) and is not complete yet.
                            // (`copy_bytes` copies a small message inline, not by a `memcpy` call.)
                            unsafe { portability_verbs::copy::copy_bytes(dst as *mut u8, data.as_ptr(), data.len()) }
                        }),
                        Err(e) => {
                            self.proto.fail(libc::EPROTO);
                            Err(e.into())
                        }
                    }
                }
                Ok(Some((Lane::Bulk, _))) => {
                    self.proto.fail(libc::EPROTO);
                    log::warn!("EXS connection: the peer sent on the bulk lane, which EXS does not use");
                    return true;
                }
                Ok(None) => return any,
                Err(e) => {
                    self.pipe_failed(&e);
                    return true;
                }
            };
            if let Err(e) = r {
                // The protocol failed the connection; the pipe stays as it is.
                log::warn!("EXS connection: {e}");
                return true;
            }
            if let Err(e) = self.pipe.pop_front() {
                self.pipe_failed(&e);
                return true;
            }
            if self.proto.has_actions() && !self.pipe.arrived() {
                // What the message brought (a receive's completion, a reply) goes out before
                // an empty look at the pipe, which would delay the event the application
                // waits for (a ping-pong's next message cannot be there yet).
                return true;
            }
        }
    }

    /// Reports the writes whose completion came, in posting order.
    fn take_write_completions(&mut self) {
        while let Some(w) = self.writes.front() {
            let Some(status) = self.pipe.take_user_completion(w.token) else { return };
            let send = w.send;
            self.writes.pop_front();
            if status.is_success() {
                self.proto.on_write_done(send);
            } else {
                log::debug!("EXS connection: a data write failed: {status:?}");
                self.proto.fail(errno_of(status));
            }
        }
    }

    /// Carries out the protocol's actions in order, as far as the pipe and the send queue
    /// allow. With `hold_open`, a control message at the very end stays back for the records a
    /// call expected soon will add (an advertisement then travels with the small message that
    /// follows it).
    fn run(&mut self, hold_open: bool) {
        loop {
            if self.backlog.is_empty() && hold_open && self.proto.only_open_send() {
                return;
            }
            let next = match self.backlog.pop_front() {
                Some(p) => p,
                None => match self.proto.next_action() {
                    // A completion is reported at once (most actions are one).
                    Some(Action::Done(d)) => {
                        self.report(d);
                        continue;
                    }
                    Some(a) => Pending::Action(a),
                    None => return,
                },
            };
            match self.carry_out(next) {
                Ok(None) => {}
                Ok(Some(back)) => {
                    self.backlog.push_front(back);
                    return;
                }
                Err(e) => {
                    self.pipe_failed(&e);
                    // Whatever waits would only fail the same way; the protocol reports
                    // every operation failed.
                    self.backlog.clear();
                }
            }
        }
    }

    /// Carries out one step; `Ok(Some(step))` hands it back when the pipe or the send queue
    /// has no room for it now.
    fn carry_out(&mut self, p: Pending) -> portability_verbs::Result<Option<Pending>> {
        let a = match p {
            Pending::Note(note) => return self.send_note(note),
            Pending::Action(a) => a,
        };
        match a {
            Action::Send(records) => {
                if !send_records(&mut self.pipe, &mut self.msg, &records)? {
                    return Ok(Some(Pending::Action(Action::Send(records))));
                }
                if records.iter().any(Record::is_close) {
                    // Delivered once the pipe has nothing of ours in flight.
                    self.close_in_flight = true;
                    self.pipe.settle_unsignaled()?;
                }
                Ok(None)
            }
            Action::Write { send, piece, remote_addr, rkey, imm } => {
                if self.writes.len() >= WRITE_DEPTH {
                    return Ok(Some(Pending::Action(Action::Write { send, piece, remote_addr, rkey, imm })));
                }
                let sge = Sge { addr: piece.addr, length: piece.len, lkey: piece.lkey };
                let inline = piece.len <= self.inline_max.min(self.pipe.qp().caps().max_inline_data);
                let wr = SendWr::write(0, &[sge], remote_addr, rkey).inline(inline);
                match self.pipe.post_user_completing(wr)? {
                    // Carried out at posting (the software provider): done with the sender's
                    // buffer already.
                    None => self.proto.on_write_done(send),
                    Some(token) => self.writes.push_back(WriteInFlight { token, send }),
                }
                match imm {
                    Some(imm) => self.send_note(WriteNote::decode(imm)),
                    None => Ok(None),
                }
            }
            Action::Copy { dst, src, len } => {
                let len = len as usize;
                match src {
                    CopySrc::Bytes(b) => {
                        // SAFETY: `dst..dst + len` lies in the registered region of a receive
                        // still in flight (checked when it started); `b` holds `len` bytes.
                        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), dst as *mut u8, len) };
                    }
                    CopySrc::Ring(off) => {
                        let ring = self.ring.as_ref().expect("the protocol copies from a stream buffer it has");
                        assert!(off as usize + len <= ring.len(), "stream-buffer chunk checked on arrival");
                        // SAFETY: the source lies in our stream buffer (asserted); the
                        // destination as above.
                        unsafe { std::ptr::copy_nonoverlapping(ring.as_ptr().add(off as usize), dst as *mut u8, len) };
                    }
                }
                Ok(None)
            }
            Action::Done(d) => {
                self.report(d);
                Ok(None)
            }
        }
    }

    /// Sends a write's note (the write was posted before it); handed back while the pipe has
    /// no room.
    fn send_note(&mut self, note: WriteNote) -> portability_verbs::Result<Option<Pending>> {
        Ok((!self.pipe.try_send(&note.encode_message())?).then_some(Pending::Note(note)))
    }

    fn report(&mut self, d: Done) {
        let Some(op) = self.ops.get_mut(d.req as usize).and_then(Option::take) else { return };
        self.free_ops.push(d.req);
        self.live_ops -= 1;
        debug_assert!(matches!(
            (d.op, op.kind),
            (OpKind::Send, EventKind::Send) | (OpKind::Recv, EventKind::Recv) | (OpKind::Close, EventKind::Close)
        ));
        drop(op.hold);
        if let Some((q, socket)) = op.target {
            q.deliver(Event {
                req: op.req,
                kind: op.kind,
                socket,
                outcome: d.outcome,
                truncated: d.truncated,
                accepted: None,
            });
            if let Some(last) = q.release() {
                self.last_queues.push(last);
            }
        }
    }
}

/// Lets go of a connection's lock, then drops the queues its reports released under it (see
/// `State::last_queues`; nearly always none, and then nothing is dropped).
#[inline(always)]
fn unlock<S>(s: SpinGuard<'_, State<S>>) {
    if s.last_queues.is_empty() {
        drop(s);
    } else {
        unlock_dropping_queues(s);
    }
}

#[inline(never)]
fn unlock_dropping_queues<S>(mut s: SpinGuard<'_, State<S>>) {
    let last_queues = std::mem::take(&mut s.last_queues);
    drop(s);
    drop(last_queues);
}

/// Sends records as one control message through `msg`; false if the pipe has no room now. A
/// small message's bytes at the end are gathered from where they lie by the pipe's store rather
/// than copied into `msg` first.
fn send_records(pipe: &mut MsgPipe, msg: &mut Vec<u8>, records: &[Record]) -> portability_verbs::Result<bool> {
    if let Some(sent) = send_lone_fill(pipe, records) {
        return sent;
    }
    msg.clear();
    let Some((last, rest)) = records.split_last() else { return Ok(true) };
    for r in rest {
        encode(r, msg, true);
    }
    encode(last, msg, false);
    if let Record::Small { pieces, .. } = last {
        if let [p] = pieces.as_slice() {
            // SAFETY: as in `encode`.
            let body = unsafe { std::slice::from_raw_parts(p.addr as *const u8, p.len as usize) };
            if pipe.try_send_gathered(msg, body)? {
                return Ok(true);
            }
        }
        append_pieces(pieces, msg);
    }
    pipe.try_send(msg)
}

/// Sends a ping-pong's control message (a fill of at most one piece, after at most a short
/// advertisement) by [`send_fill`]; `None` for any other message, and when the pipe cannot
/// gather it.
fn send_lone_fill(pipe: &mut MsgPipe, records: &[Record]) -> Option<portability_verbs::Result<bool>> {
    let (offer, fill) = match records {
        [Record::Control(Control::Advertise(ad), g), fill] if ad.fill_only => (Some((*g, ad)), fill),
        [fill] => (None, fill),
        _ => return None,
    };
    let Record::Small { fill: Some(truncated), pieces, grant } = fill else { return None };
    let piece = match pieces.as_slice() {
        [p] => *p,
        [] => Piece { addr: 0, len: 0, lkey: 0 },
        _ => return None,
    };
    match send_fill(pipe, offer, *grant, piece, *truncated) {
        Ok(false) => None,
        sent => Some(sent),
    }
}

/// Sends a fill of `piece` (empty when its length is 0), after the short advertisement
/// `offer` if any, as one control message: its records encoded by
/// [`wire::encode_lone_fill_head`] into a small array and the bytes gathered from where they
/// lie by the pipe's store. False if the pipe cannot take it so now (no room, or it cannot
/// gather).
fn send_fill(
    pipe: &mut MsgPipe,
    offer: Option<(u16, &Advert)>,
    grant: u16,
    piece: Piece,
    truncated: bool,
) -> portability_verbs::Result<bool> {
    let mut head = [0u8; wire::LONE_FILL_HEAD];
    let n = wire::encode_lone_fill_head(offer, grant, piece.len as u16, truncated, &mut head);
    let body = if piece.len == 0 {
        &[][..]
    } else {
        // SAFETY: as in `append_pieces`.
        unsafe { std::slice::from_raw_parts(piece.addr as *const u8, piece.len as usize) }
    };
    pipe.try_send_gathered(&head[..n], body)
}

/// Appends a record to a control message: a small message's header only unless `payload`.
fn encode(r: &Record, out: &mut Vec<u8>, payload: bool) {
    let at = out.len();
    match r {
        Record::Control(c, grant) => {
            out.resize(at + c.encoded_len(), 0);
            c.encode(*grant, &mut out[at..]);
        }
        Record::Small { fill, pieces, grant } => {
            let len: usize = pieces.iter().map(|p| p.len as usize).sum();
            let head = match fill {
                Some(truncated) => Control::Fill { data: &[], truncated: *truncated },
                None => Control::Data(&[]),
            };
            out.resize(at + DATA_OVERHEAD, 0);
            head.encode(*grant, &mut out[at..]);
            out[at + HEADER..at + DATA_OVERHEAD].copy_from_slice(&(len as u16).to_le_bytes());
            if payload {
                append_pieces(pieces, out);
            }
        }
    }
}

/// Appends a small message's bytes.
fn append_pieces(pieces: &[Piece], out: &mut Vec<u8>) {
    for p in pieces {
        // SAFETY: the piece lies inside a registered region the send holds (checked when it
        // started), and the send is not complete yet.
        out.extend_from_slice(unsafe { std::slice::from_raw_parts(p.addr as *const u8, p.len as usize) });
    }
}
