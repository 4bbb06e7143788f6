//! EXS throughput and CPU use, as the UNH-EXS slides measure it: one sender keeps D messages
//! of S bytes outstanding to a receiver that keeps D receives posted, over message sizes (4 KiB
//! to 4 MiB) x outstanding messages (1, 2, 4, 8, 16). In the same run and the same rounds:
//! the provider's raw RDMA writes (D outstanding, the same sizes, into the same kind of memory:
//! the ceiling) and the SDP designs (BSDP, ZSDP, AZ-SDP) streaming the same sizes (the CPU
//! cost EXS is judged against). CPU use is user and system time of both processes.
//!
//! Two processes, pinned to CPUs 0 and 1; every point is measured `--repeat` times, the
//! transports in turn, and the median kept. Tables to stdout; CSV and SVG charts to `--out`
//! (default `results/exs-blast-<time>`).
//!
//!     cargo run --release -p benches --bin exs_blast

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use benches::exs_peer::{
    self, cpu_user_sys, exs_connect, raw_connect, take, Peer, Raw, MAX_DEPTH, MAX_SIZE, SDP_DESIGNS,
};
use benches::plot::{line_chart, Axes, Series};
use benches::{fmt_size, pin_to_cpu, sizes_between, PageBuf};
use clap::Parser;
use sockets_compat::exs::{EventQueue, ExsSocket, Memory};
use sockets_compat::{SdpConfig, SdpStream};

#[derive(Parser)]
#[command(about = "EXS throughput and CPU use against raw RDMA writes and SDP")]
struct Args {
    /// Smallest message.
    #[arg(long, default_value_t = 4096)]
    min_size: usize,
    /// Largest message (at most 4 MiB).
    #[arg(long, default_value_t = 4 << 20)]
    max_size: usize,
    /// Messages outstanding (comma-separated, at most 16).
    #[arg(long, default_value = "1,2,4,8,16", value_delimiter = ',')]
    depths: Vec<usize>,
    /// Bytes of the probe that sizes each point's measurements.
    #[arg(long, default_value_t = 64 << 20)]
    volume: usize,
    /// Seconds per measurement (CPU times are kept per scheduler tick: short windows would
    /// report noise).
    #[arg(long, default_value_t = 0.25)]
    seconds: f64,
    /// Measurements per point (median kept).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// EXS socket type: seq or stream.
    #[arg(long, default_value = "seq")]
    kind: String,
    /// Skip the SDP comparison.
    #[arg(long)]
    no_sdp: bool,
    /// Where to write results.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Internal: run as the benchmark's far end.
    #[arg(long, hide = true)]
    role: Option<String>,
}

/// One measurement: seconds, and CPU seconds (user, system) of both processes together.
#[derive(Clone, Copy, Debug, Default)]
struct Run {
    secs: f64,
    user: f64,
    sys: f64,
    bytes: f64,
}

impl Run {
    fn gbps(&self) -> f64 {
        self.bytes / self.secs / 1e9
    }
    fn cpu_per_gb(&self) -> f64 {
        (self.user + self.sys) / (self.bytes / 1e9)
    }
    fn pct(&self, v: f64) -> f64 {
        v / self.secs * 100.0
    }
}

fn median(mut v: Vec<Run>) -> Run {
    v.sort_by(|a, b| a.gbps().total_cmp(&b.gbps()));
    v[v.len() / 2]
}

fn finish(peer: &mut Peer, t0: Instant, cpu0: (f64, f64), bytes: usize) -> Result<Run, String> {
    let (pu, ps) = peer.done()?;
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu_user_sys();
    Ok(Run { secs, user: cpu.0 - cpu0.0 + pu, sys: cpu.1 - cpu0.1 + ps, bytes: bytes as f64 })
}

/// What the measurements run over.
struct Links {
    peer: Peer,
    exs: ExsSocket,
    kind: String,
    tx: Memory,
    q: EventQueue,
    raw: Raw,
}

impl Links {
    fn exs_point(&mut self, size: usize, depth: usize, count: usize) -> Result<Run, String> {
        let (s, tx, q) = (&self.exs, &self.tx, &self.q);
        self.peer.send(&format!("exs-sink {} {size} {depth} {count}", self.kind))?;
        self.peer.expect("ready")?;
        let (t0, cpu0) = (Instant::now(), cpu_user_sys());
        let e = |e: sockets_compat::exs::ExsError| e.to_string();
        let mut sent = 0;
        while sent < depth.min(count) {
            s.send(q, sent as u64, tx, (sent % depth) * MAX_SIZE, size).map_err(e)?;
            sent += 1;
        }
        let mut done = 0;
        while done < count {
            take(q, 1)?;
            done += 1;
            if sent < count {
                s.send(q, sent as u64, tx, (sent % depth) * MAX_SIZE, size).map_err(e)?;
                sent += 1;
            }
        }
        finish(&mut self.peer, t0, cpu0, size * count)
    }

    fn raw_point(&mut self, size: usize, depth: usize, count: usize) -> Result<Run, String> {
        let raw = &self.raw;
        self.peer.send("raw-sink")?;
        self.peer.expect("ready")?;
        let (t0, cpu0) = (Instant::now(), cpu_user_sys());
        let mut sent = 0;
        while sent < depth.min(count) {
            raw.write(sent % depth, size, sent + 1 == count)?;
            sent += 1;
        }
        let mut done = 0;
        while done < count {
            raw.wait(1)?;
            done += 1;
            if sent < count {
                raw.write(sent % depth, size, sent + 1 == count)?;
                sent += 1;
            }
        }
        finish(&mut self.peer, t0, cpu0, size * count)
    }

    fn sdp_point(&mut self, design: usize, size: usize, count: usize) -> Result<Run, String> {
        let d = SDP_DESIGNS[design];
        self.peer.send(&format!("sdp-sink {} {size}", d.name()))?;
        self.peer.expect("ready")?;
        let cfg = SdpConfig { design: d, ..SdpConfig::default() };
        let buf = PageBuf::new(size, 7);
        let (t0, cpu0) = (Instant::now(), cpu_user_sys());
        let mut c =
            SdpStream::connect_with(("127.0.0.1", self.peer.ports.sdp[design]), cfg).map_err(|e| e.to_string())?;
        for _ in 0..count {
            c.write_all(&buf).map_err(|e| e.to_string())?;
        }
        drop(c);
        finish(&mut self.peer, t0, cpu0, size * count)
    }
}

/// Messages for a measurement of about `seconds` at the rate `probe` saw (at least 8).
fn count_for(probe: &Run, size: usize, seconds: f64) -> usize {
    ((probe.bytes / probe.secs * seconds) as usize / size).max(8)
}

fn main() {
    let args = Args::parse();
    exs_peer::run_or_serve("exs_blast", args.role.as_deref(), || run(&args));
}

fn run(args: &Args) -> Result<(), String> {
    if args.max_size > MAX_SIZE || args.depths.iter().any(|&d| d == 0 || d > MAX_DEPTH) {
        return Err(format!("sizes up to {MAX_SIZE}, depths 1..={MAX_DEPTH}"));
    }
    let mut peer = Peer::start()?;
    pin_to_cpu(0);
    peer.send("pin 1")?;
    peer.expect("ok")?;
    let kind = args.kind.as_str();
    let exs = exs_connect(&mut peer, kind)?;
    let raw = raw_connect(&mut peer)?;
    let tx = Memory::alloc(MAX_SIZE * MAX_DEPTH).map_err(|e| e.to_string())?;
    let q = EventQueue::new(2 * MAX_DEPTH).map_err(|e| e.to_string())?;
    let mut links = Links { peer, exs, kind: kind.to_string(), tx, q, raw };
    let out = exs_peer::results_dir(args.out.as_deref(), "exs-blast")?;
    let mut rows: Vec<BlastRow> = Vec::new();
    let mut sdp_rows: Vec<SdpRow> = Vec::new();
    let mut exs_series: Vec<Series> =
        args.depths.iter().map(|d| Series { name: format!("EXS {d} out"), points: vec![] }).collect();
    let mut raw_series: Vec<Series> =
        args.depths.iter().map(|d| Series { name: format!("raw {d} out"), points: vec![] }).collect();
    let mut cpu_series: Vec<Series> =
        args.depths.iter().map(|d| Series { name: format!("EXS {d} out"), points: vec![] }).collect();
    let mut sdp_cpu: Vec<Series> =
        SDP_DESIGNS.iter().map(|d| Series { name: format!("SDP {}", d.name()), points: vec![] }).collect();
    println!(
        "EXS ({kind}) blast: {} per point, median of {}; CPU: user+system of both processes",
        fmt_size(args.volume),
        args.repeat
    );
    println!(
        "{:>8} {:>4} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "size", "out", "EXS GB/s", "raw GB/s", "EXS/raw", "EXS CPUs/GB", "user%", "sys%", "raw CPUs/GB"
    );
    let mut sdp_best_at = std::collections::BTreeMap::new();
    for size in sizes_between(args.min_size, args.max_size) {
        let probe_count = (args.volume / size).max(8);
        for (di, &depth) in args.depths.iter().enumerate() {
            let (mut e, mut r) = (Vec::new(), Vec::new());
            let ce = count_for(&links.exs_point(size, depth, probe_count)?, size, args.seconds);
            let cr = count_for(&links.raw_point(size, depth, probe_count)?, size, args.seconds);
            for _ in 0..args.repeat {
                e.push(links.exs_point(size, depth, ce)?);
                r.push(links.raw_point(size, depth, cr)?);
            }
            let (e, r) = (median(e), median(r));
            let row =
                [e.gbps(), r.gbps(), e.gbps() / r.gbps(), e.cpu_per_gb(), e.pct(e.user), e.pct(e.sys), r.cpu_per_gb()];
            let cells: Vec<String> = row.iter().map(|v| format!("{v:>9.3}")).collect();
            println!("{:>8} {:>4} {}", fmt_size(size), depth, cells.join(" "));
            let [exs_gbps, raw_gbps, exs_over_raw, exs_cpu_s_per_gb, exs_user_pct, exs_sys_pct, raw_cpu_s_per_gb] = row;
            rows.push(BlastRow {
                size,
                depth,
                exs_gbps,
                raw_gbps,
                exs_over_raw,
                exs_cpu_s_per_gb,
                exs_user_pct,
                exs_sys_pct,
                raw_cpu_s_per_gb,
            });
            exs_series[di].points.push((size as f64, e.gbps()));
            raw_series[di].points.push((size as f64, r.gbps()));
            cpu_series[di].points.push((size as f64, e.cpu_per_gb()));
        }
        if !args.no_sdp {
            let mut best = f64::MAX;
            for (i, d) in SDP_DESIGNS.iter().enumerate() {
                let count = count_for(&links.sdp_point(i, size, probe_count)?, size, args.seconds);
                let runs: Result<Vec<Run>, String> =
                    (0..args.repeat).map(|_| links.sdp_point(i, size, count)).collect();
                let m = median(runs?);
                println!(
                    "{:>8}      SDP {:<6} {:>7.2} GB/s {:>10.3} CPUs/GB {:>6.1} user% {:>6.1} sys%",
                    fmt_size(size),
                    d.name(),
                    m.gbps(),
                    m.cpu_per_gb(),
                    m.pct(m.user),
                    m.pct(m.sys)
                );
                sdp_rows.push(SdpRow {
                    size,
                    design: d.name().to_string(),
                    gbps: m.gbps(),
                    cpu_s_per_gb: m.cpu_per_gb(),
                    user_pct: m.pct(m.user),
                    sys_pct: m.pct(m.sys),
                });
                sdp_cpu[i].points.push((size as f64, m.cpu_per_gb()));
                best = best.min(m.cpu_per_gb());
            }
            sdp_best_at.insert(size, best);
        }
        std::io::stdout().flush().ok();
    }
    // The targets: 4 outstanding messages of 512 KiB.
    if let Some(row) = rows.iter().find(|r| r.size == 512 << 10 && r.depth == 4) {
        let sdp = sdp_best_at.get(&(512 << 10)).copied();
        println!(
            "target (4 x 512 KiB): EXS/raw {:.2} (>= 0.90: {}); EXS {:.3} CPU-s/GB against SDP's best {} ({})",
            row.exs_over_raw,
            if row.exs_over_raw >= 0.9 { "met" } else { "NOT met" },
            row.exs_cpu_s_per_gb,
            sdp.map_or("not measured".into(), |v| format!("{v:.3}")),
            sdp.map_or("-", |v| if row.exs_cpu_s_per_gb < v { "met" } else { "NOT met" })
        );
    }
    let w = |name: &str, body: String| std::fs::write(out.join(name), body).map_err(|e| e.to_string());
    benches::results::write_csv(&out.join("exs_blast.csv"), &rows).map_err(|e| e.to_string())?;
    benches::results::write_csv(&out.join("sdp.csv"), &sdp_rows).map_err(|e| e.to_string())?;
    let settings = serde_json::json!({ "kind": kind, "volume": args.volume, "repeat": args.repeat });
    let results = serde_json::json!({ "exs": rows, "sdp": sdp_rows });
    benches::results::write_json(&out.join("results.json"), &settings, &results).map_err(|e| e.to_string())?;
    let mut bw = exs_series;
    bw.extend(raw_series);
    w(
        "throughput.svg",
        line_chart(
            &Axes {
                title: "EXS and raw RDMA write throughput (GB/s)",
                x_label: "message size",
                x_sizes: true,
                log_y: false,
            },
            &bw,
        ),
    )?;
    let mut cpu = cpu_series;
    cpu.extend(sdp_cpu);
    w(
        "cpu.svg",
        line_chart(
            &Axes { title: "CPU seconds per GB, both processes", x_label: "message size", x_sizes: true, log_y: true },
            &cpu,
        ),
    )?;
    println!("results in {}", out.display());
    Ok(())
}

/// One row of the EXS results: EXS against raw RDMA writes at one size and depth.
#[derive(serde::Serialize)]
struct BlastRow {
    size: usize,
    depth: usize,
    exs_gbps: f64,
    raw_gbps: f64,
    exs_over_raw: f64,
    exs_cpu_s_per_gb: f64,
    exs_user_pct: f64,
    exs_sys_pct: f64,
    raw_cpu_s_per_gb: f64,
}

/// One row of the SDP comparison.
#[derive(serde::Serialize)]
struct SdpRow {
    size: usize,
    design: String,
    gbps: f64,
    cpu_s_per_gb: f64,
    user_pct: f64,
    sys_pct: f64,
}
