//! The provider-independent verbs objects: device context, protection domain, memory region,
//! completion queue, queue pair and shared receive queue. Each dispatches to the provider it
//! was created on; objects of different providers or contexts cannot be mixed.

use std::sync::Arc;
use std::time::Duration;

use crate::endpoint::EndpointInfo;
use crate::error::{Result, VerbsError};
#[cfg(feature = "hardware")]
use crate::hw;
use crate::soft::{self, CqInner, CtxInner, QpInner, SoftBacking, SoftConfig, SoftMr, SrqInner};
use crate::types::*;

/// Which provider runs the verbs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Provider {
    /// The software provider (any Linux host; threads and processes of one host).
    Software,
    /// rdma-core's libibverbs on real hardware (cargo feature `hardware`).
    Hardware,
}

impl std::str::FromStr for Provider {
    type Err = VerbsError;
    fn from_str(s: &str) -> Result<Provider> {
        match s.trim().to_ascii_lowercase().as_str() {
            "soft" | "software" | "sw" => Ok(Provider::Software),
            "hw" | "hardware" | "ibverbs" => Ok(Provider::Hardware),
            other => Err(VerbsError::invalid(format!("unknown provider {other:?} (software or hardware)"))),
        }
    }
}

/// A device that can be opened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device name (`soft0` for the software provider, the HCA name otherwise).
    pub name: String,
    /// Provider behind it.
    pub provider: Provider,
}

/// Lists the devices of every provider compiled in. The software device is always there.
pub fn devices() -> Vec<DeviceInfo> {
    #[allow(unused_mut)]
    let mut v = vec![DeviceInfo { name: "soft0".into(), provider: Provider::Software }];
    #[cfg(feature = "hardware")]
    v.extend(hw::device_names().into_iter().map(|name| DeviceInfo { name, provider: Provider::Hardware }));
    v
}

#[derive(Clone)]
enum CtxImpl {
    Soft(Arc<CtxInner>),
    #[cfg(feature = "hardware")]
    Hw(Arc<hw::HwContext>),
}

/// An open device.
#[derive(Clone)]
pub struct Context(CtxImpl);

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").field("provider", &self.provider()).finish_non_exhaustive()
    }
}

impl Context {
    /// Opens the provider named by `PV_PROVIDER` (default: software).
    pub fn open_default() -> Result<Context> {
        let p = match crate::env::text("PV_PROVIDER")? {
            Some(v) => v.parse()?,
            None => Provider::Software,
        };
        Self::open(p)
    }

    /// Opens the first device of `provider`.
    pub fn open(provider: Provider) -> Result<Context> {
        match provider {
            Provider::Software => Self::open_soft(SoftConfig::from_env()?),
            #[cfg(feature = "hardware")]
            Provider::Hardware => Ok(Context(CtxImpl::Hw(Arc::new(hw::HwContext::open(None)?)))),
            #[cfg(not(feature = "hardware"))]
            Provider::Hardware => Err(VerbsError::NoDevice(
                "the hardware provider is not compiled in: build with `--features portability-verbs/hardware`".into(),
            )),
        }
    }

    /// Opens the software device with explicit tunables.
    pub fn open_soft(config: SoftConfig) -> Result<Context> {
        Ok(Context(CtxImpl::Soft(soft::open_context(config)?)))
    }

    /// The provider of this context.
    pub fn provider(&self) -> Provider {
        match &self.0 {
            CtxImpl::Soft(_) => Provider::Software,
            #[cfg(feature = "hardware")]
            CtxImpl::Hw(_) => Provider::Hardware,
        }
    }

    /// The software provider's tunables (None for the hardware provider).
    pub fn soft_config(&self) -> Option<&SoftConfig> {
        match &self.0 {
            CtxImpl::Soft(c) => Some(&c.config),
            #[cfg(feature = "hardware")]
            CtxImpl::Hw(_) => None,
        }
    }

    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        Ok(ProtectionDomain(match &self.0 {
            CtxImpl::Soft(c) => PdImpl::Soft(c.clone(), c.next_pd.fetch_add(1, std::sync::atomic::Ordering::Relaxed)),
            #[cfg(feature = "hardware")]
            CtxImpl::Hw(c) => PdImpl::Hw(Arc::new(hw::HwPd::new(c)?)),
        }))
    }

    /// Creates a completion queue holding up to `capacity` completions.
    pub fn create_cq(&self, capacity: usize) -> Result<CompletionQueue> {
        Ok(CompletionQueue(match &self.0 {
            CtxImpl::Soft(c) => CqImpl::Soft(CqInner::new(c, capacity)?),
            #[cfg(feature = "hardware")]
            CtxImpl::Hw(c) => CqImpl::Hw(Arc::new(hw::HwCq::new(c, capacity)?)),
        }))
    }
}

#[derive(Clone)]
enum PdImpl {
    Soft(Arc<CtxInner>, u32),
    #[cfg(feature = "hardware")]
    Hw(Arc<hw::HwPd>),
}

/// A protection domain: memory regions and queue pairs of one domain may be used together.
#[derive(Clone)]
pub struct ProtectionDomain(PdImpl);

impl std::fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProtectionDomain").field("provider", &self.provider()).finish_non_exhaustive()
    }
}

/// What a queue pair is created with.
#[derive(Debug)]
pub struct QpInit<'a> {
    /// Queue for send-side completions.
    pub send_cq: &'a CompletionQueue,
    /// Queue for receive-side completions.
    pub recv_cq: &'a CompletionQueue,
    /// Shared receive queue, if receives come from one.
    pub srq: Option<&'a SharedReceiveQueue>,
    /// Queue sizes.
    pub caps: QpCaps,
}

impl<'a> QpInit<'a> {
    /// One queue for both sides, default sizes, no SRQ.
    pub fn new(cq: &'a CompletionQueue) -> Self {
        QpInit { send_cq: cq, recv_cq: cq, srq: None, caps: QpCaps::default() }
    }
}

fn mismatch(what: &str) -> VerbsError {
    VerbsError::ProviderMismatch(what.into())
}

impl ProtectionDomain {
    /// The device context this domain belongs to (to create completion queues beside it).
    pub fn context(&self) -> Context {
        Context(match &self.0 {
            PdImpl::Soft(c, _) => CtxImpl::Soft(c.clone()),
            #[cfg(feature = "hardware")]
            PdImpl::Hw(p) => CtxImpl::Hw(p.context()),
        })
    }

    /// The provider of this domain.
    pub fn provider(&self) -> Provider {
        match &self.0 {
            PdImpl::Soft(..) => Provider::Software,
            #[cfg(feature = "hardware")]
            PdImpl::Hw(_) => Provider::Hardware,
        }
    }

    /// Registers an owned buffer; the region keeps it alive and frees it when dropped.
    pub fn register(&self, buf: Box<[u8]>, access: AccessFlags) -> Result<MemoryRegion> {
        let addr = buf.as_ptr() as u64;
        let len = buf.len();
        match &self.0 {
            PdImpl::Soft(c, pd) => {
                Ok(MemoryRegion(MrImpl::Soft(SoftMr::register(c, *pd, addr, len, access, SoftBacking::Owned(buf))?)))
            }
            #[cfg(feature = "hardware")]
            PdImpl::Hw(p) => Ok(MemoryRegion(MrImpl::Hw(hw::HwMr::register(p, buf, access)?))),
        }
    }

    /// Registers caller-owned memory.
    ///
    /// # Safety
    /// `[addr, addr + len)` must stay mapped for as long as the region lives, and the caller must
    /// accept that peers granted remote access write into it at any time (as with real verbs).
    pub unsafe fn register_raw(&self, addr: *mut u8, len: usize, access: AccessFlags) -> Result<MemoryRegion> {
        match &self.0 {
            PdImpl::Soft(c, pd) => Ok(MemoryRegion(MrImpl::Soft(SoftMr::register(
                c,
                *pd,
                addr as u64,
                len,
                access,
                SoftBacking::Borrowed,
            )?))),
            #[cfg(feature = "hardware")]
            // SAFETY: forwarded contract.
            PdImpl::Hw(p) => Ok(MemoryRegion(MrImpl::Hw(unsafe { hw::HwMr::register_raw(p, addr, len, access)? }))),
        }
    }

    /// Allocates and registers `len` zeroed bytes of provider memory. On the software provider
    /// this is a shared segment that peers on the host reach with plain loads and stores (the
    /// fastest RDMA target).
    pub fn alloc(&self, len: usize, access: AccessFlags) -> Result<MemoryRegion> {
        match &self.0 {
            PdImpl::Soft(c, pd) => Ok(MemoryRegion(MrImpl::Soft(SoftMr::alloc(c, *pd, len, access)?))),
            #[cfg(feature = "hardware")]
            PdImpl::Hw(_) => self.register(vec![0u8; len].into_boxed_slice(), access),
        }
    }

    /// Creates a reliable-connected queue pair (in RESET).
    pub fn create_qp(&self, init: &QpInit<'_>) -> Result<QueuePair> {
        match (&self.0, &init.send_cq.0, &init.recv_cq.0) {
            (PdImpl::Soft(c, pd), CqImpl::Soft(s), CqImpl::Soft(r)) => {
                if !Arc::ptr_eq(&s.ctx, c) || !Arc::ptr_eq(&r.ctx, c) {
                    return Err(mismatch("completion queue of another context"));
                }
                let srq = match init.srq.map(|s| &s.0) {
                    None => None,
                    Some(SrqImpl::Soft(s)) if Arc::ptr_eq(&s.ctx, c) => Some(s),
                    #[allow(unreachable_patterns)]
                    Some(_) => return Err(mismatch("shared receive queue of another context")),
                };
                Ok(QueuePair(Arc::new(QpHandle(QpImpl::Soft(QpInner::new(c, *pd, s, r, srq, init.caps)?)))))
            }
            #[cfg(feature = "hardware")]
            (PdImpl::Hw(p), CqImpl::Hw(s), CqImpl::Hw(r)) => {
                let srq = match init.srq.map(|s| &s.0) {
                    None => None,
                    Some(SrqImpl::Hw(s)) => Some(s.clone()),
                    Some(_) => return Err(mismatch("shared receive queue of another provider")),
                };
                Ok(QueuePair(Arc::new(QpHandle(QpImpl::Hw(hw::HwQp::new(p, s, r, srq, init.caps)?)))))
            }
            #[allow(unreachable_patterns)]
            _ => Err(mismatch("completion queue of another provider")),
        }
    }

    /// Creates a shared receive queue.
    pub fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<SharedReceiveQueue> {
        Ok(SharedReceiveQueue(match &self.0 {
            PdImpl::Soft(c, pd) => SrqImpl::Soft(SrqInner::new(c, *pd, max_wr, max_sge)?),
            #[cfg(feature = "hardware")]
            PdImpl::Hw(p) => SrqImpl::Hw(Arc::new(hw::HwSrq::new(p, max_wr, max_sge)?)),
        }))
    }
}

enum MrImpl {
    Soft(SoftMr),
    #[cfg(feature = "hardware")]
    Hw(hw::HwMr),
}

/// Registered memory: local accesses name it by `lkey`, peers by `rkey`. Deregistered on drop
/// (after any peer access in progress has finished).
pub struct MemoryRegion(MrImpl);

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("lkey", &format_args!("{:#x}", self.lkey()))
            .field("rkey", &format_args!("{:#x}", self.rkey()))
            .finish()
    }
}

impl MemoryRegion {
    /// Start address.
    #[inline]
    pub fn addr(&self) -> u64 {
        match &self.0 {
            MrImpl::Soft(m) => m.addr,
            #[cfg(feature = "hardware")]
            MrImpl::Hw(m) => m.addr(),
        }
    }
    /// Length in bytes.
    #[inline]
    pub fn len(&self) -> usize {
        match &self.0 {
            MrImpl::Soft(m) => m.len,
            #[cfg(feature = "hardware")]
            MrImpl::Hw(m) => m.len(),
        }
    }
    /// True for an empty region.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Local key.
    #[inline]
    pub fn lkey(&self) -> u32 {
        match &self.0 {
            MrImpl::Soft(m) => m.key,
            #[cfg(feature = "hardware")]
            MrImpl::Hw(m) => m.lkey(),
        }
    }
    /// Remote key.
    #[inline]
    pub fn rkey(&self) -> u32 {
        match &self.0 {
            MrImpl::Soft(m) => m.key,
            #[cfg(feature = "hardware")]
            MrImpl::Hw(m) => m.rkey(),
        }
    }
    /// True when peers on this host reach it with plain loads and stores (provider segment).
    pub fn is_shared_segment(&self) -> bool {
        match &self.0 {
            MrImpl::Soft(m) => m.is_shared_segment(),
            #[cfg(feature = "hardware")]
            MrImpl::Hw(_) => false,
        }
    }
    /// Raw pointer to the first byte.
    #[inline]
    pub fn as_ptr(&self) -> *mut u8 {
        self.addr() as usize as *mut u8
    }
    /// An SGE over `len` bytes at `offset`. Panics if the range is outside the region.
    #[inline]
    pub fn sge(&self, offset: usize, len: usize) -> Sge {
        assert!(offset.checked_add(len).is_some_and(|e| e <= self.len()), "SGE outside the region");
        Sge { addr: self.addr() + offset as u64, length: len as u32, lkey: self.lkey() }
    }
    /// An SGE over the whole region.
    #[inline]
    pub fn sge_all(&self) -> Sge {
        self.sge(0, self.len())
    }
    /// Copies bytes out of the region (a snapshot: peers may write concurrently).
    #[inline]
    pub fn read(&self, offset: usize, dst: &mut [u8]) {
        assert!(offset.checked_add(dst.len()).is_some_and(|e| e <= self.len()), "read outside the region");
        // SAFETY: in bounds of a live registration; volatile-free byte copy of shared memory whose
        // concurrent writers (peers) are the verbs contract's business, not Rust references.
        unsafe { crate::copy::copy_bytes(dst.as_mut_ptr(), self.as_ptr().add(offset), dst.len()) };
    }
    /// Copies bytes into the region.
    #[inline]
    pub fn write(&self, offset: usize, src: &[u8]) {
        assert!(offset.checked_add(src.len()).is_some_and(|e| e <= self.len()), "write outside the region");
        // SAFETY: in bounds of a live registration the caller owns.
        unsafe { crate::copy::copy_bytes(self.as_ptr().add(offset), src.as_ptr(), src.len()) };
    }
    /// Replaces the aligned u64 at `offset` by `op(old)`, atomically with respect to the RDMA
    /// atomics (compare-and-swap, fetch-and-add) peers run on this region, and returns `old`:
    /// how the owner of a lock word that peers take by compare-and-swap takes it too. (A plain
    /// CPU atomic is not enough: verbs atomics are only atomic with respect to each other.)
    /// The hardware provider returns [`VerbsError::Unsupported`]: without a device that
    /// promises `IBV_ATOMIC_GLOB`, the CPU's atomics and the NIC's do not exclude each other.
    pub fn local_atomic(&self, offset: usize, op: impl FnOnce(u64) -> u64) -> Result<u64> {
        match &self.0 {
            MrImpl::Soft(m) => m.local_atomic(offset, op),
            #[cfg(feature = "hardware")]
            MrImpl::Hw(_) => {
                let _ = (offset, op);
                Err(VerbsError::Unsupported("local atomics on hardware registrations".into()))
            }
        }
    }
    /// Reads the native-endian u64 at `offset` (for atomics results).
    #[inline]
    pub fn read_u64(&self, offset: usize) -> u64 {
        let mut b = [0u8; 8];
        self.read(offset, &mut b);
        u64::from_ne_bytes(b)
    }
    /// The region as a slice.
    ///
    /// # Safety
    /// No peer or posted request may write the region while the slice lives.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: in bounds; the caller guarantees no concurrent writers.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len()) }
    }
    /// The region as a mutable slice.
    ///
    /// # Safety
    /// No peer or posted request may access the region while the slice lives, and no other
    /// reference to it may exist.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        // SAFETY: in bounds; the caller guarantees exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.as_ptr(), self.len()) }
    }
}

#[derive(Clone)]
enum CqImpl {
    Soft(Arc<CqInner>),
    #[cfg(feature = "hardware")]
    Hw(Arc<hw::HwCq>),
}

/// A completion queue. Polling it also drives the software provider's progress.
#[derive(Clone)]
pub struct CompletionQueue(CqImpl);

impl std::fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionQueue").field("capacity", &self.capacity()).finish_non_exhaustive()
    }
}

impl CompletionQueue {
    /// Polls up to `out.len()` completions without blocking; returns how many were written.
    /// `Err(CqOverrun)` once completions were lost.
    #[inline]
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        match &self.0 {
            CqImpl::Soft(c) => c.poll(out),
            #[cfg(feature = "hardware")]
            CqImpl::Hw(c) => c.poll(out),
        }
    }
    /// Arms the queue: the next completion makes [`CompletionQueue::event_fd`] readable.
    pub fn req_notify(&self) -> Result<()> {
        match &self.0 {
            CqImpl::Soft(c) => {
                c.req_notify();
                Ok(())
            }
            #[cfg(feature = "hardware")]
            CqImpl::Hw(c) => c.req_notify(),
        }
    }
    /// A descriptor that turns readable when an armed event fires (for epoll or a runtime).
    pub fn event_fd(&self) -> i32 {
        match &self.0 {
            CqImpl::Soft(c) => c.event_fd(),
            #[cfg(feature = "hardware")]
            CqImpl::Hw(c) => c.event_fd(),
        }
    }
    /// Sleeps until the event descriptor is readable or `timeout` passes; true if readable.
    pub fn wait_event(&self, timeout: Option<Duration>) -> Result<bool> {
        match &self.0 {
            CqImpl::Soft(c) => c.wait_event(timeout),
            #[cfg(feature = "hardware")]
            CqImpl::Hw(c) => c.wait_event(timeout),
        }
    }
    /// Consumes the pending event (call after waking, before polling).
    pub fn ack_event(&self) {
        match &self.0 {
            CqImpl::Soft(c) => {
                c.ack_event();
            }
            #[cfg(feature = "hardware")]
            CqImpl::Hw(c) => c.ack_event(),
        }
    }
    /// Polls until at least one completion arrives: spins briefly, then sleeps on the event
    /// descriptor. `Err(Timeout)` if none came within `timeout`.
    pub fn poll_blocking(&self, out: &mut [WorkCompletion], timeout: Duration) -> Result<usize> {
        match &self.0 {
            CqImpl::Soft(c) => c.poll_blocking(out, timeout),
            #[cfg(feature = "hardware")]
            CqImpl::Hw(c) => c.poll_blocking(out, timeout),
        }
    }
    /// Capacity.
    pub fn capacity(&self) -> usize {
        match &self.0 {
            CqImpl::Soft(c) => c.capacity(),
            #[cfg(feature = "hardware")]
            CqImpl::Hw(c) => c.capacity(),
        }
    }
}

enum QpImpl {
    Soft(Arc<QpInner>),
    #[cfg(feature = "hardware")]
    Hw(hw::HwQp),
}

struct QpHandle(QpImpl);

impl Drop for QpHandle {
    fn drop(&mut self) {
        match &self.0 {
            QpImpl::Soft(q) => q.destroy(),
            #[cfg(feature = "hardware")]
            QpImpl::Hw(_) => {}
        }
    }
}

/// A reliable-connected queue pair. Clones share the same queue pair, which is destroyed when
/// the last clone drops.
#[derive(Clone)]
pub struct QueuePair(Arc<QpHandle>);

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair").field("qpn", &self.qpn()).field("state", &self.state()).finish_non_exhaustive()
    }
}

impl QueuePair {
    /// Queue-pair number.
    pub fn qpn(&self) -> u32 {
        match &self.0 .0 {
            QpImpl::Soft(q) => q.qpn,
            #[cfg(feature = "hardware")]
            QpImpl::Hw(q) => q.qpn(),
        }
    }
    /// What the peer needs to connect to this queue pair (send it over any channel).
    pub fn endpoint(&self) -> EndpointInfo {
        match &self.0 .0 {
            QpImpl::Soft(q) => EndpointInfo::Soft(q.endpoint()),
            #[cfg(feature = "hardware")]
            QpImpl::Hw(q) => EndpointInfo::Hardware(q.endpoint()),
        }
    }
    /// Whether the peer is reached over a network (the hardware provider, or the software
    /// provider over TCP): a request then completes only once the peer answered it, so a peer
    /// that goes away fails requests still on the way. On one host the software provider
    /// carries requests out into the peer's memory itself.
    pub fn over_network(&self) -> bool {
        match &self.0 .0 {
            QpImpl::Soft(q) => q.over_tcp(),
            #[cfg(feature = "hardware")]
            QpImpl::Hw(_) => true,
        }
    }

    /// Current state.
    pub fn state(&self) -> QpState {
        match &self.0 .0 {
            QpImpl::Soft(q) => q.state(),
            #[cfg(feature = "hardware")]
            QpImpl::Hw(q) => q.state(),
        }
    }
    /// Queue sizes.
    pub fn caps(&self) -> QpCaps {
        match &self.0 .0 {
            QpImpl::Soft(q) => q.caps(),
            #[cfg(feature = "hardware")]
            QpImpl::Hw(q) => q.caps(),
        }
    }
    /// Applies a state transition.
    pub fn modify(&self, t: QpTransition) -> Result<()> {
        match &self.0 .0 {
            QpImpl::Soft(q) => q.modify(t),
            #[cfg(feature = "hardware")]
            QpImpl::Hw(q) => q.modify(t),
        }
    }
    /// Walks RESET → INIT → RTR → RTS to a peer, with default attributes and every remote
    /// right granted on this QP.
    pub fn connect_to(&self, remote: EndpointInfo) -> Result<()> {
        self.modify(QpTransition::Init { access: AccessFlags::ALL, port: 1 })?;
        self.modify(QpTransition::Rtr(RtrAttr::new(remote)))?;
        self.modify(QpTransition::Rts(RtsAttr::default()))
    }
    /// Posts send-queue requests. A synchronous error (bad argument, full queue, wrong state)
    /// stops at the failing request; the ones before it were posted.
    #[inline]
    pub fn post_send(&self, wrs: &[SendWr]) -> Result<()> {
        match &self.0 .0 {
            QpImpl::Soft(q) => q.post_send(wrs),
            #[cfg(feature = "hardware")]
            QpImpl::Hw(q) => q.post_send(wrs),
        }
    }
    /// Lends this thread to the connected peer's shared copy, if the peer offers one now: on
    /// the software provider a peer pulling a large range out of this process's memory (an
    /// RDMA read, the data of a large send) offers the back half to whoever polls this queue
    /// pair, and copies it itself if nobody takes it. Every poll of a completion queue does
    /// this; a caller that spins on something else (its own memory, say, as a polled message
    /// pipe does) calls it in its loop, so that the peer's copy is shared as soon as it is
    /// offered rather than at the next poll. One load when nothing is offered. Does nothing
    /// on the hardware provider, whose NIC copies.
    #[inline]
    pub fn help_peer(&self) {
        match &self.0 .0 {
            QpImpl::Soft(q) => q.help_peer(),
            #[cfg(feature = "hardware")]
            QpImpl::Hw(_) => {}
        }
    }
    /// Posts one request and says whether it is already done: [`Posted::Completed`] means it
    /// was carried out, successfully, before this returned, and no completion will be reported
    /// for it (signaled or not); [`Posted::Pending`] means it was posted as by
    /// [`QueuePair::post_send`] and its completion will come. The software provider carries
    /// out a one-sided request (RDMA read or write, an atomic) at post when nothing is queued
    /// ahead of it, so a rendezvous read needs no trip through the completion queue; the
    /// hardware provider always answers `Pending`.
    #[inline]
    pub fn post_send_completing(&self, wr: &SendWr) -> Result<Posted> {
        match &self.0 .0 {
            QpImpl::Soft(q) => q.post_send_completing(wr),
            #[cfg(feature = "hardware")]
            QpImpl::Hw(q) => q.post_send(std::slice::from_ref(wr)).map(|()| Posted::Pending),
        }
    }
    /// Posts an RDMA write of `parts` put end to end, as inline data (copied before this
    /// returns, so the parts may be reused at once), the way `ibv_wr_set_inline_data_list`
    /// gathers a list of buffers. It is [`QueuePair::post_send`] of `SendWr::write(wr_id, ..,
    /// remote_addr, rkey).inline(true).signaled(signaled)` over the parts, with the same
    /// errors and completions; the software provider carries one out at post when nothing is
    /// queued ahead of it, without building or walking a request (the small-message fast path).
    #[inline]
    pub fn post_write_inline_list(
        &self,
        wr_id: u64,
        parts: &[&[u8]],
        remote_addr: u64,
        rkey: u32,
        signaled: bool,
    ) -> Result<()> {
        match &self.0 .0 {
            QpImpl::Soft(q) => {
                if let Some(done) = q.write_inline_list_at_once(wr_id, parts, remote_addr, rkey, signaled) {
                    return done;
                }
            }
            #[cfg(feature = "hardware")]
            QpImpl::Hw(_) => {}
        }
        self.post_write_inline_list_as_request(wr_id, parts, remote_addr, rkey, signaled)
    }
    /// Maps `len` bytes at `remote_addr` of the connected peer's memory region `rkey` into this
    /// process, for writes with plain stores ([`RemoteWindow::write`]): no request, no
    /// completion, no queue-pair lock (the way UCX's `rkey_ptr` reaches shared-memory peers).
    /// The region must grant remote writes, as for an RDMA write.
    ///
    /// `Ok(None)` where the provider cannot map it: the hardware provider, and on the software
    /// provider memory the peer registered from its own heap (reached with cross-memory attach
    /// only); memory from [`ProtectionDomain::alloc`] maps. Fails if the queue pair is not
    /// ready to send or the peer refuses the range (key, bounds, rights, protection domain).
    ///
    /// A window's writes are not ordered with this queue pair's requests: one may land before
    /// a request posted earlier has. A caller that needs order sees earlier requests complete
    /// first.
    pub fn map_remote_write(&self, remote_addr: u64, len: u64, rkey: u32) -> Result<Option<RemoteWindow>> {
        match &self.0 .0 {
            QpImpl::Soft(q) => Ok(q.map_remote_write(remote_addr, len, rkey)?.map(RemoteWindow)),
            #[cfg(feature = "hardware")]
            QpImpl::Hw(_) => Ok(None),
        }
    }
    /// [`QueuePair::post_write_inline_list`] as a request: one SGE over a copy of the parts,
    /// whatever max_send_sge is (an inline SGE needs no key, and its bytes are copied at post
    /// time anyway). Out of line: the fast path above stays small.
    #[inline(never)]
    fn post_write_inline_list_as_request(
        &self,
        wr_id: u64,
        parts: &[&[u8]],
        remote_addr: u64,
        rkey: u32,
        signaled: bool,
    ) -> Result<()> {
        let mut data = smallvec::SmallVec::<[u8; 256]>::new();
        for p in parts {
            data.extend_from_slice(p);
        }
        let sge = Sge { addr: data.as_ptr() as u64, length: data.len() as u32, lkey: 0 };
        self.post_send(&[SendWr::write(wr_id, &[sge], remote_addr, rkey).inline(true).signaled(signaled)])
    }
    /// Posts receives (not for a QP on a shared receive queue).
    #[inline]
    pub fn post_recv(&self, wrs: &[RecvWr]) -> Result<()> {
        match &self.0 .0 {
            QpImpl::Soft(q) => q.post_recv(wrs),
            #[cfg(feature = "hardware")]
            QpImpl::Hw(q) => q.post_recv(wrs),
        }
    }
}

/// A peer's registered memory mapped for plain stores ([`QueuePair::map_remote_write`]).
/// It keeps its mapping alive by itself; once the peer deregisters the region or its queue
/// pair stops answering, writes fail.
pub struct RemoteWindow(crate::soft::SoftWindow);

impl RemoteWindow {
    /// Bytes of the window.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True for a window of no bytes (never mapped: kept for the `len`/`is_empty` pair).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Writes `parts` end to end at byte `offset` of the window, with plain stores, their last
    /// 8 bytes placed last: a reader that sees those sees the rest, as with an RDMA write on
    /// the software provider. Refused, writing nothing: `RemAccessErr` once the peer
    /// deregistered the region, `RetryExcErr` once its queue pair is in error or destroyed,
    /// `LocLenErr` for a range outside the window. `LocProtErr`: a part this process may not
    /// read (what came before it may be written).
    #[inline]
    pub fn write(&self, offset: usize, parts: &[&[u8]]) -> std::result::Result<(), WcStatus> {
        self.0.write(offset, parts, false)
    }

    /// [`RemoteWindow::write`] of one part, in fewer instructions where it is 8 to 128 bytes
    /// and no protection hold is active: the path of a small message, put together first.
    #[inline]
    pub fn write_small(&self, offset: usize, bytes: &[u8]) -> std::result::Result<(), WcStatus> {
        self.0.write_small(offset, bytes)
    }

    /// [`RemoteWindow::write`] with non-temporal stores for large parts: they go to memory
    /// rather than into this CPU's cache, cheaper where the reader's CPU shares no cache with
    /// ours and dearer where it does (the reader then loads from memory), so the choice is a
    /// measured one.
    #[inline]
    pub fn write_streaming(&self, offset: usize, parts: &[&[u8]]) -> std::result::Result<(), WcStatus> {
        self.0.write(offset, parts, true)
    }
}

impl std::fmt::Debug for RemoteWindow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteWindow").field("len", &self.len()).finish_non_exhaustive()
    }
}

enum SrqImpl {
    Soft(Arc<SrqInner>),
    #[cfg(feature = "hardware")]
    Hw(Arc<hw::HwSrq>),
}

/// A shared receive queue: receives posted once, consumed by any of its queue pairs.
pub struct SharedReceiveQueue(SrqImpl);

impl std::fmt::Debug for SharedReceiveQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedReceiveQueue").finish_non_exhaustive()
    }
}

impl SharedReceiveQueue {
    /// Posts receives.
    #[inline]
    pub fn post_recv(&self, wrs: &[RecvWr]) -> Result<()> {
        match &self.0 {
            SrqImpl::Soft(s) => s.post_recv(wrs),
            #[cfg(feature = "hardware")]
            SrqImpl::Hw(s) => s.post_recv(wrs),
        }
    }
}

/// The software provider's page size (for callers aligning buffers to protect them).
pub fn page_size() -> usize {
    soft::page_size()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hardware_provider_says_clearly_when_there_is_no_device() {
        match Context::open(Provider::Hardware) {
            Ok(ctx) => assert_eq!(ctx.provider(), Provider::Hardware), // a real HCA is present
            Err(VerbsError::NoDevice(why)) => assert!(!why.is_empty()),
            Err(e) => panic!("unclear error: {e}"),
        }
    }

    #[test]
    fn the_software_device_is_always_listed() {
        assert!(devices().iter().any(|d| d.provider == Provider::Software));
        assert_eq!("soft".parse::<Provider>().unwrap(), Provider::Software);
        assert!("gpu".parse::<Provider>().is_err());
    }
}
