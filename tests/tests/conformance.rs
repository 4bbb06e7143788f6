//! Verbs conformance, in one process: every opcode and every semantic the upper layers rely on,
//! run against each available provider.

use std::time::Duration;

use portability_verbs::*;
use tests::*;

fn each(f: impl Fn(&Context)) {
    for ctx in contexts() {
        f(&ctx);
    }
}

#[test]
fn send_recv_delivers_data_length_immediate_and_qp_numbers() {
    each(|ctx| {
        let p = pair(ctx, 8192);
        let data = pattern(1, 100);
        p.mr_a.write(0, &data);
        p.b.post_recv(&[RecvWr::new(7, &[p.mr_b.sge(0, 4096)])]).unwrap();
        p.b.post_recv(&[RecvWr::new(8, &[p.mr_b.sge(4096, 4096)])]).unwrap();
        p.a.post_send(&[SendWr::send(1, &[p.mr_a.sge(0, 100)])]).unwrap();
        p.a.post_send(&[SendWr::send_with_imm(2, &[p.mr_a.sge(0, 10)], 0xdead_beef)]).unwrap();
        let s = wait_n(&p.cq_a, 2);
        assert_eq!((s[0].wr_id, s[0].status, s[0].opcode), (1, WcStatus::Success, WcOpcode::Send));
        assert_eq!((s[1].wr_id, s[1].status), (2, WcStatus::Success));
        let r = wait_n(&p.cq_b, 2);
        assert_eq!(
            (r[0].wr_id, r[0].status, r[0].opcode, r[0].byte_len, r[0].imm),
            (7, WcStatus::Success, WcOpcode::Recv, 100, None)
        );
        assert_eq!((r[1].wr_id, r[1].byte_len, r[1].imm), (8, 10, Some(0xdead_beef)));
        assert_eq!(r[0].qp_num, p.b.qpn());
        assert_eq!(r[0].src_qp, p.a.qpn());
        let mut got = vec![0u8; 100];
        p.mr_b.read(0, &mut got);
        assert_eq!(got, data);
    });
}

#[test]
fn gather_and_scatter_lists_and_every_size_across_the_copy_threshold() {
    each(|ctx| {
        let p = pair(ctx, 1 << 20);
        for (i, len) in [0usize, 1, 63, 64, 65, 4095, 8192, 8193, 65536, 300_000].into_iter().enumerate() {
            let data = pattern(i as u64, len);
            p.mr_a.write(0, &data);
            // Receive into three pieces; send from two.
            let third = len / 3;
            p.b.post_recv(&[RecvWr::new(
                i as u64,
                &[p.mr_b.sge(0, third), p.mr_b.sge(400_000, third), p.mr_b.sge(800_000, 200_000)],
            )])
            .unwrap();
            let half = len / 2;
            p.a.post_send(&[SendWr::send(i as u64, &[p.mr_a.sge(0, half), p.mr_a.sge(half, len - half)])]).unwrap();
            let r = wait_one(&p.cq_b);
            assert_eq!((r.status, r.byte_len as usize), (WcStatus::Success, len), "size {len}");
            assert_eq!(wait_one(&p.cq_a).status, WcStatus::Success);
            let mut got = vec![0u8; len];
            p.mr_b.read(0, &mut got[..third]);
            p.mr_b.read(400_000, &mut got[third..2 * third]);
            p.mr_b.read(800_000, &mut got[2 * third..]);
            assert_eq!(got, data, "size {len}");
        }
    });
}

#[test]
fn inline_send_copies_at_post_time() {
    each(|ctx| {
        let p = pair(ctx, 4096);
        let mut buf = *b"before!!";
        p.b.post_recv(&[RecvWr::new(1, &[p.mr_b.sge(0, 64)])]).unwrap();
        // Inline data need not be registered: lkey 0.
        let sge = Sge { addr: buf.as_ptr() as u64, length: 8, lkey: 0 };
        p.a.post_send(&[SendWr::send(1, &[sge]).inline(true)]).unwrap();
        buf.copy_from_slice(b"after!!!");
        assert_eq!(wait_one(&p.cq_b).byte_len, 8);
        let mut got = [0u8; 8];
        p.mr_b.read(0, &mut got);
        assert_eq!(&got, b"before!!");
        assert_eq!(buf, *b"after!!!");
        let too_big = Sge { addr: buf.as_ptr() as u64, length: 100_000, lkey: 0 };
        assert!(matches!(
            p.a.post_send(&[SendWr::send(2, &[too_big]).inline(true)]),
            Err(VerbsError::InvalidArgument(_))
        ));
    });
}

#[test]
fn rdma_write_read_and_write_with_immediate() {
    each(|ctx| {
        let p = pair(ctx, 1 << 20);
        for (i, len) in [1usize, 8, 100, 8192, 9000, 65536, 1 << 20].into_iter().enumerate() {
            let data = pattern(10 + i as u64, len);
            p.mr_a.write(0, &data);
            p.a.post_send(&[SendWr::write(1, &[p.mr_a.sge(0, len)], p.mr_b.addr(), p.mr_b.rkey())]).unwrap();
            let wc = wait_one(&p.cq_a);
            assert_eq!((wc.status, wc.opcode, wc.byte_len as usize), (WcStatus::Success, WcOpcode::RdmaWrite, len));
            let mut got = vec![0u8; len];
            p.mr_b.read(0, &mut got);
            assert_eq!(got, data, "write {len}");

            // Read it back into another part of A.
            let back = (1 << 20) - len;
            let dst = if back >= len { back } else { 0 };
            p.mr_a.write(dst, &vec![0u8; len]);
            p.a.post_send(&[SendWr::read(2, &[p.mr_a.sge(dst, len)], p.mr_b.addr(), p.mr_b.rkey())]).unwrap();
            let wc = wait_one(&p.cq_a);
            assert_eq!((wc.status, wc.opcode), (WcStatus::Success, WcOpcode::RdmaRead));
            let mut got = vec![0u8; len];
            p.mr_a.read(dst, &mut got);
            assert_eq!(got, data, "read {len}");

            // Write with immediate consumes a receive and reports the length and immediate.
            let data = pattern(20 + i as u64, len);
            p.mr_a.write(0, &data);
            p.b.post_recv(&[RecvWr::new(33, &[])]).unwrap();
            p.a.post_send(&[SendWr::write_with_imm(3, &[p.mr_a.sge(0, len)], p.mr_b.addr(), p.mr_b.rkey(), i as u32)])
                .unwrap();
            let r = wait_one(&p.cq_b);
            assert_eq!(
                (r.wr_id, r.status, r.opcode, r.byte_len as usize, r.imm),
                (33, WcStatus::Success, WcOpcode::RecvRdmaWithImm, len, Some(i as u32))
            );
            // The data is in place when the receive completes.
            let mut got = vec![0u8; len];
            p.mr_b.read(0, &mut got);
            assert_eq!(got, data, "write-with-imm {len}");
            assert_eq!(wait_one(&p.cq_a).status, WcStatus::Success);
        }
    });
}

#[test]
fn atomics_compare_swap_and_fetch_add() {
    each(|ctx| {
        let p = pair(ctx, 4096);
        p.mr_b.write(64, &5u64.to_ne_bytes());
        let target = p.mr_b.addr() + 64;
        p.a.post_send(&[SendWr::fetch_and_add(1, p.mr_a.sge(0, 8), target, p.mr_b.rkey(), 10)]).unwrap();
        let wc = wait_one(&p.cq_a);
        assert_eq!((wc.status, wc.opcode, wc.byte_len), (WcStatus::Success, WcOpcode::FetchAdd, 8));
        assert_eq!(p.mr_a.read_u64(0), 5);
        assert_eq!(p.mr_b.read_u64(64), 15);
        // Compare fails: no swap, old value returned.
        p.a.post_send(&[SendWr::compare_and_swap(2, p.mr_a.sge(8, 8), target, p.mr_b.rkey(), 99, 1)]).unwrap();
        assert_eq!(wait_one(&p.cq_a).opcode, WcOpcode::CompSwap);
        assert_eq!((p.mr_a.read_u64(8), p.mr_b.read_u64(64)), (15, 15));
        // Compare succeeds.
        p.a.post_send(&[SendWr::compare_and_swap(3, p.mr_a.sge(16, 8), target, p.mr_b.rkey(), 15, 42)]).unwrap();
        assert_eq!(wait_one(&p.cq_a).status, WcStatus::Success);
        assert_eq!((p.mr_a.read_u64(16), p.mr_b.read_u64(64)), (15, 42));
    });
}

/// `post_send_completing`: a request answered `Completed` has had its whole effect when the
/// post returns and reports no completion, signaled or not; one answered `Pending` completes
/// as after `post_send`. A request behind one still in flight keeps its place, and a failure
/// is never swallowed: `Pending`, then its error completion, and the queue pair fails. The
/// software provider completes one-sided requests at post when nothing is queued ahead of
/// them (over shared memory); the hardware provider and the TCP transport never do.
#[test]
fn requests_completed_at_post_say_so_and_report_nothing_else() {
    each(|ctx| {
        let soft = ctx.provider() == Provider::Software && !over_tcp(ctx);
        let p = pair(ctx, 1 << 17);
        let outcome = |posted: Posted, wr_id: u64, opcode: WcOpcode| {
            if posted == Posted::Pending {
                let wc = wait_one(&p.cq_a);
                assert_eq!((wc.wr_id, wc.status, wc.opcode), (wr_id, WcStatus::Success, opcode));
            }
            assert_eq!(posted == Posted::Completed, soft, "request {wr_id}");
        };
        // An unsignaled request that is pending reports nothing: a signaled zero-byte read
        // behind it completes once it has (completions come in order).
        let fence = |posted: Posted, wr_id: u64| {
            if posted == Posted::Pending {
                p.a.post_send(&[SendWr::read(wr_id, &[], 0, 0)]).unwrap();
                assert_eq!(wait_one(&p.cq_a).wr_id, wr_id);
            }
            assert_eq!(posted == Posted::Completed, soft, "request {wr_id}");
        };
        for (i, len) in [1usize, 8, 4096, 65536].into_iter().enumerate() {
            let data = pattern(40 + i as u64, len);
            p.mr_b.write(0, &data);
            let read = SendWr::read(i as u64, &[p.mr_a.sge(0, len)], p.mr_b.addr(), p.mr_b.rkey());
            outcome(p.a.post_send_completing(&read).unwrap(), i as u64, WcOpcode::RdmaRead);
            let mut got = vec![0u8; len];
            p.mr_a.read(0, &mut got);
            assert_eq!(got, data, "read {len}");

            let data = pattern(50 + i as u64, len);
            p.mr_a.write(0, &data);
            let write = SendWr::write(10 + i as u64, &[p.mr_a.sge(0, len)], p.mr_b.addr() + 65536, p.mr_b.rkey());
            fence(p.a.post_send_completing(&write.signaled(false)).unwrap(), 10 + i as u64);
            let mut got = vec![0u8; len];
            p.mr_b.read(65536, &mut got);
            assert_eq!(got, data, "write {len}");
        }
        p.mr_b.write(64, &5u64.to_ne_bytes());
        let add = SendWr::fetch_and_add(20, p.mr_a.sge(8, 8), p.mr_b.addr() + 64, p.mr_b.rkey(), 10);
        outcome(p.a.post_send_completing(&add).unwrap(), 20, WcOpcode::FetchAdd);
        assert_eq!((p.mr_a.read_u64(8), p.mr_b.read_u64(64)), (5, 15));
        assert_quiet(&p.cq_a, Duration::from_millis(20));

        // Behind a send still waiting for its receive, a read waits its turn.
        p.mr_b.write(0, b"after the send");
        p.a.post_send(&[SendWr::send(30, &[p.mr_a.sge(0, 8)])]).unwrap();
        let read = SendWr::read(31, &[p.mr_a.sge(4096, 14)], p.mr_b.addr(), p.mr_b.rkey());
        assert_eq!(p.a.post_send_completing(&read).unwrap(), Posted::Pending);
        p.b.post_recv(&[RecvWr::new(32, &[p.mr_b.sge(8192, 64)])]).unwrap();
        let wcs = wait_n(&p.cq_a, 2);
        assert_eq!((wcs[0].wr_id, wcs[1].wr_id), (30, 31), "in posting order");
        assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
        let mut got = [0u8; 14];
        p.mr_a.read(4096, &mut got);
        assert_eq!(&got, b"after the send");
        assert_eq!(wait_one(&p.cq_b).wr_id, 32);

        // A failure is reported by its completion, and fails the queue pair.
        let bad = SendWr::read(40, &[p.mr_a.sge(0, 8)], p.mr_b.addr(), p.mr_b.rkey() ^ 0x5500);
        assert_eq!(p.a.post_send_completing(&bad.signaled(false)).unwrap(), Posted::Pending);
        let wc = wait_one(&p.cq_a);
        assert_eq!((wc.wr_id, wc.status), (40, WcStatus::RemAccessErr));
        assert_eq!(p.a.state(), QpState::Error);
        let read = SendWr::read(41, &[p.mr_a.sge(0, 8)], p.mr_b.addr(), p.mr_b.rkey());
        assert_eq!(p.a.post_send_completing(&read).unwrap(), Posted::Pending);
        assert_eq!(wait_one(&p.cq_a).status, WcStatus::WrFlushErr, "nothing runs after the failure");
    });
}

/// Adds 1 to the first word of `target` `times` times, by fetch-and-add from a queue pair of its
/// own, waiting for each.
fn add_one_remotely(ctx: &Context, pd: &ProtectionDomain, target: &MemoryRegion, times: u64) {
    let cq = ctx.create_cq(64).unwrap();
    let tcq = ctx.create_cq(64).unwrap();
    let a = pd.create_qp(&QpInit::new(&cq)).unwrap();
    let b = pd.create_qp(&QpInit::new(&tcq)).unwrap();
    a.connect_to(b.endpoint()).unwrap();
    b.connect_to(a.endpoint()).unwrap();
    let res = pd.register(vec![0u8; 8].into_boxed_slice(), AccessFlags::ALL).unwrap();
    for i in 0..times {
        a.post_send(&[SendWr::fetch_and_add(i, res.sge(0, 8), target.addr(), target.rkey(), 1)]).unwrap();
        assert_eq!(wait_one(&cq).status, WcStatus::Success);
    }
}

#[test]
fn atomics_are_atomic_with_respect_to_each_other() {
    each(|ctx| {
        let pd = ctx.alloc_pd().unwrap();
        let target = pd.register(vec![0u8; 64].into_boxed_slice(), AccessFlags::ALL).unwrap();
        let threads = 4;
        let per_thread = 500u64;
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    add_one_remotely(ctx, &pd, &target, per_thread);
                });
            }
        });
        assert_eq!(target.read_u64(0), threads * per_thread);
    });
}

#[test]
fn local_atomics_exclude_the_atomics_peers_run_on_the_same_word() {
    each(|ctx| {
        let pd = ctx.alloc_pd().unwrap();
        let target = pd.register(vec![0u8; 64].into_boxed_slice(), AccessFlags::ALL).unwrap();
        match target.local_atomic(8, |v| v) {
            Err(VerbsError::Unsupported(_)) => return, // hardware without IBV_ATOMIC_GLOB
            r => assert_eq!(r.unwrap(), 0),
        }
        assert!(matches!(target.local_atomic(4, |v| v), Err(VerbsError::InvalidArgument(_))), "misaligned");
        assert!(matches!(target.local_atomic(64, |v| v), Err(VerbsError::InvalidArgument(_))), "outside");
        let (remote_threads, per_thread) = (2u64, 2000u64);
        let remote_done = std::sync::atomic::AtomicU64::new(0);
        let mut local = 0u64;
        std::thread::scope(|s| {
            for _ in 0..remote_threads {
                s.spawn(|| {
                    add_one_remotely(ctx, &pd, &target, per_thread);
                    remote_done.fetch_add(1, std::sync::atomic::Ordering::Release);
                });
            }
            // The owner increments the same word with its own CPU for as long as peers do.
            while remote_done.load(std::sync::atomic::Ordering::Acquire) < remote_threads || local < per_thread {
                target.local_atomic(0, |v| v + 1).unwrap();
                local += 1;
            }
        });
        assert_eq!(target.read_u64(0), remote_threads * per_thread + local, "an increment was lost");
    });
}

#[test]
fn remote_access_violations_complete_with_remote_access_error_and_move_the_qp_to_error() {
    each(|ctx| {
        // (what, rkey, offset, len, region rights)
        let cases: [(&str, bool, usize, usize, AccessFlags); 4] = [
            ("bad rkey", false, 0, 8, AccessFlags::ALL),
            ("out of bounds", true, 4090, 16, AccessFlags::ALL),
            ("no remote write right", true, 0, 8, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ),
            ("negative wrap", true, 0, 8, AccessFlags::ALL),
        ];
        for (what, good_key, off, len, rights) in cases {
            let p = pair(ctx, 4096);
            let target = p.pd.register(vec![0u8; 4096].into_boxed_slice(), rights).unwrap();
            let rkey = if good_key { target.rkey() } else { target.rkey() ^ 0x5500 };
            let addr =
                if what == "negative wrap" { target.addr().wrapping_sub(4096) } else { target.addr() + off as u64 };
            p.b.post_recv(&[RecvWr::new(50, &[p.mr_b.sge(0, 64)])]).unwrap();
            p.a.post_send(&[SendWr::write(1, &[p.mr_a.sge(0, len)], addr, rkey), SendWr::send(2, &[p.mr_a.sge(0, 8)])])
                .unwrap();
            let wcs = wait_n(&p.cq_a, 2);
            assert_eq!((wcs[0].wr_id, wcs[0].status), (1, WcStatus::RemAccessErr), "{what}");
            assert_eq!((wcs[1].wr_id, wcs[1].status), (2, WcStatus::WrFlushErr), "{what}");
            assert_eq!(p.a.state(), QpState::Error, "{what}");
            assert_eq!(target.read_u64(0), 0, "{what}: nothing written");
        }
        // Reads need the remote read right; a region of another protection domain is refused.
        let p = pair(ctx, 4096);
        let other_pd = ctx.alloc_pd().unwrap();
        let foreign = other_pd.register(vec![0u8; 64].into_boxed_slice(), AccessFlags::ALL).unwrap();
        p.a.post_send(&[SendWr::read(1, &[p.mr_a.sge(0, 8)], foreign.addr(), foreign.rkey())]).unwrap();
        assert_eq!(wait_one(&p.cq_a).status, WcStatus::RemAccessErr);
    });
}

/// Unsignaled inline RDMA writes (the polled message path's request, which the software
/// provider carries out at post when nothing is ahead of it): the bytes are taken at post, a
/// later signaled request's completion covers them, and a failing one is still reported (an
/// error completion is never suppressed) and fails the queue pair.
#[test]
fn unsignaled_inline_writes_take_their_bytes_at_post_and_still_report_failures() {
    each(|ctx| {
        let p = pair(ctx, 4096);
        for i in 0..40u64 {
            let mut src = pattern(i, 48);
            let sge = Sge { addr: src.as_ptr() as u64, length: 48, lkey: 0 };
            let at = p.mr_b.addr() + 64 * (i % 16);
            p.a.post_send(&[SendWr::write(i, &[sge], at, p.mr_b.rkey()).inline(true).signaled(false)]).unwrap();
            src.fill(0xEE); // the caller's bytes may be reused once the post returns
            p.a.post_send(&[SendWr::write(100 + i, &[], 0, 0)]).unwrap(); // a signaled fence
            assert_eq!(wait_one(&p.cq_a).wr_id, 100 + i, "only the signaled request reports");
            let mut got = vec![0u8; 48];
            p.mr_b.read(64 * (i % 16) as usize, &mut got);
            assert_eq!(got, pattern(i, 48), "write {i}");
        }
        let src = [7u8; 16];
        let sge = Sge { addr: src.as_ptr() as u64, length: 16, lkey: 0 };
        let bad = SendWr::write(7, &[sge], p.mr_b.addr(), p.mr_b.rkey() ^ 0x5500).inline(true).signaled(false);
        p.a.post_send(&[bad]).unwrap();
        let wc = wait_one(&p.cq_a);
        assert_eq!((wc.wr_id, wc.status), (7, WcStatus::RemAccessErr));
        assert_eq!(p.a.state(), QpState::Error);
        p.a.post_send(&[SendWr::write(8, &[sge], p.mr_b.addr(), p.mr_b.rkey()).inline(true)]).unwrap();
        assert_eq!(wait_one(&p.cq_a).status, WcStatus::WrFlushErr, "nothing runs after the failure");
    });
}

/// An inline write of a list of buffers (`post_write_inline_list`, the polled frames' request)
/// is `post_send` of the same write: the parts land end to end and may be reused at once, a
/// signaled one completes like any write, an unsignaled one reports only a failure (which
/// fails the queue pair), one behind a waiting request keeps its place, and the inline limit
/// is checked at post.
#[test]
fn inline_list_writes_land_their_parts_end_to_end_and_report_as_writes() {
    each(|ctx| {
        let p = pair(ctx, 4096);
        let shapes: [&[usize]; 6] = [&[8], &[8, 8, 24, 0, 8], &[0, 5, 3], &[1, 2, 3, 4, 5, 6, 7], &[100, 3], &[0]];
        for (i, shape) in shapes.iter().enumerate() {
            let total: usize = shape.iter().sum();
            let want = pattern(i as u64, total);
            let mut bufs: Vec<Vec<u8>> = Vec::new();
            let mut at = 0;
            for &n in *shape {
                bufs.push(want[at..at + n].to_vec());
                at += n;
            }
            let parts: Vec<&[u8]> = bufs.iter().map(|b| b.as_slice()).collect();
            let (addr, signaled) = (p.mr_b.addr() + 256 * i as u64, i % 2 == 0);
            p.a.post_write_inline_list(i as u64, &parts, addr, p.mr_b.rkey(), signaled).unwrap();
            drop(parts);
            bufs.iter_mut().for_each(|b| b.fill(0xEE)); // reusable once the post returns
            if signaled {
                let wc = wait_one(&p.cq_a);
                assert_eq!(
                    (wc.wr_id, wc.status, wc.opcode, wc.byte_len),
                    (i as u64, WcStatus::Success, WcOpcode::RdmaWrite, total as u32)
                );
            } else {
                p.a.post_send(&[SendWr::write(100 + i as u64, &[], 0, 0)]).unwrap(); // a signaled fence
                assert_eq!(wait_one(&p.cq_a).wr_id, 100 + i as u64, "only the signaled request reports");
            }
            let mut got = vec![0u8; total];
            p.mr_b.read(256 * i, &mut got);
            assert_eq!(got, want, "shape {shape:?}");
        }
        // Over the inline limit: refused at post, nothing done.
        let big = vec![1u8; p.a.caps().max_inline_data as usize];
        let err = p.a.post_write_inline_list(9, &[&big, &[1]], p.mr_b.addr(), p.mr_b.rkey(), true).unwrap_err();
        assert!(matches!(err, VerbsError::InvalidArgument(_)), "{err:?}");
        assert_quiet(&p.cq_a, Duration::from_millis(10));
        // Behind a send waiting for its receive: completes after it, in order.
        p.mr_a.write(0, b"late");
        completes_behind_a_waiting_send(&p, || {
            p.a.post_write_inline_list(21, &[b"behind", b" a send"], p.mr_b.addr() + 2048, p.mr_b.rkey(), true)
                .unwrap();
            p.a.post_write_inline_list(22, &[b"unsignaled"], p.mr_b.addr() + 2100, p.mr_b.rkey(), false).unwrap();
        });
        p.a.post_send(&[SendWr::write(23, &[], 0, 0)]).unwrap(); // a signaled fence
        assert_eq!(wait_one(&p.cq_a).wr_id, 23);
        let mut got = vec![0u8; 13];
        p.mr_b.read(2048, &mut got);
        assert_eq!(&got, b"behind a send");
        let mut got = vec![0u8; 10];
        p.mr_b.read(2100, &mut got);
        assert_eq!(&got, b"unsignaled");
        // A bad key: reported though unsignaled, and the queue pair fails.
        p.a.post_write_inline_list(30, &[&[7u8; 16]], p.mr_b.addr(), p.mr_b.rkey() ^ 0x5500, false).unwrap();
        let wc = wait_one(&p.cq_a);
        assert_eq!((wc.wr_id, wc.status), (30, WcStatus::RemAccessErr));
        assert_eq!(p.a.state(), QpState::Error);
        p.a.post_write_inline_list(31, &[&[7u8; 16]], p.mr_b.addr(), p.mr_b.rkey(), false).unwrap();
        assert_eq!(wait_one(&p.cq_a).status, WcStatus::WrFlushErr, "nothing runs after the failure");
    });
}

/// A write asking to complete at injection (`SendFlags::inject_complete`) lands whole and in
/// order with what follows it, its buffer reusable once it completed, and keeps its place in
/// the completion order behind a request that waits for its answer.
#[test]
fn writes_completed_at_injection_land_in_order() {
    each(|ctx| {
        let p = pair(ctx, 1 << 16);
        for round in 0..8u64 {
            let want = pattern(round, 8192);
            p.mr_a.write(0, &want);
            let wr = SendWr::write(round, &[p.mr_a.sge(0, 8192)], p.mr_b.addr() + 8192, p.mr_b.rkey());
            p.a.post_send(&[wr.inject_complete(true)]).unwrap();
            assert_eq!(wait_one(&p.cq_a).wr_id, round);
            p.mr_a.write(0, &[0xEE; 8192]); // reusable once completed
                                            // A send behind it finds the write's data in place.
            p.b.post_recv(&[RecvWr::new(round, &[p.mr_b.sge(0, 8)])]).unwrap();
            p.a.post_send(&[SendWr::send(100 + round, &[p.mr_a.sge(0, 8)])]).unwrap();
            assert_eq!(wait_one(&p.cq_b).wr_id, round);
            assert_eq!(wait_one(&p.cq_a).wr_id, 100 + round);
            let mut got = vec![0u8; 8192];
            p.mr_b.read(8192, &mut got);
            assert_eq!(got, want, "round {round}");
        }
        // Behind a send waiting for its receive: completes after it.
        completes_behind_a_waiting_send(&p, || {
            let wr = SendWr::write(21, &[p.mr_a.sge(0, 64)], p.mr_b.addr() + 4096, p.mr_b.rkey());
            p.a.post_send(&[wr.inject_complete(true)]).unwrap();
        });
    });
}

/// Posts a send (id 20) its receiver has no receive for, then what `behind` posts (a signaled
/// request with id 21 first): nothing completes until the receive is posted, then 20 and 21, in
/// that order.
fn completes_behind_a_waiting_send(p: &Pair, behind: impl FnOnce()) {
    p.a.post_send(&[SendWr::send(20, &[p.mr_a.sge(0, 4)])]).unwrap();
    behind();
    assert_quiet(&p.cq_a, Duration::from_millis(30));
    p.b.post_recv(&[RecvWr::new(2, &[p.mr_b.sge(0, 64)])]).unwrap();
    let wcs = wait_n(&p.cq_a, 2);
    assert_eq!(
        wcs.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        [(20, WcStatus::Success), (21, WcStatus::Success)]
    );
}

/// A zero-byte read or write names no memory, so the responder validates neither key nor
/// address (IBA C9-88): the usual keep-alive, or a fence whose completion covers earlier
/// unsignaled requests. The QP's own remote-access rights still apply.
#[test]
fn zero_byte_reads_and_writes_ignore_the_key_and_address() {
    each(|ctx| {
        let p = pair(ctx, 4096);
        let (bogus_addr, bogus_key) = (0xdead_0000u64, p.mr_b.rkey() ^ 0x7700);
        p.b.post_recv(&[RecvWr::new(40, &[])]).unwrap();
        p.a.post_send(&[
            SendWr::write(1, &[], bogus_addr, bogus_key),
            SendWr::read(2, &[], bogus_addr, bogus_key),
            SendWr::write_with_imm(3, &[], bogus_addr, bogus_key, 77),
        ])
        .unwrap();
        let wcs = wait_n(&p.cq_a, 3);
        let got: Vec<_> = wcs.iter().map(|w| (w.wr_id, w.status, w.byte_len)).collect();
        assert_eq!(got, [(1, WcStatus::Success, 0), (2, WcStatus::Success, 0), (3, WcStatus::Success, 0)]);
        let r = wait_one(&p.cq_b);
        assert_eq!(
            (r.wr_id, r.status, r.opcode, r.byte_len, r.imm),
            (40, WcStatus::Success, WcOpcode::RecvRdmaWithImm, 0, Some(77))
        );
        assert_eq!(p.a.state(), QpState::ReadyToSend);
    });
}

/// A responder queue pair in error answers nothing, whatever the request: one-sided requests
/// run out of retries as sends do, even where the memory is still registered.
#[test]
fn one_sided_requests_to_a_queue_pair_in_error_fail_with_retries_exceeded() {
    each(|ctx| {
        for (i, zero_byte) in [false, true].into_iter().enumerate() {
            let p = pair(ctx, 4096);
            p.b.modify(QpTransition::Error).unwrap();
            let sge: &[Sge] = if zero_byte { &[] } else { &[p.mr_a.sge(0, 8)] };
            p.mr_a.write(0, &[9u8; 8]);
            p.a.post_send(&[SendWr::write(i as u64, sge, p.mr_b.addr(), p.mr_b.rkey())]).unwrap();
            let wc = wait_one(&p.cq_a);
            assert_eq!((wc.wr_id, wc.status), (i as u64, WcStatus::RetryExcErr), "zero-byte: {zero_byte}");
            assert_eq!(p.mr_b.read_u64(0), 0, "nothing written");
            assert_eq!(p.a.state(), QpState::Error);
        }
    });
}

/// What the peer sent before one of our requests failed had arrived already: it completes
/// as received, not flushed, and the peer's send succeeds.
#[test]
fn a_failing_request_still_lets_what_arrived_before_it_complete() {
    each(|ctx| {
        let p = pair(ctx, 4096);
        p.b.post_recv(&[RecvWr::new(70, &[p.mr_b.sge(0, 64)])]).unwrap();
        p.mr_a.write(0, b"arrived first");
        p.a.post_send(&[SendWr::send(1, &[p.mr_a.sge(0, 13)])]).unwrap();
        p.b.post_send(&[SendWr::write(2, &[p.mr_b.sge(64, 8)], p.mr_a.addr(), p.mr_a.rkey() ^ 0x5500)]).unwrap();
        // (Completions of different work queues sharing a queue come in no set order.)
        let mut got: Vec<_> = wait_n(&p.cq_b, 2).iter().map(|w| (w.wr_id, w.status)).collect();
        got.sort_by_key(|&(id, _)| id);
        assert_eq!(got, [(2, WcStatus::RemAccessErr), (70, WcStatus::Success)]);
        let mut b = [0u8; 13];
        p.mr_b.read(0, &mut b);
        assert_eq!(&b, b"arrived first");
        assert_eq!(wait_one(&p.cq_a).status, WcStatus::Success);
    });
}

#[test]
fn bad_lkey_is_a_local_protection_error() {
    each(|ctx| {
        let p = pair(ctx, 4096);
        let bad = Sge { lkey: p.mr_a.lkey() ^ 0x100, ..p.mr_a.sge(0, 8) };
        p.a.post_send(&[SendWr::send(1, &[bad])]).unwrap();
        let wc = wait_one(&p.cq_a);
        assert_eq!(wc.status, WcStatus::LocProtErr);
        assert_eq!(p.a.state(), QpState::Error);
        // Outside the region.
        let p = pair(ctx, 4096);
        let outside = Sge { addr: p.mr_a.addr() + 4000, length: 200, lkey: p.mr_a.lkey() };
        p.a.post_send(&[SendWr::write(1, &[outside], p.mr_b.addr(), p.mr_b.rkey())]).unwrap();
        assert_eq!(wait_one(&p.cq_a).status, WcStatus::LocProtErr);
        // A read into a region without local write.
        let p = pair(ctx, 4096);
        let ro = p.pd.register(vec![0u8; 64].into_boxed_slice(), AccessFlags::REMOTE_READ).unwrap();
        p.a.post_send(&[SendWr::read(1, &[ro.sge(0, 8)], p.mr_b.addr(), p.mr_b.rkey())]).unwrap();
        assert_eq!(wait_one(&p.cq_a).status, WcStatus::LocProtErr);
    });
}

#[test]
fn receive_too_small_is_a_local_length_error() {
    each(|ctx| {
        let p = pair(ctx, 1 << 16);
        for len in [100usize, 20_000] {
            let p2 = pair(&p.ctx, 1 << 16);
            p2.b.post_recv(&[RecvWr::new(1, &[p2.mr_b.sge(0, 50)])]).unwrap();
            p2.a.post_send(&[SendWr::send(9, &[p2.mr_a.sge(0, len)])]).unwrap();
            let r = wait_one(&p2.cq_b);
            assert_eq!((r.wr_id, r.status), (1, WcStatus::LocLenErr), "len {len}");
            let s = wait_one(&p2.cq_a);
            assert_eq!((s.wr_id, s.status), (9, WcStatus::RemInvReqErr), "len {len}");
            assert_eq!(p2.b.state(), QpState::Error);
        }
        drop(p);
    });
}

#[test]
fn send_without_receive_retries_then_fails_with_rnr_retry_exceeded() {
    each(|ctx| {
        let rts = RtsAttr { rnr_retry: 2, ..RtsAttr::default() };
        let p = pair_with(ctx, 4096, rts, 1); // 10 us timer
        p.a.post_send(&[SendWr::send(1, &[p.mr_a.sge(0, 8)]), SendWr::send(2, &[p.mr_a.sge(0, 8)])]).unwrap();
        let wcs = wait_n(&p.cq_a, 2);
        assert_eq!((wcs[0].wr_id, wcs[0].status), (1, WcStatus::RnrRetryExcErr));
        assert_eq!((wcs[1].wr_id, wcs[1].status), (2, WcStatus::WrFlushErr));
        assert_eq!(p.a.state(), QpState::Error);
        // A receive posted afterwards never sees the cancelled message.
        p.b.post_recv(&[RecvWr::new(5, &[p.mr_b.sge(0, 64)])]).unwrap();
        assert_quiet(&p.cq_b, Duration::from_millis(50));
    });
}

#[test]
fn unsignaled_send_without_receive_still_reports_rnr_retry_exceeded() {
    // Nothing signaled is outstanding, so only the periodic passes of polling can find it.
    each(|ctx| {
        let rts = RtsAttr { rnr_retry: 1, ..RtsAttr::default() };
        let p = pair_with(ctx, 4096, rts, 1);
        p.a.post_send(&[SendWr::send(1, &[p.mr_a.sge(0, 8)]).signaled(false)]).unwrap();
        let wc = wait_one(&p.cq_a);
        assert_eq!((wc.wr_id, wc.status), (1, WcStatus::RnrRetryExcErr));
        assert_eq!(p.a.state(), QpState::Error);
    });
}

#[test]
fn send_waits_for_a_late_receive_while_retries_last() {
    each(|ctx| {
        let p = pair(ctx, 4096); // rnr_retry 7: retry for ever
        p.mr_a.write(0, b"late");
        p.a.post_send(&[SendWr::send(1, &[p.mr_a.sge(0, 4)])]).unwrap();
        assert_quiet(&p.cq_a, Duration::from_millis(30));
        p.b.post_recv(&[RecvWr::new(2, &[p.mr_b.sge(0, 64)])]).unwrap();
        assert_eq!(wait_one(&p.cq_b).byte_len, 4);
        assert_eq!(wait_one(&p.cq_a).status, WcStatus::Success);
    });
}

#[test]
fn error_state_flushes_every_outstanding_request() {
    each(|ctx| {
        let p = pair(ctx, 4096);
        let recvs: Vec<RecvWr> = (0..5).map(|i| RecvWr::new(i, &[p.mr_b.sge(0, 64)])).collect();
        p.b.post_recv(&recvs).unwrap();
        p.b.modify(QpTransition::Error).unwrap();
        let wcs = wait_n(&p.cq_b, 5);
        for (i, wc) in wcs.iter().enumerate() {
            assert_eq!((wc.wr_id, wc.status, wc.opcode), (i as u64, WcStatus::WrFlushErr, WcOpcode::Recv));
        }
        // Posting to a QP in error completes at once with a flush error.
        p.b.post_recv(&[RecvWr::new(9, &[p.mr_b.sge(0, 64)])]).unwrap();
        assert_eq!(wait_one(&p.cq_b).status, WcStatus::WrFlushErr);
        p.b.post_send(&[SendWr::send(10, &[p.mr_b.sge(0, 8)]).signaled(false)]).unwrap();
        assert_eq!((wait_one(&p.cq_b).wr_id, p.b.state()), (10, QpState::Error));
        // The peer notices: its sends fail instead of hanging.
        p.a.post_send(&[SendWr::send(11, &[p.mr_a.sge(0, 8)])]).unwrap();
        let wc = wait_one(&p.cq_a);
        assert_eq!((wc.wr_id, wc.status), (11, WcStatus::RetryExcErr));
    });
}

#[test]
fn completion_queue_overrun_is_reported() {
    each(|ctx| {
        let pd = ctx.alloc_pd().unwrap();
        let small = ctx.create_cq(4).unwrap();
        let other = ctx.create_cq(64).unwrap();
        let a = pd.create_qp(&QpInit::new(&other)).unwrap();
        let b = pd.create_qp(&QpInit::new(&small)).unwrap();
        a.connect_to(b.endpoint()).unwrap();
        b.connect_to(a.endpoint()).unwrap();
        let mr = pd.register(vec![0u8; 4096].into_boxed_slice(), AccessFlags::ALL).unwrap();
        let recvs: Vec<RecvWr> = (0..8).map(|i| RecvWr::new(i, &[mr.sge(0, 64)])).collect();
        b.post_recv(&recvs).unwrap();
        let sends: Vec<SendWr> = (0..8).map(|i| SendWr::send(i, &[mr.sge(64, 8)]).signaled(false)).collect();
        a.post_send(&sends).unwrap();
        let mut wc = [WorkCompletion::EMPTY; 1];
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            match small.poll(&mut wc[..0]) {
                Err(VerbsError::CqOverrun) => break,
                Ok(_) => assert!(std::time::Instant::now() < deadline, "overrun never reported"),
                Err(e) => panic!("{e}"),
            }
            std::thread::yield_now();
        }
        assert_eq!(b.state(), QpState::Error);
    });
}

#[test]
fn misaligned_atomic_is_an_invalid_request() {
    each(|ctx| {
        let p = pair(ctx, 4096);
        p.a.post_send(&[SendWr::fetch_and_add(1, p.mr_a.sge(0, 8), p.mr_b.addr() + 4, p.mr_b.rkey(), 1)]).unwrap();
        assert_eq!(wait_one(&p.cq_a).status, WcStatus::RemInvReqErr);
        let p = pair(ctx, 4096);
        assert!(matches!(
            p.a.post_send(&[SendWr::fetch_and_add(1, p.mr_a.sge(0, 4), p.mr_b.addr(), p.mr_b.rkey(), 1)]),
            Err(VerbsError::InvalidArgument(_))
        ));
    });
}

#[test]
fn qp_access_flags_gate_remote_operations() {
    each(|ctx| {
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(64).unwrap();
        let a = pd.create_qp(&QpInit::new(&cq)).unwrap();
        let b = pd.create_qp(&QpInit::new(&cq)).unwrap();
        a.connect_to(b.endpoint()).unwrap();
        b.modify(QpTransition::Init { access: AccessFlags::REMOTE_READ, port: 1 }).unwrap();
        b.modify(QpTransition::Rtr(RtrAttr::new(a.endpoint()))).unwrap();
        b.modify(QpTransition::Rts(RtsAttr::default())).unwrap();
        let mr = pd.register(vec![0u8; 64].into_boxed_slice(), AccessFlags::ALL).unwrap();
        a.post_send(&[SendWr::write(1, &[mr.sge(0, 8)], mr.addr() + 8, mr.rkey())]).unwrap();
        assert_eq!(wait_one(&cq).status, WcStatus::RemInvReqErr);
    });
}

#[test]
fn state_machine_refuses_illegal_transitions_and_posts() {
    each(|ctx| {
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(64).unwrap();
        let a = pd.create_qp(&QpInit::new(&cq)).unwrap();
        let b = pd.create_qp(&QpInit::new(&cq)).unwrap();
        let mr = pd.register(vec![0u8; 64].into_boxed_slice(), AccessFlags::ALL).unwrap();
        assert_eq!(a.state(), QpState::Reset);
        assert!(matches!(a.post_recv(&[RecvWr::new(1, &[mr.sge(0, 8)])]), Err(VerbsError::InvalidState(_))));
        assert!(matches!(a.modify(QpTransition::Rts(RtsAttr::default())), Err(VerbsError::InvalidState(_))));
        a.modify(QpTransition::Init { access: AccessFlags::ALL, port: 1 }).unwrap();
        a.post_recv(&[RecvWr::new(1, &[mr.sge(0, 8)])]).unwrap();
        assert!(matches!(a.post_send(&[SendWr::send(1, &[mr.sge(0, 8)])]), Err(VerbsError::InvalidState(_))));
        a.modify(QpTransition::Rtr(RtrAttr::new(b.endpoint()))).unwrap();
        assert_eq!(a.state(), QpState::ReadyToReceive);
        assert!(matches!(a.post_send(&[SendWr::send(1, &[mr.sge(0, 8)])]), Err(VerbsError::InvalidState(_))));
        a.modify(QpTransition::Reset).unwrap();
        assert_eq!(a.state(), QpState::Reset);
        assert!(matches!(
            a.modify(QpTransition::Init { access: AccessFlags::ALL, port: 9 }),
            Err(VerbsError::InvalidArgument(_))
        ));
    });
}

#[test]
fn queue_limits_are_enforced() {
    each(|ctx| {
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(64).unwrap();
        let caps = QpCaps { max_send_wr: 2, max_recv_wr: 2, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 16 };
        let a = pd.create_qp(&QpInit { caps, ..QpInit::new(&cq) }).unwrap();
        let b = pd.create_qp(&QpInit::new(&cq)).unwrap();
        a.connect_to(b.endpoint()).unwrap();
        b.connect_to(a.endpoint()).unwrap();
        let mr = pd.register(vec![0u8; 64].into_boxed_slice(), AccessFlags::ALL).unwrap();
        a.post_recv(&[RecvWr::new(1, &[mr.sge(0, 8)]), RecvWr::new(2, &[mr.sge(0, 8)])]).unwrap();
        assert!(matches!(a.post_recv(&[RecvWr::new(3, &[mr.sge(0, 8)])]), Err(VerbsError::Exhausted(_))));
        assert!(matches!(
            a.post_send(&[SendWr::send(1, &[mr.sge(0, 4), mr.sge(4, 4)])]),
            Err(VerbsError::InvalidArgument(_))
        ));
        // Two sends wait for receives (none at b): the third does not fit.
        a.post_send(&[SendWr::send(1, &[mr.sge(0, 4)]), SendWr::send(2, &[mr.sge(0, 4)])]).unwrap();
        assert!(matches!(a.post_send(&[SendWr::send(3, &[mr.sge(0, 4)])]), Err(VerbsError::Exhausted(_))));
    });
}

#[test]
fn sends_complete_in_order_across_ring_wraps_with_unsignaled_requests() {
    each(|ctx| {
        let p = pair(ctx, 1 << 16);
        let total = 3000u64;
        let mut next_send = 0u64;
        let mut received = 0u64;
        let mut posted_recv = 0u64;
        let mut last_signaled_done = None;
        let mut wc = [WorkCompletion::EMPTY; 32];
        let deadline = std::time::Instant::now() + WAIT;
        while received < total {
            assert!(std::time::Instant::now() < deadline, "stalled at {received}");
            while posted_recv < total && posted_recv < received + 200 {
                let slot = (posted_recv % 16) as usize * 4096;
                p.b.post_recv(&[RecvWr::new(posted_recv, &[p.mr_b.sge(slot, 4096)])]).unwrap();
                posted_recv += 1;
            }
            // A send's buffer is the application's until the send completes: 16 slots, reused
            // once a later signaled send completed.
            let done = last_signaled_done.map_or(0, |l| l + 1);
            if next_send < total && next_send < done + 16 {
                let len = 8 + (next_send as usize * 37) % 3000;
                let signaled = next_send % 8 == 7 || next_send == total - 1;
                let slot = (next_send % 16) as usize * 4096;
                p.mr_a.write(slot, &next_send.to_le_bytes());
                match p.a.post_send(&[SendWr::send(next_send, &[p.mr_a.sge(slot, len)])
                    .inline(len <= 200)
                    .signaled(signaled)])
                {
                    Ok(()) => next_send += 1,
                    Err(VerbsError::Exhausted(_)) => {}
                    Err(e) => panic!("{e}"),
                }
            }
            let n = p.cq_a.poll(&mut wc).unwrap();
            for w in &wc[..n] {
                assert_eq!(w.status, WcStatus::Success);
                assert_eq!(w.wr_id % 8, if w.wr_id == total - 1 { w.wr_id % 8 } else { 7 });
                assert!(last_signaled_done.is_none_or(|l| w.wr_id > l), "send completions out of order");
                last_signaled_done = Some(w.wr_id);
            }
            let n = p.cq_b.poll(&mut wc).unwrap();
            for w in &wc[..n] {
                assert_eq!((w.status, w.wr_id), (WcStatus::Success, received), "receives out of order");
                let slot = (w.wr_id % 16) as usize * 4096;
                assert_eq!(p.mr_b.read_u64(slot), received, "payload of message {received}");
                received += 1;
            }
        }
    });
}

#[test]
fn shared_receive_queue_feeds_several_queue_pairs() {
    each(|ctx| {
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(256).unwrap();
        let rcq = ctx.create_cq(256).unwrap();
        let srq = pd.create_srq(64, 1).unwrap();
        let mr = pd.register(vec![0u8; 64 * 64].into_boxed_slice(), AccessFlags::ALL).unwrap();
        srq.post_recv(&(0..6).map(|i| RecvWr::new(i, &[mr.sge(i as usize * 64, 64)])).collect::<Vec<_>>()).unwrap();
        let mut senders = Vec::new();
        let mut receivers = Vec::new();
        for _ in 0..3 {
            let s = pd.create_qp(&QpInit::new(&cq)).unwrap();
            let r = pd.create_qp(&QpInit { srq: Some(&srq), ..QpInit::new(&rcq) }).unwrap();
            s.connect_to(r.endpoint()).unwrap();
            r.connect_to(s.endpoint()).unwrap();
            assert!(matches!(r.post_recv(&[RecvWr::new(0, &[mr.sge(0, 8)])]), Err(VerbsError::InvalidState(_))));
            senders.push(s);
            receivers.push(r);
        }
        let src = pd.register(vec![7u8; 64].into_boxed_slice(), AccessFlags::ALL).unwrap();
        for (i, s) in senders.iter().enumerate() {
            s.post_send(&[SendWr::send(i as u64, &[src.sge(0, 16)]), SendWr::send(10 + i as u64, &[src.sge(0, 16)])])
                .unwrap();
        }
        let wcs = wait_n(&rcq, 6);
        let mut ids: Vec<u64> = wcs.iter().map(|w| w.wr_id).collect();
        ids.sort();
        assert_eq!(ids, vec![0, 1, 2, 3, 4, 5]);
        let mut qps: Vec<u32> = wcs.iter().map(|w| w.qp_num).collect();
        qps.sort();
        qps.dedup();
        assert_eq!(qps.len(), 3);
        wait_n(&cq, 6);
    });
}

#[test]
fn armed_queue_wakes_a_sleeper_on_the_event_descriptor() {
    each(|ctx| {
        let p = pair(ctx, 4096);
        p.b.post_recv(&[RecvWr::new(1, &[p.mr_b.sge(0, 64)])]).unwrap();
        let mut wc = [WorkCompletion::EMPTY; 1];
        assert_eq!(p.cq_b.poll(&mut wc).unwrap(), 0);
        p.cq_b.req_notify().unwrap();
        assert!(!p.cq_b.wait_event(Some(Duration::from_millis(20))).unwrap(), "woke with nothing to do");
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                p.a.post_send(&[SendWr::send(1, &[p.mr_a.sge(0, 8)])]).unwrap();
            });
            assert!(p.cq_b.wait_event(Some(WAIT)).unwrap(), "the send did not wake the sleeper");
        });
        p.cq_b.ack_event();
        assert_eq!(wait_one(&p.cq_b).status, WcStatus::Success);
        // Arming while a completion is pending fires at once (no lost wake-up).
        p.b.post_recv(&[RecvWr::new(2, &[p.mr_b.sge(0, 64)])]).unwrap();
        p.a.post_send(&[SendWr::send(2, &[p.mr_a.sge(0, 8)])]).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        p.cq_b.req_notify().unwrap();
        assert!(p.cq_b.wait_event(Some(Duration::from_secs(1))).unwrap());
    });
}

#[test]
fn writes_land_in_pages_the_target_protected() {
    let ctx = Context::open(Provider::Software).unwrap();
    let p = pair(&ctx, 4096);
    let page = page_size();
    let buf = vec![0u8; 3 * page].into_boxed_slice();
    let base = (buf.as_ptr() as usize).div_ceil(page) * page;
    let mr = p.pd.register(buf, AccessFlags::ALL).unwrap();
    let off = base - mr.addr() as usize;
    p.mr_a.write(0, b"through the protection");
    // SAFETY: a whole page inside a buffer only this test touches, unprotected before it is read.
    let guard = unsafe { protect::protect(base, page, protect::Protection::None) }.unwrap();
    p.a.post_send(&[SendWr::write(1, &[p.mr_a.sge(0, 22)], base as u64, mr.rkey())]).unwrap();
    assert_eq!(wait_one(&p.cq_a).status, WcStatus::Success);
    drop(guard);
    let mut got = [0u8; 22];
    mr.read(off, &mut got);
    assert_eq!(&got, b"through the protection");
}

#[test]
fn provider_allocated_memory_is_a_shared_segment_target() {
    let ctx = Context::open(Provider::Software).unwrap();
    let p = pair(&ctx, 1 << 16);
    let seg = p.pd.alloc(1 << 16, AccessFlags::ALL).unwrap();
    assert!(seg.is_shared_segment());
    let data = pattern(3, 1 << 16);
    p.mr_a.write(0, &data);
    p.a.post_send(&[SendWr::write(1, &[p.mr_a.sge(0, 1 << 16)], seg.addr(), seg.rkey())]).unwrap();
    assert_eq!(wait_one(&p.cq_a).status, WcStatus::Success);
    let mut got = vec![0u8; 1 << 16];
    seg.read(0, &mut got);
    assert_eq!(got, data);
}

/// A reader polling the last 8 bytes of an RDMA write (the RDMA fast path of eager protocols)
/// sees the whole write once they change: the software provider places them last, as a NIC's
/// in-order DMA does. Into provider memory and into this process's heap (both stored directly),
/// with cached stores and with the streaming hint's non-temporal ones (weakly ordered, so the
/// provider must fence them before the last word); each write waits for the reader's check, so
/// a stale word the reader sees is a misplacement.
#[test]
fn a_polled_write_is_whole_once_its_last_word_changed() {
    let ctx = Context::open(Provider::Software).unwrap();
    let p = pair(&ctx, 8192);
    let seg = p.pd.alloc(4096, AccessFlags::ALL).unwrap();
    let heap = p.pd.register(vec![0u8; 4096].into_boxed_slice(), AccessFlags::ALL).unwrap();
    for (target, streaming) in [(&seg, false), (&heap, false), (&seg, true), (&heap, true)] {
        target.write(0, &[0u8; 4096]);
        let checked = std::sync::atomic::AtomicU64::new(0);
        let rounds = 3000u64;
        let size = |n: u64| 16 + (n as usize * 56) % 4080; // 16..4096, multiples of 8
        std::thread::scope(|s| {
            let reader = s.spawn(|| {
                let base = target.as_ptr() as *const std::sync::atomic::AtomicU64;
                let deadline = std::time::Instant::now() + Duration::from_secs(20);
                for n in 1..=rounds {
                    let words = size(n) / 8;
                    // SAFETY: aligned words inside the live region, written concurrently by the
                    // provider only: atomic loads.
                    let word = |i: usize| unsafe { (*base.add(i)).load(std::sync::atomic::Ordering::Acquire) };
                    while word(words - 1) != n {
                        assert!(std::time::Instant::now() < deadline, "write {n} never landed");
                        std::hint::spin_loop();
                    }
                    for i in 0..words {
                        assert_eq!(word(i), n, "word {i} of {words} stale when the last one showed write {n}");
                    }
                    checked.store(n, std::sync::atomic::Ordering::Release);
                }
            });
            let mut buf = vec![0u8; 4096];
            for n in 1..=rounds {
                let len = size(n);
                for w in buf[..len].chunks_mut(8) {
                    w.copy_from_slice(&n.to_ne_bytes());
                }
                p.mr_a.write(0, &buf[..len]);
                let wr = SendWr::write(n, &[p.mr_a.sge(0, len)], target.addr(), target.rkey()).streaming(streaming);
                p.a.post_send(&[wr]).unwrap();
                assert_eq!(wait_one(&p.cq_a).status, WcStatus::Success);
                let deadline = std::time::Instant::now() + Duration::from_secs(20);
                while checked.load(std::sync::atomic::Ordering::Acquire) != n {
                    // A reader that failed has finished: stop at once (its panic is the verdict).
                    if reader.is_finished() {
                        return;
                    }
                    assert!(std::time::Instant::now() < deadline, "the reader stopped at write {n}");
                    std::thread::yield_now();
                }
            }
        });
    }
}

/// The streaming hint changes how the software provider stores, never what lands: writes of
/// every length around the line size and the hint's threshold, at every alignment of source
/// and target within a line, into provider memory and the heap, leave exactly their bytes.
#[test]
fn streaming_writes_place_exactly_their_bytes() {
    each(|ctx| {
        let p = pair(ctx, 1 << 14);
        let seg = p.pd.alloc(1 << 14, AccessFlags::ALL).unwrap();
        let heap = p.pd.register(vec![0u8; 1 << 14].into_boxed_slice(), AccessFlags::ALL).unwrap();
        let src = pattern(9, 1 << 14);
        p.mr_a.write(0, &src);
        let mut n = 0u64;
        for target in [&seg, &heap] {
            for len in [1000, 1024, 1025, 1087, 4096, 4159, 8191] {
                for (from, to) in [(0, 0), (1, 0), (0, 1), (13, 63), (64, 7), (33, 32)] {
                    let fill = vec![0xA5u8; 1 << 14];
                    target.write(0, &fill);
                    n += 1;
                    let wr = SendWr::write(n, &[p.mr_a.sge(from, len)], target.addr() + to as u64, target.rkey());
                    p.a.post_send(&[wr.streaming(true)]).unwrap();
                    assert_eq!(wait_one(&p.cq_a).status, WcStatus::Success);
                    let mut got = vec![0u8; 1 << 14];
                    target.read(0, &mut got);
                    assert_eq!(got[to..to + len], src[from..from + len], "{len} bytes from {from} to {to}");
                    assert!(got[..to].iter().chain(&got[to + len..]).all(|&b| b == 0xA5), "{len} bytes to {to}: spill");
                }
            }
        }
        // A write from a region into an overlapping range of itself (what lands is the
        // provider's business, as on a NIC) lands the same with the hint as without.
        let mut landed = Vec::new();
        for streaming in [false, true] {
            p.mr_a.write(0, &src);
            n += 1;
            let wr = SendWr::write(n, &[p.mr_a.sge(0, 4096)], p.mr_a.addr() + 100, p.mr_a.rkey());
            p.a.post_send(&[wr.streaming(streaming)]).unwrap();
            assert_eq!(wait_one(&p.cq_a).status, WcStatus::Success);
            let mut got = vec![0u8; 1 << 14];
            p.mr_a.read(0, &mut got);
            landed.push(got);
        }
        assert!(landed[0] == landed[1], "an overlapping write lands differently with the hint");
    });
}

#[test]
fn deregistered_keys_are_refused_and_never_match_a_later_registration() {
    each(|ctx| {
        let p = pair(ctx, 4096);
        let old = p.pd.register(vec![0u8; 64].into_boxed_slice(), AccessFlags::ALL).unwrap();
        let (old_addr, old_key) = (old.addr(), old.rkey());
        drop(old);
        let new = p.pd.register(vec![0u8; 64].into_boxed_slice(), AccessFlags::ALL).unwrap();
        assert_ne!(new.rkey(), old_key);
        p.a.post_send(&[SendWr::write(1, &[p.mr_a.sge(0, 8)], old_addr, old_key)]).unwrap();
        assert_eq!(wait_one(&p.cq_a).status, WcStatus::RemAccessErr);
        assert_eq!(new.read_u64(0), 0);
    });
}

/// A request that could not start when posted (the target's ring was full, or a one-sided
/// operation ordered behind a send the target had not taken yet) starts once the target made
/// room, whether or not its owner ever drives its queue pair again: a NIC needs no CPU of its
/// host for that, and an upper layer that posts and then waits on another connection (or
/// computes) must not stall its peer.
#[test]
fn requests_left_waiting_start_without_their_owner_polling() {
    each(|ctx| {
        // One-sided behind a send the target has not taken (no receive posted yet: the
        // owner's own post cannot finish the send by driving a same-process target).
        let p = pair(ctx, 1 << 20);
        p.mr_a.write(0, &[7u8; 64]);
        p.mr_a.write(64, &[9u8; 8]);
        p.a.post_send(&[SendWr::send(1, &[p.mr_a.sge(0, 64)])]).unwrap();
        p.a.post_send(&[SendWr::write(2, &[p.mr_a.sge(64, 8)], p.mr_b.addr() + 4096, p.mr_b.rkey())]).unwrap();
        p.b.post_recv(&[RecvWr::new(1, &[p.mr_b.sge(0, 64)])]).unwrap();
        assert_eq!(wait_one(&p.cq_b).status, WcStatus::Success);
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            let mut got = [0u8; 8];
            p.mr_b.read(4096, &mut got);
            if got == [9u8; 8] {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "the write never landed while its owner was idle");
            std::thread::sleep(Duration::from_micros(100));
        }
        let done = wait_n(&p.cq_a, 2);
        assert!(done.iter().all(|wc| wc.status == WcStatus::Success), "{done:?}");

        // Sends beyond what the target's ring holds at once.
        let p = pair(ctx, 1 << 20);
        let (n, len) = (64usize, 4096usize);
        let data = pattern(5, n * len);
        p.mr_a.write(0, &data);
        for i in 0..n {
            p.a.post_send(&[SendWr::send(i as u64, &[p.mr_a.sge(i * len, len)])]).unwrap();
        }
        for i in 0..n {
            p.b.post_recv(&[RecvWr::new(i as u64, &[p.mr_b.sge(i * len, len)])]).unwrap();
        }
        let got = wait_n(&p.cq_b, n);
        assert!(got.iter().enumerate().all(|(i, wc)| wc.wr_id == i as u64 && wc.status == WcStatus::Success));
        let mut back = vec![0u8; n * len];
        p.mr_b.read(0, &mut back);
        assert_eq!(back, data);
        assert_eq!(wait_n(&p.cq_a, n).len(), n);
    });
}

/// A window onto a peer's provider-allocated memory ([`QueuePair::map_remote_write`]) places
/// exactly the bytes written, end to end from their parts, where an RDMA write to the same
/// address would; the hardware provider and the TCP transport map nothing (a NIC has no such
/// window, nor has a peer on another host), and memory the peer registered from its own heap
/// does not map either.
#[test]
fn a_window_writes_where_an_rdma_write_would() {
    each(|ctx| {
        let p = pair(ctx, 4096);
        let target = p.pd.alloc(8192, AccessFlags::ALL).unwrap();
        let Some(w) = p.a.map_remote_write(target.addr() + 4096, 4096, target.rkey()).unwrap() else {
            assert!(!target.is_shared_segment() || over_tcp(ctx), "a provider segment of a peer on this host maps");
            return;
        };
        assert_eq!(w.len(), 4096);
        let (head, body, tail) = (pattern(1, 3), pattern(2, 100), pattern(3, 13));
        w.write(64, &[&head, &body, &tail]).unwrap();
        let mut got = vec![0u8; 8192];
        target.read(0, &mut got);
        let mut want = vec![0u8; 8192];
        want[4096 + 64..4096 + 64 + 116].copy_from_slice(&[head, body, tail].concat());
        assert_eq!(got, want);
        // A write ending at the window's last byte is in; one byte further is not, and writes
        // nothing.
        w.write(4096 - 8, &[&[7u8; 8]]).unwrap();
        assert_eq!(w.write(4096 - 8, &[&[9u8; 9]]), Err(WcStatus::LocLenErr));
        assert_eq!(w.write(usize::MAX, &[&[9u8; 1]]), Err(WcStatus::LocLenErr));
        assert_eq!(target.read_u64(8192 - 8), u64::from_ne_bytes([7; 8]));
        // The small-write path places and refuses the same, at every length it takes.
        for len in [8, 9, 40, 64, 127, 128] {
            let small = pattern(len as u64, len);
            w.write_small(1024, &small).unwrap();
            let mut got = vec![0u8; len];
            target.read(4096 + 1024, &mut got);
            assert_eq!(got, small, "{len} bytes");
            assert_eq!(w.write_small(4096 - len + 1, &small), Err(WcStatus::LocLenErr), "{len} bytes");
        }
        let heap = p.pd.register(vec![0u8; 64].into_boxed_slice(), AccessFlags::ALL).unwrap();
        assert!(p.a.map_remote_write(heap.addr(), 64, heap.rkey()).unwrap().is_none());
    });
}

/// A window is checked as an RDMA write is when it is made (key, bounds, remote-write right,
/// protection domain, a queue pair ready to send), and at every write afterwards: once the peer
/// deregisters the region the write fails and the peer's later memory is untouched, and once
/// the peer's queue pair is destroyed writes fail too.
#[test]
fn a_window_is_refused_what_a_write_is_and_fails_once_the_region_or_peer_is_gone() {
    let ctx = Context::open(Provider::Software).unwrap();
    let p = pair(&ctx, 4096);
    let target = p.pd.alloc(4096, AccessFlags::ALL).unwrap();
    let (addr, key) = (target.addr(), target.rkey());
    assert!(p.a.map_remote_write(addr, 4096, key ^ 0x100).is_err(), "a wrong key");
    assert!(p.a.map_remote_write(addr + 1, 4096, key).is_err(), "past the region's end");
    let read_only = p.pd.alloc(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ).unwrap();
    assert!(p.a.map_remote_write(read_only.addr(), 64, read_only.rkey()).is_err(), "no remote-write right");
    let other_pd = ctx.alloc_pd().unwrap();
    let foreign = other_pd.alloc(4096, AccessFlags::ALL).unwrap();
    assert!(p.a.map_remote_write(foreign.addr(), 64, foreign.rkey()).is_err(), "another protection domain");
    let unconnected = p.pd.create_qp(&QpInit::new(&p.cq_a)).unwrap();
    assert!(matches!(unconnected.map_remote_write(addr, 64, key), Err(VerbsError::InvalidState(_))));

    let w = p.a.map_remote_write(addr, 4096, key).unwrap().expect("a provider segment maps");
    w.write(0, &[&[1u8; 16]]).unwrap();
    drop(target);
    assert_eq!(w.write(0, &[&[2u8; 16]]), Err(WcStatus::RemAccessErr));
    assert_eq!(w.write_small(0, &[2u8; 16]), Err(WcStatus::RemAccessErr));
    let later = p.pd.alloc(4096, AccessFlags::ALL).unwrap();
    assert_eq!(w.write(0, &[&[3u8; 16]]), Err(WcStatus::RemAccessErr));
    assert_eq!(w.write_small(0, &[3u8; 16]), Err(WcStatus::RemAccessErr));
    assert_eq!(later.read_u64(0), 0);

    let w = p.a.map_remote_write(later.addr(), 4096, later.rkey()).unwrap().unwrap();
    drop(p.b);
    assert_eq!(w.write(0, &[&[4u8; 8]]), Err(WcStatus::RetryExcErr));
    assert_eq!(w.write_small(0, &[4u8; 8]), Err(WcStatus::RetryExcErr));
    assert_eq!(later.read_u64(0), 0);
}
