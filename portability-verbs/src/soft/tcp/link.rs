//! One TCP connection of a queue pair: the frames waiting to be written (gathered from
//! registered memory where they carry data) and the bytes read ahead of the frame being
//! parsed. Only how bytes move; what they mean is `soft::qp::tcp`'s.

use std::collections::VecDeque;
use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;

use smallvec::SmallVec;

use super::frame::{Frame, HEADER};
use crate::types::AccessFlags;

/// Bytes read ahead of the frame being parsed (small frames arrive many to a system call).
const STAGE_BYTES: usize = 16 * 1024;
/// A body at least this long (not yet read) is read straight into its destination.
const DIRECT_MIN: usize = 4096;
/// Header bytes batched in one piece before a new one starts.
const BATCH_BYTES: usize = 16 * 1024;
/// Pieces one `sendmsg` or `readv` takes at most.
const IOV_BATCH: usize = 64;

/// Part of the byte stream waiting to be written.
pub(crate) enum Piece {
    /// Headers and small data, batched.
    Bytes(Vec<u8>),
    /// Registered memory, checked against `key` with `need` each time it is written from
    /// (the region may be deregistered between two writes).
    Mem { addr: u64, len: usize, key: u32, need: AccessFlags },
}

/// The write side: pieces in stream order.
#[derive(Default)]
pub(crate) struct Tx {
    pieces: VecDeque<Piece>,
    /// Bytes of the front piece already written.
    front_done: usize,
    /// Bytes queued, not yet written.
    queued: usize,
}

/// Why a write stopped.
#[derive(Debug)]
pub(crate) enum TxError {
    /// The connection broke.
    Io(io::Error),
    /// A region the data came from was deregistered while queued.
    Unregistered,
}

impl Tx {
    pub fn queued(&self) -> usize {
        self.queued
    }

    pub fn is_empty(&self) -> bool {
        self.queued == 0
    }

    pub fn push_header(&mut self, f: &Frame) {
        self.push_bytes(&f.encode());
    }

    pub fn push_bytes(&mut self, b: &[u8]) {
        if b.is_empty() {
            return;
        }
        self.queued += b.len();
        if let Some(Piece::Bytes(v)) = self.pieces.back_mut() {
            if v.len() + b.len() <= BATCH_BYTES {
                v.extend_from_slice(b);
                return;
            }
        }
        let mut v = Vec::with_capacity(b.len().max(HEADER * 4));
        v.extend_from_slice(b);
        self.pieces.push_back(Piece::Bytes(v));
    }

    pub fn push_mem(&mut self, addr: u64, len: usize, key: u32, need: AccessFlags) {
        if len > 0 {
            self.queued += len;
            self.pieces.push_back(Piece::Mem { addr, len, key, need });
        }
    }

    /// Writes what the socket takes without blocking. `Ok(true)`: everything is written.
    /// `granted(key, addr, len, need)` re-checks a region before its bytes are handed to the
    /// kernel; the caller holds what keeps a granted region registered until this returns.
    pub fn flush(
        &mut self,
        sock: &TcpStream,
        granted: impl Fn(u32, u64, u64, AccessFlags) -> bool,
    ) -> Result<bool, TxError> {
        while !self.pieces.is_empty() {
            let mut iov: SmallVec<[libc::iovec; IOV_BATCH]> = SmallVec::new();
            for (i, p) in self.pieces.iter().take(IOV_BATCH).enumerate() {
                let skip = if i == 0 { self.front_done } else { 0 };
                let (base, len) = match p {
                    Piece::Bytes(v) => (v.as_ptr() as u64, v.len()),
                    Piece::Mem { addr, len, key, need } => {
                        if !granted(*key, *addr, *len as u64, *need) {
                            if i == 0 {
                                return Err(TxError::Unregistered);
                            }
                            break;
                        }
                        (*addr, *len)
                    }
                };
                iov.push(libc::iovec {
                    iov_base: (base + skip as u64) as usize as *mut libc::c_void,
                    iov_len: len - skip,
                });
            }
            // SAFETY: a zeroed msghdr is valid; it names only `iov`, which lives across the call.
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = iov.as_mut_ptr();
            msg.msg_iovlen = iov.len() as _;
            // SAFETY: every iovec names our batch buffers or a granted registration, readable
            // for its length while the caller holds off deregistration.
            let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EFAULT) {
                    // Pages held by `protect` (an AZ-SDP buffer in flight): the kernel cannot
                    // read them, the provider's copy can (through /proc/self/mem).
                    self.bounce_batch()?;
                    continue;
                }
                return match e.kind() {
                    io::ErrorKind::WouldBlock => Ok(false),
                    io::ErrorKind::Interrupted => continue,
                    _ => Err(TxError::Io(e)),
                };
            }
            self.advance(n as usize);
        }
        Ok(true)
    }

    /// Replaces the registered-memory pieces of the next batch by copies of their unwritten
    /// bytes, read the way the provider reads held pages.
    fn bounce_batch(&mut self) -> Result<(), TxError> {
        for i in 0..self.pieces.len().min(IOV_BATCH) {
            let skip = if i == 0 { self.front_done } else { 0 };
            if let Piece::Mem { addr, len, .. } = self.pieces[i] {
                let mut copy = vec![0u8; len - skip];
                // SAFETY: a registered range the caller's `granted` check covered in this
                // flush; `copy` is ours.
                let ok = unsafe {
                    super::super::dma::local_copy(copy.as_mut_ptr(), (addr as usize + skip) as *const u8, len - skip)
                };
                if !ok {
                    return Err(TxError::Unregistered);
                }
                self.pieces[i] = Piece::Bytes(copy);
                if i == 0 {
                    self.front_done = 0;
                }
            }
        }
        Ok(())
    }

    fn advance(&mut self, mut n: usize) {
        self.queued -= n;
        while n > 0 {
            let len = match self.pieces.front().expect("written bytes were queued") {
                Piece::Bytes(v) => v.len(),
                Piece::Mem { len, .. } => *len,
            };
            let left = len - self.front_done;
            if n < left {
                self.front_done += n;
                return;
            }
            n -= left;
            self.front_done = 0;
            self.pieces.pop_front();
        }
    }

    /// Forgets everything queued (the connection is gone).
    pub fn clear(&mut self) {
        self.pieces.clear();
        self.front_done = 0;
        self.queued = 0;
    }
}

/// Where a frame's data goes, in stream order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dest {
    /// Registered memory of this process, checked by whoever built the placement.
    Mem(u64, usize),
    /// Read and dropped.
    Drop(usize),
    /// The last 8 bytes of a write: stored after everything before them is in place, so a
    /// reader polling that word sees the whole write once it changed (as the polled pipe
    /// relies on).
    Last8(u64),
}

impl Dest {
    fn len(&self) -> usize {
        match *self {
            Dest::Mem(_, n) | Dest::Drop(n) => n,
            Dest::Last8(_) => 8,
        }
    }
}

/// A frame body being read into place.
#[derive(Debug, Default)]
pub(crate) struct Placement {
    dests: SmallVec<[Dest; 4]>,
    idx: usize,
    /// Bytes of `dests[idx]` done.
    off: usize,
    last8: [u8; 8],
    /// The destination refused a direct read (pages held by `protect`): go through the stage.
    bounce: bool,
}

impl Placement {
    pub fn new(dests: impl IntoIterator<Item = Dest>) -> Placement {
        Placement { dests: dests.into_iter().filter(|d| d.len() > 0).collect(), ..Default::default() }
    }

    /// `len` bytes into `addr`, the last 8 of them last when `last_word_last`.
    pub fn write_to(addr: u64, len: usize, last_word_last: bool) -> Placement {
        if last_word_last && len >= 16 {
            Placement::new([Dest::Mem(addr, len - 8), Dest::Last8(addr + len as u64 - 8)])
        } else {
            Placement::new([Dest::Mem(addr, len)])
        }
    }

    pub fn discard(len: usize) -> Placement {
        Placement::new([Dest::Drop(len)])
    }

    pub fn done(&self) -> bool {
        self.idx == self.dests.len()
    }

    fn left(&self) -> usize {
        self.dests[self.idx..].iter().map(Dest::len).sum::<usize>() - self.off
    }

    /// Takes up to `n` bytes at `src` into the current destination; returns how many.
    fn take_from(&mut self, src: *const u8, n: usize) -> Result<usize, io::Error> {
        let d = self.dests[self.idx];
        let k = (d.len() - self.off).min(n);
        match d {
            Dest::Mem(addr, _) => {
                // SAFETY: the destination was checked against a registration that the caller
                // keeps registered; `src` holds `k` bytes of the stage.
                if !unsafe { super::super::dma::local_copy((addr as usize + self.off) as *mut u8, src, k) } {
                    return Err(io::Error::from_raw_os_error(libc::EFAULT));
                }
            }
            Dest::Drop(_) => {}
            // SAFETY: `src` holds `k` bytes; `off + k <= 8`.
            Dest::Last8(_) => unsafe { std::ptr::copy_nonoverlapping(src, self.last8.as_mut_ptr().add(self.off), k) },
        }
        self.advance(k)?;
        Ok(k)
    }

    fn advance(&mut self, mut k: usize) -> Result<(), io::Error> {
        while k > 0 {
            let d = self.dests[self.idx];
            let step = (d.len() - self.off).min(k);
            self.off += step;
            k -= step;
            if self.off == d.len() {
                if let Dest::Last8(addr) = d {
                    // SAFETY: as for `Mem`; stored after every earlier byte of the write.
                    if !unsafe { super::super::dma::local_copy(addr as usize as *mut u8, self.last8.as_ptr(), 8) } {
                        return Err(io::Error::from_raw_os_error(libc::EFAULT));
                    }
                }
                self.idx += 1;
                self.off = 0;
            }
        }
        Ok(())
    }
}

/// The read side: bytes read ahead, and the header being assembled.
pub(crate) struct Rx {
    stage: Box<[u8]>,
    start: usize,
    end: usize,
    /// The last read took less than it asked for: the socket was empty then. The next read
    /// of this pass is skipped (it would almost always find nothing: a system call per
    /// message saved); data that came meanwhile is read by the next pass, which its arrival
    /// triggers (the engine's edge-triggered wake-up) or a poll makes.
    drained: bool,
}

impl Default for Rx {
    fn default() -> Self {
        Rx { stage: vec![0u8; STAGE_BYTES].into_boxed_slice(), start: 0, end: 0, drained: false }
    }
}

/// The peer closed its end (a read returned nothing).
pub(crate) fn closed() -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed the connection")
}

impl Rx {
    /// Reads into the stage without blocking; `Ok(false)`: nothing to read now.
    fn fill(&mut self, sock: &TcpStream) -> io::Result<bool> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.stage.len() - self.end < HEADER {
            self.stage.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        loop {
            let room = &mut self.stage[self.end..];
            // SAFETY: `room` is writable for its length.
            let n = unsafe {
                libc::recv(sock.as_raw_fd(), room.as_mut_ptr() as *mut libc::c_void, room.len(), libc::MSG_DONTWAIT)
            };
            if n > 0 {
                self.drained = (n as usize) < room.len();
                self.end += n as usize;
                return Ok(true);
            }
            if n == 0 {
                return Err(closed());
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => return Ok(false),
                _ => return Err(e),
            }
        }
    }

    /// True (once) when the socket was found empty by this pass's last read.
    fn was_drained(&mut self) -> bool {
        std::mem::replace(&mut self.drained, false)
    }

    /// The next frame header, if all of it has arrived.
    pub fn header(&mut self, sock: &TcpStream) -> io::Result<Option<[u8; HEADER]>> {
        while self.end - self.start < HEADER {
            if self.was_drained() || !self.fill(sock)? {
                return Ok(None);
            }
        }
        let h: [u8; HEADER] = self.stage[self.start..self.start + HEADER].try_into().expect("header bytes");
        self.start += HEADER;
        Ok(Some(h))
    }

    /// Moves the body into place as far as the bytes that arrived allow; `Ok(true)` once all
    /// of it is there.
    pub fn body(&mut self, sock: &TcpStream, p: &mut Placement) -> io::Result<bool> {
        loop {
            if p.done() {
                return Ok(true);
            }
            if self.start < self.end {
                let n = p.take_from(self.stage[self.start..].as_ptr(), self.end - self.start)?;
                self.start += n;
                continue;
            }
            if self.was_drained() {
                return Ok(false);
            }
            let direct = !p.bounce && p.left() >= DIRECT_MIN && matches!(p.dests[p.idx], Dest::Mem(..));
            if !direct {
                if !self.fill(sock)? {
                    return Ok(false);
                }
                continue;
            }
            let mut iov: SmallVec<[libc::iovec; 8]> = SmallVec::new();
            for (i, d) in p.dests[p.idx..].iter().enumerate().take(8) {
                let Dest::Mem(addr, len) = *d else { break };
                let skip = if i == 0 { p.off } else { 0 };
                iov.push(libc::iovec { iov_base: (addr as usize + skip) as *mut libc::c_void, iov_len: len - skip });
            }
            // SAFETY: a zeroed msghdr is valid; every iovec is a checked destination.
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = iov.as_mut_ptr();
            msg.msg_iovlen = iov.len() as _;
            // SAFETY: the destinations are registered memory the caller keeps registered.
            let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_DONTWAIT) };
            if n > 0 {
                let asked: usize = iov.iter().map(|v| v.iov_len).sum();
                self.drained = (n as usize) < asked;
                p.advance(n as usize)?;
                continue;
            }
            if n == 0 {
                return Err(closed());
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EAGAIN) => return Ok(false),
                // Pages held by `protect`: copy through the stage, which reaches them.
                Some(libc::EFAULT) => p.bounce = true,
                _ => return Err(e),
            }
        }
    }
}

/// Sets what every connection of the transport needs: no Nagle delay (requests are latency
/// bound and batched by us), non-blocking.
pub(crate) fn tune(sock: &TcpStream) -> io::Result<()> {
    sock.set_nodelay(true)?;
    sock.set_nonblocking(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::TcpListener;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        tune(&b).unwrap();
        (a, b)
    }

    #[test]
    fn bodies_land_in_place_with_the_last_word_last_across_partial_reads() {
        let (mut a, b) = pair();
        let mut rx = Rx::default();
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        let mut dst = vec![0u8; data.len()];
        let mut p = Placement::write_to(dst.as_mut_ptr() as u64, dst.len(), true);
        let f = Frame { len: data.len() as u32, ..Frame::new(super::super::frame::Kind::Write, 1) };
        a.write_all(&f.encode()).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let h = loop {
            if let Some(h) = rx.header(&b).unwrap() {
                break h;
            }
            assert!(std::time::Instant::now() < deadline);
        };
        assert_eq!(Frame::decode(&h).unwrap(), f);
        for chunk in data.chunks(7919) {
            a.write_all(chunk).unwrap();
            let _ = rx.body(&b, &mut p).unwrap();
        }
        while !rx.body(&b, &mut p).unwrap() {
            assert!(std::time::Instant::now() < deadline);
        }
        assert_eq!(dst, data);
        drop(a);
        let err = loop {
            match rx.header(&b) {
                Err(e) => break e,
                Ok(None) => assert!(std::time::Instant::now() < deadline),
                Ok(Some(_)) => panic!("no frame was sent"),
            }
        };
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn queued_pieces_are_written_in_order_and_a_revoked_region_stops_the_write() {
        let (a, mut b) = pair();
        b.set_nonblocking(false).unwrap();
        let mut tx = Tx::default();
        let mem = vec![5u8; 3000];
        tx.push_bytes(b"head");
        tx.push_mem(mem.as_ptr() as u64, mem.len(), 9, AccessFlags::NONE);
        tx.push_bytes(b"tail");
        assert!(tx.flush(&a, |k, _, _, _| k == 9).unwrap());
        let mut got = vec![0u8; 3008];
        std::io::Read::read_exact(&mut b, &mut got).unwrap();
        assert_eq!(&got[..4], b"head");
        assert!(got[4..3004].iter().all(|&x| x == 5));
        assert_eq!(&got[3004..], b"tail");
        tx.push_mem(mem.as_ptr() as u64, mem.len(), 9, AccessFlags::NONE);
        assert!(matches!(tx.flush(&a, |_, _, _, _| false), Err(TxError::Unregistered)));
    }
}
