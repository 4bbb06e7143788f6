//! Fuzzes the decoder of ring records a peer writes into our shared ring.
#![no_main]
use libfuzzer_sys::fuzz_target;
use portability_verbs::soft::wire::{decode_descriptors, RecordHeader, FIELDS_BYTES, HEADER_BYTES, RECORD_ALIGN};

fuzz_target!(|data: &[u8]| {
    if data.len() < FIELDS_BYTES + 4 {
        return;
    }
    let fields: [u8; FIELDS_BYTES] = data[..FIELDS_BYTES].try_into().unwrap();
    let ring = 1usize << (12 + data[FIELDS_BYTES] % 10);
    let offset = (u16::from_le_bytes([data[FIELDS_BYTES + 1], data[FIELDS_BYTES + 2]]) as usize * RECORD_ALIGN) % ring;
    if let Ok(h) = RecordHeader::decode(&fields, offset, ring) {
        assert!(offset + h.record_size() <= ring);
        assert!(HEADER_BYTES + h.payload_len() <= h.record_size());
    }
    let _ = decode_descriptors(&data[FIELDS_BYTES + 3..], u32::from_le_bytes(fields[4..8].try_into().unwrap()));
});
