//! A peer device context as this process reaches it: its control segment mapped here, a pidfd
//! that tells when it dies, the cross-memory-attach handle for its user memory, and the mappings of
//! its provider-allocated segments (reached with plain loads and stores).
//!
//! This is the software provider's "NIC": it checks remote keys the way a responder's HCA does
//! and performs one-sided operations without the peer's CPU.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::dma::{local_copy, local_copy_streaming};
use super::keys::key_slot;
use super::layout::{Bell, Ctrl, MrEntry, CTRL_BYTES, CTRL_MAGIC};
use super::segment::{ctrl_name, segment_name, Segment};
use crate::endpoint::SoftEndpoint;
use crate::error::{Result, VerbsError};
use crate::os::{self, RemoteMemory};
#[cfg(doc)]
use crate::types::SendFlags;
use crate::types::{AccessFlags, WcStatus};

/// Identity of a peer context: process, its start time, and the context id.
pub type PeerKey = (u32, u64, u64);

/// A peer context.
pub struct PeerCtx {
    pub key: PeerKey,
    pub same_process: bool,
    /// The peer's pidfd; none for this process itself (its descriptors are ours to duplicate,
    /// and it cannot die while we run).
    pidfd: Option<OwnedFd>,
    pub ctrl: Segment,
    mem: Option<RemoteMemory>,
    segs: Mutex<HashMap<u64, Arc<Segment>>>,
    /// The first [`FAST_SEGS`] of `segs`, found without its lock (every RDMA write into a
    /// provider segment looks its segment up): a slot's id, once published, names the same
    /// mapping for the context's life (a peer never reuses a segment id).
    fast_segs: [(AtomicU64, OnceLock<Arc<Segment>>); FAST_SEGS],
    bells: Mutex<HashMap<u32, (u32, Option<OwnedFd>)>>,
    dead: AtomicBool,
    lock_tag: u64,
}

/// Segments per peer looked up without a lock.
const FAST_SEGS: usize = 16;
/// Writes hinted [`SendFlags::streaming`] use non-temporal stores from this many bytes on
/// (shorter ones are mostly a partial line at either end).
const STREAMING_FROM: usize = 1024;

/// Where a validated remote range is reached.
#[derive(Clone, Copy)]
enum Reach {
    /// Plain loads and stores at this address in our process.
    Direct(*mut u8),
    /// Cross-memory attach at this address in the peer.
    Remote(u64),
}

/// A validated, in-use remote range. The peer's deregistration waits until it is dropped.
pub struct RemoteAccess<'a> {
    entry: &'a MrEntry,
    peer: &'a PeerCtx,
    reach: Reach,
    len: usize,
}

impl PeerCtx {
    /// Maps the peer context an endpoint names, checking that the process is the one it claims.
    pub fn attach(my_pid: u32, lock_tag: u64, ep: &SoftEndpoint) -> Result<PeerCtx> {
        let same_process = ep.pid == my_pid;
        let pidfd = if same_process {
            None
        } else {
            Some(os::pidfd_open(ep.pid).map_err(|e| VerbsError::PeerUnreachable(e.to_string()))?)
        };
        // The pidfd pins the process; its start time tells a recycled pid apart.
        let start = os::process_start_time(ep.pid).map_err(|e| VerbsError::PeerUnreachable(e.to_string()))?;
        if start != ep.start_time {
            return Err(VerbsError::PeerUnreachable(format!(
                "process {} is not the one that sent the endpoint",
                ep.pid
            )));
        }
        let fd = fetch_fd(pidfd.as_ref(), ep.ctrl_fd).map_err(|e| {
            VerbsError::PeerUnreachable(format!("{e} (cross-process access needs ptrace rights over the peer, e.g. the same user and kernel.yama.ptrace_scope 0 or 1 with a parent/child relation)"))
        })?;
        let ctrl = Segment::map_fetched(fd, &ctrl_name(ep.ctx_id), CTRL_BYTES)?;
        if Ctrl(&ctrl).header().magic.load(Ordering::Acquire) != CTRL_MAGIC {
            return Err(VerbsError::Protocol("peer control segment has a bad magic".into()));
        }
        let mem = if same_process { None } else { Some(RemoteMemory::open(ep.pid)?) };
        Ok(PeerCtx {
            key: (ep.pid, ep.start_time, ep.ctx_id),
            same_process,
            pidfd,
            ctrl,
            mem,
            segs: Mutex::new(HashMap::new()),
            fast_segs: std::array::from_fn(|_| (AtomicU64::new(0), OnceLock::new())),
            bells: Mutex::new(HashMap::new()),
            dead: AtomicBool::new(false),
            lock_tag,
        })
    }

    /// The peer's pidfd (readable once it exits), for epoll sets; none for this process.
    pub fn pidfd(&self) -> Option<i32> {
        self.pidfd.as_ref().map(|p| p.as_raw_fd())
    }

    /// A descriptor of the peer's, as a descriptor of ours.
    pub fn fetch(&self, remote_fd: i32) -> Result<OwnedFd> {
        fetch_fd(self.pidfd.as_ref(), remote_fd)
    }

    /// True while the peer process runs.
    pub fn alive(&self) -> bool {
        if self.dead.load(Ordering::Relaxed) {
            return false;
        }
        if self.pidfd.as_ref().is_none_or(os::pidfd_alive) {
            true
        } else {
            self.dead.store(true, Ordering::Relaxed);
            false
        }
    }

    pub fn ctrl(&self) -> Ctrl<'_> {
        Ctrl(&self.ctrl)
    }

    /// Validates an access to the peer's memory: key, bounds, rights and protection domain, the
    /// checks a responder makes. On success the range is marked in use until the guard drops.
    pub fn access(
        &self,
        rkey: u32,
        addr: u64,
        len: u64,
        need: AccessFlags,
        pd: u32,
    ) -> Result<RemoteAccess<'_>, WcStatus> {
        let entry = key_slot(rkey).and_then(|i| self.ctrl().mr(i)).ok_or(WcStatus::RemAccessErr)?;
        if entry.key.load(Ordering::Acquire) != rkey {
            return Err(WcStatus::RemAccessErr);
        }
        entry.inuse.fetch_add(1, Ordering::SeqCst);
        let mut guard = RemoteAccess { entry, peer: self, reach: Reach::Remote(0), len: len as usize };
        if entry.key.load(Ordering::SeqCst) != rkey {
            return Err(WcStatus::RemAccessErr);
        }
        let base = entry.addr.load(Ordering::Relaxed);
        let size = entry.len.load(Ordering::Relaxed);
        let access = AccessFlags::from_bits_truncate(entry.access.load(Ordering::Relaxed));
        let in_bounds = addr >= base && addr.checked_add(len).is_some_and(|end| end <= base.saturating_add(size));
        if !in_bounds || !access.contains(need) || entry.pd.load(Ordering::Relaxed) != pd {
            return Err(WcStatus::RemAccessErr);
        }
        let reach = if self.same_process {
            Reach::Direct(addr as usize as *mut u8)
        } else {
            match self.segment_of(entry) {
                Some((seg_ptr, seg_len)) => {
                    let off = entry.seg_off.load(Ordering::Relaxed) + (addr - base);
                    if off.checked_add(len).is_none_or(|e| e > seg_len as u64) {
                        return Err(WcStatus::RemAccessErr);
                    }
                    Reach::Direct(seg_ptr.wrapping_add(off as usize))
                }
                None => Reach::Remote(addr),
            }
        };
        guard.reach = reach;
        Ok(guard)
    }

    /// True if `rkey` names memory this process reaches with plain stores (a provider segment,
    /// or any memory of a same-process peer): writes there cost no more than copying through
    /// the ring, and leave the responder nothing to place. A hint only: [`PeerCtx::access`]
    /// makes the checks.
    pub fn stores_directly(&self, rkey: u32) -> bool {
        self.same_process
            || key_slot(rkey)
                .and_then(|i| self.ctrl().mr(i))
                .is_some_and(|e| e.key.load(Ordering::Acquire) == rkey && e.seg_id.load(Ordering::Relaxed) != 0)
    }

    /// The mapping (address and length here) of the provider segment holding a region,
    /// fetched and mapped on first use; it stays mapped while this context lives. None for user
    /// memory, or if the segment cannot be had (then cross-memory attach serves).
    fn segment_of(&self, entry: &MrEntry) -> Option<(*mut u8, usize)> {
        let id = entry.seg_id.load(Ordering::Relaxed);
        if id == 0 {
            return None;
        }
        for (slot_id, seg) in &self.fast_segs {
            match slot_id.load(Ordering::Acquire) {
                0 => break,
                v if v == id => return seg.get().map(|s| (s.ptr(), s.len())),
                _ => {}
            }
        }
        self.map_segment(entry, id).map(|s| (s.ptr(), s.len()))
    }

    /// [`PeerCtx::segment_of`]'s mapping itself, mapped on first use (the lookup under the lock).
    #[inline(never)]
    fn map_segment(&self, entry: &MrEntry, id: u64) -> Option<Arc<Segment>> {
        let mut segs = self.segs.lock().expect("segment cache lock");
        if let Some(s) = segs.get(&id) {
            return Some(s.clone());
        }
        let fd = self.fetch(entry.seg_fd.load(Ordering::Relaxed)).ok()?;
        let seg = Arc::new(Segment::map_fetched(fd, &segment_name(self.key.2, id), 1).ok()?);
        // Published under the lock: slots fill in order, each once.
        if let Some((slot_id, slot)) = self.fast_segs.iter().find(|(i, _)| i.load(Ordering::Relaxed) == 0) {
            if slot.set(seg.clone()).is_ok() {
                slot_id.store(id, Ordering::Release);
            }
        }
        segs.insert(id, seg.clone());
        Some(seg)
    }

    /// A window onto `len` bytes at `addr` of the peer's region `rkey` (checked as
    /// [`PeerCtx::access`] checks a write), through this process's own mapping of the provider
    /// segment holding it. None if the region is not in a provider segment (the peer's heap is
    /// reached with cross-memory attach only), or the segment cannot be mapped.
    pub fn window(
        self: &Arc<Self>,
        rkey: u32,
        addr: u64,
        len: u64,
        pd: u32,
        peer_qp: Arc<Segment>,
    ) -> Result<Option<SoftWindow>, WcStatus> {
        let access = self.access(rkey, addr, len, AccessFlags::REMOTE_WRITE, pd)?;
        let entry = access.entry;
        let id = entry.seg_id.load(Ordering::Relaxed);
        if id == 0 || len == 0 {
            return Ok(None);
        }
        let Some(seg) = self.map_segment(entry, id) else { return Ok(None) };
        let off = entry.seg_off.load(Ordering::Relaxed) + (addr - entry.addr.load(Ordering::Relaxed));
        if off.checked_add(len).is_none_or(|e| e > seg.len() as u64) {
            return Err(WcStatus::RemAccessErr);
        }
        let slot = key_slot(rkey).ok_or(WcStatus::RemAccessErr)?;
        // Checked again now that the mapping exists: a region deregistered meanwhile is refused.
        if entry.key.load(Ordering::Acquire) != rkey {
            return Err(WcStatus::RemAccessErr);
        }
        Ok(Some(SoftWindow {
            base: seg.ptr().wrapping_add(off as usize),
            len: len as usize,
            rkey,
            seg_id: id,
            slot,
            peer: self.clone(),
            peer_qp,
            _seg: seg,
        }))
    }

    /// Wakes the owner of doorbell `slot` if it armed it (sleeps or is about to). Inlined into
    /// every send and receive: the usual answer (not armed) is one load.
    #[inline]
    pub fn ring_bell(&self, slot: u32) {
        let Some(bell) = self.ctrl().bell(slot as usize) else {
            return;
        };
        // Dekker with the owner's arm-then-check (see `os::sleeper_barrier`).
        os::producer_barrier();
        if bell.armed.load(Ordering::Relaxed) != 0 {
            self.wake(bell, slot);
        }
    }

    /// [`PeerCtx::ring_bell`] found the doorbell armed: disarms it and signals its eventfd.
    #[cold]
    #[inline(never)]
    fn wake(&self, bell: &Bell, slot: u32) {
        if bell.armed.swap(0, Ordering::AcqRel) == 0 {
            return;
        }
        let generation = bell.generation.load(Ordering::Acquire);
        let mut bells = self.bells.lock().expect("bell cache lock");
        let fresh = !matches!(bells.get(&slot), Some((g, _)) if *g == generation);
        if fresh {
            let fd = self.fetch(bell.eventfd.load(Ordering::Acquire)).ok();
            bells.insert(slot, (generation, fd));
        }
        if let Some((_, Some(fd))) = bells.get(&slot) {
            os::eventfd_signal(fd.as_raw_fd());
        }
    }

    /// Copies `len` local bytes at `src` to address `to` in the peer process, by cross-memory
    /// attach, or through `/proc/PID/mem` where the peer protected the pages (as DMA would
    /// reach them) or this process may not read `src` (a receive hold). The caller has
    /// validated both ranges; no key is checked here.
    ///
    /// # Safety
    /// `src` must be valid for `len` bytes (a checked registration or provider memory).
    pub unsafe fn push(&self, to: u64, src: *const u8, len: usize) -> Result<(), WcStatus> {
        let mem = self.mem.as_ref().ok_or(WcStatus::GeneralErr)?;
        let direct = !crate::protect::read_blocked(src as usize, len) && {
            // SAFETY: the caller vouches that `src` is valid for `len` bytes; only the
            // kernel reads it (EFAULT, not a fault, if it is not readable).
            let bytes = unsafe { std::slice::from_raw_parts(src, len) };
            mem.write(to, bytes).is_ok()
        };
        // A source this process may not read (under a receive hold): through /proc/self/mem,
        // which ignores protection as DMA does.
        if !direct && !bounce(len, |at, tmp| os::read_self_mem(src as u64 + at, tmp).and(mem.write(to + at, tmp))) {
            return Err(WcStatus::RemAccessErr);
        }
        Ok(())
    }

    /// Runs `f` holding the peer's atomic lock, so atomics from every initiator on that peer's
    /// memory are atomic with respect to each other (the verbs `IBV_ATOMIC_HCA` guarantee).
    pub fn with_atomic_lock<R>(&self, f: impl FnOnce() -> R) -> Result<R, WcStatus> {
        with_atomic_lock(&self.ctrl().header().atomic_lock, self.lock_tag, f)
    }
}

/// A descriptor of the process behind `pidfd` (none: this process) as a descriptor of ours.
fn fetch_fd(pidfd: Option<&OwnedFd>, remote_fd: i32) -> Result<OwnedFd> {
    match pidfd {
        Some(p) => os::pidfd_getfd(p.as_raw_fd(), remote_fd),
        None => os::dup_fd(remote_fd),
    }
}

/// Runs `f` holding a context's atomic lock (`lock`, in its control segment), taken with `tag`
/// (pid in the high half): the lock every atomic on that context's memory takes, whichever
/// process runs it. A holder that died is detected and the lock taken over; a live holder that
/// keeps it for 5 s is an error.
pub fn with_atomic_lock<R>(lock: &AtomicU64, tag: u64, f: impl FnOnce() -> R) -> Result<R, WcStatus> {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        let cur = lock.load(Ordering::Relaxed);
        if cur == 0 && lock.compare_exchange(0, tag, Ordering::Acquire, Ordering::Relaxed).is_ok() {
            break;
        }
        spins += 1;
        if spins.is_multiple_of(1024) {
            if start.elapsed() > Duration::from_millis(100) {
                // A holder that died keeps the lock for ever: take it over.
                let holder = (cur >> 32) as u32;
                let holder_alive = holder != 0
                    && (holder == std::process::id() || os::pidfd_open(holder).is_ok_and(|fd| os::pidfd_alive(&fd)));
                if !holder_alive && lock.compare_exchange(cur, tag, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                    break;
                }
                if start.elapsed() > Duration::from_secs(5) {
                    return Err(WcStatus::RemOpErr);
                }
            }
            std::thread::yield_now();
        }
        std::hint::spin_loop();
    }
    let r = f();
    lock.store(0, Ordering::Release);
    Ok(r)
}

/// Runs `step(offset, chunk)` over `len` bytes in chunks of a per-thread bounce buffer; false
/// at the first failing chunk. For copies the kernel makes only through an intermediate buffer.
fn bounce(len: usize, mut step: impl FnMut(u64, &mut [u8]) -> std::io::Result<()>) -> bool {
    const CHUNK: usize = 256 << 10;
    thread_local! {
        static BOUNCE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    BOUNCE.with(|b| {
        let mut b = b.borrow_mut();
        b.resize(len.min(CHUNK), 0);
        (0..len).step_by(CHUNK).all(|at| step(at as u64, &mut b[..CHUNK.min(len - at)]).is_ok())
    })
}

impl RemoteAccess<'_> {
    /// Copies `len` local bytes at `src` into the remote range at byte offset `off`, with
    /// non-temporal stores if `streaming` (a write's [`SendFlags::streaming`] hint) and the range
    /// is reached through shared memory.
    ///
    /// # Safety
    /// `src` must be valid for `len` bytes (a checked local registration or provider memory).
    pub unsafe fn write_from(&self, off: usize, src: *const u8, len: usize, streaming: bool) -> Result<(), WcStatus> {
        if off.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(WcStatus::RemAccessErr);
        }
        match self.reach {
            // SAFETY: the destination was validated against a live registration (in use until
            // this guard drops); the caller vouches for the source.
            Reach::Direct(p) => {
                // The range's last 8 bytes are placed after the rest, as a NIC's in-order DMA
                // places them: a reader polling them (an RDMA fast path) then sees the whole
                // write. (Pieces come in order, so only the last one is split.)
                let last = if off + len == self.len { len.min(8) } else { 0 };
                // SAFETY (both): as above; the two pieces split the checked range.
                let placed = if streaming && len >= STREAMING_FROM {
                    unsafe { local_copy_streaming(p.add(off), src, len - last) }
                } else {
                    unsafe { local_copy(p.add(off), src, len - last) }
                } && {
                    std::sync::atomic::fence(Ordering::Release);
                    // SAFETY: see above.
                    unsafe { local_copy(p.add(off + len - last), src.add(len - last), last) }
                };
                if !placed {
                    return Err(WcStatus::RemAccessErr);
                }
            }
            // SAFETY: the caller vouches for the source; the range was validated.
            Reach::Remote(addr) => unsafe { self.peer.push(addr + off as u64, src, len)? },
        }
        Ok(())
    }

    /// Copies `parts`, put end to end, into the remote range from its start, as
    /// [`RemoteAccess::write_from`] would piece by piece: the range's last 8 bytes are placed
    /// after the rest. While no protection hold is active (the usual case) a range reached
    /// through shared memory takes plain copies with one check for the whole write, which is
    /// what makes a small frame of several parts cheap.
    ///
    /// # Safety
    /// Every part must be valid for reads of its length.
    pub unsafe fn write_parts(&self, parts: &[&[u8]]) -> Result<(), WcStatus> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if len > self.len {
            return Err(WcStatus::RemAccessErr);
        }
        match (self.reach, parts.split_last()) {
            (Reach::Direct(p), Some(_)) if !crate::protect::any_active() => {
                // SAFETY: `len <= self.len`: the parts go inside the checked destination (live
                // while this guard is); the caller vouches for the parts.
                unsafe {
                    store_parts(p, parts, |d, s, n| {
                        crate::copy::copy_bytes(d, s, n);
                        true
                    })
                };
                Ok(())
            }
            _ => {
                let mut off = 0;
                parts.iter().try_for_each(|part| {
                    // SAFETY: forwarded from the caller.
                    let r = unsafe { self.write_from(off, part.as_ptr(), part.len(), false) };
                    off += part.len();
                    r
                })
            }
        }
    }

    /// The range's address in the peer when it is reached by cross-memory attach (None when
    /// this process reaches it with plain loads and stores).
    pub fn cross_process_addr(&self) -> Option<u64> {
        match self.reach {
            Reach::Remote(addr) => Some(addr),
            Reach::Direct(_) => None,
        }
    }

    /// Copies `len` remote bytes at byte offset `off` into local memory at `dst`.
    ///
    /// # Safety
    /// `dst` must be valid for writes of `len` bytes.
    pub unsafe fn read_into(&self, off: usize, dst: *mut u8, len: usize) -> Result<(), WcStatus> {
        if off.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(WcStatus::RemAccessErr);
        }
        match self.reach {
            // SAFETY: as in `write_from`, with the roles swapped.
            Reach::Direct(p) => {
                if !unsafe { local_copy(dst, p.add(off), len) } {
                    return Err(WcStatus::RemAccessErr);
                }
            }
            Reach::Remote(addr) => {
                let mem = self.peer.mem.as_ref().ok_or(WcStatus::GeneralErr)?;
                let from = addr + off as u64;
                // (Checked first: a kernel copy into a read-only page fails only after trying
                // both cross-memory attach and /proc/PID/mem, two system calls wasted.)
                let direct = !crate::protect::kernel_write_blocked(dst as usize, len) && {
                    // SAFETY: the caller vouches that `dst` is valid for writes of `len` bytes;
                    // only the kernel writes it (EFAULT, not a fault, if it is not writable).
                    let bytes = unsafe { std::slice::from_raw_parts_mut(dst, len) };
                    mem.read(from, bytes).is_ok()
                };
                // A destination protected against this process (an asynchronous receive, or a
                // page a send keeps read-only, held or lazily): the kernel will not copy into it, so bounce
                // through /proc/self/mem, which reaches it as a NIC's DMA would.
                if !direct
                    && !bounce(len, |at, tmp| mem.read(from + at, tmp).and(os::write_self_mem(dst as u64 + at, tmp)))
                {
                    return Err(WcStatus::RemAccessErr);
                }
            }
        }
        Ok(())
    }

    /// Bytes of the validated range.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Runs a 64-bit atomic on the (8-byte, aligned) range under the peer's atomic lock; returns
    /// the old value.
    pub fn atomic(&self, op: impl FnOnce(u64) -> u64) -> Result<u64, WcStatus> {
        if self.len != 8 {
            return Err(WcStatus::RemInvReqErr);
        }
        self.peer.with_atomic_lock(|| -> Result<u64, WcStatus> {
            let mut old = [0u8; 8];
            // SAFETY: `old` is a valid local 8-byte buffer.
            unsafe { self.read_into(0, old.as_mut_ptr(), 8)? };
            let old = u64::from_ne_bytes(old);
            let new = op(old).to_ne_bytes();
            // SAFETY: `new` is a valid local 8-byte buffer.
            unsafe { self.write_from(0, new.as_ptr(), 8, false)? };
            Ok(old)
        })?
    }
}

/// A peer's registered memory written with plain stores, without a queue pair: the software
/// provider's remote-key pointer (what UCX calls `rkey_ptr`), for a sender that writes small
/// frames into a peer's ring many times a microsecond.
///
/// Why this is safe against the peer: the stores go to this process's own mapping of the
/// provider segment holding the region. A segment id is never reused, and a segment's pages
/// live for as long as any mapping of them does. So a store that races with the peer's
/// deregistration lands in pages no live region of the peer uses (as if it had landed just
/// before), and every write after the deregistration is seen to fail: [`SoftWindow::write`]
/// checks the key and the segment before storing, one shared cache line.
pub struct SoftWindow {
    base: *mut u8,
    len: usize,
    rkey: u32,
    seg_id: u64,
    slot: usize,
    /// Keeps the peer's control segment (the key table read on every write) mapped.
    peer: Arc<PeerCtx>,
    /// The segment of the peer queue pair: its state says when the peer stops answering.
    peer_qp: Arc<Segment>,
    /// Keeps `base` mapped.
    _seg: Arc<Segment>,
}

impl std::fmt::Debug for SoftWindow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SoftWindow").field("len", &self.len).finish_non_exhaustive()
    }
}

// SAFETY: `base` points into `_seg`, a shared mapping owned by the window; writes through it
// are plain stores any thread may make (the caller orders its own writes).
unsafe impl Send for SoftWindow {}
// SAFETY: as above; `write` takes `&self` and touches only the mapping and atomics.
unsafe impl Sync for SoftWindow {}

impl SoftWindow {
    /// Bytes of the window.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty window (never made: a window maps at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Writes `parts` end to end at `offset`, their last 8 bytes placed last (a reader polling
    /// the last word of a frame sees the rest once it sees that word). Refused, writing
    /// nothing, once the peer deregistered the region (`RemAccessErr`) or its queue pair is in
    /// error or destroyed (`RetryExcErr`), or if the range leaves the window (`LocLenErr`);
    /// `LocProtErr` if a part may not be read (a protection hold), the parts before it written.
    /// With `streaming`, parts of at least `STREAMING_FROM` bytes go with non-temporal stores.
    #[inline]
    pub fn write(&self, offset: usize, parts: &[&[u8]], streaming: bool) -> Result<(), WcStatus> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        self.check_writable(offset, len)?;
        if !streaming {
            // A frame's lines, last read by the peer's CPU, asked for all at once.
            crate::copy::prefetch_for_write(self.base.wrapping_add(offset), len);
        }
        // SAFETY: `offset + len <= self.len`: the parts go inside our own live mapping of the
        // region's segment (held by `_seg`); they are the caller's live slices, and
        // `local_copy` turns a source under a protection hold into `false`, not a fault.
        let stored = unsafe {
            store_parts(self.base.add(offset), parts, |d, s, n| {
                if streaming && n >= STREAMING_FROM {
                    local_copy_streaming(d, s, n)
                } else {
                    local_copy(d, s, n)
                }
            })
        };
        if stored {
            Ok(())
        } else {
            Err(WcStatus::LocProtErr)
        }
    }

    /// Writes `bytes` at `offset`, their last 8 placed last, as [`SoftWindow::write`] does
    /// with one part; in fewer instructions where they are 8 to 128 and no protection hold is
    /// active (a small message's path goes through here once per message).
    #[inline]
    pub fn write_small(&self, offset: usize, bytes: &[u8]) -> Result<(), WcStatus> {
        let len = bytes.len();
        if !(8..=128).contains(&len) || crate::protect::any_active() {
            // (A hold may lie on the destination: the general path goes around it.)
            return self.write(offset, &[bytes], false);
        }
        self.check_writable(offset, len)?;
        let split = len - 8;
        // SAFETY: `offset + len <= self.len` (checked): both stores go inside our own live
        // mapping of the region's segment (held by `_seg`), which no hold covers (none is
        // active); `bytes` is the caller's live slice of `len >= 8` bytes.
        unsafe {
            let dst = self.base.add(offset);
            crate::copy::copy_bytes(dst, bytes.as_ptr(), split);
            std::sync::atomic::fence(Ordering::Release);
            let last = std::ptr::read_unaligned(bytes.as_ptr().add(split) as *const u64);
            std::ptr::write_unaligned(dst.add(split) as *mut u64, last);
        }
        Ok(())
    }

    /// Refuses a write of `len` bytes at `offset` outside the window, after the peer's queue
    /// pair stopped answering, or once the peer deregistered the region (`write`'s errors).
    #[inline]
    fn check_writable(&self, offset: usize, len: usize) -> Result<(), WcStatus> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(WcStatus::LocLenErr);
        }
        if super::layout::qp_seg_gone(&self.peer_qp) {
            return Err(WcStatus::RetryExcErr);
        }
        let entry = self.peer.ctrl().mr(self.slot).ok_or(WcStatus::RemAccessErr)?;
        if entry.key.load(Ordering::Acquire) != self.rkey || entry.seg_id.load(Ordering::Relaxed) != self.seg_id {
            return Err(WcStatus::RemAccessErr);
        }
        Ok(())
    }
}

/// Copies `parts` end to end to `dst` with `copy`, their last 8 bytes last, behind a release
/// fence: a reader polling the last word of a write sees the rest once it sees that word (one
/// copy of many bytes may place them in any order). False as soon as a `copy` fails.
///
/// # Safety
/// `dst` must be valid for writes of the parts' total length, and `copy(dst, src, n)` safe to
/// call for each piece of a part at its place there.
#[inline]
unsafe fn store_parts(dst: *mut u8, parts: &[&[u8]], copy: impl Fn(*mut u8, *const u8, usize) -> bool) -> bool {
    let Some((last, rest)) = parts.split_last() else { return true };
    let mut off = 0;
    for part in rest {
        // SAFETY: `off + part.len()` is within the total (the caller's promise).
        if !copy(unsafe { dst.add(off) }, part.as_ptr(), part.len()) {
            return false;
        }
        off += part.len();
    }
    let split = last.len().saturating_sub(8);
    // SAFETY (both): as above, the last part in two pieces.
    copy(unsafe { dst.add(off) }, last.as_ptr(), split) && {
        std::sync::atomic::fence(Ordering::Release);
        copy(unsafe { dst.add(off + split) }, last.as_ptr().wrapping_add(split), last.len() - split)
    }
}

impl Drop for RemoteAccess<'_> {
    fn drop(&mut self) {
        self.entry.inuse.fetch_sub(1, Ordering::SeqCst);
    }
}
