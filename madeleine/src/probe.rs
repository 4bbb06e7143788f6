//! Where rendezvous (zero-copy) starts to pay, chosen per connection when it is set up.
//!
//! Below the threshold a large pack is copied through the bulk lane, the sender's copy in and
//! the receiver's copy out overlapping; above it the receiver RDMA-reads it from the sender's
//! memory. Which is faster depends on the transport between the two processes: between
//! threads of one process a read is a `memcpy`, between processes of one host it goes through
//! cross-memory attach (several times slower than `memcpy` here), on a network it runs at the
//! link's speed. So each end measures it: both register an ordinary (heap) buffer, exchange
//! its key, and in turn time RDMA reads of a few bytes and of [`PROBE_BYTES`] from the peer's
//! (the other end polling meanwhile, as the sender of a rendezvous does); the
//! crossover tuner turns that and this process's copy curve into the threshold, and the
//! connection's [`AdaptiveCrossover`] keeps the read's figures to lower it while the sender's
//! copies run slower than at set-up.

use std::time::{Duration, Instant};

use portability_verbs::datapath::{crossover, AdaptiveCrossover, MsgPipe};
use portability_verbs::{AccessFlags, Provider, SendWr, WcStatus};

use crate::resources::Resources;
use crate::{MadError, Result};

/// Bytes of the large probe read.
pub const PROBE_BYTES: usize = 256 * 1024;
const OFFER: &[u8; 8] = b"MADPROBE";
const DONE: &[u8; 8] = b"MADPDONE";
/// The lower rank's reads are over: the other end reads now.
const TURN: &[u8; 8] = b"MADPTURN";
/// A near tie goes to zero-copy (it saves the second copy's CPU time and memory traffic).
const SLACK: f64 = 0.25;

/// Runs the probe exchange with `peer` over `pipe` (both ends call this at the same point of
/// the connection's set-up, whatever their configuration) and returns the rendezvous crossover
/// for packs sent to it: `configured` if given, fixed (then this end offers its buffer but
/// reads nothing), else measured and adaptive.
pub(crate) fn rendezvous_crossover(
    pipe: &mut MsgPipe,
    s: &Resources,
    peer: usize,
    configured: Option<usize>,
) -> Result<AdaptiveCrossover> {
    let bad = |why: String| MadError::Protocol { rank: peer, why: format!("transport probe: {why}") };
    let timeout = s.cfg.timeout;
    let src = s.pd.register(vec![0x5a; PROBE_BYTES].into_boxed_slice(), AccessFlags::REMOTE_READ)?;
    let dst = s.pd.register(vec![0; PROBE_BYTES].into_boxed_slice(), AccessFlags::LOCAL_WRITE)?;
    let mut offer = OFFER.to_vec();
    offer.extend_from_slice(&src.addr().to_le_bytes());
    offer.extend_from_slice(&src.rkey().to_le_bytes());
    offer.extend_from_slice(&(PROBE_BYTES as u32).to_le_bytes());
    pipe.send(&offer, timeout)?;
    pipe.flush()?;
    let theirs = pipe.recv(timeout)?;
    if theirs.len() != 24 || &theirs[..8] != OFFER {
        return Err(bad(format!("expected an offer, got {} bytes", theirs.len())));
    }
    let addr = u64::from_le_bytes(theirs[8..16].try_into().expect("8 bytes"));
    let rkey = u32::from_le_bytes(theirs[16..20].try_into().expect("4 bytes"));
    let len = u32::from_le_bytes(theirs[20..24].try_into().expect("4 bytes")) as usize;
    if len != PROBE_BYTES {
        return Err(bad(format!("a {len}-byte probe buffer")));
    }
    // Fastest of a few reads: the first pays for faults and first lookups.
    let time_read = |pipe: &mut MsgPipe, n: usize| -> Result<Duration> {
        let mut best = Duration::MAX;
        for _ in 0..4 {
            let t = Instant::now();
            // Posted as a rendezvous read is, so that it costs what one costs.
            let Some(token) = pipe.post_user_completing(SendWr::read(0, &[dst.sge(0, n)], addr, rkey))? else {
                best = best.min(t.elapsed());
                continue;
            };
            let deadline = t + timeout;
            loop {
                pipe.progress()?;
                match pipe.take_user_completion(token) {
                    Some(WcStatus::Success) => break,
                    Some(st) => return Err(bad(format!("reading the peer's probe buffer: {st:?}"))),
                    None if Instant::now() > deadline => {
                        return Err(MadError::Timeout(format!("probe read from rank {peer}")))
                    }
                    None => std::hint::spin_loop(),
                }
            }
            best = best.min(t.elapsed());
        }
        Ok(best)
    };
    let measure = |pipe: &mut MsgPipe| -> Result<Option<(Duration, Duration)>> {
        Ok(match configured {
            Some(_) => None,
            None => Some((time_read(pipe, 8)?, time_read(pipe, PROBE_BYTES)?)),
        })
    };
    let expect = |pipe: &mut MsgPipe, what: &[u8; 8], why: &str| -> Result<()> {
        if pipe.recv(timeout)? != what {
            return Err(bad(format!("expected {why}")));
        }
        Ok(())
    };
    // The ends read in turn, the lower rank first, while the other waits on the pipe: a
    // waiting end polls, so it copies its share of the read (the back half) as the sender of
    // a live rendezvous does while it waits for its release. Reading at once, each end copied
    // alone: 256 KiB reads took 13-30 us here, against 11.0-11.2 in turn.
    let measured = if s.cfg.rank < peer {
        let measured = measure(pipe)?;
        // Our reads are over: the peer's turn. Our buffer stays until it is done.
        pipe.send(TURN, timeout)?;
        pipe.flush()?;
        expect(pipe, DONE, "the end of the probe")?;
        measured
    } else {
        expect(pipe, TURN, "the peer's turn to read")?;
        let measured = measure(pipe)?;
        pipe.send(DONE, timeout)?;
        pipe.flush()?;
        measured
    };
    let Some((small, big)) = measured else {
        return Ok(AdaptiveCrossover::fixed(configured.map_or(usize::MAX, |t| t.max(1))));
    };
    let curve = crossover::copy_curve();
    let threshold = match s.ctx.provider() {
        // On a network the link bounds the bulk lane and zero-copy alike: zero-copy pays once
        // copying costs more than its round trip (the small read).
        Provider::Hardware => crossover::crossover_from(curve, small),
        Provider::Software => crossover::zero_copy_threshold(curve, small, big, PROBE_BYTES, SLACK),
    };
    log::info!(
        "madeleine: transport to rank {peer}: read of 8 B {small:?}, of {PROBE_BYTES} B {big:?}; rendezvous from {}",
        if threshold == usize::MAX { "never".to_string() } else { format!("{threshold} B") }
    );
    Ok(AdaptiveCrossover::new(threshold, small, big, PROBE_BYTES))
}
