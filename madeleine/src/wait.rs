//! How Madeleine waits: inside a `may` coroutine it yields to the scheduler; on an OS thread it
//! spins for a while (waking a sleeping process costs tens of microseconds, a polled message a
//! fraction of one) and then naps, briefly, so a slow peer does not burn the CPU.
//!
//! The clock is read only every 64 polls: a wait that ends quickly (the common case, and the
//! one latency depends on) never pays for it.

use std::time::{Duration, Instant};

use crate::{MadError, Result};

/// Spin phase before napping, unless `MAD_SPIN_US` says otherwise.
const DEFAULT_SPIN: Duration = Duration::from_micros(200);
/// Polls between clock reads.
const CHECK_EVERY: u32 = 64;

/// One blocking wait.
pub(crate) struct Waiter {
    /// Set at the first clock read (after `CHECK_EVERY` polls).
    start: Option<Instant>,
    timeout: Duration,
    spin: Duration,
    what: &'static str,
    polls: u32,
    napping: bool,
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
    pub fn new(timeout: Duration, what: &'static str) -> Waiter {
        Waiter { start: None, timeout, spin: spin_time(), what, polls: 0, napping: false }
    }

    /// Called when a poll found nothing: yields, spins or naps; fails after the timeout.
    pub fn pause(&mut self) -> Result<()> {
        self.polls = self.polls.wrapping_add(1);
        if self.polls.is_multiple_of(CHECK_EVERY) {
            let now = Instant::now();
            let start = *self.start.get_or_insert(now);
            let waited = now - start;
            if waited > self.timeout {
                return Err(MadError::Timeout(format!("{} ({:?})", self.what, self.timeout)));
            }
            self.napping = waited > self.spin;
        }
        if may::coroutine::is_coroutine() {
            // Yielding alone can starve coroutines queued behind two waiters that keep yielding
            // to each other: after a few rounds, sleep (which parks this coroutine, not the
            // worker thread).
            if self.polls < 16 {
                may::coroutine::yield_now();
            } else {
                may::coroutine::sleep(Duration::from_micros(20));
            }
        } else if self.napping {
            std::thread::sleep(Duration::from_micros(20));
        } else {
            std::hint::spin_loop();
        }
        Ok(())
    }
}
