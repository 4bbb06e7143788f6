//! The backstop for requests left waiting: a NIC starts a queued request as soon as the
//! target has room for it, with no CPU of its host; the software provider starts one only when
//! its process drives the queue pair (a poll, a post, a wake-up). A request that could not
//! start at post time (the target's ring full, or a one-sided operation ordered behind a send
//! the target has not taken) would otherwise wait for as long as its owner computes or waits
//! on another queue, and a peer waiting for it (a flow-control acknowledgement, the last
//! message of a transfer) would stall with it.
//!
//! Queue pairs with waiting requests register here; one thread per process, started on first
//! use, looks at them every [`PERIOD`] and starts what the target made room for (try-lock: a
//! queue pair its owner is driving is left to the owner). It sleeps while nothing waits, so
//! it costs nothing to programs that keep their queues moving.

use std::sync::{Condvar, Mutex, Weak};
use std::time::Duration;

/// How often waiting requests are looked at while some wait. Their owner, if it is driving
/// its queues, starts them sooner; this only bounds how long an idle owner holds a peer up.
pub(crate) const PERIOD: Duration = Duration::from_millis(1);

/// A queue pair with requests that could not start (the queue pairs are built on this module,
/// so it holds them through this trait instead of naming them).
pub(crate) trait Waiting: Send + Sync {
    /// Starts what the target made room for; whether requests still wait.
    fn drive_waiting(&self) -> bool;
}

struct Watched {
    qps: Vec<Weak<dyn Waiting>>,
    /// The process that started the thread (a forked child has no such thread).
    thread_of: Option<u32>,
}

struct Backstop {
    watched: Mutex<Watched>,
    wake: Condvar,
}

fn backstop() -> &'static Backstop {
    static B: std::sync::OnceLock<Backstop> = std::sync::OnceLock::new();
    B.get_or_init(|| Backstop {
        watched: Mutex::new(Watched { qps: Vec::new(), thread_of: None }),
        wake: Condvar::new(),
    })
}

/// Watches `qp`, whose send queue holds requests that could not start. The caller marks it
/// watched (so it registers once until the backstop finds nothing waiting).
pub(crate) fn watch(qp: Weak<dyn Waiting>) {
    let b = backstop();
    let mut w = b.watched.lock().unwrap_or_else(|p| p.into_inner());
    w.qps.push(qp);
    let me = std::process::id();
    if w.thread_of != Some(me) {
        let spawned = crate::os::spawn_quiet("pv-soft-backstop", run);
        match spawned {
            Ok(_) => w.thread_of = Some(me),
            // Requests still start whenever their owner drives the queue pair.
            Err(e) => {
                log::warn!("software provider: no backstop thread ({e}); waiting requests need their owner's polls")
            }
        }
    }
    b.wake.notify_one();
}

fn run() {
    let b = backstop();
    let mut round: Vec<Weak<dyn Waiting>> = Vec::new();
    loop {
        {
            let mut w = b.watched.lock().unwrap_or_else(|p| p.into_inner());
            w.qps.append(&mut round);
            while w.qps.is_empty() {
                w = b.wake.wait(w).unwrap_or_else(|p| p.into_inner());
            }
        }
        std::thread::sleep(PERIOD);
        round = std::mem::take(&mut b.watched.lock().unwrap_or_else(|p| p.into_inner()).qps);
        // Still waiting: keep for the next round; finished or destroyed: drop.
        round.retain(|weak| weak.upgrade().is_some_and(|qp| qp.drive_waiting()));
    }
}
