//! Connection establishment: an out-of-band bootstrap over a unix or TCP socket that exchanges
//! queue-pair endpoints (and a little private data), the job `rdma_cm` does, behind
//! listen / accept / connect calls that return a connected queue pair in RTS.
//!
//! The frame codec ([`Frame`], [`FrameDecoder`]) is sans-IO; the functions below move its bytes.
//!
//! ```text
//! client                          server
//!   create QP, INIT
//!   HELLO(endpoint, private)  ->
//!                                  create QP, INIT, RTR(client)
//!                             <-   ACCEPT(endpoint, private)   (or REJECT(reason))
//!   RTR(server), RTS
//!   READY                     ->
//!                                  RTS
//! ```

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::endpoint::EndpointInfo;
use crate::error::{Result, VerbsError};
use crate::types::{AccessFlags, QpTransition, RtrAttr, RtsAttr};
use crate::verbs::{ProtectionDomain, QpInit, QueuePair};

const MAGIC: [u8; 4] = *b"PVCM";
const VERSION: u8 = 1;
const HEADER: usize = 8;
/// Largest frame payload.
pub const MAX_PAYLOAD: usize = 1024;
/// Largest private data a side may attach.
pub const MAX_PRIVATE: usize = 512;

/// A bootstrap message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// Client's endpoint and private data.
    Hello {
        /// Encoded endpoint.
        endpoint: EndpointInfo,
        /// Application bytes.
        private: Vec<u8>,
    },
    /// Server's endpoint and private data.
    Accept {
        /// Encoded endpoint.
        endpoint: EndpointInfo,
        /// Application bytes.
        private: Vec<u8>,
    },
    /// Client reached RTS.
    Ready,
    /// Refusal with a reason.
    Reject(String),
}

impl Frame {
    fn kind(&self) -> u8 {
        match self {
            Frame::Hello { .. } => 1,
            Frame::Accept { .. } => 2,
            Frame::Ready => 3,
            Frame::Reject(_) => 4,
        }
    }

    /// Encodes: magic, version, kind, u16 payload length, payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut payload = Vec::new();
        match self {
            Frame::Hello { endpoint, private } | Frame::Accept { endpoint, private } => {
                let ep = endpoint.encode();
                payload.push(ep.len() as u8);
                payload.extend_from_slice(&ep);
                payload.extend_from_slice(&(private.len().min(MAX_PRIVATE) as u16).to_le_bytes());
                payload.extend_from_slice(&private[..private.len().min(MAX_PRIVATE)]);
            }
            Frame::Ready => {}
            Frame::Reject(reason) => payload.extend_from_slice(&reason.as_bytes()[..reason.len().min(MAX_PAYLOAD)]),
        }
        let mut out = Vec::with_capacity(HEADER + payload.len());
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        out.push(self.kind());
        out.extend_from_slice(&(payload.len() as u16).to_le_bytes());
        out.extend_from_slice(&payload);
        out
    }

    fn decode_payload(kind: u8, p: &[u8]) -> Result<Frame> {
        let bad = |why: &str| VerbsError::Protocol(format!("bootstrap frame: {why}"));
        match kind {
            1 | 2 => {
                let (&ep_len, rest) = p.split_first().ok_or_else(|| bad("empty endpoint frame"))?;
                let ep_len = ep_len as usize;
                if rest.len() < ep_len + 2 {
                    return Err(bad("endpoint frame shorter than its lengths"));
                }
                let endpoint = EndpointInfo::decode(&rest[..ep_len])?;
                let priv_len = u16::from_le_bytes([rest[ep_len], rest[ep_len + 1]]) as usize;
                let private = &rest[ep_len + 2..];
                if private.len() != priv_len || priv_len > MAX_PRIVATE {
                    return Err(bad("private data length does not match"));
                }
                let private = private.to_vec();
                Ok(if kind == 1 { Frame::Hello { endpoint, private } } else { Frame::Accept { endpoint, private } })
            }
            3 if p.is_empty() => Ok(Frame::Ready),
            3 => Err(bad("READY with a payload")),
            4 => Ok(Frame::Reject(String::from_utf8_lossy(p).into_owned())),
            k => Err(bad(&format!("unknown kind {k}"))),
        }
    }
}

/// Accumulates bytes and yields whole frames.
#[derive(Default)]
pub struct FrameDecoder {
    buf: Vec<u8>,
}

impl FrameDecoder {
    /// Adds received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole frame, `Ok(None)` if more bytes are needed, or an error for garbage.
    pub fn next_frame(&mut self) -> Result<Option<Frame>> {
        if self.buf.len() < HEADER {
            if !MAGIC.starts_with(&self.buf[..self.buf.len().min(4)]) {
                return Err(VerbsError::Protocol("bootstrap frame: bad magic".into()));
            }
            return Ok(None);
        }
        if self.buf[..4] != MAGIC {
            return Err(VerbsError::Protocol("bootstrap frame: bad magic".into()));
        }
        if self.buf[4] != VERSION {
            return Err(VerbsError::Protocol(format!("bootstrap frame: version {}", self.buf[4])));
        }
        let len = u16::from_le_bytes([self.buf[6], self.buf[7]]) as usize;
        if len > MAX_PAYLOAD {
            return Err(VerbsError::Protocol("bootstrap frame: payload too long".into()));
        }
        if self.buf.len() < HEADER + len {
            return Ok(None);
        }
        let frame = Frame::decode_payload(self.buf[5], &self.buf[HEADER..HEADER + len]);
        self.buf.drain(..HEADER + len);
        frame.map(Some)
    }
}

/// Where a bootstrap listener lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CmAddr {
    /// A unix socket path.
    Unix(PathBuf),
    /// A TCP address.
    Tcp(SocketAddr),
}

impl std::str::FromStr for CmAddr {
    type Err = VerbsError;
    /// `unix:/path` or `host:port`.
    fn from_str(s: &str) -> Result<CmAddr> {
        if let Some(p) = s.strip_prefix("unix:") {
            return Ok(CmAddr::Unix(PathBuf::from(p)));
        }
        use std::net::ToSocketAddrs;
        s.to_socket_addrs()
            .map_err(|e| VerbsError::invalid(format!("address {s:?}: {e}")))?
            .next()
            .map(CmAddr::Tcp)
            .ok_or_else(|| VerbsError::invalid(format!("address {s:?} resolves to nothing")))
    }
}

impl std::fmt::Display for CmAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CmAddr::Unix(p) => write!(f, "unix:{}", p.display()),
            CmAddr::Tcp(a) => write!(f, "{a}"),
        }
    }
}

enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    fn addrs(&self) -> (Option<SocketAddr>, Option<SocketAddr>) {
        match self {
            Stream::Unix(_) => (None, None),
            Stream::Tcp(s) => (s.local_addr().ok(), s.peer_addr().ok()),
        }
    }
    fn set_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_read_timeout(t).and(s.set_write_timeout(t)),
            Stream::Tcp(s) => s.set_read_timeout(t).and(s.set_write_timeout(t)),
        }
    }
    fn io(&mut self) -> &mut dyn ReadWrite {
        match self {
            Stream::Unix(s) => s,
            Stream::Tcp(s) => s,
        }
    }
}

trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

/// A connected queue pair with what the peer attached.
pub struct Connection {
    /// The queue pair, in RTS.
    pub qp: QueuePair,
    /// The peer's private data.
    pub peer_private: Vec<u8>,
    /// Our end of the bootstrap socket, when it was TCP (what SDP reports as `local_addr`).
    pub local_addr: Option<SocketAddr>,
    /// The peer's end of the bootstrap socket, when it was TCP.
    pub peer_addr: Option<SocketAddr>,
}

/// Listens for bootstrap connections.
pub struct Listener {
    inner: ListenerImpl,
    addr: CmAddr,
}

enum ListenerImpl {
    Unix(UnixListener),
    Tcp(TcpListener),
}

fn io_err(what: &str) -> impl FnOnce(std::io::Error) -> VerbsError + '_ {
    move |e| {
        if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
            VerbsError::PeerUnreachable(format!("{what}: peer did not answer in time"))
        } else {
            VerbsError::os(what, e)
        }
    }
}

impl Listener {
    /// Binds a listener (a stale unix socket file at the path is replaced).
    pub fn bind(addr: &CmAddr) -> Result<Listener> {
        let inner = match addr {
            CmAddr::Unix(p) => {
                let _ = std::fs::remove_file(p);
                ListenerImpl::Unix(UnixListener::bind(p).map_err(io_err("binding the bootstrap socket"))?)
            }
            CmAddr::Tcp(a) => ListenerImpl::Tcp(TcpListener::bind(a).map_err(io_err("binding the bootstrap socket"))?),
        };
        let addr = match (&inner, addr) {
            (ListenerImpl::Tcp(l), _) => CmAddr::Tcp(l.local_addr().map_err(io_err("local address"))?),
            (_, a) => a.clone(),
        };
        Ok(Listener { inner, addr })
    }

    /// The bound address (with the real port for TCP port 0).
    pub fn local_addr(&self) -> &CmAddr {
        &self.addr
    }

    /// Accepts one client within `timeout` and connects a new queue pair to it.
    pub fn accept(
        &self,
        pd: &ProtectionDomain,
        init: &QpInit<'_>,
        private: &[u8],
        timeout: Duration,
    ) -> Result<Connection> {
        let deadline = Deadline::after(timeout);
        let mut stream = self.accept_stream(deadline)?;
        stream.set_timeout(Some(deadline.left()?)).map_err(io_err("socket timeout"))?;
        let mut dec = FrameDecoder::default();
        let (client, peer_private) = match read_frame(&mut stream, &mut dec, deadline)? {
            Frame::Hello { endpoint, private } => (endpoint, private),
            other => return Err(VerbsError::Protocol(format!("expected HELLO, got {other:?}"))),
        };
        let qp = pd.create_qp(init)?;
        let setup = qp
            .modify(QpTransition::Init { access: AccessFlags::ALL, port: 1 })
            .and_then(|_| qp.modify(QpTransition::Rtr(RtrAttr::new(client))));
        if let Err(e) = setup {
            let _ = write_frame(&mut stream, &Frame::Reject(e.to_string()));
            return Err(e);
        }
        write_frame(&mut stream, &Frame::Accept { endpoint: qp.endpoint(), private: private.to_vec() })?;
        match read_frame(&mut stream, &mut dec, deadline)? {
            Frame::Ready => {}
            other => return Err(VerbsError::Protocol(format!("expected READY, got {other:?}"))),
        }
        qp.modify(QpTransition::Rts(RtsAttr::default()))?;
        let (local_addr, peer_addr) = stream.addrs();
        Ok(Connection { qp, peer_private, local_addr, peer_addr })
    }

    fn accept_stream(&self, deadline: Deadline) -> Result<Stream> {
        let fd = match &self.inner {
            ListenerImpl::Unix(l) => std::os::fd::AsRawFd::as_raw_fd(l),
            ListenerImpl::Tcp(l) => std::os::fd::AsRawFd::as_raw_fd(l),
        };
        if !crate::soft::sys::wait_readable(fd, Some(deadline.left()?))? {
            return Err(deadline.expired());
        }
        Ok(match &self.inner {
            ListenerImpl::Unix(l) => Stream::Unix(l.accept().map_err(io_err("accept"))?.0),
            ListenerImpl::Tcp(l) => {
                let s = l.accept().map_err(io_err("accept"))?.0;
                let _ = s.set_nodelay(true);
                Stream::Tcp(s)
            }
        })
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let CmAddr::Unix(p) = &self.addr {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Connects to a listener within `timeout`, returning a queue pair in RTS.
pub fn connect(
    addr: &CmAddr,
    pd: &ProtectionDomain,
    init: &QpInit<'_>,
    private: &[u8],
    timeout: Duration,
) -> Result<Connection> {
    let deadline = Deadline::after(timeout);
    let mut stream = loop {
        let attempt = match addr {
            CmAddr::Unix(p) => UnixStream::connect(p).map(Stream::Unix),
            CmAddr::Tcp(a) => TcpStream::connect_timeout(a, deadline.left()?).map(Stream::Tcp),
        };
        match attempt {
            Ok(s) => break s,
            // The listener may not be up yet: retry until the deadline.
            Err(e) if matches!(e.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused) => {
                if deadline.passed() {
                    return Err(VerbsError::PeerUnreachable(format!("no listener at {addr}: {e}")));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(io_err("connect")(e)),
        }
    };
    stream.set_timeout(Some(deadline.left()?)).map_err(io_err("socket timeout"))?;
    let qp = pd.create_qp(init)?;
    qp.modify(QpTransition::Init { access: AccessFlags::ALL, port: 1 })?;
    write_frame(&mut stream, &Frame::Hello { endpoint: qp.endpoint(), private: private.to_vec() })?;
    let mut dec = FrameDecoder::default();
    let (server, peer_private) = match read_frame(&mut stream, &mut dec, deadline)? {
        Frame::Accept { endpoint, private } => (endpoint, private),
        Frame::Reject(why) => return Err(VerbsError::PeerUnreachable(format!("peer rejected the connection: {why}"))),
        other => return Err(VerbsError::Protocol(format!("expected ACCEPT, got {other:?}"))),
    };
    qp.modify(QpTransition::Rtr(RtrAttr::new(server)))?;
    qp.modify(QpTransition::Rts(RtsAttr::default()))?;
    write_frame(&mut stream, &Frame::Ready)?;
    let (local_addr, peer_addr) = stream.addrs();
    Ok(Connection { qp, peer_private, local_addr, peer_addr })
}

/// When a set-up step gives up, and the timeout it was given (what its error reports).
#[derive(Clone, Copy)]
struct Deadline {
    at: Instant,
    timeout: Duration,
}

impl Deadline {
    fn after(timeout: Duration) -> Deadline {
        Deadline { at: Instant::now() + timeout, timeout }
    }

    fn passed(&self) -> bool {
        Instant::now() >= self.at
    }

    fn expired(&self) -> VerbsError {
        VerbsError::Timeout(self.timeout)
    }

    /// Time left, or the timeout error once none is.
    fn left(&self) -> Result<Duration> {
        let d = self.at.saturating_duration_since(Instant::now());
        if d.is_zero() {
            Err(self.expired())
        } else {
            Ok(d)
        }
    }
}

fn write_frame(s: &mut Stream, f: &Frame) -> Result<()> {
    s.io().write_all(&f.encode()).map_err(io_err("sending a bootstrap frame"))
}

fn read_frame(s: &mut Stream, dec: &mut FrameDecoder, deadline: Deadline) -> Result<Frame> {
    let mut buf = [0u8; 512];
    loop {
        if let Some(f) = dec.next_frame()? {
            return Ok(f);
        }
        s.set_timeout(Some(deadline.left()?)).map_err(io_err("socket timeout"))?;
        let n = s.io().read(&mut buf).map_err(io_err("reading a bootstrap frame"))?;
        if n == 0 {
            return Err(VerbsError::PeerUnreachable("bootstrap peer closed the connection".into()));
        }
        dec.push(&buf[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::HwEndpoint;
    use proptest::prelude::*;

    fn ep() -> EndpointInfo {
        EndpointInfo::Hardware(HwEndpoint { lid: 1, gid: [2; 16], gid_index: 0, port: 1, qpn: 77, psn: 5, mtu: 5 })
    }

    #[test]
    fn frames_round_trip_through_split_delivery() {
        let frames = vec![
            Frame::Hello { endpoint: ep(), private: b"hi".to_vec() },
            Frame::Accept { endpoint: ep(), private: vec![] },
            Frame::Ready,
            Frame::Reject("no".into()),
        ];
        let bytes: Vec<u8> = frames.iter().flat_map(|f| f.encode()).collect();
        let mut dec = FrameDecoder::default();
        let mut got = Vec::new();
        for b in bytes {
            dec.push(&[b]);
            while let Some(f) = dec.next_frame().unwrap() {
                got.push(f);
            }
        }
        assert_eq!(got, frames);
    }

    proptest! {
        #[test]
        fn garbage_never_panics(chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 0..8)) {
            let mut dec = FrameDecoder::default();
            for c in chunks {
                dec.push(&c);
                match dec.next_frame() {
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
        }
    }
}
