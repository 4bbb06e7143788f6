//! Provider-independent verbs types: access flags, work requests, completions, QP attributes.

use smallvec::SmallVec;
use std::time::Duration;

use crate::endpoint::EndpointInfo;

bitflags::bitflags! {
    /// Memory-region and queue-pair access rights (the verbs `IBV_ACCESS_*` flags, same bits).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
    pub struct AccessFlags: u32 {
        /// The provider may write into the region on behalf of local work requests (receives,
        /// READ results, atomic results).
        const LOCAL_WRITE = 1;
        /// Peers may RDMA-write the region.
        const REMOTE_WRITE = 2;
        /// Peers may RDMA-read the region.
        const REMOTE_READ = 4;
        /// Peers may run atomics on the region.
        const REMOTE_ATOMIC = 8;
    }
}

impl AccessFlags {
    /// No rights beyond local read.
    pub const NONE: AccessFlags = AccessFlags::empty();
    /// Every right.
    pub const ALL: AccessFlags = AccessFlags::all();
}

/// One scatter/gather element: `length` bytes at `addr`, inside the local region of `lkey`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Sge {
    /// Virtual address in this process.
    pub addr: u64,
    /// Bytes.
    pub length: u32,
    /// Local key of the registered region holding the bytes.
    pub lkey: u32,
}

/// A scatter/gather list; up to four elements live inline without allocation.
pub type SgList = SmallVec<[Sge; 4]>;

/// An [`SgList`] holding a copy of `sges`. One SGE (nearly every request) is stored directly:
/// `SmallVec::from_slice` calls `memcpy` for any length, which costs more than the copy.
#[inline]
pub fn sg_list_of(sges: &[Sge]) -> SgList {
    match sges {
        [one] => {
            let mut l = SgList::new();
            l.push(*one);
            l
        }
        _ => SgList::from_slice(sges),
    }
}

/// Operation of a send-queue work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WrOpcode {
    /// Two-sided send; consumes a receive at the peer.
    Send,
    /// Send carrying 32 bits of immediate data.
    SendWithImm,
    /// One-sided write into the peer's registered memory.
    RdmaWrite,
    /// One-sided write that also consumes a receive at the peer and delivers the immediate.
    RdmaWriteWithImm,
    /// One-sided read of the peer's registered memory.
    RdmaRead,
    /// 64-bit compare-and-swap on the peer; the old value lands in the local SGE.
    AtomicCmpAndSwp,
    /// 64-bit fetch-and-add on the peer; the old value lands in the local SGE.
    AtomicFetchAndAdd,
}

impl WrOpcode {
    /// The completion opcode of a request with this operation.
    pub fn completion_opcode(self) -> WcOpcode {
        match self {
            WrOpcode::Send | WrOpcode::SendWithImm => WcOpcode::Send,
            WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm => WcOpcode::RdmaWrite,
            WrOpcode::RdmaRead => WcOpcode::RdmaRead,
            WrOpcode::AtomicCmpAndSwp => WcOpcode::CompSwap,
            WrOpcode::AtomicFetchAndAdd => WcOpcode::FetchAdd,
        }
    }
    /// True for the operations that name remote memory (address and rkey).
    pub fn is_one_sided(self) -> bool {
        !matches!(self, WrOpcode::Send | WrOpcode::SendWithImm)
    }
    /// True for the two atomics.
    pub fn is_atomic(self) -> bool {
        matches!(self, WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd)
    }
}

/// Flags of a send work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SendFlags {
    /// Generate a completion on success (errors always complete).
    pub signaled: bool,
    /// Copy the gathered data at post time; the SGE memory need not be registered and may be
    /// reused as soon as `post_send` returns.
    pub inline: bool,
    /// Wait for earlier RDMA reads and atomics to finish before this request runs.
    pub fence: bool,
    /// A hint, for RDMA writes: another CPU reads the written data next, not this one. The
    /// software provider then places what it copies through shared memory with non-temporal
    /// stores (see [`crate::copy::copy_streaming`] for when that pays); a NIC ignores it. It
    /// never changes what the request does.
    pub streaming: bool,
    /// For RDMA writes without immediate: complete once the provider no longer
    /// reads the request's local buffers, which may be before the target has the data
    /// (libfabric's `FI_INJECT_COMPLETE`). The data still lands, in order, unless the
    /// connection fails, which then fails the queue pair as usual. Over the software
    /// provider's TCP transport that saves a round trip per request for a caller that waits
    /// for its buffer (the data is in the kernel's socket buffer); elsewhere a write completes
    /// as it always does (shared memory places it at once; a NIC reports the target's
    /// acknowledgement). Other requests ignore it (a write with immediate takes a receive at
    /// the target, which may refuse it for want of one and have it sent again from its
    /// buffer).
    pub inject_complete: bool,
}

/// A send-queue work request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendWr {
    /// Caller's identifier, returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub opcode: WrOpcode,
    /// Local data (gathered for sends and writes, scattered for reads and atomic results).
    pub sg_list: SgList,
    /// Flags.
    pub flags: SendFlags,
    /// Immediate data (for the `*WithImm` opcodes).
    pub imm: u32,
    /// Remote virtual address (one-sided operations).
    pub remote_addr: u64,
    /// Remote key (one-sided operations).
    pub rkey: u32,
    /// Compare value (CAS) or addend (FAA).
    pub compare_add: u64,
    /// Swap value (CAS).
    pub swap: u64,
}

impl SendWr {
    #[inline]
    fn new(wr_id: u64, opcode: WrOpcode, sg_list: &[Sge]) -> Self {
        SendWr {
            wr_id,
            opcode,
            sg_list: sg_list_of(sg_list),
            flags: SendFlags { signaled: true, ..SendFlags::default() },
            imm: 0,
            remote_addr: 0,
            rkey: 0,
            compare_add: 0,
            swap: 0,
        }
    }
    /// A signaled SEND.
    #[inline]
    pub fn send(wr_id: u64, sg_list: &[Sge]) -> Self {
        Self::new(wr_id, WrOpcode::Send, sg_list)
    }
    /// A signaled SEND_WITH_IMM.
    #[inline]
    pub fn send_with_imm(wr_id: u64, sg_list: &[Sge], imm: u32) -> Self {
        SendWr { imm, ..Self::new(wr_id, WrOpcode::SendWithImm, sg_list) }
    }
    /// A signaled RDMA_WRITE to `remote_addr` in the peer region of `rkey`.
    #[inline]
    pub fn write(wr_id: u64, sg_list: &[Sge], remote_addr: u64, rkey: u32) -> Self {
        SendWr { remote_addr, rkey, ..Self::new(wr_id, WrOpcode::RdmaWrite, sg_list) }
    }
    /// A signaled RDMA_WRITE_WITH_IMM.
    #[inline]
    pub fn write_with_imm(wr_id: u64, sg_list: &[Sge], remote_addr: u64, rkey: u32, imm: u32) -> Self {
        SendWr { remote_addr, rkey, imm, ..Self::new(wr_id, WrOpcode::RdmaWriteWithImm, sg_list) }
    }
    /// A signaled RDMA_READ from `remote_addr` into the local SGEs.
    #[inline]
    pub fn read(wr_id: u64, sg_list: &[Sge], remote_addr: u64, rkey: u32) -> Self {
        SendWr { remote_addr, rkey, ..Self::new(wr_id, WrOpcode::RdmaRead, sg_list) }
    }
    /// A signaled compare-and-swap; the 8-byte old value lands in `result`.
    #[inline]
    pub fn compare_and_swap(wr_id: u64, result: Sge, remote_addr: u64, rkey: u32, compare: u64, swap: u64) -> Self {
        SendWr {
            remote_addr,
            rkey,
            compare_add: compare,
            swap,
            ..Self::new(wr_id, WrOpcode::AtomicCmpAndSwp, &[result])
        }
    }
    /// A signaled fetch-and-add; the 8-byte old value lands in `result`.
    #[inline]
    pub fn fetch_and_add(wr_id: u64, result: Sge, remote_addr: u64, rkey: u32, add: u64) -> Self {
        SendWr { remote_addr, rkey, compare_add: add, ..Self::new(wr_id, WrOpcode::AtomicFetchAndAdd, &[result]) }
    }
    /// Sets whether a successful completion is generated.
    #[inline]
    pub fn signaled(mut self, signaled: bool) -> Self {
        self.flags.signaled = signaled;
        self
    }
    /// Sets inline sending (data copied at post time).
    #[inline]
    pub fn inline(mut self, inline: bool) -> Self {
        self.flags.inline = inline;
        self
    }
    /// Sets the fence flag.
    #[inline]
    pub fn fence(mut self, fence: bool) -> Self {
        self.flags.fence = fence;
        self
    }
    /// Sets the streaming hint ([`SendFlags::streaming`]).
    #[inline]
    pub fn streaming(mut self, streaming: bool) -> Self {
        self.flags.streaming = streaming;
        self
    }
    /// Sets [`SendFlags::inject_complete`].
    #[inline]
    pub fn inject_complete(mut self, on: bool) -> Self {
        self.flags.inject_complete = on;
        self
    }
    /// Total bytes named by the SGE list.
    #[inline]
    pub fn byte_len(&self) -> u64 {
        self.sg_list.iter().map(|s| s.length as u64).sum()
    }
}

/// A receive-queue work request: where an incoming SEND's data is scattered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecvWr {
    /// Caller's identifier, returned in the completion.
    pub wr_id: u64,
    /// Where to scatter the data.
    pub sg_list: SgList,
}

impl RecvWr {
    /// A receive into the given SGEs.
    #[inline]
    pub fn new(wr_id: u64, sg_list: &[Sge]) -> Self {
        RecvWr { wr_id, sg_list: sg_list_of(sg_list) }
    }
    /// Total capacity in bytes.
    #[inline]
    pub fn capacity(&self) -> u64 {
        self.sg_list.iter().map(|s| s.length as u64).sum()
    }
}

/// Status of a completion (the verbs `IBV_WC_*` statuses this layer produces).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WcStatus {
    /// Done.
    Success,
    /// A receive buffer was too small for the incoming message.
    LocLenErr,
    /// Internal QP consistency error (for example a request too large for the queue pair).
    LocQpOpErr,
    /// A local SGE did not match a registered region with the needed rights.
    LocProtErr,
    /// The QP was in (or entered) the error state before this request ran.
    WrFlushErr,
    /// The responder found the request invalid (for example its receive buffer was too small).
    RemInvReqErr,
    /// The remote key, bounds, alignment or rights did not allow the access.
    RemAccessErr,
    /// The responder failed the operation.
    RemOpErr,
    /// The peer did not answer within the transport retries (it died or its QP is gone).
    RetryExcErr,
    /// The peer had no receive posted through every receiver-not-ready retry.
    RnrRetryExcErr,
    /// Anything else.
    GeneralErr,
}

impl WcStatus {
    /// True for [`WcStatus::Success`].
    pub fn is_success(self) -> bool {
        self == WcStatus::Success
    }
}

/// What became of a request posted with [`crate::QueuePair::post_send_completing`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Posted {
    /// Carried out before the post returned, successfully: no completion will be reported for
    /// it, signaled or not (as UCX's non-blocking calls return "done in place").
    Completed,
    /// Queued (or failed): its completion comes through the send completion queue, exactly as
    /// after [`crate::QueuePair::post_send`].
    Pending,
}

/// What a completion completes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WcOpcode {
    /// A SEND or SEND_WITH_IMM.
    Send,
    /// An RDMA_WRITE or RDMA_WRITE_WITH_IMM.
    RdmaWrite,
    /// An RDMA_READ.
    RdmaRead,
    /// A compare-and-swap.
    CompSwap,
    /// A fetch-and-add.
    FetchAdd,
    /// A receive consumed by a SEND.
    Recv,
    /// A receive consumed by an RDMA_WRITE_WITH_IMM.
    RecvRdmaWithImm,
}

/// One work completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The request's `wr_id`.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// What completed. For flushed receives this is [`WcOpcode::Recv`].
    pub opcode: WcOpcode,
    /// Bytes transferred (receives: bytes of the incoming message).
    pub byte_len: u32,
    /// Immediate data, when the message carried one.
    pub imm: Option<u32>,
    /// Local QP number.
    pub qp_num: u32,
    /// The sending QP's number (receives).
    pub src_qp: u32,
}

impl WorkCompletion {
    /// An all-zero completion, for sizing poll buffers.
    pub const EMPTY: WorkCompletion = WorkCompletion {
        wr_id: 0,
        status: WcStatus::Success,
        opcode: WcOpcode::Send,
        byte_len: 0,
        imm: None,
        qp_num: 0,
        src_qp: 0,
    };
}

/// Queue-pair states of the verbs state machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QpState {
    /// Just created or reset; nothing may be posted.
    Reset,
    /// Receives may be posted; nothing is processed.
    Init,
    /// Ready to receive: incoming messages are processed.
    ReadyToReceive,
    /// Ready to send: sends may be posted.
    ReadyToSend,
    /// Broken: every request completes with a flush error.
    Error,
}

/// Sizes of a queue pair's queues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpCaps {
    /// Outstanding send requests at most.
    pub max_send_wr: u32,
    /// Outstanding receive requests at most (ignored with a shared receive queue).
    pub max_recv_wr: u32,
    /// SGEs per send request at most.
    pub max_send_sge: u32,
    /// SGEs per receive request at most.
    pub max_recv_sge: u32,
    /// Inline bytes per send at most.
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps { max_send_wr: 256, max_recv_wr: 256, max_send_sge: 4, max_recv_sge: 4, max_inline_data: 256 }
    }
}

/// Attributes for the move to ready-to-receive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RtrAttr {
    /// The peer queue pair, as its [`crate::QueuePair::endpoint`] reported it.
    pub remote: EndpointInfo,
    /// Receiver-not-ready timer as the 5-bit InfiniBand code (see [`rnr_timer_duration`]).
    pub min_rnr_timer: u8,
    /// Outstanding RDMA reads and atomics the peer may target at us.
    pub max_dest_rd_atomic: u8,
}

impl RtrAttr {
    /// Defaults for a given peer: a 0.64 ms receiver-not-ready timer, 16 reads in flight.
    pub fn new(remote: EndpointInfo) -> Self {
        RtrAttr { remote, min_rnr_timer: 12, max_dest_rd_atomic: 16 }
    }
}

/// Attributes for the move to ready-to-send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RtsAttr {
    /// Transport timeout as the 5-bit InfiniBand exponent (4.096 us << timeout).
    pub timeout: u8,
    /// Transport retries (0..=7).
    pub retry_cnt: u8,
    /// Receiver-not-ready retries (0..=7; 7 means retry for ever).
    pub rnr_retry: u8,
    /// Outstanding RDMA reads and atomics we may issue.
    pub max_rd_atomic: u8,
}

impl Default for RtsAttr {
    fn default() -> Self {
        RtsAttr { timeout: 14, retry_cnt: 7, rnr_retry: 7, max_rd_atomic: 16 }
    }
}

/// A queue-pair state transition (the subset of `ibv_modify_qp` a reliable-connected QP uses).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum QpTransition {
    /// Reset → Init, with the rights peers get on this QP.
    Init {
        /// Which remote operations the QP accepts.
        access: AccessFlags,
        /// Physical port (1-based; the software provider has one port).
        port: u8,
    },
    /// Init → ready-to-receive, connecting to the peer.
    Rtr(RtrAttr),
    /// Ready-to-receive → ready-to-send.
    Rts(RtsAttr),
    /// Any state → error (flushes everything outstanding).
    Error,
    /// Any state → reset (drops everything outstanding without completions, as verbs does).
    Reset,
}

/// Duration of the InfiniBand receiver-not-ready timer code (0 means 655.36 ms).
pub fn rnr_timer_duration(code: u8) -> Duration {
    const MICROS: [u32; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560, 3_840, 5_120, 7_680,
        10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840, 245_760, 327_680, 491_520,
    ];
    Duration::from_micros(MICROS[(code & 31) as usize] as u64)
}

/// Duration of the InfiniBand local ACK timeout exponent (0 means infinite).
pub fn transport_timeout_duration(exponent: u8) -> Option<Duration> {
    if exponent == 0 {
        None
    } else {
        Some(Duration::from_nanos(4096u64 << (exponent.min(31) as u64)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_flags_compose_and_check() {
        let a = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ;
        assert!(a.contains(AccessFlags::REMOTE_READ));
        assert!(!a.contains(AccessFlags::REMOTE_WRITE));
        assert_eq!(format!("{a:?}"), "AccessFlags(LOCAL_WRITE | REMOTE_READ)");
    }

    #[test]
    fn timer_codes_follow_the_infiniband_table() {
        assert_eq!(rnr_timer_duration(1), Duration::from_micros(10));
        assert_eq!(rnr_timer_duration(0), Duration::from_micros(655_360));
        assert_eq!(transport_timeout_duration(14), Some(Duration::from_nanos(4096 << 14)));
        assert_eq!(transport_timeout_duration(0), None);
    }
}
