//! Unmodified programs under `libsdp_preload.so`, judged by their own output: Python's
//! `http.server` with `curl`, `iperf3`, `sockperf`, `socat`, and an asyncio event loop with
//! hundreds of clients, both preloaded and mixed with plain peers (TCP fallback in both
//! roles). Each side's `SDP_PRELOAD_STATS` report says whether its connections went over SDP.

use std::io::Read;
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The library, built beside this test (`target/<profile>/libsdp_preload.so`): `cargo test`
/// builds a `cdylib` crate's test harness but not the library itself, so the first test to
/// need it builds it (once; the others wait).
fn library() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            benches::build_cdylib(env!("CARGO_MANIFEST_DIR"), env!("CARGO"), "sdp-preload", "libsdp_preload.so")
        })
        .clone()
}

fn have(program: &str) -> bool {
    let found = Command::new("sh").args(["-c", &format!("command -v {program}")]).output();
    let ok = found.is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("skipped: {program} is not installed (.ci/run installs it)");
    }
    ok
}

/// A scratch directory, removed at the end.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let d = std::env::temp_dir().join(format!("sdp-preload-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }
    fn path(&self, f: &str) -> PathBuf {
        self.0.join(f)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A free TCP port whose UDP twin is free too.
fn free_port() -> u16 {
    loop {
        let p = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        if UdpSocket::bind(("127.0.0.1", p)).is_ok() {
            return p;
        }
    }
}

/// Waits until something listens on `port` (a bind that finds the port taken), at most 20 s.
fn wait_listening(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpListener::bind(("127.0.0.1", port)).is_ok() {
        assert!(Instant::now() < deadline, "nothing listens on port {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A program, preloaded or not, reporting to `stats`.
fn command(program: &str, args: &[&str], preload: bool, stats: &Path) -> Command {
    let mut c = Command::new("timeout");
    c.arg("120").arg(program).args(args);
    settings(c, preload, stats)
}

/// A server: not under `timeout` (dropping it kills it), so that it gets a Ctrl-C alone. Its
/// SIGINT is the default one whatever the test inherited: a run started in the background by
/// a shell without job control ignores SIGINT, and Python then never installs its handler.
fn server_command(program: &str, args: &[&str], preload: bool, stats: &Path) -> Command {
    use std::os::unix::process::CommandExt;
    let mut c = Command::new(program);
    c.args(args);
    // SAFETY: between fork and exec the closure only calls `signal`, async-signal-safe.
    unsafe {
        c.pre_exec(|| {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            Ok(())
        });
    }
    settings(c, preload, stats)
}

fn settings(mut c: Command, preload: bool, stats: &Path) -> Command {
    c.env("SDP_PRELOAD_STATS", stats);
    c.env_remove("LD_PRELOAD");
    if preload {
        c.env("LD_PRELOAD", library());
    }
    c
}

/// A server process, killed when dropped.
struct Server(Child);

impl Server {
    /// Interrupts the server (SIGINT, as Ctrl-C: it exits through its own handler, and its
    /// exit report is written) and waits at most 10 s for it to end.
    fn interrupt(mut self) {
        // SAFETY: signals our own child.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGINT) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.0.try_wait().unwrap().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn server(mut c: Command) -> Server {
    Server(c.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap())
}

fn run(mut c: Command) -> Output {
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{c:?}: {}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The sum of one counter over a stats file's lines (every process that reported).
fn stat(stats: &Path, key: &str) -> u64 {
    let text = std::fs::read_to_string(stats).unwrap_or_default();
    text.split_whitespace()
        .filter_map(|f| f.strip_prefix(&format!("{key}=")))
        .filter_map(|v| v.parse::<u64>().ok())
        .sum()
}

/// Waits (at most 10 s) for a server killed or finished to have written its report.
fn wait_stats(stats: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::read_to_string(stats).unwrap_or_default().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn random_file(path: &Path, bytes: usize) -> Vec<u8> {
    let mut data = vec![0u8; bytes];
    std::fs::File::open("/dev/urandom").unwrap().read_exact(&mut data).unwrap();
    std::fs::write(path, &data).unwrap();
    data
}

/// A preloaded `python3 -m http.server` on a free port serving `file`, `bytes` of random data,
/// from a directory of `s`: the server, its port and the data.
fn http_server(s: &Scratch, file: &str, bytes: usize, stats: &Path) -> (Server, u16, Vec<u8>) {
    let www = s.path("www");
    std::fs::create_dir_all(&www).unwrap();
    let data = random_file(&www.join(file), bytes);
    let port = free_port();
    let mut c =
        server_command("python3", &["-m", "http.server", &port.to_string(), "--bind", "127.0.0.1"], true, stats);
    c.current_dir(&www);
    let srv = server(c);
    wait_listening(port);
    (srv, port, data)
}

/// `python3 -m http.server` serving a 256 MiB file and `curl` fetching it, byte for byte:
/// both preloaded (over SDP), and each mixed case (over TCP, neither side noticing).
#[test]
fn http_server_and_curl_in_every_combination() {
    if !have("python3") || !have("curl") {
        return;
    }
    let s = Scratch::new("http");
    let www = s.path("www");
    std::fs::create_dir_all(&www).unwrap();
    let data = random_file(&www.join("f.bin"), 256 << 20);
    for (server_preloaded, client_preloaded) in [(true, true), (false, true), (true, false)] {
        let port = free_port();
        let (sstats, cstats) = (s.path("server.stats"), s.path("client.stats"));
        let _ = std::fs::remove_file(&sstats);
        let _ = std::fs::remove_file(&cstats);
        let mut c = server_command(
            "python3",
            &["-m", "http.server", &port.to_string(), "--bind", "127.0.0.1"],
            server_preloaded,
            &sstats,
        );
        c.current_dir(&www);
        let srv = server(c);
        wait_listening(port);
        let out = s.path("got.bin");
        let url = format!("http://127.0.0.1:{port}/f.bin");
        run(command("curl", &["-sS", "--fail", "-o", out.to_str().unwrap(), &url], client_preloaded, &cstats));
        let got = std::fs::read(&out).unwrap();
        assert!(
            got == data,
            "server preloaded {server_preloaded}, client {client_preloaded}: {} bytes differ",
            got.len()
        );
        // curl's own report (it exited); the server's once it is ended.
        let case = format!("server preloaded {server_preloaded}, client {client_preloaded}");
        if client_preloaded {
            let (sdp, tcp) = (stat(&cstats, "sdp_connect"), stat(&cstats, "tcp_connect"));
            assert_eq!((sdp, tcp), if server_preloaded { (1, 0) } else { (0, 1) }, "{case}: curl's connections");
        }
        srv.interrupt();
        if server_preloaded {
            wait_stats(&sstats);
            let (sdp, tcp) = (stat(&sstats, "sdp_accept"), stat(&sstats, "tcp_accept"));
            let report = std::fs::read_to_string(&sstats).unwrap_or_default();
            assert_eq!((sdp, tcp), if client_preloaded { (1, 0) } else { (0, 1) }, "{case}: the server's: {report:?}");
        }
    }
}

/// iperf3, client and server preloaded (its throughput in its own report), and a preloaded
/// client with a plain server.
#[test]
fn iperf3_preloaded_and_mixed() {
    if !have("iperf3") {
        return;
    }
    let s = Scratch::new("iperf3");
    for server_preloaded in [true, false] {
        let port = free_port();
        let (sstats, cstats) = (s.path("s.stats"), s.path("c.stats"));
        let _ = std::fs::remove_file(&cstats);
        let _srv = server(server_command("iperf3", &["-s", "-1", "-p", &port.to_string()], server_preloaded, &sstats));
        wait_listening(port);
        let out =
            run(command("iperf3", &["-c", "127.0.0.1", "-p", &port.to_string(), "-t", "1", "-f", "m"], true, &cstats));
        let text = String::from_utf8_lossy(&out.stdout);
        let receiver =
            text.lines().find(|l| l.contains("receiver")).unwrap_or_else(|| panic!("no receiver line:\n{text}"));
        eprintln!("iperf3, server preloaded {server_preloaded}: {receiver}");
        assert!(!receiver.contains(" 0.00 MBytes"), "nothing moved: {receiver}");
        let want = if server_preloaded { (2, 0) } else { (0, 2) }; // the control and the data connection
        assert_eq!((stat(&cstats, "sdp_connect"), stat(&cstats, "tcp_connect")), want, "{text}");
    }
}

/// sockperf's ping-pong with both ends preloaded reports its latency, beside plain TCP's.
#[test]
fn sockperf_ping_pong_preloaded() {
    if !have("sockperf") {
        return;
    }
    let s = Scratch::new("sockperf");
    for preloaded in [true, false] {
        let port = free_port();
        let stats = s.path("c.stats");
        let _ = std::fs::remove_file(&stats);
        let _srv = server(server_command(
            "sockperf",
            &["sr", "--tcp", "-i", "127.0.0.1", "-p", &port.to_string()],
            preloaded,
            &s.path("s.stats"),
        ));
        wait_listening(port);
        let out = run(command(
            "sockperf",
            // sockperf sizes its table of sequence numbers for 600,000 messages a second
            // unless told more; a faster ping-pong overruns it ("_seqN > m_maxSequenceNo").
            &["pp", "--tcp", "-i", "127.0.0.1", "-p", &port.to_string(), "-t", "1", "--mps", "5000000"],
            preloaded,
            &stats,
        ));
        let text = String::from_utf8_lossy(&out.stdout);
        let summary =
            text.lines().find(|l| l.contains("Summary: Latency is")).unwrap_or_else(|| panic!("no summary:\n{text}"));
        eprintln!("sockperf, preloaded {preloaded}: {summary}");
        assert_eq!(stat(&stats, "sdp_connect"), preloaded as u64, "{text}");
    }
}

/// socat, preloaded, relays between a preloaded client (over SDP) and a plain echo server (over
/// TCP): 8 MiB come back unchanged.
#[test]
fn socat_relays_between_a_preloaded_and_a_plain_side() {
    if !have("socat") || !have("python3") {
        return;
    }
    let s = Scratch::new("socat");
    let (echo_port, relay_port) = (free_port(), free_port());
    let echo = "import socket\nl=socket.create_server(('127.0.0.1',%P%))\nc,_=l.accept()\nwhile True:\n    d=c.recv(65536)\n    if not d: break\n    c.sendall(d)\nc.close()\n"
        .replace("%P%", &echo_port.to_string());
    let _echo = server(server_command("python3", &["-c", &echo], false, &s.path("e.stats")));
    wait_listening(echo_port);
    let relay_stats = s.path("relay.stats");
    let listen = format!("TCP-LISTEN:{relay_port},bind=127.0.0.1,reuseaddr");
    let to = format!("TCP:127.0.0.1:{echo_port}");
    let relay = server(server_command("socat", &[&listen, &to], true, &relay_stats));
    wait_listening(relay_port);
    let data = random_file(&s.path("in.bin"), 8 << 20);
    let client = "import socket,sys,threading\nd=open(sys.argv[1],'rb').read()\ns=socket.create_connection(('127.0.0.1',int(sys.argv[2])))\nt=threading.Thread(target=lambda:(s.sendall(d),s.shutdown(socket.SHUT_WR)))\nt.start()\nb=bytearray()\nwhile True:\n    x=s.recv(1<<16)\n    if not x: break\n    b+=x\nt.join()\nopen(sys.argv[3],'wb').write(b)\n";
    let out = s.path("out.bin");
    let cstats = s.path("c.stats");
    run(command(
        "python3",
        &["-c", client, s.path("in.bin").to_str().unwrap(), &relay_port.to_string(), out.to_str().unwrap()],
        true,
        &cstats,
    ));
    assert!(std::fs::read(&out).unwrap() == data, "the relayed bytes differ");
    assert_eq!(stat(&cstats, "sdp_connect"), 1);
    relay.interrupt();
    wait_stats(&relay_stats);
    assert_eq!(
        (stat(&relay_stats, "sdp_accept"), stat(&relay_stats, "tcp_connect")),
        (1, 1),
        "socat took the client over SDP and reached the plain server over TCP"
    );
}

const ASYNC_ECHO: &str = r#"
import asyncio, os, sys
async def handle(r, w):
    while True:
        d = await r.read(65536)
        if not d:
            break
        w.write(d)
        await w.drain()
    w.close()
async def server(port):
    s = await asyncio.start_server(handle, '127.0.0.1', port)
    async with s:
        await s.serve_forever()
async def clients(port, n):
    async def one(i):
        r, w = await asyncio.open_connection('127.0.0.1', port)
        data = os.urandom(1 + i * 997 % 200000)
        w.write(data)
        await w.drain()
        got = await r.readexactly(len(data))
        w.close()
        return got == data
    ok = await asyncio.gather(*[one(i) for i in range(n)])
    print("echoed", sum(ok), "of", n)
    sys.exit(0 if all(ok) else 1)
port = int(sys.argv[2])
try:
    asyncio.run(server(port) if sys.argv[1] == 's' else clients(port, int(sys.argv[3])))
except KeyboardInterrupt:
    pass  # a normal exit on Ctrl-C (an uncaught one ends the process by the signal)
"#;

/// An asyncio (epoll) echo server, preloaded, with 300 concurrent preloaded clients: every byte
/// echoed.
#[test]
fn an_asyncio_echo_server_with_hundreds_of_clients() {
    if !have("python3") {
        return;
    }
    let s = Scratch::new("asyncio");
    let port = free_port();
    let sstats = s.path("s.stats");
    let srv = server(server_command("python3", &["-c", ASYNC_ECHO, "s", &port.to_string()], true, &sstats));
    wait_listening(port);
    let cstats = s.path("c.stats");
    let out = run(command("python3", &["-c", ASYNC_ECHO, "c", &port.to_string(), "300"], true, &cstats));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "echoed 300 of 300");
    assert_eq!(stat(&cstats, "sdp_connect"), 300);
    srv.interrupt();
    wait_stats(&sstats);
    let report = std::fs::read_to_string(&sstats).unwrap_or_default();
    assert_eq!(stat(&sstats, "sdp_accept"), 300, "{report:?}");
}

/// `forks.py MODE PORT`, preloaded, its output kept for the test to read (at most 60 s).
fn forking_server(script: &str, mode: &str, port: u16) -> Child {
    Command::new("timeout")
        .args(["60", "python3", script, mode, &port.to_string()])
        .env("LD_PRELOAD", library())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// A server that forks: the pre-fork pattern (two children accept from the parent's listening
/// socket) serves its preloaded clients, over TCP once the listening socket is shared; a child
/// forked after `accept` gets an error from the inherited SDP connection (never a hang or the
/// parent's connection broken), and the parent goes on using it, over SDP.
#[test]
fn forking_servers_fall_back_cleanly() {
    if !have("python3") {
        return;
    }
    let s = Scratch::new("forks");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/forks.py");
    let port = free_port();
    let srv = forking_server(script, "prefork", port);
    wait_listening(port);
    let cstats = s.path("c.stats");
    let out = run(command("python3", &[script, "client", &port.to_string(), "2"], true, &cstats));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("client got b'child hello0'") && text.contains("client got b'child hello1'"), "{text}");
    let server = srv.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&server.stdout).trim(), "prefork server ok", "{server:?}");
    assert_eq!(stat(&cstats, "tcp_connect"), 2, "a shared listening socket takes TCP clients");

    let port = free_port();
    let srv = forking_server(script, "afteraccept", port);
    wait_listening(port);
    let cstats = s.path("c2.stats");
    let out = run(command("python3", &[script, "client", &port.to_string(), "1"], true, &cstats));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "client got b'parent hello0'");
    let server = srv.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&server.stdout);
    assert!(text.contains("child: BrokenPipeError") && text.contains("afteraccept server ok"), "{text}");
    assert_eq!(stat(&cstats, "sdp_connect"), 1);
}

/// Garbage on an accelerated port's UDP twin is ignored, and garbage from a plain client on the
/// TCP port is what the program sees (it answers as it would): SDP clients still get through.
#[test]
fn garbage_from_plain_peers_changes_nothing() {
    if !have("python3") || !have("curl") {
        return;
    }
    let s = Scratch::new("garbage");
    let (_srv, port, data) = http_server(&s, "g.bin", 1 << 20, &s.path("s.stats"));
    let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
    let twin: SocketAddr = ([127, 0, 0, 1], port).into();
    for n in [0usize, 1, 13, 15, 100, 1400] {
        udp.send_to(&vec![0x5a; n], twin).unwrap();
    }
    let mut probe = sockets_compat_probe();
    probe[4] = 9; // another version
    udp.send_to(&probe, twin).unwrap();
    // A plain client's garbage: the server answers it as HTTP (400), over TCP.
    let mut tcp = std::net::TcpStream::connect(twin).unwrap();
    std::io::Write::write_all(&mut tcp, b"\x00\x01garbage\r\n\r\n").unwrap();
    let mut answer = String::new();
    tcp.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let _ = tcp.read_to_string(&mut answer);
    assert!(answer.contains("400"), "the program's own answer to garbage: {answer:?}");
    let out = s.path("got.bin");
    let cstats = s.path("c.stats");
    let url = format!("http://127.0.0.1:{port}/g.bin");
    run(command("curl", &["-sS", "--fail", "-o", out.to_str().unwrap(), &url], true, &cstats));
    assert!(std::fs::read(&out).unwrap() == data);
    assert_eq!(stat(&cstats, "sdp_connect"), 1);
}

/// A well-formed probe's bytes (the discovery codec lives in `sockets-compat`).
fn sockets_compat_probe() -> Vec<u8> {
    let mut b = b"SDPQ\x01".to_vec();
    b.extend_from_slice(&7u64.to_le_bytes());
    b
}

/// Across two hosts (network, PID and mount namespaces joined by a veth pair): a preloaded
/// curl on one fetches from a preloaded `http.server` on the other over SDP (the probe crosses
/// the link, the software provider its TCP transport), and from a plain one over TCP.
#[test]
fn curl_and_http_server_on_two_hosts() {
    if !have("python3") || !have("curl") {
        return;
    }
    let Some(h) = benches::hosts::two_hosts_or_skip("curl_and_http_server_on_two_hosts") else { return };
    // Each host has a private /tmp: the target directory (the library, the files) stays
    // reachable on both even where it lies under /tmp (PV_HOST_KEEP, see `benches::hosts`).
    let target = library().parent().and_then(Path::parent).unwrap().to_path_buf();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("preload-hosts-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("www")).unwrap();
    let data = random_file(&dir.join("www/f.bin"), 32 << 20);
    for server_preloaded in [true, false] {
        let port = 8100 + server_preloaded as u16;
        let (sstats, cstats) = (dir.join("s.stats"), dir.join("c.stats"));
        let _ = std::fs::remove_file(&cstats);
        let mut srv = benches::hosts::TwoHosts::command(&h.b, "python3");
        srv.args(["-m", "http.server", &port.to_string(), "--bind", &h.b.ip.to_string()])
            .current_dir(dir.join("www"))
            .env("PV_HOST_KEEP", &target);
        let srv = server(settings(srv, server_preloaded, &sstats));
        let out = dir.join("got.bin");
        let fetch = format!(
            "for i in $(seq 100); do curl -sS --fail -o {} http://{}:{port}/f.bin 2>/dev/null && exit 0; sleep 0.1; done; exit 1",
            out.display(),
            h.b.ip
        );
        let mut c = benches::hosts::TwoHosts::command(&h.a, "sh");
        // A loaded host may answer the probe later than the default 50 ms, and curl would then
        // (rightly) take TCP: the probe's patience is not what this test is about.
        c.args(["-c", &fetch]).env("PV_HOST_KEEP", &target).env("SDP_PRELOAD_PROBE_MS", "2000");
        run(settings(c, true, &cstats));
        assert!(std::fs::read(&out).unwrap() == data, "server preloaded {server_preloaded}: the file differs");
        // The successful attempt is the last line of the client's reports.
        let last = std::fs::read_to_string(&cstats).unwrap_or_default().lines().last().unwrap_or_default().to_string();
        let want = if server_preloaded { "sdp_connect=1 tcp_connect=0" } else { "sdp_connect=0 tcp_connect=1" };
        assert!(last.contains(want), "server preloaded {server_preloaded}: curl reported {last:?}");
        drop(srv);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A C program checks, step by step, the socket semantics programs rely on (nonblocking connect
/// completing through POLLOUT, SO_ERROR, getpeername, F_GETFL/F_SETFL, MSG_PEEK, FIONREAD,
/// MSG_WAITALL, MSG_DONTWAIT, an epoll set holding the socket and a pipe, EINTR from a
/// waiting recv, poll, select and epoll_wait, poll and select sets whose plain member is ready
/// first, dup, shutdown and EOF, EPIPE with and without MSG_NOSIGNAL, a socket registered
/// with epoll before it connects, blocking sends that a signal ends): it passes over kernel TCP, and the same binary passes
/// preloaded, over SDP, with the client's waits polling long enough for its signals to come
/// while the library polls (`SDP_PRELOAD_POLL_US`).
#[test]
fn a_c_program_sees_the_kernels_socket_semantics() {
    if !have("cc") {
        return;
    }
    let s = Scratch::new("semantics");
    let exe = s.path("semantics");
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/semantics.c");
    let mut cc = Command::new("cc");
    cc.args(["-O1", "-Wall", "-Werror", "-o", exe.to_str().unwrap(), src]);
    run(cc);
    for preloaded in [false, true] {
        let port = free_port();
        let stats = s.path(&format!("{preloaded}.stats"));
        let srv = Command::new(&exe)
            .args(["server", &port.to_string()])
            .env("SDP_PRELOAD_STATS", &stats)
            .envs(preloaded.then(|| ("LD_PRELOAD", library())))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_listening(port);
        let mut client = command(exe.to_str().unwrap(), &["client", &port.to_string()], preloaded, &stats);
        client.env("SDP_PRELOAD_POLL_US", "1000000");
        let client = run(client);
        assert!(String::from_utf8_lossy(&client.stdout).ends_with("ALL OK\n"), "client, preloaded {preloaded}");
        let server = srv.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&server.stdout);
        assert!(
            server.status.success() && text.ends_with("ALL OK\n"),
            "server, preloaded {preloaded}:\n{text}\n{}",
            String::from_utf8_lossy(&server.stderr)
        );
        let want = preloaded as u64;
        assert_eq!((stat(&stats, "sdp_connect"), stat(&stats, "sdp_accept")), (2 * want, 2 * want));
    }
}

/// A rules file (`SDP_PRELOAD_RULES`) keeps the connections it names on TCP, both preloaded
/// sides notwithstanding; a connection no rule names goes over SDP.
#[test]
fn a_rules_file_keeps_the_connections_it_names_on_tcp() {
    if !have("python3") || !have("curl") {
        return;
    }
    let s = Scratch::new("rules");
    let (_srv, port, data) = http_server(&s, "r.bin", 1 << 20, &s.path("s.stats"));
    let rules = s.path("rules.conf");
    std::fs::write(&rules, format!("# curl stays on TCP to this port\nuse tcp connect curl *:{port}\n")).unwrap();
    let url = format!("http://127.0.0.1:{port}/r.bin");
    for (ruled, want) in [(true, "sdp_connect=0 tcp_connect=1"), (false, "sdp_connect=1 tcp_connect=0")] {
        let (out, stats) = (s.path("got.bin"), s.path(&format!("c-{ruled}.stats")));
        let mut c = command("curl", &["-sS", "--fail", "-o", out.to_str().unwrap(), &url], true, &stats);
        if ruled {
            c.env("SDP_PRELOAD_RULES", &rules);
        }
        run(c);
        assert!(std::fs::read(&out).unwrap() == data);
        let report = std::fs::read_to_string(&stats).unwrap_or_default();
        assert!(report.contains(want), "rules {ruled}: {report:?}");
    }
}
