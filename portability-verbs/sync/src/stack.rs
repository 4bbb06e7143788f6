//! A lock-free stack of the indices `0..count` (a Treiber stack whose head carries a
//! generation tag against ABA): the free list of a buffer pool shared by many threads.
//!
//! The head word holds `tag << 32 | index` (`NIL` for an empty stack); `next[i]` the index
//! below `i` while `i` is on the stack. Every successful push or pop bumps the tag, so a pop
//! that read `next[i]` of an `i` popped and pushed back meanwhile fails its compare-and-swap
//! instead of installing a stale successor.

use crate::atomic::{AtomicU32, AtomicU64, Ordering};

/// The index value marking the end of the stack.
pub const NIL: u32 = u32::MAX;

/// A lock-free stack of indices below a fixed count.
#[derive(Debug)]
pub struct IndexStack {
    head: AtomicU64,
    next: Box<[AtomicU32]>,
}

impl IndexStack {
    /// A stack holding every index of `0..count`, 0 on top (`count` below [`NIL`]).
    pub fn full(count: u32) -> IndexStack {
        assert!(count < NIL, "an index stack holds fewer than 2^32-1 indices");
        let next = (0..count).map(|i| AtomicU32::new(if i + 1 < count { i + 1 } else { NIL })).collect();
        IndexStack { head: AtomicU64::new(if count == 0 { NIL as u64 } else { 0 }), next }
    }

    /// How many indices the stack was made for.
    pub fn count(&self) -> u32 {
        self.next.len() as u32
    }

    /// Takes the top index, or `None` if the stack is empty.
    #[inline]
    pub fn pop(&self) -> Option<u32> {
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            let index = head as u32;
            if index == NIL {
                return None;
            }
            // Possibly stale (another thread popped `index` meanwhile); the tag makes the
            // swap below fail then.
            let next = self.next[index as usize].load(Ordering::Relaxed);
            let new = ((head >> 32).wrapping_add(1) << 32) | next as u64;
            match self.head.compare_exchange_weak(head, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(index),
                Err(h) => head = h,
            }
        }
    }

    /// Puts back `index`, which the caller took with [`IndexStack::pop`] and owns.
    #[inline]
    pub fn push(&self, index: u32) {
        debug_assert!(index < self.count());
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            self.next[index as usize].store(head as u32, Ordering::Relaxed);
            let new = ((head >> 32).wrapping_add(1) << 32) | index as u64;
            match self.head.compare_exchange_weak(head, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return,
                Err(h) => head = h,
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    #[test]
    fn pops_every_index_once_then_none_and_takes_them_back() {
        let s = IndexStack::full(4);
        let got: Vec<u32> = std::iter::from_fn(|| s.pop()).collect();
        assert_eq!(got, [0, 1, 2, 3]);
        s.push(2);
        s.push(0);
        assert_eq!((s.pop(), s.pop(), s.pop()), (Some(0), Some(2), None));
        assert_eq!(IndexStack::full(0).pop(), None);
    }

    #[test]
    fn threads_never_hold_one_index_at_once() {
        let s = IndexStack::full(8);
        let owned: Vec<AtomicBool> = (0..8).map(|_| AtomicBool::new(false)).collect();
        std::thread::scope(|sc| {
            for _ in 0..4 {
                sc.spawn(|| {
                    for _ in 0..20_000 {
                        if let Some(i) = s.pop() {
                            assert!(!owned[i as usize].swap(true, Ordering::AcqRel), "index {i} handed out twice");
                            owned[i as usize].store(false, Ordering::Release);
                            s.push(i);
                        }
                    }
                });
            }
        });
        let mut all: Vec<u32> = std::iter::from_fn(|| s.pop()).collect();
        all.sort_unstable();
        assert_eq!(all, (0..8).collect::<Vec<_>>());
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::atomic::AtomicBool;
    use loom::sync::Arc;

    /// Two threads pop and push back while a third pops twice: no index is ever held by two
    /// threads, and every index is on the stack at the end (the ABA case: an index popped
    /// and pushed back between another pop's read of its successor and that pop's swap).
    #[test]
    fn no_index_is_handed_out_twice_and_none_is_lost() {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(3);
        builder.check(|| {
            let s = Arc::new(IndexStack::full(3));
            let owned: Arc<Vec<AtomicBool>> = Arc::new((0..3).map(|_| AtomicBool::new(false)).collect());
            let cycle = |s: Arc<IndexStack>, owned: Arc<Vec<AtomicBool>>, rounds: usize| {
                move || {
                    for _ in 0..rounds {
                        if let Some(i) = s.pop() {
                            assert!(!owned[i as usize].swap(true, Ordering::AcqRel), "index {i} handed out twice");
                            owned[i as usize].store(false, Ordering::Release);
                            s.push(i);
                        }
                    }
                }
            };
            let t = loom::thread::spawn(cycle(s.clone(), owned.clone(), 2));
            let (a, b) = (s.pop(), s.pop());
            for i in [a, b].into_iter().flatten() {
                assert!(!owned[i as usize].swap(true, Ordering::AcqRel), "index {i} handed out twice");
            }
            for i in [a, b].into_iter().flatten() {
                owned[i as usize].store(false, Ordering::Release);
                s.push(i);
            }
            t.join().unwrap();
            let mut all: Vec<u32> = std::iter::from_fn(|| s.pop()).collect();
            all.sort_unstable();
            assert_eq!(all, [0, 1, 2]);
        });
    }
}
