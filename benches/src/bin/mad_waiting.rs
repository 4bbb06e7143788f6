//! How Madeleine's waiting behaves with one rank per core and with more ranks than cores:
//! ranks pair up (0-1, 2-3, ...) and each pair plays a ping-pong of small messages; rank 0
//! prints the pairs' one-way latency (median and p99 over every round trip of every pair) and
//! the CPU time of all ranks. Started by a launcher, once per waiting policy:
//!
//!     cargo build --release -p benches -p madeleine
//!     for spin in auto 200 0 max; do
//!         MAD_SPIN_US=$spin target/release/madrun -n 4 target/release/mad_waiting
//!     done
//!
//! (`MAD_SPIN_US`: `auto` polls while a CPU is free and sleeps while ranks outnumber the cores;
//! microseconds of polling then sleeping; `max` never sleeps.)

use std::time::{Duration, Instant};

use clap::Parser;
use madeleine::{RecvMode, SendMode, Session, SessionConfig};

/// Pairwise ping-pongs under a launcher, to compare waiting policies.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Message size (bytes).
    #[arg(long, default_value_t = 8)]
    size: usize,
    /// Round trips per pair (after the warm-up).
    #[arg(long, default_value_t = 20_000)]
    iters: usize,
    /// Round trips discarded first.
    #[arg(long, default_value_t = 2_000)]
    warmup: usize,
    /// Microseconds of computation (a dependent arithmetic loop) before each message: the
    /// work that ranks sharing a core take CPU time from each other for.
    #[arg(long, default_value_t = 0.0)]
    compute_us: f64,
    /// Stop measuring a pair after this many seconds (an oversubscribed, spinning run can be
    /// very slow).
    #[arg(long, default_value_t = 20.0)]
    max_seconds: f64,
}

fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// Busy work for `d` (the clock read every 256 steps).
fn compute(d: Duration) {
    if d.is_zero() {
        return;
    }
    let t = Instant::now();
    let mut x = 1u64;
    while t.elapsed() < d {
        for _ in 0..256 {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407));
        }
    }
}

fn main() -> madeleine::Result<()> {
    env_logger::init();
    let args = Args::parse();
    let session = Session::new(SessionConfig::from_env()?)?;
    let ch = session.channel()?;
    let (rank, size) = (session.rank(), session.size());
    if size % 2 != 0 {
        return Err(madeleine::MadError::Invalid("run an even number of ranks (they pair up)".into()));
    }
    let peer = rank ^ 1;
    let leads = rank % 2 == 0;
    let mut buf = vec![rank as u8; args.size];
    let mut one_way_ns: Vec<u64> = Vec::with_capacity(args.iters);
    ch.barrier()?;
    let (cpu0, wall0) = (cpu_seconds(), Instant::now());
    let cap = Duration::from_secs_f64(args.max_seconds);
    let work = Duration::from_secs_f64(args.compute_us * 1e-6);
    let mut i = 0;
    // The leader decides when the pair stops (a flag in its message), so both stop together.
    loop {
        let measuring = i >= args.warmup;
        let go_on = i < args.warmup + args.iters && wall0.elapsed() < cap;
        let t = Instant::now();
        if leads {
            compute(work);
            buf[0] = go_on as u8;
            let mut p = ch.begin_packing(peer)?;
            p.pack(&buf, SendMode::Cheaper, RecvMode::Express)?;
            p.end_packing()?;
            if !go_on {
                break;
            }
            let mut u = ch.begin_unpacking_from(peer)?;
            u.unpack(&mut buf, SendMode::Cheaper, RecvMode::Express)?;
            u.end_unpacking()?;
            if measuring {
                one_way_ns.push(t.elapsed().as_nanos() as u64 / 2);
            }
        } else {
            let mut u = ch.begin_unpacking_from(peer)?;
            u.unpack(&mut buf, SendMode::Cheaper, RecvMode::Express)?;
            u.end_unpacking()?;
            if buf[0] == 0 {
                break;
            }
            compute(work);
            let mut p = ch.begin_packing(peer)?;
            p.pack(&buf, SendMode::Cheaper, RecvMode::Express)?;
            p.end_packing()?;
        }
        i += 1;
    }
    let (cpu, wall) = (cpu_seconds() - cpu0, wall0.elapsed().as_secs_f64());
    // Every rank reports to rank 0: its CPU time, its wall time, its samples.
    let mut report = Vec::with_capacity(16 + 8 * one_way_ns.len());
    report.extend_from_slice(&cpu.to_le_bytes());
    report.extend_from_slice(&wall.to_le_bytes());
    one_way_ns.iter().for_each(|v| report.extend_from_slice(&v.to_le_bytes()));
    if rank != 0 {
        let len = (report.len() as u64).to_le_bytes();
        let mut p = ch.begin_packing(0)?;
        p.pack(&len, SendMode::Cheaper, RecvMode::Express)?;
        p.pack(&report, SendMode::Cheaper, RecvMode::Cheaper)?;
        p.end_packing()?;
        ch.barrier()?;
        return Ok(());
    }
    let (mut cpus, mut walls, mut all) = (vec![cpu], vec![wall], one_way_ns);
    for from in 1..size {
        let mut r = Vec::new();
        let mut u = ch.begin_unpacking_from(from)?;
        let mut len = [0u8; 8];
        u.unpack_express(&mut len, SendMode::Cheaper)?;
        r.resize(u64::from_le_bytes(len) as usize, 0);
        u.unpack(&mut r, SendMode::Cheaper, RecvMode::Cheaper)?;
        u.end_unpacking()?;
        let f = |at: usize| f64::from_le_bytes(r[at..at + 8].try_into().expect("8 bytes"));
        cpus.push(f(0));
        walls.push(f(8));
        all.extend(r[16..].chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))));
    }
    ch.barrier()?;
    all.sort_unstable();
    let pct =
        |p: f64| all.get(((all.len() as f64 * p) as usize).min(all.len().saturating_sub(1))).copied().unwrap_or(0);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let round_trips_per_pair = all.len() as f64 / (size / 2) as f64;
    let wall = walls.iter().copied().fold(0.0, f64::max);
    println!(
        "spin={:<5} ranks={size} cores={cores} size={}B round_trips={} one-way median {:.2} us p99 {:.2} us; \
         {:.2} us a round trip; CPU {:.2} s of {:.2} s wall ({:.0}% of the ranks' time)",
        std::env::var("MAD_SPIN_US").unwrap_or_else(|_| "auto".into()),
        args.size,
        all.len(),
        pct(0.5) as f64 / 1e3,
        pct(0.99) as f64 / 1e3,
        wall * 1e6 / round_trips_per_pair.max(1.0),
        cpus.iter().sum::<f64>(),
        wall,
        100.0 * cpus.iter().sum::<f64>() / (wall * size as f64),
    );
    Ok(())
}
