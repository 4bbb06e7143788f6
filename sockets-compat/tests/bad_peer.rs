//! A hand-made peer that breaks the protocol: the socket fails with a clear I/O error, after
//! delivering what arrived intact, and never hangs.

use std::io::{ErrorKind, Read, Write};
use std::time::Duration;

use portability_verbs::cm::{self, CmAddr};
use portability_verbs::datapath::MsgPipe;
use portability_verbs::{AccessFlags, Context, ProtectionDomain};
use sockets_compat::wire::{Advert, Bsdh, Message};
use sockets_compat::{Design, SdpConfig, SdpListener};

const T: Duration = Duration::from_secs(10);

/// Accepts on an SDP listener while a raw pipe peer connects; returns the socket and the peer.
fn with_raw_peer(send: impl FnOnce(&mut MsgPipe, &ProtectionDomain) + Send + 'static) -> sockets_compat::SdpStream {
    with_raw_peer_and(SdpConfig::default(), send)
}

/// [`with_raw_peer`] for a socket with settings `cfg`.
fn with_raw_peer_and(
    cfg: SdpConfig,
    send: impl FnOnce(&mut MsgPipe, &ProtectionDomain) + Send + 'static,
) -> sockets_compat::SdpStream {
    let l = SdpListener::bind_with("127.0.0.1:0", cfg).unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        let ctx = Context::open_default().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let conn = cm::connect(&CmAddr::Tcp(addr), &pd, &cm::QpSpec::default(), b"SDP1", T).unwrap();
        let mut pipe = MsgPipe::establish(conn.qp, conn.cq, &pd, SdpConfig::CREDIT, T).unwrap();
        send(&mut pipe, &pd);
        // Stay up long enough for the socket to read everything.
        let end = std::time::Instant::now() + Duration::from_secs(2);
        while std::time::Instant::now() < end {
            let _ = pipe.progress();
            std::thread::sleep(Duration::from_millis(1));
        }
    });
    // A peer thread that failed must fail the test, not hang it.
    let (s, _) = l.accept_timeout(T).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    s
}

fn encode(mseq: u32, m: Message<'_>) -> Vec<u8> {
    let mut v = Vec::new();
    m.encode(&Bsdh { mseq, ..Bsdh::default() }, &mut v);
    v
}

#[test]
fn a_malformed_header_fails_the_socket_after_the_good_bytes() {
    let mut s = with_raw_peer(|p, _| {
        p.send(&encode(1, Message::Data(b"good")), T).unwrap();
        p.send(&[0xFF, 0, 0, 0, 0, 0, 0, 99, 0, 0, 0, 2], T).unwrap(); // length lies
    });
    let mut buf = [0u8; 4];
    s.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"good");
    let e = s.read(&mut buf).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidData, "{e}");
    assert!(s.read(&mut buf).is_err(), "the socket stays failed");
}

#[test]
fn an_out_of_order_sequence_number_fails_the_socket() {
    let mut s = with_raw_peer(|p, _| {
        p.send(&encode(1, Message::Data(b"a")), T).unwrap();
        p.send(&encode(3, Message::Data(b"b")), T).unwrap();
    });
    let mut buf = [0u8; 8];
    assert_eq!(s.read(&mut buf).unwrap(), 1);
    assert_eq!(s.read(&mut buf).unwrap_err().kind(), ErrorKind::InvalidData);
}

#[test]
fn an_advertised_buffer_the_peer_does_not_honor_is_an_error_not_garbage() {
    let mut s = with_raw_peer(|p, _| {
        let bogus = Advert { len: 4096, rkey: 0xdead_beef, addr: 0x1000 };
        p.send(&encode(1, Message::SrcAvail(bogus)), T).unwrap();
    });
    let mut buf = vec![0u8; 4096];
    let e = s.read(&mut buf).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset), "{e:?}");
}

/// Sends `bytes` as one chunk of the socket's bulk lane.
fn send_bulk(p: &mut MsgPipe, pd: &ProtectionDomain, bytes: &[u8]) {
    let mr = pd.register(bytes.to_vec().into_boxed_slice(), AccessFlags::NONE).unwrap();
    let t = p.try_send_bulk(mr.sge(0, bytes.len())).unwrap().expect("room in the socket's bulk ring");
    let end = std::time::Instant::now() + T;
    while p.take_user_completion(t).is_none() {
        p.progress().unwrap();
        assert!(std::time::Instant::now() < end, "the socket never took the chunk in");
    }
}

#[test]
fn bulk_lane_bytes_are_stream_bytes_in_order_and_none_may_follow_disconnect() {
    let mut s = with_raw_peer(|p, pd| {
        p.send(&encode(1, Message::Data(b"ab")), T).unwrap();
        send_bulk(p, pd, b"cdef");
        p.send(&encode(2, Message::Data(b"gh")), T).unwrap();
        p.send(&encode(3, Message::Disconnect), T).unwrap();
        send_bulk(p, pd, b"too late");
    });
    let mut got = [0u8; 8];
    s.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"abcdefgh");
    // EOF until the late chunk is in (the peer thread may still be sending it), then an error.
    let end = std::time::Instant::now() + T;
    let e = loop {
        match s.read(&mut got) {
            Ok(0) => assert!(std::time::Instant::now() < end, "the late chunk never failed the socket"),
            Ok(n) => panic!("{n} bytes after Disconnect"),
            Err(e) => break e,
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(e.kind(), ErrorKind::InvalidData, "{e}");
}

#[test]
fn an_abort_is_a_reset() {
    let mut s = with_raw_peer(|p, _| {
        p.send(&encode(1, Message::Abort), T).unwrap();
    });
    assert_eq!(s.read(&mut [0u8; 8]).unwrap_err().kind(), ErrorKind::ConnectionReset);
    // The failure is the socket's pending error once (`SO_ERROR`), then cleared.
    assert_eq!(s.take_error().unwrap().map(|e| e.kind()), Some(ErrorKind::ConnectionReset));
    assert!(s.take_error().unwrap().is_none());
}

const PAGE: usize = 4096;

fn az() -> SdpConfig {
    SdpConfig { design: Design::AzSdp, zcopy_threshold: PAGE, az_hold_min: PAGE, ..SdpConfig::default() }
}

/// The page-aligned `pages`-page window of `v` (which has a page to spare).
fn aligned(v: &mut [u8], pages: usize) -> &mut [u8] {
    let off = (v.as_ptr() as usize).next_multiple_of(PAGE) - v.as_ptr() as usize;
    &mut v[off..off + pages * PAGE]
}

#[test]
fn a_peer_that_aborts_instead_of_reading_a_held_buffer_releases_it() {
    let mut s = with_raw_peer_and(az(), |p, _| {
        // The socket first tells where its copy-on-write lock table is.
        let table = p.recv(T).unwrap();
        assert!(matches!(Message::decode(&table).unwrap().1, Message::LockTable(_)));
        let advert = p.recv(T).unwrap();
        assert!(matches!(Message::decode(&advert).unwrap().1, Message::SrcAvail(_)));
        std::thread::sleep(Duration::from_millis(50));
        p.send(&encode(1, Message::Abort), T).unwrap();
    });
    let mut v = vec![0u8; 17 * PAGE];
    let buf = aligned(&mut v, 16);
    s.write_all(buf).unwrap();
    // The store waits for the transfer, which ends with the connection: it must not hang.
    buf.fill(1);
    assert!(buf.iter().all(|&b| b == 1));
    assert_eq!(s.write(b"x").unwrap_err().kind(), ErrorKind::ConnectionReset);
}

#[test]
fn an_unhonored_advert_into_a_held_receive_buffer_releases_it_and_fails_the_socket() {
    let mut s = with_raw_peer_and(az(), |p, _| {
        let bogus = Advert { len: 16 * PAGE as u32, rkey: 0xdead_beef, addr: 0x10000 };
        p.send(&encode(1, Message::SrcAvail(bogus)), T).unwrap();
    });
    let mut v = vec![0u8; 17 * PAGE];
    let buf = aligned(&mut v, 16);
    // The read may return at once (the data to land later) or fail already.
    let first = s.read(buf);
    // Either way the buffer is readable again (not inaccessible behind a dead transfer), and
    // nothing was written into it.
    assert!(buf.iter().all(|&b| b == 0));
    let e = match first {
        Err(e) => e,
        Ok(_) => s.read(buf).unwrap_err(),
    };
    assert!(matches!(e.kind(), ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset), "{e:?}");
}

/// A peer that answers a SrcAvail of ours it has not read to the end (or claims more than
/// it had) fails the socket: a ZSDP write never reports more bytes than it was given, and an
/// AZ-SDP buffer is released, not left read-only.
#[test]
fn an_answer_that_does_not_cover_the_srcavail_fails_the_write() {
    for (design, claim) in [(Design::Zsdp, 1i64), (Design::Zsdp, -1), (Design::AzSdp, -4096)] {
        let cfg = SdpConfig { design, zcopy_threshold: PAGE, az_hold_min: PAGE, ..SdpConfig::default() };
        let mut s = with_raw_peer_and(cfg, move |p, _| loop {
            let m = p.recv(T).unwrap();
            if let Message::SrcAvail(a) = Message::decode(&m).unwrap().1 {
                let len = (a.len as i64 + claim) as u32;
                p.send(&encode(1, Message::RdmaRdCompl { len }), T).unwrap();
                break;
            }
        });
        s.set_write_timeout(Some(T)).unwrap();
        let mut v = vec![3u8; 17 * PAGE];
        let buf = aligned(&mut v, 16);
        let e = match design {
            Design::AzSdp => {
                s.write_all(buf).unwrap();
                s.flush().unwrap_err()
            }
            _ => s.write(buf).unwrap_err(),
        };
        assert_eq!(e.kind(), ErrorKind::InvalidData, "{design:?} answered {claim:+}: {e}");
        buf.fill(1); // not left protected
        assert!(s.write(b"x").is_err(), "the socket stays failed");
    }
}
