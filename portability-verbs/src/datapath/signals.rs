//! Two of the message pipe's decisions as plain state with no I/O, driven by the pipe
//! (`datapath::pipe`) and tested here in memory:
//!
//! - [`Signalling`]: which sends ask for a completion. A completion frees send-queue slots
//!   and tells the pipe its sends left, but each one costs the poller (and, while one is in
//!   flight, a cross-core transfer of the peer's counter): so one send in
//!   [`SIGNAL_EVERY`] asks for one, covering itself and the unsignaled sends before it, and
//!   after [`SETTLE_AFTER_PASSES`] quiet progress passes a signaled empty write *settles* the
//!   unsignaled ones left (their completion becomes known).
//! - [`SleepHandshake`]: the polled strategy's frames raise no completion, so a receiver
//!   about to sleep *announces* it (a counter and the position it waits at, written into the
//!   peer's slot), and the peer, after each frame it writes, *answers* an announcement it has
//!   written past with one wake-up completion.

/// An inline send asks for a completion once this many (itself included) went since the last signaled
/// one, or when it fills the send window; the completion of a signaled send covers every
/// send before it. While a signaled send is in flight, the sender's polls read the peer's
/// consumer counter, and the peer's next write of it must take the cache line back before
/// anything the peer stores after it (its reply) can be seen: a cross-core transfer, hidden
/// behind the peer's work when transfers are quick, on the ping-pong's path when they are
/// slow (as between sockets, or in this VM's slow phases).
pub const SIGNAL_EVERY: usize = 8;
/// Progress passes with unsignaled sends pending and no send since, after which they are
/// settled.
pub const SETTLE_AFTER_PASSES: u32 = 256;

/// Which sends ask for a completion, and what each completion covers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Signalling {
    /// Sends posted unsignaled since the last signaled one.
    unsignaled: usize,
    /// Progress passes since the last send, while `unsignaled` > 0.
    unsettled_passes: u32,
}

impl Signalling {
    /// The next inline send, with `outstanding` sends in flight in a window of `window`:
    /// how many sends its completion covers (itself and the unsignaled ones before it), and
    /// whether it asks for one (every [`SIGNAL_EVERY`], or when it fills the window).
    #[inline]
    pub fn inline_post(&mut self, outstanding: usize, window: usize) -> (usize, bool) {
        let covers = self.unsignaled + 1;
        let signaled = covers >= SIGNAL_EVERY || outstanding + 1 >= window;
        self.unsignaled = if signaled { 0 } else { covers };
        self.unsettled_passes = 0;
        (covers, signaled)
    }

    /// The next send that always asks for a completion (a staged buffer's, which its
    /// completion frees): how many sends that completion covers.
    #[inline]
    pub fn signaled_post(&mut self) -> usize {
        let covers = self.unsignaled + 1;
        self.unsignaled = 0;
        covers
    }

    /// A progress pass: whether the unsignaled sends are to be settled now.
    #[inline]
    pub fn pass(&mut self) -> bool {
        if self.unsignaled == 0 {
            return false;
        }
        self.unsettled_passes += 1;
        self.unsettled_passes >= SETTLE_AFTER_PASSES
    }

    /// A settling write goes out: what its completion covers (the unsignaled sends, none
    /// after).
    pub fn settle(&mut self) -> usize {
        let covers = self.unsignaled;
        (self.unsignaled, self.unsettled_passes) = (0, 0);
        covers
    }

    /// Sends posted unsignaled since the last signaled one.
    pub fn unsignaled(&self) -> usize {
        self.unsignaled
    }
}

/// The polled strategy's sleep handshake, both roles: this end's announcements and its
/// answers to the peer's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SleepHandshake {
    /// Announcements made (never 0 once one was: 0 is the slot's "none yet").
    announced: u32,
    /// The peer's last announcement answered (or found waiting for our next frame).
    answered: u64,
}

impl SleepHandshake {
    /// This end is about to sleep having received `received` frames (a position): the word
    /// to write into the peer's slot. The peer then raises a completion for any frame past it.
    pub fn announce(&mut self, received: u64) -> u64 {
        self.announced = self.announced.wrapping_add(1).max(1);
        (self.announced as u64) << 32 | received as u32 as u64
    }

    /// After writing frames up to `sent` (or on a progress pass), with `said` read from this
    /// end's slot: whether to raise a wake-up for the peer now. Once per announcement; an
    /// announcement at `sent` itself (the peer waits for our next frame) is answered when
    /// that frame is written. Only the low halves of the positions are compared: a peer waits
    /// at most a ring behind what we wrote.
    #[inline]
    pub fn answer(&mut self, said: u64, sent: u64) -> bool {
        if said == self.answered || (sent as u32).wrapping_sub(said as u32) == 0 {
            return false;
        }
        self.answered = said;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn every_eighth_inline_send_asks_for_a_completion_covering_those_before_it() {
        let mut s = Signalling::default();
        let posts: Vec<_> = (0..SIGNAL_EVERY * 2).map(|_| s.inline_post(0, 1000)).collect();
        assert_eq!(posts[SIGNAL_EVERY - 1], (SIGNAL_EVERY, true));
        assert!(posts[..SIGNAL_EVERY - 1].iter().all(|&(_, signaled)| !signaled));
        assert_eq!(posts[2 * SIGNAL_EVERY - 1], (SIGNAL_EVERY, true));
        // A send that fills the window asks at once.
        assert_eq!(s.inline_post(0, 1000), (1, false));
        assert_eq!(s.inline_post(9, 10), (2, true));
        // A staged send covers the unsignaled ones before it.
        s.inline_post(0, 1000);
        assert_eq!(s.signaled_post(), 2);
    }

    #[test]
    fn unsignaled_sends_are_settled_after_quiet_passes_only() {
        let mut s = Signalling::default();
        assert!(!(0..1000).any(|_| s.pass()), "nothing to settle");
        s.inline_post(0, 1000);
        for _ in 1..SETTLE_AFTER_PASSES {
            assert!(!s.pass());
        }
        s.inline_post(0, 1000); // a send restarts the count
        assert!(!(1..SETTLE_AFTER_PASSES).any(|_| s.pass()));
        assert!(s.pass());
        assert_eq!(s.settle(), 2);
        assert_eq!((s.unsignaled(), s.pass()), (0, false));
    }

    /// What a sleeping receiver (B) sees of a sender (A) that keeps writing frames, whatever
    /// the interleaving: each announcement at a position A has written past is answered once,
    /// an announcement at A's own position is answered when A writes its next frame, and a
    /// wake-up is never raised twice for one announcement.
    #[test]
    fn an_announced_sleep_is_answered_once_by_the_next_frame() {
        let (mut a, mut b) = (SleepHandshake::default(), SleepHandshake::default());
        let mut sent = 5u64;
        let said = b.announce(5); // B has everything A wrote: it waits for frame 6
        assert!(!a.answer(said, sent), "nothing to wake B for yet");
        sent += 1;
        assert!(a.answer(said, sent), "frame 6 written: wake B");
        assert!(!a.answer(said, sent), "once");
        sent += 1;
        assert!(!a.answer(said, sent), "still once: B has not slept again");
        let said = b.announce(6); // B took frame 6 only, slept again
        assert!(a.answer(said, sent), "frame 7 is there: wake at once");
    }

    proptest! {
        /// Any interleaving of announcements (at what B has received: what A sent, or a frame
        /// or two behind if B decided to sleep before those landed), frames written and
        /// answers looked for: an announcement that A has written past is answered by A's next
        /// look, and at most once.
        #[test]
        fn no_announcement_is_lost_or_answered_twice(steps in prop::collection::vec((0u8..3, 0u64..3), 1..200)) {
            let (mut a, mut b) = (SleepHandshake::default(), SleepHandshake::default());
            let mut sent = 0u64;
            let mut slot = 0u64; // B's last announcement, in A's slot
            let mut pending: Option<u64> = None; // an announcement not answered yet
            for (step, behind) in steps {
                match step {
                    0 => {
                        // B takes what it saw, then sleeps.
                        slot = b.announce(sent - behind.min(sent));
                        pending = Some(slot);
                    }
                    1 => sent += 1,
                    _ => {}
                }
                let woke = a.answer(slot, sent);
                match pending {
                    Some(p) if (sent as u32) != (p as u32) => {
                        prop_assert!(woke, "announcement at {} with {} sent not answered", p as u32, sent);
                        pending = None;
                    }
                    _ => prop_assert!(!woke, "a wake-up for nothing"),
                }
            }
        }
    }
}
