//! Copy / zero-copy crossover tuning, measured the way WSDLite does it.
//!
//! Copying a small message through pre-registered buffers costs a copy; zero-copy costs a
//! registration (a cache hit when buffers are reused) plus a rendezvous round trip (two small
//! control messages). Copying pays while copying `n` bytes takes less time than that round
//! trip, so the crossover is the smallest `n` whose copy time reaches the round-trip time.
//!
//! The copy curve is measured once per process; the round trip once per peer. The result is
//! cached per peer in a file (`PV_CROSSOVER_CACHE`, default
//! `$XDG_CACHE_HOME/portability-verbs/crossover.tsv` or `~/.cache/...`), like WSDLite's registry
//! entry, and `PV_CROSSOVER_BYTES` overrides everything.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::error::{Result, VerbsError};

/// Where a crossover figure came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrossoverSource {
    /// `PV_CROSSOVER_BYTES`.
    Environment,
    /// The per-peer cache file.
    Cached,
    /// Measured now (and cached).
    Measured,
}

/// The chosen crossover.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Crossover {
    /// Messages of at least this many bytes go zero-copy.
    pub bytes: usize,
    /// Where the figure came from.
    pub source: CrossoverSource,
    /// Round trip measured for the peer (zero unless measured now).
    pub round_trip: Duration,
}

/// Nanoseconds to copy `size` bytes, for growing sizes (median of several runs, warm caches).
pub fn copy_curve() -> &'static [(usize, f64)] {
    static CURVE: OnceLock<Vec<(usize, f64)>> = OnceLock::new();
    CURVE.get_or_init(|| {
        let sizes: Vec<usize> = (6..=22).map(|p| 1usize << p).collect();
        let src = vec![1u8; 1 << 22];
        let mut dst = vec![0u8; 1 << 22];
        sizes
            .iter()
            .map(|&n| {
                let reps = (1usize << 24) / n.max(1024);
                let mut samples: Vec<f64> = (0..5)
                    .map(|_| {
                        let t = Instant::now();
                        for _ in 0..reps {
                            dst[..n].copy_from_slice(&src[..n]);
                            std::hint::black_box(&mut dst);
                        }
                        t.elapsed().as_nanos() as f64 / reps as f64
                    })
                    .collect();
                samples.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
                (n, samples[2])
            })
            .collect()
    })
}

/// The crossover for a round trip of `rtt` and a copy curve: the smallest size whose copy
/// time (at both ends: in at the sender, out at the receiver) reaches the round trip, found by
/// linear interpolation between measured sizes.
pub fn crossover_from(curve: &[(usize, f64)], rtt: Duration) -> usize {
    let target = rtt.as_nanos() as f64;
    let cost = |i: usize| 2.0 * curve[i].1;
    if curve.is_empty() {
        return 0;
    }
    if cost(0) >= target {
        return curve[0].0;
    }
    for i in 1..curve.len() {
        if cost(i) >= target {
            let (n0, c0) = (curve[i - 1].0 as f64, cost(i - 1));
            let (n1, c1) = (curve[i].0 as f64, cost(i));
            return (n0 + (target - c0) / (c1 - c0) * (n1 - n0)).round() as usize;
        }
    }
    curve[curve.len() - 1].0
}

/// Where zero-copy starts to pay when the copy path is pipelined (the bulk lane: the sender's
/// copy in and the receiver's copy out overlap, so copying `n` bytes costs about one copy,
/// `curve(n)`). Zero-copy replaces both copies with one RDMA read, measured for the peer as
/// `read_small` (a few bytes: the fixed cost) and `read_big` (`big` bytes). It is chosen from
/// the smallest curve size at which the read costs at most `1 + slack` times the copy — it
/// saves the second copy's CPU and memory traffic, so a near tie goes to it. `usize::MAX` if
/// reading never gets that close (a transport slower than memcpy, like cross-memory attach
/// against a shared-memory ring).
pub fn zero_copy_threshold(
    curve: &[(usize, f64)],
    read_small: Duration,
    read_big: Duration,
    big: usize,
    slack: f64,
) -> usize {
    let fixed = read_small.as_nanos() as f64;
    let per_byte = (read_big.as_nanos() as f64 - fixed).max(0.0) / big.max(1) as f64;
    curve.iter().find(|&&(n, copy)| fixed + per_byte * n as f64 <= (1.0 + slack) * copy).map_or(usize::MAX, |&(n, _)| n)
}

/// Chooses, pack by pack, between a connection's pipelined copy path (a bulk lane) and
/// zero-copy, from what its copies take now and not only from the probe at set-up.
///
/// The speed of a copy between two CPUs is not a constant of the machine: on this kind of VM
/// the bulk lane moves 20-28 GB/s while the host keeps a cache-line transfer near 50 ns and
/// 2-5 GB/s while it takes 200 ns, where cross-memory attach (what a zero-copy read is between
/// processes) still moves about 10. So the sender times its copies into the peer's ring
/// ([`Self::on_copy`]) over windows of [`Self::WINDOW`] bytes and takes the median rate of
/// each window's packs (a preempted copy does not count). While that runs clearly slower than
/// the probe's read ([`Self::MARGIN`]: a rendezvous adds a round trip and its control
/// messages to the read, and a near tie is not worth a switch), large packs go zero-copy;
/// every [`Self::TRIAL_EVERY`] two windows' worth go by copy again as a trial, so the
/// connection returns to copying when the host does. The first window of a connection and of a trial only warms the path up:
/// measured here, a connection's first 4 MiB of copies ran at 3-6 GB/s in a phase where the
/// next ran at 25. Sans-IO: the caller passes the clock.
#[derive(Clone, Debug)]
pub struct AdaptiveCrossover {
    /// The threshold the set-up probe (or the configuration) chose.
    probed: usize,
    /// Whether timings may lower it (not when the threshold was configured).
    adapts: bool,
    /// A zero-copy read: fixed cost (ns) and cost per byte (ns), from the probe.
    read_fixed: f64,
    read_per_byte: f64,
    /// Bytes per ns of each pack timed in the current window, and the window's bytes.
    window: Vec<f64>,
    window_bytes: usize,
    /// The current window warms the copy path up (its figure is not used).
    warming: bool,
    /// Median copy speed of the last complete window, bytes per ns.
    copy_rate: Option<f64>,
    /// While copying is slow: packs from this size on go zero-copy.
    zero_copy_from: Option<usize>,
    /// A trial window is under way (large packs go by copy until it completes).
    trial: bool,
    last_trial: Option<Instant>,
}

impl AdaptiveCrossover {
    /// Packs smaller than this are neither timed nor sent zero-copy by adaptation (a copy's
    /// fixed costs would blur the figure, and a rendezvous's round trip would dominate).
    pub const MIN_PACK: usize = 64 * 1024;
    /// Bytes of copies per decision: twice the default bulk ring, so a window's copies land
    /// in lines the path has been using.
    pub const WINDOW: usize = 4 << 20;
    /// While zero-copy is chosen, a window of copies goes as a trial at most this often (in
    /// a slow phase a trial costs about 1% of the time).
    pub const TRIAL_EVERY: Duration = Duration::from_millis(200);
    /// Zero-copy is chosen for `n` bytes while the read's cost is at most this fraction of
    /// the copy's.
    pub const MARGIN: f64 = 0.75;

    /// A crossover that starts at `probed` and adapts, knowing that a zero-copy read of a few
    /// bytes took `read_small` and of `big` bytes `read_big`.
    pub fn new(probed: usize, read_small: Duration, read_big: Duration, big: usize) -> Self {
        let read_fixed = read_small.as_nanos() as f64;
        let read_per_byte = (read_big.as_nanos() as f64 - read_fixed).max(0.0) / big.max(1) as f64;
        AdaptiveCrossover {
            probed,
            adapts: true,
            read_fixed,
            read_per_byte,
            window: Vec::new(),
            window_bytes: 0,
            warming: true,
            copy_rate: None,
            zero_copy_from: None,
            trial: false,
            last_trial: None,
        }
    }

    /// A crossover that stays at `threshold` (a configured one).
    pub fn fixed(threshold: usize) -> Self {
        AdaptiveCrossover { adapts: false, ..AdaptiveCrossover::new(threshold, Duration::ZERO, Duration::ZERO, 1) }
    }

    /// The threshold the probe or the configuration chose.
    pub fn probed(&self) -> usize {
        self.probed
    }

    /// From which size packs go zero-copy now (the probed threshold, or lower while copies are
    /// measured slow).
    pub fn current(&self) -> usize {
        self.zero_copy_from.map_or(self.probed, |n| n.min(self.probed))
    }

    /// Median copy speed of the last complete window in bytes per nanosecond (GB/s).
    pub fn copy_rate(&self) -> Option<f64> {
        self.copy_rate
    }

    /// Whether a pack of `len` bytes goes zero-copy, deciding at `now`.
    pub fn zero_copy(&mut self, len: usize, now: Instant) -> bool {
        if len >= self.probed {
            return true;
        }
        match self.zero_copy_from {
            Some(from) if len >= from => {
                if self.trial {
                    return false;
                }
                // The first trial comes a period after the switch.
                let last = *self.last_trial.get_or_insert(now);
                if now.saturating_duration_since(last) < Self::TRIAL_EVERY {
                    return true;
                }
                self.last_trial = Some(now);
                self.trial = true;
                self.warming = true;
                self.window.clear();
                self.window_bytes = 0;
                false
            }
            _ => false,
        }
    }

    /// Records that copying `bytes` of one pack took `took` (the sender's time writing them into
    /// the peer's ring); at the end of a window, chooses again.
    pub fn on_copy(&mut self, bytes: usize, took: Duration) {
        if !self.adapts || bytes < Self::MIN_PACK || took.is_zero() {
            return;
        }
        self.window.push(bytes as f64 / took.as_nanos() as f64);
        self.window_bytes += bytes;
        if self.window_bytes < Self::WINDOW {
            return;
        }
        self.window_bytes = 0;
        if std::mem::take(&mut self.warming) {
            self.window.clear();
            return;
        }
        self.window.sort_by(|a, b| a.total_cmp(b));
        let rate = self.window[self.window.len() / 2];
        self.window.clear();
        self.trial = false;
        self.copy_rate = Some(rate);
        // Zero-copy pays for `n` bytes once `fixed + n * per_byte <= MARGIN * n / rate`.
        let gain = Self::MARGIN / rate - self.read_per_byte;
        let from = (gain > 0.0).then(|| ((self.read_fixed / gain).ceil() as usize).max(Self::MIN_PACK));
        if from != self.zero_copy_from {
            log::info!(
                "copies run at {rate:.1} GB/s against a read's {:.1}: zero-copy {}",
                1.0 / self.read_per_byte.max(1e-9),
                match from {
                    Some(n) if n < self.probed => format!("from {n} bytes"),
                    _ => "as probed".to_string(),
                }
            );
            if self.zero_copy_from.is_none() {
                self.last_trial = None;
            }
        }
        self.zero_copy_from = from;
    }
}

fn cache_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("PV_CROSSOVER_CACHE") {
        return Some(PathBuf::from(p));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("portability-verbs").join("crossover.tsv"))
}

fn read_cache(peer: &str) -> Option<usize> {
    let text = std::fs::read_to_string(cache_path()?).ok()?;
    text.lines().rev().find_map(|l| {
        let mut f = l.split('\t');
        (f.next()? == peer).then(|| f.next()?.parse().ok())?
    })
}

fn write_cache(peer: &str, bytes: usize) {
    let Some(path) = cache_path() else { return };
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let mut lines: Vec<String> = std::fs::read_to_string(&path)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.split('\t').next() != Some(peer))
        .map(str::to_owned)
        .collect();
    lines.push(format!("{peer}\t{bytes}"));
    if let Err(e) = std::fs::write(&path, lines.join("\n") + "\n") {
        log::warn!("cannot write the crossover cache {}: {e}", path.display());
    }
}

/// The crossover for `peer` (a stable name: a host name, or "local" for this host): from the
/// environment, else the cache, else measured with `round_trip` (one control round trip to the
/// peer) and cached.
pub fn for_peer(peer: &str, round_trip: impl FnOnce() -> Result<Duration>) -> Result<Crossover> {
    if let Ok(v) = std::env::var("PV_CROSSOVER_BYTES") {
        let bytes =
            v.trim().parse().map_err(|_| VerbsError::invalid(format!("PV_CROSSOVER_BYTES={v:?} is not a number")))?;
        return Ok(Crossover { bytes, source: CrossoverSource::Environment, round_trip: Duration::ZERO });
    }
    if peer.contains(['\t', '\n']) {
        return Err(VerbsError::invalid("peer names may not contain tabs or newlines"));
    }
    if let Some(bytes) = read_cache(peer) {
        return Ok(Crossover { bytes, source: CrossoverSource::Cached, round_trip: Duration::ZERO });
    }
    let rtt = round_trip()?;
    let bytes = crossover_from(copy_curve(), rtt);
    write_cache(peer, bytes);
    log::info!("copy/zero-copy crossover for {peer}: {bytes} bytes (round trip {rtt:?})");
    Ok(Crossover { bytes, source: CrossoverSource::Measured, round_trip: rtt })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crossover_interpolates_where_copying_reaches_the_round_trip() {
        let curve = [(1024, 50.0), (2048, 100.0), (4096, 200.0)];
        // Both copies of 2 KiB take 200 ns, of 4 KiB 400 ns: a 300 ns round trip falls between.
        assert_eq!(crossover_from(&curve, Duration::from_nanos(300)), 3072);
        assert_eq!(crossover_from(&curve, Duration::from_nanos(10)), 1024);
        assert_eq!(crossover_from(&curve, Duration::from_secs(1)), 4096);
    }

    #[test]
    fn zero_copy_pays_only_where_reading_is_about_as_cheap_as_one_copy() {
        // memcpy at 40 bytes/ns, with a 100 ns fixed cost.
        let curve: Vec<(usize, f64)> = (10..=22).map(|p| (1usize << p, 100.0 + (1u64 << p) as f64 / 40.0)).collect();
        let us = Duration::from_micros;
        // A read as fast as memcpy after a 1 us fixed cost: pays once the copy dwarfs that cost.
        let fast = zero_copy_threshold(&curve, us(1), Duration::from_nanos(1000 + (1 << 20) / 40), 1 << 20, 0.25);
        assert_eq!(fast, 1 << 18, "875 ns of fixed cost against a quarter of a copy: from 140 KB on");
        // A read four times slower than memcpy (cross-memory attach against a ring): never.
        let slow = zero_copy_threshold(&curve, us(1), Duration::from_nanos(1000 + (1 << 20) / 10), 1 << 20, 0.25);
        assert_eq!(slow, usize::MAX);
    }

    #[test]
    fn copies_measured_slow_send_large_packs_zero_copy_with_trials_until_they_are_fast_again() {
        let us = Duration::from_micros;
        // A read: 1 us fixed, 10 bytes/ns; never pays against copies at 28 bytes/ns.
        let mut c = AdaptiveCrossover::new(usize::MAX, us(1), Duration::from_nanos(1000 + (1 << 20) / 10), 1 << 20);
        let mib = 1 << 20;
        let copy_at = |gbps: f64| Duration::from_nanos((mib as f64 / gbps) as u64);
        // Copies one window of 1 MiB packs at `gbps` (and `outlier` once), as the packer does.
        let window = |c: &mut AdaptiveCrossover, now: Instant, gbps: f64, outlier: f64| {
            for i in 0..AdaptiveCrossover::WINDOW / mib {
                assert!(!c.zero_copy(mib, now), "pack {i} of a window goes by copy");
                c.on_copy(mib, copy_at(if i == 1 { outlier } else { gbps }));
            }
        };
        let t0 = Instant::now();
        // The connection's first window (slow: cold) only warms up.
        window(&mut c, t0, 3.0, 3.0);
        assert_eq!((c.copy_rate(), c.current()), (None, usize::MAX));
        window(&mut c, t0, 28.0, 0.3);
        assert_eq!(c.copy_rate().map(|r| r.round()), Some(28.0), "the median skips an outlier");
        assert_eq!(c.current(), usize::MAX);
        // Copies a little slower than reads are not worth a switch.
        window(&mut c, t0, 12.0, 12.0);
        assert_eq!(c.current(), usize::MAX);
        // The host slows down: a window at 5 GB/s sends large packs zero-copy, small ones not.
        window(&mut c, t0, 5.0, 5.0);
        assert!(c.current() < mib && c.current() >= AdaptiveCrossover::MIN_PACK, "{c:?}");
        assert!(!c.zero_copy(4096, t0));
        c.on_copy(4096, Duration::from_secs(1)); // small packs are not timed
        let t1 = t0 + Duration::from_secs(1);
        assert!(c.zero_copy(mib, t1));
        assert!(c.zero_copy(mib, t1 + AdaptiveCrossover::TRIAL_EVERY / 2));
        // A period later, a trial goes by copy: a warm-up window, then the one that counts.
        let t2 = t1 + AdaptiveCrossover::TRIAL_EVERY;
        window(&mut c, t2, 28.0, 28.0);
        assert!(!c.zero_copy(mib, t2), "the trial goes on");
        window(&mut c, t2, 5.0, 5.0);
        assert!(c.zero_copy(mib, t2), "still slow: zero-copy until the next trial");
        // The host recovered: the next trial's window is fast, back to copying.
        let t3 = t2 + AdaptiveCrossover::TRIAL_EVERY;
        window(&mut c, t3, 5.0, 5.0);
        window(&mut c, t3, 28.0, 28.0);
        assert_eq!(c.current(), usize::MAX);
        assert!(!c.zero_copy(mib, t3));
    }

    #[test]
    fn a_configured_threshold_never_adapts() {
        let mut c = AdaptiveCrossover::fixed(usize::MAX);
        for _ in 0..(2 * AdaptiveCrossover::WINDOW) >> 20 {
            c.on_copy(1 << 20, Duration::from_secs(1));
        }
        assert!(!c.zero_copy(1 << 20, Instant::now()));
        let mut c = AdaptiveCrossover::fixed(1000);
        assert!(c.zero_copy(1000, Instant::now()) && !c.zero_copy(999, Instant::now()));
    }

    #[test]
    fn the_copy_curve_grows_with_size() {
        let c = copy_curve();
        assert!(c.first().unwrap().1 < c.last().unwrap().1);
    }

    #[test]
    fn measured_once_then_cached_per_peer_and_overridable() {
        // One test owns the environment variables (tests in one binary share them).
        let dir = std::env::temp_dir().join(format!("pv-crossover-{}", std::process::id()));
        std::env::set_var("PV_CROSSOVER_CACHE", dir.join("c.tsv"));
        std::env::remove_var("PV_CROSSOVER_BYTES");
        let first = for_peer("hostA", || Ok(Duration::from_micros(2))).unwrap();
        assert_eq!(first.source, CrossoverSource::Measured);
        let again = for_peer("hostA", || panic!("must come from the cache")).unwrap();
        assert_eq!((again.source, again.bytes), (CrossoverSource::Cached, first.bytes));
        let other = for_peer("hostB", || Ok(Duration::from_micros(20))).unwrap();
        assert!(other.bytes >= first.bytes);
        std::env::set_var("PV_CROSSOVER_BYTES", "12345");
        let env = for_peer("hostA", || panic!("environment wins")).unwrap();
        assert_eq!((env.source, env.bytes), (CrossoverSource::Environment, 12345));
        std::env::remove_var("PV_CROSSOVER_BYTES");
        std::env::remove_var("PV_CROSSOVER_CACHE");
        let _ = std::fs::remove_dir_all(dir);
    }
}
