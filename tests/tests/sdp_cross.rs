//! SDP sockets between two processes: a byte-exact echo, and a peer that dies mid-stream.

use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use sockets_compat::{Design, SdpConfig, SdpListener};

fn spawn(addr: std::net::SocketAddr, args: &[&str]) -> Child {
    spawn_env(addr, args, &[])
}

/// The peer process with `args`, its socket settings from `env` (`SDP_*`).
fn spawn_env(addr: std::net::SocketAddr, args: &[&str], env: &[(&str, &str)]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_sdp_peer"))
        .arg(addr.to_string())
        .args(args)
        .envs(env.iter().copied())
        .spawn()
        .unwrap()
}

fn reap(mut c: Child) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(st) = c.try_wait().unwrap() {
            return st;
        }
        if Instant::now() > deadline {
            let _ = c.kill();
            panic!("peer process hung");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The peer echoes a 1 MB stream written in one call; both ends use `design` with a 16 KiB
/// zero-copy threshold, so the zero-copy designs move most of it by RDMA read across the two
/// address spaces (AZ-SDP into and out of buffers protected against their own process).
fn echo_across_processes(design: Design) {
    let cfg = SdpConfig { design, zcopy_threshold: 16 * 1024, ..SdpConfig::default() };
    let l = SdpListener::bind_with("127.0.0.1:0", cfg).unwrap();
    let env = [("SDP_DESIGN", design.name()), ("SDP_ZCOPY_THRESHOLD", "16384")];
    let child = spawn_env(l.local_addr().unwrap(), &["echo"], &env);
    let (mut s, _) = l.accept_timeout(Duration::from_secs(20)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let data: Vec<u8> = (0..1_000_000u32).map(|i| (i * 7 % 253) as u8).collect();
    let mut r = s.try_clone().unwrap();
    let reader = std::thread::spawn(move || {
        let mut got = Vec::new();
        r.read_to_end(&mut got).unwrap();
        got
    });
    s.write_all(&data).unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    let got = reader.join().unwrap();
    let first_bad = got.iter().zip(&data).position(|(a, b)| a != b);
    assert!(got == data, "{design:?}: echo differs ({} bytes back, first difference at {first_bad:?})", got.len());
    assert!(reap(child).success(), "{design:?}: the peer failed");
}

#[test]
fn echo_across_processes_is_byte_exact_buffer_copy() {
    echo_across_processes(Design::Bsdp);
}

#[test]
fn echo_across_processes_is_byte_exact_zero_copy() {
    echo_across_processes(Design::Zsdp);
}

#[test]
fn echo_across_processes_is_byte_exact_asynchronous_zero_copy() {
    echo_across_processes(Design::AzSdp);
}

#[test]
fn copy_on_write_lets_two_processes_store_into_buffers_in_flight() {
    // Each process writes a buffer, stores into it at once, then reads: with block-on-write
    // each store would wait for a read the other process never reaches.
    let cfg =
        SdpConfig { design: Design::AzSdp, zcopy_threshold: 16 * 1024, az_hold_min: 16 * 1024, ..SdpConfig::default() };
    assert!(cfg.az_copy_on_write, "copy-on-write is the default");
    let l = SdpListener::bind_with("127.0.0.1:0", cfg).unwrap();
    let env = [("SDP_DESIGN", "azsdp"), ("SDP_ZCOPY_THRESHOLD", "16384"), ("SDP_AZ_HOLD_MIN", "16384")];
    let child = spawn_env(l.local_addr().unwrap(), &["write-store-read", "20"], &env);
    let (mut s, _) = l.accept_timeout(Duration::from_secs(20)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    // On a thread of its own: a deadlock stops it in the fault handler, where no timeout reaches.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = tests::write_store_read(&mut s, 1, 20).and_then(|()| s.flush());
        let _ = tx.send(r.map(|()| s));
    });
    let s = match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(r) => r.unwrap(),
        Err(_) => panic!("the two processes deadlocked on their stores"),
    };
    assert!(reap(child).success(), "the peer failed");
    drop(s);
}

/// A peer process that exits without closing its socket closes it by exiting, as the kernel
/// closes a TCP socket: its data, then EOF; writing to it afterwards fails.
#[test]
fn a_peer_exiting_without_closing_is_eof_after_its_data() {
    let l = SdpListener::bind_with("127.0.0.1:0", SdpConfig::default()).unwrap();
    let n = 300_000usize;
    let child = spawn(l.local_addr().unwrap(), &["send-then-die", &n.to_string()]);
    let (mut s, _) = l.accept_timeout(Duration::from_secs(20)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut got = vec![0u8; n];
    s.read_exact(&mut got).unwrap();
    assert!(got.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8), "data delivered before the exit is intact");
    s.write_all(&[1]).unwrap();
    assert!(reap(child).success());
    assert_eq!(s.read(&mut [0u8; 16]).unwrap(), 0, "EOF after the exit");
    let mut failed = false;
    for _ in 0..3 {
        failed |= s.write(&[0u8; 100]).is_err();
    }
    assert!(failed, "writing to a peer that is gone fails");
}

/// A peer process killed mid-stream: its data, then a reset (never EOF, never a hang).
#[test]
fn a_peer_killed_mid_stream_is_a_reset_after_its_data() {
    let l = SdpListener::bind_with("127.0.0.1:0", SdpConfig::default()).unwrap();
    let n = 300_000usize;
    let mut child = spawn(l.local_addr().unwrap(), &["send-then-wait", &n.to_string()]);
    let (mut s, _) = l.accept_timeout(Duration::from_secs(20)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut got = vec![0u8; n];
    s.read_exact(&mut got).unwrap();
    assert!(got.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8), "data delivered before the kill is intact");
    child.kill().unwrap();
    assert!(!reap(child).success());
    let start = Instant::now();
    let e = s.read(&mut [0u8; 16]).unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted),
        "expected a reset, got {e:?}"
    );
    assert!(start.elapsed() < Duration::from_secs(2), "the death is noticed within 2 s");
    assert!(s.write(&[0u8; 100]).is_err(), "writing to a dead peer fails");
}

/// The pattern of a TLS library over AZ-SDP with a low zero-copy threshold: every record is a
/// fresh allocation, written and freed at once, and the allocator reuses its memory for the
/// next allocation anywhere in the process, this library's own locked code included. Both
/// processes do it, in request-answer rounds; nothing may hang (it did in 4 of 15 sessions
/// when records of 4-20 KiB were held).
#[test]
fn freed_records_of_a_tls_like_session_never_deadlock_two_processes() {
    let cfg = SdpConfig { design: Design::AzSdp, zcopy_threshold: 4096, ..SdpConfig::default() };
    for round in 0..3 {
        let l = SdpListener::bind_with("127.0.0.1:0", cfg).unwrap();
        let env = [("SDP_DESIGN", "azsdp"), ("SDP_ZCOPY_THRESHOLD", "4096")];
        let child = spawn_env(l.local_addr().unwrap(), &["records", "2000"], &env);
        let (mut s, _) = l.accept_timeout(Duration::from_secs(20)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(tests::echo_records(&mut s, 2000).and_then(|()| s.flush()));
        });
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(r) => r.unwrap_or_else(|e| panic!("round {round}: {e}")),
            Err(_) => panic!("round {round}: the two processes deadlocked"),
        }
        assert!(reap(child).success(), "round {round}: the peer failed");
    }
}
