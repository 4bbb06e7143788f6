//! What the library did, for tests and operators: with `SDP_PRELOAD_STATS=path`, a line per
//! process is appended to `path` at exit: `pid=.. sdp_connect=.. tcp_connect=.. sdp_accept=..
//! tcp_accept=..` (connections made or accepted over SDP, and those that stayed TCP).

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

pub static SDP_CONNECTS: AtomicU64 = AtomicU64::new(0);
pub static TCP_CONNECTS: AtomicU64 = AtomicU64::new(0);
pub static SDP_ACCEPTS: AtomicU64 = AtomicU64::new(0);
pub static TCP_ACCEPTS: AtomicU64 = AtomicU64::new(0);

/// Counts one event (and, the first time, arranges for the report at exit).
pub fn count(what: &AtomicU64) {
    static REPORT: Once = Once::new();
    what.fetch_add(1, Ordering::Relaxed);
    REPORT.call_once(|| {
        if std::env::var_os("SDP_PRELOAD_STATS").is_some() {
            // SAFETY: `report` is an `extern "C" fn()` that never unwinds.
            unsafe { libc::atexit(report) };
        }
    });
}

extern "C" fn report() {
    let _ = std::panic::catch_unwind(|| {
        let _in = crate::guard::Inside::enter();
        let Some(path) = std::env::var_os("SDP_PRELOAD_STATS") else { return };
        let line = format!(
            "pid={} sdp_connect={} tcp_connect={} sdp_accept={} tcp_accept={}\n",
            std::process::id(),
            SDP_CONNECTS.load(Ordering::Relaxed),
            TCP_CONNECTS.load(Ordering::Relaxed),
            SDP_ACCEPTS.load(Ordering::Relaxed),
            TCP_ACCEPTS.load(Ordering::Relaxed),
        );
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
            let _ = f.write_all(line.as_bytes());
        }
    });
}
