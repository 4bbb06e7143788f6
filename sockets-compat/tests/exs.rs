//! The Extended Sockets API in one process: every call, both socket types, many operations
//! outstanding, and every error a caller or a peer can cause.

use std::time::Duration;

use sockets_compat::exs::{Event, EventKind, EventQueue, ExsError, ExsSocket, Memory, SocketKind, Tunable};

const LIMIT: Duration = Duration::from_secs(20);

/// Takes `n` events, failing the test if they do not come in time.
fn wait(q: &EventQueue, n: usize) -> Vec<Event> {
    let mut out = Vec::new();
    let deadline = std::time::Instant::now() + LIMIT;
    while out.len() < n {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        assert!(!left.is_zero(), "{} of {n} events came: {out:?}", out.len());
        let want = n - out.len();
        q.dequeue_into(&mut out, want, Some(left));
    }
    out
}

fn one(q: &EventQueue) -> Event {
    wait(q, 1).pop().unwrap()
}

/// A connected pair (server side, client side), set up by `tune` before connecting.
fn pair_with(kind: SocketKind, tune: impl Fn(&ExsSocket)) -> (ExsSocket, ExsSocket) {
    let q = EventQueue::new(8).unwrap();
    let l = ExsSocket::new(kind).unwrap();
    tune(&l);
    l.bind("127.0.0.1:0").unwrap();
    l.listen(4).unwrap();
    l.accept(&q, 1).unwrap();
    let c = ExsSocket::new(kind).unwrap();
    tune(&c);
    c.connect(l.local_addr().unwrap(), &q, 2).unwrap();
    let mut evs = wait(&q, 2);
    evs.sort_by_key(|e| e.req);
    assert_eq!((evs[0].kind, evs[0].outcome), (EventKind::Accept, Ok(0)));
    assert_eq!((evs[1].kind, evs[1].outcome), (EventKind::Connect, Ok(0)));
    assert!(evs[1].socket.same(&c));
    let s = evs[0].accepted.take().unwrap();
    assert_eq!(s.kind(), kind);
    (s, c)
}

fn pair(kind: SocketKind) -> (ExsSocket, ExsSocket) {
    pair_with(kind, |_| {})
}

fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32).map(|i| (i.wrapping_mul(31).wrapping_add(seed) % 251) as u8).collect()
}

#[test]
fn seqpacket_messages_of_every_size_arrive_whole_with_many_outstanding() {
    let (s, c) = pair(SocketKind::SeqPacket);
    let q = EventQueue::new(256).unwrap();
    let sizes = [0usize, 1, 7, 64, 65, 128, 129, 1000, 4096, 65536, 300_000, 1 << 20];
    let rx = Memory::alloc(sizes.len() << 20).unwrap();
    let tx = Memory::alloc(sizes.len() << 20).unwrap();
    // Half the receives posted before the sends, half after.
    let half = sizes.len() / 2;
    for (i, _) in sizes.iter().enumerate().take(half) {
        s.recv(&q, 100 + i as u64, &rx, i << 20, 1 << 20).unwrap();
    }
    for (i, &n) in sizes.iter().enumerate() {
        tx.write(i << 20, &pattern(n, i as u32));
        c.send(&q, i as u64, &tx, i << 20, n).unwrap();
    }
    for (i, _) in sizes.iter().enumerate().skip(half) {
        s.recv(&q, 100 + i as u64, &rx, i << 20, 1 << 20).unwrap();
    }
    let evs = wait(&q, 2 * sizes.len());
    for e in &evs {
        match e.kind {
            EventKind::Send => assert_eq!(e.outcome, Ok(sizes[e.req as usize] as u64)),
            EventKind::Recv => {
                let i = (e.req - 100) as usize;
                assert_eq!(e.outcome, Ok(sizes[i] as u64), "receive {i}");
                assert!(!e.truncated);
                let mut got = vec![0u8; sizes[i]];
                rx.read(i << 20, &mut got);
                assert!(got == pattern(sizes[i], i as u32), "message {i} of {} bytes differs", sizes[i]);
            }
            k => panic!("unexpected {k:?}"),
        }
    }
    // Receives complete in the order they were posted, one message each.
    let order: Vec<u64> = evs.iter().filter(|e| e.kind == EventKind::Recv).map(|e| e.req).collect();
    let mut sorted = order.clone();
    sorted.sort();
    assert_eq!(order, sorted);
}

#[test]
fn a_seqpacket_message_longer_than_the_buffer_is_cut_and_flagged() {
    for posted_first in [true, false] {
        let (s, c) = pair(SocketKind::SeqPacket);
        let q = EventQueue::new(8).unwrap();
        let rx = Memory::alloc(4096).unwrap();
        rx.write(100, &[0xEE; 64]);
        let tx = Memory::alloc(4096).unwrap();
        tx.write(0, &pattern(1000, 3));
        let msg_len = if posted_first { 1000 } else { 50 };
        if posted_first {
            s.recv(&q, 1, &rx, 0, 100).unwrap();
        }
        c.send(&q, 2, &tx, 0, msg_len).unwrap();
        if !posted_first {
            // A small message goes before any receive; this one is cut at 10 bytes.
            assert_eq!(one(&q).kind, EventKind::Send);
            s.recv(&q, 1, &rx, 0, 10).unwrap();
        }
        let evs = wait(&q, if posted_first { 2 } else { 1 });
        let r = evs.iter().find(|e| e.kind == EventKind::Recv).unwrap();
        let cut = if posted_first { 100 } else { 10 };
        assert_eq!((r.outcome, r.truncated), (Ok(cut), true));
        let mut got = vec![0u8; cut as usize];
        rx.read(0, &mut got);
        assert_eq!(got, pattern(1000, 3)[..cut as usize]);
        let mut after = [0u8; 64];
        rx.read(100, &mut after);
        assert_eq!(after, [0xEE; 64], "nothing written past the buffer");
    }
}

/// Sends `total` bytes in pieces of `send_sizes` (cycled) with up to `depth` sends and
/// `depth` receives outstanding (receives of `recv_sizes`, cycled, each into its own slot,
/// never more bytes asked than remain), checks every byte and that receives complete in the
/// order they were posted.
fn stream_transfer(
    s: &ExsSocket,
    c: &ExsSocket,
    total: usize,
    send_sizes: &[usize],
    recv_sizes: &[usize],
    depth: usize,
) {
    let data = pattern(total, 11);
    let tx = Memory::alloc(total.max(1)).unwrap();
    tx.write(0, &data);
    let slot = *recv_sizes.iter().max().unwrap();
    let rx = Memory::alloc(slot * depth).unwrap();
    let qs = EventQueue::new(depth).unwrap();
    let qr = EventQueue::new(depth).unwrap();
    let (mut sent, mut send_out, mut k) = (0usize, 0usize, 0usize);
    let mut got = Vec::with_capacity(total);
    let mut asked = 0usize;
    let mut recvs = std::collections::VecDeque::new();
    let mut next_recv = 0u64;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while got.len() < total {
        assert!(std::time::Instant::now() < deadline, "stream stalled at {} of {total} bytes", got.len());
        while sent < total && send_out < depth {
            let n = send_sizes[k % send_sizes.len()].min(total - sent);
            c.send(&qs, sent as u64, &tx, sent, n).unwrap();
            sent += n;
            send_out += 1;
            k += 1;
        }
        while recvs.len() < depth && got.len() + asked < total {
            let n = recv_sizes[next_recv as usize % recv_sizes.len()].min(total - got.len() - asked);
            let at = (next_recv as usize % depth) * slot;
            s.recv(&qr, next_recv, &rx, at, n).unwrap();
            recvs.push_back((next_recv, n));
            asked += n;
            next_recv += 1;
        }
        for e in qs.dequeue(depth, Some(Duration::ZERO)) {
            assert!(e.outcome.is_ok(), "{e:?}");
            send_out -= 1;
        }
        for e in qr.dequeue(depth, Some(Duration::from_millis(1))) {
            let n = e.outcome.unwrap() as usize;
            let (req, len) = recvs.pop_front().unwrap();
            assert_eq!(e.req, req, "receives complete in order");
            assert!(n > 0 && n <= len, "a receive of {len} got {n}");
            let mut part = vec![0u8; n];
            rx.read((req as usize % depth) * slot, &mut part);
            got.extend_from_slice(&part);
            asked -= len;
        }
    }
    let first_bad = got.iter().zip(&data).position(|(a, b)| a != b);
    assert!(first_bad.is_none(), "stream differs at byte {first_bad:?}");
    while send_out > 0 {
        for e in wait(&qs, 1) {
            assert!(e.outcome.is_ok());
            send_out -= 1;
        }
    }
}

#[test]
fn a_stream_carries_every_byte_in_order_with_and_without_its_buffer() {
    for recv_buffer in [65536i64, 0] {
        let (s, c) = pair_with(SocketKind::Stream, |x| x.set(Tunable::RecvBuffer, recv_buffer).unwrap());
        stream_transfer(&s, &c, 8 << 20, &[100_000, 1, 777, 65536, 3, 512 << 10], &[4096, 1 << 20, 10, 300_000], 8);
        stream_transfer(&s, &c, 1 << 20, &[13, 100, 2000], &[1 << 20], 16);
    }
}

#[test]
fn the_end_of_a_stream_and_closing_are_events() {
    let (s, c) = pair(SocketKind::Stream);
    let q = EventQueue::new(8).unwrap();
    let m = Memory::alloc(64).unwrap();
    m.write(0, b"last words");
    c.send(&q, 1, &m, 0, 10).unwrap();
    c.close(&q, 2).unwrap();
    let mut evs = wait(&q, 2);
    evs.sort_by_key(|e| e.req);
    assert_eq!((evs[0].kind, evs[0].outcome), (EventKind::Send, Ok(10)));
    assert_eq!((evs[1].kind, evs[1].outcome), (EventKind::Close, Ok(0)));
    let rx = Memory::alloc(64).unwrap();
    s.recv(&q, 3, &rx, 0, 64).unwrap();
    assert_eq!(one(&q).outcome, Ok(10));
    s.recv(&q, 4, &rx, 0, 64).unwrap();
    assert_eq!(one(&q).outcome, Ok(0), "the end of the peer's data");
    // A receive still waiting when its socket closes is cancelled.
    s.recv(&q, 5, &rx, 0, 64).unwrap();
    let (s2, _c2) = pair(SocketKind::SeqPacket);
    s2.recv(&q, 6, &rx, 0, 64).unwrap();
    s2.close(&q, 7).unwrap();
    let mut evs = wait(&q, 3);
    evs.sort_by_key(|e| e.req);
    assert_eq!(evs[0].outcome, Ok(0));
    assert_eq!((evs[1].req, evs[1].outcome), (6, Err(libc::ECANCELED)));
    assert_eq!((evs[2].kind, evs[2].outcome), (EventKind::Close, Ok(0)));
    assert_eq!(c.send(&q, 8, &m, 0, 1).unwrap_err().errno(), libc::EBADF);
    assert_eq!(c.close(&q, 9).unwrap_err().errno(), libc::EBADF);
}

#[test]
fn a_socket_and_queue_dropped_with_receives_in_flight_close_when_those_complete() {
    let (s, c) = pair(SocketKind::SeqPacket);
    let (qs, qc) = (EventQueue::new(8).unwrap(), EventQueue::new(8).unwrap());
    let (ms, mc) = (Memory::alloc(64).unwrap(), Memory::alloc(64).unwrap());
    s.recv(&qs, 1, &ms, 0, 8).unwrap();
    s.recv(&qs, 2, &ms, 8, 8).unwrap();
    // The application lets go of both: the receives' events will hold the socket's last
    // handles, in a queue whose last handle the second receive's report lets go of. The
    // socket's close then runs through its connection, which must not be locked by then.
    drop((s, qs));
    mc.write(0, b"12345678");
    c.send(&qc, 3, &mc, 0, 8).unwrap();
    c.send(&qc, 4, &mc, 0, 8).unwrap();
    assert!(wait(&qc, 2).iter().all(|e| e.outcome == Ok(8)));
    c.recv(&qc, 5, &mc, 0, 8).unwrap();
    assert_eq!(one(&qc).outcome, Ok(0), "the dropped socket closed: the end of its data");
}

#[test]
fn caller_errors_are_refused_at_once() {
    let (s, c) = pair(SocketKind::SeqPacket);
    let q = EventQueue::new(2).unwrap();
    let m = Memory::alloc(4096).unwrap();
    // A buffer outside its region.
    assert_eq!(c.send(&q, 1, &m, 4000, 200), Err(ExsError::OutsideRegion));
    assert_eq!(s.recv(&q, 1, &m, usize::MAX - 2, 10), Err(ExsError::OutsideRegion));
    let other = Memory::alloc(4096).unwrap();
    assert_eq!(c.send_at(&q, 1, &m, other.addr(), 10).unwrap_err().errno(), libc::EFAULT);
    // A full event queue: its third operation has no place for its event.
    s.recv(&q, 1, &m, 0, 100).unwrap();
    s.recv(&q, 2, &m, 100, 100).unwrap();
    assert_eq!(s.recv(&q, 3, &m, 200, 100), Err(ExsError::QueueFull));
    assert_eq!(q.status().pending, 2);
    assert!(q.set_capacity(1).is_err());
    // A close that finds the queue full is refused and leaves the socket open.
    assert_eq!(s.close(&q, 4), Err(ExsError::QueueFull));
    // Deregistering memory with I/O in flight.
    let (m, e) = m.deregister().unwrap_err();
    assert_eq!(e.errno(), libc::EBUSY);
    c.send(&EventQueue::new(4).unwrap(), 9, &m, 0, 1).unwrap();
    c.send(&EventQueue::new(4).unwrap(), 9, &m, 0, 1).unwrap();
    let evs = wait(&q, 2);
    assert!(evs.iter().all(|e| e.outcome == Ok(1)));
    // Not connected, wrong type for the tunable, bad tunables, set too late.
    let fresh = ExsSocket::new(SocketKind::SeqPacket).unwrap();
    assert_eq!(fresh.send(&q, 1, &m, 0, 1).unwrap_err().errno(), libc::ENOTCONN);
    assert_eq!(fresh.accept(&q, 1).unwrap_err().errno(), libc::EINVAL);
    assert_eq!(fresh.set(Tunable::RecvBuffer, 4096).unwrap_err().errno(), libc::EOPNOTSUPP);
    assert_eq!(fresh.set(Tunable::InlineMax, 100_000).unwrap_err().errno(), libc::EINVAL);
    assert_eq!(fresh.set(Tunable::AdvCredits, 0).unwrap_err().errno(), libc::EINVAL);
    assert_eq!(c.set(Tunable::SmallMax, 10).unwrap_err().errno(), libc::EISCONN);
    assert!(EventQueue::new(0).is_err());
    assert_eq!(Memory::alloc(0).unwrap_err().errno(), libc::EINVAL);
    // Process tunables: the completion thread's CPU, and back to any.
    fresh.set(Tunable::CompletionCpu, 0).unwrap();
    assert_eq!(fresh.get(Tunable::CompletionCpu), 0);
    fresh.set(Tunable::CompletionCpu, -1).unwrap();
    assert_eq!(fresh.get(Tunable::CompletionCpu), -1);
    assert_eq!(fresh.set(Tunable::CompletionCpu, 1 << 20).unwrap_err().errno(), libc::EINVAL);
    let stream = ExsSocket::new(SocketKind::Stream).unwrap();
    assert_eq!(stream.set(Tunable::RecvBuffer, 5000), Ok(()));
    assert_eq!(stream.get(Tunable::RecvBuffer), 8192);
    m.deregister().unwrap();
}

#[test]
fn connecting_to_nothing_or_to_another_type_fails_as_an_event() {
    let q = EventQueue::new(4).unwrap();
    // A port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let c = ExsSocket::new(SocketKind::Stream).unwrap();
    c.connect(port, &q, 1).unwrap();
    let e = one(&q);
    assert_eq!((e.kind, e.outcome), (EventKind::Connect, Err(libc::ECONNREFUSED)));
    // A SOCK_STREAM client of a SOCK_SEQPACKET listener.
    let l = ExsSocket::new(SocketKind::SeqPacket).unwrap();
    l.bind("127.0.0.1:0").unwrap();
    l.listen(1).unwrap();
    let c = ExsSocket::new(SocketKind::Stream).unwrap();
    c.connect(l.local_addr().unwrap(), &q, 2).unwrap();
    assert_eq!(one(&q).outcome, Err(libc::EPROTOTYPE));
    // Closing the listener cancels a waiting accept.
    l.accept(&q, 3).unwrap();
    l.close(&q, 4).unwrap();
    let mut evs = wait(&q, 2);
    evs.sort_by_key(|e| e.req);
    assert_eq!((evs[0].kind, evs[0].outcome), (EventKind::Accept, Err(libc::ECANCELED)));
    assert_eq!(evs[1].kind, EventKind::Close);
}

#[test]
fn an_event_queue_is_waited_on_through_its_descriptor() {
    let (s, c) = pair(SocketKind::SeqPacket);
    let q = EventQueue::new(4).unwrap();
    let m = Memory::alloc(64).unwrap();
    s.recv(&q, 1, &m, 0, 64).unwrap();
    let mut pfd = libc::pollfd { fd: q.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd.
    assert_eq!(unsafe { libc::poll(&mut pfd, 1, 0) }, 0, "nothing queued yet");
    c.send(&EventQueue::new(1).unwrap(), 2, &m, 0, 8).unwrap();
    // SAFETY: as above.
    let ready = unsafe { libc::poll(&mut pfd, 1, 20_000) };
    assert_eq!(ready, 1, "the completion thread queued the event and the descriptor woke");
    assert_eq!(q.status().queued, 1);
    assert_eq!(one(&q).outcome, Ok(8));
    // SAFETY: as above.
    assert_eq!(unsafe { libc::poll(&mut pfd, 1, 0) }, 0, "empty again");
}

#[test]
fn waiting_for_notification_moves_the_same_bytes() {
    let (s, c) = pair(SocketKind::Stream);
    s.set(Tunable::BusyPoll, 0).unwrap();
    stream_transfer(&s, &c, 2 << 20, &[65536, 10], &[100_000], 4);
    s.set(Tunable::BusyPoll, 1).unwrap();
    assert_eq!(s.get(Tunable::BusyPoll), 1);
}

/// A ping-pong between two threads, each end on its own queue, over messages of mixed sizes:
/// small replies leave straight from the send's start with the next receive's advertisement,
/// larger ones by a write and its note, and (SOCK_SEQPACKET) every seventh turn the echo has
/// two receives posted ahead, which puts the sends around it on the protocol's general path.
/// Every byte is checked.
#[test]
fn a_ping_pong_of_mixed_sizes_between_threads_echoes_every_byte() {
    const SIZES: [usize; 9] = [1, 8, 100, 128, 129, 500, 3000, 64, 0];
    const TURNS: usize = 400;
    const SLOT: usize = 4096;
    const SLOTS: usize = 4;
    for kind in [SocketKind::SeqPacket, SocketKind::Stream] {
        // (A stream receive takes at least a byte.)
        let size = move |turn: usize| match (kind, SIZES[turn % SIZES.len()]) {
            (SocketKind::Stream, 0) => 5,
            (_, n) => n,
        };
        let ahead = move |turn: usize| if kind == SocketKind::SeqPacket && turn % 7 == 3 { 2 } else { 1 };
        let (s, c) = pair(kind);
        let echo = std::thread::spawn(move || {
            let q = EventQueue::new(64).unwrap();
            let mem = Memory::alloc(SLOTS * SLOT).unwrap();
            // Receives posted, in turn order: (turn, slot, bytes in so far); slots in use.
            let mut posted = std::collections::VecDeque::new();
            let mut used = [false; SLOTS];
            let mut next = 0;
            let post =
                |posted: &mut std::collections::VecDeque<(usize, usize, usize)>, used: &mut [bool; SLOTS], turn| {
                    let slot = used.iter().position(|u| !u).expect("a free slot");
                    used[slot] = true;
                    s.recv(&q, slot as u64, &mem, slot * SLOT, size(turn)).unwrap();
                    posted.push_back((turn, slot, 0));
                };
            for turn in 0..TURNS {
                while next < TURNS && next < turn + ahead(turn) {
                    post(&mut posted, &mut used, next);
                    next += 1;
                }
                // This turn's message, whole (a stream's may come in pieces).
                loop {
                    let ev = one(&q);
                    let n = ev.outcome.unwrap() as usize;
                    if ev.kind == EventKind::Send {
                        used[ev.req as usize - 100] = false;
                        continue;
                    }
                    let (t, slot, got) = posted.front_mut().unwrap();
                    assert_eq!((ev.req as usize, *t), (*slot, turn));
                    *got += n;
                    if *got == size(turn) {
                        break;
                    }
                    assert_eq!(kind, SocketKind::Stream, "a message cut short");
                    let at = *slot * SLOT + *got;
                    s.recv(&q, *slot as u64, &mem, at, size(turn) - *got).unwrap();
                }
                let (_, slot, _) = posted.pop_front().unwrap();
                // The next receive before the reply, as an echo does.
                if next < TURNS && next < turn + 1 + ahead(turn + 1) {
                    post(&mut posted, &mut used, next);
                    next += 1;
                }
                s.send(&q, 100 + slot as u64, &mem, slot * SLOT, size(turn)).unwrap();
            }
            // The last replies' events.
            while used.iter().any(|u| *u) {
                let ev = one(&q);
                assert_eq!(ev.kind, EventKind::Send);
                used[ev.req as usize - 100] = false;
            }
        });
        let q = EventQueue::new(64).unwrap();
        let mem = Memory::alloc(2 * SLOT).unwrap();
        let mut got = vec![0u8; SLOT];
        for turn in 0..TURNS {
            let n = size(turn);
            let msg = pattern(n, turn as u32);
            mem.write(SLOT, &msg);
            c.recv(&q, 0, &mem, 0, n).unwrap();
            c.send(&q, 1, &mem, SLOT, n).unwrap();
            let (mut sent, mut done, mut have) = (false, false, 0);
            while !(sent && done) {
                let ev = one(&q);
                let k = ev.outcome.unwrap() as usize;
                if ev.kind == EventKind::Send {
                    sent = true;
                    continue;
                }
                assert!(k > 0 || n == 0, "the end of the data in turn {turn}");
                have += k;
                if have < n {
                    assert_eq!(kind, SocketKind::Stream, "a message cut short");
                    c.recv(&q, 0, &mem, have, n - have).unwrap();
                } else {
                    done = true;
                }
            }
            mem.read(0, &mut got[..n]);
            assert_eq!(&got[..n], &msg[..], "turn {turn}, {n} bytes, {kind:?}");
        }
        echo.join().unwrap();
    }
}
