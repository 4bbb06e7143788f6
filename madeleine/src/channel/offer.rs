//! Offers on the wire (see `protocol::offer`): a connection's claim words, told to the peer at
//! set-up, the receiver's claim and the sender's withdrawal.

use portability_verbs::datapath::MsgPipe;
use portability_verbs::{AccessFlags, MemoryRegion, SendWr, VerbsError};

use crate::protocol::offer::{self, BadClaim, Outcome};
use crate::resources::Resources;
use crate::{MadError, Result};

const TAG: &[u8; 8] = b"MADCLAIM";

/// Where our claim word lies in [`ClaimWords::words`], and where our withdrawals' swaps
/// return the word they found (a cache line apart).
const CLAIM_AT: usize = 0;
const RESULT_AT: usize = 64;

/// A connection's claim words: ours, on which we claim the peer's offers, and the peer's, on
/// which we withdraw ours.
pub(crate) struct ClaimWords {
    /// Our word (one a connection: offers come one at a time) and our swaps' results, in one
    /// provider region that the peer's compare-and-swap reaches (one region a connection).
    words: MemoryRegion,
    /// Whether we told the peer our word: not where this process cannot swap it atomically
    /// with the peer's swaps (the hardware provider without `IBV_ATOMIC_GLOB`), across a
    /// network (a withdrawal's round trip there outlasts the patience), nor with offers off;
    /// the peer then never offers.
    mine: bool,
    /// The peer's word (address, key), if it takes offers and we make them.
    peer: Option<(u64, u32)>,
}

impl ClaimWords {
    /// Allocates our words and trades addresses with the peer over `pipe` (both ends call this
    /// at the same point of the connection's set-up).
    pub(crate) fn exchange(pipe: &mut MsgPipe, s: &Resources, peer: usize) -> Result<ClaimWords> {
        let timeout = s.cfg.timeout;
        let words = s.pd.alloc(RESULT_AT + 8, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC)?;
        let offers = !pipe.qp().over_network() && !s.cfg.offer_patience.is_zero();
        let mine = match words.local_atomic(CLAIM_AT, |_| offer::NONE) {
            Ok(_) => offers,
            Err(VerbsError::Unsupported(why)) => {
                log::debug!("madeleine: no offers from rank {peer}: {why}");
                false
            }
            Err(e) => return Err(e.into()),
        };
        let mut told = TAG.to_vec();
        let (addr, rkey) = if mine { (words.addr() + CLAIM_AT as u64, words.rkey()) } else { (0, 0) };
        told.extend_from_slice(&addr.to_le_bytes());
        told.extend_from_slice(&rkey.to_le_bytes());
        pipe.send(&told, timeout)?;
        pipe.flush()?;
        let theirs = pipe.recv(timeout)?;
        if theirs.len() != 20 || &theirs[..8] != TAG {
            return Err(MadError::Protocol {
                rank: peer,
                why: format!("expected the peer's claim word, got {} bytes", theirs.len()),
            });
        }
        let addr = u64::from_le_bytes(theirs[8..16].try_into().expect("8 bytes"));
        let rkey = u32::from_le_bytes(theirs[16..20].try_into().expect("4 bytes"));
        Ok(ClaimWords { words, mine, peer: (offers && addr != 0).then_some((addr, rkey)) })
    }

    /// Whether we take the peer's offers (we told it our word).
    pub(crate) fn takes_offers(&self) -> bool {
        self.mine
    }

    /// Whether the peer takes our offers.
    pub(crate) fn can_offer(&self) -> bool {
        self.peer.is_some()
    }

    /// Claims the peer's offer `id`, our word having held `last` since the previous offer
    /// settled.
    pub(crate) fn claim(&self, id: u32, last: u64) -> Result<std::result::Result<Outcome, BadClaim>> {
        if !self.mine {
            return Err(MadError::Invalid("an offer but no claim word".into()));
        }
        let found = self.words.local_atomic(CLAIM_AT, |w| if w == last { offer::claimed(id) } else { w })?;
        Ok(offer::claim_outcome(id, last, found))
    }

    /// The compare-and-swap that withdraws our offer `id` from the peer's word, which held
    /// `last` since the previous offer settled.
    pub(crate) fn withdraw_request(&self, id: u32, last: u64) -> Option<SendWr> {
        let (addr, rkey) = self.peer?;
        Some(SendWr::compare_and_swap(0, self.words.sge(RESULT_AT, 8), addr, rkey, last, offer::withdrawn(id)))
    }

    /// The outcome of a withdrawal of offer `id` whose swap completed.
    pub(crate) fn withdraw_outcome(&self, id: u32, last: u64) -> std::result::Result<Outcome, BadClaim> {
        offer::withdraw_outcome(id, last, self.words.read_u64(RESULT_AT))
    }
}
