//! The flow-control benchmark of the SDP slides, on the software provider between two processes:
//! ping-pong latency, streaming bandwidth and receive-buffer utilization per message size for the
//! credit-based, RDMA-based and NIC-assisted (virtual window) strategies; plus the costs of the
//! data-path building blocks (registration-cache hit, pool buffer round trip) and the
//! copy/zero-copy crossover measured for the peer.

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use benches::{cacheline_one_way_ns, fmt_size, pin_to_cpu, sizes_between, wait_child};
use clap::Parser;
use hdrhistogram::Histogram;
use portability_verbs::datapath::{crossover, BufferPool, FlowStrategy, MsgPipe, RegistrationCache};
use portability_verbs::*;

use benches::PeerRole as Role;

/// Flow-control strategies side by side (latency, bandwidth, buffer utilization).
#[derive(Parser, Debug, Clone)]
#[command(version, about)]
struct Args {
    /// Largest message size (at most 16 KiB).
    #[arg(long, default_value_t = 16 * 1024)]
    max_size: usize,
    /// Round trips per latency point.
    #[arg(long, default_value_t = 5_000)]
    iters: u64,
    /// Messages per bandwidth point (at most 64 MiB in all).
    #[arg(long, default_value_t = 50_000)]
    messages: u64,
    /// Do not pin the two processes to CPUs 1 and 0.
    #[arg(long)]
    no_pin: bool,
    #[arg(long, value_enum, default_value_t = Role::Client, hide = true)]
    role: Role,
    #[arg(long, hide = true)]
    addr: Option<String>,
}

const T: Duration = Duration::from_secs(30);
const MAX: usize = 16 * 1024;

/// The strategies, sized to carry messages up to 16 KiB: credits = N/W = 4 as in the slides
/// (64 KiB of receive buffers); the ring needs 128 KiB, as its chunks are at most a quarter
/// of it.
fn strategies() -> [FlowStrategy; 3] {
    [
        FlowStrategy::Credit { buffers: 4, buf_size: MAX + 16 },
        FlowStrategy::Rdma { ring_bytes: 128 * 1024, coalesce: 4096 },
        FlowStrategy::Window { window: MAX + 16, buffers: 4 },
    ]
}

const OP_PING: u8 = b'P';
const OP_STREAM: u8 = b'S';
const OP_END: u8 = b'E';
/// What `MsgPipe::round_trip` sends (the crossover probe): echoed like a ping.
const OP_ROUND_TRIP: u8 = 0x52;

fn connect(role: Role, addr: &cm::CmAddr, strategy: FlowStrategy, listener: Option<&cm::Listener>) -> Result<MsgPipe> {
    let ctx = Context::open_default()?;
    let pd = ctx.alloc_pd()?;
    let spec = cm::QpSpec::with_depths(1024, 1024);
    let conn = match role {
        Role::Server => listener.expect("server listens").accept(&pd, &spec, b"", T)?,
        Role::Client => cm::connect_retrying(addr, &pd, &spec, b"", T)?,
    };
    MsgPipe::establish(conn.qp, conn.cq, &pd, strategy, T)
}

fn serve(args: &Args) -> Result<()> {
    let addr: cm::CmAddr = args.addr.as_deref().unwrap_or_default().parse()?;
    let listener = cm::Listener::bind(&addr)?;
    for s in strategies() {
        let mut pipe = connect(Role::Server, &addr, s, Some(&listener))?;
        let mut scratch = vec![0u8; MAX];
        loop {
            let Some((op, len)) = pipe.recv_with(|m| {
                scratch[..m.len()].copy_from_slice(m);
                (m.first().copied().unwrap_or(0), m.len())
            })?
            else {
                continue;
            };
            match op {
                OP_PING | OP_ROUND_TRIP => {
                    pipe.send(&scratch[..len], T)?;
                    pipe.flush()?;
                }
                OP_STREAM => {}
                OP_END => {
                    let st = pipe.stats();
                    let mut reply = vec![OP_END];
                    reply.extend_from_slice(&st.received_bytes.to_le_bytes());
                    reply.extend_from_slice(&st.buffer_bytes.to_le_bytes());
                    pipe.send(&reply, T)?;
                    pipe.flush()?;
                }
                0 => break, // next strategy
                _ => return Err(VerbsError::Protocol("unknown benchmark op".into())),
            }
        }
        // Let the client see our last acknowledgements before the pipe goes away.
        let until = Instant::now() + Duration::from_millis(20);
        while Instant::now() < until {
            let _ = pipe.progress();
        }
    }
    Ok(())
}

struct Row {
    strategy: &'static str,
    size: usize,
    lat_us: f64,
    p99_us: f64,
    mbps: f64,
    util: f64,
}

/// Named figures printed under the table.
type Notes = Vec<(String, String)>;

fn client(args: &Args, addr: &cm::CmAddr, child: &mut Child) -> Result<(Vec<Row>, Notes)> {
    let mut rows = Vec::new();
    let mut extra = Vec::new();
    for s in strategies() {
        if let Ok(Some(st)) = child.try_wait() {
            return Err(VerbsError::PeerUnreachable(format!("server exited: {st}")));
        }
        let mut pipe = connect(Role::Client, addr, s, None)?;
        if s.name() == "credit" {
            std::env::set_var(
                "PV_CROSSOVER_CACHE",
                std::env::temp_dir().join(format!("pv-fc-bench-{}.tsv", std::process::id())),
            );
            let xo = crossover::for_peer("fc-bench-local", || {
                let mut best = Duration::MAX;
                for _ in 0..200 {
                    best = best.min(pipe.round_trip(T)?);
                }
                Ok(best)
            })?;
            extra.push((
                "copy/zero-copy crossover (this peer)".to_string(),
                format!("{} bytes (round trip {:?}, {:?})", xo.bytes, xo.round_trip, xo.source),
            ));
        }
        let mut prev = (0u64, 0u64);
        for size in sizes_between(1, args.max_size.min(MAX)) {
            let mut msg = vec![0x5au8; size];
            // Latency.
            msg[0] = OP_PING;
            let mut h = Histogram::<u64>::new(3).expect("histogram");
            let warm = args.iters / 10;
            for i in 0..args.iters + warm {
                let t = Instant::now();
                pipe.send(&msg, T)?;
                pipe.flush()?;
                let deadline = Instant::now() + T;
                while pipe.recv_with(|_| ())?.is_none() {
                    if Instant::now() > deadline {
                        return Err(VerbsError::Timeout(T));
                    }
                }
                if i >= warm {
                    h.record((t.elapsed().as_nanos() as u64 / 2).max(1)).ok();
                }
            }
            // Bandwidth: stream, then ask for the receiver's accounting.
            msg[0] = OP_STREAM;
            let count = args.messages.min((64 << 20) / size as u64).max(100);
            let t = Instant::now();
            for _ in 0..count {
                pipe.send(&msg, T)?;
            }
            pipe.send(&[OP_END], T)?;
            pipe.flush()?;
            let reply = pipe.recv(T)?;
            let secs = t.elapsed().as_secs_f64();
            if reply.len() != 17 || reply[0] != OP_END {
                return Err(VerbsError::Protocol("bad end-of-stream reply".into()));
            }
            // The receiver's counters are cumulative: this point's share is the difference.
            let recv_total = u64::from_le_bytes(reply[1..9].try_into().expect("8"));
            let buf_total = u64::from_le_bytes(reply[9..17].try_into().expect("8"));
            let (recv_bytes, buf_bytes) = (recv_total - prev.0, buf_total - prev.1);
            prev = (recv_total, buf_total);
            rows.push(Row {
                strategy: s.name(),
                size,
                lat_us: h.value_at_quantile(0.5) as f64 / 1e3,
                p99_us: h.value_at_quantile(0.99) as f64 / 1e3,
                mbps: (count * size as u64) as f64 / secs / 1e6,
                util: recv_bytes as f64 / buf_bytes.max(1) as f64,
            });
        }
        pipe.send(&[0], T)?;
        pipe.flush()?;
        let until = Instant::now() + Duration::from_millis(20);
        while Instant::now() < until {
            let _ = pipe.progress();
        }
    }
    Ok((rows, extra))
}

/// Costs of the building blocks, in-process.
fn micro() -> Result<Notes> {
    let ctx = Context::open(Provider::Software)?;
    let pd = ctx.alloc_pd()?;
    let mut out = Vec::new();
    // Registration-cache hit.
    let cache = RegistrationCache::new(&pd, 1 << 30);
    let buf = vec![0u8; 1 << 20];
    drop(cache.get(&buf, AccessFlags::REMOTE_READ)?);
    let n = 1_000_000;
    let t = Instant::now();
    for _ in 0..n {
        let r = cache.get(std::hint::black_box(&buf[4096..8192]), AccessFlags::REMOTE_READ)?;
        std::hint::black_box(r.lkey());
    }
    out.push((
        "registration-cache hit (get + release)".into(),
        format!("{:.0} ns", t.elapsed().as_nanos() as f64 / n as f64),
    ));
    let miss_t = Instant::now();
    let fresh: Vec<Vec<u8>> = (0..200).map(|_| vec![1u8; 64 * 1024]).collect();
    for b in &fresh {
        drop(cache.get(b, AccessFlags::REMOTE_READ)?);
    }
    out.push((
        "registration (cache miss, 64 KiB)".into(),
        format!("{:.0} ns", miss_t.elapsed().as_nanos() as f64 / 200.0),
    ));
    // Pool: what a small send through the pool adds over a raw send of registered bytes.
    let pool = BufferPool::new(&pd, 256, 64, AccessFlags::NONE)?;
    let t = Instant::now();
    for i in 0..n {
        let idx = pool.acquire_index().expect("free buffer");
        pool.write(idx, 0, &(i as u64).to_le_bytes());
        std::hint::black_box(pool.sge(idx, 8));
        pool.release_index(idx)?;
    }
    out.push((
        "pool path over a raw send, 8 B (acquire, copy, release)".into(),
        format!("{:.0} ns", t.elapsed().as_nanos() as f64 / n as f64),
    ));
    for s in [FlowStrategy::CREDIT, FlowStrategy::RDMA, FlowStrategy::WINDOW] {
        out.push((
            format!("memory per connection end, default {} pipe", s.name()),
            format!(
                "{} KiB (+ the provider's {} KiB QP ring)",
                s.memory_per_end() / 1024,
                SoftConfig::default().ring_bytes / 1024
            ),
        ));
    }
    Ok(out)
}

fn main() {
    env_logger::init();
    let args = Args::parse();
    let r = match args.role {
        Role::Server => {
            if !args.no_pin {
                pin_to_cpu(0);
            }
            serve(&args)
        }
        Role::Client => run(&args),
    };
    if let Err(e) = r {
        eprintln!("fc_bench ({:?}): {e}", args.role);
        std::process::exit(1);
    }
}

fn run(args: &Args) -> Result<()> {
    let micro = micro()?;
    let floor = cacheline_one_way_ns(1, 0);
    let addr_s = format!("unix:{}/pv-fc-bench-{}.sock", std::env::temp_dir().display(), std::process::id());
    let addr: cm::CmAddr = addr_s.parse()?;
    let exe = std::env::current_exe().map_err(|e| VerbsError::Os { context: "current_exe".into(), source: e })?;
    let mut child = Command::new(exe)
        .args(std::env::args().skip(1))
        .args(["--role", "server", "--addr", &addr_s])
        .spawn()
        .map_err(|e| VerbsError::Os { context: "starting the server".into(), source: e })?;
    if !args.no_pin {
        pin_to_cpu(1);
    }
    let result = client(args, &addr, &mut child);
    let status = wait_child(&mut child, Duration::from_secs(10));
    let (rows, extra) = result?;
    if !status.is_some_and(|s| s.success()) {
        return Err(VerbsError::PeerUnreachable(format!("server ended badly: {status:?}")));
    }
    println!(
        "# flow-control strategies over the software provider, two processes (floor: cache line {floor:.0} ns one way)"
    );
    println!(
        "{:>8} {:>9} {:>11} {:>10} {:>11} {:>12}",
        "strategy", "size", "median us", "p99 us", "MB/s", "buffer use"
    );
    for r in &rows {
        println!(
            "{:>8} {:>9} {:>11.3} {:>10.3} {:>11.0} {:>11.1}%",
            r.strategy,
            fmt_size(r.size),
            r.lat_us,
            r.p99_us,
            r.mbps,
            r.util * 100.0
        );
    }
    println!();
    for (k, v) in micro.iter().chain(extra.iter()) {
        println!("# {k}: {v}");
    }
    Ok(())
}
