//! The AZ-SDP contract: after `write` returns, changing the buffer never changes what the
//! receiver gets (the change waits); after `read` returns, the buffer shows the data (a look
//! waits). Unaligned buffers, buffers sharing pages with other data, mmap aliases, the
//! fallback to ZSDP. (A buffer unmapped under the transport has a binary of its own,
//! `azsdp_unmapped.rs`.)

use std::io::{Read, Write};
use std::thread;
use std::time::{Duration, Instant};

use portability_verbs::protect;
use sockets_compat::{Design, SdpConfig, SdpStream};

mod common;
use common::{pair, Pages, Rng};

const PAGE: usize = 4096;

/// AZ-SDP with block-on-write: a store into a buffer in flight waits for the peer's read.
/// Buffers of a page and more are held (by default only those of 128 KiB and more are), so
/// the contract is tested on small buffers.
fn az() -> SdpConfig {
    SdpConfig {
        design: Design::AzSdp,
        zcopy_threshold: PAGE,
        az_hold_min: PAGE,
        az_fault_limit: u32::MAX,
        az_copy_on_write: false,
        ..SdpConfig::default()
    }
}

/// AZ-SDP with copy-on-write: such a store copies the buffer aside unless the peer is reading.
fn az_cow() -> SdpConfig {
    SdpConfig { az_copy_on_write: true, ..az() }
}

/// Reads `n` bytes on another thread after `delay`, so the writer's transfers stay in flight.
fn late_reader(mut s: SdpStream, n: usize, delay: Duration) -> thread::JoinHandle<(SdpStream, Vec<u8>)> {
    thread::spawn(move || {
        thread::sleep(delay);
        let mut got = vec![0u8; n];
        s.read_exact(&mut got).unwrap();
        (s, got)
    })
}

#[test]
fn after_write_returns_changing_the_buffer_never_changes_what_the_peer_gets() {
    let (mut c, s) = pair(az(), az());
    let mut mem = Pages::new(64 * 1024);
    let original = Rng(1).bytes(mem.len);
    mem.bytes().copy_from_slice(&original);
    let reader = late_reader(s, 2 * mem.len, Duration::from_millis(150));
    let t = Instant::now();
    c.write_all(mem.bytes()).unwrap();
    assert!(t.elapsed() < Duration::from_millis(100), "an AZ-SDP write waited for the reader");
    // The application reuses its buffer at once: the store waits until the peer has read it.
    mem.bytes().fill(0xee);
    assert!(t.elapsed() >= Duration::from_millis(100), "a store into a buffer in flight did not wait");
    c.write_all(mem.bytes()).unwrap();
    c.flush().unwrap();
    let (_s, got) = reader.join().unwrap();
    assert!(got[..mem.len] == original[..], "the peer saw a change made after write returned");
    assert!(got[mem.len..].iter().all(|&b| b == 0xee));
    assert!(c.faults() >= 1);
}

#[test]
fn after_read_returns_the_buffer_shows_the_data() {
    let (mut c, mut s) = pair(az(), az());
    let data = Rng(2).bytes(256 * 1024 + 333);
    let d = data.clone();
    let writer = thread::spawn(move || {
        c.write_all(&d).unwrap();
        c.flush().unwrap();
        c
    });
    let mut mem = Pages::new(data.len().next_multiple_of(PAGE) + PAGE);
    // An unaligned start and length: the head is read at once, the whole pages later.
    let buf = &mut mem.bytes()[7..7 + data.len()];
    let mut off = 0;
    while off < data.len() {
        let n = s.read(&mut buf[off..]).unwrap();
        assert!(n > 0);
        off += n;
    }
    assert!(buf[..] == data[..], "a look after read returned missed data");
    drop(writer.join().unwrap());
}

#[test]
fn pages_shared_with_other_data_are_never_held() {
    let (mut c, s) = pair(az(), az());
    let mut mem = Pages::new(6 * PAGE);
    // The buffer shares its first and last pages with the application's other data.
    let (start, len) = (100, 4 * PAGE + 500);
    let original = Rng(3).bytes(len);
    mem.bytes()[start..start + len].copy_from_slice(&original);
    let reader = late_reader(s, len, Duration::from_millis(100));
    c.write_all(&mem.bytes()[start..start + len]).unwrap();
    // Neighbours on the shared pages are free to change at once (no fault, no wait).
    let t = Instant::now();
    mem.bytes()[..start].fill(1);
    mem.bytes()[start + len..].fill(2);
    assert!(t.elapsed() < Duration::from_millis(50));
    // The buffer itself is not.
    mem.bytes()[start..start + len].fill(3);
    c.flush().unwrap();
    let (_s, got) = reader.join().unwrap();
    assert!(got == original);
    assert!(mem.bytes()[..start].iter().all(|&b| b == 1) && mem.bytes()[start + len..].iter().all(|&b| b == 2));
}

#[test]
fn mmap_aliases_are_protected_together() {
    let len = 16 * PAGE;
    // SAFETY: plain memfd and mmap calls; both mappings are unmapped at the end.
    let (a, b, fd) = unsafe {
        let fd = libc::memfd_create(c"sdp-alias".as_ptr(), 0);
        assert!(fd >= 0);
        assert_eq!(libc::ftruncate(fd, len as libc::off_t), 0);
        let map = || {
            let m = libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0);
            assert_ne!(m, libc::MAP_FAILED);
            m as *mut u8
        };
        (map(), map(), fd)
    };
    // SAFETY: the two mappings of `len` bytes made above, both ours.
    let (a_bytes, b_bytes) =
        unsafe { (std::slice::from_raw_parts_mut(a, len), std::slice::from_raw_parts_mut(b, len)) };
    let alias = protect::register_alias(a as usize, b as usize, len).unwrap();
    let original = Rng(4).bytes(len);
    a_bytes.copy_from_slice(&original);
    let (mut c, s) = pair(az(), az());
    let reader = late_reader(s, len, Duration::from_millis(150));
    let t = Instant::now();
    c.write_all(a_bytes).unwrap();
    // Writing through the other mapping changes the same memory: it must wait too.
    b_bytes.fill(9);
    assert!(t.elapsed() >= Duration::from_millis(100), "a store through an alias did not wait");
    let (_s, got) = reader.join().unwrap();
    assert!(got == original, "a change through an alias reached the peer");
    c.flush().unwrap();
    drop(alias);
    // SAFETY: unmapping what was mapped above.
    unsafe {
        libc::munmap(a.cast(), len);
        libc::munmap(b.cast(), len);
        libc::close(fd);
    }
}

#[test]
fn a_socket_that_faults_too_often_falls_back_to_zsdp() {
    let cfg = SdpConfig { az_fault_limit: 3, ..az() };
    let (mut c, mut s) = pair(cfg, SdpConfig::default());
    let mut mem = Pages::new(8 * PAGE);
    let reader = thread::spawn(move || {
        let mut got = vec![0u8; 8 * PAGE];
        for i in 0..10u8 {
            s.read_exact(&mut got).unwrap();
            let bad = got.iter().position(|&b| b != i);
            assert!(bad.is_none(), "message {i}: byte {bad:?} is {}", got[bad.unwrap_or(0)]);
        }
        s
    });
    for i in 0..10u8 {
        // Touching the buffer right after each write faults until the socket gives up.
        mem.bytes().fill(i);
        c.write_all(mem.bytes()).unwrap();
    }
    c.flush().unwrap();
    let s = reader.join().unwrap();
    assert!(c.faults() >= 3);
    assert_eq!(c.design(), Design::AzSdp);
    assert_eq!(c.effective_design(), Design::Zsdp);
    assert_eq!(s.peer_design(), Design::Zsdp);
}

#[test]
fn an_echo_server_sends_back_the_buffer_it_just_received() {
    let (mut c, mut s) = pair(az(), az());
    let server = thread::spawn(move || {
        let mut mem = Pages::new(32 * PAGE);
        for _ in 0..5 {
            let buf = mem.bytes();
            let mut off = 0;
            while off < buf.len() {
                let n = s.read(&mut buf[off..]).unwrap();
                // Sending a buffer whose receive has not landed waits for the data first.
                s.write_all(&buf[off..off + n]).unwrap();
                off += n;
            }
        }
        s.flush().unwrap();
        s
    });
    for round in 0..5 {
        let data = Rng(50 + round).bytes(32 * PAGE);
        let mut mem = Pages::new(32 * PAGE);
        mem.bytes().copy_from_slice(&data);
        c.write_all(mem.bytes()).unwrap();
        let mut back = Pages::new(32 * PAGE);
        c.read_exact(back.bytes()).unwrap();
        assert!(back.bytes() == &data[..], "round {round} came back different");
        c.flush().unwrap();
    }
    drop(server.join().unwrap());
}

#[test]
fn a_receive_into_a_buffer_still_being_sent_waits_for_the_send() {
    // The echo reads into the buffer it has just written: with AZ-SDP the peer may not have
    // read that write yet, and the receive must not land over it.
    let (mut c, mut s) = pair(az(), az());
    let server = thread::spawn(move || {
        let mut mem = Pages::new(16 * PAGE);
        let buf = mem.bytes();
        loop {
            let n = s.read(buf).unwrap();
            if n == 0 {
                break;
            }
            s.write_all(&buf[..n]).unwrap();
        }
        s.flush().unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        s
    });
    let data = Rng(77).bytes(256 * PAGE);
    let mut mem = Pages::new(256 * PAGE);
    mem.bytes().copy_from_slice(&data);
    let mut r = c.try_clone().unwrap();
    let reader = thread::spawn(move || {
        let mut got = Vec::new();
        r.read_to_end(&mut got).unwrap();
        got
    });
    c.write_all(mem.bytes()).unwrap();
    c.shutdown(std::net::Shutdown::Write).unwrap();
    let got = reader.join().unwrap();
    let first_bad = got.iter().zip(&data).position(|(a, b)| a != b);
    assert!(got == data, "echo differs ({} bytes back, first difference at {first_bad:?})", got.len());
    c.flush().unwrap();
    drop(server.join().unwrap());
}

#[test]
fn both_ends_writing_then_reading_into_the_same_buffer_do_not_wait_for_each_other() {
    // Each end's read waits for its own write to be taken before it may land in the buffer,
    // and the peer takes it only after its own read: the reads must not just wait.
    let (c, s) = pair(az(), az());
    let ends: Vec<_> = [(c, 1u64), (s, 2u64)]
        .into_iter()
        .map(|(mut x, seed)| {
            thread::spawn(move || {
                x.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                let mut mem = Pages::new(16 * PAGE);
                for round in 0..20 {
                    let mine = Rng(seed * 100 + round).bytes(16 * PAGE);
                    mem.bytes().copy_from_slice(&mine);
                    x.write_all(mem.bytes()).unwrap();
                    x.read_exact(mem.bytes()).unwrap();
                    let theirs = Rng((3 - seed) * 100 + round).bytes(16 * PAGE);
                    assert!(mem.bytes() == &theirs[..], "end {seed}, round {round}: wrong data");
                }
                x.flush().unwrap();
                x
            })
        })
        .collect();
    for e in ends {
        drop(e.join().unwrap());
    }
}

#[test]
fn with_copy_on_write_a_store_into_a_buffer_the_peer_has_not_read_copies_it_aside() {
    let (mut c, s) = pair(az_cow(), az_cow());
    let mut mem = Pages::new(16 * PAGE);
    let original = Rng(7).bytes(mem.len);
    mem.bytes().copy_from_slice(&original);
    let reader = late_reader(s, 2 * mem.len, Duration::from_millis(400));
    let t = Instant::now();
    c.write_all(mem.bytes()).unwrap();
    // The store takes the buffer's lock word at the idle reader and goes on with a copy made.
    mem.bytes().fill(0xee);
    assert!(t.elapsed() < Duration::from_millis(300), "the store waited for the reader ({:?})", t.elapsed());
    assert!(c.faults() >= 1);
    c.write_all(mem.bytes()).unwrap();
    c.flush().unwrap();
    let (_s, got) = reader.join().unwrap();
    assert!(got[..mem.len] == original[..], "the peer saw a change made after write returned");
    assert!(got[mem.len..].iter().all(|&b| b == 0xee));
}

#[test]
fn with_copy_on_write_a_store_still_waits_for_a_peer_already_reading() {
    let (mut c, mut s) = pair(az_cow(), az_cow());
    let mut mem = Pages::new(16 * PAGE);
    let original = Rng(8).bytes(mem.len);
    mem.bytes().copy_from_slice(&original);
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let reader = thread::spawn(move || {
        // Takes the advert's lock word with its first page, then stalls before the rest.
        let mut got = vec![0u8; 16 * PAGE];
        s.read_exact(&mut got[..PAGE]).unwrap();
        tx.send(()).unwrap();
        thread::sleep(Duration::from_millis(300));
        s.read_exact(&mut got[PAGE..]).unwrap();
        (s, got)
    });
    c.write_all(mem.bytes()).unwrap();
    rx.recv_timeout(Duration::from_secs(10)).unwrap();
    let t = Instant::now();
    mem.bytes().fill(0xee);
    assert!(t.elapsed() >= Duration::from_millis(150), "a store into a buffer being read did not wait");
    c.flush().unwrap();
    let (_s, got) = reader.join().unwrap();
    assert!(got == original, "the peer saw a change made after write returned");
}

#[test]
fn with_copy_on_write_two_ends_storing_into_buffers_in_flight_do_not_deadlock() {
    // Each end writes a buffer, stores into it at once, then reads: with block-on-write each
    // store waits for a read the other end never gets to.
    let (c, s) = pair(az_cow(), az_cow());
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    for (seed, mut x) in [(1u64, c), (2u64, s)] {
        let done = done_tx.clone();
        thread::spawn(move || {
            let mut mem = Pages::new(16 * PAGE);
            let mut got = vec![0u8; 16 * PAGE];
            for round in 0..10 {
                let mine = Rng(seed * 100 + round).bytes(16 * PAGE);
                mem.bytes().copy_from_slice(&mine);
                x.write_all(mem.bytes()).unwrap();
                mem.bytes().fill(0); // the next message is prepared in the same buffer
                x.read_exact(&mut got).unwrap();
                let theirs = Rng((3 - seed) * 100 + round).bytes(16 * PAGE);
                assert!(got == theirs, "end {seed}, round {round}: wrong data");
            }
            x.flush().unwrap();
            done.send(x).unwrap();
        });
    }
    let ends: Vec<SdpStream> =
        (0..2).map(|_| done_rx.recv_timeout(Duration::from_secs(30)).expect("deadlock")).collect();
    drop(ends);
}

/// The permissions `/proc/self/maps` shows for the page at `addr` ("rw-p", "r--p", ...).
fn perms_of(addr: usize) -> String {
    protect::page_permissions(addr).unwrap_or_else(|| panic!("{addr:#x} is not mapped"))
}

#[test]
fn a_buffer_read_by_the_peer_stays_read_only_until_touched_or_flushed() {
    let (mut c, mut s) = pair(az(), az());
    let mut mem = Pages::new(16 * PAGE);
    let addr = mem.ptr as usize;
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let reader = thread::spawn(move || {
        let mut got = vec![0u8; 16 * PAGE];
        let mut rounds = Vec::new();
        for round in 0..3 {
            if round == 1 {
                thread::sleep(Duration::from_millis(300));
            }
            s.read_exact(&mut got).unwrap();
            rounds.push(got.clone());
            tx.send(()).unwrap();
        }
        (s, rounds)
    });
    mem.bytes().fill(1);
    c.write_all(mem.bytes()).unwrap();
    rx.recv_timeout(Duration::from_secs(10)).unwrap();
    // Once the peer's answer is in (the background engine takes it), nothing holds the buffer,
    // but its pages stay read-only.
    let end = Instant::now() + Duration::from_secs(10);
    while protect::overlaps(addr, PAGE) {
        assert!(Instant::now() < end, "the peer's answer never released the buffer");
        thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(perms_of(addr), "r--p", "a buffer read by the peer is kept read-only until touched");
    // A store opens it without waiting for anything.
    let t = Instant::now();
    mem.bytes().fill(2);
    assert!(t.elapsed() < Duration::from_millis(100));
    assert_eq!(perms_of(addr), "rw-p");
    assert!(c.faults() >= 1);
    // Sent again while the reader is late: held for real, so a store waits for the read.
    let t = Instant::now();
    c.write_all(mem.bytes()).unwrap();
    mem.bytes().fill(3);
    assert!(t.elapsed() >= Duration::from_millis(50), "a store into a buffer in flight did not wait");
    c.write_all(mem.bytes()).unwrap();
    // flush opens every lazily kept buffer: system calls may write into it again.
    c.flush().unwrap();
    assert_eq!(perms_of(addr), "rw-p");
    let mut fds = [0; 2];
    // SAFETY: plain pipe/write/read calls on our own descriptors and buffer.
    unsafe {
        assert_eq!(libc::pipe(fds.as_mut_ptr()), 0);
        assert_eq!(libc::write(fds[1], [7u8; 16].as_ptr().cast(), 16), 16);
        assert_eq!(libc::read(fds[0], mem.ptr.cast(), 16), 16, "{}", std::io::Error::last_os_error());
        libc::close(fds[0]);
        libc::close(fds[1]);
    }
    let (_s, rounds) = reader.join().unwrap();
    for (round, fill) in [1u8, 2, 3].into_iter().enumerate() {
        assert!(rounds[round].iter().all(|&b| b == fill), "round {round}: the peer saw a change made after write");
    }
}
