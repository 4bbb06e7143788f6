//! The frames the software provider's TCP transport carries: one fixed header per verbs
//! request or response, followed by its data where it has any.
//!
//! Plain data and pure functions (sans-IO): `soft::qp::tcp` moves the bytes. Every header read
//! from a peer is decoded here into a validated value before it is used, so a peer that lies
//! can fail its connection but can never steer a copy.
//!
//! Header layout (48 bytes, little-endian):
//! ```text
//! 0  kind u8    1 flags u8    2 status u16 (naks only)   4 seq u32
//! 8  len u32 (data that follows: sends, writes, read responses; the asked length: read requests)
//! 12 rkey u32   16 imm u32    20 ack u32 (with FLAG_ACK: every request of the receiver's up to
//!                                        this one is done, piggybacked on any frame)
//! 24 raddr u64  32 operand u64 (compare or add; an atomic's old value)   40 swap u64
//! ```
//! A hello names the target queue pair (raddr = context id, rkey = queue-pair number) and the
//! source (operand = context id, imm = queue-pair number, swap = host identity).

use super::super::wire::MAX_MESSAGE;

/// Bytes of every frame header.
pub const HEADER: usize = 48;

/// What a frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// First frame of a connection: which queue pair it is for.
    Hello = 1,
    /// SEND (with immediate when flagged): `len` data bytes follow.
    Send = 2,
    /// RDMA WRITE (with immediate when flagged): `len` data bytes follow.
    Write = 3,
    /// RDMA READ request for `len` bytes at `raddr`.
    ReadReq = 4,
    /// Compare-and-swap at `raddr`: `operand` compared, `swap` stored.
    CmpSwap = 5,
    /// Fetch-and-add of `operand` at `raddr`.
    FetchAdd = 6,
    /// Every request up to `seq` done.
    Ack = 7,
    /// Request `seq` refused with `status` (everything before it done).
    Nak = 8,
    /// Data of read request `seq`: `len` bytes follow.
    ReadResp = 9,
    /// Old value (`operand`) of atomic request `seq`.
    AtomicResp = 10,
    /// Nothing: proof of life on an idle connection.
    Keepalive = 11,
    /// Orderly end: the sender's queue pair is gone or in error.
    Bye = 12,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Hello,
            2 => Kind::Send,
            3 => Kind::Write,
            4 => Kind::ReadReq,
            5 => Kind::CmpSwap,
            6 => Kind::FetchAdd,
            7 => Kind::Ack,
            8 => Kind::Nak,
            9 => Kind::ReadResp,
            10 => Kind::AtomicResp,
            11 => Kind::Keepalive,
            12 => Kind::Bye,
            _ => return None,
        })
    }

    /// True for what a requester sends (and a responder answers).
    pub fn is_request(self) -> bool {
        matches!(self, Kind::Send | Kind::Write | Kind::ReadReq | Kind::CmpSwap | Kind::FetchAdd)
    }

    /// True for what a responder sends back.
    pub fn is_response(self) -> bool {
        matches!(self, Kind::Ack | Kind::Nak | Kind::ReadResp | Kind::AtomicResp)
    }
}

/// The immediate field is set (SEND or WRITE with immediate).
pub const FLAG_IMM: u8 = 1;
/// The `ack` field is set: an acknowledgement riding on the frame.
pub const FLAG_ACK: u8 = 2;
/// A plain write its requester completed at injection: nothing there waits for its
/// acknowledgement, which rides on the next frame going back instead of a frame of its own.
pub const FLAG_LAZY_ACK: u8 = 4;

/// Why a responder refused a request (a nak's `status`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum NakCode {
    /// No receive was posted: retry after the receiver-not-ready timer.
    ReceiverNotReady = 1,
    /// Invalid request (receive too small, misaligned atomic).
    InvalidRequest = 2,
    /// Key, bounds, rights or protection domain refused the access.
    AccessError = 3,
    /// The responder could not carry it out (its own receive buffer refused the data).
    OperationError = 4,
}

impl NakCode {
    fn from_u16(v: u16) -> Option<NakCode> {
        Some(match v {
            1 => NakCode::ReceiverNotReady,
            2 => NakCode::InvalidRequest,
            3 => NakCode::AccessError,
            4 => NakCode::OperationError,
            _ => return None,
        })
    }
}

/// A decoded (validated) frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frame {
    /// What it is.
    pub kind: Kind,
    /// `FLAG_IMM` or 0.
    pub flags: u8,
    /// Set for naks only.
    pub nak: Option<NakCode>,
    /// The request's sequence number (the answered request's, in a response).
    pub seq: u32,
    /// Data length (see [`Frame::data_len`]), or a read request's length.
    pub len: u32,
    /// Remote key of a one-sided request.
    pub rkey: u32,
    /// Immediate data; a receiver-not-ready nak's timer code.
    pub imm: u32,
    /// Remote address of a one-sided request.
    pub raddr: u64,
    /// Compare value or addend of an atomic; the old value in its response.
    pub operand: u64,
    /// Swap value of a compare-and-swap.
    pub swap: u64,
    /// With `FLAG_ACK`: the sender, as a responder, has done every request of ours up to this.
    pub ack: u32,
}

/// Why a header was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The kind byte names no frame.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// Flags this kind cannot have.
    #[error("unknown flags {0:#x}")]
    UnknownFlags(u8),
    /// An acknowledgement field without its flag.
    #[error("ack field set without its flag")]
    Reserved,
    /// A length this kind cannot have (over 2 GiB, or any on a frame without data).
    #[error("{0:?} frame with a length of {1}")]
    BadLength(Kind, u32),
    /// A nak status that is not a [`NakCode`].
    #[error("nak status {0} is unknown")]
    BadNak(u16),
    /// A status on a frame other than a nak.
    #[error("status set on a {0:?} frame")]
    StatusOnNonNak(Kind),
}

impl Frame {
    /// A frame of `kind` with every other field zero.
    pub fn new(kind: Kind, seq: u32) -> Frame {
        Frame { kind, flags: 0, nak: None, seq, len: 0, rkey: 0, imm: 0, raddr: 0, operand: 0, swap: 0, ack: 0 }
    }

    /// Bytes of data that follow the header.
    pub fn data_len(&self) -> u32 {
        match self.kind {
            Kind::Send | Kind::Write | Kind::ReadResp => self.len,
            _ => 0,
        }
    }

    /// The immediate, if flagged.
    pub fn imm(&self) -> Option<u32> {
        (self.flags & FLAG_IMM != 0).then_some(self.imm)
    }

    /// The header's wire form.
    pub fn encode(&self) -> [u8; HEADER] {
        let mut b = [0u8; HEADER];
        b[0] = self.kind as u8;
        b[1] = self.flags;
        b[2..4].copy_from_slice(&self.nak.map(|n| n as u16).unwrap_or(0).to_le_bytes());
        b[4..8].copy_from_slice(&self.seq.to_le_bytes());
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b[12..16].copy_from_slice(&self.rkey.to_le_bytes());
        b[16..20].copy_from_slice(&self.imm.to_le_bytes());
        b[20..24].copy_from_slice(&self.ack.to_le_bytes());
        b[24..32].copy_from_slice(&self.raddr.to_le_bytes());
        b[32..40].copy_from_slice(&self.operand.to_le_bytes());
        b[40..48].copy_from_slice(&self.swap.to_le_bytes());
        b
    }

    /// Decodes and validates a header from a peer. Every malformation is an error.
    pub fn decode(b: &[u8; HEADER]) -> Result<Frame, FrameError> {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let kind = Kind::from_u8(b[0]).ok_or(FrameError::UnknownKind(b[0]))?;
        let flags = b[1];
        if flags & !(FLAG_IMM | FLAG_ACK | FLAG_LAZY_ACK) != 0
            || (flags & FLAG_IMM != 0 && !matches!(kind, Kind::Send | Kind::Write))
            || (flags & FLAG_ACK != 0 && kind == Kind::Hello)
            || (flags & FLAG_LAZY_ACK != 0 && (kind != Kind::Write || flags & FLAG_IMM != 0))
        {
            return Err(FrameError::UnknownFlags(flags));
        }
        if flags & FLAG_ACK == 0 && u32_at(20) != 0 {
            return Err(FrameError::Reserved);
        }
        let status = u16::from_le_bytes([b[2], b[3]]);
        let nak = match kind {
            Kind::Nak => Some(NakCode::from_u16(status).ok_or(FrameError::BadNak(status))?),
            _ if status != 0 => return Err(FrameError::StatusOnNonNak(kind)),
            _ => None,
        };
        let len = u32_at(8);
        let len_ok = match kind {
            Kind::Send | Kind::Write | Kind::ReadResp | Kind::ReadReq => len <= MAX_MESSAGE,
            _ => len == 0,
        };
        if !len_ok {
            return Err(FrameError::BadLength(kind, len));
        }
        Ok(Frame {
            kind,
            flags,
            nak,
            seq: u32_at(4),
            len,
            rkey: u32_at(12),
            imm: u32_at(16),
            raddr: u64_at(24),
            operand: u64_at(32),
            swap: u64_at(40),
            ack: u32_at(20),
        })
    }
}

/// True if sequence number `a` comes before `b` (wrapping, as packet sequence numbers do).
pub fn seq_before(a: u32, b: u32) -> bool {
    (b.wrapping_sub(a) as i32) > 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn frame() -> impl Strategy<Value = Frame> {
        (
            1u8..=12,
            any::<bool>(),
            1u16..=4,
            any::<u32>(),
            0..=MAX_MESSAGE,
            any::<[u32; 2]>(),
            any::<[u64; 3]>(),
            any::<Option<u32>>(),
            any::<bool>(),
        )
            .prop_map(|(k, imm, nak, seq, len, [rkey, im], [raddr, operand, swap], ack, lazy)| {
                let kind = Kind::from_u8(k).unwrap();
                let carries = matches!(kind, Kind::Send | Kind::Write | Kind::ReadResp | Kind::ReadReq);
                let ack = ack.filter(|_| kind != Kind::Hello);
                Frame {
                    kind,
                    flags: if imm && matches!(kind, Kind::Send | Kind::Write) { FLAG_IMM } else { 0 }
                        | if ack.is_some() { FLAG_ACK } else { 0 }
                        | if lazy && !imm && kind == Kind::Write { FLAG_LAZY_ACK } else { 0 },
                    ack: ack.unwrap_or(0),
                    nak: (kind == Kind::Nak).then(|| NakCode::from_u16(nak).unwrap()),
                    seq,
                    len: if carries { len } else { 0 },
                    rkey,
                    imm: im,
                    raddr,
                    operand,
                    swap,
                }
            })
    }

    proptest! {
        #[test]
        fn round_trips(f in frame()) {
            prop_assert_eq!(Frame::decode(&f.encode()).unwrap(), f);
        }

        #[test]
        fn arbitrary_headers_never_panic_and_decode_to_valid_frames(b in any::<[u8; HEADER]>()) {
            if let Ok(f) = Frame::decode(&b) {
                prop_assert!(f.data_len() <= MAX_MESSAGE);
                prop_assert_eq!(f.encode(), b);
            }
        }
    }

    #[test]
    fn lengths_that_lie_are_refused() {
        let mut f = Frame::new(Kind::Send, 1);
        f.len = MAX_MESSAGE + 1;
        assert_eq!(Frame::decode(&f.encode()), Err(FrameError::BadLength(Kind::Send, MAX_MESSAGE + 1)));
        let mut b = Frame::new(Kind::Ack, 1).encode();
        b[8] = 1;
        assert!(matches!(Frame::decode(&b), Err(FrameError::BadLength(Kind::Ack, 1))));
        let mut b = Frame::new(Kind::Nak, 1).encode();
        b[2] = 9;
        assert_eq!(Frame::decode(&b), Err(FrameError::BadNak(9)));
        b[0] = 0;
        assert_eq!(Frame::decode(&b), Err(FrameError::UnknownKind(0)));
    }

    #[test]
    fn only_plain_writes_may_ask_for_a_lazy_acknowledgement() {
        let mut f = Frame::new(Kind::Write, 1);
        f.flags = FLAG_LAZY_ACK;
        assert_eq!(Frame::decode(&f.encode()), Ok(f));
        for (kind, flags) in
            [(Kind::Write, FLAG_LAZY_ACK | FLAG_IMM), (Kind::Send, FLAG_LAZY_ACK), (Kind::Ack, FLAG_LAZY_ACK)]
        {
            let mut f = Frame::new(kind, 1);
            f.flags = flags;
            assert_eq!(Frame::decode(&f.encode()), Err(FrameError::UnknownFlags(flags)), "{kind:?}");
        }
    }

    #[test]
    fn sequence_numbers_wrap() {
        assert!(seq_before(1, 2));
        assert!(seq_before(u32::MAX, 0));
        assert!(!seq_before(2, 2));
        assert!(!seq_before(3, 2));
    }
}
