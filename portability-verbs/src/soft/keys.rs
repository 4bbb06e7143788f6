//! Memory-region keys as the software provider checks them: the key layout (slot and
//! generation), the local key table's entries, and the view through which requests check
//! their local and remote accesses without a lock.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::layout::MR_SLOTS;
use crate::types::AccessFlags;

/// True when `[addr, addr+len)` lies inside the region `[start, start+size)`.
#[inline]
fn covers(start: u64, size: u64, addr: u64, len: u64) -> bool {
    addr >= start && addr.checked_add(len).is_some_and(|end| end <= start + size)
}

/// Key layout: `(slot + 1) << 8 | generation`, generation never 0, so 0 is never a valid key
/// and a key of a freed registration does not match a later one in the same slot.
pub fn key_slot(key: u32) -> Option<usize> {
    let s = (key >> 8) as usize;
    ((1..=MR_SLOTS).contains(&s) && key & 0xff != 0).then(|| s - 1)
}

/// One registration as local checks read it (the authoritative private copy; peers read the
/// one in the control segment). `register` stores the fields, then the key
/// (release); `deregister` clears the key first. Readers holding a queue pair's lock of this
/// context read it with plain loads (see [`LocalKeys`]).
#[derive(Default)]
pub struct KeyEntry {
    pub key: AtomicU32,
    pub pd: AtomicU32,
    pub access: AtomicU32,
    pub addr: AtomicU64,
    pub len: AtomicU64,
}

impl KeyEntry {
    /// True when this entry holds `key` with `pd`, rights `need` and `[addr, addr+len)` inside.
    /// Its fields are stable while the key matches: a slot is refilled only after every reader
    /// that could have seen the old key is done (see [`CtxInner::deregister`]).
    #[inline]
    fn grants(&self, key: u32, addr: u64, len: u64, need: AccessFlags, pd: u32) -> bool {
        self.key.load(Ordering::Acquire) == key
            && self.pd.load(Ordering::Relaxed) == pd
            && AccessFlags::from_bits_truncate(self.access.load(Ordering::Relaxed)).contains(need)
            && covers(self.addr.load(Ordering::Relaxed), self.len.load(Ordering::Relaxed), addr, len)
    }
}

/// A view of the local key table: while it lives, no region it grants is deregistered.
pub struct LocalKeys<'a> {
    keys: &'a [KeyEntry],
    _changing: Option<std::sync::RwLockReadGuard<'a, ()>>,
}

impl<'a> LocalKeys<'a> {
    /// A view of `keys`, holding deregistrations off through `changing` where the reader holds
    /// no queue-pair lock.
    pub fn new(keys: &'a [KeyEntry], changing: Option<std::sync::RwLockReadGuard<'a, ()>>) -> Self {
        LocalKeys { keys, _changing: changing }
    }
}

impl LocalKeys<'_> {
    /// Validates one local access.
    #[inline]
    pub fn check(&self, key: u32, addr: u64, len: u64, need: AccessFlags, pd: u32) -> bool {
        len == 0 || key_slot(key).is_some_and(|i| self.keys[i].grants(key, addr, len, need, pd))
    }

    /// Validates a whole local SGE list (for operations whose data moves later, or to report a
    /// protection error before anything moved).
    pub fn check_all(&self, sges: &[crate::Sge], need: AccessFlags, pd: u32) -> bool {
        sges.iter().all(|s| self.check(s.lkey, s.addr, s.length as u64, need, pd))
    }

    /// Looks up a key for an access coming from a peer through this QP (rkey check at target).
    pub fn remote(&self, key: u32, addr: u64, len: u64, need: AccessFlags, pd: u32) -> bool {
        self.check(key, addr, len, need, pd) && key != 0
    }
}
