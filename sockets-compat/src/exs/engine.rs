//! The process's EXS progress: the live connections, the completion thread, and the
//! process-wide tunables (busy polling, the completion thread's CPU).
//!
//! Progress is made by whoever waits: a thread in [`super::EventQueue::dequeue`] polls every
//! connection's completion queue itself (busy polling) or, after polls lasting about a
//! wake-up's cost, sleeps on its queue while the completion thread, asleep on the
//! connections' completion events, turns completions into events (waiting for
//! notification). The completion thread also keeps connections moving while no thread waits
//! (advertisements, credits, stream-buffer acknowledgements).

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

use portability_verbs::CompletionQueue;

use super::error::{ExsError, ExsResult};

/// How long a busy-polling wait polls without progress before it sleeps (and leaves the
/// polling to the completion thread).
const SPIN_BEFORE_SLEEP: Duration = Duration::from_micros(500);
/// How long a wait for notification polls before it sleeps: about what a wake-up costs here
/// (10-30 us), so a wait that ends in a sleep costs at most twice what it needed. With a few
/// polls only, a ping-pong fell into sleeping at every message, each reply coming after its
/// peer's wake-ups (decision 019).
const NOTIFY_SPIN: Duration = Duration::from_micros(20);
/// How long the completion thread keeps polling after its last progress while busy polling
/// and no application thread waits.
const THREAD_SPIN: Duration = Duration::from_micros(200);
/// Refused sleeps in a row (with no progress between them) the completion thread answers by
/// looking again at once; after them it naps, longer each time up to [`LONGEST_NAP`].
const REFUSALS_BEFORE_NAP: u32 = 16;
/// The longest nap of a completion thread whose connections cannot sleep (its messages wait
/// for the peer's room, say): what a wait for notification may take longer then.
const LONGEST_NAP: Duration = Duration::from_micros(250);

static BUSY_POLL: AtomicBool = AtomicBool::new(true);
static CPU: AtomicI64 = AtomicI64::new(-1);
static CPU_CHANGED: AtomicBool = AtomicBool::new(false);
/// Beats of application threads polling in `dequeue` (one as a wait begins to poll, one
/// every 64 polls after), and waits that went to sleep handing the polling over.
static POLL_BEATS: AtomicU64 = AtomicU64::new(0);
static HANDOVERS: AtomicU64 = AtomicU64::new(0);
/// The completion thread stands back because application threads poll (set by the thread, and
/// by an application thread as it begins to poll: [`app_starts_driving`]).
static APP_DRIVES: AtomicBool = AtomicBool::new(false);
/// The completion thread sleeps on the connections' completion events and on [`waker`].
static ASLEEP: AtomicBool = AtomicBool::new(false);

/// Whether application threads drive progress now (they poll often enough that work left
/// for their next call goes out soon).
pub(crate) fn app_drives() -> bool {
    APP_DRIVES.load(Ordering::Relaxed)
}

/// What the engine progresses: a connection (the connections are built on the engine, so it
/// holds them through this trait instead of naming them).
pub(crate) trait Progress: Send + Sync {
    /// Takes its completions and acts on them; true if anything happened.
    fn progress(&self) -> bool;
    /// Done with every operation reported: dropped from the list.
    fn finished(&self) -> bool;
    /// Readies it for a sleep on its completion queue (its peer then raises a completion
    /// for what it sends); false if the sleep should not happen now.
    fn prepare_sleep(&self) -> bool;
    /// The completion queue the completion thread sleeps on.
    fn cq(&self) -> CompletionQueue;
}

type ConnList = Arc<Vec<Arc<dyn Progress>>>;

fn conns() -> &'static RwLock<ConnList> {
    static CONNS: OnceLock<RwLock<ConnList>> = OnceLock::new();
    CONNS.get_or_init(|| RwLock::new(Arc::new(Vec::new())))
}

/// Bumped whenever the list changes, so that pollers keep a copy of it and check one word
/// per poll instead of taking the lock.
static GENERATION: AtomicU64 = AtomicU64::new(1);

fn snapshot() -> ConnList {
    conns().read().unwrap_or_else(|p| p.into_inner()).clone()
}

thread_local! {
    static CACHED: std::cell::RefCell<(u64, ConnList)> = std::cell::RefCell::new((0, Arc::new(Vec::new())));
}

fn thread_handle() -> &'static Mutex<Option<Thread>> {
    static T: OnceLock<Mutex<Option<Thread>>> = OnceLock::new();
    T.get_or_init(|| Mutex::new(None))
}

/// Starts the completion thread (once per process; `exs_init`).
pub(crate) fn start() -> ExsResult<()> {
    static STARTED: OnceLock<Result<(), String>> = OnceLock::new();
    STARTED
        .get_or_init(|| {
            let t = portability_verbs::os::spawn_quiet("exs-completion", completion_thread)
                .map_err(|e| format!("starting the EXS completion thread: {e}"))?;
            *thread_handle().lock().unwrap_or_else(|p| p.into_inner()) = Some(t.thread().clone());
            Ok(())
        })
        .clone()
        .map_err(|e| ExsError::System(e, libc::EAGAIN))
}

/// Adds a connection to those progressed.
pub(crate) fn register(conn: Arc<dyn Progress>) {
    let mut list = conns().write().unwrap_or_else(|p| p.into_inner());
    let mut v = (**list).clone();
    v.push(conn);
    *list = Arc::new(v);
    GENERATION.fetch_add(1, Ordering::AcqRel);
    drop(list);
    wake();
}

fn unregister_finished() {
    let mut list = conns().write().unwrap_or_else(|p| p.into_inner());
    if list.iter().any(|c| c.finished()) {
        *list = Arc::new(list.iter().filter(|c| !c.finished()).cloned().collect());
        GENERATION.fetch_add(1, Ordering::AcqRel);
    }
}

/// A poller goes to sleep: the completion thread takes the polling over at once.
pub(crate) fn hand_over() {
    HANDOVERS.fetch_add(1, Ordering::Release);
    wake();
}

/// An eventfd in the completion thread's sleep, which ends it when written (`None` if the
/// system gave none: the sleep then ends at its timeout).
fn waker() -> Option<&'static OwnedFd> {
    static WAKER: OnceLock<Option<OwnedFd>> = OnceLock::new();
    WAKER
        .get_or_init(|| portability_verbs::os::eventfd().map_err(|e| log::warn!("EXS completion thread: {e}")).ok())
        .as_ref()
}

/// Wakes the completion thread.
pub(crate) fn wake() {
    if let Some(t) = thread_handle().lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
        t.unpark();
    }
}

/// Polls every connection once; true if any made progress.
pub(crate) fn progress_all() -> bool {
    let (any, finished) = CACHED.with(|cached| {
        let mut cached = cached.borrow_mut();
        let generation = GENERATION.load(Ordering::Acquire);
        if cached.0 != generation {
            *cached = (generation, snapshot());
        }
        let (mut any, mut finished) = (false, false);
        for c in cached.1.iter() {
            any |= c.progress();
            finished |= c.finished();
        }
        (any, finished)
    });
    #[cfg(test)]
    if any {
        tests::PROGRESS_MADE.fetch_add(1, Ordering::Relaxed);
    }
    if finished {
        unregister_finished();
    }
    any
}

/// Whether waits busy-poll (the default) or sleep until notified.
pub(crate) fn busy_poll() -> bool {
    BUSY_POLL.load(Ordering::Relaxed)
}

/// How long a wait polls without progress before it sleeps, by the waiting mode.
pub(crate) fn spin_before_sleep() -> Duration {
    if busy_poll() {
        SPIN_BEFORE_SLEEP
    } else {
        NOTIFY_SPIN
    }
}

/// Sets busy polling (process-wide).
pub(crate) fn set_busy_poll(on: bool) {
    BUSY_POLL.store(on, Ordering::Relaxed);
    wake();
}

/// The CPU the completion thread is pinned to, if any.
pub(crate) fn completion_cpu() -> Option<usize> {
    usize::try_from(CPU.load(Ordering::Relaxed)).ok()
}

/// Pins the completion thread to `cpu` (`None`: any CPU).
pub(crate) fn set_completion_cpu(cpu: Option<usize>) -> ExsResult<()> {
    if cpu.is_some_and(|c| c >= libc::CPU_SETSIZE as usize) {
        return Err(ExsError::Invalid("CPU number"));
    }
    CPU.store(cpu.map_or(-1, |c| c as i64), Ordering::Relaxed);
    CPU_CHANGED.store(true, Ordering::Release);
    wake();
    Ok(())
}

fn apply_cpu() {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET stays inside it (the CPU was
    // checked against CPU_SETSIZE); sched_setaffinity(0) applies to this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        match completion_cpu() {
            Some(c) => libc::CPU_SET(c, &mut set),
            None => {
                for c in 0..libc::CPU_SETSIZE as usize {
                    libc::CPU_SET(c, &mut set);
                }
            }
        }
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            log::warn!("EXS completion thread: pinning: {}", std::io::Error::last_os_error());
        }
    }
}

/// An application thread polls in `dequeue` (the completion thread stands back while beats
/// come). A plain store, not a read-modify-write (an atomic one costs a few nanoseconds on
/// every wait of a ping-pong): two threads racing may store the same value, and the next beat
/// changes it again, well within the completion thread's nap.
pub(crate) fn poll_beat() {
    POLL_BEATS.store(POLL_BEATS.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
    if !APP_DRIVES.load(Ordering::Relaxed) && busy_poll() {
        app_starts_driving();
    }
}

/// A busy-polling application thread begins to poll while the flag says nobody does: it
/// drives from now on (a receive's advertisement may wait for the call that follows, see
/// `Conn::start`), and a completion thread asleep on the queues is woken, so that it stands
/// back and, should the application stop calling, looks again within its nap. Left to the
/// completion thread alone, the flag waited for its next look: up to its 20 ms sleep, and
/// longer where pinned pollers kept every CPU busy. The first milliseconds of every burst
/// then sent a receive's advertisement apart from the reply that follows it (a ping-pong's
/// client: 13,000 of 33,000 turnarounds in `exs_pingpong`).
#[cold]
fn app_starts_driving() {
    // Sequentially consistent, as the completion thread's store of ASLEEP and load of
    // APP_DRIVES before it sleeps: one of the two sees the other's store.
    APP_DRIVES.store(true, Ordering::SeqCst);
    if ASLEEP.load(Ordering::SeqCst) {
        if let Some(fd) = waker() {
            portability_verbs::os::eventfd_signal(fd.as_raw_fd());
        }
    }
}

/// The nap after the `n`th refused sleep past [`REFUSALS_BEFORE_NAP`]: 10 us, doubling every
/// 8 refusals, at most [`LONGEST_NAP`].
fn refusal_nap(n: u32) -> Duration {
    (Duration::from_micros(10) * (1 << (n / 8).min(10))).min(LONGEST_NAP)
}

fn completion_thread() {
    let mut last_progress = Instant::now();
    let (mut seen_beats, mut seen_handovers) = (0, 0);
    let mut refused = 0u32;
    loop {
        if CPU_CHANGED.swap(false, Ordering::AcqRel) {
            apply_cpu();
        }
        let list = snapshot();
        if list.is_empty() {
            std::thread::park_timeout(Duration::from_millis(100));
            continue;
        }
        // Application threads poll if one beat since the last look (a polling wait beats every
        // 64 polls; a loop of calls at each call), unless one handed over.
        let (beats, handovers) = (POLL_BEATS.load(Ordering::Relaxed), HANDOVERS.load(Ordering::Acquire));
        let app_polls = busy_poll() && beats != seen_beats && handovers == seen_handovers;
        (seen_beats, seen_handovers) = (beats, handovers);
        if APP_DRIVES.load(Ordering::Relaxed) != app_polls {
            APP_DRIVES.store(app_polls, Ordering::Relaxed);
        }
        if app_polls {
            // An application thread polls: stand back, without arming the queues (arming
            // costs the software provider a barrier on every CPU). A poller that goes to
            // sleep wakes this thread; one that stops calling is noticed within the nap.
            std::thread::park_timeout(Duration::from_millis(5));
            continue;
        }
        if progress_all() {
            last_progress = Instant::now();
            refused = 0;
            continue;
        }
        if busy_poll() && last_progress.elapsed() < THREAD_SPIN {
            std::hint::spin_loop();
            continue;
        }
        // Asleep until a completion event, once every connection's peer knows to raise one.
        if !list.iter().all(|c| c.prepare_sleep()) {
            // A connection that cannot sleep now (something arrived, another thread drives
            // it, or its messages wait for room the peer has not freed): looked at again at
            // once a few times, then after naps, rather than spun on for as long as the peer
            // takes.
            refused = refused.saturating_add(1);
            if refused > REFUSALS_BEFORE_NAP {
                std::thread::park_timeout(refusal_nap(refused - REFUSALS_BEFORE_NAP));
            }
            continue;
        }
        refused = 0;
        ASLEEP.store(true, Ordering::SeqCst);
        if APP_DRIVES.load(Ordering::SeqCst) {
            // An application thread began to poll since the look above: stand back instead.
            ASLEEP.store(false, Ordering::Relaxed);
            continue;
        }
        let cqs: Vec<_> = list.iter().map(|c| c.cq()).collect();
        let refs: Vec<_> = cqs.iter().collect();
        let waker = waker().map(|fd| fd.as_raw_fd());
        if let Err(e) = portability_verbs::wait_any_or(&refs, waker, Duration::from_millis(20)) {
            log::debug!("EXS completion thread: waiting: {e}");
            std::thread::sleep(Duration::from_millis(1));
        }
        ASLEEP.store(false, Ordering::Relaxed);
        if waker.is_some_and(portability_verbs::os::eventfd_drain) {
            #[cfg(test)]
            tests::WOKEN_BY_APP.fetch_add(1, Ordering::Relaxed);
        }
        if progress_all() {
            last_progress = Instant::now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// Calls of [`progress_all`] in which some connection moved.
    pub(super) static PROGRESS_MADE: AtomicU64 = AtomicU64::new(0);
    /// Sleeps of the completion thread that [`app_starts_driving`] ended.
    pub(super) static WOKEN_BY_APP: AtomicU64 = AtomicU64::new(0);

    /// A connection that never moves: one with nothing to do whose peer knows to raise an
    /// event (`sleeps`: the completion thread sleeps on it), or one that never lets the
    /// thread sleep, as one whose messages wait for a peer that stopped reading.
    struct Stub {
        sleeps: bool,
        looks: AtomicU64,
        done: AtomicBool,
        cq: CompletionQueue,
    }

    impl Stub {
        fn registered(sleeps: bool) -> Arc<Stub> {
            start().unwrap();
            let cq = crate::verbs_runtime::runtime().unwrap().pd.context().create_cq(4).unwrap();
            let c = Arc::new(Stub { sleeps, looks: AtomicU64::new(0), done: AtomicBool::new(false), cq });
            register(c.clone());
            c
        }
    }

    impl Progress for Stub {
        fn progress(&self) -> bool {
            // The completion thread's looks (application threads of other tests poll too).
            if std::thread::current().name() == Some("exs-completion") {
                self.looks.fetch_add(1, Ordering::Relaxed);
            }
            false
        }
        fn finished(&self) -> bool {
            self.done.load(Ordering::Acquire)
        }
        fn prepare_sleep(&self) -> bool {
            self.sleeps
        }
        fn cq(&self) -> CompletionQueue {
            self.cq.clone()
        }
    }

    #[test]
    fn an_application_thread_that_begins_to_poll_drives_at_once_and_wakes_the_sleeping_thread() {
        let c = Stub::registered(true);
        // Tried while the thread sleeps and nothing drives (connections of tests running
        // beside this one may keep it awake for a while, or drive themselves).
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            assert!(Instant::now() < deadline, "never saw the completion thread asleep, or never woke it");
            if !(ASLEEP.load(Ordering::SeqCst) && !app_drives() && busy_poll()) {
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            let woken = WOKEN_BY_APP.load(Ordering::Relaxed);
            poll_beat();
            assert!(app_drives(), "a polling application thread drives from its first beat");
            // Woken well before its 20 ms sleep ends (it may have ended on its own just before
            // the beat: then the next try tells).
            let by = Instant::now() + Duration::from_millis(10);
            while WOKEN_BY_APP.load(Ordering::Relaxed) == woken && Instant::now() < by {
                std::thread::yield_now();
            }
            if WOKEN_BY_APP.load(Ordering::Relaxed) != woken {
                break;
            }
        }
        c.done.store(true, Ordering::Release);
        wake();
    }

    #[test]
    fn a_connection_that_cannot_sleep_is_looked_at_after_naps_not_spun_on() {
        let c = Stub::registered(false);
        // Judged over 300 ms in which no other connection (of tests running beside this one)
        // made progress: the thread spins for a while after any progress, looking at every
        // connection, as it should.
        let deadline = Instant::now() + Duration::from_secs(20);
        let looks = loop {
            std::thread::sleep(Duration::from_millis(50));
            let (before, made) = (c.looks.load(Ordering::Relaxed), PROGRESS_MADE.load(Ordering::Relaxed));
            std::thread::sleep(Duration::from_millis(300));
            if PROGRESS_MADE.load(Ordering::Relaxed) == made {
                break c.looks.load(Ordering::Relaxed) - before;
            }
            assert!(Instant::now() < deadline, "other connections never stayed quiet for 300 ms");
        };
        c.done.store(true, Ordering::Release);
        wake();
        // Napping up to 250 us between looks: a few thousand in 300 ms at most. Spinning, the
        // thread looked hundreds of thousands of times.
        assert!(looks < 30_000, "{looks} looks in 300 ms");
    }
}
