//! How a queue pair is driven: a completion-queue poll's pass (either transport), the hints
//! that let an idle poll skip the lock, the backstop that starts requests nobody drives, and
//! what a sleeper checks before and after it sleeps.

use super::*;
use crate::soft::backstop::Waiting;
use crate::soft::cq::Reporter;

impl Reporter for QpInner {
    #[inline]
    fn progress(&self, cq: &CqInner, sink: &mut Out) {
        QpInner::progress(self, cq, sink)
    }
    fn work_pending(&self, cq: &CqInner) -> bool {
        QpInner::work_pending(self, cq)
    }
    fn check_peer_now(&self) {
        QpInner::check_peer_now(self)
    }
}

impl Waiting for QpInner {
    fn drive_waiting(&self) -> bool {
        QpInner::drive_waiting(self)
    }
}

impl QpInner {
    /// One progress pass for the queue `cq`; its completions go to `sink` (the poller hands them
    /// straight to its caller), others to their queues.
    pub(crate) fn progress(&self, cq: &CqInner, sink: &mut Out) {
        if self.over_tcp.load(Ordering::Acquire) {
            return self.tcp_progress(cq, sink);
        }
        self.help_peer();
        let recv_side = std::ptr::eq(cq, &*self.recv_cq);
        let send_side = std::ptr::eq(cq, &*self.send_cq);
        let inbound = recv_side && {
            let head = self.peek_head.load(Ordering::Relaxed);
            let off = wire::ring_offset(head, self.ring_bytes);
            self.ring().publish(off).load(Ordering::Acquire) == wire::publish_word(head)
        };
        let outbound = send_side && self.sq_busy.load(Ordering::Relaxed);
        if !inbound && !outbound && !cq.overrun() {
            // Nothing to do; look at the peer's health now and then.
            let n = self.idle.load(Ordering::Relaxed).wrapping_add(1);
            self.idle.store(n, Ordering::Relaxed);
            if !n.is_multiple_of(64) {
                return;
            }
        }
        let Some(mut core) = self.core.try_lock() else {
            return;
        }; // another thread is on it
        let mut out = Out::new();
        if cq.overrun() && core.state != QpState::Error {
            self.enter_error(&mut core, &mut out);
        }
        if recv_side {
            self.progress_inbound(&mut core, &mut out);
        }
        if send_side && (outbound || self.periodic_reap_due(&mut core)) {
            self.progress_outbound(&mut core, &mut out);
        }
        if out.is_empty() && core.remote.is_some() && core.state != QpState::Error {
            core.idle_polls += 1;
            if core.idle_polls >= 32 {
                core.idle_polls = 0;
                let now = Instant::now();
                if now.duration_since(core.last_liveness) >= LIVENESS_EVERY {
                    core.last_liveness = now;
                    self.check_peer(&mut core, &mut out);
                }
            }
        }
        self.publish_peek(&core);
        self.hand_out(cq, sink, &out);
        drop(core);
    }

    /// Hands a pass's completions over, for the queue `cq` that drove it to `sink`.
    pub(super) fn hand_out(&self, cq: &CqInner, sink: &mut Out, out: &Out) {
        let recv_side = std::ptr::eq(cq, &*self.recv_cq);
        let send_side = std::ptr::eq(cq, &*self.send_cq);
        // Send-queue completions first: a receive found in this pass may have been sent in
        // answer to one of our requests that this pass also found consumed (causal order, as
        // on a wire where the acknowledgement precedes the answer).
        // Everything is handed over before the lock is released, so a thread that drives this
        // queue pair next cannot get newer completions of it queued ahead of these. The poller
        // takes this pass's completions directly only if nothing is queued at its CQ: then
        // whatever gets queued later is newer and `CqInner::poll` returns the direct ones first.
        let direct = !cq.has_queued();
        let causal = out.iter().filter(|(s, _)| *s).chain(out.iter().filter(|(s, _)| !*s));
        for &(from_send_queue, wc) in causal {
            if (from_send_queue && send_side) || (!from_send_queue && recv_side) {
                if direct {
                    sink.push((from_send_queue, wc));
                } else {
                    cq.push(std::iter::once(wc));
                }
            } else if from_send_queue {
                self.send_cq.push(std::iter::once(wc));
            } else {
                self.recv_cq.push(std::iter::once(wc));
            }
        }
    }

    /// Publishes the lock-free hints from the locked state. On every post and progress pass:
    /// inlined, with the rare hand-over to the backstop out of line.
    pub(super) fn publish_peek(&self, core: &QpCore) {
        self.peek_head.store(core.cons_head, Ordering::Relaxed);
        // Unsignaled requests in flight alone do not make polls reap: they are retired on the
        // periodic slow pass, when ring space or queue slots are needed, or by a later signaled one.
        let waiting = core.exec_next < core.sq.len();
        self.sq_busy.store(core.signaled_outstanding > 0 || waiting, Ordering::Relaxed);
        // Over TCP the engine starts waiting requests (when the socket takes more).
        if waiting
            && core.state == QpState::ReadyToSend
            && core.tcp.is_none()
            && !self.backstop_watched.load(Ordering::Relaxed)
        {
            self.hand_to_backstop();
        }
    }

    /// Has the backstop watch this queue pair's waiting requests (once until it lets go).
    #[cold]
    #[inline(never)]
    pub(super) fn hand_to_backstop(&self) {
        if !self.backstop_watched.swap(true, Ordering::Relaxed) {
            match local_qp(self.ctx.id, self.qpn) {
                Some(me) => crate::soft::backstop::watch(me),
                None => self.backstop_watched.store(false, Ordering::Relaxed),
            }
        }
    }

    /// The backstop's pass: starts the waiting requests the target made room for, if no other
    /// thread is on this queue pair, and checks on a peer that lets them wait. True while
    /// requests still wait (the backstop keeps watching).
    pub(crate) fn drive_waiting(&self) -> bool {
        let Some(mut core) = self.core.try_lock() else {
            return true;
        };
        let mut out = Out::new();
        self.progress_outbound(&mut core, &mut out);
        let waits = |core: &QpCore| core.exec_next < core.sq.len() && core.state == QpState::ReadyToSend;
        if waits(&core) {
            let now = Instant::now();
            if now.duration_since(core.last_liveness) >= LIVENESS_EVERY {
                core.last_liveness = now;
                self.check_peer(&mut core, &mut out);
            }
        }
        let waiting = waits(&core);
        if !waiting {
            // Under the lock: whoever leaves requests waiting next sees the flag down.
            self.backstop_watched.store(false, Ordering::Relaxed);
        }
        self.publish_peek(&core);
        self.deliver(&out); // under the lock: per-QP completion order across threads
        drop(core);
        waiting
    }

    /// True if a progress pass for `cq` would find something to do.
    pub(crate) fn work_pending(&self, cq: &CqInner) -> bool {
        let mut core = self.core.lock();
        if core.tcp.is_some() {
            // About to sleep: the engine reads our input from now on and pushes what arrives,
            // waking the sleeper.
            self.tcp_to_engine(&mut core);
            return false;
        }
        if std::ptr::eq(cq, &*self.recv_cq) && !core.inbound_dead {
            let off = wire::ring_offset(core.cons_head, self.ring_bytes);
            if self.ring().publish(off).load(Ordering::Acquire) == wire::publish_word(core.cons_head) {
                return true;
            }
        }
        if std::ptr::eq(cq, &*self.send_cq) && core.in_ring > 0 {
            if let Some(r) = &core.remote {
                if r.seg().consumer().consumed.load(Ordering::Acquire) != core.reaped {
                    return true;
                }
            }
        }
        if let Some(r) = &core.remote {
            if !r.peer.alive() && core.state != QpState::Error {
                return true;
            }
        }
        false
    }

    /// Checks the peer now (after a sleep, when its death may be what woke us).
    pub(crate) fn check_peer_now(&self) {
        let mut core = self.core.lock();
        let mut out = Out::new();
        if core.tcp.is_some() {
            self.tcp_drive(&mut core, &mut out);
            self.publish_peek(&core);
            self.deliver(&out);
            return;
        }
        core.last_liveness = Instant::now();
        // After a sleep, probe receiver-not-ready at once: a request the peer has no receive
        // for wakes nobody, and polls after a sleep are too few for the periodic passes.
        core.head_waits = u32::MAX;
        if core.in_ring > 0 {
            self.progress_outbound(&mut core, &mut out);
        }
        self.check_peer(&mut core, &mut out);
        self.publish_peek(&core);
        self.deliver(&out); // under the lock: per-QP completion order across threads
        drop(core);
    }
}
