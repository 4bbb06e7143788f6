//! The soak test's pieces shared by the test and its peer processes: a framed stream of random
//! sizes whose every byte the reader can check, and counts of what a process holds (to find
//! leaks).
//!
//! A frame is `[len u32][seq u32]` then `len` bytes of [`payload`]`(seed, seq)`; a frame of
//! length 0 ends the stream, its `seq` the number of frames before it.

use std::io::{self, Read, Write};
use std::time::{Duration, Instant};

/// A small deterministic random source.
pub struct XorShift(pub u64);

impl XorShift {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// The bytes of frame `seq` of stream `seed`.
pub fn payload(seed: u64, seq: u32, len: usize) -> Vec<u8> {
    let mut x = XorShift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seq as u64 | 1);
    (0..len).map(|_| x.next_u64() as u8).collect()
}

/// Writes frames of random sizes (up to `max` bytes) with random pauses for `run`, then the end
/// frame; returns the frames written. Every frame is built in one buffer, kept until the end
/// (AZ-SDP reads a written buffer after `write` returned, until `flush`: a buffer freed
/// before may be unmapped and its addresses reused, and the peer would read what lies there
/// then).
pub fn write_frames(s: &mut impl Write, seed: u64, max: u64, run: Duration) -> io::Result<u32> {
    let mut rng = XorShift(seed | 1);
    let end = Instant::now() + run;
    let mut seq = 0u32;
    let mut frame = Vec::with_capacity(8 + max as usize);
    while Instant::now() < end {
        let len = match rng.below(4) {
            0 => 1 + rng.below(64),
            1 => 1 + rng.below(8192),
            _ => 1 + rng.below(max),
        } as usize;
        frame.clear();
        frame.extend_from_slice(&(len as u32).to_le_bytes());
        frame.extend_from_slice(&seq.to_le_bytes());
        frame.extend_from_slice(&payload(seed, seq, len));
        s.write_all(&frame)?;
        seq += 1;
        if rng.below(4) == 0 {
            std::thread::sleep(Duration::from_micros(rng.below(3000)));
        }
    }
    let mut last = [0u8; 8];
    last[4..].copy_from_slice(&seq.to_le_bytes());
    s.write_all(&last)?;
    s.flush()?;
    Ok(seq)
}

/// How a framed stream ended for its reader.
#[derive(Debug)]
pub enum StreamEnd {
    /// The end frame, after every frame it counts (`frames`, `bytes` of payload), all intact.
    Complete { frames: u32, bytes: u64 },
    /// An error after `frames` intact frames of `bytes` (a peer that died).
    Failed { frames: u32, bytes: u64, kind: io::ErrorKind, at: Instant },
}

/// Reads a framed stream, checking every byte; a corrupt frame, a frame out of sequence or an
/// EOF without the end frame is an error of its own (`Err`), never a `StreamEnd`.
pub fn read_frames(s: &mut impl Read, seed: u64) -> Result<StreamEnd, String> {
    let (mut seq, mut bytes) = (0u32, 0u64);
    let mut body = Vec::new();
    loop {
        let mut head = [0u8; 8];
        if let Err(e) = s.read_exact(&mut head) {
            return match e.kind() {
                io::ErrorKind::UnexpectedEof => Err(format!("EOF after {seq} frames without the end frame")),
                kind => Ok(StreamEnd::Failed { frames: seq, bytes, kind, at: Instant::now() }),
            };
        }
        let len = u32::from_le_bytes(head[..4].try_into().expect("4")) as usize;
        let got_seq = u32::from_le_bytes(head[4..].try_into().expect("4"));
        if len == 0 {
            return if got_seq == seq {
                Ok(StreamEnd::Complete { frames: seq, bytes })
            } else {
                Err(format!("end frame says {got_seq}, {seq} came"))
            };
        }
        if got_seq != seq {
            return Err(format!("frame {got_seq} where {seq} was due"));
        }
        body.resize(len, 0);
        if let Err(e) = s.read_exact(&mut body) {
            return Ok(StreamEnd::Failed { frames: seq, bytes, kind: e.kind(), at: Instant::now() });
        }
        if body != payload(seed, seq, len) {
            return Err(format!("frame {seq} of {len} bytes corrupted"));
        }
        seq += 1;
        bytes += len as u64;
    }
}

/// What a process holds that a leak would grow: open descriptors, provider segments mapped
/// (`memfd:pv-`), threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Holdings {
    pub fds: usize,
    pub segments: usize,
    pub threads: usize,
}

impl Holdings {
    pub fn now() -> Holdings {
        let count = |dir: &str| std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0);
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
        Holdings {
            fds: count("/proc/self/fd"),
            segments: maps.lines().filter(|l| l.contains("memfd:pv-")).count(),
            threads: count("/proc/self/task"),
        }
    }

    /// Waits up to `limit` for the holdings to come back to at most `base`.
    pub fn settle_to(base: Holdings, limit: Duration) -> Result<(), Holdings> {
        let end = Instant::now() + limit;
        loop {
            let h = Holdings::now();
            if h.fds <= base.fds && h.segments <= base.segments && h.threads <= base.threads {
                return Ok(());
            }
            if Instant::now() > end {
                return Err(h);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
