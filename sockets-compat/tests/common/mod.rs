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
