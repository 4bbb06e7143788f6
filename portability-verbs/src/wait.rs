//! How a thread waits for completions, one policy for every layer (the message pipe,
//! Madeleine, SDP): a wait polls, yields its CPU now and then while threads ready to run
//! outnumber the CPUs ([`spin_yields`]), and once it has spun long enough ([`Spin`], by default by the state of the CPUs: [`crate::cores`])
//! sleeps on its queues' descriptors ([`wait_any`]). [`Backoff`] makes the decision for one
//! wait; its caller polls and sleeps.

use std::time::{Duration, Instant};

use crate::error::Result;
use crate::verbs::CompletionQueue;

/// How long a wait polls before it sleeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spin {
    /// Poll while the thread has a CPU to itself (for up to 10 ms, after which a wake-up costs
    /// about 1% of the wait); while threads ready to run outnumber the CPUs (more ranks or
    /// threads than cores, looked at every millisecond), sleep after 1 ms. Waking a sleeping
    /// thread costs 30-280 us here against 0.3 us for a polled message, and a polling thread
    /// yields its CPU now and then while they do: `benches/src/bin/mad_waiting.rs` measures the choice
    /// (docs/PERFORMANCE.md).
    Adaptive,
    /// Poll this long, then sleep: `Duration::ZERO` sleeps at once, `Duration::MAX` never
    /// sleeps.
    For(Duration),
    /// Poll this many times, then sleep; or once the polls have lasted 10 ms, whichever comes
    /// first (polls that yield the CPU can each take another thread's time slice: 6000 of them
    /// lasted seconds on two busy CPUs).
    Polls(u32),
}

/// How long an adaptive wait polls (yielding its CPU now and then) while threads ready to run
/// outnumber the CPUs, before it sleeps: waking costs 30-280 us here, so a shorter wait (a
/// partner that computes between messages on the same CPU) is cheaper polling and yielding; a
/// longer one sleeps and leaves the CPU to others.
const CONTENDED_SPIN: Duration = Duration::from_millis(1);
/// How long an adaptive wait polls while its thread has a CPU to itself: past it, a wake-up
/// costs at most about 1% of the wait, and an idle waiter stops burning its CPU.
const IDLE_SPIN: Duration = Duration::from_millis(10);
/// Polls between clock reads while spinning: a wait that ends quickly (the common case, and
/// the one latency depends on) never pays for one.
const CHECK_EVERY: u32 = 64;

/// What a polling wait does after a poll that found nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pause {
    /// Poll again (a pause instruction at most).
    Spin,
    /// Poll again after yielding the CPU.
    Yield,
    /// Sleep (on the awaited completion queues, or a short nap), then poll again.
    Sleep,
}

/// What [`Backoff::pause`] decided, and how long the wait has lasted when it read the clock
/// (every [`CHECK_EVERY`] polls while spinning, every time once sleeping).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    /// What to do before the next poll.
    pub pause: Pause,
    /// How long since the wait's first clock read, if this step read the clock.
    pub waited: Option<Duration>,
}

/// One polling wait's decisions: when it yields and when it sleeps.
#[derive(Clone, Debug)]
pub struct Backoff {
    spin: Spin,
    /// Set at the first clock read.
    start: Option<Instant>,
    polls: u32,
    sleeping: bool,
    /// Whether the wait yields its CPU now and then while it spins: always for a fixed spin;
    /// for an adaptive one, while threads ready to run outnumber the CPUs, as last looked at.
    /// (A thread with a CPU to itself gains nothing from yielding, and a yield that finds
    /// nothing else to run still costs a system call, a few tenths of a microsecond late
    /// when the awaited message comes meanwhile.)
    contended: bool,
}

impl Backoff {
    /// A wait that spins as `spin` says.
    #[inline]
    pub fn new(spin: Spin) -> Backoff {
        let sleeping = matches!(spin, Spin::For(Duration::ZERO) | Spin::Polls(0));
        Backoff { spin, start: None, polls: 0, sleeping, contended: spin != Spin::Adaptive }
    }

    /// Polls that found nothing so far.
    #[inline]
    pub fn polls(&self) -> u32 {
        self.polls
    }

    /// Whether the wait is past its spin (its next pauses sleep).
    #[inline]
    pub fn sleeping(&self) -> bool {
        self.sleeping
    }

    /// After a poll that found nothing: what to do before the next. `now` is asked only when
    /// the clock is read.
    #[inline]
    pub fn pause(&mut self, now: impl FnOnce() -> Instant) -> Step {
        self.step(now, |now, fresh| {
            let max_age = if fresh { crate::cores::SAMPLE_EVERY } else { crate::cores::LAZY_SAMPLE_EVERY };
            crate::cores::oversubscribed_within(now, max_age)
        })
    }

    /// [`Backoff::pause`], asking `oversubscribed(now, fresh)` whether threads ready to run
    /// outnumber the CPUs (an adaptive wait past the latency path, each time it reads the
    /// clock), `fresh` when a new sample may be taken.
    #[inline]
    fn step(&mut self, now: impl FnOnce() -> Instant, oversubscribed: impl FnOnce(Instant, bool) -> bool) -> Step {
        self.polls = self.polls.wrapping_add(1);
        let mut waited = None;
        if self.sleeping || self.polls.is_multiple_of(CHECK_EVERY) {
            let now = now();
            let w = now - *self.start.get_or_insert(now);
            waited = Some(w);
            // Contention changes nothing on the latency path (no yield before it, no sleep
            // before `CONTENDED_SPIN`), so a short wait never asks; and a new sample reads
            // `/proc/loadavg` (about 4 us here), so a wait shorter than `FRESH_SAMPLE_AFTER`
            // takes one only when the last is `LAZY_SAMPLE_EVERY` old, a longer one (as
            // contention makes them) once a millisecond. (Ping-pongs of 4 to 16 KiB, whose
            // waits outlast the latency path's polls, paid for a sample in about 0.5% of their
            // round trips when any wait took one once a millisecond.)
            if self.spin == Spin::Adaptive && self.polls >= LATENCY_PATH_POLLS {
                self.contended = oversubscribed(now, w >= FRESH_SAMPLE_AFTER);
            }
            self.sleeping = match self.spin {
                Spin::Adaptive if w < CONTENDED_SPIN => false,
                Spin::Adaptive if self.contended => w >= CONTENDED_SPIN,
                Spin::Adaptive => w >= IDLE_SPIN,
                Spin::For(spin) => w >= spin,
                Spin::Polls(n) => self.polls >= n || w >= IDLE_SPIN,
            };
        } else if let Spin::Polls(n) = self.spin {
            self.sleeping = self.polls >= n;
        }
        let pause = if self.sleeping {
            Pause::Sleep
        } else if self.contended && spin_yields(self.polls) {
            Pause::Yield
        } else {
            Pause::Spin
        };
        Step { pause, waited }
    }
}

/// Whether a busy-polling wait yields the CPU before its `n`-th poll (from 1): not in the
/// first 128 polls (about ten microseconds: the latency path), then on every 16th. With more
/// busy threads than CPUs, the thread that would end the wait may be the one waiting for this
/// CPU; spinning alone would keep it out for a whole time slice. Pair it with [`wait_any`]
/// once a wait has spun long enough to sleep.
pub fn spin_yields(n: u32) -> bool {
    n >= LATENCY_PATH_POLLS && n.is_multiple_of(16)
}

/// How long a wait lasts before it reads a new sample of the CPUs' state rather than the last
/// one: longer than a round trip of the messages whose latency matters.
const FRESH_SAMPLE_AFTER: Duration = Duration::from_micros(100);

/// Polls of a wait that latency depends on (about ten microseconds): a busy-polling wait
/// neither yields nor asks whether the CPUs are oversubscribed before them.
const LATENCY_PATH_POLLS: u32 = 128;

/// Sleeps until one of `cqs` has an event (a completion, or on the software provider a dead
/// peer) or `timeout` passes: arms each queue, sleeps on their descriptors together, and
/// acknowledges the events it woke for. Returns whether one fired. Waking a sleeping thread
/// costs tens of microseconds: spin on `poll` first where latency matters.
pub fn wait_any(cqs: &[&CompletionQueue], timeout: Duration) -> Result<bool> {
    wait_any_or(cqs, None, timeout)
}

/// [`wait_any`] that also ends when descriptor `also` becomes readable: a wake-up another
/// thread sends (an eventfd, say), which the caller then reads. Returns whether a queue or
/// `also` fired.
pub fn wait_any_or(cqs: &[&CompletionQueue], also: Option<std::os::fd::RawFd>, timeout: Duration) -> Result<bool> {
    let mut fds: smallvec::SmallVec<[libc::pollfd; 8]> = smallvec::SmallVec::with_capacity(cqs.len() + 1);
    for cq in cqs {
        // Armed before sleeping; a queue with work already pending fires at once.
        cq.req_notify()?;
        fds.push(libc::pollfd { fd: cq.event_fd(), events: libc::POLLIN, revents: 0 });
    }
    if let Some(fd) = also {
        fds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
    }
    let fired = crate::os::wait_any_readable(&mut fds, Some(timeout))?;
    for (cq, fd) in cqs.iter().zip(&fds) {
        if fd.revents != 0 {
            cq.ack_event();
        }
    }
    Ok(fired)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Steps `b` with a clock advancing `tick` per poll, until it sleeps or `max` polls.
    fn polls_until_sleep(b: &mut Backoff, tick: Duration, max: u32) -> Option<u32> {
        let t0 = Instant::now();
        (1..=max).find(|&i| b.pause(|| t0 + tick * i).pause == Pause::Sleep)
    }

    #[test]
    fn a_wait_spins_yields_now_and_then_and_sleeps_when_its_spin_is_over() {
        let mut b = Backoff::new(Spin::For(Duration::from_micros(100)));
        let t0 = Instant::now();
        let steps: Vec<Step> = (1..=5000u32).map(|i| b.pause(|| t0 + Duration::from_nanos(100) * i)).collect();
        assert!(steps[..127].iter().all(|s| s.pause == Pause::Spin), "the latency path never yields");
        assert_eq!(steps[127].pause, Pause::Yield, "the 128th poll yields");
        let first = steps.iter().position(|s| s.pause == Pause::Sleep).expect("sleeps") + 1;
        assert!(steps[..first - 1].iter().enumerate().all(|(i, s)| s.waited.is_some() == ((i + 1) % 64 == 0)));
        // 100 ns a poll, the clock first read at poll 64: the 100 us are over at poll 1064,
        // seen at the next clock read.
        assert_eq!(first, 1088);
        assert!(
            steps[first..].iter().all(|s| s.pause == Pause::Sleep && s.waited.is_some()),
            "reads the clock each time"
        );
    }

    #[test]
    fn zero_sleeps_at_once_max_never_and_polls_count() {
        assert_eq!(Backoff::new(Spin::For(Duration::ZERO)).pause(Instant::now).pause, Pause::Sleep);
        assert_eq!(Backoff::new(Spin::Polls(0)).pause(Instant::now).pause, Pause::Sleep);
        let mut never = Backoff::new(Spin::For(Duration::MAX));
        assert_eq!(polls_until_sleep(&mut never, Duration::from_millis(1), 10_000), None);
        let mut b = Backoff::new(Spin::Polls(6000));
        assert_eq!(polls_until_sleep(&mut b, Duration::ZERO, 10_000), Some(6000));
        // Polls that take long (each yielding to a busy thread, say) end after 10 ms: 1 ms a
        // poll, the clock first read at poll 64, seen at the next read 10 ms later.
        let mut slow = Backoff::new(Spin::Polls(6000));
        assert_eq!(polls_until_sleep(&mut slow, Duration::from_millis(1), 10_000), Some(128));
    }

    /// An adaptive wait yields only while threads ready to run outnumber the CPUs (looked at
    /// each time it reads the clock), and then sleeps after 1 ms instead of 10.
    #[test]
    fn an_adaptive_wait_yields_and_sleeps_early_only_on_oversubscribed_cpus() {
        for contended in [false, true] {
            let mut b = Backoff::new(Spin::Adaptive);
            let t0 = Instant::now();
            // The polls at which the CPUs were first asked about, and first sampled anew.
            let (first_asked, first_fresh) = (std::cell::Cell::new(None), std::cell::Cell::new(None));
            let steps: Vec<Step> = (1..=20_000u32)
                .map(|i| {
                    let ask = |_, fresh| {
                        first_asked.set(first_asked.get().or(Some(i)));
                        if fresh {
                            first_fresh.set(first_fresh.get().or(Some(i)));
                        }
                        contended
                    };
                    b.step(|| t0 + Duration::from_micros(1) * i, ask)
                })
                .collect();
            assert_eq!(first_asked.get(), Some(LATENCY_PATH_POLLS), "the latency path never asks");
            // 1 us a poll, the clock read every CHECK_EVERY polls since the first read (poll
            // 64): a new sample at the first read 100 us after it.
            let fresh_at = CHECK_EVERY * (1 + FRESH_SAMPLE_AFTER.as_micros() as u32 / CHECK_EVERY + 1);
            assert_eq!(first_fresh.get(), Some(fresh_at), "a sample only in waits past a round trip");
            let yields = steps.iter().filter(|s| s.pause == Pause::Yield).count();
            let slept = steps.iter().position(|s| s.pause == Pause::Sleep).expect("sleeps") + 1;
            assert!(steps[..127].iter().all(|s| s.pause == Pause::Spin), "{contended}: the latency path never yields");
            if contended {
                assert!(yields > 0 && steps[127].pause == Pause::Yield, "yields on busy CPUs");
                assert!((1000..=1000 + 2 * CHECK_EVERY as usize).contains(&slept), "slept after {slept} polls");
            } else {
                assert_eq!(yields, 0, "a thread with a CPU to itself does not yield");
                assert!((10_000..=10_000 + 2 * CHECK_EVERY as usize).contains(&slept), "slept after {slept} polls");
            }
        }
    }

    #[test]
    fn an_adaptive_wait_polls_for_at_least_a_millisecond_and_sleeps_after_ten() {
        let mut b = Backoff::new(Spin::Adaptive);
        // 1 us a poll: awake for the first millisecond whatever the CPUs do; asleep once 10 ms
        // passed (or earlier, from 1 ms, on a machine with more runnable threads than CPUs).
        // The clock is first read at poll CHECK_EVERY and then every CHECK_EVERY polls, so
        // 10 ms after that first read is seen up to CHECK_EVERY polls later.
        let slept = polls_until_sleep(&mut b, Duration::from_micros(1), 20_000).expect("sleeps");
        assert!((1000..=10_000 + 2 * CHECK_EVERY).contains(&slept), "slept after {slept} polls");
    }
}
