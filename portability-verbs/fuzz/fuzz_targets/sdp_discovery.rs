//! Fuzzes the preload's discovery datagrams (`sockets_compat::discovery`): whatever arrives on
//! an accelerated port's UDP twin, or as an answer to a probe.
#![no_main]
use libfuzzer_sys::fuzz_target;
use sockets_compat::discovery::{decode_answer, decode_probe, encode_answer, encode_probe};

fuzz_target!(|data: &[u8]| {
    if let Some(n) = decode_probe(data) {
        assert_eq!(&encode_probe(n)[..], data);
    }
    let nonce = data.get(5..13).map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap()));
    if let Some(p) = decode_answer(data, nonce) {
        assert_eq!(&encode_answer(nonce, p)[..], data);
    }
});
