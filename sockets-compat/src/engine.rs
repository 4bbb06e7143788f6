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
//! - **Quiet sockets**: every socket is visited while its application does not call into
//!   it, to take in the peer's control messages (a cancelled SrcAvail is answered, so the
//!   peer's write timeout leaves the connection usable) and to send what `shutdown` or
//!   `close` left for flow control to admit (Disconnect, Close): every [`QUIET_VISIT`], and
//!   less often, up to every [`QUIET_VISIT_MAX`], while its visits find nothing to do (a
//!   visit costs an idle socket's cache lines: hundreds of idle connections cost a server a
//!   few percent of a CPU at the shortest interval).
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
/// The longest interval between quiet visits, reached by doubling [`QUIET_VISIT`] after
/// each visit that found nothing to do (what a peer waiting on such a socket may wait more:
/// an answer to its SrcAvailCancel).
pub(crate) const QUIET_VISIT_MAX: Duration = Duration::from_millis(80);
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
    /// No transfer in flight, but control that flow control has not admitted yet (the
    /// Disconnect of a `shutdown`): looked at every [`QUIET_VISIT`].
    Pending,
    /// Transfers in flight, driven by the application's own calls (or a socket the engine
    /// found locked: its application is in a call).
    AppActive,
    /// Transfers in flight that the engine drives.
    Driven,
}

/// A socket the engine can drive.
pub(crate) trait Background: Send {
    /// Takes what has arrived and finishes what completed, unless the application drives the
    /// socket itself; says how soon the engine should come back. [`Visit::Idle`] lets the
    /// socket go from the watch: its next transfer puts it back ([`watch`]).
    fn background_progress(&mut self) -> Visit;
    /// A visit while the application is not calling into the socket: takes in control
    /// messages and sends what closing left pending.
    fn quiet_visit(&mut self) -> Quiet;
    /// Closes the socket as its last handle's drop would (the process is exiting).
    fn begin_close(&mut self);
}

/// What a quiet visit found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Quiet {
    /// A closed socket with nothing more to do (an orphan is then let go).
    Finished,
    /// Something to do: a message taken in, control sent or still to send, or the
    /// application calling into the socket. Visited again at the shortest interval.
    Stirring,
    /// Nothing to do: the next visit may come later.
    Still,
}

type Watched = Weak<Mutex<dyn Background>>;

/// An open socket and when it is visited next.
struct QuietEntry {
    socket: Watched,
    due: Instant,
    /// Visits in a row that found nothing to do.
    still: u32,
    /// Found closed: leaves the list.
    closed: bool,
}

/// The interval after `still` visits in a row that found nothing to do.
fn quiet_interval(still: u32) -> Duration {
    (QUIET_VISIT * (1 << still.min(8))).min(QUIET_VISIT_MAX)
}
type Orphan = Arc<Mutex<dyn Background>>;

#[derive(Default)]
struct Lists {
    /// Sockets with transfers in flight, visited often (`None`: let go of in a round,
    /// swept at the next).
    watched: Vec<Option<Watched>>,
    /// Every open socket, visited when quiet.
    open: Vec<QuietEntry>,
    /// Closed sockets still handing over their last bytes.
    orphans: Vec<Orphan>,
    /// A quiet visit made due sooner than the engine's schedule had it (a new socket's
    /// first): the engine looks then.
    quiet_sooner: Option<Instant>,
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

/// Makes a new socket known to the engine (visited while quiet, drained at exit). Once per
/// socket.
pub(crate) fn register(socket: &Arc<Mutex<dyn Background>>) {
    let due = Instant::now() + QUIET_VISIT;
    let mut l = lists();
    l.open.push(QuietEntry { socket: Arc::downgrade(socket), due, still: 0, closed: false });
    // The engine may be asleep until a later visit.
    l.quiet_sooner = Some(l.quiet_sooner.map_or(due, |t| t.min(due)));
    drop(l);
    protect::ring_bell();
}

/// Puts a socket with transfers in flight under the engine's watch, until a visit finds it
/// idle, and wakes the engine. The caller holds the socket's lock and knows it is not
/// watched now (the engine lets go of a socket under that lock).
pub(crate) fn watch(socket: &Arc<Mutex<dyn Background>>) {
    lists().watched.push(Some(Arc::downgrade(socket)));
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
            l.watched.retain(|w| w.as_ref().is_some_and(|w| w.strong_count() > 0));
            if let Some(t) = l.quiet_sooner.take() {
                next_quiet = next_quiet.min(t);
            }
            let quiet = Instant::now() >= next_quiet && !(l.open.is_empty() && l.orphans.is_empty());
            (l.watched.clone(), quiet)
        };
        let mut need = Visit::Idle;
        // (Indices of this round's snapshot stay valid in the list: only this thread removes
        // entries, in the sweep above.)
        for (i, w) in watched.into_iter().enumerate() {
            let Some(sock) = w.and_then(|w| w.upgrade()) else { continue };
            // A socket the application is using right now progresses on its own.
            let Ok(mut g) = sock.try_lock() else {
                need = need.max(Visit::AppActive);
                continue;
            };
            let visit = g.background_progress();
            if visit == Visit::Idle {
                // Let go of while its lock is held, so that a transfer it starts next finds it
                // gone and puts it back (visiting every idle socket that ever had a transfer
                // on every round cost a server with many connections its CPU).
                e.lists.lock().unwrap_or_else(|p| p.into_inner()).watched[i] = None;
            }
            need = need.max(visit);
        }
        let busy = need != Visit::Idle;
        if quiet {
            next_quiet = visit_quiet(e);
        }
        if busy {
            idle_rounds = 0;
            if protect::fault_waiters() > 0 {
                // A thread is stopped in a fault until these transfers end, and the peer may
                // need us to take its messages before it can finish them: no pause.
                std::thread::yield_now();
            } else {
                // Transfers in flight: look again soon, at once if someone starts waiting.
                let again = match need {
                    Visit::Driven => DRIVEN_VISIT,
                    Visit::AppActive => ACTIVE_VISIT,
                    _ => QUIET_VISIT,
                };
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

/// One quiet visit of every open socket that is due and of every orphan; lets go of finished
/// orphans. Returns when the next visit is due (the engine sleeps until then: an idle process
/// wakes a dozen times a second, not every [`QUIET_VISIT`]).
fn visit_quiet(e: &Engine) -> Instant {
    let now = Instant::now();
    // Sockets due within the shortest interval are visited now, a little early: their visits
    // fall in step, and the engine wakes once for them all rather than once for each.
    let horizon = now + QUIET_VISIT;
    // (Indices stay valid until the update below: only this thread removes entries.)
    let (due, orphans) = {
        let l = e.lists.lock().unwrap_or_else(|p| p.into_inner());
        let due: Vec<(usize, Watched)> =
            l.open.iter().enumerate().filter(|(_, q)| q.due <= horizon).map(|(i, q)| (i, q.socket.clone())).collect();
        (due, l.orphans.clone())
    };
    let mut found = Vec::with_capacity(due.len());
    for (i, w) in due {
        // A socket the application holds locked is in a call: it stirs. (`None`: closed.)
        let quiet = w.upgrade().map(|sock| sock.try_lock().map_or(Quiet::Stirring, |mut g| g.quiet_visit()));
        found.push((i, quiet));
    }
    let next = {
        // Closed sockets leave the list here, where they are found, rather than by a look at
        // every socket on every round (a cache miss each).
        let mut l = e.lists.lock().unwrap_or_else(|p| p.into_inner());
        let mut closed = 0;
        for (i, quiet) in found {
            let Some(q) = l.open.get_mut(i) else { continue };
            match quiet {
                Some(quiet) => {
                    q.still = if quiet == Quiet::Still { q.still.saturating_add(1) } else { 0 };
                    q.due = now + quiet_interval(q.still);
                }
                None => {
                    q.closed = true;
                    closed += 1;
                }
            }
        }
        if closed > 0 {
            l.open.retain(|q| !q.closed);
        }
        let soonest = l.open.iter().map(|q| q.due).min().unwrap_or(now + QUIET_VISIT_MAX);
        if l.orphans.is_empty() {
            soonest
        } else {
            soonest.min(now + QUIET_VISIT)
        }
    };
    let mut finished = Vec::new();
    for o in &orphans {
        if let Ok(mut g) = o.try_lock() {
            if g.quiet_visit() == Quiet::Finished {
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
    next
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
            (l.open.iter().map(|q| q.socket.clone()).collect::<Vec<_>>(), l.orphans.clone())
        };
        let (mut waiting, mut locked) = (false, false);
        for sock in open.iter().filter_map(Weak::upgrade).chain(orphans) {
            match sock.try_lock() {
                Ok(mut g) => {
                    g.begin_close();
                    waiting |= g.quiet_visit() != Quiet::Finished;
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    #[test]
    fn quiet_visits_thin_out_doubling_to_their_longest_interval() {
        let intervals: Vec<Duration> = (0..7).map(quiet_interval).collect();
        let ms = |n| Duration::from_millis(n);
        assert_eq!(intervals, [ms(5), ms(10), ms(20), ms(40), ms(80), ms(80), ms(80)]);
        assert_eq!(quiet_interval(u32::MAX), QUIET_VISIT_MAX);
    }

    /// A socket that answers its quiet visits with `answer`, counting them, and its watched
    /// visits with Driven for `driven` of them, then Idle.
    struct Stub {
        answer: Quiet,
        visits: Arc<AtomicU32>,
        driven: Arc<AtomicU32>,
    }

    impl Background for Stub {
        fn background_progress(&mut self) -> Visit {
            let left = self.driven.load(Ordering::Relaxed);
            if left == 0 {
                return Visit::Idle;
            }
            self.driven.store(left - 1, Ordering::Relaxed);
            Visit::Driven
        }
        fn quiet_visit(&mut self) -> Quiet {
            self.visits.fetch_add(1, Ordering::Relaxed);
            self.answer
        }
        fn begin_close(&mut self) {}
    }

    /// An idle socket is visited less and less often; one with something to do keeps the
    /// shortest interval.
    #[test]
    fn the_engine_visits_a_still_socket_less_often_than_a_stirring_one() {
        start();
        let stub = |answer| {
            let visits = Arc::new(AtomicU32::new(0));
            let driven = Arc::new(AtomicU32::new(0));
            let s: Arc<Mutex<dyn Background>> = Arc::new(Mutex::new(Stub { answer, visits: visits.clone(), driven }));
            register(&s);
            (s, visits)
        };
        let (_still, still) = stub(Quiet::Still);
        let (_stirring, stirring) = stub(Quiet::Stirring);
        std::thread::sleep(Duration::from_secs(1));
        let (still, stirring) = (still.load(Ordering::Relaxed), stirring.load(Ordering::Relaxed));
        // In a second: 5 + 10 + 20 + 40 + 80 ms, then every 80 ms, about 15 visits at most.
        assert!((1..=20).contains(&still), "{still} visits of a still socket");
        assert!(stirring > still, "a stirring socket visited {stirring} times, a still one {still}");
    }

    /// A watched socket is driven while it says so, let go of once idle, and taken back by
    /// the next `watch`.
    #[test]
    fn a_watched_socket_is_let_go_of_when_idle_and_watched_again_later() {
        start();
        let driven = Arc::new(AtomicU32::new(3));
        let visits = Arc::new(AtomicU32::new(0));
        let s: Arc<Mutex<dyn Background>> =
            Arc::new(Mutex::new(Stub { answer: Quiet::Still, visits, driven: driven.clone() }));
        let wait_until_driven = || {
            let deadline = Instant::now() + Duration::from_secs(10);
            while driven.load(Ordering::Relaxed) > 0 {
                assert!(Instant::now() < deadline, "the watched socket was not driven");
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        watch(&s);
        wait_until_driven();
        std::thread::sleep(Duration::from_millis(50));
        // Let go of: a Driven answer now would never be asked for.
        driven.store(2, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(driven.load(Ordering::Relaxed), 2, "an idle socket stayed watched");
        let g = s.lock().unwrap();
        watch(&s);
        drop(g);
        wait_until_driven();
    }
}
