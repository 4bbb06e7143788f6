//! SDP stream sockets with `std::net` semantics: [`SdpListener`] and [`SdpStream`].
//!
//! A connection is set up over an out-of-band TCP socket on the given address (the bootstrap
//! of `portability_verbs::cm`), then carries SDP messages ([`crate::wire`]) over a
//! flow-controlled message pipe (`datapath::pipe`, whose credit, RDMA-ring or window flow
//! control is the slides' buffer-copy flow control). How a socket *sends* is its design:
//!
//! - BSDP copies stream bytes into Data messages through the pipe's pre-registered buffers;
//! - ZSDP, for writes of at least the zero-copy threshold, advertises the registered user
//!   buffer in a SrcAvail; the receiver RDMA-reads it straight into the buffer its `read` was
//!   given and answers RdmaRdCompl, and only then does `write` return (one outstanding);
//! - AZ-SDP advertises the same way but returns at once, with the buffer's whole pages made
//!   read-only (`portability_verbs::protect`) until RdmaRdCompl releases them; several
//!   SrcAvails are outstanding. The unaligned head and tail of a buffer go as Data (the paper's
//!   hybrid). An AZ-SDP receiver makes the whole pages of its `read` buffer inaccessible, starts
//!   the RDMA read and returns; touching them waits in the fault handler until the data is
//!   there. A touch of a held buffer is a page fault; after `az_fault_limit` of them a socket
//!   falls back to ZSDP for good. The background engine (the crate's `engine` module) finishes transfers
//!   while the application computes or waits in a fault.
//!
//! The AZ-SDP contract for the application: after `write` returns, changing the buffer never
//! changes what the peer receives (the change waits); after `read` returns `n`, reading those
//! bytes shows the data (the read waits). A written buffer must stay mapped until `flush`
//! returns: freeing a large allocation unmaps it, and unmapping a held buffer loses the transfer
//! and fails the socket, or, once other memory is mapped at those addresses before the peer
//! read them, makes the peer receive that memory's bytes (the provider reads by address, where
//! a NIC would read the pinned pages). So free written buffers only after `flush`. System
//! calls given a held buffer see `EFAULT` rather than waiting: touch it, or call
//! [`SdpStream::wait_transfers`], first. A written buffer stays read-only
//! after the peer has read it (up to 16 per socket), so that writing it again costs no real
//! `mprotect`: the first store opens it through the fault handler, and `flush`,
//! `wait_transfers` and close open every such buffer.
//!
//! Receivers handle every message kind whatever their own design, so the two ends need not
//! agree. A peer's malformed message, an unhonored advertisement (the read fails) or a dead
//! peer fail the socket with an I/O error; stream bytes already delivered stay readable.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use log::debug;
use portability_verbs::cm::{self, CmAddr};
use portability_verbs::copy::{copy_bytes, copy_slice};
use portability_verbs::datapath::{FlowStrategy, Lane, MsgPipe, PipeOptions, Registration};
use portability_verbs::protect::{self, LazyRange, ProtectedRange, Protection};
use portability_verbs::{AccessFlags, CompletionQueue, MemoryRegion, SendWr, Sge, VerbsError, WcStatus};

use crate::engine::{self, Background};
use crate::proto::lock::{self, ReceiverClaim, SenderClaim, Taker};
use crate::proto::{Event, Proto, ProtoError, RxItem};
use crate::wire::{Advert, Design, Message, BSDH_LEN};

mod config;
mod conn;
mod cow;
mod listener;
mod options;
mod pace;
mod ready;
mod recv;
mod runtime;
mod send;

use crate::verbs_runtime::runtime;
use config::invalid;
pub use config::SdpConfig;
pub use listener::SdpListener;
use pace::{Deadline, Pacer};
use ready::Locked;
pub use ready::ReadyState;
use runtime::{qp_spec, resolve, verbs_io};

/// How long connection setup may take.
const SETUP_TIMEOUT: Duration = Duration::from_secs(10);
/// Private data that marks an SDP connection attempt.
const SDP_MAGIC: &[u8] = b"SDP1";
/// AZ-SDP send buffers a socket keeps lazily protected after their transfer (see [`Conn::lazy`]).
const LAZY_MAX: usize = 16;
/// Words of a connection's copy-on-write lock table: one per SrcAvail the peer may have
/// outstanding (`az_max_outstanding` is at most this), the word of SrcAvail `n` being `n % 256`.
const LOCK_WORDS: u64 = 256;
/// Where, in a connection's lock memory, our own compare-and-swap results land.
const CAS_RESULT: usize = 8 * LOCK_WORDS as usize;

/// What a SrcAvail of ours lets the peer read (kept with it in [`Proto`] until its answer).
enum Sending {
    /// ZSDP: the waiting `write` keeps the buffer and its registration.
    Waited,
    /// AZ-SDP: the application's buffer, read-only until the answer, and its registration;
    /// since when a store has been waiting for it (as far as we noticed); `lost` once the peer
    /// took the buffer's lock word first (it is reading: the store waits).
    Held { hold: ProtectedRange, reg: Registration<'static>, waited_since: Option<Instant>, lost: bool },
    /// AZ-SDP after copy-on-write: the private copy the peer reads instead.
    Copied { _copy: MemoryRegion },
}

/// What `Conn::post_read` returns for a read that completed at post (no pipe token is
/// this large).
const READ_DONE: u64 = u64::MAX;

/// An RDMA read of a peer's SrcAvail in flight, in posting (and completion) order.
struct PendingRead {
    token: u64,
    /// AZ-SDP: our receive buffer, inaccessible until the read completes.
    hold: Option<ProtectedRange>,
    _reg: Registration<'static>,
    /// Answer RdmaRdCompl with this length once complete (the advert's last read).
    answer: Option<u32>,
    /// The application read into the held buffer again before the data landed.
    ran_into: bool,
}

/// Whether an AZ-SDP receive's hold pays on this socket. A hold lets `read` return before its
/// data has landed, which helps an application that does something else before it touches the
/// buffer again; one that reads into the same buffer at once (a ttcp-style loop) waits for the
/// data anyway, and pays two `mprotect`s and a landing through `/proc/self/mem` besides. After
/// [`RxHolds::MISS_LIMIT`] holds in a row that the application ran into before they landed,
/// receives wait for their data instead (as ZSDP's do); every [`RxHolds::TRIAL_EVERY`]th
/// one may hold again, so a socket whose application changes its ways holds again.
#[derive(Default)]
struct RxHolds {
    /// Holds in a row the application ran into.
    misses: u32,
    /// Receives that waited since the last trial.
    waited: u32,
}

impl RxHolds {
    const MISS_LIMIT: u32 = 4;
    const TRIAL_EVERY: u32 = 64;

    /// Whether the next receive may hold its buffer (else it waits for its data).
    fn may_hold(&mut self) -> bool {
        if self.misses < Self::MISS_LIMIT {
            return true;
        }
        self.waited += 1;
        if self.waited >= Self::TRIAL_EVERY {
            self.waited = 0;
            return true;
        }
        false
    }

    /// A held receive landed; `ran_into`: the application met the hold before that.
    fn landed(&mut self, ran_into: bool) {
        self.misses = if ran_into { self.misses.saturating_add(1) } else { 0 };
    }
}

/// What one read attempt found.
enum ReadStep {
    Got(usize),
    Nothing,
    /// The next bytes are copied by the CPU, but a hold covers the buffer: wait, then retry.
    BufferHeld,
}

/// A socket's connection: the protocol state and what drives it.
struct Conn {
    pipe: MsgPipe,
    /// Stream content received, our SrcAvails awaiting an answer, sequence numbers, what the
    /// peer announced.
    proto: Proto<Sending>,
    config: SdpConfig,
    local: SocketAddr,
    peer: SocketAddr,
    /// Why the socket failed, if it did.
    failed: Option<(io::ErrorKind, String)>,
    /// The transport failed only after the peer's Close, with nothing of ours needing the
    /// peer any more: the peer tore its queue pair down, as a closed peer may. The
    /// connection ended rather than failed: reads see EOF, flush has nothing to wait for,
    /// writes fail as after any Close.
    ended_by_peer: bool,
    /// [`Conn::fail_verbs`] is taking in what the peer sent before its transport failed (and
    /// a failure met on the way is judged as it stands, not taken in again).
    taking_last_words: bool,
    read_shut: bool,
    write_shut: bool,
    /// `shutdown(Write)` queued a Disconnect that flow control has not admitted yet: it goes
    /// with the socket's next call or the engine's next visit (a shutdown never waits, as a
    /// TCP FIN queued behind unsent bytes does not).
    disconnect_pending: bool,
    /// Closed: when the application let go of the socket (or the process began to exit), and
    /// whether its Close is still to be sent. A closed socket lives on in the engine until the
    /// peer has taken every byte (see the crate's `engine` module).
    closing: Option<Instant>,
    close_pending: bool,
    /// `calls` as the engine's quiet visit saw it last time.
    calls_quiet: u64,
    /// Our lock table (a word per SrcAvail of the peer's, taken by us with local atomics before
    /// we read it, by the peer with compare-and-swap before it copies it aside), then the word
    /// our own compare-and-swap results land in. `None` where the provider cannot run local
    /// atomics against remote ones: the peer is then never told of a table and never copies.
    locks: Option<MemoryRegion>,
    /// Our compare-and-swap on the peer's lock table in flight: (SrcAvail number, token,
    /// value expected).
    cow_try: Option<(u64, u64, u64)>,
    /// SrcAvailUpdates flow control held back, oldest first.
    cow_unsent: VecDeque<(u64, Advert)>,
    /// When the peer last answered a SrcAvail of ours (or the connection came up): a peer that
    /// keeps answering is reading, and a store waiting for it is better left waiting.
    answered_at: Instant,
    /// ZSDP: the answer to the waiting write's SrcAvail.
    zcopy_answer: Option<u32>,
    reads: VecDeque<PendingRead>,
    /// Whether receive holds have paid lately.
    rx_holds: RxHolds,
    /// AZ-SDP send buffers read already whose pages were left read-only (oldest first): sending
    /// one again re-protects it for the price of an `mprotect` that changes nothing, and a write
    /// to one opens it from the fault handler. Opened at `flush`, `wait_transfers` and close,
    /// after which the application may unmap them.
    lazy: VecDeque<LazyRange>,
    /// Faults taken on this socket's held (and lazily kept) buffers.
    faults: u32,
    /// AZ-SDP gave up after too many faults: this socket sends and receives as ZSDP now.
    fell_back: bool,
    /// Under the engine's watch: transfers in flight (let go of when a visit finds it idle).
    watched: bool,
    /// Calls of the application into the socket so far (a counter, not a clock: reading the
    /// clock on every lock cost a tenth of an AZ-SDP write).
    calls: u64,
    /// `calls` as the background engine saw it last time.
    calls_seen: u64,
    /// `calls` as the readiness watcher saw it last time.
    calls_ready: u64,
    /// The descriptor event loops wait on (see the `ready` module); gone once the application
    /// closed the socket.
    ready: Option<ready::Readiness>,
    nonblocking: bool,
    /// `set_nodelay`'s last value (SDP never holds small writes back, whatever it says).
    nodelay: bool,
    /// `take_error` reported `failed` already.
    error_taken: bool,
    /// A peek reads the front of the stream into a private buffer: no receive hold.
    peeking: bool,
    read_timeout: Option<Duration>,
    write_timeout: Option<Duration>,
    tx: Vec<u8>,
}

/// A connected SDP stream socket: a reliable byte stream like `TcpStream`. Dropping the last
/// handle closes it: the peer reads every byte written before, then EOF, however late it
/// reads (the crate's `engine` module says how long a closed socket waits for that).
pub struct SdpStream {
    conn: Arc<Mutex<Conn>>,
    /// The connection's completion queue, to sleep on without holding the lock.
    cq: CompletionQueue,
    /// Handles of this socket ([`SdpStream::try_clone`]): the last one dropped closes it.
    handles: Arc<std::sync::atomic::AtomicUsize>,
}

impl SdpStream {
    /// Connects to an SDP listener at `addr` with the settings from the environment.
    pub fn connect(addr: impl ToSocketAddrs) -> io::Result<SdpStream> {
        Self::connect_with(addr, SdpConfig::from_env()?)
    }

    /// Connects with explicit settings: tries each address `addr` resolves to in turn, as
    /// `TcpStream::connect` does, and returns the last error if none accepts.
    pub fn connect_with(addr: impl ToSocketAddrs, config: SdpConfig) -> io::Result<SdpStream> {
        config.validate()?;
        let mut last = None;
        for a in addr.to_socket_addrs()? {
            match Self::connect_one(a, config, SETUP_TIMEOUT) {
                Ok(s) => return Ok(s),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| invalid("address resolves to nothing".into())))
    }

    /// Connects to `addr` with the settings from the environment, giving up after `timeout`
    /// (connection set-up included), as `TcpStream::connect_timeout`. A zero timeout is
    /// invalid, as in std.
    pub fn connect_timeout(addr: &SocketAddr, timeout: Duration) -> io::Result<SdpStream> {
        if timeout.is_zero() {
            return Err(invalid("zero connect timeout".into()));
        }
        let config = SdpConfig::from_env()?;
        config.validate()?;
        Self::connect_one(*addr, config, timeout)
    }

    fn connect_one(addr: SocketAddr, config: SdpConfig, timeout: Duration) -> io::Result<SdpStream> {
        let rt = runtime()?;
        let conn = cm::connect(&CmAddr::Tcp(addr), &rt.pd, &qp_spec(), SDP_MAGIC, timeout).map_err(verbs_io)?;
        if conn.peer_private != SDP_MAGIC {
            return Err(io::Error::new(io::ErrorKind::ConnectionRefused, "the listener is not an SDP socket"));
        }
        Self::establish(conn, config)
    }

    fn establish(conn: cm::Connection, config: SdpConfig) -> io::Result<Self> {
        let rt = runtime()?;
        let unknown = || io::Error::other("bootstrap socket had no TCP address");
        let (local, peer) = (conn.local_addr.ok_or_else(unknown)?, conn.peer_addr.ok_or_else(unknown)?);
        let options = PipeOptions { bulk_ring: config.bulk_ring, ..PipeOptions::default() };
        let pipe =
            MsgPipe::establish_with(conn.qp, conn.cq, &rt.pd, config.flow, options, SETUP_TIMEOUT).map_err(verbs_io)?;
        let locks = rt.pd.register(vec![0u8; CAS_RESULT + 8].into_boxed_slice(), AccessFlags::ALL).map_err(verbs_io)?;
        let locks = match locks.local_atomic(0, |v| v) {
            Ok(_) => Some(locks),
            Err(VerbsError::Unsupported(why)) => {
                debug!("SDP: no copy-on-write lock table ({why})");
                None
            }
            Err(e) => return Err(verbs_io(e)),
        };
        let mut c = Conn {
            pipe,
            proto: Proto::new(config.az_max_outstanding),
            config,
            local,
            peer,
            failed: None,
            ended_by_peer: false,
            taking_last_words: false,
            read_shut: false,
            write_shut: false,
            disconnect_pending: false,
            closing: None,
            close_pending: false,
            calls_quiet: 0,
            locks,
            cow_try: None,
            cow_unsent: VecDeque::new(),
            answered_at: Instant::now(),
            zcopy_answer: None,
            reads: VecDeque::new(),
            rx_holds: RxHolds::default(),
            lazy: VecDeque::new(),
            faults: 0,
            fell_back: false,
            watched: false,
            calls: 0,
            calls_seen: 0,
            calls_ready: 0,
            ready: Some(ready::Readiness::new()?),
            nonblocking: false,
            nodelay: true,
            error_taken: false,
            peeking: false,
            read_timeout: None,
            write_timeout: None,
            tx: Vec::with_capacity(config.flow.max_message()),
        };
        if let Some(l) = &c.locks {
            let table = Advert { len: CAS_RESULT as u32, rkey: l.rkey(), addr: l.addr() };
            c.send_now(&Message::LockTable(table))?;
        }
        let cq = c.pipe.cq().clone();
        let conn = Arc::new(Mutex::new(c));
        engine::start();
        let socket: Arc<Mutex<dyn Background>> = conn.clone();
        engine::register(&socket);
        Ok(SdpStream { conn, cq, handles: Arc::new(1.into()) })
    }

    /// [`Conn::prepare_sleep`], under the lock.
    fn prepare_sleep(&self) -> bool {
        self.lock().prepare_sleep()
    }

    fn lock(&self) -> Locked<'_> {
        // A panic while holding the lock cannot leave the protocol half-updated in a way later
        // calls would misread: every path re-checks `failed` first.
        let mut c = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        c.calls = c.calls.wrapping_add(1);
        Locked(c)
    }

    /// Shuts down reading, writing or both. Shutting down writing sends Disconnect: the peer
    /// reads EOF after the bytes already written. It never waits: a Disconnect that flow
    /// control holds back behind unread bytes goes as soon as the peer makes room, sent by the
    /// socket's next call or by the background engine.
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        let mut c = self.lock();
        c.check_ok()?;
        if matches!(how, Shutdown::Read | Shutdown::Both) {
            c.read_shut = true;
        }
        if matches!(how, Shutdown::Write | Shutdown::Both) && !c.write_shut {
            c.write_shut = true;
            c.disconnect_pending = true;
            c.send_pending_control()?;
            if c.disconnect_pending || !c.pipe.idle() {
                self.watch(&mut c);
            }
        }
        Ok(())
    }

    /// Receives what `read` would, without taking it from the stream: the next read returns
    /// the same bytes (as `TcpStream::peek`, `MSG_PEEK`). Waits as `read` does (nonblocking:
    /// `WouldBlock`); 0 at end of stream.
    pub fn peek(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.peek_impl(buf, false)
    }

    /// [`SdpStream::peek`] that never waits, whatever the socket's mode (`MSG_PEEK |
    /// MSG_DONTWAIT`): `WouldBlock` if nothing has arrived.
    pub fn try_peek(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.peek_impl(buf, true)
    }

    /// One read that never waits, whatever the socket's mode (`MSG_DONTWAIT`): `WouldBlock`
    /// if nothing has arrived. Other threads' calls keep the socket's mode.
    pub fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.read_impl(buf, true)
    }

    /// One write that never waits, whatever the socket's mode (`MSG_DONTWAIT`): what flow
    /// control takes now (copied), `WouldBlock` if nothing.
    pub fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
        self.write_impl(buf, true)
    }

    /// For an event loop about to wait on the socket's descriptor (the preload library's
    /// `poll`, `select` and `epoll_wait` call it while they poll): takes in what arrived,
    /// without waiting, shows it on the descriptor and returns it. `None` while another thread
    /// is in a call on the socket (that call shows the state it leaves).
    pub fn poll_ready(&self) -> Option<ReadyState> {
        let mut c = match self.conn.try_lock() {
            Ok(c) => Locked(c),
            Err(std::sync::TryLockError::Poisoned(p)) => Locked(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        // An application call: the readiness thread leaves the socket to it.
        c.calls = c.calls.wrapping_add(1);
        c.take_in();
        Some(ReadyState { readable: c.readable(), writable: c.writable() })
    }

    /// Tells the readiness thread that the caller is about to wait on the socket's descriptor
    /// (after [`SdpStream::try_read`] found nothing), so that it is ready to show the next
    /// arrival. (A nonblocking socket's `read` that finds nothing does this itself.)
    pub fn about_to_wait(&self) {
        if self.lock().ready.as_ref().is_some_and(|r| r.active) {
            ready::poke();
        }
    }

    fn peek_impl(&self, buf: &mut [u8], once: bool) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let deadline = &Deadline::after(self.lock().read_timeout);
        let mut pacer = Pacer::default();
        loop {
            {
                let mut c = self.lock();
                if let Some(n) = c.peek_now(buf)? {
                    return Ok(n);
                }
                if c.nonblocking || once {
                    return Err(io::ErrorKind::WouldBlock.into());
                }
            }
            pacer
                .pause_on(deadline, "peeking", Some(&self.cq), || self.prepare_sleep())
                .map_err(|e| self.timeout_is_would_block(e))?;
        }
    }

    /// Another handle to the same socket (for example a reader thread and a writer thread).
    pub fn try_clone(&self) -> io::Result<SdpStream> {
        self.handles.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(SdpStream { conn: self.conn.clone(), cq: self.cq.clone(), handles: self.handles.clone() })
    }

    /// This end's send design.
    pub fn design(&self) -> Design {
        self.lock().config.design
    }

    /// Switches this end's send design (announced to the peer with ModeChange).
    pub fn set_design(&self, design: Design) -> io::Result<()> {
        SdpConfig { design, ..self.lock().config }.validate()?;
        self.lock().config.design = design;
        self.send_control(Message::ModeChange(design))
    }

    /// The design the peer last announced (BSDP until it announces one).
    pub fn peer_design(&self) -> Design {
        self.lock().proto.peer_design()
    }

    /// The design this end really uses now: ZSDP once an AZ-SDP socket has fallen back.
    pub fn effective_design(&self) -> Design {
        self.lock().effective_design()
    }

    /// Page faults taken on this socket's buffers so far (AZ-SDP): touches that waited for a
    /// transfer, and first writes to buffers kept read-only after theirs.
    pub fn faults(&self) -> u32 {
        let c = self.lock();
        c.lazy.iter().fold(c.faults, |n, l| n.saturating_add(l.faults()))
    }

    /// Waits until every transfer this socket started has completed and its buffers are
    /// released (AZ-SDP; immediate otherwise). `write` and `read` never need this: touching a
    /// buffer waits by itself. Useful before handing a buffer to a system call.
    pub fn wait_transfers(&self, timeout: Duration) -> io::Result<()> {
        let deadline = &Deadline::after(Some(timeout));
        let mut pacer = Pacer::default();
        loop {
            {
                let mut c = self.lock();
                c.pump()?;
                if c.proto.sends().is_empty() && c.reads.is_empty() {
                    c.open_all_lazy();
                    return Ok(());
                }
            }
            pacer.pause(deadline, "waiting for transfers to complete")?;
        }
    }

    fn send_control(&self, m: Message<'_>) -> io::Result<()> {
        let deadline = &Deadline::after(self.lock().write_timeout);
        let mut pacer = Pacer::default();
        loop {
            {
                let mut c = self.lock();
                if c.try_send(&m)? {
                    break;
                }
                c.pump()?;
            }
            pacer.pause(deadline, "sending a control message")?;
        }
        self.drain_staged(deadline)?;
        self.hand_over();
        Ok(())
    }

    /// Drives the pipe until nothing accepted is still coalesced on our side.
    fn drain_staged(&self, deadline: &Deadline) -> io::Result<()> {
        let mut pacer = Pacer::default();
        loop {
            {
                let mut c = self.lock();
                c.flush_pipe()?;
                if c.pipe.staged() == 0 {
                    return Ok(());
                }
                c.pump()?;
            }
            pacer.pause(deadline, "handing data to the transport")?;
        }
    }

    fn read_impl(&self, buf: &mut [u8], once: bool) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let deadline = {
            let mut c = self.lock();
            // Before `try_read` lands what it can: a hold met now has not paid.
            c.ran_into_holds(buf);
            &Deadline::after(c.read_timeout)
        };
        let mut pacer = Pacer::default();
        loop {
            {
                let mut c = self.lock();
                match c.try_read(buf)? {
                    ReadStep::Got(n) => {
                        if !c.reads.is_empty() {
                            self.watch(&mut c);
                        }
                        return Ok(n);
                    }
                    // Our own or another socket's transfer holds the buffer: it ends without us.
                    ReadStep::BufferHeld => protect::ring_bell(),
                    ReadStep::Nothing if c.nonblocking || once => {
                        if c.nonblocking && c.ready.as_ref().is_some_and(|r| r.active) {
                            ready::poke(); // the application waits for the descriptor next
                        }
                        return Err(io::ErrorKind::WouldBlock.into());
                    }
                    ReadStep::Nothing => {
                        drop(c);
                        // Whatever comes next (a message, bulk data, our reads) completes.
                        pacer.pause_on(deadline, "reading", Some(&self.cq), || self.prepare_sleep())?;
                        continue;
                    }
                }
            }
            pacer.pause(deadline, "reading")?;
        }
    }

    /// Hands the socket to the background engine, which finishes its transfers in flight.
    fn watch(&self, c: &mut Conn) {
        if !c.watched {
            c.watched = true;
            let socket: Arc<Mutex<dyn Background>> = self.conn.clone();
            engine::watch(&socket);
        }
    }

    /// Waits until no transfer holds `buf` against reading (a receive whose data has not
    /// landed), driving this socket meanwhile: `write` reads the buffer.
    fn wait_readable(&self, buf: &[u8], deadline: &Deadline) -> io::Result<()> {
        let mut pacer = Pacer::default();
        while protect::read_blocked(buf.as_ptr() as usize, buf.len()) {
            let mut c = self.lock();
            c.ran_into_holds(buf);
            c.pump()?;
            drop(c);
            if !protect::read_blocked(buf.as_ptr() as usize, buf.len()) {
                break;
            }
            protect::ring_bell();
            pacer.pause(deadline, "waiting for a held buffer")?;
        }
        Ok(())
    }

    /// A write (blocking unless the socket is nonblocking) that `stop` can end: asked now and then
    /// while the write waits (for room, for the peer), a true makes it return the bytes
    /// written so far, or `Interrupted` if none, as a signal ends a kernel socket's send (the
    /// preload library's blocking sends). Zero-copy writes (ZSDP, AZ-SDP), whose buffer the
    /// peer may be reading, are not stopped.
    pub fn write_or_stop(&self, buf: &[u8], stop: &dyn Fn() -> bool) -> io::Result<usize> {
        self.write_with(buf, false, Some(stop))
    }

    fn write_impl(&self, buf: &[u8], once: bool) -> io::Result<usize> {
        self.write_with(buf, once, None)
    }

    fn write_with(&self, buf: &[u8], once: bool, stop: Option<&dyn Fn() -> bool>) -> io::Result<usize> {
        let (design, zcopy, nonblocking, timeout, hold_min) = {
            let c = self.lock();
            c.check_writable()?;
            let zcopy = buf.len() >= c.config.zcopy_threshold;
            (c.effective_design(), zcopy, c.nonblocking || once, c.write_timeout, c.config.az_hold_min)
        };
        if buf.is_empty() {
            return Ok(0);
        }
        let deadline = &match stop {
            Some(stop) => Deadline::after_or(timeout, stop),
            None => Deadline::after(timeout),
        };
        // Sending reads the buffer: a receive still landing in it must finish first.
        self.wait_readable(buf, deadline)?;
        // A nonblocking socket copies: it cannot hold the caller's buffer past the call.
        let written = match design {
            Design::Zsdp if zcopy && !nonblocking => self.write_zcopy(buf, timeout),
            Design::AzSdp if zcopy && !nonblocking && buf.len() >= hold_min => self.write_async(buf, deadline),
            _ => self.write_copy(buf, nonblocking, deadline),
        };
        self.hand_over();
        match written {
            Err(e) if deadline.stopped() && e.kind() == io::ErrorKind::TimedOut => {
                Err(io::Error::new(io::ErrorKind::Interrupted, "interrupted writing"))
            }
            other => other,
        }
    }

    /// Leaves the socket to the background engine while its pipe has requests the transport
    /// has not finished: on the software provider a request queued behind earlier ones (a
    /// ring acknowledgement, an RDMA write, waits for the peer to take a message first) starts
    /// only when this process drives the queue pair again, and the application may never call
    /// into the socket again (a last write, then waiting elsewhere for the answer).
    fn hand_over(&self) {
        let mut c = self.lock();
        if c.failed.is_none() && !c.pipe.idle() {
            self.watch(&mut c);
        }
    }
}

/// Splits a buffer at `addr` of `len` bytes into its unaligned head and its whole pages:
/// `(head, middle)` in bytes (`middle` 0 when no whole page fits).
fn whole_pages(addr: usize, len: usize) -> (usize, usize) {
    let page = portability_verbs::page_size();
    let head = (addr.next_multiple_of(page) - addr).min(len);
    let middle = (len - head) / page * page;
    if middle == 0 {
        (len, 0)
    } else {
        (head, middle)
    }
}

impl std::fmt::Debug for SdpStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        f.debug_struct("SdpStream")
            .field("local", &c.local)
            .field("peer", &c.peer)
            .field("design", &c.effective_design())
            .field("failed", &c.failed.as_ref().map(|(k, _)| *k))
            .finish()
    }
}

impl SdpStream {
    /// A read or write timeout is `WouldBlock`, as Linux reports `SO_RCVTIMEO` and
    /// `SO_SNDTIMEO` (`EAGAIN`); a connection that failed by timing out keeps `TimedOut`.
    fn timeout_is_would_block(&self, e: io::Error) -> io::Error {
        if e.kind() == io::ErrorKind::TimedOut && self.lock().failed.is_none() {
            return io::Error::new(
                io::ErrorKind::WouldBlock,
                e.into_inner().map_or("timed out".into(), |i| i.to_string()),
            );
        }
        e
    }
}

impl std::os::fd::AsRawFd for SdpStream {
    /// A descriptor that polls readable when a read would not wait and writable when a
    /// nonblocking write would take bytes, for `poll`, `epoll`, mio or tokio's `AsyncFd` (an
    /// eventfd kept current by this crate's readiness thread from the first time it is asked
    /// for; see the `ready` module). Shared by the socket's clones; closed with the socket.
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        let mut c = self.lock();
        let Some(r) = c.ready.as_mut() else { unreachable!("open while a handle exists") };
        let (fd, first) = (r.raw(), !std::mem::replace(&mut r.active, true));
        drop(c);
        if first {
            if let Err(e) = ready::watch_socket(&self.conn) {
                log::error!("SDP socket readiness: {e}");
            }
        }
        fd
    }
}

impl std::os::fd::AsFd for SdpStream {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        // SAFETY: the descriptor stays open while a handle of the socket exists.
        unsafe { std::os::fd::BorrowedFd::borrow_raw(std::os::fd::AsRawFd::as_raw_fd(self)) }
    }
}

impl Read for SdpStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
}

impl Read for &SdpStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.read_impl(buf, false).map_err(|e| self.timeout_is_would_block(e))
    }
}

impl Write for SdpStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&*self).write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        (&*self).flush()
    }
}

impl Write for &SdpStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_impl(buf, false).map_err(|e| self.timeout_is_would_block(e))
    }
    /// Every write hands its bytes to the transport before returning; flush drives what flow
    /// control still holds and, for AZ-SDP, waits until the peer has read every buffer written
    /// (after which they may be freed or unmapped).
    fn flush(&mut self) -> io::Result<()> {
        let deadline = &Deadline::after(self.lock().write_timeout);
        let mut pacer = Pacer::default();
        loop {
            {
                let mut c = self.lock();
                let driven = c.flush_pipe().and_then(|()| c.pump());
                if c.ended_by_peer {
                    return Ok(()); // nothing of ours was left for the peer to read
                }
                driven?;
                if c.proto.sends().is_empty() {
                    c.open_all_lazy();
                    return Ok(());
                }
            }
            pacer.pause(deadline, "waiting for the peer to read the buffers written")?;
        }
    }
}

impl Drop for SdpStream {
    /// The last handle closes the socket: Close goes after the bytes written, and a socket whose
    /// peer has not taken them all stays with the background engine until it has (as a closed
    /// TCP socket stays in the kernel), without making the caller wait.
    fn drop(&mut self) {
        if self.handles.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) != 1 {
            return;
        }
        let finished = {
            let mut c = self.lock();
            // Event loops see the descriptor closed, as a closed socket's.
            c.ready = None;
            c.start_close();
            c.close_finished()
        };
        if !finished {
            engine::orphan(self.conn.clone());
        }
    }
}

impl Drop for Conn {
    /// The connection's end (closed and done, failed, or at exit): nothing may still read or
    /// write the application's buffers afterwards.
    fn drop(&mut self) {
        self.release_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_is_fixed_when_first_asked_and_absent_without_a_timeout() {
        assert_eq!(Deadline::never().get(), None);
        assert!(!Deadline::never().passed());
        let d = Deadline::after(Some(Duration::from_millis(20)));
        let before = Instant::now();
        let first = d.get().expect("a timeout gives a deadline");
        assert!(first >= before + Duration::from_millis(20));
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(d.get(), Some(first), "asking again must not move it");
        assert!(!d.passed());
        std::thread::sleep(Duration::from_millis(25));
        assert!(d.passed());
    }

    /// A stopped deadline has passed (from the look that found the stop on), with or without a
    /// timeout; an unstopped one is as its timeout makes it.
    #[test]
    fn a_deadline_passes_once_its_stop_says_so() {
        let now = std::cell::Cell::new(false);
        let stop = || now.get();
        let d = Deadline::after_or(None, &stop);
        assert!((0..100).all(|_| !d.passed()) && !d.stopped());
        now.set(true);
        assert!((0..2 * pace::STOP_EVERY).any(|_| d.passed()), "the stop was never asked");
        assert!(d.stopped() && d.passed() && d.get().is_some());
        let d = Deadline::after_or(Some(Duration::from_secs(60)), &stop);
        assert!((0..2 * pace::STOP_EVERY).any(|_| d.passed()) && d.stopped());
    }

    /// A blocking write to a reader that reads nothing is ended by its stop: the bytes written
    /// so far, or `Interrupted` when it could write none; a stop that never says so leaves a
    /// write that fits alone.
    #[test]
    fn a_blocking_write_ends_when_its_stop_says_so() {
        let listener = SdpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = std::thread::spawn(move || listener.accept().unwrap().0);
        let w = SdpStream::connect(addr).unwrap();
        let _r = accepted.join().unwrap();
        let big = vec![7u8; 64 << 20];
        let start = Instant::now();
        let after = |t: Duration| move || start.elapsed() >= t;
        let first = w.write_or_stop(&big, &after(Duration::from_millis(100))).unwrap();
        assert!(first > 0 && first < big.len(), "a partial write, not {first} bytes");
        assert!(start.elapsed() < Duration::from_secs(5));
        let e = w.write_or_stop(&big, &|| true).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::Interrupted, "{e}");
        assert_eq!(w.write_or_stop(b"", &|| true).unwrap(), 0);
    }

    /// A transport failure found by any call while the peer's Close still waits in the pipe
    /// (a progress pass that met the peer's queue pair gone before it looked at the ring) is
    /// judged after taking that Close in: the connection ended, it was not lost.
    #[test]
    fn a_failure_found_before_the_peers_close_was_taken_in_ends_the_connection() {
        let listener = SdpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = std::thread::spawn(move || listener.accept().unwrap().0);
        let c = SdpStream::connect(addr).unwrap();
        let s = accepted.join().unwrap();
        std::thread::spawn(move || drop(c)).join().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while s.lock().pipe.front().unwrap().is_none() {
            assert!(Instant::now() < deadline, "the Close never arrived");
        }
        let mut g = s.lock();
        let e = g.fail_verbs(VerbsError::PeerUnreachable("found by a progress pass".into()));
        assert_eq!(e.kind(), io::ErrorKind::BrokenPipe, "{e}");
        assert!(g.ended_by_peer && g.proto.eof());
    }

    /// A polled pipe's messages raise no completion: a reader past its spin phase tells the
    /// peer it sleeps, and the writer's next message raises one for it (counted as control
    /// transfers on both ends: the announcement, and the wake-up).
    #[test]
    fn a_sleeping_reader_on_a_polled_stream_is_woken_by_the_write() {
        let config = SdpConfig { design: Design::Bsdp, flow: SdpConfig::POLLED, ..SdpConfig::default() };
        let listener = SdpListener::bind_with("127.0.0.1:0", config).unwrap();
        let addr = listener.local_addr().unwrap();
        let writer = std::thread::spawn(move || {
            let mut w = SdpStream::connect_with(addr, config).unwrap();
            std::thread::sleep(Duration::from_millis(200));
            w.write_all(b"wake").unwrap();
            let mut ack = [0u8; 1];
            w.read_exact(&mut ack).unwrap();
            let control = w.lock().pipe.stats().control;
            control
        });
        let (mut r, _) = listener.accept().unwrap();
        r.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut b = [0u8; 4];
        r.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"wake");
        let announced = r.lock().pipe.stats().control;
        r.write_all(b"k").unwrap();
        let answered = writer.join().unwrap();
        assert!(announced >= 1, "the reader slept without telling the writer");
        assert!(answered >= 1, "the writer raised no wake-up for the sleeping reader");
    }

    #[test]
    fn receive_holds_stop_once_the_application_keeps_running_into_them_and_are_tried_again() {
        let mut h = RxHolds::default();
        for _ in 0..RxHolds::MISS_LIMIT - 1 {
            assert!(h.may_hold());
            h.landed(true);
        }
        // A hold that paid clears the streak.
        assert!(h.may_hold());
        h.landed(false);
        for _ in 0..RxHolds::MISS_LIMIT {
            assert!(h.may_hold());
            h.landed(true);
        }
        let tries: Vec<bool> = (0..3 * RxHolds::TRIAL_EVERY).map(|_| h.may_hold()).collect();
        let trials: Vec<usize> = tries.iter().enumerate().filter(|(_, &t)| t).map(|(i, _)| i).collect();
        let every = RxHolds::TRIAL_EVERY as usize;
        assert_eq!(trials, vec![every - 1, 2 * every - 1, 3 * every - 1], "only every {every}th receive tries");
        // A trial that pays brings holds back.
        h.landed(false);
        assert!((0..8).all(|_| h.may_hold()));
    }
}
