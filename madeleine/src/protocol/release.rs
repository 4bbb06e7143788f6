//! Rendezvous release counting: the receiver reads the sender's zero-copy packs in the order
//! they were issued and says how many it has read (one wrapping count); the sender frees a
//! pack's buffer once the count covers its id, and refuses a count that goes back or past
//! what it issued.

/// A release count no honest peer sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BadRelease(pub String);

/// Reads the peer's release count (how many of our rendezvous it has read, in the order we
/// issued them: see `Unpacker::release`) and checks it: it never goes back from `seen`, the
/// count we last read, nor past `issued`, the rendezvous our packers took so far (all
/// counted in wrapping u32, as the ids are). Anything else is a broken peer.
pub(crate) fn released(seen: u32, now: u32, issued: u32) -> Result<u32, BadRelease> {
    if now.wrapping_sub(seen) > issued.wrapping_sub(seen) {
        return Err(BadRelease(format!(
            "released {now} rendezvous, {} of them after {seen} when only {issued} were issued",
            now.wrapping_sub(seen)
        )));
    }
    Ok(now)
}

/// Whether rendezvous `id` is among the first `released` (wrapping: the ids within 2^31
/// below the count).
#[inline]
pub(crate) fn is_released(released: u32, id: u32) -> bool {
    released.wrapping_sub(id).wrapping_sub(1) < 1 << 31
}
