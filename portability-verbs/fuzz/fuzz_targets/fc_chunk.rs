//! Fuzzes the flow-control record parser (chunks and buffers a peer fills) and the search
//! for polled frames in a ring a peer writes.
#![no_main]
use libfuzzer_sys::fuzz_target;
use portability_verbs::datapath::fc::{parse_chunk, poll_frame, RingReceiver, RingWords};

struct Ring<'a>(&'a [u8]);

impl RingWords for Ring<'_> {
    fn word(&self, off: u64) -> u64 {
        u64::from_le_bytes(self.0[off as usize..off as usize + 8].try_into().unwrap())
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(recs) = parse_chunk(data) {
        for (_, range) in recs {
            assert!(range.end <= data.len());
        }
    }
    // Chunk announcements: (length, wrapped) pairs against a small ring.
    let mut r = RingReceiver::new(4096);
    for pair in data.chunks_exact(3) {
        let len = u16::from_le_bytes([pair[0], pair[1]]) as u64;
        if let Ok(off) = r.on_chunk(len, pair[2] & 1 == 1) {
            assert!(off + len <= 4096);
            r.consume_to(r.received());
        }
    }
    // A polled ring holding the peer's bytes: every frame found lies inside it.
    let mut ring = vec![0u8; 4096];
    let n = data.len().min(4096);
    ring[..n].copy_from_slice(&data[..n]);
    let mut rx = RingReceiver::new(4096);
    while let Ok(Some(f)) = poll_frame(&mut rx, &Ring(&ring)) {
        assert!(f.body_off as usize + f.body_len <= 4096);
        let _ = parse_chunk(&ring[f.body_off as usize..f.body_off as usize + f.body_len]);
        rx.consume_to(f.end_pos);
    }
});
