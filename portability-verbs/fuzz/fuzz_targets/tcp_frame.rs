//! Fuzzes the decoder of the frame headers a peer sends over the software provider's TCP
//! transport: every header decodes to a valid frame that re-encodes to the same bytes, or is
//! refused.
#![no_main]
use libfuzzer_sys::fuzz_target;
use portability_verbs::soft::tcp::frame::{Frame, HEADER};
use portability_verbs::soft::wire::MAX_MESSAGE;

fuzz_target!(|data: &[u8]| {
    if data.len() < HEADER {
        return;
    }
    let h: [u8; HEADER] = data[..HEADER].try_into().unwrap();
    if let Ok(f) = Frame::decode(&h) {
        assert!(f.data_len() <= MAX_MESSAGE);
        assert_eq!(f.encode(), h);
    }
});
