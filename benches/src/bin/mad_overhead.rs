//! Madeleine's CPU cost per small message over the message pipe it runs on: one thread plays
//! a ping-pong between two sessions of the same process (packs a message on one, unpacks it
//! on the other, and back), and the same through a bare pipe pair (header and payload of the
//! same size), in alternated rounds, so no cross-core transfer or wait is measured, only
//! instructions, locks and cache-resident copies, and both see the same phases of a noisy host.
//! What this adds to the pipe is what Madeleine adds to a ping-pong's one-way latency on both
//! sides of the wire together (`stack_bench` measures that latency between processes).
//! With `--stream`, each side instead streams a round's messages between two threads pinned
//! to two CPUs, and reports the sender's time per message.

use std::time::{Duration, Instant};

use clap::Parser;
use madeleine::{RecvMode, SendMode, Session, SessionConfig};
use portability_verbs::datapath::MsgPipe;
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
    /// Rounds per layer, alternated between the layers; the best and the median are reported
    /// (this machine is noisy).
    #[arg(long, default_value_t = 7, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Measure Madeleine only (for a profiler).
    #[arg(long, conflicts_with = "pipe_only")]
    madeleine_only: bool,
    /// Measure the pipe only (for a profiler).
    #[arg(long)]
    pipe_only: bool,
    /// Instead of the one-thread ping-pong, a stream between two threads pinned to CPUs 0
    /// and 1: one sends a round's messages, the other takes them and answers the last, and
    /// the time per message is the sender's. What paces a stream of small messages (the
    /// sender's stores into the ring, the reader's polls of it) shows here without the
    /// start-up and cross-process costs of `stack_bench`'s streams.
    #[arg(long)]
    stream: bool,
    /// Instead of messages, a round's looks at a connection with nothing there
    /// (`try_begin_unpacking_from`; the pipe's `front`), and the time per look: what a
    /// waiting receiver repeats, so that a message is found half a look late on average.
    #[arg(long, conflicts_with = "stream")]
    empty_looks: bool,
}

const T: Duration = Duration::from_secs(30);

/// Bytes Madeleine puts around a message of one pack of `size` bytes (a `One` header when it
/// fits one pipe message of `max_msg` bytes with room for the `Begin` and `Inline` headers it
/// is packed behind, else `Begin`, `Inline` and `End`), for the pipe to carry the same.
fn mad_headers(size: usize, max_msg: usize) -> usize {
    use madeleine::wire::{HEADER, ONE_HEADER};
    if 2 * HEADER + size <= max_msg {
        ONE_HEADER
    } else {
        3 * HEADER
    }
}

/// One side of the comparison: a pair of ends that one thread drives in turn.
trait Pair {
    /// Sends one message `there` (or back) and receives it at the other end.
    fn one(&mut self, there: bool) -> Result<(), String>;
    /// Streams `messages` messages from one end to the other, each end on a thread of its
    /// own; returns the sender's time per message (until the receiver's answer to the last).
    fn stream(&mut self, messages: u64) -> Result<f64, String>;
    /// Looks `looks` times for a message where none comes; returns the time per look.
    fn empty_looks(&mut self, looks: u64) -> Result<f64, String>;
}

/// Time per look of `looks` calls of `look`, each of which must find nothing.
fn time_looks(looks: u64, mut look: impl FnMut() -> Result<bool, String>) -> Result<f64, String> {
    let t = Instant::now();
    for _ in 0..looks {
        if look()? {
            return Err("a look found a message where none was sent".into());
        }
    }
    Ok(t.elapsed().as_nanos() as f64 / looks as f64)
}

/// Runs `send` on this thread pinned to CPU 0 and `recv` on a thread pinned to CPU 1; returns
/// `send`'s result (nanoseconds per message) once both ended.
fn two_threads(
    messages: u64,
    send: impl FnOnce() -> Result<(), String>,
    recv: impl FnOnce() -> Result<(), String> + Send,
) -> Result<f64, String> {
    std::thread::scope(|sc| {
        let h = sc.spawn(|| {
            benches::pin_to_cpu(1);
            recv()
        });
        benches::pin_to_cpu(0);
        let t = Instant::now();
        let sent = send();
        let took = t.elapsed();
        benches::unpin();
        let got = h.join().map_err(|_| "the receiving thread panicked".to_string())?;
        sent.and(got)?;
        Ok(took.as_nanos() as f64 / messages as f64)
    })
}

/// Time per message of one round of `messages` messages, sent there and back in turn.
fn round(pair: &mut dyn Pair, messages: u64) -> Result<f64, String> {
    let t = Instant::now();
    for i in 0..messages {
        pair.one(i % 2 == 0)?;
    }
    Ok(t.elapsed().as_nanos() as f64 / messages as f64)
}

/// Two sessions of this process, one channel each.
struct MadPair {
    // Channels before sessions: dropped first.
    c0: madeleine::Channel,
    c1: madeleine::Channel,
    _s0: Session,
    _s1: Session,
    buf: Vec<u8>,
    rbuf: Vec<u8>,
}

impl MadPair {
    fn new(size: usize) -> Result<MadPair, String> {
        let dir = std::env::temp_dir().join(format!("mad-overhead-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let cfg = |rank| {
            let mut c = SessionConfig::new(rank, 2, &dir);
            c.timeout = T;
            c.wait_limit = Some(T);
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
        Ok(MadPair { c0, c1, _s0: s0, _s1: s1, buf: vec![7u8; size], rbuf: vec![0u8; size] })
    }
}

impl Pair for MadPair {
    fn one(&mut self, there: bool) -> Result<(), String> {
        let e = |e: madeleine::MadError| e.to_string();
        let ((from, from_rank), (to, to_rank)) =
            if there { ((&self.c0, 0), (&self.c1, 1)) } else { ((&self.c1, 1), (&self.c0, 0)) };
        let mut p = from.begin_packing(to_rank).map_err(e)?;
        p.pack(&self.buf, SendMode::Cheaper, RecvMode::Cheaper).map_err(e)?;
        p.end_packing().map_err(e)?;
        let mut u = to.begin_unpacking_from(from_rank).map_err(e)?;
        u.unpack(&mut self.rbuf, SendMode::Cheaper, RecvMode::Cheaper).map_err(e)?;
        u.end_unpacking().map_err(e)
    }

    fn stream(&mut self, messages: u64) -> Result<f64, String> {
        let e = |e: madeleine::MadError| e.to_string();
        let MadPair { c0, c1, buf, rbuf, .. } = self;
        let (c0, c1, buf) = (&*c0, &*c1, &*buf);
        let send = || -> Result<(), String> {
            for _ in 0..messages {
                let mut p = c0.begin_packing(1).map_err(e)?;
                p.pack(buf, SendMode::Cheaper, RecvMode::Cheaper).map_err(e)?;
                p.end_packing().map_err(e)?;
            }
            c0.begin_unpacking_from(1).map_err(e)?.end_unpacking().map_err(e)
        };
        let recv = move || -> Result<(), String> {
            for _ in 0..messages {
                let mut u = c1.begin_unpacking_from(0).map_err(e)?;
                u.unpack(rbuf, SendMode::Cheaper, RecvMode::Cheaper).map_err(e)?;
                u.end_unpacking().map_err(e)?;
            }
            c1.begin_packing(0).map_err(e)?.end_packing().map_err(e)
        };
        two_threads(messages, send, recv)
    }

    fn empty_looks(&mut self, looks: u64) -> Result<f64, String> {
        let c1 = &self.c1;
        time_looks(looks, || c1.try_begin_unpacking_from(0).map(|u| u.is_some()).map_err(|e| e.to_string()))
    }
}

/// Two message pipes of this process, connected to each other.
struct PipePair {
    a: MsgPipe,
    b: MsgPipe,
    _pd: ProtectionDomain,
    buf: Vec<u8>,
    rbuf: Vec<u8>,
}

impl PipePair {
    /// Pipes carrying what Madeleine would put in them for a pack of `size` bytes.
    fn new(size: usize) -> Result<PipePair, String> {
        let e = |e: VerbsError| e.to_string();
        let ctx = Context::open(Provider::Software).map_err(e)?;
        let pd = ctx.alloc_pd().map_err(e)?;
        let (ca, cb) = (ctx.create_cq(1024).map_err(e)?, ctx.create_cq(1024).map_err(e)?);
        let a = pd.create_qp(&QpInit::new(&ca)).map_err(e)?;
        let b = pd.create_qp(&QpInit::new(&cb)).map_err(e)?;
        a.connect_to(b.endpoint()).map_err(e)?;
        b.connect_to(a.endpoint()).map_err(e)?;
        // The strategy Madeleine's sessions run on by default, as the other side measures.
        let s = SessionConfig::new(0, 2, std::env::temp_dir()).strategy;
        let (pa, pb) = std::thread::scope(|sc| {
            let h = sc.spawn(|| MsgPipe::establish(b, cb, &pd, s, T));
            (MsgPipe::establish(a, ca, &pd, s, T), h.join().expect("pipe thread"))
        });
        let (a, b) = (pa.map_err(e)?, pb.map_err(e)?);
        let n = size + mad_headers(size, s.max_message());
        Ok(PipePair { a, b, _pd: pd, buf: vec![7u8; n], rbuf: vec![0u8; n] })
    }
}

impl Pair for PipePair {
    fn one(&mut self, there: bool) -> Result<(), String> {
        let e = |e: VerbsError| e.to_string();
        let (from, to) = if there { (&mut self.a, &mut self.b) } else { (&mut self.b, &mut self.a) };
        // Both ends are driven here, so a message is there at once: a retry means something
        // broke.
        if !from.try_send(&self.buf).map_err(e)? {
            from.progress().map_err(e)?;
            if !from.try_send(&self.buf).map_err(e)? {
                return Err("pipe: no room to send".into());
            }
        }
        let rbuf = &mut self.rbuf;
        match to.recv_with(|m| rbuf.copy_from_slice(m)).map_err(e)? {
            Some(()) => Ok(()),
            None => Err("pipe: the message did not arrive".into()),
        }
    }

    fn stream(&mut self, messages: u64) -> Result<f64, String> {
        let PipePair { a, b, buf, rbuf, .. } = self;
        let buf = &*buf;
        let send = || -> Result<(), String> {
            let deadline = Instant::now() + T;
            for _ in 0..messages {
                pipe_send(a, buf, deadline)?;
            }
            pipe_recv(a, None, deadline)
        };
        let recv = move || -> Result<(), String> {
            let deadline = Instant::now() + T;
            for _ in 0..messages {
                pipe_recv(b, Some(rbuf), deadline)?;
            }
            pipe_send(b, &[1], deadline)
        };
        two_threads(messages, send, recv)
    }

    fn empty_looks(&mut self, looks: u64) -> Result<f64, String> {
        let b = &mut self.b;
        time_looks(looks, || b.front().map(|m| m.is_some()).map_err(|e| e.to_string()))
    }
}

/// Sends `msg` on the pipe, driving it while its ring has no room.
fn pipe_send(p: &mut MsgPipe, msg: &[u8], deadline: Instant) -> Result<(), String> {
    while !p.try_send(msg).map_err(|e| e.to_string())? {
        p.progress().map_err(|e| e.to_string())?;
        if Instant::now() > deadline {
            return Err("pipe: no room to send".into());
        }
    }
    Ok(())
}

/// Waits for the pipe's next message, copying it into `into` if given.
fn pipe_recv(p: &mut MsgPipe, mut into: Option<&mut Vec<u8>>, deadline: Instant) -> Result<(), String> {
    for empty in 1u64.. {
        let got = p.recv_with(|m| {
            if let Some(into) = into.as_deref_mut() {
                into.clear();
                into.extend_from_slice(m);
            }
        });
        if got.map_err(|e| e.to_string())?.is_some() {
            return Ok(());
        }
        // The clock now and then: a look costs a few tens of nanoseconds, a clock read as much.
        if empty.is_multiple_of(1024) && Instant::now() > deadline {
            break;
        }
    }
    Err("pipe: the message did not arrive".into())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    env_logger::init();
    let args = Args::parse();
    let run = || -> Result<(), String> {
        let mut pairs: Vec<(&str, Box<dyn Pair>)> = Vec::new();
        if !args.madeleine_only {
            pairs.push(("pipe", Box::new(PipePair::new(args.size)?)));
        }
        if !args.pipe_only {
            pairs.push(("madeleine", Box::new(MadPair::new(args.size)?)));
        }
        // Rounds alternate between the pairs, so both see the same phases of a noisy host.
        let mut times = vec![Vec::new(); pairs.len()];
        for _ in 0..args.rounds {
            for (k, (_, pair)) in pairs.iter_mut().enumerate() {
                times[k].push(if args.stream {
                    pair.stream(args.messages)?
                } else if args.empty_looks {
                    pair.empty_looks(args.messages)?
                } else {
                    round(pair.as_mut(), args.messages)?
                });
            }
        }
        if args.empty_looks {
            println!("# looks at an empty connection: {} alternated rounds of {}", args.rounds, args.messages);
        } else {
            let how = if args.stream { "a stream between two threads" } else { "one thread, both ends" };
            println!("# {how}, {} B packs: {} alternated rounds of {} messages", args.size, args.rounds, args.messages);
        }
        let unit = if args.empty_looks { "look" } else { "message" };
        let mut best = Vec::new();
        for ((name, _), t) in pairs.iter().zip(&mut times) {
            let b = t.iter().copied().fold(f64::MAX, f64::min);
            println!("{name:<10} {b:7.1} ns per {unit} (best round), {:7.1} (median)", median(t));
            best.push(b);
        }
        if let [pipe, mad] = times.as_slice() {
            let mut diff: Vec<f64> = mad.iter().zip(pipe).map(|(m, p)| m - p).collect();
            println!(
                "overhead   {:7.1} ns per {unit} (best minus best), {:7.1} (median of each round's difference)",
                best[1] - best[0],
                median(&mut diff)
            );
        }
        Ok(())
    };
    if let Err(e) = run() {
        eprintln!("mad_overhead: {e}");
        std::process::exit(1);
    }
}
