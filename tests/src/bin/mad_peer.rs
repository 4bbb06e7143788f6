//! Rank 1 of the cross-process Madeleine tests (`MAD_RANK=1 MAD_SIZE=2 MAD_RENDEZVOUS=dir`).
//! `mad_peer echo`: answers every message with the same packs; a message with a zero length
//! header ends it. `mad_peer half`: sends the first pack of a message, then waits to be killed.
//! `mad_peer soak <seed> <ms>`: messages of random sizes to rank 0 for `<ms>` milliseconds, each a length
//! (EXPRESS) and `tests::soak::payload` (CHEAPER), then one of length 0 whose body is the count.

use madeleine::*;

fn main() -> Result<()> {
    let session = Session::new(SessionConfig::from_env()?)?;
    let ch = session.channel()?;
    match std::env::args().nth(1).as_deref() {
        Some("echo") => loop {
            let mut body = Vec::new();
            let mut u = ch.begin_unpacking_from(0)?;
            let mut len = [0u8; 8];
            u.unpack_express(&mut len, SendMode::Cheaper)?;
            let n = u64::from_le_bytes(len) as usize;
            body.resize(n, 0);
            u.unpack(&mut body, SendMode::Cheaper, RecvMode::Cheaper)?;
            u.end_unpacking()?;
            if n == 0 {
                return ch.barrier();
            }
            let mut p = ch.begin_packing(0)?;
            p.pack(&len, SendMode::Cheaper, RecvMode::Express)?;
            p.pack(&body, SendMode::Cheaper, RecvMode::Cheaper)?;
            p.end_packing()?;
        },
        Some("half") => {
            let mut p = ch.begin_packing(0)?;
            p.pack_safer(&[1u8; 16], RecvMode::Express)?;
            // Send the first pack out, then hang until killed (never ending the message).
            p.flush()?;
            std::thread::sleep(std::time::Duration::from_secs(3600));
            p.end_packing()
        }
        Some("soak") => {
            let arg = |i: usize| std::env::args().nth(i).and_then(|a| a.parse::<u64>().ok()).unwrap_or(0);
            let (seed, ms) = (arg(2), arg(3));
            let mut rng = tests::soak::XorShift(seed | 1);
            let end = std::time::Instant::now() + std::time::Duration::from_millis(ms);
            let mut seq = 0u32;
            while std::time::Instant::now() < end {
                let len = if rng.below(3) == 0 { 1 + rng.below(2 << 20) } else { 1 + rng.below(16384) } as usize;
                let body = tests::soak::payload(seed, seq, len);
                let head = (len as u64).to_le_bytes();
                let mut p = ch.begin_packing(0)?;
                p.pack(&head, SendMode::Cheaper, RecvMode::Express)?;
                p.pack(&body, SendMode::Cheaper, RecvMode::Cheaper)?;
                p.end_packing()?;
                seq += 1;
                if rng.below(4) == 0 {
                    std::thread::sleep(std::time::Duration::from_micros(rng.below(3000)));
                }
            }
            let zero = 0u64.to_le_bytes();
            let mut p = ch.begin_packing(0)?;
            p.pack(&zero, SendMode::Cheaper, RecvMode::Express)?;
            p.pack_safer(&seq.to_le_bytes(), RecvMode::Express)?;
            p.end_packing()?;
            // Stay until rank 0 has read everything (it says so).
            let mut u = ch.begin_unpacking_from(0)?;
            u.unpack_express(&mut [0u8; 1], SendMode::Safer)?;
            u.end_unpacking()
        }
        _ => Err(MadError::Invalid("usage: mad_peer echo|half|soak".into())),
    }
}
