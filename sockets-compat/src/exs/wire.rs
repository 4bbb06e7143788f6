//! The EXS wire format as plain data: the control messages two ends exchange over the
//! connection's message pipe, the notes of the RDMA writes that carry data, and the private
//! data of the connection handshake. No I/O; every length a peer sends is checked, so a
//! malformed message is a [`WireError`], never a panic or an out-of-bounds read.
//!
//! A control message carries one or more records back to back (an advertisement rides with
//! the small message that follows it). Every record starts with a 4-byte header: kind, flags,
//! and the message credits the sender grants back (little endian); data records then give
//! their length (2 bytes) and the bytes. A data write is followed by a message of its own,
//! its [`WriteNote`] (what a write-with-immediate's immediate would say).

use thiserror::Error;

/// Bytes of a control message header.
pub const HEADER: usize = 4;
/// Bytes of the largest record without data (an advertisement).
pub const MAX_CONTROL: usize = HEADER + 28;
/// Bytes a data record adds to its data.
pub const DATA_OVERHEAD: usize = HEADER + 2;

/// Bytes of the largest control message to an end whose small messages reach `small_max`
/// bytes: the largest data record and an advertisement beside it. Both ends compute it from
/// the receiver's `small_max` (the sender never packs a message larger).
pub fn message_max(small_max: u32) -> usize {
    (DATA_OVERHEAD + small_max as usize + MAX_CONTROL).next_multiple_of(64)
}
/// Largest length one write may carry (the immediate's length field).
pub const MAX_WRITE: u32 = (1 << 30) - 1;

/// The immediate's flag: the write landed in the receiver's stream buffer, not in an
/// advertised buffer.
const IMM_RING: u32 = 1 << 31;
/// The immediate's second flag: for an advertised buffer, the message was longer than the
/// buffer and was cut; for the stream buffer, the write starts a new lap (the tail of the
/// previous one is skipped).
const IMM_FLAG: u32 = 1 << 30;

/// A malformed EXS message.
#[derive(Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum WireError {
    /// Fewer bytes than the message kind needs.
    #[error("truncated EXS message: {have} bytes, {need} needed")]
    Truncated {
        /// Bytes present.
        have: usize,
        /// Bytes needed.
        need: usize,
    },
    /// A kind this implementation does not know.
    #[error("unknown EXS message kind {0:#04x}")]
    UnknownKind(u8),
    /// A field out of its allowed range.
    #[error("bad EXS {field}: {value}")]
    BadField {
        /// Which field.
        field: &'static str,
        /// Its value.
        value: u64,
    },
}

mod kind {
    pub const ADVERTISE: u8 = 1;
    pub const REJECT: u8 = 2;
    pub const DATA: u8 = 3;
    pub const RING_ACK: u8 = 4;
    pub const CREDIT: u8 = 5;
    pub const CLOSE: u8 = 6;
    pub const FILL: u8 = 7;
    pub const ADVERTISE_SMALL: u8 = 9;
}

/// The flag of a [`Control::Fill`] record whose message was cut to the buffer.
const FLAG_TRUNCATED: u8 = 1;

/// A receive buffer offered to the sender: it may RDMA-write up to `len` bytes at `addr`
/// with `rkey`, then say so with the write's note; or fill it with a [`Control::Fill`] record.
///
/// A buffer no larger than the small messages its end takes is offered in a short form,
/// `fill_only`: without address and key (0 here), and without its sequence number (it is the
/// next one), since the sender fills it with a record whatever it sends (a longer message is
/// cut to the buffer). The form keeps a ping-pong's message (advertisement and a small
/// message's fill) within one cache line of the peer's ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Advert {
    /// Sequence number of this advertisement (consecutive from 0); 0 as decoded from the
    /// short form, where the receiver's count gives it.
    pub seq: u32,
    /// Deliveries outside advertisements (small messages, stream-buffer writes) the receiver
    /// had seen when it advertised: a sender that made more must reject the advertisement,
    /// since the receiver will fill that buffer from them. The short form carries its low 32
    /// bits (compared as such: far fewer deliveries than that are ever in flight).
    pub unadvertised_seen: u64,
    /// Where the buffer starts in the receiver's memory.
    pub addr: u64,
    /// Bytes it holds (at most [`MAX_WRITE`]; in the short form at most [`u16::MAX`]).
    pub len: u32,
    /// Remote key of its memory region.
    pub rkey: u32,
    /// The short form: filled by a record only.
    pub fill_only: bool,
}

/// A control message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Control<'a> {
    /// A receive buffer offered.
    Advertise(Advert),
    /// The sender will not write into advertisement `seq` (it was made before data the
    /// receiver had not seen yet).
    Reject {
        /// The advertisement's sequence number.
        seq: u32,
    },
    /// A small message, carried in the record itself, outside any advertisement (an
    /// unadvertised delivery).
    Data(&'a [u8]),
    /// A small message for the oldest advertisement not yet answered, carried in the record
    /// itself instead of written into the buffer (the receiver copies it there).
    Fill {
        /// The bytes (at most the advertised length).
        data: &'a [u8],
        /// SOCK_SEQPACKET: the message was longer than the buffer and was cut.
        truncated: bool,
    },
    /// The receiver consumed its stream buffer up to this position (total bytes).
    RingAck {
        /// Bytes consumed since the connection began.
        consumed: u64,
    },
    /// Nothing but the header's credits.
    Credit,
    /// The sender sends nothing more.
    Close,
}

impl Control<'_> {
    /// Bytes of the encoded message.
    pub fn encoded_len(&self) -> usize {
        HEADER
            + match self {
                Control::Advertise(a) if a.fill_only => 6,
                Control::Advertise(_) => 28,
                Control::Reject { .. } => 4,
                Control::Data(d) | Control::Fill { data: d, .. } => 2 + d.len(),
                Control::RingAck { .. } => 8,
                Control::Credit | Control::Close => 0,
            }
    }

    /// Encodes the message with `grant` credits into `out` (at least
    /// [`Control::encoded_len`] bytes); returns the length.
    pub fn encode(&self, grant: u16, out: &mut [u8]) -> usize {
        let n = self.encoded_len();
        let out = &mut out[..n];
        let mut flags = 0;
        let k = match self {
            Control::Advertise(a) if a.fill_only => {
                out[4..8].copy_from_slice(&(a.unadvertised_seen as u32).to_le_bytes());
                out[8..10].copy_from_slice(&(a.len as u16).to_le_bytes());
                kind::ADVERTISE_SMALL
            }
            Control::Advertise(a) => {
                out[4..8].copy_from_slice(&a.seq.to_le_bytes());
                out[8..16].copy_from_slice(&a.unadvertised_seen.to_le_bytes());
                out[16..24].copy_from_slice(&a.addr.to_le_bytes());
                out[24..28].copy_from_slice(&a.len.to_le_bytes());
                out[28..32].copy_from_slice(&a.rkey.to_le_bytes());
                kind::ADVERTISE
            }
            Control::Reject { seq } => {
                out[4..8].copy_from_slice(&seq.to_le_bytes());
                kind::REJECT
            }
            Control::Data(d) => {
                out[4..6].copy_from_slice(&(d.len() as u16).to_le_bytes());
                out[6..].copy_from_slice(d);
                kind::DATA
            }
            Control::Fill { data, truncated } => {
                out[4..6].copy_from_slice(&(data.len() as u16).to_le_bytes());
                out[6..].copy_from_slice(data);
                flags = if *truncated { FLAG_TRUNCATED } else { 0 };
                kind::FILL
            }
            Control::RingAck { consumed } => {
                out[4..12].copy_from_slice(&consumed.to_le_bytes());
                kind::RING_ACK
            }
            Control::Credit => kind::CREDIT,
            Control::Close => kind::CLOSE,
        };
        out[0] = k;
        out[1] = flags;
        out[2..4].copy_from_slice(&grant.to_le_bytes());
        n
    }

    /// Decodes a control message holding exactly one record into (credits granted, record).
    pub fn decode(b: &[u8]) -> Result<(u16, Control<'_>), WireError> {
        let (grant, c, used) = Control::decode_one(b)?;
        if used != b.len() {
            return Err(WireError::BadField { field: "bytes after the record", value: (b.len() - used) as u64 });
        }
        Ok((grant, c))
    }

    /// Decodes the record at the start of `b` into (credits granted, record, its bytes).
    pub fn decode_one(b: &[u8]) -> Result<(u16, Control<'_>, usize), WireError> {
        let need = |n: usize| if b.len() < n { Err(WireError::Truncated { have: b.len(), need: n }) } else { Ok(()) };
        need(HEADER)?;
        let grant = u16::from_le_bytes([b[2], b[3]]);
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let data = || -> Result<&[u8], WireError> {
            need(DATA_OVERHEAD)?;
            let n = u16::from_le_bytes([b[4], b[5]]) as usize;
            need(DATA_OVERHEAD + n)?;
            Ok(&b[DATA_OVERHEAD..DATA_OVERHEAD + n])
        };
        let msg = match b[0] {
            kind::ADVERTISE => {
                need(32)?;
                let a = Advert {
                    seq: u32_at(4),
                    unadvertised_seen: u64_at(8),
                    addr: u64_at(16),
                    len: u32_at(24),
                    rkey: u32_at(28),
                    fill_only: false,
                };
                if a.len > MAX_WRITE {
                    return Err(WireError::BadField { field: "advertised length", value: a.len as u64 });
                }
                if a.addr.checked_add(a.len as u64).is_none() {
                    return Err(WireError::BadField { field: "advertised address", value: a.addr });
                }
                Control::Advertise(a)
            }
            kind::ADVERTISE_SMALL => {
                need(10)?;
                Control::Advertise(Advert {
                    seq: 0,
                    unadvertised_seen: u32_at(4) as u64,
                    addr: 0,
                    len: u16::from_le_bytes([b[8], b[9]]) as u32,
                    rkey: 0,
                    fill_only: true,
                })
            }
            kind::REJECT => {
                need(8)?;
                Control::Reject { seq: u32_at(4) }
            }
            kind::DATA => Control::Data(data()?),
            kind::FILL => Control::Fill { data: data()?, truncated: b[1] & FLAG_TRUNCATED != 0 },
            kind::RING_ACK => {
                need(12)?;
                Control::RingAck { consumed: u64_at(4) }
            }
            kind::CREDIT => Control::Credit,
            kind::CLOSE => Control::Close,
            k => return Err(WireError::UnknownKind(k)),
        };
        let used = msg.encoded_len();
        Ok((grant, msg, used))
    }
}

/// A ping-pong's control message: a fill, after at most one short advertisement (the
/// sender's next receive). See [`lone_fill`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoneFill<'a> {
    /// The short advertisement and the credits its record grants.
    pub offer: Option<(u16, Advert)>,
    /// Credits the fill's record grants.
    pub grant: u16,
    /// The fill's bytes.
    pub data: &'a [u8],
    /// The fill's truncation flag.
    pub truncated: bool,
}

/// Decodes `b` if it is exactly a [`LoneFill`], to the records [`records`] gives for it, at a
/// fraction of the cost (a ping-pong's every message is one); `None` for any other message,
/// which [`records`] then decodes or refuses.
pub fn lone_fill(b: &[u8]) -> Option<LoneFill<'_>> {
    let u16_at = |b: &[u8], i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
    let (offer, fill) = match b.split_first_chunk::<10>() {
        Some((a, rest)) if a[0] == kind::ADVERTISE_SMALL => {
            let ad = Advert {
                seq: 0,
                unadvertised_seen: u32::from_le_bytes([a[4], a[5], a[6], a[7]]) as u64,
                addr: 0,
                len: u16_at(a, 8) as u32,
                rkey: 0,
                fill_only: true,
            };
            (Some((u16_at(a, 2), ad)), rest)
        }
        _ => (None, b),
    };
    let (head, data) = fill.split_first_chunk::<DATA_OVERHEAD>()?;
    if head[0] != kind::FILL || data.len() != u16_at(head, 4) as usize {
        return None;
    }
    Some(LoneFill { offer, grant: u16_at(head, 2), data, truncated: head[1] & FLAG_TRUNCATED != 0 })
}

/// Bytes of a [`LoneFill`]'s records before its data, at most.
pub const LONE_FILL_HEAD: usize = 10 + DATA_OVERHEAD;

/// Encodes the records of a [`LoneFill`] of `len` bytes up to its data (which follow them)
/// into `out`, as [`Control::encode`] does, in a fraction of its instructions (a ping-pong's
/// every message is one); returns the length. `offer` is a short advertisement's.
pub fn encode_lone_fill_head(
    offer: Option<(u16, &Advert)>,
    grant: u16,
    len: u16,
    truncated: bool,
    out: &mut [u8; LONE_FILL_HEAD],
) -> usize {
    let at = match offer {
        Some((g, ad)) => {
            debug_assert!(ad.fill_only);
            let [g0, g1] = g.to_le_bytes();
            let [s0, s1, s2, s3] = (ad.unadvertised_seen as u32).to_le_bytes();
            let [l0, l1] = (ad.len as u16).to_le_bytes();
            out[..10].copy_from_slice(&[kind::ADVERTISE_SMALL, 0, g0, g1, s0, s1, s2, s3, l0, l1]);
            10
        }
        None => 0,
    };
    let [g0, g1] = grant.to_le_bytes();
    let [l0, l1] = len.to_le_bytes();
    let flags = if truncated { FLAG_TRUNCATED } else { 0 };
    out[at..at + DATA_OVERHEAD].copy_from_slice(&[kind::FILL, flags, g0, g1, l0, l1]);
    at + DATA_OVERHEAD
}

/// The records of a received control message, in order; an error ends them.
pub fn records(mut b: &[u8]) -> impl Iterator<Item = Result<(u16, Control<'_>), WireError>> {
    std::iter::from_fn(move || {
        if b.is_empty() {
            return None;
        }
        match Control::decode_one(b) {
            Ok((g, c, used)) => {
                b = &b[used..];
                Some(Ok((g, c)))
            }
            Err(e) => {
                b = &[];
                Some(Err(e))
            }
        }
    })
}

/// What a data write's immediate says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteNote {
    /// The oldest advertisement not yet answered holds `len` bytes (the message, cut to the
    /// buffer when `truncated`). Earlier plain writes into the same buffer count in `len`.
    Advertised {
        /// Bytes now in the buffer.
        len: u32,
        /// SOCK_SEQPACKET: the message did not fit and its tail was dropped.
        truncated: bool,
    },
    /// `len` bytes landed in the stream buffer at the sender's write position.
    Ring {
        /// Bytes written.
        len: u32,
        /// The write starts a new lap of the buffer.
        wrapped: bool,
    },
}

impl WriteNote {
    /// The immediate value.
    pub fn encode(self) -> u32 {
        match self {
            WriteNote::Advertised { len, truncated } => {
                debug_assert!(len <= MAX_WRITE);
                len | if truncated { IMM_FLAG } else { 0 }
            }
            WriteNote::Ring { len, wrapped } => {
                debug_assert!(len <= MAX_WRITE);
                len | IMM_RING | if wrapped { IMM_FLAG } else { 0 }
            }
        }
    }

    /// Decodes an immediate value (every value means something; the receiver checks it
    /// against its state).
    pub fn decode(imm: u32) -> WriteNote {
        let len = imm & MAX_WRITE;
        let flag = imm & IMM_FLAG != 0;
        if imm & IMM_RING != 0 {
            WriteNote::Ring { len, wrapped: flag }
        } else {
            WriteNote::Advertised { len, truncated: flag }
        }
    }
}

/// The kind byte of a write note: a message of its own, never among records.
const WRITE_NOTE: u8 = 8;
/// Bytes of an encoded write note.
pub const WRITE_NOTE_LEN: usize = 8;

/// What one message of a connection's pipe holds: records (controls, small messages), or a
/// write note, the [`WriteNote`] of a data write that raised no immediate of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Message<'a> {
    /// Records, back to back (decode them with [`records`]).
    Records(&'a [u8]),
    /// A data write landed (it was posted before the note, so it is placed before it).
    Written(WriteNote),
}

impl<'a> Message<'a> {
    /// Tells a note from records by the kind byte; a note must be exactly
    /// [`WRITE_NOTE_LEN`] bytes with its reserved bytes zero.
    pub fn decode(b: &'a [u8]) -> Result<Message<'a>, WireError> {
        if b.first() != Some(&WRITE_NOTE) {
            return Ok(Message::Records(b));
        }
        if b.len() != WRITE_NOTE_LEN {
            return Err(WireError::BadField { field: "write note length", value: b.len() as u64 });
        }
        if b[1..4] != [0, 0, 0] {
            return Err(WireError::BadField { field: "write note reserved bytes", value: b[1] as u64 });
        }
        Ok(Message::Written(WriteNote::decode(u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")))))
    }
}

impl WriteNote {
    /// The note as a message of its own ([`Message::Written`]).
    pub fn encode_message(self) -> [u8; WRITE_NOTE_LEN] {
        let mut b = [0u8; WRITE_NOTE_LEN];
        b[0] = WRITE_NOTE;
        b[4..8].copy_from_slice(&self.encode().to_le_bytes());
        b
    }
}

/// The socket types EXS offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SocketKind {
    /// A byte stream: sends may be split and joined.
    Stream,
    /// Messages whose boundaries are kept.
    SeqPacket,
}

/// What each end tells the other in the connection handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The socket type (both ends must agree).
    pub kind: SocketKind,
    /// Control messages the sender takes unread at most (the peer's initial credits).
    pub msg_credits: u16,
    /// Largest small message the sender takes inside a control message.
    pub small_max: u32,
    /// The sender's stream buffer: address, bytes (0: none), remote key.
    pub ring_addr: u64,
    /// Bytes of the stream buffer.
    pub ring_len: u32,
    /// Its remote key.
    pub ring_rkey: u32,
}

/// Version 2: control messages travel over a message pipe, not into posted slots.
const HELLO_MAGIC: &[u8; 4] = b"EXS2";
/// Bytes of an encoded [`Hello`].
pub const HELLO_LEN: usize = 28;

impl Hello {
    /// Encodes the handshake data.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(HELLO_MAGIC);
        b[4] = match self.kind {
            SocketKind::Stream => 1,
            SocketKind::SeqPacket => 2,
        };
        b[6..8].copy_from_slice(&self.msg_credits.to_le_bytes());
        b[8..12].copy_from_slice(&self.small_max.to_le_bytes());
        b[12..20].copy_from_slice(&self.ring_addr.to_le_bytes());
        b[20..24].copy_from_slice(&self.ring_len.to_le_bytes());
        b[24..28].copy_from_slice(&self.ring_rkey.to_le_bytes());
        b
    }

    /// Decodes the peer's handshake data.
    pub fn decode(b: &[u8]) -> Result<Hello, WireError> {
        if b.len() < HELLO_LEN {
            return Err(WireError::Truncated { have: b.len(), need: HELLO_LEN });
        }
        if &b[0..4] != HELLO_MAGIC {
            return Err(WireError::BadField {
                field: "handshake magic",
                value: u32::from_le_bytes(b[0..4].try_into().expect("4")) as u64,
            });
        }
        let kind = match b[4] {
            1 => SocketKind::Stream,
            2 => SocketKind::SeqPacket,
            k => return Err(WireError::BadField { field: "socket type", value: k as u64 }),
        };
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let h = Hello {
            kind,
            msg_credits: u16::from_le_bytes([b[6], b[7]]),
            small_max: u32_at(8),
            ring_addr: u64::from_le_bytes(b[12..20].try_into().expect("8 bytes")),
            ring_len: u32_at(20),
            ring_rkey: u32_at(24),
        };
        if h.msg_credits < 4 {
            return Err(WireError::BadField { field: "message credits", value: h.msg_credits as u64 });
        }
        if h.small_max > super::SMALL_MAX_LIMIT as u32 {
            return Err(WireError::BadField { field: "small message size", value: h.small_max as u64 });
        }
        if h.ring_len > MAX_WRITE || h.ring_addr.checked_add(h.ring_len as u64).is_none() {
            return Err(WireError::BadField { field: "stream buffer", value: h.ring_len as u64 });
        }
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn control() -> impl Strategy<Value = (u16, Vec<u8>, u8, u32, u64, u64, u32, u32)> {
        (
            any::<u16>(),
            proptest::collection::vec(any::<u8>(), 0..200),
            0u8..8,
            any::<u32>(),
            any::<u64>(),
            0u64..1 << 62,
            0..=MAX_WRITE,
            any::<u32>(),
        )
    }

    proptest! {
        #[test]
        fn control_messages_round_trip((grant, data, k, seq, pos, addr, len, rkey) in control()) {
            let msg = match k {
                0 => Control::Advertise(Advert { seq, unadvertised_seen: pos, addr, len, rkey, fill_only: false }),
                6 => Control::Advertise(Advert {
                    seq: 0,
                    unadvertised_seen: pos & 0xffff_ffff,
                    addr: 0,
                    len: len & 0xffff,
                    rkey: 0,
                    fill_only: true,
                }),
                1 => Control::Reject { seq },
                2 => Control::Data(&data),
                3 => Control::RingAck { consumed: pos },
                4 => Control::Credit,
                5 => Control::Fill { data: &data, truncated: seq % 2 == 0 },
                _ => Control::Close,
            };
            let mut buf = vec![0u8; msg.encoded_len()];
            let n = msg.encode(grant, &mut buf);
            prop_assert_eq!(n, buf.len());
            let (g, back) = Control::decode(&buf).unwrap();
            prop_assert_eq!(g, grant);
            prop_assert_eq!(back, msg);
        }

        #[test]
        fn records_packed_in_one_send_come_back_in_order(lens in proptest::collection::vec(0usize..100, 1..6), grant: u16) {
            let datas: Vec<Vec<u8>> = lens.iter().map(|&n| vec![n as u8; n]).collect();
            let msgs: Vec<Control> = datas.iter().enumerate().map(|(i, d)| if i % 2 == 0 { Control::Data(d) } else { Control::Reject { seq: i as u32 } }).collect();
            let mut buf = Vec::new();
            for m in &msgs {
                let at = buf.len();
                buf.resize(at + m.encoded_len(), 0);
                m.encode(grant, &mut buf[at..]);
            }
            let back: Vec<(u16, Control)> = records(&buf).map(|r| r.unwrap()).collect();
            prop_assert_eq!(back.len(), msgs.len());
            for ((g, c), m) in back.into_iter().zip(msgs) {
                prop_assert_eq!(g, grant);
                prop_assert_eq!(c, m);
            }
        }

        #[test]
        fn a_lone_fill_decodes_as_its_records_do(
            offer in proptest::option::of((any::<u16>(), any::<u32>(), any::<u16>())),
            grant: u16,
            data in proptest::collection::vec(any::<u8>(), 0..80),
            truncated: bool,
            noise in proptest::collection::vec(any::<u8>(), 0..24),
            cut in 0usize..120,
        ) {
            let mut buf = Vec::new();
            let mut push = |c: Control, g: u16| {
                let at = buf.len();
                buf.resize(at + c.encoded_len(), 0);
                c.encode(g, &mut buf[at..]);
            };
            if let Some((g, seen, len)) = offer {
                let ad = Advert { seq: 0, unadvertised_seen: seen as u64, addr: 0, len: len as u32, rkey: 0, fill_only: true };
                push(Control::Advertise(ad), g);
            }
            push(Control::Fill { data: &data, truncated }, grant);
            let want = LoneFill {
                offer: offer.map(|(g, seen, len)| {
                    (g, Advert { seq: 0, unadvertised_seen: seen as u64, addr: 0, len: len as u32, rkey: 0, fill_only: true })
                }),
                grant,
                data: &data,
                truncated,
            };
            prop_assert_eq!(lone_fill(&buf), Some(want));
            // Its encoder writes what the general one does.
            let mut head = [0u8; LONE_FILL_HEAD];
            let n = encode_lone_fill_head(want.offer.as_ref().map(|(g, ad)| (*g, ad)), grant, data.len() as u16, truncated, &mut head);
            prop_assert_eq!(&head[..n], &buf[..buf.len() - data.len()]);
            // Cut, lengthened or any bytes: whenever it decodes, it is what `records` gives.
            for b in [&buf[..cut.min(buf.len())], &[&buf[..], &noise[..]].concat()[..], &noise[..]] {
                if let Some(l) = lone_fill(b) {
                    let recs: Vec<_> = records(b).collect::<Result<_, _>>().unwrap();
                    let mut want = Vec::new();
                    if let Some((g, ad)) = l.offer {
                        want.push((g, Control::Advertise(ad)));
                    }
                    want.push((l.grant, Control::Fill { data: l.data, truncated: l.truncated }));
                    prop_assert_eq!(recs, want);
                }
            }
        }

        #[test]
        fn any_bytes_decode_to_a_message_or_an_error(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = Control::decode(&bytes);
            let _ = Hello::decode(&bytes);
            let _ = records(&bytes).count();
            let _ = lone_fill(&bytes);
        }

        #[test]
        fn write_notes_round_trip_and_records_stay_records(imm: u32, bytes in proptest::collection::vec(any::<u8>(), 0..16)) {
            let note = WriteNote::decode(imm);
            let encoded = note.encode_message();
            prop_assert_eq!(Message::decode(&encoded), Ok(Message::Written(note)));
            match Message::decode(&bytes) {
                Ok(Message::Records(b)) => prop_assert_eq!(b, &bytes[..]),
                Ok(Message::Written(_)) => prop_assert!(bytes.len() == WRITE_NOTE_LEN && bytes[0] == WRITE_NOTE),
                Err(_) => prop_assert!(bytes[0] == WRITE_NOTE),
            }
        }

        #[test]
        fn immediates_round_trip(len in 0..=MAX_WRITE, truncated: bool, ring: bool) {
            let note = if ring { WriteNote::Ring { len, wrapped: truncated } } else { WriteNote::Advertised { len, truncated } };
            prop_assert_eq!(WriteNote::decode(note.encode()), note);
        }
    }

    #[test]
    fn a_hello_round_trips_and_refuses_nonsense() {
        let h = Hello {
            kind: SocketKind::SeqPacket,
            msg_credits: 64,
            small_max: 128,
            ring_addr: 0x1000,
            ring_len: 65536,
            ring_rkey: 7,
        };
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        let mut bad = h.encode();
        bad[0] = b'X';
        assert!(Hello::decode(&bad).is_err());
        let mut bad = h.encode();
        bad[4] = 9;
        assert!(Hello::decode(&bad).is_err());
        assert!(Hello::decode(&h.encode()[..20]).is_err());
    }

    #[test]
    fn an_advertisement_past_the_address_space_is_refused() {
        let a = Control::Advertise(Advert {
            seq: 0,
            unadvertised_seen: 0,
            addr: u64::MAX - 3,
            len: 16,
            rkey: 1,
            fill_only: false,
        });
        let mut buf = [0u8; MAX_CONTROL];
        let n = a.encode(0, &mut buf);
        assert!(matches!(Control::decode(&buf[..n]), Err(WireError::BadField { .. })));
    }
}
