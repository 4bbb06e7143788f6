//! Copy speed per relative alignment of destination and source (modulo 4 KiB): glibc's
//! `memmove` against `portability_verbs::copy::copy_bytes`, which every bulk copy of the stack
//! goes through (ring writes, bulk-lane reads, SDP stream bytes). On CPUs whose string copy
//! suffers 4K aliasing, `memmove` collapses for a few alignments; this shows which, how far,
//! and that `copy_bytes` does not.

use std::time::Instant;

use benches::fmt_size;
use clap::Parser;
use portability_verbs::copy::copy_bytes;

/// memmove against copy_bytes at every relative alignment.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Copy sizes in bytes (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [65536usize, 1 << 20])]
    sizes: Vec<usize>,
    /// Relative alignments tried: every `step`-th of 0..4096.
    #[arg(long, default_value_t = 1)]
    step: usize,
    /// Timed runs per point; the best is kept (this machine is noisy).
    #[arg(long, default_value_t = 3)]
    runs: u32,
}

/// Best GB/s of `runs` timed runs of `copy` over 16 MiB (destinations spread over 8 slots, so
/// a 1 MiB copy is not served from the cache the previous one filled).
fn speed(runs: u32, len: usize, mut copy: impl FnMut(usize)) -> f64 {
    let reps = ((16usize << 20) / len).max(8);
    (0..runs)
        .map(|_| {
            let t = Instant::now();
            for i in 0..reps {
                copy(i % 8);
            }
            (len * reps) as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

struct Summary {
    mean: f64,
    worst: f64,
    worst_at: usize,
    slow: usize,
}

fn summarize(points: &[(usize, f64)]) -> Summary {
    let mean = points.iter().map(|p| p.1).sum::<f64>() / points.len() as f64;
    let (worst_at, worst) = points.iter().copied().fold((0, f64::MAX), |a, p| if p.1 < a.1 { p } else { a });
    let slow = points.iter().filter(|p| p.1 < mean / 2.0).count();
    Summary { mean, worst, worst_at, slow }
}

fn main() {
    env_logger::init();
    let args = Args::parse();
    let step = args.step.clamp(1, 4096);
    println!("# copy_bench: GB/s by relative alignment (destination - source, modulo 4 KiB), best of {}", args.runs);
    println!("{:>10} {:>10} {:>8} {:>8} {:>10} {:>6}", "size", "copy", "mean", "worst", "worst at", "slow");
    for &len in &args.sizes {
        let slot = len.next_multiple_of(4096) + 4096;
        let src = vec![0x5au8; len + 4096];
        let mut dst = vec![0u8; 8 * slot + 4096];
        // The source at a page start; destinations at `rel` past a page start.
        let src_at = (src.as_ptr() as usize).next_multiple_of(4096) - src.as_ptr() as usize;
        let dst_page = (dst.as_ptr() as usize).next_multiple_of(4096) - dst.as_ptr() as usize;
        let s = src[src_at..].as_ptr();
        let mut plain = Vec::new();
        let mut ours = Vec::new();
        for rel in (0..4096).step_by(step) {
            let base = dst.as_mut_ptr();
            let at = |k: usize| dst_page + k * slot + rel;
            // SAFETY: `at(k) + len` stays inside `dst` (8 slots of `len` rounded up plus a
            // page, after a page of slack), and `s` has `len` bytes after it.
            plain.push((rel, speed(args.runs, len, |k| unsafe { std::ptr::copy(s, base.add(at(k)), len) })));
            // SAFETY: as above.
            ours.push((rel, speed(args.runs, len, |k| unsafe { copy_bytes(base.add(at(k)), s, len) })));
            std::hint::black_box(&mut dst);
        }
        for (name, points) in [("memmove", &plain), ("copy_bytes", &ours)] {
            let s = summarize(points);
            println!(
                "{:>10} {:>10} {:>8.1} {:>8.1} {:>10} {:>6}",
                fmt_size(len),
                name,
                s.mean,
                s.worst,
                s.worst_at,
                s.slow
            );
        }
    }
    println!("# slow: alignments below half the mean; worst at: the relative alignment of the worst");
}
