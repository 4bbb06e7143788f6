//! The main benchmark: every layer of the stack side by side, in one run, on the default
//! software provider — raw verbs (SEND/RECV and RDMA write-with-immediate), the flow-controlled
//! message pipe Madeleine's small messages ride on, Madeleine, and
//! plain TCP over loopback as the legacy baseline — with one-way ping-pong latency (median,
//! p99), streaming bandwidth and CPU efficiency (MB per CPU-second, as WSDLite reports it) per
//! message size. The layers take turns: each size is measured in rounds, every layer running a
//! block of its round trips and of its stream per round, so that the phases of a noisy machine
//! fall on all of them alike, and each layer's latency is also given as its difference to raw
//! SEND/RECV taken round by round. Prints a table with each layer's ratio to TCP and to raw
//! verbs, and writes JSON, CSV and SVG plots to a results folder. With the `ucx` layer, UCX's
//! `ucx_perftest` takes its turn in the same rounds (while our processes sleep), and every
//! layer is also compared with it round by round (`-ucx us`, `bw/ucx`).
//!
//! With no arguments it starts its own peer process. `--role server --listen ADDR` and
//! `--role client --connect ADDR` run the two halves on different hosts (raw and TCP layers).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use benches::plot::{line_chart, Axes, Series};
use benches::{
    cacheline_one_way_ns, cacheline_one_way_ns_over, fmt_size, pin_to_cpu, sizes_between, wait_child, TickClock,
};
use clap::{Parser, ValueEnum};
use hdrhistogram::Histogram;
use madeleine::{RecvMode, SendMode, Session, SessionConfig};
use portability_verbs::*;

mod blocks;
mod cpeers;
mod links;
mod report;
mod ucx;

use blocks::*;
use cpeers::*;
use links::*;
use report::*;
use ucx::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, ValueEnum)]
enum Layer {
    /// portability-verbs SEND/RECV.
    RawSend,
    /// portability-verbs RDMA write-with-immediate.
    RawWwi,
    /// The flow-controlled message pipe (NIC-assisted window) under Madeleine's small
    /// messages; a message longer than the pipe's largest goes as several.
    Pipe,
    /// Madeleine pack/unpack, the library choosing (static buffers below its threshold,
    /// zero-copy above).
    Madeleine,
    /// Madeleine forced onto the static-buffer (copy) path.
    MadCopy,
    /// Madeleine forced onto the zero-copy (rendezvous) path.
    MadZcopy,
    /// Madeleine choosing, a stream's messages ended with `end_packing_nowait` and up to
    /// `--in-flight` of them left pending (zero-copy packs read while the next are sent).
    MadNowait,
    /// Madeleine forced onto the zero-copy path, messages ended as `mad-nowait` ends them.
    MadZcopyNowait,
    /// std::net TCP over loopback.
    Tcp,
    /// SDP stream sockets (`sockets_compat::SdpStream`, buffer copy: the design unmodified
    /// programs get under `libsdp_preload.so`), read and written as the TCP layer's.
    Sdp,
    /// UCX, the peer the targets name: `ucx_perftest`'s tag-matching ping-pong (`tag_lat`) and
    /// stream (`tag_bw`) over shared memory, at its best: each point's first round tries
    /// `UCX_TLS=posix,self` and `posix,cma,self` (or `UCX_TLS` as set) and keeps the better;
    /// every block runs at least 2000 round trips or 5000 messages (about 2 GiB for large
    /// ones), its own warm-up excluded, in a pair of processes of its own, pinned as ours are,
    /// while ours sleep. Same host only; needs `ucx_perftest` (Debian: `ucx-utils`). Its
    /// latency is the 50th percentile ucx_perftest reports, its p99 the 99th of a second run of
    /// each latency block (`-R 99`; both over a block's last 2048 round trips); no CPU time.
    /// A peer's latency block whose median falls below the cache-line floor measured just
    /// before it (impossible for a message between the two CPUs) runs again, at most twice.
    Ucx,
    /// Open MPI, the default shared-memory path (`ob1` with the `vader` BTL): a ping-pong of
    /// `MPI_Send`/`MPI_Recv` and a stream of 64 outstanding `MPI_Isend`s (`benches/peers/
    /// mpi_pingpong.c`, compiled with `mpicc`), two ranks by `mpirun` for each of this layer's
    /// blocks, as long as UCX's, pinned as ours are, while ours sleep. Same host only; needs
    /// `mpicc` and `mpirun` (Debian: `libopenmpi-dev`, `openmpi-bin`). Its latency is the
    /// median one-way of its round trips, and their 99th percentile; no CPU time.
    Mpi,
    /// libfabric's shared-memory provider (`shm`): reliable-datagram endpoints sending
    /// untagged messages, a ping-pong and a stream of windows of 64 (`benches/peers/
    /// fi_pingpong.c`, compiled with `cc -lfabric`; a process and the child it forks), as long
    /// as UCX's blocks, pinned as ours are, while ours sleep. Same host only; needs libfabric's
    /// headers (Debian: `libfabric-dev`). Median and 99th percentile of the one-way latency; no
    /// CPU time.
    Libfabric,
}

impl Layer {
    /// A peer's own program, run while ours sleep.
    fn is_peer(self) -> bool {
        matches!(self, Layer::Ucx | Layer::Mpi | Layer::Libfabric)
    }
}

impl Layer {
    fn is_madeleine(self) -> bool {
        matches!(self, Layer::Madeleine | Layer::MadCopy | Layer::MadZcopy | Layer::MadNowait | Layer::MadZcopyNowait)
    }

    /// Whether a stream of this layer leaves messages pending (`end_packing_nowait`).
    fn nowait(self) -> bool {
        matches!(self, Layer::MadNowait | Layer::MadZcopyNowait)
    }

    /// The rendezvous threshold the layer forces, if any.
    fn mad_threshold(self) -> Option<usize> {
        match self {
            Layer::MadCopy => Some(usize::MAX),
            Layer::MadZcopy | Layer::MadZcopyNowait => Some(1),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Layer::RawSend => "raw-send",
            Layer::RawWwi => "raw-wwi",
            Layer::Pipe => "pipe",
            Layer::Madeleine => "madeleine",
            Layer::MadCopy => "mad-copy",
            Layer::MadZcopy => "mad-zcopy",
            Layer::MadNowait => "mad-nowait",
            Layer::MadZcopyNowait => "mad-zcopy-nowait",
            Layer::Tcp => "tcp",
            Layer::Sdp => "sdp",
            Layer::Ucx => "ucx",
            Layer::Mpi => "mpi",
            Layer::Libfabric => "libfabric",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Role {
    Both,
    Client,
    Server,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Wait {
    /// Spin on completions (lowest latency).
    Busy,
    /// Sleep on completion events (saves CPU).
    Interrupt,
}

/// Benchmarks the stack's layers side by side.
#[derive(Parser, Debug, Clone)]
#[command(version, about)]
struct Args {
    /// Layers to measure. By default: raw verbs, Madeleine as it chooses (what its users get)
    /// and forced onto each of its two paths (the Madeleine paper's two figures), and TCP.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_values = ["raw-send", "raw-wwi", "madeleine", "mad-copy", "mad-zcopy", "tcp", "sdp"]
    )]
    layers: Vec<Layer>,
    /// Smallest message size (bytes).
    #[arg(long, default_value_t = 1)]
    min_size: usize,
    /// Largest message size (bytes, at most 4 MiB).
    #[arg(long, default_value_t = 4 << 20)]
    max_size: usize,
    /// Round trips per latency point (fewer for large sizes).
    #[arg(long, default_value_t = 2000)]
    iters: u64,
    /// Round trips discarded before measuring.
    #[arg(long, default_value_t = 200)]
    warmup: u64,
    /// Bytes streamed per bandwidth point. Beside a peer layer, every layer's stream block is
    /// as long as the peer's (at least 5000 messages or about 2 GiB) after an untimed tenth,
    /// and every latency block too (at least 2000 round trips after a tenth).
    #[arg(long, default_value_t = 64 << 20)]
    stream_bytes: u64,
    /// Messages the `mad-nowait` layers' streams leave pending at most.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=1024))]
    in_flight: u64,
    /// Stop a layer's remaining sizes once its measurements took this many seconds.
    #[arg(long, default_value_t = 20)]
    duration_cap: u64,
    /// Rounds per size: each layer's round trips and stream are split into this many blocks,
    /// run in turn with the other layers' (layer A, B, C, A, B, C, ...), so a phase of this
    /// noisy machine falls on every layer alike and the `-raw` column compares each layer with
    /// raw SEND/RECV round by round. 1 runs each layer's point in one piece.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=1000))]
    rounds: u64,
    /// Provider for the verbs-based layers.
    #[arg(long, value_enum, default_value_t = ProviderArg::Software)]
    provider: ProviderArg,
    /// Pin client and server to these two CPUs (when present).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 0])]
    cpus: Vec<usize>,
    /// Do not pin.
    #[arg(long)]
    no_pin: bool,
    /// Busy-poll or sleep on events while waiting.
    #[arg(long, value_enum, default_value_t = Wait::Busy)]
    wait: Wait,
    /// Results folder (default: `results/stack-<time>`).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Also writes each latency block's one-way samples (ns, in the order taken, one a line)
    /// to `<DIR>/<layer>-<size>-<round>.txt`, to study tails: which round trips were slow,
    /// in runs or alone, how often. Our layers only (a peer's program reports percentiles).
    #[arg(long, value_name = "DIR")]
    samples: Option<PathBuf>,
    /// Run one half only: `server` (with --listen) or `client` (with --connect).
    #[arg(long, value_enum, default_value_t = Role::Both)]
    role: Role,
    /// Server: TCP address to listen on for the bootstrap and the TCP layer.
    #[arg(long)]
    listen: Option<String>,
    /// Client: the server's address.
    #[arg(long)]
    connect: Option<String>,
    /// Run client and server on two "hosts" made of namespaces joined by a veth pair (needs
    /// root): the layers then cross a machine boundary (the software provider over TCP). Layers
    /// default to raw-send, raw-wwi, pipe, madeleine and tcp (UCX runs on one host only).
    #[arg(long)]
    netns: bool,
    /// Internal: the Madeleine rendezvous directory shared with the spawned peer.
    #[arg(long, hide = true)]
    mad_dir: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ProviderArg {
    Software,
    Hardware,
}

/// How long a measured wait may take before the run fails (a lost message, a dead peer).
const T: Duration = Duration::from_secs(5);
/// How long connecting may take: on a loaded two-CPU machine (CI runs several benchmark
/// processes side by side, in debug builds) one process may reach a layer's set-up seconds
/// after the other; a 5 s window once failed there (the cause was not reproduced).
const SETUP: Duration = Duration::from_secs(30);
const MAX: usize = 4 << 20;

/// One measured point.
#[derive(Clone, Debug)]
struct Point {
    layer: Layer,
    size: usize,
    median_us: f64,
    /// None where the layer's tool does not report it (UCX).
    p99_us: Option<f64>,
    gbps: f64,
    mb_per_cpu_s: Option<f64>,
    /// Median over the rounds of this layer's median latency minus raw SEND/RECV's in the
    /// same round (when raw SEND/RECV ran at this size).
    minus_raw_us: Option<f64>,
    /// The same, minus UCX's (when the UCX layer ran at this size).
    minus_ucx_us: Option<f64>,
}

fn lat_iters(args: &Args, size: usize) -> u64 {
    (args.iters * 4096 / (size as u64).max(4096)).max(20)
}

fn stream_count(args: &Args, size: usize) -> u64 {
    (args.stream_bytes / size as u64).clamp(20, 200_000)
}

// ---------------------------------------------------------------- driving the links

/// The client's side of the whole run: for each size, rounds of latency and stream blocks,
/// every layer in turn within a round; then `Done` for the server.
fn measure(
    args: &Args,
    layers: &[Layer],
    links: &mut [Box<dyn Link>],
    sizes: &[usize],
    progress: &mut dyn FnMut(Layer, usize),
) -> Result<Vec<Point>, String> {
    let mut out = Vec::new();
    let clock = TickClock::new();
    let cap = Duration::from_secs(args.duration_cap);
    let mut spent = vec![Duration::ZERO; layers.len()];
    let mut capped = vec![false; layers.len()];
    for &size in sizes {
        for (i, layer) in layers.iter().enumerate() {
            if !capped[i] && spent[i] > cap {
                capped[i] = true;
                eprintln!("\n{}: duration cap reached, sizes from {} skipped", layer.name(), fmt_size(size));
            }
        }
        let active: Vec<usize> = (0..layers.len()).filter(|&i| !capped[i]).collect();
        if active.is_empty() {
            break;
        }
        let iters = lat_iters(args, size);
        let warmup = args.warmup.min(iters);
        let count = stream_count(args, size);
        let (lat_rounds, stream_rounds) = (args.rounds.min(iters), args.rounds.min(count));
        let mut tallies: Vec<Tally> = active
            .iter()
            .map(|_| Tally {
                hist: Histogram::new(3).expect("histogram"),
                round_medians: Vec::new(),
                round_p99s: Vec::new(),
                bytes: 0.0,
                secs: 0.0,
                cpu: 0.0,
            })
            .collect();
        // UCX's transport sets for this size (latency, stream), chosen in its first round.
        let mut ucx_tls: (Option<String>, Option<String>) = (None, None);
        // Beside a peer, every layer's blocks are as long as the peer's, each after as long a
        // warm-up (a tenth): the same conditions for all (a block of ours also starts after
        // other layers ran, cold).
        let peers_in_run = active.iter().any(|&i| layers[i].is_peer());
        for r in 0..lat_rounds.max(stream_rounds) {
            for (t, &i) in tallies.iter_mut().zip(&active) {
                if r == 0 {
                    progress(layers[i], size);
                }
                let started = Instant::now();
                let fail = |e: String| format!("client, {}: {e}", layers[i].name());
                if layers[i].is_peer() {
                    let cpus = (!args.no_pin).then(|| (args.cpus[0], args.cpus.get(1).copied().unwrap_or(0)));
                    // UCX at its best: each block long enough for its steady state (its own
                    // warm-up excluded), with the better of its transport sets.
                    if r < lat_rounds {
                        let n = share(iters, lat_rounds, r).max(UCX_MIN_ROUND_TRIPS);
                        let warm = warmup.div_ceil(lat_rounds).max(n / 10);
                        let block = Block::Latency { link: i, size, round_trips: 0 };
                        let run = |tls: &mut Option<String>| run_peer(layers[i], true, size, n, warm, cpus, tls);
                        let got = peer_latency_block(layers[i], size, cpus, links, block, &mut ucx_tls.0, run)
                            .map_err(fail)?;
                        let p50 = (got.p50_us * 1e3).round().max(1.0) as u64;
                        t.hist.record_n(p50, n).ok();
                        t.round_medians.push(p50);
                        t.round_p99s.extend(got.p99_us.map(|us| (us * 1e3).round() as u64));
                    }
                    if r < stream_rounds {
                        let messages = peer_stream_messages(size, share(count, stream_rounds, r));
                        let block = Block::Stream { link: i, size, messages };
                        let warm = messages / 10;
                        let got = ucx_block(block, links, || {
                            run_peer(layers[i], false, size, messages, warm, cpus, &mut ucx_tls.1)
                        })
                        .map_err(fail)?;
                        let bytes = (messages * size as u64) as f64;
                        t.bytes += bytes;
                        t.secs += bytes / (got.gbps * 1e9).max(1.0);
                    }
                    spent[i] += started.elapsed();
                    continue;
                }
                if r < lat_rounds {
                    // Every block warms up again: the other layers ran in between. Beside a
                    // peer, as long as the peer's block and its warm-up.
                    let (mut warm, mut n) = (warmup.div_ceil(lat_rounds), share(iters, lat_rounds, r));
                    if peers_in_run {
                        n = n.max(UCX_MIN_ROUND_TRIPS);
                        warm = warm.max(n / 10);
                    }
                    Block::Latency { link: i, size, round_trips: warm + n }
                        .announce(links[0].as_mut())
                        .map_err(fail)?;
                    let mut samples = latency_block(links[i].as_mut(), &clock, size, warm, n).map_err(fail)?;
                    if let Some(dir) = &args.samples {
                        write_samples(dir, layers[i], size, r, &samples)?;
                    }
                    for &s in &samples {
                        t.hist.record(s).ok();
                    }
                    t.round_p99s.push(quantile(&mut samples, 0.99));
                    t.round_medians.push(median(&mut samples));
                }
                if r < stream_rounds {
                    let mut messages = share(count, stream_rounds, r);
                    if peers_in_run {
                        messages = peer_stream_messages(size, messages);
                        let warm = (messages / 10).max(1);
                        Block::Stream { link: i, size, messages: warm }.announce(links[0].as_mut()).map_err(fail)?;
                        links[i].send_stream(size, warm).map_err(fail)?;
                        links[i].recv(CONTROL).map_err(fail)?;
                    }
                    Block::Stream { link: i, size, messages }.announce(links[0].as_mut()).map_err(fail)?;
                    let link = links[i].as_mut();
                    let cpu0 = benches::cpu_seconds(false);
                    let clock = Instant::now();
                    link.send_stream(size, messages).map_err(fail)?;
                    link.recv(CONTROL).map_err(fail)?; // the server's acknowledgement, with its CPU time
                    t.secs += clock.elapsed().as_secs_f64();
                    t.cpu += benches::cpu_seconds(false) - cpu0 + link.get()[0] as f64 * 1e-9;
                    t.bytes += (messages * size as u64) as f64;
                }
                spent[i] += started.elapsed();
            }
        }
        let rounds_of =
            |layer: Layer| active.iter().position(|&i| layers[i] == layer).map(|k| tallies[k].round_medians.clone());
        let (raw, ucx) = (rounds_of(Layer::RawSend), rounds_of(Layer::Ucx));
        for (t, &i) in tallies.iter_mut().zip(&active) {
            // Median over the rounds of this layer's round median minus the reference's.
            let minus = |reference: &Option<Vec<u64>>, layer: Layer| {
                reference.as_ref().filter(|_| layers[i] != layer).map(|reference| {
                    let mut d: Vec<i64> =
                        t.round_medians.iter().zip(reference).map(|(&a, &b)| a as i64 - b as i64).collect();
                    median(&mut d) as f64 / 1e3
                })
            };
            let (minus_raw_us, minus_ucx_us) = (minus(&raw, Layer::RawSend), minus(&ucx, Layer::Ucx));
            let ours = !layers[i].is_peer();
            out.push(Point {
                layer: layers[i],
                size,
                median_us: t.hist.value_at_quantile(0.5) as f64 / 1e3,
                // The median of the rounds' 99th percentiles, for every layer alike: a peer
                // reports no samples to pool.
                p99_us: (!t.round_p99s.is_empty()).then(|| median(&mut t.round_p99s) as f64 / 1e3),
                gbps: t.bytes / t.secs.max(1e-9) / 1e9,
                // CPU time of both processes during the stream (the server reports its own).
                mb_per_cpu_s: ours.then(|| t.bytes / 1e6 / t.cpu.max(1e-9)),
                minus_raw_us,
                minus_ucx_us,
            });
        }
    }
    Block::Done.announce(links[0].as_mut()).map_err(|e| format!("client, ending the run: {e}"))?;
    Ok(out)
}

/// Times a peer's latency block whose median came out below the cache-line floor is run again.
const PEER_RETRIES_BELOW_FLOOR: u32 = 2;

/// A peer's latency block (`run`, with the point's transport set), run again while its median
/// falls below the cache-line floor measured just before it: a one-way message moves at least
/// one cache line between the two CPUs, so such a median measured something else
/// (`ucx_perftest` reported some now and then, 4-5x below its neighbours).
fn peer_latency_block(
    layer: Layer,
    size: usize,
    cpus: Option<(usize, usize)>,
    links: &mut [Box<dyn Link>],
    block: Block,
    tls: &mut Option<String>,
    mut run: impl FnMut(&mut Option<String>) -> Result<PeerResult, String>,
) -> Result<PeerResult, String> {
    let mut retries = 0;
    loop {
        let floor = floor_now(cpus);
        let got = ucx_block(block, links, || run(tls))?;
        match floor {
            Some(f) if got.p50_us * 1e3 < f => {
                let again = retries < PEER_RETRIES_BELOW_FLOOR;
                let what = if again { "run again" } else { "kept" };
                log::warn!(
                    "{} {size} B: median {:.3} us below the cache-line floor ({f:.0} ns): {what}",
                    layer.name(),
                    got.p50_us
                );
                if !again {
                    return Ok(got);
                }
                retries += 1;
            }
            _ => return Ok(got),
        }
    }
}

/// The cache-line floor (ns one way) between the client's and the server's CPUs now, while
/// both our processes sleep; none unpinned or on one CPU. (Not asked of
/// `available_parallelism`: the client is pinned by now, so it says one.) The lowest of four
/// short measures (a few milliseconds in all): a check against a floor must not overstate it,
/// and an interrupt in one raises it.
fn floor_now(cpus: Option<(usize, usize)>) -> Option<f64> {
    let (a, b) = cpus.filter(|(a, b)| a != b)?;
    (0..4).map(|_| cacheline_one_way_ns_over(a, b, 5_000)).reduce(f64::min)
}

/// Writes one latency block's samples for `--samples`.
fn write_samples(dir: &std::path::Path, layer: Layer, size: usize, round: u64, samples: &[u64]) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join(format!("{}-{size}-{round}.txt", layer.name()));
    let text: String = samples.iter().map(|s| format!("{s}\n")).collect();
    std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))
}

/// One block of a peer's own benchmark (`layer` is `ucx`, `mpi` or `libfabric`): a ping-pong
/// of `n` round trips (`latency`) or a stream of `n` messages, after `warm`. UCX's transport
/// set is chosen in a point's first block and kept in `ucx_tls` for its later ones.
fn run_peer(
    layer: Layer,
    latency: bool,
    size: usize,
    n: u64,
    warm: u64,
    cpus: Option<(usize, usize)>,
    ucx_tls: &mut Option<String>,
) -> Result<PeerResult, String> {
    let test = if latency { "lat" } else { "bw" };
    match layer {
        Layer::Mpi => return CPeer::Mpi.run(test, size, n, warm, cpus),
        Layer::Libfabric => return CPeer::Libfabric.run(test, size, n, warm, cpus),
        _ => {}
    }
    let test = if latency { "tag_lat" } else { "tag_bw" };
    let first = ucx_tls.is_none();
    let (got, tls) = run_ucx_best(test, size, n, warm, cpus, ucx_tls)?;
    if first {
        log::info!("ucx {size} B {test}: best with UCX_TLS={tls}");
    }
    if !latency {
        return Ok(PeerResult { p50_us: 0.0, p99_us: None, gbps: got.gbps });
    }
    // ucx_perftest reads one percentile a run: the 99th from a second run of the block.
    let p99 = run_ucx(test, size, n, warm, cpus, &tls, UCX_P99)?;
    Ok(PeerResult { p50_us: got.percentile_us, p99_us: Some(p99.percentile_us), gbps: got.gbps })
}

/// The server's side: serves the blocks the client announces, until it is done.
fn serve(links: &mut [Box<dyn Link>], layers: &[Layer]) -> Result<(), String> {
    loop {
        links[0].recv(CONTROL).map_err(|e| format!("server, waiting for the next block: {e}"))?;
        let w = links[0].get();
        let fail = |link: usize| move |e: String| format!("server, {}: {e}", layers[link].name());
        let block = Block::decode(w, links.len()).map_err(|e| format!("server: {e}"))?;
        if let Block::Latency { link, .. } | Block::Stream { link, .. } = block {
            if layers[link].is_peer() {
                // The peer's own processes run now: sleep until the client says they are done.
                links[link].recv(CONTROL).map_err(fail(link))?;
                continue;
            }
        }
        match block {
            Block::Done => return Ok(()),
            Block::Latency { link, size, round_trips } => {
                let l = links[link].as_mut();
                for _ in 0..round_trips {
                    l.recv(size).map_err(fail(link))?;
                    l.send(size).map_err(fail(link))?;
                }
            }
            Block::Stream { link, size, messages } => {
                let l = links[link].as_mut();
                let cpu0 = benches::cpu_seconds(false);
                for _ in 0..messages {
                    l.recv(size).map_err(fail(link))?;
                }
                l.put([((benches::cpu_seconds(false) - cpu0) * 1e9) as u64, 0]);
                l.send(CONTROL).map_err(fail(link))?;
            }
        }
    }
}

fn sizes(args: &Args) -> Vec<usize> {
    sizes_between(args.min_size, args.max_size.min(MAX))
}

fn open_ctx(args: &Args) -> Result<Context> {
    Context::open(match args.provider {
        ProviderArg::Software => Provider::Software,
        ProviderArg::Hardware => Provider::Hardware,
    })
}

/// Runs every layer as the server; `addr` is the TCP address of the bootstrap.
fn server_main(args: &Args, addr: &str) -> Result<(), String> {
    let tcp = TcpListener::bind(addr).map_err(|e| format!("listen {addr}: {e}"))?;
    let local = tcp.local_addr().map_err(|e| e.to_string())?;
    // The verbs connection manager listens on the next port.
    let cm_addr = cm::CmAddr::Tcp(std::net::SocketAddr::new(local.ip(), local.port() + 1));
    let listener = cm::Listener::bind(&cm_addr).map_err(|e| format!("verbs bootstrap on {cm_addr}: {e}"))?;
    let ctx = open_ctx(args).map_err(|e| e.to_string())?;
    // Every layer's link is set up first (in the client's order): the blocks then alternate.
    let mut links = Vec::new();
    for &layer in &args.layers {
        // Which process and step failed is what tells a slow start from a lost peer.
        let context = |e: String| format!("server, setting up {}: {e}", layer.name());
        let link: Box<dyn Link> = match layer {
            Layer::RawSend | Layer::RawWwi => Box::new(
                RawLink::setup(
                    &ctx,
                    |pd, spec, p| listener.accept(pd, spec, p, SETUP),
                    layer == Layer::RawWwi,
                    args.wait,
                )
                .map_err(|e| context(e.to_string()))?,
            ),
            Layer::Pipe => Box::new(
                PipeLink::setup(&ctx, |pd, spec, p| listener.accept(pd, spec, p, SETUP), args.wait)
                    .map_err(|e| context(e.to_string()))?,
            ),
            l if l.is_madeleine() => {
                // One host: the shared directory, the client rank 0. Across hosts: the server
                // is rank 0 and serves the root rendezvous on the ports after its own.
                let link = match &args.mad_dir {
                    Some(dir) => mad_link(l, 1, dir.join(l.name()), None, args.in_flight as usize),
                    None => {
                        let root = layer_port(local, &args.layers, l);
                        mad_link(l, 0, PathBuf::new(), Some(root), args.in_flight as usize)
                    }
                };
                Box::new(link.map_err(context)?)
            }
            Layer::Sdp => {
                let at = layer_port(local, &args.layers, layer);
                let l = sockets_compat::SdpListener::bind(at).map_err(|e| context(format!("SDP listen {at}: {e}")))?;
                let (s, _) = l.accept().map_err(|e| context(e.to_string()))?;
                Box::new(StreamLink::new(s, args.wait).map_err(|e| context(e.to_string()))?)
            }
            _ => {
                let (s, _) = tcp.accept().map_err(|e| context(e.to_string()))?;
                let link = if layer.is_peer() { TcpLink::sleeper(s) } else { TcpLink::new(s, args.wait) };
                Box::new(link.map_err(|e| context(e.to_string()))?)
            }
        };
        links.push(link);
    }
    serve(&mut links, &args.layers)
}

/// A layer's own port on the server (a Madeleine layer's root rendezvous across hosts, the
/// SDP layer's listener): the server's address, a port per layer after the bootstrap's two.
fn layer_port(server: std::net::SocketAddr, layers: &[Layer], layer: Layer) -> std::net::SocketAddr {
    let i = layers.iter().position(|&l| l == layer).unwrap_or(0) as u16;
    std::net::SocketAddr::new(server.ip(), server.port() + 2 + i)
}

/// A port that is free, with the next one free too: the bootstrap's and the verbs connection
/// manager's. The kernel picks the first; the second is checked, since an ephemeral socket of
/// another program (a parallel test's connection) may hold it. Both are let go just before the
/// server binds them.
fn free_port_pair() -> Result<u16, String> {
    for _ in 0..64 {
        let first = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("finding a free port: {e}"))?;
        let port = first.local_addr().map_err(|e| e.to_string())?.port();
        if port < u16::MAX && TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
            return Ok(port);
        }
    }
    Err("no two consecutive free ports on 127.0.0.1 in 64 tries".into())
}

fn client_main(args: &Args, addr: &str, child: &mut Option<Child>) -> Result<Vec<Point>, String> {
    let sock: std::net::SocketAddr = addr.parse().map_err(|e| format!("{addr}: {e}"))?;
    let cm_addr = cm::CmAddr::Tcp(std::net::SocketAddr::new(sock.ip(), sock.port() + 1));
    let ctx = open_ctx(args).map_err(|e| e.to_string())?;
    let sizes = sizes(args);
    let total = sizes.len() * args.layers.len();
    let mut done = 0usize;
    let show = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut progress = |layer: Layer, size: usize| {
        done += 1;
        if show {
            let width = 30;
            let filled = done * width / total.max(1);
            eprint!(
                "\r  [{}{}] {:>3}/{total} {:<10} {:>8}   ",
                "#".repeat(filled),
                " ".repeat(width - filled),
                done,
                layer.name(),
                fmt_size(size)
            );
        }
    };
    let mut links = Vec::new();
    for &layer in &args.layers {
        if let Some(c) = child.as_mut() {
            if let Ok(Some(st)) = c.try_wait() {
                return Err(format!("the server process exited ({st})"));
            }
        }
        let context = |e: String| format!("client, setting up {}: {e}", layer.name());
        let link: Box<dyn Link> = match layer {
            Layer::RawSend | Layer::RawWwi => Box::new(
                RawLink::setup(
                    &ctx,
                    |pd, spec, p| cm::connect_retrying(&cm_addr, pd, spec, p, SETUP),
                    layer == Layer::RawWwi,
                    args.wait,
                )
                .map_err(|e| context(e.to_string()))?,
            ),
            Layer::Pipe => Box::new(
                PipeLink::setup(&ctx, |pd, spec, p| cm::connect_retrying(&cm_addr, pd, spec, p, SETUP), args.wait)
                    .map_err(|e| context(e.to_string()))?,
            ),
            l if l.is_madeleine() => {
                let link = match &args.mad_dir {
                    Some(dir) => mad_link(l, 0, dir.join(l.name()), None, args.in_flight as usize),
                    None => {
                        mad_link(l, 1, PathBuf::new(), Some(layer_port(sock, &args.layers, l)), args.in_flight as usize)
                    }
                };
                Box::new(link.map_err(context)?)
            }
            Layer::Sdp => {
                let at = layer_port(sock, &args.layers, layer);
                let deadline = Instant::now() + SETUP;
                let s = loop {
                    match sockets_compat::SdpStream::connect(at) {
                        Ok(s) => break s,
                        Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
                        Err(e) => return Err(context(format!("SDP connect {at}: {e}"))),
                    }
                };
                Box::new(StreamLink::new(s, args.wait).map_err(|e| context(e.to_string()))?)
            }
            _ => {
                let deadline = Instant::now() + SETUP;
                let s = loop {
                    match TcpStream::connect(sock) {
                        Ok(s) => break s,
                        Err(e) if Instant::now() < deadline => {
                            let _ = e;
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        Err(e) => return Err(context(format!("TCP connect: {e}"))),
                    }
                };
                let link = if layer.is_peer() { TcpLink::sleeper(s) } else { TcpLink::new(s, args.wait) };
                Box::new(link.map_err(|e| context(e.to_string()))?)
            }
        };
        links.push(link);
    }
    let points = measure(args, &args.layers, &mut links, &sizes, &mut progress)?;
    if show {
        eprintln!("\r{:70}", "");
    }
    Ok(points)
}

/// `--netns`: the server on one namespace host, the client (which reports) on the other.
fn run_across_namespaces(args: &Args) -> Result<(), String> {
    let hosts = benches::hosts::TwoHosts::new()?;
    let addr = format!("{}:7500", hosts.b.ip);
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let exe = exe.to_str().ok_or("the program's path is not UTF-8")?;
    let mut passed: Vec<String> = std::env::args().skip(1).filter(|a| a != "--netns").collect();
    if !passed.iter().any(|a| a == "--layers" || a.starts_with("--layers=")) {
        passed.push("--layers=raw-send,raw-wwi,pipe,madeleine,tcp".into());
    }
    if args.out.is_none() {
        // The client runs with a private /tmp, but the results folder is relative to the
        // current directory, which it shares.
        let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        passed.push(format!("--out=results/stack-netns-{stamp}"));
    }
    let mut server = benches::hosts::TwoHosts::command(&hosts.b, exe)
        .args(&passed)
        .args(["--role", "server", "--listen", &addr])
        .spawn()
        .map_err(|e| format!("starting the server: {e}"))?;
    let status = benches::hosts::TwoHosts::command(&hosts.a, exe)
        .args(&passed)
        .args(["--role", "client", "--connect", &addr])
        .status()
        .map_err(|e| format!("starting the client: {e}"));
    let server_status = wait_child(&mut server, Duration::from_secs(10));
    if server_status.is_none() {
        let _ = server.kill();
        let _ = server.wait();
    }
    match status? {
        st if st.success() => Ok(()),
        st => Err(format!("the client ended with {st}; the server with {server_status:?}")),
    }
}

fn main() {
    env_logger::init();
    let args = Args::parse();
    if let Err(e) = run(&args) {
        eprintln!("stack_bench: {e}");
        std::process::exit(1);
    }
}

fn run(args: &Args) -> Result<(), String> {
    if args.min_size == 0 || args.min_size > args.max_size || args.max_size > MAX {
        return Err(format!("sizes must satisfy 1 <= --min-size <= --max-size <= {MAX}"));
    }
    if let Some(l) = args.layers.iter().enumerate().find_map(|(i, l)| args.layers[..i].contains(l).then_some(l)) {
        return Err(format!("layer {} given twice", l.name()));
    }
    for (layer, peer) in [(Layer::Mpi, CPeer::Mpi), (Layer::Libfabric, CPeer::Libfabric)] {
        if args.layers.contains(&layer) {
            if args.role == Role::Client {
                return Err(format!(
                    "the {} layer runs on one host only, started by a plain run (drop it with --layers)",
                    layer.name()
                ));
            }
            if let Some(why) = peer.missing().filter(|_| args.role == Role::Both) {
                return Err(why.into());
            }
        }
    }
    if args.layers.contains(&Layer::Ucx) {
        // (A plain run's own server process is started with `--role server`; it only sleeps.)
        if args.role == Role::Client {
            return Err("the ucx layer runs on one host only, started by a plain run (drop it with --layers)".into());
        }
        if args.role == Role::Both && !ucx_perftest_found() {
            return Err("the ucx layer needs ucx_perftest on the PATH (Debian: apt-get install ucx-utils)".into());
        }
    }
    match args.role {
        Role::Server => {
            if !args.no_pin {
                pin_to_cpu(args.cpus.get(1).copied().unwrap_or(0));
            }
            let addr = args.listen.as_deref().ok_or("--role server needs --listen ADDR")?;
            server_main(args, addr)
        }
        Role::Client => {
            let addr = args.connect.clone().ok_or("--role client needs --connect ADDR")?;
            if !args.no_pin {
                pin_to_cpu(args.cpus[0]);
            }
            let points = client_main(args, &addr, &mut None)?;
            report(args, &points, None)
        }
        Role::Both if args.netns => run_across_namespaces(args),
        Role::Both => {
            let ncpu = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
            let floor = (ncpu > 1 && !args.no_pin)
                .then(|| cacheline_one_way_ns(args.cpus[0], args.cpus.get(1).copied().unwrap_or(0)));
            let port = free_port_pair()?;
            let addr = format!("127.0.0.1:{port}");
            let dir = std::env::temp_dir().join(format!("stack-bench-{}", std::process::id()));
            let exe = std::env::current_exe().map_err(|e| e.to_string())?;
            let mut child = Command::new(exe)
                .args(std::env::args().skip(1))
                .args(["--role", "server", "--listen", &addr, "--mad-dir"])
                .arg(&dir)
                .spawn()
                .map_err(|e| format!("starting the server: {e}"))?;
            if !args.no_pin {
                pin_to_cpu(args.cpus[0]);
            }
            let mut args2 = args.clone();
            args2.mad_dir = Some(dir.clone());
            let mut child_opt = Some(child);
            let result = client_main(&args2, &addr, &mut child_opt);
            child = child_opt.take().expect("child");
            let status = wait_child(&mut child, Duration::from_secs(10));
            let _ = std::fs::remove_dir_all(&dir);
            let points = result?;
            if !status.is_some_and(|s| s.success()) {
                return Err(format!("the server process ended badly: {status:?}"));
            }
            report(args, &points, floor)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_round_trip_and_bad_ones_are_refused() {
        for b in [
            Block::Latency { link: 0, size: 1, round_trips: 7 },
            Block::Latency { link: 6, size: MAX, round_trips: u64::MAX },
            Block::Stream { link: 3, size: 4096, messages: 20 },
            Block::Done,
        ] {
            assert_eq!(Block::decode(b.encode(), 7), Ok(b));
        }
        let bad = |b: Block, links| Block::decode(b.encode(), links).unwrap_err();
        assert!(bad(Block::Latency { link: 2, size: 8, round_trips: 1 }, 2).contains("link 2 of 2"));
        assert!(bad(Block::Stream { link: 0, size: MAX + 1, messages: 1 }, 1).contains("4194305-byte"));
        assert!(bad(Block::Stream { link: 0, size: 0, messages: 1 }, 1).contains("0-byte"));
        assert!(Block::decode([9, 0], 1).unwrap_err().contains("unknown block kind 9"));
    }

    #[test]
    fn ucx_perftest_output_is_read_by_column_name_and_bad_output_refused() {
        let out =
            "some banner\niterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr\n\
                   100000,0.180,0.183,0.183,41.69,1000.0,5464179,5464179\n";
        let got = parse_ucx_csv(out, UCX_MEDIAN).unwrap();
        assert_eq!(got.percentile_us, 0.18);
        assert!((got.gbps - 1.048576).abs() < 1e-9, "MiB/s to GB/s: {got:?}");
        let p99 = "iterations,99.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw\n2000,0.745,0.5,0.5,13,13\n";
        assert_eq!(parse_ucx_csv(p99, UCX_P99).unwrap().percentile_us, 0.745);
        assert!(parse_ucx_csv(p99, UCX_MEDIAN).unwrap_err().contains("no 50.0_percentile_lat column"));
        let bad = |out: &str| parse_ucx_csv(out, UCX_MEDIAN).unwrap_err();
        assert!(bad("connect() failed\n").contains("no CSV header"));
        assert!(bad("iterations,overall_bw\n").contains("no CSV values"));
        assert!(bad("iterations,overall_bw\n1,2,3\n").contains("2 CSV columns but 3"));
        assert!(bad("iterations,overall_bw\n1,2\n").contains("no 50.0_percentile_lat column"));
        assert!(bad("iterations,50.0_percentile_lat,overall_bw\n1,x,2\n").contains("not a number"));
        assert!(bad("iterations,50.0_percentile_lat,overall_bw\n1,-1,2\n").contains("out of range"));
    }

    #[test]
    fn quantiles_index_as_the_c_peers_do() {
        let mut v: Vec<u64> = (1..=100).rev().collect();
        assert_eq!(quantile(&mut v, 0.99), 100); // t[n * 99 / 100] of the sorted samples
        assert_eq!(median(&mut v), 51);
        assert_eq!(quantile(&mut [7u64], 0.99), 7);
        let mut few: Vec<u64> = vec![3, 1, 2];
        assert_eq!(quantile(&mut few, 0.99), 3);
    }

    #[test]
    fn shares_add_up_and_differ_by_at_most_one() {
        for (total, parts) in [(10, 3), (2000, 8), (7, 7), (20, 8), (1, 1)] {
            let s: Vec<u64> = (0..parts).map(|r| share(total, parts, r)).collect();
            assert_eq!(s.iter().sum::<u64>(), total);
            assert!(s.iter().max().unwrap() - s.iter().min().unwrap() <= 1);
        }
    }
}
