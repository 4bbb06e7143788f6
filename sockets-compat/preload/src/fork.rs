//! `fork`: a child cannot use its parent's SDP connections (the library's threads are not in
//! it, its peers copy by the parent's process id, and the rings it would drive are the
//! parent's too), so they fall back cleanly rather than break the parent's:
//! - before the fork, every listening socket stops answering SDP probes (its UDP twin is
//!   replaced by an unbound socket): the listening socket is now shared with a child (the
//!   pre-fork server pattern) whose `accept` could not hand over an SDP connection, so new
//!   clients connect over TCP, to either process;
//! - in the child, at its first intercepted call, the inherited connections become dead TCP
//!   sockets (reads `ENOTCONN`, writes `EPIPE`, `poll` `POLLHUP`), left untouched otherwise
//!   (the parent's connections go on), and nothing is accelerated in the child from then on.
//!
//! A program that forks only to run another program (`fork` then `exec`) loses acceleration of
//! its listening sockets; `posix_spawn` and `vfork`, which Python's `subprocess` uses, do not
//! count as forks here.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;

use crate::guard::Inside;
use crate::table::{self, Entry};

/// Set in a forked child (by the handler `fork` runs there; an atomic store only).
static FORKED: AtomicBool = AtomicBool::new(false);

/// Whether this process is a forked child of one that used the library.
#[inline]
pub fn forked() -> bool {
    FORKED.load(Ordering::Relaxed)
}

/// Registers the handlers `fork` runs (once, at the library's first socket: nothing at load).
pub fn watch() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: handlers that are `extern "C" fn()` and never unwind.
        if unsafe { libc::pthread_atfork(Some(before_fork), None, Some(in_child)) } != 0 {
            log::info!("sdp_preload: cannot watch fork");
        }
    });
}

extern "C" fn before_fork() {
    let _ = std::panic::catch_unwind(|| {
        if forked() {
            return;
        }
        let _in = Inside::enter();
        for l in table::listening() {
            l.stop_probes();
        }
    });
}

extern "C" fn in_child() {
    // Async-signal-safe: one store. The table is put right at the first call that reads it.
    FORKED.store(true, Ordering::Relaxed);
}

/// In a forked child: turns the inherited entries of `entries` (the whole table, taken out of
/// it) into what the child can use. Connections become dead TCP sockets and are forgotten
/// (dropping one would close the parent's connection); listening sockets are the kernel's
/// alone; candidates stay plain sockets.
pub fn disown(entries: impl IntoIterator<Item = (libc::c_int, Entry)>) {
    for (fd, e) in entries {
        match e {
            Entry::Connected(c) => {
                dead_socket_at(fd, c.domain);
                std::mem::forget(c);
            }
            Entry::Listening(l) => std::mem::forget(l),
            Entry::Candidate(_) | Entry::Epoll(_) => {}
        }
    }
}

/// Puts an unconnected TCP socket at `fd` (keeping its close-on-exec flag).
fn dead_socket_at(fd: libc::c_int, domain: libc::c_int) {
    let r = crate::real::real();
    // SAFETY: plain descriptor calls on the caller's descriptor and a new socket.
    unsafe {
        let cloexec = (r.fcntl)(fd, libc::F_GETFD, 0) & libc::FD_CLOEXEC != 0;
        let s = (r.socket)(domain, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if s >= 0 {
            (r.dup3)(s, fd, if cloexec { libc::O_CLOEXEC } else { 0 });
            (r.close)(s);
        }
    }
}
