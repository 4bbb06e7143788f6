//! How Madeleine waits: inside a `may` coroutine it yields to the scheduler; on an OS thread it
//! polls while the thread has a CPU to itself (waking a sleeping process costs tens of
//! microseconds, a polled message a fraction of one) for up to 10 ms (a wake-up then costs
//! about 1% of the wait); while threads ready to run outnumber the CPUs
//! ([`portability_verbs::cores`]: more ranks or threads than cores) it sleeps after 1 ms. Past
//! its first polls a polling thread yields its CPU now and then, so that a thread with work
//! queued behind it runs. It sleeps on the completion queues' descriptors (where the
//! awaited event raises a completion: a message, bulk data, a read of ours; else it naps
//! briefly). Before it sleeps it tells
//! each connection's pipe (a polled pipe's peer then raises a completion for its next message,
//! which would otherwise raise none).
//!
//! That is the session's [`crate::Spin::Adaptive`], the default; [`crate::Spin::For`] spins for
//! a fixed time instead (zero sleeps at once, `Duration::MAX` never sleeps). The clock is read
//! only every 64 polls while spinning: a wait that ends quickly (the common case, and the one
//! latency depends on) never pays for it.

use std::time::{Duration, Instant};

use portability_verbs::wait::{Backoff, Pause};
use portability_verbs::CompletionQueue;
use smallvec::SmallVec;

use crate::{MadError, Result};

/// Longest sleep on completion queues: bounds what a wake-up taken by another thread sleeping
/// on the same queue costs.
const SLEEP_SLICE: Duration = Duration::from_millis(2);
/// A nap where no completion announces the event (a peer's flow-control update is a plain
/// RDMA write).
const NAP: Duration = Duration::from_micros(20);

/// How a blocking call on an OS thread waits for its event (the stack's one waiting policy).
pub use portability_verbs::wait::Spin;

/// How long a blocking call may wait, and how long it spins before it sleeps (from the
/// session's configuration).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Patience {
    pub timeout: Duration,
    pub spin: Spin,
}

/// What a sleeping wait sleeps on: a connection whose completion queue raises a completion
/// for the awaited event once [`Sleeper::prepare_sleep`] readied it (the connections are built
/// on this module, so it takes them through this trait).
pub(crate) trait Sleeper {
    /// Readies the connection for a sleep; false if it cannot be slept on now.
    fn prepare_sleep(&self) -> bool;
    /// The completion queue to sleep on.
    fn cq(&self) -> &CompletionQueue;
}

/// One blocking wait.
pub(crate) struct Waiter {
    timeout: Duration,
    spin: Spin,
    what: &'static str,
    /// When it yields and when it sleeps; made at the first pause (most waits of a busy
    /// connection end at their first poll, and pay nothing for it).
    backoff: Option<Backoff>,
    /// Whether the wait runs in a coroutine, looked up at the first pause (a thread-local
    /// lookup a spinning waiter need not repeat on every poll).
    in_coroutine: Option<bool>,
}

impl Waiter {
    #[inline]
    pub fn new(p: &Patience, what: &'static str) -> Waiter {
        Waiter { timeout: p.timeout, spin: p.spin, what, backoff: None, in_coroutine: None }
    }

    /// Whether the wait is past its spin phase.
    #[cfg(test)]
    fn sleeping(&self) -> bool {
        match &self.backoff {
            Some(b) => b.sleeping(),
            None => Backoff::new(self.spin).sleeping(),
        }
    }

    /// Called when a poll found nothing and no completion will say when to look again:
    /// yields, spins or naps; fails after the timeout.
    pub fn pause(&mut self) -> Result<()> {
        self.pause_on::<NoSleeper>(&[])
    }

    /// Called when a poll found nothing and the awaited event comes by one of `conns`: yields,
    /// spins, or (after the spin phase, on an OS thread) sleeps on their completion queues;
    /// fails after the timeout.
    pub fn pause_on<S: Sleeper>(&mut self, conns: &[&S]) -> Result<()> {
        let spin = self.spin;
        let backoff = self.backoff.get_or_insert_with(|| Backoff::new(spin));
        let step = backoff.pause(Instant::now);
        let polls = backoff.polls();
        let mut left = self.timeout;
        if let Some(waited) = step.waited {
            if waited > self.timeout {
                return Err(MadError::Timeout(format!("{} ({:?})", self.what, self.timeout)));
            }
            left = self.timeout - waited;
        }
        if *self.in_coroutine.get_or_insert_with(may::coroutine::is_coroutine) {
            // Yielding alone can starve coroutines queued behind two waiters that keep yielding
            // to each other: after a few rounds, sleep (which parks this coroutine, not the
            // worker thread).
            if polls < 16 {
                may::coroutine::yield_now();
            } else {
                may::coroutine::sleep(NAP);
            }
        } else if step.pause == Pause::Spin {
            // Poll again at once. A poll is a full trip through the transport's queues; a
            // pause instruction (about 25 ns here) would only delay seeing the event.
        } else if step.pause == Pause::Yield {
            // With more busy threads than CPUs, the one that would end this wait may be
            // waiting for this one.
            std::thread::yield_now();
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

/// The sleeper of a wait no completion announces (it naps instead).
enum NoSleeper {}

impl Sleeper for NoSleeper {
    fn prepare_sleep(&self) -> bool {
        match *self {}
    }
    fn cq(&self) -> &CompletionQueue {
        match *self {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiter(spin: Duration) -> Waiter {
        Waiter::new(&Patience { timeout: Duration::from_secs(10), spin: Spin::For(spin) }, "a test")
    }

    #[test]
    fn no_spin_phase_sleeps_from_the_first_pause() {
        let mut w = waiter(Duration::ZERO);
        assert!(w.sleeping());
        w.pause().unwrap();
        assert!(w.sleeping());
    }

    #[test]
    fn an_endless_spin_phase_never_sleeps_and_still_times_out() {
        let mut w = waiter(Duration::MAX);
        for _ in 0..640 {
            w.pause().unwrap();
        }
        assert!(!w.sleeping());
        let mut w =
            Waiter::new(&Patience { timeout: Duration::from_millis(20), spin: Spin::For(Duration::MAX) }, "a test");
        let t = Instant::now();
        let e = loop {
            if let Err(e) = w.pause() {
                break e;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "no timeout");
        };
        assert!(matches!(e, MadError::Timeout(_)), "{e}");
        assert!(!w.sleeping());
    }

    #[test]
    fn a_spin_phase_spins_then_sleeps() {
        let mut w = waiter(Duration::from_millis(5));
        for _ in 0..64 {
            w.pause().unwrap();
        }
        assert!(!w.sleeping(), "asleep before the spin phase ended");
        std::thread::sleep(Duration::from_millis(10));
        for _ in 0..64 {
            w.pause().unwrap();
        }
        assert!(w.sleeping(), "still spinning after the spin phase");
    }

    #[test]
    fn an_adaptive_wait_sleeps_soon_while_threads_ready_to_run_outnumber_the_cpus() {
        use portability_verbs::cores::Spinners;
        let cpus = Spinners::cpus();
        let spinners = Spinners::start(8 * cpus);
        let mut w = Waiter::new(&Patience { timeout: Duration::from_secs(10), spin: Spin::Adaptive }, "a test");
        let t = Instant::now();
        while !w.sleeping() && t.elapsed() < Duration::from_secs(5) {
            w.pause().unwrap();
        }
        drop(spinners);
        assert!(w.sleeping(), "still polling with {} threads spinning on {cpus} CPUs", 8 * cpus);
    }
}
