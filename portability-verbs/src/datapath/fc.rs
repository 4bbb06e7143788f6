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
    /// A ring of `size` bytes.
    pub fn new(size: u64) -> RingSender {
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
    /// Reserves `len` bytes; None if the ring lacks room now.
    pub fn reserve(&mut self, len: u64) -> Option<ChunkPlace> {
        assert!(len > 0 && len <= self.max_chunk(), "chunk size out of range");
        let off = self.sent % self.size;
        let (skip, wrapped) = if off + len > self.size { (self.size - off, true) } else { (0, false) };
        if self.sent + skip + len - self.acked > self.size {
            return None;
        }
        self.before_last = self.sent;
        self.sent += skip;
        let offset = self.sent % self.size;
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
    /// A ring of `size` bytes.
    pub fn new(size: u64) -> RingReceiver {
        RingReceiver { size, received: 0, consumed: 0, acked: 0 }
    }
    /// A chunk of `len` bytes was announced (write-with-immediate), `wrapped` if it starts a
    /// new lap. Returns its offset in the ring, after checking it lies in the sender's space.
    pub fn on_chunk(&mut self, len: u64, wrapped: bool) -> Result<u64, FcError> {
        let off = self.received % self.size;
        let skip = if wrapped { self.size - off } else { 0 };
        if wrapped && off == 0 {
            return Err(FcError::BadRecord("wrap announced at the start of a lap"));
        }
        let start = self.received + skip;
        let space = self.size - (self.received - self.consumed);
        if len == 0 || len > self.size / 4 || (start % self.size) + len > self.size || skip + len > space {
            return Err(FcError::RingOverrun { len, at: start, space });
        }
        self.received = start + len;
        Ok(start % self.size)
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
}

/// Coalesces small messages into one chunk up to a threshold (RDMA and NIC-assisted).
#[derive(Clone, Debug, Default)]
pub struct Coalescer {
    staged: Vec<u8>,
    records: usize,
}

impl Coalescer {
    /// Appends a record; false if it would make the chunk exceed `max` (flush first).
    pub fn push(&mut self, rec: Record, payload: &[u8], max: usize) -> bool {
        if !self.staged.is_empty() && self.staged.len() + RECORD_HEADER + payload.len() > max {
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
    }
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
        fn ring_pair_never_loses_reorders_or_overruns(ops in proptest::collection::vec((1u64..256, 0u8..3), 1..400)) {
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
    }
}
