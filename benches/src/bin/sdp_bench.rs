//! The AZ-SDP paper's benchmark suite on the software provider: BSDP, ZSDP, AZ-SDP and TCP
//! loopback side by side in one run. Single connection: ping-pong latency, ttcp-style
//! unidirectional throughput, throughput with computation between sends (overlap), and the
//! page-fault window (the sender touches its buffer every W writes). Several connections:
//! hot-spot latency (one server, several clients), multi-stream throughput (a thread pair per
//! connection) and multi-client throughput (one server thread reading every client).
//!
//! By default both ends are threads of this process; `--peer process` runs the far end of the
//! single-connection tests (latency, throughput, overlap, fault window) in a child process, as
//! two applications would (a second address space: the software provider moves data by
//! cross-memory attach, and `mprotect` in a single-threaded process needs no TLB shootdown).
//! Single-connection tests pin the two ends to CPUs 0 and 1. Multi-connection tests always
//! run threads of this process. TCP busy-polls nonblocking sockets, as SDP's receive path does. Buffers are page-aligned.
//! Tables go to stdout; JSON and SVG charts to `--out` (default `results/sdp-<time>`).
//!
//!     cargo run --release -p benches --bin sdp_bench

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command};
use std::thread;
use std::time::{Duration, Instant};

use benches::plot::{line_chart, Axes, Series};
use benches::{cacheline_one_way_ns, fmt_size, io_whole, pin_to_cpu, sizes_between, unpin, PageBuf};
use clap::Parser;
use hdrhistogram::Histogram;
use sockets_compat::{Design, SdpConfig, SdpListener, SdpStream};

#[derive(Parser)]
#[command(about = "SDP designs against TCP loopback: the AZ-SDP paper's benchmark suite")]
struct Args {
    /// Which tests to run (latency, throughput, overlap, window, idle, hotspot, multi; and,
    /// when named, idle-many).
    #[arg(long, default_value = "latency,throughput,overlap,window,idle,hotspot,multi", value_delimiter = ',')]
    tests: Vec<String>,
    /// Smallest message of the latency and throughput sweeps.
    #[arg(long, default_value_t = 8)]
    min: usize,
    /// Largest message of the latency and throughput sweeps.
    #[arg(long, default_value_t = 1 << 20)]
    max: usize,
    /// Round trips per latency point.
    #[arg(long, default_value_t = 2000)]
    iters: usize,
    /// Bytes moved per throughput point.
    #[arg(long, default_value_t = 256 << 20)]
    volume: usize,
    /// Computation between sends in the overlap test, microseconds (comma-separated).
    #[arg(long, default_value = "0,25,50,100,200", value_delimiter = ',')]
    compute_us: Vec<u64>,
    /// Page-fault windows: the sender touches its buffer every W writes (comma-separated).
    #[arg(long, default_value = "1,2,4,8,16,64", value_delimiter = ',')]
    windows: Vec<usize>,
    /// Connection pairs the idle-many test holds (comma-separated).
    #[arg(long, default_value = "10,100,250", value_delimiter = ',')]
    idle_pairs: Vec<usize>,
    /// Connection counts of the multi-connection tests (comma-separated).
    #[arg(long, default_value = "1,2,4", value_delimiter = ',')]
    connections: Vec<usize>,
    /// Which transports (bsdp, zsdp, azsdp, azsdp-bow, tcp; azsdp copies a buffer aside when
    /// the application stores into it before the peer reads it, azsdp-bow waits instead).
    #[arg(long, default_value = "bsdp,zsdp,azsdp,tcp", value_delimiter = ',')]
    layers: Vec<String>,
    /// The zero-copy threshold of ZSDP and AZ-SDP.
    #[arg(long, default_value_t = 16 * 1024)]
    zcopy_threshold: usize,
    /// Measurements per point: every point is taken this many times, the layers in turn
    /// (a slow spell of the host hits them all alike), and the median reported.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=99))]
    repeat: u32,
    /// Where the far end of single-connection tests runs: `thread` or `process`.
    #[arg(long, value_enum, default_value_t = PeerKind::Thread)]
    peer: PeerKind,
    /// Where to write results.json and the charts.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Internal: serve the tests of the parent whose control socket listens at this address.
    #[arg(long, hide = true)]
    serve: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum PeerKind {
    Thread,
    Process,
}

/// A connected byte stream of any layer.
trait Stream: Read + Write + Send + 'static {
    fn nonblocking(&self, on: bool);
    fn read_timeout(&self, t: Duration);
}

impl Stream for TcpStream {
    fn nonblocking(&self, on: bool) {
        self.set_nonblocking(on).expect("set_nonblocking");
    }
    fn read_timeout(&self, t: Duration) {
        self.set_read_timeout(Some(t)).expect("set_read_timeout");
    }
}

impl Stream for SdpStream {
    fn nonblocking(&self, on: bool) {
        self.set_nonblocking(on).expect("set_nonblocking");
    }
    fn read_timeout(&self, t: Duration) {
        self.set_read_timeout(Some(t)).expect("set_read_timeout");
    }
}

const T: Duration = Duration::from_secs(60);

fn read_full(s: &mut dyn Stream, buf: &mut [u8]) -> std::io::Result<()> {
    io_whole(buf.len(), T, |off| s.read(&mut buf[off..]))
}

fn write_full(s: &mut dyn Stream, buf: &[u8]) -> std::io::Result<()> {
    io_whole(buf.len(), T, |off| s.write(&buf[off..]))
}

/// Reads one byte per page: what an application looking at its data does (for AZ-SDP it
/// waits until receives into `buf` have landed, which it must before freeing `buf`). The sum
/// goes through `black_box` too, or the unused loads would be optimized away.
fn touch(buf: &[u8]) -> u64 {
    std::hint::black_box(std::hint::black_box(buf).iter().step_by(4096).map(|&b| b as u64).sum())
}

/// The socket configuration of an SDP layer: a design's name, or `azsdp-bow` for AZ-SDP with
/// block-on-write instead of the default copy-on-write; other settings from the `SDP_*`
/// environment variables (`SdpConfig::from_env`).
fn sdp_config(layer: &str, zcopy_threshold: usize) -> SdpConfig {
    let (name, block_on_write) = match layer.strip_suffix("-bow") {
        Some(name) => (name, true),
        None => (layer, false),
    };
    let design = Design::by_name(name).unwrap_or_else(|| panic!("unknown layer {layer}"));
    let env = SdpConfig::from_env().unwrap_or_else(|e| panic!("SDP_* settings: {e}"));
    SdpConfig { design, zcopy_threshold, az_copy_on_write: !block_on_write, ..env }
}

/// `n` connected pairs of the named transport on one listener: (client, server) each.
fn connect_many(layer: &str, zcopy_threshold: usize, n: usize) -> Vec<(Box<dyn Stream>, Box<dyn Stream>)> {
    if layer == "tcp" {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let a = l.local_addr().expect("addr");
        return (0..n)
            .map(|_| {
                let c = TcpStream::connect(a).expect("connect");
                let s = l.accept().expect("accept").0;
                for x in [&c, &s] {
                    x.set_nodelay(true).expect("nodelay");
                    x.set_nonblocking(true).expect("nonblocking");
                }
                (Box::new(c) as Box<dyn Stream>, Box::new(s) as Box<dyn Stream>)
            })
            .collect();
    }
    let cfg = sdp_config(layer, zcopy_threshold);
    let l = SdpListener::bind_with("127.0.0.1:0", cfg).expect("bind");
    let a = l.local_addr().expect("addr");
    (0..n)
        .map(|_| {
            let t = thread::spawn(move || SdpStream::connect_with(a, cfg).expect("connect"));
            let s = l.accept_timeout(Duration::from_secs(20)).expect("accept").0;
            let c = t.join().expect("connect thread");
            for x in [&c, &s] {
                x.set_read_timeout(Some(T)).expect("timeout");
                x.set_write_timeout(Some(T)).expect("timeout");
            }
            (Box::new(c) as Box<dyn Stream>, Box::new(s) as Box<dyn Stream>)
        })
        .collect()
}

fn connect(layer: &str, zcopy_threshold: usize) -> (Box<dyn Stream>, Box<dyn Stream>) {
    connect_many(layer, zcopy_threshold, 1).pop().expect("one pair")
}

/// Warm-up round trips before `iters` measured ones.
fn rounds(iters: usize) -> usize {
    iters + iters / 10
}

/// The measuring end of a ping-pong: `rounds(iters)` round trips of `size`, the first tenth
/// unrecorded; one-way latencies (half round trips) in nanoseconds.
fn pingpong_client(mut c: Box<dyn Stream>, size: usize, iters: usize) -> Histogram<u64> {
    let warm = rounds(iters) - iters;
    let mut h = Histogram::<u64>::new(3).expect("histogram");
    let mut buf = PageBuf::new(size, 1);
    for i in 0..iters + warm {
        let t = Instant::now();
        write_full(&mut *c, &buf).expect("client write");
        read_full(&mut *c, &mut buf).expect("client read");
        touch(&buf);
        if i >= warm {
            h.record(t.elapsed().as_nanos() as u64 / 2).expect("record");
        }
    }
    c.flush().expect("client flush");
    h
}

/// What the far end of a single-connection test does.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Role {
    /// Reads `size` and writes it back, `rounds` times.
    Echo { size: usize, rounds: usize },
    /// Reads `count` messages of `size`, then writes a one-byte acknowledgement.
    Sink { size: usize, count: usize },
}

impl Role {
    fn line(self) -> String {
        match self {
            Role::Echo { size, rounds } => format!("echo {size} {rounds}"),
            Role::Sink { size, count } => format!("sink {size} {count}"),
        }
    }

    fn parse(kind: &str, a: usize, b: usize) -> Option<Role> {
        match kind {
            "echo" => Some(Role::Echo { size: a, rounds: b }),
            "sink" => Some(Role::Sink { size: a, count: b }),
            _ => None,
        }
    }
}

/// Plays `role` on `s` (in a thread of this process or in the peer process); returns the
/// stream once the peer has everything (flush), so dropping it loses nothing.
fn serve(mut s: Box<dyn Stream>, role: Role) -> Box<dyn Stream> {
    match role {
        Role::Echo { size, rounds } => {
            let mut buf = PageBuf::new(size, 0);
            for _ in 0..rounds {
                read_full(&mut *s, &mut buf).expect("server read");
                write_full(&mut *s, &buf).expect("server write");
            }
        }
        Role::Sink { size, count } => {
            receive_stream(&mut *s, size, count);
            write_full(&mut *s, &[1]).expect("ack");
        }
    }
    s.flush().expect("server flush");
    s
}

/// Where the far end of single-connection tests runs.
enum Peer {
    Thread,
    Process(Remote),
}

impl Peer {
    /// A stream to a far end that plays `role` (threads: pinned to CPU 1; this end to CPU 0),
    /// and what to wait for once this end is done.
    fn open(&mut self, layer: &str, zt: usize, role: Role) -> (Box<dyn Stream>, Option<thread::JoinHandle<()>>) {
        pin_to_cpu(0);
        match self {
            Peer::Thread => {
                let (c, s) = connect(layer, zt);
                let far = thread::spawn(move || {
                    pin_to_cpu(1);
                    drop(serve(s, role));
                });
                (c, Some(far))
            }
            Peer::Process(r) => (r.open(layer, zt, role), None),
        }
    }

    /// Waits for the far end of the last `open` to finish.
    fn finish(&mut self, far: Option<thread::JoinHandle<()>>) {
        if let Some(t) = far {
            t.join().expect("far end");
        }
        if let Peer::Process(r) = self {
            r.finish();
        }
    }
}

/// The child process that plays the far end, and the control socket to it: one line per test
/// (`layer zt role size n` → `port`, then `done` when the role is played).
struct Remote {
    child: Child,
    to: TcpStream,
    from: BufReader<TcpStream>,
}

impl Remote {
    fn start() -> Remote {
        let l = TcpListener::bind("127.0.0.1:0").expect("control bind");
        let exe = std::env::current_exe().expect("own executable");
        let child = Command::new(exe)
            .args(["--serve", &l.local_addr().expect("addr").to_string()])
            .spawn()
            .expect("starting the peer process");
        let (to, _) = l.accept().expect("the peer process connects");
        let from = BufReader::new(to.try_clone().expect("clone"));
        Remote { child, to, from }
    }

    fn reply(&mut self) -> String {
        let mut line = String::new();
        match self.from.read_line(&mut line) {
            Ok(n) if n > 0 => line.trim().to_string(),
            r => panic!("the peer process went away ({r:?})"),
        }
    }

    fn open(&mut self, layer: &str, zt: usize, role: Role) -> Box<dyn Stream> {
        writeln!(self.to, "{layer} {zt} {}", role.line()).expect("control write");
        let port: u16 = self.reply().parse().expect("port from the peer");
        let a = SocketAddr::from(([127, 0, 0, 1], port));
        if layer == "tcp" {
            let c = TcpStream::connect(a).expect("connect");
            c.set_nodelay(true).expect("nodelay");
            c.set_nonblocking(true).expect("nonblocking");
            return Box::new(c);
        }
        let c = SdpStream::connect_with(a, sdp_config(layer, zt)).expect("connect");
        c.set_read_timeout(Some(T)).expect("timeout");
        c.set_write_timeout(Some(T)).expect("timeout");
        Box::new(c)
    }

    fn finish(&mut self) {
        let r = self.reply();
        assert_eq!(r, "done", "the peer process");
    }
}

impl Drop for Remote {
    fn drop(&mut self) {
        let _ = writeln!(self.to, "quit");
        if benches::wait_child(&mut self.child, Duration::from_secs(10)).is_none_or(|st| !st.success()) {
            eprintln!("sdp_bench: the peer process did not end cleanly");
        }
    }
}

/// The child's side of [`Remote`]: plays one test per control line on CPU 1 until `quit`.
fn serve_parent(control: &str) {
    pin_to_cpu(1);
    let mut to = TcpStream::connect(control).expect("control connect");
    let from = BufReader::new(to.try_clone().expect("clone"));
    for line in from.lines() {
        let line = line.expect("control read");
        let w: Vec<&str> = line.split_whitespace().collect();
        if w.first() == Some(&"quit") {
            return;
        }
        let [layer, zt, kind, a, b] = w[..] else { panic!("bad control line {line:?}") };
        let num = |x: &str| x.parse::<usize>().unwrap_or_else(|_| panic!("bad number in {line:?}"));
        let role = Role::parse(kind, num(a), num(b)).unwrap_or_else(|| panic!("bad role in {line:?}"));
        let s: Box<dyn Stream> = if layer == "tcp" {
            let l = TcpListener::bind("127.0.0.1:0").expect("bind");
            writeln!(to, "{}", l.local_addr().expect("addr").port()).expect("control write");
            let s = l.accept().expect("accept").0;
            s.set_nodelay(true).expect("nodelay");
            s.set_nonblocking(true).expect("nonblocking");
            Box::new(s)
        } else {
            let l = SdpListener::bind_with("127.0.0.1:0", sdp_config(layer, num(zt))).expect("bind");
            writeln!(to, "{}", l.local_addr().expect("addr").port()).expect("control write");
            let s = l.accept_timeout(Duration::from_secs(20)).expect("accept").0;
            s.set_read_timeout(Some(T)).expect("timeout");
            s.set_write_timeout(Some(T)).expect("timeout");
            Box::new(s)
        };
        drop(serve(s, role));
        writeln!(to, "done").expect("control write");
    }
}

/// Median one-way latency in microseconds.
fn pingpong(peer: &mut Peer, layer: &str, size: usize, iters: usize, zt: usize) -> f64 {
    let (c, far) = peer.open(layer, zt, Role::Echo { size, rounds: rounds(iters) });
    let h = pingpong_client(c, size, iters);
    peer.finish(far);
    h.value_at_quantile(0.5) as f64 / 1000.0
}

fn spin_for(d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

/// How a throughput sender behaves between writes.
#[derive(Clone, Copy, Default)]
struct SenderLoad {
    /// Busy work after each write (the overlap test).
    compute: Duration,
    /// Store into the buffer after every `touch_every` writes (the page-fault window).
    touch_every: Option<usize>,
}

/// Sends `count` writes of `size` from `c`; returns once the peer has taken them all in
/// (flush: AZ-SDP must not free a buffer the peer still reads), with the time the first
/// `warm_up` writes had returned: the start of the steady state, past first touches of rings
/// and buffers and the ramp of flow control.
fn send_stream(c: &mut dyn Stream, size: usize, count: usize, warm_up: usize, load: SenderLoad) -> Instant {
    let mut buf = PageBuf::new(size, 7);
    let mut steady = Instant::now();
    for i in 0..count {
        if i == warm_up {
            steady = Instant::now();
        }
        write_full(c, &buf).expect("sender write");
        if !load.compute.is_zero() {
            spin_for(load.compute);
        }
        if load.touch_every.is_some_and(|w| (i + 1) % w == 0) {
            std::hint::black_box(&mut buf[..])[0] = i as u8;
        }
    }
    // AZ-SDP: the buffer goes back to the allocator only once the peer has read it.
    c.flush().expect("sender flush");
    steady
}

/// Receives `count` messages of `size` into one buffer and looks at the last one.
fn receive_stream(s: &mut dyn Stream, size: usize, count: usize) {
    let mut buf = PageBuf::new(size, 0);
    for _ in 0..count {
        read_full(s, &mut buf).expect("receiver read");
    }
    touch(&buf);
}

/// Unidirectional throughput in GB/s of `volume` bytes in writes of `size`; the receiver
/// reads `size` at a time and acknowledges the end. The first eighth of the writes is a
/// warm-up, not timed (what is still buffered when the clock starts, a few credits' worth,
/// is small against the rest).
fn throughput(peer: &mut Peer, layer: &str, size: usize, volume: usize, load: SenderLoad, zt: usize) -> f64 {
    let count = (volume / size).max(8);
    let warm_up = count / 8;
    let (mut c, far) = peer.open(layer, zt, Role::Sink { size, count });
    let steady = send_stream(&mut *c, size, count, warm_up, load);
    let mut ack = [0u8];
    read_full(&mut *c, &mut ack).expect("ack");
    let secs = steady.elapsed().as_secs_f64();
    c.flush().expect("flush");
    // Both ends close at once (the far end's close lingers until we take its last messages).
    drop(c);
    peer.finish(far);
    ((count - warm_up) * size) as f64 / secs / 1e9
}

/// CPU the reading thread uses (% of one core) while a blocking read waits `wait` on a
/// connection nothing arrives on, until its timeout: what an idle connection with a reader
/// blocked on it costs.
fn idle_read(layer: &str, wait: Duration, zt: usize) -> f64 {
    let (_c, mut s) = connect(layer, zt);
    s.nonblocking(false);
    s.read_timeout(wait);
    let (cpu, t) = (benches::cpu_seconds(true), Instant::now());
    let r = s.read(&mut [0u8; 16]);
    let used = benches::cpu_seconds(true) - cpu;
    match r {
        Err(e) if matches!(e.kind(), std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock) => {}
        r => panic!("{layer}: an idle read returned {r:?}"),
    }
    used / t.elapsed().as_secs_f64() * 100.0
}

/// CPU the whole process uses (% of one core) while `n` connection pairs of it sit idle for
/// `wait`, each having carried a byte first: what idle connections cost a server (the
/// background engine's visits; kernel TCP's cost nothing).
fn idle_connections(layer: &str, n: usize, wait: Duration, zt: usize) -> f64 {
    let mut pairs = connect_many(layer, zt, n);
    for (c, s) in &mut pairs {
        s.nonblocking(false);
        write_full(&mut **c, b"x").expect("write");
        read_full(&mut **s, &mut [0u8]).expect("read");
    }
    thread::sleep(Duration::from_secs(1)); // settled: what the byte left in flight is done
    let (cpu, t) = (benches::cpu_seconds(false), Instant::now());
    thread::sleep(wait);
    (benches::cpu_seconds(false) - cpu) / t.elapsed().as_secs_f64() * 100.0
}

/// Hot-spot, as the paper runs it: `n` clients ping-pong with one server thread, which takes
/// a message from every client in turn, then answers every client in turn (so an AZ-SDP
/// server's answers overlap, where a ZSDP server's wait for each other); the median one-way
/// latency over all clients (half of each client's round trip), microseconds.
fn hot_spot(layer: &str, n: usize, size: usize, iters: usize, zt: usize) -> f64 {
    let (clients, mut servers): (Vec<_>, Vec<_>) = connect_many(layer, zt, n).into_iter().unzip();
    let server = thread::spawn(move || {
        let mut bufs: Vec<PageBuf> = (0..servers.len()).map(|_| PageBuf::new(size, 0)).collect();
        for _ in 0..rounds(iters) {
            for (s, buf) in servers.iter_mut().zip(&mut bufs) {
                read_full(&mut **s, buf).expect("server read");
            }
            for (s, buf) in servers.iter_mut().zip(&bufs) {
                write_full(&mut **s, buf).expect("server write");
            }
        }
        for s in &mut servers {
            s.flush().expect("server flush");
        }
        servers
    });
    let runs: Vec<_> = clients.into_iter().map(|c| thread::spawn(move || pingpong_client(c, size, iters))).collect();
    let mut all = Histogram::<u64>::new(3).expect("histogram");
    for r in runs {
        all.add(r.join().expect("client")).expect("merge");
    }
    drop(server.join().expect("server"));
    all.value_at_quantile(0.5) as f64 / 1000.0
}

/// Multi-stream: `n` connections, each with its own sender and receiver thread; aggregate GB/s.
fn multi_stream(layer: &str, n: usize, size: usize, volume: usize, zt: usize) -> f64 {
    let pairs = connect_many(layer, zt, n);
    let count = (volume / n / size).max(8);
    let t = Instant::now();
    let threads: Vec<_> = pairs
        .into_iter()
        .flat_map(|(mut c, mut s)| {
            [
                thread::spawn(move || {
                    send_stream(&mut *c, size, count, 0, SenderLoad::default());
                    let mut ack = [0u8];
                    read_full(&mut *c, &mut ack).expect("ack");
                    c.flush().expect("flush");
                }),
                thread::spawn(move || {
                    receive_stream(&mut *s, size, count);
                    write_full(&mut *s, &[1]).expect("ack");
                    s.flush().expect("flush");
                }),
            ]
        })
        .collect();
    for th in threads {
        th.join().expect("stream thread");
    }
    (n * count * size) as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// Multi-client: `n` client threads send to one server thread that reads every connection in
/// turn (nonblocking, as a select loop does); aggregate GB/s.
fn multi_client(layer: &str, n: usize, size: usize, volume: usize, zt: usize) -> f64 {
    let pairs = connect_many(layer, zt, n);
    let count = (volume / n / size).max(8);
    let (clients, mut servers): (Vec<_>, Vec<_>) = pairs.into_iter().unzip();
    let t = Instant::now();
    let senders: Vec<_> = clients
        .into_iter()
        .map(|mut c| {
            thread::spawn(move || {
                send_stream(&mut *c, size, count, 0, SenderLoad::default());
                let mut ack = [0u8];
                read_full(&mut *c, &mut ack).expect("ack");
                c.flush().expect("flush");
            })
        })
        .collect();
    let mut bufs: Vec<PageBuf> = (0..n).map(|_| PageBuf::new(size, 0)).collect();
    let mut got = vec![0usize; n];
    let total = count * size;
    for s in &servers {
        s.nonblocking(true);
    }
    let deadline = Instant::now() + T;
    while got.iter().any(|&g| g < total) {
        assert!(Instant::now() < deadline, "multi-client server stalled");
        for (i, s) in servers.iter_mut().enumerate() {
            if got[i] == total {
                continue;
            }
            let off = got[i] % size;
            match s.read(&mut bufs[i][off..]) {
                Ok(0) => panic!("a client closed early"),
                Ok(k) => got[i] += k,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => panic!("multi-client read: {e}"),
            }
        }
    }
    for (s, b) in servers.iter_mut().zip(&bufs) {
        touch(b);
        s.nonblocking(false);
        write_full(&mut **s, &[1]).expect("ack");
    }
    let secs = t.elapsed().as_secs_f64();
    for th in senders {
        th.join().expect("client");
    }
    (n * total) as f64 / secs / 1e9
}

/// One measured table: rows of `x` against a figure per layer.
struct Table {
    key: String,
    title: String,
    x_name: &'static str,
    x_sizes: bool,
    log_y: bool,
    layers: Vec<String>,
    /// Measurements per point.
    repeat: u32,
    /// Per row: `x`, each layer's median, each layer's samples.
    rows: Vec<(f64, Vec<f64>, Vec<Vec<f64>>)>,
}

/// The median of `v` (the mean of the middle two of an even count).
fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

impl Table {
    fn start(
        key: &str,
        title: String,
        x_name: &'static str,
        x_sizes: bool,
        log_y: bool,
        layers: &[String],
        repeat: u32,
    ) -> Table {
        println!("\n## {title}");
        print!("{x_name:>10}");
        for l in layers {
            print!("{l:>10}");
        }
        println!();
        Table { key: key.into(), title, x_name, x_sizes, log_y, layers: layers.to_vec(), repeat, rows: Vec::new() }
    }

    /// Measures and prints one row: each layer's figure `repeat` times, the layers in turn, and
    /// the median of each (every sample goes to the JSON).
    fn row(&mut self, x: f64, label: String, mut figure: impl FnMut(&str) -> f64) {
        print!("{label:>10}");
        std::io::stdout().flush().ok();
        let mut samples = vec![Vec::new(); self.layers.len()];
        for _ in 0..self.repeat {
            for (l, s) in self.layers.iter().zip(&mut samples) {
                s.push(figure(l));
            }
        }
        let medians: Vec<f64> = samples.iter().map(|s| median(s)).collect();
        for f in &medians {
            print!("{f:>10.2}");
        }
        println!();
        self.rows.push((x, medians, samples));
    }

    /// The table as the results file holds it: per row, `x`, each layer's median and samples.
    fn json(&self) -> serde_json::Value {
        let rows: Vec<serde_json::Value> = self
            .rows
            .iter()
            .map(|(x, medians, samples)| {
                let mut row = serde_json::Map::new();
                row.insert("x".into(), serde_json::json!(x));
                for (l, m) in self.layers.iter().zip(medians) {
                    row.insert(l.clone(), serde_json::json!(m));
                }
                let all: serde_json::Map<String, serde_json::Value> =
                    self.layers.iter().zip(samples).map(|(l, s)| (l.clone(), serde_json::json!(s))).collect();
                row.insert("samples".into(), all.into());
                row.into()
            })
            .collect();
        serde_json::json!({ "key": self.key, "title": self.title, "x": self.x_name, "rows": rows })
    }

    fn svg(&self) -> String {
        let series: Vec<Series> = self
            .layers
            .iter()
            .enumerate()
            .map(|(k, l)| Series { name: l.clone(), points: self.rows.iter().map(|(x, v, _)| (*x, v[k])).collect() })
            .collect();
        line_chart(
            &Axes { title: &self.title, x_label: self.x_name, x_sizes: self.x_sizes, log_y: self.log_y },
            &series,
        )
    }
}

fn main() {
    env_logger::init();
    let a = Args::parse();
    if let Some(control) = &a.serve {
        serve_parent(control);
        return;
    }
    let floor = cacheline_one_way_ns(0, 1);
    let (mut peer, ends) = match a.peer {
        PeerKind::Thread => (Peer::Thread, "threads of one process"),
        PeerKind::Process => (Peer::Process(Remote::start()), "two processes"),
    };
    let env = SdpConfig::from_env().unwrap_or_else(|e| panic!("SDP_* settings: {e}"));
    println!(
        "# sdp_bench: {ends} on CPUs 0 and 1; cache-line one-way floor now {floor:.0} ns; each figure the median of {} runs, the layers in turn",
        a.repeat
    );
    println!(
        "# zero-copy threshold {} (ZSDP, AZ-SDP), buffer copy {:?}, bulk ring {} for writes from {}, AZ-SDP outstanding {}",
        fmt_size(a.zcopy_threshold),
        env.flow,
        fmt_size(env.bulk_ring),
        fmt_size(env.bulk_min),
        env.az_max_outstanding
    );
    let zt = a.zcopy_threshold;
    let sizes = sizes_between(a.min.max(1), a.max);
    let run = |test: &str| a.tests.iter().any(|t| t == test);
    let mut tables = Vec::new();

    if run("latency") {
        let mut t = Table::start(
            "latency",
            "Ping-pong latency, one way, median (us)".into(),
            "size",
            true,
            true,
            &a.layers,
            a.repeat,
        );
        for &size in &sizes {
            let iters = (a.iters * 64 * 1024 / size.max(64 * 1024)).max(50);
            t.row(size as f64, fmt_size(size), |l| pingpong(&mut peer, l, size, iters, zt));
        }
        tables.push(t);
    }

    if run("throughput") {
        let mut t = Table::start(
            "throughput",
            "Unidirectional throughput (GB/s)".into(),
            "size",
            true,
            false,
            &a.layers,
            a.repeat,
        );
        for &size in sizes.iter().filter(|&&s| s >= 1024) {
            let vol = a.volume.min(size * 160_000);
            t.row(size as f64, fmt_size(size), |l| throughput(&mut peer, l, size, vol, SenderLoad::default(), zt));
        }
        tables.push(t);
    }

    for size in [64 * 1024, 1 << 20].into_iter().filter(|_| run("overlap")) {
        let title = format!("Overlap: throughput at {} with computation between sends (GB/s)", fmt_size(size));
        let mut t = Table::start(&format!("overlap_{size}"), title, "compute us", false, false, &a.layers, a.repeat);
        for &us in &a.compute_us {
            // Enough sends for a steady state, bounded in time.
            let n = if us == 0 { 2000 } else { (400_000 / us as usize).clamp(200, 4000) };
            let load = SenderLoad { compute: Duration::from_micros(us), ..SenderLoad::default() };
            t.row(us as f64, format!("{us}us"), |l| {
                throughput(&mut peer, l, size, (size * n).min(a.volume.max(size * 8)), load, zt)
            });
        }
        tables.push(t);
    }

    for size in [64 * 1024, 1 << 20].into_iter().filter(|_| run("window")) {
        let title =
            format!("Page-fault window: throughput at {}, buffer touched every W writes (GB/s)", fmt_size(size));
        let mut t = Table::start(&format!("fault_window_{size}"), title, "W", false, false, &a.layers, a.repeat);
        for &w in &a.windows {
            let load = SenderLoad { touch_every: Some(w.max(1)), ..SenderLoad::default() };
            let vol = a.volume.min(size * 4000);
            t.row(w as f64, format!("{w}"), |l| throughput(&mut peer, l, size, vol, load, zt));
        }
        tables.push(t);
    }

    // Several connections: threads of this process, every thread may run anywhere.
    drop(peer);
    unpin();
    if run("idle") {
        let title = "Idle connection: CPU of a thread blocked in read, % of one core".into();
        let mut t = Table::start("idle", title, "seconds", false, false, &a.layers, a.repeat);
        t.row(1.0, "1".into(), |l| idle_read(l, Duration::from_secs(1), zt));
        tables.push(t);
    }
    if run("idle-many") {
        let title = "Idle connections: CPU of the process holding N pairs, % of one core".into();
        let mut t = Table::start("idle_many", title, "pairs", false, false, &a.layers, a.repeat);
        for &n in &a.idle_pairs {
            t.row(n as f64, format!("{n}"), |l| idle_connections(l, n, Duration::from_secs(3), zt));
        }
        tables.push(t);
    }
    for size in [8usize, 64 * 1024].into_iter().filter(|_| run("hotspot")) {
        let title = format!("Hot-spot latency at {}: one server, N clients, median one way (us)", fmt_size(size));
        let mut t = Table::start(&format!("hot_spot_{size}"), title, "clients", false, false, &a.layers, a.repeat);
        for &n in &a.connections {
            let iters = if size < 4096 { a.iters / 2 } else { a.iters / 10 }.max(50);
            t.row(n as f64, format!("{n}"), |l| hot_spot(l, n, size, iters, zt));
        }
        tables.push(t);
    }

    let size = 64 * 1024;
    let vol = a.volume.min(size * 8000);
    type Aggregate = fn(&str, usize, usize, usize, usize) -> f64;
    let aggregates: [(&str, &str, &'static str, Aggregate); 2] = [
        ("multi_stream", "Multi-stream throughput", "streams", multi_stream),
        ("multi_client", "Multi-client throughput into one server thread", "clients", multi_client),
    ];
    for (key, what, x_name, measure) in aggregates.into_iter().filter(|_| run("multi")) {
        let title = format!("{what} at {} (GB/s, aggregate)", fmt_size(size));
        let mut t = Table::start(key, title, x_name, false, false, &a.layers, a.repeat);
        for &n in &a.connections {
            t.row(n as f64, format!("{n}"), |l| measure(l, n, size, vol, zt));
        }
        tables.push(t);
    }

    let out = a.out.clone().unwrap_or_else(|| {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        PathBuf::from("results").join(format!("sdp-{t}"))
    });
    let written = std::fs::create_dir_all(&out).and_then(|_| {
        let json: Vec<serde_json::Value> = tables.iter().map(Table::json).collect();
        let settings = serde_json::json!({ "floor_ns": floor, "zcopy_threshold": zt, "peer": ends.to_string() });
        benches::results::write_json(&out.join("results.json"), &settings, &json)?;
        for t in &tables {
            std::fs::write(out.join(format!("{}.svg", t.key)), t.svg())?;
        }
        Ok(())
    });
    match written {
        Ok(()) => println!("\n# results (results.json and one SVG chart per table) in {}", out.display()),
        Err(e) => eprintln!("sdp_bench: writing {}: {e}", out.display()),
    }
}
