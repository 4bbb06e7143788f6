//! Verbs conformance across two processes: this test process against a `pv_peer` child,
//! connected through the bootstrap socket, over the software provider.

use std::io::Write;
use std::process::{Child, Command as Proc};
use std::time::{Duration, Instant};

use portability_verbs::*;
use tests::peer_client::*;
use tests::peer_proto::*;
use tests::*;

/// A `pv_peer target` child on this host and the client connected to it.
struct Peer {
    child: Child,
    client: PeerClient,
}

impl std::ops::Deref for Peer {
    type Target = PeerClient;
    fn deref(&self) -> &PeerClient {
        &self.client
    }
}

impl std::ops::DerefMut for Peer {
    fn deref_mut(&mut self) -> &mut PeerClient {
        &mut self.client
    }
}

fn socket_path(tag: &str) -> String {
    format!("{}/pv-test-{}-{tag}.sock", std::env::temp_dir().display(), std::process::id())
}

impl Peer {
    fn spawn(tag: &str) -> Peer {
        Peer::spawn_env(tag, &[])
    }

    /// Spawns the peer with extra environment variables.
    fn spawn_env(tag: &str, env: &[(&str, &str)]) -> Peer {
        let path = socket_path(tag);
        let child = Proc::new(env!("CARGO_BIN_EXE_pv_peer"))
            .args(["target", &format!("unix:{path}")])
            .envs(env.iter().copied())
            .spawn()
            .unwrap();
        Peer { child, client: PeerClient::connect(&format!("unix:{path}")) }
    }

    fn finish(mut self) {
        // The peer exits without answering.
        self.post(&Command::Exit);
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                assert!(st.success(), "peer exited with {st}");
                return;
            }
            assert!(Instant::now() < deadline, "peer did not exit");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn sends_cross_processes_at_every_size() {
    let mut peer = Peer::spawn("echo");
    sends_at_every_size(&mut peer);
    peer.finish();
}

#[test]
fn one_sided_operations_reach_user_memory_and_shared_segments() {
    for segment in [false, true] {
        let mut peer = Peer::spawn(if segment { "onesided-seg" } else { "onesided" });
        one_sided_operations(&mut peer, segment);
    }
}

/// Reads into `peer.client.out` at `at` from the peer's user region at `off`, checking the bytes.
fn read_and_check(peer: &mut Peer, data: &[u8], at: usize, off: usize, len: usize, what: &str) {
    let (base, rkey) = peer.client.region(false);
    peer.client.next_id += 1;
    let wc = peer.client.one_sided(SendWr::read(
        peer.client.next_id,
        &[peer.client.out.sge(at, len)],
        base + off as u64,
        rkey,
    ));
    assert_eq!(wc.status, WcStatus::Success, "{what}");
    let mut got = vec![0u8; len];
    peer.client.out.read(at, &mut got);
    assert!(got == data[off..off + len], "{what}: read {len} at {off} differs");
}

/// Runs `step(0)`, `step(1)`, ... at least `min` times, then until `done()` or 20 s passed (the
/// caller's assertions then tell what did not happen).
fn repeat_until(min: usize, done: impl Fn() -> bool, mut step: impl FnMut(usize)) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut i = 0;
    while i < min || (!done() && Instant::now() < deadline) {
        step(i);
        i += 1;
    }
}

/// Large pulls from another process's user memory (reads, and the data of large sends) offer
/// their back half to that process, whose polling thread pushes it while the puller copies the
/// front: the bytes are exact whoever copied them, into plain and protected local pages, from
/// plain and protected peer pages.
#[test]
fn large_pulls_share_their_copy_with_a_polling_peer() {
    // The peer spins between commands rather than sleeping, so it polls when the reads come.
    let mut peer = Peer::spawn_env("shared", &[("PV_SOFT_SPIN_US", "5000000")]);
    let (base, rkey) = peer.client.region(false);
    let data = pattern(77, REGION);
    peer.client.out.write(0, &data);
    peer.client.next_id += 1;
    let wc = peer.client.one_sided(SendWr::write(peer.client.next_id, &[peer.client.out.sge(0, REGION)], base, rkey));
    assert_eq!(wc.status, WcStatus::Success);
    let before = soft::shared_copies();
    let shapes = [(0, REGION), (3 * 4096 + 100, 65_536 + 77), (5000, 32_768), (12_345, 300_001)];
    // Whether the peer helps depends on it being scheduled during a copy of a few hundred
    // microseconds; with other tests busy on both CPUs that may take more than a few rounds, so
    // keep reading (every read still checked) until it has helped once.
    repeat_until(
        8,
        || soft::shared_copies().helped != before.helped,
        |round| {
            for &(off, len) in &shapes {
                peer.client.out.write(REGION, &vec![0u8; len]);
                read_and_check(&mut peer, &data, REGION, off, len, &format!("round {round}"));
            }
        },
    );
    let after = soft::shared_copies();
    assert!(after.offered - before.offered >= 32, "{before:?} -> {after:?}");
    assert!(after.helped > before.helped, "the polling peer never pushed a half: {before:?} -> {after:?}");

    // Large sends: each side pulls the other's message, the sender waiting for its completion
    // pushes the back half. Our polling for the echo helps the peer's pull of the command.
    // As above, keep going past 12 echoes until both sides have pushed once.
    let lens = [32_768usize, 33_001, 60_000];
    let pushed_both = || {
        let now = soft::shared_copies();
        now.helped != after.helped && now.pushed != after.pushed
    };
    repeat_until(12, pushed_both, |i| {
        let len = lens[i % lens.len()];
        let echo = pattern(1000 + i as u64, len);
        assert!(peer.client.call(&Command::Echo(echo.clone())) == echo, "echo of {len} bytes differs");
    });
    let last = soft::shared_copies();
    assert!(last.offered - after.offered >= 12, "{after:?} -> {last:?}");
    assert!(last.helped > after.helped && last.pushed > after.pushed, "{after:?} -> {last:?}");

    // Into local pages under a no-access hold (an asynchronous receive): both halves land
    // through /proc/PID/mem.
    let page = page_size();
    let at = REGION + (page - (peer.client.out.addr() as usize + REGION) % page) % page;
    let len = 16 * page;
    // SAFETY: whole pages inside our own registered buffer, touched only by the provider until
    // the hold is dropped.
    let hold =
        unsafe { protect::protect(peer.client.out.addr() as usize + at, len, protect::Protection::None) }.unwrap();
    peer.client.next_id += 1;
    let wc =
        peer.client.one_sided(SendWr::read(peer.client.next_id, &[peer.client.out.sge(at, len)], base + 4096, rkey));
    assert_eq!(wc.status, WcStatus::Success);
    drop(hold);
    let mut got = vec![0u8; len];
    peer.client.out.read(at, &mut got);
    assert!(got == data[4096..4096 + len], "read into held pages differs");

    // From peer pages it protected: its push bounces through its own /proc/self/mem.
    let poff = (page - peer.client.layout.user_addr as usize % page) % page;
    let call = Command::Protect { offset: poff as u64, len: (16 * page) as u64 };
    assert_eq!(Reply::decode(&peer.client.call(&call)), Some(Reply::Ok));
    read_and_check(&mut peer, &data, REGION, poff, 16 * page, "from protected peer pages");
    assert_eq!(Reply::decode(&peer.client.call(&Command::Unprotect)), Some(Reply::Ok));
    peer.finish();
}

#[test]
fn atomics_cross_processes() {
    let mut peer = Peer::spawn("atomics");
    atomics(&mut peer);
    peer.finish();
}

#[test]
fn writes_land_in_pages_the_peer_protected() {
    let mut peer = Peer::spawn("protect");
    let page = page_size();
    let offset = (page - peer.client.layout.user_addr as usize % page) % page;
    assert_eq!(
        Reply::decode(&peer.client.call(&Command::Protect { offset: offset as u64, len: page as u64 })),
        Some(Reply::Ok)
    );
    let data = pattern(9, page);
    peer.client.out.write(0, &data);
    peer.client.next_id += 1;
    let (base, rkey) = peer.client.region(false);
    let wc = peer.client.one_sided(SendWr::write(
        peer.client.next_id,
        &[peer.client.out.sge(0, page)],
        base + offset as u64,
        rkey,
    ));
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(Reply::decode(&peer.client.call(&Command::Unprotect)), Some(Reply::Ok));
    assert_eq!(peer.client.checksum(false, offset, page), fnv(&data));
    peer.finish();
}

#[test]
fn a_killed_peer_moves_the_queue_pair_to_error_with_flushes_quickly() {
    let shm_before = std::fs::read_dir("/dev/shm").map(|d| d.count()).unwrap_or(0);
    let mut peer = Peer::spawn("kill");
    assert_eq!(peer.client.call(&Command::Echo(b"alive".to_vec())), b"alive");
    // Outstanding: 4 receives; also a send into a peer that will never consume it.
    peer.child.kill().unwrap();
    peer.child.wait().unwrap();
    let start = Instant::now();
    let wcs = wait_n(&peer.client.cq, 4);
    let elapsed = start.elapsed();
    assert!(wcs.iter().all(|w| w.status == WcStatus::WrFlushErr), "{wcs:?}");
    assert!(elapsed < Duration::from_secs(2), "took {elapsed:?}");
    assert_eq!(peer.client.qp.state(), QpState::Error);
    // Posting now fails over at once rather than hanging.
    peer.client.qp.post_send(&[SendWr::send(1, &[peer.client.out.sge(0, 8)])]).unwrap();
    assert_eq!(wait_one(&peer.client.cq).status, WcStatus::WrFlushErr);
    let shm_after = std::fs::read_dir("/dev/shm").map(|d| d.count()).unwrap_or(0);
    assert_eq!(shm_before, shm_after, "nothing may be left in /dev/shm");
}

#[test]
fn a_bad_client_fails_only_its_own_bootstrap() {
    let ctx = Context::open(Provider::Software).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let spec = cm::QpSpec::default();
    let path = socket_path("garbage");
    let listener = cm::Listener::bind(&format!("unix:{path}").parse().unwrap()).unwrap();
    // A client that sends garbage, one that says nothing, and one whose well-formed HELLO names
    // a process that is not the sender's.
    let mut junk = std::os::unix::net::UnixStream::connect(&path).unwrap();
    junk.write_all(b"GET / HTTP/1.1\r\n\r\nthis is not a bootstrap frame").unwrap();
    let _silent = std::os::unix::net::UnixStream::connect(&path).unwrap();
    let fake = EndpointInfo::Soft(SoftEndpoint {
        pid: std::process::id(),
        start_time: 1,
        ctx_id: 1,
        ctrl_fd: 0,
        qp_fd: 0,
        qpn: 1,
        ring_bytes: 1 << 17,
        pd: 1,
        rq_slot: 0,
        send_cq_bell: 0,
        recv_cq_bell: 0,
        host: soft::host_identity(),
        tcp: "127.0.0.1:1".parse().unwrap(),
        tcp_only: false,
    });
    let mut liar = std::os::unix::net::UnixStream::connect(&path).unwrap();
    liar.write_all(&cm::Frame::Hello { endpoint: fake, private: vec![] }.encode()).unwrap();
    // None of them is a connection, and none is an error of the listener's.
    match listener.accept(&pd, &spec, b"", Duration::from_millis(300)) {
        Err(VerbsError::Timeout(_)) => {}
        Err(e) => panic!("a bad client's failure reached accept: {e}"),
        Ok(_) => panic!("a bad client was accepted"),
    }
    assert_eq!(listener.pending(), 1, "only the silent client is still waited for");
    // The liar was told why.
    let mut answer = Vec::new();
    liar.set_read_timeout(Some(WAIT)).unwrap();
    let _ = std::io::Read::read_to_end(&mut liar, &mut answer);
    let mut dec = cm::FrameDecoder::default();
    dec.push(&answer);
    assert!(matches!(dec.next_frame(), Ok(Some(cm::Frame::Reject(_)))), "{answer:?}");
    // A good client behind them is accepted.
    std::thread::scope(|s| {
        let client = s.spawn(|| cm::connect(&format!("unix:{path}").parse().unwrap(), &pd, &spec, b"c", WAIT).unwrap());
        let server = listener.accept(&pd, &spec, b"s", WAIT).unwrap();
        assert_eq!(server.peer_private, b"c");
        assert_eq!(client.join().unwrap().peer_private, b"s");
    });
    // The silent client's handshake runs out on its own.
    listener.set_handshake_timeout(Duration::from_millis(100));
    let _ = listener.accept(&pd, &spec, b"", Duration::from_millis(50));
    std::thread::sleep(Duration::from_millis(150));
    let _ = listener.accept(&pd, &spec, b"", Duration::ZERO);
    assert_eq!(listener.pending(), 1, "the deadline is the one given when the client came");
    listener.set_handshake_timeout(Duration::from_secs(10));
    // Nobody listening: refused at once, as a TCP connect is.
    let start = Instant::now();
    let r = cm::connect(&format!("unix:{path}.none").parse().unwrap(), &pd, &spec, b"", WAIT);
    assert!(matches!(r, Err(VerbsError::Refused(_))), "{r:?}");
    assert!(start.elapsed() < Duration::from_secs(1));
    let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed = tcp.local_addr().unwrap();
    drop(tcp);
    let r = cm::connect(&cm::CmAddr::Tcp(closed), &pd, &spec, b"", WAIT);
    assert!(matches!(r, Err(VerbsError::Refused(_))), "{r:?}");
    assert!(start.elapsed() < Duration::from_secs(1));
}

/// Many clients connecting at once, each from its own thread, all get a working queue pair
/// through a listener accepting without blocking (the pattern of an event loop), and none
/// fails: no client's descriptors are let go while it may still fetch them.
#[test]
fn concurrent_clients_of_a_nonblocking_accept_loop_all_connect() {
    let ctx = Context::open(Provider::Software).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let spec = cm::QpSpec::default();
    for round in 0..3 {
        let listener = cm::Listener::bind(&"127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().clone();
        const N: usize = 20;
        std::thread::scope(|s| {
            let clients: Vec<_> = (0..N)
                .map(|i| {
                    s.spawn({
                        let (addr, pd) = (addr.clone(), &pd);
                        move || cm::connect(&addr, pd, &spec, &[i as u8], WAIT)
                    })
                })
                .collect();
            let mut accepted = Vec::new();
            let deadline = Instant::now() + WAIT;
            while accepted.len() < N {
                assert!(Instant::now() < deadline, "round {round}: {} of {N} accepted", accepted.len());
                match listener.accept(&pd, &spec, b"", Duration::ZERO) {
                    Ok(c) => accepted.push(c),
                    Err(VerbsError::Timeout(_)) => std::thread::sleep(Duration::from_micros(200)),
                    Err(e) => panic!("round {round}: accept failed: {e}"),
                }
            }
            // Every pair works: each client sends its number to its server end.
            let mr = pd.register(vec![0u8; 2 * N].into_boxed_slice(), AccessFlags::ALL).unwrap();
            for (i, server) in accepted.iter().enumerate() {
                server.qp.post_recv(&[RecvWr::new(i as u64, &[mr.sge(N + i, 1)])]).unwrap();
            }
            for c in clients {
                let client = c.join().unwrap().unwrap_or_else(|e| panic!("round {round}: a client failed: {e}"));
                let i = client.qp.qpn() as usize % N;
                mr.write(i, &[client.peer_private.len() as u8]);
                let sge = Sge { addr: mr.addr() + i as u64, length: 1, lkey: mr.lkey() };
                client.qp.post_send(&[SendWr::send(1, &[sge])]).unwrap();
                assert_eq!(wait_one(&client.cq).status, WcStatus::Success);
            }
            for server in &accepted {
                let wc = wait_one(&server.cq);
                assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 1), "round {round}");
                assert_eq!(server.peer_private.len(), 1);
            }
        });
    }
}

#[test]
fn tcp_bootstrap_connects_too() {
    let ctx = Context::open(Provider::Software).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let spec = cm::QpSpec::default();
    let listener = cm::Listener::bind(&"127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = listener.local_addr().clone();
    std::thread::scope(|s| {
        let server = s.spawn(|| listener.accept(&pd, &spec, b"server", WAIT).unwrap());
        let client = cm::connect(&addr, &pd, &spec, b"client", WAIT).unwrap();
        let server = server.join().unwrap();
        assert_eq!(client.peer_private, b"server");
        assert_eq!(server.peer_private, b"client");
        let mr = pd.register(vec![0u8; 64].into_boxed_slice(), AccessFlags::ALL).unwrap();
        server.qp.post_recv(&[RecvWr::new(1, &[mr.sge(0, 32)])]).unwrap();
        client.qp.post_send(&[SendWr::send(2, &[mr.sge(32, 8)])]).unwrap();
        assert_eq!(wait_one(&server.cq).status, WcStatus::Success);
        assert_eq!(wait_one(&client.cq).status, WcStatus::Success);
    });
}

#[test]
fn flow_controlled_pipes_cross_processes_with_every_strategy() {
    use portability_verbs::datapath::{crossover, FlowStrategy, MsgPipe};
    for name in ["credit", "rdma", "window", "polled"] {
        let strategy = FlowStrategy::by_name(name).unwrap();
        let path = socket_path(&format!("pipe-{name}"));
        let mut child =
            Proc::new(env!("CARGO_BIN_EXE_pv_peer")).args(["pipe", name, &format!("unix:{path}")]).spawn().unwrap();
        let ctx = Context::open(Provider::Software).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let conn = cm::connect_retrying(
            &format!("unix:{path}").parse().unwrap(),
            &pd,
            &cm::QpSpec::with_depths(512, 512),
            b"",
            WAIT,
        )
        .unwrap();
        let mut pipe = MsgPipe::establish(conn.qp, conn.cq, &pd, strategy, WAIT).unwrap();
        // Random sizes, several in flight at once; replies are read whenever the pipe holds a
        // message back (as any full-duplex application must, or both ends fill up).
        let sizes: Vec<usize> = (0..400).map(|i| 1 + (i * 7919) % strategy.max_message()).collect();
        let (mut next, mut next_reply) = (0, 0);
        let deadline = Instant::now() + WAIT;
        while next_reply < sizes.len() {
            assert!(Instant::now() < deadline, "{name}: stalled at {next}/{next_reply}: {:?}", pipe.stats());
            if next < sizes.len() && pipe.try_send(&pattern(next as u64, sizes[next])).unwrap() {
                next += 1;
                continue;
            }
            pipe.flush().unwrap();
            while let Some(m) = pipe.recv_with(|m| m.to_vec()).unwrap() {
                assert_eq!(m, pattern(next_reply as u64, sizes[next_reply]), "{name} reply {next_reply}");
                next_reply += 1;
            }
        }
        // The crossover for this peer, measured over the pipe's round trip.
        std::env::set_var("PV_CROSSOVER_CACHE", std::env::temp_dir().join(format!("pv-xo-{}.tsv", std::process::id())));
        let xo = crossover::for_peer(&format!("test-{name}"), || pipe.round_trip(WAIT)).unwrap();
        assert!(xo.bytes > 0 && xo.round_trip > Duration::ZERO, "{xo:?}");
        pipe.send(&[], WAIT).unwrap();
        pipe.flush().unwrap();
        let deadline = Instant::now() + WAIT;
        while child.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "peer did not exit");
            let _ = pipe.progress();
            std::thread::sleep(Duration::from_millis(2));
        }
        assert!(child.wait().unwrap().success());
    }
}
