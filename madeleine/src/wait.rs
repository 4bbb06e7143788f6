//! How Madeleine waits: inside a `may` coroutine it yields to the scheduler; on an OS thread it
//! spins for a while (waking a sleeping process costs tens of microseconds, a polled message a
//! fraction of one) and then naps, briefly, so a slow peer does not burn the CPU.

use std::time::{Duration, Instant};

use crate::{MadError, Result};

/// Spin phase before napping, unless `MAD_SPIN_US` says otherwise.
const DEFAULT_SPIN: Duration = Duration::from_micros(200);

/// One blocking wait.
pub(crate) struct Waiter {
    start: Instant,
    deadline: Instant,
    spin: Duration,
    what: &'static str,
    polls: u32,
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
        let start = Instant::now();
        Waiter { start, deadline: start + timeout, spin: spin_time(), what, polls: 0 }
    }

    /// Called when a poll found nothing: yields, spins or naps; fails after the timeout.
    pub fn pause(&mut self) -> Result<()> {
        self.polls = self.polls.wrapping_add(1);
        if self.polls.is_multiple_of(64) && Instant::now() > self.deadline {
            return Err(MadError::Timeout(format!("{} ({:?})", self.what, self.deadline - self.start)));
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
        } else if self.polls < 64 || self.start.elapsed() < self.spin {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
        Ok(())
    }
}
