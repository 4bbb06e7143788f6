//! Software reliable-connected queue pairs and shared receive queues.
//!
//! Each queue pair owns a segment with its state and an inbound ring. The peer's requester writes
//! records (sends, writes-with-immediate) into that ring; our responder consumes them when a
//! completion queue is polled or a receive is posted. One-sided operations (RDMA write, read,
//! atomics, and the data of large writes-with-immediate) are carried out by the requester itself
//! on the responder's registered memory, after checking the responder's published keys: the
//! responder's CPU takes no part, as with a NIC, except that a polling responder may push the
//! back half of a large read (`assist`).
//!
//! Ordering: requests of one queue pair run in posting order. A one-sided request waits until
//! every earlier ring record has been consumed, so the responder sees effects in order, as an RC
//! responder processes packets in PSN order. Completions are reported in posting order.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::assist::{self, Back, Stuck};
use super::cq::CqInner;
use super::ctx::{local_copy, CtxInner, LocalKeys};
use super::layout::{qp_state_code, QpSeg, QP_DESTROYED, QP_MAGIC, RING_OFFSET};
use super::peer::PeerCtx;
use super::segment::{qp_name, Segment};
use super::spin::SpinLock;
use super::sys;
use super::wire::{self, status, Descriptor, RecordHeader, RecordKind, FIELDS_BYTES};

mod tcp;
use crate::endpoint::{EndpointInfo, SoftEndpoint};
use crate::error::{Result, VerbsError};
use crate::types::*;

/// A shared receive queue.
pub struct SrqInner {
    pub ctx: Arc<CtxInner>,
    pub pd: u32,
    pub rq_slot: u32,
    pub max_wr: u32,
    pub max_sge: u32,
    queue: Mutex<VecDeque<RecvWr>>,
}

impl SrqInner {
    pub fn new(ctx: &Arc<CtxInner>, pd: u32, max_wr: u32, max_sge: u32) -> Result<Arc<SrqInner>> {
        if max_wr == 0 || max_sge == 0 {
            return Err(VerbsError::invalid("a shared receive queue needs max_wr and max_sge > 0"));
        }
        let rq_slot = ctx.rq_slots.lock().expect("slot lock").take("receive queue")?;
        let c = ctx.ctrl().rq(rq_slot as usize).expect("slot in range");
        c.posted.store(0, Ordering::Relaxed);
        c.consumed.store(0, Ordering::Relaxed);
        Ok(Arc::new(SrqInner { ctx: ctx.clone(), pd, rq_slot, max_wr, max_sge, queue: Mutex::new(VecDeque::new()) }))
    }

    pub fn post_recv(&self, wrs: &[RecvWr]) -> Result<()> {
        let mut q = self.queue.lock().expect("srq lock");
        for wr in wrs {
            if wr.sg_list.len() > self.max_sge as usize {
                return Err(VerbsError::invalid(format!(
                    "{} SGEs over the SRQ's max_sge {}",
                    wr.sg_list.len(),
                    self.max_sge
                )));
            }
            if q.len() >= self.max_wr as usize {
                return Err(VerbsError::Exhausted("shared receive queue is full".into()));
            }
            q.push_back(RecvWr { wr_id: wr.wr_id, sg_list: crate::types::sg_list_of(&wr.sg_list) });
            self.ctx.ctrl().rq(self.rq_slot as usize).expect("slot").posted.fetch_add(1, Ordering::Release);
        }
        Ok(())
    }
}

impl Drop for SrqInner {
    fn drop(&mut self) {
        self.ctx.rq_slots.lock().expect("slot lock").give(self.rq_slot);
    }
}

/// Where an outstanding send-queue request stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SqStage {
    /// Not yet carried out.
    Waiting,
    /// Its record is in the peer's ring at `start..end` (produced-byte counts), at ring offset `off`.
    InRing { start: u64, end: u64, off: usize, target_placed: bool },
    /// Sent over TCP, waiting for its response (`tcp`).
    OnWire,
    /// Finished with this status.
    Done(WcStatus),
}

/// Where an inline request's data is.
enum Inline {
    /// Not inline: the SGEs name registered memory.
    No,
    /// Still in the caller's memory (valid during `post_send` only).
    Borrowed,
    /// Copied, because the request could not start during `post_send`.
    Owned(Vec<u8>),
}

/// A send-queue request as it is kept: what its completion needs, and the request itself only
/// while it waits to start (requests that start at post time are never copied).
struct SqEntry {
    wr_id: u64,
    opcode: WrOpcode,
    signaled: bool,
    byte_len: u32,
    stage: SqStage,
    waiting: Option<Box<(SendWr, Inline)>>,
}

struct Remote {
    info: SoftEndpoint,
    peer: Arc<PeerCtx>,
    /// Shared with the windows onto the peer's memory (they read its state).
    seg: Arc<Segment>,
    ring_bytes: usize,
    /// The peer queue pair itself when it lives in this process: a requester waiting for its
    /// records to be consumed can run the responder's side itself.
    local: Option<std::sync::Weak<QpInner>>,
}

impl Remote {
    fn seg(&self) -> QpSeg<'_> {
        QpSeg(&self.seg)
    }
    fn ring(&self) -> RingView {
        RingView { base: self.seg().ring(), bytes: self.ring_bytes }
    }
    /// True once the peer queue pair is in error or destroyed: as a responder it answers
    /// nothing more.
    fn peer_qp_gone(&self) -> bool {
        qp_seg_gone(&self.seg)
    }
}

/// True once the queue pair whose segment `seg` is went into error or was destroyed.
#[inline]
pub(crate) fn qp_seg_gone(seg: &Segment) -> bool {
    let state = QpSeg(seg).header().state.load(Ordering::Acquire);
    state == qp_state_code(QpState::Error) || state == QP_DESTROYED
}

struct RnrTrack {
    start: u64,
    naks: u32,
    last: Instant,
}

struct QpCore {
    state: QpState,
    access: AccessFlags,
    min_rnr_timer: u8,
    rts: RtsAttr,
    remote: Option<Remote>,
    // Requester side.
    sq: VecDeque<SqEntry>,
    /// Index in `sq` of the first request not yet carried out.
    exec_next: usize,
    /// Ring records in flight (placed, not yet seen consumed).
    in_ring: usize,
    /// Those of them whose data the responder places (sends, small writes-with-immediate):
    /// one-sided requests wait for these, so the responder sees effects in order.
    in_ring_data: usize,
    produced: u64,
    /// Peer's consumed count as last turned into completions.
    reaped: u64,
    rnr: Option<RnrTrack>,
    /// Signaled requests not yet reported: someone waits for them, so reap eagerly.
    signaled_outstanding: usize,
    /// Reaps that found the head record still waiting (receiver-not-ready is probed only now
    /// and then, so the peer's receive counters are not pulled across cores on every poll).
    head_waits: u32,
    // Responder side.
    rq: VecDeque<RecvWr>,
    cons_head: u64,
    inbound_dead: bool,
    idle_polls: u32,
    /// Periodic passes since the last one that reaped (see [`QpInner::periodic_reap_due`]).
    quiet_passes: u32,
    last_liveness: Instant,
    /// The TCP transport's state when the peer is reached over TCP (`remote` is then None).
    tcp: Option<Box<tcp::TcpSide>>,
}

/// A software queue pair.
pub struct QpInner {
    pub ctx: Arc<CtxInner>,
    pub qpn: u32,
    pub pd: u32,
    seg: Segment,
    ring_bytes: usize,
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
    srq: Option<Arc<SrqInner>>,
    rq_slot: u32,
    caps: QpCaps,
    core: SpinLock<QpCore>,
    /// Lock-free hints so an idle poll costs a few loads: the responder's next record position
    /// and sequence, and whether the send queue holds anything.
    peek_head: AtomicU64,
    sq_busy: AtomicBool,
    idle: AtomicU32,
    /// Registered with the backstop, which starts waiting requests when we do not.
    backstop_watched: AtomicBool,
    /// The connected peer, for helping with its shared copies without the queue pair's lock
    /// (a thread of ours may hold that lock waiting for the peer's help in turn).
    helper_peer: Mutex<Option<Arc<PeerCtx>>>,
    /// Shared copies offered so far (their job ids).
    assist_jobs: AtomicU64,
    /// The share of a shared copy this side takes as the copier (`assist::next_share`).
    copier_share: AtomicU32,
    /// Connected over TCP (read without the lock by polls).
    over_tcp: AtomicBool,
    /// A TCP connection from our peer that arrived before our ready-to-receive transition.
    parked: Mutex<Option<(std::net::TcpStream, crate::soft::tcp::frame::Frame)>>,
}

type LocalQps = Mutex<std::collections::HashMap<(u64, u32), std::sync::Weak<QpInner>>>;

/// Queue pairs of this process, so a same-process requester can drive its responder.
fn local_qps() -> &'static LocalQps {
    static QPS: std::sync::OnceLock<LocalQps> = std::sync::OnceLock::new();
    QPS.get_or_init(Default::default)
}

fn local_qp(ctx_id: u64, qpn: u32) -> Option<std::sync::Weak<QpInner>> {
    local_qps().lock().expect("local qp registry").get(&(ctx_id, qpn)).cloned()
}

/// Waits until every thread that held the lock of a queue pair of context `ctx_id` when this
/// was called has let it go: the grace period of a deregistration, since lock holders read
/// the key table without a lock. Must not be called while holding such a lock.
pub(crate) fn wait_for_lock_holders(ctx_id: u64) {
    let qps: Vec<_> = local_qps()
        .lock()
        .expect("local qp registry")
        .iter()
        .filter(|(k, _)| k.0 == ctx_id)
        .map(|(_, w)| w.clone())
        .collect();
    for qp in qps.iter().filter_map(std::sync::Weak::upgrade) {
        drop(qp.core.lock());
    }
}

/// Completions produced by one pass, `true` for send-queue ones; inline up to 8 (no allocation).
pub(crate) type Out = smallvec::SmallVec<[(bool, WorkCompletion); 8]>;

const LIVENESS_EVERY: Duration = Duration::from_millis(10);

/// How long a shared copy waits for a live peer that took its back half (a stopped peer).
const ASSIST_TIMEOUT: Duration = Duration::from_secs(5);

/// A periodic pass (nothing signaled or waiting) reaps unsignaled requests only every this
/// many passes, or when the send queue is half full.
const PERIODIC_REAP_EVERY: u32 = 16;

fn status_of(code: u32) -> WcStatus {
    match code {
        status::OK => WcStatus::Success,
        status::REM_INV_REQ => WcStatus::RemInvReqErr,
        status::REM_ACCESS => WcStatus::RemAccessErr,
        status::REM_OP => WcStatus::RemOpErr,
        _ => WcStatus::GeneralErr,
    }
}

impl QpInner {
    pub fn new(
        ctx: &Arc<CtxInner>,
        pd: u32,
        send_cq: &Arc<CqInner>,
        recv_cq: &Arc<CqInner>,
        srq: Option<&Arc<SrqInner>>,
        caps: QpCaps,
    ) -> Result<Arc<QpInner>> {
        if caps.max_send_wr == 0
            || caps.max_send_sge == 0
            || (srq.is_none() && (caps.max_recv_wr == 0 || caps.max_recv_sge == 0))
        {
            return Err(VerbsError::invalid("queue sizes must be > 0"));
        }
        if caps.max_send_wr > 1 << 16 || caps.max_recv_wr > 1 << 16 || caps.max_send_sge > 64 || caps.max_recv_sge > 64
        {
            return Err(VerbsError::invalid("queue sizes over the provider's limits (64 Ki requests, 64 SGEs)"));
        }
        if caps.max_inline_data as usize > ctx.config.copy_threshold {
            return Err(VerbsError::invalid(format!(
                "max_inline_data {} over the provider's {}",
                caps.max_inline_data, ctx.config.copy_threshold
            )));
        }
        if let Some(s) = srq {
            if s.pd != pd {
                return Err(VerbsError::invalid("the shared receive queue belongs to another protection domain"));
            }
        }
        let qpn = ctx.next_qpn.fetch_add(1, Ordering::Relaxed) & 0x00ff_ffff;
        let ring_bytes = ctx.config.ring_bytes;
        let seg = Segment::create_named(&qp_name(ctx.id, qpn), 0, RING_OFFSET + ring_bytes)?;
        let rq_slot = match srq {
            Some(s) => s.rq_slot,
            None => {
                let slot = ctx.rq_slots.lock().expect("slot lock").take("receive queue")?;
                let c = ctx.ctrl().rq(slot as usize).expect("slot in range");
                c.posted.store(0, Ordering::Relaxed);
                c.consumed.store(0, Ordering::Relaxed);
                slot
            }
        };
        {
            let h = QpSeg(&seg).header();
            h.qpn.store(qpn, Ordering::Relaxed);
            h.pd.store(pd, Ordering::Relaxed);
            h.state.store(qp_state_code(QpState::Reset), Ordering::Relaxed);
            h.magic.store(QP_MAGIC, Ordering::Release);
        }
        let qp = Arc::new(QpInner {
            ctx: ctx.clone(),
            qpn,
            pd,
            seg,
            ring_bytes,
            send_cq: send_cq.clone(),
            recv_cq: recv_cq.clone(),
            srq: srq.cloned(),
            rq_slot,
            caps,
            core: SpinLock::new(QpCore {
                state: QpState::Reset,
                access: AccessFlags::NONE,
                min_rnr_timer: 12,
                rts: RtsAttr::default(),
                remote: None,
                sq: VecDeque::new(),
                exec_next: 0,
                in_ring: 0,
                in_ring_data: 0,
                produced: 0,
                reaped: 0,
                rnr: None,
                signaled_outstanding: 0,
                head_waits: 0,
                rq: VecDeque::new(),
                cons_head: 0,
                inbound_dead: false,
                idle_polls: 0,
                quiet_passes: 0,
                last_liveness: Instant::now(),
                tcp: None,
            }),
            peek_head: AtomicU64::new(0),
            sq_busy: AtomicBool::new(false),
            idle: AtomicU32::new(0),
            backstop_watched: AtomicBool::new(false),
            helper_peer: Mutex::new(None),
            assist_jobs: AtomicU64::new(0),
            copier_share: AtomicU32::new(assist::EVEN_SHARE),
            over_tcp: AtomicBool::new(false),
            parked: Mutex::new(None),
        });
        send_cq.attach(&qp);
        recv_cq.attach(&qp);
        local_qps().lock().expect("local qp registry").insert((ctx.id, qpn), Arc::downgrade(&qp));
        Ok(qp)
    }

    fn ring(&self) -> RingView {
        RingView { base: QpSeg(&self.seg).ring(), bytes: self.ring_bytes }
    }

    fn header(&self) -> &super::layout::QpHeader {
        QpSeg(&self.seg).header()
    }

    pub fn caps(&self) -> QpCaps {
        self.caps
    }

    pub fn state(&self) -> QpState {
        self.core.lock().state
    }

    /// What the peer needs to connect to this queue pair.
    pub fn endpoint(&self) -> SoftEndpoint {
        SoftEndpoint {
            pid: self.ctx.pid,
            start_time: self.ctx.start_time,
            ctx_id: self.ctx.id,
            ctrl_fd: self.ctx.ctrl.fd(),
            qp_fd: self.seg.fd(),
            qpn: self.qpn,
            ring_bytes: self.ring_bytes as u32,
            pd: self.pd,
            rq_slot: self.rq_slot,
            send_cq_bell: self.send_cq.bell_slot,
            recv_cq_bell: self.recv_cq.bell_slot,
            host: super::host::identity(),
            tcp: self.tcp_listen_addr(),
            tcp_only: self.ctx.config.tcp_only,
        }
    }

    fn set_state(&self, core: &mut QpCore, s: QpState) {
        core.state = s;
        self.header().state.store(qp_state_code(s), Ordering::Release);
    }

    /// Applies a state transition, enforcing the verbs state machine.
    pub fn modify(&self, t: QpTransition) -> Result<()> {
        let mut core = self.core.lock();
        let mut flushed = Out::new();
        match (core.state, t) {
            (_, QpTransition::Reset) => self.reset(&mut core),
            (_, QpTransition::Error) => self.enter_error(&mut core, &mut flushed),
            (QpState::Reset, QpTransition::Init { access, port }) => {
                if port != 1 {
                    return Err(VerbsError::invalid(format!("port {port}: the software device has port 1 only")));
                }
                core.access = access;
                self.header().access.store(access.bits(), Ordering::Relaxed);
                self.set_state(&mut core, QpState::Init);
            }
            (QpState::Init, QpTransition::Rtr(attr)) => {
                let EndpointInfo::Soft(info) = attr.remote else {
                    return Err(VerbsError::ProviderMismatch(
                        "a software QP can only connect to a software endpoint".into(),
                    ));
                };
                core.min_rnr_timer = attr.min_rnr_timer & 31;
                self.header().min_rnr_timer.store(core.min_rnr_timer as u32, Ordering::Relaxed);
                if self.wants_tcp(&info) {
                    self.connect_tcp(&mut core, &info)?;
                    self.over_tcp.store(true, Ordering::Release);
                } else {
                    let remote = self.connect(&info)?;
                    self.watch_peer(&remote.peer, true);
                    *self.helper_peer.lock().expect("helper peer lock") = Some(remote.peer.clone());
                    core.remote = Some(remote);
                }
                self.set_state(&mut core, QpState::ReadyToReceive);
            }
            (QpState::ReadyToReceive, QpTransition::Rts(attr)) => {
                if attr.retry_cnt > 7 || attr.rnr_retry > 7 {
                    return Err(VerbsError::invalid("retry_cnt and rnr_retry are 0..=7"));
                }
                core.rts = attr;
                self.set_state(&mut core, QpState::ReadyToSend);
            }
            (QpState::ReadyToSend, QpTransition::Rts(attr)) => core.rts = attr,
            (s, t) => return Err(VerbsError::InvalidState(format!("no transition {t:?} from {s:?}"))),
        }
        self.publish_peek(&core);
        // Delivered under the lock: completions of one queue pair reach its queues in order
        // even when several threads drive it.
        self.deliver(&flushed);
        drop(core);
        Ok(())
    }

    fn connect(&self, info: &SoftEndpoint) -> Result<Remote> {
        if !info.ring_bytes.is_power_of_two() || (info.ring_bytes as usize) < 8192 {
            return Err(VerbsError::Protocol(format!("peer ring of {} bytes is not a valid ring", info.ring_bytes)));
        }
        if self.ctx.ctrl().bell(0).is_none() {
            unreachable!("control segment always has doorbells");
        }
        let peer = self.ctx.peer(info)?;
        if peer.ctrl().bell(info.send_cq_bell as usize).is_none()
            || peer.ctrl().bell(info.recv_cq_bell as usize).is_none()
            || peer.ctrl().rq(info.rq_slot as usize).is_none()
        {
            return Err(VerbsError::Protocol("peer endpoint names slots out of range".into()));
        }
        let fd = peer.fetch(info.qp_fd).map_err(|e| VerbsError::PeerUnreachable(e.to_string()))?;
        let ring_bytes = info.ring_bytes as usize;
        let seg = Arc::new(Segment::map_fetched(fd, &qp_name(info.ctx_id, info.qpn), RING_OFFSET + ring_bytes)?);
        let local = if peer.same_process { local_qp(info.ctx_id, info.qpn) } else { None };
        let remote = Remote { info: *info, peer, seg, ring_bytes, local };
        let h = remote.seg().header();
        if h.magic.load(Ordering::Acquire) != QP_MAGIC || h.qpn.load(Ordering::Relaxed) != info.qpn {
            return Err(VerbsError::Protocol("peer queue-pair segment does not match its endpoint".into()));
        }
        Ok(remote)
    }

    fn reset(&self, core: &mut QpCore) {
        *self.helper_peer.lock().expect("helper peer lock") = None;
        self.tcp_close(core);
        self.over_tcp.store(false, Ordering::Release);
        QpSeg(&self.seg).assist().state.store(0, Ordering::Release);
        if let Some(r) = core.remote.take() {
            self.watch_peer(&r.peer, false);
        }
        core.sq.clear();
        core.exec_next = 0;
        core.in_ring = 0;
        core.in_ring_data = 0;
        core.produced = 0;
        core.reaped = 0;
        core.rnr = None;
        core.signaled_outstanding = 0;
        core.head_waits = 0;
        let dropped = core.rq.len() as u64;
        core.rq.clear();
        if self.srq.is_none() {
            self.count_consumed(dropped);
        }
        core.cons_head = 0;
        core.inbound_dead = false;
        // SAFETY: the ring lies inside our own segment; no peer is connected any more.
        unsafe { std::ptr::write_bytes(QpSeg(&self.seg).ring(), 0, self.ring_bytes) };
        QpSeg(&self.seg).consumer().consumed.store(0, Ordering::Release);
        QpSeg(&self.seg).consumer().taking.store(0, Ordering::Release);
        self.header().cancel_from.store(0, Ordering::Release);
        self.set_state(core, QpState::Reset);
    }

    /// Our context's key table, read without a lock: `held` proves our lock is held, and a
    /// deregistration waits for that lock ([`wait_for_lock_holders`]). Use the view only while
    /// the guard that `held` came from lives.
    #[inline]
    fn keys(&self, held: &QpCore) -> LocalKeys<'_> {
        let _ = held;
        // SAFETY: we are a queue pair of `self.ctx` (registered in `local_qps` until dropped),
        // and the caller holds our lock (it lent us `held` from the guard) while it uses the view.
        unsafe { self.ctx.keys_under_qp_lock() }
    }

    fn rq_counters(&self) -> &super::layout::RqCounters {
        self.ctx.ctrl().rq(self.rq_slot as usize).expect("slot in range")
    }

    /// Counts `n` more receives consumed (the peer compares the counters to tell
    /// receiver-not-ready). A queue pair's own counters change only under its lock, so a plain
    /// store does, without a locked instruction per message; a shared receive queue's are
    /// counted by every queue pair taking from it.
    fn count_consumed(&self, n: u64) {
        let c = &self.rq_counters().consumed;
        if self.srq.is_some() {
            c.fetch_add(n, Ordering::Release);
        } else {
            add_as_only_writer(c, n);
        }
    }

    /// A request of ours failed: the queue pair goes to error, but what the peer placed in our
    /// ring before that is delivered first, as a NIC would have taken it on arrival (the peer
    /// may have closed after its last message, which makes our next request fail).
    fn fail_sending(&self, core: &mut QpCore, out: &mut Out) {
        self.progress_inbound(core, out);
        self.enter_error(core, out);
    }

    /// Moves to the error state: every outstanding request completes with a flush error and
    /// records still waiting in the peer's ring are cancelled.
    fn enter_error(&self, core: &mut QpCore, out: &mut Out) {
        if core.state == QpState::Error {
            return;
        }
        self.set_state(core, QpState::Error);
        self.tcp_error(core);
        if let Some(r) = &core.remote {
            // Records still in the peer's ring must never be delivered now.
            if let Some(first) = core.sq.iter().find_map(|e| match e.stage {
                SqStage::InRing { start, .. } => Some(start),
                _ => None,
            }) {
                cancel_from(r, first);
            }
        }
        for e in core.sq.iter_mut() {
            if !matches!(e.stage, SqStage::Done(_)) {
                e.stage = SqStage::Done(WcStatus::WrFlushErr);
            }
        }
        core.exec_next = core.sq.len();
        core.in_ring = 0;
        core.in_ring_data = 0;
        self.retire(core, out);
        let flushed = core.rq.len() as u64;
        for wr in core.rq.drain(..) {
            out.push((false, self.recv_wc(wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, 0, None, 0)));
        }
        if flushed > 0 {
            self.count_consumed(flushed);
        }
    }

    fn recv_wc(
        &self,
        wr_id: u64,
        status: WcStatus,
        opcode: WcOpcode,
        len: u32,
        imm: Option<u32>,
        src_qp: u32,
    ) -> WorkCompletion {
        WorkCompletion { wr_id, status, opcode, byte_len: len, imm, qp_num: self.qpn, src_qp }
    }

    /// Hands completions to the right queues: `true` marks send-queue ones.
    fn deliver(&self, wcs: &Out) {
        if wcs.is_empty() {
            return;
        }
        self.send_cq.push(wcs.iter().filter(|(s, _)| *s).map(|(_, w)| *w));
        self.recv_cq.push(wcs.iter().filter(|(s, _)| !*s).map(|(_, w)| *w));
    }

    /// Posts receives.
    pub fn post_recv(&self, wrs: &[RecvWr]) -> Result<()> {
        if self.srq.is_some() {
            return Err(VerbsError::InvalidState("this QP uses a shared receive queue; post to the SRQ".into()));
        }
        let mut core = self.core.lock();
        let mut out = Out::new();
        let r = (|| {
            for wr in wrs {
                if wr.sg_list.len() > self.caps.max_recv_sge as usize {
                    return Err(VerbsError::invalid(format!(
                        "{} SGEs over max_recv_sge {}",
                        wr.sg_list.len(),
                        self.caps.max_recv_sge
                    )));
                }
                match core.state {
                    QpState::Reset => return Err(VerbsError::InvalidState("cannot post receives in RESET".into())),
                    QpState::Error => {
                        out.push((false, self.recv_wc(wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, 0, None, 0)));
                        continue;
                    }
                    _ => {}
                }
                if core.rq.len() >= self.caps.max_recv_wr as usize {
                    return Err(VerbsError::Exhausted("receive queue is full".into()));
                }
                core.rq.push_back(RecvWr { wr_id: wr.wr_id, sg_list: crate::types::sg_list_of(&wr.sg_list) });
                // Under our lock, the only writer (see `count_consumed`).
                add_as_only_writer(&self.rq_counters().posted, 1);
            }
            Ok(())
        })();
        // A message may have been waiting for this receive.
        self.progress_inbound(&mut core, &mut out);
        self.publish_peek(&core);
        self.deliver(&out); // under the lock: per-QP completion order across threads
        drop(core);
        r
    }

    /// Posts send-queue requests and starts them at once where the ring and ordering allow.
    pub fn post_send(&self, wrs: &[SendWr]) -> Result<()> {
        let mut core = self.core.lock();
        if core.tcp.is_some() {
            let r = self.tcp_post_send(&mut core, wrs);
            drop(core);
            return r;
        }
        if let [wr] = wrs {
            if let Some(done) = self.post_write_at_once(&mut core, wr) {
                return done;
            }
        }
        let mut out = Out::new();
        let mut result = Ok(());
        for wr in wrs {
            if core.sq.len() >= self.caps.max_send_wr as usize && self.reap(&mut core, &mut out) {
                // Full: unsignaled requests the peer already consumed free their slots.
                self.retire(&mut core, &mut out);
            }
            if let Err(e) = self.check_send(&core, wr) {
                result = Err(e);
                break;
            }
            let inline = if wr.flags.inline && wr.opcode != WrOpcode::RdmaRead && !wr.opcode.is_atomic() {
                Inline::Borrowed
            } else {
                Inline::No
            };
            let Some(mut entry) = self.admit(&mut core, wr) else { continue };
            // Nothing waits ahead of it: start it straight from the caller's request.
            let started = if core.exec_next == core.sq.len() {
                self.start_with_retry(&mut core, wr, &inline, &mut out)
            } else {
                None
            };
            match started {
                Some(stage) => self.queue_started(&mut core, entry, stage, &mut out),
                None => {
                    // It must wait: keep a copy, with inline data copied out of the caller's
                    // buffer, which may be reused as soon as we return.
                    let inline = match inline {
                        Inline::Borrowed => Inline::Owned(inline_bytes(wr)),
                        other => other,
                    };
                    entry.waiting = Some(Box::new((wr.clone(), inline)));
                    core.sq.push_back(entry);
                }
            }
        }
        self.end_post(&mut core, &mut out);
        drop(core);
        result
    }

    /// A checked request's send-queue entry, counted; None when the queue pair is in error
    /// (then it is queued flushed, to be reported in order).
    fn admit(&self, core: &mut QpCore, wr: &SendWr) -> Option<SqEntry> {
        core.signaled_outstanding += wr.flags.signaled as usize;
        let mut entry = SqEntry {
            wr_id: wr.wr_id,
            opcode: wr.opcode,
            signaled: wr.flags.signaled,
            byte_len: if wr.opcode.is_atomic() { 8 } else { wr.byte_len() as u32 },
            stage: SqStage::Waiting,
            waiting: None,
        };
        if core.state == QpState::Error {
            entry.stage = SqStage::Done(WcStatus::WrFlushErr);
            core.sq.push_back(entry);
            core.exec_next = core.sq.len();
            return None;
        }
        Some(entry)
    }

    /// Queues a request that started (or finished) at post.
    fn queue_started(&self, core: &mut QpCore, mut entry: SqEntry, stage: SqStage, out: &mut Out) {
        entry.stage = stage;
        core.sq.push_back(entry);
        self.account_started(core, stage, out);
    }

    /// The end of a post: retires what finished, publishes the queue's state, reports.
    fn end_post(&self, core: &mut QpCore, out: &mut Out) {
        self.retire(core, out);
        self.publish_peek(core);
        self.deliver(out); // under the lock: per-QP completion order across threads
    }

    /// The polled message path's request: an inline RDMA write with nothing ahead of it in the
    /// send queue (empty, so no ring record of ours waits to be placed first). It is carried
    /// out now and reported at once (the general path would queue it, find it done and retire
    /// it at once). None, with nothing done: take the general path.
    #[inline]
    fn post_write_at_once(&self, core: &mut QpCore, wr: &SendWr) -> Option<Result<()>> {
        if wr.opcode != WrOpcode::RdmaWrite
            || !wr.flags.inline
            || !core.sq.is_empty()
            || core.state != QpState::ReadyToSend
        {
            return None;
        }
        if let Err(e) = self.check_send(core, wr) {
            return Some(Err(e));
        }
        let stage = self.run_one_sided(core, wr, &Inline::Borrowed);
        self.report_at_once(core, wr.wr_id, wr.byte_len() as u32, wr.flags.signaled, stage);
        Some(Ok(()))
    }

    /// One one-sided request (RDMA read or write, an atomic) carried out now if nothing is
    /// queued ahead of it; a success is reported only by the return value (no completion, as
    /// if unsignaled and known done), a failure as any failed request is (a completion, and
    /// the queue pair fails). Anything else takes [`QpInner::post_send`]'s path.
    pub fn post_send_completing(&self, wr: &SendWr) -> Result<Posted> {
        let one_sided = matches!(
            wr.opcode,
            WrOpcode::RdmaRead | WrOpcode::RdmaWrite | WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd
        );
        let mut core = self.core.lock();
        if !one_sided || !core.sq.is_empty() || core.state != QpState::ReadyToSend || core.tcp.is_some() {
            drop(core);
            return self.post_send(std::slice::from_ref(wr)).map(|()| Posted::Pending);
        }
        self.check_send(&core, wr)?;
        let inline = if wr.flags.inline && wr.opcode == WrOpcode::RdmaWrite { Inline::Borrowed } else { Inline::No };
        match self.run_one_sided(&core, wr, &inline) {
            SqStage::Done(WcStatus::Success) => Ok(Posted::Completed),
            stage => {
                let byte_len = if wr.opcode.is_atomic() { 8 } else { wr.byte_len() as u32 };
                self.fail_at_once(&mut core, wr.wr_id, wr.opcode, byte_len, stage);
                Ok(Posted::Pending)
            }
        }
    }

    /// Reports an RDMA write carried out at post time with an empty send queue, as retiring it
    /// would: a success only if `signaled` (straight to the completion queue: nothing is
    /// queued ahead of it); a failure always, and it fails the queue pair.
    fn report_at_once(&self, core: &mut QpCore, wr_id: u64, byte_len: u32, signaled: bool, stage: SqStage) {
        if stage != SqStage::Done(WcStatus::Success) {
            self.fail_at_once(core, wr_id, WrOpcode::RdmaWrite, byte_len, stage);
        } else if signaled {
            let opcode = WrOpcode::RdmaWrite.completion_opcode();
            let wc = WorkCompletion {
                wr_id,
                status: WcStatus::Success,
                opcode,
                byte_len,
                imm: None,
                qp_num: self.qpn,
                src_qp: 0,
            };
            // Under our lock: per-QP completion order across threads.
            self.send_cq.push(std::iter::once(wc));
        }
    }

    /// An RDMA write of `parts` put end to end, inline, carried out now if nothing is queued
    /// ahead of it: what [`QpInner::post_send`] would do with the same write over SGEs naming
    /// the parts, with no request to build and walk (the polled message path's frames), through
    /// the same checks as any one-sided request, and reported at once. None, with nothing done:
    /// post it as a request.
    #[inline]
    pub fn write_inline_list_at_once(
        &self,
        wr_id: u64,
        parts: &[&[u8]],
        remote_addr: u64,
        rkey: u32,
        signaled: bool,
    ) -> Option<Result<()>> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if len > self.caps.max_inline_data as usize {
            return Some(Err(VerbsError::invalid(format!(
                "{len} inline bytes over max_inline_data {}",
                self.caps.max_inline_data
            ))));
        }
        let mut core = self.core.lock();
        if !core.sq.is_empty() || core.state != QpState::ReadyToSend || core.tcp.is_some() {
            return None;
        }
        let stage = match self.remote_write_access(&core, rkey, remote_addr, len as u64) {
            Ok(None) => SqStage::Done(WcStatus::Success),
            // SAFETY: the parts are caller memory, valid during this call.
            Ok(Some(access)) => SqStage::Done(unsafe { access.write_parts(parts) }.err().unwrap_or(WcStatus::Success)),
            Err(st) => SqStage::Done(st),
        };
        self.report_at_once(&mut core, wr_id, len as u32, signaled, stage);
        Some(Ok(()))
    }

    /// A window onto `len` bytes at `remote_addr` of the connected peer's region `rkey`, for
    /// writes with plain stores (see [`super::peer::SoftWindow`]); None where the region is
    /// not in a provider segment. Checked as an RDMA write is: a refusal is an error.
    pub fn map_remote_write(&self, remote_addr: u64, len: u64, rkey: u32) -> Result<Option<super::peer::SoftWindow>> {
        let core = self.core.lock();
        if !matches!(core.state, QpState::ReadyToSend) {
            return Err(VerbsError::InvalidState(format!("mapping a peer's memory in {:?} (needs RTS)", core.state)));
        }
        if core.tcp.is_some() {
            return Ok(None); // the peer's memory is on another host
        }
        let refused = |st: WcStatus| {
            VerbsError::invalid(format!(
                "peer refused a window of {len} bytes at {remote_addr:#x} key {rkey:#x}: {st:?}"
            ))
        };
        let r = self.peer_grants(&core, AccessFlags::REMOTE_WRITE).map_err(refused)?;
        r.peer.window(rkey, remote_addr, len, r.info.pd, r.seg.clone()).map_err(refused)
    }

    /// Reports a request carried out at post time that failed (unsignaled or not) and fails
    /// the queue pair: the general path's bookkeeping, with the outcome already known.
    fn fail_at_once(&self, core: &mut QpCore, wr_id: u64, opcode: WrOpcode, byte_len: u32, stage: SqStage) {
        let mut out = Out::new();
        let entry = SqEntry { wr_id, opcode, signaled: false, byte_len, stage, waiting: None };
        self.queue_started(core, entry, stage, &mut out);
        self.end_post(core, &mut out);
    }

    fn check_send(&self, core: &QpCore, wr: &SendWr) -> Result<()> {
        match core.state {
            QpState::ReadyToSend | QpState::Error => {}
            s => return Err(VerbsError::InvalidState(format!("cannot post sends in {s:?}"))),
        }
        if core.sq.len() >= self.caps.max_send_wr as usize {
            return Err(VerbsError::Exhausted("send queue is full".into()));
        }
        if wr.sg_list.len() > self.caps.max_send_sge as usize {
            return Err(VerbsError::invalid(format!(
                "{} SGEs over max_send_sge {}",
                wr.sg_list.len(),
                self.caps.max_send_sge
            )));
        }
        let len = wr.byte_len();
        if len > wire::MAX_MESSAGE as u64 {
            return Err(VerbsError::invalid("message over 2 GiB"));
        }
        if wr.flags.inline
            && !wr.opcode.is_atomic()
            && wr.opcode != WrOpcode::RdmaRead
            && len > self.caps.max_inline_data as u64
        {
            return Err(VerbsError::invalid(format!(
                "{len} inline bytes over max_inline_data {}",
                self.caps.max_inline_data
            )));
        }
        if wr.opcode.is_atomic() && (wr.sg_list.len() != 1 || wr.sg_list[0].length != 8) {
            return Err(VerbsError::invalid("an atomic takes exactly one 8-byte SGE"));
        }
        Ok(())
    }

    /// Carries out waiting requests in order, as far as ring space and ordering allow.
    fn execute(&self, core: &mut QpCore, out: &mut Out) {
        while core.exec_next < core.sq.len() && core.state == QpState::ReadyToSend {
            let idx = core.exec_next;
            let Some(pending) = core.sq[idx].waiting.take() else {
                core.exec_next += 1; // already finished (flushed)
                continue;
            };
            match self.start_with_retry(core, &pending.0, &pending.1, out) {
                None => {
                    core.sq[idx].waiting = Some(pending);
                    return;
                }
                Some(stage) => {
                    core.sq[idx].stage = stage;
                    self.account_started(core, stage, out);
                }
            }
        }
    }

    /// Starts a request; if the ring is full or ordering holds it back, harvests what the peer
    /// consumed (only harvested space is reused: its status words are still to be read) and
    /// tries once more. None: it must wait.
    fn start_with_retry(&self, core: &mut QpCore, wr: &SendWr, inline: &Inline, out: &mut Out) -> Option<SqStage> {
        if let Some(stage) = self.start(core, wr, inline) {
            return Some(stage);
        }
        let before = (core.reaped, core.in_ring_data);
        if !self.reap(core, out) || (core.reaped, core.in_ring_data) == before {
            return None;
        }
        self.start(core, wr, inline)
    }

    /// Bookkeeping after the request at `exec_next` started.
    fn account_started(&self, core: &mut QpCore, stage: SqStage, out: &mut Out) {
        core.exec_next += 1;
        match stage {
            SqStage::InRing { target_placed, .. } => {
                core.in_ring += 1;
                core.in_ring_data += target_placed as usize;
            }
            SqStage::Done(st) if !st.is_success() => self.fail_sending(core, out),
            _ => {}
        }
    }

    /// Starts one request: places its ring record, or carries out a one-sided operation. None
    /// if it cannot start now (ring full, or ordering behind earlier records).
    fn start(&self, core: &mut QpCore, wr: &SendWr, inline: &Inline) -> Option<SqStage> {
        match wr.opcode {
            WrOpcode::Send | WrOpcode::SendWithImm => self.start_send(core, wr, inline),
            WrOpcode::RdmaWriteWithImm => {
                if core.in_ring_data > 0 && !self.wwi_is_ring_inline(core, wr) {
                    return None; // its data placement must follow earlier records
                }
                self.start_write_imm(core, wr, inline)
            }
            _ => {
                if core.in_ring_data > 0 {
                    return None; // one-sided requests follow earlier ring records
                }
                Some(self.run_one_sided(core, wr, inline))
            }
        }
    }

    /// True when a write-with-immediate goes through the ring with its data: small, and the
    /// target is user memory of another process (one record beats a cross-memory-attach call).
    /// Into memory we reach with plain stores (provider segments, same-process memory) the data
    /// is stored directly and only a notification goes through the ring: no copy left for the
    /// responder, and nothing for later one-sided requests to wait for.
    fn wwi_is_ring_inline(&self, core: &QpCore, wr: &SendWr) -> bool {
        let Some(r) = &core.remote else {
            return false;
        };
        wr.byte_len() as usize <= self.ctx.config.copy_threshold && !r.peer.stores_directly(wr.rkey)
    }

    /// Places a record in the peer's ring: `fill` writes the payload. Returns the stage, or
    /// None if the ring has no room now.
    fn place_record(
        &self,
        core: &mut QpCore,
        header: RecordHeader,
        fill: impl FnOnce(*mut u8) -> Result<(), WcStatus>,
    ) -> Option<SqStage> {
        let r = core.remote.as_ref()?;
        let ring = r.ring();
        let ring_bytes = r.ring_bytes;
        let size = header.record_size();
        if size > wire::max_record(ring_bytes) {
            return Some(SqStage::Done(WcStatus::LocQpOpErr));
        }
        let placement = wire::place(core.produced, core.reaped, ring_bytes, size)?;
        // `place` keeps the record inside the ring and clear of unconsumed bytes.
        if let Err(st) = fill(ring.payload(placement.at, &header)) {
            return Some(SqStage::Done(st));
        }
        ring.status(placement.at).store(status::OK, Ordering::Relaxed);
        ring.write_fields(placement.at, &header);
        let start = core.produced + (placement.advance - size) as u64;
        if let Some(pad_at) = placement.pad_at {
            let pad = RecordHeader {
                kind: RecordKind::Pad,
                flags: 0,
                sge_count: 0,
                len: (ring_bytes - pad_at) as u32,
                imm: 0,
                rkey: 0,
                raddr: 0,
            };
            ring.write_fields(pad_at, &pad);
            // Record first (at 0), then the pad that leads the consumer to it.
            ring.publish(placement.at).store(wire::publish_word(start), Ordering::Release);
            ring.publish(pad_at).store(wire::publish_word(core.produced), Ordering::Release);
        } else {
            ring.publish(placement.at).store(wire::publish_word(start), Ordering::Release);
        }
        core.produced += placement.advance as u64;
        r.peer.ring_bell(r.info.recv_cq_bell);
        let target_placed = header.kind != RecordKind::WriteImmNotify;
        Some(SqStage::InRing { start, end: core.produced, off: placement.at, target_placed })
    }

    fn start_send(&self, core: &mut QpCore, wr: &SendWr, inline: &Inline) -> Option<SqStage> {
        let len = wr.byte_len() as u32;
        let flags = if wr.opcode == WrOpcode::SendWithImm { wire::FLAG_IMM } else { 0 };
        let mut h =
            RecordHeader { kind: RecordKind::SendInline, flags, sge_count: 0, len, imm: wr.imm, rkey: 0, raddr: 0 };
        let is_inline = !matches!(inline, Inline::No);
        let keys = self.keys(core);
        if !is_inline && !keys.check_all(&wr.sg_list, AccessFlags::NONE, self.pd) {
            return Some(SqStage::Done(WcStatus::LocProtErr));
        }
        if is_inline || len as usize <= self.ctx.config.copy_threshold {
            return self.place_record(core, h, |dst| self.gather_into(&keys, dst, inline, &wr.sg_list));
        }
        let count = wr.sg_list.iter().filter(|s| s.length > 0).count();
        if count > wire::MAX_DESC {
            return Some(SqStage::Done(WcStatus::LocQpOpErr));
        }
        h.kind = RecordKind::SendDescriptors;
        h.sge_count = count as u16;
        self.place_record(core, h, |dst| {
            for (i, s) in wr.sg_list.iter().filter(|s| s.length > 0).enumerate() {
                let d = Descriptor { addr: s.addr, len: s.length, key: s.lkey }.encode();
                // SAFETY: `dst` has room for sge_count descriptors (the record was sized so).
                unsafe { std::ptr::copy_nonoverlapping(d.as_ptr(), dst.add(i * wire::DESC_BYTES), wire::DESC_BYTES) };
            }
            Ok(())
        })
    }

    /// Copies a request's data (inline bytes, or its checked local SGEs) to `dst`.
    fn gather_into(&self, keys: &LocalKeys, dst: *mut u8, inline: &Inline, sges: &[Sge]) -> Result<(), WcStatus> {
        let need = match inline {
            Inline::Owned(data) => {
                // SAFETY: `dst` has room for the whole message (the record was sized by its length).
                unsafe { crate::copy::copy_bytes(dst, data.as_ptr(), data.len()) };
                return Ok(());
            }
            Inline::Borrowed => None,
            Inline::No => Some(AccessFlags::NONE),
        };
        self.each_local_piece(keys, sges, need, |off, addr, len| {
            // SAFETY: the piece is a checked local registration, or inline caller memory valid
            // during post_send; `dst` has room for the sum of the SGE lengths.
            if unsafe { local_copy(dst.add(off), addr as *const u8, len) } {
                Ok(())
            } else {
                Err(WcStatus::LocProtErr)
            }
        })
    }

    /// Walks a local SGE list, calling `f(message_offset, address, length)` for each piece.
    /// With `need`, each piece is first checked against `keys` (which keeps it registered
    /// throughout); without, the SGEs are inline caller memory and are not looked up.
    fn each_local_piece(
        &self,
        keys: &LocalKeys,
        sges: &[Sge],
        need: Option<AccessFlags>,
        mut f: impl FnMut(usize, usize, usize) -> Result<(), WcStatus>,
    ) -> Result<(), WcStatus> {
        let mut off = 0usize;
        for s in sges {
            if let Some(need) = need {
                if !keys.check(s.lkey, s.addr, s.length as u64, need, self.pd) {
                    return Err(WcStatus::LocProtErr);
                }
            }
            f(off, s.addr as usize, s.length as usize)?;
            off += s.length as usize;
        }
        Ok(())
    }

    fn start_write_imm(&self, core: &mut QpCore, wr: &SendWr, inline: &Inline) -> Option<SqStage> {
        let len = wr.byte_len() as u32;
        let keys = self.keys(core);
        if matches!(inline, Inline::No) && !keys.check_all(&wr.sg_list, AccessFlags::NONE, self.pd) {
            return Some(SqStage::Done(WcStatus::LocProtErr));
        }
        let header = |kind| RecordHeader {
            kind,
            flags: wire::FLAG_IMM,
            sge_count: 0,
            len,
            imm: wr.imm,
            rkey: wr.rkey,
            raddr: wr.remote_addr,
        };
        if self.wwi_is_ring_inline(core, wr) {
            let h = header(RecordKind::WriteImmInline);
            return self.place_record(core, h, |dst| self.gather_into(&keys, dst, inline, &wr.sg_list));
        }
        // Room for the notification first, so the data is written exactly once.
        let r = core.remote.as_ref()?;
        let h = header(RecordKind::WriteImmNotify);
        wire::place(core.produced, core.reaped, r.ring_bytes, h.record_size())?;
        if let SqStage::Done(st) = self.run_one_sided(core, wr, inline) {
            if !st.is_success() {
                return Some(SqStage::Done(st));
            }
        }
        self.place_record(core, h, |_| Ok(()))
    }

    /// The responder's first checks of a one-sided request: a live peer queue pair that grants
    /// `need` remote rights. The peer's state and rights are read, not its key table.
    #[inline]
    fn peer_grants<'c>(&self, core: &'c QpCore, need: AccessFlags) -> Result<&'c Remote, WcStatus> {
        let Some(r) = &core.remote else {
            return Err(WcStatus::RetryExcErr);
        };
        if r.peer_qp_gone() {
            // No answer comes: the requester's retries run out.
            return Err(WcStatus::RetryExcErr);
        }
        let peer_qp_access = AccessFlags::from_bits_truncate(r.seg().header().access.load(Ordering::Relaxed));
        if !peer_qp_access.contains(need) {
            return Err(WcStatus::RemInvReqErr);
        }
        Ok(r)
    }

    /// The checked destination of an RDMA write of `len` bytes from inline data: None for a
    /// zero-byte write, which names no memory.
    #[inline]
    fn remote_write_access<'c>(
        &self,
        core: &'c QpCore,
        rkey: u32,
        remote_addr: u64,
        len: u64,
    ) -> Result<Option<super::peer::RemoteAccess<'c>>, WcStatus> {
        let r = self.peer_grants(core, AccessFlags::REMOTE_WRITE)?;
        if len == 0 {
            return Ok(None);
        }
        r.peer.access(rkey, remote_addr, len, AccessFlags::REMOTE_WRITE, r.info.pd).map(Some)
    }

    /// Carries out a one-sided request on the peer's memory; returns its final stage.
    fn run_one_sided(&self, core: &QpCore, wr: &SendWr, inline: &Inline) -> SqStage {
        let (need_remote, need_local) = match wr.opcode {
            WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm => (AccessFlags::REMOTE_WRITE, AccessFlags::NONE),
            WrOpcode::RdmaRead => (AccessFlags::REMOTE_READ, AccessFlags::LOCAL_WRITE),
            _ => (AccessFlags::REMOTE_ATOMIC, AccessFlags::LOCAL_WRITE),
        };
        let r = match self.peer_grants(core, need_remote) {
            Ok(r) => r,
            Err(st) => return SqStage::Done(st),
        };
        let keys = self.keys(core);
        if matches!(inline, Inline::No) && !keys.check_all(&wr.sg_list, need_local, self.pd) {
            return SqStage::Done(WcStatus::LocProtErr);
        }
        let len = wr.byte_len();
        if wr.opcode.is_atomic() && !wr.remote_addr.is_multiple_of(8) {
            return SqStage::Done(WcStatus::RemInvReqErr);
        }
        if len == 0 && !wr.opcode.is_atomic() {
            // A zero-byte read or write names no memory: the responder checks neither key nor
            // address (IBA C9-88), which makes it a keep-alive or a completion fence.
            return SqStage::Done(WcStatus::Success);
        }
        let access = match r.peer.access(wr.rkey, wr.remote_addr, len, need_remote, r.info.pd) {
            Ok(a) => a,
            Err(st) => return SqStage::Done(st),
        };
        let result = match wr.opcode {
            WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm => match inline {
                // SAFETY: inline bytes are ours.
                Inline::Owned(d) => unsafe { access.write_from(0, d.as_ptr(), d.len(), false) },
                // SAFETY (both arms): the pieces are checked local registrations, or inline SGEs
                // naming caller memory valid during post_send.
                Inline::Borrowed => self.each_local_piece(&keys, &wr.sg_list, None, |off, addr, len| unsafe {
                    access.write_from(off, addr as *const u8, len, false)
                }),
                Inline::No => {
                    self.each_local_piece(&keys, &wr.sg_list, Some(AccessFlags::NONE), |off, addr, len| unsafe {
                        access.write_from(off, addr as *const u8, len, wr.flags.streaming)
                    })
                }
            },
            WrOpcode::RdmaRead => {
                let one_piece = wr.sg_list.len() == 1;
                self.each_local_piece(&keys, &wr.sg_list, Some(AccessFlags::LOCAL_WRITE), |off, addr, len| {
                    let dst = addr as *mut u8;
                    // SAFETY (both): the piece is a checked local registration with LOCAL_WRITE.
                    let shared = one_piece
                        .then(|| unsafe { self.pull_shared(r, &access, dst, len, wr.rkey, need_remote) })
                        .flatten();
                    shared.unwrap_or_else(|| unsafe { access.read_into(off, dst, len) })
                })
            }
            WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => {
                let (cmp_add, swap, cas) = (wr.compare_add, wr.swap, wr.opcode == WrOpcode::AtomicCmpAndSwp);
                access
                    .atomic(|old| {
                        if cas {
                            if old == cmp_add {
                                swap
                            } else {
                                old
                            }
                        } else {
                            old.wrapping_add(cmp_add)
                        }
                    })
                    .and_then(|old| {
                        let s = wr.sg_list[0];
                        let bytes = old.to_ne_bytes();
                        let writable = keys.check(s.lkey, s.addr, 8, AccessFlags::LOCAL_WRITE, self.pd);
                        // SAFETY: checked local registration of 8 writable bytes.
                        let copied = writable && unsafe { local_copy(s.addr as usize as *mut u8, bytes.as_ptr(), 8) };
                        copied.then_some(()).ok_or(WcStatus::LocProtErr)
                    })
            }
            _ => Err(WcStatus::GeneralErr),
        };
        SqStage::Done(match result {
            Ok(()) => WcStatus::Success,
            Err(st) => st,
        })
    }

    /// True if a pull of `len` bytes by cross-memory attach (a read, or a large send's data) is
    /// worth sharing with the peer.
    fn worth_sharing(&self, len: usize) -> bool {
        let min = self.ctx.config.assist_min;
        min > 0 && len >= min
    }

    /// Pulls the whole `len` bytes of `access` (registered in the peer under `key` with `need`)
    /// into `dst`, offering the back half to the peer (see `assist`): the peer's polling thread
    /// pushes it while we copy the front half, or we copy it too. None (nothing copied) if the
    /// range is not in another process's user memory or too short to be worth sharing.
    ///
    /// # Safety
    /// `dst` must be valid for writes of `len` bytes (a checked local registration).
    unsafe fn pull_shared(
        &self,
        r: &Remote,
        access: &super::peer::RemoteAccess<'_>,
        dst: *mut u8,
        len: usize,
        key: u32,
        need: AccessFlags,
    ) -> Option<Result<(), WcStatus>> {
        let src = access.cross_process_addr().filter(|_| self.worth_sharing(len) && len == access.len())?;
        // Jobs of one queue pair are sequential (its lock), so a plain load and store do (a
        // lost update would only lose one job's lesson).
        let share = self.copier_share.load(Ordering::Relaxed);
        let split = assist::split_point(len as u64, share);
        let job = assist::Job { src, dst: dst as u64, len: len as u64, split, key, need: need.bits() };
        let id = self.assist_jobs.fetch_add(1, Ordering::Relaxed) + 1;
        let offer = assist::open(r.seg().assist(), id, &job);
        let split = split as usize;
        let started = Instant::now();
        // SAFETY: the front part of the caller's range.
        let front = unsafe { access.read_into(0, dst, split) };
        let front_took = started.elapsed();
        // Settled whatever the front's outcome: no helper write may land after we return.
        let back = offer.settle(ASSIST_TIMEOUT, || r.peer.alive());
        if let (Ok(()), Ok((Back::Helper, waited))) = (&front, &back) {
            self.copier_share.store(assist::next_share(share, front_took, *waited), Ordering::Relaxed);
        }
        Some(front.and_then(|()| match back.map(|(b, _)| b) {
            Ok(Back::Helper) => Ok(()),
            // SAFETY: the back part of the caller's range.
            Ok(Back::Copier | Back::HelperFailed) => unsafe { access.read_into(split, dst.add(split), len - split) },
            Err(Stuck::HelperGone | Stuck::TimedOut) => Err(WcStatus::RetryExcErr),
            Err(Stuck::Corrupt) => Err(WcStatus::RemOpErr),
        }))
    }

    /// Pushes the back half of a shared copy our peer offers now, if it offers one (one load
    /// of the assist line when it does not).
    #[inline]
    pub(crate) fn help_peer(&self) {
        if let Some(taken) = assist::try_take(QpSeg(&self.seg).assist()) {
            self.help(taken);
        }
    }

    /// Pushes the back half of a copy our peer offered (see `assist`), if it names memory we
    /// registered for it; reports the outcome on the line either way.
    fn help(&self, taken: assist::Taken<'_>) {
        let peer = self.helper_peer.lock().expect("helper peer lock").clone();
        let job = taken.job;
        let (off, len) = job.back();
        // Never waits for a deregistration (we hold no queue-pair lock here): it may itself wait
        // for the copier's access to end, which waits for us. The copier then copies the half
        // itself.
        let keys = self.ctx.try_local_keys();
        let ok = peer.zip(keys).is_some_and(|(p, keys)| {
            let need = AccessFlags::from_bits_truncate(job.need);
            let src = job.src.checked_add(off);
            let fits = src.is_some_and(|src| keys.check(job.key, src, len, need, self.pd));
            // SAFETY: the source range was checked against our registration of it, which `keys`
            // keeps registered until the copy is done.
            fits && unsafe { p.push(job.dst.wrapping_add(off), (job.src + off) as usize as *const u8, len as usize) }
                .is_ok()
        });
        taken.finish(ok);
    }

    /// Reports finished requests in order: errors always, successes when signaled.
    fn retire(&self, core: &mut QpCore, out: &mut Out) {
        while let Some(front) = core.sq.front() {
            let SqStage::Done(st) = front.stage else {
                break;
            };
            if !st.is_success() || front.signaled {
                out.push((
                    true,
                    WorkCompletion {
                        wr_id: front.wr_id,
                        status: st,
                        opcode: front.opcode.completion_opcode(),
                        byte_len: front.byte_len,
                        imm: None,
                        qp_num: self.qpn,
                        src_qp: 0,
                    },
                ));
            }
            let signaled = front.signaled;
            core.sq.pop_front();
            core.signaled_outstanding -= signaled as usize;
            core.exec_next = core.exec_next.saturating_sub(1);
        }
    }

    /// Requester side: learn which records the peer consumed, detect receiver-not-ready and a
    /// dead peer, run what was waiting.
    fn progress_outbound(&self, core: &mut QpCore, out: &mut Out) {
        if self.reap(core, out) {
            self.execute(core, out);
        }
        self.retire(core, out);
    }

    /// Turns the records the peer consumed into finished requests and watches the head record
    /// for receiver-not-ready. Returns false if the QP went to error.
    fn reap(&self, core: &mut QpCore, out: &mut Out) -> bool {
        if core.in_ring > 0 {
            let Some(r) = &core.remote else { return true };
            if let Some(target) = r.local.as_ref().and_then(std::sync::Weak::upgrade) {
                // Same process: do the responder's work now rather than wait for its thread.
                target.drive_inbound();
            }
            let consumed = r.seg().consumer().consumed.load(Ordering::Acquire);
            core.reaped = consumed;
            let ring = r.ring();
            let mut error = None;
            for e in core.sq.iter_mut() {
                let SqStage::InRing { start, end, off, target_placed } = e.stage else {
                    if matches!(e.stage, SqStage::Waiting) {
                        break;
                    }
                    continue;
                };
                if end > consumed {
                    // Not consumed: receiver-not-ready if it heads the ring and no receive waits.
                    core.head_waits = core.head_waits.wrapping_add(1);
                    let probe = core.head_waits.is_multiple_of(64);
                    let taken = r.seg().consumer().taking.load(Ordering::Acquire) > start;
                    if probe && start == consumed && !taken {
                        let rq = r.peer.ctrl().rq(r.info.rq_slot as usize).expect("validated at connect");
                        let empty = rq.posted.load(Ordering::Acquire) <= rq.consumed.load(Ordering::Acquire);
                        if empty {
                            let timer =
                                rnr_timer_duration(r.seg().header().min_rnr_timer.load(Ordering::Relaxed) as u8);
                            let now = Instant::now();
                            let t = core.rnr.get_or_insert(RnrTrack { start, naks: 0, last: now });
                            if t.start != start {
                                *t = RnrTrack { start, naks: 0, last: now };
                            }
                            if now.duration_since(t.last) >= timer {
                                t.naks += 1;
                                t.last = now;
                            }
                            if core.rts.rnr_retry != 7 && t.naks > core.rts.rnr_retry as u32 && cancel_from(r, start) {
                                e.stage = SqStage::Done(WcStatus::RnrRetryExcErr);
                                error = Some(());
                            }
                        }
                    }
                    break;
                }
                let st = status_of(ring.status(off).load(Ordering::Acquire));
                e.stage = SqStage::Done(st);
                core.in_ring -= 1;
                core.in_ring_data -= target_placed as usize;
                if !st.is_success() {
                    error = Some(());
                    break;
                }
            }
            if error.is_some() {
                self.fail_sending(core, out);
                return false;
            }
        }
        true
    }

    /// Responder side: consume records from our ring into posted receives.
    fn progress_inbound(&self, core: &mut QpCore, out: &mut Out) {
        if !matches!(core.state, QpState::ReadyToReceive | QpState::ReadyToSend) || core.inbound_dead {
            return;
        }
        let ring = self.ring();
        let mut consumed_any = false;
        for _ in 0..64 {
            let off = wire::ring_offset(core.cons_head, self.ring_bytes);
            // `off` is a record boundary: we only ever advance by validated record sizes.
            if ring.publish(off).load(Ordering::Acquire) != wire::publish_word(core.cons_head) {
                break;
            }
            let fields = ring.read_fields(off);
            let h = match RecordHeader::decode(&fields, off, self.ring_bytes) {
                Ok(h) => h,
                Err(e) => {
                    log::error!("QP {}: malformed record from the peer: {e}; moving to error", self.qpn);
                    self.enter_error(core, out);
                    return;
                }
            };
            if h.kind == RecordKind::Pad {
                core.cons_head += h.len as u64;
                consumed_any = true;
                continue;
            }
            // The receive to fill: looked at in place (it leaves the queue only once used); one
            // of a shared receive queue is taken out, and put back if unused.
            let mut from_srq = None;
            let recv = match &self.srq {
                None => core.rq.front(),
                Some(s) => {
                    from_srq = s.queue.lock().expect("srq lock").pop_front();
                    from_srq.as_ref()
                }
            };
            let Some(recv) = recv else {
                break; // receiver not ready
            };
            // Cancel handshake, hot half: announce the take, then look for a cancel. The
            // producer's half (`cancel_from`) stores the cancel, runs a membarrier, then reads
            // `taking`: one of the two sides always sees the other.
            let consumer = QpSeg(&self.seg).consumer();
            consumer.taking.store(core.cons_head + 1, Ordering::Relaxed);
            sys::producer_barrier();
            let cancel = self.header().cancel_from.load(Ordering::Acquire);
            if cancel != 0 && cancel - 1 <= core.cons_head {
                consumer.taking.store(core.cons_head, Ordering::Relaxed);
                self.put_back_receive(from_srq);
                core.inbound_dead = true;
                break;
            }
            // The decoder checked that the record lies inside the ring.
            let payload = ring.payload(off, &h);
            let (result, keep_receive) = self.deliver_record(core, &h, payload, recv);
            let src_qp = core.remote.as_ref().map(|r| r.info.qpn).unwrap_or(0);
            let imm = (h.flags & wire::FLAG_IMM != 0).then_some(h.imm);
            let opcode = if matches!(h.kind, RecordKind::WriteImmInline | RecordKind::WriteImmNotify) {
                WcOpcode::RecvRdmaWithImm
            } else {
                WcOpcode::Recv
            };
            let (code, local_status) = match result {
                Ok(()) => (status::OK, WcStatus::Success),
                Err(code) => {
                    ring.status(off).store(code, Ordering::Release);
                    (code, if code == status::REM_INV_REQ { WcStatus::LocLenErr } else { WcStatus::LocProtErr })
                }
            };
            if keep_receive {
                self.put_back_receive(from_srq);
            } else {
                let wr_id = recv.wr_id;
                if self.srq.is_none() {
                    core.rq.pop_front();
                }
                self.count_consumed(1);
                out.push((false, self.recv_wc(wr_id, local_status, opcode, h.len, imm, src_qp)));
            }
            core.cons_head += h.record_size() as u64;
            consumed_any = true;
            if keep_receive {
                continue;
            }
            if code != status::OK {
                QpSeg(&self.seg).consumer().consumed.store(core.cons_head, Ordering::Release);
                self.enter_error(core, out);
                return;
            }
        }
        if consumed_any {
            QpSeg(&self.seg).consumer().consumed.store(core.cons_head, Ordering::Release);
            if let Some(r) = &core.remote {
                r.peer.ring_bell(r.info.send_cq_bell);
            }
        }
    }

    /// Leaves an unused receive at the head of its queue: our own queue's is still there; one
    /// `taken` from the shared queue goes back to its front.
    fn put_back_receive(&self, taken: Option<RecvWr>) {
        if let (Some(s), Some(wr)) = (&self.srq, taken) {
            s.queue.lock().expect("srq lock").push_front(wr);
        }
    }

    /// Carries out one claimed record. Returns the record status code (Err for failures) and
    /// whether the receive goes back unused (the requester could not supply its data).
    fn deliver_record(
        &self,
        core: &QpCore,
        h: &RecordHeader,
        payload: *const u8,
        recv: &RecvWr,
    ) -> (Result<(), u32>, bool) {
        let keys = self.keys(core);
        match h.kind {
            RecordKind::SendInline => {
                if h.len as u64 > recv.capacity() {
                    return (Err(status::REM_INV_REQ), false);
                }
                (
                    self.scatter(&keys, recv, h.len as usize, |dst, off, n| {
                        // SAFETY: `off + n <= len` and the payload holds `len` bytes inside the ring.
                        if unsafe { local_copy(dst, payload.add(off), n) } {
                            Ok(())
                        } else {
                            Err(status::REM_ACCESS)
                        }
                    }),
                    false,
                )
            }
            RecordKind::SendDescriptors => {
                if h.len as u64 > recv.capacity() {
                    return (Err(status::REM_INV_REQ), false);
                }
                let mut raw = [0u8; wire::MAX_DESC * wire::DESC_BYTES];
                let n = h.payload_len();
                // SAFETY: the payload holds `n` descriptor bytes inside the ring.
                unsafe { std::ptr::copy_nonoverlapping(payload, raw.as_mut_ptr(), n) };
                let descs = match wire::decode_descriptors(&raw[..n], h.len) {
                    Ok(d) => d,
                    Err(_) => return (Err(status::REM_INV_REQ), false),
                };
                let Some(r) = &core.remote else {
                    return (Err(status::REM_OP), true);
                };
                let res = self.pull_descriptors(&keys, r, &descs, recv);
                match res {
                    Ok(()) => (Ok(()), false),
                    // The requester's own memory failed it: its local protection error; our
                    // receive was not consumed.
                    Err(_) => (Err(status::REM_OP), true),
                }
            }
            RecordKind::WriteImmInline => {
                if !core.access.contains(AccessFlags::REMOTE_WRITE) {
                    return (Err(status::REM_ACCESS), false);
                }
                if h.len == 0 {
                    return (Ok(()), false); // names no memory: no key to check (IBA C9-88)
                }
                if !keys.remote(h.rkey, h.raddr, h.len as u64, AccessFlags::REMOTE_WRITE, self.pd) {
                    return (Err(status::REM_ACCESS), false);
                }
                // SAFETY: the destination is a live registration with remote write (checked
                // against `keys`); the payload holds `len` bytes inside the ring.
                let placed = unsafe { local_copy(h.raddr as usize as *mut u8, payload, h.len as usize) };
                (placed.then_some(()).ok_or(status::REM_ACCESS), false)
            }
            RecordKind::WriteImmNotify => (Ok(()), false),
            RecordKind::Pad => (Ok(()), true),
        }
    }

    /// Copies the requester's descriptors into our receive SGEs, one copy.
    fn pull_descriptors(&self, keys: &LocalKeys, r: &Remote, descs: &[Descriptor], recv: &RecvWr) -> Result<(), u32> {
        let total: usize = descs.iter().map(|d| d.len as usize).sum();
        // Walk source and destination lists together.
        let mut si = 0usize;
        let mut s_off = 0usize;
        let mut accesses = Vec::with_capacity(descs.len());
        for d in descs {
            let a =
                r.peer.access(d.key, d.addr, d.len as u64, AccessFlags::NONE, r.info.pd).map_err(|_| status::REM_OP)?;
            accesses.push(a);
        }
        self.scatter(keys, recv, total, |dst, _off, mut n| {
            if let ([d], [a]) = (descs, &accesses[..]) {
                // SAFETY: `dst` is a checked receive SGE with room for `n` bytes (all of `a`'s
                // range, or `pull_shared` declines).
                if let Some(done) = unsafe { self.pull_shared(r, a, dst, n, d.key, AccessFlags::NONE) } {
                    return done.map_err(|_| status::REM_OP);
                }
            }
            let mut dst = dst;
            while n > 0 {
                let a = &accesses[si];
                let take = (a.len() - s_off).min(n);
                // SAFETY: `dst` is inside a checked receive SGE with room for `n` bytes.
                unsafe { a.read_into(s_off, dst, take) }.map_err(|_| status::REM_OP)?;
                // SAFETY: advancing within the same checked SGE.
                dst = unsafe { dst.add(take) };
                n -= take;
                s_off += take;
                if s_off == a.len() {
                    si += 1;
                    s_off = 0;
                }
            }
            Ok(())
        })
    }

    /// Scatters `len` bytes into a receive's SGEs: `copy(dst, message_offset, n)` fills each piece.
    fn scatter(
        &self,
        keys: &LocalKeys,
        recv: &RecvWr,
        len: usize,
        mut copy: impl FnMut(*mut u8, usize, usize) -> Result<(), u32>,
    ) -> Result<(), u32> {
        let mut off = 0usize;
        for s in &recv.sg_list {
            if off == len {
                break;
            }
            let n = (s.length as usize).min(len - off);
            if !keys.check(s.lkey, s.addr, n as u64, AccessFlags::LOCAL_WRITE, self.pd) {
                return Err(status::REM_OP);
            }
            copy(s.addr as usize as *mut u8, off, n)?;
            off += n;
        }
        Ok(())
    }

    /// Checks peer liveness and the peer QP's state; fails the connection if it is gone.
    fn check_peer(&self, core: &mut QpCore, out: &mut Out) {
        let Some(r) = &core.remote else { return };
        let peer_qp_gone = r.peer_qp_gone();
        let peer_alive = r.peer.alive();
        let peer_qpn = r.info.qpn;
        if peer_qp_gone || !peer_alive {
            // What the peer sent before it went, and what it consumed of ours, still counts.
            self.progress_inbound(core, out);
            if !self.reap(core, out) {
                return;
            }
            self.retire(core, out);
        }
        let outstanding = core.sq.iter().any(|e| !matches!(e.stage, SqStage::Done(_)));
        // A dead process fails the connection at once. A live peer whose QP broke is noticed
        // only by a request that needs it, as a real responder would (transport retries run out).
        let gone = !peer_alive || (peer_qp_gone && outstanding);
        if gone && core.state != QpState::Error {
            log::debug!("QP {}: peer QP {peer_qpn} is gone; moving to error", self.qpn);
            // The oldest outstanding request timed out; the rest are flushed.
            if let Some(e) = core.sq.iter_mut().find(|e| !matches!(e.stage, SqStage::Done(_))) {
                e.stage = SqStage::Done(WcStatus::RetryExcErr);
            }
            self.enter_error(core, out);
        }
    }

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
    fn hand_out(&self, cq: &CqInner, sink: &mut Out, out: &Out) {
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

    /// Whether a periodic pass should reap. With only unsignaled requests in flight nobody
    /// waits for their completions: reaping them reads the peer's consumed count, a line the
    /// peer writes on every message, and doing that on every periodic pass (about once per
    /// message in a ping-pong) costs a cache miss here and makes the peer's next write of it
    /// wait for the line to come back. They are still retired on every `PERIODIC_REAP_EVERY`th
    /// pass (which also probes for receiver-not-ready and errors), when the queue is half
    /// full, and when a request needs ring space or a queue slot.
    fn periodic_reap_due(&self, core: &mut QpCore) -> bool {
        if core.in_ring == 0 {
            return false;
        }
        core.quiet_passes += 1;
        if core.quiet_passes >= PERIODIC_REAP_EVERY || core.sq.len() * 2 >= self.caps.max_send_wr as usize {
            core.quiet_passes = 0;
            // Rare enough to probe receiver-not-ready on every one.
            core.head_waits = u32::MAX;
            return true;
        }
        false
    }

    /// Publishes the lock-free hints from the locked state. On every post and progress pass:
    /// inlined, with the rare hand-over to the backstop out of line.
    fn publish_peek(&self, core: &QpCore) {
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
    fn hand_to_backstop(&self) {
        if !self.backstop_watched.swap(true, Ordering::Relaxed) {
            match local_qp(self.ctx.id, self.qpn) {
                Some(me) => super::backstop::watch(me),
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

    /// Runs the responder side if no other thread is on this queue pair.
    fn drive_inbound(&self) {
        let Some(mut core) = self.core.try_lock() else {
            return;
        };
        let mut out = Out::new();
        self.progress_inbound(&mut core, &mut out);
        self.publish_peek(&core);
        self.deliver(&out); // under the lock: per-QP completion order across threads
        drop(core);
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

    /// Makes the peer's death wake sleepers of both queues (`on`), or stops it. A peer in this
    /// process has no pidfd to watch: it cannot die while we run.
    fn watch_peer(&self, peer: &PeerCtx, on: bool) {
        if let Some(pidfd) = peer.pidfd() {
            for cq in [&self.send_cq, &self.recv_cq] {
                if on {
                    cq.watch(pidfd)
                } else {
                    cq.unwatch(pidfd)
                }
            }
        }
    }

    /// Marks the QP destroyed for its peer and detaches it from its queues, which hold it until
    /// then (the public queue pair calls this when its last clone drops).
    pub fn destroy(&self) {
        *self.helper_peer.lock().expect("helper peer lock") = None;
        let mut core = self.core.lock();
        self.header().state.store(QP_DESTROYED, Ordering::Release);
        self.tcp_close(&mut core);
        if let Some(r) = core.remote.take() {
            self.watch_peer(&r.peer, false);
        }
        core.state = QpState::Error;
        self.send_cq.detach(self);
        self.recv_cq.detach(self);
    }
}

impl Drop for QpInner {
    fn drop(&mut self) {
        local_qps().lock().expect("local qp registry").remove(&(self.ctx.id, self.qpn));
        if self.srq.is_none() {
            self.ctx.rq_slots.lock().expect("slot lock").give(self.rq_slot);
        }
    }
}

/// Adds `n` to a shared counter that only the caller writes (others only read it): a load and
/// a release store, where `fetch_add` would be a locked instruction.
fn add_as_only_writer(c: &AtomicU64, n: u64) {
    c.store(c.load(Ordering::Relaxed) + n, Ordering::Release);
}

/// Cancel handshake, rare half: cancels the peer's records from ring position `pos` on.
/// Returns true if the record at `pos` was not taken (so it never will be); false if the
/// consumer had already taken it (it will complete normally).
fn cancel_from(r: &Remote, pos: u64) -> bool {
    let cancel = &r.seg().header().cancel_from;
    if cancel.load(Ordering::Relaxed) == 0 {
        cancel.store(pos + 1, Ordering::Relaxed);
    }
    sys::sleeper_barrier();
    r.seg().consumer().taking.load(Ordering::Acquire) <= pos
}

/// Copies an inline request's data out of the caller's buffers.
fn inline_bytes(wr: &SendWr) -> Vec<u8> {
    let mut v = Vec::with_capacity(wr.byte_len() as usize);
    for s in &wr.sg_list {
        // SAFETY: inline SGEs name caller memory valid for the duration of post_send, during
        // which this runs.
        v.extend_from_slice(unsafe { std::slice::from_raw_parts(s.addr as usize as *const u8, s.length as usize) });
    }
    v
}

/// A ring mapped in this process, with bounds-checked access to its record words.
#[derive(Clone, Copy)]
struct RingView {
    base: *mut u8,
    bytes: usize,
}

impl RingView {
    fn check(&self, off: usize) {
        assert!(
            off.is_multiple_of(wire::RECORD_ALIGN) && off + wire::RECORD_ALIGN <= self.bytes,
            "record offset outside the ring"
        );
    }
    /// The publish word of the record at `off`.
    fn publish(&self, off: usize) -> &AtomicU64 {
        self.check(off);
        // SAFETY: in bounds (checked), 8-byte aligned (the ring is page-aligned plus a multiple of
        // 64 bytes), in a mapping that outlives the view's users; any bits are a valid AtomicU64.
        unsafe { &*(self.base.add(off) as *const AtomicU64) }
    }
    /// The status word of the record at `off`.
    fn status(&self, off: usize) -> &AtomicU32 {
        self.check(off);
        // SAFETY: as for `publish`, 4 bytes at a 4-aligned offset inside the header.
        unsafe { &*(self.base.add(off + wire::STATUS_OFFSET) as *const AtomicU32) }
    }
    /// Writes the decoded fields of a header (from byte 8 of a record; a send's stop before
    /// its status word and payload).
    fn write_fields(&self, off: usize, h: &RecordHeader) {
        self.check(off);
        let b = h.encode();
        // SAFETY: at most 32 bytes at off+8, inside the record's first line, which is inside
        // the ring (checked above).
        unsafe { crate::copy::copy_bytes(self.base.add(off + 8), b.as_ptr(), h.fields_len()) };
    }
    /// Copies the decoded fields of the header at `off`.
    fn read_fields(&self, off: usize) -> [u8; FIELDS_BYTES] {
        self.check(off);
        let mut b = [0u8; FIELDS_BYTES];
        // SAFETY: as in `write_fields`.
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(off + 8), b.as_mut_ptr(), FIELDS_BYTES) };
        b
    }
    /// Pointer to the payload of the record with header `h` at `off`.
    fn payload(&self, off: usize, h: &RecordHeader) -> *mut u8 {
        assert!(off + h.record_size() <= self.bytes, "record outside the ring");
        self.base.wrapping_add(off + h.header_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connected pair on one completion queue. Dropping it destroys both queue pairs, as
    /// the public `QueuePair` does: the queue holds them until then.
    struct Pair {
        cq: Arc<CqInner>,
        a: Arc<QpInner>,
        b: Arc<QpInner>,
    }

    impl Drop for Pair {
        fn drop(&mut self) {
            self.a.destroy();
            self.b.destroy();
        }
    }

    fn connected() -> Pair {
        connected_with_srq(false)
    }

    /// A connected pair; `b` takes its receives from a shared receive queue if `srq`.
    fn connected_with_srq(srq: bool) -> Pair {
        let ctx = CtxInner::open(super::super::SoftConfig::default()).unwrap();
        let cq = CqInner::new(&ctx, 64).unwrap();
        let shared = srq.then(|| SrqInner::new(&ctx, 1, 16, 1).unwrap());
        let a = QpInner::new(&ctx, 1, &cq, &cq, None, QpCaps::default()).unwrap();
        let b = QpInner::new(&ctx, 1, &cq, &cq, shared.as_ref(), QpCaps::default()).unwrap();
        for (q, p) in [(&a, &b), (&b, &a)] {
            q.modify(QpTransition::Init { access: AccessFlags::ALL, port: 1 }).unwrap();
            q.modify(QpTransition::Rtr(RtrAttr::new(EndpointInfo::Soft(p.endpoint())))).unwrap();
            q.modify(QpTransition::Rts(RtsAttr::default())).unwrap();
        }
        Pair { cq, a, b }
    }

    #[test]
    fn destroyed_queue_pairs_are_freed_though_their_completion_queue_lives_on() {
        let p = connected();
        let cq = p.cq.clone();
        let (a, b) = (Arc::downgrade(&p.a), Arc::downgrade(&p.b));
        drop(p);
        assert!(a.upgrade().is_none() && b.upgrade().is_none(), "the completion queue kept them");
        let mut wc = [WorkCompletion::EMPTY; 4];
        assert_eq!(cq.poll(&mut wc).unwrap(), 0, "the queue still polls without them");
    }

    /// Writes a raw record into `qp`'s inbound ring at offset 0 as its peer would, with
    /// arbitrary field bytes, published for ring position `pos`.
    fn scribble_at(qp: &QpInner, fields: [u8; FIELDS_BYTES], pos: u64, payload: &[u8]) {
        let ring = qp.ring();
        // SAFETY: test-only raw writes inside our own ring.
        unsafe {
            std::ptr::copy_nonoverlapping(fields.as_ptr(), ring.base.add(8), FIELDS_BYTES);
            std::ptr::copy_nonoverlapping(payload.as_ptr(), ring.base.add(wire::HEADER_BYTES), payload.len());
        }
        ring.publish(0).store(wire::publish_word(pos), Ordering::Release);
    }

    fn scribble(qp: &QpInner, fields: [u8; FIELDS_BYTES], payload: &[u8]) {
        scribble_at(qp, fields, 0, payload)
    }

    fn poll_until_error(cq: &CqInner, qp: &QpInner) {
        let mut wc = [WorkCompletion::EMPTY; 8];
        for _ in 0..100 {
            let _ = cq.poll(&mut wc);
            if qp.state() == QpState::Error {
                return;
            }
        }
        panic!("garbage did not move the QP to error");
    }

    fn header(kind: RecordKind, len: u32, sge_count: u16) -> [u8; FIELDS_BYTES] {
        RecordHeader { kind, flags: 0, sge_count, len, imm: 0, rkey: 0, raddr: 0 }.encode()
    }

    #[test]
    fn unknown_record_kind_fails_the_connection() {
        let p = connected();
        let (cq, b) = (p.cq.clone(), p.b.clone());
        let mut f = [0u8; FIELDS_BYTES];
        f[0] = 0x7f;
        scribble(&b, f, &[]);
        poll_until_error(&cq, &b);
    }

    #[test]
    fn record_longer_than_the_ring_fails_the_connection() {
        let p = connected();
        let (cq, b) = (p.cq.clone(), p.b.clone());
        b.post_recv(&[RecvWr::new(1, &[])]).unwrap();
        scribble(&b, header(RecordKind::SendInline, 1 << 30, 0), &[]);
        poll_until_error(&cq, &b);
    }

    #[test]
    fn a_record_published_for_another_lap_is_never_consumed() {
        let p = connected();
        let (cq, b) = (p.cq.clone(), p.b.clone());
        b.post_recv(&[RecvWr::new(1, &[])]).unwrap();
        scribble_at(&b, header(RecordKind::SendInline, 0, 0), b.ring_bytes as u64, &[]);
        let mut wc = [WorkCompletion::EMPTY; 8];
        for _ in 0..10 {
            assert_eq!(cq.poll(&mut wc).unwrap(), 0);
        }
        assert_eq!(b.state(), QpState::ReadyToSend);
    }

    #[test]
    fn descriptors_that_do_not_add_up_are_an_invalid_request() {
        let p = connected();
        let (cq, b) = (p.cq.clone(), p.b.clone());
        let mut buf = vec![0u8; 64];
        let d = Descriptor { addr: buf.as_mut_ptr() as u64, len: 64, key: 0x101 }.encode();
        b.post_recv(&[RecvWr::new(1, &[])]).unwrap();
        scribble(&b, header(RecordKind::SendDescriptors, 1000, 1), &d);
        poll_until_error(&cq, &b);
        assert_eq!(b.ring().status(0).load(Ordering::Acquire), status::REM_INV_REQ);
    }

    #[test]
    fn descriptors_naming_unregistered_memory_are_refused_without_touching_it() {
        for srq in [false, true] {
            let p = connected_with_srq(srq);
            let (cq, b) = (p.cq.clone(), p.b.clone());
            let d = Descriptor { addr: 0x1000, len: 64, key: 0x4242 }.encode();
            let buf = [0u8; 64];
            let key = b.ctx.register(buf.as_ptr() as u64, 64, AccessFlags::ALL, 1, None).unwrap();
            let recv = [RecvWr::new(7, &[Sge { addr: buf.as_ptr() as u64, length: 64, lkey: key }])];
            match &b.srq {
                Some(s) => s.post_recv(&recv).unwrap(),
                None => b.post_recv(&recv).unwrap(),
            }
            scribble(&b, header(RecordKind::SendDescriptors, 64, 1), &d);
            let mut wc = [WorkCompletion::EMPTY; 8];
            for _ in 0..10 {
                let _ = cq.poll(&mut wc);
            }
            // The requester's fault: it gets an error; our receive stays posted, at the head.
            assert_eq!(b.ring().status(0).load(Ordering::Acquire), status::REM_OP);
            let waiting: Vec<u64> = match &b.srq {
                Some(s) => s.queue.lock().unwrap().iter().map(|r| r.wr_id).collect(),
                None => b.core.lock().rq.iter().map(|r| r.wr_id).collect(),
            };
            assert_eq!(waiting, [7], "shared receive queue: {srq}");
        }
    }

    #[test]
    fn deregistration_waits_for_queue_pair_lock_holders_reading_keys_without_a_lock() {
        let p = connected();
        let (a, b) = (p.a.clone(), p.b.clone());
        let buf = [0u8; 64];
        let addr = buf.as_ptr() as u64;
        let key = a.ctx.register(addr, 64, AccessFlags::ALL, a.pd, None).unwrap();
        let held = a.core.lock();
        assert!(a.keys(&held).check(key, addr, 64, AccessFlags::LOCAL_WRITE, a.pd));
        let done = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                a.ctx.deregister(key);
                done.store(true, Ordering::Release);
            });
            std::thread::sleep(Duration::from_millis(100));
            // The holder checked the key before it was cleared and may still be copying into
            // the region: the deregistration (and the freeing after it) waits.
            assert!(!done.load(Ordering::Acquire), "deregistration did not wait for the lock holder");
            drop(held);
        });
        assert!(done.load(Ordering::Acquire));
        assert!(!a.keys(&a.core.lock()).check(key, addr, 64, AccessFlags::LOCAL_WRITE, a.pd));
        // A new registration reusing the slot gets a fresh key; the old one stays refused.
        let again = b.ctx.register(addr, 64, AccessFlags::ALL, a.pd, None).unwrap();
        assert_ne!(again, key);
        assert!(!b.keys(&b.core.lock()).check(key, addr, 64, AccessFlags::NONE, a.pd));
        assert!(b.keys(&b.core.lock()).check(again, addr, 64, AccessFlags::NONE, a.pd));
    }
}
