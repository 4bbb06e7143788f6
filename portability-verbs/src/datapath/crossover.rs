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
