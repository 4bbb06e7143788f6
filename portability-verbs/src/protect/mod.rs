//! Memory protection of application buffers the transport still owns: the one place that calls
//! `mprotect` on them, and the fault handler that makes a touch of such a buffer wait.
//!
//! Asynchronous zero-copy sockets return from `send` while the network still reads the buffer,
//! and from `recv` before the data has landed. To keep synchronous semantics they *hold* the
//! buffer: [`protect`] makes its pages read-only (a send: reading is harmless, writing would
//! change what the peer gets) or inaccessible (a receive: the data is not there yet). Holds may
//! overlap (the same buffer sent twice, a page shared by two buffers): each page gets the
//! strictest protection of the holds covering it, recomputed when a hold comes or goes.
//!
//! A thread that touches a held page faults into the `fault` module's SIGSEGV handler, which waits (a
//! futex, async-signal-safe) until the holds forbidding that access are released and then lets
//! the access retry; faults on pages nobody holds go to the handler installed before ours.
//! Releasing a hold is the transport's job (its progress path), so the progress path must never
//! touch held memory with plain loads and stores — the software provider goes through
//! `/proc/self/mem` for held ranges ([`overlaps`]), as a NIC's DMA ignores page protection.
//!
//! Buffers mapped twice (two `mmap`s of one file or memfd) are protected together once
//! [`register_alias`] has been told about them.
//!
//! A send hold may end *lazily* ([`ProtectedRange::release_lazily`]): its pages stay read-only
//! with nobody waiting on them, and the first write opens them from the fault handler (no wait).
//! Sending the same buffer again then re-protects it at the cost of an `mprotect` that changes
//! nothing ([`LazyRange::reprotect`], about 0.5 us on a VM where a real change of 16 pages
//! costs 4 us, and more with a TLB shootdown per CPU the process runs on). Whoever keeps a
//! [`LazyRange`] must drop it before the memory may be unmapped.

mod fault;

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use pv_sync::slot::{RangeSlot, FREE};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use crate::error::{Result, VerbsError};

pub use fault::{fault_bell, fault_waiters, faults_handled, guarded_read, ring_bell, wait_bell};

/// How many holds may exist at once in the process.
pub const MAX_HOLDS: usize = 1024;

/// The protection a hold asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protection {
    /// No access (reads and writes fault): a receive buffer whose data has not landed.
    None,
    /// Read-only (writes fault): a send buffer the peer has not read yet.
    ReadOnly,
}

/// Strictness of a page or hold: 0 untouched, 1 read-only, 2 no access.
const OPEN: u8 = FREE;
const READ_ONLY: u8 = 1;
const NO_ACCESS: u8 = 2;
/// A lazily released send hold: pages still read-only, nothing waits on them.
const LAZY: u8 = 3;
/// A lazy range being opened (by the fault handler or its owner).
const LAZY_OPENING: u8 = 4;
/// A lazy range opened again; the slot still belongs to its [`LazyRange`].
const LAZY_OPEN: u8 = 5;

/// True for the levels of a live hold (which shape page protection).
fn is_hold(level: u8) -> bool {
    level == READ_ONLY || level == NO_ACCESS
}

/// True if a slot at `level` forbids a read (or, with `write`, a write).
fn blocks(level: u8, write: bool) -> bool {
    match level {
        READ_ONLY => write,
        NO_ACCESS => true,
        _ => false,
    }
}

impl Protection {
    fn level(self) -> u8 {
        match self {
            Protection::None => NO_ACCESS,
            Protection::ReadOnly => READ_ONLY,
        }
    }
}

/// One hold as the fault handler sees it: published only under [`WRITER`], read lock-free
/// (level `OPEN` while the slot is free).
struct Slot {
    hold: RangeSlot,
    /// Faults the handler waited out on this hold.
    faults: AtomicU32,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE_SLOT: Slot = Slot { hold: RangeSlot::new(), faults: AtomicU32::new(0) };
static SLOTS: [Slot; MAX_HOLDS] = [FREE_SLOT; MAX_HOLDS];
/// One past the highest slot index ever used (bounds the lock-free scans).
static USED: AtomicUsize = AtomicUsize::new(0);
/// Live holds.
static ACTIVE: AtomicUsize = AtomicUsize::new(0);
/// Bumped after every release, before its slot is freed: a futex word fault waiters sleep on.
static RELEASES: AtomicU32 = AtomicU32::new(0);

struct Writer {
    free: Vec<usize>,
    aliases: Vec<Alias>,
}

/// Two page-aligned ranges that map the same memory.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Alias {
    a: usize,
    b: usize,
    len: usize,
}

static WRITER: Mutex<Writer> = Mutex::new(Writer { free: Vec::new(), aliases: Vec::new() });

fn writer() -> std::sync::MutexGuard<'static, Writer> {
    WRITER.lock().unwrap_or_else(|p| p.into_inner())
}

/// True while some range of this process is held.
#[inline]
pub fn any_active() -> bool {
    ACTIVE.load(Ordering::Acquire) != 0
}

/// True if any hold covers a byte of `[addr, addr + len)`: plain loads or stores there may fault.
#[inline]
pub fn overlaps(addr: usize, len: usize) -> bool {
    any_active() && blocking_hold(addr, len, true).is_some()
}

/// True if the kernel may find a page of `[addr, addr + len)` not writable right now: a hold
/// there, or a lazily released send hold not yet opened (its pages stay read-only until a
/// store opens them; a kernel copy into them fails with `EFAULT` instead). Lock-free.
#[inline]
pub fn kernel_write_blocked(addr: usize, len: usize) -> bool {
    USED.load(Ordering::Acquire) != 0
        && overlapping(addr, addr.saturating_add(len.max(1)))
            .any(|o| blocks(o.level, true) || matches!(o.level, LAZY | LAZY_OPENING))
}

/// True if some hold forbids reading a byte of `[addr, addr + len)`.
#[inline]
pub fn read_blocked(addr: usize, len: usize) -> bool {
    any_active() && blocking_hold(addr, len, false).is_some()
}

/// The index of a live hold that forbids a read (or, with `write`, a write) somewhere in
/// `[addr, addr + len)`. Lock-free and async-signal-safe.
fn blocking_hold(addr: usize, len: usize, write: bool) -> Option<usize> {
    overlapping(addr, addr.saturating_add(len.max(1))).find(|o| blocks(o.level, write)).map(|o| o.index)
}

/// A slot in use as a scan finds it.
#[derive(Clone, Copy)]
struct Seen {
    index: usize,
    level: u8,
    start: usize,
    end: usize,
}

/// The slots in use (holds and lazy ranges) whose range meets `[start, end)`. Lock-free and
/// async-signal-safe: every scan of the table, the fault handler's included, goes through it.
fn overlapping(start: usize, end: usize) -> impl Iterator<Item = Seen> {
    let used = USED.load(Ordering::Acquire);
    SLOTS[..used].iter().enumerate().filter_map(move |(index, s)| {
        // One publication's range and level (a slot being republished reads as free).
        let h = s.hold.snapshot()?;
        (h.start < end && start < h.end).then_some(Seen { index, level: h.level, start: h.start, end: h.end })
    })
}

/// What the holds say about a copy of `len` bytes from `src` to `dst`, found in one lock-free
/// scan (the provider asks for every copy it makes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CopyHolds {
    /// A hold forbids writing into the destination.
    pub dst_held: bool,
    /// A hold forbids reading the source.
    pub src_read_blocked: bool,
    /// A hold covers the source (read-only ones included: loads are fine, stores would fault).
    pub src_held: bool,
}

/// The holds over a copy's destination and source (see [`CopyHolds`]).
#[inline]
pub fn copy_holds(dst: usize, src: usize, len: usize) -> CopyHolds {
    let mut h = CopyHolds::default();
    if !any_active() || len == 0 {
        return h;
    }
    let (dst_end, src_end) = (dst.saturating_add(len), src.saturating_add(len));
    let (lo, hi) = (dst.min(src), dst_end.max(src_end));
    for o in overlapping(lo, hi) {
        if o.start < dst_end && dst < o.end && blocks(o.level, true) {
            h.dst_held = true;
        }
        if o.start < src_end && src < o.end {
            h.src_read_blocked |= blocks(o.level, false);
            h.src_held |= blocks(o.level, true);
        }
    }
    h
}

/// True if a live read-only hold covers `addr` (a read fault there means the page is gone).
/// Lock-free and async-signal-safe.
fn read_only_hold_at(addr: usize) -> bool {
    overlapping(addr, addr.saturating_add(1)).any(|o| o.level == READ_ONLY)
}

/// The lazy range (not yet opened, or being opened) covering `addr`. Lock-free and
/// async-signal-safe.
fn lazy_at(addr: usize) -> Option<usize> {
    overlapping(addr, addr.saturating_add(1)).find(|o| matches!(o.level, LAZY | LAZY_OPENING)).map(|o| o.index)
}

/// Opens lazy range `i` (read-write again) if it is still lazy; returns whether this call did
/// it. Async-signal-safe: the fault handler calls it on a write to such a range.
fn open_lazy(i: usize) -> bool {
    let s = &SLOTS[i];
    if !s.hold.swap_level(LAZY, LAZY_OPENING) {
        return false;
    }
    let (start, end) = s.hold.range();
    let rw = libc::PROT_READ | libc::PROT_WRITE;
    // SAFETY: the range was protected by a hold whose owner vouched for it and keeps it mapped
    // while the lazy range lives (a hole unmapped against that contract just fails, page by
    // page, without opening anything mapped there since).
    if !unsafe { crate::os::mprotect(start, end - start, rw) } {
        let page = crate::os::page_size();
        for p in (start..end).step_by(page) {
            // SAFETY: as above, one page at a time.
            unsafe { crate::os::mprotect(p, page, rw) };
        }
    }
    // Pages open first, then the generation moves (see `fault`).
    RELEASES.fetch_add(1, Ordering::AcqRel);
    s.hold.set_level(LAZY_OPEN);
    fault::wake_releases();
    true
}

/// Waits while someone else opens lazy range `i`. Async-signal-safe.
fn wait_opened(i: usize) {
    while SLOTS[i].hold.level() == LAZY_OPENING {
        let seen = RELEASES.load(Ordering::Acquire);
        if SLOTS[i].hold.level() != LAZY_OPENING {
            break;
        }
        fault::sleep_on_releases(seen, Duration::from_micros(100));
    }
}

/// Opens every lazy range other than `skip` that overlaps `[start, end)`, so a new hold there
/// starts from pages only live holds shape. Called under [`WRITER`].
fn open_lazy_overlapping(start: usize, end: usize, skip: Option<usize>) {
    for o in overlapping(start, end) {
        if Some(o.index) != skip && matches!(o.level, LAZY | LAZY_OPENING) && !open_lazy(o.index) {
            wait_opened(o.index);
        }
    }
}

/// The permissions of the mapping holding `addr` as `/proc/self/maps` shows them (`"r--p"`,
/// `"rw-s"`...), or None if nothing is mapped there: what a page's protection is right now,
/// for diagnostics and tests.
pub fn page_permissions(addr: usize) -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|line| {
        let mut f = line.split_whitespace();
        let (range, perms) = (f.next()?, f.next()?);
        let (a, b) = range.split_once('-')?;
        let (a, b) = (usize::from_str_radix(a, 16).ok()?, usize::from_str_radix(b, 16).ok()?);
        (a <= addr && addr < b).then(|| perms.to_string())
    })
}

/// Waits until no hold forbids reading (or, with `write`, writing) `[addr, addr + len)`: what a
/// library call does before touching an application buffer itself, outside any lock the
/// progress path needs. Returns `false` if `timeout` ran out first.
pub fn wait_accessible(addr: usize, len: usize, write: bool, timeout: Option<Duration>) -> bool {
    if !any_active() {
        return true;
    }
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        let seen = RELEASES.load(Ordering::Acquire);
        if blocking_hold(addr, len, write).is_none() {
            return true;
        }
        let mut nap = Duration::from_millis(5);
        if let Some(d) = deadline {
            let left = d.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            nap = nap.min(left);
        }
        ring_bell();
        fault::sleep_on_releases(seen, nap);
    }
}

/// A held range (with its alias images); dropping it releases the hold.
#[derive(Debug)]
pub struct ProtectedRange {
    addr: usize,
    len: usize,
    slots: SmallVec<[usize; 2]>,
}

impl ProtectedRange {
    /// Start of the range.
    pub fn addr(&self) -> usize {
        self.addr
    }
    /// Bytes in the range.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True for an empty range.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Faults the handler has waited out on this hold so far.
    pub fn faults(&self) -> u32 {
        self.slots.iter().map(|&i| SLOTS[i].faults.load(Ordering::Relaxed)).sum()
    }
}

/// Holds the page-aligned range `[addr, addr + len)` (and every registered alias of it) with
/// `prot` until the returned value is dropped.
///
/// # Safety
/// The range must be memory this process owns. Until the hold is dropped, code that must not
/// block (the progress path that will release the hold, anything holding a lock it needs) must
/// not touch the range with plain loads or stores.
pub unsafe fn protect(addr: usize, len: usize, prot: Protection) -> Result<ProtectedRange> {
    let page = crate::os::page_size();
    if !addr.is_multiple_of(page) || !len.is_multiple_of(page) || len == 0 {
        return Err(VerbsError::invalid("protected ranges must be whole pages"));
    }
    check_handler()?;
    let mut w = writer();
    let mut ranges: SmallVec<[(usize, usize); 2]> = SmallVec::new();
    ranges.push((addr, addr + len));
    for al in &w.aliases {
        for (from, to) in [(al.a, al.b), (al.b, al.a)] {
            let (s, e) = (addr.max(from), (addr + len).min(from + al.len));
            if s < e {
                ranges.push((s - from + to, e - from + to));
            }
        }
    }
    let mut held = ProtectedRange { addr, len, slots: SmallVec::new() };
    for (s, e) in ranges {
        match add_hold(&mut w, s, e, prot.level()) {
            Ok(i) => held.slots.push(i),
            Err(err) => {
                for i in held.slots.drain(..) {
                    remove_hold(&mut w, i);
                }
                return Err(err);
            }
        }
    }
    Ok(held)
}

impl ProtectedRange {
    /// Ends a read-only hold but leaves its pages read-only until something writes to them
    /// (the fault handler then opens them without waiting) or the returned [`LazyRange`] is
    /// dropped; [`LazyRange::reprotect`] holds them again cheaply. Releases at once (and
    /// returns `None`) where that is not possible: a no-access hold, an aliased buffer, or
    /// pages another hold still covers.
    ///
    /// # Safety
    /// The range must stay mapped (the caller's own memory) until the returned [`LazyRange`]
    /// is dropped: dropping it, or a write there, changes the protection of those addresses.
    pub unsafe fn release_lazily(mut self) -> Option<LazyRange> {
        let [i] = self.slots[..] else { return None };
        let w = writer();
        let s = &SLOTS[i];
        let (start, end) = s.hold.range();
        let shared = overlapping(start, end).any(|o| o.index != i && is_hold(o.level));
        if s.hold.level() != READ_ONLY || shared {
            return None; // `self` drops here, after the lock: an ordinary release
        }
        self.slots.clear();
        s.faults.store(0, Ordering::Relaxed);
        // A writer waiting in the handler wakes, finds no hold, and opens the range itself.
        RELEASES.fetch_add(1, Ordering::AcqRel);
        s.hold.set_level(LAZY);
        ACTIVE.fetch_sub(1, Ordering::AcqRel);
        drop(w);
        fault::wake_releases();
        Some(LazyRange { addr: self.addr, len: self.len, slot: i })
    }
}

/// The pages of a lazily released send hold ([`ProtectedRange::release_lazily`]): read-only
/// until written to or until this is dropped, which opens them. The memory must stay mapped
/// while this lives.
#[derive(Debug)]
pub struct LazyRange {
    addr: usize,
    len: usize,
    slot: usize,
}

impl LazyRange {
    /// Start of the range.
    pub fn addr(&self) -> usize {
        self.addr
    }
    /// Bytes in the range.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True for an empty range.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Writes that opened the range (faults taken since the lazy release).
    pub fn faults(&self) -> u32 {
        SLOTS[self.slot].faults.load(Ordering::Relaxed)
    }

    /// Holds the range read-only again, as [`protect`] would (its contract was promised by
    /// [`ProtectedRange::release_lazily`]'s caller): the pages are usually still read-only, so
    /// this costs an `mprotect` that changes nothing.
    pub fn reprotect(self) -> Result<ProtectedRange> {
        let (addr, len, i) = (self.addr, self.len, self.slot);
        check_handler()?;
        let mut w = writer();
        let aliased = w
            .aliases
            .iter()
            .any(|a| (a.a < addr + len && addr < a.a + a.len) || (a.b < addr + len && addr < a.b + a.len));
        if aliased {
            drop(w);
            drop(self);
            // SAFETY: the range was held before, under the contract the caller keeps.
            return unsafe { protect(addr, len, Protection::ReadOnly) };
        }
        std::mem::forget(self); // the slot becomes the new hold's
        let s = &SLOTS[i];
        // Claimed back before the fault handler can start opening it; if it has, wait for it.
        if !s.hold.swap_level(LAZY, READ_ONLY) {
            wait_opened(i);
            s.hold.set_level(READ_ONLY);
        }
        open_lazy_overlapping(addr, addr + len, Some(i));
        apply_hold(&mut w, i, addr, addr + len, READ_ONLY)?;
        let mut slots = SmallVec::new();
        slots.push(i);
        Ok(ProtectedRange { addr, len, slots })
    }
}

impl Drop for LazyRange {
    fn drop(&mut self) {
        let mut w = writer();
        if !open_lazy(self.slot) {
            wait_opened(self.slot);
        }
        SLOTS[self.slot].hold.set_level(OPEN);
        w.free.push(self.slot);
    }
}

/// Makes sure our fault handler is installed: at the first hold of a burst and every 64th
/// hold after (something may install its own handler over ours; asking costs a system call,
/// a sixth of a hold's price when the pages are already read-only).
fn check_handler() -> Result<()> {
    static HOLDS: AtomicU32 = AtomicU32::new(0);
    if !any_active() || HOLDS.fetch_add(1, Ordering::Relaxed).is_multiple_of(64) {
        fault::ensure_installed()?;
    }
    Ok(())
}

impl Drop for ProtectedRange {
    fn drop(&mut self) {
        if self.slots.is_empty() {
            return;
        }
        let mut w = writer();
        for i in self.slots.drain(..) {
            remove_hold(&mut w, i);
        }
        drop(w);
        fault::wake_releases();
    }
}

fn add_hold(w: &mut Writer, start: usize, end: usize, level: u8) -> Result<usize> {
    let i = match w.free.pop() {
        Some(i) => i,
        None => {
            let i = USED.load(Ordering::Relaxed);
            if i == MAX_HOLDS {
                return Err(VerbsError::Exhausted(format!("more than {MAX_HOLDS} protected ranges")));
            }
            USED.store(i + 1, Ordering::Release);
            i
        }
    };
    open_lazy_overlapping(start, end, None);
    let s = &SLOTS[i];
    // Published before the pages close, so a fault always finds its hold.
    s.hold.publish(start, end, level);
    if has_twin(start, end, level, i) {
        // The same buffer is in flight already (a stream writing one buffer over and over):
        // its pages are closed as far as this hold needs.
        s.faults.store(0, Ordering::Relaxed);
        ACTIVE.fetch_add(1, Ordering::AcqRel);
        return Ok(i);
    }
    apply_hold(w, i, start, end, level)?;
    Ok(i)
}

/// True if a live hold other than `skip` covers exactly `[start, end)` at least as strictly
/// as `level`: the pages need no change for `skip` to come or go.
fn has_twin(start: usize, end: usize, level: u8, skip: usize) -> bool {
    overlapping(start, end)
        .any(|o| o.index != skip && is_hold(o.level) && o.level >= level && o.start == start && o.end == end)
}

/// Closes the pages of the just-published hold `i` as far as it and the other live holds ask;
/// on failure restores them and frees the slot.
fn apply_hold(w: &mut Writer, i: usize, start: usize, end: usize, level: u8) -> Result<()> {
    SLOTS[i].faults.store(0, Ordering::Relaxed);
    ACTIVE.fetch_add(1, Ordering::AcqRel);
    let mut done: SmallVec<[(usize, usize, u8); 4]> = SmallVec::new();
    for (x, y, base) in segments(start, end, Some(i)) {
        let now = base.max(level);
        // Applied even where other holds already ask for as much (or a lazy range left it so):
        // pages unmapped and mapped again under a stale hold (against the contract) must not
        // stay open. An `mprotect` that changes nothing is cheap.
        // SAFETY: the caller of `protect` vouches for the range; `x..y` lies inside it.
        if let Err(e) = unsafe { set_protection(x, y, now) } {
            for (x, y, base) in done {
                // SAFETY: restores what was there before on the same range.
                let _ = unsafe { set_protection(x, y, base) };
            }
            SLOTS[i].hold.set_level(OPEN);
            ACTIVE.fetch_sub(1, Ordering::AcqRel);
            w.free.push(i);
            return Err(e);
        }
        done.push((x, y, base));
    }
    Ok(())
}

fn remove_hold(w: &mut Writer, i: usize) {
    let s = &SLOTS[i];
    let ((start, end), level) = (s.hold.range(), s.hold.level());
    let pieces = if has_twin(start, end, level, i) { SmallVec::new() } else { segments(start, end, Some(i)) };
    for (x, y, base) in pieces {
        if base.max(level) != base {
            // SAFETY: the range was protected by `add_hold`; this loosens it to what the other
            // holds still need.
            if unsafe { set_protection(x, y, base) }.is_err() {
                // Part of the range was unmapped under the hold (against the contract), and
                // mprotect stops at the first hole: loosen page by page, so pages mapped there
                // since (another buffer, held and released meanwhile) are not left closed.
                let page = crate::os::page_size();
                for p in (x..y).step_by(page) {
                    // SAFETY: as above, one page at a time; unmapped pages just fail.
                    let _ = unsafe { set_protection(p, p + page, base) };
                }
                log::debug!("unprotected a partly unmapped buffer page by page");
            }
        }
    }
    // Pages open first, then the generation moves, then the slot goes: a fault handler that no
    // longer finds the hold is sure to see the new generation (see `fault`).
    RELEASES.fetch_add(1, Ordering::AcqRel);
    s.hold.set_level(OPEN);
    ACTIVE.fetch_sub(1, Ordering::AcqRel);
    w.free.push(i);
}

/// Splits `[start, end)` into pieces of uniform protection from the live holds other than
/// `skip`: `(from, to, strictest level)`, adjacent pieces of one level merged.
fn segments(start: usize, end: usize, skip: Option<usize>) -> SmallVec<[(usize, usize, u8); 4]> {
    let others: SmallVec<[(usize, usize, u8); 8]> = overlapping(start, end)
        .filter(|o| Some(o.index) != skip && is_hold(o.level))
        .map(|o| (o.start.max(start), o.end.min(end), o.level))
        .collect();
    split_levels(start, end, &others)
}

/// Pure part of [`segments`]: the strictest level over each piece of `[start, end)`.
fn split_levels(start: usize, end: usize, holds: &[(usize, usize, u8)]) -> SmallVec<[(usize, usize, u8); 4]> {
    let mut cuts: SmallVec<[usize; 16]> = SmallVec::new();
    cuts.push(start);
    cuts.push(end);
    for &(a, b, _) in holds {
        cuts.push(a);
        cuts.push(b);
    }
    cuts.sort_unstable();
    cuts.dedup();
    let mut out: SmallVec<[(usize, usize, u8); 4]> = SmallVec::new();
    for w in cuts.windows(2) {
        let (x, y) = (w[0], w[1]);
        let level = holds.iter().filter(|&&(a, b, _)| a <= x && y <= b).map(|h| h.2).max().unwrap_or(OPEN);
        match out.last_mut() {
            Some(last) if last.1 == x && last.2 == level => last.1 = y,
            _ => out.push((x, y, level)),
        }
    }
    out
}

/// # Safety
/// `[x, y)` must be whole pages of memory the caller may protect.
unsafe fn set_protection(x: usize, y: usize, level: u8) -> Result<()> {
    let p = match level {
        OPEN => libc::PROT_READ | libc::PROT_WRITE,
        READ_ONLY => libc::PROT_READ,
        _ => libc::PROT_NONE,
    };
    // SAFETY: guaranteed by the caller.
    if !unsafe { crate::os::mprotect(x, y - x, p) } {
        return Err(VerbsError::last_os("mprotect"));
    }
    Ok(())
}

/// Declares that `[a, a + len)` and `[b, b + len)` map the same memory (two `mmap`s of one
/// file): from now on a hold on either protects both. Dropping the returned guard forgets it.
pub fn register_alias(a: usize, b: usize, len: usize) -> Result<AliasGuard> {
    let page = crate::os::page_size();
    if !a.is_multiple_of(page) || !b.is_multiple_of(page) || !len.is_multiple_of(page) || len == 0 {
        return Err(VerbsError::invalid("aliased ranges must be whole pages"));
    }
    if a < b.saturating_add(len) && b < a.saturating_add(len) {
        return Err(VerbsError::invalid("an alias must not overlap its original"));
    }
    let alias = Alias { a, b, len };
    writer().aliases.push(alias);
    Ok(AliasGuard { alias })
}

/// Keeps an alias registered; see [`register_alias`].
#[derive(Debug)]
pub struct AliasGuard {
    alias: Alias,
}

impl Drop for AliasGuard {
    fn drop(&mut self) {
        let mut w = writer();
        if let Some(i) = w.aliases.iter().position(|a| *a == self.alias) {
            w.aliases.swap_remove(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    /// Serializes these tests: one of them swaps the process's SIGSEGV handler.
    fn serial() -> std::sync::MutexGuard<'static, ()> {
        static LOCK: Mutex<()> = Mutex::new(());
        LOCK.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fresh anonymous pages, unmapped on drop.
    struct Pages {
        addr: usize,
        len: usize,
    }

    impl Pages {
        fn new(n: usize) -> Pages {
            let len = n * crate::os::page_size();
            // SAFETY: a private anonymous mapping with no preconditions.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED);
            Pages { addr: p as usize, len }
        }
    }

    impl Drop for Pages {
        fn drop(&mut self) {
            // SAFETY: unmaps the mapping made in `new`.
            unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
        }
    }

    /// The permissions `/proc/self/maps` shows for the page at `addr` ("rw-p", "r--p", ...).
    fn perms_of(addr: usize) -> String {
        page_permissions(addr).unwrap_or_else(|| panic!("{addr:#x} is not mapped"))
    }

    #[test]
    fn a_write_to_a_send_hold_waits_for_the_release() {
        let _s = serial();
        let pages = Pages::new(1);
        // SAFETY: our own fresh page; the writer thread below is the only toucher.
        let hold = unsafe { protect(pages.addr, pages.len, Protection::ReadOnly) }.unwrap();
        assert_eq!(perms_of(pages.addr), "r--p");
        let done = Arc::new(AtomicBool::new(false));
        let (addr, d) = (pages.addr, done.clone());
        let writer = std::thread::spawn(move || {
            // SAFETY: a page of ours; the store faults and waits until the hold is released.
            unsafe { std::ptr::write_volatile(addr as *mut u8, 7) };
            d.store(true, Ordering::SeqCst);
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(!done.load(Ordering::SeqCst), "the write went through a read-only hold");
        // Reads are fine meanwhile.
        // SAFETY: the page is readable.
        assert_eq!(unsafe { std::ptr::read_volatile(pages.addr as *const u8) }, 0);
        assert!(hold.faults() >= 1);
        drop(hold);
        writer.join().unwrap();
        // SAFETY: readable again.
        assert_eq!(unsafe { std::ptr::read_volatile(pages.addr as *const u8) }, 7);
        assert_eq!(perms_of(pages.addr), "rw-p");
    }

    #[test]
    fn a_read_of_a_receive_hold_sees_the_data_that_landed_meanwhile() {
        let _s = serial();
        let pages = Pages::new(2);
        // SAFETY: our own fresh pages.
        let hold = unsafe { protect(pages.addr, pages.len, Protection::None) }.unwrap();
        assert!(overlaps(pages.addr + 100, 1) && read_blocked(pages.addr, 1));
        let addr = pages.addr + pages.len - 8;
        let reader = std::thread::spawn(move || {
            // SAFETY: our page; the load waits until the hold is gone.
            unsafe { std::ptr::read_volatile(addr as *const u64) }
        });
        std::thread::sleep(Duration::from_millis(30));
        // The "NIC" writes through the protection, then the transport releases the hold.
        crate::os::write_self_mem(addr as u64, &0xfeed_u64.to_ne_bytes()).unwrap();
        drop(hold);
        assert_eq!(reader.join().unwrap(), 0xfeed);
        assert!(!overlaps(pages.addr, pages.len));
    }

    #[test]
    fn overlapping_holds_keep_the_strictest_protection_until_the_last_goes() {
        let _s = serial();
        let pages = Pages::new(3);
        let p = crate::os::page_size();
        // SAFETY: our own fresh pages.
        let (send, recv) = unsafe {
            (
                protect(pages.addr, 2 * p, Protection::ReadOnly).unwrap(),
                protect(pages.addr + p, 2 * p, Protection::None).unwrap(),
            )
        };
        assert_eq!([perms_of(pages.addr), perms_of(pages.addr + p)], ["r--p", "---p"]);
        // SAFETY: as above.
        let again = unsafe { protect(pages.addr, p, Protection::ReadOnly) }.unwrap();
        drop(recv);
        assert_eq!(
            [perms_of(pages.addr), perms_of(pages.addr + p), perms_of(pages.addr + 2 * p)],
            ["r--p", "r--p", "rw-p"]
        );
        drop(send);
        assert_eq!([perms_of(pages.addr), perms_of(pages.addr + p)], ["r--p", "rw-p"]);
        drop(again);
        assert_eq!(perms_of(pages.addr), "rw-p");
        assert!(wait_accessible(pages.addr, pages.len, true, Some(Duration::ZERO)));
    }

    #[test]
    fn a_copy_learns_in_one_scan_what_each_query_says() {
        let _s = serial();
        let pages = Pages::new(4);
        let p = crate::os::page_size();
        let (ro, na, free) = (pages.addr, pages.addr + p, pages.addr + 3 * p);
        // SAFETY: our own fresh pages.
        let (_send, _recv) =
            unsafe { (protect(ro, p, Protection::ReadOnly).unwrap(), protect(na, p, Protection::None).unwrap()) };
        let separately = |dst: usize, src: usize, len: usize| CopyHolds {
            dst_held: overlaps(dst, len),
            src_read_blocked: read_blocked(src, len),
            src_held: overlaps(src, len),
        };
        for (dst, src, len) in
            [(free, ro, p), (free, na, 8), (ro, free, 8), (na, free, p), (free, free + 8, 64), (ro, na, p)]
        {
            assert_eq!(copy_holds(dst, src, len), separately(dst, src, len), "dst {dst:#x} src {src:#x} len {len}");
        }
        // Ranges that only touch a hold's edge are not under it.
        assert_eq!(copy_holds(free, na + p, p), CopyHolds::default());
        assert_eq!(copy_holds(ro - p, free, p), CopyHolds::default());
    }

    #[test]
    fn an_alias_is_protected_with_its_original() {
        let _s = serial();
        let p = crate::os::page_size();
        // SAFETY: plain memfd and mmap calls; both mappings are unmapped at the end.
        let (a, b, fd) = unsafe {
            let fd = libc::memfd_create(c"alias-test".as_ptr(), 0);
            assert!(fd >= 0);
            assert_eq!(libc::ftruncate(fd, p as libc::off_t), 0);
            let map = || {
                let m =
                    libc::mmap(std::ptr::null_mut(), p, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0);
                assert_ne!(m, libc::MAP_FAILED);
                m as usize
            };
            (map(), map(), fd)
        };
        let alias = register_alias(a, b, p).unwrap();
        // SAFETY: our own mapping.
        let hold = unsafe { protect(a, p, Protection::ReadOnly) }.unwrap();
        assert_eq!([perms_of(a), perms_of(b)], ["r--s", "r--s"]);
        drop(hold);
        drop(alias);
        // SAFETY: as above.
        let hold = unsafe { protect(a, p, Protection::ReadOnly) }.unwrap();
        assert_eq!(perms_of(b), "rw-s");
        drop(hold);
        // SAFETY: unmapping what was mapped above.
        unsafe {
            libc::munmap(a as *mut libc::c_void, p);
            libc::munmap(b as *mut libc::c_void, p);
            libc::close(fd);
        }
    }

    #[test]
    fn faults_that_are_not_ours_go_to_the_previous_handler() {
        let _s = serial();
        static CALLED: AtomicUsize = AtomicUsize::new(0);
        static PAGE: AtomicUsize = AtomicUsize::new(0);
        extern "C" fn theirs(_: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
            // SAFETY: a valid siginfo from the kernel (through our chaining).
            let addr = unsafe { (*info).si_addr() } as usize;
            if addr & !(crate::os::page_size() - 1) == PAGE.load(Ordering::SeqCst) {
                CALLED.fetch_add(1, Ordering::SeqCst);
                // SAFETY: opens the page this test closed.
                unsafe { libc::mprotect(addr as *mut libc::c_void, 4096, libc::PROT_READ | libc::PROT_WRITE) };
            }
        }
        let foreign = Pages::new(1);
        let ours = Pages::new(1);
        PAGE.store(foreign.addr, Ordering::SeqCst);
        // Install "their" handler as the current one (as `may` would), remembering what was there.
        // SAFETY: plain sigaction calls; restored at the end.
        let saved = unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = theirs as *const () as libc::sighandler_t;
            act.sa_flags = libc::SA_SIGINFO;
            let mut old: libc::sigaction = std::mem::zeroed();
            assert_eq!(libc::sigaction(libc::SIGSEGV, &act, &mut old), 0);
            old
        };
        // SAFETY: our own page; this installs our handler on top of theirs.
        let hold = unsafe { protect(ours.addr, ours.len, Protection::ReadOnly) }.unwrap();
        // SAFETY: a page of ours, closed by hand: not held, so the fault is theirs.
        unsafe {
            libc::mprotect(foreign.addr as *mut libc::c_void, foreign.len, libc::PROT_NONE);
            std::ptr::write_volatile(foreign.addr as *mut u8, 1);
        }
        assert_eq!(CALLED.load(Ordering::SeqCst), 1);
        drop(hold);
        // SAFETY: restores the handler found at the start.
        unsafe { libc::sigaction(libc::SIGSEGV, &saved, std::ptr::null_mut()) };
    }

    #[test]
    fn a_lazily_released_send_buffer_opens_on_the_first_write() {
        let _s = serial();
        let pages = Pages::new(2);
        // SAFETY: our own fresh pages.
        let hold = unsafe { protect(pages.addr, pages.len, Protection::ReadOnly) }.unwrap();
        // SAFETY: `pages` outlives every lazy range of this test.
        let lazy = unsafe { hold.release_lazily() }.expect("a lone read-only hold goes lazily");
        assert_eq!(perms_of(pages.addr), "r--p");
        assert!(!overlaps(pages.addr, pages.len), "nothing is held any more");
        // SAFETY: our page: the store faults once, the handler opens the range, the store retries.
        unsafe { std::ptr::write_volatile((pages.addr + pages.len - 1) as *mut u8, 9) };
        assert_eq!([perms_of(pages.addr), perms_of(pages.addr + pages.len - 1)], ["rw-p", "rw-p"]);
        assert_eq!(lazy.faults(), 1);
        drop(lazy);
        assert_eq!(perms_of(pages.addr), "rw-p");
        // Dropping an untouched lazy range opens it.
        // SAFETY: as above.
        let lazy = unsafe { protect(pages.addr, pages.len, Protection::ReadOnly).unwrap().release_lazily() }.unwrap();
        assert_eq!(perms_of(pages.addr), "r--p");
        drop(lazy);
        assert_eq!(perms_of(pages.addr), "rw-p");
    }

    #[test]
    fn a_lazy_range_still_blocks_kernel_writes_until_opened() {
        let _s = serial();
        let pages = Pages::new(2);
        let p = crate::os::page_size();
        assert!(!kernel_write_blocked(pages.addr, 2 * p));
        // SAFETY: our own fresh pages, which outlive the holds and lazy ranges on them.
        let hold = unsafe { protect(pages.addr, p, Protection::ReadOnly).unwrap() };
        assert!(kernel_write_blocked(pages.addr, 2 * p));
        assert!(!kernel_write_blocked(pages.addr + p, p), "the next page is not held");
        // SAFETY: as above.
        let lazy = unsafe { hold.release_lazily() }.unwrap();
        assert!(!overlaps(pages.addr, p), "nobody waits on a lazy range");
        assert!(kernel_write_blocked(pages.addr, p), "but its page is still read-only");
        assert_eq!(perms_of(pages.addr), "r--p");
        drop(lazy);
        assert!(!kernel_write_blocked(pages.addr, 2 * p));
    }

    #[test]
    fn a_reprotected_lazy_range_holds_writes_again() {
        let _s = serial();
        let pages = Pages::new(1);
        // SAFETY: our own fresh page, which outlives its lazy ranges.
        let lazy = unsafe { protect(pages.addr, pages.len, Protection::ReadOnly).unwrap().release_lazily() }.unwrap();
        let hold = lazy.reprotect().unwrap();
        assert!(overlaps(pages.addr, 1));
        let done = Arc::new(AtomicBool::new(false));
        let (addr, d) = (pages.addr, done.clone());
        let writer = std::thread::spawn(move || {
            // SAFETY: our page; the store waits for the hold, then opens the lazy range.
            unsafe { std::ptr::write_volatile(addr as *mut u8, 5) };
            d.store(true, Ordering::SeqCst);
        });
        std::thread::sleep(Duration::from_millis(30));
        assert!(!done.load(Ordering::SeqCst), "the write went through a re-protected range");
        // Released lazily while the writer waits: it opens the range itself and goes on.
        // SAFETY: as above.
        let lazy = unsafe { hold.release_lazily() }.unwrap();
        writer.join().unwrap();
        assert_eq!(perms_of(pages.addr), "rw-p");
        // Opened by a write, then held again: closed for real.
        let hold = lazy.reprotect().unwrap();
        assert_eq!(perms_of(pages.addr), "r--p");
        drop(hold);
        assert_eq!(perms_of(pages.addr), "rw-p");
        // SAFETY: readable.
        assert_eq!(unsafe { std::ptr::read_volatile(pages.addr as *const u8) }, 5);
    }

    #[test]
    fn lazy_ranges_give_way_to_other_holds() {
        let _s = serial();
        let pages = Pages::new(3);
        let p = crate::os::page_size();
        // SAFETY: our own fresh pages.
        let (a, b) = unsafe {
            (
                protect(pages.addr, 2 * p, Protection::ReadOnly).unwrap(),
                protect(pages.addr, p, Protection::ReadOnly).unwrap(),
            )
        };
        // Pages another hold covers are released at once.
        // SAFETY: `pages` outlives the lazy ranges.
        assert!(unsafe { b.release_lazily() }.is_none());
        assert_eq!(perms_of(pages.addr), "r--p");
        // SAFETY: as above.
        let lazy = unsafe { a.release_lazily() }.unwrap();
        // A new hold over part of a lazy range opens the rest of it first.
        // SAFETY: as above.
        let recv = unsafe { protect(pages.addr + p, 2 * p, Protection::None) }.unwrap();
        assert_eq!([perms_of(pages.addr), perms_of(pages.addr + p)], ["rw-p", "---p"]);
        drop(lazy);
        assert_eq!(perms_of(pages.addr + p), "---p");
        drop(recv);
        assert_eq!(perms_of(pages.addr + p), "rw-p");
    }

    #[test]
    fn a_guarded_read_of_a_vanished_send_buffer_reports_it_instead_of_crashing() {
        let _s = serial();
        let pages = Pages::new(2);
        let p = crate::os::page_size();
        // SAFETY: our own fresh pages.
        let hold = unsafe { protect(pages.addr, pages.len, Protection::ReadOnly) }.unwrap();
        let mut out = vec![1u8; pages.len];
        // SAFETY: the held pages are mapped and readable.
        let ((), intact) = guarded_read(|| unsafe { std::ptr::copy(pages.addr as *const u8, out.as_mut_ptr(), p) });
        assert!(intact);
        // Against the contract: the second page goes away under the hold.
        // SAFETY: unmaps a page of our own mapping.
        unsafe { libc::munmap((pages.addr + p) as *mut libc::c_void, p) };
        // SAFETY: the vanished page faults; the guard maps a zero page there.
        let ((), intact) =
            guarded_read(|| unsafe { std::ptr::copy(pages.addr as *const u8, out.as_mut_ptr(), pages.len) });
        assert!(!intact, "a copy from a vanished page looked intact");
        assert!(out[p..].iter().all(|&b| b == 0));
        drop(hold);
    }

    #[test]
    fn levels_split_and_merge() {
        let s = split_levels(0, 100, &[]);
        assert_eq!(s.as_slice(), &[(0, 100, OPEN)]);
        let s = split_levels(0, 100, &[(20, 40, READ_ONLY), (30, 60, NO_ACCESS), (60, 70, NO_ACCESS)]);
        assert_eq!(s.as_slice(), &[(0, 20, OPEN), (20, 30, READ_ONLY), (30, 70, NO_ACCESS), (70, 100, OPEN)]);
    }
}
