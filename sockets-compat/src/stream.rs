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
use portability_verbs::datapath::{FlowStrategy, Lane, MsgPipe, PipeOptions, Registration, RegistrationCache};
use portability_verbs::protect::{self, LazyRange, ProtectedRange, Protection};
use portability_verbs::{
    AccessFlags, CompletionQueue, Context, MemoryRegion, ProtectionDomain, SendWr, Sge, VerbsError, WcStatus,
};

use crate::engine::{self, Background};
use crate::proto::lock::{self, ReceiverClaim, SenderClaim, Taker};
use crate::proto::{Event, Proto, ProtoError, RxItem};
use crate::wire::{Advert, Design, Message, BSDH_LEN};

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

/// Per-socket settings, by default from the environment: `SDP_DESIGN` (`bsdp`, `zsdp`,
/// `azsdp`), `SDP_FLOW` (`credit`, `rdma`, `window`, `polled`: must be the same at both ends),
/// `SDP_ZCOPY_THRESHOLD` (bytes), `SDP_AZ_OUTSTANDING`, `SDP_AZ_FAULT_LIMIT`, `SDP_AZ_HOLD_MIN`, `SDP_AZ_COW`
/// (`1` or `0`), `SDP_BULK_RING` and `SDP_BULK_MIN` (bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SdpConfig {
    /// How this end sends.
    pub design: Design,
    /// The buffer-copy flow control (both ends must use the same).
    pub flow: FlowStrategy,
    /// Writes of at least this many bytes go zero-copy (ZSDP, AZ-SDP).
    pub zcopy_threshold: usize,
    /// AZ-SDP: SrcAvails a socket may have outstanding before `write` waits.
    pub az_max_outstanding: usize,
    /// AZ-SDP: page faults on held buffers after which the socket falls back to ZSDP.
    pub az_fault_limit: u32,
    /// AZ-SDP: the smallest transfer whose buffer is held (memory-protected) while in flight;
    /// smaller zero-copy writes are copied (as BSDP sends them) and smaller reads wait for
    /// their data. Buffers below the allocator's mmap threshold (128 KiB in glibc) live in
    /// heap memory the allocator reuses once the program frees them, and a TLS library, say,
    /// frees each record right after writing it: the allocator's next use of those pages,
    /// inside this library's own locked code, would wait for a transfer only that code can
    /// finish. Copying them costs less than protecting them anyway.
    pub az_hold_min: usize,
    /// AZ-SDP: a store into a buffer the peer has not started reading copies it aside (the
    /// paper's copy-on-write) instead of waiting for the peer to read it (block-on-write).
    pub az_copy_on_write: bool,
    /// Bytes of this socket's inbound bulk ring (0: none; else a power of two, 4 KiB to
    /// 1 GiB). The peer's large buffer-copy writes land there straight from its buffer.
    pub bulk_ring: usize,
    /// Buffer-copy writes of at least this many bytes go through the peer's bulk ring, when
    /// it has one: copied once by the sender into the ring and once out by the receiver's
    /// `read` (Data messages cost a third copy, through the pipe's private buffers). A
    /// nonblocking socket always sends Data: the bulk lane would hold its buffer past the call.
    pub bulk_min: usize,
}

impl SdpConfig {
    /// Credit-based defaults sized for streams: 16 private buffers of 8 KiB.
    pub const CREDIT: FlowStrategy = FlowStrategy::Credit { buffers: 16, buf_size: 8192 + 16 };
    /// RDMA-ring defaults: a 128 KiB ring, 4 KiB coalescing.
    pub const RDMA: FlowStrategy = FlowStrategy::Rdma { ring_bytes: 128 * 1024, coalesce: 4096 };
    /// Window defaults: 16 receives of 8 KiB.
    pub const WINDOW: FlowStrategy = FlowStrategy::Window { window: 8192, buffers: 16 };
    /// Polled defaults: a 128 KiB ring, 4 KiB coalescing.
    pub const POLLED: FlowStrategy = FlowStrategy::Polled { ring_bytes: 128 * 1024, coalesce: 4096 };

    /// The settings from the environment (invalid values are an error, not ignored).
    pub fn from_env() -> io::Result<SdpConfig> {
        let mut c = SdpConfig::default();
        if let Ok(v) = std::env::var("SDP_DESIGN") {
            c.design = Design::by_name(&v).ok_or_else(|| invalid(format!("SDP_DESIGN={v:?}: bsdp, zsdp or azsdp")))?;
        }
        if let Ok(v) = std::env::var("SDP_FLOW") {
            c.flow = match v.as_str() {
                "credit" => Self::CREDIT,
                "rdma" => Self::RDMA,
                "window" => Self::WINDOW,
                "polled" => Self::POLLED,
                _ => return Err(invalid(format!("SDP_FLOW={v:?}: credit, rdma, window or polled"))),
            };
        }
        if let Ok(v) = std::env::var("SDP_ZCOPY_THRESHOLD") {
            c.zcopy_threshold = v.parse().map_err(|_| invalid(format!("SDP_ZCOPY_THRESHOLD={v:?}: bytes")))?;
        }
        if let Ok(v) = std::env::var("SDP_AZ_OUTSTANDING") {
            c.az_max_outstanding = v.parse().map_err(|_| invalid(format!("SDP_AZ_OUTSTANDING={v:?}: a count")))?;
        }
        if let Ok(v) = std::env::var("SDP_AZ_FAULT_LIMIT") {
            c.az_fault_limit = v.parse().map_err(|_| invalid(format!("SDP_AZ_FAULT_LIMIT={v:?}: a count")))?;
        }
        if let Ok(v) = std::env::var("SDP_AZ_HOLD_MIN") {
            c.az_hold_min = v.parse().map_err(|_| invalid(format!("SDP_AZ_HOLD_MIN={v:?}: bytes")))?;
        }
        if let Ok(v) = std::env::var("SDP_BULK_RING") {
            c.bulk_ring = v.parse().map_err(|_| invalid(format!("SDP_BULK_RING={v:?}: bytes")))?;
        }
        if let Ok(v) = std::env::var("SDP_BULK_MIN") {
            c.bulk_min = v.parse().map_err(|_| invalid(format!("SDP_BULK_MIN={v:?}: bytes")))?;
        }
        if let Ok(v) = std::env::var("SDP_AZ_COW") {
            c.az_copy_on_write = match v.as_str() {
                "1" | "true" | "on" => true,
                "0" | "false" | "off" => false,
                _ => return Err(invalid(format!("SDP_AZ_COW={v:?}: 1 or 0"))),
            };
        }
        c.validate()?;
        Ok(c)
    }

    fn validate(&self) -> io::Result<()> {
        if self.az_max_outstanding == 0 || self.az_max_outstanding > LOCK_WORDS as usize {
            return Err(invalid(format!("az_max_outstanding must be 1..={LOCK_WORDS}")));
        }
        if self.flow.max_message() <= BSDH_LEN {
            return Err(invalid("flow-control messages too small for an SDP header".into()));
        }
        let ring = self.bulk_ring;
        if ring > 0 && (!(4096..=1 << 30).contains(&ring) || !ring.is_power_of_two()) {
            return Err(invalid(format!("bulk_ring of {ring} bytes: 0, or a power of two from 4 KiB to 1 GiB")));
        }
        if self.bulk_min == 0 {
            return Err(invalid("bulk_min must be at least 1 byte".into()));
        }
        Ok(())
    }
}

impl Default for SdpConfig {
    fn default() -> Self {
        SdpConfig {
            design: Design::Bsdp,
            flow: Self::CREDIT,
            zcopy_threshold: 64 * 1024,
            az_max_outstanding: 16,
            az_fault_limit: 64,
            az_hold_min: 128 * 1024,
            az_copy_on_write: true,
            bulk_ring: 2 << 20,
            bulk_min: 16 * 1024,
        }
    }
}

fn invalid(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, why)
}

fn verbs_io(e: VerbsError) -> io::Error {
    let kind = match &e {
        VerbsError::Timeout(_) => io::ErrorKind::TimedOut,
        VerbsError::PeerUnreachable(_) => io::ErrorKind::ConnectionReset,
        VerbsError::Refused(_) => io::ErrorKind::ConnectionRefused,
        VerbsError::Protocol(_) => io::ErrorKind::ConnectionAborted,
        VerbsError::InvalidArgument(_) => io::ErrorKind::InvalidInput,
        VerbsError::Os { source, .. } => source.kind(),
        _ => io::ErrorKind::Other,
    };
    io::Error::new(kind, e)
}

/// The verbs objects every socket of the process shares.
struct Runtime {
    pd: ProtectionDomain,
    regcache: RegistrationCache,
}

fn runtime() -> io::Result<&'static Runtime> {
    static RT: OnceLock<std::result::Result<Runtime, String>> = OnceLock::new();
    let rt = RT.get_or_init(|| {
        let ctx = Context::open_default().map_err(|e| e.to_string())?;
        let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
        let regcache = RegistrationCache::new(&pd, 1 << 30);
        Ok(Runtime { pd, regcache })
    });
    rt.as_ref().map_err(|e| io::Error::other(format!("opening the verbs device: {e}")))
}

fn resolve(addr: impl ToSocketAddrs) -> io::Result<SocketAddr> {
    addr.to_socket_addrs()?.next().ok_or_else(|| invalid("address resolves to nothing".into()))
}

/// A listening SDP socket.
pub struct SdpListener {
    inner: cm::Listener,
    local: SocketAddr,
    config: SdpConfig,
    nonblocking: std::sync::atomic::AtomicBool,
}

impl SdpListener {
    /// Binds to `addr` (port 0 picks a free port) with the settings from the environment.
    pub fn bind(addr: impl ToSocketAddrs) -> io::Result<SdpListener> {
        Self::bind_with(addr, SdpConfig::from_env()?)
    }

    /// Binds with explicit settings (accepted sockets send with `config.design`).
    pub fn bind_with(addr: impl ToSocketAddrs, config: SdpConfig) -> io::Result<SdpListener> {
        config.validate()?;
        runtime()?;
        let inner = cm::Listener::bind(&CmAddr::Tcp(resolve(addr)?)).map_err(verbs_io)?;
        let local = match inner.local_addr() {
            CmAddr::Tcp(a) => *a,
            CmAddr::Unix(_) => unreachable!("bound a TCP address"),
        };
        Ok(SdpListener { inner, local, config, nonblocking: false.into() })
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local)
    }

    /// Nonblocking mode: `accept` returns `WouldBlock` when no client is waiting.
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        self.nonblocking.store(on, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Waits for a connection and returns the connected socket and the peer's address.
    pub fn accept(&self) -> io::Result<(SdpStream, SocketAddr)> {
        self.accept_until(None)
    }

    /// [`SdpListener::accept`] that gives up with `TimedOut` after `limit` (an extension to
    /// the std API: lets tests and tools wait for a peer that may have failed to start).
    pub fn accept_timeout(&self, limit: Duration) -> io::Result<(SdpStream, SocketAddr)> {
        self.accept_until(Some(Instant::now() + limit))
    }

    fn accept_until(&self, deadline: Option<Instant>) -> io::Result<(SdpStream, SocketAddr)> {
        let rt = runtime()?;
        loop {
            let nonblocking = self.nonblocking.load(std::sync::atomic::Ordering::Relaxed);
            // Each client's bootstrap runs on its own inside the listener: a nonblocking accept
            // takes one that finished, a blocking one waits (in slices, to notice a switch to
            // nonblocking mode) for the next. A client that fails its bootstrap is dropped
            // there and never seen here, as a TCP listener never shows a failed handshake.
            let wait = match (nonblocking, deadline) {
                (true, _) => Duration::ZERO,
                (false, None) => Duration::from_millis(200),
                (false, Some(d)) => d.saturating_duration_since(Instant::now()).min(Duration::from_millis(200)),
            };
            match self.inner.accept(&rt.pd, &qp_spec(), SDP_MAGIC, wait) {
                Ok(conn) => {
                    if conn.peer_private != SDP_MAGIC {
                        debug!("rejecting a non-SDP bootstrap peer");
                        continue;
                    }
                    match SdpStream::establish(conn, self.config) {
                        Ok(s) => {
                            let peer = s.peer_addr()?;
                            return Ok((s, peer));
                        }
                        // The client's failure, not the listener's.
                        Err(e) => debug!("an SDP client failed its set-up: {e}"),
                    }
                }
                Err(VerbsError::Timeout(_)) if nonblocking => return Err(io::ErrorKind::WouldBlock.into()),
                Err(VerbsError::Timeout(_)) if deadline.is_some_and(|d| Instant::now() >= d) => {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, "no connection in time"))
                }
                // No client yet: keep listening, as a blocking accept does.
                Err(VerbsError::Timeout(_)) => continue,
                Err(e) => return Err(verbs_io(e)),
            }
        }
    }

    /// An endless iterator over accepted connections.
    pub fn incoming(&self) -> impl Iterator<Item = io::Result<SdpStream>> + '_ {
        std::iter::repeat_with(move || self.accept().map(|(s, _)| s))
    }
}

/// Every connection's queue pair and completion queue.
fn qp_spec() -> cm::QpSpec {
    cm::QpSpec::with_depths(512, 512)
}

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
    /// Registered with the background engine.
    watched: bool,
    /// Calls of the application into the socket so far (a counter, not a clock: reading the
    /// clock on every lock cost a tenth of an AZ-SDP write).
    calls: u64,
    /// `calls` as the background engine saw it last time.
    calls_seen: u64,
    nonblocking: bool,
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

    /// Connects with explicit settings.
    pub fn connect_with(addr: impl ToSocketAddrs, config: SdpConfig) -> io::Result<SdpStream> {
        config.validate()?;
        let rt = runtime()?;
        let conn = cm::connect(&CmAddr::Tcp(resolve(addr)?), &rt.pd, &qp_spec(), SDP_MAGIC, SETUP_TIMEOUT)
            .map_err(verbs_io)?;
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
            nonblocking: false,
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

    fn lock(&self) -> MutexGuard<'_, Conn> {
        // A panic while holding the lock cannot leave the protocol half-updated in a way later
        // calls would misread: every path re-checks `failed` first.
        let mut c = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        c.calls = c.calls.wrapping_add(1);
        c
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.lock().peer)
    }

    /// This end's address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.lock().local)
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

    /// Nonblocking mode: reads and writes that would wait return `WouldBlock` instead. (A
    /// nonblocking ZSDP socket copies: it cannot hold the caller's buffer past the call.)
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        self.lock().nonblocking = on;
        Ok(())
    }

    /// Bounds how long `read` waits (`None`: forever). A zero duration is invalid, as in std.
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        if t == Some(Duration::ZERO) {
            return Err(invalid("zero read timeout".into()));
        }
        self.lock().read_timeout = t;
        Ok(())
    }

    /// Bounds how long `write` waits (`None`: forever). A zero duration is invalid, as in std.
    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        if t == Some(Duration::ZERO) {
            return Err(invalid("zero write timeout".into()));
        }
        self.lock().write_timeout = t;
        Ok(())
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

    fn read_impl(&self, buf: &mut [u8]) -> io::Result<usize> {
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
                    ReadStep::Nothing if c.nonblocking => return Err(io::ErrorKind::WouldBlock.into()),
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

    fn write_impl(&self, buf: &[u8]) -> io::Result<usize> {
        let (design, zcopy, nonblocking, timeout, hold_min) = {
            let c = self.lock();
            c.check_writable()?;
            let zcopy = buf.len() >= c.config.zcopy_threshold;
            (c.effective_design(), zcopy, c.nonblocking, c.write_timeout, c.config.az_hold_min)
        };
        if buf.is_empty() {
            return Ok(0);
        }
        let deadline = &Deadline::after(timeout);
        // Sending reads the buffer: a receive still landing in it must finish first.
        self.wait_readable(buf, deadline)?;
        // A nonblocking socket copies: it cannot hold the caller's buffer past the call.
        let written = match design {
            Design::Zsdp if zcopy && !nonblocking => self.write_zcopy(buf, timeout),
            Design::AzSdp if zcopy && !nonblocking && buf.len() >= hold_min => self.write_async(buf, deadline),
            _ => self.write_copy(buf, nonblocking, deadline),
        };
        self.hand_over();
        written
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

    /// BSDP: copies `buf` into Data messages; may send part of it (nonblocking, or timed out
    /// after some progress).
    fn write_copy(&self, buf: &[u8], nonblocking: bool, deadline: &Deadline) -> io::Result<usize> {
        if !nonblocking {
            let chunk = {
                let c = self.lock();
                if buf.len() >= c.config.bulk_min {
                    c.pipe.bulk_chunk_max()
                } else {
                    0
                }
            };
            if chunk > 0 {
                return self.write_bulk(buf, chunk, deadline);
            }
        }
        let mut pacer = Pacer::default();
        let mut sent = 0;
        while sent < buf.len() {
            let progressed = {
                let mut c = self.lock();
                let chunk = (buf.len() - sent).min(c.max_payload());
                if c.try_send(&Message::Data(&buf[sent..sent + chunk]))? {
                    sent += chunk;
                    true
                } else {
                    c.pump()?;
                    false
                }
            };
            if !progressed {
                if nonblocking {
                    break;
                }
                if sent > 0 && deadline.passed() {
                    break; // a partial write, as a timed-out socket write reports it
                }
                pacer.pause(deadline, "writing")?;
            } else {
                pacer = Pacer::default();
            }
        }
        if sent == 0 {
            self.lock().flush_pipe()?;
            return Err(io::ErrorKind::WouldBlock.into());
        }
        if !nonblocking {
            // No kernel drives the transport after we return: hand the coalesced tail over now.
            self.drain_staged(deadline)?;
        } else {
            self.lock().flush_pipe()?;
        }
        Ok(sent)
    }

    /// BSDP, large writes: `buf` is RDMA-written, `chunk` bytes at a time, into the peer's
    /// bulk ring (in order with the messages: the chunks are stream bytes), and the call
    /// returns once every chunk written has completed (the buffer is the caller's again). On
    /// the software provider a chunk completes when the peer's process takes it in (any call
    /// on its socket), so a write can wait for a reader, as a TCP write does once the buffers
    /// are full. A write timeout stops starting chunks, for a partial write as TCP reports
    /// it; chunks started and still not taken in after as long again fail the socket (the
    /// buffer cannot be handed back with a transfer from it pending), like an unanswered
    /// ZSDP write.
    fn write_bulk(&self, buf: &[u8], chunk: usize, deadline: &Deadline) -> io::Result<usize> {
        let rt = runtime()?;
        // SAFETY: `buf` stays borrowed (mapped, unchanged) until this returns, and it returns
        // only after every chunk written from it completed, or with the queue pair in error.
        let reg = unsafe { rt.regcache.get_raw(buf.as_ptr() as u64, buf.len() as u64, AccessFlags::NONE) }
            .map_err(verbs_io)?;
        let write_timeout = self.lock().write_timeout;
        let mut tokens = VecDeque::new();
        let (mut sent, mut end) = (0, buf.len());
        let (mut pacer, mut polls) = (Pacer::default(), 0u32);
        let result = loop {
            match self.lock().bulk_step(&buf[sent..end], reg.lkey(), chunk, &mut tokens) {
                Ok(0) if sent == end && tokens.is_empty() => break Ok(sent),
                Ok(0) => {
                    // The clock every 64th poll only (a tenth of the loop's time otherwise).
                    polls = polls.wrapping_add(1);
                    if !polls.is_multiple_of(64) {
                        pacer.pause(&Deadline::never(), "writing")?;
                        continue;
                    }
                    let now = Instant::now();
                    if sent < end && deadline.get().is_some_and(|d| now >= d) {
                        if sent == 0 {
                            break Err(io::Error::new(io::ErrorKind::TimedOut, "timed out writing"));
                        }
                        end = sent; // a partial write: finish the chunks started, start no more
                    } else if deadline.get().zip(write_timeout).is_some_and(|(d, t)| now >= d + t) {
                        let why = "the peer did not take bulk data in within twice the write timeout";
                        break Err(self.lock().fail(io::ErrorKind::TimedOut, why.into()));
                    } else {
                        pacer.pause(&Deadline::never(), "writing")?;
                    }
                }
                Ok(n) => {
                    sent += n;
                    pacer = Pacer::default();
                }
                Err(e) => break Err(e),
            }
        };
        if result.is_err() && !tokens.is_empty() {
            // Nothing may read `buf` once we return: stop the queue pair first.
            let _ = self.lock().pipe.qp().modify(portability_verbs::QpTransition::Error);
        }
        drop(reg);
        result
    }

    /// AZ-SDP: the unaligned head and tail go as Data, the whole pages between as a SrcAvail
    /// of the read-only-protected buffer; returns without waiting for the receiver.
    fn write_async(&self, buf: &[u8], deadline: &Deadline) -> io::Result<usize> {
        let (head, middle) = whole_pages(buf.as_ptr() as usize, buf.len().min(u32::MAX as usize & !0xfff));
        if middle == 0 {
            return self.write_copy(buf, false, deadline);
        }
        if head > 0 {
            let n = self.write_copy(&buf[..head], false, deadline)?;
            if n < head {
                return Ok(n);
            }
        }
        match self.advertise_held(&buf[head..head + middle], deadline) {
            Ok(()) => {}
            Err(e) if head > 0 && e.kind() == io::ErrorKind::TimedOut => return Ok(head),
            Err(e) => return Err(e),
        }
        let tail = &buf[head + middle..];
        if tail.is_empty() {
            return Ok(buf.len());
        }
        match self.write_copy(tail, false, deadline) {
            Ok(n) => Ok(head + middle + n),
            Err(e) if e.kind() == io::ErrorKind::TimedOut => Ok(head + middle),
            Err(e) => Err(e),
        }
    }

    /// Protects `pages` read-only, advertises them and returns; RdmaRdCompl releases them.
    fn advertise_held(&self, pages: &[u8], deadline: &Deadline) -> io::Result<()> {
        let rt = runtime()?;
        let mut pacer = Pacer::default();
        loop {
            {
                let mut c = self.lock();
                c.pump()?;
                if c.proto.sends().len() < c.config.az_max_outstanding {
                    break;
                }
            }
            // RdmaRdCompl arrives as a message.
            let what = "waiting for an outstanding SrcAvail to be read";
            pacer.pause_on(deadline, what, Some(&self.cq), || self.prepare_sleep())?;
        }
        let (addr, len) = (pages.as_ptr() as usize, pages.len());
        // SAFETY: the pages stay mapped until the receiver answers, by the AZ-SDP contract
        // (module docs); a failed socket drops the registration only after its QP is down.
        let reg =
            unsafe { rt.regcache.get_raw(addr as u64, len as u64, AccessFlags::REMOTE_READ) }.map_err(verbs_io)?;
        let advert = Advert { len: len as u32, rkey: reg.rkey(), addr: addr as u64 };
        // The same buffer sent before is usually still read-only: hold it again for the price
        // of an `mprotect` that changes nothing.
        let lazy = {
            let mut c = self.lock();
            let i = c.lazy.iter().position(|l| l.addr() == addr && l.len() == len);
            let lazy = i.and_then(|i| c.lazy.remove(i));
            if let Some(l) = &lazy {
                c.note_faults(l.faults());
            }
            lazy
        };
        let hold = match lazy {
            Some(lazy) => lazy.reprotect(),
            // SAFETY: whole pages of the caller's buffer; our own code reads them only (BSDP
            // copies) and the provider reaches them like DMA, so nothing in the progress path
            // faults.
            None => unsafe { protect::protect(addr, len, Protection::ReadOnly) },
        }
        .map_err(verbs_io)?;
        // If this fails the socket has failed; the hold is dropped with the error.
        self.send_advert(advert, Sending::Held { hold, reg, waited_since: None, lost: false }, deadline)
    }

    /// Sends a SrcAvail for `advert` as soon as flow control admits it, queueing `what` under
    /// its number to await the answer, and hands it to the transport. An AZ-SDP advert puts
    /// the socket under the engine's watch (nobody waits for its answer).
    fn send_advert(&self, advert: Advert, what: Sending, deadline: &Deadline) -> io::Result<()> {
        let watched = matches!(what, Sending::Held { .. });
        let mut pending = Some(what);
        let mut pacer = Pacer::default();
        loop {
            {
                let mut c = self.lock();
                c.check_writable()?;
                c.advertise(advert, &mut pending)?;
                if pending.is_none() {
                    if watched {
                        self.watch(&mut c);
                    }
                    break;
                }
                c.pump()?;
            }
            pacer.pause(deadline, "sending a SrcAvail")?;
        }
        self.drain_staged(deadline)
    }

    /// ZSDP: advertise the registered buffer and wait until the receiver has read it.
    fn write_zcopy(&self, buf: &[u8], timeout: Option<Duration>) -> io::Result<usize> {
        let rt = runtime()?;
        let buf = &buf[..buf.len().min(u32::MAX as usize)];
        let reg = rt.regcache.get(buf, AccessFlags::REMOTE_READ).map_err(verbs_io)?;
        let advert = Advert { len: buf.len() as u32, rkey: reg.rkey(), addr: buf.as_ptr() as u64 };
        let mut deadline = Deadline::after(timeout);
        self.lock().zcopy_answer = None;
        self.send_advert(advert, Sending::Waited, &deadline)?;
        let mut cancelled = false;
        let mut pacer = Pacer::default();
        loop {
            {
                let mut c = self.lock();
                let pumped = c.pump();
                if let Some(n) = c.zcopy_answer.take() {
                    if n == 0 {
                        // Nothing was read before the cancel: the write timed out, the socket
                        // is as it was before it.
                        return Err(io::Error::new(io::ErrorKind::WouldBlock, "the receiver read nothing in time"));
                    }
                    return Ok(n as usize);
                }
                if let Err(e) = pumped {
                    // The buffer may still be read by a peer we no longer hear: make sure the
                    // queue pair is down before the registration (and `buf`) is let go.
                    c.abort_locally();
                    return Err(e);
                }
            }
            if deadline.passed() {
                if cancelled {
                    // The peer answers neither the advertisement nor its cancellation: the
                    // connection is dropped so the buffer can no longer be read.
                    let mut c = self.lock();
                    c.abort_locally();
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the receiver did not answer a cancelled SrcAvail",
                    ));
                }
                cancelled = true;
                // Marked first: the answer (for fewer bytes now) may come at once.
                self.lock().proto.cancel_oldest();
                self.send_control(Message::SrcAvailCancel)?;
                deadline = Deadline::after(timeout);
            }
            pacer.pause_on(&Deadline::never(), "waiting for RdmaRdCompl", Some(&self.cq), || self.prepare_sleep())?;
        }
    }
}

/// What holding `len` bytes of whole pages costs (`mprotect` to close them and again to open
/// them: about 2 us a call plus 80 ns a page on the VMs we measured): an AZ-SDP receive waits
/// this long for a queued read before it protects the buffer and returns.
fn hold_cost(len: usize) -> Duration {
    let pages = len.div_ceil(portability_verbs::page_size()) as u64;
    Duration::from_nanos(2 * (2000 + 80 * pages))
}

/// Whether `hold` covers a byte of `buf`.
fn hold_meets(hold: &ProtectedRange, buf: &[u8]) -> bool {
    let start = buf.as_ptr() as usize;
    hold.addr() < start + buf.len() && start < hold.addr() + hold.len()
}

/// What copying `len` bytes aside costs (a fresh buffer's page faults and the copy: about
/// 20 us plus 4 bytes a nanosecond): a store waits this long for the peer's read before an
/// AZ-SDP sender copies the buffer instead.
fn copy_cost(len: usize) -> Duration {
    Duration::from_nanos(20_000 + len as u64 / 4)
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

impl Background for Conn {
    /// Leaves a socket the application called into since the engine's last round (at most
    /// 200 us ago while transfers are in flight) to the application, unless a thread waits in
    /// a fault: on a loaded machine a third thread polling a busy socket only steals its CPU
    /// and its lock.
    fn background_progress(&mut self) -> bool {
        let in_flight = self.in_flight();
        let app_active = std::mem::replace(&mut self.calls_seen, self.calls) != self.calls;
        if in_flight && protect::fault_waiters() == 0 && app_active {
            return true;
        }
        if self.failed.is_none() && in_flight {
            // Errors are recorded in the socket; its next call reports them.
            let _ = self.pump();
        }
        self.failed.is_none() && self.in_flight()
    }

    fn quiet_visit(&mut self) -> bool {
        if self.closing.is_none() {
            // An application calling into its socket drives it itself.
            if std::mem::replace(&mut self.calls_quiet, self.calls) != self.calls || self.failed.is_some() {
                return false;
            }
            // Errors are recorded in the socket; its next call reports them.
            let _ = self.pump_control().and_then(|()| self.send_pending_control());
            return false;
        }
        if self.failed.is_none() {
            let _ = self.send_pending_control().and_then(|()| self.pump());
        }
        self.close_finished()
    }

    fn begin_close(&mut self) {
        self.start_close();
    }
}

impl Conn {
    /// Transfers of ours still under way: sends not completed or staged, SrcAvails not
    /// answered, reads of the peer's memory not landed.
    fn in_flight(&self) -> bool {
        !self.proto.sends().is_empty() || !self.reads.is_empty() || !self.pipe.idle()
    }

    /// Sends the Disconnect of `shutdown` and the Close of `close` once flow control admits
    /// them (in that order, each at most once, behind every byte written before).
    fn send_pending_control(&mut self) -> io::Result<()> {
        if self.disconnect_pending && self.try_send(&Message::Disconnect)? {
            self.disconnect_pending = false;
        }
        if self.close_pending && !self.disconnect_pending && self.try_send(&Message::Close)? {
            self.close_pending = false;
        }
        self.flush_pipe()
    }

    /// The application let go of the socket: Close follows the bytes written (it is
    /// Disconnect too, and says we read nothing more).
    fn start_close(&mut self) {
        if self.closing.is_none() {
            self.closing = Some(Instant::now());
            self.read_shut = true;
            self.close_pending = true;
            // Close says all Disconnect says.
            self.disconnect_pending = false;
            if self.failed.is_none() {
                let _ = self.send_pending_control().and_then(|()| self.pump());
            }
        }
    }

    /// Whether a closed socket is done: the peer took every byte (and read the buffers still
    /// held, for AZ-SDP) after our Close, or closed itself (it reads nothing more), or the
    /// connection failed; or the peer took nothing for [`engine::ORPHAN_LINGER`], and the
    /// connection is reset.
    fn close_finished(&mut self) -> bool {
        if self.failed.is_some() || self.pipe.failure().is_some() || self.proto.peer_closed() {
            return true;
        }
        if !self.close_pending && !self.in_flight() {
            return true;
        }
        if self.closing.is_some_and(|t| t.elapsed() >= engine::ORPHAN_LINGER) {
            let why = "the peer took no bytes for as long as a closed socket waits";
            self.abort_locally();
            debug!("SDP socket {} -> {}: {why}", self.local, self.peer);
            return true;
        }
        false
    }

    /// The pipe's [`MsgPipe::prepare_sleep`] (false on an error: the next poll reports it).
    fn prepare_sleep(&mut self) -> bool {
        self.pipe.prepare_sleep().unwrap_or(false)
    }

    fn max_payload(&self) -> usize {
        self.config.flow.max_message() - BSDH_LEN
    }

    fn effective_design(&self) -> Design {
        if self.fell_back {
            Design::Zsdp
        } else {
            self.config.design
        }
    }

    /// Counts the faults a released hold (or lazy range) saw; too many make an AZ-SDP socket
    /// fall back.
    fn note_faults(&mut self, faults: u32) {
        self.faults = self.faults.saturating_add(faults);
        if !self.fell_back && self.config.design == Design::AzSdp && self.faults >= self.config.az_fault_limit {
            self.fell_back = true;
            log::info!(
                "SDP socket {} -> {}: {} page faults on held buffers, falling back to ZSDP",
                self.local,
                self.peer,
                self.faults
            );
            // Informational for the peer; a full pipe just skips the announcement.
            let _ = self.try_send(&Message::ModeChange(Design::Zsdp));
        }
    }

    /// Opens the lazily kept send buffer at `index`.
    fn open_lazy(&mut self, index: usize) {
        if let Some(lazy) = self.lazy.remove(index) {
            self.note_faults(lazy.faults());
        }
    }

    /// Opens every lazily kept send buffer (the application may unmap them afterwards).
    fn open_all_lazy(&mut self) {
        while !self.lazy.is_empty() {
            self.open_lazy(0);
        }
    }

    /// Ends every transfer in flight at once: the queue pair goes to error first, so nothing
    /// can still read or write the buffers, then the holds and registrations are dropped.
    fn release_all(&mut self) {
        self.open_all_lazy();
        if self.proto.sends().is_empty() && self.reads.is_empty() {
            return;
        }
        let _ = self.pipe.qp().modify(portability_verbs::QpTransition::Error);
        self.proto.drop_sends();
        self.reads.clear();
    }

    /// The peer closed (it reads and sends nothing more) and nothing of ours waits for it: no
    /// SrcAvail of ours unanswered, no read of its memory in flight or still to start.
    fn nothing_needs_the_peer(&self) -> bool {
        self.proto.peer_closed()
            && self.proto.sends().is_empty()
            && self.reads.is_empty()
            && self.proto.rx().iter().all(|item| matches!(item, RxItem::Bytes(..)))
    }

    fn check_ok(&self) -> io::Result<()> {
        match &self.failed {
            Some((kind, why)) => Err(io::Error::new(*kind, why.clone())),
            None => Ok(()),
        }
    }

    fn check_writable(&self) -> io::Result<()> {
        self.check_ok()?;
        if self.write_shut {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, "socket shut down for writing"));
        }
        if self.proto.peer_closed() {
            // TCP would answer the bytes with a reset, and the next write would see EPIPE.
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, "the peer closed the connection"));
        }
        Ok(())
    }

    fn fail(&mut self, kind: io::ErrorKind, why: String) -> io::Error {
        if self.failed.is_none() {
            debug!("SDP socket {} -> {} failed: {why}", self.local, self.peer);
            self.failed = Some((kind, why));
            // Never leave application buffers inaccessible behind a dead connection.
            self.release_all();
        }
        let (k, w) = self.failed.clone().expect("set");
        io::Error::new(k, w)
    }

    fn fail_verbs(&mut self, e: VerbsError) -> io::Error {
        if self.failed.is_none() && matches!(e, VerbsError::PeerUnreachable(_)) && self.nothing_needs_the_peer() {
            self.ended_by_peer = true;
            return self.fail(io::ErrorKind::BrokenPipe, format!("the peer closed the connection (then: {e})"));
        }
        let kind = match &e {
            VerbsError::Timeout(_) => io::ErrorKind::TimedOut,
            _ => io::ErrorKind::ConnectionReset,
        };
        self.fail(kind, format!("connection lost: {e}"))
    }

    /// Stops all traffic at once: the queue pair goes to error, so the peer can no longer read
    /// any buffer we advertised.
    fn abort_locally(&mut self) {
        let _ = self.pipe.qp().modify(portability_verbs::QpTransition::Error);
        self.fail(io::ErrorKind::ConnectionAborted, "connection aborted".into());
    }

    fn try_send(&mut self, m: &Message<'_>) -> io::Result<bool> {
        self.check_ok()?;
        self.proto.encode(m, &mut self.tx);
        match self.pipe.try_send(&self.tx) {
            Ok(true) => Ok(true),
            Ok(false) => {
                self.proto.unsend();
                Ok(false)
            }
            Err(e) => Err(self.fail_verbs(e)),
        }
    }

    /// Finishes the RDMA reads that completed, in order: releases their holds and answers
    /// the adverts they ended.
    fn complete_reads(&mut self) -> io::Result<()> {
        if self.reads.is_empty() {
            return Ok(());
        }
        self.pipe.progress().map_err(|e| self.fail_verbs(e))?;
        while let Some(front) = self.reads.front() {
            match self.pipe.take_user_completion(front.token) {
                None => break,
                Some(WcStatus::Success) => {
                    let r = self.reads.pop_front().expect("front");
                    if let Some(h) = &r.hold {
                        self.note_faults(h.faults());
                        self.rx_holds.landed(r.ran_into || h.faults() > 0);
                    }
                    drop(r.hold);
                    if let Some(n) = r.answer {
                        self.answer_read(n)?;
                    }
                }
                Some(st) => {
                    // The peer advertised memory it does not let us read.
                    let _ = self.try_send(&Message::Abort);
                    let _ = self.pipe.flush();
                    return Err(self.fail(
                        io::ErrorKind::ConnectionAborted,
                        format!("the peer's SrcAvail could not be read: {st:?}"),
                    ));
                }
            }
        }
        Ok(())
    }

    fn flush_pipe(&mut self) -> io::Result<()> {
        self.pipe.flush().map_err(|e| self.fail_verbs(e))
    }

    /// Takes in every message that has arrived, queueing stream content and applying control.
    fn pump(&mut self) -> io::Result<()> {
        self.pump_until(None)
    }

    /// [`Conn::pump`] for a reader with `reader_room` bytes of buffer: stops at stream bytes it
    /// copies straight out of the pipe next (bulk-lane bytes, a Data message that fits). Taking
    /// them into the queue would cost a copy and an allocation, and once it holds anything every
    /// later message would follow the same way.
    fn pump_until(&mut self, reader_room: Option<usize>) -> io::Result<()> {
        self.check_ok()?;
        if self.disconnect_pending || self.close_pending {
            self.send_pending_control()?;
        }
        if self.pipe.staged() > 0 {
            self.flush_pipe()?;
        }
        loop {
            // A reader stops only with nothing queued: what is queued goes first, and may wait
            // for control further on (a SrcAvail's update). The check looks at the pipe once:
            // an item arriving after it waits for the next pump, where a second look would take
            // it into the queue. (After Disconnect, stream bytes are a protocol error: taken in,
            // they fail the socket.)
            if let Some(room) = reader_room {
                if !self.proto.eof() && self.proto.rx().is_empty() {
                    match self.front_is_direct(room) {
                        Some(false) => {}
                        Some(true) | None => {
                            self.complete_reads()?;
                            return self.copy_on_write();
                        }
                    }
                }
            }
            if !self.take_one()? {
                self.complete_reads()?;
                return self.copy_on_write();
            }
        }
    }

    /// Takes in the next message or bulk bytes, if any arrived; whether one did.
    fn take_one(&mut self) -> io::Result<bool> {
        let mut outcome: Result<Event<Sending>, ProtoError> = Ok(Event::None);
        let got = {
            let proto = &mut self.proto;
            self.pipe.recv_lane(|lane, bytes| {
                outcome = match lane {
                    Lane::Message => proto.on_message(bytes),
                    Lane::Bulk => proto.on_bulk(bytes).map(|()| Event::None),
                }
            })
        };
        match got {
            Ok(Some(())) => {}
            Ok(None) => return Ok(false),
            Err(e) => return Err(self.fail_verbs(e)),
        }
        match outcome {
            Ok(event) => self.apply(event)?,
            Err(e) => {
                // The peer broke the protocol: tell it, then fail.
                let _ = self.try_send(&Message::Abort);
                let _ = self.pipe.flush();
                return Err(self.fail(io::ErrorKind::InvalidData, e.to_string()));
            }
        }
        Ok(true)
    }

    /// Takes in the control messages that arrived, up to the first stream bytes (left in the
    /// pipe for the application's read: taking them would cost a copy and let the peer send
    /// more than the receive buffers hold). What the background engine does for a socket
    /// whose application is busy elsewhere: a peer's SrcAvailCancel is answered, its Close
    /// seen.
    fn pump_control(&mut self) -> io::Result<()> {
        self.check_ok()?;
        loop {
            let stream_bytes = match self.pipe.front() {
                Ok(Some((Lane::Bulk, _))) | Ok(None) => true,
                Ok(Some((Lane::Message, bytes))) => self.proto.next_data(bytes).is_some(),
                Err(_) => false, // taken (and failed on) below
            };
            if stream_bytes || !self.take_one()? {
                break;
            }
        }
        self.complete_reads()?;
        self.copy_on_write()
    }

    /// Does what an incoming message asks.
    fn apply(&mut self, event: Event<Sending>) -> io::Result<()> {
        match event {
            Event::None => {}
            Event::Answered { sent, read } => {
                self.answered_at = Instant::now();
                match sent.what {
                    Sending::Waited => self.zcopy_answer = Some(read),
                    Sending::Copied { .. } => {}
                    Sending::Held { hold, reg, .. } => {
                        self.note_faults(hold.faults());
                        drop(reg);
                        // SAFETY: the buffer stays mapped until `flush`, `wait_transfers` or
                        // close, by the AZ-SDP contract (module docs), and each of those opens
                        // `lazy` first.
                        if let Some(lazy) = unsafe { hold.release_lazily() } {
                            self.lazy.push_back(lazy);
                            if self.lazy.len() > LAZY_MAX {
                                self.open_lazy(0);
                            }
                        }
                    }
                }
            }
            Event::Withdrawn { done } => {
                // Answered with what was read, after the reads already started on it landed.
                self.finish_reads()?;
                self.answer_read(done)?;
            }
            Event::Aborted => {
                return Err(self.fail(io::ErrorKind::ConnectionReset, "the peer aborted the connection".into()))
            }
        }
        Ok(())
    }

    fn answer_read(&mut self, n: u32) -> io::Result<()> {
        self.send_now(&Message::RdmaRdCompl { len: n })
    }

    /// Sends a control message from inside the protocol (no caller to come back later),
    /// driving the pipe until flow control admits it.
    fn send_now(&mut self, m: &Message<'_>) -> io::Result<()> {
        let deadline = Instant::now() + SETUP_TIMEOUT;
        while !self.try_send(m)? {
            self.pipe.progress().map_err(|e| self.fail_verbs(e))?;
            if Instant::now() > deadline {
                return Err(self.fail(io::ErrorKind::TimedOut, "no credit to send a control message".into()));
            }
        }
        self.flush_pipe()
    }

    /// Sends a SrcAvail for `advert` if flow control admits it now, taking `what` (left in
    /// place otherwise) into the queue of SrcAvails awaiting an answer under its number.
    fn advertise(&mut self, advert: Advert, what: &mut Option<Sending>) -> io::Result<()> {
        if self.try_send(&Message::SrcAvail(advert))? {
            self.proto.advertised(advert.len, what.take().expect("something to advertise"));
        }
        Ok(())
    }

    /// Takes the lock word of the SrcAvail at the front of the queue before its first read:
    /// `false` if the peer took it first (it copies the buffer aside and re-advertises it: wait
    /// for its SrcAvailUpdate).
    fn claim_front(&mut self) -> io::Result<bool> {
        let Some(RxItem::Src(src)) = self.proto.rx().front() else { return Ok(true) };
        if src.claimed {
            return Ok(true);
        }
        let index = src.index;
        let Some(locks) = &self.locks else { return Ok(true) }; // the peer cannot copy
        let off = 8 * (index % LOCK_WORDS) as usize;
        let old = locks.local_atomic(off, |w| lock::receiver_take(w, index)).map_err(|e| self.fail_verbs(e))?;
        match lock::receiver_claim(old, index) {
            ReceiverClaim::Won => {
                if let Some(RxItem::Src(src)) = self.proto.rx_front_mut() {
                    src.claimed = true;
                }
                Ok(true)
            }
            ReceiverClaim::Moved => Ok(false),
            ReceiverClaim::Corrupt => {
                let why = format!("lock word of SrcAvail {index} holds {old:#x}");
                Err(self.fail(io::ErrorKind::InvalidData, why))
            }
        }
    }

    /// AZ-SDP copy-on-write, the sender's side: when a thread waits in the fault handler to
    /// write a buffer of ours the peer has not read yet, take its lock word at the peer by
    /// compare-and-swap; if we win, copy the buffer aside, release the application's pages and
    /// re-advertise the copy (SrcAvailUpdate). If the peer took the word first it is reading
    /// the buffer, and the writer waits for that. One compare-and-swap in flight at a time.
    fn copy_on_write(&mut self) -> io::Result<()> {
        if !self.send_updates()? {
            return Ok(());
        }
        // Our lock memory holds the compare-and-swap results (a peer announcing a table to a
        // socket without one is ignored).
        let Some(table) = self.proto.peer_locks().filter(|_| self.config.az_copy_on_write && self.locks.is_some())
        else {
            return Ok(());
        };
        if let Some((index, token, expected)) = self.cow_try {
            self.pipe.progress().map_err(|e| self.fail_verbs(e))?;
            match self.pipe.take_user_completion(token) {
                None => return Ok(()),
                Some(WcStatus::Success) => self.cow_try = None,
                Some(st) => {
                    let why = format!("the peer's lock table could not be reached: {st:?}");
                    return Err(self.fail(io::ErrorKind::ConnectionAborted, why));
                }
            }
            let old = self.locks.as_ref().expect("checked above").read_u64(CAS_RESULT);
            let Some(i) = self.proto.sends().iter().position(|o| o.index == index) else { return Ok(()) };
            match lock::sender_claim(old, expected, index) {
                SenderClaim::Won => return self.copy_aside(i),
                SenderClaim::Reading => {
                    // The peer is reading it: the writer waits for its answer.
                    if let Some(Sending::Held { lost, .. }) = self.proto.send_mut(i).map(|o| &mut o.what) {
                        *lost = true;
                    }
                }
                // The word held an older SrcAvail's value than we guessed: try again with it.
                SenderClaim::Retry(old) => return self.try_lock(table, index, old),
            }
        }
        // A store that has waited longer than copying the buffer would take, while the peer
        // answered none of our SrcAvails: it is not reading (a peer that is, even behind other
        // buffers of ours, ends the wait sooner than copies would).
        // The clock only once a store waits: `pump` runs on every socket call. No thread stopped
        // in the fault handler, no store waits on any hold (one load instead of a look at
        // every outstanding hold's counter, lines the fault handler and other threads write).
        if protect::fault_waiters() == 0 {
            return Ok(());
        }
        let (mut now, answered_at) = (None, self.answered_at);
        let wanted = self.proto.sends_mut().find_map(|o| match &mut o.what {
            Sending::Held { hold, lost: false, waited_since, .. } if hold.faults() > 0 => {
                let now = *now.get_or_insert_with(Instant::now);
                let since = (*waited_since.get_or_insert(now)).max(answered_at);
                (now - since >= copy_cost(hold.len())).then_some(o.index)
            }
            _ => None,
        });
        if let Some(index) = wanted {
            self.try_lock(table, index, lock::sender_guess(index, table.len as u64 / 8))?;
        }
        Ok(())
    }

    /// Posts the compare-and-swap that takes SrcAvail `index`'s lock word in the peer's
    /// `table`, if it holds `expected`.
    fn try_lock(&mut self, table: Advert, index: u64, expected: u64) -> io::Result<()> {
        let locks = self.locks.as_ref().expect("copy_on_write checks our lock memory first");
        let word = table.addr + 8 * (index % (table.len as u64 / 8));
        let mine = lock::word(index, Taker::Sender);
        let wr = SendWr::compare_and_swap(0, locks.sge(CAS_RESULT, 8), word, table.rkey, expected, mine);
        let token = self.pipe.post_user(wr).map_err(|e| self.fail_verbs(e))?;
        self.cow_try = Some((index, token, expected));
        Ok(())
    }

    /// We hold the lock word of our SrcAvail at `i` (of `proto.sends()`): copy its buffer
    /// aside, let the application have its pages back, and tell the peer where the bytes are
    /// now.
    fn copy_aside(&mut self, i: usize) -> io::Result<()> {
        let rt = runtime()?;
        let Some(Sending::Held { hold, .. }) = self.proto.sends().get(i).map(|o| &o.what) else { return Ok(()) };
        let mut copy = vec![0u8; hold.len()].into_boxed_slice();
        // SAFETY: the held pages are read-only, not inaccessible (a receive into them waits for
        // this send), so plain loads do not fault; pages unmapped against the contract are
        // reported instead of crashing.
        let ((), intact) =
            protect::guarded_read(|| unsafe { copy_bytes(copy.as_mut_ptr(), hold.addr() as *const u8, copy.len()) });
        if !intact {
            return Err(self.fail(io::ErrorKind::ConnectionAborted, "a held send buffer was unmapped".into()));
        }
        let mr = rt.pd.register(copy, AccessFlags::REMOTE_READ).map_err(verbs_io)?;
        let advert = Advert { len: mr.len() as u32, rkey: mr.rkey(), addr: mr.addr() };
        let sent = self.proto.send_mut(i).expect("looked up above");
        let index = sent.index;
        let held = std::mem::replace(&mut sent.what, Sending::Copied { _copy: mr });
        if let Sending::Held { hold, reg, .. } = held {
            self.note_faults(hold.faults());
            drop(reg);
            drop(hold); // the writer waiting in the fault handler goes on
        }
        self.cow_unsent.push_back((index, advert));
        self.send_updates()?;
        self.flush_pipe()
    }

    /// Sends the SrcAvailUpdates waiting for flow control, in order; `false` if some still wait.
    fn send_updates(&mut self) -> io::Result<bool> {
        while let Some(&(index, advert)) = self.cow_unsent.front() {
            if !self.try_send(&Message::SrcAvailUpdate { index, advert })? {
                return Ok(false);
            }
            self.cow_unsent.pop_front();
        }
        Ok(true)
    }

    /// One step of a bulk write: starts the next chunk of `rest` (registered under `lkey`) if
    /// the peer's ring has room; otherwise takes in what arrived (the peer may be writing to
    /// us too, and its chunks must not wait for ours) and collects the chunks completed, in
    /// order, from `tokens`. Returns the bytes started.
    fn bulk_step(&mut self, rest: &[u8], lkey: u32, chunk: usize, tokens: &mut VecDeque<u64>) -> io::Result<usize> {
        if !rest.is_empty() {
            self.check_writable()?;
            let n = rest.len().min(chunk);
            let sge = Sge { addr: rest.as_ptr() as u64, length: n as u32, lkey };
            match self.pipe.try_send_bulk(sge) {
                Ok(Some(t)) => {
                    tokens.push_back(t);
                    return Ok(n);
                }
                Ok(None) => {}
                Err(e) => return Err(self.fail_verbs(e)),
            }
        }
        self.pump()?;
        while let Some(&t) = tokens.front() {
            match self.pipe.take_user_completion(t) {
                None => break,
                Some(WcStatus::Success) => _ = tokens.pop_front(),
                Some(st) => return Err(self.fail(io::ErrorKind::ConnectionReset, format!("bulk write failed: {st:?}"))),
            }
        }
        Ok(0)
    }

    /// Whether the pipe's next item is stream bytes a reader with `room` bytes of buffer takes
    /// straight from the pipe ([`Conn::read_in_place`]): bulk-lane bytes, or a well-formed Data
    /// message of at most `room` bytes (anything else `pump` takes, and fails on if malformed).
    /// `None` when nothing has arrived.
    fn front_is_direct(&mut self, room: usize) -> Option<bool> {
        match self.pipe.front() {
            Ok(Some((Lane::Bulk, _))) => Some(true),
            Ok(Some((Lane::Message, bytes))) => Some(self.proto.next_data(bytes).is_some_and(|(_, d)| d.len() <= room)),
            Ok(None) => None,
            // Taken (and failed on) by `pump`.
            Err(_) => Some(false),
        }
    }

    /// One nonblocking read attempt.
    fn try_read(&mut self, buf: &mut [u8]) -> io::Result<ReadStep> {
        if self.read_shut {
            return Ok(ReadStep::Got(0));
        }
        let direct = self.read_in_place(buf)?;
        if direct > 0 {
            return Ok(ReadStep::Got(direct));
        }
        // Stream bytes already queued go first, without taking in more behind them (that
        // would queue those too, and a reader keeping up with its writer would never get back
        // to copying straight from the pipe).
        let queued = matches!(self.proto.rx().front(), Some(RxItem::Bytes(..)));
        let pumped = if queued { Ok(()) } else { self.pump_until(Some(buf.len())) };
        if pumped.is_ok() && self.proto.rx().is_empty() && !self.proto.eof() && self.pipe.peek_lane().is_some() {
            // Control taken in, stream bytes next: straight from the pipe, unless `buf` is held.
            let direct = self.read_in_place(buf)?;
            return Ok(if direct > 0 { ReadStep::Got(direct) } else { ReadStep::BufferHeld });
        }
        // Bytes that arrived before a failure are still delivered, then the error.
        match self.proto.rx_front_mut() {
            Some(RxItem::Bytes(..)) => {
                // As much as is queued, across messages, as a TCP read returns; not into held
                // pages (a plain copy would fault there, with our lock held).
                let Some(mut n) = self.proto.read_queued(buf, |d| protect::overlaps(d.as_ptr() as usize, d.len()))
                else {
                    return Ok(ReadStep::BufferHeld);
                };
                if n < buf.len() && pumped.is_ok() {
                    // The queue ran dry: what follows in the pipe, straight from it.
                    n += self.read_in_place(&mut buf[n..])?;
                }
                Ok(ReadStep::Got(n))
            }
            Some(RxItem::Src(src)) => {
                pumped?;
                let (a, done) = (src.advert, src.done);
                let n = (buf.len() as u64).min((a.len - done) as u64) as usize;
                // Receiving writes the buffer: a send still reading it (AZ-SDP returned before
                // the peer took it) or a receive still landing in it must finish first, as a
                // store of the application's would wait in the fault handler.
                if protect::overlaps(buf.as_ptr() as usize, n) {
                    if self.sending_from(&buf[..n]) {
                        // Our own write of this buffer, which the peer may take only after a
                        // read of its own that waits for us the same way: take the data aside
                        // now (answering the peer), to be copied in once the buffer is free.
                        if !self.claim_front()? {
                            return Ok(ReadStep::Nothing); // moved: its SrcAvailUpdate is coming
                        }
                        self.read_aside(n)?;
                    }
                    return Ok(ReadStep::BufferHeld);
                }
                if !self.claim_front()? {
                    return Ok(ReadStep::Nothing); // moved: its SrcAvailUpdate is coming
                }
                // An AZ-SDP receiver holds the whole pages and lets their read land later;
                // the unaligned head is read at once.
                let (head, middle) = if self.effective_design() == Design::AzSdp && n >= self.config.az_hold_min {
                    whole_pages(buf.as_ptr() as usize, n)
                } else {
                    (n, 0)
                };
                let end = done + (head + middle) as u32;
                let answer = (end == a.len).then_some(end);
                if head > 0 {
                    let dst = &mut buf[..head];
                    let token =
                        self.post_read(dst, a.addr + done as u64, a.rkey, false, answer.filter(|_| middle == 0))?;
                    self.wait_read(token)?;
                }
                if middle > 0 {
                    let dst = &mut buf[head..head + middle];
                    let hold = self.rx_holds.may_hold();
                    let token = self.post_read(dst, a.addr + done as u64 + head as u64, a.rkey, hold, answer)?;
                    if !hold {
                        self.wait_read(token)?;
                    }
                }
                self.proto.consume_front_src(end);
                Ok(ReadStep::Got(head + middle))
            }
            None => {
                if !self.ended_by_peer {
                    pumped?;
                }
                Ok(if self.proto.eof() { ReadStep::Got(0) } else { ReadStep::Nothing })
            }
        }
    }

    /// Whether an AZ-SDP write of ours still holds part of `buf`.
    fn sending_from(&self, buf: &[u8]) -> bool {
        self.proto.sends().iter().any(|o| match &o.what {
            Sending::Held { hold, .. } => hold_meets(hold, buf),
            _ => false,
        })
    }

    /// Reads the next `n` bytes of the SrcAvail at the front into a private buffer, queued as
    /// stream bytes ahead of the rest of it, answering the peer if that ends the SrcAvail.
    fn read_aside(&mut self, n: usize) -> io::Result<()> {
        let Some(RxItem::Src(src)) = self.proto.rx().front() else { return Ok(()) };
        let (a, done) = (src.advert, src.done);
        let mut aside = vec![0u8; n];
        let end = done + n as u32;
        let token = self.post_read(&mut aside, a.addr + done as u64, a.rkey, false, (end == a.len).then_some(end))?;
        self.wait_read(token)?;
        self.proto.consume_front_src(end);
        self.proto.push_front_bytes(aside);
        Ok(())
    }

    /// The buffer-copy fast path: while nothing is queued, copies whole Data messages and
    /// bulk-lane bytes straight from the pipe's receive buffers and bulk ring into `buf` (one
    /// copy, no queue, no allocation), as many as fit. Anything else (control, a SrcAvail, a
    /// message larger than what is left of `buf`, a malformed one) is left to `pump`. Returns
    /// the bytes copied.
    fn read_in_place(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut n = 0;
        while self.proto.rx().is_empty() && !self.proto.eof() && self.failed.is_none() {
            let Ok(Some((lane, bytes))) = self.pipe.front() else { break };
            if lane == Lane::Bulk {
                // Bulk-lane bytes: as many as fit, the rest left in the ring for the next read.
                let k = bytes.len().min(buf.len() - n);
                if k == 0 || protect::overlaps(buf[n..].as_ptr() as usize, k) {
                    break;
                }
                copy_slice(&mut buf[n..n + k], &bytes[..k]);
                let whole = k == bytes.len();
                n += k;
                let r = if whole { self.pipe.pop_front() } else { self.pipe.consume_front(k) };
                r.map_err(|e| self.fail_verbs(e))?;
                continue;
            }
            // Anything but the next Data message is left to `pump` (which fails on a bad one).
            let Some((h, d)) = self.proto.next_data(bytes) else { break };
            if d.len() > buf.len() - n || protect::overlaps(buf[n..].as_ptr() as usize, d.len()) {
                break;
            }
            self.proto.took_data(&h);
            copy_slice(&mut buf[n..n + d.len()], d);
            n += d.len();
            self.pipe.pop_front().map_err(|e| self.fail_verbs(e))?;
        }
        Ok(n)
    }

    /// Starts an RDMA read of peer memory into `dst`; with `hold`, `dst` (whole pages) stays
    /// inaccessible until the read completes. The token to wait on: [`READ_DONE`] if the read
    /// completed before this returned.
    fn post_read(&mut self, dst: &mut [u8], addr: u64, rkey: u32, hold: bool, answer: Option<u32>) -> io::Result<u64> {
        let rt = runtime()?;
        // SAFETY: `dst` stays mapped until the read completes: a synchronous read waits for
        // it, an AZ-SDP read relies on the contract in the module docs; a failed socket drops
        // the registration only after its QP is down.
        let reg = unsafe { rt.regcache.get_raw(dst.as_ptr() as u64, dst.len() as u64, AccessFlags::LOCAL_WRITE) }
            .map_err(verbs_io)?;
        let sge = Sge { addr: dst.as_ptr() as u64, length: dst.len() as u32, lkey: reg.lkey() };
        let wr = SendWr::read(0, &[sge], addr, rkey);
        let token = if self.reads.is_empty() {
            // Nothing of ours ahead of it: the provider may carry it out now (the software
            // provider does), with no completion to collect and nothing to hold.
            match self.pipe.post_user_completing(wr).map_err(|e| self.fail_verbs(e))? {
                Some(token) => token,
                None => {
                    drop(reg);
                    if let Some(n) = answer {
                        self.answer_read(n)?;
                    }
                    return Ok(READ_DONE);
                }
            }
        } else {
            self.pipe.post_user(wr).map_err(|e| self.fail_verbs(e))?
        };
        self.reads.push_back(PendingRead { token, hold: None, _reg: reg, answer, ran_into: false });
        if hold {
            // Protect only what is still in flight once the application gets control back: the
            // data landing before the pages close is harmless (the caller has not returned), and
            // a read already complete needs no hold. A read that is merely queued (the software
            // provider runs it once the peer has taken our earlier messages) is waited for as
            // long as protecting and opening the pages would cost: a hold is worth it only for
            // a longer wait, and data landing in held pages costs an extra copy there.
            let budget = hold_cost(dst.len());
            let start = Instant::now();
            loop {
                self.complete_reads()?;
                if !self.reads.iter().any(|r| r.token == token) || start.elapsed() >= budget {
                    break;
                }
                std::hint::spin_loop();
            }
            if let Some(r) = self.reads.iter_mut().find(|r| r.token == token) {
                // SAFETY: whole pages of the caller's buffer; the provider writes them like DMA,
                // and our own code copies into held memory only after the hold is gone
                // (`BufferHeld`).
                let h = unsafe { protect::protect(dst.as_ptr() as usize, dst.len(), Protection::None) };
                r.hold = Some(h.map_err(verbs_io)?);
            }
        }
        Ok(token)
    }

    /// Waits until the read `token` (and every read before it) has completed.
    fn wait_read(&mut self, token: u64) -> io::Result<()> {
        let (mut deadline, mut polls) = (None, 0u32);
        loop {
            self.complete_reads()?;
            if !self.reads.iter().any(|r| r.token == token) {
                return Ok(());
            }
            // The clock only once the read is slow (the software provider's usually is not).
            polls = polls.wrapping_add(1);
            if !polls.is_multiple_of(64) {
                std::hint::spin_loop();
                continue;
            }
            let deadline = *deadline.get_or_insert_with(|| Instant::now() + SETUP_TIMEOUT);
            if Instant::now() > deadline {
                return Err(self.fail(io::ErrorKind::TimedOut, "an RDMA read did not complete".into()));
            }
            std::hint::spin_loop();
        }
    }

    /// Notes that the application came back to `buf` while receive holds on it had not landed.
    fn ran_into_holds(&mut self, buf: &[u8]) {
        for r in self.reads.iter_mut() {
            if r.hold.as_ref().is_some_and(|h| hold_meets(h, buf)) {
                r.ran_into = true;
            }
        }
    }

    /// Waits until every read in flight has completed.
    fn finish_reads(&mut self) -> io::Result<()> {
        match self.reads.back() {
            Some(r) => self.wait_read(r.token),
            None => Ok(()),
        }
    }
}

/// A call's timeout, turned into a point in time only when the call first has to wait: the
/// calls that complete at once (most small reads and writes) never read the clock for it.
struct Deadline {
    timeout: Option<Duration>,
    at: std::cell::Cell<Option<Instant>>,
}

impl Deadline {
    fn never() -> Deadline {
        Deadline::after(None)
    }

    fn after(timeout: Option<Duration>) -> Deadline {
        Deadline { timeout, at: std::cell::Cell::new(None) }
    }

    /// When the call times out, counted from the first time this is asked.
    fn get(&self) -> Option<Instant> {
        let t = self.timeout?;
        let at = self.at.get().unwrap_or_else(|| Instant::now() + t);
        self.at.set(Some(at));
        Some(at)
    }

    fn passed(&self) -> bool {
        self.get().is_some_and(|d| Instant::now() >= d)
    }
}

/// Waits between polls: spins first (the latency path), then yields, then sleeps: on the
/// socket's completion queue where the awaited event raises a completion (a message, bulk
/// data, the peer's answer), else in short naps (a flow-control update is a plain RDMA write,
/// a hold's release a futex wake-up).
#[derive(Default)]
struct Pacer {
    polls: u32,
}

/// Longest sleep on a completion queue: bounds what a wake-up taken by another thread
/// sleeping on the same queue (a `try_clone` of the socket) costs.
const SLEEP_SLICE: Duration = Duration::from_millis(2);
/// A nap where no completion announces the event.
const NAP: Duration = Duration::from_micros(20);

impl Pacer {
    fn pause(&mut self, deadline: &Deadline, what: &str) -> io::Result<()> {
        self.pause_on(deadline, what, None, || true)
    }

    /// [`Pacer::pause`] for an event that raises a completion on `cq`. Before it sleeps there it
    /// calls `prepare` (the pipe's [`MsgPipe::prepare_sleep`]: a polled pipe's messages raise
    /// no completion unless the peer is told we sleep); false: something arrived, poll again.
    fn pause_on(
        &mut self,
        deadline: &Deadline,
        what: &str,
        cq: Option<&CompletionQueue>,
        prepare: impl FnOnce() -> bool,
    ) -> io::Result<()> {
        self.polls += 1;
        let deadline = deadline.get();
        let sleeping = self.polls >= 6000;
        if (sleeping || self.polls.is_multiple_of(64)) && deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(io::Error::new(io::ErrorKind::TimedOut, format!("timed out {what}")));
        }
        if !sleeping && !portability_verbs::spin_yields(self.polls) {
            std::hint::spin_loop();
        } else if !sleeping {
            // A server thread and its clients may outnumber the CPUs.
            std::thread::yield_now();
        } else if let Some(cq) = cq {
            if !prepare() {
                return Ok(());
            }
            let slice = deadline.map_or(SLEEP_SLICE, |d| d.saturating_duration_since(Instant::now()).min(SLEEP_SLICE));
            if let Err(e) = portability_verbs::wait_any(&[cq], slice) {
                // The next poll reports a broken queue; until then, nap.
                debug!("SDP: cannot sleep on the completion queue: {e}");
                std::thread::sleep(NAP);
            }
        } else {
            std::thread::sleep(NAP);
        }
        Ok(())
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

impl std::fmt::Debug for SdpListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SdpListener").field("local", &self.local).field("design", &self.config.design).finish()
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

impl Read for SdpStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
}

impl Read for &SdpStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.read_impl(buf).map_err(|e| self.timeout_is_would_block(e))
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
        self.write_impl(buf).map_err(|e| self.timeout_is_would_block(e))
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
