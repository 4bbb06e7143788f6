//! A small spin lock, for state held across short critical sections that never wait inside:
//! the software provider's queue-pair state and completion-queue lists, Madeleine's
//! connections.
//!
//! Why not `std::sync::Mutex`: its unlock is an atomic read-modify-write (to find waiters), a full
//! barrier on x86 that stalls `post_send` until the cache line it just wrote into the peer's ring
//! has been fetched, exposing a cross-core transfer on every message. Unlocking here is a plain
//! release store. And a guard may be dropped on another thread than the one that took it
//! (coroutines migrate between `may`'s workers). A waiter spins, then yields.

use crate::atomic::{spin_loop, yield_now, AtomicBool, Ordering, UnsafeCell};

/// A spin lock around `T`.
#[derive(Debug, Default)]
pub struct SpinLock<T> {
    locked: AtomicBool,
    data: UnsafeCell<T>,
}

// SAFETY: access to `data` is serialised by `locked` (acquire on lock, release on unlock).
unsafe impl<T: Send> Sync for SpinLock<T> {}
// SAFETY: owning the lock owns the data.
unsafe impl<T: Send> Send for SpinLock<T> {}

/// Exclusive access until dropped (on any thread).
#[derive(Debug)]
pub struct SpinGuard<'a, T> {
    lock: &'a SpinLock<T>,
}

/// Polls of a held lock before a waiter starts yielding its CPU (the holder may be a
/// preempted thread).
const SPINS_BEFORE_YIELD: u32 = 256;

impl<T> SpinLock<T> {
    /// A free lock around `v`.
    #[cfg(not(loom))]
    pub const fn new(v: T) -> Self {
        SpinLock { locked: AtomicBool::new(false), data: UnsafeCell::new(v) }
    }

    /// A free lock around `v`.
    #[cfg(loom)]
    pub fn new(v: T) -> Self {
        SpinLock { locked: AtomicBool::new(false), data: UnsafeCell::new(v) }
    }

    /// Takes the lock, spinning (then yielding) while another thread holds it.
    #[inline]
    pub fn lock(&self) -> SpinGuard<'_, T> {
        match self.try_lock() {
            Some(g) => g,
            None => self.lock_contended(),
        }
    }

    #[inline(never)]
    fn lock_contended(&self) -> SpinGuard<'_, T> {
        let mut spins = 0u32;
        loop {
            if let Some(g) = self.try_lock() {
                return g;
            }
            while self.locked.load(Ordering::Relaxed) {
                spins += 1;
                if spins > SPINS_BEFORE_YIELD {
                    yield_now();
                } else {
                    spin_loop();
                }
            }
        }
    }

    /// Takes the lock if it is free.
    #[inline]
    pub fn try_lock(&self) -> Option<SpinGuard<'_, T>> {
        if self.locked.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok() {
            Some(SpinGuard { lock: self })
        } else {
            None
        }
    }

    /// Whether some guard holds the lock now (a hint: it may change at once).
    pub fn is_locked(&self) -> bool {
        self.locked.load(Ordering::Relaxed)
    }

    /// The value, through the only reference there is (no locking needed).
    pub fn get_mut(&mut self) -> &mut T {
        // SAFETY: `&mut self` excludes every guard.
        self.data.with_mut(|p| unsafe { &mut *p })
    }
}

impl<T> std::ops::Deref for SpinGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: the guard proves exclusive access.
        self.lock.data.with(|p| unsafe { &*p })
    }
}

impl<T> std::ops::DerefMut for SpinGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: the guard proves exclusive access, and `&mut self` is the only borrow of it.
        self.lock.data.with_mut(|p| unsafe { &mut *p })
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        self.lock.locked.store(false, Ordering::Release);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn counts_correctly_under_contention() {
        let l = SpinLock::new(0u64);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..10_000 {
                        *l.lock() += 1;
                    }
                });
            }
        });
        assert_eq!(*l.lock(), 40_000);
    }

    #[test]
    fn a_guard_dropped_on_another_thread_releases_the_lock() {
        let l = SpinLock::new(1u32);
        let g = l.lock();
        assert!(l.try_lock().is_none() && l.is_locked());
        std::thread::scope(|s| {
            s.spawn(move || drop(g));
        });
        assert_eq!(*l.try_lock().expect("released"), 1);
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;

    /// Two threads increment under the lock (one through `try_lock`): no update is lost, and
    /// loom's cell tracking finds no access outside the lock's happens-before order.
    #[test]
    fn increments_under_the_lock_are_never_lost() {
        loom::model(|| {
            let l = Arc::new(SpinLock::new(0u32));
            let l2 = l.clone();
            let t = loom::thread::spawn(move || {
                *l2.lock() += 1;
            });
            loop {
                if let Some(mut g) = l.try_lock() {
                    *g += 1;
                    break;
                }
                loom::thread::yield_now();
            }
            t.join().unwrap();
            assert_eq!(*l.lock(), 2);
        });
    }

    /// A guard taken on one thread and dropped on another hands the data over intact.
    #[test]
    fn a_guard_moved_to_another_thread_hands_over_the_data() {
        loom::model(|| {
            // Leaked so that the guard may move to a thread (loom has no scoped threads).
            let l: &'static SpinLock<u32> = Box::leak(Box::new(SpinLock::new(0u32)));
            let mut g = l.lock();
            *g = 7;
            let t = loom::thread::spawn(move || {
                let mut g = g;
                *g += 1;
            });
            let v = *l.lock();
            t.join().unwrap();
            assert_eq!(v, 8);
        });
    }
}
