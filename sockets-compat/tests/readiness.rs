//! Sockets as event loops see them: `poll` and `epoll` (level- and edge-triggered) on
//! `SdpStream::as_raw_fd` and `SdpListener::as_raw_fd`, every wait bounded.

use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::thread;
use std::time::{Duration, Instant};

use sockets_compat::{SdpConfig, SdpListener, SdpStream};

mod common;
use common::{pair, Rng};

/// `poll` on one descriptor: the events it reported within `ms` (0: none).
fn poll(fd: i32, events: i16, ms: i32) -> i16 {
    let mut p = libc::pollfd { fd, events, revents: 0 };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    assert!(n >= 0, "poll: {}", std::io::Error::last_os_error());
    p.revents
}

struct Epoll(i32);

impl Epoll {
    fn new() -> Epoll {
        // SAFETY: no arguments but flags; checked.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        assert!(fd >= 0);
        Epoll(fd)
    }
    fn add(&self, fd: i32, events: u32) {
        let mut ev = libc::epoll_event { events, u64: fd as u64 };
        // SAFETY: a valid epoll descriptor and event.
        assert_eq!(unsafe { libc::epoll_ctl(self.0, libc::EPOLL_CTL_ADD, fd, &mut ev) }, 0);
    }
    fn modify(&self, fd: i32, events: u32) {
        let mut ev = libc::epoll_event { events, u64: fd as u64 };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::epoll_ctl(self.0, libc::EPOLL_CTL_MOD, fd, &mut ev) }, 0);
    }
    /// The events of the first ready descriptor within `ms`, if any.
    fn wait(&self, ms: i32) -> Option<u32> {
        let mut ev = [libc::epoll_event { events: 0, u64: 0 }; 4];
        // SAFETY: a valid array of events.
        let n = unsafe { libc::epoll_wait(self.0, ev.as_mut_ptr(), 4, ms) };
        assert!(n >= 0);
        (n > 0).then(|| ev[0].events)
    }
}

impl Drop for Epoll {
    fn drop(&mut self) {
        // SAFETY: our own descriptor.
        unsafe { libc::close(self.0) };
    }
}

const IN: i16 = libc::POLLIN;
const OUT: i16 = libc::POLLOUT;

#[test]
fn poll_shows_arrivals_end_of_stream_and_writability() {
    let (mut c, mut s) = pair(SdpConfig::default(), SdpConfig::default());
    s.set_nonblocking(true).unwrap();
    let fd = s.as_raw_fd();
    assert_eq!(fd, s.as_raw_fd(), "one descriptor per socket");
    assert_eq!(poll(fd, IN | OUT, 0), OUT, "writable, nothing to read");
    for round in 0..50u8 {
        let msg = [round; 100];
        c.write_all(&msg).unwrap();
        assert_eq!(poll(fd, IN, 10_000) & IN, IN, "round {round}: the arrival shows");
        let mut got = [0u8; 100];
        let mut at = 0;
        while at < 100 {
            match s.read(&mut got[at..]) {
                Ok(n) => at += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => assert_eq!(poll(fd, IN, 10_000) & IN, IN),
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(got, msg);
        assert_eq!(s.read(&mut got).unwrap_err().kind(), ErrorKind::WouldBlock);
        assert_eq!(poll(fd, IN, 0), 0, "round {round}: drained, not readable");
        if round % 10 == 0 {
            // Arrivals while the application is not calling at all.
            thread::sleep(Duration::from_millis(3));
        }
    }
    drop(c);
    assert_eq!(poll(fd, IN, 10_000) & IN, IN, "end of stream shows readable");
    assert_eq!(s.read(&mut [0u8; 8]).unwrap(), 0);
    assert_eq!(poll(fd, IN, 0) & IN, IN, "and stays readable");
}

/// An edge-triggered loop that reads until `WouldBlock` and then waits gets every byte of a
/// stream written in bursts with pauses (the kind of loop mio and tokio run).
#[test]
fn an_edge_triggered_loop_gets_every_byte() {
    let (c, s) = pair(SdpConfig::default(), SdpConfig::default());
    s.set_nonblocking(true).unwrap();
    let ep = Epoll::new();
    ep.add(s.as_raw_fd(), (libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLET) as u32);
    let data = Rng(11).bytes(3 << 20);
    let sent = data.clone();
    let writer = thread::spawn(move || {
        let mut c = c;
        let mut rng = Rng(5);
        let mut at = 0;
        while at < sent.len() {
            let n = (1 + rng.below(64 * 1024)).min(sent.len() - at);
            c.write_all(&sent[at..at + n]).unwrap();
            at += n;
            if rng.below(8) == 0 {
                thread::sleep(Duration::from_millis(1));
            }
        }
        c
    });
    let mut got = Vec::with_capacity(data.len());
    let mut buf = vec![0u8; 100 * 1024];
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut s = s;
    while got.len() < data.len() {
        assert!(Instant::now() < deadline, "stalled at {} of {} bytes", got.len(), data.len());
        loop {
            match s.read(&mut buf) {
                Ok(0) => panic!("early end of stream"),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => panic!("{e}"),
            }
        }
        if got.len() < data.len() {
            ep.wait(10_000);
        }
    }
    assert!(got == data, "the stream arrived changed");
    drop(writer.join().unwrap());
}

/// A writer whose peer does not read gets `WouldBlock`; an edge-triggered wait for writability
/// ends once the peer reads (room comes back), and `EPOLL_CTL_MOD` re-arms it.
#[test]
fn a_blocked_writer_is_woken_when_room_comes_back() {
    let (c, s) = pair(SdpConfig::default(), SdpConfig::default());
    c.set_nonblocking(true).unwrap();
    let ep = Epoll::new();
    let fd = c.as_raw_fd();
    ep.add(fd, (libc::EPOLLOUT | libc::EPOLLET) as u32);
    let chunk = vec![7u8; 16 * 1024];
    let mut written = 0usize;
    let mut c = c;
    loop {
        match c.write(&chunk) {
            Ok(n) => written += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) => panic!("{e}"),
        }
        assert!(written < 1 << 30, "never blocked");
    }
    // Drain the edges so far, then let the peer read everything.
    while ep.wait(0).is_some() {}
    let reader = thread::spawn(move || {
        let mut s = s;
        let mut buf = vec![0u8; 64 * 1024];
        let mut n = 0;
        while n < written {
            n += s.read(&mut buf).unwrap();
        }
        s
    });
    let ev = ep.wait(10_000).expect("no writability edge once the peer read");
    assert_ne!(ev & libc::EPOLLOUT as u32, 0);
    assert!(c.write(&chunk).unwrap() > 0, "writable when told so");
    ep.modify(fd, (libc::EPOLLOUT | libc::EPOLLIN) as u32);
    assert!(ep.wait(1_000).is_some(), "level-triggered after EPOLL_CTL_MOD: writable");
    let _s = reader.join().unwrap();
}

#[test]
fn a_listener_polls_readable_when_a_client_waits() {
    let l = SdpListener::bind("127.0.0.1:0").unwrap();
    l.set_nonblocking(true).unwrap();
    let fd = l.as_raw_fd();
    assert_eq!(poll(fd, IN, 0), 0);
    assert_eq!(l.accept().unwrap_err().kind(), ErrorKind::WouldBlock);
    let addr = l.local_addr().unwrap();
    for i in 0..3 {
        let client = thread::spawn(move || SdpStream::connect(addr).unwrap());
        assert_eq!(poll(fd, IN, 10_000) & IN, IN, "client {i} shows");
        let (mut s, peer) = l.accept().unwrap();
        let mut c = client.join().unwrap();
        assert_eq!(peer, c.local_addr().unwrap());
        c.write_all(b"hi").unwrap();
        let mut got = [0u8; 2];
        s.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hi");
        assert_eq!(poll(fd, IN, 0), 0, "nobody else waits");
    }
}
