//! Offers: zero-copy for the packs of a blocking send below the rendezvous threshold, without
//! making the sender wait for its receiver.
//!
//! A bulk-lane pack is copied twice (into the peer's ring, out of it); a rendezvous reads it
//! once, but a blocking `end_packing` then waits until the receiver reads it, which ranks that
//! both send before they receive cannot afford below the large packs (decision 005). An offer
//! is a rendezvous the sender may take back: the receiver claims it before reading it, and a
//! sender whose offer is still unclaimed after its patience (`SessionConfig::offer_patience`)
//! withdraws it and sends the pack through the bulk lane. Both are compare-and-swaps on one
//! word, the receiver's claim word: the receiver's own atomic (the common case costs it no
//! round trip), the sender's an RDMA atomic. Exactly one wins, so the receiver reads the
//! buffer only while the sender waits, and a sender never waits longer than its patience for
//! a receiver that is not there.
//!
//! The word says how the last offer settled ([`claimed`] or [`withdrawn`] with its id;
//! [`NONE`] before the first). Offers settle one at a time and in order, so both ends know
//! what it holds before the next: each swap expects that, and a swap meant for one offer
//! never takes another. [`OfferPolicy`] chooses which packs are offered: where the receiver
//! is likely waiting for them.

use std::time::Duration;

/// Bulk packs from this size on may be offered: below it one more copy costs less than the
/// claim (at 8 KiB zero-copy was 0.1-0.15 us slower one way than the bulk lane here).
pub(crate) const OFFER_MIN: usize = 16 * 1024;

/// How long a sender waits for its receiver to claim an offer before withdrawing it, by
/// default (`SessionConfig::offer_patience`). A receiver that waits for the message claims it
/// within a microsecond or two; one busy elsewhere may take any time, and the sender then
/// pays this once and copies.
pub(crate) const OFFER_PATIENCE: Duration = Duration::from_micros(20);

/// The longest pause after withdrawals, in packs the policy would offer. Pauses grow with
/// withdrawals in a row (none after the first, then 1, 3, 7, ... packs) and a claim ends
/// them: a receiver held up once (an interrupt, a page fault) costs one copied message, while
/// a pattern where receivers always come late (two ranks that each send before they
/// receive) soon pays the patience only once per this many of its messages.
pub(crate) const LONGEST_PAUSE: u32 = 64;

/// Packs not offered after the `in_a_row`-th withdrawal without a claim between.
fn pause_after(in_a_row: u32) -> u32 {
    ((1u32 << in_a_row.saturating_sub(1).min(7)) - 1).min(LONGEST_PAUSE)
}

const STATE_BITS: u32 = 2;
const CLAIMED: u64 = 1;
const WITHDRAWN: u64 = 2;

/// The claim word before any offer settled.
pub(crate) const NONE: u64 = 0;

/// The claim word once the receiver claimed offer `id` (it reads the buffer).
pub(crate) fn claimed(id: u32) -> u64 {
    u64::from(id) << STATE_BITS | CLAIMED
}

/// The claim word once the sender withdrew offer `id` (its bytes follow by the bulk lane).
pub(crate) fn withdrawn(id: u32) -> u64 {
    u64::from(id) << STATE_BITS | WITHDRAWN
}

/// Who won an offer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The receiver: it reads the sender's buffer.
    Claimed,
    /// The sender: the bytes come through the bulk lane.
    Withdrawn,
}

impl Outcome {
    /// The claim word once offer `id` settled so.
    pub fn word(self, id: u32) -> u64 {
        match self {
            Outcome::Claimed => claimed(id),
            Outcome::Withdrawn => withdrawn(id),
        }
    }
}

/// A claim word that says neither (a broken peer, or a word overwritten).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BadClaim(pub String);

/// The outcome of the receiver's claim of offer `id`: its swap expected `last`, how the
/// previous offer settled, and found `found`.
pub(crate) fn claim_outcome(id: u32, last: u64, found: u64) -> Result<Outcome, BadClaim> {
    match found {
        w if w == last => Ok(Outcome::Claimed),
        w if w == withdrawn(id) => Ok(Outcome::Withdrawn),
        w => Err(BadClaim(format!("offer {id}: the claim word holds {w:#x}, not {last:#x}"))),
    }
}

/// The outcome of the sender's withdrawal of offer `id`: its swap expected `last`, how the
/// previous offer settled, and found `found`.
pub(crate) fn withdraw_outcome(id: u32, last: u64, found: u64) -> Result<Outcome, BadClaim> {
    match found {
        w if w == last => Ok(Outcome::Withdrawn),
        w if w == claimed(id) => Ok(Outcome::Claimed),
        w => Err(BadClaim(format!("offer {id}: the claim word holds {w:#x}, not {last:#x}"))),
    }
}

/// Which bulk packs of blocking sends a connection offers: those of at least [`OFFER_MIN`]
/// bytes sent after the peer's last message to us arrived (a request answered, a ping-pong:
/// its receiver is likely waiting), not those of a stream (the receiver reads behind, and
/// offers would make each message wait for its read instead of letting copies overlap), and
/// after withdrawals in a row, none of the next few it would offer (see [`LONGEST_PAUSE`]).
#[derive(Clone, Debug, Default)]
pub(crate) struct OfferPolicy {
    /// Messages received from the peer when our previous message was sent.
    received_at_last_send: u32,
    /// Messages still to send without offers.
    paused: u32,
    /// Offers withdrawn since the last one claimed.
    withdrawn_in_a_row: u32,
    /// The peer's claim word as our last offer left it.
    last: u64,
}

impl OfferPolicy {
    /// Whether the last pack of a blocking send, `len` bytes, goes as an offer, `received`
    /// messages having come from the peer so far.
    pub fn offers(&mut self, len: usize, received: u32) -> bool {
        if len < OFFER_MIN || received == self.received_at_last_send {
            return false;
        }
        if self.paused > 0 {
            self.paused -= 1;
            return false;
        }
        true
    }

    /// A message went out, `received` messages having come from the peer so far.
    #[inline]
    pub fn sent(&mut self, received: u32) {
        self.received_at_last_send = received;
    }

    /// The peer's claim word as our last offer left it (what a withdrawal expects).
    pub fn last(&self) -> u64 {
        self.last
    }

    /// Offer `id` settled so; after withdrawals in a row the next offers wait.
    pub fn settled(&mut self, id: u32, outcome: Outcome) {
        self.last = outcome.word(id);
        match outcome {
            Outcome::Claimed => self.withdrawn_in_a_row = 0,
            Outcome::Withdrawn => {
                self.withdrawn_in_a_row = self.withdrawn_in_a_row.saturating_add(1);
                self.paused = pause_after(self.withdrawn_in_a_row);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_swap_wins_and_an_id_takes_only_its_own_offer() {
        for id in [0, 1, 7, u32::MAX] {
            for last in [NONE, claimed(id.wrapping_sub(1)), withdrawn(id.wrapping_sub(1))] {
                // Whoever comes first finds the word as the last offer left it.
                assert_eq!(claim_outcome(id, last, last), Ok(Outcome::Claimed));
                assert_eq!(withdraw_outcome(id, last, last), Ok(Outcome::Withdrawn));
                // The second finds the first's word.
                assert_eq!(claim_outcome(id, last, Outcome::Withdrawn.word(id)), Ok(Outcome::Withdrawn));
                assert_eq!(withdraw_outcome(id, last, Outcome::Claimed.word(id)), Ok(Outcome::Claimed));
                // Words of another offer, or its own swap's word, are a broken peer's.
                let other = id.wrapping_add(1);
                for w in [claimed(other), withdrawn(other), u64::MAX] {
                    assert!(claim_outcome(id, last, w).is_err(), "{id} {w:#x}");
                    assert!(withdraw_outcome(id, last, w).is_err(), "{id} {w:#x}");
                }
                assert!(claim_outcome(id, last, claimed(id)).is_err());
                assert!(withdraw_outcome(id, last, withdrawn(id)).is_err());
            }
        }
    }

    #[test]
    fn replies_are_offered_streams_are_not() {
        let mut p = OfferPolicy::default();
        // A ping-pong: each send follows a message from the peer.
        for received in 1..10 {
            assert!(p.offers(OFFER_MIN, received));
            p.sent(received);
        }
        // A stream: nothing came in between.
        assert!(!p.offers(OFFER_MIN, 9));
        p.sent(9);
        assert!(!p.offers(1 << 20, 9));
        // Too small, whatever the pattern.
        assert!(!p.offers(OFFER_MIN - 1, 10));
    }

    #[test]
    fn withdrawals_in_a_row_pause_offers_longer_and_a_claim_ends_the_pauses() {
        let mut p = OfferPolicy::default();
        let mut received = 0;
        // Offers the policy declines before it offers again.
        let mut declined_before_offering = |p: &mut OfferPolicy| {
            for declined in 0..=LONGEST_PAUSE {
                received += 1;
                let offered = p.offers(OFFER_MIN, received);
                p.sent(received);
                if offered {
                    return declined;
                }
            }
            panic!("no offer after {LONGEST_PAUSE} packs")
        };
        p.settled(0, Outcome::Claimed);
        assert_eq!(p.last(), claimed(0));
        assert_eq!(declined_before_offering(&mut p), 0);
        // One withdrawal (a receiver held up once): the next pack is offered again.
        p.settled(1, Outcome::Withdrawn);
        assert_eq!(p.last(), withdrawn(1));
        assert_eq!(declined_before_offering(&mut p), 0);
        // Receivers that keep coming late: the pauses double, up to the longest.
        let mut pauses = Vec::new();
        for id in 2..12 {
            p.settled(id, Outcome::Withdrawn);
            pauses.push(declined_before_offering(&mut p));
        }
        assert_eq!(pauses, [1, 3, 7, 15, 31, 63, 64, 64, 64, 64]);
        // A claim: a withdrawal after it pauses nothing.
        p.settled(12, Outcome::Claimed);
        p.settled(13, Outcome::Withdrawn);
        assert_eq!(declined_before_offering(&mut p), 0);
        assert_eq!(p.last(), withdrawn(13));
    }
}
