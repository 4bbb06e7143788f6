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
//! A thread that touches a held page faults into [`fault`]'s SIGSEGV handler, which waits (a
//! futex, async-signal-safe) until the holds forbidding that access are released and then lets
//! the access retry; faults on pages nobody holds go to the handler installed before ours.
//! Releasing a hold is the transport's job (its progress path), so the progress path must never
//! touch held memory with plain loads and stores — the software provider goes through
//! `/proc/self/mem` for held ranges ([`overlaps`]), as a NIC's DMA ignores page protection.
//!
//! Buffers mapped twice (two `mmap`s of one file or memfd) are protected together once
//! [`register_alias`] has been told about them.

mod fault;

use std::sync::atomic::{AtomicU32, AtomicU8, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use crate::error::{Result, VerbsError};

pub use fault::{fault_bell, fault_waiters, faults_handled, ring_bell, wait_bell};

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
const OPEN: u8 = 0;
const READ_ONLY: u8 = 1;
const NO_ACCESS: u8 = 2;

impl Protection {
    fn level(self) -> u8 {
        match self {
            Protection::None => NO_ACCESS,
            Protection::ReadOnly => READ_ONLY,
        }
    }
}

/// One hold as the fault handler sees it: written only under [`WRITER`], read lock-free.
struct Slot {
    start: AtomicUsize,
    end: AtomicUsize,
    /// `OPEN` while the slot is free.
    level: AtomicU8,
    /// Faults the handler waited out on this hold.
    faults: AtomicU32,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE_SLOT: Slot = Slot {
    start: AtomicUsize::new(0),
    end: AtomicUsize::new(0),
    level: AtomicU8::new(OPEN),
    faults: AtomicU32::new(0),
};
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

/// True if some hold forbids reading a byte of `[addr, addr + len)`.
#[inline]
pub fn read_blocked(addr: usize, len: usize) -> bool {
    any_active() && blocking_hold(addr, len, false).is_some()
}

/// The index of a live hold that forbids a read (or, with `write`, a write) somewhere in
/// `[addr, addr + len)`. Lock-free and async-signal-safe.
fn blocking_hold(addr: usize, len: usize, write: bool) -> Option<usize> {
    let end = addr.saturating_add(len.max(1));
    let used = USED.load(Ordering::Acquire);
    for (i, s) in SLOTS[..used].iter().enumerate() {
        let level = s.level.load(Ordering::Acquire);
        if level == OPEN || (!write && level != NO_ACCESS) {
            continue;
        }
        if s.start.load(Ordering::Relaxed) < end && addr < s.end.load(Ordering::Relaxed) {
            return Some(i);
        }
    }
    None
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
        fault::futex_wait(&RELEASES, seen, nap);
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
    let page = crate::soft::page_size();
    if !addr.is_multiple_of(page) || !len.is_multiple_of(page) || len == 0 {
        return Err(VerbsError::invalid("protected ranges must be whole pages"));
    }
    fault::ensure_installed()?;
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
        fault::futex_wake_all(&RELEASES);
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
    let before = segments(start, end, Some(i));
    let s = &SLOTS[i];
    s.start.store(start, Ordering::Relaxed);
    s.end.store(end, Ordering::Relaxed);
    s.faults.store(0, Ordering::Relaxed);
    // Published before the pages close, so a fault always finds its hold.
    s.level.store(level, Ordering::Release);
    ACTIVE.fetch_add(1, Ordering::AcqRel);
    let mut done: SmallVec<[(usize, usize, u8); 4]> = SmallVec::new();
    for (x, y, base) in before {
        let now = base.max(level);
        // Applied even where other holds already ask for as much: pages unmapped and mapped
        // again under a stale hold (against the contract) must not stay open.
        // SAFETY: the caller of `protect` vouches for the range; `x..y` lies inside it.
        if let Err(e) = unsafe { set_protection(x, y, now) } {
            for (x, y, base) in done {
                // SAFETY: restores what was there before on the same range.
                let _ = unsafe { set_protection(x, y, base) };
            }
            s.level.store(OPEN, Ordering::Release);
            ACTIVE.fetch_sub(1, Ordering::AcqRel);
            w.free.push(i);
            return Err(e);
        }
        done.push((x, y, base));
    }
    Ok(i)
}

fn remove_hold(w: &mut Writer, i: usize) {
    let s = &SLOTS[i];
    let (start, end, level) =
        (s.start.load(Ordering::Relaxed), s.end.load(Ordering::Relaxed), s.level.load(Ordering::Relaxed));
    for (x, y, base) in segments(start, end, Some(i)) {
        if base.max(level) != base {
            // SAFETY: the range was protected by `add_hold`; this loosens it to what the other
            // holds still need.
            if unsafe { set_protection(x, y, base) }.is_err() {
                // Part of the range was unmapped under the hold (against the contract), and
                // mprotect stops at the first hole: loosen page by page, so pages mapped there
                // since (another buffer, held and released meanwhile) are not left closed.
                let page = crate::soft::page_size();
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
    s.level.store(OPEN, Ordering::Release);
    ACTIVE.fetch_sub(1, Ordering::AcqRel);
    w.free.push(i);
}

/// Splits `[start, end)` into pieces of uniform protection from the live holds other than
/// `skip`: `(from, to, strictest level)`, adjacent pieces of one level merged.
fn segments(start: usize, end: usize, skip: Option<usize>) -> SmallVec<[(usize, usize, u8); 4]> {
    let used = USED.load(Ordering::Acquire);
    let mut others: SmallVec<[(usize, usize, u8); 8]> = SmallVec::new();
    for (i, s) in SLOTS[..used].iter().enumerate() {
        let level = s.level.load(Ordering::Acquire);
        if Some(i) == skip || level == OPEN {
            continue;
        }
        let (a, b) = (s.start.load(Ordering::Relaxed), s.end.load(Ordering::Relaxed));
        if a < end && start < b {
            others.push((a.max(start), b.min(end), level));
        }
    }
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
    if unsafe { libc::mprotect(x as *mut libc::c_void, y - x, p) } != 0 {
        return Err(VerbsError::last_os("mprotect"));
    }
    Ok(())
}

/// Declares that `[a, a + len)` and `[b, b + len)` map the same memory (two `mmap`s of one
/// file): from now on a hold on either protects both. Dropping the returned guard forgets it.
pub fn register_alias(a: usize, b: usize, len: usize) -> Result<AliasGuard> {
    let page = crate::soft::page_size();
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
            let len = n * crate::soft::page_size();
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
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        for line in maps.lines() {
            let mut f = line.split_whitespace();
            let (range, perms) = (f.next().unwrap(), f.next().unwrap());
            let (a, b) = range.split_once('-').unwrap();
            let (a, b) = (usize::from_str_radix(a, 16).unwrap(), usize::from_str_radix(b, 16).unwrap());
            if a <= addr && addr < b {
                return perms.to_string();
            }
        }
        panic!("{addr:#x} is not mapped")
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
        crate::soft::sys::write_self_mem(addr as u64, &0xfeed_u64.to_ne_bytes()).unwrap();
        drop(hold);
        assert_eq!(reader.join().unwrap(), 0xfeed);
        assert!(!overlaps(pages.addr, pages.len));
    }

    #[test]
    fn overlapping_holds_keep_the_strictest_protection_until_the_last_goes() {
        let _s = serial();
        let pages = Pages::new(3);
        let p = crate::soft::page_size();
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
    fn an_alias_is_protected_with_its_original() {
        let _s = serial();
        let p = crate::soft::page_size();
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
            if addr & !(crate::soft::page_size() - 1) == PAGE.load(Ordering::SeqCst) {
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
    fn levels_split_and_merge() {
        let s = split_levels(0, 100, &[]);
        assert_eq!(s.as_slice(), &[(0, 100, OPEN)]);
        let s = split_levels(0, 100, &[(20, 40, READ_ONLY), (30, 60, NO_ACCESS), (60, 70, NO_ACCESS)]);
        assert_eq!(s.as_slice(), &[(0, 20, OPEN), (20, 30, READ_ONLY), (30, 70, NO_ACCESS), (70, 100, OPEN)]);
    }
}
