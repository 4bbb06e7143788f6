//! The far end of the EXS benchmarks (`exs_blast`, `exs_pingpong`): a child process the
//! benchmark starts and drives by lines on its stdin, answering on its stdout. It holds an
//! EXS listener of each socket type, a raw verbs connection (the baseline: RDMA writes with
//! and without immediate) and SDP listeners (the designs EXS is compared with), and for each
//! command it sinks or echoes one measurement's traffic and reports its own CPU time.
//!
//! Commands: `exs-accept seq|stream`, `raw-accept`, `exs-sink KIND SIZE DEPTH COUNT`,
//! `raw-sink`, `sdp-sink DESIGN SIZE`, `exs-echo SIZE ITERS`, `raw-echo SIZE ITERS`,
//! `busy 0|1`, `pin CPU|-1`, `quit`. Replies: `ready`, `ok`, `done USER SYS` (CPU seconds of
//! the whole process during the command), `fail WHY`.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use portability_verbs::cm::{self, CmAddr, Connection, QpSpec};
use portability_verbs::*;
use sockets_compat::exs::{EventQueue, ExsSocket, Memory, SocketKind, Tunable};
use sockets_compat::{Design, SdpConfig, SdpListener};

/// The largest message and depth the benchmarks use (the peers' buffers hold this much).
pub const MAX_SIZE: usize = 4 << 20;
/// The most messages outstanding.
pub const MAX_DEPTH: usize = 16;
/// The SDP designs compared.
pub const SDP_DESIGNS: [Design; 3] = [Design::Bsdp, Design::Zsdp, Design::AzSdp];
const LIMIT: Duration = Duration::from_secs(60);

/// A benchmark program's `main`: the far end when `role` says so, else `run` (its error
/// printed under `name`, exit status 1), with logging set up.
pub fn run_or_serve(name: &str, role: Option<&str>, run: impl FnOnce() -> Result<(), String>) {
    if role == Some("server") {
        serve();
        return;
    }
    env_logger::init();
    if let Err(e) = run() {
        eprintln!("{name}: {e}");
        std::process::exit(1);
    }
}

/// The folder results go to: `out`, or `results/<name>-<time>`; made if missing.
pub fn results_dir(out: Option<&std::path::Path>, name: &str) -> Result<std::path::PathBuf, String> {
    let dir = out.map(std::path::Path::to_path_buf).unwrap_or_else(|| {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        std::path::PathBuf::from(format!("results/{name}-{t}"))
    });
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    Ok(dir)
}

/// User and system CPU seconds of this process.
pub fn cpu_user_sys() -> (f64, f64) {
    // SAFETY: getrusage fills a zeroed struct.
    let u = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u
    };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    (tv(u.ru_utime), tv(u.ru_stime))
}

fn kind_of(s: &str) -> SocketKind {
    if s == "stream" {
        SocketKind::Stream
    } else {
        SocketKind::SeqPacket
    }
}

/// Where the child's listeners are.
pub struct Ports {
    /// EXS SOCK_SEQPACKET and SOCK_STREAM.
    pub exs: [u16; 2],
    /// Raw verbs bootstrap.
    pub raw: u16,
    /// SDP, per design in [`SDP_DESIGNS`] order.
    pub sdp: [u16; 3],
}

/// The raw verbs connection: queue pair, completion queue, our buffer and the peer's.
pub struct Raw {
    pub conn: Connection,
    pub mr: MemoryRegion,
    pub peer_addr: u64,
    pub peer_rkey: u32,
}

fn raw_buffer() -> Result<(ProtectionDomain, MemoryRegion), String> {
    let ctx = Context::open_default().map_err(|e| e.to_string())?;
    let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
    let mr = pd.alloc(MAX_SIZE * MAX_DEPTH, AccessFlags::ALL).map_err(|e| e.to_string())?;
    Ok((pd, mr))
}

fn private_of(mr: &MemoryRegion) -> Vec<u8> {
    let mut p = mr.addr().to_le_bytes().to_vec();
    p.extend_from_slice(&mr.rkey().to_le_bytes());
    p
}

fn raw_from(conn: Connection, mr: MemoryRegion) -> Result<Raw, String> {
    let p = &conn.peer_private;
    if p.len() < 12 {
        return Err("raw peer sent no buffer".into());
    }
    let peer_addr = u64::from_le_bytes(p[0..8].try_into().unwrap());
    let peer_rkey = u32::from_le_bytes(p[8..12].try_into().unwrap());
    Ok(Raw { conn, mr, peer_addr, peer_rkey })
}

fn raw_spec() -> QpSpec {
    QpSpec::with_depths(64, 64)
}

impl Raw {
    /// Connects to the child's raw listener.
    pub fn connect(port: u16) -> Result<Raw, String> {
        let (pd, mr) = raw_buffer()?;
        let addr = CmAddr::Tcp(([127, 0, 0, 1], port).into());
        let conn = cm::connect(&addr, &pd, &raw_spec(), &private_of(&mr), LIMIT).map_err(|e| e.to_string())?;
        raw_from(conn, mr)
    }

    /// Posts a receive (for a write-with-immediate).
    pub fn post_recv(&self) -> Result<(), String> {
        self.conn.qp.post_recv(&[RecvWr::new(0, &[self.mr.sge(0, 0)])]).map_err(|e| e.to_string())
    }

    /// Writes `len` bytes from our slot `slot` to the peer's, with immediate when `imm`.
    pub fn write(&self, slot: usize, len: usize, imm: bool) -> Result<(), String> {
        let sge = self.mr.sge(slot * MAX_SIZE, len);
        let remote = self.peer_addr + (slot * MAX_SIZE) as u64;
        let wr = if imm {
            SendWr::write_with_imm(1, &[sge], remote, self.peer_rkey, len as u32)
        } else {
            SendWr::write(1, &[sge], remote, self.peer_rkey)
        };
        self.conn.qp.post_send(&[wr]).map_err(|e| e.to_string())
    }

    /// Busy-polls until a receive completed; returns how many send completions came first.
    pub fn wait_recv(&self) -> Result<usize, String> {
        let mut sends = 0;
        while self.wait(1)? == 0 {
            sends += 1;
        }
        Ok(sends)
    }

    /// Busy-polls until `n` completions came; returns how many were receives.
    pub fn wait(&self, n: usize) -> Result<usize, String> {
        let mut wcs = [WorkCompletion::EMPTY; 16];
        let (mut got, mut recvs) = (0, 0);
        let mut spin = crate::Spin::new(LIMIT);
        while got < n {
            let k = self.conn.cq.poll(&mut wcs[..(n - got).min(16)]).map_err(|e| e.to_string())?;
            for wc in &wcs[..k] {
                if !wc.status.is_success() {
                    return Err(format!("completion {:?}", wc.status));
                }
                recvs += usize::from(matches!(wc.opcode, WcOpcode::RecvRdmaWithImm | WcOpcode::Recv));
            }
            got += k;
            if k == 0 {
                spin.tick().map_err(|e| e.to_string())?;
            }
        }
        Ok(recvs)
    }
}

/// The benchmark's handle on its child.
pub struct Peer {
    child: Child,
    to: ChildStdin,
    from: BufReader<ChildStdout>,
    /// Its listeners.
    pub ports: Ports,
}

impl Peer {
    /// Starts this executable as the child (`--role server`).
    pub fn start() -> Result<Peer, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = Command::new(exe)
            .args(["--role", "server"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| e.to_string())?;
        let to = child.stdin.take().unwrap();
        let from = BufReader::new(child.stdout.take().unwrap());
        let mut p = Peer { child, to, from, ports: Ports { exs: [0; 2], raw: 0, sdp: [0; 3] } };
        let line = p.line()?;
        let n: Vec<u16> = line.split_whitespace().skip(1).filter_map(|w| w.parse().ok()).collect();
        if !line.starts_with("ports") || n.len() != 6 {
            return Err(format!("peer said {line:?}"));
        }
        p.ports = Ports { exs: [n[0], n[1]], raw: n[2], sdp: [n[3], n[4], n[5]] };
        Ok(p)
    }

    fn line(&mut self) -> Result<String, String> {
        let mut l = String::new();
        self.from.read_line(&mut l).map_err(|e| e.to_string())?;
        if l.is_empty() {
            return Err("the peer exited".into());
        }
        if let Some(why) = l.strip_prefix("fail ") {
            return Err(format!("peer: {}", why.trim()));
        }
        Ok(l.trim().to_string())
    }

    /// Sends a command.
    pub fn send(&mut self, cmd: &str) -> Result<(), String> {
        writeln!(self.to, "{cmd}").and_then(|()| self.to.flush()).map_err(|e| e.to_string())
    }

    /// Waits for a reply that starts with `word`; returns the rest.
    pub fn expect(&mut self, word: &str) -> Result<String, String> {
        let l = self.line()?;
        l.strip_prefix(word).map(|r| r.trim().to_string()).ok_or_else(|| format!("peer said {l:?}, expected {word}"))
    }

    /// Waits for `done USER SYS`.
    pub fn done(&mut self) -> Result<(f64, f64), String> {
        let r = self.expect("done")?;
        let v: Vec<f64> = r.split_whitespace().filter_map(|w| w.parse().ok()).collect();
        if v.len() != 2 {
            return Err(format!("peer's CPU report {r:?}"));
        }
        Ok((v[0], v[1]))
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.send("quit");
        if crate::wait_child(&mut self.child, Duration::from_secs(5)).is_none() {
            let _ = self.child.kill();
        }
    }
}

/// Dequeues exactly `n` events (all successful); returns their byte total.
pub fn take(q: &EventQueue, n: usize) -> Result<u64, String> {
    let mut evs = Vec::with_capacity(n);
    let mut bytes = 0;
    while evs.len() < n {
        let want = n - evs.len();
        if q.dequeue_into(&mut evs, want, Some(LIMIT)) == 0 {
            return Err(format!("{} of {n} events within {LIMIT:?}", evs.len()));
        }
    }
    for e in &evs {
        bytes += e.outcome.map_err(|errno| format!("{:?} failed: errno {errno}", e.kind))?;
    }
    Ok(bytes)
}

/// Connects an EXS socket of `kind` to the child (after telling it to accept).
pub fn exs_connect(peer: &mut Peer, kind: &str) -> Result<ExsSocket, String> {
    peer.send(&format!("exs-accept {kind}"))?;
    let q = EventQueue::new(4).map_err(|e| e.to_string())?;
    let s = ExsSocket::new(kind_of(kind)).map_err(|e| e.to_string())?;
    let port = peer.ports.exs[usize::from(kind == "stream")];
    s.connect(("127.0.0.1", port), &q, 0).map_err(|e| e.to_string())?;
    take(&q, 1)?;
    peer.expect("ok")?;
    Ok(s)
}

/// Connects the raw verbs baseline to the child.
pub fn raw_connect(peer: &mut Peer) -> Result<Raw, String> {
    peer.send("raw-accept")?;
    let r = Raw::connect(peer.ports.raw)?;
    peer.expect("ok")?;
    Ok(r)
}

/// A sink's receives: never more asked of a stream than remains to come (a receive left
/// posted would take the next measurement's bytes).
#[derive(Default)]
struct Sink {
    stream: bool,
    size: usize,
    depth: usize,
    total: u64,
    count: usize,
    got: u64,
    msgs: usize,
    posted: usize,
    asked: std::collections::VecDeque<u64>,
}

impl Sink {
    fn post(&mut self, s: &ExsSocket, q: &EventQueue, mem: &Memory) -> Result<(), String> {
        loop {
            let asked: u64 = self.asked.iter().sum();
            let n = if self.stream {
                (self.total - self.got - asked).min(self.size as u64)
            } else {
                u64::from(self.posted < self.count) * self.size as u64
            };
            if self.asked.len() >= self.depth || n == 0 {
                return Ok(());
            }
            let slot = self.posted % self.depth;
            s.recv(q, slot as u64, mem, slot * MAX_SIZE, n as usize).map_err(|e| e.to_string())?;
            self.asked.push_back(n);
            self.posted += 1;
        }
    }

    fn took(&mut self, n: u64) {
        self.got += n;
        self.msgs += 1;
        self.asked.pop_front();
    }

    fn finished(&self) -> bool {
        if self.stream {
            self.got >= self.total
        } else {
            self.msgs >= self.count
        }
    }
}

/// Waits for a receive's event; returns how many send events came before it.
pub fn wait_recv(q: &EventQueue) -> Result<usize, String> {
    thread_local! {
        static EVENTS: std::cell::RefCell<Vec<sockets_compat::exs::Event>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let mut sends = 0;
    loop {
        let ev = EVENTS.with(|v| {
            let mut v = v.borrow_mut();
            q.dequeue_into(&mut v, 1, Some(LIMIT));
            v.pop()
        });
        let ev = ev.ok_or("no event within the limit")?;
        ev.outcome.map_err(|errno| format!("{:?} failed: errno {errno}", ev.kind))?;
        if ev.kind == sockets_compat::exs::EventKind::Recv {
            return Ok(sends);
        }
        sends += 1;
    }
}

struct Server {
    exs: [ExsSocket; 2],
    exs_conn: [Option<ExsSocket>; 2],
    raw_listener: cm::Listener,
    raw: Option<Raw>,
    raw_pd: ProtectionDomain,
    raw_mr: Option<MemoryRegion>,
    sdp: Vec<SdpListener>,
    mem: Memory,
    q: EventQueue,
}

/// The child's main loop (`--role server`).
pub fn serve() {
    let result = (|| -> Result<(), String> {
        let mut s = server_setup()?;
        println!(
            "ports {} {} {} {} {} {}",
            s.exs[0].local_addr().unwrap().port(),
            s.exs[1].local_addr().unwrap().port(),
            match s.raw_listener.local_addr() {
                CmAddr::Tcp(a) => a.port(),
                CmAddr::Unix(_) => 0,
            },
            s.sdp[0].local_addr().map_err(|e| e.to_string())?.port(),
            s.sdp[1].local_addr().map_err(|e| e.to_string())?.port(),
            s.sdp[2].local_addr().map_err(|e| e.to_string())?.port(),
        );
        let stdin = std::io::stdin();
        for line in stdin.lock().lines() {
            let line = line.map_err(|e| e.to_string())?;
            let w: Vec<&str> = line.split_whitespace().collect();
            let cpu = cpu_user_sys();
            let r = match w.as_slice() {
                ["quit"] => return Ok(()),
                _ => s.command(&w),
            };
            match r {
                Ok(Some(word)) if word == "done" => {
                    let now = cpu_user_sys();
                    println!("done {:.6} {:.6}", now.0 - cpu.0, now.1 - cpu.1);
                }
                Ok(Some(word)) => println!("{word}"),
                Ok(None) => {}
                Err(e) => println!("fail {e}"),
            }
            std::io::stdout().flush().map_err(|e| e.to_string())?;
        }
        Ok(())
    })();
    if let Err(e) = result {
        println!("fail {e}");
    }
}

fn server_setup() -> Result<Server, String> {
    let e = |e: sockets_compat::exs::ExsError| e.to_string();
    let listen = |kind| -> Result<ExsSocket, String> {
        let s = ExsSocket::new(kind).map_err(e)?;
        s.bind("127.0.0.1:0").map_err(e)?;
        s.listen(4).map_err(e)?;
        Ok(s)
    };
    let exs = [listen(SocketKind::SeqPacket)?, listen(SocketKind::Stream)?];
    let raw_listener = cm::Listener::bind(&CmAddr::Tcp(([127, 0, 0, 1], 0).into())).map_err(|e| e.to_string())?;
    let (raw_pd, raw_mr) = raw_buffer()?;
    let mut sdp = Vec::new();
    for d in SDP_DESIGNS {
        let cfg = SdpConfig { design: d, ..SdpConfig::default() };
        sdp.push(SdpListener::bind_with("127.0.0.1:0", cfg).map_err(|e| e.to_string())?);
    }
    let mem = Memory::alloc(MAX_SIZE * MAX_DEPTH).map_err(e)?;
    let q = EventQueue::new(4 * MAX_DEPTH).map_err(e)?;
    Ok(Server { exs, exs_conn: [None, None], raw_listener, raw: None, raw_pd, raw_mr: Some(raw_mr), sdp, mem, q })
}

impl Server {
    /// Runs one command; returns the reply word (`done` gets the CPU times appended).
    fn command(&mut self, w: &[&str]) -> Result<Option<String>, String> {
        let num = |i: usize| -> Result<usize, String> {
            w.get(i).and_then(|v| v.parse().ok()).ok_or(format!("bad command {w:?}"))
        };
        let e = |e: sockets_compat::exs::ExsError| e.to_string();
        match w {
            ["exs-accept", kind] => {
                let i = usize::from(*kind == "stream");
                self.exs[i].accept(&self.q, 0).map_err(e)?;
                let ev = self.q.dequeue(1, Some(LIMIT)).pop().ok_or("no connection")?;
                self.exs_conn[i] = Some(ev.accepted.ok_or("accept failed")?);
                Ok(Some("ok".into()))
            }
            ["raw-accept"] => {
                let mr = self.raw_mr.take().ok_or("raw already connected")?;
                let conn = self
                    .raw_listener
                    .accept(&self.raw_pd, &raw_spec(), &private_of(&mr), LIMIT)
                    .map_err(|e| e.to_string())?;
                self.raw = Some(raw_from(conn, mr)?);
                Ok(Some("ok".into()))
            }
            ["exs-sink", kind, ..] => {
                let (size, depth, count) = (num(2)?, num(3)?, num(4)?);
                let s = self.exs_conn[usize::from(*kind == "stream")].clone().ok_or("not connected")?;
                let mut sink = Sink {
                    stream: *kind == "stream",
                    size,
                    depth,
                    total: (size * count) as u64,
                    count,
                    ..Sink::default()
                };
                sink.post(&s, &self.q, &self.mem)?;
                println!("ready");
                std::io::stdout().flush().map_err(|e| e.to_string())?;
                while !sink.finished() {
                    let ev = self.q.dequeue(1, Some(LIMIT)).pop().ok_or("sink stalled")?;
                    let n = ev.outcome.map_err(|errno| format!("receive failed: errno {errno}"))?;
                    sink.took(n);
                    sink.post(&s, &self.q, &self.mem)?;
                }
                Ok(Some("done".into()))
            }
            ["raw-sink"] => {
                let raw = self.raw.as_ref().ok_or("raw not connected")?;
                raw.post_recv()?;
                println!("ready");
                std::io::stdout().flush().map_err(|e| e.to_string())?;
                raw.wait(1)?;
                Ok(Some("done".into()))
            }
            ["sdp-sink", design, ..] => {
                let size = num(2)?;
                let i = SDP_DESIGNS.iter().position(|d| d.name() == *design).ok_or("unknown design")?;
                println!("ready");
                std::io::stdout().flush().map_err(|e| e.to_string())?;
                let (mut c, _) = self.sdp[i].accept_timeout(LIMIT).map_err(|e| e.to_string())?;
                c.set_read_timeout(Some(LIMIT)).map_err(|e| e.to_string())?;
                let mut buf = crate::PageBuf::new(size, 0);
                loop {
                    let n = c.read(&mut buf).map_err(|e| e.to_string())?;
                    if n == 0 {
                        break;
                    }
                }
                Ok(Some("done".into()))
            }
            ["exs-echo", ..] => {
                let (size, iters) = (num(1)?, num(2)?);
                let s = self.exs_conn[0].clone().ok_or("not connected")?;
                s.recv(&self.q, 0, &self.mem, 0, size).map_err(e)?;
                println!("ready");
                std::io::stdout().flush().map_err(|e| e.to_string())?;
                let mut sends = 0;
                for i in 0..iters {
                    sends -= wait_recv(&self.q)?;
                    // The next receive is advertised before the reply goes.
                    if i + 1 < iters {
                        s.recv(&self.q, 0, &self.mem, 0, size).map_err(e)?;
                    }
                    s.send(&self.q, 1, &self.mem, MAX_SIZE, size).map_err(e)?;
                    sends += 1;
                }
                take(&self.q, sends)?;
                Ok(Some("done".into()))
            }
            ["raw-echo", ..] => {
                let (size, iters) = (num(1)?, num(2)?);
                let raw = self.raw.as_ref().ok_or("raw not connected")?;
                raw.post_recv()?;
                println!("ready");
                std::io::stdout().flush().map_err(|e| e.to_string())?;
                let mut sends = 0;
                for i in 0..iters {
                    sends -= raw.wait_recv()?;
                    if i + 1 < iters {
                        raw.post_recv()?;
                    }
                    raw.write(1, size, true)?;
                    sends += 1;
                }
                raw.wait(sends)?;
                Ok(Some("done".into()))
            }
            ["busy", on] => {
                self.exs[0].set(Tunable::BusyPoll, i64::from(*on == "1")).map_err(e)?;
                Ok(Some("ok".into()))
            }
            ["pin", cpu] => {
                let cpu: i64 = cpu.parse().map_err(|_| "bad cpu")?;
                match usize::try_from(cpu) {
                    Ok(c) => crate::pin_to_cpu(c),
                    Err(_) => crate::unpin(),
                }
                self.exs[0].set(Tunable::CompletionCpu, cpu).map_err(e)?;
                Ok(Some("ok".into()))
            }
            _ => Err(format!("unknown command {w:?}")),
        }
    }
}
