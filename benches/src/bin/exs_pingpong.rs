//! EXS round trips, as the UNH-EXS slides measure them: a SOCK_SEQPACKET ping-pong between
//! two processes with busy polling and with waiting for notification, threads pinned to CPUs
//! and not, over message sizes; in the same run the provider's raw RDMA write-with-immediate
//! ping-pong (busy-polled, pinned and not) as the floor. Reports the median and 99th
//! percentile one-way time (half the round trip), EXS's difference to raw (the median of the
//! differences of rounds that alternate the two, each round's pair taken in one phase of a
//! host whose speed drifts), and the CPU use of both processes (user and system).
//!
//! Pinned: this process's thread and completion thread on CPU 0, the peer's on CPU 1.
//! Tables to stdout; CSV and an SVG chart to `--out` (default `results/exs-pingpong-<time>`).
//!
//!     cargo run --release -p benches --bin exs_pingpong

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use benches::exs_peer::{self, cpu_user_sys, exs_connect, raw_connect, take, wait_recv, Peer, Raw, MAX_SIZE};
use benches::plot::{line_chart, Axes, Series};
use benches::{cacheline_one_way_ns, fmt_size, pin_to_cpu, unpin};
use clap::Parser;
use hdrhistogram::Histogram;
use sockets_compat::exs::{EventQueue, ExsSocket, Memory, Tunable};

#[derive(Parser)]
#[command(about = "EXS ping-pong: busy polling against notification, pinned and not, against raw write-with-immediate")]
struct Args {
    /// Message sizes (comma-separated).
    #[arg(long, default_value = "8,64,512,4096,32768", value_delimiter = ',')]
    sizes: Vec<usize>,
    /// Round trips per point (after a tenth as many of warm-up), split over `--rounds`.
    #[arg(long, default_value_t = 20000)]
    iters: usize,
    /// Rounds per point, EXS and raw alternated, so that each EXS-raw difference is taken in
    /// one phase of the host (which changes speed within minutes): the reported difference
    /// is the median of the rounds'.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Round trips per block while waiting for notification (each costs wake-ups).
    #[arg(long, default_value_t = 3000)]
    notify_iters: usize,
    /// Ways of waiting to measure: busy, notify (comma-separated).
    #[arg(long, default_value = "busy,notify", value_delimiter = ',')]
    waits: Vec<String>,
    /// Pinnings to measure: pinned, free (comma-separated).
    #[arg(long, default_value = "pinned,free", value_delimiter = ',')]
    pinnings: Vec<String>,
    /// Where to write results.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Internal: run as the benchmark's far end.
    #[arg(long, hide = true)]
    role: Option<String>,
}

/// One block: one-way times (ns) and CPU use of both processes.
struct Block {
    hist: Histogram<u64>,
    secs: f64,
    user: f64,
    sys: f64,
}

impl Block {
    /// Adds another block's times and CPU use to this one's.
    fn merge(&mut self, other: &Block) -> Result<(), String> {
        self.hist.add(&other.hist).map_err(|e| e.to_string())?;
        (self.secs, self.user, self.sys) = (self.secs + other.secs, self.user + other.user, self.sys + other.sys);
        Ok(())
    }

    fn us(&self, q: f64) -> f64 {
        self.hist.value_at_quantile(q) as f64 / 1000.0
    }
}

struct Links {
    peer: Peer,
    exs: ExsSocket,
    mem: Memory,
    q: EventQueue,
    raw: Raw,
}

fn block(
    peer: &mut Peer,
    cmd: &str,
    iters: usize,
    mut round: impl FnMut() -> Result<(), String>,
) -> Result<Block, String> {
    let warm = (iters / 10).max(10);
    peer.send(&format!("{cmd} {}", iters + warm))?;
    peer.expect("ready")?;
    let mut hist = Histogram::<u64>::new_with_bounds(1, 10_000_000_000, 3).map_err(|e| e.to_string())?;
    for _ in 0..warm {
        round()?;
    }
    let (t0, cpu0) = (Instant::now(), cpu_user_sys());
    for _ in 0..iters {
        let t = Instant::now();
        round()?;
        hist.record((t.elapsed().as_nanos() as u64 / 2).max(1)).map_err(|e| e.to_string())?;
    }
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu_user_sys();
    let (pu, ps) = peer.done()?;
    Ok(Block { hist, secs, user: cpu.0 - cpu0.0 + pu, sys: cpu.1 - cpu0.1 + ps })
}

impl Links {
    fn exs_block(&mut self, size: usize, iters: usize) -> Result<Block, String> {
        let (s, mem, q) = (self.exs.clone(), self.mem.clone(), self.q.clone());
        let e = |e: sockets_compat::exs::ExsError| e.to_string();
        let mut sends = 0usize;
        let b = block(&mut self.peer, &format!("exs-echo {size}"), iters, || {
            s.recv(&q, 0, &mem, 0, size).map_err(e)?;
            s.send(&q, 1, &mem, MAX_SIZE, size).map_err(e)?;
            sends += 1;
            sends -= wait_recv(&q)?;
            Ok(())
        })?;
        take(&self.q, sends)?;
        Ok(b)
    }

    fn raw_block(&mut self, size: usize, iters: usize) -> Result<Block, String> {
        let raw = &self.raw;
        let mut sends = 0usize;
        let b = block(&mut self.peer, &format!("raw-echo {size}"), iters, || {
            raw.post_recv()?;
            raw.write(0, size, true)?;
            sends += 1;
            sends -= raw.wait_recv()?;
            Ok(())
        })?;
        raw.wait(sends)?;
        Ok(b)
    }

    fn setup(&mut self, busy: bool, pinned: bool) -> Result<(), String> {
        let e = |e: sockets_compat::exs::ExsError| e.to_string();
        self.exs.set(Tunable::BusyPoll, i64::from(busy)).map_err(e)?;
        self.peer.send(&format!("busy {}", u8::from(busy)))?;
        self.peer.expect("ok")?;
        if pinned {
            pin_to_cpu(0);
        } else {
            unpin();
        }
        self.exs.set(Tunable::CompletionCpu, if pinned { 0 } else { -1 }).map_err(e)?;
        self.peer.send(if pinned { "pin 1" } else { "pin -1" })?;
        self.peer.expect("ok")?;
        Ok(())
    }
}

fn main() {
    let args = Args::parse();
    exs_peer::run_or_serve("exs_pingpong", args.role.as_deref(), || run(&args));
}

fn run(args: &Args) -> Result<(), String> {
    if args.sizes.iter().any(|&s| s == 0 || s > MAX_SIZE) {
        return Err(format!("sizes 1..={MAX_SIZE}"));
    }
    let mut peer = Peer::start()?;
    let exs = exs_connect(&mut peer, "seq")?;
    let raw = raw_connect(&mut peer)?;
    let mem = Memory::alloc(2 * MAX_SIZE).map_err(|e| e.to_string())?;
    let q = EventQueue::new(64).map_err(|e| e.to_string())?;
    let mut links = Links { peer, exs, mem, q, raw };
    let out = exs_peer::results_dir(args.out.as_deref(), "exs-pingpong")?;
    let mut rows: Vec<PingRow> = Vec::new();
    let mut series = Vec::new();
    println!("EXS SOCK_SEQPACKET ping-pong, one-way (half round trip); raw = write-with-immediate, busy-polled, same pinning");
    println!(
        "{:<8} {:<8} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "waiting", "pinned", "size", "EXS p50us", "EXS p99us", "raw p50us", "EXS-raw", "user%", "sys%"
    );
    let mut target = None;
    for pinned in [true, false] {
        if !args.pinnings.iter().any(|p| p == if pinned { "pinned" } else { "free" }) {
            continue;
        }
        for busy in [true, false] {
            if !args.waits.iter().any(|w| w == if busy { "busy" } else { "notify" }) {
                continue;
            }
            links.setup(busy, pinned)?;
            let mode = if busy { "busy" } else { "notify" };
            let mut points = Vec::new();
            for &size in &args.sizes {
                let rounds = args.rounds.max(1);
                let iters = if busy { args.iters } else { args.notify_iters }.div_ceil(rounds);
                let floor_before = cacheline_one_way_ns(0, 1);
                let mut pairs = Vec::new();
                for _ in 0..rounds {
                    let eb = links.exs_block(size, iters)?;
                    links.setup(true, pinned)?;
                    let rb = links.raw_block(size, args.iters.div_ceil(rounds))?;
                    links.setup(busy, pinned)?;
                    pairs.push((eb, rb));
                }
                let mut diffs: Vec<f64> = pairs.iter().map(|(eb, rb)| eb.us(0.5) - rb.us(0.5)).collect();
                let (mut e, mut r) = pairs.remove(0);
                for (eb, rb) in &pairs {
                    e.merge(eb)?;
                    r.merge(rb)?;
                }
                let floor_after = cacheline_one_way_ns(0, 1);
                diffs.sort_by(f64::total_cmp);
                let diff = diffs[diffs.len() / 2];
                println!(
                    "#   {} rounds, EXS-raw from {:.2} to {:.2} us; cache-line floor {floor_before:.0} ns before, {floor_after:.0} after",
                    rounds,
                    diffs[0],
                    diffs[diffs.len() - 1]
                );
                let row = [e.us(0.5), e.us(0.99), r.us(0.5), diff, e.user / e.secs * 100.0, e.sys / e.secs * 100.0];
                let cells: Vec<String> = row.iter().map(|v| format!("{v:>9.2}")).collect();
                println!("{mode:<8} {pinned:<8} {:>7} {}", fmt_size(size), cells.join(" "));
                let [median_us, p99_us, raw_median_us, minus_raw_us, user_pct, sys_pct] = row;
                rows.push(PingRow {
                    mode: mode.to_string(),
                    pinned,
                    size,
                    median_us,
                    p99_us,
                    raw_median_us,
                    minus_raw_us,
                    user_pct,
                    sys_pct,
                });
                points.push((size as f64, e.us(0.5)));
                if busy && pinned && size == 8 {
                    target = Some(diff);
                }
                std::io::stdout().flush().ok();
            }
            series.push(Series { name: format!("{mode}{}", if pinned { ", pinned" } else { "" }), points });
        }
    }
    if let Some(d) = target {
        println!(
            "target (8 B, busy polling, pinned): EXS - raw = {d:.3} us (<= 0.1: {})",
            if d <= 0.1 { "met" } else { "NOT met" }
        );
    }
    benches::results::write_csv(&out.join("exs_pingpong.csv"), &rows).map_err(|e| e.to_string())?;
    let settings = serde_json::json!({ "iters": args.iters, "notify_iters": args.notify_iters, "rounds": args.rounds });
    benches::results::write_json(&out.join("results.json"), &settings, &rows).map_err(|e| e.to_string())?;
    let chart = line_chart(
        &Axes { title: "EXS one-way latency (us, median)", x_label: "message size", x_sizes: true, log_y: true },
        &series,
    );
    std::fs::write(out.join("latency.svg"), chart).map_err(|e| e.to_string())?;
    println!("results in {}", out.display());
    Ok(())
}

/// One row of the results: EXS against raw write-with-immediate at one size, waiting mode and
/// pinning.
#[derive(serde::Serialize)]
struct PingRow {
    mode: String,
    pinned: bool,
    size: usize,
    median_us: f64,
    p99_us: f64,
    raw_median_us: f64,
    minus_raw_us: f64,
    user_pct: f64,
    sys_pct: f64,
}
