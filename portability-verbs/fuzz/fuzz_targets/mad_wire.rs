//! Fuzzes Madeleine's message decoder (pipe messages a peer sends), including the records of a
//! message sent whole, which its receiver decodes from its own copy.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(recs) = madeleine::wire::decode(data) {
        for (rec, range) in recs {
            assert!(range.end <= data.len());
            if let madeleine::wire::Record::Whole { .. } = rec {
                let body = &data[range];
                if let Ok(inner) = madeleine::wire::decode(body) {
                    assert!(inner.iter().all(|(_, r)| r.end <= body.len()));
                }
            }
        }
    }
});
