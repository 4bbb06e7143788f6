//! Helpers shared by the socket tests.
#![allow(dead_code)]

use std::thread;
use std::time::Duration;

use sockets_compat::{SdpConfig, SdpListener, SdpStream};

/// A deterministic pseudo-random byte source (xorshift), so failures reproduce.
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

pub fn pair(client: SdpConfig, server: SdpConfig) -> (SdpStream, SdpStream) {
    let l = SdpListener::bind_with("127.0.0.1:0", server).unwrap();
    let addr = l.local_addr().unwrap();
    let t = thread::spawn(move || SdpStream::connect_with(addr, client).unwrap());
    let (s, peer) = l.accept_timeout(Duration::from_secs(20)).unwrap();
    let c = t.join().unwrap();
    assert_eq!(peer, c.local_addr().unwrap());
    assert_eq!(s.local_addr().unwrap(), addr);
    assert_eq!(c.peer_addr().unwrap(), addr);
    for x in [&s, &c] {
        x.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        x.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
    }
    (c, s)
}

/// Page-aligned anonymous memory of its own mapping, unmapped on drop.
pub struct Pages {
    pub ptr: *mut u8,
    pub len: usize,
}

// SAFETY: plain memory; the tests hand it between threads like a Vec.
unsafe impl Send for Pages {}

impl Pages {
    pub fn new(len: usize) -> Pages {
        // SAFETY: a private anonymous mapping with no preconditions.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        Pages { ptr: p.cast(), len }
    }
    pub fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is `len` bytes, owned by self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        // SAFETY: unmaps what `new` mapped.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}
