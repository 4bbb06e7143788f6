//! EXS sockets: SOCK_STREAM and SOCK_SEQPACKET endpoints whose connect, accept, send, receive
//! and close start at once and complete as events on an event queue.

use std::collections::VecDeque;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use portability_verbs::cm::{self, CmAddr, Connection, QpSpec};
use portability_verbs::datapath::pipe::{FlowStrategy, MsgPipe};
use portability_verbs::{AccessFlags, MemoryRegion, QpCaps};

use super::conn::SEND_DEPTH;
use super::engine;
use super::error::{ExsError, ExsResult};
use super::memory::Memory;
use super::queue::EventKind;
use super::wire::{Hello, SocketKind, MAX_WRITE};
use super::SMALL_MAX_LIMIT;
use super::{Event, EventQueue};
use crate::verbs_runtime::runtime;

/// A socket's connection, its events naming sockets.
type Conn = super::conn::Conn<ExsSocket>;
/// An operation of a socket's connection.
type Op = super::conn::Op<ExsSocket>;

/// Control messages each end takes unread at most (the peer's credits).
const CONTROL_CREDITS: u16 = 64;
/// Receives each queue pair keeps posted: the pipe's setup and wake-ups.
const PIPE_RECEIVES: u32 = 80;
/// How long a connect may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an accepted connection's pipe setup may take.
const PIPE_SETUP_TIMEOUT: Duration = Duration::from_secs(2);
/// Accepted connections whose pipe a listener sets up at once at most (more wait their turn).
const MAX_SETTING_UP: usize = 16;
/// The largest stream buffer.
const MAX_RECV_BUFFER: u32 = 64 << 20;

/// What `exs_fcntl` sets. Socket tunables take effect at `connect` or `listen` (an accepted
/// socket has its listener's); process tunables at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tunable {
    /// Largest message sent inside a control message when no advertisement is at hand
    /// (0 ..= 4096 bytes, default 128; the receiver's value bounds the sender's).
    SmallMax,
    /// Largest write whose data is copied into the work request (0 ..= 256, default 64).
    InlineMax,
    /// Process-wide: waits poll (1, the default; 500 us without an event before they sleep)
    /// or sleep until notified (0; after 20 us of polls).
    BusyPoll,
    /// Process-wide: the CPU the completion thread runs on (-1: any, the default).
    CompletionCpu,
    /// SOCK_STREAM: bytes of the stream buffer that takes data ahead of any receive (0: none;
    /// rounded up to a power of two, at least 4096; default 65536).
    RecvBuffer,
    /// Receives advertised to the peer at once at most (1 ..= 32, default 16).
    AdvCredits,
}

/// The socket tunables.
#[derive(Clone, Copy, Debug)]
struct Options {
    small_max: u32,
    inline_max: u32,
    recv_buffer: u32,
    adv_credits: u32,
}

impl Default for Options {
    fn default() -> Self {
        Options { small_max: 128, inline_max: 64, recv_buffer: 64 << 10, adv_credits: 16 }
    }
}

enum State {
    Fresh { bound: Option<SocketAddr> },
    Connecting,
    Listening(Arc<Listening>),
    Connected(Arc<Conn>),
    Closed,
}

struct Inner {
    id: i32,
    kind: SocketKind,
    state: Mutex<State>,
    /// The connection once connected (sends and receives take no lock to find it), and
    /// whether the socket was closed since.
    conn: OnceLock<Arc<Conn>>,
    closed: AtomicBool,
    options: Mutex<Options>,
}

/// An EXS socket. Clones share it; dropping the last one closes it without an event.
#[derive(Clone)]
pub struct ExsSocket(Arc<Inner>);

impl std::fmt::Debug for ExsSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ExsSocket({}, {:?})", self.0.id, self.0.kind)
    }
}

/// Socket numbers start here, far from the kernel's descriptors, so that one passed to
/// `read` or `close` by mistake fails instead of touching another file.
pub const FIRST_SOCKET_ID: i32 = 1 << 20;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A listening socket's accept machinery.
struct Listening {
    local: SocketAddr,
    stop: AtomicBool,
    queue: Mutex<AcceptQueue>,
}

#[derive(Default)]
struct AcceptQueue {
    /// `accept` calls waiting for a connection.
    waiting: VecDeque<(u64, EventQueue, ExsSocket)>,
    /// Connections waiting for an `accept`.
    ready: VecDeque<ExsSocket>,
    /// Connections whose pipe is being set up, each on a thread of its own (as the kernel
    /// keeps connections not yet established apart from its accept queue).
    setting_up: usize,
    backlog: usize,
}

impl ExsSocket {
    /// A new unconnected socket (`exs_socket`).
    pub fn new(kind: SocketKind) -> ExsResult<ExsSocket> {
        engine::start()?;
        runtime().map_err(ExsError::io)?;
        Ok(Self::with(kind, Options::default(), State::Fresh { bound: None }))
    }

    fn with(kind: SocketKind, options: Options, state: State) -> ExsSocket {
        static NEXT: AtomicI32 = AtomicI32::new(FIRST_SOCKET_ID);
        let conn = OnceLock::new();
        if let State::Connected(c) = &state {
            let _ = conn.set(c.clone());
        }
        ExsSocket(Arc::new(Inner {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            kind,
            state: Mutex::new(state),
            conn,
            closed: AtomicBool::new(false),
            options: Mutex::new(options),
        }))
    }

    /// The socket's number (what the C API calls its descriptor).
    pub fn id(&self) -> i32 {
        self.0.id
    }

    /// Its type.
    pub fn kind(&self) -> SocketKind {
        self.0.kind
    }

    /// Names the address a listening socket takes (`exs_bind`).
    pub fn bind(&self, addr: impl ToSocketAddrs) -> ExsResult<()> {
        let addr = addr
            .to_socket_addrs()
            .map_err(ExsError::io)?
            .next()
            .ok_or(ExsError::Invalid("address resolves to nothing"))?;
        match &mut *lock(&self.0.state) {
            State::Fresh { bound: b @ None } => {
                *b = Some(addr);
                Ok(())
            }
            State::Fresh { .. } => Err(ExsError::state("socket already bound", libc::EINVAL)),
            _ => Err(ExsError::state("socket in use", libc::EISCONN)),
        }
    }

    /// The address a listening socket took (its port, when it was bound to port 0).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        match &*lock(&self.0.state) {
            State::Listening(l) => Some(l.local),
            State::Fresh { bound } => *bound,
            _ => None,
        }
    }

    /// Starts listening (`exs_listen`): connections are accepted in the background, up to
    /// `backlog` of them waiting for `accept`.
    pub fn listen(&self, backlog: usize) -> ExsResult<()> {
        let mut st = lock(&self.0.state);
        let State::Fresh { bound: Some(addr) } = &*st else {
            return Err(ExsError::state("listen needs a bound, unconnected socket", libc::EINVAL));
        };
        let listener = cm::Listener::bind(&CmAddr::Tcp(*addr)).map_err(ExsError::verbs)?;
        let local = match listener.local_addr() {
            CmAddr::Tcp(a) => *a,
            CmAddr::Unix(_) => *addr,
        };
        let l = Arc::new(Listening {
            local,
            stop: AtomicBool::new(false),
            queue: Mutex::new(AcceptQueue { backlog: backlog.clamp(1, 4096), ..AcceptQueue::default() }),
        });
        let (kind, options) = (self.0.kind, *lock(&self.0.options));
        let l2 = l.clone();
        portability_verbs::os::spawn_quiet("exs-accept", move || accept_loop(listener, l2, kind, options))
            .map_err(ExsError::io)?;
        *st = State::Listening(l);
        Ok(())
    }

    /// Starts accepting a connection (`exs_accept`); the event carries the new socket.
    pub fn accept(&self, queue: &EventQueue, req: u64) -> ExsResult<()> {
        let l = match &*lock(&self.0.state) {
            State::Listening(l) => l.clone(),
            _ => return Err(ExsError::state("accept on a socket that does not listen", libc::EINVAL)),
        };
        queue.reserve()?;
        let mut q = lock(&l.queue);
        match q.ready.pop_front() {
            Some(s) => {
                drop(q);
                queue.deliver(accept_event(req, self.clone(), Ok(s)));
            }
            None => q.waiting.push_back((req, queue.clone(), self.clone())),
        }
        Ok(())
    }

    /// Starts connecting to a listening EXS socket (`exs_connect`).
    pub fn connect(&self, addr: impl ToSocketAddrs, queue: &EventQueue, req: u64) -> ExsResult<()> {
        let addr = addr
            .to_socket_addrs()
            .map_err(ExsError::io)?
            .next()
            .ok_or(ExsError::Invalid("address resolves to nothing"))?;
        {
            let mut st = lock(&self.0.state);
            match &*st {
                State::Fresh { bound: None } => {}
                State::Fresh { .. } => {
                    return Err(ExsError::state("a bound socket listens; it does not connect", libc::EINVAL))
                }
                State::Connecting => return Err(ExsError::state("connect already in progress", libc::EALREADY)),
                State::Connected(_) => return Err(ExsError::state("socket already connected", libc::EISCONN)),
                State::Listening(_) => return Err(ExsError::state("socket listens", libc::EINVAL)),
                State::Closed => return Err(ExsError::state("socket closed", libc::EBADF)),
            }
            queue.reserve()?;
            *st = State::Connecting;
        }
        let (me, queue) = (self.clone(), queue.clone());
        let spawned = portability_verbs::os::spawn_quiet("exs-connect", move || {
            let (kind, options) = (me.0.kind, *lock(&me.0.options));
            let result = prepare(kind, &options).and_then(|(mem, hello)| {
                let rt = runtime().map_err(ExsError::io)?;
                let c = cm::connect(&CmAddr::Tcp(addr), &rt.pd, &qp_spec(), &hello.encode(), CONNECT_TIMEOUT)
                    .map_err(ExsError::verbs)?;
                establish(c, mem, &hello, &options, CONNECT_TIMEOUT)
            });
            let outcome = {
                let mut st = lock(&me.0.state);
                match result {
                    Ok(conn) if matches!(*st, State::Connecting) => {
                        let _ = me.0.conn.set(conn.clone());
                        *st = State::Connected(conn);
                        Ok(0)
                    }
                    Ok(_) => Err(libc::ECANCELED),
                    Err(e) => {
                        if matches!(*st, State::Connecting) {
                            *st = State::Fresh { bound: None };
                        }
                        log::debug!("EXS connect to {addr}: {e}");
                        Err(e.errno())
                    }
                }
            };
            queue.deliver(Event {
                req,
                kind: EventKind::Connect,
                socket: me.clone(),
                outcome,
                truncated: false,
                accepted: None,
            });
        });
        if let Err(e) = spawned {
            *lock(&self.0.state) = State::Fresh { bound: None };
            return Err(ExsError::io(e));
        }
        Ok(())
    }

    fn connected(&self) -> ExsResult<&Arc<Conn>> {
        if self.0.closed.load(Ordering::Acquire) {
            return Err(ExsError::state("socket closed", libc::EBADF));
        }
        self.0.conn.get().ok_or(ExsError::state("socket not connected", libc::ENOTCONN))
    }

    fn start_io(
        &self,
        kind: EventKind,
        queue: &EventQueue,
        req: u64,
        mem: &Memory,
        addr: u64,
        len: usize,
    ) -> ExsResult<()> {
        if len as u64 > MAX_WRITE as u64 && self.0.kind == SocketKind::SeqPacket {
            return Err(ExsError::state("message larger than SOCK_SEQPACKET carries", libc::EMSGSIZE));
        }
        let conn = self.connected()?;
        let hold = mem.hold(addr, len as u64)?;
        queue.reserve()?;
        let op = Op { req, kind, target: Some((queue.clone(), self.clone())), hold: Some(hold) };
        let (lkey, rkey, len) = (mem.lkey(), mem.rkey(), len as u64);
        let r = match kind {
            EventKind::Send => conn.start_send(op, addr, len, lkey),
            _ => conn.start(op, |p, token| p.post_recv(token, addr, len, rkey)),
        };
        if r.is_err() {
            queue.unreserve();
        }
        r
    }

    /// Starts sending `len` bytes at `offset` in `mem` (`exs_send`). The bytes must stay
    /// unchanged until the event: they may be read by RDMA until then.
    pub fn send(&self, queue: &EventQueue, req: u64, mem: &Memory, offset: usize, len: usize) -> ExsResult<()> {
        let addr = mem.addr().checked_add(offset as u64).ok_or(ExsError::OutsideRegion)?;
        self.start_io(EventKind::Send, queue, req, mem, addr, len)
    }

    /// Starts receiving into `len` bytes at `offset` in `mem` (`exs_recv`): a SOCK_STREAM
    /// receive completes with the bytes at hand (at least one; 0 is the end of the peer's
    /// data), a SOCK_SEQPACKET receive with one message (cut to the buffer, and flagged so,
    /// when longer).
    pub fn recv(&self, queue: &EventQueue, req: u64, mem: &Memory, offset: usize, len: usize) -> ExsResult<()> {
        if len == 0 && self.0.kind == SocketKind::Stream {
            return Err(ExsError::Invalid("a stream receive of no bytes"));
        }
        let addr = mem.addr().checked_add(offset as u64).ok_or(ExsError::OutsideRegion)?;
        self.start_io(EventKind::Recv, queue, req, mem, addr, len)
    }

    /// [`ExsSocket::send`] by address, as the C API passes it.
    pub fn send_at(&self, queue: &EventQueue, req: u64, mem: &Memory, addr: u64, len: usize) -> ExsResult<()> {
        self.start_io(EventKind::Send, queue, req, mem, addr, len)
    }

    /// [`ExsSocket::recv`] by address, as the C API passes it.
    pub fn recv_at(&self, queue: &EventQueue, req: u64, mem: &Memory, addr: u64, len: usize) -> ExsResult<()> {
        if len == 0 && self.0.kind == SocketKind::Stream {
            return Err(ExsError::Invalid("a stream receive of no bytes"));
        }
        self.start_io(EventKind::Recv, queue, req, mem, addr, len)
    }

    /// Starts closing (`exs_close`): the bytes sent go first, then the peer sees the end of
    /// the data; receives still waiting complete with `ECANCELED`. The close's event comes once
    /// the peer has every byte and the end (the process may exit then). A listening socket
    /// stops accepting (waiting accepts complete with `ECANCELED`).
    pub fn close(&self, queue: &EventQueue, req: u64) -> ExsResult<()> {
        let mut st = lock(&self.0.state);
        match &*st {
            State::Closed => return Err(ExsError::state("socket already closed", libc::EBADF)),
            State::Connecting => return Err(ExsError::state("connect in progress", libc::EINPROGRESS)),
            _ => {}
        }
        // The event's place first: a full queue refuses the close and leaves the socket open.
        queue.reserve()?;
        self.0.closed.store(true, Ordering::Release);
        match std::mem::replace(&mut *st, State::Closed) {
            State::Connected(conn) => {
                drop(st);
                let op = Op { req, kind: EventKind::Close, target: Some((queue.clone(), self.clone())), hold: None };
                let r = conn.start(op, |p, token| p.close(token));
                if r.is_err() {
                    queue.unreserve();
                }
                return r;
            }
            State::Listening(l) => stop_listening(&l),
            _ => {}
        }
        drop(st);
        queue.deliver(Event {
            req,
            kind: EventKind::Close,
            socket: self.clone(),
            outcome: Ok(0),
            truncated: false,
            accepted: None,
        });
        Ok(())
    }

    /// Sets a tunable (`exs_fcntl`).
    pub fn set(&self, t: Tunable, value: i64) -> ExsResult<()> {
        let out_of_range = ExsError::Invalid("tunable value out of range");
        match t {
            Tunable::BusyPoll => {
                engine::set_busy_poll(value != 0);
                return Ok(());
            }
            Tunable::CompletionCpu => return engine::set_completion_cpu(usize::try_from(value).ok()),
            _ => {}
        }
        if !matches!(*lock(&self.0.state), State::Fresh { .. }) {
            return Err(ExsError::state("socket tunables are set before connect or listen", libc::EISCONN));
        }
        let mut o = lock(&self.0.options);
        match t {
            Tunable::SmallMax if (0..=SMALL_MAX_LIMIT as i64).contains(&value) => o.small_max = value as u32,
            Tunable::InlineMax if (0..=QpCaps::default().max_inline_data as i64).contains(&value) => {
                o.inline_max = value as u32
            }
            Tunable::AdvCredits if (1..=32).contains(&value) => o.adv_credits = value as u32,
            Tunable::RecvBuffer if self.0.kind != SocketKind::Stream => {
                return Err(ExsError::state("only SOCK_STREAM has a stream buffer", libc::EOPNOTSUPP))
            }
            Tunable::RecvBuffer if value == 0 => o.recv_buffer = 0,
            Tunable::RecvBuffer if (1..=MAX_RECV_BUFFER as i64).contains(&value) => {
                o.recv_buffer = (value as u32).next_power_of_two().max(4096)
            }
            _ => return Err(out_of_range),
        }
        Ok(())
    }

    /// Reads a tunable.
    pub fn get(&self, t: Tunable) -> i64 {
        let o = lock(&self.0.options);
        match t {
            Tunable::SmallMax => o.small_max as i64,
            Tunable::InlineMax => o.inline_max as i64,
            Tunable::BusyPoll => engine::busy_poll() as i64,
            Tunable::CompletionCpu => engine::completion_cpu().map_or(-1, |c| c as i64),
            Tunable::RecvBuffer => o.recv_buffer as i64,
            Tunable::AdvCredits => o.adv_credits as i64,
        }
    }

    /// Whether two handles name the same socket.
    pub fn same(&self, other: &ExsSocket) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        match std::mem::replace(self.state.get_mut().unwrap_or_else(|p| p.into_inner()), State::Closed) {
            State::Connected(conn) => {
                let op = Op { req: 0, kind: EventKind::Close, target: None, hold: None };
                // Already closing or failed: nothing more to do.
                let _ = conn.start(op, |p, token| p.close(token));
            }
            State::Listening(l) => stop_listening(&l),
            _ => {}
        }
    }
}

fn qp_spec() -> QpSpec {
    QpSpec::with_depths(SEND_DEPTH, PIPE_RECEIVES)
}

/// The pipe every connection's control messages travel in (both ends must use the same): a
/// 32 KiB polled ring, room for frames of 8 KiB (the largest control message is 4.2 KiB).
const PIPE: FlowStrategy = FlowStrategy::POLLED;

/// A connection's memory before the handshake: the stream buffer, if any.
struct Prepared {
    ring: Option<MemoryRegion>,
}

/// A connection's memory and the handshake data that describes it.
fn prepare(kind: SocketKind, o: &Options) -> ExsResult<(Prepared, Hello)> {
    let rt = runtime().map_err(ExsError::io)?;
    let ring = match kind {
        SocketKind::Stream if o.recv_buffer > 0 => {
            Some(rt.pd.alloc(o.recv_buffer as usize, AccessFlags::ALL).map_err(ExsError::verbs)?)
        }
        _ => None,
    };
    let hello = Hello {
        kind,
        msg_credits: CONTROL_CREDITS,
        small_max: o.small_max,
        ring_addr: ring.as_ref().map_or(0, |r| r.addr()),
        ring_len: ring.as_ref().map_or(0, |r| r.len() as u32),
        ring_rkey: ring.as_ref().map_or(0, |r| r.rkey()),
    };
    Ok((Prepared { ring }, hello))
}

/// Checks the peer's handshake, sets up the connection's pipe (an exchange with the peer of
/// at most `timeout`) and starts the connection's driver.
fn establish(c: Connection, p: Prepared, ours: &Hello, o: &Options, timeout: Duration) -> ExsResult<Arc<Conn>> {
    let peer =
        Hello::decode(&c.peer_private).map_err(|e| ExsError::System(format!("peer's handshake: {e}"), libc::EPROTO))?;
    if peer.kind != ours.kind {
        return Err(ExsError::state("the peer's socket is of another type", libc::EPROTOTYPE));
    }
    let rt = runtime().map_err(ExsError::io)?;
    let pipe = MsgPipe::establish(c.qp, c.cq, &rt.pd, PIPE, timeout).map_err(ExsError::verbs)?;
    let conn = Arc::new(Conn::new(pipe, p.ring, ours, peer, o.adv_credits, o.inline_max)?);
    engine::register(conn.clone());
    Ok(conn)
}

fn stop_listening(l: &Listening) {
    l.stop.store(true, Ordering::Release);
    let mut q = lock(&l.queue);
    q.ready.clear();
    for (req, queue, socket) in q.waiting.drain(..) {
        queue.deliver(accept_event(req, socket, Err(libc::ECANCELED)));
    }
}

fn accept_loop(listener: cm::Listener, l: Arc<Listening>, kind: SocketKind, o: Options) {
    let mut prepared = None;
    while !l.stop.load(Ordering::Acquire) {
        {
            let q = lock(&l.queue);
            if q.ready.len() >= q.backlog || q.setting_up >= MAX_SETTING_UP {
                drop(q);
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
        }
        let (mem, hello) = match prepared.take() {
            Some(p) => p,
            None => match prepare(kind, &o) {
                Ok(p) => p,
                Err(e) => {
                    log::warn!("EXS listener on {}: {e}", l.local);
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
            },
        };
        let Ok(rt) = runtime() else { return };
        let c = match listener.accept(&rt.pd, &qp_spec(), &hello.encode(), Duration::from_millis(50)) {
            Ok(c) => c,
            Err(portability_verbs::VerbsError::Timeout(_)) => {
                prepared = Some((mem, hello));
                continue;
            }
            Err(e) => {
                log::debug!("EXS listener on {}: {e}", l.local);
                prepared = Some((mem, hello));
                continue;
            }
        };
        // The pipe's set-up is an exchange with the client: on a thread of its own, so that a
        // client that connects and then says nothing holds up only itself.
        lock(&l.queue).setting_up += 1;
        let (l2, o2) = (l.clone(), o);
        let spawned = portability_verbs::os::spawn_quiet("exs-accepted", move || {
            let conn = establish(c, mem, &hello, &o2, PIPE_SETUP_TIMEOUT);
            offer_accepted(&l2, kind, o2, conn);
        });
        if let Err(e) = spawned {
            log::warn!("EXS listener on {}: refused a client: {e}", l.local);
            lock(&l.queue).setting_up -= 1;
        }
    }
}

/// The event of an `accept` on `listening`: the connection, or the error number.
fn accept_event(req: u64, listening: ExsSocket, accepted: Result<ExsSocket, i32>) -> Event {
    let (outcome, accepted) = match accepted {
        Ok(s) => (Ok(0), Some(s)),
        Err(errno) => (Err(errno), None),
    };
    Event { req, kind: EventKind::Accept, socket: listening, outcome, truncated: false, accepted }
}

/// Hands a connection whose set-up ended to a waiting `accept`, or queues it for the next.
fn offer_accepted(l: &Listening, kind: SocketKind, o: Options, conn: ExsResult<Arc<Conn>>) {
    let mut q = lock(&l.queue);
    q.setting_up -= 1;
    let conn = match conn {
        Ok(c) => c,
        Err(e) => {
            log::debug!("EXS listener on {}: refused a client: {e}", l.local);
            return;
        }
    };
    let socket = ExsSocket::with(kind, o, State::Connected(conn));
    if l.stop.load(Ordering::Acquire) {
        // Nobody will accept it: dropped, it closes.
        drop(q);
        return;
    }
    match q.waiting.pop_front() {
        Some((req, queue, listening)) => {
            drop(q);
            queue.deliver(accept_event(req, listening, Ok(socket)));
        }
        None => q.ready.push_back(socket),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// A client that completes the connection handshake and then never sets up its pipe holds
    /// up only itself: another client connects and is accepted meanwhile.
    #[test]
    fn a_silent_client_does_not_hold_up_other_accepts() {
        let q = EventQueue::new(8).unwrap();
        let l = ExsSocket::new(SocketKind::SeqPacket).unwrap();
        l.bind("127.0.0.1:0").unwrap();
        l.listen(4).unwrap();
        let addr = l.local_addr().unwrap();
        // The silent client: a valid handshake, then nothing.
        let (_mem, hello) = prepare(SocketKind::SeqPacket, &Options::default()).unwrap();
        let rt = runtime().unwrap();
        let silent = cm::connect(&CmAddr::Tcp(addr), &rt.pd, &qp_spec(), &hello.encode(), CONNECT_TIMEOUT).unwrap();
        let started = Instant::now();
        l.accept(&q, 1).unwrap();
        let c = ExsSocket::new(SocketKind::SeqPacket).unwrap();
        c.connect(addr, &q, 2).unwrap();
        let mut events = Vec::new();
        while events.len() < 2 && started.elapsed() < 4 * PIPE_SETUP_TIMEOUT {
            let want = 2 - events.len();
            q.dequeue_into(&mut events, want, Some(Duration::from_millis(100)));
        }
        let waited = started.elapsed();
        assert_eq!(events.len(), 2, "accept and connect did not both complete: {events:?}");
        assert!(events.iter().all(|e| e.outcome == Ok(0)), "{events:?}");
        assert!(
            waited < PIPE_SETUP_TIMEOUT / 2,
            "the second client waited {waited:?}, behind the silent one's set-up ({PIPE_SETUP_TIMEOUT:?})"
        );
        drop(silent);
    }
}
