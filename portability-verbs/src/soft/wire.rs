//! The record format of the software provider's inbound rings, and the ring's space arithmetic.
//!
//! Plain data and pure functions (sans-IO): `soft::qp` moves the bytes through shared
//! memory. Everything a peer writes is decoded here into a validated local copy before it is used,
//! so a peer scribbling on the ring can fail its connection but can never steer a copy out of
//! bounds.
//!
//! Record layout (64-byte aligned, never wrapping inside the ring):
//! ```text
//! 0  publish: u64 written last by the producer: a function of the record's absolute position
//!                 (see `publish_word`), so stale bytes of an earlier lap never match
//! 8  kind: u8, flags: u8, sge_count: u16, len: u32, imm: u32
//! 20 status: u32  0 from the producer; the consumer writes an error code only on failure
//! 24 payload      sends: inline data, or sge_count descriptors of 16 bytes (addr u64, len u32,
//!                 key u32)
//! 24 raddr: u64, rkey: u32, (reserved u32)   writes with immediate only; their data at 40
//! ```
//! A send header is 24 bytes, so a send of up to 40 bytes (a small message with its upper
//! layers' headers) is one cache line: the consumer's one miss, the producer's one ownership
//! request.
//! On success the consumer writes nothing into the ring: a record is done when the consumer's
//! counter passes it. Every lap overwrites every byte of the ring, so the bytes at a position are
//! from the current or the previous lap; a previous-lap header carries another position's
//! publish word, and previous-lap payload matches the expected 64-bit word with probability
//! 2^-64 (and must then still pass the decoder).

/// Records start on this alignment (a cache line).
pub const RECORD_ALIGN: usize = 64;
/// Bytes of a send's (and a pad's) header.
pub const HEADER_BYTES: usize = 24;
/// Bytes of a write-with-immediate's header (with the remote address and key).
pub const WRITE_HEADER_BYTES: usize = 40;
/// Offset of the status word in a record.
pub const STATUS_OFFSET: usize = 20;
/// Bytes the consumer reads to decode a header: bytes 8..40 of a record (a send's payload
/// starts inside them and is ignored; every record spans at least these).
pub const FIELDS_BYTES: usize = 32;
/// Bytes of those the producer writes for a send or a pad (bytes 8..20).
const SEND_FIELDS_BYTES: usize = 12;
/// Bytes of one descriptor in a descriptor record.
pub const DESC_BYTES: usize = 16;
/// Descriptors one record may carry at most.
pub const MAX_DESC: usize = 64;
/// Largest message length the transport carries (the verbs limit of 2^31 bytes).
pub const MAX_MESSAGE: u32 = 1 << 31;

/// The publish word of a record starting at absolute ring position `pos` (bytes produced before
/// it): the line index and a scrambled copy of it, never zero.
pub fn publish_word(pos: u64) -> u64 {
    let line = (pos / RECORD_ALIGN as u64) as u32;
    let check = line.rotate_left(16) ^ 0xA5C3_5A3C;
    line as u64 | (check as u64) << 32
}

/// The record statuses (the `status` word).
pub mod status {
    /// Written by the producer; stays so on success.
    pub const OK: u32 = 0;
    /// The responder found the request invalid (receive buffer too small, bad descriptor).
    pub const REM_INV_REQ: u32 = 3;
    /// The responder refused the remote access (key, bounds, rights).
    pub const REM_ACCESS: u32 = 4;
    /// The responder failed the operation (for example could not read the sender's memory).
    pub const REM_OP: u32 = 5;
}

/// What a record asks the consumer to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordKind {
    /// A SEND whose data is in the payload.
    SendInline,
    /// A SEND whose data the consumer pulls from the producer's registered memory.
    SendDescriptors,
    /// An RDMA write-with-immediate whose data is in the payload; the consumer places it.
    WriteImmInline,
    /// An RDMA write-with-immediate whose data the producer already placed.
    WriteImmNotify,
    /// Filler up to the end of the ring.
    Pad,
}

impl RecordKind {
    /// Whether records of this kind name the responder's memory (their header carries the
    /// remote address and key).
    pub fn addresses_memory(self) -> bool {
        matches!(self, RecordKind::WriteImmInline | RecordKind::WriteImmNotify)
    }

    fn code(self) -> u8 {
        match self {
            RecordKind::SendInline => 1,
            RecordKind::SendDescriptors => 2,
            RecordKind::WriteImmInline => 3,
            RecordKind::WriteImmNotify => 4,
            RecordKind::Pad => 5,
        }
    }
    fn from_code(c: u8) -> Option<RecordKind> {
        Some(match c {
            1 => RecordKind::SendInline,
            2 => RecordKind::SendDescriptors,
            3 => RecordKind::WriteImmInline,
            4 => RecordKind::WriteImmNotify,
            5 => RecordKind::Pad,
            _ => return None,
        })
    }
    /// True for the kinds that consume a receive at the consumer.
    pub fn consumes_receive(self) -> bool {
        self != RecordKind::Pad
    }
}

/// Header flag: the message carries immediate data.
pub const FLAG_IMM: u8 = 1;

/// A decoded record header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordHeader {
    /// What to do.
    pub kind: RecordKind,
    /// [`FLAG_IMM`] or 0.
    pub flags: u8,
    /// Descriptors in the payload ([`RecordKind::SendDescriptors`]).
    pub sge_count: u16,
    /// Message bytes (for a pad: the pad record's size).
    pub len: u32,
    /// Immediate data.
    pub imm: u32,
    /// Remote key (write-with-immediate).
    pub rkey: u32,
    /// Remote address (write-with-immediate).
    pub raddr: u64,
}

/// Why a record was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// Unknown kind byte.
    #[error("unknown record kind {0}")]
    UnknownKind(u8),
    /// The record would run past the end of the ring.
    #[error("record of {size} bytes at offset {offset} overruns a ring of {ring} bytes")]
    Overrun {
        /// Record size.
        size: usize,
        /// Its offset.
        offset: usize,
        /// Ring size.
        ring: usize,
    },
    /// A pad that does not end exactly at the ring's end.
    #[error("pad record does not end at the ring's end")]
    BadPad,
    /// Descriptor count or lengths inconsistent.
    #[error("bad descriptors: {0}")]
    BadDescriptors(&'static str),
    /// Length over the transport limit.
    #[error("message length {0} over the transport limit")]
    TooLong(u32),
    /// Unknown flag bits.
    #[error("unknown flags {0:#x}")]
    BadFlags(u8),
}

impl RecordHeader {
    /// Encodes the decoded part of the header (record bytes 8..40, the status word zero);
    /// the producer writes the first [`RecordHeader::fields_len`] bytes of it.
    pub fn encode(&self) -> [u8; FIELDS_BYTES] {
        let mut b = [0u8; FIELDS_BYTES];
        b[0] = self.kind.code();
        b[1] = self.flags;
        b[2..4].copy_from_slice(&self.sge_count.to_le_bytes());
        b[4..8].copy_from_slice(&self.len.to_le_bytes());
        b[8..12].copy_from_slice(&self.imm.to_le_bytes());
        if self.kind.addresses_memory() {
            b[16..24].copy_from_slice(&self.raddr.to_le_bytes());
            b[24..28].copy_from_slice(&self.rkey.to_le_bytes());
        }
        b
    }

    /// Bytes of [`RecordHeader::encode`] that belong to this record's header (the rest of a
    /// send's 32 are its payload).
    pub fn fields_len(&self) -> usize {
        if self.kind.addresses_memory() {
            FIELDS_BYTES
        } else {
            SEND_FIELDS_BYTES
        }
    }

    /// Bytes of this record's header: where its payload starts.
    pub fn header_bytes(&self) -> usize {
        if self.kind.addresses_memory() {
            WRITE_HEADER_BYTES
        } else {
            HEADER_BYTES
        }
    }

    /// Bytes of payload that follow the header.
    pub fn payload_len(&self) -> usize {
        match self.kind {
            RecordKind::SendInline | RecordKind::WriteImmInline => self.len as usize,
            RecordKind::SendDescriptors => self.sge_count as usize * DESC_BYTES,
            RecordKind::WriteImmNotify => 0,
            RecordKind::Pad => self.len as usize - HEADER_BYTES,
        }
    }

    /// Bytes a record with this header and `payload` bytes after it occupies in the ring.
    fn size_with(&self, payload: usize) -> usize {
        (self.header_bytes() + payload).div_ceil(RECORD_ALIGN) * RECORD_ALIGN
    }

    /// Bytes the whole record occupies in the ring.
    pub fn record_size(&self) -> usize {
        match self.kind {
            RecordKind::Pad => self.len as usize,
            _ => self.size_with(self.payload_len()),
        }
    }

    /// Decodes a header found at `offset` in a ring of `ring` bytes, validating everything that
    /// can be validated without the payload.
    #[inline]
    pub fn decode(b: &[u8; FIELDS_BYTES], offset: usize, ring: usize) -> Result<RecordHeader, RecordError> {
        let kind = RecordKind::from_code(b[0]).ok_or(RecordError::UnknownKind(b[0]))?;
        let (raddr, rkey) = if kind.addresses_memory() {
            (
                u64::from_le_bytes(b[16..24].try_into().expect("8 bytes")),
                u32::from_le_bytes(b[24..28].try_into().expect("4 bytes")),
            )
        } else {
            (0, 0) // those bytes are the payload's
        };
        let h = RecordHeader {
            kind,
            flags: b[1],
            sge_count: u16::from_le_bytes([b[2], b[3]]),
            len: u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")),
            imm: u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")),
            rkey,
            raddr,
        };
        if h.flags & !FLAG_IMM != 0 {
            return Err(RecordError::BadFlags(h.flags));
        }
        if h.len > MAX_MESSAGE {
            return Err(RecordError::TooLong(h.len));
        }
        match kind {
            RecordKind::Pad => {
                let len = h.len as usize;
                if len < HEADER_BYTES || !len.is_multiple_of(RECORD_ALIGN) || offset.checked_add(len) != Some(ring) {
                    return Err(RecordError::BadPad);
                }
            }
            RecordKind::SendDescriptors if h.sge_count == 0 || h.sge_count as usize > MAX_DESC => {
                return Err(RecordError::BadDescriptors("descriptor count out of range"));
            }
            _ => {}
        }
        let size = h.record_size();
        if offset.checked_add(size).is_none_or(|end| end > ring) {
            return Err(RecordError::Overrun { size, offset, ring });
        }
        Ok(h)
    }
}

/// One descriptor of a [`RecordKind::SendDescriptors`] record: bytes in the producer's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Descriptor {
    /// Address in the producer.
    pub addr: u64,
    /// Bytes.
    pub len: u32,
    /// Producer's local key of the region holding them.
    pub key: u32,
}

impl Descriptor {
    /// Encodes one descriptor.
    pub fn encode(&self) -> [u8; DESC_BYTES] {
        let mut b = [0u8; DESC_BYTES];
        b[0..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b[12..16].copy_from_slice(&self.key.to_le_bytes());
        b
    }
    /// Decodes one descriptor.
    pub fn decode(b: &[u8; DESC_BYTES]) -> Descriptor {
        Descriptor {
            addr: u64::from_le_bytes(b[0..8].try_into().expect("8 bytes")),
            len: u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")),
            key: u32::from_le_bytes(b[12..16].try_into().expect("4 bytes")),
        }
    }
}

/// Decodes and checks the descriptor payload of a record whose header says `total` bytes.
pub fn decode_descriptors(payload: &[u8], total: u32) -> Result<smallvec::SmallVec<[Descriptor; 4]>, RecordError> {
    if !payload.len().is_multiple_of(DESC_BYTES) || payload.is_empty() || payload.len() / DESC_BYTES > MAX_DESC {
        return Err(RecordError::BadDescriptors("payload is not a whole descriptor list"));
    }
    let list: smallvec::SmallVec<[Descriptor; 4]> =
        payload.chunks_exact(DESC_BYTES).map(|c| Descriptor::decode(c.try_into().expect("16 bytes"))).collect();
    let sum: u64 = list.iter().map(|d| d.len as u64).sum();
    if sum != total as u64 {
        return Err(RecordError::BadDescriptors("lengths do not add up to the message length"));
    }
    if list.iter().any(|d| d.addr.checked_add(d.len as u64).is_none()) {
        return Err(RecordError::BadDescriptors("descriptor wraps the address space"));
    }
    Ok(list)
}

/// Where the producer puts its next record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// A pad record to write first at this offset, running to the ring's end.
    pub pad_at: Option<usize>,
    /// Offset of the record.
    pub at: usize,
    /// Ring bytes used in all (pad included): what the produced count advances by.
    pub advance: usize,
}

/// Offset in a ring of `ring` bytes (a power of two, checked when a ring is made or a peer's is
/// accepted) of absolute position `pos`: a mask, where `%` compiles to a 64-bit division (on
/// every poll of an idle queue pair and every record taken).
#[inline]
pub fn ring_offset(pos: u64, ring: usize) -> usize {
    debug_assert!(ring.is_power_of_two());
    (pos & (ring as u64 - 1)) as usize
}

/// Finds room for a record of `size` bytes. `produced` and `consumed` are the monotonic byte
/// counts of both ends. Returns `None` when the ring is too full now.
pub fn place(produced: u64, consumed: u64, ring: usize, size: usize) -> Option<Placement> {
    debug_assert!(ring.is_power_of_two() && size.is_multiple_of(RECORD_ALIGN));
    let used = produced.checked_sub(consumed)? as usize;
    if used > ring {
        return None;
    }
    let free = ring - used;
    let off = ring_offset(produced, ring);
    let to_end = ring - off;
    let (pad_at, at, advance) = if size <= to_end { (None, off, size) } else { (Some(off), 0, to_end + size) };
    if advance > free {
        return None;
    }
    Some(Placement { pad_at, at, advance })
}

/// The largest record a ring of `ring` bytes accepts (so that one always fits after a wrap).
pub fn max_record(ring: usize) -> usize {
    ring / 2
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn kind() -> impl Strategy<Value = RecordKind> {
        prop_oneof![
            Just(RecordKind::SendInline),
            Just(RecordKind::SendDescriptors),
            Just(RecordKind::WriteImmInline),
            Just(RecordKind::WriteImmNotify),
        ]
    }

    proptest! {
        #[test]
        fn headers_round_trip(kind in kind(), imm_flag in any::<bool>(), sges in 1u16..=MAX_DESC as u16,
                              len in 0u32..4096, imm in any::<u32>(), rkey in any::<u32>(), raddr in any::<u64>(),
                              payload in any::<[u8; FIELDS_BYTES]>()) {
            let (rkey, raddr) = if kind.addresses_memory() { (rkey, raddr) } else { (0, 0) };
            let h = RecordHeader { kind, flags: if imm_flag { FLAG_IMM } else { 0 }, sge_count: sges, len, imm, rkey, raddr };
            let ring = 1 << 16;
            // What the consumer reads: the fields the producer wrote, then the payload's bytes.
            let mut seen = payload;
            seen[..h.fields_len()].copy_from_slice(&h.encode()[..h.fields_len()]);
            prop_assert_eq!(RecordHeader::decode(&seen, 0, ring).unwrap(), h);
            prop_assert!(h.fields_len() <= h.header_bytes() - 8);
        }

        #[test]
        fn ring_offset_is_the_remainder(pos in any::<u64>(), ring_log in 13u32..31) {
            let ring = 1usize << ring_log;
            prop_assert_eq!(ring_offset(pos, ring), (pos % ring as u64) as usize);
        }

        #[test]
        fn small_sends_take_one_cache_line(len in 0u32..=40) {
            let h = RecordHeader { kind: RecordKind::SendInline, flags: 0, sge_count: 0, len, imm: 0, rkey: 0, raddr: 0 };
            prop_assert_eq!(h.record_size(), RECORD_ALIGN);
        }

        #[test]
        fn arbitrary_headers_never_panic_and_stay_in_bounds(b in any::<[u8; FIELDS_BYTES]>(), off in 0usize..(1 << 16), ring_log in 12u32..20) {
            let ring = 1usize << ring_log;
            let off = (off % ring) / RECORD_ALIGN * RECORD_ALIGN;
            if let Ok(h) = RecordHeader::decode(&b, off, ring) {
                prop_assert!(off + h.record_size() <= ring);
                prop_assert!(h.header_bytes() + h.payload_len() <= h.record_size());
            }
        }

        #[test]
        fn arbitrary_descriptor_payloads_never_panic(p in proptest::collection::vec(any::<u8>(), 0..200), total in any::<u32>()) {
            let _ = decode_descriptors(&p, total);
        }

        /// A producer/consumer model: random record sizes, random consumption; placements never
        /// overlap unconsumed bytes and never cross the end.
        #[test]
        fn placements_never_overlap_unconsumed_data(ops in proptest::collection::vec((1usize..40, any::<bool>()), 1..300)) {
            let ring = 4096usize;
            let (mut produced, mut consumed) = (0u64, 0u64);
            let mut inflight: std::collections::VecDeque<u64> = Default::default();
            for (lines, consume) in ops {
                let size = lines * RECORD_ALIGN;
                if consume {
                    if let Some(end) = inflight.pop_front() { consumed = end; }
                    continue;
                }
                if let Some(p) = place(produced, consumed, ring, size) {
                    prop_assert!(p.at + size <= ring);
                    prop_assert!(produced + p.advance as u64 <= consumed + ring as u64);
                    if let Some(pad) = p.pad_at { prop_assert_eq!(p.at, 0); prop_assert_eq!(pad as u64, produced % ring as u64); }
                    produced += p.advance as u64;
                    inflight.push_back(produced);
                } else {
                    prop_assert!(size > max_record(ring) || produced - consumed > 0);
                }
            }
        }
    }

    #[test]
    fn publish_words_differ_across_laps_and_are_never_zero() {
        for pos in [0u64, 64, 4096, 1 << 20, 1 << 40] {
            assert_ne!(publish_word(pos), 0);
            assert_ne!(publish_word(pos), publish_word(pos + (1 << 17)));
            assert_ne!(publish_word(pos), publish_word(pos + 64));
        }
    }

    #[test]
    fn pad_must_reach_the_end() {
        let h = RecordHeader { kind: RecordKind::Pad, flags: 0, sge_count: 0, len: 128, imm: 0, rkey: 0, raddr: 0 };
        assert!(RecordHeader::decode(&h.encode(), 4096 - 128, 4096).is_ok());
        assert_eq!(RecordHeader::decode(&h.encode(), 4096 - 192, 4096), Err(RecordError::BadPad));
    }
}
