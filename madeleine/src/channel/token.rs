//! `Token` and `Claim`: the lock a connection's pipe and each direction are held by.

use super::*;

/// A lock around state, taken two ways: claimed for a whole message (one direction of a
/// connection, with its next sequence number and a buffer kept between messages: no
/// allocation, no thread-local lookup on a message's path), waiting as any blocking call
/// does; or held for a short critical section that never waits inside (the connection's
/// pipe), spinning. Unlike a `MutexGuard`, a claim may be released on another thread than
/// the one that took it, which coroutines migrating between `may` workers need; and its
/// release is a plain store where a mutex's is an atomic exchange (the pipe is locked on
/// every poll of a waiting receiver).
pub(crate) struct Token<T> {
    pub(super) busy: std::sync::atomic::AtomicBool,
    pub(super) state: UnsafeCell<T>,
}

// SAFETY: `state` is reached only through a `Claim`, and `busy` admits one claim at a time
// (acquire on claim, release on drop), as a lock does.
unsafe impl<T: Send> Sync for Token<T> {}

impl<T> Token<T> {
    pub(super) fn new(state: T) -> Token<T> {
        Token { busy: std::sync::atomic::AtomicBool::new(false), state: UnsafeCell::new(state) }
    }

    /// The state, through the only reference there is (no claim needed).
    pub(super) fn get_mut(&mut self) -> &mut T {
        self.state.get_mut()
    }

    /// Takes the token for a short critical section (one that never waits inside): spins,
    /// yielding the CPU now and then (the holder may be a preempted thread).
    #[inline]
    pub(super) fn hold(&self) -> Claim<'_, T> {
        match self.try_claim() {
            Some(c) => c,
            None => self.hold_contended(),
        }
    }

    #[inline(never)]
    pub(super) fn hold_contended(&self) -> Claim<'_, T> {
        let mut polls = 0u32;
        loop {
            if let Some(c) = self.try_claim() {
                return c;
            }
            polls = polls.wrapping_add(1);
            if portability_verbs::spin_yields(polls) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    #[inline]
    pub(super) fn try_claim(&self) -> Option<Claim<'_, T>> {
        self.busy.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).ok().map(|_| Claim { t: self })
    }

    /// Claims, yielding (coroutines) or spinning then napping (threads) while another holds it.
    #[inline]
    pub(super) fn claim(&self, p: Patience) -> Result<Claim<'_, T>> {
        match self.try_claim() {
            Some(c) => Ok(c),
            None => self.claim_slow(p),
        }
    }

    #[inline(never)]
    pub(super) fn claim_slow(&self, p: Patience) -> Result<Claim<'_, T>> {
        let mut w = Waiter::new(p, "waiting for a connection held by another sender or receiver");
        loop {
            if let Some(c) = self.try_claim() {
                return Ok(c);
            }
            w.pause()?;
        }
    }
}

/// A held [`Token`], giving access to its state; released on drop.
pub(crate) struct Claim<'a, T> {
    pub(super) t: &'a Token<T>,
}

impl<T> std::ops::Deref for Claim<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: this claim is the only one (see `Token`).
        unsafe { &*self.t.state.get() }
    }
}

impl<T> std::ops::DerefMut for Claim<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: this claim is the only one (see `Token`), and `&mut self` the only borrow.
        unsafe { &mut *self.t.state.get() }
    }
}

impl<T> Drop for Claim<'_, T> {
    fn drop(&mut self) {
        self.t.busy.store(false, Ordering::Release);
    }
}
