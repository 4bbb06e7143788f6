//! The background progress engine: what a kernel does for TCP sockets while their program is
//! busy elsewhere, done by one thread per process.
//!
//! - **Transfers in flight** (AZ-SDP): a `write` returns while the peer still reads the
//!   (protected) buffer, and a `read` returns before the data has landed. Something must notice
//!   the end of those transfers and release the buffers even when the application makes no
//!   further socket call — in particular when it is stopped in the fault handler, touching one
//!   of them. Sockets with transfers in flight are *watched*: visited every 200 us while the
//!   engine drives them, every [`ACTIVE_VISIT`] while their application does (it progresses
//!   them itself), at once when the fault handler rings the bell.
//! - **Quiet sockets**: every socket is visited every [`QUIET_VISIT`] while its application
//!   does not call into it, to take in the peer's control messages (a cancelled SrcAvail is
//!   answered, so the peer's write timeout leaves the connection usable) and to send what
//!   `shutdown` or `close` left for flow control to admit (Disconnect, Close).
//! - **Orphans**: a socket closed with bytes the peer has not taken yet stays here (as a TCP
//!   socket stays in the kernel after `close`) until the peer took them, closed, died, or
//!   [`ORPHAN_LINGER`] passed. At process exit they, and every socket still open, are given
//!   that long to finish ([`drain_at_exit`]), so bytes a program wrote before it exited arrive.
//!
//! The engine never blocks on a socket lock the application holds and never touches
//! application memory itself (the provider reaches held pages the way DMA does), so a thread
//! waiting in a fault can never be waiting for it to get past that fault.

use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use portability_verbs::protect;

/// How long a closed socket keeps trying to hand its last bytes to a live peer that does not
/// take them (Linux gives an orphaned TCP socket a comparable time before it resets it).
pub(crate) const ORPHAN_LINGER: Duration = Duration::from_secs(60);
/// How often a socket its application does not call into is visited.
pub(crate) const QUIET_VISIT: Duration = Duration::from_millis(5);
/// How often a socket with transfers in flight is visited while its application calls into
/// it (and so drives it): only to take over once the application stops. Waking every 200 us
/// instead cost a busy-polling program thousands of preemptions a second.
pub(crate) const ACTIVE_VISIT: Duration = Duration::from_millis(1);
/// How often a socket with transfers in flight is visited while the engine drives it.
const DRIVEN_VISIT: Duration = Duration::from_micros(200);

/// What a watched socket needs of the engine after a visit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Visit {
    /// No transfer in flight.
    Idle,
    /// Transfers in flight, driven by the application's own calls (or a socket the engine
    /// found locked: its application is in a call).
    AppActive,
    /// Transfers in flight that the engine drives.
    Driven,
}

/// A socket the engine can drive.
pub(crate) trait Background: Send {
    /// Takes what has arrived and finishes what completed, unless the application drives the
    /// socket itself; says how soon the engine should come back.
    fn background_progress(&mut self) -> Visit;
    /// A visit while the application is not calling into the socket: takes in control
    /// messages and sends what closing left pending. Returns `true` once a closed socket has
    /// nothing more to do (an orphan is then let go).
    fn quiet_visit(&mut self) -> bool;
    /// Closes the socket as its last handle's drop would (the process is exiting).
    fn begin_close(&mut self);
}

type Watched = Weak<Mutex<dyn Background>>;
type Orphan = Arc<Mutex<dyn Background>>;

#[derive(Default)]
struct Lists {
    /// Sockets with transfers in flight, visited often.
    watched: Vec<Watched>,
    /// Every open socket, visited when quiet.
    open: Vec<Watched>,
    /// Closed sockets still handing over their last bytes.
    orphans: Vec<Orphan>,
}

struct Engine {
    lists: Mutex<Lists>,
}

fn engine() -> &'static Engine {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let spawned = portability_verbs::os::spawn_quiet("sdp-progress", run);
        if let Err(e) = spawned {
            // Sockets still progress on their own calls; only waits in faults would depend on it.
            log::error!("cannot start the SDP progress thread: {e}");
        }
        // SAFETY: `at_exit` is an `extern "C" fn()` that never unwinds (it catches panics).
        if unsafe { libc::atexit(at_exit) } != 0 {
            log::warn!("SDP: cannot register the exit hook: bytes written just before exit may be lost");
        }
        Engine { lists: Mutex::new(Lists::default()) }
    })
}

fn lists() -> std::sync::MutexGuard<'static, Lists> {
    engine().lists.lock().unwrap_or_else(|p| p.into_inner())
}

fn add(list: &mut Vec<Watched>, socket: &Arc<Mutex<dyn Background>>) {
    let w = Arc::downgrade(socket);
    if !list.iter().any(|x| x.ptr_eq(&w)) {
        list.push(w);
    }
}

/// Makes a new socket known to the engine (visited while quiet, drained at exit).
pub(crate) fn register(socket: &Arc<Mutex<dyn Background>>) {
    add(&mut lists().open, socket);
}

/// Puts a socket with transfers in flight under the engine's watch (once per socket is
/// enough) and wakes the engine.
pub(crate) fn watch(socket: &Arc<Mutex<dyn Background>>) {
    add(&mut lists().watched, socket);
    protect::ring_bell();
}

/// Keeps a closed socket alive until it has handed over its last bytes.
pub(crate) fn orphan(socket: Orphan) {
    lists().orphans.push(socket);
    protect::ring_bell();
}

fn run() {
    let e = engine();
    let mut idle_rounds = 0u32;
    let mut next_quiet = Instant::now();
    loop {
        let bell = protect::fault_bell();
        let (watched, quiet) = {
            let mut l = e.lists.lock().unwrap_or_else(|p| p.into_inner());
            l.watched.retain(|w| w.strong_count() > 0);
            l.open.retain(|w| w.strong_count() > 0);
            let quiet = Instant::now() >= next_quiet && !(l.open.is_empty() && l.orphans.is_empty());
            (l.watched.clone(), quiet)
        };
        let mut need = Visit::Idle;
        for w in watched {
            let Some(sock) = w.upgrade() else { continue };
            // A socket the application is using right now progresses on its own.
            let Ok(mut g) = sock.try_lock() else {
                need = need.max(Visit::AppActive);
                continue;
            };
            need = need.max(g.background_progress());
        }
        let busy = need != Visit::Idle;
        if quiet {
            visit_quiet(e);
            next_quiet = Instant::now() + QUIET_VISIT;
        }
        if busy {
            idle_rounds = 0;
            if protect::fault_waiters() > 0 {
                // A thread is stopped in a fault until these transfers end, and the peer may
                // need us to take its messages before it can finish them: no pause.
                std::thread::yield_now();
            } else {
                // Transfers in flight: look again soon, at once if someone starts waiting.
                let again = if need == Visit::Driven { DRIVEN_VISIT } else { ACTIVE_VISIT };
                protect::wait_bell(bell, again);
            }
        } else {
            idle_rounds = idle_rounds.saturating_add(1);
            let has_sockets = {
                let l = e.lists.lock().unwrap_or_else(|p| p.into_inner());
                !(l.open.is_empty() && l.orphans.is_empty())
            };
            let nap = if has_sockets {
                next_quiet.saturating_duration_since(Instant::now()).max(Duration::from_micros(100))
            } else if idle_rounds < 100 {
                Duration::from_millis(1)
            } else {
                Duration::from_millis(100)
            };
            protect::wait_bell(bell, nap);
        }
    }
}

/// One quiet visit of every open socket and every orphan; lets go of finished orphans.
fn visit_quiet(e: &Engine) {
    let (open, orphans) = {
        let l = e.lists.lock().unwrap_or_else(|p| p.into_inner());
        (l.open.clone(), l.orphans.clone())
    };
    for sock in open.iter().filter_map(Weak::upgrade) {
        if let Ok(mut g) = sock.try_lock() {
            g.quiet_visit();
        };
    }
    let mut finished = Vec::new();
    for o in &orphans {
        if let Ok(mut g) = o.try_lock() {
            if g.quiet_visit() {
                finished.push(Arc::as_ptr(o) as *const () as usize);
            }
        }
    }
    if !finished.is_empty() {
        let gone: Vec<Orphan> = {
            let mut l = e.lists.lock().unwrap_or_else(|p| p.into_inner());
            let (gone, keep) =
                l.orphans.drain(..).partition(|o| finished.contains(&(Arc::as_ptr(o) as *const () as usize)));
            l.orphans = keep;
            gone
        };
        // Their teardown (outside the list's lock) releases their queue pairs.
        drop(gone);
    }
}

/// At process exit, every socket still open is closed and every orphan given until
/// [`ORPHAN_LINGER`] to hand over its last bytes, as the kernel would deliver a TCP socket's.
/// Sockets whose peers took everything end at once; the exit waits only for a live peer that
/// does not read.
pub(crate) fn drain_at_exit() {
    let Some(e) = ENGINE_READY.get().and(Some(engine())) else { return };
    let start = Instant::now();
    let mut last_progress = start;
    loop {
        let (open, orphans) = {
            let l = e.lists.lock().unwrap_or_else(|p| p.into_inner());
            (l.open.clone(), l.orphans.clone())
        };
        let (mut waiting, mut locked) = (false, false);
        for sock in open.iter().filter_map(Weak::upgrade).chain(orphans) {
            match sock.try_lock() {
                Ok(mut g) => {
                    g.begin_close();
                    waiting |= !g.quiet_visit();
                }
                Err(_) => locked = true,
            };
        }
        let now = Instant::now();
        if waiting {
            last_progress = now;
        }
        // A socket another thread keeps locked (in a call that may never return while the
        // process exits) is not waited for long.
        let stuck = locked && now.duration_since(last_progress) >= Duration::from_secs(1);
        if (!waiting && !locked) || stuck || now.duration_since(start) >= ORPHAN_LINGER {
            return;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Set once a socket used the engine (the exit hook has nothing to do otherwise).
static ENGINE_READY: OnceLock<()> = OnceLock::new();

/// Starts the engine (its thread and exit hook) for a new socket.
pub(crate) fn start() {
    engine();
    let _ = ENGINE_READY.set(());
}

extern "C" fn at_exit() {
    // Unwinding out of an exit hook would abort: a panic here only loses the drain.
    let _ = std::panic::catch_unwind(drain_at_exit);
}
