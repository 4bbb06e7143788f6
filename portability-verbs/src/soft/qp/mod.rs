//! Software reliable-connected queue pairs and shared receive queues: what both transports
//! share (the state machine, the send and receive queues, the checks of a request, completions
//! in posting order) here; how requests move in `ring` (a peer on this host: shared rings and
//! direct copies) and `tcp` (any other peer: frames over TCP).
//!
//! Ordering: requests of one queue pair run in posting order and complete in it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::assist::{self, Back, Stuck};
use super::cq::Out;
use super::ctx::CtxInner;
use super::dma::local_copy;
use super::keys::LocalKeys;
use super::layout::{qp_state_code, QpSeg, QP_DESTROYED, QP_MAGIC, RING_OFFSET};
use super::peer::PeerCtx;
use super::segment::{qp_name, Segment};
use super::wire::{self, status, Descriptor, RecordHeader, RecordKind, FIELDS_BYTES};
use super::CqInner;
use crate::os;
use pv_sync::SpinLock;

mod drive;
mod ring;
mod srq;
mod tcp;

pub use srq::SrqInner;

pub(crate) use super::layout::qp_seg_gone;
use crate::endpoint::{EndpointInfo, SoftEndpoint};
use crate::error::{Result, VerbsError};
use crate::types::*;
use ring::{cancel_from, Remote, RnrTrack};

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

    /// Connected over the TCP transport.
    pub fn over_tcp(&self) -> bool {
        self.over_tcp.load(Ordering::Acquire)
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
        let ctx = super::super::open_context(super::super::SoftConfig::default()).unwrap();
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
