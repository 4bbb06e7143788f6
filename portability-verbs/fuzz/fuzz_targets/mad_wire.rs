//! Fuzzes Madeleine's message decoder (pipe messages a peer sends), including the records of a
//! message sent whole, which its receiver decodes from its own copy, and the records a bulk
//! chunk carries, decoded one at a time in place.
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
    // A chunk that carries records: walk them as the receiver does, data after a Bulk.
    let mut at = 0;
    while at < data.len() {
        let Ok((rec, range, next)) = madeleine::wire::decode_in_chunk(data, at) else { break };
        assert!(range.end <= data.len() && next > at && next <= data.len());
        at = match rec {
            madeleine::wire::Record::Bulk { total, .. } => next.saturating_add(total.min(usize::MAX as u64) as usize),
            _ => next,
        };
    }
});
