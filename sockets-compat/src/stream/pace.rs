//! How a socket call waits: its deadline, and the spin-yield-sleep pacing between polls.

use portability_verbs::wait::{Backoff, Pause, Spin};

use super::*;

/// A call's timeout, turned into a point in time only when the call first has to wait: the
/// calls that complete at once (most small reads and writes) never read the clock for it.
/// A call may also be stopped from outside (a signal, for the preload library): a deadline
/// whose `stop` says so has passed.
pub(super) struct Deadline<'a> {
    timeout: Option<Duration>,
    at: std::cell::Cell<Option<Instant>>,
    stop: Option<&'a dyn Fn() -> bool>,
    /// Looks since `stop` was last asked (it is asked every [`STOP_EVERY`]th).
    looks: std::cell::Cell<u32>,
}

/// How often a deadline asks its `stop` (a system call, for the preload library's).
pub(super) const STOP_EVERY: u32 = 16;

impl<'a> Deadline<'a> {
    pub(super) fn never() -> Deadline<'a> {
        Deadline::after(None)
    }

    pub(super) fn after(timeout: Option<Duration>) -> Deadline<'a> {
        Deadline { timeout, at: std::cell::Cell::new(None), stop: None, looks: std::cell::Cell::new(0) }
    }

    /// [`Deadline::after`] that has also passed once `stop` says so.
    pub(super) fn after_or(timeout: Option<Duration>, stop: &'a dyn Fn() -> bool) -> Deadline<'a> {
        Deadline { stop: Some(stop), ..Deadline::after(timeout) }
    }

    /// When the call times out, counted from the first time this is asked.
    pub(super) fn get(&self) -> Option<Instant> {
        if !self.stopped() {
            if let Some(stop) = self.stop {
                let looks = self.looks.get().wrapping_add(1);
                self.looks.set(looks);
                if looks.is_multiple_of(STOP_EVERY) && stop() {
                    // Passed from now on.
                    self.looks.set(u32::MAX);
                    self.at.set(Some(Instant::now()));
                }
            }
        }
        if self.stopped() {
            return self.at.get();
        }
        let t = self.timeout?;
        let at = self.at.get().unwrap_or_else(|| Instant::now() + t);
        self.at.set(Some(at));
        Some(at)
    }

    pub(super) fn passed(&self) -> bool {
        self.get().is_some_and(|d| Instant::now() >= d)
    }

    /// Whether `stop` ended the call.
    pub(super) fn stopped(&self) -> bool {
        self.looks.get() == u32::MAX
    }
}

/// Waits between polls, as the stack's waiting policy decides (`portability_verbs::wait`):
/// spins first (the latency path), yields now and then, then sleeps: on the socket's
/// completion queue where the awaited event raises a completion (a message, bulk data, the
/// peer's answer), else in short naps (a flow-control update is a plain RDMA write, a hold's
/// release a futex wake-up).
pub(super) struct Pacer {
    backoff: Backoff,
}

/// Polls before a socket call sleeps.
const SPIN_POLLS: u32 = 6000;

impl Default for Pacer {
    fn default() -> Self {
        Pacer { backoff: Backoff::new(Spin::Polls(SPIN_POLLS)) }
    }
}

/// Longest sleep on a completion queue: bounds what a wake-up taken by another thread
/// sleeping on the same queue (a `try_clone` of the socket) costs.
const SLEEP_SLICE: Duration = Duration::from_millis(2);

/// A nap where no completion announces the event.
const NAP: Duration = Duration::from_micros(20);

impl Pacer {
    pub(super) fn pause(&mut self, deadline: &Deadline, what: &str) -> io::Result<()> {
        self.pause_on(deadline, what, None, || true)
    }

    /// [`Pacer::pause`] for an event that raises a completion on `cq`. Before it sleeps there it
    /// calls `prepare` (the pipe's [`MsgPipe::prepare_sleep`]: a polled pipe's messages raise
    /// no completion unless the peer is told we sleep); false: something arrived, poll again.
    pub(super) fn pause_on(
        &mut self,
        deadline: &Deadline,
        what: &str,
        cq: Option<&CompletionQueue>,
        prepare: impl FnOnce() -> bool,
    ) -> io::Result<()> {
        let deadline = deadline.get();
        let step = self.backoff.pause(Instant::now);
        if step.waited.is_some() && deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(io::Error::new(io::ErrorKind::TimedOut, format!("timed out {what}")));
        }
        if step.pause == Pause::Spin {
            std::hint::spin_loop();
        } else if step.pause == Pause::Yield {
            // A server thread and its clients may outnumber the CPUs.
            std::thread::yield_now();
        } else if let Some(cq) = cq {
            if !prepare() {
                return Ok(());
            }
            let slice = deadline.map_or(SLEEP_SLICE, |d| d.saturating_duration_since(Instant::now()).min(SLEEP_SLICE));
            if let Err(e) = portability_verbs::wait_any(&[cq], slice) {
                // The next poll reports a broken queue; until then, nap.
                debug!("SDP: cannot sleep on the completion queue: {e}");
                std::thread::sleep(NAP);
            }
        } else {
            std::thread::sleep(NAP);
        }
        Ok(())
    }
}
