//! Whether the CPUs this process may run on are oversubscribed now: more runnable threads on
//! the machine than CPUs for them. A waiting thread polls while it has a CPU to itself (a
//! wake-up costs tens of microseconds, a poll a fraction of one) and sleeps on completion
//! events when threads that are ready to run would otherwise queue behind it (more ranks or
//! threads than cores), as Madeleine over VIA chose its waiting by the state of the threads.
//!
//! The runnable count is the kernel's, from `/proc/loadavg` (all runnable tasks of the
//! machine, the reader included); the CPUs are those `available_parallelism` reports
//! (affinity and cgroup quota), or the online ones for a pinned thread (see `shared_cpus`).
//! One sample per process serves every waiting thread for [`SAMPLE_EVERY`]: a read costs a few
//! microseconds, so short waits go by one up to [`LAZY_SAMPLE_EVERY`] old (`wait::Backoff`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How long one sample of the runnable count serves.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(1);

/// Whether `runnable` threads (the asker among them) are more than `cpus` can run at once.
#[inline]
pub fn decide(runnable: u32, cpus: u32) -> bool {
    runnable > cpus
}

/// The runnable count from `/proc/loadavg`'s text ("0.42 1.41 1.60 2/345 12345": the fourth
/// field's first number).
pub fn runnable_from_loadavg(text: &str) -> Option<u32> {
    let field = text.split_ascii_whitespace().nth(3)?;
    field.split_once('/')?.0.parse().ok()
}

struct Census {
    epoch: Instant,
    cpus: u32,
    /// Nanoseconds after `epoch` of the last sample (0: none yet), taken by one thread at a
    /// time (the one whose compare-exchange moved it).
    sampled_at: AtomicU64,
    oversubscribed: AtomicBool,
}

fn census() -> &'static Census {
    static CENSUS: OnceLock<Census> = OnceLock::new();
    CENSUS.get_or_init(|| Census {
        epoch: Instant::now(),
        cpus: shared_cpus(),
        sampled_at: AtomicU64::new(0),
        oversubscribed: AtomicBool::new(false),
    })
}

/// The CPUs the machine's runnable threads compete for, as this process can tell: those it
/// may run on (affinity and cgroup quota, `available_parallelism`), unless its thread is
/// pinned to fewer than are online. The runnable count is the whole machine's, and launchers
/// pin ranks to CPUs of their own (`mpirun --bind-to core`): a pinned rank that counted its
/// one CPU would take its peers, busy on theirs, for threads queued behind it, and yield and
/// sleep early in every wait. Ranks pinned together onto fewer CPUs than ranks are thus not
/// seen as oversubscribed. Asked once, by the first wait.
fn shared_cpus() -> u32 {
    let available = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
    let allowed = std::fs::read_to_string("/proc/thread-self/status")
        .ok()
        .and_then(|status| status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).and_then(count_cpu_list));
    match (allowed, online_cpus()) {
        (Some(allowed), Some(online)) if allowed < online => online,
        _ => available,
    }
}

/// The machine's online CPUs, whatever the calling thread is pinned to (`None` where the
/// kernel's list cannot be read).
pub fn online_cpus() -> Option<u32> {
    std::fs::read_to_string("/sys/devices/system/cpu/online").ok().and_then(|t| count_cpu_list(&t))
}

/// The CPUs of a kernel CPU list (`0-3,8,10-11`), or `None` if it is not one.
fn count_cpu_list(list: &str) -> Option<u32> {
    list.trim().split(',').try_fold(0u32, |n, part| {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let (lo, hi): (u32, u32) = (lo.trim().parse().ok()?, hi.trim().parse().ok()?);
        n.checked_add(hi.checked_sub(lo)?.checked_add(1)?)
    })
}

/// Whether this machine's CPUs are oversubscribed at `now` (a sample at most
/// [`SAMPLE_EVERY`] old; where `/proc/loadavg` cannot be read, never).
pub fn oversubscribed(now: Instant) -> bool {
    oversubscribed_within(now, SAMPLE_EVERY)
}

/// How old a sample may be for a wait that cannot afford a new one (one whose latency
/// matters): a read then costs one wait in this many milliseconds' worth of them, and a
/// sample taken in other conditions (a benchmark's other programs, a job's previous phase)
/// is not believed for longer.
pub const LAZY_SAMPLE_EVERY: Duration = Duration::from_millis(20);

/// [`oversubscribed`] by a sample at most `max_age` old (taken now if the last is older).
pub fn oversubscribed_within(now: Instant, max_age: Duration) -> bool {
    let c = census();
    let at = (now.saturating_duration_since(c.epoch).as_nanos() as u64).max(1);
    let last = c.sampled_at.load(Ordering::Relaxed);
    if last != 0 && at.saturating_sub(last) < max_age.as_nanos() as u64 {
        return c.oversubscribed.load(Ordering::Relaxed);
    }
    if c.sampled_at.compare_exchange(last, at, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
        let runnable = std::fs::read_to_string("/proc/loadavg").ok().and_then(|t| runnable_from_loadavg(&t));
        c.oversubscribed.store(runnable.is_some_and(|r| decide(r, c.cpus)), Ordering::Relaxed);
    }
    c.oversubscribed.load(Ordering::Relaxed)
}

/// Threads that keep `n` CPUs' worth of work runnable until dropped: an oversubscribed machine,
/// for tests and benchmarks of waiting policies.
pub struct Spinners {
    stop: std::sync::Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Spinners {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spinners").field("threads", &self.threads.len()).finish()
    }
}

impl Spinners {
    /// Starts `n` busy threads.
    pub fn start(n: usize) -> Spinners {
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let threads = (0..n)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        Spinners { stop, threads }
    }

    /// The CPUs this process may use (what [`oversubscribed`] counts against).
    pub fn cpus() -> usize {
        census().cpus as usize
    }
}

impl Drop for Spinners {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_runnable_count_is_the_fourth_fields_numerator() {
        assert_eq!(runnable_from_loadavg("0.42 1.41 1.60 2/345 12345\n"), Some(2));
        assert_eq!(runnable_from_loadavg("0.00 0.00 0.00 17/1024 1"), Some(17));
        for bad in ["", "0.42 1.41 1.60", "0.42 1.41 1.60 x/345 1", "0.42 1.41 1.60 345 1"] {
            assert_eq!(runnable_from_loadavg(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn cpu_lists_are_counted_as_the_kernel_writes_them() {
        assert_eq!(count_cpu_list("0-1\n"), Some(2));
        assert_eq!(count_cpu_list("0"), Some(1));
        assert_eq!(count_cpu_list("0-3,8,10-11"), Some(7));
        for bad in ["", "x", "3-1", "0-", "1,,2"] {
            assert_eq!(count_cpu_list(bad), None, "{bad:?}");
        }
    }

    /// A thread pinned to one CPU counts the machine's online CPUs (the peers of a bound rank
    /// run on their own), one that may run anywhere what it may use.
    #[test]
    fn a_pinned_thread_counts_the_online_cpus() {
        let online = online_cpus();
        let free = shared_cpus();
        assert!(free >= 1 && online.is_none_or(|o| free <= o), "{free} of {online:?}");
        let pinned = std::thread::spawn(|| {
            // SAFETY: a zeroed cpu_set_t is valid; CPU_SET writes inside it; the call reads it.
            let ok = unsafe {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(0, &mut set);
                libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
            };
            ok.then(shared_cpus)
        })
        .join()
        .unwrap();
        if let (Some(pinned), Some(online)) = (pinned, online) {
            assert_eq!(pinned, online.max(1));
        }
    }

    #[test]
    fn more_runnable_threads_than_cpus_is_oversubscribed() {
        assert!(!decide(1, 2));
        assert!(!decide(2, 2));
        assert!(decide(3, 2));
        assert!(decide(5, 4));
    }

    #[test]
    fn the_machine_can_be_asked_and_a_sample_serves_a_while() {
        let now = Instant::now();
        let first = oversubscribed(now);
        // Within the sample's life the answer cannot change.
        assert_eq!(oversubscribed(now + SAMPLE_EVERY / 2), first);
        // A sample taken while 8 more threads per CPU spin sees them.
        let cpus = Spinners::cpus();
        let spinners = Spinners::start(8 * cpus);
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut seen = false;
        while !seen && Instant::now() < deadline {
            std::thread::sleep(SAMPLE_EVERY * 2);
            seen = oversubscribed(Instant::now());
        }
        drop(spinners);
        assert!(seen, "{} spinning threads on {cpus} CPUs never counted as oversubscribed", 8 * cpus);
    }
}
