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

/// How a connection's bulk lane stores its copies into the peer's ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stores {
    /// Plain stores: the lines stay in the sender's cache until the reader takes them. Fast
    /// while the two CPUs share a cache.
    Cached,
    /// Non-temporal stores ([`crate::types::SendFlags::streaming`]): the lines go to memory.
    /// Fast while the two CPUs share no cache, where each cached line would wait for a
    /// transfer between caches.
    Streaming,
}

impl Stores {
    fn index(self) -> usize {
        self as usize
    }
    fn other(self) -> Self {
        match self {
            Stores::Cached => Stores::Streaming,
            Stores::Streaming => Stores::Cached,
        }
    }
}

/// What copying out of a bulk lane has cost its reader so far, cumulative: the reader
/// publishes it as one word ([`CopyOut::word`], through the pipe's
/// [`crate::datapath::MsgPipe::report_copy_out`]), and the writer's crossover of smaller packs
/// takes the rate between two words, so that it judges the stores it chooses by what both
/// ends pay for them (the reader's loads find the lines in the writer's cache, or in memory).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CopyOut {
    /// Bytes copied out (of the copies timed).
    pub bytes: u64,
    /// Time those copies took, in nanoseconds.
    pub ns: u64,
}

impl CopyOut {
    /// Adds a copy of `bytes` that took `took`.
    pub fn add(&mut self, bytes: usize, took: Duration) {
        self.bytes += bytes as u64;
        self.ns += took.as_nanos() as u64;
    }

    /// The counters as one word: 64-byte units in the low half, 64-ns units in the high half,
    /// each wrapping (rates come from the difference of two words).
    pub fn word(&self) -> u64 {
        u64::from((self.bytes >> 6) as u32) | u64::from((self.ns >> 6) as u32) << 32
    }

    /// Bytes per ns copied out between two words, if bytes and time passed between them.
    pub fn rate_between(earlier: u64, later: u64) -> Option<f64> {
        let bytes = (later as u32).wrapping_sub(earlier as u32);
        let time = ((later >> 32) as u32).wrapping_sub((earlier >> 32) as u32);
        (bytes > 0 && time > 0).then(|| f64::from(bytes) / f64::from(time))
    }
}

/// A copy speed measured over one window.
#[derive(Clone, Copy, Debug)]
struct Measured {
    /// Median over the window's slices ([`AdaptiveCrossover::SLICE`]), bytes per ns (GB/s).
    rate: f64,
    /// When, and after how many bytes of large packs ([`AdaptiveCrossover::MIN_PACK`] on).
    at: Instant,
    bytes_at: u64,
}

/// Chooses, pack by pack, how a connection moves large packs: by its pipelined copy path (a
/// bulk lane) with cached or streaming stores, or zero-copy; from what its copies take now
/// and not only from the probe at set-up.
///
/// The speed of a copy between two CPUs is not a constant of the machine. On this kind of VM
/// (two vCPUs that the host moves between cores that share a cache and cores that do not) the
/// bulk lane moved 15-28 GB/s with cached stores while a cache-line transfer took 50-170 ns,
/// and 2-4 GB/s while it took 200-280 ns; streaming stores then moved 9-12 GB/s (and 8-13 in
/// the fast phases), and cross-memory attach (what a zero-copy read is between processes)
/// 10-18. So:
/// - the sender times its hand-overs into the peer's ring ([`Self::on_copy`]) over windows of
///   [`Self::WINDOW`] bytes and takes the median rate of each window's slices (a preempted
///   slice does not count);
/// - it measures both kinds of stores and copies with the faster ([`Self::stores`]); a kind's
///   figure is measured again (one window) once it is due (below);
/// - while the faster copy runs clearly slower than the probe's read ([`Self::MARGIN`]: a
///   rendezvous adds a round trip and its control messages to the read, and a near tie is
///   not worth a switch), large packs go zero-copy; a trial then copies again now and then,
///   so the connection returns to copying when the host does.
///
/// A trial or a remeasure comes at most every [`Self::TRIAL_EVERY`] and after
/// [`Self::TRIAL_BYTES`] of large packs, so bursts spaced by idle periods do not each start
/// with one. The first window of a connection and of a trial only warms the path up:
/// measured here, a connection's first 4 MiB of copies ran at 3-6 GB/s in a phase where the
/// next ran at 25. Sans-IO: the caller passes the clock.
#[derive(Clone, Debug)]
pub struct AdaptiveCrossover {
    /// The packs it times and may send zero-copy: from this size on (and below the large
    /// ones, for [`Self::for_smaller_packs`]).
    min_pack: usize,
    /// Bytes of copies per figure ([`Self::WINDOW`], or less for smaller packs).
    window_len: usize,
    /// For a crossover that counts the reader's copies too: the reader's [`CopyOut::word`]
    /// when the current window began, and the latest one seen.
    reader: Option<(Option<u64>, u64)>,
    /// The threshold the set-up probe (or the configuration) chose.
    probed: usize,
    /// Whether timings may lower the threshold (not when it was configured; the stores
    /// adapt either way).
    adapts: bool,
    /// A zero-copy read: fixed cost (ns) and cost per byte (ns), from the probe.
    read_fixed: f64,
    read_per_byte: f64,
    /// Bytes per ns of each slice of the current window, and the window's bytes.
    window: Vec<f64>,
    window_bytes: usize,
    /// The slice being timed: its bytes and time.
    slice: (usize, Duration),
    /// The current window warms the copy path up (its figure is not used).
    warming: bool,
    /// The stores copies use now (and the current window measures).
    stores: Stores,
    /// The last figure of each kind of stores (indexed by [`Stores::index`]).
    measured: [Option<Measured>; 2],
    /// While copying is slow: packs from this size on go zero-copy.
    zero_copy_from: Option<usize>,
    /// A window of copies is under way that large packs must feed (a trial or a remeasure).
    trial: bool,
    /// When the last trial of copying began, or zero-copy was chosen (time, large bytes).
    last_trial: Option<(Instant, u64)>,
    /// Bytes of large packs so far.
    large_bytes: u64,
}

impl AdaptiveCrossover {
    /// Packs smaller than this are neither timed nor sent zero-copy by adaptation (a copy's
    /// fixed costs would blur the figure, and a rendezvous's round trip would dominate).
    pub const MIN_PACK: usize = 64 * 1024;
    /// Bytes of copies per decision: twice the default bulk ring, so a window's copies land
    /// in lines the path has been using.
    pub const WINDOW: usize = 4 << 20;
    /// Bytes of packs timed as one figure of a window, whose median the window takes. Packs
    /// are not timed one by one: while they follow each other the ring's room comes back in
    /// bursts (as the receiver acknowledges), so some packs wait and the next ones do not,
    /// and a median of packs would report the ones that did not wait. Four slices a window
    /// still let the median pass over a preempted one.
    pub const SLICE: usize = Self::WINDOW / 4;
    /// A figure is measured again, or a trial of copying made, at most this often...
    pub const TRIAL_EVERY: Duration = Duration::from_millis(200);
    /// ...and after this many bytes of large packs (so a trial, two windows, costs at most a
    /// few percent of the traffic however it is spaced out in time).
    pub const TRIAL_BYTES: u64 = 32 * Self::WINDOW as u64;
    /// Zero-copy is chosen for `n` bytes while the read's cost is at most this fraction of
    /// the copy's.
    pub const MARGIN: f64 = 0.75;
    /// The smallest packs [`Self::for_smaller_packs`] times.
    pub const MIN_SMALL_PACK: usize = 8 * 1024;
    /// The window of [`Self::for_smaller_packs`]: a latency-bound exchange of such packs
    /// should not take long to learn.
    pub const SMALL_WINDOW: usize = Self::WINDOW / 8;
    /// With both ends' copies counted, streaming stores are chosen only if they beat cached
    /// ones by this much (a near tie stays with the stores that keep lines in caches).
    pub const STREAMING_EDGE: f64 = 0.9;

    /// A crossover that starts at `probed` and adapts, knowing that a zero-copy read of a few
    /// bytes took `read_small` and of `big` bytes `read_big`.
    pub fn new(probed: usize, read_small: Duration, read_big: Duration, big: usize) -> Self {
        let read_fixed = read_small.as_nanos() as f64;
        let read_per_byte = (read_big.as_nanos() as f64 - read_fixed).max(0.0) / big.max(1) as f64;
        AdaptiveCrossover {
            min_pack: Self::MIN_PACK,
            window_len: Self::WINDOW,
            reader: None,
            probed,
            adapts: true,
            read_fixed,
            read_per_byte,
            window: Vec::new(),
            window_bytes: 0,
            slice: (0, Duration::ZERO),
            warming: true,
            stores: Stores::Cached,
            measured: [None, None],
            zero_copy_from: None,
            trial: false,
            last_trial: None,
            large_bytes: 0,
        }
    }

    /// A crossover that stays at `threshold` (a configured one); its copies still choose
    /// their stores.
    pub fn fixed(threshold: usize) -> Self {
        AdaptiveCrossover { adapts: false, ..AdaptiveCrossover::new(threshold, Duration::ZERO, Duration::ZERO, 1) }
    }

    /// The stores of the packs from [`Self::MIN_SMALL_PACK`] up to the large ones, which
    /// always copy: a rendezvous would make a blocking send of such a pack wait for its
    /// receiver, and programs exchange packs of that size with blocking sends on both sides.
    /// Its figures count the reader's copies out of the ring as well as the sender's stores
    /// ([`Self::on_copy_read`]): the sender alone times non-temporal stores fast whatever the
    /// phase, their cost falling on the reader.
    pub fn for_smaller_packs() -> Self {
        AdaptiveCrossover {
            min_pack: Self::MIN_SMALL_PACK,
            window_len: Self::SMALL_WINDOW,
            reader: Some((None, 0)),
            ..AdaptiveCrossover::fixed(usize::MAX)
        }
    }

    /// The smallest pack it times.
    pub fn min_pack(&self) -> usize {
        self.min_pack
    }

    /// Bytes of copies per figure.
    pub fn window_len(&self) -> usize {
        self.window_len
    }

    /// Counts a pack of `len` bytes that it is the crossover of (the bytes that space its
    /// remeasures and trials); [`Self::zero_copy`] counts the packs it is asked about.
    #[inline]
    pub fn count(&mut self, len: usize) {
        if len >= self.min_pack {
            self.large_bytes += len as u64;
        }
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

    /// The stores the next copy uses.
    pub fn stores(&self) -> Stores {
        self.stores
    }

    /// The copy speed last measured with the stores chosen, in bytes per nanosecond (GB/s).
    pub fn copy_rate(&self) -> Option<f64> {
        // Cached stores are measured first, and chosen until both were.
        self.measured[self.chosen_stores().index()].map(|m| m.rate)
    }

    /// What a copy figure is worth against other ways: a streaming one counts for
    /// [`Self::MARGIN`] of itself, for what the sender's timing cannot see. Streamed lines are
    /// read from memory, so the receiver's copies out of the ring slow down while the sender's
    /// copies in speed up; measured end to end, streaming moved 9-13 GB/s where the sender
    /// timed 12-22.
    /// With the reader's copies counted ([`Self::for_smaller_packs`]) the figure says it all,
    /// and streaming only needs [`Self::STREAMING_EDGE`].
    fn effective(&self, stores: Stores, rate: f64) -> f64 {
        match stores {
            Stores::Cached => rate,
            Stores::Streaming if self.reader.is_some() => Self::STREAMING_EDGE * rate,
            Stores::Streaming => Self::MARGIN * rate,
        }
    }

    /// The stores that copy faster by the figures so far ([`Self::effective`]; cached ones
    /// until both were measured).
    fn chosen_stores(&self) -> Stores {
        match self.measured {
            [Some(cached), Some(streaming)] if cached.rate < self.effective(Stores::Streaming, streaming.rate) => {
                Stores::Streaming
            }
            _ => Stores::Cached,
        }
    }

    /// Whether a figure (or trial) taken at `at`, after `bytes_at` bytes of large packs, is due
    /// again at `now`.
    fn due(&self, at: Instant, bytes_at: u64, now: Instant) -> bool {
        now.saturating_duration_since(at) >= Self::TRIAL_EVERY
            && self.large_bytes.saturating_sub(bytes_at) >= Self::TRIAL_BYTES
    }

    /// Whether a pack of `len` bytes goes zero-copy, deciding at `now`. Call it for every
    /// pack of at least `MIN_PACK.min(probed)` bytes (it counts them).
    pub fn zero_copy(&mut self, len: usize, now: Instant) -> bool {
        if len >= self.probed {
            return true;
        }
        self.count(len);
        if !self.adapts {
            return false;
        }
        match self.zero_copy_from {
            Some(from) if len >= from => {
                if self.trial {
                    return false;
                }
                // The first trial comes a period after the switch.
                let last = *self.last_trial.get_or_insert((now, self.large_bytes));
                if !self.due(last.0, last.1, now) {
                    return true;
                }
                self.last_trial = Some((now, self.large_bytes));
                self.trial = true;
                self.warming = true;
                self.window.clear();
                self.window_bytes = 0;
                self.slice = (0, Duration::ZERO);
                false
            }
            _ => false,
        }
    }

    /// [`Self::on_copy`] for [`Self::for_smaller_packs`]: `reader` is the reader's latest
    /// [`CopyOut::word`].
    pub fn on_copy_read(&mut self, bytes: usize, took: Duration, reader: u64, now: Instant) {
        if let Some((_, latest)) = &mut self.reader {
            *latest = reader;
        }
        self.on_copy(bytes, took, now);
    }

    /// Records that handing `bytes` of one pack to the peer by copy (with [`Self::stores`])
    /// took `took`: the copies into its ring and the waits for room, so that while packs
    /// follow each other it is the pace at which the peer drains the ring (which the stores
    /// change too, as the peer's loads find lines in another cache or in memory). At the end
    /// of a window, at `now`, chooses again.
    pub fn on_copy(&mut self, bytes: usize, took: Duration, now: Instant) {
        if bytes < self.min_pack || took.is_zero() {
            return;
        }
        self.slice.0 += bytes;
        self.slice.1 += took;
        if self.slice.0 < self.window_len / 4 {
            return;
        }
        let (slice_bytes, slice_took) = std::mem::replace(&mut self.slice, (0, Duration::ZERO));
        self.window.push(slice_bytes as f64 / slice_took.as_nanos().max(1) as f64);
        self.window_bytes += slice_bytes;
        if self.window_bytes < self.window_len {
            return;
        }
        self.window_bytes = 0;
        // The reader's copies over the window, for a crossover that counts them.
        let reader = self.reader.map(|(start, latest)| {
            self.reader = Some((Some(latest), latest));
            start.and_then(|s| CopyOut::rate_between(s, latest))
        });
        if std::mem::take(&mut self.warming) {
            self.window.clear();
            return;
        }
        self.window.sort_by(|a, b| a.total_cmp(b));
        let sent = self.window[self.window.len() / 2];
        self.window.clear();
        let rate = match reader {
            None => sent,
            // Both ends' copies, one after the other.
            Some(Some(read)) => 1.0 / (1.0 / sent + 1.0 / read),
            // The reader reported nothing over the window: no figure.
            Some(None) => return,
        };
        self.measured[self.stores.index()] = Some(Measured { rate, at: now, bytes_at: self.large_bytes });
        // The other kind of stores is measured when it never was or its figure is due; until
        // then (one window) large packs keep copying.
        let other = self.stores.other();
        let remeasure = self.measured[other.index()].is_none_or(|m| self.due(m.at, m.bytes_at, now));
        let before = (self.stores, self.zero_copy_from);
        let chosen = self.chosen_stores();
        self.stores = if remeasure { other } else { chosen };
        self.trial = remeasure;
        let best = self.effective(chosen, self.measured[chosen.index()].map_or(rate, |m| m.rate));
        // Zero-copy pays for `n` bytes once `fixed + n * per_byte <= MARGIN * n / best`.
        let gain = Self::MARGIN / best - self.read_per_byte;
        let from = (self.adapts && gain > 0.0).then(|| ((self.read_fixed / gain).ceil() as usize).max(self.min_pack));
        if from.is_some() && self.zero_copy_from.is_none() {
            self.last_trial = None;
        }
        self.zero_copy_from = from;
        if (self.stores, self.zero_copy_from) != before {
            log::info!(
                "copies run at {rate:.1} GB/s with {:?} stores (chosen {best:.1}, a read {}): {} with {:?} stores, \
                 zero-copy {}",
                before.0,
                if self.adapts { format!("{:.1}", 1.0 / self.read_per_byte.max(1e-9)) } else { "unused".into() },
                if remeasure { "measuring" } else { "copying" },
                self.stores,
                match from {
                    Some(n) if n < self.probed => format!("from {n} bytes"),
                    _ => "as probed".to_string(),
                }
            );
        }
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
    if let Some(bytes) = crate::env::parse("PV_CROSSOVER_BYTES", "bytes")? {
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

    const MIB: usize = 1 << 20;

    /// Copies one window of 1 MiB packs at `gbps` (`outlier` for its second slice), deciding
    /// each pack as the packer does; returns how many went zero-copy.
    fn window(c: &mut AdaptiveCrossover, now: Instant, gbps: f64, outlier: f64) -> usize {
        let copy_at = |gbps: f64| Duration::from_nanos((MIB as f64 / gbps) as u64);
        let slice_packs = AdaptiveCrossover::SLICE / MIB;
        let mut zero = 0;
        for i in 0..AdaptiveCrossover::WINDOW / MIB {
            if c.zero_copy(MIB, now) {
                zero += 1;
                continue;
            }
            c.on_copy(MIB, copy_at(if i / slice_packs == 1 { outlier } else { gbps }), now);
        }
        zero
    }

    /// A read of 1 us fixed cost moving `gbps`.
    fn read_at(gbps: f64) -> AdaptiveCrossover {
        let us = Duration::from_micros;
        AdaptiveCrossover::new(usize::MAX, us(1), Duration::from_nanos(1000 + (MIB as f64 / gbps) as u64), MIB)
    }

    #[test]
    fn both_stores_are_measured_and_the_faster_copies_until_its_figure_is_due_again() {
        // Reads at 10 GB/s never pay against these copies.
        let mut c = read_at(10.0);
        let t0 = Instant::now();
        // The connection's first window (slow: cold) only warms up.
        assert_eq!(window(&mut c, t0, 3.0, 3.0), 0);
        assert_eq!((c.copy_rate(), c.stores()), (None, Stores::Cached));
        // Cached stores at 28 (the median skips a preempted slice), then streaming ones once.
        assert_eq!(window(&mut c, t0, 28.0, 0.3), 0);
        assert_eq!(c.copy_rate().map(|r| r.round()), Some(28.0));
        assert_eq!(c.stores(), Stores::Streaming, "the other stores are measured next");
        assert_eq!(window(&mut c, t0, 12.0, 12.0), 0);
        assert_eq!((c.stores(), c.current()), (Stores::Cached, usize::MAX));
        // A little slower than streaming is not worth a switch; much slower is.
        assert_eq!(window(&mut c, t0, 10.0, 10.0), 0);
        assert_eq!(c.stores(), Stores::Cached);
        assert_eq!(window(&mut c, t0, 3.0, 3.0), 0);
        assert_eq!((c.stores(), c.current()), (Stores::Streaming, usize::MAX));
        // Streaming figures keep coming; the cached one is measured again only once it is both
        // a period old and a trial's worth of bytes behind.
        let t1 = t0 + AdaptiveCrossover::TRIAL_EVERY;
        let windows = (AdaptiveCrossover::TRIAL_BYTES as usize).div_ceil(AdaptiveCrossover::WINDOW);
        for i in 0..windows - 2 {
            window(&mut c, t1, 11.0, 11.0);
            assert_eq!(c.stores(), Stores::Streaming, "window {i}");
        }
        let mut remeasured = false;
        for _ in 0..3 {
            window(&mut c, t1, 11.0, 11.0);
            remeasured |= c.stores() == Stores::Cached;
            if remeasured {
                break;
            }
        }
        assert!(remeasured, "the cached figure is due again");
        // The host recovered: cached stores are fast again and stay.
        window(&mut c, t1, 25.0, 25.0);
        assert_eq!((c.stores(), c.copy_rate().map(|r| r.round())), (Stores::Cached, Some(25.0)));
    }

    #[test]
    fn copies_measured_slow_send_large_packs_zero_copy_with_trials_until_they_are_fast_again() {
        // Reads at 20 GB/s: they pay against copies at 5, not at 28.
        let mut c = read_at(20.0);
        let t0 = Instant::now();
        window(&mut c, t0, 28.0, 28.0);
        window(&mut c, t0, 28.0, 28.0);
        window(&mut c, t0, 12.0, 12.0);
        assert_eq!((c.stores(), c.current()), (Stores::Cached, usize::MAX));
        // The host slows down (both stores): large packs go zero-copy, small ones not.
        window(&mut c, t0, 5.0, 5.0);
        assert!(c.current() < MIB && c.current() >= AdaptiveCrossover::MIN_PACK, "{c:?}");
        assert!(!c.zero_copy(4096, t0));
        c.on_copy(4096, Duration::from_secs(1), t0); // small packs are not timed
        assert_eq!(window(&mut c, t0, 5.0, 5.0), AdaptiveCrossover::WINDOW / MIB);
        // A period later but without a trial's worth of bytes (bursts spaced out): no trial.
        let t1 = t0 + AdaptiveCrossover::TRIAL_EVERY;
        assert_eq!(window(&mut c, t1, 28.0, 28.0), AdaptiveCrossover::WINDOW / MIB);
        // Once both are due, a trial copies: a warm-up window, then the one that counts (and
        // here one more, as the streaming figure is due too).
        let per = AdaptiveCrossover::WINDOW / MIB;
        let mut zero_copied = 0;
        while !c.trial {
            zero_copied += window(&mut c, t1, 5.0, 5.0);
            assert!(zero_copied <= 2 * AdaptiveCrossover::TRIAL_BYTES as usize / MIB, "no trial");
        }
        // (The two windows sent zero-copy above count too.)
        assert!(zero_copied * MIB >= AdaptiveCrossover::TRIAL_BYTES as usize - 3 * AdaptiveCrossover::WINDOW);
        let mut trial_windows = 0;
        while c.trial {
            assert_eq!(window(&mut c, t1, 5.0, 5.0), 0, "a trial copies until it is measured");
            trial_windows += 1;
        }
        assert!((1..=3).contains(&trial_windows), "{trial_windows} windows after the first pack ({per} packs each)");
        assert!(c.zero_copy(MIB, t1), "still slow: zero-copy until the next trial");
        // The host recovered: the next trial is fast, back to copying.
        let t2 = t1 + AdaptiveCrossover::TRIAL_EVERY;
        for _ in 0..AdaptiveCrossover::TRIAL_BYTES as usize / AdaptiveCrossover::WINDOW + 4 {
            window(&mut c, t2, 28.0, 28.0);
        }
        assert_eq!((c.current(), c.stores()), (usize::MAX, Stores::Cached));
        assert!(!c.zero_copy(MIB, t2));
    }

    /// One window of `pack`-byte packs for a crossover of smaller packs: the sender's stores
    /// at `sent` GB/s, the reader's copies out at `read` GB/s (reported every pack; none if
    /// `read` is zero).
    fn window_read(c: &mut AdaptiveCrossover, out: &mut CopyOut, pack: usize, now: Instant, sent: f64, read: f64) {
        for _ in 0..c.window_len() / pack {
            c.count(pack);
            if read > 0.0 {
                out.add(pack, Duration::from_nanos((pack as f64 / read) as u64));
            }
            c.on_copy_read(pack, Duration::from_nanos((pack as f64 / sent) as u64), out.word(), now);
        }
    }

    #[test]
    fn smaller_packs_choose_their_stores_by_both_ends_copies_and_always_copy() {
        const PACK: usize = 16 * 1024;
        let mut c = AdaptiveCrossover::for_smaller_packs();
        let mut out = CopyOut::default();
        let t0 = Instant::now();
        // Cores sharing a cache: cached stores 25 GB/s and the reader's copies 25 (12.5 for
        // both); streaming stores time 45 for the sender but 8 for the reader (6.8): cached.
        window_read(&mut c, &mut out, PACK, t0, 25.0, 25.0); // warms up
        window_read(&mut c, &mut out, PACK, t0, 25.0, 25.0);
        assert!(c.copy_rate().is_some_and(|r| (12.0..=12.6).contains(&r)), "{:?}", c.copy_rate());
        assert_eq!(c.stores(), Stores::Streaming, "the other stores are measured next");
        window_read(&mut c, &mut out, PACK, t0, 45.0, 8.0);
        assert_eq!((c.stores(), c.current()), (Stores::Cached, usize::MAX));
        // Cores sharing no cache: cached stores at 3, the reader's copies at 3 (1.5), below the
        // streaming figure: streaming, measured again (40 and 9: 7.3), kept.
        window_read(&mut c, &mut out, PACK, t0, 3.0, 3.0);
        assert_eq!(c.stores(), Stores::Streaming);
        window_read(&mut c, &mut out, PACK, t0, 40.0, 9.0);
        assert_eq!((c.stores(), c.current()), (Stores::Streaming, usize::MAX));
        // Once the cached figure is due again (a period, a trial's worth of packs), it is
        // measured again: the host is fast again, back to cached stores.
        let t1 = t0 + AdaptiveCrossover::TRIAL_EVERY;
        for _ in 0..AdaptiveCrossover::TRIAL_BYTES as usize / PACK {
            c.count(PACK);
        }
        window_read(&mut c, &mut out, PACK, t1, 45.0, 8.0);
        assert_eq!(c.stores(), Stores::Cached, "measured again");
        window_read(&mut c, &mut out, PACK, t1, 25.0, 25.0);
        assert_eq!(c.stores(), Stores::Cached);
        assert!(!c.zero_copy(PACK, t1), "never zero-copy");
        // A reader that reports nothing gives no figure: the choice stands.
        let mut quiet = AdaptiveCrossover::for_smaller_packs();
        let mut none = CopyOut::default();
        for _ in 0..4 {
            window_read(&mut quiet, &mut none, PACK, t0, 3.0, 0.0);
        }
        assert_eq!((quiet.stores(), quiet.copy_rate()), (Stores::Cached, None));
    }

    #[test]
    fn copy_out_words_give_the_rate_between_them_across_wraps() {
        let mut a = CopyOut { bytes: (u32::MAX as u64 - 10) << 6, ns: (u32::MAX as u64 - 3) << 6 };
        let before = a.word();
        a.add(64 * 100, Duration::from_nanos(64 * 50));
        assert_eq!(CopyOut::rate_between(before, a.word()), Some(2.0));
        assert_eq!(CopyOut::rate_between(before, before), None);
    }

    #[test]
    fn a_configured_threshold_never_adapts() {
        let mut c = AdaptiveCrossover::fixed(usize::MAX);
        for _ in 0..(2 * AdaptiveCrossover::WINDOW) >> 20 {
            c.on_copy(1 << 20, Duration::from_secs(1), Instant::now());
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
