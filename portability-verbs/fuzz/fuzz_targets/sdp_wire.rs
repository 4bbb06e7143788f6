//! Fuzzes the SDP message decoder and sequence checker (everything an SDP peer sends).
#![no_main]
use libfuzzer_sys::fuzz_target;
use sockets_compat::wire::{Message, Sequencer};

fuzz_target!(|data: &[u8]| {
    let mut seq = Sequencer::default();
    // The input is a run of messages, each prefixed by a one-byte length.
    let mut rest = data;
    while let Some((&n, tail)) = rest.split_first() {
        let n = (n as usize).min(tail.len());
        let (msg, tail) = tail.split_at(n);
        rest = tail;
        if let Ok((h, m)) = Message::decode(msg) {
            // What decodes re-encodes to the same bytes.
            let mut out = Vec::new();
            m.encode(&h, &mut out);
            assert_eq!(out, msg);
            let _ = seq.accept(&h);
        }
    }
});
