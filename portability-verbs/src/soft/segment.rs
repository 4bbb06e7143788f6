//! Shared-memory segments: a memfd mapped shared, owned by the process that created it, reachable
//! by peers through `pidfd_getfd` on the owner's descriptor number. Nothing is ever named in
//! `/dev/shm`, so a process killed at any moment leaves nothing behind.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::{MmapOptions, MmapRaw};

use crate::error::{Result, VerbsError};
use crate::os;

static NEXT_SEGMENT_ID: AtomicU64 = AtomicU64::new(1);

/// The memfd name of a segment; a peer that fetches the descriptor checks it, so a descriptor
/// number recycled by the owner is never mistaken for the segment it expects.
pub fn segment_name(ctx_id: u64, seg_id: u64) -> String {
    format!("pv-seg-{ctx_id:x}-{seg_id:x}")
}

/// The memfd name of a context's control segment.
pub fn ctrl_name(ctx_id: u64) -> String {
    format!("pv-ctrl-{ctx_id:x}")
}

/// The memfd name of a queue pair's segment.
pub fn qp_name(ctx_id: u64, qpn: u32) -> String {
    format!("pv-qp-{ctx_id:x}-{qpn:x}")
}

/// A shared segment mapped in this process.
pub struct Segment {
    /// Owns the mapping (unmapped on drop); reached through `base` and `len`.
    _map: MmapRaw,
    /// The mapping's base (page-aligned) and length, kept as plain fields: `at` runs several
    /// times per message and reaching them through the mapping object cost more than its checks.
    base: *mut u8,
    len: usize,
    file: File,
    id: u64,
}

impl Segment {
    /// Creates and maps a zeroed segment of `len` bytes (rounded up to a page), named after its
    /// context and a fresh id.
    pub fn create(ctx_id: u64, len: usize) -> Result<Segment> {
        let id = NEXT_SEGMENT_ID.fetch_add(1, Ordering::Relaxed);
        Self::create_named(&segment_name(ctx_id, id), id, len)
    }

    /// Creates and maps a zeroed segment with an explicit memfd name.
    pub fn create_named(name: &str, id: u64, len: usize) -> Result<Segment> {
        let len = round_to_page(len.max(1));
        let file = os::memfd(name, len)?;
        // Populated: a segment is a ring or registered memory both ends will go through, and a
        // first touch of each page (a fault of a few microseconds on this kind of VM) would
        // otherwise fall on the data path, once per page, in whichever process comes first.
        let map = MmapOptions::new()
            .len(len)
            .populate()
            .map_raw(&file)
            .map_err(|e| VerbsError::os("mapping a shared segment", e))?;
        Ok(Segment::from_parts(map, file, id))
    }

    fn from_parts(map: MmapRaw, file: File, id: u64) -> Segment {
        let (base, len) = (map.as_mut_ptr(), map.len());
        debug_assert_eq!(base as usize % os::page_size(), 0, "mappings are page-aligned");
        Segment { _map: map, base, len, file, id }
    }

    /// Maps a segment whose descriptor was fetched from its owner, after checking that the
    /// descriptor is the memfd named `expected_name` and at least `min_len` bytes long.
    pub fn map_fetched(fd: OwnedFd, expected_name: &str, min_len: usize) -> Result<Segment> {
        let target = os::fd_target(fd.as_raw_fd()).map_err(|e| VerbsError::os("inspecting a fetched descriptor", e))?;
        let want = format!("/memfd:{expected_name} (deleted)");
        if target != want {
            return Err(VerbsError::PeerUnreachable(format!("descriptor is {target:?}, expected {want:?}")));
        }
        // SAFETY: `fd` is an owned descriptor; File takes over its ownership.
        let file = unsafe { File::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(fd)) };
        let len = file.metadata().map_err(|e| VerbsError::os("sizing a fetched segment", e))?.len() as usize;
        if len < min_len {
            return Err(VerbsError::Protocol(format!("peer segment has {len} bytes, expected at least {min_len}")));
        }
        // Populated, as in `create_named`: the pages exist, their mapping here need not be
        // faulted in one by one while copying.
        let map = MmapOptions::new()
            .len(len)
            .populate()
            .map_raw(&file)
            .map_err(|e| VerbsError::os("mapping a peer segment", e))?;
        Ok(Segment::from_parts(map, file, 0))
    }

    /// Base address of the mapping.
    pub fn ptr(&self) -> *mut u8 {
        self.base
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Descriptor number in this process (what peers fetch).
    pub fn fd(&self) -> i32 {
        self.file.as_raw_fd()
    }
    /// Process-unique id (0 for a mapped peer segment).
    pub fn id(&self) -> u64 {
        self.id
    }
    /// A reference to a `T` at byte offset `off`.
    ///
    /// Panics if the object does not fit or is misaligned: offsets are computed by this crate's
    /// layout code, never taken from a peer.
    #[inline]
    pub fn at<T>(&self, off: usize) -> &T {
        // The base is page-aligned, so the offset's alignment is the object's (for the
        // constant offsets of the layout code this check folds away).
        assert!(off.is_multiple_of(std::mem::align_of::<T>()), "segment layout misaligned");
        assert!(off + std::mem::size_of::<T>() <= self.len, "segment layout overflow");
        // SAFETY: in bounds and aligned (checked above; alignments are far below a page); the
        // mapping lives as long as `self`; the types placed in segments are atomics or plain
        // integers, valid for any bit pattern and safe to share between threads and processes.
        unsafe { &*(self.base.add(off) as *const T) }
    }
}

/// Rounds up to the page size.
pub fn round_to_page(len: usize) -> usize {
    let page = os::page_size();
    len.div_ceil(page) * page
}

// SAFETY: a Segment is a shared mapping plus its file; all access to its contents goes through
// atomics or explicit raw copies whose synchronisation is the protocol's business.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn fetched_mapping_sees_the_same_memory_and_checks_the_name() {
        let seg = Segment::create(7, 100).unwrap();
        assert_eq!(seg.len(), os::page_size());
        let me = os::pidfd_open(std::process::id()).unwrap();
        let fd = os::pidfd_getfd(me.as_raw_fd(), seg.fd()).unwrap();
        let peer = Segment::map_fetched(fd, &segment_name(7, seg.id()), 64).unwrap();
        seg.at::<AtomicU32>(64).store(42, Ordering::Release);
        assert_eq!(peer.at::<AtomicU32>(64).load(Ordering::Acquire), 42);
        let fd = os::pidfd_getfd(me.as_raw_fd(), seg.fd()).unwrap();
        assert!(Segment::map_fetched(fd, &segment_name(8, seg.id()), 64).is_err());
    }
}
