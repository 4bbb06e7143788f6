//! The differential harness (`tests::diff`) run: every scenario over TCP and over SDP in every
//! design, the client in a thread and in a process of its own; whatever differs from TCP in
//! bytes, error kinds or timing classes fails the test.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tests::diff::{self, Net, Scenario};

/// Runs `sc` over `net` with the client in a thread (or a process) and judges it.
fn run(net: Net, sc: Scenario, process: bool) -> Result<Vec<String>, String> {
    let l = net.listen().map_err(|e| format!("listen: {e}"))?;
    let addr = l.local_addr().map_err(|e| e.to_string())?;
    if process {
        let child = Command::new(env!("CARGO_BIN_EXE_diff_peer"))
            .args([net.name(), &sc.name(), &addr.to_string()])
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| e.to_string())?;
        let server = diff::server(sc, &*l);
        let out = wait_output(child)?;
        let client: Vec<String> = String::from_utf8_lossy(&out).lines().map(str::to_owned).collect();
        diff::judge(&client, &server)
    } else {
        std::thread::scope(|s| {
            let c = s.spawn(move || diff::client(net, sc, addr));
            let server = diff::server(sc, &*l);
            let client = c.join().map_err(|_| "the client panicked".to_string())?;
            diff::judge(&client, &server)
        })
    }
}

/// The child's standard output once it exited (killed, and an error, after a long wait).
fn wait_output(mut child: std::process::Child) -> Result<Vec<u8>, String> {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        if let Some(st) = child.try_wait().map_err(|e| e.to_string())? {
            let mut out = Vec::new();
            std::io::Read::read_to_end(child.stdout.as_mut().expect("piped"), &mut out).map_err(|e| e.to_string())?;
            return if st.success() { Ok(out) } else { Err(format!("the client process failed: {st}")) };
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            return Err("the client process hung".into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// TCP's observations, then each SDP design's compared with them.
fn differential(sc: Scenario, process: bool) {
    let mut failures = Vec::new();
    let reference = run(Net::Tcp, sc, process).unwrap_or_else(|e| panic!("{sc:?} over TCP: {e}"));
    for net in &Net::ALL[1..] {
        match run(*net, sc, process) {
            Ok(obs) if obs == reference => {}
            Ok(obs) => failures.push(format!("{}: {obs:#?}", net.name())),
            Err(e) => failures.push(format!("{}: {e}", net.name())),
        }
    }
    let mode = if process { "processes" } else { "threads" };
    assert!(failures.is_empty(), "{sc:?} between {mode} differs from TCP {reference:#?}:\n{}", failures.join("\n"));
}

macro_rules! differential_tests {
    ($($name:ident: $sc:expr;)*) => {
        mod threads {
            use super::*;
            $(#[test] fn $name() { differential($sc, false) })*
        }
        mod processes {
            use super::*;
            $(#[test] fn $name() { differential($sc, true) })*
        }
    };
}

differential_tests! {
    echo: Scenario::Echo;
    close_then_late_read: Scenario::CloseThenLateRead;
    shutdown_when_full: Scenario::ShutdownWhenFull;
    write_timeout_then_usable: Scenario::WriteTimeoutThenUsable;
    idle_reads: Scenario::IdleReads;
    write_after_peer_closed: Scenario::WriteAfterPeerClosed;
    accept_past_bad_clients: Scenario::AcceptPastBadClients;
    nonblocking_accept_many: Scenario::NonblockingAcceptMany;
    connect_refused: Scenario::ConnectRefused;
}

#[test]
fn every_scenario_is_run() {
    assert_eq!(Scenario::ALL.len(), 9, "add the new scenario to differential_tests!");
}
