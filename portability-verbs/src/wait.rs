//! How a thread waits for completions, one policy for every layer: a busy poll yields its CPU
//! now and then ([`spin_yields`]), and a wait that has spun long enough sleeps on its queues'
//! descriptors ([`wait_any`]). When to stop spinning depends on the state of the CPUs
//! ([`crate::cores`]).

use std::time::Duration;

use crate::error::Result;
use crate::verbs::CompletionQueue;

/// Whether a busy-polling wait yields the CPU before its `n`-th poll (from 1): not in the
/// first 128 polls (about ten microseconds: the latency path), then on every 16th. With more
/// busy threads than CPUs, the thread that would end the wait may be the one waiting for this
/// CPU; spinning alone would keep it out for a whole time slice. Pair it with [`wait_any`]
/// once a wait has spun long enough to sleep.
pub fn spin_yields(n: u32) -> bool {
    n >= 128 && n.is_multiple_of(16)
}

/// Sleeps until one of `cqs` has an event (a completion, or on the software provider a dead
/// peer) or `timeout` passes: arms each queue, sleeps on their descriptors together, and
/// acknowledges the events it woke for. Returns whether one fired. Waking a sleeping thread
/// costs tens of microseconds: spin on `poll` first where latency matters.
pub fn wait_any(cqs: &[&CompletionQueue], timeout: Duration) -> Result<bool> {
    let mut fds: smallvec::SmallVec<[libc::pollfd; 8]> = smallvec::SmallVec::with_capacity(cqs.len());
    for cq in cqs {
        // Armed before sleeping; a queue with work already pending fires at once.
        cq.req_notify()?;
        fds.push(libc::pollfd { fd: cq.event_fd(), events: libc::POLLIN, revents: 0 });
    }
    let fired = crate::os::wait_any_readable(&mut fds, Some(timeout))?;
    for (cq, fd) in cqs.iter().zip(&fds) {
        if fd.revents != 0 {
            cq.ack_event();
        }
    }
    Ok(fired)
}
