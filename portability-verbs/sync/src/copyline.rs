//! The line through which a process offers the back half of a copy to its peer, the
//! *helper* (the software provider's shared copies, `soft::assist`): a seqlock for the job's
//! fields, and a compare-and-swap on one state word for who copies the back half.
//!
//! The protocol lives in one line of the helper's queue-pair segment ([`AssistLine`]), written
//! by the puller (the *copier*) and read by the helper; jobs of one line are sequential (the
//! copier's queue-pair lock). Its state word holds `job id << 8 | flags`, 0 when no job is open:
//! - the copier closes the line (state 0), writes the job's fields, then opens it (`id << 8`);
//! - whoever sets `BACK_TAKEN` first (compare-and-swap on the whole word) copies the back half;
//!   a helper that took it sets `HELPER_DONE` (and `HELPER_FAILED` if its copy failed) after;
//! - the copier closes the job only after the helper it let in is done, so no helper write
//!   lands after the copier reported the transfer complete. A helper reads the fields before
//!   its compare-and-swap: if the copier reopened the line meanwhile, the word changed and the
//!   swap fails, so fields of another job are never acted on.
//!
//! Plain atomics and functions, no I/O: the queue pair supplies the copies.

use std::sync::atomic::AtomicU64 as Counter;
use std::time::{Duration, Instant};

use crate::atomic::{fence, spin_loop, yield_now, AtomicU32, AtomicU64, Ordering};

/// Third line of a queue-pair segment: a shared copy the peer offers this side to help with
/// (see the module's doc). Written by the peer (the copier); this side (the helper) takes jobs from it.
#[repr(C, align(64))]
#[derive(Debug, Default)]
pub struct AssistLine {
    /// `job id << 8 | flags`, 0 while no job is open.
    pub state: AtomicU64,
    /// Source address, in the helper.
    pub src: AtomicU64,
    /// Destination address, in the copier.
    pub dst: AtomicU64,
    /// Bytes of the whole copy.
    pub len: AtomicU64,
    /// Where the back half (the helper's part) starts.
    pub split: AtomicU64,
    /// Key of the helper's registration of the source.
    pub key: AtomicU32,
    /// Access rights that registration must grant (access flag bits).
    pub need: AtomicU32,
}

/// This process's shared copies so far (diagnostics, e.g. for benchmarks to report).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SharedCopies {
    /// Copies this process pulled offering their back half.
    pub offered: u64,
    /// Of those, back halves a peer pushed.
    pub helped: u64,
    /// Back halves this process pushed for its peers.
    pub pushed: u64,
}

static OFFERED: Counter = Counter::new(0);
static HELPED: Counter = Counter::new(0);
static PUSHED: Counter = Counter::new(0);

/// This process's shared-copy counts.
pub fn counts() -> SharedCopies {
    SharedCopies {
        offered: OFFERED.load(std::sync::atomic::Ordering::Relaxed),
        helped: HELPED.load(std::sync::atomic::Ordering::Relaxed),
        pushed: PUSHED.load(std::sync::atomic::Ordering::Relaxed),
    }
}

/// The back half was taken (by the copier or a helper).
const BACK_TAKEN: u64 = 1;
/// Taken by the helper (with `BACK_TAKEN`).
const BY_HELPER: u64 = 2;
/// The helper finished its copy.
const HELPER_DONE: u64 = 4;
/// The helper's copy failed (the copier copies the half itself).
const HELPER_FAILED: u64 = 8;
const FLAGS: u64 = 0xff;

/// What a job moves: `len` bytes from the helper's `src` to the copier's `dst`; the helper may
/// take `split..len`. `key` and `need` name the helper's registration of `src` (the helper
/// checks them against its own table before touching its memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Job {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
    pub split: u64,
    pub key: u32,
    pub need: u32,
}

impl Job {
    /// The back half (offset and length), the part a helper may take.
    pub fn back(&self) -> (u64, u64) {
        (self.split, self.len - self.split)
    }
}

/// How long a copier waited for its helper when it settled a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Waited {
    /// Not at all: the back half was done, or nobody had taken it, when the front was.
    No,
    /// This long, after its front part.
    For(Duration),
}

/// An open job, from the copier's side. Dropping it without [`Offer::settle`] is allowed only
/// before a helper can have taken the back half; `settle` closes the line.
#[derive(Debug)]
pub struct Offer<'a> {
    line: &'a AssistLine,
    word: u64,
}

/// How the back half got copied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Back {
    /// The copier took it back: it must copy it itself.
    Copier,
    /// The helper copied it.
    Helper,
    /// The helper took it and failed: the copier must copy it itself.
    HelperFailed,
}

/// Why waiting for a helper stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stuck {
    /// The helper's process died with the back half taken.
    HelperGone,
    /// The helper held the back half longer than the timeout (stopped, or starved of CPU).
    TimedOut,
    /// The line's state word is not one the protocol writes (a peer scribbled on it).
    Corrupt,
}

/// Opens job `id` (non-zero in its low 56 bits) on `line` for a helper to take its back half.
pub fn open<'a>(line: &'a AssistLine, id: u64, job: &Job) -> Offer<'a> {
    debug_assert!(job.split <= job.len);
    // A seqlock's write: closed first (the helper's swap must fail on a word whose fields are
    // being rewritten), the fence keeping the field stores behind the close, then opened with
    // a release store (the fields before the word). Plain stores on x86, where seven SeqCst
    // stores were seven locked instructions on the path between two copies.
    line.state.store(0, Ordering::Relaxed);
    fence(Ordering::Release);
    line.src.store(job.src, Ordering::Relaxed);
    line.dst.store(job.dst, Ordering::Relaxed);
    line.len.store(job.len, Ordering::Relaxed);
    line.split.store(job.split, Ordering::Relaxed);
    line.key.store(job.key, Ordering::Relaxed);
    line.need.store(job.need, Ordering::Relaxed);
    let word = (id & (u64::MAX >> 8)).max(1) << 8;
    line.state.store(word, Ordering::Release);
    OFFERED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Offer { line, word }
}

impl Offer<'_> {
    /// After copying the front part: takes the back part back if no helper took it, else
    /// waits (spinning, then yielding) until the helper is done, and says how long it waited
    /// (for [`next_share`]). `helper_alive` is asked now and then while waiting. The line is
    /// closed on return, whatever the outcome.
    pub fn settle(self, timeout: Duration, mut helper_alive: impl FnMut() -> bool) -> Result<(Back, Waited), Stuck> {
        let line = self.line;
        // (Release: a helper that reads the closed line acts on nothing of this job's.)
        let close = || line.state.store(0, Ordering::Release);
        if line.state.compare_exchange(self.word, self.word | BACK_TAKEN, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            close();
            return Ok((Back::Copier, Waited::No));
        }
        let mut start = None;
        let mut spins = 0u32;
        loop {
            let s = line.state.load(Ordering::Acquire);
            if s & !FLAGS != self.word || s & BY_HELPER == 0 {
                // Nobody but a helper taking or finishing this job writes the word meanwhile.
                close();
                return Err(Stuck::Corrupt);
            }
            if s & HELPER_DONE != 0 {
                close();
                HELPED.fetch_add((s & HELPER_FAILED == 0) as u64, std::sync::atomic::Ordering::Relaxed);
                let back = if s & HELPER_FAILED != 0 { Back::HelperFailed } else { Back::Helper };
                return Ok((back, start.map_or(Waited::No, |t: Instant| Waited::For(t.elapsed()))));
            }
            let start = *start.get_or_insert_with(Instant::now);
            spins += 1;
            if spins.is_multiple_of(256) {
                if spins >= 4096 {
                    yield_now();
                }
                if spins.is_multiple_of(4096) {
                    if !helper_alive() {
                        close();
                        return Err(Stuck::HelperGone);
                    }
                    if start.elapsed() > timeout {
                        close();
                        return Err(Stuck::TimedOut);
                    }
                }
            }
            spin_loop();
        }
    }
}

/// A back half a helper took: copy it, then [`Taken::finish`].
#[must_use]
#[derive(Debug)]
pub struct Taken<'a> {
    line: &'a AssistLine,
    word: u64,
    pub job: Job,
}

/// The helper's side: if `line` holds an open job whose back half nobody took, takes it.
/// One load when the line is idle (a helper calls this on every progress pass).
#[inline]
pub fn try_take(line: &AssistLine) -> Option<Taken<'_>> {
    let s = line.state.load(Ordering::Acquire);
    if s == 0 || s & FLAGS != 0 {
        return None;
    }
    let job = Job {
        src: line.src.load(Ordering::Relaxed),
        dst: line.dst.load(Ordering::Relaxed),
        len: line.len.load(Ordering::Relaxed),
        split: line.split.load(Ordering::Relaxed),
        key: line.key.load(Ordering::Relaxed),
        need: line.need.load(Ordering::Relaxed),
    };
    // A seqlock's read: the fields were read before this swap, which succeeds only if the
    // word is unchanged, so they are the fields of job `s`. Had a field load seen a store of
    // the copier's next job, the acquire fence would order the close before the swap (the
    // copier's release fence sits between the two), and the swap would fail.
    fence(Ordering::Acquire);
    line.state.compare_exchange(s, s | BACK_TAKEN | BY_HELPER, Ordering::AcqRel, Ordering::Relaxed).ok()?;
    let taken = Taken { line, word: s | BACK_TAKEN | BY_HELPER, job };
    if job.split > job.len {
        // A copier would never open this: report it failed (the copier copies it itself).
        taken.finish(false);
        return None;
    }
    Some(taken)
}

impl Taken<'_> {
    /// Reports the helper's copy done (`ok`: it succeeded); its writes happen before. A no-op
    /// if the copier gave up on this job meanwhile (the line may hold a newer one).
    pub fn finish(self, ok: bool) {
        let flags = HELPER_DONE | if ok { 0 } else { HELPER_FAILED };
        let told = self.line.state.compare_exchange(self.word, self.word | flags, Ordering::Release, Ordering::Relaxed);
        PUSHED.fetch_add((ok && told.is_ok()) as u64, std::sync::atomic::Ordering::Relaxed);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    fn job(len: u64) -> Job {
        Job { src: 0x1000, dst: 0x9000, len, split: len / 2, key: 7, need: 2 }
    }

    #[test]
    fn settle_says_how_long_the_copier_waited() {
        let line = AssistLine::default();
        let offer = open(&line, 1, &job(65536));
        try_take(&line).unwrap().finish(true);
        assert_eq!(offer.settle(Duration::from_secs(1), || true), Ok((Back::Helper, Waited::No)));
        let line = Arc::new(AssistLine::default());
        let offer = open(&line, 2, &job(65536));
        let taken_line = line.clone();
        let helper = std::thread::spawn(move || {
            let t = try_take(&taken_line).unwrap();
            // Long enough that the copier reaches `settle` first even on a loaded machine.
            std::thread::sleep(Duration::from_millis(200));
            t.finish(true);
        });
        while line.state.load(Ordering::SeqCst) & BY_HELPER == 0 {
            std::hint::spin_loop();
        }
        let before = std::time::Instant::now();
        match offer.settle(Duration::from_secs(5), || true) {
            // What it reports is the wait it made (no timing bound: the machine may be loaded).
            Ok((Back::Helper, Waited::For(w))) => {
                assert!(w > Duration::ZERO && w <= before.elapsed(), "waited {w:?}")
            }
            other => panic!("{other:?}"),
        }
        helper.join().unwrap();
        let line = AssistLine::default();
        let offer = open(&line, 3, &job(65536));
        assert_eq!(offer.settle(Duration::from_secs(1), || true), Ok((Back::Copier, Waited::No)));
    }

    #[test]
    fn an_offer_nobody_takes_goes_back_to_the_copier() {
        let line = AssistLine::default();
        let offer = open(&line, 1, &job(65536));
        assert_eq!(offer.settle(Duration::from_secs(1), || true).map(|(b, _)| b), Ok(Back::Copier));
        assert!(try_take(&line).is_none(), "a settled line offers nothing");
    }

    #[test]
    fn a_helper_takes_the_fields_of_the_open_job_once() {
        let line = AssistLine::default();
        assert!(try_take(&line).is_none(), "an idle line offers nothing");
        let j = job(1 << 20);
        let offer = open(&line, 5, &j);
        let taken = try_take(&line).expect("an open job");
        assert_eq!(taken.job, j);
        assert!(try_take(&line).is_none(), "the back half goes to one helper");
        taken.finish(true);
        assert_eq!(offer.settle(Duration::from_secs(1), || true).map(|(b, _)| b), Ok(Back::Helper));
    }

    #[test]
    fn a_failed_helper_hands_the_half_back() {
        let line = AssistLine::default();
        let offer = open(&line, 9, &job(65536));
        try_take(&line).unwrap().finish(false);
        assert_eq!(offer.settle(Duration::from_secs(1), || true).map(|(b, _)| b), Ok(Back::HelperFailed));
    }

    #[test]
    fn a_helper_that_dies_holding_the_half_is_reported() {
        let line = AssistLine::default();
        let offer = open(&line, 3, &job(65536));
        let taken = try_take(&line).unwrap();
        assert_eq!(offer.settle(Duration::from_secs(5), || false).map(|(b, _)| b), Err(Stuck::HelperGone));
        let next = open(&line, 4, &job(65536));
        taken.finish(true); // a late finish must not touch the next job
        assert_eq!(next.settle(Duration::from_secs(1), || true).map(|(b, _)| b), Ok(Back::Copier));
    }

    #[test]
    fn a_helper_that_never_finishes_times_out() {
        let line = AssistLine::default();
        let offer = open(&line, 3, &job(65536));
        let _taken = try_take(&line).unwrap();
        assert_eq!(offer.settle(Duration::from_millis(20), || true).map(|(b, _)| b), Err(Stuck::TimedOut));
    }

    #[test]
    fn malformed_fields_are_refused_not_copied() {
        let line = AssistLine::default();
        let offer = open(&line, 4, &job(65536));
        line.split.store(1 << 40, Ordering::SeqCst); // a peer scribbling on the line
        assert!(try_take(&line).is_none());
        assert_eq!(offer.settle(Duration::from_secs(1), || true).map(|(b, _)| b), Ok(Back::HelperFailed));
    }

    /// Many jobs, a helper thread racing the copier on each: every back half is copied exactly
    /// once, by the side the settle names, and never after the job closed.
    #[test]
    fn racing_copier_and_helper_copy_every_back_half_exactly_once() {
        const JOBS: u64 = 20_000;
        let line = Arc::new(AssistLine::default());
        let copies = Arc::new((0..JOBS).map(|_| AtomicU64::new(0)).collect::<Vec<_>>());
        let closed = Arc::new((0..JOBS).map(|_| AtomicBool::new(false)).collect::<Vec<_>>());
        let stop = Arc::new(AtomicBool::new(false));
        let helper = {
            let (line, copies, closed, stop) = (line.clone(), copies.clone(), closed.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut helped = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    if let Some(t) = try_take(&line) {
                        let i = t.job.src as usize; // the job's index, carried in `src`
                        assert!(!closed[i].load(Ordering::SeqCst), "helped a closed job");
                        copies[i].fetch_add(1, Ordering::SeqCst);
                        t.finish(true);
                        helped += 1;
                    }
                }
                helped
            })
        };
        let mut by_copier = 0u64;
        for i in 0..JOBS {
            let j = Job { src: i, dst: 0, len: 8192, split: 4096, key: 1, need: 0 };
            let offer = open(&line, i + 1, &j);
            for _ in 0..(i % 7) * 20 {
                std::hint::spin_loop(); // the front half's copy
            }
            match offer.settle(Duration::from_secs(10), || true).expect("helper alive").0 {
                Back::Copier => {
                    copies[i as usize].fetch_add(1, Ordering::SeqCst);
                    by_copier += 1;
                }
                Back::Helper => {}
                Back::HelperFailed => unreachable!("the helper never fails here"),
            }
            closed[i as usize].store(true, Ordering::SeqCst);
        }
        stop.store(true, Ordering::Relaxed);
        let helped = helper.join().unwrap();
        assert_eq!(helped + by_copier, JOBS);
        assert!(copies.iter().all(|c| c.load(Ordering::SeqCst) == 1));
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;

    /// The copier opens job 1, settles it, and opens job 2 while a helper tries to take a
    /// back half: the helper acts on the fields of the job it took (never a mix of two jobs'
    /// fields, never a job already closed), the back half of each job is copied once (by the
    /// side `settle` names), and a helper's copy is done before the copier's settle returns.
    #[test]
    fn a_helper_takes_one_whole_job_and_never_a_closed_one() {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(3);
        builder.check(|| {
            let line = Arc::new(AssistLine::default());
            // What the helper's copy wrote, per job (0: nothing), read by the copier after settle.
            let copied = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
            let (hl, hc) = (line.clone(), copied.clone());
            let helper = loom::thread::spawn(move || {
                if let Some(t) = try_take(&hl) {
                    let j = t.job;
                    // The fields of one job: job n has src n, dst 10n, len 100n, split 50n.
                    assert!(j.src == 1 || j.src == 2, "{j:?}");
                    assert_eq!((j.dst, j.len, j.split), (10 * j.src, 100 * j.src, 50 * j.src), "torn: {j:?}");
                    hc[j.src as usize - 1].store(1, Ordering::Relaxed);
                    t.finish(true);
                }
            });
            for n in 1..=2u64 {
                let offer = open(&line, n, &Job { src: n, dst: 10 * n, len: 100 * n, split: 50 * n, key: 1, need: 0 });
                let (back, _) = offer.settle(Duration::from_secs(60), || true).expect("the helper is alive");
                let by_helper = copied[n as usize - 1].load(Ordering::Relaxed) == 1;
                match back {
                    Back::Helper => assert!(by_helper, "job {n}: settled as helped before the helper's copy"),
                    Back::Copier => assert!(!by_helper, "job {n}: copied twice"),
                    Back::HelperFailed => unreachable!(),
                }
            }
            helper.join().unwrap();
        });
    }
}
