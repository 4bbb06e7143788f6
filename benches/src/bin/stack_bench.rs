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
use benches::{cacheline_one_way_ns, fmt_size, pin_to_cpu, sizes_between, timer_cost_ns, wait_child};
use clap::{Parser, ValueEnum};
use hdrhistogram::Histogram;
use madeleine::{RecvMode, SendMode, Session, SessionConfig};
use portability_verbs::*;

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
    /// UCX, the peer the targets name: `ucx_perftest`'s tag-matching ping-pong (`tag_lat`) and
    /// stream (`tag_bw`) over shared memory (`UCX_TLS=posix,cma,self` unless set), in a pair
    /// of processes of its own started for each of this layer's blocks, pinned as ours are,
    /// while ours sleep. Same host only; needs `ucx_perftest` (Debian: `ucx-utils`). Its
    /// latency is the 50th percentile ucx_perftest reports; it reports no p99 and no CPU time.
    Ucx,
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
            Layer::Ucx => "ucx",
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
        default_values = ["raw-send", "raw-wwi", "madeleine", "mad-copy", "mad-zcopy", "tcp"]
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
    /// Bytes streamed per bandwidth point.
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
    /// Run one half only: `server` (with --listen) or `client` (with --connect).
    #[arg(long, value_enum, default_value_t = Role::Both)]
    role: Role,
    /// Server: TCP address to listen on for the bootstrap and the TCP layer.
    #[arg(long)]
    listen: Option<String>,
    /// Client: the server's address.
    #[arg(long)]
    connect: Option<String>,
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

/// Bytes of a control message (a block's announcement, a stream's acknowledgement).
const CONTROL: usize = 16;

fn put_words(b: &mut [u8], w: [u64; 2]) {
    b[..8].copy_from_slice(&w[0].to_le_bytes());
    b[8..CONTROL].copy_from_slice(&w[1].to_le_bytes());
}

fn words(b: &[u8]) -> [u64; 2] {
    let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    [word(0), word(8)]
}

/// A connected transport of one layer, from one side.
trait Link {
    /// Sends `len` bytes of the buffer.
    fn send(&mut self, len: usize) -> Result<(), String>;
    /// Receives one message of `len` bytes.
    fn recv(&mut self, len: usize) -> Result<(), String>;
    /// Sends `count` messages of `len` bytes (a stream), all handed over when it returns.
    fn send_stream(&mut self, len: usize, count: u64) -> Result<(), String> {
        (0..count).try_for_each(|_| self.send(len))
    }
    /// Writes a control message (two words) at the start of the send buffer.
    fn put(&mut self, w: [u64; 2]);
    /// Reads the control message at the start of the last received message.
    fn get(&self) -> [u64; 2];
}

// ---------------------------------------------------------------- raw verbs

struct RawLink {
    qp: QueuePair,
    cq: CompletionQueue,
    send_buf: MemoryRegion,
    recv_buf: MemoryRegion,
    target: (u64, u32),
    wwi: bool,
    wait: Wait,
    posted: u64,
    wcs: Vec<WorkCompletion>,
    /// Receives completed, and those handed to the caller.
    recvs: u64,
    taken: u64,
    sends_done: u64,
    sends: u64,
}

impl RawLink {
    fn setup(
        ctx: &Context,
        conn_fn: impl FnOnce(&ProtectionDomain, &cm::QpSpec, &[u8]) -> Result<cm::Connection>,
        wwi: bool,
        wait: Wait,
    ) -> Result<RawLink> {
        let pd = ctx.alloc_pd()?;
        let send_buf = pd.register(vec![0x5a; MAX].into_boxed_slice(), AccessFlags::ALL)?;
        let recv_buf = pd.alloc(MAX, AccessFlags::ALL)?;
        let spec = cm::QpSpec { cq_capacity: 4096, ..cm::QpSpec::with_depths(1024, 1024) };
        let mut private = recv_buf.addr().to_le_bytes().to_vec();
        private.extend_from_slice(&recv_buf.rkey().to_le_bytes());
        let conn = conn_fn(&pd, &spec, &private)?;
        let cq = conn.cq.clone();
        let p = &conn.peer_private;
        if p.len() != 12 {
            return Err(VerbsError::Protocol("bad private data".into()));
        }
        let target =
            (u64::from_le_bytes(p[..8].try_into().expect("8")), u32::from_le_bytes(p[8..12].try_into().expect("4")));
        let mut l = RawLink {
            qp: conn.qp,
            cq,
            send_buf,
            recv_buf,
            target,
            wwi,
            wait,
            posted: 0,
            wcs: vec![WorkCompletion::EMPTY; 64],
            recvs: 0,
            taken: 0,
            sends_done: 0,
            sends: 0,
        };
        for _ in 0..512 {
            l.post_recv()?;
        }
        Ok(l)
    }

    fn post_recv(&mut self) -> Result<()> {
        self.posted += 1;
        self.qp.post_recv(&[RecvWr::new(self.posted, &[self.recv_buf.sge(0, MAX)])])
    }

    fn poll(&mut self) -> Result<(), String> {
        let n = match self.wait {
            Wait::Busy => self.cq.poll(&mut self.wcs).map_err(|e| e.to_string())?,
            Wait::Interrupt => self.cq.poll_blocking(&mut self.wcs, T).map_err(|e| e.to_string())?,
        };
        for wc in &self.wcs[..n] {
            if wc.status != WcStatus::Success {
                return Err(format!("completion failed: {wc:?}"));
            }
            match wc.opcode {
                WcOpcode::Recv | WcOpcode::RecvRdmaWithImm => self.recvs += 1,
                _ => self.sends_done += 1,
            }
        }
        Ok(())
    }
}

impl Link for RawLink {
    fn send(&mut self, len: usize) -> Result<(), String> {
        // Keep at most 256 sends in flight (signal every 64th).
        let mut patience = Patience::default();
        while self.sends - self.sends_done * 64 >= 256 {
            self.poll()?;
            if patience.expired() {
                return Err("send queue stuck".into());
            }
        }
        self.sends += 1;
        let signaled = self.sends.is_multiple_of(64);
        let sge = [self.send_buf.sge(0, len)];
        let wr = if self.wwi {
            SendWr::write_with_imm(self.sends, &sge, self.target.0, self.target.1, len as u32)
        } else {
            SendWr::send(self.sends, &sge)
        };
        self.qp.post_send(&[wr.inline(len <= 64).signaled(signaled)]).map_err(|e| e.to_string())
    }

    fn recv(&mut self, _len: usize) -> Result<(), String> {
        let mut patience = Patience::default();
        while self.recvs == self.taken {
            self.poll()?;
            if patience.expired() {
                return Err("no message within the timeout".into());
            }
        }
        self.taken += 1;
        self.post_recv().map_err(|e| e.to_string())
    }

    fn put(&mut self, w: [u64; 2]) {
        let mut b = [0u8; CONTROL];
        put_words(&mut b, w);
        self.send_buf.write(0, &b);
    }

    fn get(&self) -> [u64; 2] {
        [self.recv_buf.read_u64(0), self.recv_buf.read_u64(8)]
    }
}

/// A busy wait's timeout ([`T`]), starting at the first check and read from the clock only
/// every 1024th: a clock read costs about a tenth of a small message's one-way latency, and
/// the benchmark should measure the stack, not its own timeouts.
#[derive(Default)]
struct Patience {
    checks: u32,
    deadline: Option<Instant>,
}

impl Patience {
    fn expired(&mut self) -> bool {
        self.checks = self.checks.wrapping_add(1);
        if self.checks % 1024 != 1 {
            return false;
        }
        let now = Instant::now();
        now > *self.deadline.get_or_insert(now + T)
    }
}

// ---------------------------------------------------------------- message pipe

struct PipeLink {
    pipe: datapath::MsgPipe,
    _pd: ProtectionDomain,
    wait: Wait,
    buf: Vec<u8>,
    rbuf: Vec<u8>,
}

impl PipeLink {
    fn setup(
        ctx: &Context,
        conn_fn: impl FnOnce(&ProtectionDomain, &cm::QpSpec, &[u8]) -> Result<cm::Connection>,
        wait: Wait,
    ) -> Result<PipeLink> {
        let pd = ctx.alloc_pd()?;
        let conn = conn_fn(&pd, &cm::QpSpec { cq_capacity: 4096, ..cm::QpSpec::default() }, &[])?;
        let strategy = flow_strategy().map_err(VerbsError::InvalidArgument)?;
        let pipe = datapath::MsgPipe::establish(conn.qp, conn.cq, &pd, strategy, SETUP)?;
        Ok(PipeLink { pipe, _pd: pd, wait, buf: vec![0x5a; MAX], rbuf: vec![0; MAX] })
    }

    /// Waits a little for the pipe's next completion (nothing, when busy-polling).
    fn pause(&mut self, patience: &mut Patience, what: &str) -> Result<(), String> {
        if patience.expired() {
            return Err(format!("pipe: {what} within {T:?}"));
        }
        if self.wait == Wait::Interrupt && self.pipe.prepare_sleep().map_err(|e| e.to_string())? {
            wait_any(&[self.pipe.cq()], Duration::from_millis(1)).map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

impl Link for PipeLink {
    fn send(&mut self, len: usize) -> Result<(), String> {
        let mut patience = Patience::default();
        let max = self.pipe.strategy().max_message();
        let mut off = 0;
        loop {
            let end = (off + max).min(len);
            if self.pipe.try_send(&self.buf[off..end]).map_err(|e| e.to_string())? {
                off = end;
                if off == len {
                    break;
                }
                continue;
            }
            self.pipe.progress().map_err(|e| e.to_string())?;
            self.pause(&mut patience, "no room to send")?;
        }
        // Accepted is not sent: what the pipe coalesced behind outstanding sends leaves at a
        // later completion, and the peer must not wait for it while this side serves another
        // layer's link (as Madeleine's send does).
        loop {
            self.pipe.flush().map_err(|e| e.to_string())?;
            if self.pipe.staged() == 0 {
                return Ok(());
            }
            self.pipe.progress().map_err(|e| e.to_string())?;
            self.pause(&mut patience, "message not handed to the transport")?;
        }
    }

    fn recv(&mut self, len: usize) -> Result<(), String> {
        let mut patience = Patience::default();
        let mut got = 0;
        loop {
            let rbuf = &mut self.rbuf;
            let n = self
                .pipe
                .recv_with(|m| {
                    let n = m.len().min(len - got);
                    rbuf[got..got + n].copy_from_slice(&m[..n]);
                    (n == m.len()).then_some(n)
                })
                .map_err(|e| e.to_string())?;
            match n {
                Some(Some(n)) => {
                    got += n;
                    if got == len {
                        return Ok(());
                    }
                }
                Some(None) => return Err(format!("pipe: more than the {len} bytes expected")),
                None => self.pause(&mut patience, "no message")?,
            }
        }
    }

    fn put(&mut self, w: [u64; 2]) {
        put_words(&mut self.buf, w);
    }

    fn get(&self) -> [u64; 2] {
        words(&self.rbuf)
    }
}

// ---------------------------------------------------------------- Madeleine

struct MadLink {
    ch: madeleine::Channel,
    _session: Session,
    peer: usize,
    buf: Vec<u8>,
    rbuf: Vec<u8>,
    /// Messages a stream leaves pending at most (0: each message's `end_packing` waits).
    in_flight: usize,
}

impl Link for MadLink {
    fn send(&mut self, len: usize) -> Result<(), String> {
        let mut p = self.ch.begin_packing(self.peer).map_err(|e| e.to_string())?;
        p.pack(&self.buf[..len], SendMode::Cheaper, RecvMode::Cheaper).map_err(|e| e.to_string())?;
        p.end_packing().map_err(|e| e.to_string())
    }
    fn send_stream(&mut self, len: usize, count: u64) -> Result<(), String> {
        if self.in_flight == 0 {
            return (0..count).try_for_each(|_| self.send(len));
        }
        let mut pending = std::collections::VecDeque::with_capacity(self.in_flight);
        for _ in 0..count {
            if pending.len() == self.in_flight {
                pending.pop_front().map_or(Ok(()), madeleine::PendingSend::wait).map_err(|e| e.to_string())?;
            }
            let mut p = self.ch.begin_packing(self.peer).map_err(|e| e.to_string())?;
            p.pack(&self.buf[..len], SendMode::Cheaper, RecvMode::Cheaper).map_err(|e| e.to_string())?;
            pending.push_back(p.end_packing_nowait().map_err(|e| e.to_string())?);
        }
        pending.into_iter().try_for_each(madeleine::PendingSend::wait).map_err(|e| e.to_string())
    }
    fn recv(&mut self, len: usize) -> Result<(), String> {
        let mut u = self.ch.begin_unpacking_from(self.peer).map_err(|e| e.to_string())?;
        u.unpack(&mut self.rbuf[..len], SendMode::Cheaper, RecvMode::Cheaper).map_err(|e| e.to_string())?;
        u.end_unpacking().map_err(|e| e.to_string())
    }
    fn put(&mut self, w: [u64; 2]) {
        put_words(&mut self.buf, w);
    }
    fn get(&self) -> [u64; 2] {
        words(&self.rbuf)
    }
}

/// The rendezvous threshold Madeleine's transport probe chose (when the `madeleine` layer ran).
static MAD_PROBED_THRESHOLD: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

/// The flow strategy of the pipe and Madeleine layers: Madeleine's default, or `MAD_FLOW`.
fn flow_strategy() -> Result<datapath::FlowStrategy, String> {
    match std::env::var("MAD_FLOW") {
        Ok(name) => datapath::FlowStrategy::by_name(&name)
            .ok_or_else(|| format!("MAD_FLOW={name:?}: credit, rdma, window or polled")),
        Err(_) => Ok(SessionConfig::new(0, 1, "").strategy),
    }
}

fn mad_link(layer: Layer, rank: usize, dir: PathBuf, in_flight: usize) -> Result<MadLink, String> {
    let mut cfg = SessionConfig::new(rank, 2, dir);
    // The session's one timeout bounds its rendezvous as well as its waits for messages.
    cfg.timeout = SETUP;
    cfg.wait_limit = Some(SETUP);
    if let Some(t) = layer.mad_threshold() {
        cfg.rendezvous_threshold = Some(t);
    }
    cfg.strategy = flow_strategy()?;
    let s = Session::new(cfg).map_err(|e| e.to_string())?;
    let ch = s.channel().map_err(|e| e.to_string())?;
    if layer == Layer::Madeleine && rank == 0 {
        let t = ch.rendezvous_threshold(1).map_err(|e| e.to_string())?;
        let _ = MAD_PROBED_THRESHOLD.set(t);
    }
    let in_flight = if layer.nowait() { in_flight.max(1) } else { 0 };
    Ok(MadLink { ch, _session: s, peer: 1 - rank, buf: vec![0x5a; MAX], rbuf: vec![0; MAX], in_flight })
}

// ---------------------------------------------------------------- TCP

struct TcpLink {
    s: TcpStream,
    buf: Vec<u8>,
    /// How long one message may take.
    limit: Duration,
}

impl TcpLink {
    /// Busy waiting: a nonblocking socket polled in a loop; interrupt waiting: blocking calls
    /// (with timeouts, so a dead peer cannot hang the run).
    fn new(s: TcpStream, wait: Wait) -> std::io::Result<TcpLink> {
        Self::with_limit(s, wait, T)
    }

    fn with_limit(s: TcpStream, wait: Wait, limit: Duration) -> std::io::Result<TcpLink> {
        s.set_nodelay(true)?;
        s.set_nonblocking(wait == Wait::Busy)?;
        s.set_read_timeout(Some(limit))?;
        s.set_write_timeout(Some(limit))?;
        Ok(TcpLink { s, buf: vec![0x5a; MAX], limit })
    }

    /// The UCX layer's link: blocking, so the server sleeps in a read while UCX's processes
    /// run, until the client's message says they are done.
    fn sleeper(s: TcpStream) -> std::io::Result<TcpLink> {
        Self::with_limit(s, Wait::Interrupt, UCX_LIMIT + Duration::from_secs(30))
    }
}

impl Link for TcpLink {
    fn send(&mut self, len: usize) -> Result<(), String> {
        let (s, buf) = (&mut self.s, &self.buf);
        benches::io_whole(len, self.limit, |off| s.write(&buf[off..len])).map_err(|e| format!("TCP send: {e}"))
    }
    fn recv(&mut self, len: usize) -> Result<(), String> {
        let (s, buf) = (&mut self.s, &mut self.buf);
        benches::io_whole(len, self.limit, |off| s.read(&mut buf[off..len])).map_err(|e| format!("TCP receive: {e}"))
    }
    fn put(&mut self, w: [u64; 2]) {
        put_words(&mut self.buf, w);
    }
    fn get(&self) -> [u64; 2] {
        words(&self.buf)
    }
}

// ---------------------------------------------------------------- UCX, the peer

/// How long one ucx_perftest run may take before the run fails.
const UCX_LIMIT: Duration = Duration::from_secs(120);

/// What one ucx_perftest run reported.
#[derive(Clone, Copy, Debug, PartialEq)]
struct UcxResult {
    /// Median one-way latency (its `50.0_percentile_lat`, us).
    p50_us: f64,
    /// Overall bandwidth (its `overall_bw`, in MiB/s there), GB/s.
    gbps: f64,
}

/// Reads ucx_perftest's `-v` output: a CSV header line starting with `iterations,` and the
/// values on the line after it, found by column name.
fn parse_ucx_csv(out: &str) -> Result<UcxResult, String> {
    let lines: Vec<&str> = out.lines().map(str::trim).collect();
    let at = lines.iter().rposition(|l| l.starts_with("iterations,")).ok_or("no CSV header in its output")?;
    let values = lines.get(at + 1).ok_or("no CSV values after its header")?;
    let (names, values): (Vec<&str>, Vec<&str>) = (lines[at].split(',').collect(), values.split(',').collect());
    if names.len() != values.len() {
        return Err(format!("{} CSV columns but {} values", names.len(), values.len()));
    }
    let column = |name: &str| -> Result<f64, String> {
        let i = names.iter().position(|n| *n == name).ok_or_else(|| format!("no {name} column"))?;
        let v: f64 = values[i].parse().map_err(|_| format!("{name} is not a number: {:?}", values[i]))?;
        if v.is_finite() && v >= 0.0 {
            Ok(v)
        } else {
            Err(format!("{name} out of range: {v}"))
        }
    };
    Ok(UcxResult { p50_us: column("50.0_percentile_lat")?, gbps: column("overall_bw")? * 1_048_576.0 / 1e9 })
}

/// Whether `ucx_perftest` is on the PATH.
fn ucx_perftest_found() -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join("ucx_perftest").is_file()))
}

/// A `ucx_perftest` command, pinned to `cpu` (with taskset) if given, over shared memory
/// unless `UCX_TLS` says otherwise.
fn ucx_command(cpu: Option<usize>) -> Command {
    let mut c = match cpu {
        Some(cpu) => {
            let mut c = Command::new("taskset");
            c.args(["-c", &cpu.to_string(), "ucx_perftest"]);
            c
        }
        None => Command::new("ucx_perftest"),
    };
    if std::env::var_os("UCX_TLS").is_none() {
        c.env("UCX_TLS", "posix,cma,self");
    }
    c
}

/// Runs one ucx_perftest `test` of `n` iterations (after `warm` unrecorded ones) between a
/// server and a client process, pinned to the server's and the client's CPUs of `cpus`
/// (client, server) if given. The client is retried while the server is still coming up.
fn run_ucx(test: &str, size: usize, n: u64, warm: u64, cpus: Option<(usize, usize)>) -> Result<UcxResult, String> {
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("finding a free port: {e}"))?
        .port()
        .to_string();
    let log = std::env::temp_dir().join(format!("stack-bench-ucx-{}-{port}", std::process::id()));
    let mut server = ucx_command(cpus.map(|c| c.1))
        .args(["-p", &port])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("starting ucx_perftest: {e}"))?;
    let started = Instant::now();
    let result = loop {
        let file = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let mut client = ucx_command(cpus.map(|c| c.0))
            .args(["127.0.0.1", "-p", &port, "-t", test, "-s", &size.to_string()])
            .args(["-n", &n.max(1).to_string(), "-w", &warm.to_string(), "-v"])
            .stdout(file.try_clone().map_err(|e| e.to_string())?)
            .stderr(file)
            .spawn()
            .map_err(|e| format!("starting ucx_perftest: {e}"))?;
        let status = wait_child(&mut client, UCX_LIMIT);
        let out = std::fs::read_to_string(&log).unwrap_or_default();
        match status {
            Some(st) if st.success() => break parse_ucx_csv(&out).map_err(|e| format!("ucx_perftest {test}: {e}")),
            // Not listening yet: the client gives up at once; try again for a while.
            Some(_) if matches!(server.try_wait(), Ok(None)) && started.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Some(st) => {
                let tail: Vec<&str> = out.lines().rev().take(3).collect();
                break Err(format!("ucx_perftest {test} failed ({st}): {}", tail.join(" / ")));
            }
            None => break Err(format!("ucx_perftest {test} took over {UCX_LIMIT:?}")),
        }
    };
    if wait_child(&mut server, Duration::from_secs(10)).is_none() {
        log::warn!("the ucx_perftest server did not end; killed");
    }
    let _ = std::fs::remove_file(&log);
    result
}

/// One of the UCX layer's blocks: tells the server to sleep on the layer's link, runs UCX
/// (`run`), then wakes the server.
fn ucx_block(
    block: Block,
    links: &mut [Box<dyn Link>],
    run: impl FnOnce() -> Result<UcxResult, String>,
) -> Result<UcxResult, String> {
    let (Block::Latency { link, .. } | Block::Stream { link, .. }) = block else {
        return Err("not a measuring block".into());
    };
    block.announce(links[0].as_mut())?;
    let got = run();
    // Woken either way, so that a failure ends the run cleanly on both sides; UCX's own
    // failure is the one reported.
    links[link].put([0, 0]);
    let woken = links[link].send(CONTROL);
    let got = got?;
    woken.map(|()| got)
}

// ---------------------------------------------------------------- driving the links

/// What the client asks the server to serve next: a 16-byte message on the first layer's link,
/// outside the measurements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Block {
    /// `round_trips` ping-pongs of `size` bytes on link `link`.
    Latency { link: usize, size: usize, round_trips: u64 },
    /// `messages` of `size` bytes streamed on link `link`, then the server's acknowledgement
    /// carrying the CPU nanoseconds it spent.
    Stream { link: usize, size: usize, messages: u64 },
    /// The run is over.
    Done,
}

impl Block {
    fn encode(self) -> [u64; 2] {
        let head = |kind: u64, link: usize, size: usize| kind | (link as u64) << 8 | (size as u64) << 16;
        match self {
            Block::Latency { link, size, round_trips } => [head(1, link, size), round_trips],
            Block::Stream { link, size, messages } => [head(2, link, size), messages],
            Block::Done => [0, 0],
        }
    }

    /// Checks what the client sent against the links and sizes there are.
    fn decode(w: [u64; 2], links: usize) -> Result<Block, String> {
        let (kind, link, size) = (w[0] & 0xff, (w[0] >> 8 & 0xff) as usize, (w[0] >> 16) as usize);
        let block = match kind {
            0 => return Ok(Block::Done),
            1 => Block::Latency { link, size, round_trips: w[1] },
            2 => Block::Stream { link, size, messages: w[1] },
            k => return Err(format!("the client sent an unknown block kind {k}")),
        };
        if link >= links || size == 0 || size > MAX {
            return Err(format!("the client asked for link {link} of {links} with {size}-byte messages"));
        }
        Ok(block)
    }

    /// One message, so that a link whose `get` sees only the latest arrival reads it whole.
    fn announce(self, control: &mut dyn Link) -> Result<(), String> {
        control.put(self.encode());
        control.send(CONTROL)
    }
}

/// The `r`th of `parts` near-equal shares of `total`.
fn share(total: u64, parts: u64, r: u64) -> u64 {
    total / parts + u64::from(r < total % parts)
}

/// The median of a block's samples or of the rounds' differences (reordered).
fn median<T: Ord + Copy>(v: &mut [T]) -> T {
    let mid = v.len() / 2;
    *v.select_nth_unstable(mid).1
}

/// One layer's measurements at one size, summed over the rounds.
struct Tally {
    hist: Histogram<u64>,
    /// Each round's median one-way latency (ns).
    round_medians: Vec<u64>,
    bytes: f64,
    secs: f64,
    cpu: f64,
}

/// Runs `warm` unrecorded round trips, then `n` recorded ones; returns their one-way times (ns).
fn latency_block(link: &mut dyn Link, size: usize, warm: u64, n: u64) -> Result<Vec<u64>, String> {
    let mut samples = Vec::with_capacity(n as usize);
    // One clock read per round trip, as ucx_perftest takes it: each round trip ends where
    // the next begins, so the loop's own work is counted once and the timer once.
    let mut last = Instant::now();
    for i in 0..warm + n {
        link.send(size)?;
        link.recv(size)?;
        let now = Instant::now();
        if i >= warm {
            samples.push(((now - last).as_nanos() as u64 / 2).max(1));
        }
        last = now;
    }
    Ok(samples)
}

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
                bytes: 0.0,
                secs: 0.0,
                cpu: 0.0,
            })
            .collect();
        for r in 0..lat_rounds.max(stream_rounds) {
            for (t, &i) in tallies.iter_mut().zip(&active) {
                if r == 0 {
                    progress(layers[i], size);
                }
                let started = Instant::now();
                let fail = |e: String| format!("client, {}: {e}", layers[i].name());
                if layers[i] == Layer::Ucx {
                    let cpus = (!args.no_pin).then(|| (args.cpus[0], args.cpus.get(1).copied().unwrap_or(0)));
                    if r < lat_rounds {
                        let (warm, n) = (warmup.div_ceil(lat_rounds), share(iters, lat_rounds, r));
                        let block = Block::Latency { link: i, size, round_trips: 0 };
                        let got = ucx_block(block, links, || run_ucx("tag_lat", size, n, warm, cpus)).map_err(fail)?;
                        let p50 = (got.p50_us * 1e3).round().max(1.0) as u64;
                        t.hist.record_n(p50, n).ok();
                        t.round_medians.push(p50);
                    }
                    if r < stream_rounds {
                        let messages = share(count, stream_rounds, r);
                        let block = Block::Stream { link: i, size, messages };
                        let got = ucx_block(block, links, || run_ucx("tag_bw", size, messages, messages / 10, cpus))
                            .map_err(fail)?;
                        let bytes = (messages * size as u64) as f64;
                        t.bytes += bytes;
                        t.secs += bytes / (got.gbps * 1e9).max(1.0);
                    }
                    spent[i] += started.elapsed();
                    continue;
                }
                if r < lat_rounds {
                    // Every block warms up again: the other layers ran in between.
                    let warm = warmup.div_ceil(lat_rounds);
                    let n = share(iters, lat_rounds, r);
                    Block::Latency { link: i, size, round_trips: warm + n }
                        .announce(links[0].as_mut())
                        .map_err(fail)?;
                    let mut samples = latency_block(links[i].as_mut(), size, warm, n).map_err(fail)?;
                    for &s in &samples {
                        t.hist.record(s).ok();
                    }
                    t.round_medians.push(median(&mut samples));
                }
                if r < stream_rounds {
                    let messages = share(count, stream_rounds, r);
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
            let ours = layers[i] != Layer::Ucx;
            out.push(Point {
                layer: layers[i],
                size,
                median_us: t.hist.value_at_quantile(0.5) as f64 / 1e3,
                p99_us: ours.then(|| t.hist.value_at_quantile(0.99) as f64 / 1e3),
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

/// The server's side: serves the blocks the client announces, until it is done.
fn serve(links: &mut [Box<dyn Link>], layers: &[Layer]) -> Result<(), String> {
    loop {
        links[0].recv(CONTROL).map_err(|e| format!("server, waiting for the next block: {e}"))?;
        let w = links[0].get();
        let fail = |link: usize| move |e: String| format!("server, {}: {e}", layers[link].name());
        let block = Block::decode(w, links.len()).map_err(|e| format!("server: {e}"))?;
        if let Block::Latency { link, .. } | Block::Stream { link, .. } = block {
            if layers[link] == Layer::Ucx {
                // UCX's own processes run now: sleep until the client says they are done.
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
                let dir = args.mad_dir.as_ref().ok_or("madeleine needs the shared directory (same host only)")?;
                Box::new(mad_link(l, 1, dir.join(l.name()), args.in_flight as usize).map_err(context)?)
            }
            _ => {
                let (s, _) = tcp.accept().map_err(|e| context(e.to_string()))?;
                let link = if layer == Layer::Ucx { TcpLink::sleeper(s) } else { TcpLink::new(s, args.wait) };
                Box::new(link.map_err(|e| context(e.to_string()))?)
            }
        };
        links.push(link);
    }
    serve(&mut links, &args.layers)
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
                let dir = args.mad_dir.as_ref().ok_or("madeleine needs a shared directory (same host only)")?;
                Box::new(mad_link(l, 0, dir.join(l.name()), args.in_flight as usize).map_err(context)?)
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
                let link = if layer == Layer::Ucx { TcpLink::sleeper(s) } else { TcpLink::new(s, args.wait) };
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

// ---------------------------------------------------------------- output

fn find(points: &[Point], layer: Layer, size: usize) -> Option<&Point> {
    points.iter().find(|p| p.layer == layer && p.size == size)
}

fn print_table(points: &[Point], layers: &[Layer]) {
    let with_ucx = layers.contains(&Layer::Ucx);
    println!(
        "{:>10} {:>9} {:>10} {:>9} {:>9} {:>10} {:>9} {:>9} {:>9}{}",
        "layer",
        "size",
        "median us",
        "p99 us",
        "-raw us",
        "GB/s",
        "MB/CPU-s",
        "lat/tcp",
        "bw/raw",
        if with_ucx { format!(" {:>9} {:>9}", "-ucx us", "bw/ucx") } else { String::new() }
    );
    for &layer in layers {
        for p in points.iter().filter(|p| p.layer == layer) {
            let tcp = find(points, Layer::Tcp, p.size);
            let raw = find(points, Layer::RawSend, p.size);
            let ucx = find(points, Layer::Ucx, p.size);
            // An absent value prints as a dash.
            let dash = |a: Option<String>| a.unwrap_or_else(|| "-".into());
            let r = |a: Option<f64>| dash(a.map(|v| format!("{v:.2}")));
            let us = |a: Option<f64>| dash(a.map(|v| format!("{v:+.3}")));
            println!(
                "{:>10} {:>9} {:>10.3} {:>9} {:>9} {:>9.2} {:>10} {:>9} {:>9}{}",
                layer.name(),
                fmt_size(p.size),
                p.median_us,
                dash(p.p99_us.map(|v| format!("{v:.3}"))),
                us(p.minus_raw_us),
                p.gbps,
                dash(p.mb_per_cpu_s.map(|v| format!("{v:.0}"))),
                r(tcp.map(|t| p.median_us / t.median_us)),
                r(raw.map(|t| p.gbps / t.gbps)),
                if with_ucx {
                    format!(" {:>9} {:>9}", us(p.minus_ucx_us), r(ucx.map(|t| p.gbps / t.gbps)))
                } else {
                    String::new()
                }
            );
        }
    }
}

fn write_results(dir: &std::path::Path, points: &[Point], meta: &str) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut csv = String::from("layer,size,median_us,p99_us,minus_raw_us,gbps,mb_per_cpu_s,minus_ucx_us\n");
    let mut json = format!("{{\"meta\":{meta},\"points\":[");
    for (i, p) in points.iter().enumerate() {
        // Absent values: empty in the CSV, null in the JSON.
        let opt = |v: Option<f64>, digits: usize, none: &str| {
            v.map(|v| format!("{v:.digits$}")).unwrap_or_else(|| none.into())
        };
        csv.push_str(&format!(
            "{},{},{:.4},{},{},{:.4},{},{}\n",
            p.layer.name(),
            p.size,
            p.median_us,
            opt(p.p99_us, 4, ""),
            opt(p.minus_raw_us, 4, ""),
            p.gbps,
            opt(p.mb_per_cpu_s, 1, ""),
            opt(p.minus_ucx_us, 4, "")
        ));
        json.push_str(&format!(
            "{}{{\"layer\":\"{}\",\"size\":{},\"median_us\":{:.4},\"p99_us\":{},\"minus_raw_us\":{},\"gbps\":{:.4},\"mb_per_cpu_s\":{},\"minus_ucx_us\":{}}}",
            if i > 0 { "," } else { "" },
            p.layer.name(),
            p.size,
            p.median_us,
            opt(p.p99_us, 4, "null"),
            opt(p.minus_raw_us, 4, "null"),
            p.gbps,
            opt(p.mb_per_cpu_s, 1, "null"),
            opt(p.minus_ucx_us, 4, "null")
        ));
    }
    json.push_str("]}\n");
    std::fs::write(dir.join("results.csv"), csv)?;
    std::fs::write(dir.join("results.json"), json)?;
    std::fs::write(dir.join("latency.svg"), svg_plot(points, "one-way latency (us, median)", |p| p.median_us))?;
    std::fs::write(dir.join("bandwidth.svg"), svg_plot(points, "bandwidth (GB/s)", |p| p.gbps))?;
    Ok(())
}

/// A log-log line chart of `value` against message size, one line per layer.
fn svg_plot(points: &[Point], title: &str, value: impl Fn(&Point) -> f64) -> String {
    // Each layer once, in the order it first appears (points come size by size, the layers
    // taking turns within each size).
    let mut layers: Vec<Layer> = Vec::new();
    for p in points {
        if !layers.contains(&p.layer) {
            layers.push(p.layer);
        }
    }
    let series: Vec<Series> = layers
        .iter()
        .map(|l| Series {
            name: l.name().to_string(),
            points: points.iter().filter(|p| p.layer == *l).map(|p| (p.size as f64, value(p))).collect(),
        })
        .collect();
    line_chart(&Axes { title, x_label: "message size", x_sizes: true, log_y: true }, &series)
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
            if args.layers.iter().any(|l| l.is_madeleine()) && args.mad_dir.is_none() {
                return Err("the madeleine layer runs on one host only (drop it with --layers)".into());
            }
            let points = client_main(args, &addr, &mut None)?;
            report(args, &points, None)
        }
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

fn report(args: &Args, points: &[Point], floor: Option<f64>) -> Result<(), String> {
    let timer = timer_cost_ns();
    println!(
        "# stack_bench: {} provider, two processes on one host, {:?} waiting",
        match args.provider {
            ProviderArg::Software => "software",
            ProviderArg::Hardware => "hardware",
        },
        args.wait
    );
    println!(
        "# timer cost {timer:.1} ns (included in latencies, not subtracted){}",
        floor.map(|f| format!("; cache-line floor {f:.0} ns one way")).unwrap_or_default()
    );
    print_table(points, &args.layers);
    if let Some(p) = points.iter().find(|p| p.layer == Layer::RawSend && p.size <= 64) {
        let rtt = Duration::from_nanos((2.0 * p.median_us * 1e3) as u64);
        let x = portability_verbs::datapath::crossover::crossover_from(
            portability_verbs::datapath::crossover::copy_curve(),
            rtt,
        );
        println!("# copy/zero-copy crossover chosen for this peer: {} (copy curve of this process, round trip {:.2} us of this run)", fmt_size(x), 2.0 * p.median_us);
    }
    match MAD_PROBED_THRESHOLD.get() {
        Some(&usize::MAX) => println!("# madeleine's transport probe: zero-copy never pays to this peer (large packs copied through the bulk lane)"),
        Some(&t) => println!("# madeleine's transport probe: packs of {} and more go zero-copy to this peer", fmt_size(t)),
        None => {}
    }
    let out = args.out.clone().unwrap_or_else(|| {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        PathBuf::from("results").join(format!("stack-{t}"))
    });
    let meta = format!(
        "{{\"provider\":\"{:?}\",\"wait\":\"{:?}\",\"timer_ns\":{timer:.1},\"floor_ns\":{}}}",
        args.provider,
        args.wait,
        floor.map(|f| format!("{f:.1}")).unwrap_or_else(|| "null".into())
    );
    write_results(&out, points, &meta).map_err(|e| format!("writing {}: {e}", out.display()))?;
    println!("# results (JSON, CSV, latency.svg, bandwidth.svg) in {}", out.display());
    Ok(())
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
        let got = parse_ucx_csv(out).unwrap();
        assert_eq!(got.p50_us, 0.18);
        assert!((got.gbps - 1.048576).abs() < 1e-9, "MiB/s to GB/s: {got:?}");
        assert!(parse_ucx_csv("connect() failed\n").unwrap_err().contains("no CSV header"));
        assert!(parse_ucx_csv("iterations,overall_bw\n").unwrap_err().contains("no CSV values"));
        assert!(parse_ucx_csv("iterations,overall_bw\n1,2,3\n").unwrap_err().contains("2 CSV columns but 3"));
        let no_p50 = "iterations,overall_bw\n1,2\n";
        assert!(parse_ucx_csv(no_p50).unwrap_err().contains("no 50.0_percentile_lat column"));
        let nan = "iterations,50.0_percentile_lat,overall_bw\n1,x,2\n";
        assert!(parse_ucx_csv(nan).unwrap_err().contains("not a number"));
        let negative = "iterations,50.0_percentile_lat,overall_bw\n1,-1,2\n";
        assert!(parse_ucx_csv(negative).unwrap_err().contains("out of range"));
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
