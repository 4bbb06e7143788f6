//! SDP sockets between two processes: a byte-exact echo, and a peer that dies mid-stream.

use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use sockets_compat::{SdpConfig, SdpListener};

fn spawn(addr: std::net::SocketAddr, args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_sdp_peer")).arg(addr.to_string()).args(args).spawn().unwrap()
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

#[test]
fn echo_across_processes_is_byte_exact() {
    let l = SdpListener::bind_with("127.0.0.1:0", SdpConfig::default()).unwrap();
    let child = spawn(l.local_addr().unwrap(), &["echo"]);
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
    assert!(got == data, "echo differs ({} bytes back)", got.len());
    assert!(reap(child).success());
}

#[test]
fn a_peer_dying_mid_stream_is_a_reset_after_its_data() {
    let l = SdpListener::bind_with("127.0.0.1:0", SdpConfig::default()).unwrap();
    let n = 300_000usize;
    let child = spawn(l.local_addr().unwrap(), &["send-then-die", &n.to_string()]);
    let (mut s, _) = l.accept_timeout(Duration::from_secs(20)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut got = vec![0u8; n];
    s.read_exact(&mut got).unwrap();
    assert!(got.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8), "data delivered before death is intact");
    s.write_all(&[1]).unwrap();
    assert!(reap(child).success());
    // The peer exited without closing: not EOF, not a hang, a connection error.
    let e = s.read(&mut [0u8; 16]).unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted),
        "expected a reset, got {e:?}"
    );
    assert!(s.write(&[0u8; 100]).is_err(), "writing to a dead peer fails");
}
