//! A C program built against `exs.h` and `libexs.so` (`tests/exs_test.c`): both ends in one
//! process, then an echo between two processes, then between two hosts (network, PID and
//! mount namespaces joined by a veth pair, where the software provider crosses over TCP).
//! Each run is judged by the program's own checks of every byte.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `libexs.so`, built beside this test (`cargo test` builds a cdylib crate's test harness,
/// not the library itself), and the C program linked against it.
fn program() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let lib = benches::build_cdylib(env!("CARGO_MANIFEST_DIR"), env!("CARGO"), "exs-c", "libexs.so");
            let dir = lib.parent().unwrap();
            let bin = dir.join("exs_test");
            let src = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/exs_test.c");
            let include = concat!(env!("CARGO_MANIFEST_DIR"), "/include");
            let out = Command::new("cc")
                .args(["-O1", "-Wall", "-Wextra", "-Werror", "-I", include, src, "-L"])
                .arg(dir)
                .arg("-lexs")
                .arg(format!("-Wl,-rpath,{}", dir.display()))
                .arg("-o")
                .arg(&bin)
                .output()
                .expect("run cc");
            assert!(out.status.success(), "cc: {}", String::from_utf8_lossy(&out.stderr));
            bin
        })
        .clone()
}

/// Waits for `child`, killing it after `limit`; returns its output.
fn finish(mut child: Child, limit: Duration) -> String {
    let deadline = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = child.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

#[test]
fn the_c_program_passes_in_one_process() {
    let child = Command::new(program()).arg("self").stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let out = finish(child, Duration::from_secs(120));
    assert!(out.contains("PASS self"), "{out}");
}

/// Starts the echo server from `server` and the client from `client`, both kinds in turn.
fn echo_pair(server: impl Fn(&str) -> Command, client: impl Fn(&str) -> Command) {
    for kind in ["seq", "stream"] {
        let mut srv = server(kind).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        let mut lines = BufReader::new(srv.stdout.take().unwrap()).lines();
        let first = lines.next().map(|l| l.unwrap_or_default()).unwrap_or_default();
        assert_eq!(first, "LISTENING", "the server did not start");
        let c = client(kind).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        let out = finish(c, Duration::from_secs(120));
        assert!(out.contains("PASS client"), "{kind} client: {out}");
        let rest: Vec<String> = lines.map_while(Result::ok).collect();
        let stderr = finish(srv, Duration::from_secs(30));
        assert!(rest.iter().any(|l| l == "PASS serve"), "{kind} server: {rest:?}\n{stderr}");
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn the_c_program_echoes_between_two_processes() {
    let port = free_port().to_string();
    let bin = program();
    echo_pair(
        |kind| {
            let mut c = Command::new(&bin);
            c.args(["serve", &port, kind]);
            c
        },
        |kind| {
            let mut c = Command::new(&bin);
            c.args(["client", "127.0.0.1", &port, kind]);
            c
        },
    );
}

#[test]
fn the_c_program_echoes_between_two_hosts() {
    let bin = program();
    let Some(h) = benches::hosts::two_hosts_or_skip("the_c_program_echoes_between_two_hosts") else { return };
    let keep = bin.parent().unwrap().to_path_buf();
    let b_ip = h.b.ip.to_string();
    echo_pair(
        |kind| {
            let mut c = benches::hosts::TwoHosts::command(&h.b, bin.to_str().unwrap());
            c.args(["serve", "7311", kind]).env("PV_HOST_KEEP", &keep);
            c
        },
        |kind| {
            let mut c = benches::hosts::TwoHosts::command(&h.a, bin.to_str().unwrap());
            c.args(["client", &b_ip, "7311", kind]).env("PV_HOST_KEEP", &keep);
            c
        },
    );
}

/// A peer process killed while our receive waits: the receive completes with an error event
/// and the socket's later calls fail, instead of waiting forever.
#[test]
fn a_peer_that_dies_fails_the_operations_waiting_on_it() {
    use sockets_compat::exs::{EventKind, EventQueue, ExsSocket, Memory, SocketKind};
    let port = free_port();
    let mut srv =
        Command::new(program()).args(["serve", &port.to_string(), "seq"]).stdout(Stdio::piped()).spawn().unwrap();
    let mut lines = BufReader::new(srv.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "LISTENING");
    let q = EventQueue::new(8).unwrap();
    let c = ExsSocket::new(SocketKind::SeqPacket).unwrap();
    c.connect(("127.0.0.1", port), &q, 1).unwrap();
    let ev = q.dequeue(1, Some(Duration::from_secs(20))).pop().expect("connect event");
    assert_eq!((ev.kind, ev.outcome), (EventKind::Connect, Ok(0)));
    let m = Memory::alloc(1 << 16).unwrap();
    c.recv(&q, 2, &m, 0, 1 << 16).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    srv.kill().unwrap();
    srv.wait().unwrap();
    let started = Instant::now();
    let ev = q.dequeue(1, Some(Duration::from_secs(30))).pop().expect("the receive never completed");
    assert_eq!(ev.kind, EventKind::Recv);
    assert!(ev.outcome.is_err(), "{ev:?}");
    eprintln!("receive failed with errno {:?} {:?} after the peer died", ev.outcome, started.elapsed());
    let e = c.send(&q, 3, &m, 0, 10).unwrap_err();
    assert!(e.errno() != 0, "{e}");
}
