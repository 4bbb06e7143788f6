//! The SDP wire protocol as plain data: the base header (BSDH) and the messages a stream
//! exchanges, encoded into and decoded from byte slices with no I/O.
//!
//! Every message starts with the 16-byte BSDH: message id, flags, buffer credits, total length
//! (header included), the sender's message sequence number `mseq` and the last `mseq` it
//! received (`mseq_ack`). Message ids follow the SDP specification's numbering; the two
//! messages of AZ-SDP's copy-on-write variant (LockTable, SrcAvailUpdate), which the
//! specification does not have, use ids from 0x80. Decoding checks
//! every length against the bytes actually present, so a malformed peer message is an error,
//! never a panic or an out-of-bounds read.

use thiserror::Error;

/// Bytes of the base SDP header.
pub const BSDH_LEN: usize = 16;

/// A malformed SDP message.
#[derive(Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum WireError {
    /// Fewer bytes than the header, or than the header's length field claims.
    #[error("truncated SDP message: {have} bytes, {need} needed")]
    Truncated {
        /// Bytes present.
        have: usize,
        /// Bytes the header requires.
        need: usize,
    },
    /// The length field disagrees with the message's bytes.
    #[error("SDP length field {claimed} but the message has {actual} bytes")]
    BadLength {
        /// What the header says.
        claimed: u32,
        /// What arrived.
        actual: usize,
    },
    /// An id this implementation does not know.
    #[error("unknown SDP message id {0:#04x}")]
    UnknownId(u8),
    /// A message whose sequence number does not follow the previous one.
    #[error("SDP message out of order: mseq {got}, expected {expected}")]
    OutOfOrder {
        /// The message's mseq.
        got: u32,
        /// The mseq that should have come.
        expected: u32,
    },
    /// A field out of its allowed range.
    #[error("bad SDP {field}: {value}")]
    BadField {
        /// Which field.
        field: &'static str,
        /// Its value.
        value: u64,
    },
}

/// Message ids (SDP specification numbering).
mod mid {
    pub const DISCONNECT: u8 = 0x02;
    pub const ABORT: u8 = 0x03;
    pub const RDMA_RD_COMPL: u8 = 0x06;
    pub const MODE_CHANGE: u8 = 0x07;
    pub const SRC_AVAIL_CANCEL: u8 = 0x08;
    pub const LOCK_TABLE: u8 = 0x80;
    pub const SRC_AVAIL_UPDATE: u8 = 0x81;
    pub const CLOSE: u8 = 0x82;
    pub const SINK_AVAIL: u8 = 0xFD;
    pub const SRC_AVAIL: u8 = 0xFE;
    pub const DATA: u8 = 0xFF;
}

/// The flag bit of a Data message sent urgently (OOB-like; carried, not interpreted).
pub const FLAG_URGENT: u8 = 0x01;
/// The flag bit asking the receiver to answer with a credit update at once.
pub const FLAG_REQ_CREDITS: u8 = 0x02;

/// The base SDP header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Bsdh {
    /// Flag bits (`FLAG_*`).
    pub flags: u8,
    /// Receive buffers the sender of this message has free for its peer (credits).
    pub bufs: u16,
    /// This message's sequence number.
    pub mseq: u32,
    /// The last sequence number the sender received.
    pub mseq_ack: u32,
}

/// Which send design a socket uses (carried by ModeChange).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Design {
    /// Buffer copy through pre-registered private buffers.
    Bsdp,
    /// Synchronous zero-copy: SrcAvail, the receiver reads, send returns on RdmaRdCompl.
    Zsdp,
    /// Asynchronous zero-copy with memory protection.
    AzSdp,
}

impl Design {
    fn code(self) -> u8 {
        match self {
            Design::Bsdp => 0,
            Design::Zsdp => 1,
            Design::AzSdp => 2,
        }
    }
    fn from_code(c: u8) -> Option<Design> {
        Some(match c {
            0 => Design::Bsdp,
            1 => Design::Zsdp,
            2 => Design::AzSdp,
            _ => return None,
        })
    }
    /// The design named `bsdp`, `zsdp` or `azsdp` (case-insensitive).
    pub fn by_name(name: &str) -> Option<Design> {
        match name.to_ascii_lowercase().as_str() {
            "bsdp" => Some(Design::Bsdp),
            "zsdp" => Some(Design::Zsdp),
            "azsdp" | "az-sdp" => Some(Design::AzSdp),
            _ => None,
        }
    }
    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Design::Bsdp => "bsdp",
            Design::Zsdp => "zsdp",
            Design::AzSdp => "azsdp",
        }
    }
}

/// A buffer advertised for the peer to read (SrcAvail) or write (SinkAvail).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Advert {
    /// Bytes advertised.
    pub len: u32,
    /// Remote key of the registration.
    pub rkey: u32,
    /// Virtual address of the first byte.
    pub addr: u64,
}

impl Advert {
    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.len.to_be_bytes());
        out.extend_from_slice(&self.rkey.to_be_bytes());
        out.extend_from_slice(&self.addr.to_be_bytes());
    }

    /// Decodes 16 bytes (the caller checked there are exactly 16).
    fn decode(b: &[u8]) -> Result<Advert, WireError> {
        let a = Advert {
            len: u32::from_be_bytes(b[0..4].try_into().expect("4 bytes")),
            rkey: u32::from_be_bytes(b[4..8].try_into().expect("4 bytes")),
            addr: u64::from_be_bytes(b[8..16].try_into().expect("8 bytes")),
        };
        if a.len == 0 {
            return Err(WireError::BadField { field: "advertised length", value: 0 });
        }
        if a.addr.checked_add(a.len as u64).is_none() {
            return Err(WireError::BadField { field: "advertised address", value: a.addr });
        }
        Ok(a)
    }
}

/// One SDP message (the payload of Data borrowed from the decoded bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Message<'a> {
    /// Stream bytes; empty data is a pure credit update.
    Data(&'a [u8]),
    /// The sender's buffer is available for an RDMA read.
    SrcAvail(Advert),
    /// The receiver's buffer is available for an RDMA write.
    SinkAvail(Advert),
    /// The receiver has read `len` bytes of the oldest SrcAvail and is done with it.
    RdmaRdCompl {
        /// Bytes read.
        len: u32,
    },
    /// The sender withdraws its oldest SrcAvail (the receiver answers RdmaRdCompl with what it
    /// read, possibly 0).
    SrcAvailCancel,
    /// The sender switches design.
    ModeChange(Design),
    /// Where the sender keeps one lock word (8 bytes) per outstanding SrcAvail of its peer,
    /// for AZ-SDP's copy-on-write: the word of the SrcAvail numbered `n` (counting from 0 on
    /// the connection) is at `addr + 8 * (n % (len / 8))`, taken by compare-and-swap.
    LockTable(Advert),
    /// Copy-on-write: the sender's SrcAvail numbered `index` (whose lock it won, so the
    /// receiver has not started reading it) now lies in `advert` (same length).
    SrcAvailUpdate {
        /// Number of the SrcAvail on the connection, from 0.
        index: u64,
        /// Where its bytes are now.
        advert: Advert,
    },
    /// The sender will send no more stream bytes (shutdown of its write side).
    Disconnect,
    /// The sender closed the socket: Disconnect (if it did not send one already), and it will
    /// read nothing more, so its peer need not wait for its own messages to be taken. (The
    /// specification ends a connection with a connection-manager handshake after both
    /// Disconnects instead; without one, a closer that lingered until its peer's Disconnect
    /// arrived could wait for a peer that never closes.)
    Close,
    /// The sender drops the connection at once.
    Abort,
}

impl Message<'_> {
    fn id(&self) -> u8 {
        match self {
            Message::Data(_) => mid::DATA,
            Message::SrcAvail(_) => mid::SRC_AVAIL,
            Message::SinkAvail(_) => mid::SINK_AVAIL,
            Message::RdmaRdCompl { .. } => mid::RDMA_RD_COMPL,
            Message::SrcAvailCancel => mid::SRC_AVAIL_CANCEL,
            Message::ModeChange(_) => mid::MODE_CHANGE,
            Message::LockTable(_) => mid::LOCK_TABLE,
            Message::SrcAvailUpdate { .. } => mid::SRC_AVAIL_UPDATE,
            Message::Disconnect => mid::DISCONNECT,
            Message::Close => mid::CLOSE,
            Message::Abort => mid::ABORT,
        }
    }

    /// Bytes after the header.
    pub fn body_len(&self) -> usize {
        match self {
            Message::Data(d) => d.len(),
            Message::SrcAvail(_) | Message::SinkAvail(_) | Message::LockTable(_) => 16,
            Message::SrcAvailUpdate { .. } => 24,
            Message::RdmaRdCompl { .. } => 4,
            Message::ModeChange(_) => 4,
            Message::SrcAvailCancel | Message::Disconnect | Message::Close | Message::Abort => 0,
        }
    }

    /// Bytes of the whole encoded message.
    pub fn encoded_len(&self) -> usize {
        BSDH_LEN + self.body_len()
    }

    /// Appends the message, with header `h`, to `out`.
    pub fn encode(&self, h: &Bsdh, out: &mut Vec<u8>) {
        let len = self.encoded_len() as u32;
        out.push(self.id());
        out.push(h.flags);
        out.extend_from_slice(&h.bufs.to_be_bytes());
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(&h.mseq.to_be_bytes());
        out.extend_from_slice(&h.mseq_ack.to_be_bytes());
        match self {
            Message::Data(d) => out.extend_from_slice(d),
            Message::SrcAvail(a) | Message::SinkAvail(a) | Message::LockTable(a) => a.encode(out),
            Message::SrcAvailUpdate { index, advert } => {
                out.extend_from_slice(&index.to_be_bytes());
                advert.encode(out);
            }
            Message::RdmaRdCompl { len } => out.extend_from_slice(&len.to_be_bytes()),
            Message::ModeChange(d) => out.extend_from_slice(&[d.code(), 0, 0, 0]),
            Message::SrcAvailCancel | Message::Disconnect | Message::Close | Message::Abort => {}
        }
    }

    /// Decodes one whole message (exactly the bytes of one transport message).
    pub fn decode(bytes: &[u8]) -> Result<(Bsdh, Message<'_>), WireError> {
        if bytes.len() < BSDH_LEN {
            return Err(WireError::Truncated { have: bytes.len(), need: BSDH_LEN });
        }
        let be32 = |o: usize| u32::from_be_bytes(bytes[o..o + 4].try_into().expect("4 bytes"));
        let id = bytes[0];
        let h =
            Bsdh { flags: bytes[1], bufs: u16::from_be_bytes([bytes[2], bytes[3]]), mseq: be32(8), mseq_ack: be32(12) };
        let len = be32(4);
        if len as usize != bytes.len() {
            return Err(WireError::BadLength { claimed: len, actual: bytes.len() });
        }
        let body = &bytes[BSDH_LEN..];
        let need = |n: usize| {
            if body.len() == n {
                Ok(())
            } else {
                Err(WireError::BadLength { claimed: len, actual: BSDH_LEN + n })
            }
        };
        let msg = match id {
            mid::DATA => Message::Data(body),
            mid::SRC_AVAIL | mid::SINK_AVAIL => {
                need(16)?;
                let a = Advert::decode(body)?;
                if id == mid::SRC_AVAIL {
                    Message::SrcAvail(a)
                } else {
                    Message::SinkAvail(a)
                }
            }
            mid::LOCK_TABLE => {
                need(16)?;
                let a = Advert::decode(body)?;
                if !a.len.is_multiple_of(8) || !a.addr.is_multiple_of(8) {
                    return Err(WireError::BadField { field: "lock table (8-byte words)", value: a.len as u64 });
                }
                Message::LockTable(a)
            }
            mid::SRC_AVAIL_UPDATE => {
                need(24)?;
                let index = u64::from_be_bytes(body[0..8].try_into().expect("8 bytes"));
                Message::SrcAvailUpdate { index, advert: Advert::decode(&body[8..])? }
            }
            mid::RDMA_RD_COMPL => {
                need(4)?;
                Message::RdmaRdCompl { len: u32::from_be_bytes(body[0..4].try_into().expect("4 bytes")) }
            }
            mid::MODE_CHANGE => {
                need(4)?;
                if body[1..4] != [0, 0, 0] {
                    return Err(WireError::BadField { field: "reserved bytes of ModeChange", value: body[3] as u64 });
                }
                let d =
                    Design::from_code(body[0]).ok_or(WireError::BadField { field: "mode", value: body[0] as u64 })?;
                Message::ModeChange(d)
            }
            mid::SRC_AVAIL_CANCEL | mid::DISCONNECT | mid::CLOSE | mid::ABORT => {
                need(0)?;
                match id {
                    mid::SRC_AVAIL_CANCEL => Message::SrcAvailCancel,
                    mid::DISCONNECT => Message::Disconnect,
                    mid::CLOSE => Message::Close,
                    _ => Message::Abort,
                }
            }
            other => return Err(WireError::UnknownId(other)),
        };
        Ok((h, msg))
    }
}

/// Sequence numbers of one connection end: stamps outgoing headers and checks that incoming
/// ones arrive in order (a gap or repeat means a broken or malicious peer).
#[derive(Debug, Default, Clone)]
pub struct Sequencer {
    next_out: u32,
    last_in: u32,
}

impl Sequencer {
    /// The header of the next outgoing message.
    pub fn stamp(&mut self, flags: u8, bufs: u16) -> Bsdh {
        self.next_out = self.next_out.wrapping_add(1);
        Bsdh { flags, bufs, mseq: self.next_out, mseq_ack: self.last_in }
    }

    /// Takes back the last stamp (its message was not sent after all).
    pub fn unstamp(&mut self) {
        self.next_out = self.next_out.wrapping_sub(1);
    }

    /// Checks an incoming header: its `mseq` must follow the previous one, and its `mseq_ack`
    /// may not acknowledge messages we never sent.
    pub fn accept(&mut self, h: &Bsdh) -> Result<(), WireError> {
        self.check(h)?;
        self.last_in = h.mseq;
        Ok(())
    }

    /// Whether [`Sequencer::accept`] would take `h`, without taking it.
    pub fn check(&self, h: &Bsdh) -> Result<(), WireError> {
        if h.mseq != self.last_in.wrapping_add(1) {
            return Err(WireError::OutOfOrder { got: h.mseq, expected: self.last_in.wrapping_add(1) });
        }
        if self.next_out.wrapping_sub(h.mseq_ack) > (1 << 31) {
            return Err(WireError::BadField { field: "mseq_ack (ahead of what was sent)", value: h.mseq_ack as u64 });
        }
        Ok(())
    }

    /// The last incoming sequence number accepted.
    pub fn last_in(&self) -> u32 {
        self.last_in
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_design() -> impl Strategy<Value = Design> {
        prop_oneof![Just(Design::Bsdp), Just(Design::Zsdp), Just(Design::AzSdp)]
    }

    fn arb_advert() -> impl Strategy<Value = Advert> {
        (1u32.., any::<u32>(), 0u64..(1 << 48)).prop_map(|(len, rkey, addr)| Advert { len, rkey, addr })
    }

    #[derive(Debug, Clone)]
    enum Owned {
        Data(Vec<u8>),
        Src(Advert),
        Sink(Advert),
        Compl(u32),
        Cancel,
        Mode(Design),
        Locks(Advert),
        Update(u64, Advert),
        Disc,
        Close,
        Abort,
    }

    impl Owned {
        fn msg(&self) -> Message<'_> {
            match self {
                Owned::Data(d) => Message::Data(d),
                Owned::Src(a) => Message::SrcAvail(*a),
                Owned::Sink(a) => Message::SinkAvail(*a),
                Owned::Compl(l) => Message::RdmaRdCompl { len: *l },
                Owned::Cancel => Message::SrcAvailCancel,
                Owned::Mode(d) => Message::ModeChange(*d),
                Owned::Locks(a) => Message::LockTable(*a),
                Owned::Update(index, advert) => Message::SrcAvailUpdate { index: *index, advert: *advert },
                Owned::Disc => Message::Disconnect,
                Owned::Close => Message::Close,
                Owned::Abort => Message::Abort,
            }
        }
    }

    fn arb_msg() -> impl Strategy<Value = Owned> {
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..300).prop_map(Owned::Data),
            arb_advert().prop_map(Owned::Src),
            arb_advert().prop_map(Owned::Sink),
            any::<u32>().prop_map(Owned::Compl),
            Just(Owned::Cancel),
            arb_design().prop_map(Owned::Mode),
            (1u32..1 << 20, any::<u32>(), 0u64..(1 << 45)).prop_map(|(n, rkey, w)| Owned::Locks(Advert {
                len: 8 * n,
                rkey,
                addr: 8 * w
            })),
            (any::<u64>(), arb_advert()).prop_map(|(i, a)| Owned::Update(i, a)),
            Just(Owned::Disc),
            Just(Owned::Close),
            Just(Owned::Abort),
        ]
    }

    proptest! {
        #[test]
        fn messages_round_trip(m in arb_msg(), flags in any::<u8>(), bufs in any::<u16>(),
                               mseq in any::<u32>(), ack in any::<u32>()) {
            let h = Bsdh { flags, bufs, mseq, mseq_ack: ack };
            let mut out = Vec::new();
            m.msg().encode(&h, &mut out);
            prop_assert_eq!(out.len(), m.msg().encoded_len());
            let (h2, m2) = Message::decode(&out).unwrap();
            prop_assert_eq!(h2, h);
            prop_assert_eq!(m2, m.msg());
        }

        #[test]
        fn every_truncation_or_extension_is_an_error(m in arb_msg(), cut in 0usize..400, extra in 1usize..8) {
            let mut out = Vec::new();
            m.msg().encode(&Bsdh::default(), &mut out);
            let cut = cut % out.len();
            prop_assert!(Message::decode(&out[..cut]).is_err());
            out.extend(std::iter::repeat_n(0u8, extra));
            prop_assert!(Message::decode(&out).is_err());
        }

        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = Message::decode(&bytes);
        }
    }

    #[test]
    fn bad_fields_are_rejected() {
        let mut out = Vec::new();
        Message::SrcAvail(Advert { len: 0, rkey: 1, addr: 2 }).encode(&Bsdh::default(), &mut out);
        assert!(matches!(Message::decode(&out), Err(WireError::BadField { .. })));
        out.clear();
        Message::SrcAvail(Advert { len: 10, rkey: 1, addr: u64::MAX - 3 }).encode(&Bsdh::default(), &mut out);
        assert!(matches!(Message::decode(&out), Err(WireError::BadField { .. })));
        out.clear();
        Message::ModeChange(Design::Zsdp).encode(&Bsdh::default(), &mut out);
        out[BSDH_LEN + 2] = 1;
        assert!(matches!(Message::decode(&out), Err(WireError::BadField { .. })), "one encoding per message");
        out[BSDH_LEN + 2] = 0;
        out[BSDH_LEN] = 9;
        assert!(matches!(Message::decode(&out), Err(WireError::BadField { .. })));
        out[0] = 0x55;
        assert_eq!(Message::decode(&out), Err(WireError::UnknownId(0x55)));
        out.clear();
        Message::LockTable(Advert { len: 12, rkey: 1, addr: 8 }).encode(&Bsdh::default(), &mut out);
        assert!(matches!(Message::decode(&out), Err(WireError::BadField { .. })), "lock words are 8 bytes");
        out.clear();
        Message::SrcAvailUpdate { index: 3, advert: Advert { len: 0, rkey: 1, addr: 8 } }
            .encode(&Bsdh::default(), &mut out);
        assert!(matches!(Message::decode(&out), Err(WireError::BadField { .. })));
    }

    #[test]
    fn sequencer_accepts_order_and_rejects_gaps_and_bogus_acks() {
        let (mut a, mut b) = (Sequencer::default(), Sequencer::default());
        for _ in 0..3 {
            let h = a.stamp(0, 0);
            b.accept(&h).unwrap();
        }
        let h = b.stamp(0, 0);
        assert_eq!(h.mseq_ack, 3);
        a.accept(&h).unwrap();
        let _lost = a.stamp(0, 0);
        let h = a.stamp(0, 0);
        assert!(b.accept(&h).is_err(), "a gap is an error");
        let mut c = Sequencer::default();
        let bogus = Bsdh { mseq: 1, mseq_ack: 50, ..Bsdh::default() };
        assert!(c.accept(&bogus).is_err(), "acknowledging unsent messages is an error");
    }
}
