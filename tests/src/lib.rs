//! Shared helpers of the cross-crate tests: providers to run against, connected pairs, waits
//! with timeouts, and the peer process used by cross-process tests.

use std::time::Duration;

use portability_verbs::*;

/// Every wait in a test gives up after this long, so a bug fails a test instead of hanging CI.
pub const WAIT: Duration = Duration::from_secs(10);

/// The contexts to run a conformance test on: the software provider always (over shared memory
/// and over its TCP transport), the hardware one
/// when compiled in and a device exists (otherwise the reason it is skipped is printed).
pub fn contexts() -> Vec<Context> {
    let mut v = vec![
        Context::open(Provider::Software).expect("software provider opens"),
        Context::open_soft(SoftConfig { tcp_only: true, ..SoftConfig::default() })
            .expect("software provider over TCP opens"),
    ];
    match Context::open(Provider::Hardware) {
        Ok(c) => v.push(c),
        Err(e) => eprintln!("skipping the hardware provider: {e}"),
    }
    v
}

/// True for a software context whose queue pairs talk over its TCP transport (no shared
/// memory with the peer: nothing completes at post, no windows onto peer memory).
pub fn over_tcp(ctx: &Context) -> bool {
    ctx.soft_config().is_some_and(|c| c.tcp_only)
}

/// Two connected queue pairs of one context, each with its own completion queue, and one
/// registered buffer per side.
pub struct Pair {
    pub ctx: Context,
    pub pd: ProtectionDomain,
    pub cq_a: CompletionQueue,
    pub cq_b: CompletionQueue,
    pub a: QueuePair,
    pub b: QueuePair,
    pub mr_a: MemoryRegion,
    pub mr_b: MemoryRegion,
}

/// Builds a [`Pair`] with `len`-byte buffers and every right on both regions.
pub fn pair(ctx: &Context, len: usize) -> Pair {
    pair_with(ctx, len, RtsAttr::default(), 12)
}

/// Builds a [`Pair`] with explicit RTS attributes and receiver-not-ready timer code.
pub fn pair_with(ctx: &Context, len: usize, rts: RtsAttr, min_rnr_timer: u8) -> Pair {
    let pd = ctx.alloc_pd().unwrap();
    let cq_a = ctx.create_cq(1024).unwrap();
    let cq_b = ctx.create_cq(1024).unwrap();
    let a = pd.create_qp(&QpInit::new(&cq_a)).unwrap();
    let b = pd.create_qp(&QpInit::new(&cq_b)).unwrap();
    for (q, peer) in [(&a, b.endpoint()), (&b, a.endpoint())] {
        q.modify(QpTransition::Init { access: AccessFlags::ALL, port: 1 }).unwrap();
        q.modify(QpTransition::Rtr(RtrAttr { min_rnr_timer, ..RtrAttr::new(peer) })).unwrap();
    }
    a.modify(QpTransition::Rts(rts)).unwrap();
    b.modify(QpTransition::Rts(rts)).unwrap();
    let mr_a = pd.register(vec![0u8; len].into_boxed_slice(), AccessFlags::ALL).unwrap();
    let mr_b = pd.register(vec![0u8; len].into_boxed_slice(), AccessFlags::ALL).unwrap();
    Pair { ctx: ctx.clone(), pd, cq_a, cq_b, a, b, mr_a, mr_b }
}

/// Waits for exactly one completion on `cq` (fails the test after [`WAIT`]).
pub fn wait_one(cq: &CompletionQueue) -> WorkCompletion {
    let mut wc = [WorkCompletion::EMPTY; 1];
    match cq.poll_blocking(&mut wc, WAIT) {
        Ok(1) => wc[0],
        other => panic!("no completion within {WAIT:?}: {other:?}"),
    }
}

/// Waits for `n` completions on `cq`.
pub fn wait_n(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let mut out = Vec::with_capacity(n);
    let mut wc = [WorkCompletion::EMPTY; 64];
    let deadline = std::time::Instant::now() + WAIT;
    while out.len() < n {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        assert!(!left.is_zero(), "only {} of {n} completions within {WAIT:?}: {out:?}", out.len());
        let want = (n - out.len()).min(wc.len());
        match cq.poll_blocking(&mut wc[..want], left) {
            Ok(k) => out.extend_from_slice(&wc[..k]),
            Err(e) => panic!("only {} of {n} completions: {e}; got {out:?}", out.len()),
        }
    }
    out
}

/// Asserts that nothing completes on `cq` for `d`.
pub fn assert_quiet(cq: &CompletionQueue, d: Duration) {
    let mut wc = [WorkCompletion::EMPTY; 4];
    let end = std::time::Instant::now() + d;
    while std::time::Instant::now() < end {
        let n = cq.poll(&mut wc).unwrap();
        assert_eq!(n, 0, "unexpected completion {:?}", &wc[..n]);
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A deterministic byte pattern for `len` bytes seeded by `seed`.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeExamples;

/// Two namespace hosts joined by a veth pair (the benchmark programs' helper).
pub use benches::hosts;
pub mod diff;
pub mod peer_client;
pub mod peer_proto;
pub mod soak;

/// One end of the AZ-SDP symmetric store pattern: `rounds` times, write a 16-page buffer
/// (`pattern(end * 1000 + round)`), store into it at once (preparing the next message in the
/// same memory), then read the other end's 16 pages (`pattern((3 - end) * 1000 + round)`) into
/// a second buffer. With block-on-write both ends' stores wait for reads neither end reaches.
pub fn write_store_read(s: &mut sockets_compat::SdpStream, end: u64, rounds: u64) -> std::io::Result<()> {
    use std::io::{Read, Write};
    const PAGES: usize = 16;
    let page = portability_verbs::page_size();
    let mut backing = vec![0u8; (PAGES + 1) * page];
    let off = (backing.as_ptr() as usize).next_multiple_of(page) - backing.as_ptr() as usize;
    let buf = &mut backing[off..off + PAGES * page];
    let mut got = vec![0u8; PAGES * page];
    for round in 0..rounds {
        buf.copy_from_slice(&pattern(end * 1000 + round, buf.len()));
        s.write_all(buf)?;
        buf.fill(0);
        s.read_exact(&mut got)?;
        if got != pattern((3 - end) * 1000 + round, got.len()) {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("round {round}: wrong data")));
        }
    }
    Ok(())
}

/// Record sizes of [`send_records`] and [`echo_records`]: 4 to 20 KiB, as TLS records with
/// their overhead.
fn record_sizes(n: usize) -> Vec<usize> {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            4096 + (x % 16384) as usize
        })
        .collect()
}

/// The client of a TLS-like session: `n` rounds of a length-prefixed record, each a fresh
/// allocation written and freed at once, answered by the same record echoed.
pub fn send_records(s: &mut sockets_compat::SdpStream, n: usize) -> std::io::Result<()> {
    use std::io::{Read, Write};
    for (i, len) in record_sizes(n).into_iter().enumerate() {
        let rec = pattern(i as u64, len);
        s.write_all(&(len as u32).to_le_bytes())?;
        s.write_all(&rec)?;
        drop(rec);
        let mut h = [0u8; 4];
        s.read_exact(&mut h)?;
        let mut back = vec![0u8; u32::from_le_bytes(h) as usize];
        s.read_exact(&mut back)?;
        if back != pattern(i as u64, len) {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("record {i} differs")));
        }
    }
    Ok(())
}

/// The server of [`send_records`]: echoes `n` records, each read into a fresh allocation,
/// written back and freed at once.
pub fn echo_records(s: &mut sockets_compat::SdpStream, n: usize) -> std::io::Result<()> {
    use std::io::{Read, Write};
    for _ in 0..n {
        let mut h = [0u8; 4];
        s.read_exact(&mut h)?;
        let mut rec = vec![0u8; u32::from_le_bytes(h) as usize];
        s.read_exact(&mut rec)?;
        s.write_all(&h)?;
        s.write_all(&rec)?;
        drop(rec);
    }
    Ok(())
}
