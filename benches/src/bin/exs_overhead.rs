//! EXS's CPU cost per small message: one thread plays both ends of a SOCK_SEQPACKET
//! connection in one process (no second CPU, no cache line crossing between CPUs), and does
//! a ping-pong's work: at each end a receive and a send, then a wait for the receive's event.
//! What it reports is the work of the layer and the provider per one-way message, the part of
//! `exs_pingpong`'s latency that is not the cache's; run it under `perf record` to see where
//! it goes.
//!
//!     cargo run --release -p benches --bin exs_overhead -- --size 8

use std::time::{Duration, Instant};

use clap::Parser;
use sockets_compat::exs::{EventKind, EventQueue, ExsError, ExsSocket, Memory, SocketKind};

#[derive(Parser)]
#[command(about = "EXS's CPU cost per small message: one thread, both ends, one process")]
struct Args {
    /// Message size in bytes.
    #[arg(long, default_value_t = 8)]
    size: usize,
    /// One-way messages per round.
    #[arg(long, default_value_t = 200_000)]
    messages: usize,
    /// Rounds (the best is reported beside the median), after one of warm-up.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    rounds: u64,
    /// Idle polls per round (0: none measured).
    #[arg(long, default_value_t = 200_000)]
    idle_polls: usize,
}

const LIMIT: Duration = Duration::from_secs(10);

/// Waits for the receive's event on `q`; the send's events are taken on the way.
fn wait_recv(q: &EventQueue, events: &mut Vec<sockets_compat::exs::Event>) -> Result<(), String> {
    loop {
        events.clear();
        q.dequeue_into(events, 4, Some(LIMIT));
        if events.is_empty() {
            return Err("no event within the limit".into());
        }
        let mut got = false;
        for ev in events.iter() {
            ev.outcome.map_err(|e| format!("{:?} failed: errno {e}", ev.kind))?;
            got |= ev.kind == EventKind::Recv;
        }
        if got {
            return Ok(());
        }
    }
}

fn main() -> Result<(), String> {
    env_logger::init();
    let args = Args::parse();
    let e = |e: ExsError| e.to_string();
    let (qa, qb) = (EventQueue::new(1024).map_err(e)?, EventQueue::new(1024).map_err(e)?);
    let listener = ExsSocket::new(SocketKind::SeqPacket).map_err(e)?;
    listener.bind("127.0.0.1:0").map_err(e)?;
    listener.listen(1).map_err(e)?;
    listener.accept(&qb, 0).map_err(e)?;
    let a = ExsSocket::new(SocketKind::SeqPacket).map_err(e)?;
    a.connect(listener.local_addr().ok_or("no address")?, &qa, 0).map_err(e)?;
    let connected = qa.dequeue(1, Some(LIMIT)).pop().ok_or("no connect event")?;
    connected.outcome.map_err(|n| format!("connect: errno {n}"))?;
    let b = qb.dequeue(1, Some(LIMIT)).pop().and_then(|ev| ev.accepted).ok_or("no accept event")?;
    let size = args.size;
    let (ma, mb) = (Memory::alloc(2 * size.max(64)).map_err(e)?, Memory::alloc(2 * size.max(64)).map_err(e)?);
    let mut events = Vec::new();
    // A receive is posted ahead at each end, as a ping-pong's peer has one posted when the
    // message comes; each step then sends and posts the next receive, as the echo does.
    b.recv(&qb, 1, &mb, 0, size).map_err(e)?;
    a.recv(&qa, 1, &ma, 0, size).map_err(e)?;
    let mut per_round = Vec::new();
    for round in 0..=args.rounds {
        let t = Instant::now();
        for _ in 0..args.messages / 2 {
            a.send(&qa, 2, &ma, size, size).map_err(e)?;
            wait_recv(&qb, &mut events)?;
            b.recv(&qb, 1, &mb, 0, size).map_err(e)?;
            b.send(&qb, 2, &mb, size, size).map_err(e)?;
            wait_recv(&qa, &mut events)?;
            a.recv(&qa, 1, &ma, 0, size).map_err(e)?;
        }
        let ns = t.elapsed().as_nanos() as f64 / (args.messages / 2 * 2) as f64;
        // The first round warms up.
        if round > 0 {
            per_round.push(ns);
        }
    }
    per_round.sort_by(f64::total_cmp);
    // An idle poll (a receive posted at each end, nothing in flight): how late a busy-polled
    // wait sees a message that lands while it polls, at most.
    let mut idle = Vec::new();
    for _ in 0..(args.rounds as usize).min(args.idle_polls) {
        let t = Instant::now();
        for _ in 0..args.idle_polls {
            if qa.dequeue_into(&mut events, 4, Some(Duration::ZERO)) > 0 {
                return Err("an event while idle".into());
            }
        }
        idle.push(t.elapsed().as_nanos() as f64 / args.idle_polls as f64);
    }
    idle.sort_by(f64::total_cmp);
    println!("# one thread, both ends, {size} B SOCK_SEQPACKET messages: {} rounds of {}", args.rounds, args.messages);
    println!("ns per one-way message: median {:.0}, best {:.0}", per_round[per_round.len() / 2], per_round[0]);
    if !idle.is_empty() {
        println!("ns per idle poll (both connections): median {:.0}, best {:.0}", idle[idle.len() / 2], idle[0]);
    }
    Ok(())
}
