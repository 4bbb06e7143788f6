//! Helpers shared by the benchmark programs: sizes, CPU pinning, memory and timer measurement,
//! bounded busy-waiting, and two namespace "hosts" on one machine (also used by the tests).

pub mod exs_peer;
pub mod hosts;
pub mod plot;
pub mod results;

use std::time::{Duration, Instant};

use portability_verbs::{Result, VerbsError};

/// Powers of two from `min` to `max` (both rounded to powers of two).
pub fn sizes_between(min: usize, max: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = min.max(1).next_power_of_two();
    while s <= max {
        v.push(s);
        s *= 2;
    }
    v
}

/// `1 KiB`-style size.
pub fn fmt_size(n: usize) -> String {
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{} MiB", n >> 20)
    } else if n >= 1 << 10 && n.is_multiple_of(1 << 10) {
        format!("{} KiB", n >> 10)
    } else {
        format!("{n} B")
    }
}

/// Pins the calling thread to `cpu` if the machine has it (silently does nothing otherwise).
pub fn pin_to_cpu(cpu: usize) {
    if cpu < online_cpus() {
        set_affinity(&[cpu]);
    }
}

/// Lets the calling thread (and the threads it spawns from now on) run on every online CPU
/// again, after [`pin_to_cpu`].
pub fn unpin() {
    set_affinity(&(0..online_cpus()).collect::<Vec<_>>());
}

/// Online CPUs, not `available_parallelism`: that one reflects this thread's current affinity,
/// so a thread spawned by a pinned thread could never pin itself elsewhere (and a pinned
/// benchmark would report a host of one CPU).
pub fn online_cpus() -> usize {
    portability_verbs::cores::online_cpus().map_or(1, |n| n.max(1) as usize)
}

fn set_affinity(cpus: &[usize]) {
    // SAFETY: a zeroed cpu_set_t is valid; CPU_SET writes inside it; sched_setaffinity reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// CPU time (user and system, seconds) of this process, or with `thread` of the calling
/// thread only.
pub fn cpu_seconds(thread: bool) -> f64 {
    let who = if thread { libc::RUSAGE_THREAD } else { libc::RUSAGE_SELF };
    // SAFETY: getrusage fills a zeroed struct.
    let u = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(who, &mut u);
        u
    };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// Proportional set size of this process in KiB (0 if unknown).
pub fn pss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/smaps_rollup")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Pss:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// Cost of one `Instant::now()` in nanoseconds (measured, reported next to latencies).
pub fn timer_cost_ns() -> f64 {
    read_cost_ns(Instant::now)
}

/// Nanoseconds one call of the clock `read` takes, over 200,000 calls.
fn read_cost_ns<T>(read: impl Fn() -> T) -> f64 {
    let n = 200_000;
    let t0 = Instant::now();
    for _ in 0..n {
        std::hint::black_box(read());
    }
    t0.elapsed().as_nanos() as f64 / n as f64
}

/// The clock a ping-pong reads once per round trip, as cheap as `ucx_perftest`'s: the CPU's
/// time-stamp counter where it runs at a constant rate through sleep states (x86-64 with
/// `constant_tsc` and `nonstop_tsc`), else `Instant`. A read costs about 12 ns here against
/// 31 for `Instant::now()`, which would add 9-10 ns to every one-way figure that UCX's do not
/// carry. Ticks become nanoseconds by the rate a [`TickSpan`] measures over the block itself,
/// so no calibration run is needed and a block's clock drift cannot enter its samples.
/// `benches/peers/ticks.h` is the same clock for the C peers.
#[derive(Clone, Copy, Debug)]
pub struct TickClock {
    tsc: bool,
    epoch: Instant,
}

impl TickClock {
    /// The counter if it is invariant, else `Instant`.
    pub fn new() -> TickClock {
        let flags = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| s.lines().find(|l| l.starts_with("flags")).map(str::to_owned))
            .unwrap_or_default();
        let has = |f: &str| flags.split_whitespace().any(|w| w == f);
        let tsc = cfg!(target_arch = "x86_64") && has("constant_tsc") && has("nonstop_tsc");
        TickClock { tsc, epoch: Instant::now() }
    }

    /// Whether this clock reads the time-stamp counter.
    pub fn is_tsc(&self) -> bool {
        self.tsc
    }

    /// Now, in ticks (nanoseconds since the clock's creation where there is no counter).
    #[inline(always)]
    pub fn now(&self) -> u64 {
        #[cfg(target_arch = "x86_64")]
        if self.tsc {
            // SAFETY: RDTSC reads a counter and touches no memory; every x86-64 CPU has it.
            return unsafe { core::arch::x86_64::_rdtsc() };
        }
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Starts measuring the tick rate over a block of samples.
    pub fn span(&self) -> TickSpan {
        TickSpan { clock: *self, wall: Instant::now(), ticks: self.now() }
    }

    /// Cost of one [`TickClock::now`] in nanoseconds (reported next to latencies).
    pub fn cost_ns(&self) -> f64 {
        read_cost_ns(|| self.now())
    }
}

impl Default for TickClock {
    fn default() -> Self {
        TickClock::new()
    }
}

/// The wall clock and the tick count at a block's start: at its end, the rate between them.
#[derive(Clone, Copy, Debug)]
pub struct TickSpan {
    clock: TickClock,
    wall: Instant,
    ticks: u64,
}

impl TickSpan {
    /// Nanoseconds per tick from the span's start to now (1 without a counter; over a block
    /// of a few milliseconds, to about one part in 100,000: two wall-clock reads' worth).
    pub fn ns_per_tick(&self) -> f64 {
        let ticks = self.clock.now().saturating_sub(self.ticks);
        let ns = self.wall.elapsed().as_nanos() as f64;
        if !self.clock.tsc || ticks == 0 {
            return 1.0;
        }
        ns / ticks as f64
    }
}

/// Bounded busy-waiting: `tick` errors once the deadline passes (checked every 1024 ticks).
pub struct Spin {
    deadline: Instant,
    limit: Duration,
    ticks: u32,
}

impl Spin {
    /// A spin that may last `limit`.
    pub fn new(limit: Duration) -> Spin {
        Spin { deadline: Instant::now() + limit, limit, ticks: 0 }
    }
    /// One iteration of a wait loop. No pause instruction: it costs about 30 ns here, as much
    /// as a poll of a completion queue, and would delay seeing the completion by half that
    /// on average; a verbs program polls its queue in a tight loop, as the layers measured
    /// beside it do.
    pub fn tick(&mut self) -> Result<()> {
        self.ticks = self.ticks.wrapping_add(1);
        if self.ticks.is_multiple_of(1024) && Instant::now() > self.deadline {
            return Err(VerbsError::Timeout(self.limit));
        }
        Ok(())
    }
}

/// The physical floor of a one-way message between two CPUs: each of two threads (pinned to
/// `cpu_a` and `cpu_b`) writes its own cache line and spins on the other's, as a ring flag does.
/// Returns nanoseconds one way. Measured in the same run as the figures it is compared with,
/// because this kind of machine drifts from minute to minute.
pub fn cacheline_one_way_ns(cpu_a: usize, cpu_b: usize) -> f64 {
    cacheline_one_way_ns_over(cpu_a, cpu_b, 200_000)
}

/// [`cacheline_one_way_ns`] over `rounds` round trips (a few milliseconds for 10,000 here), to
/// check a figure against the floor of the moment it was taken. The clock starts once both
/// threads run on their CPUs: a thread's start and move took about 1.5 ms here, which read
/// as 0.78 us one way over 2,500 round trips whose floor was 0.2.
pub fn cacheline_one_way_ns_over(cpu_a: usize, cpu_b: usize, rounds: u64) -> f64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    #[repr(align(128))]
    struct Line(AtomicU64);
    const READY: u64 = u64::MAX;
    let (a, b) = (Line(AtomicU64::new(0)), Line(AtomicU64::new(0)));
    let rounds = rounds.max(1);
    let mut elapsed = Duration::ZERO;
    std::thread::scope(|s| {
        s.spawn(|| {
            pin_to_cpu(cpu_b);
            b.0.store(READY, Ordering::Release);
            for i in 1..=rounds {
                while a.0.load(Ordering::Acquire) != i {
                    std::hint::spin_loop();
                }
                b.0.store(i, Ordering::Release);
            }
        });
        pin_to_cpu(cpu_a);
        while b.0.load(Ordering::Acquire) != READY {
            std::hint::spin_loop();
        }
        let t0 = Instant::now();
        for i in 1..=rounds {
            a.0.store(i, Ordering::Release);
            while b.0.load(Ordering::Acquire) != i {
                std::hint::spin_loop();
            }
        }
        elapsed = t0.elapsed();
    });
    elapsed.as_nanos() as f64 / (2 * rounds) as f64
}

/// Waits up to `limit` for a child process to exit, killing it after that. Returns its exit
/// status, or None if it had to be killed.
pub fn wait_child(child: &mut std::process::Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(st)) => return Some(st),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}

/// Runs `op` until it has moved `len` bytes, retrying on `WouldBlock` (busy-polling nonblocking
/// sockets) for at most `limit`. `op` gets the offset reached and returns the bytes it moved;
/// 0 means the peer closed (`UnexpectedEof`). The whole-buffer read and write of the TCP and
/// SDP benchmark layers.
pub fn io_whole(
    len: usize,
    limit: Duration,
    mut op: impl FnMut(usize) -> std::io::Result<usize>,
) -> std::io::Result<()> {
    use std::io::ErrorKind;
    let (mut off, mut polls) = (0, 0u64);
    let deadline = Instant::now() + limit;
    while off < len {
        match op(off) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => off += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                polls += 1;
                if polls % 1024 == 0 {
                    if Instant::now() > deadline {
                        return Err(ErrorKind::TimedOut.into());
                    }
                    // Busy-polling, but not starving a peer that shares the CPU.
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop()
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The role of a two-process benchmark run: the client starts its server peer itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PeerRole {
    /// Measures, and starts the server.
    Client,
    /// Answers the client.
    Server,
}

/// A page-aligned byte buffer (as benchmarks allocate with `posix_memalign`), so zero-copy
/// designs that work in whole pages see whole pages.
pub struct PageBuf {
    v: Vec<u8>,
    off: usize,
    len: usize,
}

impl PageBuf {
    /// `len` bytes of `fill`, starting on a page boundary.
    pub fn new(len: usize, fill: u8) -> PageBuf {
        let page = portability_verbs::page_size();
        let v = vec![fill; len + page];
        let off = (v.as_ptr() as usize).next_multiple_of(page) - v.as_ptr() as usize;
        PageBuf { v, off, len }
    }
}

impl std::ops::Deref for PageBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.v[self.off..self.off + self.len]
    }
}

impl std::ops::DerefMut for PageBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.v[self.off..self.off + self.len]
    }
}

/// Builds the `cdylib` of `package` beside the running test executable
/// (`target/<profile>/<file>`) and returns its path: `cargo test` builds a cdylib crate's test
/// harness but not the library itself. `manifest_dir` is the calling crate's directory.
pub fn build_cdylib(manifest_dir: &str, cargo: &str, package: &str, file: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("own executable");
    let dir = exe.parent().and_then(std::path::Path::parent).expect("target/<profile>/deps");
    let release = dir.file_name().is_some_and(|n| n == "release");
    let mut c = std::process::Command::new(cargo);
    c.args(["build", "--quiet", "-p", package]).current_dir(manifest_dir);
    if release {
        c.arg("--release");
    }
    if let Some(target) = dir.parent() {
        c.env("CARGO_TARGET_DIR", target);
    }
    let out = c.output().expect("run cargo");
    assert!(out.status.success(), "building {package}: {}", String::from_utf8_lossy(&out.stderr));
    let lib = dir.join(file);
    assert!(lib.is_file(), "{} not built", lib.display());
    lib
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ticks converted at the rate a span measured give back the wall time of a later
    /// interval (a sleep: at least as long as asked, rarely much longer).
    #[test]
    fn ticks_convert_to_the_wall_time_they_span() {
        let clock = TickClock::new();
        let span = clock.span();
        std::thread::sleep(Duration::from_millis(20));
        let rate = span.ns_per_tick();
        assert!(rate > 0.0, "a rate of {rate} ns per tick");
        let (wall, t0) = (Instant::now(), clock.now());
        std::thread::sleep(Duration::from_millis(10));
        let ticks = clock.now().saturating_sub(t0);
        let (took, wall) = (ticks as f64 * rate, wall.elapsed().as_nanos() as f64);
        assert!((took - wall).abs() < wall * 0.05, "{ticks} ticks at {rate} ns: {took} ns, the wall clock {wall}");
    }
}
