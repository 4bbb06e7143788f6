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
use super::signals::{Signalling, SleepHandshake};
use crate::error::{Result, VerbsError};
use crate::types::*;
use crate::verbs::{CompletionQueue, MemoryRegion, ProtectionDomain, QueuePair, RemoteWindow};
use crate::wait::{Backoff, Pause, Spin};

mod acks;
mod bulk;
mod recv;
mod send;
mod strategy;
mod user;

pub use acks::NoticeBoard;
pub use strategy::FlowStrategy;

/// Options of a pipe end.
#[derive(Debug, Clone, Default)]
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

/// Most frames a progress pass takes in from a polled ring.
const FRAMES_PER_PASS: usize = 32;
/// A polled pipe's empty [`MsgPipe::front`] calls per full progress pass.
const PROGRESS_EVERY: u32 = 8;

/// Between two polls of a blocking `send` or `recv` (they never sleep: a polled pipe's peer
/// raises no completion unless told): spins, yields now and then; fails after `timeout`.
fn pause(backoff: &mut Backoff, timeout: Duration) -> Result<()> {
    let step = backoff.pause(Instant::now);
    if step.waited.is_some_and(|w| w > timeout) {
        return Err(VerbsError::Timeout(timeout));
    }
    match step.pause {
        Pause::Spin => std::hint::spin_loop(),
        Pause::Yield | Pause::Sleep => std::thread::yield_now(),
    }
    Ok(())
}

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

/// A polled frame holding one data message, taken in while nothing else waited (nearly every
/// small message of a ping-pong or a stream): read where it lies in our ring without passing
/// through the queues every other arrival takes (`MsgPipe::inbox`, `MsgPipe::msgs`). It comes
/// before everything queued.
#[derive(Clone, Copy)]
struct LoneFrame {
    /// Ring offset of the message's bytes, and their length.
    off: usize,
    len: usize,
    /// Ring position after the frame (what reading it releases).
    end_pos: u64,
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
/// Where the peer writes its latest copy-out report ([`MsgPipe::report_copy_out`]), and the 8
/// bytes we write ours from.
const ACK_COPY_OUT: usize = 128;
const ACK_COPY_OUT_SRC: usize = 136;
const ACK_BYTES: usize = 144;
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

/// Why a pipe failed: what [`MsgPipe::failure`] says, and, if the peer went away (its queue
/// pair or process gone), that error's text. Every later call reports the same kind of error:
/// a layer above tells a peer that closed and left from one that broke the protocol.
struct Failure {
    said: String,
    peer_gone: Option<String>,
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
    /// The peer's bulk ring mapped for plain stores, where the provider can
    /// ([`MsgPipe::try_send_bulk_copy`]).
    bulk_window: Option<RemoteWindow>,
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
    /// The next message, when it arrived alone in a polled frame; then before `inbox`.
    lone: Option<LoneFrame>,
    inbox: VecDeque<Chunk>,
    /// (offset from its chunk's base, length) of every message of `inbox`'s chunks, in order.
    msgs: VecDeque<(usize, usize)>,
    /// Sends posted whose completion is not known yet (their own, or that of a later
    /// signaled send).
    outstanding: usize,
    /// Which sends ask for a completion.
    signals: Signalling,
    /// Records up to this size go inline (the queue pair's limit, at most `INLINE_MAX`; 0 if
    /// it takes a single SGE per send).
    inline_max: usize,
    peer_ack_seen: u64,
    /// Polled strategy: our sleep announcements, and our answers to the peer's.
    sleep: SleepHandshake,
    /// A sleep was announced since the last full progress pass: the peer's wake-up may be
    /// waiting in the completion queue, and until it is taken the peer's later requests
    /// complete behind it (in order), which holds its send window.
    reap_wake: bool,
    /// The ring position our standing sleep announcement waits at, until the peer answers it
    /// (its wake-up) or a frame arrives: a sleeper that looks again and again (a polling
    /// loop that keeps waking) announces once, instead of posting a write per look.
    sleep_standing: Option<u64>,
    /// Polled strategy: [`MsgPipe::front`] calls that found nothing (see
    /// [`MsgPipe::progress_due`]).
    empty_fronts: u32,
    failed: Option<Failure>,
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
    /// A bulk chunk's write held back to be posted with the frame that announces it, in one
    /// call (one doorbell; one `sendmsg` on the TCP transport instead of two).
    held_chunk: Option<SendWr>,
}

impl std::fmt::Debug for MsgPipe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MsgPipe").field("strategy", &self.strategy).field("stats", &self.stats).finish_non_exhaustive()
    }
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
            bulk_window: None,
            bulk_tx: RingSender::new(1),
            bulk_streaming: false,
            peer_bulk_ack_seen: 0,
            peer_acks: None,
            credits: Credits::new(credits_n),
            ring_tx: RingSender::new(ring_n),
            ring_rx: RingReceiver::new(ring_n),
            coalescer: Coalescer::default(),
            lone: None,
            inbox: VecDeque::new(),
            msgs: VecDeque::new(),
            outstanding: 0,
            signals: Signalling::default(),
            inline_max,
            peer_ack_seen: 0,
            sleep: SleepHandshake::default(),
            reap_wake: false,
            sleep_standing: None,
            empty_fronts: 0,
            failed: None,
            stats: PipeStats::default(),
            wcs: vec![WorkCompletion::EMPTY; 32],
            freed: smallvec::SmallVec::new(),
            user_done: std::collections::HashMap::new(),
            user_in_flight: 0,
            bulk_staging: smallvec::SmallVec::new(),
            held_chunk: None,
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
            // A refusal only leaves bulk data posted (each write checks again what the peer named).
            self.bulk_window = self.qp.map_remote_write(v(6), bulk_len, v(7) as u32).unwrap_or_else(|e| {
                log::debug!("pipe: bulk copies go as posted writes, the peer's bulk ring does not map: {e}");
                None
            });
        }
        Ok(())
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
            Some(Failure { peer_gone: Some(why), .. }) => Err(VerbsError::PeerUnreachable(why.clone())),
            Some(f) => Err(VerbsError::Protocol(f.said.clone())),
            None => Ok(()),
        }
    }

    fn fail(&mut self, e: VerbsError) -> VerbsError {
        if self.failed.is_none() {
            let peer_gone = match &e {
                VerbsError::PeerUnreachable(why) => Some(why.clone()),
                _ => None,
            };
            self.failed = Some(Failure { said: e.to_string(), peer_gone });
            let _ = self.qp.modify(QpTransition::Error);
        }
        e
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
        if self.signals.pass() {
            self.settle()?;
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
                    // Answered: the next sleep announces again.
                    self.sleep_standing = None;
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

    /// Settles the sends posted without asking for a completion now, rather than after
    /// [`crate::datapath::signals::SETTLE_AFTER_PASSES`] quiet progress passes: for a caller
    /// about to stop polling the pipe (a background thread that visits it now and then, for
    /// which those passes would take a long time), so that [`MsgPipe::idle`] holds as soon as
    /// the peer took them. Nothing to do without such sends.
    pub fn settle_unsignaled(&mut self) -> Result<()> {
        self.check_failed()?;
        if self.signals.unsignaled() == 0 {
            return Ok(());
        }
        self.settle().map_err(|e| self.fail(e))
    }

    /// Posts a signaled empty RDMA write behind the unsignaled sends: its completion, which
    /// comes once the peer took them, is theirs.
    fn settle(&mut self) -> Result<()> {
        let (addr, rkey) = self.peer_acks.ok_or_else(|| VerbsError::Protocol("a send before setup".into()))?;
        let covers = self.signals.unsignaled();
        self.qp.post_send(&[SendWr::write(wr_id(TAG_INLINE_SEND, covers as u64), &[], addr, rkey)])?;
        self.signals.settle();
        Ok(())
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

    /// Bytes of our messages in the peer's ring that it has not acknowledged (ring
    /// strategies; 0 for the others). 0 once the peer has read all we sent and said so, as
    /// in a ping-pong, where its reply carries the acknowledgement; more while it reads
    /// behind us, as in a stream.
    pub fn unacknowledged(&self) -> u64 {
        self.ring_tx.in_flight()
    }

    /// Whether everything accepted has been handed over and every transfer completed (what a
    /// closing socket lingers for before it tears the queue pair down).
    pub fn idle(&self) -> bool {
        self.outstanding == 0 && self.coalescer.is_empty()
    }

    /// Whether a message of the pipe's largest size would likely be taken by `try_send` now
    /// (for an event loop's "writable"; `try_send` stays the authority): the send window has a
    /// slot, and the credits, staging buffers or ring room its strategy needs are there. Room
    /// that comes back arrives as the peer's RDMA writes, seen by `progress`.
    pub fn has_room(&self) -> bool {
        if self.failed.is_some() {
            return false;
        }
        let pool_free = self.send_pool.stats().in_use < self.send_pool.capacity();
        match self.strategy {
            FlowStrategy::Credit { .. } => {
                self.credits.can_send_data() && self.outstanding < self.strategy.send_slots() && pool_free
            }
            FlowStrategy::Window { .. } => pool_free,
            FlowStrategy::Rdma { .. } | FlowStrategy::Polled { .. } => {
                self.ring_tx.has_room_for_max() && (self.direct_now() || self.outstanding < self.strategy.send_slots())
            }
        }
    }

    /// Why the pipe failed, if it did.
    pub fn failure(&self) -> Option<&str> {
        self.failed.as_ref().map(|f| f.said.as_str())
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::signals::{SETTLE_AFTER_PASSES, SIGNAL_EVERY};
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
                assert!(a.signals.unsignaled() < SIGNAL_EVERY, "{s:?} {n}: {} unsignaled", a.signals.unsignaled());
                let deadline = Instant::now() + T;
                let mut passes = 0u32;
                while !a.idle() {
                    assert!(Instant::now() < deadline, "{s:?} {n}: never idle ({} outstanding)", a.outstanding);
                    a.progress().unwrap();
                    b.progress().unwrap();
                    passes += 1;
                }
                assert!(passes <= SETTLE_AFTER_PASSES + 100, "{s:?} {n}: idle after {passes} passes");
                assert_eq!((a.outstanding, a.signals.unsignaled()), (0, 0));
                // The pipe goes on working after the settling write.
                stream(&mut a, &mut b, &[5, 300, 24]);
            }
        }
    }

    /// `unacknowledged` tells a sender whose peer keeps up from one whose peer reads behind:
    /// in a ping-pong the reply acknowledges the message it answers, so the sender sees 0
    /// before its next message; in a stream the bytes the peer has not read stay counted.
    #[test]
    fn unacknowledged_is_zero_in_a_ping_pong_and_counts_a_stream() {
        for s in [FlowStrategy::Polled { ring_bytes: 65536, coalesce: 4096 }, FlowStrategy::RDMA] {
            let (mut a, mut b) = pair(s);
            assert_eq!(a.unacknowledged(), 0, "{s:?}");
            let deadline = Instant::now() + T;
            let take = |p: &mut MsgPipe, want: &[u8]| loop {
                assert!(Instant::now() < deadline, "{s:?}: nothing arrived");
                if let Some((_, m)) = p.front().unwrap() {
                    assert_eq!(m, want, "{s:?}");
                    p.pop_front().unwrap();
                    return;
                }
                p.progress().unwrap();
            };
            for i in 0..20u64 {
                assert!(a.try_send(&msg(i, 3000)).unwrap() && a.flush().is_ok(), "{s:?}");
                assert!(a.unacknowledged() > 0, "{s:?}: a message in flight");
                take(&mut b, &msg(i, 3000));
                assert!(b.try_send(&msg(i, 16)).unwrap() && b.flush().is_ok(), "{s:?}");
                take(&mut a, &msg(i, 16));
                assert_eq!(a.unacknowledged(), 0, "{s:?}: round trip {i} answered");
            }
            for i in 0..3u64 {
                assert!(a.try_send(&msg(i, 3000)).unwrap() && a.flush().is_ok(), "{s:?}");
            }
            take(&mut b, &msg(0, 3000));
            for _ in 0..10 {
                a.progress().unwrap();
                b.progress().unwrap();
            }
            assert!(a.unacknowledged() >= 2 * 3000, "{s:?}: two messages unread");
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

    /// Each strategy with small rings and windows (the polled one with frames stored and
    /// posted), for the bulk lane's tests.
    fn every_strategy_small() -> [(FlowStrategy, bool); 5] {
        let polled = FlowStrategy::Polled { ring_bytes: 4096, coalesce: 700 };
        [
            (FlowStrategy::Rdma { ring_bytes: 4096, coalesce: 700 }, false),
            (FlowStrategy::Window { window: 512, buffers: 4 }, false),
            (FlowStrategy::Credit { buffers: 4, buf_size: 512 }, false),
            (polled, false),
            (polled, true),
        ]
    }

    /// Messages and bulk chunks interleaved arrive in the order sent, each by its lane, with
    /// the bulk ring wrapping many times and the sender held back while it is full.
    #[test]
    fn bulk_chunks_interleave_with_messages_in_order() {
        for (s, posted_frames) in every_strategy_small() {
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

    /// Bulk copies (stored into the peer's ring, the caller's bytes free at once) take what
    /// the ring has room for, and arrive whole and in order with the messages, on every
    /// strategy; without a peer's ring to store into they are refused.
    #[test]
    fn bulk_copies_take_what_fits_and_arrive_in_order() {
        let credit = FlowStrategy::Credit { buffers: 4, buf_size: 512 };
        let (_pd, mut a, _b) = pair_with(credit, PipeOptions { bulk_ring: 0, ..PipeOptions::default() });
        assert!(!a.bulk_copies() && a.try_send_bulk_copy(b"x").is_err());
        for (s, posted_frames) in every_strategy_small() {
            let o = PipeOptions { bulk_ring: 16 * 1024, posted_frames, ..PipeOptions::default() };
            let (_pd, mut a, mut b) = pair_with(s, o);
            assert!(a.bulk_copies(), "{s:?}: one process maps the peer's ring");
            let deadline = Instant::now() + T;
            // Item i: a message (i % 3 == 0) or bulk bytes, up to twice the largest chunk.
            let item_len = |i: usize| if i.is_multiple_of(3) { 1 + i % 400 } else { 1 + (i * 1237) % 9000 };
            let item = |i: usize| -> Vec<u8> { (0..item_len(i)).map(|k| ((k * 7 + i * 13) % 251) as u8).collect() };
            let (mut next, mut offset, mut got, mut partial, mut blocked) = (0usize, 0usize, 0usize, 0usize, 0usize);
            let mut pending: Vec<u8> = Vec::new();
            const N: usize = 300;
            let mut round = 0usize;
            while got < N {
                assert!(Instant::now() < deadline, "{s:?}: stalled at {got}");
                round += 1;
                if next < N {
                    let bytes = item(next);
                    if next % 3 == 0 {
                        if a.try_send(&msg(next as u64, bytes.len())).unwrap() {
                            next += 1;
                        } else {
                            blocked += 1;
                        }
                    } else {
                        let n = a.try_send_bulk_copy(&bytes[offset..]).unwrap();
                        assert!(n <= a.bulk_chunk_max());
                        if n == 0 {
                            blocked += 1;
                        } else if offset + n < bytes.len() {
                            offset += n;
                            partial += 1;
                        } else {
                            (next, offset) = (next + 1, 0);
                        }
                    }
                }
                a.progress().unwrap();
                a.flush().unwrap();
                if round.is_multiple_of(16) || next == N {
                    while let Some((lane, bytes)) = b.recv_lane(|l, m| (l, m.to_vec())).unwrap() {
                        if got % 3 == 0 {
                            assert_eq!((lane, bytes), (Lane::Message, msg(got as u64, item_len(got))), "item {got}");
                            got += 1;
                        } else {
                            assert_eq!(lane, Lane::Bulk, "item {got}");
                            pending.extend_from_slice(&bytes);
                            if pending.len() >= item_len(got) {
                                assert_eq!(pending, item(got), "{s:?}: item {got}");
                                pending.clear();
                                got += 1;
                            }
                        }
                    }
                }
                b.progress().unwrap();
            }
            assert!(
                blocked > 0 && partial > 0,
                "{s:?}: the ring never filled up ({blocked} blocked, {partial} partial)"
            );
        }
    }

    /// A message sent from two parts arrives as one message, joined, in order with messages
    /// sent whole. Only the polled strategy takes such messages (where its frame can go at
    /// once: stored through the window, or small enough to post inline); the others say so,
    /// sending nothing. A message over the largest is refused.
    #[test]
    fn gathered_messages_arrive_joined_where_the_pipe_takes_them() {
        for (s, posted_frames) in every_strategy_small() {
            let o = PipeOptions { posted_frames, ..PipeOptions::default() };
            let (_pd, mut a, mut b) = pair_with(s, o);
            let max = s.max_message();
            assert!(a.try_send_gathered(&[1; 8], &vec![2; max - 7]).is_err(), "{s:?}: over the largest");
            let body = |i: usize| -> Vec<u8> { (0..(i * 37) % (max - 8)).map(|k| (k ^ i) as u8).collect() };
            let deadline = Instant::now() + T;
            let (mut got, mut gathered) = (0, 0);
            const N: usize = 100;
            for i in 0..N {
                let head = (i as u64).to_le_bytes();
                loop {
                    assert!(Instant::now() < deadline, "{s:?}: stalled at {i}");
                    if a.try_send_gathered(&head, &body(i)).unwrap() {
                        gathered += 1;
                        break;
                    }
                    if a.try_send(&[&head[..], &body(i)].concat()).unwrap() {
                        break;
                    }
                    a.progress().unwrap();
                    while let Some(m) = b.recv_with(|m| m.to_vec()).unwrap() {
                        assert_eq!(m, [&(got as u64).to_le_bytes()[..], &body(got)].concat(), "{s:?}: message {got}");
                        got += 1;
                    }
                }
                a.flush().unwrap();
            }
            while got < N {
                assert!(Instant::now() < deadline, "{s:?}: stalled at {got} received");
                if let Some(m) = b.recv_with(|m| m.to_vec()).unwrap() {
                    assert_eq!(m, [&(got as u64).to_le_bytes()[..], &body(got)].concat(), "{s:?}: message {got}");
                    got += 1;
                }
                a.progress().unwrap();
            }
            match s {
                FlowStrategy::Polled { .. } => assert!(gathered > 0, "{s:?}: nothing gathered"),
                _ => assert_eq!(gathered, 0, "{s:?}: only the polled strategy gathers"),
            }
        }
    }

    /// A framed bulk copy arrives as head, data and tail in one chunk, whole or not at all
    /// (refused while the ring lacks room for all of it, never cut), with cached or streaming
    /// stores, timed or not, and a reader that keeps
    /// finding chunks acknowledges them without a progress pass: a sender storing its own
    /// chunks waits for no completion, so nothing else would free its room.
    #[test]
    fn framed_bulk_copies_go_whole_and_readers_acknowledge_as_they_read() {
        for (s, posted_frames) in every_strategy_small() {
            let o = PipeOptions { bulk_ring: 16 * 1024, posted_frames, ..PipeOptions::default() };
            let (_pd, mut a, mut b) = pair_with(s, o);
            let max = a.bulk_chunk_max();
            assert!(a.try_send_bulk_copy_framed(&[], &[], &[]).is_err(), "{s:?}: an empty chunk");
            assert!(a.try_send_bulk_copy_framed(b"h", &vec![0; max], &[]).is_err(), "{s:?}: over the largest chunk");
            let deadline = Instant::now() + T;
            let (mut sent, mut got, mut refused) = (0usize, 0usize, 0usize);
            const N: usize = 200;
            while got < N {
                assert!(Instant::now() < deadline, "{s:?}: stalled at {got} of {sent} sent");
                // Up to the ring's full width unread, so the sender meets a full ring.
                while sent < N && sent < got + 8 {
                    let data: Vec<u8> = (0..(sent * 811) % (max - 16)).map(|k| (k + sent) as u8).collect();
                    let (head, tail) = ((sent as u32).to_le_bytes(), [0xee; 3]);
                    a.set_bulk_streaming(sent % 2 == 1);
                    let stored = if sent % 3 == 0 {
                        a.try_send_bulk_copy_timed(&head, &data, &tail, true).unwrap().is_some()
                    } else {
                        a.try_send_bulk_copy_framed(&head, &data, &tail).unwrap()
                    };
                    if !stored {
                        refused += 1;
                        break;
                    }
                    sent += 1;
                }
                // The sender's own pass takes in acknowledgements; the reader reads what was
                // sent and no further (a read that finds nothing runs a progress pass).
                a.progress().unwrap();
                while got < sent {
                    let Some((lane, bytes)) = b.recv_lane(|l, m| (l, m.to_vec())).unwrap() else { break };
                    let n = (got * 811) % (max - 16);
                    assert_eq!(lane, Lane::Bulk, "{s:?}: chunk {got}");
                    assert_eq!(bytes.len(), 4 + n + 3, "{s:?}: chunk {got} cut or joined");
                    assert_eq!(bytes[..4], (got as u32).to_le_bytes(), "{s:?}: chunk {got} out of order");
                    assert!(bytes[4..4 + n].iter().enumerate().all(|(k, &x)| x == (k + got) as u8));
                    assert_eq!(bytes[4 + n..], [0xee; 3]);
                    got += 1;
                }
            }
            assert!(refused > 0, "{s:?}: the ring never filled up: the test did not test a full ring");
        }
    }

    /// A sender that closes once its bulk copies are stored (they complete at once) leaves
    /// them readable: the receiver's acknowledgements to the gone peer are not failures.
    #[test]
    fn bulk_copies_stay_readable_after_the_sender_is_gone() {
        let (_pd, mut a, mut b) = pair_with(
            FlowStrategy::Polled { ring_bytes: 4096, coalesce: 700 },
            PipeOptions { bulk_ring: 16 * 1024, ..PipeOptions::default() },
        );
        let data: Vec<u8> = (0..12 * 1024u32).map(|i| (i % 253) as u8).collect();
        let mut sent = 0;
        let deadline = Instant::now() + T;
        while sent < data.len() {
            assert!(Instant::now() < deadline, "the ring never took the data");
            sent += a.try_send_bulk_copy(&data[sent..]).unwrap();
            a.progress().unwrap();
        }
        drop(a);
        let mut got = Vec::new();
        while got.len() < data.len() {
            assert!(Instant::now() < deadline, "stalled at {} bytes", got.len());
            if let Some(bytes) = b.recv_lane(|_, m| m.to_vec()).unwrap() {
                got.extend_from_slice(&bytes);
            }
            // A reader's progress writes the acknowledgements its reads made due.
            b.progress().unwrap();
        }
        assert_eq!(got, data);
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

    /// A polled pipe posts a bulk chunk together with the frame that announces it; where that
    /// frame cannot go (here: no staging buffer left, the chunk's framing took the last), the
    /// chunk goes alone at once and its announcement follows once a buffer is back: the data
    /// arrives whole, in order with the messages around it.
    #[test]
    fn a_chunk_whose_announcement_must_wait_goes_first_and_arrives_in_order() {
        let polled = FlowStrategy::Polled { ring_bytes: 4096, coalesce: 700 };
        let o = PipeOptions { bulk_ring: 16 * 1024, posted_frames: true, ..PipeOptions::default() };
        let (pd, mut a, mut b) = pair_with(polled, o);
        let src: Vec<u8> = (0..3000u32).map(|i| (i * 7 % 251) as u8).collect();
        let reg = pd.register(src.clone().into_boxed_slice(), AccessFlags::NONE).unwrap();
        assert!(a.try_send(b"before").unwrap());
        a.flush().unwrap();
        // Every staging buffer but one held: the chunk's framing takes the last.
        let mut held = Vec::new();
        while a.send_pool.stats().in_use + 1 < a.send_pool.capacity() {
            held.push(a.send_pool.try_acquire().expect("a free buffer"));
        }
        let token = a.try_send_bulk_framed(b"head", reg.sge(0, src.len()), b"tail").unwrap().expect("room");
        assert!(a.held_chunk.is_none(), "the chunk was not posted");
        assert!(a.staged() > 0, "the announcement went without a staging buffer");
        drop(held);
        assert!(a.try_send(b"after").unwrap());
        let deadline = Instant::now() + T;
        let mut got = Vec::new();
        while got.len() < 3 {
            assert!(Instant::now() < deadline, "stalled after {got:?}");
            a.progress().unwrap();
            a.flush().unwrap();
            if let Some(x) = b.recv_lane(|l, m| (l, m.to_vec())).unwrap() {
                got.push(x);
            }
        }
        let chunk = [&b"head"[..], &src, b"tail"].concat();
        assert_eq!(got, [(Lane::Message, b"before".to_vec()), (Lane::Bulk, chunk), (Lane::Message, b"after".to_vec())]);
        while a.take_user_completion(token).is_none() {
            a.progress().unwrap();
            assert!(Instant::now() < deadline, "the chunk never completed");
        }
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
        // Polled: a message alone in its frame is read where it lies, not through the queues.
        for s in [
            FlowStrategy::Credit { buffers: 4, buf_size: 512 },
            FlowStrategy::Polled { ring_bytes: 4096, coalesce: 700 },
        ] {
            read_in_pieces(s);
        }
    }

    fn read_in_pieces(s: FlowStrategy) {
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
                    // Until everything accepted left too: `staged` says what the pipe still holds.
                    while next < N || got < N || p.staged() > 0 {
                        assert!(Instant::now() < deadline, "{s:?} stalled: sent {next}, got {got}: {:?}", p.stats());
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

    /// A pipe whose peer went away says so on every later call, not only on the one that
    /// found it: a layer above tells a peer that closed and left (its last messages read)
    /// from one that broke the protocol by the error's kind.
    #[test]
    fn a_gone_peer_is_reported_as_unreachable_on_every_later_call() {
        for s in strategies() {
            let (mut a, b) = pair(s);
            drop(b);
            let deadline = Instant::now() + T;
            let first = loop {
                match a.try_send(b"ping").and_then(|_| a.progress()) {
                    Err(e) => break e,
                    Ok(()) => assert!(Instant::now() < deadline, "{s:?}: the peer's absence went unseen"),
                }
            };
            assert!(matches!(first, VerbsError::PeerUnreachable(_)), "{s:?}: {first}");
            for later in [a.progress().unwrap_err(), a.try_send(b"again").unwrap_err()] {
                assert!(matches!(later, VerbsError::PeerUnreachable(_)), "{s:?}: {later}");
            }
            assert!(a.failure().is_some_and(|f| f.starts_with("peer unreachable")), "{s:?}");
        }
    }

    /// A peer's last messages, delivered before it went away, stay readable even when the
    /// failure is found (by a send) before they were looked for: a peer that said goodbye and
    /// left is told from one that vanished mid-conversation by what it said last.
    #[test]
    fn last_words_of_a_gone_peer_are_read_after_a_send_finds_it_gone() {
        for s in strategies() {
            let (mut a, mut b) = pair(s);
            assert!(b.try_send(b"goodbye").unwrap(), "{s:?}");
            b.flush().unwrap();
            // Delivered: the peer's queue pair saw its completion before it went.
            let deadline = Instant::now() + T;
            b.settle_unsignaled().unwrap();
            while !b.idle() {
                b.progress().unwrap();
                assert!(Instant::now() < deadline, "{s:?}: the last words were never delivered");
            }
            drop(b);
            let deadline = Instant::now() + T;
            loop {
                match a.try_send(b"ping").and_then(|_| a.flush()).and_then(|()| a.progress()) {
                    Err(e) => {
                        assert!(matches!(e, VerbsError::PeerUnreachable(_)), "{s:?}: {e}");
                        break;
                    }
                    Ok(()) => assert!(Instant::now() < deadline, "{s:?}: the peer's absence went unseen"),
                }
            }
            let last = a.recv_with(|m| m.to_vec()).unwrap_or_else(|e| panic!("{s:?}: {e}"));
            assert_eq!(last.as_deref(), Some(&b"goodbye"[..]), "{s:?}");
            assert!(matches!(a.recv_with(|m| m.to_vec()), Err(VerbsError::PeerUnreachable(_))), "{s:?}");
        }
    }

    /// The same for more frames than one progress pass takes from a polled ring: they are all
    /// read, in order, however the failure was found.
    #[test]
    fn a_polled_ring_is_read_to_its_end_after_a_progress_pass_found_the_peer_gone() {
        let s = FlowStrategy::Polled { ring_bytes: 8192, coalesce: 700 };
        let (mut a, mut b) = pair(s);
        let n = FRAMES_PER_PASS as u64 + 8;
        let deadline = Instant::now() + T;
        for i in 0..n {
            while !b.try_send(&msg(i, 24)).unwrap() {
                b.progress().unwrap();
                assert!(Instant::now() < deadline, "no room for message {i}");
            }
            b.flush().unwrap(); // a frame each
        }
        b.settle_unsignaled().unwrap();
        while !b.idle() {
            b.progress().unwrap();
            assert!(Instant::now() < deadline, "the messages were never delivered");
        }
        drop(b);
        let e = loop {
            match a.try_send(b"ping").and_then(|_| a.flush()).and_then(|()| a.progress()) {
                Err(e) => break e,
                Ok(()) => assert!(Instant::now() < deadline, "the peer's absence went unseen"),
            }
        };
        assert!(matches!(e, VerbsError::PeerUnreachable(_)), "{e}");
        for i in 0..n {
            let got = a.recv_with(|m| m.to_vec()).unwrap_or_else(|e| panic!("message {i}: {e}"));
            assert_eq!(got, Some(msg(i, 24)), "message {i}");
        }
        assert!(matches!(a.recv_with(|m| m.to_vec()), Err(VerbsError::PeerUnreachable(_))));
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

    /// A sleeper that prepares again and again without anything arriving (woken by other
    /// things, as a completion thread watching many connections is) announces once: more
    /// announcements than the send queue holds still leave the pipe working, and the peer's
    /// next frame still raises the wake-up.
    #[test]
    fn a_sleep_announced_and_not_answered_is_not_announced_again() {
        let (mut a, mut b) = pair(FlowStrategy::Polled { ring_bytes: 4096, coalesce: 700 });
        let before = a.stats().control;
        for _ in 0..2000 {
            assert!(a.prepare_sleep().unwrap(), "nothing arrived");
        }
        assert_eq!(a.stats().control, before + 1, "one announcement stands");
        b.send(b"wake", T).unwrap();
        assert!(crate::wait_any(&[a.cq()], T).unwrap(), "the frame raised a wake-up");
        let deadline = Instant::now() + T;
        let got = loop {
            if let Some(m) = a.recv_with(|m| m.to_vec()).unwrap() {
                break m;
            }
            assert!(Instant::now() < deadline, "the frame never came");
        };
        assert_eq!(got, b"wake");
        // Answered: the next sleep is announced anew.
        assert!(a.prepare_sleep().unwrap());
        assert_eq!(a.stats().control, before + 2);
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

    /// A release count, and a copy-out report, land in the peer's slots, stored directly or
    /// posted, under every strategy, without a message: the peer's messages queued unread do
    /// not hold them up.
    #[test]
    fn release_counts_and_copy_out_reports_reach_the_peer_past_unread_messages() {
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
                    b.report_copy_out(!count).unwrap();
                    let deadline = Instant::now() + T;
                    while a.peer_copy_out() != !count {
                        assert!(Instant::now() < deadline, "{s:?} posted {posted}: report {count} never came");
                        a.progress().unwrap();
                        b.progress().unwrap();
                    }
                    assert_eq!(a.peer_released(), count, "{s:?}: the slots are apart");
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
