//! Readiness for event loops: a descriptor per socket that `poll`, `select`, `epoll` (and so
//! mio and tokio's `AsyncFd`) can wait on, as on a TCP socket's.
//!
//! The descriptor is an `eventfd` whose counter shows the socket's state: 0 writable only, 1
//! readable and writable, `u64::MAX - 1` readable only (an eventfd is readable above zero and
//! writable below that value). A socket neither readable nor writable shows writable: a write
//! then returns `WouldBlock` (a level-triggered loop waiting for writability alone spins until
//! room comes back); when room comes back the counter is pulsed, so that an edge-triggered loop
//! sees the edge. Every change writes the counter, so edge-triggered waiters see each one.
//!
//! Who keeps it current: the application's own calls (each shows the state it leaves behind,
//! when the lock is released), and, while the application waits elsewhere, the watcher thread
//! of this module, which takes in what arrived for the sockets and listeners whose descriptor
//! was asked for and sleeps on their completion queues (the peer is told we sleep, so its next
//! message raises a completion) or, while a socket cannot send, looks again every
//! [`SOON`] (room comes back as a plain RDMA write, which raises nothing). A read that finds
//! nothing wakes it, so that it prepares for the wait that follows.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Weak;

use super::*;

/// The counter that shows "readable, not writable".
const READABLE_ONLY: u64 = u64::MAX - 1;
/// How soon the watcher looks again at a socket that cannot send, a listener with handshakes
/// under way, or one whose application held its lock.
const SOON: Duration = Duration::from_micros(100);
/// How long the watcher looks without sleeping after an application began to wait.
const EAGER: Duration = Duration::from_micros(200);
/// The watcher's longest sleep (a backstop: every awaited event wakes it).
const BACKSTOP: Duration = Duration::from_millis(50);

/// A socket's readiness descriptor and what it shows.
pub(super) struct Readiness {
    fd: OwnedFd,
    shown: (bool, bool),
    /// The descriptor was asked for: keep it current (else nobody looks at it).
    pub(super) active: bool,
}

impl Readiness {
    pub(super) fn new() -> io::Result<Readiness> {
        // SAFETY: eventfd has no memory arguments; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a new descriptor nothing else owns.
        Ok(Readiness { fd: unsafe { OwnedFd::from_raw_fd(fd) }, shown: (false, true), active: false })
    }

    pub(super) fn raw(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Shows `readable` and `writable` (system calls only on a change).
    pub(super) fn show(&mut self, readable: bool, writable: bool) {
        let want = (readable, writable);
        if want == self.shown {
            return;
        }
        let was = std::mem::replace(&mut self.shown, want);
        self.set(match want {
            (false, _) => 0,
            (true, true) => 1,
            (true, false) => READABLE_ONLY,
        });
        if want == (false, true) && was == (false, false) {
            // Shown writable all along (an eventfd cannot show neither): a pulse makes the edge
            // an edge-triggered waiter for room needs (a spurious EPOLLIN first, then EPOLLOUT as
            // the counter is read back to zero).
            self.set(1);
            self.set(0);
        }
    }

    /// Sets the counter to `value` (at most [`READABLE_ONLY`]).
    fn set(&self, value: u64) {
        let mut old = 0u64;
        // SAFETY: 8 bytes into a local; resets the counter (EAGAIN when it is 0 already).
        unsafe { libc::read(self.raw(), &mut old as *mut u64 as *mut libc::c_void, 8) };
        if value > 0 {
            // SAFETY: 8 bytes from a local; the counter is 0, so the value fits.
            unsafe { libc::write(self.raw(), &value as *const u64 as *const libc::c_void, 8) };
        }
    }
}

/// What a socket's state allows now, as [`SdpStream::poll_ready`] finds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadyState {
    /// A read returns at once (bytes, end of stream, or the failure it reports).
    pub readable: bool,
    /// A nonblocking write takes bytes now, or fails at once.
    pub writable: bool,
}

impl Conn {
    /// Takes in what arrived, without waiting: the peer's transfers complete, control
    /// messages at the front are applied. Failures are recorded in the socket and shown as
    /// readiness; its next call reports them.
    pub(super) fn take_in(&mut self) {
        if self.failed.is_none() && self.closing.is_none() {
            if let Err(e) = self.pipe.progress() {
                self.fail_verbs(e);
            } else {
                let _ = self.pump_control();
            }
        }
    }

    /// Whether a read would return at once: bytes queued or in the pipe, end of stream, a
    /// failure (reported by the read), or reading shut down. (A control message at the front
    /// of the pipe counts too: the read that takes it in then finds the truth.)
    pub(super) fn readable(&self) -> bool {
        self.read_shut
            || self.failed.is_some()
            || self.proto.eof()
            || !self.proto.rx().is_empty()
            || self.pipe.peek_lane().is_some()
    }

    /// Whether a nonblocking write would take bytes now, or fail at once. Where large writes
    /// are stored into the peer's bulk ring, that ring must have room for one of them too (a
    /// socket shown writable whose next write finds no room would make an event loop spin).
    pub(super) fn writable(&self) -> bool {
        let room = || {
            self.pipe.has_room()
                && (!self.pipe.bulk_copies()
                    || self.pipe.bulk_room() >= self.config.bulk_min.min(self.pipe.bulk_chunk_max()))
        };
        self.write_shut || self.failed.is_some() || self.proto.peer_closed() || room()
    }

    /// Shows the socket's state on its readiness descriptor, if one was asked for.
    #[inline]
    pub(super) fn show_ready(&mut self) {
        if self.ready.as_ref().is_some_and(|r| r.active) {
            if self.proto.rx().is_empty() && self.pipe.peek_lane().is_some() {
                // Control messages at the front (credits, acknowledgements) are taken in now,
                // so that only stream bytes show readable. A failure is recorded in the
                // socket, and shows readable: the next read reports it.
                let _ = self.pump_control();
            }
            let (r, w) = (self.readable(), self.writable());
            if let Some(ready) = self.ready.as_mut() {
                ready.show(r, w);
            }
        }
    }
}

/// A socket's lock, held for one of its calls: the state the call leaves is shown on the
/// readiness descriptor when it is released.
pub(super) struct Locked<'a>(pub(super) MutexGuard<'a, Conn>);

impl std::ops::Deref for Locked<'_> {
    type Target = Conn;
    fn deref(&self) -> &Conn {
        &self.0
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Conn {
        &mut self.0
    }
}

impl Drop for Locked<'_> {
    #[inline]
    fn drop(&mut self) {
        self.0.show_ready();
    }
}

/// What the watcher keeps current.
#[derive(Default)]
struct Watched {
    sockets: Vec<Weak<Mutex<Conn>>>,
    listeners: Vec<Weak<listener::Shared>>,
}

struct Watcher {
    watched: Mutex<Watched>,
    /// Written to wake the watcher for a new member.
    bell: OwnedFd,
}

static WATCHER_REF: OnceLock<Result<Watcher, String>> = OnceLock::new();

fn watcher() -> io::Result<&'static Watcher> {
    let w = WATCHER_REF.get_or_init(|| {
        let bell = Readiness::new().map_err(|e| e.to_string())?.fd;
        portability_verbs::os::spawn_quiet("sdp-ready", run).map_err(|e| e.to_string())?;
        Ok(Watcher { watched: Mutex::new(Watched::default()), bell })
    });
    w.as_ref().map_err(|e| io::Error::other(format!("starting the SDP readiness thread: {e}")))
}

fn ring(w: &Watcher) {
    let one = 1u64;
    // SAFETY: 8 bytes from a local into the bell eventfd.
    unsafe { libc::write(w.bell.as_raw_fd(), &one as *const u64 as *const libc::c_void, 8) };
}

/// Keeps `conn`'s readiness descriptor current from now on.
pub(super) fn watch_socket(conn: &Arc<Mutex<Conn>>) -> io::Result<()> {
    let w = watcher()?;
    w.watched.lock().unwrap_or_else(|p| p.into_inner()).sockets.push(Arc::downgrade(conn));
    ring(w);
    Ok(())
}

/// Keeps a listener's readiness descriptor current from now on.
pub(super) fn watch_listener(l: &Arc<listener::Shared>) -> io::Result<()> {
    let w = watcher()?;
    w.watched.lock().unwrap_or_else(|p| p.into_inner()).listeners.push(Arc::downgrade(l));
    ring(w);
    Ok(())
}

/// What one look at a socket found.
struct Look {
    /// Look again soon rather than sleeping on the queue.
    soon: bool,
    /// The queue to sleep on (armed), if the socket waits for an arrival.
    cq: Option<CompletionQueue>,
}

/// Takes in what arrived for a socket its application is not calling into, shows its state,
/// and, if nothing is there to read and the watcher is about to sleep long (`sleep`), prepares
/// to sleep on it. (Preparing tells the peer, whose next message then raises a wake-up that
/// takes one of our receives: only once per sleep.)
fn look_at_socket(conn: &Arc<Mutex<Conn>>, sleep: bool) -> Look {
    let Ok(mut c) = conn.try_lock() else {
        // The application is in a call: it shows the state when it leaves.
        return Look { soon: true, cq: None };
    };
    let calls = c.calls;
    if std::mem::replace(&mut c.calls_ready, calls) != calls {
        // The application called since the last look and drives the socket itself (taking
        // its lock here would only make it wait); a call that finds nothing wakes us.
        return Look { soon: true, cq: None };
    }
    c.take_in();
    c.show_ready();
    if c.failed.is_some() || c.ready.is_none() {
        return Look { soon: false, cq: None };
    }
    // Room to send comes back as a plain RDMA write (no completion), and requests of ours
    // still queued (acknowledgements of what we read) start only when this process drives the
    // queue pair: look again soon.
    let soon = !c.writable() || !c.pipe.idle();
    if c.readable() || !sleep {
        return Look { soon, cq: None };
    }
    // Told we sleep, the peer's next message raises a completion; something may have come
    // meanwhile (then look again at once).
    if !c.prepare_sleep() {
        return Look { soon: true, cq: None };
    }
    let cq = c.pipe.cq().clone();
    match cq.req_notify() {
        Ok(()) => Look { soon, cq: Some(cq) },
        Err(_) => Look { soon: true, cq: None },
    }
}

fn run() {
    // The thread starts before the static is set: wait for it.
    let w = loop {
        match watcher() {
            Ok(w) => break w,
            Err(_) => std::thread::sleep(Duration::from_millis(1)),
        }
    };
    let mut sleep_long = false;
    let mut last_poke: Option<Instant> = None;
    loop {
        let (sockets, listeners) = {
            let mut g = w.watched.lock().unwrap_or_else(|p| p.into_inner());
            g.sockets.retain(|s| s.strong_count() > 0);
            g.listeners.retain(|l| l.strong_count() > 0);
            (g.sockets.clone(), g.listeners.clone())
        };
        let mut fds = vec![libc::pollfd { fd: w.bell.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
        let mut cqs = Vec::new();
        let mut soon = false;
        for s in sockets.iter().filter_map(Weak::upgrade) {
            let look = look_at_socket(&s, sleep_long);
            soon |= look.soon;
            if let Some(cq) = look.cq {
                fds.push(libc::pollfd { fd: cq.event_fd(), events: libc::POLLIN, revents: 0 });
                cqs.push(cq);
            }
        }
        for l in listeners.iter().filter_map(Weak::upgrade) {
            let (again, fd) = l.background_accept();
            soon |= again;
            fds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
        }
        // A pass that finds nothing to do but sleep is followed by one that prepares each
        // socket for it (announcing the sleep to its peer), then the sleep.
        if !soon && !sleep_long && last_poke.is_none_or(|t| t.elapsed() >= EAGER) {
            sleep_long = true;
            continue;
        }
        // Just after an application found nothing and began to wait, the next message is
        // likely near: look without sleeping for a while (as a polling reader would).
        let eager = last_poke.is_some_and(|t: Instant| t.elapsed() < EAGER);
        let timeout = if eager {
            Duration::ZERO
        } else if soon {
            SOON
        } else {
            BACKSTOP
        };
        let ts = libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as _ };
        // SAFETY: `fds` is a valid array of pollfd and `ts` a valid timespec for the call.
        unsafe { libc::ppoll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, &ts, std::ptr::null()) };
        let mut drained = 0u64;
        // SAFETY: 8 bytes into a local; empties the bell (EAGAIN when it did not ring).
        if unsafe { libc::read(w.bell.as_raw_fd(), &mut drained as *mut u64 as *mut libc::c_void, 8) } == 8 {
            last_poke = Some(Instant::now());
        }
        if eager {
            std::thread::yield_now();
        }
        for (cq, fd) in cqs.iter().zip(&fds[1..]) {
            if fd.revents != 0 {
                cq.ack_event();
            }
        }
        sleep_long = false;
    }
}

/// Wakes the watcher to look at the sockets again at once (an application found nothing to
/// read and is about to wait for its descriptor: the watcher must be prepared for that socket).
pub(super) fn poke() {
    if let Some(Ok(w)) = WATCHER_REF.get().map(|w| w.as_ref()) {
        ring(w);
    }
}
