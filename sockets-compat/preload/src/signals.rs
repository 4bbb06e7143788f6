//! The program's signals while the library waits for it: blocked while the library polls, so
//! that one that comes is seen pending (rather than run by its handler while the library goes
//! on waiting), and let in again, which runs the handler, before the call returns `EINTR` as
//! the kernel's would.

use libc::sigset_t;

/// The program's asynchronous signals blocked while the library polls for it (one home for
/// the mask: `portability_verbs::os`, which the stack's own threads start with too).
pub use portability_verbs::os::AsyncSignalsBlocked as Blocked;

fn empty() -> sigset_t {
    // SAFETY: sigset_t is plain data; all zeroes is the empty set.
    unsafe { std::mem::zeroed() }
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
