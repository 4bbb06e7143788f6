//! Flow control, sans-IO: the message-record format and the accounting of the three strategies
//! of the SDP flow-control slides. Plain data and functions; [`super::pipe`] drives them over a
//! queue pair. Everything a peer tells us (credits, acknowledged positions, record lengths) is
//! checked here, and a violation is an [`FcError`], never a silent overrun.
//!
//! - **Credit-based**: the receiver pre-posts N buffers; each message takes one credit; freed
//!   buffers return as credits piggybacked on reverse traffic, or in an explicit credit message
//!   once half are owed. The last credit is reserved for credit messages, so two sides can never
//!   deadlock waiting for each other's credits.
//! - **RDMA-based**: the sender manages the receiver's ring and places chunks with RDMA
//!   write-with-immediate; small messages are coalesced into one chunk up to a threshold; the
//!   receiver returns the consumed position.
//! - **NIC-assisted** (virtual window): the receiver posts N/W receives of W bytes; the sender
//!   sends segments of at most W without credits (the transport's receiver-not-ready retries
//!   queue what finds no receive) and coalesces what queues up behind outstanding sends.

/// Bytes of a record header.
pub const RECORD_HEADER: usize = 16;

/// Why a peer's flow-control data was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FcError {
    /// The peer granted credits it cannot have (more than it was ever given).
    #[error("peer granted {granted} credits, more than the {limit} it could owe")]
    Overgrant {
        /// Credits the peer claimed.
        granted: u64,
        /// The most it could owe.
        limit: u64,
    },
    /// The peer acknowledged a ring position it never received.
    #[error("peer acknowledged ring position {acked} (sent so far {sent}, acknowledged before {previous})")]
    BadAck {
        /// Position the peer claimed.
        acked: u64,
        /// Bytes actually sent.
        sent: u64,
        /// Previous acknowledgement.
        previous: u64,
    },
    /// The peer wrote past the ring space it was allotted.
    #[error("peer chunk of {len} bytes at ring position {at} exceeds its allotted space ({space} bytes free)")]
    RingOverrun {
        /// Chunk length.
        len: u64,
        /// Where it would start.
        at: u64,
        /// Space the sender was allowed.
        space: u64,
    },
    /// A record is malformed (unknown kind, lengths that do not add up).
    #[error("malformed record: {0}")]
    BadRecord(&'static str),
    /// The peer sent more messages than it had credits for, or named an unknown buffer.
    #[error("peer used a receive buffer it had no credit for")]
    NoCredit,
}

/// Kind of a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordKind {
    /// Application bytes.
    Data,
    /// An explicit credit grant (no payload).
    Credit,
    /// Setup information (strategy parameters, ring address and key).
    Setup,
    /// A bulk-lane chunk announced in a polled frame (the polled strategy's bulk chunks carry
    /// no immediate): its payload is a [`BulkNote`].
    Bulk,
}

/// The payload of a [`RecordKind::Bulk`] record: where the chunk lies in the bulk ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BulkNote {
    /// Chunk bytes.
    pub len: u32,
    /// True if the chunk starts a new lap of the bulk ring.
    pub wrapped: bool,
}

impl BulkNote {
    /// Bytes of an encoded note.
    pub const BYTES: usize = 8;

    /// Encodes the note.
    pub fn encode(&self) -> [u8; BulkNote::BYTES] {
        let mut b = [0u8; BulkNote::BYTES];
        b[0..4].copy_from_slice(&self.len.to_le_bytes());
        b[4] = self.wrapped as u8;
        b
    }

    /// Decodes a note (a [`RecordKind::Bulk`] record's payload).
    pub fn decode(b: &[u8]) -> Result<BulkNote, FcError> {
        let b: &[u8; BulkNote::BYTES] = b.try_into().map_err(|_| FcError::BadRecord("bulk note of the wrong size"))?;
        if b[4] > 1 || b[5..8] != [0; 3] {
            return Err(FcError::BadRecord("bulk note with unknown flags"));
        }
        Ok(BulkNote { len: u32::from_le_bytes(b[0..4].try_into().expect("4 bytes")), wrapped: b[4] == 1 })
    }
}

/// A decoded record header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record {
    /// What it is.
    pub kind: RecordKind,
    /// Credits granted to the receiver of this record (credit strategy).
    pub credits: u16,
    /// Payload bytes following the header.
    pub len: u32,
    /// Ring bytes the sender of this record has consumed of the receiver's writes (RDMA
    /// strategy), 0 if it says nothing.
    pub ack: u64,
}

impl Record {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; RECORD_HEADER] {
        let mut b = [0u8; RECORD_HEADER];
        b[0] = match self.kind {
            RecordKind::Data => 1,
            RecordKind::Credit => 2,
            RecordKind::Setup => 3,
            RecordKind::Bulk => 4,
        };
        b[2..4].copy_from_slice(&self.credits.to_le_bytes());
        b[4..8].copy_from_slice(&self.len.to_le_bytes());
        b[8..16].copy_from_slice(&self.ack.to_le_bytes());
        b
    }

    /// Decodes one header.
    pub fn decode(b: &[u8; RECORD_HEADER]) -> Result<Record, FcError> {
        let kind = match b[0] {
            1 => RecordKind::Data,
            2 => RecordKind::Credit,
            3 => RecordKind::Setup,
            4 => RecordKind::Bulk,
            _ => return Err(FcError::BadRecord("unknown kind")),
        };
        if b[1] != 0 {
            return Err(FcError::BadRecord("unknown flags"));
        }
        let r = Record {
            kind,
            credits: u16::from_le_bytes([b[2], b[3]]),
            len: u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")),
            ack: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
        };
        if r.kind == RecordKind::Credit && r.len != 0 {
            return Err(FcError::BadRecord("credit record with a payload"));
        }
        if r.kind == RecordKind::Bulk && r.len as usize != BulkNote::BYTES {
            return Err(FcError::BadRecord("bulk record whose payload is not a note"));
        }
        Ok(r)
    }
}

/// The records of one chunk: (header, payload range) pairs, inline for the usual few.
pub type ParsedChunk = smallvec::SmallVec<[(Record, std::ops::Range<usize>); 4]>;

/// Splits a received chunk into records, validating every length. Returns (header, payload
/// range) pairs (without allocating for up to four records).
pub fn parse_chunk(chunk: &[u8]) -> Result<ParsedChunk, FcError> {
    records(chunk).collect()
}

/// The records of a received chunk, one at a time, each length validated before it is
/// yielded: (header, payload range) pairs, then at most one error (and nothing after it).
/// What the receive path walks without collecting.
pub fn records(chunk: &[u8]) -> Records<'_> {
    Records { chunk, at: 0 }
}

/// Iterator of [`records`].
#[derive(Debug)]
pub struct Records<'a> {
    chunk: &'a [u8],
    at: usize,
}

impl Iterator for Records<'_> {
    type Item = Result<(Record, std::ops::Range<usize>), FcError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.at >= self.chunk.len() {
            return None;
        }
        let at = self.at;
        // Whatever happens, this record is the last one looked at if it is bad.
        self.at = self.chunk.len();
        let Some(hdr) = self.chunk.get(at..at + RECORD_HEADER).and_then(|s| <&[u8; RECORD_HEADER]>::try_from(s).ok())
        else {
            return Some(Err(FcError::BadRecord("chunk ends inside a header")));
        };
        let r = match Record::decode(hdr) {
            Ok(r) => r,
            Err(e) => return Some(Err(e)),
        };
        let start = at + RECORD_HEADER;
        let Some(end) = start.checked_add(r.len as usize) else {
            return Some(Err(FcError::BadRecord("length overflows")));
        };
        if end > self.chunk.len() {
            return Some(Err(FcError::BadRecord("payload runs past the chunk")));
        }
        self.at = end;
        Some(Ok((r, start..end)))
    }
}

/// Credit accounting of one side of a connection (it both sends and receives).
#[derive(Clone, Debug)]
pub struct Credits {
    /// Credits we hold: messages we may still send into the peer's buffers.
    available: u64,
    /// Buffers we freed and have not yet granted back.
    owed: u64,
    /// Buffers the peer may be holding of ours (posted at start): the most it can ever hold.
    limit: u64,
    /// Messages received that had no credit (must stay 0).
    peer_outstanding: u64,
}

impl Credits {
    /// Both sides post `n` buffers; each starts with `n` credits.
    pub fn new(n: u64) -> Credits {
        Credits { available: n, owed: 0, limit: n, peer_outstanding: 0 }
    }
    /// Credits held now.
    pub fn available(&self) -> u64 {
        self.available
    }
    /// May a data message go now? The last credit is kept for credit messages.
    pub fn can_send_data(&self) -> bool {
        self.available >= 2
    }
    /// May a credit message go now?
    pub fn can_send_credit(&self) -> bool {
        self.available >= 1 && self.owed > 0
    }
    /// Takes a credit for an outgoing message; returns the credits to piggyback on it.
    pub fn on_send(&mut self) -> u16 {
        debug_assert!(self.available >= 1);
        self.available -= 1;
        let grant = self.owed.min(u16::MAX as u64);
        self.owed -= grant;
        grant as u16
    }
    /// Takes what is owed, to grant on a message that already took its credit (a record
    /// packed into a message on its way).
    pub fn take_grant(&mut self) -> u16 {
        let grant = self.owed.min(u16::MAX as u64);
        self.owed -= grant;
        grant as u16
    }
    /// Takes a credit for a transfer that cannot carry a grant (a bulk-lane chunk, whose
    /// notification consumes a posted buffer): what is owed stays owed.
    pub fn on_send_bare(&mut self) {
        debug_assert!(self.available >= 1);
        self.available -= 1;
    }
    /// A message from the peer arrived (in one of our posted buffers) carrying `grant`.
    pub fn on_receive(&mut self, grant: u16) -> Result<(), FcError> {
        self.peer_outstanding += 1;
        if self.peer_outstanding > self.limit {
            return Err(FcError::NoCredit);
        }
        let available = self.available + grant as u64;
        if available > self.limit {
            return Err(FcError::Overgrant { granted: grant as u64, limit: self.limit - self.available });
        }
        self.available = available;
        Ok(())
    }
    /// We consumed a received message and reposted its buffer.
    pub fn on_buffer_freed(&mut self) {
        self.peer_outstanding -= 1;
        self.owed += 1;
    }
    /// Should an explicit credit message go (half the buffers are owed and nothing else is
    /// going to carry them)?
    pub fn needs_update(&self) -> bool {
        self.owed * 2 >= self.limit
    }
    /// Credits owed to the peer.
    pub fn owed(&self) -> u64 {
        self.owed
    }
}

/// The sender's view of the peer's ring (RDMA strategy).
#[derive(Clone, Debug)]
pub struct RingSender {
    size: u64,
    sent: u64,
    acked: u64,
    /// `sent` before the latest reservation, for `unreserve`.
    before_last: u64,
}

/// Where a chunk goes in the peer's ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkPlace {
    /// Byte offset in the ring.
    pub offset: u64,
    /// True if the chunk starts a new lap (the tail of the previous lap is skipped).
    pub wrapped: bool,
}

impl RingSender {
    /// A ring of `size` bytes, a power of two (offsets are masked, not divided: a division
    /// costs tens of cycles on the message path).
    pub fn new(size: u64) -> RingSender {
        assert!(size.is_power_of_two(), "ring of {size} bytes: not a power of two");
        RingSender { size, sent: 0, acked: 0, before_last: 0 }
    }
    /// The largest chunk ever placed: a quarter of the ring. A chunk that does not fit before
    /// the end skips the tail, so a reservation may need up to twice its size; with chunks of
    /// at most R/4 that is at most R/2, always available once the receiver has acknowledged
    /// down to its threshold (R/4 unacknowledged) — the sender can never wait for an
    /// acknowledgement the receiver has no reason to send.
    pub fn max_chunk(&self) -> u64 {
        self.size / 4
    }
    /// The largest chunk [`RingSender::reserve`] places now: at most
    /// [`RingSender::max_chunk`], 0 if the ring has no room (for a sender that takes what fits
    /// rather than waiting for room for all it has).
    pub fn largest_chunk(&self) -> u64 {
        let free = self.size - (self.sent - self.acked);
        let before_end = self.size - (self.sent & (self.size - 1));
        // Up to the end of the ring, or, skipping that tail, from its start.
        free.min(before_end).max(free.saturating_sub(before_end)).min(self.max_chunk())
    }
    /// Reserves `len` bytes; None if the ring lacks room now.
    pub fn reserve(&mut self, len: u64) -> Option<ChunkPlace> {
        assert!(len > 0 && len <= self.max_chunk(), "chunk size out of range");
        let off = self.sent & (self.size - 1);
        let (skip, wrapped) = if off + len > self.size { (self.size - off, true) } else { (0, false) };
        if self.sent + skip + len - self.acked > self.size {
            return None;
        }
        self.before_last = self.sent;
        self.sent += skip;
        let offset = self.sent & (self.size - 1);
        self.sent += len;
        Some(ChunkPlace { offset, wrapped })
    }
    /// Gives back the most recent reservation (its chunk was not sent), skipped tail included.
    pub fn unreserve(&mut self) {
        self.sent = self.before_last;
    }

    /// The receiver says it consumed up to `pos`. Acknowledgements travel two ways
    /// (piggybacked and written directly), so an older one arriving late is ignored; one past
    /// what was sent is an error.
    pub fn on_ack(&mut self, pos: u64) -> Result<(), FcError> {
        if pos > self.sent {
            return Err(FcError::BadAck { acked: pos, sent: self.sent, previous: self.acked });
        }
        self.acked = self.acked.max(pos);
        Ok(())
    }
    /// Bytes in flight (sent, not acknowledged).
    pub fn in_flight(&self) -> u64 {
        self.sent - self.acked
    }
    /// Whether a chunk of the largest size fits now (half the ring free always holds one,
    /// skipped tail included).
    pub fn has_room_for_max(&self) -> bool {
        self.in_flight() * 2 <= self.size
    }
    /// Ring position after the last reservation.
    pub fn sent(&self) -> u64 {
        self.sent
    }
}

/// The receiver's view of its own ring (RDMA strategy).
#[derive(Clone, Debug)]
pub struct RingReceiver {
    size: u64,
    received: u64,
    consumed: u64,
    acked: u64,
}

impl RingReceiver {
    /// A ring of `size` bytes, a power of two (0: no ring, nothing may arrive).
    pub fn new(size: u64) -> RingReceiver {
        assert!(size == 0 || size.is_power_of_two(), "ring of {size} bytes: not a power of two");
        RingReceiver { size, received: 0, consumed: 0, acked: 0 }
    }

    fn offset(&self, pos: u64) -> u64 {
        pos & self.size.wrapping_sub(1)
    }
    /// A chunk of `len` bytes was announced (write-with-immediate), `wrapped` if it starts a
    /// new lap. Returns its offset in the ring, after checking it lies in the sender's space.
    pub fn on_chunk(&mut self, len: u64, wrapped: bool) -> Result<u64, FcError> {
        let off = self.offset(self.received);
        let skip = if wrapped { self.size - off } else { 0 };
        if wrapped && off == 0 {
            return Err(FcError::BadRecord("wrap announced at the start of a lap"));
        }
        let start = self.received + skip;
        let space = self.size - (self.received - self.consumed);
        if len == 0 || len > self.size / 4 || self.offset(start) + len > self.size || skip + len > space {
            return Err(FcError::RingOverrun { len, at: start, space });
        }
        self.received = start + len;
        Ok(self.offset(start))
    }
    /// The application finished with `len` more bytes (chunks are consumed in order, skips
    /// included via [`RingReceiver::consume_to`]).
    pub fn consume_to(&mut self, pos_after_chunk: u64) {
        debug_assert!(pos_after_chunk <= self.received && pos_after_chunk >= self.consumed);
        self.consumed = pos_after_chunk;
    }
    /// Position after the last announced chunk.
    pub fn received(&self) -> u64 {
        self.received
    }
    /// Should an explicit acknowledgement go (a quarter of the ring is unacknowledged)?
    pub fn needs_ack(&self) -> bool {
        (self.consumed - self.acked) * 4 >= self.size
    }
    /// Takes the position to acknowledge (piggybacked or explicit).
    pub fn take_ack(&mut self) -> u64 {
        self.acked = self.consumed;
        self.consumed
    }
    /// The position an acknowledgement would carry now, without taking it (for a record
    /// that may yet be refused: [`RingReceiver::acked_to`] once it is on its way).
    pub fn ack_due(&self) -> u64 {
        self.consumed
    }
    /// An acknowledgement of `pos` (from [`RingReceiver::ack_due`]) is on its way.
    pub fn acked_to(&mut self, pos: u64) {
        self.acked = self.acked.max(pos);
    }
}

/// Coalesces small messages into one chunk up to a threshold (RDMA and NIC-assisted).
#[derive(Clone, Debug, Default)]
pub struct Coalescer {
    staged: Vec<u8>,
    records: usize,
    /// No record may join the staged chunk (it ends with one that must come last).
    sealed: bool,
}

impl Coalescer {
    /// Appends a record; false if it would make the chunk exceed `max`, or the chunk is
    /// sealed (flush first).
    pub fn push(&mut self, rec: Record, payload: &[u8], max: usize) -> bool {
        if self.sealed || (!self.staged.is_empty() && self.staged.len() + RECORD_HEADER + payload.len() > max) {
            return false;
        }
        self.staged.extend_from_slice(&rec.encode());
        self.staged.extend_from_slice(payload);
        self.records += 1;
        true
    }
    /// Bytes staged.
    pub fn len(&self) -> usize {
        self.staged.len()
    }
    /// Nothing staged.
    pub fn is_empty(&self) -> bool {
        self.staged.is_empty()
    }
    /// Takes the staged chunk and the number of records in it.
    pub fn take(&mut self) -> (Vec<u8>, usize) {
        let n = std::mem::take(&mut self.records);
        (std::mem::take(&mut self.staged), n)
    }
    /// The staged bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.staged
    }
    /// Clears after the staged bytes were copied out.
    pub fn clear(&mut self) {
        self.staged.clear();
        self.records = 0;
        self.sealed = false;
    }
    /// Closes the staged chunk to further records until it is flushed.
    pub fn seal(&mut self) {
        self.sealed = true;
    }
}

// ---------------------------------------------------------------------------------------------
// Polled frames (polled strategy)
// ---------------------------------------------------------------------------------------------

/// Ring alignment of a polled frame: a small message and its framing share one cache line.
pub const FRAME_ALIGN: u64 = 64;
/// Framing bytes of a polled frame: the publish word before the body and its copy after it.
pub const FRAME_OVERHEAD: usize = 16;
/// Largest polled ring: frame bodies (a quarter of it at most) fit the publish word's length.
pub const MAX_POLLED_RING: u64 = 64 << 20;
const FRAME_LEN_BITS: u32 = 24;
const FRAME_STAMP_BITS: u32 = 39;
const FRAME_VALID: u64 = 1 << 63;

/// A polled frame is one RDMA write of `[publish word][body, padded to 8][publish word]`
/// placed at a [`FRAME_ALIGN`]-aligned ring position; the body is records. The publish word
/// holds the body's length and a stamp of the frame's ring position, so that nothing the ring
/// held before (earlier laps, bytes of other frames, zeroes) can pass for it. The receiver
/// polls the word at its next position; once it carries the expected stamp, the length tells
/// where the closing copy lies, and once that is there too the whole frame is: a write's last
/// bytes are placed last (how RDMA fast paths poll, and what the software provider
/// guarantees). No receive is posted and no completion is raised per message.
///
/// The publish word of a frame with a `body`-byte body at ring position `pos`.
pub fn frame_word(pos: u64, body: usize) -> u64 {
    let stamp = (pos / FRAME_ALIGN) & ((1 << FRAME_STAMP_BITS) - 1);
    FRAME_VALID | stamp << FRAME_LEN_BITS | body as u64
}

/// Bytes a frame with a `body`-byte body writes: the body padded to 8 and the two words.
pub fn frame_written(body: usize) -> usize {
    FRAME_OVERHEAD + body.next_multiple_of(8)
}

/// Ring bytes a frame with a `body`-byte body takes (the next frame starts aligned).
pub fn frame_reserved(body: usize) -> u64 {
    (frame_written(body) as u64).next_multiple_of(FRAME_ALIGN)
}

/// Largest frame body in a ring of `ring` bytes (a frame takes at most a quarter of it).
pub const fn frame_body_max(ring: u64) -> usize {
    (ring / 4) as usize - FRAME_OVERHEAD
}

/// What goes around a `body`-byte frame body at ring position `pos`: the publish word (before
/// the body and again after it) and the zero padding between the body and the closing word.
/// A frame is written as `[word, body.., padding, word]`, from its parts or from a copy
/// ([`encode_frame`]).
pub fn frame_framing(pos: u64, body: usize) -> ([u8; 8], &'static [u8]) {
    (frame_word(pos, body).to_le_bytes(), &[0; 7][..body.next_multiple_of(8) - body])
}

/// Frames a body made of `parts` (put end to end) for ring position `pos` into `out` (at
/// least [`frame_written`] bytes); returns the bytes to write.
pub fn encode_frame<'a>(pos: u64, parts: &[&[u8]], out: &'a mut [u8]) -> &'a [u8] {
    let body: usize = parts.iter().map(|p| p.len()).sum();
    let (word, pad) = frame_framing(pos, body);
    let mut at = 0;
    for p in [&word[..]].into_iter().chain(parts.iter().copied()).chain([pad, &word[..]]) {
        out[at..at + p.len()].copy_from_slice(p);
        at += p.len();
    }
    debug_assert_eq!(at, frame_written(body));
    &out[..at]
}

/// Reads 8-byte words of a polled ring (atomically, in the driver; from a byte array in tests).
pub trait RingWords {
    /// The word at byte offset `off` (8-aligned, inside the ring).
    fn word(&self, off: u64) -> u64;
}

/// A frame found whole in the ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameAt {
    /// Ring offset of its body.
    pub body_off: u64,
    /// Body bytes.
    pub body_len: usize,
    /// Ring position after it (what to acknowledge once its records are read).
    pub end_pos: u64,
}

/// Finds the next frame of a polled ring if it has arrived whole (None: nothing yet, or still
/// arriving), checks that it lies in the space the sender was allotted, and accounts for it
/// in `rx` (the ring's consumption and acknowledgements, as for RDMA chunks). A frame that
/// would not fit before the ring's end starts the next lap, so near the end both places are
/// looked at (the stamps tell them apart).
#[inline]
pub fn poll_frame(rx: &mut RingReceiver, ring: &impl RingWords) -> Result<Option<FrameAt>, FcError> {
    let size = rx.size;
    let pos = rx.received();
    let left = size - rx.offset(pos);
    let (start, reserved, body, wrapped) = match whole_frame(size, ring, pos)? {
        Some((body, reserved)) => (pos, reserved, body, false),
        None if left < size / 4 => {
            let Some((body, reserved)) = whole_frame(size, ring, pos + left)? else { return Ok(None) };
            // Frames are written in order, so a frame at `pos` not yet whole shows its publish
            // word by now if there is one: then the frame at the next lap's start followed it
            // without wrapping, and is taken in its turn.
            if ring.word(rx.offset(pos)) >> FRAME_LEN_BITS == frame_word(pos, 0) >> FRAME_LEN_BITS {
                return Ok(None);
            }
            if reserved <= left {
                return Err(FcError::BadRecord("a frame wrapped though it fitted before the ring's end"));
            }
            (pos + left, reserved, body, true)
        }
        None => return Ok(None),
    };
    rx.on_chunk(reserved, wrapped)?;
    Ok(Some(FrameAt { body_off: rx.offset(start) + 8, body_len: body, end_pos: rx.received() }))
}

/// Whether the next frame of a polled ring has begun arriving: its publish word is at the
/// ring's next position or, near the ring's end, at the next lap's start. Two loads and
/// compares at most, for a receiver spinning on an empty ring; [`poll_frame`] makes the
/// checks (a frame begun may not be whole yet, or may be bad).
#[inline]
pub fn frame_begun(rx: &RingReceiver, ring: &impl RingWords) -> bool {
    let pos = rx.received();
    let off = rx.offset(pos);
    let stamp_of = |word: u64| word >> FRAME_LEN_BITS;
    if stamp_of(ring.word(off)) == stamp_of(frame_word(pos, 0)) {
        return true;
    }
    let left = rx.size - off;
    left < rx.size / 4 && stamp_of(ring.word(0)) == stamp_of(frame_word(pos + left, 0))
}

/// The frame at ring position `start` if it is whole: its body length and the ring bytes it
/// takes.
#[inline]
fn whole_frame(size: u64, ring: &impl RingWords, start: u64) -> Result<Option<(usize, u64)>, FcError> {
    let off = start & (size - 1);
    let word = ring.word(off);
    let body = (word & ((1 << FRAME_LEN_BITS) - 1)) as usize;
    if word != frame_word(start, body) {
        return Ok(None);
    }
    let (written, reserved) = (frame_written(body) as u64, frame_reserved(body));
    if reserved > size / 4 || off + reserved > size {
        return Err(FcError::RingOverrun { len: reserved, at: start, space: size - off });
    }
    if ring.word(off + written - 8) != word {
        return Ok(None);
    }
    Ok(Some((body, reserved)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_last_credit_is_reserved_and_updates_never_deadlock() {
        let (mut a, mut b) = (Credits::new(4), Credits::new(4));
        // A sends until it may not: 3 data messages, keeping the last credit.
        let mut sent = 0;
        while a.can_send_data() {
            let g = a.on_send();
            b.on_receive(g).unwrap();
            sent += 1;
        }
        assert_eq!((sent, a.available()), (3, 1));
        // B's application frees the buffers; B owes 3 and must say so even with no data to send.
        for _ in 0..3 {
            b.on_buffer_freed();
        }
        assert!(b.needs_update() && b.can_send_credit());
        let g = b.on_send();
        a.on_receive(g).unwrap();
        a.on_buffer_freed(); // the credit message's buffer
        assert_eq!(a.available(), 4);
    }

    #[test]
    fn overgrant_and_uncredited_messages_are_detected() {
        let mut a = Credits::new(4);
        assert!(matches!(a.on_receive(1), Err(FcError::Overgrant { .. })));
        let mut b = Credits::new(2);
        b.on_receive(0).unwrap();
        b.on_receive(0).unwrap();
        assert_eq!(b.on_receive(0), Err(FcError::NoCredit));
    }

    #[test]
    fn ring_acks_are_checked() {
        let mut s = RingSender::new(1024);
        s.reserve(100).unwrap();
        assert!(s.on_ack(200).is_err());
        s.on_ack(100).unwrap();
        s.on_ack(50).unwrap(); // a late, older acknowledgement changes nothing
        assert_eq!(s.in_flight(), 0);
    }

    #[test]
    fn ring_receiver_refuses_chunks_past_the_allotted_space() {
        let mut r = RingReceiver::new(1024);
        for _ in 0..4 {
            r.on_chunk(256, false).unwrap();
        }
        assert!(matches!(r.on_chunk(100, false), Err(FcError::RingOverrun { .. })));
        let mut r = RingReceiver::new(1024);
        assert!(matches!(r.on_chunk(300, false), Err(FcError::RingOverrun { .. })), "over a quarter of the ring");
        assert!(r.on_chunk(0, false).is_err());
    }

    proptest! {
        /// A deterministic in-memory pair: random chunk sizes, random consumption and
        /// acknowledgement timing; nothing lost, duplicated, reordered or overrun.
        #[test]
        fn ring_pair_never_loses_reorders_or_overruns(ops in proptest::collection::vec((1u64..256, 0u8..4), 1..400)) {
            let size = 1024;
            let mut s = RingSender::new(size);
            let mut r = RingReceiver::new(size);
            let mut in_flight: std::collections::VecDeque<(u64, u64, bool, u64)> = Default::default(); // (seq, len, wrapped, offset)
            let mut delivered: std::collections::VecDeque<(u64, u64)> = Default::default(); // (seq, end pos)
            let mut next = 0u64;
            let mut expect = 0u64;
            for (len, op) in ops {
                match op {
                    0 => if let Some(p) = s.reserve(len) {
                        in_flight.push_back((next, len, p.wrapped, p.offset));
                        next += 1;
                    },
                    3 => {
                        // The largest chunk that fits is placed, and nothing larger would be.
                        let len = s.largest_chunk();
                        if len < s.max_chunk() {
                            let mut more = s.clone();
                            prop_assert!(more.reserve(len + 1).is_none(), "{} fit beyond the largest", len + 1);
                        }
                        if len > 0 {
                            let p = s.reserve(len);
                            prop_assert!(p.is_some(), "the largest chunk, {}, did not fit", len);
                            let p = p.unwrap();
                            in_flight.push_back((next, len, p.wrapped, p.offset));
                            next += 1;
                        }
                    }
                    1 => if let Some((seq, len, wrapped, offset)) = in_flight.pop_front() {
                        let at = r.on_chunk(len, wrapped).unwrap();
                        prop_assert_eq!(at, offset);
                        delivered.push_back((seq, r.received()));
                    },
                    _ => {
                        if let Some((seq, end)) = delivered.pop_front() {
                            prop_assert_eq!(seq, expect);
                            expect += 1;
                            r.consume_to(end);
                        }
                        let ack = r.take_ack();
                        s.on_ack(ack).unwrap();
                        prop_assert!(s.in_flight() <= size);
                    }
                }
            }
        }

        /// Random interleavings of two sides exchanging data and credits never overrun the
        /// receiver's posted buffers and never deadlock when both keep consuming.
        #[test]
        fn credit_pair_never_overruns(ops in proptest::collection::vec(0u8..4, 1..500), n in 2u64..16) {
            let mut side = [Credits::new(n), Credits::new(n)];
            let mut queues: [std::collections::VecDeque<u16>; 2] = Default::default(); // in flight to side i
            let mut held = [0u64; 2]; // messages received, not yet consumed, by side i
            for op in ops {
                let (from, to) = if op % 2 == 0 { (0, 1) } else { (1, 0) };
                if op < 2 {
                    // Data when a credit beyond the reserved one is left, else a credit update.
                    if side[from].can_send_data() || side[from].can_send_credit() {
                        let g = side[from].on_send();
                        queues[to].push_back(g);
                    }
                } else {
                    if let Some(g) = queues[to].pop_front() {
                        side[to].on_receive(g).unwrap();
                        held[to] += 1;
                    }
                    if held[to] > 0 {
                        held[to] -= 1;
                        side[to].on_buffer_freed();
                    }
                }
                for i in 0..2 {
                    prop_assert!(queues[i].len() as u64 + held[i] <= n, "receiver {} overrun", i);
                }
            }
        }

        #[test]
        fn chunks_of_arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = parse_chunk(&b);
        }

        #[test]
        fn coalesced_chunks_parse_back(msgs in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..50), 1..20)) {
            let mut c = Coalescer::default();
            for m in &msgs {
                let rec = Record { kind: RecordKind::Data, credits: 0, len: m.len() as u32, ack: 0 };
                prop_assert!(c.push(rec, m, usize::MAX));
            }
            let (chunk, n) = c.take();
            prop_assert_eq!(n, msgs.len());
            let recs = parse_chunk(&chunk).unwrap();
            let got: Vec<Vec<u8>> = recs.iter().map(|(_, r)| chunk[r.clone()].to_vec()).collect();
            prop_assert_eq!(got, msgs);
        }

        #[test]
        fn polled_frames_arrive_in_order_only_when_whole(
            bodies in proptest::collection::vec(0usize..300, 1..300),
            lag in 0usize..6,
        ) {
            const SIZE: u64 = 4096;
            let mut ring = ByteRing(vec![0xA5; SIZE as usize]);
            let (mut tx, mut rx) = (RingSender::new(SIZE), RingReceiver::new(SIZE));
            let mut sent: std::collections::VecDeque<(Vec<u8>, u64)> = Default::default();
            let mut next = 0usize;
            let mut buf = vec![0u8; 2048];
            while next < bodies.len() || !sent.is_empty() {
                // The receiver reads and consumes what arrived, lagging by up to `lag` frames.
                while sent.len() > lag || (next == bodies.len() && !sent.is_empty()) {
                    prop_assert!(frame_begun(&rx, &ring), "a whole frame is seen to have begun");
                    let f = poll_frame(&mut rx, &ring).unwrap().expect("a whole frame is found");
                    let (body, _) = sent.pop_front().unwrap();
                    prop_assert_eq!(&ring.0[f.body_off as usize..f.body_off as usize + f.body_len], &body[..]);
                    rx.consume_to(f.end_pos);
                    let ack = rx.take_ack();
                    tx.on_ack(ack).unwrap();
                }
                if next == bodies.len() {
                    break;
                }
                if sent.is_empty() {
                    prop_assert!(!frame_begun(&rx, &ring), "nothing has begun before it is written");
                    prop_assert_eq!(poll_frame(&mut rx, &ring).unwrap(), None, "nothing is found before it is written");
                }
                let body: Vec<u8> = (0..bodies[next]).map(|i| (i * 31 + next) as u8).collect();
                let Some(place) = tx.reserve(frame_reserved(body.len())) else {
                    prop_assert!(!sent.is_empty(), "an empty ring always has room");
                    let f = poll_frame(&mut rx, &ring).unwrap().unwrap();
                    sent.pop_front();
                    rx.consume_to(f.end_pos);
                    let ack = rx.take_ack();
                    tx.on_ack(ack).unwrap();
                    continue;
                };
                let pos = tx.sent() - frame_reserved(body.len());
                prop_assert_eq!(pos % SIZE, place.offset);
                let bytes = encode_frame(pos, &[&body], &mut buf).to_vec();
                // All but the closing word: not yet a frame.
                let at = place.offset as usize;
                let n = bytes.len();
                ring.0[at..at + n - 8].copy_from_slice(&bytes[..n - 8]);
                prop_assert!(frame_begun(&rx, &ring), "a frame being written has begun");
                if sent.is_empty() {
                    prop_assert_eq!(poll_frame(&mut rx, &ring).unwrap(), None, "a frame without its closing word is not whole");
                }
                ring.0[at + n - 8..at + n].copy_from_slice(&bytes[n - 8..]);
                sent.push_back((body, pos));
                next += 1;
            }
        }

        #[test]
        fn polled_rings_of_arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 4096..=4096), pos in 0u64..1 << 20) {
            let mut rx = RingReceiver::new(4096);
            // Start anywhere: consume a run of empty space first.
            let mut ring = ByteRing(b);
            let _ = poll_frame(&mut rx, &ring);
            // A forged frame word with a length past the allotted space is refused, not read.
            let pos = pos / FRAME_ALIGN * FRAME_ALIGN % 4096;
            let word = frame_word(pos, 4000);
            ring.0[pos as usize..pos as usize + 8].copy_from_slice(&word.to_le_bytes());
            let mut rx = RingReceiver::new(4096);
            rx.received = pos;
            rx.consumed = pos;
            prop_assert!(poll_frame(&mut rx, &ring).is_err());
        }
    }

    struct ByteRing(Vec<u8>);
    impl RingWords for ByteRing {
        fn word(&self, off: u64) -> u64 {
            u64::from_le_bytes(self.0[off as usize..off as usize + 8].try_into().unwrap())
        }
    }

    #[test]
    fn frame_words_of_other_positions_and_laps_never_match() {
        let w = frame_word(4096 + 128, 10);
        assert_ne!(w, frame_word(128, 10), "the previous lap's frame at the same offset");
        assert_ne!(w, frame_word(4096 + 192, 10));
        assert_ne!(w & FRAME_VALID, 0);
        assert_eq!(frame_reserved(8 + RECORD_HEADER), 64, "an 8-byte message and its framing share a line");
        assert_eq!(frame_reserved(frame_body_max(4096)), 1024);
    }

    #[test]
    fn a_wrapped_frame_is_found_at_the_next_lap_and_a_needless_wrap_is_refused() {
        const SIZE: u64 = 4096;
        let mut ring = ByteRing(vec![0; SIZE as usize]);
        let mut rx = RingReceiver::new(SIZE);
        // Fill up to 64 bytes before the end with one-line frames.
        let mut buf = vec![0u8; 1024];
        let mut pos = 0;
        while pos < SIZE - 64 {
            let b = encode_frame(pos, &[&[7; 8]], &mut buf).to_vec();
            ring.0[pos as usize..pos as usize + b.len()].copy_from_slice(&b);
            let f = poll_frame(&mut rx, &ring).unwrap().unwrap();
            rx.consume_to(f.end_pos);
            pos = f.end_pos;
        }
        // A 100-byte body does not fit in the last line: it starts the next lap.
        let b = encode_frame(SIZE, &[&[9; 100]], &mut buf).to_vec();
        ring.0[..b.len()].copy_from_slice(&b);
        let f = poll_frame(&mut rx, &ring).unwrap().unwrap();
        assert_eq!((f.body_off, f.body_len, f.end_pos), (8, 100, SIZE + 128));
        // An 8-byte body would have fitted in the last line: wrapping it is a protocol error.
        let mut rx = RingReceiver::new(SIZE);
        rx.received = SIZE - 64;
        rx.consumed = SIZE - 64;
        let b = encode_frame(SIZE, &[&[9; 8]], &mut buf).to_vec();
        ring.0[..b.len()].copy_from_slice(&b);
        assert!(poll_frame(&mut rx, &ring).is_err());
    }

    /// The receiver finds nothing at its position, then, before it looks at the next lap's
    /// start, the sender writes the frames up to the lap's end and one at the next lap's start
    /// (which did not wrap). That frame is not taken for a wrapped one.
    #[test]
    fn frames_reaching_the_next_lap_while_the_receiver_looks_are_not_taken_for_a_wrap() {
        struct Racy {
            before: ByteRing,
            after: ByteRing,
            reads: std::cell::Cell<usize>,
        }
        impl RingWords for Racy {
            fn word(&self, off: u64) -> u64 {
                let n = self.reads.replace(self.reads.get() + 1);
                if n == 0 { &self.before } else { &self.after }.word(off)
            }
        }
        const SIZE: u64 = 4096;
        let mut buf = vec![0u8; 1024];
        let mut after = ByteRing(vec![0; SIZE as usize]);
        // Frames of one line from SIZE - 192 to the end, then one at the next lap's start.
        for pos in [SIZE - 192, SIZE - 128, SIZE - 64, SIZE] {
            let b = encode_frame(pos, &[&[pos as u8; 8]], &mut buf).to_vec();
            let at = (pos % SIZE) as usize;
            after.0[at..at + b.len()].copy_from_slice(&b);
        }
        let mut rx = RingReceiver::new(SIZE);
        rx.received = SIZE - 192;
        rx.consumed = SIZE - 192;
        let racy = Racy { before: ByteRing(vec![0; SIZE as usize]), after, reads: 0.into() };
        assert_eq!(poll_frame(&mut rx, &racy).unwrap(), None);
        let mut taken = Vec::new();
        while let Some(f) = poll_frame(&mut rx, &racy).unwrap() {
            taken.push(f.end_pos);
            rx.consume_to(f.end_pos);
        }
        assert_eq!(taken, [SIZE - 128, SIZE - 64, SIZE, SIZE + 64]);
    }

    #[test]
    fn bulk_notes_round_trip_and_reject_garbage() {
        let n = BulkNote { len: 65536, wrapped: true };
        assert_eq!(BulkNote::decode(&n.encode()), Ok(n));
        assert!(BulkNote::decode(&[0; 7]).is_err());
        assert!(BulkNote::decode(&[0, 0, 0, 0, 2, 0, 0, 0]).is_err());
        let rec = Record { kind: RecordKind::Bulk, credits: 0, len: 9, ack: 0 };
        assert!(Record::decode(&rec.encode()).is_err(), "a bulk record's payload is exactly a note");
    }
}
