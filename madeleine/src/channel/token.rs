//! `Token` and `Claim`: the lock a connection's pipe and each direction are held by.

use portability_verbs::sync::{SpinGuard, SpinLock};

use super::*;

/// A lock around state (the stack's spin lock, `portability_verbs::sync::SpinLock`), taken
/// two ways: claimed for a whole message (one direction of a
/// connection, with its next sequence number and a buffer kept between messages: no
/// allocation, no thread-local lookup on a message's path), waiting as any blocking call
/// does; or held for a short critical section that never waits inside (the connection's
/// pipe), spinning. Unlike a `MutexGuard`, a claim may be released on another thread than
/// the one that took it, which coroutines migrating between `may` workers need; and its
/// release is a plain store where a mutex's is an atomic exchange (the pipe is locked on
/// every poll of a waiting receiver).
pub(crate) struct Token<T>(SpinLock<T>);

impl<T> Token<T> {
    pub(super) fn new(state: T) -> Token<T> {
        Token(SpinLock::new(state))
    }

    /// The state, through the only reference there is (no claim needed).
    pub(super) fn get_mut(&mut self) -> &mut T {
        self.0.get_mut()
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
        self.0.try_lock()
    }

    /// Claims, yielding (coroutines) or spinning then napping (threads) while another holds it.
    #[inline]
    pub(super) fn claim(&self, p: &Patience) -> Result<Claim<'_, T>> {
        match self.try_claim() {
            Some(c) => Ok(c),
            None => self.claim_slow(p),
        }
    }

    #[inline(never)]
    pub(super) fn claim_slow(&self, p: &Patience) -> Result<Claim<'_, T>> {
        let mut w = Waiter::new(p, "waiting for a connection held by another sender or receiver");
        loop {
            if let Some(c) = self.try_claim() {
                return Ok(c);
            }
            w.pause()?;
        }
    }
}

/// A held [`Token`], giving access to its state; released on drop (on any thread).
pub(crate) type Claim<'a, T> = SpinGuard<'a, T>;
