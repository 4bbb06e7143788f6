//! The SIGSEGV handler behind [`super::protect`]: a touch of a held page waits for the hold to
//! go, then retries; any other fault goes to the handler that was installed before ours (the
//! `may` runtime's stack-guard handler, Rust's own, or the default action).
//!
//! A write to a lazily released send buffer opens it (`mprotect`) and retries at once.
//!
//! Everything here is async-signal-safe: the handler reads the lock-free hold table, sleeps on
//! a futex, calls `mprotect` and touches only atomics and a const-initialized thread-local. It takes no lock and
//! allocates nothing, so it cannot deadlock with the code it interrupted.

use std::cell::Cell;
use std::sync::atomic::{compiler_fence, AtomicPtr, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use super::{blocking_hold, lazy_at, open_lazy, wait_opened, RELEASES, SLOTS};
use crate::error::{Result, VerbsError};

/// The handler that was installed before ours (leaked, never freed: the handler may read it
/// at any time).
static PREVIOUS: AtomicPtr<libc::sigaction> = AtomicPtr::new(std::ptr::null_mut());
static INSTALL: Mutex<()> = Mutex::new(());
/// Rung when a thread starts waiting in a fault (and by [`ring_bell`]): progress engines sleep
/// on it.
static BELL: AtomicU32 = AtomicU32::new(0);
static HANDLED: AtomicU64 = AtomicU64::new(0);
/// Threads waiting in the handler right now.
static WAITING: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// The last fault this thread let retry without finding a hold: (address, release
    /// generation). A second identical fault is not ours.
    static LAST_RETRY: Cell<(usize, u32)> = const { Cell::new((0, 0)) };
    /// Inside [`guarded_read`]: 0 no, 1 yes, 2 yes and a hole was filled. An atomic behind
    /// compiler fences, not a `Cell`: the fault handler changes it in the middle of the read,
    /// which the compiler cannot see (with a `Cell`, an optimised build folded the value set
    /// before the copy into the check after it, and a vanished page read as intact).
    static GUARDED: AtomicU8 = const { AtomicU8::new(0) };
}

/// Runs `read`, which reads memory under a read-only hold with plain loads (the provider
/// copying a send buffer, as DMA would), and says whether that memory was still there. The
/// application may have unmapped it against its contract; a load there would kill the process,
/// so the fault handler maps a zero page into the hole (never over anything mapped) and the
/// copy finishes with garbage that the caller must discard (`false`). Such a page stays mapped.
pub fn guarded_read<R>(read: impl FnOnce() -> R) -> (R, bool) {
    GUARDED.with(|g| g.store(1, Ordering::Relaxed));
    compiler_fence(Ordering::SeqCst);
    let r = read();
    compiler_fence(Ordering::SeqCst);
    let intact = GUARDED.with(|g| g.swap(0, Ordering::Relaxed)) == 1;
    (r, intact)
}

/// A read fault inside [`guarded_read`] on a page a read-only hold covers: the page is gone.
/// Fills the hole with a zero page; returns whether it did. Async-signal-safe.
fn fill_hole(addr: usize) -> bool {
    if GUARDED.with(|g| g.load(Ordering::Relaxed)) == 0 || !super::read_only_hold_at(addr) {
        return false;
    }
    let page = crate::os::page_size();
    // SAFETY: maps one private anonymous page where nothing is mapped (MAP_FIXED_NOREPLACE
    // fails rather than replace a mapping); no existing memory changes.
    let p = unsafe {
        libc::mmap(
            (addr & !(page - 1)) as *mut libc::c_void,
            page,
            libc::PROT_READ,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return false;
    }
    GUARDED.with(|g| g.store(2, Ordering::Relaxed));
    true
}

/// Faults handled so far in this process (waited out, or writes that opened a lazy range).
pub fn faults_handled() -> u64 {
    HANDLED.load(Ordering::Relaxed)
}

/// Threads stopped in the fault handler right now, waiting for a hold to go: a progress engine
/// that otherwise leaves busy sockets to their own threads must step in.
pub fn fault_waiters() -> usize {
    WAITING.load(Ordering::Acquire)
}

/// The bell's current value, to pass to [`wait_bell`].
pub fn fault_bell() -> u32 {
    BELL.load(Ordering::Acquire)
}

/// Rings the bell: wakes whoever sleeps in [`wait_bell`] (new work for a progress engine).
pub fn ring_bell() {
    BELL.fetch_add(1, Ordering::AcqRel);
    crate::os::futex_wake_all(&BELL);
}

/// Sleeps until the bell moves past `seen` or `timeout` passes.
pub fn wait_bell(seen: u32, timeout: Duration) {
    crate::os::futex_wait(&BELL, seen, timeout);
}

/// Makes sure our handler is the current SIGSEGV handler, chaining to whatever was there. Cheap
/// when it already is (one `sigaction` query); re-installs if something replaced it since.
pub(super) fn ensure_installed() -> Result<()> {
    let ours = on_fault as *const () as libc::sighandler_t;
    if current_handler()? == ours {
        return Ok(());
    }
    let _g = INSTALL.lock().unwrap_or_else(|p| p.into_inner());
    if current_handler()? == ours {
        return Ok(());
    }
    // SAFETY: sigaction is plain data; an all-zero value is a valid starting point.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = ours;
    action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
    // SAFETY: sa_mask is a valid sigset_t to initialize.
    unsafe { libc::sigemptyset(&mut action.sa_mask) };
    let previous: &'static mut libc::sigaction = Box::leak(Box::new(
        // SAFETY: as above.
        unsafe { std::mem::zeroed() },
    ));
    // SAFETY: valid action and out-pointer; our handler is async-signal-safe.
    if unsafe { libc::sigaction(libc::SIGSEGV, &action, previous) } != 0 {
        return Err(VerbsError::last_os("installing the SIGSEGV handler"));
    }
    PREVIOUS.store(previous, Ordering::Release);
    log::debug!("memory-protection fault handler installed");
    Ok(())
}

fn current_handler() -> Result<libc::sighandler_t> {
    // SAFETY: querying with a null new action only writes the out-pointer.
    let mut cur: libc::sigaction = unsafe { std::mem::zeroed() };
    if unsafe { libc::sigaction(libc::SIGSEGV, std::ptr::null(), &mut cur) } != 0 {
        return Err(VerbsError::last_os("querying the SIGSEGV handler"));
    }
    Ok(cur.sa_sigaction)
}

/// True if the faulting access was a write (x86-64 reports it in the page-fault error code);
/// elsewhere every fault counts as a write, which waits for read-only holds too.
fn faulted_on_write(ctx: *mut libc::c_void) -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        if ctx.is_null() {
            return true;
        }
        // SAFETY: the kernel passes a valid ucontext_t to SA_SIGINFO handlers.
        let uc = unsafe { &*(ctx as *const libc::ucontext_t) };
        uc.uc_mcontext.gregs[libc::REG_ERR as usize] & 2 != 0
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    {
        let _ = ctx;
        true
    }
}

extern "C" fn on_fault(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo_t for SIGSEGV to SA_SIGINFO handlers.
    let addr = unsafe { (*info).si_addr() } as usize;
    let write = faulted_on_write(ctx);
    if !write && fill_hole(addr) {
        return; // the copy goes on, reading zeros
    }
    if wait_out(addr, write) {
        return; // the access retries on pages opened since
    }
    chain(sig, info, ctx);
}

/// Waits while a hold forbids the access. Returns `true` if the fault was (or may have been)
/// ours and the access should retry, `false` to hand the fault on.
fn wait_out(addr: usize, write: bool) -> bool {
    let (mut counted, mut rounds, mut waited_on) = (false, 0u32, usize::MAX);
    loop {
        let seen = RELEASES.load(Ordering::Acquire);
        let Some(i) = blocking_hold(addr, 1, write) else { break };
        if i != waited_on {
            // Every hold this access waits for learns of it (one that copies its buffer aside
            // on a fault must, even when another hold over the page was found first).
            waited_on = i;
            SLOTS[i].faults.fetch_add(1, Ordering::Relaxed);
        }
        if !counted {
            counted = true;
            HANDLED.fetch_add(1, Ordering::Relaxed);
            WAITING.fetch_add(1, Ordering::AcqRel);
        }
        // Tell the progress engine someone is stuck, on every round (it may have napped).
        ring_bell();
        sleep_on_releases(seen, Duration::from_millis(2));
        rounds += 1;
        if rounds == 5000 {
            // About ten seconds: say why this thread is stuck (write(2) is async-signal-safe).
            let msg = b"portability-verbs: a thread has waited ~10 s on a memory-protected buffer still in \
flight (a peer that does not read, or a buffer freed or reused before the socket's flush?)\n";
            // SAFETY: writes a static message to stderr.
            unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
        }
    }
    if counted {
        WAITING.fetch_sub(1, Ordering::AcqRel);
    }
    // A write to a lazily released send buffer: open it (the hold we may have waited for can
    // have become one).
    if write {
        if let Some(i) = lazy_at(addr) {
            if open_lazy(i) {
                SLOTS[i].faults.fetch_add(1, Ordering::Relaxed);
                if !counted {
                    HANDLED.fetch_add(1, Ordering::Relaxed);
                }
            } else {
                wait_opened(i);
            }
            LAST_RETRY.with(|c| c.set((0, 0)));
            return true;
        }
    }
    if counted {
        LAST_RETRY.with(|c| c.set((0, 0)));
        return true;
    }
    // No hold now. A release may have raced with the fault (pages opened, then the slot freed):
    // then the generation moved after the fault, so a retry is right. The same address faulting
    // twice with no release in between is a genuine fault.
    let generation = RELEASES.load(Ordering::Acquire);
    LAST_RETRY.with(|c| {
        if c.get() == (addr, generation) {
            false
        } else {
            c.set((addr, generation));
            true
        }
    })
}

fn chain(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let prev = PREVIOUS.load(Ordering::Acquire);
    // SAFETY: a non-null PREVIOUS points at a leaked, never-freed sigaction.
    let prev = unsafe { prev.as_ref() };
    match prev {
        Some(p) if p.sa_sigaction != libc::SIG_DFL && p.sa_sigaction != libc::SIG_IGN => {
            if p.sa_flags & libc::SA_SIGINFO != 0 {
                // SAFETY: with SA_SIGINFO, sa_sigaction holds a three-argument handler.
                let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                    unsafe { std::mem::transmute(p.sa_sigaction) };
                f(sig, info, ctx);
            } else {
                // SAFETY: without SA_SIGINFO, it holds a one-argument handler.
                let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(p.sa_sigaction) };
                f(sig);
            }
        }
        _ => {
            // Default action: restore it and return, so the access faults again and kills the
            // process the ordinary way (with a core dump where enabled).
            // SAFETY: zeroed sigaction is SIG_DFL with an empty mask.
            let dfl: libc::sigaction = unsafe { std::mem::zeroed() };
            // SAFETY: sigaction is async-signal-safe.
            unsafe { libc::sigaction(sig, &dfl, std::ptr::null_mut()) };
        }
    }
}

/// Threads sleeping (or about to sleep) on the release generation: a release makes the wake-up
/// system call only when there is someone to wake.
static RELEASE_SLEEPERS: AtomicU32 = AtomicU32::new(0);

/// Sleeps until the release generation moves past `seen` (or `timeout`). Async-signal-safe.
pub(super) fn sleep_on_releases(seen: u32, timeout: Duration) {
    RELEASE_SLEEPERS.fetch_add(1, Ordering::SeqCst);
    // A release after `seen` was read has moved the generation: the futex returns at once.
    // One that saw no sleeper happened before the increment above, so the same holds.
    crate::os::futex_wait(&RELEASES, seen, timeout);
    RELEASE_SLEEPERS.fetch_sub(1, Ordering::SeqCst);
}

/// Wakes the sleepers of [`sleep_on_releases`], after the generation has moved.
pub(super) fn wake_releases() {
    std::sync::atomic::fence(Ordering::SeqCst);
    if RELEASE_SLEEPERS.load(Ordering::SeqCst) > 0 {
        crate::os::futex_wake_all(&RELEASES);
    }
}
