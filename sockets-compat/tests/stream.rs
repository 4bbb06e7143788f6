//! Stream-socket conformance: byte-exact streams in every design and flow control, partial
//! reads, shutdown and EOF, nonblocking mode, timeouts, many connections at once.

use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown;
use std::thread;
use std::time::Duration;

use sockets_compat::{Design, SdpConfig, SdpListener, SdpStream};

mod common;
use common::{pair, Rng};

/// Writes a random stream in random-sized writes across every protocol boundary and checks
/// the reader, reading in random-sized pieces, gets exactly it.
fn random_stream(cfg: SdpConfig, seed: u64) {
    random_stream_between(cfg, cfg, seed)
}

/// [`random_stream`] from a writer with settings `cfg` to a reader with `reader`.
fn random_stream_between(cfg: SdpConfig, reader: SdpConfig, seed: u64) {
    let (mut c, mut s) = pair(cfg, reader);
    let mut rng = Rng(seed);
    let sizes: Vec<usize> = (0..60)
        .map(|i| match i % 4 {
            0 => 1 + rng.below(64),
            1 => 1 + rng.below(20_000),
            2 => cfg.zcopy_threshold.saturating_sub(1) + rng.below(3),
            _ => 1 + rng.below(300_000),
        })
        .collect();
    let total: usize = sizes.iter().sum();
    let data = rng.bytes(total);
    let expect = data.clone();
    let writer = thread::spawn(move || {
        let mut off = 0;
        for n in sizes {
            c.write_all(&data[off..off + n]).unwrap();
            off += n;
        }
        // AZ-SDP: `data` may be unmapped once the peer has read it all.
        c.flush().unwrap();
        c.shutdown(Shutdown::Write).unwrap();
        c
    });
    let mut got = Vec::with_capacity(total);
    let mut buf = vec![0u8; 400_000];
    loop {
        let want = 1 + rng.below(buf.len());
        let n = s.read(&mut buf[..want]).unwrap();
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
    }
    let _c = writer.join().unwrap();
    assert_eq!(got.len(), expect.len());
    assert!(got == expect, "stream corrupted ({cfg:?})");
}

#[test]
fn bsdp_streams_are_byte_exact_under_every_flow_control() {
    for (i, flow) in [SdpConfig::CREDIT, SdpConfig::RDMA, SdpConfig::WINDOW, SdpConfig::POLLED].into_iter().enumerate()
    {
        random_stream(SdpConfig { design: Design::Bsdp, flow, ..SdpConfig::default() }, 11 + i as u64);
    }
}

/// Large buffer-copy writes through the peer's bulk ring: a small ring that wraps again and
/// again, chunks smaller than the writes, bulk bytes between Data messages, reads in pieces;
/// and a reader without a bulk ring, to which the same writer sends Data.
#[test]
fn bulk_lane_streams_are_byte_exact_under_every_flow_control() {
    for (i, flow) in [SdpConfig::CREDIT, SdpConfig::RDMA, SdpConfig::WINDOW, SdpConfig::POLLED].into_iter().enumerate()
    {
        let cfg =
            SdpConfig { design: Design::Bsdp, flow, bulk_ring: 16 * 1024, bulk_min: 3000, ..SdpConfig::default() };
        random_stream(cfg, 31 + i as u64);
        random_stream_between(cfg, SdpConfig { bulk_ring: 0, ..cfg }, 41 + i as u64);
    }
}

/// Two ends that each write more than the other's bulk ring holds before reading anything:
/// each takes in the other's chunks while it waits for room, so neither waits forever.
#[test]
fn two_ends_writing_large_buffers_at_once_both_finish() {
    let cfg = SdpConfig { bulk_ring: 64 * 1024, ..SdpConfig::default() };
    let (c, s) = pair(cfg, cfg);
    let run = |mut sock: SdpStream, seed: u64| {
        thread::spawn(move || {
            sock.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            let mine = Rng(seed).bytes(4 << 20);
            sock.write_all(&mine).unwrap();
            let mut theirs = vec![0u8; 4 << 20];
            sock.read_exact(&mut theirs).unwrap();
            theirs
        })
    };
    let (a, b) = (run(c, 1), run(s, 2));
    assert!(a.join().unwrap() == Rng(2).bytes(4 << 20));
    assert!(b.join().unwrap() == Rng(1).bytes(4 << 20));
}

/// A bulk writer whose reader does not read fills the reader's ring, then its write timeout
/// ends the write part-way, as TCP's does; the reader gets exactly the bytes reported.
#[test]
fn a_bulk_writer_whose_reader_waits_gets_a_partial_write_at_its_timeout() {
    let cfg = SdpConfig { bulk_ring: 64 * 1024, ..SdpConfig::default() };
    let (mut c, mut s) = pair(cfg, cfg);
    c.set_write_timeout(Some(Duration::from_millis(100))).unwrap();
    let data = Rng(77).bytes(8 << 20);
    let n = c.write(&data).unwrap();
    assert!(n > 0 && n < data.len(), "wrote {n} bytes");
    let mut got = vec![0u8; n];
    s.read_exact(&mut got).unwrap();
    assert!(got[..] == data[..n]);
    // Nothing more is there, and the socket still works (a write the ring holds whole).
    s.set_nonblocking(true).unwrap();
    assert_eq!(s.read(&mut [0u8; 16]).unwrap_err().kind(), ErrorKind::WouldBlock);
    c.write_all(&data[n..n + 40_000]).unwrap();
    s.set_nonblocking(false).unwrap();
    let mut more = vec![0u8; 40_000];
    s.read_exact(&mut more).unwrap();
    assert!(more[..] == data[n..n + 40_000]);
}

#[test]
fn zsdp_streams_are_byte_exact_across_the_threshold() {
    for (i, threshold) in [1usize, 4096, 64 * 1024].into_iter().enumerate() {
        let cfg = SdpConfig { design: Design::Zsdp, zcopy_threshold: threshold, ..SdpConfig::default() };
        random_stream(cfg, 101 + i as u64);
    }
}

#[test]
fn azsdp_streams_are_byte_exact_across_the_threshold() {
    for (i, threshold) in [4096usize, 64 * 1024].into_iter().enumerate() {
        // The reader looks at every buffer at once (faults), so it falls back to ZSDP midway.
        let cfg = SdpConfig { design: Design::AzSdp, zcopy_threshold: threshold, ..SdpConfig::default() };
        random_stream(cfg, 201 + i as u64);
    }
    // Never falling back: every touch waits out its transfer.
    let cfg =
        SdpConfig { design: Design::AzSdp, zcopy_threshold: 4096, az_fault_limit: u32::MAX, ..SdpConfig::default() };
    random_stream(cfg, 301);
}

#[test]
fn a_zsdp_sender_talks_to_a_bsdp_receiver() {
    let z = SdpConfig { design: Design::Zsdp, zcopy_threshold: 1000, ..SdpConfig::default() };
    let (mut c, mut s) = pair(z, SdpConfig::default());
    let data = Rng(5).bytes(50_000);
    let d = data.clone();
    let t = thread::spawn(move || {
        c.write_all(&d).unwrap();
        c
    });
    let mut got = vec![0u8; data.len()];
    s.read_exact(&mut got).unwrap();
    assert_eq!(got, data);
    let mut back = t.join().unwrap();
    s.write_all(b"ok").unwrap();
    let mut two = [0u8; 2];
    back.read_exact(&mut two).unwrap();
    assert_eq!(&two, b"ok");
}

#[test]
fn partial_reads_leave_the_rest_for_the_next_read() {
    for design in [Design::Bsdp, Design::Zsdp, Design::AzSdp] {
        let cfg = SdpConfig { design, zcopy_threshold: 8, ..SdpConfig::default() };
        let (mut c, mut s) = pair(cfg, cfg);
        let t = thread::spawn(move || {
            c.write_all(b"0123456789").unwrap();
            c
        });
        let mut three = [0u8; 3];
        let mut got = Vec::new();
        while got.len() < 10 {
            let n = s.read(&mut three).unwrap();
            assert!(n > 0 && n <= 3);
            got.extend_from_slice(&three[..n]);
        }
        assert_eq!(got, b"0123456789");
        drop(t.join().unwrap());
    }
}

#[test]
fn a_read_takes_every_arrived_message_that_fits_as_tcp_does() {
    // Four 8 KiB Data messages, all in the receiver's buffers before it reads (the writer's
    // credits cover them): one large read gets all of them, in order, whichever way they are
    // taken (straight from the receive buffers, or queued behind a partial read).
    for first in [0usize, 100] {
        let cfg = SdpConfig::default();
        let (mut c, mut s) = pair(cfg, cfg);
        let body: Vec<u8> = (0..4 * 8192u32).map(|i| (i * 7 + i / 8192) as u8).collect();
        c.write_all(&body).unwrap();
        let mut got = vec![0u8; first];
        s.read_exact(&mut got).unwrap();
        let mut rest = vec![0u8; body.len()];
        let n = s.read(&mut rest).unwrap();
        assert_eq!(n, body.len() - first, "one read after a first read of {first} bytes");
        got.extend_from_slice(&rest[..n]);
        assert_eq!(got, body);
    }
}

#[test]
fn shutdown_gives_eof_after_the_data_and_forbids_writing() {
    let (mut c, mut s) = pair(SdpConfig::default(), SdpConfig::default());
    c.write_all(b"last words").unwrap();
    c.shutdown(Shutdown::Write).unwrap();
    let mut got = String::new();
    s.read_to_string(&mut got).unwrap();
    assert_eq!(got, "last words");
    assert_eq!(s.read(&mut [0u8; 8]).unwrap(), 0, "EOF stays EOF");
    assert_eq!(c.write(b"x").unwrap_err().kind(), ErrorKind::BrokenPipe);
    // The other direction still works.
    s.write_all(b"reply").unwrap();
    let mut r = [0u8; 5];
    c.read_exact(&mut r).unwrap();
    assert_eq!(&r, b"reply");
}

#[test]
fn dropping_a_socket_is_eof_for_the_peer() {
    let (mut c, mut s) = pair(SdpConfig::default(), SdpConfig::default());
    c.write_all(&[7u8; 100_000]).unwrap_or_else(|e| panic!("{e}"));
    let t = thread::spawn(move || drop(c));
    let mut got = Vec::new();
    s.read_to_end(&mut got).unwrap();
    t.join().unwrap();
    assert_eq!(got.len(), 100_000);
    assert!(got.iter().all(|&b| b == 7));
}

#[test]
fn a_closed_peer_is_eof_then_writing_to_it_is_a_broken_pipe() {
    let (mut c, mut s) = pair(SdpConfig::default(), SdpConfig::default());
    c.write_all(b"goodbye").unwrap();
    drop(c);
    let mut got = String::new();
    s.read_to_string(&mut got).unwrap();
    assert_eq!(got, "goodbye");
    // The peer said it reads nothing more: the write fails rather than being lost.
    let err = s.write(b"anyone there?").unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BrokenPipe, "{err}");
    assert_eq!(s.read(&mut [0u8; 8]).unwrap(), 0, "EOF stays EOF");
}

/// Our end of a connection whose peer read what we wrote, closed and went away.
fn after_the_peer_read_and_left(design: Design) -> SdpStream {
    let cfg = SdpConfig { design, ..SdpConfig::default() };
    let (mut c, mut s) = pair(cfg, cfg);
    s.write_all(b"last words").unwrap();
    let mut got = [0u8; 10];
    c.read_exact(&mut got).unwrap();
    thread::spawn(move || drop(c)).join().unwrap();
    s
}

/// A peer that closed may tear its queue pair down at once; our transport then fails the next
/// time it needs the peer (here, settling the completion of our last, already delivered,
/// write). With the Close taken and nothing of ours waiting for the peer, that is the end of
/// the connection, not a lost one: flush has nothing to wait for and reads stay at EOF.
#[test]
fn after_the_peer_closed_and_went_away_flush_succeeds_and_reads_stay_at_eof() {
    for design in [Design::Bsdp, Design::Zsdp, Design::AzSdp] {
        let mut s = after_the_peer_read_and_left(design);
        assert_eq!(s.read(&mut [0u8; 8]).unwrap(), 0, "{design:?}: the Close is EOF");
        // Each call drives the transport once; a few hundred reach its periodic settling of
        // our unsignaled write, which meets the peer's queue pair gone.
        for i in 0..1000 {
            s.flush().unwrap_or_else(|e| panic!("{design:?}: flush {i} after the peer closed: {e}"));
            assert_eq!(s.read(&mut [0u8; 8]).unwrap(), 0, "{design:?}: EOF stays EOF");
        }
        let err = s.write(b"anyone there?").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::BrokenPipe, "{design:?}: {err}");
    }
}

/// The same when our transport finds the peer gone before we took its Close: its last
/// messages are taken in before the failure is judged (a sender that only flushes, as a
/// benchmark's does, never reads the Close first).
#[test]
fn a_flush_that_meets_the_peer_gone_before_its_close_was_read_succeeds() {
    for design in [Design::Bsdp, Design::Zsdp, Design::AzSdp] {
        let mut s = after_the_peer_read_and_left(design);
        for i in 0..1000 {
            s.flush().unwrap_or_else(|e| panic!("{design:?}: flush {i} after the peer closed: {e}"));
        }
        assert_eq!(s.read(&mut [0u8; 8]).unwrap(), 0, "{design:?}: the Close is EOF");
        let err = s.write(b"anyone there?").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::BrokenPipe, "{design:?}: {err}");
    }
}

/// A write that meets the peer gone before its Close was read is a broken pipe, as any write
/// after a Close: the peer's last messages are taken in before the failure is judged, and
/// reads then see the stream's end (not a reset) after the bytes it sent.
#[test]
fn a_write_that_meets_the_peer_gone_before_its_close_was_read_is_a_broken_pipe() {
    for design in [Design::Bsdp, Design::Zsdp, Design::AzSdp] {
        let cfg = SdpConfig { design, ..SdpConfig::default() };
        let (mut c, mut s) = pair(cfg, cfg);
        c.write_all(b"bye").unwrap();
        thread::spawn(move || drop(c)).join().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let err = loop {
            match s.write(b"x").and_then(|_| s.flush()) {
                Ok(()) => assert!(std::time::Instant::now() < deadline, "{design:?}: the peer's end went unseen"),
                Err(e) => break e,
            }
        };
        assert_eq!(err.kind(), ErrorKind::BrokenPipe, "{design:?}: {err}");
        let mut got = Vec::new();
        s.read_to_end(&mut got).unwrap_or_else(|e| panic!("{design:?}: {e}"));
        assert_eq!(got, b"bye", "{design:?}");
    }
}

#[test]
fn a_peer_that_shut_down_writing_then_closes_is_a_broken_pipe_only_after_the_close() {
    let (mut c, mut s) = pair(SdpConfig::default(), SdpConfig::default());
    c.shutdown(Shutdown::Write).unwrap();
    assert_eq!(s.read(&mut [0u8; 8]).unwrap(), 0);
    // Half-closed: it still reads.
    s.write_all(b"reply").unwrap();
    let mut r = [0u8; 5];
    c.read_exact(&mut r).unwrap();
    assert_eq!(&r, b"reply");
    drop(c);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let err = loop {
        // The Close arrives after the Disconnect; the first writes may still go out.
        match s.write(b"x") {
            Ok(_) => assert!(std::time::Instant::now() < deadline, "the close never arrived"),
            Err(e) => break e,
        }
        thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(err.kind(), ErrorKind::BrokenPipe, "{err}");
}

/// Both ends write, read the other's stream whole and close at once, again and again: the
/// close race (each end's last message meeting a queue pair the other already dropped) must
/// neither lose bytes nor hang.
#[test]
fn both_ends_closing_at_once_lose_nothing() {
    for design in [Design::Bsdp, Design::Zsdp, Design::AzSdp] {
        let cfg = SdpConfig { design, ..SdpConfig::default() };
        for round in 0..8u64 {
            let (a, b) = pair(cfg, cfg);
            let len = 300_000 + round as usize * 10_000;
            let ends: Vec<_> = [(a, 1u64), (b, 2u64)]
                .into_iter()
                .map(|(mut sock, seed)| {
                    thread::spawn(move || {
                        let mine = Rng(seed + round * 10).bytes(len);
                        let theirs = Rng((3 - seed) + round * 10).bytes(len);
                        let writer = {
                            let mut w = sock.try_clone().unwrap();
                            thread::spawn(move || {
                                w.write_all(&mine).unwrap();
                                w.flush().unwrap();
                            })
                        };
                        let mut got = vec![0u8; len];
                        sock.read_exact(&mut got).unwrap();
                        writer.join().unwrap();
                        assert!(got == theirs, "{design:?} round {round}: stream corrupted");
                        drop(sock);
                    })
                })
                .collect();
            for e in ends {
                e.join().unwrap();
            }
        }
    }
}

#[test]
fn nonblocking_mode_returns_would_block() {
    let (mut c, mut s) = pair(SdpConfig::default(), SdpConfig::default());
    s.set_nonblocking(true).unwrap();
    assert_eq!(s.read(&mut [0u8; 4]).unwrap_err().kind(), ErrorKind::WouldBlock);
    // A nonblocking writer fills the flow-control window and then gets WouldBlock.
    c.set_nonblocking(true).unwrap();
    let chunk = vec![1u8; 64 * 1024];
    let mut written = 0;
    let blocked = loop {
        match c.write(&chunk) {
            Ok(n) => written += n,
            Err(e) => break e,
        }
        assert!(written < 64 << 20, "a reader that never reads must stop a nonblocking writer");
    };
    assert_eq!(blocked.kind(), ErrorKind::WouldBlock);
    // Everything written arrives.
    let mut got = 0;
    let mut buf = vec![0u8; 1 << 16];
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while got < written {
        match s.read(&mut buf) {
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => assert!(std::time::Instant::now() < deadline),
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(got, written);
}

#[test]
fn read_timeouts_expire_as_would_block_as_on_linux() {
    let (_c, mut s) = pair(SdpConfig::default(), SdpConfig::default());
    s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    assert_eq!(s.read(&mut [0u8; 4]).unwrap_err().kind(), ErrorKind::WouldBlock);
    assert!(s.set_read_timeout(Some(Duration::ZERO)).is_err());
}

/// A zero-copy write whose reader does not read times out as a TCP write does (`WouldBlock`,
/// nothing sent), and the connection stays usable: the reader never sees the cancelled bytes,
/// and the next write arrives whole. The reader's process answers the cancellation without
/// its application calling in.
#[test]
fn a_zsdp_write_timeout_leaves_the_connection_usable() {
    let z = SdpConfig { design: Design::Zsdp, zcopy_threshold: 1024, ..SdpConfig::default() };
    let (mut c, mut s) = pair(z, SdpConfig::default());
    c.set_write_timeout(Some(Duration::from_millis(100))).unwrap();
    let buf = vec![3u8; 8192];
    let e = c.write(&buf).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::WouldBlock, "{e}");
    drop(buf);
    s.set_nonblocking(true).unwrap();
    assert_eq!(s.read(&mut [0u8; 8192]).unwrap_err().kind(), ErrorKind::WouldBlock);
    s.set_nonblocking(false).unwrap();
    let next: Vec<u8> = (0..20_000u32).map(|i| i as u8).collect();
    let expect = next.clone();
    let writer = thread::spawn(move || {
        c.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
        c.write_all(&next).unwrap();
        c
    });
    let mut got = vec![0u8; expect.len()];
    s.read_exact(&mut got).unwrap();
    assert!(got == expect);
    let _c = writer.join().unwrap();
}

#[test]
fn try_clone_shares_the_socket_between_a_reader_and_a_writer_thread() {
    let (c, s) = pair(SdpConfig::default(), SdpConfig::default());
    let echo = thread::spawn(move || {
        let mut r = s.try_clone().unwrap();
        let mut w = s;
        let mut buf = [0u8; 4096];
        loop {
            let n = r.read(&mut buf).unwrap();
            if n == 0 {
                return;
            }
            w.write_all(&buf[..n]).unwrap();
        }
    });
    let mut w = c.try_clone().unwrap();
    let mut r = c;
    let data = Rng(9).bytes(300_000);
    let d = data.clone();
    let writer = thread::spawn(move || {
        w.write_all(&d).unwrap();
        w.shutdown(Shutdown::Write).unwrap();
    });
    let mut got = Vec::new();
    r.read_to_end(&mut got).unwrap();
    writer.join().unwrap();
    echo.join().unwrap();
    assert!(got == data);
}

#[test]
fn many_connections_at_once() {
    let l = SdpListener::bind_with("127.0.0.1:0", SdpConfig::default()).unwrap();
    let addr = l.local_addr().unwrap();
    const N: usize = 12;
    let server = thread::spawn(move || {
        let mut socks: Vec<SdpStream> = l.incoming().take(N).map(|s| s.unwrap()).collect();
        // Echo one message on every socket, in an interleaved order.
        socks.reverse();
        for s in &mut socks {
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            let mut b = [0u8; 8];
            s.read_exact(&mut b).unwrap();
            s.write_all(&b).unwrap();
        }
    });
    let clients: Vec<_> = (0..N)
        .map(|i| {
            thread::spawn(move || {
                let mut c = SdpStream::connect_with(addr, SdpConfig::default()).unwrap();
                c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                c.write_all(&(i as u64).to_le_bytes()).unwrap();
                let mut b = [0u8; 8];
                c.read_exact(&mut b).unwrap();
                assert_eq!(u64::from_le_bytes(b), i as u64);
            })
        })
        .collect();
    for c in clients {
        c.join().unwrap();
    }
    server.join().unwrap();
}

#[test]
fn bad_settings_are_errors() {
    let none = SdpConfig { design: Design::AzSdp, az_max_outstanding: 0, ..SdpConfig::default() };
    assert_eq!(SdpListener::bind_with("127.0.0.1:0", none).err().unwrap().kind(), ErrorKind::InvalidInput);
    for bad in
        [SdpConfig { bulk_ring: 5000, ..SdpConfig::default() }, SdpConfig { bulk_min: 0, ..SdpConfig::default() }]
    {
        assert_eq!(SdpListener::bind_with("127.0.0.1:0", bad).err().unwrap().kind(), ErrorKind::InvalidInput);
    }
    assert!(SdpStream::connect_with("127.0.0.1:1", SdpConfig::default()).is_err());
}

#[test]
fn accept_without_a_client_times_out_or_would_block() {
    let l = SdpListener::bind_with("127.0.0.1:0", SdpConfig::default()).unwrap();
    assert_eq!(l.accept_timeout(Duration::from_millis(50)).err().unwrap().kind(), ErrorKind::TimedOut);
    l.set_nonblocking(true).unwrap();
    assert_eq!(l.accept().err().unwrap().kind(), ErrorKind::WouldBlock);
}

/// `peek` returns what the next read returns and takes nothing, in every design and for bytes
/// that came zero-copy; at end of stream it returns 0; nonblocking, `WouldBlock`.
#[test]
fn peek_shows_the_next_bytes_and_leaves_them() {
    for design in [Design::Bsdp, Design::Zsdp, Design::AzSdp] {
        let cfg = SdpConfig { design, zcopy_threshold: 16 * 1024, ..SdpConfig::default() };
        let (c, mut s) = pair(cfg, SdpConfig::default());
        let mut rng = Rng(design as u64 + 7);
        let lens = [5usize, 4096, 200 * 1024];
        let all: Vec<Vec<u8>> = lens.iter().map(|&n| rng.bytes(n)).collect();
        // Zero-copy writes wait for the reader: from a thread of their own, which keeps the
        // buffers until its flush says they were read (AZ-SDP holds their pages until then:
        // memory freed earlier may be the reader's next allocation, whose page faults until
        // it reads, which it then never does).
        let sent = all.clone();
        let writer = thread::spawn(move || {
            let mut c = c;
            for d in &sent {
                c.write_all(d).unwrap();
            }
            c.flush().unwrap();
            c
        });
        for data in &all {
            let len = data.len();
            let mut got = vec![0u8; len];
            let mut at = 0;
            while at < len {
                let mut peeked = vec![0u8; len - at];
                let n = s.peek(&mut peeked).unwrap();
                assert!(n > 0, "{design:?}: peek at {at} of {len}");
                assert_eq!(peeked[..n], data[at..at + n], "{design:?}: peeked at {at}");
                let mut again = vec![0u8; n];
                assert_eq!(s.peek(&mut again).unwrap(), n, "{design:?}: a second peek sees as much");
                let r = s.read(&mut got[at..at + n]).unwrap();
                assert_eq!(got[at..at + r], data[at..at + r], "{design:?}: read after peek at {at}");
                at += r;
            }
        }
        let c = writer.join().unwrap();
        s.set_nonblocking(true).unwrap();
        assert_eq!(s.peek(&mut [0u8; 4]).unwrap_err().kind(), ErrorKind::WouldBlock);
        s.set_nonblocking(false).unwrap();
        drop(c);
        assert_eq!(s.peek(&mut [0u8; 4]).unwrap(), 0, "{design:?}: EOF");
    }
}

/// What `TcpStream` offers besides reading and writing: timeouts read back, `nodelay`,
/// `take_error` (a failed socket's: `bad_peer.rs`), `connect_timeout`, every resolved address
/// tried.
#[test]
fn tcp_stream_settings_read_back_and_connecting_tries_every_address() {
    let (c, s) = pair(SdpConfig::default(), SdpConfig::default());
    assert_eq!(c.read_timeout().unwrap(), Some(Duration::from_secs(20)));
    c.set_read_timeout(None).unwrap();
    assert_eq!(c.read_timeout().unwrap(), None);
    assert_eq!(c.write_timeout().unwrap(), Some(Duration::from_secs(20)));
    assert!(c.nodelay().unwrap());
    c.set_nodelay(false).unwrap();
    assert!(!c.nodelay().unwrap());
    assert!(c.take_error().unwrap().is_none(), "a working socket has no pending error");
    drop((c, s));

    // connect_timeout: a listener there connects; none there is refused, not hung.
    let l = SdpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = thread::spawn(move || l.accept_timeout(Duration::from_secs(20)).map(|(s, _)| s));
    let c = SdpStream::connect_timeout(&addr, Duration::from_secs(10)).unwrap();
    let s = t.join().unwrap().unwrap();
    assert_eq!(c.peer_addr().unwrap(), s.local_addr().unwrap());
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    assert!(SdpStream::connect_timeout(&free, Duration::from_secs(5)).is_err());
    assert_eq!(SdpStream::connect_timeout(&free, Duration::ZERO).unwrap_err().kind(), ErrorKind::InvalidInput);
    // Every resolved address in turn: the first refuses, the second accepts.
    let l = SdpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = thread::spawn(move || l.accept_timeout(Duration::from_secs(20)).map(|(s, _)| s));
    let c = SdpStream::connect(&[free, addr][..]).unwrap();
    let _s = t.join().unwrap().unwrap();
    assert_eq!(c.peer_addr().unwrap(), addr);
}
