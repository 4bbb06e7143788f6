//! Fuzzes the flow-control record parser (chunks and buffers a peer fills).
#![no_main]
use libfuzzer_sys::fuzz_target;
use portability_verbs::datapath::fc::{parse_chunk, RingReceiver};

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
});
