//! Event queues: where asynchronous EXS operations report their completion.
//!
//! Every operation reserves its event's place when it starts, so a queue never overflows: an
//! operation that finds no room is refused at once ([`ExsError::QueueFull`]). A queue can be
//! waited on by [`EventQueue::dequeue`] (which also drives the connections' progress) or
//! through its descriptor, readable while events are queued.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use portability_verbs::sync::{SpinGuard, SpinLock};

use super::engine;
use super::error::{ExsError, ExsResult};
use super::proto::Outcome;

/// Which call an event completes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// `send`.
    Send,
    /// `recv`.
    Recv,
    /// `accept`: the event carries the new socket.
    Accept,
    /// `connect`.
    Connect,
    /// `close`.
    Close,
}

/// A completed operation, naming the socket `S` it ran on (the sockets are built on queues,
/// so the queue is generic over them instead of naming them: `exs::Event` is the one in use).
#[derive(Debug)]
pub struct Event<S> {
    /// The request id the operation was started with.
    pub req: u64,
    /// The call.
    pub kind: EventKind,
    /// The socket the operation ran on.
    pub socket: S,
    /// Bytes moved (a receive's 0 is the end of the peer's data; 0 for the others), or the
    /// error number.
    pub outcome: Outcome,
    /// SOCK_SEQPACKET receive: the message was longer than the buffer and was cut to it.
    pub truncated: bool,
    /// `accept`: the connected socket.
    pub accepted: Option<S>,
}

/// What [`EventQueue::status`] reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueStatus {
    /// Events the queue holds at most (queued and reserved together).
    pub capacity: usize,
    /// Events waiting to be dequeued.
    pub queued: usize,
    /// Operations in flight that will report here.
    pub pending: usize,
}

struct State<S> {
    events: VecDeque<Event<S>>,
    /// Events queued and places reserved, together (under the lock: a dequeue, which takes
    /// it anyway, then gives places back without an atomic read-modify-write of its own).
    used: usize,
    /// Threads asleep on `ready` (a notification is a system call: only made for them).
    sleepers: usize,
}

/// Where waits sleep. A sleeper takes `lock` before it releases the queue's state, so a
/// delivery that saw it counted in `sleepers` (under the state's lock) takes `lock` only once
/// the sleeper waits on `ready`, and its notification cannot be lost.
struct Sleep {
    lock: Mutex<()>,
    ready: Condvar,
}

struct Inner<S> {
    id: u64,
    /// Events queued: written under the lock only (plain stores, no read-modify-write), read
    /// without it.
    queued: AtomicUsize,
    capacity: AtomicUsize,
    /// A spin lock, not a `Mutex`: held for a few instructions by reservations, deliveries
    /// and dequeues (and an eventfd write, once the descriptor is in use), and its release
    /// is a plain store, where a `Mutex`'s is a full barrier.
    state: SpinLock<State<S>>,
    sleep: Sleep,
    /// Readable while events are queued, once the application asked for it (keeping it
    /// costs two system calls per event, which a queue nobody polls need not pay).
    efd: OwnedFd,
    fd_used: AtomicBool,
}

/// An event queue (`exs_qhandle_t`) of events naming sockets `S` (`exs::EventQueue` is the one
/// in use). Clones share the queue.
pub struct EventQueue<S>(Arc<Inner<S>>);

impl<S> Clone for EventQueue<S> {
    fn clone(&self) -> Self {
        EventQueue(self.0.clone())
    }
}

impl<S> std::fmt::Debug for EventQueue<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EventQueue({})", self.0.id)
    }
}

/// The largest capacity a queue may have.
pub const MAX_CAPACITY: usize = 1 << 20;

impl<S> EventQueue<S> {
    /// A queue holding at most `capacity` events (1 ..= [`MAX_CAPACITY`]).
    pub fn new(capacity: usize) -> ExsResult<EventQueue<S>> {
        if capacity == 0 || capacity > MAX_CAPACITY {
            return Err(ExsError::Invalid("event queue capacity"));
        }
        engine::start()?;
        let efd = portability_verbs::os::eventfd().map_err(ExsError::verbs)?;
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Ok(EventQueue(Arc::new(Inner {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            queued: AtomicUsize::new(0),
            capacity: AtomicUsize::new(capacity),
            state: SpinLock::new(State { events: VecDeque::new(), used: 0, sleepers: 0 }),
            sleep: Sleep { lock: Mutex::new(()), ready: Condvar::new() },
            efd,
            fd_used: AtomicBool::new(false),
        })))
    }

    fn lock(&self) -> SpinGuard<'_, State<S>> {
        self.0.state.lock()
    }

    /// Reserves the place of one operation's event.
    pub(crate) fn reserve(&self) -> ExsResult<()> {
        let mut s = self.lock();
        if s.used >= self.0.capacity.load(Ordering::Acquire) {
            return Err(ExsError::QueueFull);
        }
        s.used += 1;
        Ok(())
    }

    /// Gives back a reservation whose operation never started.
    pub(crate) fn unreserve(&self) {
        self.lock().used -= 1;
    }

    /// Queues the event of an operation that reserved its place.
    pub(crate) fn deliver(&self, ev: Event<S>) {
        let mut s = self.lock();
        let was_empty = s.events.is_empty();
        s.events.push_back(ev);
        self.0.queued.store(s.events.len(), Ordering::Release);
        if was_empty {
            self.signal(true);
        }
        let sleepers = s.sleepers;
        drop(s);
        if sleepers > 0 {
            // Taken once each sleeper counted waits (see `Sleep`).
            drop(self.0.sleep.lock.lock().unwrap_or_else(|p| p.into_inner()));
            self.0.sleep.ready.notify_all();
        }
    }

    /// Sets (`true`) or clears the descriptor's readability.
    fn signal(&self, on: bool) {
        if !self.0.fd_used.load(Ordering::Acquire) {
            return;
        }
        let fd = self.0.efd.as_raw_fd();
        if on {
            portability_verbs::os::eventfd_signal(fd);
        } else {
            portability_verbs::os::eventfd_drain(fd);
        }
    }

    /// Takes up to `max` events, waiting up to `timeout` (`None`: as long as it takes) for the
    /// first. Returns an empty vector when the time ran out. Waiting drives the connections'
    /// progress: by polling (busy polling, the default) or by sleeping until the completion
    /// thread queues an event ([`super::Tunable::BusyPoll`]).
    pub fn dequeue(&self, max: usize, timeout: Option<Duration>) -> Vec<Event<S>> {
        let mut out = Vec::new();
        self.dequeue_into(&mut out, max, timeout);
        out
    }

    /// [`EventQueue::dequeue`] into `out` (appended); returns how many were taken.
    pub fn dequeue_into(&self, out: &mut Vec<Event<S>>, max: usize, timeout: Option<Duration>) -> usize {
        // The clock is read only once waiting starts.
        let mut deadline = None;
        // Beats as a poller once it polls (a call that finds events at once does not).
        let mut polling = false;
        let mut idle_since = None;
        // Polls so far, and idle polls since the last that found work.
        let (mut polls, mut spins) = (0u32, 0u32);
        loop {
            if self.0.queued.load(Ordering::Acquire) > 0 && max > 0 {
                let mut s = self.lock();
                let n = max.min(s.events.len());
                // One by one: nearly always one or two, where a drain's set-up costs more.
                for _ in 0..n {
                    out.extend(s.events.pop_front());
                }
                self.0.queued.store(s.events.len(), Ordering::Release);
                s.used -= n;
                if s.events.is_empty() {
                    self.signal(false);
                }
                return n;
            }
            if max == 0 {
                return 0;
            }
            if !polling {
                polling = true;
                engine::poll_beat();
            }
            let progressed = engine::progress_all();
            // A caller that does not wait is answered after one poll.
            if !progressed && timeout == Some(Duration::ZERO) {
                return 0;
            }
            // The clock is read every 64th poll, whatever the polls found (a wait whose
            // connections keep moving still ends at its timeout), and not on the first idle
            // one: a reading costs about as much as a poll, and a busy-polled exchange goes
            // idle a few times a message (idleness is then seen up to 64 polls, a few
            // microseconds, late).
            polls = polls.wrapping_add(1);
            spins = if progressed { 0 } else { spins + 1 };
            if polls % 64 != 0 {
                // Poll again at once, as Madeleine's waits do: a pause instruction (about 30
                // ns here, as long as an idle poll) would only delay seeing the event.
                continue;
            }
            engine::poll_beat();
            let now = Instant::now();
            let deadline = *deadline.get_or_insert_with(|| timeout.map(|t| now + t));
            if deadline.is_some_and(|d| now >= d) {
                return 0;
            }
            if progressed {
                idle_since = None;
                continue;
            }
            let idle = *idle_since.get_or_insert(now);
            if now - idle < engine::spin_before_sleep() {
                if portability_verbs::spin_yields(spins / 64) {
                    std::thread::yield_now();
                }
                continue;
            }
            // Nothing for a while: sleep until the completion thread (which takes over the
            // polling now, asleep on every queue pair's completion events) queues an event.
            polling = false;
            engine::hand_over();
            // The nap is reckoned before the lock is taken (a clock read is not for a spin lock).
            let nap = if engine::busy_poll() { Duration::from_millis(1) } else { Duration::from_millis(50) };
            let nap = deadline.map_or(nap, |d| nap.min(d.saturating_duration_since(Instant::now())));
            let mut s = self.lock();
            if s.events.is_empty() {
                s.sleepers += 1;
                let asleep = self.0.sleep.lock.lock().unwrap_or_else(|p| p.into_inner());
                drop(s);
                let woken = self.0.sleep.ready.wait_timeout(asleep, nap).unwrap_or_else(|p| p.into_inner());
                drop(woken);
                self.lock().sleepers -= 1;
            }
            (spins, idle_since) = (0, None);
        }
    }

    /// Capacity, queued events and operations in flight.
    pub fn status(&self) -> QueueStatus {
        let s = self.lock();
        let used = s.used;
        QueueStatus {
            capacity: self.0.capacity.load(Ordering::Acquire),
            queued: s.events.len(),
            pending: used - s.events.len(),
        }
    }

    /// Changes the capacity (not below what is queued and in flight).
    pub fn set_capacity(&self, capacity: usize) -> ExsResult<()> {
        if capacity == 0 || capacity > MAX_CAPACITY {
            return Err(ExsError::Invalid("event queue capacity"));
        }
        // Under the lock, as reservations are counted.
        let s = self.lock();
        if capacity < s.used {
            return Err(ExsError::Busy("the event queue"));
        }
        self.0.capacity.store(capacity, Ordering::Release);
        Ok(())
    }

    /// A descriptor readable while events are queued (for `poll`, `epoll`, an event loop).
    /// It is kept from the first call on.
    pub fn as_raw_fd(&self) -> RawFd {
        if !self.0.fd_used.swap(true, Ordering::AcqRel) {
            let s = self.lock();
            self.signal(!s.events.is_empty());
        }
        self.0.efd.as_raw_fd()
    }

    /// Whether nothing is queued or in flight (a queue may be deleted then).
    pub fn is_idle(&self) -> bool {
        let s = self.lock();
        s.events.is_empty() && s.used == 0
    }

    /// Whether two handles name the same queue.
    pub fn same(&self, other: &EventQueue<S>) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Lets go of this handle; if it was the last, returns the queue to drop later (its events
    /// may hold the last handle of a socket, whose drop closes the socket through its
    /// connection's lock: a connection reporting under that lock drops it once it let go).
    #[must_use]
    pub(crate) fn release(self) -> Option<LastHandle<S>> {
        Arc::into_inner(self.0).map(LastHandle)
    }
}

/// A queue whose last handle was released ([`EventQueue::release`]): dropping this drops it.
pub(crate) struct LastHandle<S>(#[allow(dead_code)] Inner<S>);
