//! Fuzzes the bootstrap frame decoder with arbitrarily split input.
#![no_main]
use libfuzzer_sys::fuzz_target;
use portability_verbs::cm::FrameDecoder;

fuzz_target!(|data: &[u8]| {
    let mut dec = FrameDecoder::default();
    for chunk in data.chunks(7) {
        dec.push(chunk);
        loop {
            match dec.next_frame() {
                Ok(Some(_)) => continue,
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
});
