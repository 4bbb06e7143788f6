//! Raw portability-verbs benchmark between two processes: ping-pong one-way latency (median, p99)
//! and streaming bandwidth per message size, for SEND/RECV, RDMA write-with-immediate, and plain
//! RDMA writes into provider-allocated shared memory and into ordinary user memory.
//!
//! It starts its own peer process (`--role server`), pins both processes to different CPUs when
//! there are two, and prints one table per operation. This is the floor every upper layer is
//! measured against.

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use benches::{cacheline_one_way_ns, fmt_size, pin_to_cpu, pss_kib, sizes_between, timer_cost_ns, Spin};
use clap::{Parser, ValueEnum};
use hdrhistogram::Histogram;
use portability_verbs::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Op {
    /// SEND/RECV: latency and bandwidth.
    Send,
    /// RDMA write-with-immediate into the peer's provider segment: latency and bandwidth.
    Wwi,
    /// RDMA write into the peer's provider-allocated shared segment: bandwidth, and latency
    /// with the receiver polling the segment's memory for the message's last 8 bytes (no
    /// completion, no posted receive: the floor of an eager-RDMA path; from 8 bytes).
    WriteSeg,
    /// RDMA write-with-immediate into the peer's provider segment, latency only, with the
    /// receiver polling the segment's memory for the message's last 8 bytes as for
    /// `write-seg`, and taking the completion after its reply: the floor of an eager-RDMA path
    /// whose messages still raise a completion (so a sleeping receiver wakes); from 8 bytes.
    WwiSeg,
    /// RDMA write into the peer's ordinary (heap) memory, by cross-memory attach: bandwidth.
    WriteUser,
}

use benches::PeerRole as Role;

/// Raw verbs ping-pong and streaming benchmark over two processes.
#[derive(Parser, Debug, Clone)]
#[command(version, about)]
struct Args {
    /// Operations to measure.
    #[arg(long, value_enum, value_delimiter = ',', default_values = ["send", "wwi", "write-seg", "write-user"])]
    ops: Vec<Op>,
    /// Smallest message size in bytes.
    #[arg(long, default_value_t = 1)]
    min_size: usize,
    /// Largest message size in bytes (at most 4 MiB).
    #[arg(long, default_value_t = 4 << 20)]
    max_size: usize,
    /// Latency round trips per size at 8 bytes (fewer for large sizes).
    #[arg(long, default_value_t = 20_000)]
    iters: u64,
    /// Bytes streamed per bandwidth point (at least 64 messages).
    #[arg(long, default_value_t = 256 << 20)]
    stream_bytes: u64,
    /// Round trips or messages discarded before measuring.
    #[arg(long, default_value_t = 1_000)]
    warmup: u64,
    /// Pin the client and the server to these CPUs (when the machine has them).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 0])]
    cpus: Vec<usize>,
    /// Do not pin.
    #[arg(long)]
    no_pin: bool,
    /// Spread streamed messages over 16 MiB of target and receive buffers instead of reusing one
    /// buffer (the default, as perftest and ucx_perftest do; spreading measures memory bandwidth).
    #[arg(long)]
    spread: bool,
    /// Also write the results, with the run's metadata (host, commit, arguments), as JSON to this file.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    #[arg(long, value_enum, default_value_t = Role::Client, hide = true)]
    role: Role,
    #[arg(long, hide = true)]
    addr: Option<String>,
}

const RECV_REGION: usize = 64 << 20;
const SEG_REGION: usize = 16 << 20;
const SEND_REGION: usize = 4 << 20;
const MAX_SIZE: usize = 4 << 20;
const WINDOW_BYTES: usize = 16 << 20;
const TIMEOUT: Duration = Duration::from_secs(20);

/// One side's resources.
struct Side {
    qp: QueuePair,
    cq: CompletionQueue,
    send_buf: MemoryRegion,
    recv_buf: MemoryRegion,
    _seg: MemoryRegion,
    _user: MemoryRegion,
    ctrl: MemoryRegion,
    peer: [u64; 4],
    posted: u64,
    wcs: Vec<WorkCompletion>,
    pending_recvs: std::collections::VecDeque<WorkCompletion>,
    /// Messages seen in memory (wwi-seg) whose completions are still to be taken.
    polled_early: u64,
    /// Completions of polled messages taken in this latency run (wwi-seg).
    early_taken: u64,
    send_done: u64,
}

fn layout(seg: &MemoryRegion, user: &MemoryRegion) -> Vec<u8> {
    [seg.addr(), seg.rkey() as u64, user.addr(), user.rkey() as u64].iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn parse_layout(b: &[u8]) -> Result<[u64; 4]> {
    if b.len() != 32 {
        return Err(VerbsError::Protocol("peer layout has the wrong size".into()));
    }
    let mut out = [0u64; 4];
    for (i, c) in b.chunks(8).enumerate() {
        out[i] = u64::from_le_bytes(c.try_into().expect("8 bytes"));
    }
    Ok(out)
}

impl Side {
    fn setup(role: Role, addr: &str) -> Result<Side> {
        let ctx = Context::open_default()?;
        let pd = ctx.alloc_pd()?;
        let send_buf = pd.register(vec![0x5au8; SEND_REGION].into_boxed_slice(), AccessFlags::ALL)?;
        let recv_buf = pd.register(vec![0u8; RECV_REGION].into_boxed_slice(), AccessFlags::ALL)?;
        let seg = pd.alloc(SEG_REGION, AccessFlags::ALL)?;
        let user = pd.register(vec![0u8; SEG_REGION].into_boxed_slice(), AccessFlags::ALL)?;
        let ctrl = pd.register(vec![0u8; 4096].into_boxed_slice(), AccessFlags::ALL)?;
        // Touch everything once so page faults stay out of the measurements.
        for r in [&send_buf, &recv_buf, &seg, &user] {
            for off in (0..r.len()).step_by(4096) {
                r.write(off, &[1]);
            }
        }
        let spec = cm::QpSpec { cq_capacity: 4096, ..cm::QpSpec::with_depths(1024, 1024) };
        let addr: cm::CmAddr = addr.parse()?;
        let private = layout(&seg, &user);
        let conn = match role {
            Role::Server => cm::Listener::bind(&addr)?.accept(&pd, &spec, &private, TIMEOUT)?,
            Role::Client => cm::connect_retrying(&addr, &pd, &spec, &private, TIMEOUT)?,
        };
        let cq = conn.cq.clone();
        let peer = parse_layout(&conn.peer_private)?;
        Ok(Side {
            qp: conn.qp,
            cq,
            send_buf,
            recv_buf,
            _seg: seg,
            _user: user,
            ctrl,
            peer,
            posted: 0,
            wcs: vec![WorkCompletion::EMPTY; 64],
            pending_recvs: Default::default(),
            polled_early: 0,
            early_taken: 0,
            send_done: 0,
        })
    }

    /// Polls once; queues receive completions, counts send-side ones. Fails on any error.
    fn poll(&mut self) -> Result<()> {
        let n = self.cq.poll(&mut self.wcs)?;
        for wc in &self.wcs[..n] {
            if wc.status != WcStatus::Success {
                return Err(VerbsError::PeerUnreachable(format!("completion failed: {wc:?}")));
            }
            match wc.opcode {
                WcOpcode::Recv | WcOpcode::RecvRdmaWithImm => self.pending_recvs.push_back(*wc),
                _ => self.send_done += 1,
            }
        }
        Ok(())
    }

    fn wait_recv(&mut self) -> Result<WorkCompletion> {
        let mut spin = Spin::new(TIMEOUT);
        loop {
            if let Some(wc) = self.pending_recvs.pop_front() {
                return Ok(wc);
            }
            self.poll()?;
            spin.tick()?;
        }
    }

    /// Like `wait_recv`, but sleeps on the completion queue's descriptor after a short spin, so
    /// a passive target leaves its CPU to the initiator.
    fn wait_recv_sleeping(&mut self) -> Result<WorkCompletion> {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            if let Some(wc) = self.pending_recvs.pop_front() {
                return Ok(wc);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let n = self.cq.poll_blocking(&mut self.wcs, left)?;
            let wcs: Vec<WorkCompletion> = self.wcs[..n].to_vec();
            for wc in wcs {
                if wc.status != WcStatus::Success {
                    return Err(VerbsError::PeerUnreachable(format!("completion failed: {wc:?}")));
                }
                match wc.opcode {
                    WcOpcode::Recv | WcOpcode::RecvRdmaWithImm => self.pending_recvs.push_back(wc),
                    _ => self.send_done += 1,
                }
            }
        }
    }

    fn wait_sends(&mut self, done: u64) -> Result<()> {
        let mut spin = Spin::new(TIMEOUT);
        while self.send_done < done {
            self.poll()?;
            spin.tick()?;
        }
        Ok(())
    }

    /// One latency message: message `i` of `total`, then a receive reposted off the critical
    /// path while the peer has `LAT_DEPTH` posted.
    fn ping(&mut self, op: Op, i: u64, size: usize, total: u64) -> Result<()> {
        let (raddr, rkey) = target(self, op);
        if matches!(op, Op::WriteSeg | Op::WwiSeg) {
            // The last 8 bytes say which message this is; the peer polls them in its memory.
            self.send_buf.write(size - 8, &(i + 1).to_le_bytes());
        }
        if op == Op::WriteSeg {
            let wr = SendWr::write(i, &[self.send_buf.sge(0, size)], raddr, rkey);
            // Signaled now and then, so the send queue's slots come back.
            let signaled = i % 64 == 63 || i + 1 == total;
            self.qp.post_send(&[wr.inline(size <= 64).signaled(signaled)])?;
            if signaled {
                self.wait_sends(self.send_done + 1)?;
            }
            return Ok(());
        }
        let wr = match op {
            Op::Send => SendWr::send(i, &[self.send_buf.sge(0, size)]),
            _ => SendWr::write_with_imm(i, &[self.send_buf.sge(0, size)], raddr, rkey, i as u32),
        };
        self.qp.post_send(&[wr.inline(size <= 64).signaled(i + 1 == total)])?;
        if op == Op::WwiSeg {
            return self.take_polled_completions(size, total);
        }
        if i + LAT_DEPTH < total {
            self.post_recv(0, size.max(1))?;
        }
        Ok(())
    }

    /// Waits for the peer's latency message `i`: a receive, or (write-seg, wwi-seg) its write
    /// landing.
    fn wait_pong(&mut self, op: Op, i: u64, size: usize) -> Result<()> {
        if !matches!(op, Op::WriteSeg | Op::WwiSeg) {
            return self.wait_recv().map(|_| ());
        }
        self.wait_written(i, size)?;
        // A write-with-immediate's completion is still to come: taken after the reply.
        self.polled_early += (op == Op::WwiSeg) as u64;
        Ok(())
    }

    /// Takes the completions of messages seen in memory that are here (after the reply:
    /// off the critical path) and posts their receives again while the peer has messages left.
    fn take_polled_completions(&mut self, size: usize, total: u64) -> Result<()> {
        self.poll()?;
        while self.polled_early > 0 {
            let Some(_) = self.pending_recvs.pop_front() else { break };
            self.polled_early -= 1;
            // The peer's message this receive took, counted from the run's start.
            self.early_taken += 1;
            if self.early_taken - 1 + LAT_DEPTH < total {
                self.post_recv(0, size)?;
            }
        }
        Ok(())
    }

    /// Takes the completions of messages already seen in memory (the end of a wwi-seg run).
    fn drain_early(&mut self) -> Result<()> {
        while self.polled_early > 0 {
            self.wait_recv()?;
            self.polled_early -= 1;
        }
        Ok(())
    }

    /// Waits until the peer's write of message `i` (`size` bytes) landed in our segment.
    fn wait_written(&mut self, i: u64, size: usize) -> Result<()> {
        let mut spin = Spin::new(TIMEOUT);
        // SAFETY: in bounds of our live segment (size <= SEG_REGION); a volatile load, since
        // the peer writes it behind the compiler's back.
        let flag = unsafe { self._seg.as_ptr().add(size - 8) } as *const u64;
        while u64::from_le(unsafe { std::ptr::read_volatile(flag) }) != i + 1 {
            spin.tick()?;
        }
        Ok(())
    }

    fn post_recv(&mut self, off: usize, len: usize) -> Result<()> {
        self.posted += 1;
        self.qp.post_recv(&[RecvWr::new(self.posted, &[self.recv_buf.sge(off, len)])])
    }

    fn post_ctrl_recv(&mut self) -> Result<()> {
        self.posted += 1;
        self.qp.post_recv(&[RecvWr::new(self.posted, &[self.ctrl.sge(0, 64)])])
    }

    fn send_ctrl(&mut self) -> Result<()> {
        let done = self.send_done + 1;
        self.qp.post_send(&[SendWr::send(u64::MAX, &[self.ctrl.sge(64, 8)])])?;
        self.wait_sends(done)
    }
}

fn latency_iters(args: &Args, size: usize) -> u64 {
    (args.iters * 64 / (size as u64).max(64)).clamp(200, args.iters)
}

fn stream_count(args: &Args, size: usize) -> u64 {
    (args.stream_bytes / size as u64).clamp(64, 2_000_000)
}

fn window(size: usize) -> u64 {
    (WINDOW_BYTES / size).clamp(2, 256) as u64
}

fn target(side: &Side, op: Op) -> (u64, u32) {
    match op {
        Op::WriteUser => (side.peer[2], side.peer[3] as u32),
        _ => (side.peer[0], side.peer[1] as u32),
    }
}

/// Receives kept posted during a latency run, so that reposting happens off the critical path
/// (after the next message is sent), as perftest does.
const LAT_DEPTH: u64 = 8;

/// Receives a latency run of `op` keeps posted (none where the peer's messages are polled for
/// in memory).
fn latency_receives(op: Op) -> u64 {
    if op == Op::WriteSeg {
        0
    } else {
        LAT_DEPTH
    }
}

/// The client side of one latency point; records one-way latencies in nanoseconds.
fn client_latency(side: &mut Side, args: &Args, op: Op, size: usize, hist: &mut Histogram<u64>) -> Result<()> {
    let iters = latency_iters(args, size);
    let total = iters + args.warmup.min(iters);
    let done = side.send_done + 1;
    side.early_taken = 0;
    for _ in 0..latency_receives(op).min(total) {
        side.post_recv(0, size.max(1))?;
    }
    for i in 0..total {
        let t0 = Instant::now();
        side.ping(op, i, size, total)?;
        side.wait_pong(op, i, size)?;
        let rtt = t0.elapsed().as_nanos() as u64;
        if i >= args.warmup.min(iters) {
            hist.record((rtt / 2).max(1)).ok();
        }
    }
    side.drain_early()?;
    side.wait_sends(done)
}

fn server_latency(side: &mut Side, args: &Args, op: Op, size: usize) -> Result<()> {
    let iters = latency_iters(args, size);
    let total = iters + args.warmup.min(iters);
    let done = side.send_done + 1;
    side.early_taken = 0;
    for i in 0..total {
        side.wait_pong(op, i, size)?;
        side.ping(op, i, size, total)?;
    }
    side.drain_early()?;
    side.wait_sends(done)
}

/// The client side of one bandwidth point; returns bytes per second.
fn client_bandwidth(side: &mut Side, args: &Args, op: Op, size: usize) -> Result<f64> {
    let count = stream_count(args, size);
    let win = window(size);
    let (raddr, rkey) = target(side, op);
    let slots = if args.spread { (SEG_REGION / size).max(1) as u64 } else { 1 };
    side.post_ctrl_recv()?; // for the end-of-stream acknowledgement
    let start_done = side.send_done;
    let t0 = Instant::now();
    let mut posted = 0u64;
    let mut spin = Spin::new(TIMEOUT);
    while posted < count {
        while posted < count && posted - (side.send_done - start_done) < win {
            let off = ((posted % slots) as usize * size) as u64;
            let wr = match op {
                Op::Send => SendWr::send(posted, &[side.send_buf.sge(0, size)]),
                Op::Wwi => SendWr::write_with_imm(posted, &[side.send_buf.sge(0, size)], raddr + off, rkey, 0),
                Op::WwiSeg => return Err(VerbsError::InvalidArgument("wwi-seg measures latency only".into())),
                Op::WriteSeg | Op::WriteUser => SendWr::write(posted, &[side.send_buf.sge(0, size)], raddr + off, rkey),
            };
            side.qp.post_send(&[wr.inline(size <= 64)])?;
            posted += 1;
        }
        side.poll()?;
        spin.tick()?;
    }
    side.wait_sends(start_done + count)?;
    let needs_receiver = matches!(op, Op::Send | Op::Wwi);
    if needs_receiver {
        side.wait_recv()?; // the receiver saw everything
    }
    let secs = t0.elapsed().as_secs_f64();
    if !needs_receiver {
        side.send_ctrl()?;
        side.wait_recv()?;
    }
    Ok((count * size as u64) as f64 / secs)
}

fn server_bandwidth(side: &mut Side, args: &Args, op: Op, size: usize) -> Result<()> {
    let count = stream_count(args, size);
    if matches!(op, Op::WriteSeg | Op::WriteUser) {
        side.wait_recv_sleeping()?; // the client's end-of-stream message (receive posted at sync)
        return side.send_ctrl();
    }
    let win = window(size).min(1000);
    let slots = if args.spread { (RECV_REGION / size).clamp(1, win as usize) } else { 1 };
    for k in 0..win {
        side.post_recv((k as usize % slots) * size, size)?;
    }
    let mut got = 0u64;
    let mut reposted = win;
    while got < count {
        let wc = side.wait_recv()?;
        got += 1;
        if reposted < count {
            side.qp
                .post_recv(&[RecvWr::new(wc.wr_id, &[side.recv_buf.sge((reposted as usize % slots) * size, size)])])?;
            reposted += 1;
        }
    }
    side.send_ctrl()
}

/// One measurement point, in the order both sides agree on.
#[derive(Clone, Copy)]
struct Point {
    op: Op,
    size: usize,
    latency: bool,
}

fn schedule(args: &Args) -> Vec<Point> {
    let mut v = Vec::new();
    for &op in &args.ops {
        for size in sizes_between(args.min_size, args.max_size.min(MAX_SIZE)) {
            if matches!(op, Op::Send | Op::Wwi) || (matches!(op, Op::WriteSeg | Op::WwiSeg) && size >= 8) {
                v.push(Point { op, size, latency: true });
            }
            if op != Op::WwiSeg {
                v.push(Point { op, size, latency: false });
            }
        }
    }
    v
}

/// Start of each point: the server posts what it needs, then says READY.
fn sync(side: &mut Side, role: Role, ready: impl FnOnce(&mut Side) -> Result<()>) -> Result<()> {
    match role {
        Role::Client => {
            side.post_ctrl_recv()?;
            side.wait_recv().map(|_| ())
        }
        Role::Server => {
            ready(side)?;
            side.send_ctrl()
        }
    }
}

fn run_server(args: &Args) -> Result<()> {
    let mut side = Side::setup(Role::Server, args.addr.as_deref().unwrap_or_default())?;
    for p in schedule(args) {
        if p.latency {
            let (size, depth) = (p.size, latency_receives(p.op).min(latency_iters(args, p.size) * 2));
            sync(&mut side, Role::Server, |s| (0..depth).try_for_each(|_| s.post_recv(0, size.max(1))))?;
            server_latency(&mut side, args, p.op, p.size)?;
        } else {
            let one_sided = matches!(p.op, Op::WriteSeg | Op::WriteUser);
            sync(&mut side, Role::Server, |s| if one_sided { s.post_ctrl_recv() } else { Ok(()) })?;
            server_bandwidth(&mut side, args, p.op, p.size)?;
        }
    }
    Ok(())
}

struct Row {
    op: Op,
    size: usize,
    median_us: Option<f64>,
    p99_us: Option<f64>,
    /// None where only latency was measured (wwi-seg).
    gbps: Option<f64>,
}

fn run_client(args: &Args, child: &mut Child, addr: &str) -> Result<Vec<Row>> {
    let mut side = Side::setup(Role::Client, addr)?;
    let mut rows: Vec<Row> = Vec::new();
    let points = schedule(args);
    let total = points.len();
    let progress = std::io::IsTerminal::is_terminal(&std::io::stderr());
    for (k, p) in points.into_iter().enumerate() {
        if let Ok(Some(st)) = child.try_wait() {
            return Err(VerbsError::PeerUnreachable(format!("the server process exited ({st})")));
        }
        if progress {
            eprint!(
                "\r  [{:>3}/{total}] {:?} {:>8} {:<10}",
                k + 1,
                p.op,
                fmt_size(p.size),
                if p.latency { "latency" } else { "bandwidth" }
            );
        }
        sync(&mut side, Role::Client, |_| Ok(()))?;
        if p.latency {
            let mut h = Histogram::<u64>::new(3).expect("histogram");
            client_latency(&mut side, args, p.op, p.size, &mut h)?;
            rows.push(Row {
                op: p.op,
                size: p.size,
                median_us: Some(h.value_at_quantile(0.5) as f64 / 1e3),
                p99_us: Some(h.value_at_quantile(0.99) as f64 / 1e3),
                gbps: None,
            });
        } else {
            let bw = client_bandwidth(&mut side, args, p.op, p.size)?;
            match rows.iter_mut().find(|r| r.op == p.op && r.size == p.size) {
                Some(r) => r.gbps = Some(bw / 1e9),
                None => rows.push(Row { op: p.op, size: p.size, median_us: None, p99_us: None, gbps: Some(bw / 1e9) }),
            }
        }
    }
    if progress {
        eprintln!("\r{:60}", "");
    }
    drop(side);
    Ok(rows)
}

/// Memory one connected queue-pair pair costs: PSS growth over many in-process pairs, each
/// having carried a message.
fn memory_per_qp_pair() -> Result<(f64, usize)> {
    let ctx = Context::open(Provider::Software)?;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(4096)?;
    let mr = pd.register(vec![0u8; 4096].into_boxed_slice(), AccessFlags::ALL)?;
    let n = 32;
    let before = pss_kib();
    let mut keep = Vec::new();
    for _ in 0..n {
        let a = pd.create_qp(&QpInit::new(&cq))?;
        let b = pd.create_qp(&QpInit::new(&cq))?;
        a.connect_to(b.endpoint())?;
        b.connect_to(a.endpoint())?;
        b.post_recv(&[RecvWr::new(1, &[mr.sge(0, 64)])])?;
        a.post_send(&[SendWr::send(1, &[mr.sge(64, 64)])])?;
        let mut wc = [WorkCompletion::EMPTY; 2];
        let mut got = 0;
        while got < 2 {
            got += cq.poll_blocking(&mut wc[..2 - got], TIMEOUT)?;
        }
        keep.push((a, b));
    }
    let after = pss_kib();
    let per_pair = (after.saturating_sub(before)) as f64 / n as f64;
    Ok((per_pair, SoftConfig::default().ring_bytes))
}

fn main() {
    env_logger::init();
    let args = Args::parse();
    let result = match args.role {
        Role::Server => {
            if !args.no_pin {
                pin_to_cpu(args.cpus.get(1).copied().unwrap_or(0));
            }
            run_server(&args).map(|_| ())
        }
        Role::Client => client_main(&args),
    };
    if let Err(e) = result {
        eprintln!("verbs_pingpong ({:?}): {e}", args.role);
        std::process::exit(1);
    }
}

fn client_main(args: &Args) -> Result<()> {
    if args.max_size > MAX_SIZE || args.min_size == 0 || args.min_size > args.max_size {
        return Err(VerbsError::InvalidArgument(format!("sizes must satisfy 1 <= min <= max <= {MAX_SIZE}")));
    }
    let addr = format!("unix:{}/pv-bench-{}.sock", std::env::temp_dir().display(), std::process::id());
    let mut cmd =
        Command::new(std::env::current_exe().map_err(|e| VerbsError::Os { context: "current_exe".into(), source: e })?);
    cmd.args(std::env::args().skip(1)).args(["--role", "server", "--addr", &addr]);
    let ncpu = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    // The hardware floor, before the server starts spinning on its CPU.
    let floor = (ncpu > 1).then(|| cacheline_one_way_ns(args.cpus[0], args.cpus.get(1).copied().unwrap_or(0)));
    let mut child =
        cmd.spawn().map_err(|e| VerbsError::Os { context: "starting the server process".into(), source: e })?;
    if !args.no_pin {
        pin_to_cpu(args.cpus.first().copied().unwrap_or(1));
    }
    println!("# portability-verbs raw benchmark: software provider, two processes");
    println!(
        "# {} CPUs, pinning {}, timer cost {:.1} ns (included in latencies, not subtracted)",
        ncpu,
        if args.no_pin {
            "off".to_string()
        } else {
            format!("client->{} server->{}", args.cpus[0], args.cpus.get(1).unwrap_or(&0))
        },
        timer_cost_ns()
    );
    if let Some(ns) = floor {
        println!("# floor: a cache line crosses between the two CPUs in {ns:.0} ns one way (measured now)");
    }
    let rows = run_client(args, &mut child, &addr);
    let status = wait_child(&mut child);
    let rows = rows?;
    status?;
    let mut json_rows = Vec::new();
    for op in &args.ops {
        println!("\n## {op:?}");
        println!("{:>10} {:>12} {:>12} {:>12}", "size", "median us", "p99 us", "GB/s");
        for r in rows.iter().filter(|r| r.op == *op) {
            let f = |v: Option<f64>| v.map(|x| format!("{x:.3}")).unwrap_or_else(|| "-".into());
            let bw = r.gbps.map(|x| format!("{x:.2}")).unwrap_or_else(|| "-".into());
            println!("{:>10} {:>12} {:>12} {:>12}", fmt_size(r.size), f(r.median_us), f(r.p99_us), bw);
            json_rows.push(serde_json::json!({
                "layer": "raw",
                "op": format!("{:?}", r.op),
                "size": r.size,
                "median_us": r.median_us,
                "p99_us": r.p99_us,
                "gbps": r.gbps,
            }));
        }
    }
    let (pss, ring) = memory_per_qp_pair()?;
    println!("\n# memory per connected QP pair: {pss:.0} KiB resident (PSS growth over 32 pairs; each QP maps a {} KiB ring)", ring / 1024);
    if let Some(path) = &args.json {
        let settings = serde_json::json!({ "floor_ns": floor });
        benches::results::write_json(path, &settings, &json_rows)
            .map_err(|e| VerbsError::Os { context: format!("writing {}", path.display()), source: e })?;
    }
    Ok(())
}

fn wait_child(child: &mut Child) -> Result<()> {
    match benches::wait_child(child, Duration::from_secs(10)) {
        Some(st) if st.success() => Ok(()),
        Some(st) => Err(VerbsError::PeerUnreachable(format!("server process failed: {st}"))),
        None => Err(VerbsError::PeerUnreachable("server process did not finish".into())),
    }
}
