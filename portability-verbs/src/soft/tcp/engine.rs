//! The transport's progress thread, one per process: it accepts the connections peers open to
//! our queue pairs, and drives every connection whose socket has something for it, so that a
//! responder answers (places writes, serves reads and atomics, takes sends into receives)
//! without its application calling in, as a NIC does. Asleep in epoll while nothing happens;
//! wakes on a coarse tick for keep-alives, liveness and retry timers.

use std::collections::HashMap;
use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::frame::{Frame, Kind, HEADER};
use crate::error::{Result, VerbsError};

/// What the engine drives: a queue pair reached over TCP (the queue pairs are built on this
/// transport, so the engine holds them through this trait instead of naming them).
pub(crate) trait Link: Send + Sync {
    /// Its socket has something for it (input, or room for waiting output).
    fn event(&self);
    /// The coarse tick: keep-alives, liveness, retry timers.
    fn tick(&self, now: Instant);
}

/// Takes a connection whose hello asked for a queue pair of this process.
pub(crate) type Acceptor = fn(TcpStream, &Frame);

const LISTENER: u64 = 0;
/// Tick while nothing is urgent (keep-alives and liveness need no finer).
const TICK: Duration = Duration::from_millis(50);
/// Tick while a retry timer runs (receiver-not-ready timers start at 10 us).
const URGENT_TICK: Duration = Duration::from_millis(1);
/// Tick while application threads poll some connection's input: how soon the engine takes the
/// input back once they stop without saying so (a thread that sleeps hands it back at once).
/// Finer costs a wake-up a millisecond per process for as long as a program polls, and each
/// one counts as a runnable thread in the waiting policy's census (`crate::cores`): between two
/// namespace hosts on two vCPUs it made Madeleine's waits yield, its 8 B p99 17-19 us.
const POLLED_TICK: Duration = Duration::from_millis(10);
/// A peer that connected must say which queue pair it wants within this long.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections at most waiting for their hello.
const MAX_HELLOS: usize = 1024;

/// The process's transport engine.
pub(crate) struct Engine {
    /// Where peers connect.
    pub addr: SocketAddr,
    epoll: OwnedFd,
    links: Mutex<HashMap<u64, Weak<dyn Link>>>,
    accept: Acceptor,
    next_token: AtomicU64,
    /// Queue pairs with a retry timer running: the tick is fine-grained while non-zero.
    urgent: AtomicUsize,
    /// Connections whose input application threads poll (the tick then looks for the ones
    /// they stopped polling).
    polled: AtomicUsize,
}

static ENGINE: OnceLock<std::result::Result<&'static Engine, String>> = OnceLock::new();

/// The engine, started on first use (binding `addr`: `PV_SOFT_TCP_ADDR`, else every IPv4
/// interface on a port the kernel picks; handing greeted connections to `accept`).
pub(crate) fn engine(addr: Option<SocketAddr>, accept: Acceptor) -> Result<&'static Engine> {
    ENGINE
        .get_or_init(|| {
            start(addr.unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0))), accept).map_err(|e| e.to_string())
        })
        .as_ref()
        .copied()
        .map_err(|e| VerbsError::PeerUnreachable(format!("the TCP transport could not start: {e}")))
}

fn start(addr: SocketAddr, accept: Acceptor) -> Result<&'static Engine> {
    let listener = TcpListener::bind(addr).map_err(|e| VerbsError::PeerUnreachable(format!("bind {addr}: {e}")))?;
    listener.set_nonblocking(true).map_err(|e| VerbsError::PeerUnreachable(format!("listener: {e}")))?;
    let addr = listener.local_addr().map_err(|e| VerbsError::PeerUnreachable(e.to_string()))?;
    let epoll = crate::os::epoll_create()?;
    ctl(epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, listener.as_raw_fd(), libc::EPOLLIN as u32, LISTENER)?;
    let engine: &'static Engine = Box::leak(Box::new(Engine {
        addr,
        epoll,
        links: Mutex::new(HashMap::new()),
        accept,
        next_token: AtomicU64::new(1),
        urgent: AtomicUsize::new(0),
        polled: AtomicUsize::new(0),
    }));
    crate::os::spawn_quiet("pv-tcp", move || engine.run(listener))
        .map_err(|e| VerbsError::Exhausted(format!("cannot start the TCP progress thread: {e}")))?;
    log::debug!("TCP transport listening on {addr}");
    Ok(engine)
}

fn ctl(epfd: RawFd, op: i32, fd: RawFd, events: u32, token: u64) -> Result<()> {
    let mut ev = libc::epoll_event { events, u64: token };
    // SAFETY: `ev` is a valid epoll_event; both descriptors are open.
    if unsafe { libc::epoll_ctl(epfd, op, fd, &mut ev) } < 0 {
        return Err(VerbsError::last_os("epoll_ctl"));
    }
    Ok(())
}

/// A connection waiting for its hello.
struct Greeting {
    stream: TcpStream,
    got: Vec<u8>,
    since: Instant,
}

impl Engine {
    /// Watches `sock` for `qp` (edge-triggered: whoever is woken reads until the socket is
    /// empty). Returns the token that `unregister` takes.
    pub fn register(&self, sock: &TcpStream, qp: Weak<dyn Link>) -> Result<u64> {
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        self.links.lock().expect("engine links").insert(token, qp);
        let events = (libc::EPOLLIN | libc::EPOLLRDHUP | libc::EPOLLET) as u32;
        if let Err(e) = ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, sock.as_raw_fd(), events, token) {
            self.links.lock().expect("engine links").remove(&token);
            return Err(e);
        }
        Ok(token)
    }

    /// What wakes the engine for `sock`: its input (`false` while an application thread polls
    /// it: waking a second thread for what the poller reads itself costs a context switch per
    /// message), its writability (only while bytes wait for room: every acknowledgement of
    /// the kernel's would wake it otherwise). Re-arming reports what is there already.
    pub fn watch(&self, sock: &TcpStream, token: u64, input: bool, output: bool) {
        let mut events = libc::EPOLLET as u32;
        if input {
            events |= (libc::EPOLLIN | libc::EPOLLRDHUP) as u32;
        }
        if output {
            events |= libc::EPOLLOUT as u32;
        }
        if let Err(e) = ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_MOD, sock.as_raw_fd(), events, token) {
            log::warn!("TCP transport: cannot change what wakes the engine: {e}");
        }
    }

    pub fn unregister(&self, sock: &TcpStream, token: u64) {
        crate::os::epoll_del(self.epoll.as_raw_fd(), sock.as_raw_fd());
        self.links.lock().expect("engine links").remove(&token);
    }

    /// A queue pair's retry timer started (`true`) or stopped.
    pub fn urgent(&self, on: bool) {
        count(&self.urgent, on);
    }

    /// Application threads took a connection's input (`true`), or gave it back.
    pub fn polled(&self, on: bool) {
        count(&self.polled, on);
    }

    fn link(&self, token: u64) -> Option<Arc<dyn Link>> {
        self.links.lock().expect("engine links").get(&token).and_then(Weak::upgrade)
    }

    fn run(&self, listener: TcpListener) {
        let mut greetings: HashMap<u64, Greeting> = HashMap::new();
        let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 256];
        let mut last_tick = Instant::now();
        loop {
            let tick = if self.urgent.load(Ordering::Relaxed) > 0 {
                URGENT_TICK
            } else if self.polled.load(Ordering::Relaxed) > 0 {
                POLLED_TICK
            } else {
                TICK
            };
            let wait = tick.saturating_sub(last_tick.elapsed());
            // SAFETY: `events` is writable for its length.
            let n = unsafe {
                libc::epoll_wait(
                    self.epoll.as_raw_fd(),
                    events.as_mut_ptr(),
                    events.len() as i32,
                    wait.as_millis().max(if wait.is_zero() { 0 } else { 1 }) as i32,
                )
            };
            for ev in &events[..n.max(0) as usize] {
                let token = ev.u64;
                if token == LISTENER {
                    self.accept_all(&listener, &mut greetings);
                } else if let Some(g) = greetings.get_mut(&token) {
                    match read_hello(g) {
                        Ok(None) => {}
                        Ok(Some(hello)) => {
                            let g = greetings.remove(&token).expect("greeting present");
                            crate::os::epoll_del(self.epoll.as_raw_fd(), g.stream.as_raw_fd());
                            (self.accept)(g.stream, &hello);
                        }
                        Err(e) => {
                            log::debug!("dropping a TCP transport connection: {e}");
                            greetings.remove(&token);
                        }
                    }
                } else if let Some(link) = self.link(token) {
                    link.event();
                }
            }
            if last_tick.elapsed() >= tick {
                last_tick = Instant::now();
                let links: Vec<_> =
                    self.links.lock().expect("engine links").values().filter_map(Weak::upgrade).collect();
                for link in links {
                    link.tick(last_tick);
                }
                greetings.retain(|_, g| g.since.elapsed() < HELLO_TIMEOUT);
            }
        }
    }

    fn accept_all(&self, listener: &TcpListener, greetings: &mut HashMap<u64, Greeting>) {
        loop {
            match listener.accept() {
                Ok((stream, from)) => {
                    if greetings.len() >= MAX_HELLOS || stream.set_nonblocking(true).is_err() {
                        log::warn!("refusing a TCP transport connection from {from}: too many waiting for their hello");
                        continue;
                    }
                    let token = self.next_token.fetch_add(1, Ordering::Relaxed);
                    let events = (libc::EPOLLIN | libc::EPOLLRDHUP) as u32;
                    if ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, stream.as_raw_fd(), events, token).is_ok() {
                        greetings
                            .insert(token, Greeting { stream, got: Vec::with_capacity(HEADER), since: Instant::now() });
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // Out of descriptors and the like: back off rather than spin.
                    log::warn!("TCP transport accept: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    return;
                }
            }
        }
    }
}

/// Reads a connection's first frame; `Ok(None)` until all of it arrived.
fn read_hello(g: &mut Greeting) -> std::io::Result<Option<Frame>> {
    let mut buf = [0u8; HEADER];
    let want = HEADER - g.got.len();
    match g.stream.read(&mut buf[..want]) {
        Ok(0) => return Err(super::link::closed()),
        Ok(n) => g.got.extend_from_slice(&buf[..n]),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
        Err(e) => return Err(e),
    }
    if g.got.len() < HEADER {
        return Ok(None);
    }
    let f = Frame::decode(&g.got[..].try_into().expect("a header")).map_err(std::io::Error::other)?;
    if f.kind != Kind::Hello {
        return Err(std::io::Error::other(format!("first frame is a {:?}, not a hello", f.kind)));
    }
    Ok(Some(f))
}

fn count(c: &AtomicUsize, on: bool) {
    if on {
        c.fetch_add(1, Ordering::Relaxed);
    } else {
        c.fetch_sub(1, Ordering::Relaxed);
    }
}
