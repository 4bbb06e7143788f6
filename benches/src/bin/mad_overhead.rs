//! Madeleine's CPU cost per small message over the message pipe it runs on: one thread plays
//! a ping-pong between two sessions of the same process (packs a message on one, unpacks it
//! on the other, and back), then the same through a bare pipe pair (header and payload of the
//! same size), so no cross-core transfer or wait is measured, only instructions, locks and
//! cache-resident copies. What this adds to the
//! pipe is what Madeleine adds to a ping-pong's one-way latency on both sides of the wire
//! together (`stack_bench` measures that latency between processes).

use std::time::{Duration, Instant};

use clap::Parser;
use madeleine::{RecvMode, SendMode, Session, SessionConfig};
use portability_verbs::datapath::{FlowStrategy, MsgPipe};
use portability_verbs::*;

/// Per-message CPU cost of Madeleine and of the bare message pipe, side by side.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Pack size (bytes; small: the path of latency-bound messages).
    #[arg(long, default_value_t = 8)]
    size: usize,
    /// Messages per round.
    #[arg(long, default_value_t = 500_000)]
    messages: u64,
    /// Rounds per layer; the best is reported (this machine is noisy).
    #[arg(long, default_value_t = 7)]
    rounds: u32,
    /// Measure Madeleine only (for a profiler).
    #[arg(long, conflicts_with = "pipe_only")]
    madeleine_only: bool,
    /// Measure the pipe only (for a profiler).
    #[arg(long)]
    pipe_only: bool,
}

const T: Duration = Duration::from_secs(30);

/// Bytes Madeleine puts around a message of one pack of `size` bytes (a `One` header when it
/// goes whole, else `Begin`, `Inline` and `End`), for the pipe to carry the same.
fn mad_headers(size: usize) -> usize {
    use madeleine::wire::{HEADER, ONE_HEADER, WHOLE_MAX};
    if size + ONE_HEADER <= WHOLE_MAX {
        ONE_HEADER
    } else {
        3 * HEADER
    }
}

/// Best time per message of `rounds` rounds of `messages` messages, sent by `one(true)`
/// (there) and `one(false)` (back) in turn.
fn best_of(rounds: u32, messages: u64, mut one: impl FnMut(bool) -> Result<(), String>) -> Result<f64, String> {
    let mut best = f64::MAX;
    for _ in 0..rounds {
        let t = Instant::now();
        for i in 0..messages {
            one(i % 2 == 0)?;
        }
        best = best.min(t.elapsed().as_nanos() as f64 / messages as f64);
    }
    Ok(best)
}

fn madeleine_cost(args: &Args) -> Result<f64, String> {
    let dir = std::env::temp_dir().join(format!("mad-overhead-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let cfg = |rank| {
        let mut c = SessionConfig::new(rank, 2, &dir);
        c.timeout = T;
        c
    };
    // Each rank's set-up runs while the other's does (ours first, then the join), as the
    // rendezvous may need both.
    let (s0, s1) = std::thread::scope(|sc| {
        let h = sc.spawn(|| Session::new(cfg(1)));
        let s0 = Session::new(cfg(0));
        (s0, h.join().expect("session thread"))
    });
    let (s0, s1) = (s0.map_err(|e| e.to_string())?, s1.map_err(|e| e.to_string())?);
    let (c0, c1) = std::thread::scope(|sc| {
        let h = sc.spawn(|| s1.channel());
        (s0.channel(), h.join().expect("channel thread"))
    });
    let (c0, c1) = (c0.map_err(|e| e.to_string())?, c1.map_err(|e| e.to_string())?);
    let _ = std::fs::remove_dir_all(&dir);
    let buf = vec![7u8; args.size];
    let mut rbuf = vec![0u8; args.size];
    let e = |e: madeleine::MadError| e.to_string();
    best_of(args.rounds, args.messages, |there| {
        let ((from, from_rank), (to, to_rank)) = if there { ((&c0, 0), (&c1, 1)) } else { ((&c1, 1), (&c0, 0)) };
        let mut p = from.begin_packing(to_rank).map_err(e)?;
        p.pack(&buf, SendMode::Cheaper, RecvMode::Cheaper).map_err(e)?;
        p.end_packing().map_err(e)?;
        let mut u = to.begin_unpacking_from(from_rank).map_err(e)?;
        u.unpack(&mut rbuf, SendMode::Cheaper, RecvMode::Cheaper).map_err(e)?;
        u.end_unpacking().map_err(e)
    })
}

fn pipe_cost(args: &Args) -> Result<f64, String> {
    let e = |e: VerbsError| e.to_string();
    let ctx = Context::open(Provider::Software).map_err(e)?;
    let pd = ctx.alloc_pd().map_err(e)?;
    let (ca, cb) = (ctx.create_cq(1024).map_err(e)?, ctx.create_cq(1024).map_err(e)?);
    let a = pd.create_qp(&QpInit::new(&ca)).map_err(e)?;
    let b = pd.create_qp(&QpInit::new(&cb)).map_err(e)?;
    a.connect_to(b.endpoint()).map_err(e)?;
    b.connect_to(a.endpoint()).map_err(e)?;
    let s = FlowStrategy::WINDOW;
    let (pa, pb) = std::thread::scope(|sc| {
        let h = sc.spawn(|| MsgPipe::establish(b, cb, &pd, s, T));
        (MsgPipe::establish(a, ca, &pd, s, T), h.join().expect("pipe thread"))
    });
    let (mut pa, mut pb) = (pa.map_err(e)?, pb.map_err(e)?);
    let buf = vec![7u8; args.size + mad_headers(args.size)];
    let mut rbuf = vec![0u8; args.size + mad_headers(args.size)];
    // Both ends are driven here, so a message is there at once: a retry means something broke.
    best_of(args.rounds, args.messages, |there| {
        let (from, to) = if there { (&mut pa, &mut pb) } else { (&mut pb, &mut pa) };
        if !from.try_send(&buf).map_err(e)? {
            from.progress().map_err(e)?;
            if !from.try_send(&buf).map_err(e)? {
                return Err("pipe: no room to send".into());
            }
        }
        match to.recv_with(|m| rbuf.copy_from_slice(m)).map_err(e)? {
            Some(()) => Ok(()),
            None => Err("pipe: the message did not arrive".into()),
        }
    })
}

fn main() {
    env_logger::init();
    let args = Args::parse();
    let run = || -> Result<(), String> {
        if args.madeleine_only {
            println!("madeleine  {:7.1} ns per message (send + receive)", madeleine_cost(&args)?);
            return Ok(());
        }
        if args.pipe_only {
            println!("pipe       {:7.1} ns per message (send + receive)", pipe_cost(&args)?);
            return Ok(());
        }
        let pipe = pipe_cost(&args)?;
        let mad = madeleine_cost(&args)?;
        println!("# one thread, both ends, {} B packs: best of {} rounds of {}", args.size, args.rounds, args.messages);
        println!(
            "pipe       {pipe:7.1} ns per message (send + receive, {} B with headers)",
            args.size + mad_headers(args.size)
        );
        println!("madeleine  {mad:7.1} ns per message (send + receive)");
        println!("overhead   {:7.1} ns per message", mad - pipe);
        Ok(())
    };
    if let Err(e) = run() {
        eprintln!("mad_overhead: {e}");
        std::process::exit(1);
    }
}
