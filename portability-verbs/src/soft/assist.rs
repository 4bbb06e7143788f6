//! Shared copies: a process that pulls a large range out of its peer's memory by cross-memory
//! attach (an RDMA read, or the data of a large send) copies the front half itself and offers
//! the back half to the peer, whose next progress pass pushes it (if the peer polls at all).
//!
//! Why: on a NIC neither CPU copies; here the puller's CPU alone did, at about 12 GB/s after a
//! system call of about 2 us, while the peer typically spins waiting for that very transfer
//! (a sender waiting for its send's completion, a rendezvous source for its `Fin`). Two cores
//! copying halves measured 1.5x (64 KiB) to 1.9x (1 MiB) one core copying the whole. The
//! puller never depends on the peer: an offer nobody takes is copied by the puller itself.
//! "Half" starts at half: each queue pair then moves its split job by job ([`next_share`]) to
//! where its copier and its helper end together, as the helper may join late or copy slower.
//!
//! The protocol (one line of the helper's queue-pair segment, a seqlock and a
//! compare-and-swap) is `pv_sync::copyline`, model-checked there; this module adds the split's
//! policy.

use std::time::Duration;

pub use pv_sync::copyline::{counts, open, try_take, Back, Job, SharedCopies, Stuck, Taken, Waited};

/// The copier's share of a job (of [`SHARE_ONE`]) to begin with: half.
pub const EVEN_SHARE: u32 = SHARE_ONE / 2;
/// A whole job, as a share.
pub const SHARE_ONE: u32 = 1 << 16;
/// Bounds of the copier's share: a helper always gets something worth its system call, and
/// the copier keeps some even when its helper seems slow.
const MIN_SHARE: u32 = SHARE_ONE / 8;
const MAX_SHARE: u32 = SHARE_ONE / 8 * 7;

/// Where to split `len` bytes between copier and helper, the copier taking `share` (of
/// [`SHARE_ONE`]) from the front: rounded down to a page, so that no page is pinned by both.
pub fn split_point(len: u64, share: u32) -> u64 {
    (((len as u128 * share.min(SHARE_ONE) as u128) >> 16) as u64) & !4095
}

/// The copier's next share after a job the helper took and finished, split with `share`,
/// whose front part took the copier `front` and after which it waited `waited`.
///
/// Why the split moves: the two halves are not equal work. The helper joins when its polling
/// loop sees the offer, and the two system calls copy at whatever speed their CPUs and caches
/// give them; in a Madeleine stream of 64 KiB messages the copier waited 0.1-1.5 us for its
/// helper after a 4.5-4.9 us front half, while the helper's half took 4.7-5.6 us. So, job by
/// job: a copier that waited `w` after a front of `f` could have copied about `w / f` of its
/// front more, and the two would then have shared that, so its share grows by half of that
/// (damped by half again, as one job's timing is noisy); a helper that was done first gets a
/// step more (1/64 of the share), so that the split follows a helper that got faster. The
/// split thus settles where both end together, give or take a page.
pub fn next_share(share: u32, front: Duration, waited: Waited) -> u32 {
    let s = share.clamp(MIN_SHARE, MAX_SHARE) as f64;
    let next = match waited {
        Waited::No => s - s / 64.0,
        Waited::For(w) => {
            let f = front.as_nanos().max(1) as f64;
            s + s * (w.as_nanos() as f64 / f).min(1.0) / 4.0
        }
    };
    (next as u32).clamp(MIN_SHARE, MAX_SHARE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_is_page_aligned_and_inside() {
        assert_eq!(split_point(65536, EVEN_SHARE), 32768);
        assert_eq!(split_point(65536 + 100, EVEN_SHARE), 32768);
        assert_eq!(split_point(4096, EVEN_SHARE), 0);
        assert_eq!(split_point(0, EVEN_SHARE), 0);
        assert_eq!(split_point(65536, SHARE_ONE / 4 * 3), 49152);
        assert_eq!(split_point(1 << 40, SHARE_ONE), 1 << 40);
        assert_eq!(split_point(u64::MAX, SHARE_ONE), !4095, "no overflow");
    }

    /// A model of two copiers: the helper joins `late` ns after the offer and copies at
    /// `helper_rate` bytes/ns, the copier at `copier_rate`; each system call costs `fixed`.
    /// The share must settle where neither waits long for the other.
    fn converge(late: f64, copier_rate: f64, helper_rate: f64) -> (u32, f64) {
        let (len, fixed) = (65536u64, 1500.0);
        let mut share = EVEN_SHARE;
        let mut idle = 0.0;
        for job in 0..200 {
            let split = split_point(len, share) as f64;
            let front = fixed + split / copier_rate;
            let back_done = late + fixed + (len as f64 - split) / helper_rate;
            let waited = if back_done > front {
                Waited::For(Duration::from_nanos((back_done - front) as u64))
            } else {
                Waited::No
            };
            if job >= 150 {
                idle += (back_done - front).abs();
            }
            share = next_share(share, Duration::from_nanos(front as u64), waited);
        }
        (share, idle / 50.0)
    }

    #[test]
    fn the_split_follows_a_late_or_slow_helper_and_comes_back() {
        // Equal speeds, a punctual helper: about half.
        let (share, idle) = converge(0.0, 12.0, 12.0);
        assert!((SHARE_ONE * 7 / 16..=SHARE_ONE * 9 / 16).contains(&share), "share {share}");
        assert!(idle < 400.0, "idle {idle} ns a job");
        // A helper that joins 1 us late and copies 20% slower: the copier takes more, and the
        // two end within about a page's copy of each other (a page is 340 ns at 12 B/ns).
        let (share, idle) = converge(1000.0, 12.0, 10.0);
        assert!(share > SHARE_ONE * 9 / 16, "share {share}");
        assert!(idle < 700.0, "idle {idle} ns a job, against 1550 at half and half");
        // A faster helper: the copier gives some away.
        let (share, _) = converge(0.0, 8.0, 14.0);
        assert!(share < SHARE_ONE * 7 / 16, "share {share}");
        // Bounds hold against a helper that never keeps up.
        let (share, _) = converge(100_000.0, 12.0, 1.0);
        assert_eq!(share, MAX_SHARE);
    }
}
