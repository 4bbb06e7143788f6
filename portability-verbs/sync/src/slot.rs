//! A slot publishing a byte range and a level (a small state number, 0 for a free slot) to
//! lock-free readers: the entry of the memory-protection hold table, read by the fault handler
//! and by every copy the software provider makes.
//!
//! Writers are serialised by their owner (the table's writer lock); readers take no lock and
//! may run in a signal handler, so they never wait. The range is guarded by a sequence word
//! (a seqlock): a writer makes it odd, rewrites the range, makes it even again; a reader that
//! saw the same even value before and after its loads has a range of one publication, and
//! retries otherwise. A reader that finds it odd reports the slot free: a range being written
//! belongs to a hold not yet in force (its pages close only after the publication), and the
//! writer may be the very thread the reader interrupted. The level may change on its own
//! (released, or a lazy state moved by compare-and-swap) without touching the range.

use crate::atomic::{fence, AtomicU32, AtomicU8, AtomicUsize, Ordering};

/// The level of a free slot.
pub const FREE: u8 = 0;

/// One published range and its level.
#[derive(Debug, Default)]
pub struct RangeSlot {
    seq: AtomicU32,
    start: AtomicUsize,
    end: AtomicUsize,
    level: AtomicU8,
}

/// What a reader saw in a slot in use: one publication's range, with a level it had.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Snapshot {
    pub level: u8,
    pub start: usize,
    pub end: usize,
}

impl RangeSlot {
    /// A free slot.
    #[cfg(not(loom))]
    pub const fn new() -> RangeSlot {
        RangeSlot {
            seq: AtomicU32::new(0),
            start: AtomicUsize::new(0),
            end: AtomicUsize::new(0),
            level: AtomicU8::new(FREE),
        }
    }

    /// A free slot.
    #[cfg(loom)]
    pub fn new() -> RangeSlot {
        RangeSlot {
            seq: AtomicU32::new(0),
            start: AtomicUsize::new(0),
            end: AtomicUsize::new(0),
            level: AtomicU8::new(FREE),
        }
    }

    /// Writer (the slot free, writers serialised): publishes `[start, end)` at `level`. A
    /// reader that sees the level afterwards sees this range with it.
    pub fn publish(&self, start: usize, end: usize, level: u8) {
        debug_assert_ne!(level, FREE);
        let s = self.seq.load(Ordering::Relaxed);
        self.seq.store(s.wrapping_add(1), Ordering::Relaxed);
        // The odd sequence before the range's stores (a reader seeing a new store sees it).
        fence(Ordering::Release);
        self.start.store(start, Ordering::Relaxed);
        self.end.store(end, Ordering::Relaxed);
        self.seq.store(s.wrapping_add(2), Ordering::Release);
        self.level.store(level, Ordering::Release);
    }

    /// Writer: sets the level, the range unchanged ([`FREE`] frees the slot).
    pub fn set_level(&self, level: u8) {
        self.level.store(level, Ordering::Release);
    }

    /// Moves the level from `from` to `to` if it is `from` (any thread, a signal handler
    /// included); whether it did.
    pub fn swap_level(&self, from: u8, to: u8) -> bool {
        self.level.compare_exchange(from, to, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    /// The range of a slot in use that is not being republished (its owner's view, or a
    /// thread that just moved its level by [`RangeSlot::swap_level`]).
    pub fn range(&self) -> (usize, usize) {
        (self.start.load(Ordering::Relaxed), self.end.load(Ordering::Relaxed))
    }

    /// The level now.
    pub fn level(&self) -> u8 {
        self.level.load(Ordering::Acquire)
    }

    /// Reader (lock-free, never waits, async-signal-safe): the slot's level and range if it is
    /// in use, from one publication; `None` if it is free or being written.
    #[inline]
    pub fn snapshot(&self) -> Option<Snapshot> {
        loop {
            let s1 = self.seq.load(Ordering::Acquire);
            if s1 & 1 != 0 {
                return None;
            }
            let level = self.level.load(Ordering::Acquire);
            if level == FREE {
                return None;
            }
            let (start, end) = (self.start.load(Ordering::Relaxed), self.end.load(Ordering::Relaxed));
            // The range's loads before the second look at the sequence.
            fence(Ordering::Acquire);
            if self.seq.load(Ordering::Relaxed) == s1 {
                return Some(Snapshot { level, start, end });
            }
            // Republished meanwhile (by another thread: it finishes).
            crate::atomic::spin_loop();
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_slot_shows_what_was_published_and_nothing_once_free() {
        let s = RangeSlot::new();
        assert_eq!(s.snapshot(), None);
        s.publish(0x1000, 0x3000, 2);
        assert_eq!(s.snapshot(), Some(Snapshot { level: 2, start: 0x1000, end: 0x3000 }));
        assert!(s.swap_level(2, 3) && !s.swap_level(2, 4));
        assert_eq!(s.snapshot().map(|x| x.level), Some(3));
        s.set_level(FREE);
        assert_eq!(s.snapshot(), None);
        s.publish(0x8000, 0x9000, 1);
        assert_eq!(s.snapshot(), Some(Snapshot { level: 1, start: 0x8000, end: 0x9000 }));
    }

    /// Readers racing a writer that reuses the slot over and over never see a range of one
    /// publication with another's (each publication's start and end and level agree).
    #[test]
    fn readers_never_see_a_torn_range() {
        let s = RangeSlot::new();
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|sc| {
            for _ in 0..2 {
                sc.spawn(|| {
                    while !stop.load(Ordering::Relaxed) {
                        if let Some(x) = s.snapshot() {
                            assert_eq!(x.end, x.start + 0x1000, "{x:?}");
                            assert_eq!(x.level as usize, 1 + (x.start >> 12) % 2, "{x:?}");
                        }
                    }
                });
            }
            for i in 1..200_000usize {
                s.publish(i << 12, (i << 12) + 0x1000, 1 + (i % 2) as u8);
                s.set_level(FREE);
            }
            stop.store(true, Ordering::Relaxed);
        });
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;

    /// A writer releases hold A and publishes hold B in the same slot while a reader scans:
    /// the reader sees nothing, A or B, never A's level with B's range or half of each; and a
    /// reader that runs after B's publication (joined) sees B.
    #[test]
    fn a_reused_slot_is_never_read_torn() {
        loom::model(|| {
            let slot = Arc::new(RangeSlot::new());
            slot.publish(0x1000, 0x2000, 1);
            let w = slot.clone();
            let writer = loom::thread::spawn(move || {
                w.set_level(FREE);
                w.publish(0x5000, 0x7000, 2);
            });
            let seen = slot.snapshot();
            let a = Snapshot { level: 1, start: 0x1000, end: 0x2000 };
            let b = Snapshot { level: 2, start: 0x5000, end: 0x7000 };
            assert!(seen.is_none() || seen == Some(a) || seen == Some(b), "torn: {seen:?}");
            writer.join().unwrap();
            assert_eq!(slot.snapshot(), Some(b));
        });
    }

    /// A level moved by compare-and-swap on another thread (a lazy range opened by the fault
    /// handler) keeps its range: the reader sees the range with the old or the new level.
    #[test]
    fn a_level_swapped_elsewhere_keeps_its_range() {
        loom::model(|| {
            let slot = Arc::new(RangeSlot::new());
            slot.publish(0x1000, 0x2000, 3);
            let h = slot.clone();
            let handler = loom::thread::spawn(move || assert!(h.swap_level(3, 4)));
            let seen = slot.snapshot().expect("in use throughout");
            assert!(matches!(seen.level, 3 | 4) && (seen.start, seen.end) == (0x1000, 0x2000), "{seen:?}");
            handler.join().unwrap();
        });
    }
}
