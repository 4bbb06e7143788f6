//! How Madeleine waits: inside a `may` coroutine it yields to the scheduler; on an OS thread it
//! spins for a while (waking a sleeping process costs tens of microseconds, a polled message a
//! fraction of one), then sleeps on the completion queues' descriptors where the awaited event
//! raises a completion (a message, bulk data, a read of ours), else naps briefly. Before it
//! sleeps it tells each connection's pipe (a polled pipe's peer then raises a completion for
//! its next message, which would otherwise raise none).
//!
//! The clock is read only every 64 polls while spinning: a wait that ends quickly (the common
//! case, and the one latency depends on) never pays for it.

use std::time::{Duration, Instant};

use portability_verbs::CompletionQueue;
use smallvec::SmallVec;

use crate::channel::Conn;
use crate::{MadError, Result};

/// Spin phase before sleeping, unless `MAD_SPIN_US` says otherwise.
const DEFAULT_SPIN: Duration = Duration::from_micros(200);
/// Polls between clock reads while spinning.
const CHECK_EVERY: u32 = 64;
/// Longest sleep on completion queues: bounds what a wake-up taken by another thread sleeping
/// on the same queue costs.
const SLEEP_SLICE: Duration = Duration::from_millis(2);
/// A nap where no completion announces the event (a peer's flow-control update is a plain
/// RDMA write).
const NAP: Duration = Duration::from_micros(20);

/// One blocking wait.
pub(crate) struct Waiter {
    /// Set at the first clock read.
    start: Option<Instant>,
    timeout: Duration,
    /// The spin phase, looked up at the first clock read (a wait that ends before it never
    /// pays for the lookup).
    spin: Duration,
    what: &'static str,
    polls: u32,
    sleeping: bool,
    /// Whether the wait runs in a coroutine, looked up at the first pause (a thread-local
    /// lookup a spinning waiter need not repeat on every poll).
    in_coroutine: Option<bool>,
}

fn spin_time() -> Duration {
    static SPIN: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *SPIN.get_or_init(|| {
        std::env::var("MAD_SPIN_US")
            .ok()
            .and_then(|v| v.parse().ok())
            .map(Duration::from_micros)
            .unwrap_or(DEFAULT_SPIN)
    })
}

impl Waiter {
    #[inline]
    pub fn new(timeout: Duration, what: &'static str) -> Waiter {
        Waiter { start: None, timeout, spin: Duration::ZERO, what, polls: 0, sleeping: false, in_coroutine: None }
    }

    /// Called when a poll found nothing and no completion will say when to look again:
    /// yields, spins or naps; fails after the timeout.
    pub fn pause(&mut self) -> Result<()> {
        self.pause_on(&[])
    }

    /// Called when a poll found nothing and the awaited event comes by one of `conns`: yields,
    /// spins, or (after the spin phase, on an OS thread) sleeps on their completion queues;
    /// fails after the timeout.
    pub fn pause_on(&mut self, conns: &[&Conn]) -> Result<()> {
        self.polls = self.polls.wrapping_add(1);
        let mut left = self.timeout;
        if self.sleeping || self.polls.is_multiple_of(CHECK_EVERY) {
            let now = Instant::now();
            if self.start.is_none() {
                self.spin = spin_time();
            }
            let waited = now - *self.start.get_or_insert(now);
            if waited > self.timeout {
                return Err(MadError::Timeout(format!("{} ({:?})", self.what, self.timeout)));
            }
            left = self.timeout - waited;
            self.sleeping = waited > self.spin;
        }
        if *self.in_coroutine.get_or_insert_with(may::coroutine::is_coroutine) {
            // Yielding alone can starve coroutines queued behind two waiters that keep yielding
            // to each other: after a few rounds, sleep (which parks this coroutine, not the
            // worker thread).
            if self.polls < 16 {
                may::coroutine::yield_now();
            } else {
                may::coroutine::sleep(NAP);
            }
        } else if !self.sleeping {
            // Spinning: poll again at once. A poll is a full trip through the transport's
            // queues; a pause instruction (about 25 ns here) would only delay seeing the event.
            // Past the first polls, other threads of this CPU get it now and then: with more
            // busy threads than CPUs, the one that would end this wait may be waiting for it.
            if portability_verbs::spin_yields(self.polls) {
                std::thread::yield_now();
            }
        } else if conns.is_empty() {
            std::thread::sleep(NAP);
        } else if conns.iter().all(|c| c.prepare_sleep()) {
            let cqs: SmallVec<[&CompletionQueue; 8]> = conns.iter().map(|c| c.cq()).collect();
            if let Err(e) = portability_verbs::wait_any(&cqs, left.min(SLEEP_SLICE)) {
                // The queues cannot be slept on (the caller's next poll reports a broken one).
                log::debug!("madeleine: cannot sleep on completion queues: {e}");
                std::thread::sleep(NAP);
            }
        }
        Ok(())
    }
}
