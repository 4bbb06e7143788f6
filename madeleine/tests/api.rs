//! Madeleine's contracts, with the ranks of a group as threads of this process (each with its
//! own session, device context and connections, as separate processes would have).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use madeleine::*;
use portability_verbs::datapath::FlowStrategy;

static GROUP: AtomicUsize = AtomicUsize::new(0);

/// Runs `f(rank, channel)` on `n` ranks at once; panics propagate.
fn group<F>(n: usize, threshold: usize, f: F)
where
    F: Fn(usize, &Channel) + Sync,
{
    group_with(n, threshold, true, Duration::from_secs(20), f)
}

fn group_with<F>(n: usize, threshold: usize, barrier: bool, timeout: Duration, f: F)
where
    F: Fn(usize, &Channel) + Sync,
{
    group_cfg(
        n,
        barrier,
        |cfg| {
            cfg.timeout = timeout;
            cfg.wait_limit = Some(timeout);
            cfg.rendezvous_threshold = Some(threshold);
        },
        f,
    )
}

thread_local! {
    /// The flow strategy of the groups this test thread makes (None: the default).
    static FLOW: std::cell::Cell<Option<FlowStrategy>> = const { std::cell::Cell::new(None) };
    /// The spin phase of the groups this test thread makes (None: the default).
    static SPIN: std::cell::Cell<Option<Spin>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with groups whose pipes use `strategy`.
fn with_flow(strategy: FlowStrategy, f: impl FnOnce()) {
    FLOW.set(Some(strategy));
    f();
    FLOW.set(None);
}

/// As [`group`], each rank's configuration set by `set`.
fn group_cfg<F>(n: usize, barrier: bool, set: impl Fn(&mut SessionConfig) + Sync, f: F)
where
    F: Fn(usize, &Channel) + Sync,
{
    let (flow, spin) = (FLOW.get(), SPIN.get());
    let dir =
        std::env::temp_dir().join(format!("mad-test-{}-{}", std::process::id(), GROUP.fetch_add(1, Ordering::Relaxed)));
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let (dir, f, set) = (dir.clone(), &f, &set);
                s.spawn(move || {
                    let mut cfg = SessionConfig::new(rank, n, dir);
                    // A bug fails the test instead of hanging it (a session's own default is to
                    // wait as long as it takes).
                    cfg.wait_limit = Some(Duration::from_secs(60));
                    if let Some(s) = flow {
                        cfg.strategy = s;
                    }
                    if let Some(s) = spin {
                        cfg.spin = s;
                    }
                    set(&mut cfg);
                    let session = Session::new(cfg).unwrap();
                    let ch = session.channel().unwrap();
                    let control = session.channel().unwrap();
                    f(rank, &ch);
                    // Nobody tears down while others still talk to it (on a channel of its
                    // own, so the barrier never meets the test's messages).
                    if barrier {
                        control.barrier().unwrap();
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
    });
    let _ = std::fs::remove_dir_all(dir);
}

/// Views cells as bytes, so a test can change a buffer the packer holds (what SEND_LATER
/// allows).
fn unsafe_cell_bytes(cells: &[std::cell::Cell<u8>]) -> &[u8] {
    // SAFETY: Cell<u8> has the layout of u8; the packer reads these bytes only at end_packing,
    // after the last `set`, on this thread.
    unsafe { std::slice::from_raw_parts(cells.as_ptr() as *const u8, cells.len()) }
}

/// Sends `body` to rank 1 as a length packed EXPRESS and the body packed CHEAPER.
fn send_sized(ch: &Channel, body: &[u8]) {
    let len = (body.len() as u64).to_le_bytes();
    let (mut p, _reports) = begin_past_reports(ch, 1);
    p.pack(&len, SendMode::Cheaper, RecvMode::Express).unwrap();
    p.pack(body, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
    p.end_packing().unwrap();
}

/// Receives what `send_sized` sent: the usual EXPRESS/CHEAPER pattern.
fn recv_sized(ch: &Channel) -> Vec<u8> {
    // A CHEAPER buffer must outlive the unpacker (the borrow checker insists: the data may
    // land until end_unpacking), so it is declared first and sized later.
    let mut body = Vec::new();
    let mut u = ch.begin_unpacking().unwrap();
    let mut len = [0u8; 8];
    u.unpack_express(&mut len, SendMode::Cheaper).unwrap();
    // The length decides the next unpack.
    body.resize(u64::from_le_bytes(len) as usize, 0);
    u.unpack(&mut body, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
    u.end_unpacking().unwrap();
    body
}

fn pattern(seed: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (seed * 131 + i * 7 + (i >> 8)) as u8).collect()
}

const SMALL: usize = 4096; // rendezvous threshold used by most tests

#[test]
fn safer_copies_at_pack_later_reads_at_end_packing() {
    group(2, SMALL, |rank, ch| {
        for len in [8usize, 100_000] {
            if rank == 0 {
                let mut a = vec![1u8; len];
                // LATER: the buffer is read at end_packing, so changes made up to then (here
                // through a Cell-like interior, since the packer borrows the buffer) are sent.
                let b: Vec<std::cell::Cell<u8>> = (0..len).map(|_| std::cell::Cell::new(2)).collect();
                let b_bytes: &[u8] = unsafe_cell_bytes(&b);
                let mut p = ch.begin_packing(1).unwrap();
                p.pack_safer(&a, RecvMode::Express).unwrap();
                a.fill(9); // SAFER: too late to change what is sent
                p.pack(b_bytes, SendMode::Later, RecvMode::Express).unwrap();
                for c in &b {
                    c.set(3); // before end_packing: this is what the receiver gets
                }
                p.end_packing().unwrap();
                assert_eq!(a[0], 9);
            } else {
                let mut a = vec![0u8; len];
                let mut b = vec![0u8; len];
                let mut u = ch.begin_unpacking().unwrap();
                u.unpack_express(&mut a, SendMode::Safer).unwrap();
                u.unpack_express(&mut b, SendMode::Later).unwrap();
                u.end_unpacking().unwrap();
                assert!(a.iter().all(|&x| x == 1), "SAFER data changed after pack");
                assert!(b.iter().all(|&x| x == 3));
            }
        }
    });
}

#[test]
fn express_data_is_there_at_unpack_and_cheaper_after_end_unpacking() {
    group(2, SMALL, |rank, ch| {
        let body_len = 200_000;
        if rank == 0 {
            send_sized(ch, &pattern(1, body_len));
        } else {
            let body = recv_sized(ch);
            assert_eq!(body.len(), body_len);
            assert_eq!(body, pattern(1, body_len));
        }
    });
}

#[test]
fn every_size_across_protocol_boundaries_and_many_packs_per_message() {
    // With a small rendezvous threshold (inline, bulk, rendezvous) and with none (inline and
    // bulk only, the bulk ring of 1 MiB wrapping in 256 KiB chunks).
    for threshold in [SMALL, usize::MAX] {
        every_size_with(threshold);
    }
}

fn every_size_with(threshold: usize) {
    group(2, threshold, |rank, ch| {
        let sizes = [
            0usize,
            1,
            15,
            16,
            17,
            1000,
            1970,
            2100,
            4095,
            4096,
            4097,
            16_000,
            16_400,
            70_000,
            262_144,
            262_145,
            1 << 20,
            (4 << 20) - 1,
        ];
        if rank == 0 {
            let bufs: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(i, &n)| pattern(i, n)).collect();
            let mut p = ch.begin_packing(1).unwrap();
            for (i, b) in bufs.iter().enumerate() {
                let r = if i % 2 == 0 { RecvMode::Express } else { RecvMode::Cheaper };
                p.pack(b, SendMode::Cheaper, r).unwrap();
            }
            p.end_packing().unwrap();
        } else {
            let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
            let mut u = ch.begin_unpacking().unwrap();
            for (i, b) in bufs.iter_mut().enumerate() {
                let r = if i % 2 == 0 { RecvMode::Express } else { RecvMode::Cheaper };
                u.unpack(b, SendMode::Cheaper, r).unwrap();
            }
            u.end_unpacking().unwrap();
            for (i, b) in bufs.iter().enumerate() {
                assert_eq!(b, &pattern(i, sizes[i]), "pack {i} of {} bytes", sizes[i]);
            }
        }
    });
}

/// Packs of the sizes that go as one pipe message only while the peer keeps up (above a frame
/// of a 32 KiB ring, up to Madeleine's largest frame, a 64 KiB ring's) arrive intact and in
/// order either way: in a ping-pong, where each message goes as a frame, and in a stream the
/// receiver reads behind, where they take the bulk lane, in every shape a message takes (a
/// lone pack straight from the application's buffer, a copied one, behind an express header,
/// two of them).
#[test]
fn frame_sized_packs_arrive_intact_whether_the_peer_keeps_up_or_reads_behind() {
    let sizes = [8000usize, 8150, 8192, 8300, 12_000, 16_200, 16_320, 16_384];
    let shapes = 4;
    let send = |ch: &Channel, i: usize, shape: usize| {
        let (n, a, b) = (sizes[i % sizes.len()], pattern(i, sizes[i % sizes.len()]), pattern(i + 1000, 300));
        let mut p = ch.begin_packing(1).unwrap();
        match shape {
            0 => p.pack(&a, SendMode::Cheaper, RecvMode::Cheaper).unwrap(),
            1 => p.pack_safer(&a, RecvMode::Cheaper).unwrap(),
            2 => {
                p.pack_safer(&(n as u64).to_le_bytes(), RecvMode::Express).unwrap();
                p.pack(&a, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
            }
            _ => {
                p.pack(&a, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
                p.pack(&b, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
            }
        }
        p.end_packing().unwrap();
    };
    let recv = |ch: &Channel, i: usize, shape: usize| {
        let n = sizes[i % sizes.len()];
        let (mut a, mut b, mut len) = (vec![0u8; n], vec![0u8; 300], [0u8; 8]);
        let mut u = ch.begin_unpacking_from(0).unwrap();
        match shape {
            0 => u.unpack(&mut a, SendMode::Cheaper, RecvMode::Cheaper).unwrap(),
            1 => u.unpack(&mut a, SendMode::Safer, RecvMode::Cheaper).unwrap(),
            2 => {
                u.unpack_express(&mut len, SendMode::Safer).unwrap();
                assert_eq!(u64::from_le_bytes(len), n as u64);
                u.unpack(&mut a, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
            }
            _ => {
                u.unpack(&mut a, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
                u.unpack(&mut b, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
            }
        }
        u.end_unpacking().unwrap();
        assert!(a == pattern(i, n), "message {i} ({n} bytes, shape {shape}) corrupted");
        if shape == 3 {
            assert!(b == pattern(i + 1000, 300), "message {i}'s second pack corrupted");
        }
    };
    group(2, usize::MAX, |rank, ch| {
        let messages = sizes.len() * shapes;
        // A ping-pong: the reply acknowledges each message before the next.
        for i in 0..messages {
            if rank == 0 {
                send(ch, i, i % shapes);
                let mut ack = [0u8; 1];
                let mut u = ch.begin_unpacking_from(1).unwrap();
                u.unpack_express(&mut ack, SendMode::Safer).unwrap();
                u.end_unpacking().unwrap();
            } else {
                recv(ch, i, i % shapes);
                let mut p = ch.begin_packing(0).unwrap();
                p.pack_safer(&[1], RecvMode::Express).unwrap();
                p.end_packing().unwrap();
            }
        }
        // A stream the receiver reads behind (it starts late, and the sender goes on).
        if rank == 0 {
            for i in 0..4 * messages {
                send(ch, i, i % shapes);
            }
        } else {
            std::thread::sleep(Duration::from_millis(50));
            for i in 0..4 * messages {
                recv(ch, i, i % shapes);
            }
        }
    });
}

/// Both ranks send messages with packs larger than the peer's bulk ring before either
/// receives: each sender, waiting for ring space, must drain the other's data (the slow path)
/// instead of deadlocking; everything arrives intact.
#[test]
fn crossing_bulk_messages_do_not_deadlock() {
    group(2, usize::MAX, |rank, ch| {
        let peer = 1 - rank;
        let len = 3 << 20;
        let bodies: Vec<Vec<u8>> = (0..3).map(|i| pattern(rank * 10 + i, len)).collect();
        for b in &bodies {
            let mut p = ch.begin_packing(peer).unwrap();
            p.pack_safer(&(b.len() as u64).to_le_bytes(), RecvMode::Express).unwrap();
            p.pack(b, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
            p.pack_safer(b"tail", RecvMode::Express).unwrap();
            p.end_packing().unwrap();
        }
        for i in 0..3 {
            let mut n = [0u8; 8];
            let mut body = vec![0u8; len];
            let mut tail = [0u8; 4];
            let mut u = ch.begin_unpacking_from(peer).unwrap();
            u.unpack_express(&mut n, SendMode::Safer).unwrap();
            u.unpack(&mut body, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
            u.unpack_express(&mut tail, SendMode::Safer).unwrap();
            u.end_unpacking().unwrap();
            assert_eq!(u64::from_le_bytes(n), len as u64);
            assert!(body == pattern(peer * 10 + i, len), "message {i} from {peer} corrupted");
            assert_eq!(&tail, b"tail");
        }
    });
}

/// A receiver that leaves a bulk pack unread gets a mismatch error, and the connection goes on
/// working for the next message.
#[test]
fn an_unread_bulk_pack_is_a_mismatch_and_the_connection_survives() {
    group(2, usize::MAX, |rank, ch| {
        let big = pattern(3, 300_000);
        if rank == 0 {
            let mut p = ch.begin_packing(1).unwrap();
            p.pack(&big, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
            p.end_packing().unwrap();
            send_sized(ch, &big);
        } else {
            let u = ch.begin_unpacking().unwrap();
            let e = u.end_unpacking().unwrap_err();
            assert!(matches!(e, MadError::Mismatch { .. }), "{e}");
            assert_eq!(recv_sized(ch), big);
        }
    });
}

/// A bulk-lane pack unpacked with other modes or another size is a mismatch (the unpack
/// writes nothing of it), and the connection goes on; then the same pack, and one followed by
/// another pack, unpacked as sent, arrive intact.
#[test]
fn a_bulk_pack_unpacked_otherwise_is_a_mismatch_and_as_sent_arrives_intact() {
    group(2, usize::MAX, |rank, ch| {
        let big = pattern(4, 20_000);
        let send = |tail: bool| {
            let (mut p, _reports) = begin_past_reports(ch, 1);
            p.pack(&big, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
            if tail {
                p.pack_safer(b"tail", RecvMode::Express).unwrap();
            }
            p.end_packing().unwrap();
        };
        if rank == 0 {
            for tail in [false, false, false, true] {
                send(tail);
            }
            return;
        }
        for (len, recv) in [(big.len(), RecvMode::Express), (big.len() - 1, RecvMode::Cheaper)] {
            let mut b = vec![0u8; len];
            let mut u = ch.begin_unpacking().unwrap();
            let e = if recv == RecvMode::Express {
                u.unpack_express(&mut b, SendMode::Cheaper).unwrap_err()
            } else {
                u.unpack(&mut b, SendMode::Cheaper, recv).unwrap_err()
            };
            assert!(matches!(e, MadError::Mismatch { .. }), "{e}");
            drop(u);
            assert!(b.iter().all(|&x| x == 0), "a mismatched unpack wrote into its buffer");
        }
        let mut b = vec![0u8; big.len()];
        let mut u = ch.begin_unpacking().unwrap();
        u.unpack(&mut b, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
        u.end_unpacking().unwrap();
        assert!(b == big);
        let (mut b, mut tail) = (vec![0u8; big.len()], [0u8; 4]);
        let mut u = ch.begin_unpacking().unwrap();
        u.unpack(&mut b, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
        u.unpack_express(&mut tail, SendMode::Safer).unwrap();
        u.end_unpacking().unwrap();
        assert!(b == big && &tail == b"tail");
    });
}

/// A receiver that unpacks one pack more than a bulk-lane message held gets a mismatch naming
/// the pack counts, its connection goes on (the next messages arrive), and the sender is told
/// too: its next send to that rank reports what the receiver found, once.
#[test]
fn an_extra_unpack_of_a_bulk_message_is_a_mismatch_on_both_sides() {
    group(2, usize::MAX, |rank, ch| {
        let big = pattern(9, 64 * 1024);
        if rank == 0 {
            let mut p = ch.begin_packing(1).unwrap();
            p.pack(&big, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
            p.end_packing().unwrap();
            // Wait until the receiver has found the mismatch.
            let mut u = ch.begin_unpacking_from(1).unwrap();
            let mut go = [0u8; 1];
            u.unpack_express(&mut go, SendMode::Safer).unwrap();
            u.end_unpacking().unwrap();
            let e = ch.begin_packing(1).and_then(|mut p| {
                p.pack(&big, SendMode::Cheaper, RecvMode::Cheaper)?;
                p.end_packing()
            });
            match e {
                Err(MadError::Mismatch { rank: 1, why }) => {
                    assert!(why.contains("packed 1") && why.contains("asked for more"), "{why}")
                }
                other => panic!("the sender was not told: {other:?}"),
            }
            // Told once; the connection goes on, 40 messages of 64 KiB (more than the bulk
            // ring holds).
            for i in 0..40 {
                send_sized(ch, &pattern(i, 64 * 1024));
            }
        } else {
            let mut b = vec![0u8; big.len()];
            let mut u = ch.begin_unpacking().unwrap();
            u.unpack(&mut b, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
            let mut extra = [0u8; 8];
            let e = u.unpack_express(&mut extra, SendMode::Cheaper).unwrap_err();
            assert!(matches!(&e, MadError::Mismatch { why, .. } if why.contains("asked for more")), "{e}");
            let e = u.end_unpacking().unwrap_err();
            assert!(matches!(e, MadError::Mismatch { .. }), "{e}");
            assert_eq!(b, big);
            let mut p = ch.begin_packing(0).unwrap();
            p.pack_safer(&[1], RecvMode::Express).unwrap();
            p.end_packing().unwrap();
            for i in 0..40 {
                assert_eq!(recv_sized(ch), pattern(i, 64 * 1024), "message {i}");
            }
        }
    });
}

/// Four ranks in a ring each send their right neighbour a message larger than the bulk ring
/// with `end_packing_nowait`, and only then receive from the left, as an MPI program with
/// `MPI_Isend` then `MPI_Recv` does: a nonblocking send never needs its receiver to be
/// receiving. Messages of one large pack, and of large packs around small ones.
#[test]
fn a_ring_of_nonblocking_sends_before_receives_completes() {
    const N: usize = 4;
    for shape in 0..2 {
        group(N, usize::MAX, |rank, ch| {
            let right = (rank + 1) % N;
            let big = pattern(rank, 8 << 20);
            let second = pattern(rank + 10, 3 << 20);
            let tag = [rank as u8; 8];
            let mut p = ch.begin_packing(right).unwrap();
            p.pack(&big, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
            if shape == 1 {
                p.pack(&tag, SendMode::Cheaper, RecvMode::Express).unwrap();
                p.pack(&second, SendMode::Later, RecvMode::Cheaper).unwrap();
            }
            let pending = p.end_packing_nowait().unwrap();
            let left = (rank + N - 1) % N;
            let mut got = vec![0u8; 8 << 20];
            let mut got2 = vec![0u8; 3 << 20];
            let mut small = [0u8; 8];
            let mut u = ch.begin_unpacking_from(left).unwrap();
            u.unpack(&mut got, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
            if shape == 1 {
                u.unpack_express(&mut small, SendMode::Cheaper).unwrap();
                u.unpack(&mut got2, SendMode::Later, RecvMode::Cheaper).unwrap();
            }
            u.end_unpacking().unwrap();
            pending.wait().unwrap();
            assert!(got == pattern(left, 8 << 20), "shape {shape}: rank {rank} got a wrong message");
            if shape == 1 {
                assert_eq!(small, [left as u8; 8]);
                assert!(got2 == pattern(left + 10, 3 << 20));
            }
        });
    }
}

/// Blocking calls wait as long as it takes, as MPI's do: a receive posted long before its
/// message (here four times the set-up timeout) gets it; a session's `wait_limit` bounds it.
#[test]
fn a_receive_outlives_the_set_up_timeout() {
    group_cfg(
        2,
        true,
        |cfg| {
            cfg.timeout = Duration::from_millis(500);
            cfg.wait_limit = None;
        },
        |rank, ch| {
            if rank == 0 {
                std::thread::sleep(Duration::from_secs(2));
                let mut p = ch.begin_packing(1).unwrap();
                p.pack_safer(b"late", RecvMode::Express).unwrap();
                p.end_packing().unwrap();
            } else {
                let t = std::time::Instant::now();
                let mut u = ch.begin_unpacking().unwrap();
                let mut b = [0u8; 4];
                u.unpack_express(&mut b, SendMode::Safer).unwrap();
                u.end_unpacking().unwrap();
                assert_eq!(&b, b"late");
                assert!(t.elapsed() >= Duration::from_millis(1500));
            }
        },
    );
    // With a limit, the same wait ends in a timeout.
    group_cfg(
        2,
        false,
        |cfg| cfg.wait_limit = Some(Duration::from_millis(300)),
        |rank, ch| {
            if rank == 1 {
                assert!(matches!(ch.begin_unpacking().map(|_| ()), Err(MadError::Timeout(_))));
            } else {
                // Up until rank 1 gave up (a closed peer would end its wait first).
                std::thread::sleep(Duration::from_millis(1000));
            }
        },
    );
}

/// A rendezvous pack unpacked with the wrong size or modes is a mismatch: the sender is
/// released all the same (its `end_packing` returns) and the connection goes on. Both ways a
/// rendezvous travels: whole (its record alone in the message) and after a flush (records
/// taken one by one from the pipe).
#[test]
fn a_mismatched_rendezvous_pack_releases_the_sender_and_the_connection_survives() {
    group(2, SMALL, |rank, ch| {
        let big = pattern(5, 100_000);
        for flushed in [false, true] {
            for wrong_modes in [false, true] {
                if rank == 0 {
                    let (mut p, _reports) = begin_past_reports(ch, 1);
                    if flushed {
                        p.pack(&[7u8; 8], SendMode::Cheaper, RecvMode::Express).unwrap();
                        p.flush().unwrap();
                    }
                    p.pack(&big, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
                    p.end_packing().unwrap();
                    send_sized(ch, &big);
                } else {
                    let mut u = ch.begin_unpacking().unwrap();
                    if flushed {
                        let mut h = [0u8; 8];
                        u.unpack_express(&mut h, SendMode::Cheaper).unwrap();
                    }
                    let e = if wrong_modes {
                        let mut b = vec![0u8; big.len()];
                        u.unpack_express(&mut b, SendMode::Cheaper).unwrap_err()
                    } else {
                        let mut b = vec![0u8; big.len() - 1];
                        u.unpack_express(&mut b, SendMode::Cheaper).unwrap_err()
                    };
                    assert!(matches!(e, MadError::Mismatch { .. }), "{e}");
                    drop(u);
                    assert_eq!(recv_sized(ch), big, "flushed {flushed}, wrong modes {wrong_modes}");
                }
            }
        }
    });
}

/// Without a configured threshold each connection probes its transport at set-up (between
/// threads of one process an RDMA read is a plain copy, so zero-copy usually pays from some
/// size on; in a debug build or between processes, copying through the bulk lane may win at
/// every size). Each sender decides alone (the records say which protocol a pack took), so
/// packs on both sides of the sender's threshold arrive intact whatever the receiver chose.
#[test]
fn the_probe_picks_a_rendezvous_threshold_per_connection() {
    let dir = std::env::temp_dir().join(format!("mad-probe-{}", std::process::id()));
    std::thread::scope(|s| {
        for rank in 0..2 {
            let dir = dir.clone();
            s.spawn(move || {
                let session = Session::new(SessionConfig::new(rank, 2, dir)).unwrap();
                let ch = session.channel().unwrap();
                let t = ch.rendezvous_threshold(1 - rank).unwrap();
                assert!(t > 2048, "zero-copy chosen for packs that fit an eager message ({t})");
                let sizes = if t == usize::MAX { [1 << 20, 2 << 20, 4 << 20] } else { [t - 1, t, t + 4096] };
                for len in sizes {
                    if rank == 0 {
                        send_sized(&ch, &pattern(len, len));
                    } else {
                        let body = recv_sized(&ch);
                        assert!(body == pattern(body.len(), body.len()), "{} bytes", body.len());
                    }
                }
                ch.barrier().unwrap();
            });
        }
    });
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn any_source_with_per_sender_order() {
    let n = 4;
    group(n, SMALL, |rank, ch| {
        let per = 30;
        if rank != 0 {
            for k in 0..per {
                let mut p = ch.begin_packing(0).unwrap();
                let v = [rank as u8, k as u8];
                p.pack_safer(&v, RecvMode::Express).unwrap();
                p.end_packing().unwrap();
            }
        } else {
            let mut next = vec![0u8; n];
            for _ in 0..per * (n - 1) {
                let mut u = ch.begin_unpacking().unwrap();
                let mut v = [0u8; 2];
                u.unpack_express(&mut v, SendMode::Safer).unwrap();
                assert_eq!(u.source(), v[0] as usize);
                u.end_unpacking().unwrap();
                assert_eq!(v[1], next[v[0] as usize], "messages from {} out of order", v[0]);
                next[v[0] as usize] += 1;
            }
            // And from a chosen source.
        }
    });
}

/// Polls `f` until it gives a value, failing the test after `secs` seconds (never a hang).
fn poll_until<T>(secs: u64, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(std::time::Instant::now() < deadline, "nothing within {secs} s");
        std::thread::yield_now();
    }
}

#[test]
fn nonblocking_receives_find_nothing_then_the_message() {
    group(2, SMALL, |rank, ch| {
        if rank == 0 {
            // Wait until rank 1 has looked at an empty channel, then send it two messages.
            let mut u = ch.begin_unpacking_from(1).unwrap();
            let mut go = [0u8; 1];
            u.unpack_express(&mut go, SendMode::Safer).unwrap();
            u.end_unpacking().unwrap();
            for k in [5u8, 6] {
                let mut p = ch.begin_packing(1).unwrap();
                p.pack_safer(&[k; 3], RecvMode::Express).unwrap();
                p.end_packing().unwrap();
            }
        } else {
            assert!(ch.try_begin_unpacking_from(0).unwrap().is_none());
            assert!(ch.try_begin_unpacking().unwrap().is_none());
            assert!(matches!(ch.try_begin_unpacking_from(7), Err(MadError::Invalid(_))));
            let mut p = ch.begin_packing(0).unwrap();
            p.pack_safer(&[1], RecvMode::Express).unwrap();
            p.end_packing().unwrap();

            let mut u = poll_until(10, || ch.try_begin_unpacking_from(0).unwrap());
            assert_eq!(u.source(), 0);
            // While this message is being read, its source's next one is not handed out.
            assert!(ch.try_begin_unpacking_from(0).unwrap().is_none());
            assert!(ch.try_begin_unpacking().unwrap().is_none());
            let mut b = [0u8; 3];
            u.unpack_express(&mut b, SendMode::Safer).unwrap();
            u.end_unpacking().unwrap();
            assert_eq!(b, [5; 3]);

            let mut u = poll_until(10, || ch.try_begin_unpacking().unwrap());
            assert_eq!(u.source(), 0);
            u.unpack_express(&mut b, SendMode::Safer).unwrap();
            u.end_unpacking().unwrap();
            assert_eq!(b, [6; 3]);
        }
    });
}

#[test]
fn a_nonblocking_receive_from_a_peer_that_closed_is_an_error() {
    group_with(2, SMALL, false, Duration::from_secs(20), |rank, ch| {
        if rank == 1 {
            // Rank 0 returns at once, dropping its channel: polls end in an error, not in
            // `None` forever.
            let e = poll_until(10, || match ch.try_begin_unpacking_from(0) {
                Ok(None) => None,
                Ok(Some(_)) => panic!("a message from a peer that sent none"),
                Err(e) => Some(e),
            });
            assert!(matches!(e, MadError::PeerClosed { rank: 0 }), "{e}");
        }
    });
}

#[test]
fn what_was_sent_before_a_close_arrives_then_the_close_is_an_error() {
    // A long timeout: the close must end the wait, not the timeout.
    group_with(3, SMALL, false, Duration::from_secs(60), |rank, ch| {
        if rank == 0 {
            for k in 0..3u8 {
                let mut p = ch.begin_packing(2).unwrap();
                p.pack_safer(&[k; 5], RecvMode::Express).unwrap();
                p.end_packing().unwrap();
            }
            // Dropping the channel (returning) closes this end after them.
        } else if rank == 2 {
            let t = std::time::Instant::now();
            for k in 0..3u8 {
                let mut u = ch.begin_unpacking_from(0).unwrap();
                let mut b = [0u8; 5];
                u.unpack_express(&mut b, SendMode::Safer).unwrap();
                u.end_unpacking().unwrap();
                assert_eq!(b, [k; 5]);
            }
            let e = ch.begin_unpacking_from(0).expect_err("rank 0 closed");
            assert!(matches!(e, MadError::PeerClosed { rank: 0 }), "{e}");
            // Any sender: rank 1 is still there and sends one message when told, then closes.
            let mut p = ch.begin_packing(1).unwrap();
            p.pack_safer(&[1], RecvMode::Express).unwrap();
            p.end_packing().unwrap();
            let mut u = ch.begin_unpacking().unwrap();
            assert_eq!(u.source(), 1);
            let mut b = [0u8; 1];
            u.unpack_express(&mut b, SendMode::Safer).unwrap();
            u.end_unpacking().unwrap();
            let e = ch.begin_unpacking().expect_err("every sender closed");
            assert!(matches!(e, MadError::AllPeersClosed), "{e}");
            assert!(t.elapsed() < Duration::from_secs(30), "waited for the timeout: {:?}", t.elapsed());
            // Sending to a peer known to have closed fails too.
            let mut p = ch.begin_packing(0).unwrap();
            p.pack_safer(&[1], RecvMode::Express).unwrap();
            let e = p.end_packing().expect_err("rank 0 closed");
            assert!(matches!(e, MadError::PeerClosed { rank: 0 }), "{e}");
        } else {
            // Once rank 2 read what rank 0 sent and saw it close: one message, then a close.
            let mut u = ch.begin_unpacking_from(2).unwrap();
            let mut b = [0u8; 1];
            u.unpack_express(&mut b, SendMode::Safer).unwrap();
            u.end_unpacking().unwrap();
            let mut p = ch.begin_packing(2).unwrap();
            p.pack_safer(&[9], RecvMode::Express).unwrap();
            p.end_packing().unwrap();
        }
    });
}

#[test]
fn a_zero_copy_pack_read_by_a_receiver_that_closes_at_once_completes() {
    // The receiver reads the pack, answers Fin and drops its channel (Bye) right away: the
    // sender, waiting for the Fin, may find both at once and must end its message all the same.
    for _ in 0..10 {
        group_with(2, 1, false, Duration::from_secs(20), |rank, ch| {
            if rank == 0 {
                let data = pattern(3, 64);
                let mut p = ch.begin_packing(1).unwrap();
                p.pack(&data, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
                p.end_packing().unwrap();
            } else {
                let mut b = vec![0u8; 64];
                let mut u = ch.begin_unpacking_from(0).unwrap();
                u.unpack(&mut b, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
                u.end_unpacking().unwrap();
                assert_eq!(b, pattern(3, 64));
            }
        });
    }
}

/// CPU time this thread has used.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid out-pointer for clock_gettime.
    assert_eq!(unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) }, 0);
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

#[test]
fn a_long_wait_sleeps_on_the_completion_queues() {
    long_wait();
}

/// A message's first pack, packed `Cheaper` and large enough to go from the application's
/// buffer straight into the pipe's frame when it is alone, arrives intact alone (gathered on
/// the polled strategy, joined on the others), followed by packs of every kind, after a
/// `flush`, or as the only pack of messages that fill a pipe message exactly.
#[test]
fn first_packs_sent_from_the_buffer_arrive_alone_or_followed() {
    for strategy in [None, Some(FlowStrategy::CREDIT), Some(FlowStrategy::WINDOW)] {
        let run = || {
            group(2, usize::MAX, |rank, ch| {
                // The largest pack that goes whole into a pipe message of 8160 bytes.
                let max = 8160 - 2 * madeleine::wire::HEADER;
                // Around the smallest that goes from the buffer (`GATHER_MIN`, 256), and larger.
                let firsts = [255usize, 256, 257, 1024, 4096, max - 1, max];
                // How each message goes on after its first pack.
                #[derive(Clone, Copy, Debug)]
                enum Then {
                    Alone,
                    Small,
                    Safer,
                    Bulk,
                    Flushed,
                }
                let thens = [Then::Alone, Then::Small, Then::Safer, Then::Bulk, Then::Flushed];
                let mut i = 0;
                for &first in &firsts {
                    for &then in &thens {
                        i += 1;
                        let a = pattern(i, first);
                        let b = pattern(
                            i + 1000,
                            match then {
                                Then::Alone => 0,
                                Then::Small | Then::Safer | Then::Flushed => 300,
                                Then::Bulk => 70_000,
                            },
                        );
                        if rank == 0 {
                            let mut p = ch.begin_packing(1).unwrap();
                            p.pack(&a, SendMode::Cheaper, RecvMode::Express).unwrap();
                            match then {
                                Then::Alone => {}
                                Then::Small | Then::Bulk => p.pack(&b, SendMode::Cheaper, RecvMode::Cheaper).unwrap(),
                                Then::Safer => p.pack_safer(&b, RecvMode::Express).unwrap(),
                                Then::Flushed => {
                                    p.flush().unwrap();
                                    p.pack(&b, SendMode::Cheaper, RecvMode::Express).unwrap();
                                }
                            }
                            p.end_packing().unwrap();
                        } else {
                            let (mut got_a, mut got_b) = (vec![0u8; a.len()], vec![0u8; b.len()]);
                            let mut u = ch.begin_unpacking().unwrap();
                            u.unpack(&mut got_a, SendMode::Cheaper, RecvMode::Express).unwrap();
                            if !b.is_empty() {
                                let recv = if matches!(then, Then::Small | Then::Bulk) {
                                    RecvMode::Cheaper
                                } else {
                                    RecvMode::Express
                                };
                                let send =
                                    if matches!(then, Then::Safer) { SendMode::Safer } else { SendMode::Cheaper };
                                u.unpack(&mut got_b, send, recv).unwrap();
                            }
                            u.end_unpacking().unwrap();
                            assert!(got_a == a && got_b == b, "{first} bytes then {then:?}: corrupted");
                        }
                    }
                }
            })
        };
        match strategy {
            Some(s) => with_flow(s, run),
            None => run(),
        }
    }
}

/// The other tests run on the default strategy (polled); every other one carries every size
/// and protocol too, and wakes a receiver asleep on its completion queues.
#[test]
fn every_flow_strategy_carries_every_size_and_wakes_sleeping_receivers() {
    for strategy in [FlowStrategy::WINDOW, FlowStrategy::RDMA, FlowStrategy::CREDIT] {
        with_flow(strategy, || {
            for threshold in [SMALL, usize::MAX] {
                every_size_with(threshold);
            }
            long_wait();
        });
    }
}

/// With no spin phase every wait sleeps on the completion queues (or naps) at once: each
/// protocol still completes, one rank waiting for another's reply at every step, and a long
/// wait costs next to no CPU.
#[test]
fn a_session_that_never_spins_carries_every_protocol_and_sleeps_at_once() {
    SPIN.set(Some(Spin::For(Duration::ZERO)));
    for threshold in [SMALL, usize::MAX] {
        every_size_with(threshold);
    }
    // A ping-pong across the inline, bulk and zero-copy paths, waiting sends included.
    group(2, SMALL, |rank, ch| {
        let peer = 1 - rank;
        for (i, len) in [8usize, 3000, 70_000, 8, 300_000].into_iter().cycle().take(60).enumerate() {
            let out = pattern(i, len);
            if (i + rank) % 2 == 0 {
                let mut p = ch.begin_packing(peer).unwrap();
                p.pack(&out, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
                p.end_packing().unwrap();
            } else {
                let mut got = vec![0u8; len];
                let mut u = ch.begin_unpacking_from(peer).unwrap();
                u.unpack(&mut got, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
                u.end_unpacking().unwrap();
                assert_eq!(got, out, "message {i} of {len} bytes");
            }
        }
    });
    // A long wait sleeps as it would after a spin phase.
    long_wait();
    SPIN.set(None);
}

fn long_wait() {
    const QUIET: Duration = Duration::from_millis(400);
    group(3, usize::MAX, |rank, ch| {
        if rank == 0 {
            // Any source, then one source: both sleep once the spin phase is over.
            let (t, cpu) = (std::time::Instant::now(), thread_cpu());
            let mut u = ch.begin_unpacking().unwrap();
            let mut b = [0u8; 4];
            u.unpack_express(&mut b, SendMode::Safer).unwrap();
            let from = u.source();
            u.end_unpacking().unwrap();
            let other = 3 - from;
            let mut u = ch.begin_unpacking_from(other).unwrap();
            u.unpack_express(&mut b, SendMode::Safer).unwrap();
            u.end_unpacking().unwrap();
            let (waited, used) = (t.elapsed(), thread_cpu() - cpu);
            assert!(waited >= QUIET);
            // Spinning would use all of it, napping in 20 us steps a good part. (A tenth, not
            // less: on a loaded host each wake-up costs more, 41 ms of 814 was seen.)
            assert!(used < waited / 10, "waiting {waited:?} used {used:?} of CPU");
        } else {
            std::thread::sleep(QUIET * rank as u32);
            let mut p = ch.begin_packing(0).unwrap();
            p.pack_safer(&(rank as u32).to_le_bytes(), RecvMode::Express).unwrap();
            p.end_packing().unwrap();
        }
    });
}

/// `begin_packing`, past the mismatch reports of earlier messages it returns first (each
/// once); the reports, for the caller to check.
fn begin_past_reports(ch: &Channel, dest: usize) -> (Packer<'_>, Vec<String>) {
    let mut reports = Vec::new();
    loop {
        match ch.begin_packing(dest) {
            Ok(p) => return (p, reports),
            Err(MadError::Mismatch { rank, why }) if rank == dest && reports.len() < 16 => reports.push(why),
            Err(e) => panic!("begin_packing: {e}"),
        }
    }
}

#[test]
fn mode_and_size_mismatches_are_reported() {
    // Messages of one pack, all whole: a small one and one of 1000 bytes (copied out at
    // begin_unpacking), one of 4000 (left in the pipe for its unpack to copy out); the checks
    // must hold on each path.
    group(2, SMALL, |rank, ch| {
        // Every report rank 0 is told of: a report comes with the sender's next message, which
        // may be one of this loop's when flow control made it wait for the receiver.
        let mut told = Vec::new();
        for len in [10, 1000, 4000] {
            if rank == 0 {
                for _ in 0..5 {
                    let (mut p, reports) = begin_past_reports(ch, 1);
                    for why in reports {
                        assert!(why.contains("unpacked message"), "{why}");
                        told.push(why);
                    }
                    p.pack_safer(&vec![1u8; len], RecvMode::Express).unwrap();
                    p.end_packing().unwrap();
                }
                continue;
            }
            let mut b = vec![0u8; len + 1];
            let mut u = ch.begin_unpacking().unwrap();
            assert!(matches!(u.unpack_express(&mut b, SendMode::Safer), Err(MadError::Mismatch { .. })));
            drop(u);
            let mut b = vec![0u8; len];
            let mut u = ch.begin_unpacking().unwrap();
            assert!(matches!(u.unpack_express(&mut b, SendMode::Cheaper), Err(MadError::Mismatch { .. })));
            drop(u);
            // Too few unpacks: reported at end_unpacking.
            let u = ch.begin_unpacking().unwrap();
            assert!(matches!(u.end_unpacking(), Err(MadError::Mismatch { .. })));
            // Too many: reported at the unpack and at end_unpacking; the connection goes on.
            let mut u = ch.begin_unpacking().unwrap();
            u.unpack_express(&mut b, SendMode::Safer).unwrap();
            assert!(matches!(u.unpack_express(&mut b, SendMode::Safer), Err(MadError::Mismatch { .. })));
            assert!(matches!(u.end_unpacking(), Err(MadError::Mismatch { .. })));
            let mut u = ch.begin_unpacking().unwrap();
            u.unpack_express(&mut b, SendMode::Safer).unwrap();
            u.end_unpacking().unwrap();
            assert_eq!(b, vec![1u8; len]);
        }
        // Once the receiver is done, the sender's next message is told of the latest mismatch
        // (message 13, one unpack too many) unless an earlier one was, then goes.
        if rank == 1 {
            let mut p = ch.begin_packing(0).unwrap();
            p.pack_safer(&[1], RecvMode::Express).unwrap();
            p.end_packing().unwrap();
            assert_eq!(recv_sized(ch), b"after");
        } else {
            let mut u = ch.begin_unpacking_from(1).unwrap();
            u.unpack_express(&mut [0u8; 1], SendMode::Safer).unwrap();
            u.end_unpacking().unwrap();
            let (mut p, reports) = begin_past_reports(ch, 1);
            told.extend(reports);
            let last = told.iter().filter(|w| w.contains("message 13") && w.contains("asked for more")).count();
            assert_eq!(last, 1, "the last mismatch is told once: {told:?}");
            // `send_sized`, on the packer that came past the reports.
            let body = b"after";
            let len = (body.len() as u64).to_le_bytes();
            p.pack(&len, SendMode::Cheaper, RecvMode::Express).unwrap();
            p.pack(body, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
            p.end_packing().unwrap();
        }
    });
}

/// A message of one pack large enough to stay in the pipe until its unpack, begun, and then
/// drained out of the pipe by its receiver's own sends (a sender waiting for the peer takes
/// what arrived out of the pipe, so that the peer's window opens) before it is unpacked: it
/// and the message behind it arrive intact, in order.
#[test]
fn a_message_begun_then_drained_by_a_send_arrives_intact() {
    group(2, SMALL, |rank, ch| {
        let (a, b) = (pattern(1, 4000), pattern(2, 3000));
        let big = pattern(3, 100_000);
        if rank == 1 {
            for m in [&a, &b] {
                let mut p = ch.begin_packing(0).unwrap();
                p.pack(m, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
                p.end_packing().unwrap();
            }
            // Late, so that rank 0's send below waits for us, draining our pipe meanwhile.
            std::thread::sleep(Duration::from_millis(100));
            let mut got = vec![0u8; big.len()];
            let mut u = ch.begin_unpacking_from(0).unwrap();
            u.unpack(&mut got, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
            u.end_unpacking().unwrap();
            assert!(got == big);
            return;
        }
        let mut got_a = vec![0u8; a.len()];
        let mut u = ch.begin_unpacking_from(1).unwrap();
        // A zero-copy message to the sender, whose end waits until the sender read it.
        let mut p = ch.begin_packing(1).unwrap();
        p.pack(&big, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
        p.end_packing().unwrap();
        u.unpack(&mut got_a, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
        u.end_unpacking().unwrap();
        assert!(got_a == a);
        let mut got_b = vec![0u8; b.len()];
        let mut u = ch.begin_unpacking_from(1).unwrap();
        u.unpack(&mut got_b, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
        u.end_unpacking().unwrap();
        assert!(got_b == b);
    });
}

#[test]
fn many_threads_send_and_receive_at_once_with_checksums() {
    group(2, SMALL, |rank, ch| {
        let threads = 4;
        let per = 40;
        std::thread::scope(|s| {
            for t in 0..threads {
                s.spawn(move || {
                    if rank == 0 {
                        for k in 0..per {
                            let len = (t * 977 + k * 4099) % 20_000;
                            let body = pattern(t * 1000 + k, len);
                            let sum: u64 = body.iter().map(|&b| b as u64).sum();
                            let hdr = [(len as u64).to_le_bytes(), sum.to_le_bytes()].concat();
                            let mut p = ch.begin_packing(1).unwrap();
                            p.pack(&hdr, SendMode::Cheaper, RecvMode::Express).unwrap();
                            p.pack(&body, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
                            p.end_packing().unwrap();
                        }
                    } else {
                        for _ in 0..per {
                            let mut body = Vec::new();
                            let mut u = ch.begin_unpacking().unwrap();
                            let mut hdr = [0u8; 16];
                            u.unpack_express(&mut hdr, SendMode::Cheaper).unwrap();
                            let len = u64::from_le_bytes(hdr[..8].try_into().unwrap()) as usize;
                            let sum = u64::from_le_bytes(hdr[8..].try_into().unwrap());
                            body.resize(len, 0);
                            u.unpack(&mut body, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
                            u.end_unpacking().unwrap();
                            assert_eq!(body.iter().map(|&b| b as u64).sum::<u64>(), sum);
                        }
                    }
                });
            }
        });
    });
}

#[test]
fn coroutines_send_and_receive_without_blocking_the_scheduler() {
    // The application sizes coroutine stacks (the library never configures `may`): the verbs
    // path needs more than may's 32 KiB default, especially unoptimized.
    may::config().set_stack_size(0x10000);
    group(2, SMALL, |rank, ch| {
        let n = 8;
        let done = AtomicUsize::new(0);
        may::coroutine::scope(|s| {
            for c in 0..n {
                let done = &done;
                may::go!(s, move || {
                    if rank == 0 {
                        send_sized(ch, &pattern(c, 5000 + c));
                    } else {
                        let body = recv_sized(ch);
                        let n = body.len();
                        assert_eq!(body, pattern(n - 5000, n));
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                });
            }
        });
        assert_eq!(done.load(Ordering::Relaxed), n);
    });
}

#[test]
fn a_peer_dying_mid_message_is_an_error_not_a_hang() {
    // A short timeout: the dead sender's connection must produce an error, not a hang.
    group_with(2, SMALL, false, Duration::from_secs(3), |rank, ch| {
        if rank == 0 {
            // Begin a message, send part of it, then vanish (the connection breaks).
            let mut p = ch.begin_packing(1).unwrap();
            p.pack_safer(&[7u8; 10], RecvMode::Express).unwrap();
            std::mem::forget(p); // never ends the message
        } else {
            let mut u = match ch.begin_unpacking() {
                Ok(u) => u,
                Err(_) => return,
            };
            let mut b = [0u8; 10];
            let r = u.unpack_express(&mut b, SendMode::Safer);
            // The first pack may or may not have arrived; the second never comes.
            let mut c = [0u8; 10];
            let r2 = r.and_then(|_| u.unpack_express(&mut c, SendMode::Safer));
            assert!(r2.is_err());
            std::mem::forget(u);
        }
    });
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 6, .. proptest::prelude::ProptestConfig::default() })]
    /// Random pack sequences (sizes around every boundary, all mode combinations) arrive intact.
    #[test]
    fn random_pack_sequences_arrive_intact(
        packs in proptest::collection::vec((0usize..40_000, 0u8..3, proptest::prelude::any::<bool>()), 0..40),
    ) {
        let packs = &packs;
        group(2, SMALL, move |rank, ch| {
            let mode = |s: u8| [SendMode::Safer, SendMode::Later, SendMode::Cheaper][s as usize];
            let recv = |e: bool| if e { RecvMode::Express } else { RecvMode::Cheaper };
            if rank == 0 {
                let bufs: Vec<Vec<u8>> = packs.iter().enumerate().map(|(i, &(n, _, _))| pattern(i, n)).collect();
                let mut p = ch.begin_packing(1).unwrap();
                for (b, &(_, s, e)) in bufs.iter().zip(packs) {
                    p.pack(b, mode(s), recv(e)).unwrap();
                }
                p.end_packing().unwrap();
            } else {
                let mut bufs: Vec<Vec<u8>> = packs.iter().map(|&(n, _, _)| vec![0u8; n]).collect();
                let mut u = ch.begin_unpacking().unwrap();
                for (b, &(_, s, e)) in bufs.iter_mut().zip(packs) {
                    u.unpack(b, mode(s), recv(e)).unwrap();
                }
                u.end_unpacking().unwrap();
                for (i, b) in bufs.iter().enumerate() {
                    assert_eq!(b, &pattern(i, packs[i].0), "pack {i}");
                }
            }
        });
    }
}

/// Messages of bulk packs travel as bulk chunks that carry their own records (the Bulk
/// announcement before the data, the End after it): with a 4 KiB bulk ring (1 KiB chunks),
/// sizes that put the End in the last data chunk, exactly fill it (the End then goes in a
/// chunk of its own) or spill over, and packs before, between and after bulk packs, in
/// messages back to back, all arrive intact and in order.
#[test]
fn bulk_chunks_carry_their_records_at_every_framing_boundary() {
    // Begin + Bulk records lead the first chunk: 1024 - 32 data bytes fit beside them.
    let first = 1024 - 32;
    let sizes: Vec<usize> =
        [first, first + 1024, first + 2 * 1024].iter().flat_map(|&n| [n - 17, n - 16, n - 1, n, n + 1]).collect(); // the smallest go inline, the rest by the bulk lane
    let shapes = 4;
    group_cfg(
        2,
        true,
        |cfg| {
            cfg.bulk_ring_bytes = 4096;
            cfg.rendezvous_threshold = Some(usize::MAX);
            cfg.timeout = Duration::from_secs(20);
            cfg.wait_limit = Some(Duration::from_secs(20));
        },
        |rank, ch| {
            for (i, &n) in sizes.iter().enumerate() {
                for shape in 0..shapes {
                    let (a, b) = (pattern(i * 10 + shape, n), pattern(i * 10 + shape + 5, n + 3));
                    if rank == 0 {
                        let mut p = ch.begin_packing(1).unwrap();
                        match shape {
                            0 => p.pack(&a, SendMode::Cheaper, RecvMode::Cheaper).unwrap(),
                            1 => {
                                p.pack_safer(b"head", RecvMode::Express).unwrap();
                                p.pack(&a, SendMode::Cheaper, RecvMode::Express).unwrap();
                            }
                            2 => {
                                p.pack(&a, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
                                p.pack(&b, SendMode::Later, RecvMode::Cheaper).unwrap();
                            }
                            _ => {
                                p.pack(&a, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
                                p.flush().unwrap();
                                p.pack_safer(b"tail", RecvMode::Express).unwrap();
                            }
                        }
                        p.end_packing().unwrap();
                    } else {
                        let (mut ga, mut gb, mut small) = (vec![0u8; n], vec![0u8; n + 3], [0u8; 4]);
                        let mut u = ch.begin_unpacking_from(0).unwrap();
                        match shape {
                            0 => u.unpack(&mut ga, SendMode::Cheaper, RecvMode::Cheaper).unwrap(),
                            1 => {
                                u.unpack_express(&mut small, SendMode::Safer).unwrap();
                                assert_eq!(&small, b"head");
                                u.unpack(&mut ga, SendMode::Cheaper, RecvMode::Express).unwrap();
                            }
                            2 => {
                                u.unpack(&mut ga, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
                                u.unpack(&mut gb, SendMode::Later, RecvMode::Cheaper).unwrap();
                            }
                            _ => {
                                u.unpack(&mut ga, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
                                u.unpack_express(&mut small, SendMode::Safer).unwrap();
                                assert_eq!(&small, b"tail");
                            }
                        }
                        u.end_unpacking().unwrap();
                        assert!(ga == a, "{n} bytes, shape {shape}");
                        if shape == 2 {
                            assert!(gb == b, "{} bytes, shape {shape}", n + 3);
                        }
                    }
                }
            }
        },
    );
}

#[test]
fn pending_sends_keep_zero_copy_messages_in_flight_and_complete() {
    // Rank 0 ends its messages without waiting for the reads (up to 4 pending), mixes in
    // messages ended the usual way, polls some pending sends, waits for others and drops the
    // rest; rank 1 checks every message.
    const N: usize = 40;
    let len_of = |i: usize| [100, 3 * SMALL, 70_000, 300_000][i % 4] + i;
    group(2, SMALL, |rank, ch| {
        if rank == 0 {
            let bufs: Vec<Vec<u8>> = (0..N).map(|i| pattern(i, len_of(i))).collect();
            // Every buffer a pending send names outlives it (the borrow checker insists).
            let heads: Vec<[u8; 8]> = (0..N).map(|i| (i as u64).to_le_bytes()).collect();
            let mut pending = std::collections::VecDeque::new();
            for (i, (buf, head)) in bufs.iter().zip(&heads).enumerate() {
                let mut p = ch.begin_packing(1).unwrap();
                p.pack(head, SendMode::Cheaper, RecvMode::Express).unwrap();
                p.pack(buf, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
                if i % 5 == 4 {
                    // The usual ending, with other messages' reads still pending.
                    p.end_packing().unwrap();
                    continue;
                }
                let mut sent = p.end_packing_nowait().unwrap();
                if buf.len() < SMALL {
                    // Nothing went zero-copy: complete at once.
                    assert!(sent.is_complete().unwrap());
                }
                pending.push_back(sent);
                if pending.len() > 4 {
                    let mut oldest = pending.pop_front().unwrap();
                    match i % 3 {
                        0 => oldest.wait().unwrap(),
                        1 => {
                            poll_until(20, || oldest.is_complete().unwrap().then_some(()));
                            assert!(oldest.is_complete().unwrap());
                        }
                        _ => drop(oldest), // waits
                    }
                }
            }
            for p in pending {
                p.wait().unwrap();
            }
        } else {
            for i in 0..N {
                let mut head = [0u8; 8];
                let mut body = vec![0u8; len_of(i)];
                let mut u = ch.begin_unpacking_from(0).unwrap();
                u.unpack_express(&mut head, SendMode::Cheaper).unwrap();
                assert_eq!(u64::from_le_bytes(head), i as u64);
                u.unpack(&mut body, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
                u.end_unpacking().unwrap();
                assert!(body == pattern(i, len_of(i)), "message {i}");
            }
        }
    });
}

#[test]
fn a_pending_send_whose_receiver_closes_unread_is_an_error_not_a_hang() {
    group_with(2, SMALL, false, Duration::from_secs(5), |rank, ch| {
        if rank == 0 {
            let data = pattern(9, 100_000);
            let started = std::time::Instant::now();
            // The close may come before the message is handed over (ending it fails) or after
            // (waiting for it fails).
            let sent = ch.begin_packing(1).and_then(|mut p| {
                p.pack(&data, SendMode::Cheaper, RecvMode::Cheaper)?;
                p.end_packing_nowait()?.wait()
            });
            assert!(sent.is_err(), "the receiver closed without reading");
            assert!(started.elapsed() < Duration::from_secs(4), "noticed the close, not the timeout");
        }
        // Rank 1 closes its end without receiving anything.
    });
}

#[test]
fn a_pending_send_completes_once_read_and_leaves_the_connection_free_meanwhile() {
    // The receiver reads nothing until the sender says so (ranks are threads here): the
    // pending send must not complete before, and the next message must go meanwhile.
    let go = std::sync::atomic::AtomicBool::new(false);
    group(2, SMALL, |rank, ch| {
        let (a, b) = (pattern(1, 100_000), pattern(2, 64));
        if rank == 0 {
            let mut p = ch.begin_packing(1).unwrap();
            p.pack(&a, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
            let mut pending = p.end_packing_nowait().unwrap();
            assert!(!pending.is_complete().unwrap(), "complete before the receiver read it");
            let mut p = ch.begin_packing(1).unwrap();
            p.pack(&b, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
            p.end_packing().unwrap();
            assert!(!pending.is_complete().unwrap());
            go.store(true, Ordering::Release);
            pending.wait().unwrap();
        } else {
            poll_until(20, || go.load(Ordering::Acquire).then_some(()));
            for want in [&a, &b] {
                let mut got = vec![0u8; want.len()];
                let mut u = ch.begin_unpacking_from(0).unwrap();
                u.unpack(&mut got, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
                u.end_unpacking().unwrap();
                assert!(&got == want);
            }
        }
    });
}

/// Two jobs that share a rendezvous directory by mistake never connect: a rank's handshake
/// carries its job, and a rank of another job is turned away; a rank whose socket a live rank
/// of another job already holds fails at once, and never unlinks it.
#[test]
fn ranks_of_two_jobs_never_connect() {
    let dir = std::env::temp_dir().join(format!("mad-jobs-{}", std::process::id()));
    let cfg = |rank, job: &str| {
        let mut c = SessionConfig::new(rank, 2, &dir);
        c.job = job.into();
        c.timeout = Duration::from_millis(800);
        c.wait_limit = Some(Duration::from_secs(10));
        c
    };
    let a0 = Session::new(cfg(0, "job-a")).unwrap();
    // Rank 0 of another job: its socket is a live listener's.
    let e = Session::new(cfg(0, "job-b")).map(|_| ()).unwrap_err();
    assert!(e.to_string().contains("in use"), "{e}");
    let b1 = Session::new(cfg(1, "job-b")).unwrap();
    std::thread::scope(|s| {
        let h = s.spawn(|| b1.channel().map(|_| ()));
        assert!(a0.channel().is_err(), "rank 0 of job a connected to job b");
        assert!(h.join().unwrap().is_err(), "rank 1 of job b connected to job a");
    });
    // Job a's socket is still there for its own ranks.
    assert!(dir.join("rank-0.sock").exists());
    drop(a0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// SEND_LATER: a buffer packed with `pack_later` may be written until `end_packing`, and the
/// receiver gets what it held then, on every path (inline at 1 B and 4 KiB, the bulk lane at
/// 64 KiB, zero-copy at 4 MiB with a threshold below it, the bulk lane there above it).
#[test]
fn send_later_buffers_changed_before_end_packing_arrive_changed() {
    for threshold in [1 << 20, usize::MAX] {
        group(2, threshold, |rank, ch| {
            for len in [1usize, 4096, 64 * 1024, 4 << 20] {
                if rank == 0 {
                    let mut header = [0u8; 8];
                    let mut body = vec![0u8; len];
                    let mut p = ch.begin_packing(1).unwrap();
                    let h = p.pack_later(&mut header, RecvMode::Express).unwrap();
                    let b = p.pack_later(&mut body, RecvMode::Cheaper).unwrap();
                    p.pack_safer(b"tail", RecvMode::Express).unwrap();
                    // Written after they were packed: what end_packing finds is what goes.
                    p.later_mut(h).unwrap().copy_from_slice(&(len as u64).to_le_bytes());
                    p.later_mut(b).unwrap().copy_from_slice(&pattern(len, len));
                    p.end_packing().unwrap();
                } else {
                    let mut body = vec![0u8; len];
                    let mut u = ch.begin_unpacking().unwrap();
                    let mut header = [0u8; 8];
                    u.unpack_express(&mut header, SendMode::Later).unwrap();
                    assert_eq!(u64::from_le_bytes(header), len as u64, "threshold {threshold}, {len} B");
                    u.unpack(&mut body, SendMode::Later, RecvMode::Cheaper).unwrap();
                    let mut tail = [0u8; 4];
                    u.unpack_express(&mut tail, SendMode::Safer).unwrap();
                    u.end_unpacking().unwrap();
                    assert!(
                        body == pattern(len, len),
                        "threshold {threshold}, {len} B: the body as packed, not as ended"
                    );
                    assert_eq!(&tail, b"tail");
                }
            }
        });
    }
}
