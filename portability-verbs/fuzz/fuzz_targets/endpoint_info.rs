//! Fuzzes the decoder of endpoint information received from a peer.
#![no_main]
use libfuzzer_sys::fuzz_target;
use portability_verbs::EndpointInfo;

fuzz_target!(|data: &[u8]| {
    if let Ok(info) = EndpointInfo::decode(data) {
        assert_eq!(EndpointInfo::decode(&info.encode()).unwrap(), info);
    }
});
