//! A flow-controlled message pipe over a connected queue pair: the driver of the sans-IO
//! strategies of [`super::fc`]. Madeleine's eager path and the SDP buffer-copy path sit on it.
//!
//! Messages are copied (into pool buffers, or coalesced chunks) and delivered in order; the
//! receiver reads them in place (`recv_with`), without another copy. Either side may send.
//!
//! A peer that breaks the flow-control contract (credits it does not have, a chunk past its ring
//! space, a malformed record, a buffer it has no credit for) fails the pipe with
//! [`VerbsError::Protocol`]; messages received before the failure stay readable.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::fc::{self, Coalescer, Credits, FcError, Record, RecordKind, RingReceiver, RingSender, RECORD_HEADER};
use super::pool::{BufferPool, PoolBuf};
use crate::error::{Result, VerbsError};
use crate::types::*;
use crate::verbs::{CompletionQueue, MemoryRegion, ProtectionDomain, QueuePair, RemoteWindow};

/// Which flow control a pipe uses (both ends must agree; the setup exchange checks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlowStrategy {
    /// Credit-based: `buffers` pre-posted receive buffers of `buf_size` bytes, one message each.
    Credit {
        /// Receive buffers posted (= initial credits).
        buffers: u32,
        /// Bytes per buffer (largest message + 16).
        buf_size: usize,
    },
    /// RDMA-based: the sender places chunks in the receiver's `ring_bytes` ring with RDMA
    /// write-with-immediate, coalescing small messages up to `coalesce` bytes.
    Rdma {
        /// Bytes of each side's inbound ring.
        ring_bytes: usize,
        /// Immediate-send threshold: chunks are flushed once this many bytes are staged.
        coalesce: usize,
    },
    /// NIC-assisted virtual window: `buffers` receives of `window` bytes; segments of at most
    /// `window` go out without credits, the transport queueing what finds no receive.
    Window {
        /// Segment (and receive buffer) size.
        window: usize,
        /// Receives posted (N/W).
        buffers: u32,
    },
    /// Polled RDMA: the sender RDMA-writes each message (or, while the ring is short of room,
    /// a coalesced batch of up to `coalesce` bytes) as a frame into the receiver's
    /// `ring_bytes` ring, and the receiver finds it by polling the ring's memory: no receive,
    /// no immediate, no completion per message (see [`super::fc::frame_word`]). The fastest
    /// small-message path; it relies on a write's last bytes being placed last, as the
    /// software provider guarantees and RDMA NICs do. A receiver about to sleep on the
    /// completion queue must say so first ([`MsgPipe::prepare_sleep`]): the sender then
    /// raises a completion for it.
    Polled {
        /// Bytes of each side's inbound ring.
        ring_bytes: usize,
        /// Largest coalesced batch (frame body).
        coalesce: usize,
    },
}

impl FlowStrategy {
    /// Credit-based defaults: 32 buffers of 2 KiB.
    pub const CREDIT: FlowStrategy = FlowStrategy::Credit { buffers: 32, buf_size: 2048 };
    /// RDMA-based defaults: a 32 KiB ring (8 KiB chunks), 4 KiB coalescing threshold.
    pub const RDMA: FlowStrategy = FlowStrategy::Rdma { ring_bytes: 32 * 1024, coalesce: 4096 };
    /// NIC-assisted defaults: 32 receives of 2 KiB.
    pub const WINDOW: FlowStrategy = FlowStrategy::Window { window: 2048, buffers: 32 };
    /// Polled defaults: a 32 KiB ring (frames of up to 8 KiB), 4 KiB batches.
    pub const POLLED: FlowStrategy = FlowStrategy::Polled { ring_bytes: 32 * 1024, coalesce: 4096 };

    /// The default of a strategy by name: `credit`, `rdma` or `window`.
    pub fn by_name(name: &str) -> Option<FlowStrategy> {
        match name {
            "credit" => Some(FlowStrategy::CREDIT),
            "rdma" => Some(FlowStrategy::RDMA),
            "window" | "nic" => Some(FlowStrategy::WINDOW),
            "polled" => Some(FlowStrategy::POLLED),
            _ => None,
        }
    }

    /// Short name.
    pub fn name(&self) -> &'static str {
        match self {
            FlowStrategy::Credit { .. } => "credit",
            FlowStrategy::Rdma { .. } => "rdma",
            FlowStrategy::Window { .. } => "window",
            FlowStrategy::Polled { .. } => "polled",
        }
    }

    /// Largest message the pipe carries.
    pub fn max_message(&self) -> usize {
        match *self {
            FlowStrategy::Credit { buf_size, .. } => buf_size - RECORD_HEADER,
            FlowStrategy::Rdma { ring_bytes, .. } => ring_bytes / 4 - RECORD_HEADER,
            FlowStrategy::Window { window, .. } => window - RECORD_HEADER,
            FlowStrategy::Polled { ring_bytes, .. } => fc::frame_body_max(ring_bytes as u64) - RECORD_HEADER,
        }
    }

    fn validate(&self) -> Result<()> {
        let ok = match *self {
            FlowStrategy::Credit { buffers, buf_size } => buffers >= 2 && buf_size > RECORD_HEADER,
            FlowStrategy::Rdma { ring_bytes, coalesce } => {
                ring_bytes >= 4096
                    && ring_bytes.is_power_of_two()
                    && coalesce > RECORD_HEADER
                    && coalesce <= ring_bytes / 4
            }
            FlowStrategy::Window { window, buffers } => buffers >= 1 && window > RECORD_HEADER,
            FlowStrategy::Polled { ring_bytes, coalesce } => {
                (4096..=fc::MAX_POLLED_RING as usize).contains(&ring_bytes)
                    && ring_bytes.is_power_of_two()
                    && coalesce > RECORD_HEADER
                    && coalesce <= fc::frame_body_max(ring_bytes as u64)
            }
        };
        if ok {
            Ok(())
        } else {
            Err(VerbsError::invalid(format!("flow strategy {self:?} out of range")))
        }
    }

    fn code(&self) -> (u8, u64, u64) {
        match *self {
            FlowStrategy::Credit { buffers, buf_size } => (1, buffers as u64, buf_size as u64),
            FlowStrategy::Rdma { ring_bytes, coalesce } => (2, ring_bytes as u64, coalesce as u64),
            FlowStrategy::Window { window, buffers } => (3, buffers as u64, window as u64),
            FlowStrategy::Polled { ring_bytes, coalesce } => (4, ring_bytes as u64, coalesce as u64),
        }
    }

    /// Sends outstanding at most (staging buffers of one pipe end).
    fn send_slots(&self) -> usize {
        match self {
            FlowStrategy::Rdma { .. } => 4,
            FlowStrategy::Polled { .. } => 8,
            _ => 16,
        }
    }

    /// Sends that may go straight to the transport while earlier ones are outstanding (the
    /// window strategy also stops at the peer's receive buffers; later messages coalesce).
    fn straight_sends(&self) -> usize {
        match *self {
            FlowStrategy::Window { buffers, .. } => (buffers as usize).min(self.send_slots()),
            _ => self.send_slots(),
        }
    }

    /// Bytes of one staging buffer.
    fn send_slot_bytes(&self) -> usize {
        match *self {
            FlowStrategy::Credit { buf_size, .. } => buf_size,
            FlowStrategy::Rdma { ring_bytes, .. } => ring_bytes / 4,
            FlowStrategy::Window { window, .. } => window,
            FlowStrategy::Polled { ring_bytes, .. } => ring_bytes / 4,
        }
    }

    /// Memory one pipe end registers: receive buffers or ring, send staging, setup.
    pub fn memory_per_end(&self) -> usize {
        let recv = match *self {
            FlowStrategy::Credit { buffers, buf_size } => buffers as usize * buf_size,
            FlowStrategy::Rdma { ring_bytes, .. } => ring_bytes,
            FlowStrategy::Window { window, buffers } => buffers as usize * window,
            FlowStrategy::Polled { ring_bytes, .. } => ring_bytes,
        };
        recv + self.send_slots() * self.send_slot_bytes() + 2 * SETUP_BYTES + 16
    }
}

/// Options of a pipe end.
#[derive(Clone, Default)]
pub struct PipeOptions {
    /// Bytes of this end's inbound bulk ring (0: none). The bulk lane carries large data in
    /// chunks of up to a quarter of the peer's ring, RDMA-written straight from the sender's
    /// registered memory (one copy in, one copy out, pipelined across the two ends), in order
    /// with the pipe's messages. Under the credit strategy each chunk costs a credit (its
    /// notification consumes a posted buffer, given back at once). See
    /// [`MsgPipe::try_send_bulk`].
    pub bulk_ring: usize,
    /// Stage outgoing messages in this pool instead of a pool of the pipe's own. Shared by
    /// many pipes, it keeps send-side memory constant however many peers there are; a pipe
    /// whose message finds the pool empty reports flow control (`try_send` returns false).
    /// Its buffers must hold the strategy's largest transfer.
    pub send_pool: Option<Arc<BufferPool>>,
    /// Polled strategy: post every frame as an RDMA write, as on a NIC, even where the
    /// provider maps the peer's ring for plain stores (by default frames are stored through
    /// such a [`RemoteWindow`] while nothing posted is in flight: no request, no completion,
    /// no queue-pair lock). For tests and measurements of the posted path.
    pub posted_frames: bool,
}

/// Counters of a pipe end.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PipeStats {
    /// Messages accepted by `try_send`.
    pub sent: u64,
    /// Messages delivered to the application.
    pub received: u64,
    /// Payload bytes received.
    pub received_bytes: u64,
    /// Receive-buffer bytes those messages occupied (whole buffers, or ring bytes with headers
    /// and skipped tails): `received_bytes / buffer_bytes` is the buffer utilization.
    pub buffer_bytes: u64,
    /// Transfers (sends or RDMA chunks) posted for application data.
    pub transfers: u64,
    /// Explicit credit or acknowledgement messages.
    pub control: u64,
    /// Times `try_send` had to refuse for lack of credits, ring space or queue slots.
    pub blocked: u64,
}

impl PipeStats {
    /// Receive-buffer utilization (payload bytes over buffer bytes used), 0..1.
    pub fn utilization(&self) -> f64 {
        if self.buffer_bytes == 0 {
            0.0
        } else {
            self.received_bytes as f64 / self.buffer_bytes as f64
        }
    }
}

/// Which lane a received message came by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lane {
    /// A message of the flow-controlled message path (`try_send`).
    Message,
    /// A chunk of the bulk lane (`try_send_bulk`).
    Bulk,
}

/// Immediate-data bit marking a bulk-lane chunk (bit 31 marks a wrapped chunk, the low 30
/// bits carry the length).
const IMM_BULK: u32 = 1 << 30;
const IMM_WRAPPED: u32 = 1 << 31;
const IMM_LEN: u32 = IMM_BULK - 1;
/// The immediate of a wake-up (polled strategy): a completion for a receiver that said it
/// sleeps, raised for a frame it has not seen.
const IMM_WAKE: u32 = u32::MAX;
/// Largest bulk ring (chunk lengths must fit the immediate's 30 bits).
const MAX_BULK_RING: usize = 1 << 30;

/// Write-with-immediate notifications kept posted (RDMA strategy; wake-ups, polled strategy).
const NOTIFY_RECEIVES: u32 = 64;
const SETUP_BYTES: usize = 128;
/// Setup payload: strategy code (8 bytes), then nine u64 (two strategy parameters, message
/// ring address and key, acknowledgement slots address and key, bulk ring address, key, size).
const SETUP_PAYLOAD: usize = 80;

const TAG_SHIFT: u32 = 56;
const TAG_SETUP_SEND: u64 = 1;
const TAG_DATA_SEND: u64 = 2;
const TAG_SETUP_RECV: u64 = 4;
const TAG_DATA_RECV: u64 = 5;
const TAG_NOTIFY_RECV: u64 = 6;
const TAG_USER: u64 = 7;
const TAG_INLINE_SEND: u64 = 8;

/// Largest record (header and payload) sent inline, straight from the caller's bytes.
const INLINE_MAX: usize = 256;

/// An inline send is signaled once this many (itself included) went since the last signaled
/// one, or when it fills the send window; the completion of a signaled send covers every
/// send before it. While a signaled send is in flight, the sender's polls read the peer's
/// consumer counter, and the peer's next write of it must take the cache line back before
/// anything the peer stores after it (its reply) can be seen: a cross-core transfer, hidden
/// behind the peer's work when transfers are quick, on the ping-pong's path when they are
/// slow (as between sockets, or in this VM's slow phases).
const SIGNAL_EVERY: usize = 8;
/// Most frames a progress pass takes in from a polled ring.
const FRAMES_PER_PASS: usize = 32;
/// A polled pipe's empty [`MsgPipe::front`] calls per full progress pass.
const PROGRESS_EVERY: u32 = 8;
/// Progress passes with unsignaled sends pending and no send since, after which a signaled
/// empty RDMA write is posted behind them so that their completion becomes known (`idle`).
const SETTLE_AFTER_PASSES: u32 = 256;

fn wr_id(tag: u64, low: u64) -> u64 {
    tag << TAG_SHIFT | low
}

/// The `wr_id` of a staged send: its buffer's index, and how many sends its completion
/// covers (itself and the unsignaled ones before it).
fn staged_wr_id(index: u32, covers: usize) -> u64 {
    wr_id(TAG_DATA_SEND, index as u64 | (covers as u64) << 32)
}

/// Where received messages live until the application reads them.
#[derive(Clone, Copy)]
enum ChunkStore {
    /// A receive buffer (its index in the pool, and where it lies), reposted when all its
    /// messages are read.
    Buf { index: u32, base: *const u8 },
    /// Ring bytes, acknowledged when all its messages are read (position after the chunk).
    /// A bulk chunk announced in a polled frame also releases that frame (`frame_end`, the
    /// message-ring position after it; 0 if none).
    Ring { base: *const u8, end_pos: u64, lane: Lane, frame_end: u64 },
}

/// A received chunk whose messages are not all read. Their ranges wait in the pipe's one
/// queue of messages (`MsgPipe::msgs`), in order: a chunk is small to queue and to take off,
/// and needs no list of its own (nearly every chunk holds one message).
#[derive(Clone, Copy)]
struct Chunk {
    store: ChunkStore,
    /// Its messages not yet released.
    left: u32,
}

struct PeerRing {
    addr: u64,
    rkey: u32,
}

/// Offsets in `ack_mr`: where the peer writes how much of our message ring / bulk ring it
/// consumed, and the 8 bytes we write our own acknowledgements from; where a polled peer
/// says it sleeps (its announcement number in the high half, the low half of the ring
/// position it waits at in the low half), and the 8 bytes we say it from; where the peer
/// writes the count it released ([`MsgPipe::release_to`]), and the 8 bytes we write ours from.
const ACK_RING: usize = 0;
const ACK_RING_SRC: usize = 8;
const ACK_BULK: usize = 16;
const ACK_BULK_SRC: usize = 24;
const ACK_SLEEP: usize = 32;
const ACK_SLEEP_SRC: usize = 40;
const ACK_RELEASE: usize = 48;
const ACK_RELEASE_SRC: usize = 56;
/// Where the peer writes its latest notice ([`MsgPipe::notice_to`]), and the bytes we write
/// ours from: [`NOTICE_WORDS`] words, the last one (its count) placed last.
const ACK_NOTICE: usize = 64;
const ACK_NOTICE_SRC: usize = 96;
const ACK_BYTES: usize = 128;
/// Words of a notice.
pub const NOTICE_WORDS: usize = 4;

/// Reads the words of our polled ring as the peer's writes land in it (empty when the pipe
/// has no ring).
#[derive(Clone, Copy)]
struct RingView {
    base: *const u8,
    len: usize,
}

impl fc::RingWords for RingView {
    #[inline]
    fn word(&self, off: u64) -> u64 {
        let off = off as usize;
        assert!(off.is_multiple_of(8) && off + 8 <= self.len, "ring word {off} outside the ring");
        // SAFETY: an 8-aligned word inside the ring (registered memory of ours, page-aligned,
        // alive with the pipe), asserted above. The peer's RDMA writes store into it
        // concurrently: an atomic load sees the old word or the new one, never a torn one.
        let word = unsafe { std::sync::atomic::AtomicU64::from_ptr(self.base.add(off) as *mut u64) };
        u64::from_le(word.load(std::sync::atomic::Ordering::Acquire))
    }
}

/// Reads the latest notice the peer of a pipe sent ([`MsgPipe::notice_to`]): all zero before
/// the first. The last word is read first: a notice whose last word has changed is complete.
#[derive(Clone)]
pub struct NoticeBoard {
    slots: Arc<MemoryRegion>,
}

impl NoticeBoard {
    /// The notice's last word alone (one load: what a caller compares with the last one it saw).
    #[inline]
    pub fn last_word(&self) -> u64 {
        self.slots.read_u64(ACK_NOTICE + 8 * (NOTICE_WORDS - 1))
    }

    /// The whole latest notice.
    pub fn read(&self) -> [u64; NOTICE_WORDS] {
        let mut w = [0u64; NOTICE_WORDS];
        w[NOTICE_WORDS - 1] = self.last_word();
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        for (i, x) in w.iter_mut().take(NOTICE_WORDS - 1).enumerate() {
            *x = self.slots.read_u64(ACK_NOTICE + 8 * i);
        }
        w
    }
}

/// A flow-controlled message pipe.
pub struct MsgPipe {
    qp: QueuePair,
    cq: CompletionQueue,
    strategy: FlowStrategy,
    recv_pool: Option<Arc<BufferPool>>,
    send_pool: Arc<BufferPool>,
    setup_mr: MemoryRegion,
    ring: Option<MemoryRegion>,
    /// Where `ring` lies, kept at hand for the receiver's polls.
    ring_words: RingView,
    /// The slots where the peer writes how much of our rings it consumed, and the bytes we
    /// write our acknowledgements from (`ACK_*` offsets). Shared with [`NoticeBoard`]s.
    ack_mr: Arc<MemoryRegion>,
    peer_ring: Option<PeerRing>,
    /// Polled strategy: the peer's ring mapped for plain stores, where the provider can
    /// ([`QueuePair::map_remote_write`]). Frames go through it while nothing posted on the
    /// queue pair is in flight (a window's writes are not ordered with posted requests).
    ring_window: Option<RemoteWindow>,
    /// Whether frames may go through `ring_window` (not [`PipeOptions::posted_frames`]).
    direct_frames: bool,
    /// The peer's acknowledgement slots mapped for plain stores, where the provider can (and
    /// `direct_frames`): [`MsgPipe::release_to`] writes through it.
    ack_window: Option<RemoteWindow>,
    /// Our inbound bulk ring, and the peer's (None: that direction has no bulk lane).
    bulk_ring: Option<MemoryRegion>,
    peer_bulk: Option<PeerRing>,
    bulk_tx: RingSender,
    bulk_rx: RingReceiver,
    /// Bulk chunks are written with the [`SendFlags::streaming`] hint.
    bulk_streaming: bool,
    peer_bulk_ack_seen: u64,
    /// The peer's acknowledgement slots (address and key of its `ack_mr`).
    peer_acks: Option<(u64, u32)>,
    credits: Credits,
    ring_tx: RingSender,
    ring_rx: RingReceiver,
    coalescer: Coalescer,
    inbox: VecDeque<Chunk>,
    /// (offset from its chunk's base, length) of every message of `inbox`'s chunks, in order.
    msgs: VecDeque<(usize, usize)>,
    /// Sends posted whose completion is not known yet (their own, or that of a later
    /// signaled send).
    outstanding: usize,
    /// Sends posted unsignaled since the last signaled one.
    unsignaled: usize,
    /// Progress passes since the last send, while `unsignaled` > 0.
    unsettled_passes: u32,
    /// Records up to this size go inline (the queue pair's limit, at most `INLINE_MAX`; 0 if
    /// it takes a single SGE per send).
    inline_max: usize,
    peer_ack_seen: u64,
    /// Polled strategy: our sleep announcements so far, and the peer's latest one we
    /// answered (0: none).
    sleeps_announced: u32,
    peer_sleep_answered: u64,
    /// A sleep was announced since the last full progress pass: the peer's wake-up may be
    /// waiting in the completion queue, and until it is taken the peer's later requests
    /// complete behind it (in order), which holds its send window.
    reap_wake: bool,
    /// Polled strategy: [`MsgPipe::front`] calls that found nothing (see
    /// [`MsgPipe::progress_due`]).
    empty_fronts: u32,
    failed: Option<String>,
    stats: PipeStats,
    wcs: Vec<WorkCompletion>,
    /// Receive buffers read and not yet posted again (by the next `progress`).
    freed: smallvec::SmallVec<[u32; 8]>,
    /// Completions of requests posted through `post_user`, by token.
    user_done: std::collections::HashMap<u64, WcStatus>,
    /// Staging buffers of framed bulk chunks in flight, by token.
    bulk_staging: smallvec::SmallVec<[(u64, u32); 4]>,
    next_user: u64,
    /// Requests posted through `post_user` whose completion has not come.
    user_in_flight: usize,
}

// SAFETY: the raw pointers in `ChunkStore` point into `ring`, `bulk_ring` or the receive
// pool's memory, all owned by the pipe.
unsafe impl Send for MsgPipe {}

fn fc_err(e: FcError) -> VerbsError {
    VerbsError::Protocol(format!("flow control: {e}"))
}

impl MsgPipe {
    /// Sets up a pipe on a connected queue pair (in RTS, with `cq` as its completion queue for
    /// both sides and nothing posted yet). Both ends call this with the same strategy; the
    /// setup exchange checks they agree. Waits at most `timeout` for the peer.
    pub fn establish(
        qp: QueuePair,
        cq: CompletionQueue,
        pd: &ProtectionDomain,
        strategy: FlowStrategy,
        timeout: Duration,
    ) -> Result<MsgPipe> {
        Self::establish_with(qp, cq, pd, strategy, PipeOptions::default(), timeout)
    }

    /// [`MsgPipe::establish`] with options (a shared send pool).
    pub fn establish_with(
        qp: QueuePair,
        cq: CompletionQueue,
        pd: &ProtectionDomain,
        strategy: FlowStrategy,
        options: PipeOptions,
        timeout: Duration,
    ) -> Result<MsgPipe> {
        strategy.validate()?;
        let ring = options.bulk_ring;
        if ring > 0 && (!(4096..=MAX_BULK_RING).contains(&ring) || !ring.is_power_of_two()) {
            return Err(VerbsError::invalid(format!("bulk ring of {ring} bytes: a power of two from 4 KiB to 1 GiB")));
        }
        let setup_mr = pd.alloc(2 * SETUP_BYTES, AccessFlags::LOCAL_WRITE)?;
        let ack_mr = Arc::new(pd.alloc(ACK_BYTES, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?);
        let bulk_ring = match options.bulk_ring {
            0 => None,
            n => Some(pd.alloc(n, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?),
        };
        let (recv_pool, ring) = match strategy {
            FlowStrategy::Credit { buffers, buf_size } => {
                (Some(BufferPool::new(pd, buf_size, buffers as usize, AccessFlags::LOCAL_WRITE)?), None)
            }
            FlowStrategy::Window { window, buffers } => {
                (Some(BufferPool::new(pd, window, buffers as usize, AccessFlags::LOCAL_WRITE)?), None)
            }
            FlowStrategy::Rdma { ring_bytes, .. } | FlowStrategy::Polled { ring_bytes, .. } => {
                (None, Some(pd.alloc(ring_bytes, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?))
            }
        };
        let send_slot = strategy.send_slot_bytes();
        let send_pool = match options.send_pool {
            Some(p) if p.buf_size() >= send_slot => p,
            Some(p) => {
                return Err(VerbsError::invalid(format!(
                    "shared send pool buffers of {} bytes cannot hold this strategy's {send_slot}-byte transfers",
                    p.buf_size()
                )))
            }
            None => BufferPool::new(pd, send_slot, strategy.send_slots(), AccessFlags::NONE)?,
        };
        let (credits_n, ring_n) = match strategy {
            FlowStrategy::Credit { buffers, .. } => (buffers as u64, 1u64),
            FlowStrategy::Rdma { ring_bytes, .. } | FlowStrategy::Polled { ring_bytes, .. } => (0, ring_bytes as u64),
            FlowStrategy::Window { buffers, .. } => (buffers as u64, 1),
        };
        // Inline records gather a header and a payload: two SGEs.
        let caps = qp.caps();
        let inline_max = if caps.max_send_sge >= 2 { (caps.max_inline_data as usize).min(INLINE_MAX) } else { 0 };
        let mut pipe = MsgPipe {
            qp,
            cq,
            strategy,
            recv_pool,
            send_pool,
            setup_mr,
            ring_words: RingView {
                base: ring.as_ref().map_or(std::ptr::null(), |r| r.as_ptr()),
                len: ring.as_ref().map_or(0, |r| r.len()),
            },
            ring,
            ack_mr,
            peer_ring: None,
            ring_window: None,
            direct_frames: !options.posted_frames,
            ack_window: None,
            bulk_rx: RingReceiver::new(options.bulk_ring as u64),
            bulk_ring,
            peer_bulk: None,
            bulk_tx: RingSender::new(1),
            bulk_streaming: false,
            peer_bulk_ack_seen: 0,
            peer_acks: None,
            credits: Credits::new(credits_n),
            ring_tx: RingSender::new(ring_n),
            ring_rx: RingReceiver::new(ring_n),
            coalescer: Coalescer::default(),
            inbox: VecDeque::new(),
            msgs: VecDeque::new(),
            outstanding: 0,
            unsignaled: 0,
            unsettled_passes: 0,
            inline_max,
            peer_ack_seen: 0,
            sleeps_announced: 0,
            peer_sleep_answered: 0,
            reap_wake: false,
            empty_fronts: 0,
            failed: None,
            stats: PipeStats::default(),
            wcs: vec![WorkCompletion::EMPTY; 32],
            freed: smallvec::SmallVec::new(),
            user_done: std::collections::HashMap::new(),
            user_in_flight: 0,
            bulk_staging: smallvec::SmallVec::new(),
            next_user: 0,
        };
        pipe.setup(timeout)?;
        Ok(pipe)
    }

    fn setup(&mut self, timeout: Duration) -> Result<()> {
        // The setup receive first: receives are consumed in order, so it gets the peer's setup.
        self.qp.post_recv(&[RecvWr::new(wr_id(TAG_SETUP_RECV, 0), &[self.setup_mr.sge(SETUP_BYTES, SETUP_BYTES)])])?;
        match self.strategy {
            FlowStrategy::Credit { buffers, .. } | FlowStrategy::Window { buffers, .. } => {
                let pool = self.recv_pool.clone().expect("receive pool");
                for _ in 0..buffers {
                    self.post_data_recv(pool.acquire_index().expect("fresh pool"))?;
                }
            }
            FlowStrategy::Rdma { .. } | FlowStrategy::Polled { .. } => {
                for _ in 0..NOTIFY_RECEIVES {
                    self.qp.post_recv(&[RecvWr::new(wr_id(TAG_NOTIFY_RECV, 0), &[])])?;
                }
            }
        }
        let (code, p1, p2) = self.strategy.code();
        let (ring_addr, ring_rkey) = self.ring.as_ref().map(|r| (r.addr(), r.rkey())).unwrap_or((0, 0));
        let (bulk_addr, bulk_rkey, bulk_len) =
            self.bulk_ring.as_ref().map(|r| (r.addr(), r.rkey(), r.len() as u64)).unwrap_or((0, 0, 0));
        let mut payload = Vec::with_capacity(SETUP_PAYLOAD);
        payload.push(code);
        payload.extend_from_slice(&[0; 7]);
        for v in [
            p1,
            p2,
            ring_addr,
            ring_rkey as u64,
            self.ack_mr.addr(),
            self.ack_mr.rkey() as u64,
            bulk_addr,
            bulk_rkey as u64,
            bulk_len,
        ] {
            payload.extend_from_slice(&v.to_le_bytes());
        }
        let rec = Record { kind: RecordKind::Setup, credits: 0, len: payload.len() as u32, ack: 0 };
        self.setup_mr.write(0, &rec.encode());
        self.setup_mr.write(RECORD_HEADER, &payload);
        let len = RECORD_HEADER + payload.len();
        self.qp.post_send(&[SendWr::send(wr_id(TAG_SETUP_SEND, 0), &[self.setup_mr.sge(0, len)])])?;
        let deadline = Instant::now() + timeout;
        let (mut got_setup, mut sent_setup) = (false, false);
        // Data may follow the peer's setup before our own setup send has completed.
        let mut early = Vec::new();
        while !(got_setup && sent_setup) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(VerbsError::PeerUnreachable("pipe setup: the peer did not answer in time".into()));
            }
            let n = self.cq.poll_blocking(&mut self.wcs, left)?;
            for i in 0..n {
                let wc = self.wcs[i];
                if wc.status != WcStatus::Success {
                    return Err(VerbsError::PeerUnreachable(format!("pipe setup failed: {wc:?}")));
                }
                match wc.wr_id >> TAG_SHIFT {
                    TAG_SETUP_SEND => sent_setup = true,
                    TAG_SETUP_RECV => {
                        self.accept_setup(wc.byte_len as usize)?;
                        got_setup = true;
                    }
                    TAG_DATA_RECV | TAG_NOTIFY_RECV if got_setup => early.push(wc),
                    _ => return Err(VerbsError::Protocol("pipe setup: data before the setup exchange".into())),
                }
            }
        }
        for wc in early {
            self.handle_completion(wc)?;
        }
        Ok(())
    }

    fn accept_setup(&mut self, len: usize) -> Result<()> {
        let mut b = vec![0u8; len.min(SETUP_BYTES)];
        self.setup_mr.read(SETUP_BYTES, &mut b);
        let recs = fc::parse_chunk(&b).map_err(fc_err)?;
        let [(rec, range)] = recs.as_slice() else {
            return Err(VerbsError::Protocol("pipe setup: expected exactly one record".into()));
        };
        let p = &b[range.clone()];
        if rec.kind != RecordKind::Setup || p.len() != SETUP_PAYLOAD {
            return Err(VerbsError::Protocol("pipe setup: malformed setup record".into()));
        }
        let v = |i: usize| u64::from_le_bytes(p[8 + 8 * i..16 + 8 * i].try_into().expect("8 bytes"));
        let (code, p1, p2) = self.strategy.code();
        if p[0] != code || v(0) != p1 || v(1) != p2 {
            return Err(VerbsError::Protocol(format!(
                "pipe setup: the peer uses another strategy (code {} params {} {}) than ours {:?}",
                p[0],
                v(0),
                v(1),
                self.strategy
            )));
        }
        self.peer_acks = Some((v(4), v(5) as u32));
        if self.direct_frames {
            // As for the ring: a refusal leaves releases posted, and checked by each write.
            self.ack_window = self.qp.map_remote_write(v(4), ACK_BYTES as u64, v(5) as u32).unwrap_or_else(|e| {
                log::debug!("pipe: releases go as posted writes, the peer's slots do not map: {e}");
                None
            });
        }
        if code == 2 || code == 4 {
            self.peer_ring = Some(PeerRing { addr: v(2), rkey: v(3) as u32 });
            if code == 4 && self.direct_frames {
                self.map_peer_ring()?;
            }
        }
        let bulk_len = v(8);
        if bulk_len > 0 {
            if bulk_len < 4096 || bulk_len > MAX_BULK_RING as u64 || !bulk_len.is_power_of_two() {
                return Err(VerbsError::Protocol(format!("pipe setup: bulk ring of {bulk_len} bytes")));
            }
            self.peer_bulk = Some(PeerRing { addr: v(6), rkey: v(7) as u32 });
            self.bulk_tx = RingSender::new(bulk_len);
        }
        Ok(())
    }

    /// Posts message buffer `index` (receive buffers live by index: always posted or holding
    /// received messages, never in the pool's free list).
    fn post_data_recv(&mut self, index: u32) -> Result<()> {
        let pool = self.recv_pool.as_ref().ok_or_else(|| VerbsError::Protocol("no message buffers".into()))?;
        let sge = pool.sge_full_of(index)?;
        self.qp.post_recv(&[RecvWr::new(wr_id(TAG_DATA_RECV, index as u64), &[sge])])
    }

    /// Posts the receive buffers read since the last call, in one request list.
    fn post_freed(&mut self) -> Result<()> {
        if self.freed.is_empty() {
            return Ok(());
        }
        let pool = self.recv_pool.as_ref().ok_or_else(|| VerbsError::Protocol("no message buffers".into()))?;
        let mut wrs: smallvec::SmallVec<[RecvWr; 8]> = smallvec::SmallVec::new();
        for &index in &self.freed {
            wrs.push(RecvWr::new(wr_id(TAG_DATA_RECV, index as u64), &[pool.sge_full_of(index)?]));
        }
        if let FlowStrategy::Credit { .. } = self.strategy {
            for _ in 0..self.freed.len() {
                self.credits.on_buffer_freed();
            }
        }
        self.freed.clear();
        self.qp.post_recv(&wrs)
    }

    /// The strategy.
    pub fn strategy(&self) -> FlowStrategy {
        self.strategy
    }

    /// Counters.
    pub fn stats(&self) -> PipeStats {
        self.stats
    }

    /// The underlying queue pair.
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }

    fn check_failed(&self) -> Result<()> {
        match &self.failed {
            Some(why) => Err(VerbsError::Protocol(why.clone())),
            None => Ok(()),
        }
    }

    fn fail(&mut self, e: VerbsError) -> VerbsError {
        if self.failed.is_none() {
            self.failed = Some(e.to_string());
            let _ = self.qp.modify(QpTransition::Error);
        }
        e
    }

    /// Offers a message; `Ok(false)` if flow control holds it back now (call
    /// [`MsgPipe::progress`] and retry). The bytes are copied before it returns.
    pub fn try_send(&mut self, msg: &[u8]) -> Result<bool> {
        self.check_failed()?;
        if msg.len() > self.strategy.max_message() {
            return Err(VerbsError::invalid(format!(
                "message of {} bytes over the pipe's {} (larger data goes by rendezvous)",
                msg.len(),
                self.strategy.max_message()
            )));
        }
        if self.outstanding >= self.strategy.send_slots() {
            // The send window looks full, perhaps only because its completions were not taken
            // (a polled reader's passes do not look): take them before holding the message
            // back, or staging it for a flush only a later call would make.
            if let Err(e) = self.poll_completions() {
                return Err(self.fail(e));
            }
        }
        let accepted = match self.strategy {
            FlowStrategy::Credit { .. } => {
                if !self.credits.can_send_data()
                    || self.outstanding >= self.strategy.send_slots()
                    || self.send_pool.stats().in_use >= self.send_pool.capacity()
                {
                    false
                } else {
                    let grant = self.credits.on_send();
                    let rec = Record { kind: RecordKind::Data, credits: grant, len: msg.len() as u32, ack: 0 };
                    self.send_record(rec, msg)?;
                    true
                }
            }
            FlowStrategy::Window { window, .. } => {
                let rec = Record { kind: RecordKind::Data, credits: 0, len: msg.len() as u32, ack: 0 };
                // The first N/W segments go straight to the transport; what comes while they are
                // outstanding is coalesced and sent as one segment at the next completion.
                let pool_free = self.send_pool.stats().in_use < self.send_pool.capacity();
                if pool_free && self.outstanding < self.strategy.straight_sends() && self.coalescer.is_empty() {
                    self.send_record(rec, msg)?;
                    true
                } else {
                    // Queued behind outstanding segments: coalesce until a completion.
                    self.coalescer.push(rec, msg, window)
                }
            }
            FlowStrategy::Rdma { coalesce, .. } => {
                // The acknowledgement rides on the record only if the record is taken.
                let ack = self.ring_rx.ack_due();
                let rec = Record { kind: RecordKind::Data, credits: 0, len: msg.len() as u32, ack };
                let max = coalesce.max(RECORD_HEADER + msg.len());
                let taken = if self.coalescer.push(rec, msg, max) {
                    if self.outstanding == 0 || self.coalescer.len() >= coalesce {
                        self.flush_ring()?;
                    }
                    true
                } else {
                    self.flush_ring()?;
                    self.coalescer.push(rec, msg, max)
                };
                if taken {
                    self.ring_rx.acked_to(ack);
                }
                taken
            }
            FlowStrategy::Polled { coalesce, .. } => {
                let ack = self.ring_rx.ack_due();
                let rec = Record { kind: RecordKind::Data, credits: 0, len: msg.len() as u32, ack };
                // Alone in its frame, straight from the caller's bytes, unless earlier messages
                // wait or it is large; then batched (what waits goes first).
                let taken = if self.coalescer.is_empty() && self.write_frame_inline(rec, msg)? {
                    true
                } else {
                    let max = coalesce.max(RECORD_HEADER + msg.len());
                    let pushed = self.coalescer.push(rec, msg, max);
                    self.flush_frames()?;
                    pushed || self.coalescer.push(rec, msg, max)
                };
                if taken {
                    self.ring_rx.acked_to(ack);
                }
                taken
            }
        };
        if accepted {
            self.stats.sent += 1;
        } else {
            self.stats.blocked += 1;
        }
        Ok(accepted)
    }

    /// Sends one record (credit and window strategies): inline when it is small (the
    /// transport gathers header and payload at post: no staging buffer to take and give back,
    /// no key checks, no copy of ours), else from a staging buffer.
    fn send_record(&mut self, rec: Record, payload: &[u8]) -> Result<()> {
        let len = RECORD_HEADER + payload.len();
        if len <= self.inline_max {
            let header = rec.encode();
            let sges = [
                Sge { addr: header.as_ptr() as u64, length: RECORD_HEADER as u32, lkey: 0 },
                Sge { addr: payload.as_ptr() as u64, length: payload.len() as u32, lkey: 0 },
            ];
            let sges = if payload.is_empty() { &sges[..1] } else { &sges[..] };
            self.post_inline_counted(SendWr::send(0, sges))?;
            self.stats.transfers += 1;
            return Ok(());
        }
        let mut b = self.send_pool.try_acquire().ok_or_else(|| VerbsError::Exhausted("pipe send pool".into()))?;
        b.push(&rec.encode());
        b.push(payload);
        self.post_staged(b)
    }

    /// Posts an inline request (a send, or a frame's write) in the send window: signaled once
    /// every `SIGNAL_EVERY`, or when it fills the window.
    #[inline]
    fn post_inline_counted(&mut self, wr: SendWr) -> Result<()> {
        self.post_counted(|qp, wr_id, signaled| {
            let mut wr = wr.inline(true).signaled(signaled);
            wr.wr_id = wr_id;
            qp.post_send(&[wr])
        })
    }

    /// Posts one inline send with `post(qp, wr_id, signaled)`, signaled as
    /// [`MsgPipe::post_inline_counted`] says.
    #[inline]
    fn post_counted(&mut self, post: impl FnOnce(&QueuePair, u64, bool) -> Result<()>) -> Result<()> {
        let covers = self.unsignaled + 1;
        let signaled = covers >= SIGNAL_EVERY || self.outstanding + 1 >= self.strategy.straight_sends();
        post(&self.qp, wr_id(TAG_INLINE_SEND, covers as u64), signaled)?;
        self.unsignaled = if signaled { 0 } else { covers };
        self.unsettled_passes = 0;
        self.outstanding += 1;
        Ok(())
    }

    /// Writes one record as a frame of its own, inline from the caller's bytes (polled
    /// strategy); false if it is too large to go inline, or the ring or the send window has
    /// no room now.
    fn write_frame_inline(&mut self, rec: Record, payload: &[u8]) -> Result<bool> {
        let body = RECORD_HEADER + payload.len();
        let written = fc::frame_written(body);
        let direct = self.direct_now();
        if !direct && (written > self.inline_max || self.outstanding >= self.strategy.send_slots()) {
            return Ok(false);
        }
        let reserved = fc::frame_reserved(body);
        let Some(place) = self.ring_tx.reserve(reserved) else { return Ok(false) };
        let Some((peer_addr, rkey)) = self.peer_ring.as_ref().map(|p| (p.addr, p.rkey)) else {
            self.ring_tx.unreserve();
            return Err(VerbsError::Protocol("a frame before setup".into()));
        };
        // Written from its parts, with no staging copy: the publish word and the record header
        // from one small array, the payload from where it lies, the padding and the closing
        // word from another.
        let (word, pad) = fc::frame_framing(self.ring_tx.sent() - reserved, body);
        let mut head = [0u8; 8 + RECORD_HEADER];
        head[..8].copy_from_slice(&word);
        head[8..].copy_from_slice(&rec.encode());
        let mut tail = [0u8; 16];
        tail[pad.len()..pad.len() + 8].copy_from_slice(&word);
        let parts: [&[u8]; 3] = [&head, payload, &tail[..pad.len() + 8]];
        if direct {
            let window = self.ring_window.as_ref().expect("direct_now checked");
            let stored = window.write(place.offset as usize, &parts);
            self.frame_stored(stored)?;
            return Ok(true);
        }
        let addr = peer_addr + place.offset;
        let posted =
            self.post_counted(|qp, wr_id, signaled| qp.post_write_inline_list(wr_id, &parts, addr, rkey, signaled));
        if let Err(e) = posted {
            self.ring_tx.unreserve();
            return Err(e);
        }
        self.stats.transfers += 1;
        self.after_frame()?;
        Ok(true)
    }

    /// Writes what is coalesced as one frame from a staging buffer (polled strategy), if the
    /// ring, the send window and the staging pool have room.
    fn flush_frames(&mut self) -> Result<()> {
        let direct = self.direct_now();
        if self.coalescer.is_empty() || (!direct && self.outstanding >= self.strategy.send_slots()) {
            return Ok(());
        }
        let body = self.coalescer.len();
        let reserved = fc::frame_reserved(body);
        let Some(place) = self.ring_tx.reserve(reserved) else {
            return Ok(()); // no ring space until the peer acknowledges
        };
        if direct {
            let (word, pad) = fc::frame_framing(self.ring_tx.sent() - reserved, body);
            let window = self.ring_window.as_ref().expect("direct_now checked");
            let stored = window.write(place.offset as usize, &[&word, self.coalescer.bytes(), pad, &word]);
            self.coalescer.clear();
            return self.frame_stored(stored);
        }
        let Some(mut b) = self.send_pool.try_acquire() else {
            self.ring_tx.unreserve();
            return Ok(());
        };
        let (word, pad) = fc::frame_framing(self.ring_tx.sent() - reserved, body);
        b.push(&word);
        b.push(self.coalescer.bytes());
        b.push(pad);
        b.push(&word);
        self.coalescer.clear();
        let peer = self.peer_ring.as_ref().ok_or_else(|| VerbsError::Protocol("a frame before setup".into()))?;
        let sge = b.sge();
        let inline = sge.length as usize <= self.inline_max;
        let id = staged_wr_id(b.into_index(), self.unsignaled + 1);
        self.qp.post_send(&[SendWr::write(id, &[sge], peer.addr + place.offset, peer.rkey).inline(inline)])?;
        self.unsignaled = 0;
        self.outstanding += 1;
        self.stats.transfers += 1;
        self.after_frame()
    }

    /// After a frame is written (polled strategy): answers the peer if it said it sleeps. The
    /// fence orders the frame's stores before the read of the peer's word, as the peer orders
    /// its word before its last look at the ring ([`MsgPipe::prepare_sleep`]): one of the two
    /// sees the other. (That holds where a write lands when posted, as the software provider's
    /// into provider memory do; elsewhere the sleeper's bounded sleep is the backstop.)
    #[inline]
    fn after_frame(&mut self) -> Result<()> {
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        self.answer_peer_sleep()
    }

    /// Whether the next frame goes through the window onto the peer's ring: there is one, and
    /// nothing posted on the queue pair is in flight (a frame stored now could overtake it: a
    /// bulk chunk, say, that the frame announces).
    #[inline]
    fn direct_now(&self) -> bool {
        self.ring_window.is_some() && self.outstanding == 0 && self.user_in_flight == 0
    }

    /// After a frame's store through the window: counts it and does what follows every frame
    /// ([`MsgPipe::after_frame`]). A refusal (the peer deregistered its ring, or its queue
    /// pair stopped answering) fails the pipe, as a failed write's completion would.
    #[inline]
    fn frame_stored(&mut self, stored: std::result::Result<(), WcStatus>) -> Result<()> {
        if let Err(st) = stored {
            self.ring_tx.unreserve();
            return Err(self.fail(VerbsError::PeerUnreachable(format!("pipe frame write failed: {st:?}"))));
        }
        self.stats.transfers += 1;
        self.after_frame()
    }

    /// Maps the peer's ring for frames written with plain stores, if the provider can. A
    /// refusal only leaves frames posted: what the peer named is checked again by each write,
    /// whose failure then fails the pipe.
    fn map_peer_ring(&mut self) -> Result<()> {
        let Some(peer) = &self.peer_ring else { return Ok(()) };
        let ring = self.ring_tx.max_chunk() * 4;
        self.ring_window = match self.qp.map_remote_write(peer.addr, ring, peer.rkey) {
            Ok(w) => w,
            Err(e) => {
                log::debug!("pipe: frames go as posted writes, the peer's ring does not map: {e}");
                None
            }
        };
        Ok(())
    }

    /// True if frames go into the peer's ring with plain stores while nothing posted is in
    /// flight (polled strategy, a provider that maps the peer's ring, and
    /// [`PipeOptions::posted_frames`] not set).
    pub fn direct_frames(&self) -> bool {
        self.ring_window.is_some()
    }

    /// If the peer said it sleeps waiting at a ring position we have written past, raises a
    /// completion for it (a zero-byte write-with-immediate), once per announcement.
    #[inline]
    fn answer_peer_sleep(&mut self) -> Result<()> {
        let said = self.ack_mr.read_u64(ACK_SLEEP);
        if said == self.peer_sleep_answered {
            return Ok(());
        }
        // Low halves of the positions: it waits at most a ring behind what we wrote.
        if (self.ring_tx.sent() as u32).wrapping_sub(said as u32) == 0 {
            return Ok(()); // it waits for our next frame: answered when that is written
        }
        self.peer_sleep_answered = said;
        let (addr, rkey) = self.peer_acks.ok_or_else(|| VerbsError::Protocol("a wake-up before setup".into()))?;
        self.post_inline_counted(SendWr::write_with_imm(0, &[], addr, rkey, IMM_WAKE))?;
        self.stats.control += 1;
        Ok(())
    }

    /// Call before sleeping on [`MsgPipe::cq`]; `Ok(false)`: a message arrived meanwhile, do
    /// not sleep. Under the polled strategy messages raise no completion: this tells the peer
    /// we sleep (an RDMA write into its acknowledgement slots) and takes a last look at the
    /// ring; the peer then raises a completion for any frame we have not seen. A sleeper that
    /// skips it still wakes at the end of its sleep, but every message then costs a whole
    /// sleep. (What was already received before the call is not looked at: call it after a
    /// look that found nothing.)
    pub fn prepare_sleep(&mut self) -> Result<bool> {
        if let FlowStrategy::Polled { .. } = self.strategy {
            // Frames this call takes in count as arrivals, those of its first pass too: the
            // caller looked before calling and found nothing.
            let before = self.ring_rx.received();
            self.progress()?;
            if !self.coalescer.is_empty() {
                // Messages of ours wait for the send window (completions the peer releases by
                // taking an earlier wake-up): sleeping now could leave both ends asleep.
                return Ok(false);
            }
            let (addr, rkey) = self.peer_acks.ok_or_else(|| VerbsError::Protocol("sleep before setup".into()))?;
            self.sleeps_announced = self.sleeps_announced.wrapping_add(1).max(1);
            let word = (self.sleeps_announced as u64) << 32 | self.ring_rx.received() as u32 as u64;
            self.ack_mr.write(ACK_SLEEP_SRC, &word.to_ne_bytes());
            let sge = self.ack_mr.sge(ACK_SLEEP_SRC, 8);
            // Mostly unsignaled: a completion of our own would end the sleep it announces (and,
            // raised while the queue is still armed from the last sleep, the next one too).
            if let Err(e) = self.post_inline_counted(SendWr::write(0, &[sge], addr + ACK_SLEEP as u64, rkey)) {
                return Err(self.fail(e));
            }
            self.stats.control += 1;
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            self.progress()?;
            self.reap_wake = true;
            return Ok(self.ring_rx.received() == before);
        }
        Ok(true)
    }

    fn post_staged(&mut self, b: PoolBuf) -> Result<()> {
        let sge = b.sge();
        let id = staged_wr_id(b.into_index(), self.unsignaled + 1);
        self.qp.post_send(&[SendWr::send(id, &[sge]).inline(sge.length <= 64)])?;
        self.unsignaled = 0;
        self.outstanding += 1;
        self.stats.transfers += 1;
        Ok(())
    }

    /// Sends what is coalesced (window: one segment; RDMA: one chunk if the ring has room).
    pub fn flush(&mut self) -> Result<()> {
        self.check_failed()?;
        match self.strategy {
            FlowStrategy::Rdma { .. } => self.flush_ring(),
            FlowStrategy::Polled { .. } => self.flush_frames(),
            FlowStrategy::Window { .. } => self.flush_window(),
            FlowStrategy::Credit { .. } => Ok(()),
        }
    }

    fn flush_window(&mut self) -> Result<()> {
        if self.coalescer.is_empty() || self.outstanding >= self.strategy.send_slots() {
            return Ok(());
        }
        let Some(mut b) = self.send_pool.try_acquire() else { return Ok(()) };
        b.push(self.coalescer.bytes());
        self.coalescer.clear();
        self.post_staged(b)
    }

    fn flush_ring(&mut self) -> Result<()> {
        if self.coalescer.is_empty() || self.outstanding >= self.strategy.send_slots() {
            return Ok(());
        }
        let len = self.coalescer.len() as u64;
        let Some(place) = self.ring_tx.reserve(len) else {
            return Ok(()); // no ring space until the peer acknowledges
        };
        let peer = self.peer_ring.as_ref().expect("set up");
        let (addr, rkey) = (peer.addr + place.offset, peer.rkey);
        let Some(mut b) = self.send_pool.try_acquire() else {
            // A shared pool ran dry: give the ring space back and retry at the next progress.
            self.ring_tx.unreserve();
            return Ok(());
        };
        b.push(self.coalescer.bytes());
        self.coalescer.clear();
        let imm = len as u32 | if place.wrapped { 1 << 31 } else { 0 };
        let sge = b.sge();
        let id = staged_wr_id(b.into_index(), self.unsignaled + 1);
        self.qp.post_send(&[SendWr::write_with_imm(id, &[sge], addr, rkey, imm)])?;
        self.unsignaled = 0;
        self.outstanding += 1;
        self.stats.transfers += 1;
        Ok(())
    }

    /// Drives completions: frees send slots, takes in received chunks, returns credits and
    /// acknowledgements. Never blocks.
    pub fn progress(&mut self) -> Result<()> {
        self.check_failed()?;
        match self.progress_inner() {
            Ok(()) => Ok(()),
            Err(e) => Err(self.fail(e)),
        }
    }

    fn progress_inner(&mut self) -> Result<()> {
        self.reap_wake = false;
        self.post_freed()?;
        if self.unsignaled > 0 {
            self.unsettled_passes += 1;
            if self.unsettled_passes >= SETTLE_AFTER_PASSES {
                self.settle()?;
            }
        }
        if let FlowStrategy::Polled { .. } = self.strategy {
            self.poll_frames(FRAMES_PER_PASS)?;
        }
        self.poll_completions()?;
        if let FlowStrategy::Rdma { .. } | FlowStrategy::Polled { .. } = self.strategy {
            let acked = self.ack_mr.read_u64(ACK_RING);
            if acked != self.peer_ack_seen {
                self.peer_ack_seen = acked;
                self.ring_tx.on_ack(acked).map_err(fc_err)?;
            }
            if self.ring_rx.needs_ack() {
                self.write_ack(Lane::Message)?;
            }
            if let FlowStrategy::Polled { .. } = self.strategy {
                self.flush_frames()?;
                self.answer_peer_sleep()?;
            } else {
                self.flush_ring()?;
            }
        }
        if let FlowStrategy::Window { .. } = self.strategy {
            self.flush_window()?;
        }
        if self.peer_bulk.is_some() {
            let acked = self.ack_mr.read_u64(ACK_BULK);
            if acked != self.peer_bulk_ack_seen {
                self.peer_bulk_ack_seen = acked;
                self.bulk_tx.on_ack(acked).map_err(fc_err)?;
            }
        }
        if self.bulk_ring.is_some() && self.bulk_rx.needs_ack() {
            self.write_ack(Lane::Bulk)?;
        }
        if let FlowStrategy::Credit { .. } = self.strategy {
            if self.credits.needs_update()
                && self.credits.can_send_credit()
                && self.outstanding < self.strategy.send_slots()
            {
                let grant = self.credits.on_send();
                self.send_record(Record { kind: RecordKind::Credit, credits: grant, len: 0, ack: 0 }, &[])?;
                self.stats.control += 1;
            }
        }
        Ok(())
    }

    fn handle_completion(&mut self, wc: WorkCompletion) -> Result<()> {
        if wc.wr_id >> TAG_SHIFT == TAG_USER {
            let token = wc.wr_id & ((1 << TAG_SHIFT) - 1);
            if let Some(i) = self.bulk_staging.iter().position(|&(t, _)| t == token) {
                let (_, index) = self.bulk_staging.swap_remove(i);
                self.send_pool.release_index(index)?;
            }
            self.user_in_flight = self.user_in_flight.saturating_sub(1);
            self.user_done.insert(token, wc.status);
            if wc.status != WcStatus::Success {
                return Err(VerbsError::PeerUnreachable(format!("transfer failed: {:?} ({:?})", wc.status, wc.opcode)));
            }
            return Ok(());
        }
        if wc.status != WcStatus::Success {
            return Err(VerbsError::PeerUnreachable(format!(
                "pipe transfer failed: {:?} ({:?})",
                wc.status, wc.opcode
            )));
        }
        let (tag, low) = (wc.wr_id >> TAG_SHIFT, wc.wr_id & ((1 << TAG_SHIFT) - 1));
        match tag {
            TAG_DATA_SEND => {
                self.send_pool.release_index(low as u32)?;
                self.sends_done((low >> 32) as usize)?;
            }
            TAG_INLINE_SEND => self.sends_done(low as usize)?,
            TAG_SETUP_SEND => {}
            TAG_DATA_RECV if wc.opcode == WcOpcode::RecvRdmaWithImm => {
                // A bulk chunk's notification consumed a message buffer without filling it
                // (under credits, one the sender paid for: owed back like a read message's).
                if let FlowStrategy::Credit { .. } = self.strategy {
                    self.credits.on_receive(0).map_err(fc_err)?;
                    self.credits.on_buffer_freed();
                }
                self.post_data_recv(low as u32)?;
                self.on_bulk_chunk(wc.imm.ok_or_else(|| VerbsError::Protocol("chunk without immediate".into()))?)?;
            }
            TAG_DATA_RECV => self.on_data_recv(low as u32, wc.byte_len as usize)?,
            TAG_NOTIFY_RECV => {
                let imm = wc.imm.ok_or_else(|| VerbsError::Protocol("chunk without immediate".into()))?;
                self.qp.post_recv(&[RecvWr::new(wr_id(TAG_NOTIFY_RECV, 0), &[])])?;
                if let FlowStrategy::Polled { .. } = self.strategy {
                    // Only wake-ups raise completions here: the frames are in the ring.
                    if imm != IMM_WAKE {
                        return Err(VerbsError::Protocol(format!("immediate {imm:#x} on a polled pipe")));
                    }
                } else if imm & IMM_BULK != 0 {
                    self.on_bulk_chunk(imm)?;
                } else {
                    self.on_ring_chunk(imm)?;
                }
            }
            _ => return Err(VerbsError::Protocol(format!("unexpected completion {wc:?}"))),
        }
        Ok(())
    }

    /// Takes what the completion queue holds.
    fn poll_completions(&mut self) -> Result<()> {
        let n = self.cq.poll(&mut self.wcs)?;
        let mut failure = None;
        for i in 0..n {
            let wc = self.wcs[i];
            // A failure keeps what the rest of the batch brought: messages that arrived before
            // it stay readable (`front`).
            if let Err(e) = self.handle_completion(wc) {
                failure.get_or_insert(e);
            }
        }
        failure.map_or(Ok(()), Err)
    }

    /// Accounts for a signaled send's completion, which covers `covers` sends.
    fn sends_done(&mut self, covers: usize) -> Result<()> {
        self.outstanding = self.outstanding.checked_sub(covers).ok_or_else(|| {
            VerbsError::Protocol(format!("a completion for {covers} sends with {} outstanding", self.outstanding))
        })?;
        Ok(())
    }

    /// Posts a signaled empty RDMA write behind the unsignaled sends: its completion, which
    /// comes once the peer took them, is theirs.
    fn settle(&mut self) -> Result<()> {
        let (addr, rkey) = self.peer_acks.ok_or_else(|| VerbsError::Protocol("a send before setup".into()))?;
        self.qp.post_send(&[SendWr::write(wr_id(TAG_INLINE_SEND, self.unsignaled as u64), &[], addr, rkey)])?;
        self.unsignaled = 0;
        self.unsettled_passes = 0;
        Ok(())
    }

    /// Tells the peer how far we consumed one of our rings (RDMA write into its ack slot).
    fn write_ack(&mut self, lane: Lane) -> Result<()> {
        let (pos, src, dst) = match lane {
            Lane::Message => (self.ring_rx.take_ack(), ACK_RING_SRC, ACK_RING),
            Lane::Bulk => (self.bulk_rx.take_ack(), ACK_BULK_SRC, ACK_BULK),
        };
        self.post_ack_word(src, dst, pos)
    }

    /// Writes `word` into the peer's acknowledgement slot `dst`: stored through the window onto
    /// the peer's slots where there is one (no request, no completion), else as a posted inline
    /// RDMA write from our slot `src`, counted in the send window like every other send.
    ///
    /// Counted, because a reader that keeps finding messages writes acknowledgements without
    /// ever passing through a full progress pass: were each signaled, their completions would
    /// pile up in the completion queue until it overran. Counted sends raise a completion only
    /// every [`SIGNAL_EVERY`], and once the window is full the completions are taken here, so
    /// the queue holds at most a window's worth whatever the reader does.
    fn post_ack_word(&mut self, src: usize, dst: usize, word: u64) -> Result<()> {
        if let Some(window) = &self.ack_window {
            window
                .write(dst, &[&word.to_ne_bytes()])
                .map_err(|st| VerbsError::PeerUnreachable(format!("acknowledgement write failed: {st:?}")))?;
            self.stats.control += 1;
            return Ok(());
        }
        let (addr, rkey) = self.peer_acks.ok_or_else(|| VerbsError::Protocol("acknowledgement before setup".into()))?;
        if self.outstanding >= self.strategy.send_slots() {
            self.poll_completions()?;
        }
        self.ack_mr.write(src, &word.to_ne_bytes());
        let sge = self.ack_mr.sge(src, 8);
        self.post_inline_counted(SendWr::write(0, &[sge], addr + dst as u64, rkey))?;
        self.stats.control += 1;
        Ok(())
    }

    /// Sets the count the peer reads with [`MsgPipe::peer_released`]: a cumulative counter of
    /// the layer above (Madeleine's: how many of the peer's zero-copy buffers it has read), in
    /// the peer's acknowledgement slots rather than in a message. So it takes no ring space or
    /// credit, never waits behind messages the peer has not read yet, and costs the peer one
    /// load to look at. The latest write wins: callers keep it monotone. It wakes no sleeper:
    /// a peer waiting for it polls (or naps).
    pub fn release_to(&mut self, count: u64) -> Result<()> {
        self.check_failed()?;
        self.post_ack_word(ACK_RELEASE_SRC, ACK_RELEASE, count).map_err(|e| self.fail(e))
    }

    /// Tells the peer something out of band: `words`, of which the last should change with
    /// every notice (a count), land in the peer's notice slot, the last word placed last, where
    /// its [`NoticeBoard`] reads them without taking anything out of the pipe. Like
    /// [`MsgPipe::release_to`] it takes no ring space or credit, never waits behind messages,
    /// wakes nobody, and the latest notice overwrites an earlier one not yet read. (Madeleine's
    /// receiver tells the sender of a message that it unpacked it differently than packed.)
    pub fn notice_to(&mut self, words: [u64; NOTICE_WORDS]) -> Result<()> {
        self.check_failed()?;
        let mut bytes = [0u8; 8 * NOTICE_WORDS];
        for (b, w) in bytes.chunks_exact_mut(8).zip(words) {
            b.copy_from_slice(&w.to_ne_bytes());
        }
        let sent = if let Some(window) = &self.ack_window {
            window
                .write(ACK_NOTICE, &[&bytes])
                .map_err(|st| VerbsError::PeerUnreachable(format!("notice write failed: {st:?}")))
        } else {
            let (addr, rkey) = match self.peer_acks {
                Some(p) => p,
                None => return Err(VerbsError::Protocol("a notice before setup".into())),
            };
            if self.outstanding >= self.strategy.send_slots() {
                self.poll_completions()?;
            }
            self.ack_mr.write(ACK_NOTICE_SRC, &bytes);
            let sge = self.ack_mr.sge(ACK_NOTICE_SRC, bytes.len());
            self.post_inline_counted(SendWr::write(0, &[sge], addr + ACK_NOTICE as u64, rkey))
        };
        sent.map_err(|e| self.fail(e))?;
        self.stats.control += 1;
        Ok(())
    }

    /// A reader of the notices the peer sends with [`MsgPipe::notice_to`], usable without the
    /// pipe (from another thread, with no lock).
    pub fn notice_board(&self) -> NoticeBoard {
        NoticeBoard { slots: self.ack_mr.clone() }
    }

    /// The count the peer last set with [`MsgPipe::release_to`] (0 before it set any).
    #[inline]
    pub fn peer_released(&self) -> u64 {
        self.ack_mr.read_u64(ACK_RELEASE)
    }

    fn on_bulk_chunk(&mut self, imm: u32) -> Result<()> {
        self.on_bulk_chunk_at((imm & IMM_LEN) as u64, imm & IMM_WRAPPED != 0, 0)
    }

    /// A bulk chunk of `len` bytes arrived in the bulk ring; once read, it also releases the
    /// polled frame that announced it (`frame_end`, 0 if none).
    fn on_bulk_chunk_at(&mut self, len: u64, wrapped: bool, frame_end: u64) -> Result<()> {
        let ring = self
            .bulk_ring
            .as_ref()
            .ok_or_else(|| VerbsError::Protocol("bulk chunk on a pipe without a bulk ring".into()))?;
        let before = self.bulk_rx.received();
        let off = self.bulk_rx.on_chunk(len, wrapped).map_err(fc_err)?;
        if len == 0 || off + len > ring.len() as u64 {
            return Err(VerbsError::Protocol(format!("bulk chunk of {len} bytes at {off} outside the ring")));
        }
        self.stats.buffer_bytes += self.bulk_rx.received() - before;
        let end_pos = self.bulk_rx.received();
        self.msgs.push_back((off as usize, len as usize));
        let store = ChunkStore::Ring { base: ring.as_ptr(), end_pos, lane: Lane::Bulk, frame_end };
        self.inbox.push_back(Chunk { store, left: 1 });
        Ok(())
    }

    /// Takes in the frames that arrived whole in our ring (polled strategy), at most `limit`;
    /// returns how many. (A reader asks for one: it reads that frame's messages before
    /// looking at the ring again.)
    #[inline]
    fn poll_frames(&mut self, limit: usize) -> Result<usize> {
        let words = self.ring_words;
        if words.len == 0 {
            return Err(VerbsError::Protocol("polled pipe without a ring".into()));
        }
        for n in 0..limit {
            let before = self.ring_rx.received();
            let Some(frame) = fc::poll_frame(&mut self.ring_rx, &words).map_err(fc_err)? else { return Ok(n) };
            self.stats.buffer_bytes += self.ring_rx.received() - before;
            self.take_frame(words.base, frame)?;
        }
        Ok(limit)
    }

    /// Queues a frame's messages, or the bulk chunk it announces (alone in its frame).
    fn take_frame(&mut self, base: *const u8, frame: fc::FrameAt) -> Result<()> {
        let at = frame.body_off as usize;
        // SAFETY: `poll_frame` found the frame whole inside our ring, in space the sender may
        // not reuse until we acknowledge it. Parsing keeps only validated ranges, never
        // re-reading a header.
        let body = unsafe { std::slice::from_raw_parts(base.add(at), frame.body_len) };
        let (mut left, mut bulk) = (0u32, None);
        for r in fc::records(body) {
            let (rec, range) = r.map_err(fc_err)?;
            if bulk.is_some() {
                return Err(VerbsError::Protocol("a record after a bulk note in one frame".into()));
            }
            if rec.ack != 0 {
                self.ring_tx.on_ack(rec.ack).map_err(fc_err)?;
            }
            match rec.kind {
                RecordKind::Data => {
                    self.msgs.push_back((at + range.start, range.len()));
                    left += 1;
                }
                RecordKind::Bulk if left == 0 => bulk = Some(fc::BulkNote::decode(&body[range]).map_err(fc_err)?),
                kind => return Err(VerbsError::Protocol(format!("{kind:?} record in a polled frame"))),
            }
        }
        match bulk {
            Some(note) => self.on_bulk_chunk_at(note.len as u64, note.wrapped, frame.end_pos),
            None if left > 0 => {
                let store = ChunkStore::Ring { base, end_pos: frame.end_pos, lane: Lane::Message, frame_end: 0 };
                self.inbox.push_back(Chunk { store, left });
                Ok(())
            }
            None => Err(VerbsError::Protocol("an empty polled frame".into())),
        }
    }

    /// Whether bulk chunks from now on carry the [`SendFlags::streaming`] hint (the software
    /// provider then writes them into the peer's ring with non-temporal stores). Which is
    /// faster depends on whether the two CPUs share a cache, so callers measure: see
    /// [`crate::datapath::AdaptiveCrossover`].
    pub fn set_bulk_streaming(&mut self, on: bool) {
        self.bulk_streaming = on;
    }

    /// Largest chunk [`MsgPipe::try_send_bulk`] takes (a quarter of the peer's bulk ring); 0 if
    /// the peer has no bulk ring.
    pub fn bulk_chunk_max(&self) -> usize {
        if self.peer_bulk.is_some() {
            self.bulk_tx.max_chunk() as usize
        } else {
            0
        }
    }

    /// Offers one bulk chunk: `data` (registered memory of this pipe's protection domain, at
    /// most [`MsgPipe::bulk_chunk_max`] bytes) is RDMA-written into the peer's bulk ring and
    /// delivered in order with the messages, as [`Lane::Bulk`]. `Ok(None)` if the ring has no
    /// room now (call [`MsgPipe::progress`] and retry). `Ok(Some(token))`: `data` must stay
    /// untouched until [`MsgPipe::take_user_completion`] reports the token.
    pub fn try_send_bulk(&mut self, data: Sge) -> Result<Option<u64>> {
        self.try_send_bulk_framed(&[], data, &[])
    }

    /// Most bytes [`MsgPipe::try_send_bulk_framed`] carries around a chunk's data.
    pub fn bulk_frame_max(&self) -> usize {
        self.send_pool.buf_size()
    }

    /// A bulk chunk of `head`, then `data`, then `tail`, written as one: the framing bytes
    /// (copied before this returns, at most [`MsgPipe::bulk_frame_max`] together) let a layer
    /// above send its own records with the data, so a transfer needs no message next to its
    /// chunk. (A message ahead of a chunk holds the chunk back on transports that place a
    /// send's data only when the target takes it, as the software provider does: an RDMA
    /// write never overtakes an earlier send.) `data` may be empty when framing is not; the
    /// rest as [`MsgPipe::try_send_bulk`], `Ok(None)` also when no staging buffer is free.
    pub fn try_send_bulk_framed(&mut self, head: &[u8], data: Sge, tail: &[u8]) -> Result<Option<u64>> {
        self.check_failed()?;
        let max = self.bulk_chunk_max();
        let frame = head.len() + tail.len();
        let total = frame + data.length as usize;
        if total == 0 || total > max || frame > self.bulk_frame_max() {
            return Err(VerbsError::invalid(format!(
                "bulk chunk of {total} bytes, {frame} of them framing (1 to {max}, framing at most {}; \
                 0 means the peer has no bulk ring)",
                self.bulk_frame_max()
            )));
        }
        if !self.coalescer.is_empty() {
            // Staged messages go first: the lanes share one order.
            self.flush()?;
            if !self.coalescer.is_empty() {
                return Ok(None);
            }
        }
        let credit = matches!(self.strategy, FlowStrategy::Credit { .. });
        if credit && !self.credits.can_send_data() {
            self.stats.blocked += 1;
            return Ok(None);
        }
        let Some(place) = self.bulk_tx.reserve(total as u64) else {
            self.stats.blocked += 1;
            return Ok(None);
        };
        let mut sges: smallvec::SmallVec<[Sge; 3]> = smallvec::SmallVec::new();
        let mut staging = None;
        if frame > 0 {
            let Some(mut b) = self.send_pool.try_acquire() else {
                // Freed as earlier transfers complete.
                self.bulk_tx.unreserve();
                self.stats.blocked += 1;
                return Ok(None);
            };
            b.push(head);
            b.push(tail);
            let all = b.sge();
            if !head.is_empty() {
                sges.push(Sge { length: head.len() as u32, ..all });
            }
            if data.length > 0 {
                sges.push(data);
            }
            if !tail.is_empty() {
                sges.push(Sge { addr: all.addr + head.len() as u64, length: tail.len() as u32, lkey: all.lkey });
            }
            staging = Some(b.into_index());
        } else {
            sges.push(data);
        }
        let peer = self.peer_bulk.as_ref().expect("bulk_chunk_max checked");
        let polled = matches!(self.strategy, FlowStrategy::Polled { .. });
        let wr = if polled {
            // Announced by a frame written after it (`note_bulk_chunk`).
            SendWr::write(0, &sges, peer.addr + place.offset, peer.rkey)
        } else {
            let imm = total as u32 | IMM_BULK | if place.wrapped { IMM_WRAPPED } else { 0 };
            SendWr::write_with_imm(0, &sges, peer.addr + place.offset, peer.rkey, imm)
        };
        let wr = SendWr { flags: SendFlags { streaming: self.bulk_streaming, ..wr.flags }, ..wr };
        match self.post_user(wr) {
            Ok(token) => {
                if credit {
                    self.credits.on_send_bare();
                }
                if polled {
                    self.note_bulk_chunk(total as u32, place.wrapped)?;
                }
                if let Some(index) = staging {
                    self.bulk_staging.push((token, index));
                }
                self.stats.transfers += 1;
                Ok(Some(token))
            }
            Err(e) => {
                self.bulk_tx.unreserve();
                if let Some(index) = staging {
                    self.send_pool.release_index(index)?;
                }
                Err(e)
            }
        }
    }

    /// Announces a bulk chunk just written (polled strategy): a note alone in the next frame,
    /// written after the chunk's data, so that the receiver finds the data placed.
    fn note_bulk_chunk(&mut self, len: u32, wrapped: bool) -> Result<()> {
        let ack = self.ring_rx.ack_due();
        let note = fc::BulkNote { len, wrapped }.encode();
        let rec = Record { kind: RecordKind::Bulk, credits: 0, len: note.len() as u32, ack };
        // The coalescer is empty (a bulk chunk waits until it is), so the note is taken.
        if !self.coalescer.push(rec, &note, usize::MAX) {
            return Err(VerbsError::Protocol("bulk note behind staged messages".into()));
        }
        self.ring_rx.acked_to(ack);
        self.coalescer.seal();
        self.flush_frames()
    }

    fn on_data_recv(&mut self, index: u32, len: usize) -> Result<()> {
        let pool = self.recv_pool.as_ref().ok_or_else(|| VerbsError::Protocol("data receive on a ring pipe".into()))?;
        let (base, buf_size) = (pool.sge_full_of(index)?.addr as *const u8, pool.buf_size());
        if len > buf_size {
            return Err(VerbsError::Protocol(format!("{len}-byte receive in a {buf_size}-byte buffer")));
        }
        // SAFETY: the receive completed, so the buffer is ours (no transfer targets it until it
        // is reposted) and `len` bytes of it lie inside it (checked above). Parsing keeps only
        // validated ranges, never re-reading a header.
        let bytes = unsafe { std::slice::from_raw_parts(base, len) };
        let credit = matches!(self.strategy, FlowStrategy::Credit { .. });
        let mut left = 0u32;
        let mut grant = None;
        for r in fc::records(bytes) {
            let (rec, range) = r.map_err(fc_err)?;
            if credit {
                // One message per buffer, each paid for with one credit.
                if grant.replace(rec.credits).is_some() {
                    return Err(fc_err(FcError::BadRecord("a credit-based buffer holds exactly one record")));
                }
            }
            match rec.kind {
                RecordKind::Data => {
                    self.msgs.push_back((range.start, range.len()));
                    left += 1;
                }
                RecordKind::Credit => {}
                RecordKind::Setup => return Err(VerbsError::Protocol("setup record after setup".into())),
                RecordKind::Bulk => return Err(VerbsError::Protocol("bulk note outside a polled frame".into())),
            }
        }
        if credit {
            let grant =
                grant.ok_or_else(|| fc_err(FcError::BadRecord("a credit-based buffer holds exactly one record")))?;
            self.credits.on_receive(grant).map_err(fc_err)?;
        }
        self.stats.buffer_bytes += buf_size as u64;
        if left == 0 {
            // A credit message: its buffer is free at once.
            self.repost(index)?;
        } else {
            self.inbox.push_back(Chunk { store: ChunkStore::Buf { index, base }, left });
        }
        Ok(())
    }

    fn repost(&mut self, index: u32) -> Result<()> {
        if let FlowStrategy::Credit { .. } = self.strategy {
            self.credits.on_buffer_freed();
        }
        self.post_data_recv(index)
    }

    fn on_ring_chunk(&mut self, imm: u32) -> Result<()> {
        let ring =
            self.ring.as_ref().ok_or_else(|| VerbsError::Protocol("ring chunk on a pipe without a ring".into()))?;
        if imm & IMM_BULK != 0 {
            return Err(VerbsError::Protocol("message-ring chunk flagged as bulk".into()));
        }
        let (len, wrapped) = ((imm & IMM_LEN) as u64, imm & IMM_WRAPPED != 0);
        let before = self.ring_rx.received();
        let off = self.ring_rx.on_chunk(len, wrapped).map_err(fc_err)?;
        if off + len > ring.len() as u64 {
            return Err(VerbsError::Protocol("ring chunk past the ring".into()));
        }
        // SAFETY: the ring accounting placed the chunk inside our ring (checked above), in
        // space the sender may not reuse until we acknowledge it. Parsing keeps only validated
        // ranges, never re-reading a header.
        let bytes = unsafe { std::slice::from_raw_parts(ring.as_ptr().add(off as usize) as *const u8, len as usize) };
        let mut left = 0u32;
        for r in fc::records(bytes) {
            let (rec, range) = r.map_err(fc_err)?;
            if rec.kind != RecordKind::Data {
                return Err(VerbsError::Protocol("non-data record in a ring chunk".into()));
            }
            if rec.ack != 0 {
                self.ring_tx.on_ack(rec.ack).map_err(fc_err)?;
            }
            self.msgs.push_back((off as usize + range.start, range.len()));
            left += 1;
        }
        self.stats.buffer_bytes += self.ring_rx.received() - before;
        let end_pos = self.ring_rx.received();
        if left == 0 {
            self.ring_rx.consume_to(end_pos);
        } else {
            let store = ChunkStore::Ring { base: ring.as_ptr(), end_pos, lane: Lane::Message, frame_end: 0 };
            self.inbox.push_back(Chunk { store, left });
        }
        Ok(())
    }

    /// Reads the next message in place: `f` sees its bytes. `Ok(None)` if none is there now.
    /// After a failure, messages received before it are still returned, then the error. (On a
    /// pipe whose peer sends bulk chunks, use [`MsgPipe::recv_lane`].)
    pub fn recv_with<R>(&mut self, f: impl FnOnce(&[u8]) -> R) -> Result<Option<R>> {
        self.recv_lane(|_, b| f(b))
    }

    /// Whether a received message or chunk is waiting (without driving progress), and by
    /// which lane.
    pub fn peek_lane(&self) -> Option<Lane> {
        self.inbox.front().map(|c| match c.store {
            ChunkStore::Buf { .. } => Lane::Message,
            ChunkStore::Ring { lane, .. } => lane,
        })
    }

    /// Reads the next message or bulk chunk in place: `f` sees its lane and bytes.
    pub fn recv_lane<R>(&mut self, f: impl FnOnce(Lane, &[u8]) -> R) -> Result<Option<R>> {
        let Some((lane, bytes)) = self.front()? else { return Ok(None) };
        let r = f(lane, bytes);
        self.pop_front()?;
        Ok(Some(r))
    }

    /// The next message or bulk chunk and its lane, in place and left in the pipe (so a
    /// reader may take it apart across several calls; [`MsgPipe::pop_front`] releases it).
    /// Drives progress if nothing is there. `Ok(None)` if nothing arrived. After a failure,
    /// messages received before it are still returned, then the error.
    pub fn front(&mut self) -> Result<Option<(Lane, &[u8])>> {
        if self.inbox.is_empty() && self.failed.is_none() && !self.polled_arrivals() && self.progress_due() {
            // A failure found now still leaves earlier messages readable.
            if let Err(e) = self.progress() {
                if self.inbox.is_empty() {
                    return Err(e);
                }
            }
        }
        let (Some(chunk), Some(&(off, len))) = (self.inbox.front(), self.msgs.front()) else {
            self.check_failed()?;
            return Ok(None);
        };
        let (base, lane) = match &chunk.store {
            ChunkStore::Buf { base, .. } => (*base, Lane::Message),
            ChunkStore::Ring { base, lane, .. } => (*base, *lane),
        };
        // SAFETY: the bytes lie in a receive buffer we own until it is reposted, or in ring
        // space the sender may not reuse until we acknowledge it; both happen only in
        // `pop_front`, which needs the `&mut self` this borrow holds.
        Ok(Some((lane, unsafe { std::slice::from_raw_parts(base.add(off), len) })))
    }

    /// Polled strategy: whether frames arrived, looking at the ring alone (a full progress
    /// pass, with its completion-queue poll, is for when nothing did: off the path from a
    /// message's arrival to its reader). A bad frame fails the pipe; the frames before it
    /// stay readable, and the caller's progress reports the failure once they are read.
    #[inline]
    fn polled_arrivals(&mut self) -> bool {
        if !matches!(self.strategy, FlowStrategy::Polled { .. })
            || self.reap_wake
            || !fc::frame_begun(&self.ring_rx, &self.ring_words)
        {
            return false;
        }
        match self.poll_frames(1) {
            Ok(n) => n > 0,
            Err(e) => {
                let _ = self.fail(e);
                !self.inbox.is_empty()
            }
        }
    }

    /// Whether a [`MsgPipe::front`] that found nothing drives a full progress pass. A polled
    /// pipe has looked at its ring already; the pass's other work (completions,
    /// acknowledgements, batched frames, the peer's sleep) is done on every
    /// [`PROGRESS_EVERY`]-th empty look, so that a reader spinning for a message finds it
    /// within a ring poll of its arrival rather than within a whole pass (about 500
    /// instructions against 100). The looks in between still take the peer's offer of a
    /// shared copy ([`QueuePair::help_peer`]): a zero-copy sender waits here for the reads of
    /// its buffers, and its receiver waited 0.1-0.5 us longer per 64 KiB read (230 ns to be
    /// helped on average, against 100) when only the passes took it.
    #[inline]
    fn progress_due(&mut self) -> bool {
        if !matches!(self.strategy, FlowStrategy::Polled { .. }) || self.reap_wake {
            return true;
        }
        self.empty_fronts = self.empty_fronts.wrapping_add(1);
        if self.empty_fronts.is_multiple_of(PROGRESS_EVERY) {
            return true;
        }
        self.qp.help_peer();
        false
    }

    /// Marks the first `n` bytes of the message [`MsgPipe::front`] returned as read: `front`
    /// returns the rest from then on, and [`MsgPipe::pop_front`] still releases it (a stream
    /// reader takes a large message or bulk chunk in as many pieces as its reads ask for).
    pub fn consume_front(&mut self, n: usize) -> Result<()> {
        let Some((off, len)) = self.msgs.front_mut() else {
            return Err(VerbsError::invalid("consume_front with no message there"));
        };
        if n > *len {
            return Err(VerbsError::invalid(format!("consume_front of {n} bytes of a {len}-byte message")));
        }
        *off += n;
        *len -= n;
        self.stats.received_bytes += n as u64;
        Ok(())
    }

    /// Releases the message [`MsgPipe::front`] returned: once every message of its chunk is
    /// read, acknowledges its ring space, or hands its receive buffer back to the transport
    /// (at the next progress). Does nothing if nothing is there.
    pub fn pop_front(&mut self) -> Result<()> {
        // (`msgs` holds a range for every message left in `inbox`'s chunks.)
        let Some(chunk) = self.inbox.front_mut() else { return Ok(()) };
        let Some((_, len)) = self.msgs.pop_front() else { return Ok(()) };
        chunk.left -= 1;
        self.stats.received += 1;
        self.stats.received_bytes += len as u64;
        if chunk.left == 0 {
            let store = chunk.store;
            self.inbox.pop_front();
            match store {
                // Posted again by the next progress: off the path from a message's arrival to
                // its reader's reply.
                ChunkStore::Buf { index, .. } => self.freed.push(index),
                ChunkStore::Ring { end_pos, lane: Lane::Message, .. } => {
                    self.ring_rx.consume_to(end_pos);
                    if self.ring_rx.needs_ack() && matches!(self.strategy, FlowStrategy::Polled { .. }) {
                        // A reader that keeps finding frames may not pass through `progress`.
                        if let Err(e) = self.write_ack(Lane::Message) {
                            return Err(self.fail(e));
                        }
                    }
                }
                ChunkStore::Ring { end_pos, lane: Lane::Bulk, frame_end, .. } => {
                    self.bulk_rx.consume_to(end_pos);
                    if frame_end != 0 {
                        self.ring_rx.consume_to(frame_end);
                    }
                }
            }
        }
        Ok(())
    }

    /// Sends, driving progress until flow control admits the message or `timeout` passes.
    /// Admitted may mean staged behind a full send window: keep driving the pipe until
    /// [`MsgPipe::staged`] is 0 before going idle.
    pub fn send(&mut self, msg: &[u8], timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.try_send(msg)? {
                return Ok(());
            }
            self.progress()?;
            if Instant::now() > deadline {
                return Err(VerbsError::Timeout(timeout));
            }
            std::hint::spin_loop();
        }
    }

    /// Posts a request of the caller's on the pipe's queue pair (for example the RDMA read of a
    /// rendezvous), its `wr_id` replaced by a token; its completion is collected by
    /// [`MsgPipe::progress`] and handed out by [`MsgPipe::take_user_completion`].
    pub fn post_user(&mut self, mut wr: SendWr) -> Result<u64> {
        self.check_failed()?;
        let token = self.tag_user(&mut wr);
        self.qp.post_send(&[wr])?;
        self.user_posted();
        Ok(token)
    }

    /// Gives a user request the next token as its `wr_id`, signaled (its completion is how
    /// the token is handed back).
    fn tag_user(&self, wr: &mut SendWr) -> u64 {
        let token = self.next_user;
        wr.wr_id = wr_id(TAG_USER, token);
        wr.flags.signaled = true;
        token
    }

    /// A user request tagged by [`MsgPipe::tag_user`] was posted and will complete.
    fn user_posted(&mut self) {
        self.next_user = (self.next_user + 1) & ((1 << TAG_SHIFT) - 1);
        self.user_in_flight += 1;
    }

    /// Posts a request of the caller's as [`MsgPipe::post_user`] does, unless the provider
    /// carries it out at once ([`QueuePair::post_send_completing`]): then `None`, and there is
    /// no completion to wait for (the software provider's rendezvous reads). Else the token to
    /// wait on.
    pub fn post_user_completing(&mut self, mut wr: SendWr) -> Result<Option<u64>> {
        self.check_failed()?;
        let token = self.tag_user(&mut wr);
        match self.qp.post_send_completing(&wr)? {
            Posted::Completed => Ok(None),
            Posted::Pending => {
                self.user_posted();
                Ok(Some(token))
            }
        }
    }

    /// Requests of the caller's ([`MsgPipe::post_user`]) not settled yet: in flight, or
    /// completed with their status not taken.
    pub fn user_unsettled(&self) -> usize {
        self.user_in_flight + self.user_done.len()
    }

    /// The status of a request posted with [`MsgPipe::post_user`] once it completed, polling
    /// the completion queue even after the pipe failed (where [`MsgPipe::poll_user_completion`]
    /// reports the failure): for a caller that must know its request no longer uses its memory
    /// before it lets the memory go. A failed pipe's queue pair is in error, so every request
    /// of it completes (flushed) soon.
    pub fn settle_user(&mut self, token: u64) -> Option<WcStatus> {
        if let Some(st) = self.take_user_completion(token) {
            return Some(st);
        }
        if let Err(e) = self.poll_completions() {
            self.fail(e);
        }
        self.take_user_completion(token)
    }

    /// The status of a request posted with [`MsgPipe::post_user`], once it completed.
    pub fn take_user_completion(&mut self, token: u64) -> Option<WcStatus> {
        self.user_done.remove(&token)
    }

    /// The status of a request posted with [`MsgPipe::post_user`]: taken at once if it
    /// completed, else after one poll of the completion queue (not a whole
    /// [`MsgPipe::progress`] pass: a waiter for its own read need not move the pipe's flow
    /// control on every poll, and a receiver's read completes at post on the software
    /// provider, so this is the path every zero-copy message takes).
    pub fn poll_user_completion(&mut self, token: u64) -> Result<Option<WcStatus>> {
        if let Some(st) = self.take_user_completion(token) {
            return Ok(Some(st));
        }
        self.check_failed()?;
        let polled = self.poll_completions();
        match self.take_user_completion(token) {
            // Its own status says more than the pipe failure a failed request causes.
            Some(st) => Ok(Some(st)),
            None => polled.map(|()| None).map_err(|e| self.fail(e)),
        }
    }

    /// The completion queue of the pipe (to sleep on its event descriptor).
    pub fn cq(&self) -> &CompletionQueue {
        &self.cq
    }

    /// Bytes accepted by `try_send` but still staged (coalesced, not yet handed to the
    /// transport): the sender must keep calling `flush`/`progress` until this is 0.
    pub fn staged(&self) -> usize {
        self.coalescer.len()
    }

    /// Whether everything accepted has been handed over and every transfer completed (what a
    /// closing socket lingers for before it tears the queue pair down).
    pub fn idle(&self) -> bool {
        self.outstanding == 0 && self.coalescer.is_empty()
    }

    /// Why the pipe failed, if it did.
    pub fn failure(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    /// One control round trip: sends a 1-byte message and waits for the peer's answer (the
    /// peer must echo it). What the crossover tuner measures per peer.
    pub fn round_trip(&mut self, timeout: Duration) -> Result<Duration> {
        let t = Instant::now();
        self.send(&[0x52], timeout)?;
        self.flush()?;
        self.recv(timeout)?;
        Ok(t.elapsed())
    }

    /// Receives the next message into a vector, waiting at most `timeout`.
    pub fn recv(&mut self, timeout: Duration) -> Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(v) = self.recv_with(|b| b.to_vec())? {
                return Ok(v);
            }
            self.flush()?;
            if Instant::now() > deadline {
                return Err(VerbsError::Timeout(timeout));
            }
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Context, Provider, QpInit};
    use proptest::prelude::*;

    const T: Duration = Duration::from_secs(10);

    fn qps() -> (ProtectionDomain, (QueuePair, CompletionQueue), (QueuePair, CompletionQueue)) {
        let ctx = Context::open(Provider::Software).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let (a, b) = qps_in(&ctx, &pd);
        (pd, a, b)
    }

    type End = (QueuePair, CompletionQueue);

    fn qps_in(ctx: &Context, pd: &ProtectionDomain) -> (End, End) {
        let (ca, cb) = (ctx.create_cq(1024).unwrap(), ctx.create_cq(1024).unwrap());
        let a = pd.create_qp(&QpInit::new(&ca)).unwrap();
        let b = pd.create_qp(&QpInit::new(&cb)).unwrap();
        a.connect_to(b.endpoint()).unwrap();
        b.connect_to(a.endpoint()).unwrap();
        ((a, ca), (b, cb))
    }

    fn pair(s: FlowStrategy) -> (MsgPipe, MsgPipe) {
        let (pd, (a, ca), (b, cb)) = qps();
        std::thread::scope(|sc| {
            let h = sc.spawn(|| MsgPipe::establish(b, cb, &pd, s, T).unwrap());
            let pa = MsgPipe::establish(a, ca, &pd, s, T).unwrap();
            (pa, h.join().unwrap())
        })
    }

    fn strategies() -> [FlowStrategy; 4] {
        [
            FlowStrategy::Credit { buffers: 4, buf_size: 512 },
            FlowStrategy::Rdma { ring_bytes: 4096, coalesce: 700 },
            FlowStrategy::Window { window: 512, buffers: 4 },
            FlowStrategy::Polled { ring_bytes: 4096, coalesce: 700 },
        ]
    }

    fn msg(i: u64, len: usize) -> Vec<u8> {
        (0..len).map(|k| (i as usize * 31 + k * 7) as u8).collect()
    }

    /// Streams `sizes` from a to b with both ends progressing in lock step; checks order and
    /// content.
    fn stream(a: &mut MsgPipe, b: &mut MsgPipe, sizes: &[usize]) {
        let deadline = Instant::now() + T;
        let mut next = 0usize;
        let mut got = 0usize;
        while got < sizes.len() {
            assert!(Instant::now() < deadline, "stalled at {got} of {}", sizes.len());
            if next < sizes.len() && a.try_send(&msg(next as u64, sizes[next])).unwrap() {
                next += 1;
            }
            a.progress().unwrap();
            if next == sizes.len() {
                a.flush().unwrap();
            }
            while let Some(m) = b.recv_with(|m| m.to_vec()).unwrap() {
                assert_eq!(m, msg(got as u64, sizes[got]), "message {got}");
                got += 1;
            }
        }
    }

    fn pair_with(s: FlowStrategy, o: PipeOptions) -> (ProtectionDomain, MsgPipe, MsgPipe) {
        let (pd, (a, ca), (b, cb)) = qps();
        let (pa, pb) = std::thread::scope(|sc| {
            let o2 = o.clone();
            let h = sc.spawn(|| MsgPipe::establish_with(b, cb, &pd, s, o2, T).unwrap());
            let pa = MsgPipe::establish_with(a, ca, &pd, s, o, T).unwrap();
            (pa, h.join().unwrap())
        });
        (pd, pa, pb)
    }

    /// Inline sends are signaled only now and then; the pipe still learns that every one of
    /// them completed: from a later signaled send, or from the empty write it posts behind
    /// the last few once the sender went quiet. Meanwhile nothing is lost or reordered.
    #[test]
    fn unsignaled_sends_are_all_accounted_for() {
        let few_buffers = FlowStrategy::Window { window: 512, buffers: 4 };
        let all = [FlowStrategy::WINDOW, few_buffers, FlowStrategy::CREDIT, FlowStrategy::RDMA, FlowStrategy::POLLED];
        for (s, posted_frames) in all.map(|s| (s, false)).into_iter().chain([(FlowStrategy::POLLED, true)]) {
            for n in [1usize, SIGNAL_EVERY - 1, SIGNAL_EVERY, 3 * SIGNAL_EVERY + 2, 200] {
                let (_pd, mut a, mut b) = pair_with(s, PipeOptions { posted_frames, ..PipeOptions::default() });
                stream(&mut a, &mut b, &vec![24; n]);
                assert!(a.unsignaled < SIGNAL_EVERY, "{s:?} {n}: {} unsignaled", a.unsignaled);
                let deadline = Instant::now() + T;
                let mut passes = 0u32;
                while !a.idle() {
                    assert!(Instant::now() < deadline, "{s:?} {n}: never idle ({} outstanding)", a.outstanding);
                    a.progress().unwrap();
                    b.progress().unwrap();
                    passes += 1;
                }
                assert!(passes <= SETTLE_AFTER_PASSES + 100, "{s:?} {n}: idle after {passes} passes");
                assert_eq!((a.outstanding, a.unsignaled), (0, 0));
                // The pipe goes on working after the settling write.
                stream(&mut a, &mut b, &[5, 300, 24]);
            }
        }
    }

    /// A polled reader that only calls `front` (a receive loop) looks at its ring on every
    /// call and drives the rest of the pipe now and then: its own batched frames go out and
    /// its send window's completions come back, so two ends that only send and `front` never
    /// stall.
    #[test]
    fn a_reader_calling_only_front_still_drives_its_pipe() {
        let s = FlowStrategy::Polled { ring_bytes: 4096, coalesce: 700 };
        let (mut a, mut b) = pair(s);
        let deadline = Instant::now() + T;
        let (mut sent, mut got) = ([0usize; 2], [0usize; 2]);
        const N: usize = 300;
        while got.iter().any(|&g| g < N) {
            assert!(Instant::now() < deadline, "stalled: sent {sent:?}, got {got:?}");
            for (i, p) in [&mut a, &mut b].into_iter().enumerate() {
                // Sends until refused (later ones are batched behind a full window).
                while sent[i] < N && p.try_send(&msg(sent[i] as u64, 40)).unwrap() {
                    sent[i] += 1;
                }
                if let Some((_, m)) = p.front().unwrap() {
                    assert_eq!(m, msg(got[i] as u64, 40), "end {i}, message {}", got[i]);
                    p.pop_front().unwrap();
                    got[i] += 1;
                }
            }
        }
        assert!(a.front().unwrap().is_none() && b.front().unwrap().is_none());
    }

    /// A reader that always finds a frame (its sender keeps ahead of it) never passes through
    /// a full progress pass, yet the acknowledgements it writes as it reads must not pile up
    /// completions: its completion queue, sized for the pipe, never overruns however long the
    /// stream, whether acknowledgements are stored through a window or posted.
    #[test]
    fn a_reader_that_always_finds_frames_never_overruns_its_completion_queue() {
        let s = FlowStrategy::Polled { ring_bytes: 4096, coalesce: 700 };
        for posted_frames in [false, true] {
            let ctx = Context::open(Provider::Software).unwrap();
            let pd = ctx.alloc_pd().unwrap();
            // Room for the pipe's notification receives and a little more: an acknowledgement
            // raising a completion per quarter ring read overruns it within a few thousand
            // messages.
            let small = NOTIFY_RECEIVES as usize + 32;
            let (ca, cb) = (ctx.create_cq(small).unwrap(), ctx.create_cq(small).unwrap());
            let a = pd.create_qp(&QpInit::new(&ca)).unwrap();
            let b = pd.create_qp(&QpInit::new(&cb)).unwrap();
            a.connect_to(b.endpoint()).unwrap();
            b.connect_to(a.endpoint()).unwrap();
            let o = PipeOptions { posted_frames, ..PipeOptions::default() };
            let (mut a, mut b) = std::thread::scope(|sc| {
                let o2 = o.clone();
                let h = sc.spawn(|| MsgPipe::establish_with(b, cb, &pd, s, o2, T).unwrap());
                (MsgPipe::establish_with(a, ca, &pd, s, o, T).unwrap(), h.join().unwrap())
            });
            let deadline = Instant::now() + T;
            const N: usize = 20_000;
            let mut got = 0;
            while got < N {
                assert!(Instant::now() < deadline, "posted {posted_frames}: stalled at {got}");
                if !a.try_send(&msg(got as u64, 40)).unwrap() {
                    a.progress().unwrap();
                    continue;
                }
                a.flush().unwrap();
                if a.staged() > 0 {
                    a.progress().unwrap();
                    a.flush().unwrap();
                }
                // The frame is in b's ring: b's look finds it, never an empty one.
                let (_, m) = b.front().unwrap().expect("the frame just written");
                assert_eq!(m, msg(got as u64, 40), "posted {posted_frames}: message {got}");
                b.pop_front().unwrap();
                got += 1;
            }
            b.progress().unwrap();
            assert!(b.failure().is_none(), "posted {posted_frames}: {:?}", b.failure());
        }
    }

    /// A notice reaches the peer's board past messages it has not read, whole (its last word
    /// changing last), through the window or posted; the latest one wins.
    #[test]
    fn notices_reach_the_peer_out_of_band() {
        for posted_frames in [false, true] {
            let s = FlowStrategy::Polled { ring_bytes: 4096, coalesce: 700 };
            let (_pd, mut a, mut b) = pair_with(s, PipeOptions { posted_frames, ..PipeOptions::default() });
            let board = b.notice_board();
            assert_eq!(board.read(), [0; NOTICE_WORDS]);
            assert!(a.try_send(&msg(0, 40)).unwrap());
            for n in 1..=3u64 {
                a.notice_to([n, 2 * n, 3 * n, n << 32]).unwrap();
                let deadline = Instant::now() + T;
                while board.last_word() != n << 32 {
                    assert!(Instant::now() < deadline, "posted {posted_frames}: notice {n} never arrived");
                    a.progress().unwrap();
                }
                assert_eq!(board.read(), [n, 2 * n, 3 * n, n << 32]);
            }
            // The message sent before is still there, unread.
            assert_eq!(b.recv(T).unwrap(), msg(0, 40));
        }
    }

    /// Messages and bulk chunks interleaved arrive in the order sent, each by its lane, with
    /// the bulk ring wrapping many times and the sender held back while it is full.
    #[test]
    fn bulk_chunks_interleave_with_messages_in_order() {
        let polled = FlowStrategy::Polled { ring_bytes: 4096, coalesce: 700 };
        for (s, posted_frames) in [
            (FlowStrategy::Rdma { ring_bytes: 4096, coalesce: 700 }, false),
            (FlowStrategy::Window { window: 512, buffers: 4 }, false),
            (FlowStrategy::Credit { buffers: 4, buf_size: 512 }, false),
            (polled, false),
            (polled, true),
        ] {
            let o = PipeOptions { bulk_ring: 16 * 1024, posted_frames, ..PipeOptions::default() };
            let (pd, mut a, mut b) = pair_with(s, o);
            assert_eq!(a.bulk_chunk_max(), 4096);
            let src: Vec<u8> = (0..4096u32).map(|i| (i * 13 % 251) as u8).collect();
            let reg = pd.register(src.clone().into_boxed_slice(), AccessFlags::NONE).unwrap();
            let deadline = Instant::now() + T;
            // Item i: a message (i % 3 == 0) or a bulk chunk of a size that makes the ring wrap.
            let item_len = |i: usize| if i.is_multiple_of(3) { 1 + i % 400 } else { 1 + (i * 1237) % 4096 };
            let (mut next, mut got, mut blocked) = (0usize, 0usize, 0usize);
            let mut tokens = Vec::new();
            const N: usize = 600;
            let mut round = 0usize;
            while got < N {
                assert!(Instant::now() < deadline, "stalled at {got}");
                round += 1;
                if next < N {
                    let len = item_len(next);
                    let sent = if next % 3 == 0 {
                        a.try_send(&msg(next as u64, len)).unwrap()
                    } else {
                        match a.try_send_bulk(reg.sge(0, len)).unwrap() {
                            Some(t) => {
                                tokens.push(t);
                                true
                            }
                            None => false,
                        }
                    };
                    if sent {
                        next += 1;
                    } else {
                        blocked += 1;
                    }
                }
                a.progress().unwrap();
                a.flush().unwrap();
                // The receiver reads only every 16th round: the ring fills up.
                if round.is_multiple_of(16) || next == N {
                    while let Some((lane, bytes)) = b.recv_lane(|l, m| (l, m.to_vec())).unwrap() {
                        let len = item_len(got);
                        if got % 3 == 0 {
                            assert_eq!((lane, bytes), (Lane::Message, msg(got as u64, len)), "item {got}");
                        } else {
                            assert_eq!(lane, Lane::Bulk, "item {got}");
                            assert_eq!(bytes, src[..len], "item {got}");
                        }
                        got += 1;
                    }
                }
                b.progress().unwrap();
            }
            assert!(blocked > 0, "the ring never filled up: the test did not test flow control");
            for t in tokens {
                while a.take_user_completion(t).is_none() {
                    a.progress().unwrap();
                }
            }
        }
    }

    /// A framed chunk arrives as head, data, tail in one chunk (also with no data), its
    /// staging buffer comes back when it completes, and framing that does not fit is refused.
    #[test]
    fn framed_chunks_carry_head_data_and_tail() {
        let s = FlowStrategy::Window { window: 512, buffers: 4 };
        let (pd, mut a, mut b) = pair_with(s, PipeOptions { bulk_ring: 16 * 1024, ..PipeOptions::default() });
        let src: Vec<u8> = (0..4096u32).map(|i| (i * 11 % 241) as u8).collect();
        let reg = pd.register(src.clone().into_boxed_slice(), AccessFlags::NONE).unwrap();
        let deadline = Instant::now() + T;
        let cases: [(&[u8], usize, &[u8]); 4] =
            [(b"head", 1000, b"tail"), (b"", 4000, b"t"), (b"only-framing", 0, b"!"), (&[7u8; 512], 3584, b"")];
        for (i, &(head, len, tail)) in cases.iter().enumerate() {
            let token = loop {
                if let Some(t) = a.try_send_bulk_framed(head, reg.sge(0, len), tail).unwrap() {
                    break t;
                }
                a.progress().unwrap();
                b.progress().unwrap();
                assert!(Instant::now() < deadline, "case {i} never sent");
            };
            let got = loop {
                if let Some(x) = b.recv_lane(|l, m| (l, m.to_vec())).unwrap() {
                    break x;
                }
                assert!(Instant::now() < deadline, "case {i} never arrived");
            };
            assert_eq!(got, (Lane::Bulk, [head, &src[..len], tail].concat()), "case {i}");
            while a.take_user_completion(token).is_none() {
                a.progress().unwrap();
                b.progress().unwrap();
                assert!(Instant::now() < deadline, "case {i} never completed");
            }
        }
        assert!(a.bulk_staging.is_empty(), "staging buffers still held");
        assert_eq!(a.send_pool.stats().in_use, 0, "staging buffers not back in the pool");
        let over = vec![0u8; a.bulk_frame_max() + 1];
        assert!(a.try_send_bulk_framed(&over, reg.sge(0, 1), b"").is_err(), "framing over the staging buffer");
        assert!(a.try_send_bulk_framed(b"", reg.sge(0, 0), b"").is_err(), "an empty chunk");
        assert!(a.try_send_bulk_framed(b"x", reg.sge(0, 4096), b"").is_err(), "a chunk over the largest");
    }

    /// A bulk lane is refused where it cannot work, and misuse is an error, not a panic.
    #[test]
    fn bulk_lane_arguments_are_checked() {
        let (pd, (a, ca), _) = qps();
        let odd = MsgPipe::establish_with(
            a,
            ca,
            &pd,
            FlowStrategy::CREDIT,
            PipeOptions { bulk_ring: 3 << 12, ..PipeOptions::default() },
            Duration::from_millis(10),
        );
        assert!(matches!(odd, Err(VerbsError::InvalidArgument(_))), "{:?}", odd.err());
        let (mut a, _b) = pair(FlowStrategy::WINDOW);
        assert_eq!(a.bulk_chunk_max(), 0);
        let mr = pd.alloc(64, AccessFlags::NONE).unwrap();
        assert!(a.try_send_bulk(mr.sge(0, 64)).is_err(), "no bulk ring at the peer");
        assert!(a.consume_front(1).is_err(), "nothing there to consume");
    }

    /// A reader may take a message and a bulk chunk in pieces: `front` shows what is left,
    /// too large a piece is refused, and `pop_front` releases the rest (the ring space is
    /// acknowledged and reused).
    #[test]
    fn messages_and_chunks_are_read_in_pieces() {
        let s = FlowStrategy::Credit { buffers: 4, buf_size: 512 };
        let (pd, mut a, mut b) = pair_with(s, PipeOptions { bulk_ring: 16 * 1024, ..PipeOptions::default() });
        let src: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 253) as u8).collect();
        let reg = pd.register(src.clone().into_boxed_slice(), AccessFlags::NONE).unwrap();
        let deadline = Instant::now() + T;
        for round in 0..12 {
            let m = msg(round, 300);
            while !a.try_send(&m).unwrap() {
                a.progress().unwrap();
                b.progress().unwrap();
                assert!(Instant::now() < deadline);
            }
            let token = loop {
                if let Some(t) = a.try_send_bulk(reg.sge(0, 4096)).unwrap() {
                    break t;
                }
                a.progress().unwrap();
                b.progress().unwrap();
                assert!(Instant::now() < deadline);
            };
            for (want_lane, want) in [(Lane::Message, &m[..]), (Lane::Bulk, &src[..])] {
                let mut got = Vec::new();
                while got.len() < want.len() {
                    assert!(Instant::now() < deadline, "round {round}: stalled");
                    let Some((lane, bytes)) = b.front().unwrap() else { continue };
                    assert_eq!(lane, want_lane);
                    let piece = bytes.len().min(1 + (round as usize * 97 + got.len()) % 1000);
                    got.extend_from_slice(&bytes[..piece]);
                    let left = bytes.len();
                    assert!(b.consume_front(left + 1).is_err(), "more than is left");
                    b.consume_front(piece).unwrap();
                }
                assert_eq!(got, want, "round {round}");
                assert_eq!(b.front().unwrap().map(|(_, m)| m.len()), Some(0));
                b.pop_front().unwrap();
            }
            while a.take_user_completion(token).is_none() {
                a.progress().unwrap();
                b.progress().unwrap();
                assert!(Instant::now() < deadline);
            }
        }
    }

    /// Both ends on their own threads, streaming at once in both directions: no message may
    /// be lost, repeated or reordered (the lock-step tests above cannot race the provider).
    #[test]
    fn concurrent_two_thread_streams_lose_nothing() {
        for s in [
            FlowStrategy::Credit { buffers: 16, buf_size: 8192 + 16 },
            FlowStrategy::Rdma { ring_bytes: 64 * 1024, coalesce: 4096 },
            FlowStrategy::Window { window: 8192, buffers: 16 },
        ] {
            let (a, b) = pair(s);
            let run = |mut p: MsgPipe| {
                move || {
                    const N: u64 = 20_000;
                    let deadline = Instant::now() + Duration::from_secs(60);
                    let (mut next, mut got) = (0u64, 0u64);
                    while next < N || got < N {
                        assert!(Instant::now() < deadline, "stalled: sent {next}, got {got}");
                        if next < N {
                            let len = if next % 3 == 0 {
                                s.max_message()
                            } else {
                                8 + (next as usize * 977) % (s.max_message() - 8)
                            };
                            let mut m = msg(next, len);
                            m[..8].copy_from_slice(&next.to_le_bytes());
                            if p.try_send(&m).unwrap() {
                                next += 1;
                            }
                        }
                        p.progress().unwrap();
                        p.flush().unwrap();
                        // Irregular pauses, as applications have: a racing provider shows here.
                        match (next + got) % 97 {
                            0 => std::thread::sleep(Duration::from_micros(20)),
                            1..=3 => std::thread::yield_now(),
                            _ => {}
                        }
                        while let Some(seq) = p.recv_with(|m| u64::from_le_bytes(m[..8].try_into().unwrap())).unwrap() {
                            assert_eq!(seq, got, "{s:?}: message lost or reordered");
                            got += 1;
                        }
                    }
                    p
                }
            };
            let ha = std::thread::spawn(run(a));
            let hb = std::thread::spawn(run(b));
            let (pa, pb) = (ha.join().unwrap(), hb.join().unwrap());
            drop((pa, pb));
        }
    }

    #[test]
    fn every_strategy_delivers_in_order_both_ways() {
        for (s, posted_frames) in strategies().map(|s| (s, false)).into_iter().chain([(strategies()[3], true)]) {
            let (_pd, mut a, mut b) = pair_with(s, PipeOptions { posted_frames, ..PipeOptions::default() });
            let sizes: Vec<usize> = (0..300).map(|i| (i * 37) % (s.max_message() + 1)).collect();
            assert!(sizes.iter().all(|&n| n <= s.max_message()));
            stream(&mut a, &mut b, &sizes);
            stream(&mut b, &mut a, &sizes);
            let st = b.stats();
            assert_eq!(st.received, 300, "{s:?}");
            assert!(st.utilization() > 0.0 && st.utilization() <= 1.0);
        }
    }

    #[test]
    fn small_messages_use_buffers_far_better_with_rdma_and_window_than_credits() {
        // A sender faster than its receiver: bursts of 20 small messages between reads.
        let mut util = Vec::new();
        for s in strategies() {
            let (mut a, mut b) = pair(s);
            let (mut next, mut got) = (0u64, 0u64);
            let deadline = Instant::now() + T;
            while got < 500 {
                assert!(Instant::now() < deadline);
                let burst_end = (next + 20).min(500);
                while next < burst_end && a.try_send(&msg(next, 8)).unwrap() {
                    next += 1;
                }
                a.progress().unwrap();
                a.flush().unwrap();
                while let Some(m) = b.recv_with(|m| m.to_vec()).unwrap() {
                    assert_eq!(m, msg(got, 8));
                    got += 1;
                }
            }
            util.push(b.stats().utilization());
        }
        assert!(util[1] > 4.0 * util[0] && util[2] > 4.0 * util[0], "{util:?}");
    }

    #[test]
    fn pipes_can_share_one_send_pool() {
        let ctx = Context::open(Provider::Software).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let ((a, ca), (b, cb)) = qps_in(&ctx, &pd);
        let ((c, cc), (d, cd)) = qps_in(&ctx, &pd);
        let pd2 = pd.clone();
        let shared = BufferPool::new(&pd, 512, 4, AccessFlags::NONE).unwrap();
        let s = FlowStrategy::Window { window: 512, buffers: 4 };
        let opts = PipeOptions { send_pool: Some(shared.clone()), ..PipeOptions::default() };
        let (mut p1, mut r1, mut p2, mut r2) = std::thread::scope(|sc| {
            let h1 = sc.spawn(|| MsgPipe::establish(b, cb, &pd, s, T).unwrap());
            let h2 = sc.spawn(|| MsgPipe::establish(d, cd, &pd2, s, T).unwrap());
            let p1 = MsgPipe::establish_with(a, ca, &pd, s, opts.clone(), T).unwrap();
            let p2 = MsgPipe::establish_with(c, cc, &pd2, s, opts.clone(), T).unwrap();
            (p1, h1.join().unwrap(), p2, h2.join().unwrap())
        });
        // Larger than what goes inline (which needs no staging buffer).
        stream(&mut p1, &mut r1, &[300; 200]);
        stream(&mut p2, &mut r2, &[300; 200]);
        assert!(shared.stats().acquires >= 400 / 4, "{:?}", shared.stats());
        let too_small = BufferPool::new(&pd, 64, 4, AccessFlags::NONE).unwrap();
        let ((e, ce), _) = qps_in(&ctx, &pd);
        let r = MsgPipe::establish_with(
            e,
            ce,
            &pd,
            s,
            PipeOptions { send_pool: Some(too_small), ..PipeOptions::default() },
            T,
        );
        assert!(matches!(r, Err(VerbsError::InvalidArgument(_))));
    }

    #[test]
    fn default_strategies_fit_a_connection_in_256_kib_with_the_provider_ring() {
        let ring = crate::SoftConfig::default().ring_bytes;
        for s in [FlowStrategy::CREDIT, FlowStrategy::RDMA, FlowStrategy::WINDOW, FlowStrategy::POLLED] {
            assert!(s.memory_per_end() + ring <= 256 * 1024, "{s:?}: {} + {ring}", s.memory_per_end());
        }
    }

    #[test]
    fn oversized_messages_and_mismatched_strategies_are_refused() {
        let (mut a, _b) = pair(FlowStrategy::Credit { buffers: 4, buf_size: 512 });
        assert!(matches!(a.try_send(&[0u8; 600]), Err(VerbsError::InvalidArgument(_))));
        let (pd, (qa, ca), (qb, cb)) = qps();
        std::thread::scope(|sc| {
            let h = sc.spawn(|| MsgPipe::establish(qb, cb, &pd, FlowStrategy::WINDOW, T));
            let ra = MsgPipe::establish(qa, ca, &pd, FlowStrategy::CREDIT, T);
            assert!(matches!(ra, Err(VerbsError::Protocol(_))));
            assert!(matches!(h.join().unwrap(), Err(VerbsError::Protocol(_))));
        });
    }

    /// A raw peer: sets up like a pipe of `s`, then sends whatever the test wants.
    fn raw_peer(s: FlowStrategy) -> (MsgPipe, QueuePair, CompletionQueue, MemoryRegion) {
        let (pd, (qa, ca), (qb, cb)) = qps();
        let mr = pd.register(vec![0u8; 8192].into_boxed_slice(), AccessFlags::ALL).unwrap();
        qb.post_recv(&[RecvWr::new(0, &[mr.sge(4096, 4096)])]).unwrap();
        let (code, p1, p2) = s.code();
        let mut payload = vec![code, 0, 0, 0, 0, 0, 0, 0];
        for v in [p1, p2, 0, 0, 0, 0, 0, 0, 0] {
            payload.extend_from_slice(&v.to_le_bytes());
        }
        let rec = Record { kind: RecordKind::Setup, credits: 0, len: payload.len() as u32, ack: 0 };
        mr.write(0, &rec.encode());
        mr.write(RECORD_HEADER, &payload);
        qb.post_send(&[SendWr::send(1, &[mr.sge(0, RECORD_HEADER + payload.len())])]).unwrap();
        let pipe = MsgPipe::establish(qa, ca, &pd, s, T).unwrap();
        let mut wc = [WorkCompletion::EMPTY; 4];
        let mut n = 0;
        while n < 2 {
            n += cb.poll_blocking(&mut wc[..2 - n], T).unwrap();
        }
        (pipe, qb, cb, mr)
    }

    fn raw_send(qb: &QueuePair, mr: &MemoryRegion, recs: &[(Record, &[u8])]) {
        let mut at = 0;
        for (r, p) in recs {
            mr.write(at, &r.encode());
            mr.write(at + RECORD_HEADER, p);
            at += RECORD_HEADER + p.len();
        }
        qb.post_send(&[SendWr::send(9, &[mr.sge(0, at)])]).unwrap();
    }

    fn until_error(p: &mut MsgPipe) -> VerbsError {
        let deadline = Instant::now() + T;
        loop {
            match p.recv_with(|m| m.to_vec()) {
                Err(e) => return e,
                Ok(_) => assert!(Instant::now() < deadline, "no error"),
            }
        }
    }

    #[test]
    fn a_peer_granting_credits_it_does_not_have_fails_the_pipe_keeping_what_arrived() {
        let (mut p, qb, _cb, mr) = raw_peer(FlowStrategy::Credit { buffers: 4, buf_size: 512 });
        raw_send(&qb, &mr, &[(Record { kind: RecordKind::Data, credits: 0, len: 3, ack: 0 }, b"one")]);
        let deadline = Instant::now() + T;
        let first = loop {
            if let Some(m) = p.recv_with(|m| m.to_vec()).unwrap() {
                break m;
            }
            assert!(Instant::now() < deadline);
        };
        assert_eq!(first, b"one");
        raw_send(&qb, &mr, &[(Record { kind: RecordKind::Data, credits: 0, len: 3, ack: 0 }, b"two")]);
        raw_send(&qb, &mr, &[(Record { kind: RecordKind::Credit, credits: 50, len: 0, ack: 0 }, b"")]);
        // "two" arrived before the bad grant: it is still delivered, then the error.
        let deadline = Instant::now() + T;
        let second = loop {
            match p.recv_with(|m| m.to_vec()) {
                Ok(Some(m)) => break m,
                Ok(None) => assert!(Instant::now() < deadline),
                Err(e) => panic!("lost a message received before the error: {e}"),
            }
        };
        assert_eq!(second, b"two");
        let e = until_error(&mut p);
        assert!(e.to_string().contains("granted"), "{e}");
        assert!(p.try_send(b"x").is_err());
    }

    #[test]
    fn a_malformed_record_fails_the_pipe() {
        let (mut p, qb, _cb, mr) = raw_peer(FlowStrategy::WINDOW);
        raw_send(&qb, &mr, &[(Record { kind: RecordKind::Data, credits: 0, len: 4000, ack: 0 }, b"short")]);
        let e = until_error(&mut p);
        assert!(matches!(e, VerbsError::Protocol(_)), "{e}");
    }

    #[test]
    fn a_ring_chunk_past_the_allotted_space_fails_the_pipe() {
        let (mut p, qb, _cb, mr) = raw_peer(FlowStrategy::Rdma { ring_bytes: 4096, coalesce: 1024 });
        // Announce a chunk larger than the ring allows (no data needed: the announcement is
        // what is checked).
        qb.post_send(&[SendWr::write_with_imm(9, &[mr.sge(0, 8)], mr.addr(), mr.rkey(), 3000)]).unwrap();
        let e = until_error(&mut p);
        assert!(e.to_string().contains("allotted"), "{e}");
    }

    /// Polled messages raise no completion: a receiver that says it sleeps gets one raised
    /// by the sender's next frame, in every interleaving of the two (each side sleeps before
    /// every message it waits for). Sleeps are long, so one that runs to its end is a lost
    /// wake-up, not a slow machine.
    #[test]
    fn a_polled_receiver_that_sleeps_is_woken_by_the_next_frame() {
        const ROUNDS: u64 = 200;
        const SLICE: Duration = Duration::from_secs(1);
        let (a, b) = pair(FlowStrategy::Polled { ring_bytes: 4096, coalesce: 700 });
        let run = |mut p: MsgPipe, first: bool| {
            move || {
                let (mut slept, mut woken) = (0u32, 0u32);
                let deadline = Instant::now() + T;
                for i in 0..ROUNDS {
                    if first {
                        p.send(&msg(i, 8 + i as usize % 100), T).unwrap();
                    }
                    let m = loop {
                        assert!(Instant::now() < deadline, "round {i}: stalled");
                        if let Some(m) = p.recv_with(|m| m.to_vec()).unwrap() {
                            break m;
                        }
                        if p.prepare_sleep().unwrap() {
                            slept += 1;
                            woken += crate::wait_any(&[p.cq()], SLICE).unwrap() as u32;
                        }
                    };
                    assert_eq!(m, msg(i, 8 + i as usize % 100));
                    if !first {
                        p.send(&m, T).unwrap();
                    }
                }
                // The last reply may wait behind a full send window.
                while p.staged() > 0 {
                    assert!(Instant::now() < deadline, "the last reply stayed staged");
                    p.progress().unwrap();
                }
                (p, slept, woken)
            }
        };
        let hb = std::thread::spawn(run(b, false));
        let (_a, slept_a, woken_a) = run(a, true)();
        let (_b, slept_b, woken_b) = hb.join().unwrap();
        let (slept, woken) = (slept_a + slept_b, woken_a + woken_b);
        assert!(slept > 0, "nobody slept: the test did not test wake-ups");
        let lost = slept - woken.min(slept);
        assert_eq!(lost, 0, "{lost} of {slept} sleeps were not ended by a wake-up");
    }

    /// The peer's ring address and key, from the setup a pipe sent a raw peer.
    fn ring_of(mr: &MemoryRegion) -> (u64, u32) {
        let v = |i: usize| mr.read_u64(4096 + RECORD_HEADER + 8 + 8 * i);
        (v(2), v(3) as u32)
    }

    /// Writes into a polled pipe's ring, from its raw peer, a frame of one 3-byte message
    /// `forge`d, its closing word copied from the opening one.
    fn send_forged_frame(qb: &QueuePair, mr: &MemoryRegion, forge: fn(&mut Vec<u8>)) {
        let (addr, rkey) = ring_of(mr);
        let rec = Record { kind: RecordKind::Data, credits: 0, len: 3, ack: 0 };
        let mut body = rec.encode().to_vec();
        body.extend_from_slice(b"abc");
        let mut frame = vec![0u8; 64];
        let n = fc::encode_frame(0, &[&body], &mut frame).len();
        frame.truncate(n);
        forge(&mut frame);
        let word: [u8; 8] = frame[..8].try_into().unwrap();
        frame[n - 8..].copy_from_slice(&word);
        mr.write(0, &frame);
        qb.post_send(&[SendWr::write(9, &[mr.sge(0, n)], addr, rkey)]).unwrap();
    }

    #[test]
    fn malformed_polled_frames_fail_the_pipe() {
        let s = FlowStrategy::Polled { ring_bytes: 4096, coalesce: 700 };
        type Forge = fn(&mut Vec<u8>);
        let forgeries: [(&str, Forge); 4] = [
            ("a frame longer than a quarter of the ring", |f| {
                f[..8].copy_from_slice(&fc::frame_word(0, 2000).to_le_bytes())
            }),
            ("a record running past its frame", |f| f[12..16].copy_from_slice(&100u32.to_le_bytes())),
            ("an unknown record kind", |f| f[8] = 9),
            ("a credit record", |f| f[8] = 2),
        ];
        let send = |forge: Forge| {
            let (p, qb, cb, mr) = raw_peer(s);
            send_forged_frame(&qb, &mr, forge);
            (p, qb, cb, mr)
        };
        for (what, forge) in forgeries {
            let (mut p, _qb, _cb, _mr) = send(forge);
            let e = until_error(&mut p);
            assert!(matches!(e, VerbsError::Protocol(_)), "{what}: {e}");
        }
        // The same frame unforged is a message.
        let (mut p, _qb, _cb, _mr) = send(|_| {});
        assert_eq!(p.recv(T).unwrap(), b"abc");
    }

    /// A request of the caller's that completed unseen before the pipe failed is still
    /// reported by `settle_user` (the caller may then let its memory go), where
    /// `poll_user_completion` reports the pipe's failure.
    #[test]
    fn a_request_is_settled_after_the_pipe_failed() {
        let (mut p, qb, _cb, mr) = raw_peer(FlowStrategy::Polled { ring_bytes: 4096, coalesce: 700 });
        mr.write(6000, b"settled");
        let src = mr.sge(6000, 7);
        let token = p.post_user(SendWr::read(0, &[mr.sge(7000, 7)], src.addr, mr.rkey())).unwrap();
        // The peer breaks the protocol: a record of an unknown kind.
        send_forged_frame(&qb, &mr, |f| f[8] = 9);
        let e = until_error(&mut p);
        assert!(matches!(e, VerbsError::Protocol(_)), "{e}");
        // The read's completion is still in the queue: the failure came first.
        assert!(p.poll_user_completion(token).is_err(), "a failed pipe reports its failure");
        let deadline = Instant::now() + T;
        let st = loop {
            if let Some(st) = p.settle_user(token) {
                break st;
            }
            assert!(Instant::now() < deadline, "never settled");
        };
        assert!(matches!(st, WcStatus::Success | WcStatus::WrFlushErr), "{st:?}");
    }

    /// On the software provider a polled pipe stores its frames into the peer's ring through a
    /// window, posting nothing; a frame that follows a posted bulk chunk (which it may announce)
    /// is posted behind it until the chunk completes, then frames go through the window again.
    /// With `posted_frames` every frame is posted.
    #[test]
    fn polled_frames_are_stored_directly_unless_something_posted_is_in_flight() {
        let s = FlowStrategy::Polled { ring_bytes: 4096, coalesce: 700 };
        let o = PipeOptions { bulk_ring: 16 * 1024, ..PipeOptions::default() };
        let (pd, mut a, mut b) = pair_with(s, o.clone());
        assert!(a.direct_frames() && b.direct_frames());
        stream(&mut a, &mut b, &[8, 300, 900, 24]);
        assert_eq!((a.outstanding, a.stats().transfers), (0, 4), "four frames, nothing posted");
        let reg = pd.register(vec![5u8; 4096].into_boxed_slice(), AccessFlags::NONE).unwrap();
        let token = a.try_send_bulk(reg.sge(0, 4096)).unwrap().expect("room for a chunk");
        assert!(a.try_send(&msg(1, 40)).unwrap());
        assert!(a.outstanding > 0, "the message after a chunk in flight is posted behind it");
        let deadline = Instant::now() + T;
        let mut got = Vec::new();
        while got.len() < 2 || a.take_user_completion(token).is_none() {
            assert!(Instant::now() < deadline, "stalled");
            a.progress().unwrap();
            while let Some(m) = b.recv_lane(|l, m| (l, m.to_vec())).unwrap() {
                got.push(m);
            }
            b.progress().unwrap();
        }
        assert_eq!(got, [(Lane::Bulk, vec![5u8; 4096]), (Lane::Message, msg(1, 40))]);
        while !a.idle() {
            assert!(Instant::now() < deadline, "never idle");
            a.progress().unwrap();
            b.progress().unwrap();
        }
        let posted = a.stats().transfers;
        stream(&mut a, &mut b, &[8, 8]);
        assert_eq!((a.outstanding, a.stats().transfers), (0, posted + 2), "direct again");

        let (_pd, mut a, mut b) = pair_with(s, PipeOptions { posted_frames: true, ..o });
        assert!(!a.direct_frames());
        assert!(a.try_send(&msg(0, 8)).unwrap());
        assert_eq!(a.outstanding, 1, "a posted frame");
        while b.recv_with(|m| assert_eq!(m, msg(0, 8))).unwrap().is_none() {
            assert!(Instant::now() < deadline, "stalled");
        }
    }

    /// A release count lands in the peer's slot, stored directly or posted, under every
    /// strategy, without a message: the peer's messages queued unread do not hold it up.
    #[test]
    fn release_counts_reach_the_peer_past_unread_messages() {
        for posted in [false, true] {
            for s in strategies() {
                let (_pd, mut a, mut b) = pair_with(s, PipeOptions { posted_frames: posted, ..PipeOptions::default() });
                assert_eq!(a.peer_released(), 0, "{s:?}");
                assert!(a.try_send(&msg(0, 100)).unwrap() && a.flush().is_ok());
                for count in [1u64, 2, 1 << 40] {
                    b.release_to(count).unwrap();
                    let deadline = Instant::now() + T;
                    while a.peer_released() != count {
                        assert!(Instant::now() < deadline, "{s:?} posted {posted}: release {count} never came");
                        a.progress().unwrap();
                        b.progress().unwrap();
                    }
                }
                assert_eq!(b.stats().received, 0, "{s:?}: the message stays unread");
                let deadline = Instant::now() + T;
                while b.recv_with(|m| assert_eq!(m, msg(0, 100))).unwrap().is_none() {
                    assert!(Instant::now() < deadline, "{s:?}: the message never came");
                    a.progress().unwrap();
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 12, .. ProptestConfig::default() })]
        /// Random message sizes and random interleavings of the two ends' progress.
        #[test]
        fn random_traffic_is_never_lost_duplicated_or_reordered(
            which in 0usize..5,
            sizes in proptest::collection::vec(0usize..500, 1..150),
            steps in proptest::collection::vec(0u8..4, 50..400),
        ) {
            // 4: the polled strategy with every frame posted.
            let s = strategies()[which.min(3)];
            let sizes: Vec<usize> = sizes.iter().map(|&n| n.min(s.max_message())).collect();
            let (_pd, mut a, mut b) = pair_with(s, PipeOptions { posted_frames: which == 4, ..PipeOptions::default() });
            let mut next = 0usize;
            let mut got = 0usize;
            let deadline = Instant::now() + T;
            let mut k = 0;
            while got < sizes.len() {
                prop_assert!(Instant::now() < deadline, "stalled");
                match steps[k % steps.len()] {
                    0 => if next < sizes.len() && a.try_send(&msg(next as u64, sizes[next])).unwrap() { next += 1 },
                    1 => a.progress().unwrap(),
                    2 => if let Some(m) = b.recv_with(|m| m.to_vec()).unwrap() {
                        prop_assert_eq!(m, msg(got as u64, sizes[got]));
                        got += 1;
                    },
                    _ => { a.flush().unwrap(); b.progress().unwrap(); }
                }
                k += 1;
                if k > steps.len() * 50 {
                    // The random schedule may starve one side: finish in lock step.
                    if next < sizes.len() && a.try_send(&msg(next as u64, sizes[next])).unwrap() { next += 1 }
                    a.progress().unwrap();
                    a.flush().unwrap();
                    if let Some(m) = b.recv_with(|m| m.to_vec()).unwrap() {
                        prop_assert_eq!(m, msg(got as u64, sizes[got]));
                        got += 1;
                    }
                }
            }
        }
    }
}
