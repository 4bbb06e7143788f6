//! The server's side: a listening socket that also takes SDP clients. The program's listening
//! socket stays the kernel's, so plain clients connect to it as ever and `poll`/`epoll` on it
//! work unchanged. Beside it: an SDP listener on an ephemeral port, and a UDP socket on the
//! same address and port that answers clients' probes with that port. When an SDP client has
//! connected, this library's thread rings the program's listening socket with a TCP
//! connection of its own (a *doorbell*): the program's `accept` takes it, recognises it by
//! its address, and gets the SDP connection in its place.

use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use sockets_compat::{discovery, SdpListener, SdpStream};

use crate::guard::Inside;

/// How long a doorbell may take to connect to the program's own listening socket.
const RING_TIMEOUT: Duration = Duration::from_secs(2);

/// A listening socket that takes SDP clients too.
pub struct Listening {
    sdp: SdpListener,
    udp: UdpSocket,
    /// Where doorbells connect: the listening address (an unspecified IP: loopback).
    ring_at: SocketAddr,
    /// SDP connections waiting for the program's `accept`, by their doorbell's address (as the
    /// program's side of the doorbell sees its peer), with the SDP peer's address and the
    /// doorbell (kept open until then).
    waiting: Mutex<HashMap<SocketAddr, (SdpStream, SocketAddr, TcpStream)>>,
    /// What `getsockname` of accepted connections reports.
    pub local: SocketAddr,
}

impl Listening {
    /// Starts taking SDP clients beside the kernel's listening socket bound to `local`.
    pub fn start(local: SocketAddr) -> io::Result<Arc<Listening>> {
        Listening::bind(local)?.open()
    }

    /// Binds the probe port (the UDP twin of `local`) and the SDP listener, answering nothing
    /// yet: bound before the kernel's socket listens, a probe that comes in between waits in
    /// the twin's buffer for [`Listening::open`] instead of being refused (the server then
    /// taken for a plain one for a while).
    pub fn bind(local: SocketAddr) -> io::Result<Listening> {
        let udp = UdpSocket::bind(local)?;
        udp.set_nonblocking(true)?;
        let sdp = SdpListener::bind(SocketAddr::new(local.ip(), 0))?;
        sdp.set_nonblocking(true)?;
        let ip = match local.ip() {
            std::net::IpAddr::V4(a) if a.is_unspecified() => std::net::Ipv4Addr::LOCALHOST.into(),
            std::net::IpAddr::V6(a) if a.is_unspecified() => std::net::Ipv6Addr::LOCALHOST.into(),
            ip => ip,
        };
        Ok(Listening {
            sdp,
            udp,
            ring_at: SocketAddr::new(ip, local.port()),
            waiting: Mutex::new(HashMap::new()),
            local,
        })
    }

    /// Answers probes and takes SDP clients from now on (the kernel's socket listens).
    pub fn open(self) -> io::Result<Arc<Listening>> {
        let l = Arc::new(self);
        responder()?.add(&l);
        log::info!("sdp_preload: {} takes SDP clients too (SDP listener {})", l.local, l.sdp.local_addr()?);
        Ok(l)
    }

    /// The SDP connection a doorbell from `peer` stands for, with the SDP client's address.
    pub fn take(&self, peer: SocketAddr) -> Option<(SdpStream, SocketAddr)> {
        let (stream, from, _doorbell) = self.waiting.lock().unwrap_or_else(|p| p.into_inner()).remove(&peer)?;
        Some((stream, from))
    }

    /// Stops answering probes for good: the UDP twin is replaced by an unbound socket, so new
    /// clients' probes are refused at once and they connect over TCP (see `crate::fork`).
    pub fn stop_probes(&self) {
        let domain = if self.local.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
        // The number stays valid for the responder, which then reads nothing from it.
        crate::real::fresh_socket_at(self.udp.as_raw_fd(), domain, libc::SOCK_DGRAM | libc::SOCK_NONBLOCK, true);
    }

    /// Answers what probes arrived.
    fn answer_probes(&self) {
        let Ok(port) = self.sdp.local_addr().map(|a| a.port()) else { return };
        let mut buf = [0u8; 64];
        while let Ok((n, from)) = self.udp.recv_from(&mut buf) {
            if let Some(nonce) = discovery::decode_probe(&buf[..n]) {
                let _ = self.udp.send_to(&discovery::encode_answer(nonce, port), from);
            }
        }
    }

    /// Takes the SDP clients that connected and rings the program's listening socket for each.
    fn ring_for_arrivals(&self) {
        loop {
            let (stream, from) = match self.sdp.accept() {
                Ok(got) => got,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    log::debug!("sdp_preload: an SDP client failed: {e}");
                    continue;
                }
            };
            // Known under its address before it connects: the program may accept it at once.
            let rung = bound_socket(self.ring_at).and_then(|(sock, key)| {
                let mut w = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
                w.insert(key, (stream, from, sock.try_clone()?));
                drop(w);
                let connected = connect_within(&sock, self.ring_at, RING_TIMEOUT);
                if connected.is_err() {
                    self.waiting.lock().unwrap_or_else(|p| p.into_inner()).remove(&key);
                }
                connected
            });
            if let Err(e) = rung {
                // The program's listening socket is gone or full: the client is dropped, as a
                // full backlog drops a TCP client.
                log::info!("sdp_preload: cannot ring {} for an SDP client: {e}", self.ring_at);
            }
        }
    }
}

/// A TCP socket bound to an ephemeral port of `to`'s family and loopback or address, not
/// connected yet, and its address.
fn bound_socket(to: SocketAddr) -> io::Result<(TcpStream, SocketAddr)> {
    let domain = if to.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    // SAFETY: plain socket creation; checked.
    let fd = unsafe { libc::socket(domain, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new socket nothing else owns.
    let sock = unsafe { <TcpStream as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let (storage, len) = crate::addr::sockaddr_of(SocketAddr::new(to.ip(), 0));
    // SAFETY: a valid address of `len` bytes.
    if unsafe { libc::bind(fd, &storage as *const _ as *const libc::sockaddr, len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let key = sock.local_addr()?;
    Ok((sock, key))
}

/// Connects a socket from [`bound_socket`] to `to`, waiting at most `limit`.
fn connect_within(sock: &TcpStream, to: SocketAddr, limit: Duration) -> io::Result<()> {
    let fd = sock.as_raw_fd();
    sock.set_nonblocking(true)?;
    let (storage, len) = crate::addr::sockaddr_of(to);
    // SAFETY: a valid address of `len` bytes.
    if unsafe { libc::connect(fd, &storage as *const _ as *const libc::sockaddr, len) } != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(e);
        }
        let mut p = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
        // SAFETY: one valid pollfd.
        if unsafe { libc::poll(&mut p, 1, limit.as_millis() as i32) } != 1 {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "the doorbell did not connect in time"));
        }
        if let Some(e) = sock.take_error()? {
            return Err(e);
        }
    }
    sock.set_nonblocking(false)
}

/// The thread that answers probes and rings for arrivals, for every listening socket.
struct Responder {
    listening: Mutex<Vec<Weak<Listening>>>,
    /// An eventfd written when a listening socket is added.
    bell: std::os::fd::OwnedFd,
}

impl Responder {
    fn add(&self, l: &Arc<Listening>) {
        self.listening.lock().unwrap_or_else(|p| p.into_inner()).push(Arc::downgrade(l));
        let one = 1u64;
        // SAFETY: 8 bytes from a local into our eventfd.
        unsafe { libc::write(self.bell.as_raw_fd(), &one as *const u64 as *const libc::c_void, 8) };
    }
}

fn responder() -> io::Result<&'static Responder> {
    static R: OnceLock<Result<Responder, String>> = OnceLock::new();
    let r = R.get_or_init(|| {
        // SAFETY: eventfd has no memory arguments; checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error().to_string());
        }
        // SAFETY: a new descriptor nothing else owns.
        let bell = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        portability_verbs::os::spawn_quiet("sdp-preload", run).map_err(|e| e.to_string())?;
        Ok(Responder { listening: Mutex::new(Vec::new()), bell })
    });
    r.as_ref().map_err(|e| io::Error::other(format!("starting the SDP responder: {e}")))
}

fn run() {
    Inside::forever();
    let r = loop {
        match responder() {
            Ok(r) => break r,
            Err(_) => std::thread::sleep(Duration::from_millis(1)),
        }
    };
    loop {
        let all: Vec<Arc<Listening>> = {
            let mut g = r.listening.lock().unwrap_or_else(|p| p.into_inner());
            g.retain(|l| l.strong_count() > 0);
            g.iter().filter_map(Weak::upgrade).collect()
        };
        let mut fds = vec![libc::pollfd { fd: r.bell.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
        for l in &all {
            l.answer_probes();
            l.ring_for_arrivals();
            fds.push(libc::pollfd { fd: l.udp.as_raw_fd(), events: libc::POLLIN, revents: 0 });
            fds.push(libc::pollfd { fd: l.sdp.as_raw_fd(), events: libc::POLLIN, revents: 0 });
        }
        drop(all);
        // SAFETY: a valid array of pollfd for the call.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 100) };
        let mut drained = 0u64;
        // SAFETY: 8 bytes into a local (EAGAIN when the bell did not ring).
        unsafe { libc::read(r.bell.as_raw_fd(), &mut drained as *mut u64 as *mut libc::c_void, 8) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A probe that comes after the twin is bound but before the server listens (and its
    /// twin is opened) waits for an answer instead of being refused.
    #[test]
    fn a_probe_sent_before_the_listener_opened_is_answered_once_it_opens() {
        let _in = Inside::enter();
        let bound = Listening::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let twin = bound.udp.local_addr().unwrap();
        let client = UdpSocket::bind("127.0.0.1:0").unwrap();
        client.send_to(&discovery::encode_probe(42), twin).unwrap();
        client.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        let mut buf = [0u8; 64];
        let early = client.recv_from(&mut buf).unwrap_err();
        assert!(matches!(early.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut), "{early}");
        let l = bound.open().unwrap();
        client.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let (n, _) = client.recv_from(&mut buf).unwrap();
        assert_eq!(discovery::decode_answer(&buf[..n], 42), Some(l.sdp.local_addr().unwrap().port()));
    }
}
