//! Rank 1 of the cross-process Madeleine tests (`MAD_RANK=1 MAD_SIZE=2 MAD_RENDEZVOUS=dir`).
//! `mad_peer echo`: answers every message with the same packs; a message with a zero length
//! header ends it. `mad_peer half`: sends the first pack of a message, then waits to be killed.

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
        _ => Err(MadError::Invalid("usage: mad_peer echo|half".into())),
    }
}
