//! The program's signals while the library waits for it: blocked while the library polls, so
//! that one that comes is seen pending (rather than run by its handler while the library goes
//! on waiting), and let in again, which runs the handler, before the call returns `EINTR` as
//! the kernel's would.

use std::ffi::c_int;

use libc::sigset_t;

/// Signals never blocked: a fault in the thread must reach its handler.
const SYNCHRONOUS: [c_int; 6] = [libc::SIGSEGV, libc::SIGBUS, libc::SIGFPE, libc::SIGILL, libc::SIGTRAP, libc::SIGSYS];

fn empty() -> sigset_t {
    // SAFETY: sigset_t is plain data; all zeroes is the empty set.
    unsafe { std::mem::zeroed() }
}

/// The calling thread's asynchronous signals blocked until this is dropped, which restores
/// its mask (a signal that came meanwhile is delivered then) and keeps `errno`.
pub struct Blocked {
    old: sigset_t,
}

impl Blocked {
    pub fn all_async() -> Blocked {
        let (mut all, mut old) = (empty(), empty());
        // SAFETY: valid sets; changes this thread's mask only (restored on drop).
        unsafe {
            libc::sigfillset(&mut all);
            for s in SYNCHRONOUS {
                libc::sigdelset(&mut all, s);
            }
            libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old);
        }
        Blocked { old }
    }

    /// The mask the thread had: the one the program waits with.
    pub fn program_mask(&self) -> &sigset_t {
        &self.old
    }
}

impl Drop for Blocked {
    fn drop(&mut self) {
        // SAFETY: the calling thread's errno, kept across the mask's restoration.
        let errno = unsafe { *libc::__errno_location() };
        // SAFETY: restores the mask saved by `all_async`.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.old, std::ptr::null_mut()) };
        crate::set_errno(errno);
    }
}

/// Whether a signal that `mask` lets in is pending for the thread (its own or the process's).
pub fn pending_for(mask: *const sigset_t) -> bool {
    let mut pending = empty();
    // SAFETY: a valid set for the kernel to fill.
    if unsafe { libc::sigpending(&mut pending) } != 0 {
        return false;
    }
    // SAFETY: valid sets; signal numbers in range.
    (1..=libc::SIGRTMAX()).any(|s| unsafe { libc::sigismember(&pending, s) == 1 && libc::sigismember(mask, s) == 0 })
}

/// Whether every signal handler the program installed asks for `SA_RESTART` (then the kernel
/// would have restarted a socket call without a timeout that a signal interrupted; the signal
/// that did cannot be known here, so one handler without it makes the call return `EINTR`,
/// which is what Python's handlers, for one, expect).
pub fn handlers_restart() -> bool {
    (1..=libc::SIGRTMAX()).filter(|&s| s != libc::SIGKILL && s != libc::SIGSTOP).all(|sig| {
        // SAFETY: reads the disposition of `sig` into a zeroed struct.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        if unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) } != 0 {
            return true;
        }
        old.sa_sigaction == libc::SIG_DFL || old.sa_sigaction == libc::SIG_IGN || old.sa_flags & libc::SA_RESTART != 0
    })
}
