//! Across a machine boundary: two "hosts" made of namespaces (`tests::hosts`), joined only by a
//! veth pair, so the software provider must use its TCP transport. Each test says so and
//! passes when it cannot make the hosts (not root); CI runs as root, so there all of them run.

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tests::hosts::*;

/// A program running on one host, its stdout lines read by a thread.
struct Running {
    child: Child,
    lines: mpsc::Receiver<String>,
    what: String,
}

impl Running {
    fn start(host: &Host, program: &str, args: &[&str], env: &[(&str, &str)]) -> Running {
        let mut child = TwoHosts::command(host, program)
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start a program on a host");
        let out = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Running { child, lines, what: format!("{program} {}", args.join(" ")) }
    }

    /// The next line of output within `limit` (the test fails otherwise).
    fn line(&self, limit: Duration) -> String {
        self.lines.recv_timeout(limit).unwrap_or_else(|e| panic!("{}: no output within {limit:?}: {e}", self.what))
    }

    /// Waits for the program to end within `limit`; returns whether it succeeded.
    fn wait(&mut self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st.success();
            }
            assert!(Instant::now() < deadline, "{} did not end within {limit:?}", self.what);
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const PV_PEER: &str = env!("CARGO_BIN_EXE_pv_peer");
const MAD_RING: &str = env!("CARGO_BIN_EXE_mad_ring");
const XHOST: &str = env!("CARGO_BIN_EXE_xhost");
const LIMIT: Duration = Duration::from_secs(60);

#[test]
fn verbs_conformance_across_hosts() {
    let Some(h) = two_hosts_or_skip("verbs_conformance_across_hosts") else { return };
    for (i, scenario) in ["sends", "onesided-user", "onesided-seg", "atomics"].into_iter().enumerate() {
        let addr = format!("{}:{}", h.b.ip, 7100 + i);
        let _peer = Running::start(&h.b, PV_PEER, &["target", &addr], &[]);
        let mut client = Running::start(&h.a, XHOST, &["verbs", &addr, scenario], &[]);
        let line = client.line(LIMIT);
        assert!(line.starts_with(&format!("ok {scenario}")), "{scenario}: {line}");
        assert!(client.wait(LIMIT), "{scenario}: client failed");
    }
}

#[test]
fn flow_controlled_pipes_cross_hosts_with_every_strategy() {
    let Some(h) = two_hosts_or_skip("flow_controlled_pipes_cross_hosts_with_every_strategy") else { return };
    for (i, strategy) in ["credit", "rdma", "window", "polled"].into_iter().enumerate() {
        let addr = format!("{}:{}", h.b.ip, 7500 + i);
        let mut peer = Running::start(&h.b, PV_PEER, &["pipe", strategy, &addr], &[]);
        let mut client = Running::start(&h.a, XHOST, &["pipe", strategy, &addr], &[]);
        let line = client.line(LIMIT);
        assert!(line.starts_with(&format!("ok pipe {strategy}")), "{strategy}: {line}");
        assert!(client.wait(LIMIT), "{strategy}: client failed");
        assert!(peer.wait(LIMIT), "{strategy}: the echoing peer failed");
    }
}

#[test]
fn sdp_streams_are_byte_exact_across_hosts() {
    let Some(h) = two_hosts_or_skip("sdp_streams_are_byte_exact_across_hosts") else { return };
    for (i, design) in ["bsdp", "zsdp", "azsdp"].into_iter().enumerate() {
        let addr = format!("{}:{}", h.b.ip, 7200 + i);
        let env = [("SDP_DESIGN", design)];
        let mut server = Running::start(&h.b, XHOST, &["sdp-echo", &addr], &env);
        assert_eq!(server.line(LIMIT), "listening");
        let mut client = Running::start(&h.a, XHOST, &["sdp-client", &addr, "3000017"], &env);
        let line = client.line(LIMIT);
        assert!(line.starts_with("ok 3000017 bytes"), "{design}: {line}");
        assert!(client.wait(LIMIT), "{design}: client failed");
        assert!(server.line(LIMIT).starts_with("echoed 3000017 bytes"), "{design}");
        assert!(server.wait(LIMIT), "{design}: server failed");
    }
}

/// Runs `xhost watch` on host A against a peer on host B, does `cut` once the client is
/// connected, and returns how long the client took to see its queue pair fail.
fn failure_seen_after(h: &TwoHosts, port: u16, cut: impl FnOnce(&mut Running)) -> (Duration, String) {
    let addr = format!("{}:{port}", h.b.ip);
    let mut peer = Running::start(&h.b, PV_PEER, &["target", &addr], &[]);
    let client = Running::start(&h.a, XHOST, &["watch", &addr], &[]);
    assert_eq!(client.line(LIMIT), "ready");
    let start = Instant::now();
    cut(&mut peer);
    let report = client.line(LIMIT);
    let elapsed = start.elapsed();
    let after = client.line(LIMIT);
    assert_eq!(after, "post after failure: Some(WrFlushErr)", "{report}");
    (elapsed, report)
}

#[test]
fn a_killed_peer_on_another_host_fails_the_queue_pair_quickly() {
    let Some(h) = two_hosts_or_skip("a_killed_peer_on_another_host_fails_the_queue_pair_quickly") else { return };
    let (elapsed, report) = failure_seen_after(&h, 7300, |peer| {
        peer.child.kill().unwrap();
        peer.child.wait().unwrap();
    });
    eprintln!("killed peer: failure seen after {elapsed:?}");
    assert!(report.starts_with("failed: state Error, 4 of 4 receives flushed"), "{report}");
    assert!(elapsed < Duration::from_secs(2), "took {elapsed:?}: {report}");
}

#[test]
fn a_pulled_link_fails_the_queue_pair_within_the_bound() {
    let Some(h) = two_hosts_or_skip("a_pulled_link_fails_the_queue_pair_within_the_bound") else { return };
    let (elapsed, report) = failure_seen_after(&h, 7400, |_| TwoHosts::set_link(&h.b, false).unwrap());
    eprintln!("pulled link: failure seen after {elapsed:?}");
    assert!(report.starts_with("failed: state Error, 4 of 4 receives flushed"), "{report}");
    // The silence limit (2 s) plus the engine's tick.
    assert!(elapsed < Duration::from_millis(2600), "took {elapsed:?}: {report}");
}

/// A Madeleine job of four ranks, two per host, meeting through rank 0 (`MAD_ROOT`): the pairs
/// on one host talk through shared memory, the others over TCP; the ring example checks every
/// byte and rank 0 says so.
#[test]
fn a_madeleine_job_spans_two_hosts() {
    let Some(h) = two_hosts_or_skip("a_madeleine_job_spans_two_hosts") else { return };
    let root = format!("{}:7600", h.a.ip);
    let keep = std::path::Path::new(MAD_RING).parent().unwrap().to_str().unwrap();
    let env = [("MAD_SIZE", "4"), ("MAD_ROOT", root.as_str()), ("MAD_JOB", "two-hosts"), ("PV_HOST_KEEP", keep)];
    // Both ranks of a host in one PID namespace: they are one host's processes.
    let script = "MAD_RANK=$1 \"$0\" & MAD_RANK=$2 \"$0\"; s=$?; wait $! && exit $s";
    let mut b = Running::start(&h.b, "sh", &["-c", script, MAD_RING, "2", "3"], &env);
    let mut a = Running::start(&h.a, "sh", &["-c", script, MAD_RING, "0", "1"], &env);
    let mut lines = Vec::new();
    while let Ok(l) = a.lines.recv_timeout(LIMIT) {
        lines.push(l);
        if lines.last().is_some_and(|l| l.starts_with("ring of")) {
            break;
        }
    }
    assert_eq!(lines.last().map(String::as_str), Some("ring of 4 ranks: ok"), "{lines:?}");
    assert!(a.wait(LIMIT), "host A's ranks failed: {lines:?}");
    assert!(b.wait(LIMIT), "host B's ranks failed");
}
