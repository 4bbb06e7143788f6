//! The client programs of the two-host tests (`tests/tests/two_hosts.rs`), run in one
//! namespace "host" against `pv_peer` or another `xhost` in the other:
//!
//! - `xhost verbs <addr> <sends|onesided-user|onesided-seg|atomics>`: a conformance scenario
//!   against `pv_peer target <addr>`.
//! - `xhost watch <addr>`: connects to `pv_peer target`, prints `ready`, then waits until its
//!   queue pair fails (the test kills the peer or pulls the link) and prints what it saw.
//! - `xhost pipe <credit|rdma|window|polled> <addr>`: messages of random sizes through a
//!   flow-controlled pipe to `pv_peer pipe`, which echoes them; checked byte for byte.
//! - `xhost sdp-echo <bind>` / `xhost sdp-client <addr> <bytes>`: an SDP stream echoed back,
//!   checked byte for byte.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use portability_verbs::*;
use sockets_compat::{SdpListener, SdpStream};
use tests::peer_client::*;
use tests::peer_proto::Command;

fn main() {
    env_logger::init();
    let args: Vec<String> = std::env::args().collect();
    let a: Vec<&str> = args.iter().skip(1).map(String::as_str).collect();
    match a.as_slice() {
        ["verbs", addr, scenario] => {
            let mut peer = PeerClient::connect(addr);
            match *scenario {
                "sends" => sends_at_every_size(&mut peer),
                "onesided-user" => one_sided_operations(&mut peer, false),
                "onesided-seg" => one_sided_operations(&mut peer, true),
                "atomics" => atomics(&mut peer),
                other => fail(&format!("unknown scenario {other}")),
            }
            if *scenario != "onesided-user" && *scenario != "onesided-seg" {
                peer.post(&Command::Exit);
            }
            println!("ok {scenario} (host {:#x})", soft::host_identity());
        }
        ["watch", addr] => watch(addr),
        ["pipe", strategy, addr] => pipe(strategy, addr).unwrap_or_else(|e| fail(&e.to_string())),
        ["sdp-echo", bind] => sdp_echo(bind).unwrap_or_else(|e| fail(&e.to_string())),
        ["sdp-client", addr, bytes] => sdp_client(addr, bytes.parse().expect("a byte count")),
        _ => fail("usage: xhost verbs <addr> <scenario> | watch <addr> | sdp-echo <bind> | sdp-client <addr> <bytes>"),
    }
}

fn fail(why: &str) -> ! {
    eprintln!("xhost: {why}");
    std::process::exit(1);
}

fn watch(addr: &str) {
    let mut peer = PeerClient::connect(addr);
    assert_eq!(peer.call(&Command::Echo(b"alive".to_vec())), b"alive");
    println!("ready");
    std::io::stdout().flush().unwrap();
    // Outstanding: the 4 receives of the replies; they flush when the queue pair fails.
    let start = Instant::now();
    let wcs = completions_within(&peer.cq, 4, Duration::from_secs(30));
    let elapsed = start.elapsed();
    let flushed = wcs.iter().filter(|w| w.status == WcStatus::WrFlushErr).count();
    println!(
        "failed: state {:?}, {flushed} of 4 receives flushed, {} ms after ready",
        peer.qp.state(),
        elapsed.as_millis()
    );
    // Posting now fails at once rather than hanging.
    peer.qp.post_send(&[SendWr::send(1, &[peer.out.sge(0, 8)])]).unwrap();
    let after = completions_within(&peer.cq, 1, Duration::from_secs(5));
    println!("post after failure: {:?}", after.first().map(|w| w.status));
}

fn pipe(name: &str, addr: &str) -> Result<()> {
    use portability_verbs::datapath::{FlowStrategy, MsgPipe};
    let strategy = FlowStrategy::by_name(name).ok_or_else(|| VerbsError::InvalidArgument(name.into()))?;
    let ctx = Context::open_default()?;
    let pd = ctx.alloc_pd()?;
    let wait = Duration::from_secs(20);
    let conn = cm::connect_retrying(&addr.parse()?, &pd, &cm::QpSpec::with_depths(512, 512), b"", wait)?;
    let mut pipe = MsgPipe::establish(conn.qp, conn.cq, &pd, strategy, wait)?;
    let sizes: Vec<usize> = (0..400).map(|i| 1 + (i * 7919) % strategy.max_message()).collect();
    let (mut next, mut next_reply) = (0, 0);
    let deadline = Instant::now() + Duration::from_secs(60);
    while next_reply < sizes.len() {
        if Instant::now() > deadline {
            fail(&format!("{name}: stalled at {next}/{next_reply}"));
        }
        if next < sizes.len() && pipe.try_send(&tests::pattern(next as u64, sizes[next]))? {
            next += 1;
            continue;
        }
        pipe.flush()?;
        while let Some(m) = pipe.recv_with(|m| m.to_vec())? {
            if m != tests::pattern(next_reply as u64, sizes[next_reply]) {
                fail(&format!("{name}: reply {next_reply} differs"));
            }
            next_reply += 1;
        }
    }
    pipe.send(&[], wait)?;
    pipe.flush()?;
    // A moment for the peer to take the empty message (its acknowledgement may arrive late).
    let end = Instant::now() + Duration::from_secs(1);
    while Instant::now() < end && pipe.progress().is_ok() {
        std::thread::sleep(Duration::from_millis(2));
    }
    println!("ok pipe {name}: {} messages echoed exactly", sizes.len());
    Ok(())
}

fn sdp_echo(bind: &str) -> std::io::Result<()> {
    let listener = SdpListener::bind(bind)?;
    println!("listening");
    std::io::stdout().flush()?;
    let (mut s, from) = listener.accept()?;
    let mut buf = vec![0u8; 256 * 1024];
    let mut total = 0u64;
    loop {
        let n = s.read(&mut buf)?;
        if n == 0 {
            break;
        }
        s.write_all(&buf[..n])?;
        total += n as u64;
    }
    // An AZ-SDP write's buffer is the socket's until `flush` (the peer may still be reading
    // it), and `buf` is freed when this returns.
    s.flush()?;
    s.shutdown(std::net::Shutdown::Write)?;
    println!("echoed {total} bytes to {from}");
    Ok(())
}

fn sdp_client(addr: &str, bytes: usize) {
    let data = tests::pattern(5, bytes);
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut s = loop {
        match SdpStream::connect(addr) {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline => {
                log::debug!("connect: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => fail(&format!("connect {addr}: {e}")),
        }
    };
    let mut w = s.try_clone().unwrap_or_else(|e| fail(&format!("try_clone: {e}")));
    let sender = std::thread::spawn({
        let data = data.clone();
        move || {
            for chunk in data.chunks(100_003) {
                w.write_all(chunk).unwrap();
            }
            w.flush().unwrap(); // (AZ-SDP) `data` is freed when this thread ends
            w.shutdown(std::net::Shutdown::Write).unwrap();
        }
    });
    let mut got = Vec::with_capacity(bytes);
    s.read_to_end(&mut got).unwrap_or_else(|e| fail(&format!("read: {e}")));
    sender.join().unwrap();
    if got != data {
        let at = got.iter().zip(&data).position(|(a, b)| a != b).unwrap_or(got.len().min(data.len()));
        fail(&format!("echo differs: {} of {} bytes back, first difference at {at}", got.len(), data.len()));
    }
    println!("ok {bytes} bytes echoed exactly");
}
