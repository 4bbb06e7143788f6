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

use std::sync::Once;

use crate::guard::Inside;
use crate::table;

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
        if table::forked() {
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
    table::set_forked();
}
