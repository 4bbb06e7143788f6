//! One connection's driver: the thin code between [`Proto`] and the queue pair. It posts what
//! the protocol decides, feeds it the completions, copies what it says to copy, and turns its
//! completions into events on the queues the operations named.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use portability_verbs::cm::Connection;
use portability_verbs::{
    CompletionQueue, MemoryRegion, QueuePair, RecvWr, SendWr, Sge, WcOpcode, WcStatus, WorkCompletion,
};

use super::engine::{self, Progress};
use super::error::{ExsError, ExsResult};
use super::memory::InFlight;
use super::proto::{Action, CopySrc, Done, Errno, OpKind, Proto, ProtoConfig, Record};
use super::queue::{Event, EventKind, EventQueue};
use super::wire::{self, Control, Hello, DATA_OVERHEAD, HEADER};

const TAG_SLOT: u64 = 1 << 56;
const TAG_TX: u64 = 2 << 56;
const TAG_WRITE: u64 = 3 << 56;
/// A SEND carrying our Close (always signaled: its completion completes the close).
const TAG_CLOSE: u64 = 4 << 56;
const TAG_MASK: u64 = 0xff << 56;
/// The id of a request whose buffer was released at posting (inline data is copied then).
const NO_BUFFER: u64 = (1 << 56) - 1;
/// Inline requests left unsignaled in a row at most: a NIC frees send-queue slots only
/// when a later request's completion comes, so one in this many asks for one.
const SIGNAL_EVERY: u32 = 16;

/// Send requests a connection keeps outstanding at most (more wait in its backlog).
pub(crate) const SEND_DEPTH: u32 = 512;
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

/// A connection's memory: receive slots, stream buffer, and (once the peer's slot size is
/// known) the buffers its SENDs are packed in.
pub(crate) struct ConnMemory {
    pub(crate) slots: MemoryRegion,
    pub(crate) ring: Option<MemoryRegion>,
    pub(crate) slot_size: usize,
    pub(crate) slot_count: usize,
    pub(crate) tx: MemoryRegion,
    /// Bytes of each SEND buffer: the peer's slot size.
    pub(crate) tx_size: usize,
}

struct State<S> {
    proto: Proto,
    qp: QueuePair,
    mem: ConnMemory,
    tx_free: Vec<u32>,
    /// Operations in flight, by token (a slab: tokens are reused once reported).
    ops: Vec<Option<Op<S>>>,
    free_ops: Vec<u64>,
    live_ops: usize,
    backlog: VecDeque<Action>,
    sq_used: u32,
    /// Requests posted unsignaled since the last signaled one, and per signaled request in
    /// flight the send-queue slots its completion frees.
    unsignaled: u32,
    batches: VecDeque<u32>,
    inline_max: u32,
    scratch: Vec<u8>,
    closing_since: Option<Instant>,
}

/// A connected EXS socket's transport; its events name sockets `S` (the sockets are built on
/// connections, so a connection is generic over them instead of naming them).
pub(crate) struct Conn<S> {
    state: Mutex<State<S>>,
    cq: CompletionQueue,
    finished: AtomicBool,
}

impl<S> Conn<S> {
    /// Takes over a connected queue pair: posts every receive slot.
    pub(crate) fn new(
        c: Connection,
        mem: ConnMemory,
        ours: &Hello,
        peer: Hello,
        adv_credits: u32,
        inline_max: u32,
    ) -> ExsResult<Conn<S>> {
        let cfg = ProtoConfig {
            kind: ours.kind,
            slots: ours.slots,
            small_max: ours.small_max,
            ring_len: ours.ring_len,
            adv_credits,
            peer,
        };
        let tx_count = mem.slot_count as u32;
        let state = State {
            proto: Proto::new(cfg),
            qp: c.qp,
            tx_free: (0..tx_count).rev().collect(),
            mem,
            ops: Vec::new(),
            free_ops: Vec::new(),
            live_ops: 0,
            backlog: VecDeque::new(),
            sq_used: 0,
            unsignaled: 0,
            batches: VecDeque::new(),
            inline_max,
            scratch: Vec::new(),
            closing_since: None,
        };
        for i in 0..state.mem.slot_count {
            state.post_slot(i).map_err(ExsError::verbs)?;
        }
        Ok(Conn { state: Mutex::new(state), cq: c.cq, finished: AtomicBool::new(false) })
    }

    fn lock(&self) -> MutexGuard<'_, State<S>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
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
        let mut s = self.lock();
        let token = s.free_ops.pop().unwrap_or(s.ops.len() as u64);
        if op.kind == EventKind::Close && s.closing_since.is_none() {
            s.closing_since = Some(Instant::now());
        }
        match f(&mut s.proto, token) {
            Ok(()) => {
                // A receive's advertisement may wait for the call that usually follows (a send
                // on this connection, or a wait that polls it) to leave in the same SEND: only
                // while an application thread drives progress (otherwise nothing would send it
                // before the completion thread's next look).
                let hold_open = op.kind == EventKind::Recv && engine::app_drives();
                if token as usize == s.ops.len() {
                    s.ops.push(Some(op));
                } else {
                    s.ops[token as usize] = Some(op);
                }
                s.live_ops += 1;
                s.run(hold_open);
                self.check_finished(&s);
                Ok(())
            }
            Err(e) => Err(ExsError::Connection(e)),
        }
    }

    /// Polls the completion queue and carries out what follows; true if anything happened.
    /// Skips a connection another thread is driving.
    pub(crate) fn progress(&self) -> bool {
        let Ok(mut s) = self.state.try_lock() else { return false };
        let mut wcs = [WorkCompletion::EMPTY; 8];
        let mut any = false;
        loop {
            let n = match self.cq.poll(&mut wcs) {
                Ok(n) => n,
                Err(e) => {
                    log::debug!("EXS connection: polling: {e}");
                    s.proto.fail(libc::EIO);
                    0
                }
            };
            for wc in &wcs[..n] {
                s.on_completion(wc);
            }
            any |= n > 0;
            if n < wcs.len() {
                break;
            }
        }
        if !s.backlog.is_empty() || any || s.proto.has_actions() {
            s.run(false);
        }
        if s.closing_since.is_some_and(|t| t.elapsed() > LINGER) && !s.proto.peer_closed() && s.proto.closed() {
            s.proto.fail(libc::ETIMEDOUT);
            s.run(false);
        }
        self.check_finished(&s);
        any
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
    fn cq(&self) -> CompletionQueue {
        Conn::cq(self)
    }
}

impl<S> State<S> {
    fn post_slot(&self, i: usize) -> portability_verbs::Result<()> {
        let sge = self.mem.slots.sge(i * self.mem.slot_size, self.mem.slot_size);
        self.qp.post_recv(&[RecvWr::new(TAG_SLOT | i as u64, &[sge])])
    }

    fn on_completion(&mut self, wc: &WorkCompletion) {
        let tag = wc.wr_id & TAG_MASK;
        let id = wc.wr_id & !TAG_MASK;
        match tag {
            TAG_TX | TAG_WRITE | TAG_CLOSE => {
                // Send completions come in posting order: this one ends its batch of
                // unsignaled requests too.
                self.sq_used -= self.batches.pop_front().unwrap_or(1);
                if id != NO_BUFFER {
                    if tag == TAG_WRITE {
                        if wc.status.is_success() {
                            self.proto.on_write_done(id);
                        }
                    } else {
                        self.tx_free.push(id as u32);
                    }
                }
                if tag == TAG_CLOSE && wc.status.is_success() {
                    self.proto.on_close_delivered();
                }
            }
            _ => {}
        }
        if !wc.status.is_success() {
            if self.proto.failure().is_none() {
                log::debug!("EXS connection failed: {:?}", wc.status);
            }
            self.proto.fail(errno_of(wc.status));
            return;
        }
        if tag != TAG_SLOT {
            return;
        }
        let slot = id as usize;
        let r = match wc.opcode {
            WcOpcode::RecvRdmaWithImm => self.proto.on_write_imm(wc.imm.unwrap_or(0)),
            _ => {
                let len = (wc.byte_len as usize).min(self.mem.slot_size);
                self.scratch.resize(len, 0);
                self.mem.slots.read(slot * self.mem.slot_size, &mut self.scratch);
                let bytes = std::mem::take(&mut self.scratch);
                let r = self.proto.on_control(&bytes, &mut |dst, data| {
                    // SAFETY: the protocol places a small message inside the buffer of the
                    // receive it completes, which lies in a registered region the receive
                    // holds (checked when it started) and is not complete yet.
                    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst as *mut u8, data.len()) }
                });
                self.scratch = bytes;
                r
            }
        };
        if let Err(e) = r {
            log::warn!("EXS connection: {e}");
            return;
        }
        if let Err(e) = self.post_slot(slot) {
            log::debug!("EXS connection: reposting a slot: {e}");
            self.proto.fail(libc::ECONNRESET);
        }
    }

    /// Carries out the protocol's actions in order, as far as the send queue allows. With
    /// `hold_open`, a SEND at the very end stays back for the records a call expected soon
    /// will add (an advertisement then travels with the small message that follows it).
    fn run(&mut self, hold_open: bool) {
        loop {
            if self.backlog.is_empty() && hold_open && self.proto.only_open_send() {
                return;
            }
            let Some(a) = self.backlog.pop_front().or_else(|| self.proto.next_action()) else { return };
            let full = match a {
                Action::Send(_) => self.sq_used >= SEND_DEPTH || self.tx_free.is_empty(),
                Action::Write { .. } => self.sq_used >= SEND_DEPTH,
                _ => false,
            };
            if full {
                self.backlog.push_front(a);
                return;
            }
            if let Err(e) = self.act(a) {
                log::debug!("EXS connection: posting: {e}");
                self.proto.fail(libc::ECONNRESET);
            }
        }
    }

    fn act(&mut self, a: Action) -> portability_verbs::Result<()> {
        match a {
            Action::Send(records) => {
                let i = self.tx_free.pop().expect("checked by run");
                let base = i as usize * self.mem.tx_size;
                let mut at = base;
                for r in &records {
                    at += self.encode(r, at);
                }
                self.post_tx(i, at - base, records.iter().any(Record::is_close))
            }
            Action::Write { send, piece, remote_addr, rkey, imm } => {
                let sge = Sge { addr: piece.addr, length: piece.len, lkey: piece.lkey };
                let wr = match imm {
                    Some(imm) => SendWr::write_with_imm(TAG_WRITE | send, &[sge], remote_addr, rkey, imm),
                    None => SendWr::write(TAG_WRITE | send, &[sge], remote_addr, rkey),
                };
                if piece.len <= self.inline_max {
                    // The data is copied at posting: the write is done with the sender's
                    // buffer at once, and needs no completion of its own.
                    let mut wr = wr.inline(true);
                    wr.wr_id = TAG_WRITE | NO_BUFFER;
                    self.post(wr, true)?;
                    self.proto.on_write_done(send);
                    Ok(())
                } else {
                    self.post(wr, false)
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
                        let ring = self.mem.ring.as_ref().expect("the protocol copies from a stream buffer it has");
                        assert!(off as usize + len <= ring.len(), "stream-buffer chunk checked on arrival");
                        // SAFETY: the source lies in our stream buffer (asserted); the
                        // destination as above.
                        unsafe { std::ptr::copy_nonoverlapping(ring.as_ptr().add(off as usize), dst as *mut u8, len) };
                    }
                }
                Ok(())
            }
            Action::Done(d) => {
                self.report(d);
                Ok(())
            }
        }
    }

    /// Writes a record into the control buffers at `at`; returns its length.
    fn encode(&mut self, r: &Record, at: usize) -> usize {
        match r {
            Record::Control(c, grant) => {
                let mut buf = [0u8; wire::MAX_CONTROL];
                let n = c.encode(*grant, &mut buf);
                self.mem.tx.write(at, &buf[..n]);
                n
            }
            Record::Small { fill, pieces, grant } => {
                let len: usize = pieces.iter().map(|p| p.len as usize).sum();
                let head = match fill {
                    Some(truncated) => Control::Fill { data: &[], truncated: *truncated },
                    None => Control::Data(&[]),
                };
                let mut buf = [0u8; DATA_OVERHEAD];
                head.encode(*grant, &mut buf);
                buf[HEADER..DATA_OVERHEAD].copy_from_slice(&(len as u16).to_le_bytes());
                self.mem.tx.write(at, &buf);
                let mut to = at + DATA_OVERHEAD;
                for p in pieces {
                    // SAFETY: the piece lies inside a registered region the send holds
                    // (checked when it started), and the send is not complete yet.
                    let src = unsafe { std::slice::from_raw_parts(p.addr as *const u8, p.len as usize) };
                    self.mem.tx.write(to, src);
                    to += p.len as usize;
                }
                DATA_OVERHEAD + len
            }
        }
    }

    fn post_tx(&mut self, i: u32, len: usize, close: bool) -> portability_verbs::Result<()> {
        let sge = self.mem.tx.sge(i as usize * self.mem.tx_size, len);
        let inline = len <= self.qp.caps().max_inline_data as usize;
        // Inline data is copied at posting: the buffer is free again at once.
        let buffer = if inline { NO_BUFFER } else { i as u64 };
        let wr_id = if close { TAG_CLOSE | buffer } else { TAG_TX | buffer };
        let r = self.post(SendWr::send(wr_id, &[sge]).inline(inline), inline && !close);
        if inline || r.is_err() {
            self.tx_free.push(i);
        }
        r
    }

    /// Posts a request; one that `may_skip` its completion goes unsignaled unless it ends a
    /// batch of [`SIGNAL_EVERY`].
    fn post(&mut self, wr: SendWr, may_skip: bool) -> portability_verbs::Result<()> {
        let signal = !may_skip || self.unsignaled + 1 >= SIGNAL_EVERY;
        self.qp.post_send(&[wr.signaled(signal)])?;
        self.sq_used += 1;
        if signal {
            self.batches.push_back(self.unsignaled + 1);
            self.unsignaled = 0;
        } else {
            self.unsignaled += 1;
        }
        Ok(())
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
        }
    }
}
