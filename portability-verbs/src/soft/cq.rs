//! Software completion queues: a bounded queue of completions, the progress driver of the queue
//! pairs that report to it, and a doorbell + eventfd so a waiter can sleep.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::ctx::CtxInner;
use crate::error::{Result, VerbsError};
use crate::os;
use crate::types::WorkCompletion;
use pv_sync::SpinLock;

/// Completions produced by one pass, `true` for send-queue ones; inline up to 8 (no allocation).
pub(crate) type Out = smallvec::SmallVec<[(bool, WorkCompletion); 8]>;

/// What a completion queue drives: the queue pairs that report to it (they are built on
/// completion queues, so the queue is generic over them instead of naming them; one type, so
/// a poll's calls are direct).
pub(crate) trait Reporter: Sized {
    /// One progress pass for `cq`; its completions go to `sink`, others to their queues.
    fn progress(&self, cq: &Cq<Self>, sink: &mut Out);
    /// Whether a progress pass for `cq` would find something to do (checked after arming).
    fn work_pending(&self, cq: &Cq<Self>) -> bool;
    /// Checks the peer now (after a sleep, when its death may be what woke the sleeper).
    fn check_peer_now(&self);
}

struct CqState {
    queue: VecDeque<WorkCompletion>,
}

/// A software completion queue, driving the queue pairs `Q` that report to it.
pub struct Cq<Q> {
    pub ctx: Arc<CtxInner>,
    capacity: usize,
    state: Mutex<CqState>,
    /// Completions queued (a hint read without the lock).
    queued: AtomicUsize,
    overrun: AtomicBool,
    /// The queue pairs reporting here, held strongly until a queue pair's `destroy` detaches it
    /// (the public queue pair's drop does). A poll drives them under one compare-and-swap:
    /// no reader count, no reference counts (each a locked instruction on every poll).
    qps: SpinLock<Vec<Arc<Q>>>,
    pub bell_slot: u32,
    eventfd: OwnedFd,
    epoll: OwnedFd,
    watched: Mutex<HashMap<i32, usize>>,
}

impl<Q: Reporter> Cq<Q> {
    pub fn new(ctx: &Arc<CtxInner>, capacity: usize) -> Result<Arc<Cq<Q>>> {
        if capacity == 0 || capacity > (1 << 22) {
            return Err(VerbsError::invalid(format!("CQ capacity {capacity} out of 1..=4M")));
        }
        let eventfd = os::eventfd()?;
        let epoll = os::epoll_create()?;
        os::epoll_add(epoll.as_raw_fd(), eventfd.as_raw_fd())?;
        let bell_slot = ctx.bell_slots.lock().expect("slot lock").take("completion-queue doorbell")?;
        let bell = ctx.ctrl().bell(bell_slot as usize).expect("slot in range");
        bell.armed.store(0, Ordering::Relaxed);
        bell.eventfd.store(eventfd.as_raw_fd(), Ordering::Relaxed);
        bell.generation.fetch_add(1, Ordering::Release);
        Ok(Arc::new(Cq {
            ctx: ctx.clone(),
            capacity,
            state: Mutex::new(CqState { queue: VecDeque::with_capacity(capacity.min(4096)) }),
            queued: AtomicUsize::new(0),
            overrun: AtomicBool::new(false),
            qps: SpinLock::new(Vec::new()),
            bell_slot,
            eventfd,
            epoll,
            watched: Mutex::new(HashMap::new()),
        }))
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub(crate) fn attach(&self, qp: &Arc<Q>) {
        let mut qps = self.qps.lock();
        if !qps.iter().any(|q| Arc::ptr_eq(q, qp)) {
            qps.push(qp.clone());
        }
    }

    /// Forgets a queue pair. The caller holds a reference, so its last one never drops here.
    pub(crate) fn detach(&self, qp: *const Q) {
        self.qps.lock().retain(|q| Arc::as_ptr(q) != qp);
    }

    /// The attached queue pairs, for work that may block (taking a queue pair's lock under
    /// the list's would deadlock with a queue pair's `destroy`, which detaches under its own).
    fn attached(&self) -> Vec<Arc<Q>> {
        self.qps.lock().clone()
    }

    /// Makes a peer's death wake sleepers of this queue (its pidfd joins the epoll set).
    pub(crate) fn watch(&self, pidfd: i32) {
        let mut w = self.watched.lock().expect("watch lock");
        let n = w.entry(pidfd).or_insert(0);
        if *n == 0 && os::epoll_add(self.epoll.as_raw_fd(), pidfd).is_err() {
            log::warn!("cannot watch peer pidfd {pidfd}");
        }
        *n += 1;
    }

    pub(crate) fn unwatch(&self, pidfd: i32) {
        let mut w = self.watched.lock().expect("watch lock");
        if let Some(n) = w.get_mut(&pidfd) {
            *n -= 1;
            if *n == 0 {
                w.remove(&pidfd);
                os::epoll_del(self.epoll.as_raw_fd(), pidfd);
            }
        }
    }

    /// Adds completions; sets the overrun error if they do not fit. Wakes a sleeper if armed.
    pub(crate) fn push(&self, wcs: impl IntoIterator<Item = WorkCompletion>) {
        let mut wcs = wcs.into_iter().peekable();
        if wcs.peek().is_none() {
            return;
        }
        let mut pushed = 0;
        {
            let mut s = self.state.lock().expect("cq lock");
            for wc in wcs {
                if s.queue.len() >= self.capacity {
                    if !self.overrun.swap(true, Ordering::Relaxed) {
                        log::error!("completion queue overrun (capacity {})", self.capacity);
                    }
                } else {
                    s.queue.push_back(wc);
                    pushed += 1;
                }
            }
            self.queued.fetch_add(pushed, Ordering::Release);
        }
        if pushed > 0 {
            self.wake_if_armed();
        }
    }

    pub(crate) fn overrun(&self) -> bool {
        self.overrun.load(Ordering::Relaxed)
    }

    fn wake_if_armed(&self) {
        let bell = self.ctx.ctrl().bell(self.bell_slot as usize).expect("slot in range");
        os::producer_barrier();
        if bell.armed.load(Ordering::Relaxed) != 0 && bell.armed.swap(0, Ordering::AcqRel) != 0 {
            os::eventfd_signal(self.eventfd.as_raw_fd());
        }
    }

    /// Drives every attached queue pair once; completions for this queue are added to `sink`.
    /// If another thread is driving them, leaves it to that thread.
    pub(crate) fn progress(&self, sink: &mut Out) {
        let Some(qps) = self.qps.try_lock() else {
            return;
        };
        for qp in qps.iter() {
            qp.progress(self, sink);
        }
    }

    /// Checks every attached queue pair's peer at once.
    pub(crate) fn check_peers(&self) {
        for qp in self.attached() {
            qp.check_peer_now();
        }
    }

    /// True if a progress pass could produce something now (used after arming).
    fn work_pending(&self) -> bool {
        if self.queued.load(Ordering::SeqCst) != 0 {
            return true;
        }
        self.attached().iter().any(|qp| qp.work_pending(self))
    }

    /// Polls up to `out.len()` completions without blocking.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let mut sink = Out::new();
        self.progress(&mut sink);
        if self.overrun() {
            // Lost completions break every queue pair that reports here.
            self.progress(&mut Out::new());
            return Err(VerbsError::CqOverrun);
        }
        // This pass's direct completions are older than anything queued for their queue pairs
        // (see the queue pairs' `progress`): they go first, and what does not fit goes to the queue's
        // front, ahead of newer ones.
        let n = out.len().min(sink.len());
        for (slot, (_, wc)) in out.iter_mut().zip(&sink) {
            *slot = *wc;
        }
        if sink.len() > n {
            self.push_front(sink[n..].iter().map(|(_, wc)| *wc));
        }
        if n == out.len() || self.queued.load(Ordering::Acquire) == 0 {
            return Ok(n);
        }
        let mut s = self.state.lock().expect("cq lock");
        let m = (out.len() - n).min(s.queue.len());
        for (slot, wc) in out[n..].iter_mut().zip(s.queue.drain(..m)) {
            *slot = wc;
        }
        self.queued.fetch_sub(m, Ordering::Relaxed);
        Ok(n + m)
    }

    /// Whether completions wait in the queue (a hint read without the lock).
    pub(crate) fn has_queued(&self) -> bool {
        self.queued.load(Ordering::Acquire) != 0
    }

    /// Puts completions back at the queue's front, in order (a poll's overflow).
    fn push_front(&self, wcs: impl DoubleEndedIterator<Item = WorkCompletion>) {
        let mut s = self.state.lock().expect("cq lock");
        let mut pushed = 0;
        for wc in wcs.rev() {
            if s.queue.len() >= self.capacity {
                if !self.overrun.swap(true, Ordering::Relaxed) {
                    log::error!("completion queue overrun (capacity {})", self.capacity);
                }
            } else {
                s.queue.push_front(wc);
                pushed += 1;
            }
        }
        self.queued.fetch_add(pushed, Ordering::Release);
    }

    /// Arms the queue: the next completion or peer activity makes [`Cq::event_fd`]
    /// readable. If work is already pending, the descriptor is made readable at once, so an
    /// arm-then-sleep sequence never misses a wake-up.
    pub fn req_notify(&self) {
        let bell = self.ctx.ctrl().bell(self.bell_slot as usize).expect("slot in range");
        bell.armed.store(1, Ordering::SeqCst);
        os::sleeper_barrier();
        if self.work_pending() && bell.armed.swap(0, Ordering::AcqRel) != 0 {
            os::eventfd_signal(self.eventfd.as_raw_fd());
        }
    }

    /// The descriptor to sleep on (an epoll set of the doorbell eventfd and the peers' pidfds).
    pub fn event_fd(&self) -> i32 {
        self.epoll.as_raw_fd()
    }

    /// Consumes a pending event; returns whether there was one.
    pub fn ack_event(&self) -> bool {
        os::eventfd_drain(self.eventfd.as_raw_fd())
    }

    /// Sleeps until an event or `timeout`; returns whether the descriptor became readable.
    pub fn wait_event(&self, timeout: Option<Duration>) -> Result<bool> {
        os::wait_readable(self.epoll.as_raw_fd(), timeout)
    }

    /// Polls, spinning for the configured time, then sleeping on the doorbell, until at least
    /// one completion is there or `timeout` passes (then `Err(Timeout)`).
    pub fn poll_blocking(&self, out: &mut [WorkCompletion], timeout: Duration) -> Result<usize> {
        let start = Instant::now();
        let spin_until = start + self.ctx.config.spin;
        loop {
            let n = self.poll(out)?;
            if n > 0 {
                return Ok(n);
            }
            let now = Instant::now();
            if now >= start + timeout {
                return Err(VerbsError::Timeout(timeout));
            }
            if now < spin_until {
                std::hint::spin_loop();
                continue;
            }
            self.req_notify();
            let left = (start + timeout).saturating_duration_since(Instant::now());
            // Sleep in slices so a dead peer is noticed even if its pidfd is not watched.
            self.wait_event(Some(left.min(Duration::from_millis(50))))?;
            self.ack_event();
            self.check_peers();
        }
    }
}

impl<Q> Drop for Cq<Q> {
    fn drop(&mut self) {
        let bell = self.ctx.ctrl().bell(self.bell_slot as usize).expect("slot in range");
        bell.armed.store(0, Ordering::Relaxed);
        bell.eventfd.store(-1, Ordering::Relaxed);
        bell.generation.fetch_add(1, Ordering::Release);
        self.ctx.bell_slots.lock().expect("slot lock").give(self.bell_slot);
    }
}
