//! Fuzzes Madeleine's message decoder (pipe messages a peer sends).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(recs) = madeleine::wire::decode(data) {
        for (_, range) in recs {
            assert!(range.end <= data.len());
        }
    }
});
