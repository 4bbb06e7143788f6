//! Connection establishment: an out-of-band bootstrap over a unix or TCP socket that exchanges
//! queue-pair endpoints (and a little private data), the job `rdma_cm` does, behind
//! listen / accept / connect calls that return a connected queue pair in RTS.
//!
//! The frame codec ([`Frame`], [`FrameDecoder`]) is sans-IO; the functions below move its bytes.
//!
//! ```text
//! client                          server
//!   create QP, INIT
//!   HELLO(endpoint, private)  ->
//!                                  create QP, INIT, RTR(client)
//!                             <-   ACCEPT(endpoint, private)   (or REJECT(reason))
//!   RTR(server), RTS
//!   READY                     ->
//!                                  RTS
//! ```

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::endpoint::EndpointInfo;
use crate::error::{Result, VerbsError};
use crate::types::{AccessFlags, QpCaps, QpTransition, RtrAttr, RtsAttr};
use crate::verbs::{CompletionQueue, ProtectionDomain, QpInit, QueuePair};

const MAGIC: [u8; 4] = *b"PVCM";
const VERSION: u8 = 1;
const HEADER: usize = 8;
/// Largest frame payload.
pub const MAX_PAYLOAD: usize = 1024;
/// Largest private data a side may attach.
pub const MAX_PRIVATE: usize = 512;

/// A bootstrap message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// Client's endpoint and private data.
    Hello {
        /// Encoded endpoint.
        endpoint: EndpointInfo,
        /// Application bytes.
        private: Vec<u8>,
    },
    /// Server's endpoint and private data.
    Accept {
        /// Encoded endpoint.
        endpoint: EndpointInfo,
        /// Application bytes.
        private: Vec<u8>,
    },
    /// Client reached RTS.
    Ready,
    /// Refusal with a reason.
    Reject(String),
}

impl Frame {
    fn kind(&self) -> u8 {
        match self {
            Frame::Hello { .. } => 1,
            Frame::Accept { .. } => 2,
            Frame::Ready => 3,
            Frame::Reject(_) => 4,
        }
    }

    /// Encodes: magic, version, kind, u16 payload length, payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut payload = Vec::new();
        match self {
            Frame::Hello { endpoint, private } | Frame::Accept { endpoint, private } => {
                let ep = endpoint.encode();
                payload.push(ep.len() as u8);
                payload.extend_from_slice(&ep);
                payload.extend_from_slice(&(private.len().min(MAX_PRIVATE) as u16).to_le_bytes());
                payload.extend_from_slice(&private[..private.len().min(MAX_PRIVATE)]);
            }
            Frame::Ready => {}
            Frame::Reject(reason) => payload.extend_from_slice(&reason.as_bytes()[..reason.len().min(MAX_PAYLOAD)]),
        }
        let mut out = Vec::with_capacity(HEADER + payload.len());
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        out.push(self.kind());
        out.extend_from_slice(&(payload.len() as u16).to_le_bytes());
        out.extend_from_slice(&payload);
        out
    }

    fn decode_payload(kind: u8, p: &[u8]) -> Result<Frame> {
        let bad = |why: &str| VerbsError::Protocol(format!("bootstrap frame: {why}"));
        match kind {
            1 | 2 => {
                let (&ep_len, rest) = p.split_first().ok_or_else(|| bad("empty endpoint frame"))?;
                let ep_len = ep_len as usize;
                if rest.len() < ep_len + 2 {
                    return Err(bad("endpoint frame shorter than its lengths"));
                }
                let endpoint = EndpointInfo::decode(&rest[..ep_len])?;
                let priv_len = u16::from_le_bytes([rest[ep_len], rest[ep_len + 1]]) as usize;
                let private = &rest[ep_len + 2..];
                if private.len() != priv_len || priv_len > MAX_PRIVATE {
                    return Err(bad("private data length does not match"));
                }
                let private = private.to_vec();
                Ok(if kind == 1 { Frame::Hello { endpoint, private } } else { Frame::Accept { endpoint, private } })
            }
            3 if p.is_empty() => Ok(Frame::Ready),
            3 => Err(bad("READY with a payload")),
            4 => Ok(Frame::Reject(String::from_utf8_lossy(p).into_owned())),
            k => Err(bad(&format!("unknown kind {k}"))),
        }
    }
}

/// Accumulates bytes and yields whole frames.
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buf: Vec<u8>,
}

impl FrameDecoder {
    /// Adds received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole frame, `Ok(None)` if more bytes are needed, or an error for garbage.
    pub fn next_frame(&mut self) -> Result<Option<Frame>> {
        if self.buf.len() < HEADER {
            if !MAGIC.starts_with(&self.buf[..self.buf.len().min(4)]) {
                return Err(VerbsError::Protocol("bootstrap frame: bad magic".into()));
            }
            return Ok(None);
        }
        if self.buf[..4] != MAGIC {
            return Err(VerbsError::Protocol("bootstrap frame: bad magic".into()));
        }
        if self.buf[4] != VERSION {
            return Err(VerbsError::Protocol(format!("bootstrap frame: version {}", self.buf[4])));
        }
        let len = u16::from_le_bytes([self.buf[6], self.buf[7]]) as usize;
        if len > MAX_PAYLOAD {
            return Err(VerbsError::Protocol("bootstrap frame: payload too long".into()));
        }
        if self.buf.len() < HEADER + len {
            return Ok(None);
        }
        let frame = Frame::decode_payload(self.buf[5], &self.buf[HEADER..HEADER + len]);
        self.buf.drain(..HEADER + len);
        frame.map(Some)
    }
}

/// Where a bootstrap listener lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CmAddr {
    /// A unix socket path.
    Unix(PathBuf),
    /// A TCP address.
    Tcp(SocketAddr),
}

impl std::str::FromStr for CmAddr {
    type Err = VerbsError;
    /// `unix:/path` or `host:port`.
    fn from_str(s: &str) -> Result<CmAddr> {
        if let Some(p) = s.strip_prefix("unix:") {
            return Ok(CmAddr::Unix(PathBuf::from(p)));
        }
        use std::net::ToSocketAddrs;
        s.to_socket_addrs()
            .map_err(|e| VerbsError::invalid(format!("address {s:?}: {e}")))?
            .next()
            .map(CmAddr::Tcp)
            .ok_or_else(|| VerbsError::invalid(format!("address {s:?} resolves to nothing")))
    }
}

impl std::fmt::Display for CmAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CmAddr::Unix(p) => write!(f, "unix:{}", p.display()),
            CmAddr::Tcp(a) => write!(f, "{a}"),
        }
    }
}

enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    /// `ours` with the IP this stream's peer reached us at, and `theirs` with the IP we reached
    /// the peer at, where an endpoint leaves its TCP transport's IP unspecified.
    fn fill_ips(&self, ours: EndpointInfo) -> EndpointInfo {
        match self.addrs().0 {
            Some(local) => ours.with_tcp_ip(local.ip()),
            None => ours,
        }
    }
    fn fill_peer_ip(&self, theirs: EndpointInfo) -> EndpointInfo {
        match self.addrs().1 {
            Some(peer) => theirs.with_tcp_ip(peer.ip()),
            None => theirs,
        }
    }

    fn addrs(&self) -> (Option<SocketAddr>, Option<SocketAddr>) {
        match self {
            Stream::Unix(_) => (None, None),
            Stream::Tcp(s) => (s.local_addr().ok(), s.peer_addr().ok()),
        }
    }
    fn fd(&self) -> RawFd {
        match self {
            Stream::Unix(s) => s.as_raw_fd(),
            Stream::Tcp(s) => s.as_raw_fd(),
        }
    }
    fn set_nonblocking(&self, on: bool) -> std::io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_nonblocking(on),
            Stream::Tcp(s) => s.set_nonblocking(on),
        }
    }
    fn io(&mut self) -> &mut dyn ReadWrite {
        match self {
            Stream::Unix(s) => s,
            Stream::Tcp(s) => s,
        }
    }
}

trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

/// What every queue pair a connection manager call creates is made of: a completion queue of its
/// own (for both sides) holding `cq_capacity` completions, and these queue sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpSpec {
    /// Queue sizes of the queue pair.
    pub caps: QpCaps,
    /// Completions the connection's completion queue holds (at least the queue pair's send and
    /// receive depths together, so that it cannot overrun).
    pub cq_capacity: usize,
}

impl Default for QpSpec {
    fn default() -> Self {
        let caps = QpCaps::default();
        QpSpec { caps, cq_capacity: (caps.max_send_wr + caps.max_recv_wr) as usize }
    }
}

impl QpSpec {
    /// Queue sizes `send` and `recv`, with a completion queue that holds both.
    pub fn with_depths(send: u32, recv: u32) -> QpSpec {
        let caps = QpCaps { max_send_wr: send, max_recv_wr: recv, ..QpCaps::default() };
        QpSpec { caps, cq_capacity: (send + recv) as usize }
    }

    /// A completion queue and a queue pair reporting to it, in INIT.
    fn create(&self, pd: &ProtectionDomain) -> Result<(QueuePair, CompletionQueue)> {
        if self.cq_capacity < (self.caps.max_send_wr + self.caps.max_recv_wr) as usize {
            return Err(VerbsError::invalid(format!(
                "a completion queue of {} for queues of {} + {} could overrun",
                self.cq_capacity, self.caps.max_send_wr, self.caps.max_recv_wr
            )));
        }
        let cq = pd.context().create_cq(self.cq_capacity)?;
        let qp = pd.create_qp(&QpInit { caps: self.caps, ..QpInit::new(&cq) })?;
        qp.modify(QpTransition::Init { access: AccessFlags::ALL, port: 1 })?;
        Ok((qp, cq))
    }
}

/// A connected queue pair with what the peer attached.
pub struct Connection {
    /// The queue pair, in RTS.
    pub qp: QueuePair,
    /// Its completion queue (send and receive side).
    pub cq: CompletionQueue,
    /// The peer's private data.
    pub peer_private: Vec<u8>,
    /// Our end of the bootstrap socket, when it was TCP (what SDP reports as `local_addr`).
    pub local_addr: Option<SocketAddr>,
    /// The peer's end of the bootstrap socket, when it was TCP.
    pub peer_addr: Option<SocketAddr>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("qpn", &self.qp.qpn())
            .field("peer_private", &self.peer_private.len())
            .field("local_addr", &self.local_addr)
            .field("peer_addr", &self.peer_addr)
            .finish()
    }
}

/// How long a client's bootstrap may take on the server's side, from its connection to its
/// READY, unless [`Listener::set_handshake_timeout`] says otherwise.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Listens for bootstrap connections. Each client's bootstrap runs on its own, without
/// blocking: a client that is slow, silent, sends garbage or dies costs the others nothing,
/// and fails only its own connection (never an `accept`). A queue pair whose endpoint went to
/// a client lives until the client said READY (so the descriptors the client fetches from it
/// stay valid) or its handshake failed.
pub struct Listener {
    inner: ListenerImpl,
    addr: CmAddr,
    pending: Mutex<Vec<Handshake>>,
    handshake_timeout: Mutex<Duration>,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener").field("addr", self.local_addr()).finish_non_exhaustive()
    }
}

enum ListenerImpl {
    Unix(UnixListener),
    Tcp(TcpListener),
}

impl ListenerImpl {
    fn fd(&self) -> RawFd {
        match self {
            ListenerImpl::Unix(l) => l.as_raw_fd(),
            ListenerImpl::Tcp(l) => l.as_raw_fd(),
        }
    }

    /// A client waiting to be accepted, if any.
    fn try_accept(&self) -> std::io::Result<Option<Stream>> {
        let accepted = match self {
            ListenerImpl::Unix(l) => l.accept().map(|(s, _)| Stream::Unix(s)),
            ListenerImpl::Tcp(l) => l.accept().map(|(s, _)| {
                let _ = s.set_nodelay(true);
                Stream::Tcp(s)
            }),
        };
        match accepted {
            Ok(s) => Ok(Some(s)),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(None),
            // A client that reset before we took it is its own failure, not the listener's.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ECONNABORTED | libc::EPROTO)) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// One client's bootstrap on the server's side.
struct Handshake {
    stream: Stream,
    dec: FrameDecoder,
    /// Bytes of ours not yet written.
    out: Vec<u8>,
    /// After the client's HELLO: our queue pair (in RTR), its completion queue, the client's
    /// private data.
    qp: Option<(QueuePair, CompletionQueue, Vec<u8>)>,
    deadline: Instant,
}

/// What one step of a handshake came to.
enum Step {
    /// Waiting for the client (or for room to write to it).
    Waiting,
    /// The client is connected.
    Done(Box<Connection>),
}

impl Handshake {
    /// Takes what the client sent and answers it, without blocking.
    fn step(&mut self, pd: &ProtectionDomain, spec: &QpSpec, private: &[u8]) -> Result<Step> {
        if Instant::now() >= self.deadline {
            return Err(VerbsError::PeerUnreachable("the client did not finish its bootstrap in time".into()));
        }
        self.flush()?;
        let mut buf = [0u8; 512];
        loop {
            if let Some(frame) = self.dec.next_frame()? {
                match (frame, self.qp.is_some()) {
                    (Frame::Hello { endpoint, private: peer_private }, false) => {
                        let endpoint = self.stream.fill_peer_ip(endpoint);
                        match spec.create(pd).and_then(|(qp, cq)| {
                            qp.modify(QpTransition::Rtr(RtrAttr::new(endpoint)))?;
                            Ok((qp, cq))
                        }) {
                            Ok((qp, cq)) => {
                                let endpoint = self.stream.fill_ips(qp.endpoint());
                                let accept = Frame::Accept { endpoint, private: private.to_vec() };
                                self.out.extend_from_slice(&accept.encode());
                                self.qp = Some((qp, cq, peer_private));
                                self.flush()?;
                            }
                            Err(e) => {
                                self.out.extend_from_slice(&Frame::Reject(e.to_string()).encode());
                                let _ = self.flush();
                                return Err(e);
                            }
                        }
                    }
                    (Frame::Ready, true) => {
                        let (qp, cq, peer_private) = self.qp.take().expect("checked");
                        qp.modify(QpTransition::Rts(RtsAttr::default()))?;
                        let (local_addr, peer_addr) = self.stream.addrs();
                        return Ok(Step::Done(Box::new(Connection { qp, cq, peer_private, local_addr, peer_addr })));
                    }
                    (other, _) => return Err(VerbsError::Protocol(format!("unexpected bootstrap frame {other:?}"))),
                }
                continue;
            }
            match self.stream.io().read(&mut buf) {
                Ok(0) => return Err(VerbsError::PeerUnreachable("the client closed its bootstrap socket".into())),
                Ok(n) => self.dec.push(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(Step::Waiting),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(VerbsError::os("reading a bootstrap frame", e)),
            }
        }
    }

    /// Writes what of ours the socket takes now.
    fn flush(&mut self) -> Result<()> {
        while !self.out.is_empty() {
            match self.stream.io().write(&self.out) {
                Ok(n) => _ = self.out.drain(..n),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(VerbsError::os("sending a bootstrap frame", e)),
            }
        }
        Ok(())
    }

    fn poll_events(&self) -> libc::pollfd {
        let out = if self.out.is_empty() { 0 } else { libc::POLLOUT };
        libc::pollfd { fd: self.stream.fd(), events: libc::POLLIN | out, revents: 0 }
    }
}

fn io_err(what: &str) -> impl FnOnce(std::io::Error) -> VerbsError + '_ {
    move |e| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            VerbsError::PeerUnreachable(format!("{what}: peer did not answer in time"))
        }
        std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound => {
            VerbsError::Refused(format!("{what}: {e}"))
        }
        _ => VerbsError::os(what, e),
    }
}

/// Longest a wait for clients sleeps before the handshakes' own deadlines are looked at.
const ACCEPT_SLICE: Duration = Duration::from_millis(50);
/// Handshakes a listener keeps in progress at most: clients beyond are closed at once (each
/// waits at most the handshake timeout, so a flood of silent clients cannot grow the table
/// without bound).
const MAX_PENDING: usize = 1024;

impl Listener {
    /// Binds a listener. A unix socket file left at the path by a process that is gone is
    /// replaced; one that a live listener answers on is an error (it belongs to someone else:
    /// another job's rank, say).
    pub fn bind(addr: &CmAddr) -> Result<Listener> {
        let inner = match addr {
            CmAddr::Unix(p) => {
                if UnixStream::connect(p).is_ok() {
                    return Err(VerbsError::InvalidState(format!(
                        "{} is in use by a live listener (another job in the same rendezvous directory?)",
                        p.display()
                    )));
                }
                let _ = std::fs::remove_file(p);
                ListenerImpl::Unix(UnixListener::bind(p).map_err(io_err("binding the bootstrap socket"))?)
            }
            CmAddr::Tcp(a) => ListenerImpl::Tcp(TcpListener::bind(a).map_err(io_err("binding the bootstrap socket"))?),
        };
        match &inner {
            ListenerImpl::Unix(l) => l.set_nonblocking(true),
            ListenerImpl::Tcp(l) => l.set_nonblocking(true),
        }
        .map_err(io_err("a nonblocking bootstrap socket"))?;
        let addr = match (&inner, addr) {
            (ListenerImpl::Tcp(l), _) => CmAddr::Tcp(l.local_addr().map_err(io_err("local address"))?),
            (_, a) => a.clone(),
        };
        Ok(Listener { inner, addr, pending: Mutex::new(Vec::new()), handshake_timeout: Mutex::new(HANDSHAKE_TIMEOUT) })
    }

    /// The bound address (with the real port for TCP port 0).
    pub fn local_addr(&self) -> &CmAddr {
        &self.addr
    }

    /// The listening socket's descriptor (readable when a client connects), for an event
    /// loop that then calls [`Listener::accept`] with a zero timeout.
    pub fn raw_fd(&self) -> RawFd {
        self.inner.fd()
    }

    /// How long each client's bootstrap may take (default [`HANDSHAKE_TIMEOUT`]).
    pub fn set_handshake_timeout(&self, t: Duration) {
        *self.handshake_timeout.lock().unwrap_or_else(|p| p.into_inner()) = t;
    }

    /// Handshakes in progress (clients connected whose bootstrap has not finished).
    pub fn pending(&self) -> usize {
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Returns the next client whose bootstrap finishes within `timeout` (zero: only one that
    /// finishes now), with a queue pair made by `spec` connected to it and `private` sent to it;
    /// [`VerbsError::Timeout`] if none does. Meanwhile it drives every client's bootstrap, so a
    /// client's handshake may be finished by a later call (with that call's `spec` and
    /// `private` for what it creates then). Clients that fail are dropped, each on its own.
    pub fn accept(
        &self,
        pd: &ProtectionDomain,
        spec: &QpSpec,
        private: &[u8],
        timeout: Duration,
    ) -> Result<Connection> {
        let deadline = Deadline::after(timeout);
        let handshake_timeout = *self.handshake_timeout.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let mut fds = vec![libc::pollfd { fd: self.inner.fd(), events: libc::POLLIN, revents: 0 }];
            {
                let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
                while let Some(stream) = self.inner.try_accept().map_err(io_err("accept"))? {
                    // A client's own failure, or a flood of clients past what the table holds,
                    // costs that client its connection (closed at once), not the listener.
                    if pending.len() >= MAX_PENDING {
                        log::warn!(
                            "bootstrap on {}: {MAX_PENDING} handshakes in progress, refusing a client",
                            self.addr
                        );
                        continue;
                    }
                    if let Err(e) = stream.set_nonblocking(true) {
                        log::debug!("bootstrap on {}: a client's socket: {e}", self.addr);
                        continue;
                    }
                    pending.push(Handshake {
                        stream,
                        dec: FrameDecoder::default(),
                        out: Vec::new(),
                        qp: None,
                        deadline: Instant::now() + handshake_timeout,
                    });
                }
                let mut i = 0;
                while i < pending.len() {
                    match pending[i].step(pd, spec, private) {
                        Ok(Step::Waiting) => {
                            fds.push(pending[i].poll_events());
                            i += 1;
                        }
                        Ok(Step::Done(conn)) => {
                            pending.swap_remove(i);
                            return Ok(*conn);
                        }
                        Err(e) => {
                            log::debug!("bootstrap on {}: a client's handshake failed: {e}", self.addr);
                            pending.swap_remove(i);
                        }
                    }
                }
            }
            let left = deadline.at.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(deadline.expired());
            }
            crate::os::wait_any_readable(&mut fds, Some(left.min(ACCEPT_SLICE)))?;
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let CmAddr::Unix(p) = &self.addr {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Connects to a listener within `timeout`, returning a queue pair in RTS made by `spec`. No
/// listener at the address is [`VerbsError::Refused`] at once, as a TCP connect is.
pub fn connect(
    addr: &CmAddr,
    pd: &ProtectionDomain,
    spec: &QpSpec,
    private: &[u8],
    timeout: Duration,
) -> Result<Connection> {
    let deadline = Deadline::after(timeout);
    let stream = open(addr, &deadline)?;
    handshake(stream, pd, spec, private, deadline)
}

/// [`connect`] to a listener that may not be up yet (the peers of a job starting together):
/// a refused connection is tried again until `timeout`.
pub fn connect_retrying(
    addr: &CmAddr,
    pd: &ProtectionDomain,
    spec: &QpSpec,
    private: &[u8],
    timeout: Duration,
) -> Result<Connection> {
    let deadline = Deadline::after(timeout);
    let stream = loop {
        match open(addr, &deadline) {
            Ok(s) => break s,
            Err(VerbsError::Refused(why)) => {
                if deadline.passed() {
                    return Err(VerbsError::Refused(format!("no listener at {addr} within {timeout:?}: {why}")));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(e),
        }
    };
    handshake(stream, pd, spec, private, deadline)
}

fn open(addr: &CmAddr, deadline: &Deadline) -> Result<Stream> {
    let what = format!("connecting to {addr}");
    match addr {
        CmAddr::Unix(p) => UnixStream::connect(p).map(Stream::Unix),
        CmAddr::Tcp(a) => TcpStream::connect_timeout(a, deadline.left()?).map(|s| {
            let _ = s.set_nodelay(true);
            Stream::Tcp(s)
        }),
    }
    .map_err(io_err(&what))
}

/// The client's side of the bootstrap, blocking (with the deadline) on its one socket.
fn handshake(
    mut stream: Stream,
    pd: &ProtectionDomain,
    spec: &QpSpec,
    private: &[u8],
    deadline: Deadline,
) -> Result<Connection> {
    let (qp, cq) = spec.create(pd)?;
    let endpoint = stream.fill_ips(qp.endpoint());
    write_frame(&mut stream, &Frame::Hello { endpoint, private: private.to_vec() }, deadline)?;
    let mut dec = FrameDecoder::default();
    let (server, peer_private) = match read_frame(&mut stream, &mut dec, deadline)? {
        Frame::Accept { endpoint, private } => (stream.fill_peer_ip(endpoint), private),
        Frame::Reject(why) => return Err(VerbsError::Refused(format!("the listener rejected the connection: {why}"))),
        other => return Err(VerbsError::Protocol(format!("expected ACCEPT, got {other:?}"))),
    };
    qp.modify(QpTransition::Rtr(RtrAttr::new(server)))?;
    qp.modify(QpTransition::Rts(RtsAttr::default()))?;
    write_frame(&mut stream, &Frame::Ready, deadline)?;
    let (local_addr, peer_addr) = stream.addrs();
    Ok(Connection { qp, cq, peer_private, local_addr, peer_addr })
}

/// When a set-up step gives up, and the timeout it was given (what its error reports).
#[derive(Clone, Copy)]
struct Deadline {
    at: Instant,
    timeout: Duration,
}

impl Deadline {
    fn after(timeout: Duration) -> Deadline {
        Deadline { at: Instant::now() + timeout, timeout }
    }

    fn passed(&self) -> bool {
        Instant::now() >= self.at
    }

    fn expired(&self) -> VerbsError {
        VerbsError::Timeout(self.timeout)
    }

    /// Time left, or the timeout error once none is.
    fn left(&self) -> Result<Duration> {
        let d = self.at.saturating_duration_since(Instant::now());
        if d.is_zero() {
            Err(self.expired())
        } else {
            Ok(d)
        }
    }
}

fn set_timeout(s: &Stream, deadline: Deadline) -> Result<()> {
    let t = Some(deadline.left()?);
    match s {
        Stream::Unix(s) => s.set_read_timeout(t).and(s.set_write_timeout(t)),
        Stream::Tcp(s) => s.set_read_timeout(t).and(s.set_write_timeout(t)),
    }
    .map_err(io_err("socket timeout"))
}

fn write_frame(s: &mut Stream, f: &Frame, deadline: Deadline) -> Result<()> {
    set_timeout(s, deadline)?;
    s.io().write_all(&f.encode()).map_err(io_err("sending a bootstrap frame"))
}

fn read_frame(s: &mut Stream, dec: &mut FrameDecoder, deadline: Deadline) -> Result<Frame> {
    let mut buf = [0u8; 512];
    loop {
        if let Some(f) = dec.next_frame()? {
            return Ok(f);
        }
        set_timeout(s, deadline)?;
        let n = s.io().read(&mut buf).map_err(io_err("reading a bootstrap frame"))?;
        if n == 0 {
            return Err(VerbsError::PeerUnreachable("bootstrap peer closed the connection".into()));
        }
        dec.push(&buf[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::HwEndpoint;
    use proptest::prelude::*;

    fn ep() -> EndpointInfo {
        EndpointInfo::Hardware(HwEndpoint { lid: 1, gid: [2; 16], gid_index: 0, port: 1, qpn: 77, psn: 5, mtu: 5 })
    }

    #[test]
    fn frames_round_trip_through_split_delivery() {
        let frames = vec![
            Frame::Hello { endpoint: ep(), private: b"hi".to_vec() },
            Frame::Accept { endpoint: ep(), private: vec![] },
            Frame::Ready,
            Frame::Reject("no".into()),
        ];
        let bytes: Vec<u8> = frames.iter().flat_map(|f| f.encode()).collect();
        let mut dec = FrameDecoder::default();
        let mut got = Vec::new();
        for b in bytes {
            dec.push(&[b]);
            while let Some(f) = dec.next_frame().unwrap() {
                got.push(f);
            }
        }
        assert_eq!(got, frames);
    }

    proptest! {
        #[test]
        fn garbage_never_panics(chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 0..8)) {
            let mut dec = FrameDecoder::default();
            for c in chunks {
                dec.push(&c);
                match dec.next_frame() {
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
        }
    }
}
