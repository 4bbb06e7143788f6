//! A queue pair over the TCP transport: the requester and responder of the verbs carried as
//! frames (`soft::tcp::frame`) on one connection per queue-pair pair.
//!
//! - Requester (`requester`): every request gets the next sequence number and goes out as one
//!   frame, its data gathered from registered memory by the kernel (`sendmsg`). It stays in
//!   `sent` until its response: acknowledgements are cumulative (an ack, a read or atomic
//!   response, a nak, or an ack riding on any frame, for sequence `s` also completes every send
//!   and write before `s`), so completions come in posting order as on an RC queue pair. A
//!   receiver-not-ready nak rewinds: after the responder's timer, everything from the nak'd
//!   request is sent again, `rnr_retry` times.
//! - Responder (`responder`): requests are taken in sequence order; the checks are the ring
//!   transport's (receive capacity, local keys of receives, the queue pair's access flags,
//!   remote keys with rights, bounds and protection domain); data is read straight into the
//!   target (a write's last 8 bytes after the rest). After refusing a request it drops
//!   everything until that request comes again (only a receiver-not-ready one does), as a
//!   responder drops packets after a nak.
//! - Liveness: a closed connection, a peer silent past `SoftConfig::tcp_timeout` (idle
//!   connections carry keep-alives) or a process gone fails the queue pair; an orderly `Bye`
//!   (the peer's queue pair destroyed or in error) fails it only if requests are outstanding.
//!
//! Driven under the queue pair's lock by posts, completion-queue polls and the per-process
//! engine thread (`soft::tcp::engine`), whichever comes first.

use std::collections::VecDeque;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

mod requester;
mod responder;

use super::{local_qp, status_of, Out, QpCore, QpInner, SqStage};
use crate::endpoint::SoftEndpoint;
use crate::error::{Result, VerbsError};
use crate::soft::dma::local_copy;
use crate::soft::tcp::engine::{Engine, Link};
use crate::soft::tcp::frame::{seq_before, Frame, Kind, NakCode, FLAG_ACK, FLAG_IMM, FLAG_LAZY_ACK};
use crate::soft::tcp::link::{self, Dest, Placement, Rx, Tx, TxError};
use crate::soft::wire::status;
use crate::types::*;
use requester::emit;

/// The process's TCP engine, handing the connections it greets to [`QpInner::accept_tcp`].
fn engine(addr: Option<SocketAddr>) -> Result<&'static Engine> {
    crate::soft::tcp::engine::engine(addr, QpInner::accept_tcp)
}

impl Link for QpInner {
    fn event(&self) {
        self.tcp_event()
    }
    fn tick(&self, now: Instant) {
        self.tcp_tick(now)
    }
}

/// How long a connecting side waits for the peer's listener.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an accepting side waits for its peer to connect once it is ready to receive.
const ACCEPT_TIMEOUT: Duration = Duration::from_secs(10);
/// New requests wait while this many bytes are queued for the socket.
const TX_LIMIT: usize = 8 << 20;
/// Input is the engine's again once no application thread polled for this long (looked at on
/// the engine's tick while threads poll: every 10 ms).
const POLLER_GONE: Duration = Duration::from_millis(1);
/// Frames one pass reads at most (bounds how long it holds the queue pair's lock).
const FRAMES_PER_PASS: usize = 256;

/// A request on the wire, kept until its response (a receiver-not-ready rewind sends it again).
struct Sent {
    seq: u32,
    wr: SendWr,
    inline: Option<InlineBytes>,
}

/// Inline data kept for a request (small ones without an allocation).
type InlineBytes = smallvec::SmallVec<[u8; 64]>;

/// What follows once the body of the frame being read is in place.
enum Then {
    Nothing,
    /// A write: acknowledge it (`lazy`: on the next frame going back, whenever that is).
    Ack {
        seq: u32,
        lazy: bool,
    },
    /// A send or write-with-immediate: its receive completes.
    Receive {
        wr: RecvWr,
        opcode: WcOpcode,
        imm: Option<u32>,
        len: u32,
        seq: u32,
    },
    /// The read at the head of `sent` completes.
    ReadDone,
}

/// A receiver-not-ready rewind in progress.
struct Rnr {
    seq: u32,
    naks: u32,
    /// When the rewind is sent; None once it was.
    resend_at: Option<Instant>,
}

/// The connection and its socket's registration with the engine.
struct Conn {
    sock: TcpStream,
    token: u64,
}

impl Drop for Conn {
    /// Ends the connection with a FIN after what was written; what the peer sent that nobody
    /// read is read and dropped first, since closing a socket with unread data resets the
    /// connection, and a reset can overtake the peer's reading of our last frames.
    fn drop(&mut self) {
        if let Ok(e) = engine(None) {
            e.unregister(&self.sock, self.token);
        }
        let _ = self.sock.shutdown(std::net::Shutdown::Write);
        // What is there now, bounded: a peer that keeps sending cannot hold the caller here.
        let mut sink = [0u8; 4096];
        for _ in 0..256 {
            if !matches!(std::io::Read::read(&mut &self.sock, &mut sink), Ok(n) if n > 0) {
                break;
            }
        }
    }
}

/// The TCP state of a queue pair connected over TCP.
pub(super) struct TcpSide {
    peer: SoftEndpoint,
    conn: Option<Conn>,
    /// When the side was set up: an accepting side gives its peer `ACCEPT_TIMEOUT` to connect.
    since: Instant,
    tx: Tx,
    rx: Rx,
    reading: Option<(Placement, Then)>,
    // Requester.
    next_seq: u32,
    sent: VecDeque<Sent>,
    rnr: Option<Rnr>,
    // Responder.
    expect_seq: u32,
    /// After refusing this request, everything else is dropped until it comes again.
    dropping_until: Option<u32>,
    ack_due: Option<u32>,
    /// Nothing of the peer's waits for `ack_due` (it covers only writes completed at
    /// injection): it rides on our next frame and never goes alone.
    ack_lazy: bool,
    /// An application pass left `ack_due` for its next post to carry; the next pass sends it.
    ack_held: bool,
    last_rx: Instant,
    last_tx: Instant,
    /// The connection is over: nothing more arrives or leaves.
    gone: bool,
    /// Counted in the engine's urgent tick (a rewind timer runs).
    urgent: bool,
    /// The engine is woken for our input (else an application thread polls it).
    engine_reads: bool,
    /// The engine is woken when the socket takes more (bytes wait in `tx`).
    engine_writes: bool,
    /// When an application thread last polled us.
    last_poll: Instant,
}

impl TcpSide {
    fn new(peer: SoftEndpoint) -> Box<TcpSide> {
        let now = Instant::now();
        Box::new(TcpSide {
            peer,
            conn: None,
            since: now,
            tx: Tx::default(),
            rx: Rx::default(),
            reading: None,
            next_seq: 1,
            sent: VecDeque::new(),
            rnr: None,
            expect_seq: 1,
            dropping_until: None,
            ack_due: None,
            ack_lazy: false,
            ack_held: false,
            last_rx: now,
            last_tx: now,
            gone: false,
            urgent: false,
            engine_reads: true,
            engine_writes: false,
            last_poll: now,
        })
    }

    /// Request `seq` is done: every request up to it is acknowledged by our next frame, and
    /// by one of its own unless all those not acknowledged yet ask for it `lazy`.
    fn ack(&mut self, seq: u32, lazy: bool) {
        self.ack_lazy = lazy && (self.ack_due.is_none() || self.ack_lazy);
        self.ack_due = Some(seq);
    }

    /// Queues a frame, carrying the acknowledgement that is due (nothing else need carry it).
    fn push(&mut self, mut f: Frame) {
        if let Some(seq) = self.ack_due.take() {
            f.flags |= FLAG_ACK;
            f.ack = seq;
            self.ack_held = false;
        }
        self.tx.push_header(&f);
    }

    /// Hands our input to the engine (`true`) or to polling application threads.
    fn engine_reads(&mut self, on: bool) {
        if self.engine_reads == on {
            return;
        }
        if let (Some(c), Ok(e)) = (&self.conn, engine(None)) {
            self.engine_reads = on;
            e.watch(&c.sock, c.token, on, self.engine_writes);
            // While a poller has it, the engine's tick takes it back once polls stop.
            e.polled(!on);
        }
    }

    /// Has the engine woken when the socket takes more (`true` while bytes wait in `tx`).
    fn engine_writes(&mut self, on: bool) {
        if self.engine_writes == on {
            return;
        }
        if let (Some(c), Ok(e)) = (&self.conn, engine(None)) {
            self.engine_writes = on;
            e.watch(&c.sock, c.token, self.engine_reads, on);
        }
    }

    /// Counts in the engine's fine tick while a rewind timer runs.
    fn set_urgent(&mut self, on: bool) {
        if self.urgent != on {
            self.urgent = on;
            if let Ok(e) = engine(None) {
                e.urgent(on);
            }
        }
    }

    /// Closes the connection, after a best-effort flush of what is queued and a `Bye`.
    fn close(&mut self, keys: impl Fn(u32, u64, u64, AccessFlags) -> bool) {
        self.engine_reads(true);
        if let Some(c) = self.conn.take() {
            self.push(Frame::new(Kind::Bye, 0));
            let _ = self.tx.flush(&c.sock, keys);
        }
        self.tx.clear();
        self.reading = None;
        self.gone = true;
        self.set_urgent(false);
    }
}

impl Drop for TcpSide {
    fn drop(&mut self) {
        self.set_urgent(false);
        self.engine_reads(true);
    }
}

/// The address to connect for `peer`: its listener, on loopback when it did not say which IP.
fn peer_addr(peer: &SoftEndpoint) -> SocketAddr {
    let mut a = peer.tcp;
    if a.ip().is_unspecified() {
        a.set_ip(match a.ip() {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
        });
    }
    a
}

impl QpInner {
    /// True when the queue pair must reach `peer` over TCP (see [`SoftEndpoint::needs_tcp`]).
    pub(super) fn wants_tcp(&self, peer: &SoftEndpoint) -> bool {
        peer.host != crate::soft::host::identity() || peer.tcp_only || self.ctx.config.tcp_only
    }

    /// Where our engine listens (the engine starts on first use).
    pub(super) fn tcp_listen_addr(&self) -> SocketAddr {
        match engine(self.ctx.config.tcp_addr) {
            Ok(e) => e.addr,
            Err(e) => {
                log::warn!("{e}; peers on other hosts cannot reach this queue pair");
                SocketAddr::from(([0, 0, 0, 0], 0))
            }
        }
    }

    /// Connects to `peer` over TCP (the ready-to-receive transition). Of the two queue pairs,
    /// the one with the smaller (context, queue-pair number) connects; the other adopts the
    /// connection when the engine hands it over (now, if it arrived already).
    pub(super) fn connect_tcp(&self, core: &mut QpCore, peer: &SoftEndpoint) -> Result<()> {
        let mut side = TcpSide::new(*peer);
        if (self.ctx.id, self.qpn) < (peer.ctx_id, peer.qpn) {
            let addr = peer_addr(peer);
            let mut sock = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT).map_err(|e| {
                VerbsError::PeerUnreachable(format!("TCP transport of queue pair {} at {addr}: {e}", peer.qpn))
            })?;
            let mut hello = Frame::new(Kind::Hello, 0);
            hello.raddr = peer.ctx_id;
            hello.rkey = peer.qpn;
            hello.operand = self.ctx.id;
            hello.imm = self.qpn;
            hello.swap = crate::soft::host::identity();
            std::io::Write::write_all(&mut sock, &hello.encode())
                .map_err(|e| VerbsError::PeerUnreachable(format!("TCP transport hello to {addr}: {e}")))?;
            side.conn = Some(self.register_conn(sock)?);
        } else {
            let parked = self.parked.lock().expect("parked connection lock").take();
            if let Some((sock, hello)) = parked {
                if hello.operand == peer.ctx_id && hello.imm == peer.qpn {
                    side.conn = Some(self.register_conn(sock)?);
                }
            }
        }
        core.tcp = Some(side);
        Ok(())
    }

    fn register_conn(&self, sock: TcpStream) -> Result<Conn> {
        link::tune(&sock).map_err(|e| VerbsError::PeerUnreachable(format!("TCP transport socket: {e}")))?;
        let me =
            local_qp(self.ctx.id, self.qpn).ok_or_else(|| VerbsError::InvalidState("queue pair is gone".into()))?;
        let token = engine(self.ctx.config.tcp_addr)?.register(&sock, me)?;
        Ok(Conn { sock, token })
    }

    /// The engine's hand-over of a connection whose hello names one of our queue pairs.
    pub(crate) fn accept_tcp(sock: TcpStream, hello: &Frame) {
        let Some(qp) = local_qp(hello.raddr, hello.rkey).and_then(|w| w.upgrade()) else {
            log::debug!("TCP transport: a hello for queue pair {} that does not exist", hello.rkey);
            return;
        };
        let mut core = qp.core.lock();
        let waiting = core.tcp.as_ref().is_some_and(|t| t.conn.is_none() && !t.gone);
        if waiting {
            let side = core.tcp.as_ref().expect("checked");
            if side.peer.ctx_id != hello.operand || side.peer.qpn != hello.imm {
                log::warn!("TCP transport: queue pair {} refused a connection from another peer", qp.qpn);
                return;
            }
            match qp.register_conn(sock) {
                Ok(c) => core.tcp.as_mut().expect("checked").conn = Some(c),
                Err(e) => log::warn!("TCP transport: {e}"),
            }
            let mut out = Out::new();
            qp.tcp_drive(&mut core, &mut out);
            qp.deliver_tcp(&mut core, out);
        } else if matches!(core.state, QpState::Reset | QpState::Init) {
            // Its peer got here first: kept until our ready-to-receive transition.
            *qp.parked.lock().expect("parked connection lock") = Some((sock, *hello));
        }
    }

    /// One pass: reads and handles what arrived, starts waiting requests, writes what is
    /// queued. Completions go to `out`.
    pub(super) fn tcp_drive(&self, core: &mut QpCore, out: &mut Out) {
        self.tcp_drive_by(core, out, false);
    }

    /// A pass; `by_poller` when an application thread polling its completions runs it (it may
    /// leave an acknowledgement for its next request to carry).
    fn tcp_drive_by(&self, core: &mut QpCore, out: &mut Out, by_poller: bool) {
        let Some(mut t) = core.tcp.take() else { return };
        self.tcp_pass(core, &mut t, out, by_poller);
        if core.tcp.is_none() {
            core.tcp = Some(t);
        }
        self.retire(core, out);
    }

    fn tcp_pass(&self, core: &mut QpCore, t: &mut TcpSide, out: &mut Out, by_poller: bool) {
        if t.conn.is_none() {
            if t.gone {
                self.fail_waiting_after_loss(core, t, out);
            }
            return;
        }
        // A poller's pass was just stamped (`tcp_progress`): one clock read per poll.
        let now = if by_poller { t.last_poll } else { Instant::now() };
        for _ in 0..FRAMES_PER_PASS {
            let Some(c) = &t.conn else { break };
            if let Some((p, _)) = &mut t.reading {
                match t.rx.body(&c.sock, p) {
                    Ok(true) => {
                        let (_, then) = t.reading.take().expect("reading");
                        self.finish(core, t, then, out);
                        continue;
                    }
                    Ok(false) => break,
                    Err(e) => return self.lost(core, t, out, &e.to_string(), false),
                }
            }
            match t.rx.header(&c.sock) {
                Ok(Some(h)) => {
                    t.last_rx = now;
                    match Frame::decode(&h) {
                        Ok(f) => self.on_frame(core, t, f, out),
                        Err(e) => return self.protocol_failure(core, t, out, &e.to_string()),
                    }
                    if t.gone {
                        return;
                    }
                }
                Ok(None) => break,
                Err(e) => return self.lost(core, t, out, &e.to_string(), false),
            }
        }
        if let Some(r) = &mut t.rnr {
            if r.resend_at.is_some_and(|at| now >= at) {
                r.resend_at = None;
                t.set_urgent(false);
                let sent = std::mem::take(&mut t.sent);
                for s in &sent {
                    emit(t, s);
                }
                t.sent = sent;
            }
        }
        self.tcp_execute(core, t, out);
        // An acknowledgement nothing carried: a poller keeps it for one pass (a ping-pong's
        // answer carries it: one system call per message, not two); then it goes alone.
        if let Some(seq) = t.ack_due.filter(|_| !t.ack_lazy) {
            if by_poller && !t.ack_held {
                t.ack_held = true;
            } else {
                t.ack_due = None;
                t.ack_held = false;
                t.tx.push_header(&Frame::new(Kind::Ack, seq));
            }
        }
        self.flush(core, t, out);
    }

    /// Writes what the socket takes now.
    fn flush(&self, core: &mut QpCore, t: &mut TcpSide, out: &mut Out) {
        let Some(c) = &t.conn else { return };
        if t.tx.is_empty() {
            return self.complete_injected(core, t);
        }
        let keys = self.keys(core);
        let r = t.tx.flush(&c.sock, |k, a, l, need| keys.check(k, a, l, need, self.pd));
        drop(keys);
        match r {
            Ok(all) => {
                t.last_tx = Instant::now();
                t.engine_writes(!all);
                if all {
                    self.complete_injected(core, t);
                }
            }
            Err(TxError::Io(e)) => self.lost(core, t, out, &e.to_string(), false),
            Err(TxError::Unregistered) => {
                log::error!("QP {}: a region with data in flight was deregistered", self.qpn);
                self.complete_front(core, t, WcStatus::LocProtErr);
                self.fail(core, t, out);
            }
        }
    }

    fn on_frame(&self, core: &mut QpCore, t: &mut TcpSide, f: Frame, out: &mut Out) {
        if f.flags & FLAG_ACK != 0 {
            self.acknowledged(core, t, f.ack, out);
            if t.gone {
                return;
            }
        }
        match f.kind {
            Kind::Keepalive => {}
            Kind::Bye => self.lost(core, t, out, "the peer queue pair closed", true),
            Kind::Hello => self.protocol_failure(core, t, out, "a second hello"),
            k if k.is_request() => self.respond(core, t, f, out),
            _ => self.on_response(core, t, f, out),
        }
    }

    /// A request of ours failed: the queue pair goes to error (flushing the rest) and the
    /// connection closes with a `Bye`.
    fn fail(&self, core: &mut QpCore, t: &mut TcpSide, out: &mut Out) {
        self.shut(core, t);
        self.enter_error(core, out);
    }

    /// Ends the connection (a `Bye` after what is queued, if it still stands) and forgets the
    /// requests on it; a receive a message cut short had taken goes back to its queue.
    fn shut(&self, core: &mut QpCore, t: &mut TcpSide) {
        self.restore_receive(core, t);
        if !t.gone {
            let keys = self.keys(core);
            t.close(|k, a, l, need| keys.check(k, a, l, need, self.pd));
        }
        t.sent.clear();
        t.rnr = None;
    }

    fn protocol_failure(&self, core: &mut QpCore, t: &mut TcpSide, out: &mut Out, why: &str) {
        log::error!("QP {}: malformed traffic from the peer over TCP: {why}; moving to error", self.qpn);
        if let Some(e) = core.sq.iter_mut().find(|e| !matches!(e.stage, SqStage::Done(_))) {
            e.stage = SqStage::Done(WcStatus::GeneralErr);
        }
        self.fail(core, t, out);
    }

    /// The connection ended. A broken one (no `Bye`: the process died, the link went down)
    /// fails the queue pair at once; an orderly end only if requests are outstanding, which
    /// can never be answered now (later requests fail when they start).
    fn lost(&self, core: &mut QpCore, t: &mut TcpSide, out: &mut Out, why: &str, orderly: bool) {
        log::debug!("QP {}: TCP connection to queue pair {} ended: {why}", self.qpn, t.peer.qpn);
        self.restore_receive(core, t);
        t.engine_reads(true);
        t.conn = None;
        t.tx.clear();
        t.reading = None;
        t.gone = true;
        t.set_urgent(false);
        let outstanding = core.sq.iter().any(|e| !matches!(e.stage, SqStage::Done(_)));
        if !orderly || outstanding {
            self.fail_waiting_after_loss(core, t, out);
            if core.state != QpState::Error {
                self.enter_error(core, out);
            }
        }
    }

    /// With the connection gone, the oldest outstanding request ran out of retries.
    fn fail_waiting_after_loss(&self, core: &mut QpCore, t: &mut TcpSide, out: &mut Out) {
        if core.state == QpState::Error {
            return;
        }
        if let Some(e) = core.sq.iter_mut().find(|e| !matches!(e.stage, SqStage::Done(_))) {
            e.stage = SqStage::Done(WcStatus::RetryExcErr);
            t.sent.clear();
            self.enter_error(core, out);
        }
    }

    /// Hands our input to the engine (an application thread is about to sleep).
    pub(super) fn tcp_to_engine(&self, core: &mut QpCore) {
        if let Some(t) = core.tcp.as_mut() {
            t.engine_reads(true);
            if t.ack_held {
                let mut out = Out::new();
                self.tcp_drive(core, &mut out);
                self.deliver(&out);
            }
        }
    }

    /// The engine's call when the socket has something for us.
    pub(crate) fn tcp_event(&self) {
        let mut core = self.core.lock();
        let mut out = Out::new();
        self.tcp_drive(&mut core, &mut out);
        self.deliver_tcp(&mut core, out);
    }

    /// Hands completions to their queues under the lock (per-QP completion order across
    /// threads); a queue they overran fails the queue pair before anyone can see the overrun.
    fn deliver_tcp(&self, core: &mut QpCore, out: Out) {
        self.deliver(&out);
        if (self.send_cq.overrun() || self.recv_cq.overrun()) && core.state != QpState::Error {
            let mut flushed = Out::new();
            self.enter_error(core, &mut flushed);
            self.deliver(&flushed);
        }
        self.publish_peek(core);
    }

    /// The engine's periodic call: keep-alives, liveness, timers, and whatever a missed
    /// wake-up left.
    pub(crate) fn tcp_tick(&self, now: Instant) {
        let mut core = self.core.lock();
        let mut out = Out::new();
        if let Some(mut t) = core.tcp.take() {
            let timeout = self.ctx.config.tcp_timeout;
            if !t.engine_reads && now.duration_since(t.last_poll) >= POLLER_GONE {
                t.engine_reads(true);
            }
            if t.conn.is_none() && !t.gone && now.duration_since(t.since) > ACCEPT_TIMEOUT {
                self.lost(&mut core, &mut t, &mut out, "the peer never connected", false);
            } else if t.conn.is_some() && now.duration_since(t.last_rx) > timeout {
                let why = format!("the peer was silent for {timeout:?}");
                self.lost(&mut core, &mut t, &mut out, &why, false);
            } else if t.conn.is_some() && now.duration_since(t.last_tx) >= timeout / 4 {
                t.push(Frame::new(Kind::Keepalive, 0));
            }
            self.tcp_pass(&mut core, &mut t, &mut out, false);
            if core.tcp.is_none() {
                core.tcp = Some(t);
            }
            self.retire(&mut core, &mut out);
        }
        self.deliver_tcp(&mut core, out);
    }

    /// Closes the connection of a queue pair leaving the TCP transport (destroyed or reset),
    /// telling the peer.
    pub(super) fn tcp_close(&self, core: &mut QpCore) {
        if let Some(mut t) = core.tcp.take() {
            self.shut(core, &mut t);
        }
    }

    /// Closes the connection of a queue pair that went to error (its peer learns at once).
    pub(super) fn tcp_error(&self, core: &mut QpCore) {
        if let Some(mut t) = core.tcp.take() {
            self.shut(core, &mut t);
            core.tcp = Some(t);
        }
    }

    /// A completion-queue poll's pass over a TCP queue pair (if no other thread is on it).
    pub(super) fn tcp_progress(&self, cq: &super::CqInner, sink: &mut Out) {
        let Some(mut core) = self.core.try_lock() else {
            return;
        };
        let mut out = Out::new();
        if cq.overrun() && core.state != QpState::Error {
            self.enter_error(&mut core, &mut out);
        }
        if let Some(t) = core.tcp.as_mut() {
            t.last_poll = Instant::now();
            t.engine_reads(false);
        }
        self.tcp_drive_by(&mut core, &mut out, true);
        self.publish_peek(&core);
        self.hand_out(cq, sink, &out);
        drop(core);
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::time::{Duration, Instant};

    use crate::soft::tcp::frame::{Frame, Kind, NakCode, FLAG_LAZY_ACK, HEADER};
    use crate::*;

    /// A queue pair over TCP whose peer is the test's own socket (a hand-made peer), which has
    /// read the hello.
    struct Fake {
        _ctx: Context,
        cq: CompletionQueue,
        qp: QueuePair,
        mr: MemoryRegion,
        peer: TcpStream,
    }

    fn fake() -> Fake {
        let ctx = Context::open_soft(SoftConfig { tcp_only: true, ..SoftConfig::default() }).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(64).unwrap();
        let qp = pd.create_qp(&QpInit::new(&cq)).unwrap();
        let mr = pd.register(vec![0u8; 8192].into_boxed_slice(), AccessFlags::ALL).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let EndpointInfo::Soft(mut ep) = qp.endpoint() else { unreachable!("a software queue pair") };
        // The larger context id: our queue pair connects to the fake.
        (ep.ctx_id, ep.qpn, ep.tcp) = (u64::MAX, 77, listener.local_addr().unwrap());
        qp.modify(QpTransition::Init { access: AccessFlags::ALL, port: 1 }).unwrap();
        qp.modify(QpTransition::Rtr(RtrAttr::new(EndpointInfo::Soft(ep)))).unwrap();
        qp.modify(QpTransition::Rts(RtsAttr::default())).unwrap();
        let (mut peer, _) = listener.accept().unwrap();
        peer.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut hello = [0u8; HEADER];
        peer.read_exact(&mut hello).unwrap();
        assert_eq!(Frame::decode(&hello).unwrap().kind, Kind::Hello);
        Fake { _ctx: ctx, cq, qp, mr, peer }
    }

    /// The next frame from the queue pair other than a keep-alive.
    fn next_frame(peer: &mut TcpStream) -> Frame {
        loop {
            let mut h = [0u8; HEADER];
            peer.read_exact(&mut h).unwrap();
            let f = Frame::decode(&h).unwrap();
            if f.kind != Kind::Keepalive {
                return f;
            }
        }
    }

    fn wait_for_error(f: &Fake) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while f.qp.state() != QpState::Error {
            assert!(Instant::now() < deadline, "the queue pair never failed");
            let _ = f.cq.poll(&mut [WorkCompletion::EMPTY; 4]);
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_write_whose_key_or_bounds_lie_is_refused_and_writes_nothing() {
        let mut f = fake();
        let mut w = Frame::new(Kind::Write, 1);
        (w.raddr, w.rkey, w.len) = (f.mr.addr() + 8192 - 8, f.mr.rkey(), 64);
        f.peer.write_all(&w.encode()).unwrap();
        f.peer.write_all(&[0xee; 64]).unwrap();
        let nak = next_frame(&mut f.peer);
        assert_eq!((nak.kind, nak.seq, nak.nak), (Kind::Nak, 1, Some(NakCode::AccessError)));
        // Another key entirely, then a request that skips a sequence number.
        let mut w = Frame::new(Kind::Write, 2);
        (w.raddr, w.rkey, w.len) = (f.mr.addr(), f.mr.rkey() ^ 0x100, 8);
        f.peer.write_all(&w.encode()).unwrap();
        f.peer.write_all(&[0xee; 8]).unwrap();
        let mut buf = vec![0u8; 8192];
        f.mr.read(0, &mut buf);
        assert!(buf.iter().all(|&b| b == 0), "nothing may be written");
        assert_eq!(f.qp.state(), QpState::ReadyToSend, "a responder refusing a request stays usable");
    }

    #[test]
    fn a_malformed_header_fails_the_queue_pair() {
        let mut f = fake();
        let mut h = Frame::new(Kind::Ack, 1).encode();
        h[0] = 99;
        f.peer.write_all(&h).unwrap();
        wait_for_error(&f);
        assert_eq!(next_frame(&mut f.peer).kind, Kind::Bye);
    }

    #[test]
    fn a_send_longer_than_the_receive_is_a_length_error_on_both_sides() {
        let mut f = fake();
        f.qp.post_recv(&[RecvWr::new(5, &[f.mr.sge(0, 64)])]).unwrap();
        let mut s = Frame::new(Kind::Send, 1);
        s.len = 1000;
        f.peer.write_all(&s.encode()).unwrap();
        f.peer.write_all(&[1u8; 1000]).unwrap();
        let nak = next_frame(&mut f.peer);
        assert_eq!((nak.kind, nak.nak), (Kind::Nak, Some(NakCode::InvalidRequest)));
        let mut wc = [WorkCompletion::EMPTY; 1];
        assert_eq!(f.cq.poll_blocking(&mut wc, Duration::from_secs(10)).unwrap(), 1);
        assert_eq!((wc[0].wr_id, wc[0].status), (5, WcStatus::LocLenErr));
        assert_eq!(f.qp.state(), QpState::Error);
        let mut buf = vec![0u8; 8192];
        f.mr.read(0, &mut buf);
        assert!(buf.iter().all(|&b| b == 0), "nothing may be written");
    }

    #[test]
    fn a_peer_that_stops_mid_frame_fails_the_queue_pair_and_flushes() {
        let mut f = fake();
        f.qp.post_recv(&[RecvWr::new(5, &[f.mr.sge(0, 4096)])]).unwrap();
        let mut s = Frame::new(Kind::Send, 1);
        s.len = 1000;
        f.peer.write_all(&s.encode()).unwrap();
        f.peer.write_all(&[1u8; 10]).unwrap();
        drop(f.peer);
        let mut wc = [WorkCompletion::EMPTY; 1];
        assert_eq!(f.cq.poll_blocking(&mut wc, Duration::from_secs(10)).unwrap(), 1);
        assert_eq!((wc[0].wr_id, wc[0].status), (5, WcStatus::WrFlushErr));
        assert_eq!(f.qp.state(), QpState::Error);
    }

    #[test]
    fn answers_for_requests_never_made_fail_the_queue_pair() {
        let mut f = fake();
        let mut r = Frame::new(Kind::ReadResp, 9);
        r.len = 16;
        f.peer.write_all(&r.encode()).unwrap();
        f.peer.write_all(&[7u8; 16]).unwrap();
        wait_for_error(&f);
    }

    /// Polls until `n` completions came (or 10 s passed) and returns their ids.
    fn completions(f: &Fake, n: usize) -> Vec<u64> {
        let mut ids = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while ids.len() < n && Instant::now() < deadline {
            let mut wc = [WorkCompletion::EMPTY; 4];
            let n = f.cq.poll(&mut wc).unwrap();
            for c in &wc[..n] {
                assert_eq!(c.status, WcStatus::Success, "{c:?}");
                ids.push(c.wr_id);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        ids
    }

    #[test]
    fn a_write_completed_at_injection_needs_no_answer_but_keeps_posting_order() {
        let mut f = fake();
        let mut data = [0u8; 64];
        // A plain write waits for its acknowledgement, and holds back the one behind it.
        f.qp.post_send(&[SendWr::write(1, &[f.mr.sge(0, 64)], 0x1000, 5)]).unwrap();
        f.qp.post_send(&[SendWr::write(2, &[f.mr.sge(64, 64)], 0x1000, 5).inject_complete(true)]).unwrap();
        let first = next_frame(&mut f.peer);
        f.peer.read_exact(&mut data).unwrap();
        let second = next_frame(&mut f.peer);
        assert_eq!(second.kind, Kind::Write);
        // Only the one completed at injection lets its acknowledgement wait.
        assert_eq!((first.flags & FLAG_LAZY_ACK, second.flags & FLAG_LAZY_ACK), (0, FLAG_LAZY_ACK));
        f.peer.read_exact(&mut data).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let mut wc = [WorkCompletion::EMPTY; 4];
        assert_eq!(f.cq.poll(&mut wc).unwrap(), 0, "nothing completes before the first write's answer");
        f.peer.write_all(&Frame::new(Kind::Ack, first.seq).encode()).unwrap();
        assert_eq!(completions(&f, 2), [1, 2]);
        // Alone, it completes while the peer says nothing.
        f.qp.post_send(&[SendWr::write(3, &[f.mr.sge(0, 64)], 0x1000, 5).inject_complete(true)]).unwrap();
        let third = next_frame(&mut f.peer);
        f.peer.read_exact(&mut data).unwrap();
        assert_eq!(completions(&f, 1), [3]);
        // The peer acknowledging it later is no news; refusing it fails the queue pair.
        f.peer.write_all(&Frame::new(Kind::Ack, third.seq).encode()).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(f.qp.state(), QpState::ReadyToSend);
        let mut nak = Frame::new(Kind::Nak, third.seq);
        nak.nak = Some(NakCode::AccessError);
        f.peer.write_all(&nak.encode()).unwrap();
        wait_for_error(&f);
    }

    #[test]
    fn writes_completed_at_injection_are_acknowledged_by_the_next_frame_back_not_alone() {
        let mut f = fake();
        let write = |seq: u32, at: u64, flags: u8| {
            let mut w = Frame::new(Kind::Write, seq);
            (w.raddr, w.rkey, w.len, w.flags) = (f.mr.addr() + at, f.mr.rkey(), 8, flags);
            w
        };
        f.peer.write_all(&write(1, 0, FLAG_LAZY_ACK).encode()).unwrap();
        f.peer.write_all(&[1u8; 8]).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut placed = [0u8; 8];
        while placed != [1u8; 8] {
            assert!(Instant::now() < deadline, "the write was never placed");
            std::thread::sleep(Duration::from_millis(1));
            f.mr.read(0, &mut placed);
        }
        // No frame of its own answers it...
        f.peer.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        let mut h = [0u8; HEADER];
        let quiet = f.peer.read_exact(&mut h);
        assert!(quiet.is_err(), "an answer came: {:?}", Frame::decode(&h));
        f.peer.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        // ...while a write that waits for its answer gets one, covering both.
        f.peer.write_all(&write(2, 8, 0).encode()).unwrap();
        f.peer.write_all(&[2u8; 8]).unwrap();
        let ack = next_frame(&mut f.peer);
        assert_eq!((ack.kind, ack.seq), (Kind::Ack, 2));
    }

    #[test]
    fn a_write_completed_at_injection_behind_a_refused_send_completes_without_an_answer_of_its_own() {
        let mut f = fake();
        let mut data = [0u8; 8];
        f.qp.post_send(&[SendWr::send(1, &[f.mr.sge(0, 8)])]).unwrap();
        f.qp.post_send(&[SendWr::write(2, &[f.mr.sge(8, 8)], 0x1000, 5).inject_complete(true)]).unwrap();
        let send = next_frame(&mut f.peer);
        f.peer.read_exact(&mut data).unwrap();
        let write = next_frame(&mut f.peer);
        f.peer.read_exact(&mut data).unwrap();
        assert_eq!((send.kind, write.kind, write.flags & FLAG_LAZY_ACK), (Kind::Send, Kind::Write, FLAG_LAZY_ACK));
        // Receiver not ready (the shortest timer): both go again, in order; the write waits
        // behind the send.
        let mut nak = Frame::new(Kind::Nak, send.seq);
        (nak.nak, nak.imm) = (Some(NakCode::ReceiverNotReady), 1);
        f.peer.write_all(&nak.encode()).unwrap();
        let again = next_frame(&mut f.peer);
        f.peer.read_exact(&mut data).unwrap();
        let write_again = next_frame(&mut f.peer);
        f.peer.read_exact(&mut data).unwrap();
        assert_eq!((again.kind, again.seq, write_again.seq), (Kind::Send, send.seq, write.seq));
        let mut wc = [WorkCompletion::EMPTY; 4];
        assert_eq!(f.cq.poll(&mut wc).unwrap(), 0, "nothing completes before the send's answer");
        // Only the send is answered: the write behind it completes anyway.
        f.peer.write_all(&Frame::new(Kind::Ack, send.seq).encode()).unwrap();
        assert_eq!(completions(&f, 2), [1, 2]);
    }
}
