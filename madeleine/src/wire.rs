//! Madeleine's message format, sans-IO: the records a message is made of, carried in the
//! messages of a flow-controlled pipe ([`portability_verbs::datapath::MsgPipe`]).
//!
//! ```text
//! Begin                      a message starts (seq: per connection and direction)
//! Inline  modes len last     a fragment of a pack's bytes follows the header
//! Rdv     modes len addr key id offer   a large pack the receiver RDMA-reads from the sender
//! Bulk    modes total        a pack whose `total` bytes follow as bulk-lane chunks
//! End     packs              the message had this many packs
//! Whole   seq packs          a whole message in one pipe message: Begin, its `packs` records, no End
//! One     seq modes          a whole small message of one pack, its bytes after the header
//! Bye                        the sender closed its end: nothing follows on this connection
//! ```
//! Tag 5 is not used (it was a `Fin`, the receiver's word that it read a rendezvous: the
//! release count in the pipe's acknowledgement slots says that now, see
//! `MsgPipe::release_to`), and decodes as an unknown record.
//! A `Bulk` record ends its pipe message: the pack's chunks come next on the pipe's bulk lane.
//! A bulk chunk that arrives when no pack's bytes are due carries records itself (decoded with
//! [`decode_in_chunk`]): there a `Bulk` record's data follows it in the same chunk (and in
//! later chunks if longer), and records may follow the data (the message's `End`), so a
//! message of bulk packs needs no pipe message at all.
//! A `Whole` record owns the rest of its pipe message: its packs' records, each a complete
//! `Inline` record or an `Rdv` (the path of small messages, and of a message whose large packs
//! go zero-copy, which a receiver takes out of the pipe in one step). A `One` record is the
//! leanest of these, for the commonest message (a single small pack): an 8-byte header, the
//! pack's bytes to the end of the pipe message, so that a message of up to 16 bytes fills the
//! transport's first cache line with room to spare and the receiver decodes one record. Every
//! other header is 16 bytes (Rdv 32); every length is checked on decode.
//! An `Rdv` with `offer` set is a pack the sender may take back: the receiver first claims it
//! (a compare-and-swap on its claim word, which a withdrawal swaps too: `protocol::offer`);
//! if the sender withdrew it, its bytes follow on the connection as a `Bulk` record and data.

use crate::{RecvMode, SendMode};

/// Bytes of a record header.
pub const HEADER: usize = 16;
/// Bytes of a rendezvous record.
pub const RDV: usize = 32;
/// Bytes of a `One` record's header.
pub const ONE_HEADER: usize = 8;
/// The first byte of a `One` record.
const ONE_TAG: u8 = 8;

/// A record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Record {
    /// A message starts.
    Begin {
        /// Sequence number of the message on its connection.
        seq: u32,
    },
    /// A fragment of a pack copied inline.
    Inline {
        /// Modes the pack was made with.
        modes: Modes,
        /// Bytes of this fragment.
        len: u32,
        /// The pack's last fragment.
        last: bool,
        /// Total bytes of the pack.
        total: u64,
    },
    /// A pack to be read by the receiver from the sender's registered memory.
    Rdv {
        /// Modes the pack was made with.
        modes: Modes,
        /// Bytes of the pack.
        len: u64,
        /// Address in the sender.
        addr: u64,
        /// Remote key of the sender's registration.
        rkey: u32,
        /// Identifier: the sender's rendezvous on a connection are numbered 0, 1, 2, ... in
        /// the order it issues them (the receiver releases them by count).
        id: u32,
        /// An offer: to be claimed before it is read, since the sender may withdraw it and
        /// send its bytes through the bulk lane instead (its flag byte).
        offer: bool,
    },
    /// A pack whose bytes follow as bulk-lane chunks.
    Bulk {
        /// Modes the pack was made with.
        modes: Modes,
        /// Bytes of the pack.
        total: u64,
    },
    /// The message is complete.
    End {
        /// Number of packs in it.
        packs: u32,
    },
    /// A whole message: the rest of the pipe message holds its packs, each a complete
    /// `Inline` record or an `Rdv` record.
    Whole {
        /// Sequence number of the message on its connection.
        seq: u32,
        /// Number of packs in it.
        packs: u32,
    },
    /// A whole message of one complete pack, whose bytes are the rest of the pipe message.
    One {
        /// Sequence number of the message on its connection.
        seq: u32,
        /// Modes the pack was made with.
        modes: Modes,
    },
    /// The sender closed its end of the connection (its channel was dropped): the receiver
    /// reports that to whoever waits for more from it, instead of letting them time out.
    Bye,
}

/// The modes of a pack, as sent (so the receiver can check its unpack against them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Modes {
    /// Send mode.
    pub send: SendMode,
    /// Receive mode.
    pub recv: RecvMode,
}

impl Modes {
    #[inline]
    fn byte(self) -> u8 {
        let s = match self.send {
            SendMode::Safer => 0,
            SendMode::Later => 1,
            SendMode::Cheaper => 2,
        };
        let r = match self.recv {
            RecvMode::Express => 0,
            RecvMode::Cheaper => 1,
        };
        s | r << 2
    }
    /// The modes as one byte (what records carry).
    pub fn code(self) -> u8 {
        self.byte()
    }

    /// The modes a byte from [`Modes::code`] names (None for any other byte).
    pub fn from_code(b: u8) -> Option<Modes> {
        Self::from_byte(b)
    }

    #[inline]
    fn from_byte(b: u8) -> Option<Modes> {
        let send = match b & 3 {
            0 => SendMode::Safer,
            1 => SendMode::Later,
            2 => SendMode::Cheaper,
            _ => return None,
        };
        let recv = match (b >> 2) & 1 {
            0 => RecvMode::Express,
            _ => RecvMode::Cheaper,
        };
        (b >> 3 == 0).then_some(Modes { send, recv })
    }
}

/// Why bytes from a peer are not a valid record sequence.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("malformed message from peer: {0}")]
pub struct WireError(pub &'static str);

impl Record {
    /// Appends the encoding (header, and for `Inline` nothing more: the caller appends the
    /// fragment's bytes; for `Whole`, the message's records; for `One`, the pack's bytes).
    #[inline]
    pub fn encode(&self, out: &mut Vec<u8>) {
        let (lo, hi) = self.words();
        // Two 8-byte stores straight from registers: a header assembled byte by byte in a
        // temporary and then copied costs a store-forwarding stall on every message.
        out.extend_from_slice(&lo.to_le_bytes());
        if let Record::One { .. } = self {
            return;
        }
        out.extend_from_slice(&hi.to_le_bytes());
        if let Record::Rdv { len, id, .. } = *self {
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(&(id as u64).to_le_bytes());
        }
    }

    /// Writes the record's 16-byte header (all of it but a rendezvous record's second half)
    /// over `out`'s first 16 bytes (a header encoded before).
    #[inline]
    pub fn write_header(&self, out: &mut [u8; HEADER]) {
        let (lo, hi) = self.words();
        out[..8].copy_from_slice(&lo.to_le_bytes());
        out[8..].copy_from_slice(&hi.to_le_bytes());
    }

    /// A `One` record's 8-byte header.
    #[inline]
    pub fn one_header(seq: u32, modes: Modes) -> [u8; ONE_HEADER] {
        Record::One { seq, modes }.words().0.to_le_bytes()
    }

    /// The record's 16-byte header (all of it but a rendezvous record's second half).
    #[inline]
    pub fn header(&self) -> [u8; HEADER] {
        let mut h = [0u8; HEADER];
        self.write_header(&mut h);
        h
    }

    /// The header as two little-endian words: bytes 0-7 (tag, modes, flag, reserved byte,
    /// a 32-bit field) and bytes 8-15.
    #[inline]
    fn words(&self) -> (u64, u64) {
        let lo = |tag: u8, modes: u8, flag: u8, field: u32| {
            tag as u64 | (modes as u64) << 8 | (flag as u64) << 16 | (field as u64) << 32
        };
        match *self {
            Record::Begin { seq } => (lo(1, 0, 0, seq), 0),
            Record::Inline { modes, len, last, total } => (lo(2, modes.byte(), last as u8, len), total),
            Record::Rdv { modes, addr, rkey, offer, .. } => (lo(3, modes.byte(), offer as u8, rkey), addr),
            Record::Bulk { modes, total } => (lo(6, modes.byte(), 0, 0), total),
            Record::End { packs } => (lo(4, 0, 0, packs), 0),
            Record::Whole { seq, packs } => (lo(7, 0, 0, seq), packs as u64),
            Record::One { seq, modes } => (lo(ONE_TAG, modes.byte(), 0, seq), 0),
            Record::Bye => (lo(9, 0, 0, 0), 0),
        }
    }

    /// Bytes the encoding takes (without an inline fragment's data).
    pub fn encoded_len(&self) -> usize {
        match self {
            Record::Rdv { .. } => RDV,
            Record::One { .. } => ONE_HEADER,
            _ => HEADER,
        }
    }
}

/// The records of one pipe message, with the byte ranges of inline data (no allocation for
/// the usual few records: this is on every message's path).
pub type Decoded = smallvec::SmallVec<[(Record, std::ops::Range<usize>); 4]>;

/// Decodes a pipe message into records; inline fragments come with the byte range of their
/// data in `msg`.
pub fn decode(msg: &[u8]) -> Result<Decoded, WireError> {
    let mut out = Decoded::new();
    let mut at = 0;
    while at < msg.len() {
        let (rec, data, next) = decode_one(msg, at)?;
        out.push((rec, data));
        at = next;
    }
    Ok(out)
}

/// Decodes the record at offset `at` of a pipe message (a record boundary): the record, the
/// byte range of its inline data in `msg` (for `Whole`, the message's records up to the end of
/// `msg`; for `One`, its pack's bytes up to the end of `msg`; empty for other records), and where the next record starts. What a reader taking a
/// message apart in place, one record at a time, calls.
pub fn decode_one(msg: &[u8], at: usize) -> Result<(Record, std::ops::Range<usize>, usize), WireError> {
    decode_at(msg, at, false)
}

/// Decodes the record at offset `at` of a bulk chunk that carries records: as
/// [`decode_one`], except that a `Bulk` record's data follows it (where the next record
/// would start) and that `Whole` and `One` records, which own the rest of a pipe message, are
/// refused.
pub fn decode_in_chunk(chunk: &[u8], at: usize) -> Result<(Record, std::ops::Range<usize>, usize), WireError> {
    decode_at(chunk, at, true)
}

/// If a pipe message is a `One` record (the commonest message: what a reader checks first),
/// its sequence number and modes, checked as [`decode_one`] checks them; its pack's bytes are
/// the rest of the message, from [`ONE_HEADER`] on. `None` if it is some other record.
#[inline]
pub fn decode_one_record(msg: &[u8]) -> Option<Result<(u32, Modes), WireError>> {
    let h: &[u8; ONE_HEADER] = msg.get(..ONE_HEADER)?.try_into().expect("a header's bytes");
    if h[0] != ONE_TAG {
        return None;
    }
    Some(match Modes::from_byte(h[1]) {
        _ if h[3] != 0 => Err(WireError("reserved header byte set")),
        None => Err(WireError("bad modes")),
        Some(_) if h[2] != 0 => Err(WireError("reserved one-pack bytes set")),
        Some(modes) => Ok((u32::from_le_bytes([h[4], h[5], h[6], h[7]]), modes)),
    })
}

fn decode_at(msg: &[u8], at: usize, in_chunk: bool) -> Result<(Record, std::ops::Range<usize>, usize), WireError> {
    let u32_at = |b: &[u8], i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
    let u64_at = |b: &[u8], i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    let short = WireError("message ends inside a record header");
    let h = msg.get(at..at.saturating_add(ONE_HEADER)).ok_or(short.clone())?;
    if h[3] != 0 {
        return Err(WireError("reserved header byte set"));
    }
    if h[0] == ONE_TAG {
        if in_chunk {
            return Err(WireError("a whole message in a bulk chunk"));
        }
        let (seq, modes) = decode_one_record(&msg[at..]).expect("a One tag")?;
        return Ok((Record::One { seq, modes }, at + ONE_HEADER..msg.len(), msg.len()));
    }
    let h = msg.get(at..at.saturating_add(HEADER)).ok_or(short)?;
    Ok(match h[0] {
        1 => (Record::Begin { seq: u32_at(h, 4) }, at..at, at + HEADER),
        2 => {
            let modes = Modes::from_byte(h[1]).ok_or(WireError("bad modes"))?;
            if h[2] > 1 {
                return Err(WireError("bad fragment flag"));
            }
            let len = u32_at(h, 4);
            let total = u64_at(h, 8);
            let start = at + HEADER;
            let end = start.checked_add(len as usize).ok_or(WireError("length overflows"))?;
            if end > msg.len() {
                return Err(WireError("inline fragment runs past the message"));
            }
            if len as u64 > total {
                return Err(WireError("fragment longer than its pack"));
            }
            (Record::Inline { modes, len, last: h[2] == 1, total }, start..end, end)
        }
        3 => {
            let modes = Modes::from_byte(h[1]).ok_or(WireError("bad modes"))?;
            let x = msg.get(at + HEADER..at + RDV).ok_or(WireError("message ends inside a rendezvous record"))?;
            if h[2] > 1 {
                return Err(WireError("bad offer flag"));
            }
            let (len, addr, rkey, id) = (u64_at(x, 0), u64_at(h, 8), u32_at(h, 4), u32_at(x, 8));
            let rec = Record::Rdv { modes, len, addr, rkey, id, offer: h[2] == 1 };
            if x[12..].iter().any(|&b| b != 0) {
                return Err(WireError("reserved rendezvous bytes set"));
            }
            (rec, at..at, at + RDV)
        }
        4 => (Record::End { packs: u32_at(h, 4) }, at..at, at + HEADER),
        6 => {
            let modes = Modes::from_byte(h[1]).ok_or(WireError("bad modes"))?;
            if h[2] != 0 || h[4..8] != [0; 4] {
                return Err(WireError("reserved bulk bytes set"));
            }
            if at + HEADER != msg.len() && !in_chunk {
                return Err(WireError("records after a bulk announcement"));
            }
            (Record::Bulk { modes, total: u64_at(h, 8) }, at..at, at + HEADER)
        }
        7 if in_chunk => return Err(WireError("a whole message in a bulk chunk")),
        7 => {
            if h[1] != 0 || h[2] != 0 || h[12..16] != [0; 4] {
                return Err(WireError("reserved whole-message bytes set"));
            }
            (Record::Whole { seq: u32_at(h, 4), packs: u32_at(h, 8) }, at + HEADER..msg.len(), msg.len())
        }
        9 if in_chunk => return Err(WireError("a close in a bulk chunk")),
        9 => {
            if h[1..16].iter().any(|&b| b != 0) {
                return Err(WireError("reserved close bytes set"));
            }
            if at + HEADER != msg.len() {
                return Err(WireError("records after a close"));
            }
            (Record::Bye, at..at, at + HEADER)
        }
        _ => return Err(WireError("unknown record tag")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn modes() -> impl Strategy<Value = Modes> {
        (0u8..3, any::<bool>()).prop_map(|(s, r)| Modes::from_byte(s | (r as u8) << 2).unwrap())
    }

    fn record() -> impl Strategy<Value = (Record, Vec<u8>)> {
        prop_oneof![
            any::<u32>().prop_map(|seq| (Record::Begin { seq }, vec![])),
            (modes(), proptest::collection::vec(any::<u8>(), 0..64), any::<bool>(), 0u64..1000).prop_map(
                |(m, d, last, extra)| {
                    (Record::Inline { modes: m, len: d.len() as u32, last, total: d.len() as u64 + extra }, d)
                }
            ),
            (modes(), any::<u64>(), any::<u64>(), any::<u32>(), any::<u32>(), any::<bool>()).prop_map(
                |(m, len, addr, rkey, id, offer)| (Record::Rdv { modes: m, len, addr, rkey, id, offer }, vec![])
            ),
            any::<u32>().prop_map(|packs| (Record::End { packs }, vec![])),
        ]
    }

    fn bulk() -> impl Strategy<Value = Record> {
        (modes(), any::<u64>()).prop_map(|(m, total)| Record::Bulk { modes: m, total })
    }

    /// A record that ends its pipe message, with what follows it there.
    fn last() -> impl Strategy<Value = (Record, Vec<u8>)> {
        prop_oneof![
            bulk().prop_map(|b| (b, vec![])),
            (any::<u32>(), any::<u32>(), proptest::collection::vec(any::<u8>(), 0..300))
                .prop_map(|(seq, packs, body)| (Record::Whole { seq, packs }, body)),
            (any::<u32>(), modes(), proptest::collection::vec(any::<u8>(), 0..300))
                .prop_map(|(seq, modes, body)| (Record::One { seq, modes }, body)),
            Just((Record::Bye, vec![])),
        ]
    }

    proptest! {
        #[test]
        fn sequences_round_trip(mut recs in proptest::collection::vec(record(), 0..20), tail in proptest::option::of(last())) {
            let mut bytes = Vec::new();
            for (r, d) in &recs {
                r.encode(&mut bytes);
                bytes.extend_from_slice(d);
            }
            if let Some((r, d)) = tail {
                r.encode(&mut bytes);
                bytes.extend_from_slice(&d);
                recs.push((r, d));
            }
            let got = decode(&bytes).unwrap();
            prop_assert_eq!(got.len(), recs.len());
            for ((r, range), (want, data)) in got.iter().zip(&recs) {
                prop_assert_eq!(r, want);
                prop_assert_eq!(&bytes[range.clone()], &data[..]);
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..200)) {
            if let Ok(recs) = decode(&b) {
                for (_, r) in recs { prop_assert!(r.end <= b.len()); }
            }
        }

        #[test]
        fn the_one_check_agrees_with_the_decoder(mut b in proptest::collection::vec(any::<u8>(), 0..24), one in any::<bool>()) {
            if one && !b.is_empty() {
                b[0] = ONE_TAG;
            }
            match (decode_one_record(&b), decode_one(&b, 0)) {
                (None, Ok((rec, _, _))) => {
                    let is_one = matches!(rec, Record::One { .. });
                    prop_assert!(!is_one);
                }
                (None, Err(_)) => prop_assert!(b.len() < ONE_HEADER || b[0] != ONE_TAG),
                (Some(Ok((seq, modes))), Ok((rec, data, next))) => {
                    prop_assert_eq!(rec, Record::One { seq, modes });
                    prop_assert_eq!((data, next), (ONE_HEADER..b.len(), b.len()));
                }
                (Some(Err(a)), Err(d)) => prop_assert_eq!(a, d),
                (a, d) => prop_assert!(false, "one check {:?}, decoder {:?}", a, d),
            }
        }

        #[test]
        fn a_header_rewritten_in_place_reads_back(seq in any::<u32>(), packs in any::<u32>(), (r, d) in record()) {
            let mut bytes = Vec::new();
            Record::Begin { seq }.encode(&mut bytes);
            r.encode(&mut bytes);
            bytes.extend_from_slice(&d);
            bytes[..HEADER].copy_from_slice(&Record::Whole { seq, packs }.header());
            let (got, body, next) = decode_one(&bytes, 0).unwrap();
            prop_assert_eq!(got, Record::Whole { seq, packs });
            prop_assert_eq!(body, HEADER..bytes.len());
            prop_assert_eq!(next, bytes.len());
            prop_assert_eq!(decode_one(&bytes[HEADER..], 0).unwrap().0, r);
        }

        #[test]
        fn a_one_header_over_an_inline_header_reads_back(seq in any::<u32>(), m in modes(), d in proptest::collection::vec(any::<u8>(), 0..64)) {
            // What a sender of a one-pack message does: Begin and Inline encoded while packing,
            // the One header written over the Inline header's second half at the end.
            let mut bytes = Vec::new();
            Record::Begin { seq }.encode(&mut bytes);
            Record::Inline { modes: m, len: d.len() as u32, last: true, total: d.len() as u64 }.encode(&mut bytes);
            bytes.extend_from_slice(&d);
            let at = 2 * HEADER - ONE_HEADER;
            bytes[at..2 * HEADER].copy_from_slice(&Record::one_header(seq, m));
            let mut encoded = Vec::new();
            Record::One { seq, modes: m }.encode(&mut encoded);
            prop_assert_eq!(&encoded[..], &bytes[at..2 * HEADER]);
            let (got, body, next) = decode_one(&bytes, at).unwrap();
            prop_assert_eq!(got, Record::One { seq, modes: m });
            prop_assert_eq!(&bytes[body], &d[..]);
            prop_assert_eq!(next, bytes.len());
            prop_assert!(decode_in_chunk(&bytes, at).is_err());
        }

        #[test]
        fn a_bulk_announcement_must_end_its_message(m in modes(), total in any::<u64>(), (after, data) in record()) {
            let mut bytes = Vec::new();
            Record::Bulk { modes: m, total }.encode(&mut bytes);
            after.encode(&mut bytes);
            bytes.extend_from_slice(&data);
            prop_assert!(decode(&bytes).is_err());
        }
    }
}
