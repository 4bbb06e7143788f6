//! The soak test: peer processes streaming random sizes with random pauses, some SIGKILLed at
//! random points. Among survivors nothing is lost or corrupted; every stream from a killed peer
//! ends in an error within 2 s of the kill (never a hang, never corrupt bytes); and once every
//! connection is gone the process holds no more descriptors, provider segments or threads than
//! before. `SOAK_SECS` sets how long the peers stream (default 3; longer runs outside CI) and
//! `SOAK_SEED` the randomness (default: from the clock, printed, so a failure can be replayed).

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use madeleine::*;
use sockets_compat::{SdpConfig, SdpListener};
use tests::soak::{self, Holdings, StreamEnd, XorShift};

fn secs() -> u64 {
    std::env::var("SOAK_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(3)
}

fn seed() -> u64 {
    let s = std::env::var("SOAK_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    });
    eprintln!("soak seed {s} (SOAK_SEED={s} replays it), {} s", secs());
    s
}

/// Kills the child if the test fails before it exits.
struct Reap(Child);

impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// SDP connections from six processes (two of each design) stream framed data of random sizes;
/// two of them are killed at random moments of their stream.
#[test]
fn sdp_streams_survive_killed_peers_and_leak_nothing() {
    let seed = seed();
    let mut rng = XorShift(seed | 1);
    let run = Duration::from_secs(secs());
    let l = SdpListener::bind_with("127.0.0.1:0", SdpConfig { zcopy_threshold: 16 * 1024, ..SdpConfig::default() })
        .unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let spawn = |i: u64, ms: u128| {
        let design = ["bsdp", "zsdp", "azsdp"][i as usize % 3];
        Reap(
            Command::new(env!("CARGO_BIN_EXE_sdp_peer"))
                .args([&addr, "soak", &(seed ^ i).to_string(), &ms.to_string()])
                .env("SDP_DESIGN", design)
                .env("SDP_ZCOPY_THRESHOLD", "16384")
                .spawn()
                .unwrap(),
        )
    };
    // A first connection brings up what a process keeps once (the progress engine, the
    // provider's threads); what holds after it is the baseline.
    {
        let _warm = spawn(1000, 1);
        let (mut s, _) = l.accept_timeout(Duration::from_secs(20)).unwrap();
        std::io::Read::read_exact(&mut s, &mut [0u8; 8]).unwrap();
        assert!(matches!(soak::read_frames(&mut s, seed ^ 1000), Ok(StreamEnd::Complete { .. })));
    }
    let base = Holdings::now();
    const N: u64 = 6;
    let mut children: Vec<Reap> = (0..N).map(|i| spawn(i, run.as_millis())).collect();
    let readers: Vec<_> = (0..N)
        .map(|_| {
            let (mut s, _) = l.accept_timeout(Duration::from_secs(20)).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            std::thread::spawn(move || {
                // Each stream opens with its seed, which says whose it is.
                let mut id = [0u8; 8];
                std::io::Read::read_exact(&mut s, &mut id).unwrap();
                let stream_seed = u64::from_le_bytes(id);
                (stream_seed ^ seed, soak::read_frames(&mut s, stream_seed))
            })
        })
        .collect();
    // Two victims, killed somewhere in the middle of their streams.
    let first = rng.below(N);
    let victims = [first, (first + 1 + rng.below(N - 1)) % N];
    let mut killed_at = vec![None; N as usize];
    let start = Instant::now();
    for &v in &victims {
        let at = Duration::from_millis(rng.below(run.as_millis() as u64 * 3 / 4) + 50);
        std::thread::sleep(at.saturating_sub(start.elapsed()));
        children[v as usize].0.kill().unwrap();
        killed_at[v as usize] = Some(Instant::now());
    }
    let (mut complete, mut verified, mut kills) = (0, 0u64, 0);
    for h in readers {
        let (who, r) = h.join().unwrap();
        match (r, killed_at[who as usize]) {
            (Ok(StreamEnd::Complete { frames, bytes }), _) => {
                assert!(frames > 0);
                complete += 1;
                verified += bytes;
            }
            (Ok(StreamEnd::Failed { frames, bytes, kind, at }), Some(kill)) => {
                let late = at.saturating_duration_since(kill);
                assert!(late < Duration::from_secs(2), "stream {who}: the kill was noticed after {late:?}");
                eprintln!("stream {who}: killed after {frames} intact frames, then {kind:?} in {late:?}");
                verified += bytes;
                kills += 1;
            }
            (r, _) => panic!("stream {who} (killed: {}): {r:?}", killed_at[who as usize].is_some()),
        }
    }
    assert!(complete >= (N as usize) - victims.len());
    eprintln!("soak sdp: {N} streams, {complete} complete, {kills} killed mid-stream, {verified} bytes verified");
    for c in &mut children {
        let _ = c.0.wait();
    }
    drop(children);
    if let Err(now) = Holdings::settle_to(base, Duration::from_secs(5)) {
        panic!("after every connection ended the process holds {now:?}, against {base:?} before");
    }
}

/// A Madeleine session of three processes: ranks 1 and 2 stream messages of random sizes to
/// rank 0 (this test), which receives from each on a thread of its own; rank 2 is killed at a
/// random moment. Rank 1's messages all arrive intact, the receive from rank 2 fails with
/// `PeerLost` within 2 s of the kill.
#[test]
fn madeleine_ranks_survive_a_killed_rank() {
    let seed = seed();
    let mut rng = XorShift(seed | 1);
    let run = Duration::from_secs(secs());
    let dir = std::env::temp_dir().join(format!("mad-soak-{}", std::process::id()));
    let spawn = |rank: usize| {
        Reap(
            Command::new(env!("CARGO_BIN_EXE_mad_peer"))
                .args(["soak", &(seed ^ rank as u64).to_string(), &run.as_millis().to_string()])
                .env("MAD_RANK", rank.to_string())
                .env("MAD_SIZE", "3")
                .env("MAD_RENDEZVOUS", &dir)
                .spawn()
                .unwrap(),
        )
    };
    let mut children = [spawn(1), spawn(2)];
    let mut cfg = SessionConfig::new(0, 3, &dir);
    cfg.timeout = Duration::from_secs(20);
    cfg.wait_limit = Some(Duration::from_secs(20));
    let session = Session::new(cfg).unwrap();
    let ch = session.channel().unwrap();
    let kill_after = Duration::from_millis(rng.below(run.as_millis() as u64 * 3 / 4) + 50);
    // Rank 2 is killed once every rank is past set-up (each sent a message): a rank that
    // dies during set-up leaves the others waiting out the set-up timeout, by design.
    let started = [std::sync::atomic::AtomicBool::new(false), std::sync::atomic::AtomicBool::new(false)];
    let bytes = std::sync::atomic::AtomicU64::new(0);
    let (killed_at, results) = std::thread::scope(|s| {
        let receivers: Vec<_> = [1usize, 2]
            .map(|rank| {
                let (ch, started, bytes) = (&ch, &started, &bytes);
                s.spawn(move || -> (usize, Result<u32>, Instant) {
                    let mut seq = 0u32;
                    loop {
                        let mut body = Vec::new();
                        let got = (|| -> Result<Option<u32>> {
                            let mut u = ch.begin_unpacking_from(rank)?;
                            let mut len = [0u8; 8];
                            u.unpack_express(&mut len, SendMode::Cheaper)?;
                            let len = u64::from_le_bytes(len) as usize;
                            if len == 0 {
                                let mut n = [0u8; 4];
                                u.unpack_express(&mut n, SendMode::Safer)?;
                                u.end_unpacking()?;
                                return Ok(Some(u32::from_le_bytes(n)));
                            }
                            body.resize(len, 0);
                            u.unpack(&mut body, SendMode::Cheaper, RecvMode::Cheaper)?;
                            u.end_unpacking()?;
                            Ok(None)
                        })();
                        match got {
                            Ok(Some(n)) => {
                                return (
                                    rank,
                                    if n == seq {
                                        Ok(n)
                                    } else {
                                        Err(MadError::Invalid(format!("{n} counted, {seq} came")))
                                    },
                                    Instant::now(),
                                )
                            }
                            Ok(None) => {
                                assert!(
                                    body == soak::payload(seed ^ rank as u64, seq, body.len()),
                                    "rank {rank}: message {seq} corrupted"
                                );
                                bytes.fetch_add(body.len() as u64, std::sync::atomic::Ordering::Relaxed);
                                seq += 1;
                                started[rank - 1].store(true, std::sync::atomic::Ordering::Relaxed);
                            }
                            Err(e) => return (rank, Err(e), Instant::now()),
                        }
                    }
                })
            })
            .into_iter()
            .collect();
        let up = Instant::now();
        while !started.iter().all(|s| s.load(std::sync::atomic::Ordering::Relaxed)) {
            assert!(up.elapsed() < Duration::from_secs(20), "the ranks never started");
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(kill_after);
        children[1].0.kill().unwrap();
        let killed_at = Instant::now();
        (killed_at, receivers.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>())
    });
    for (rank, result, at) in results {
        match (rank, result) {
            (1, Ok(n)) => {
                assert!(n > 0);
                let mut p = ch.begin_packing(1).unwrap();
                p.pack_safer(&[1], RecvMode::Express).unwrap();
                p.end_packing().unwrap();
            }
            (2, Err(MadError::PeerLost { .. })) => {
                let late = at.saturating_duration_since(killed_at);
                assert!(late < Duration::from_secs(2), "rank 2's death was noticed after {late:?}");
            }
            (2, Ok(_)) => {} // it finished before the kill
            (r, other) => panic!("rank {r}: {other:?}"),
        }
    }
    assert!(children[0].0.wait().unwrap().success(), "rank 1 failed");
    eprintln!("soak madeleine: 2 ranks streaming, 1 killed, {} bytes verified", bytes.into_inner());
}
