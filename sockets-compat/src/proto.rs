//! The protocol state of one SDP connection as plain data (sans-IO): the stream content
//! received and not read yet, our SrcAvails awaiting an answer, the sequence numbers, what the
//! peer announced (its design, its copy-on-write lock table), and the rules every incoming
//! message is checked against.
//!
//! [`crate::stream`] drives it: it hands every message the pipe delivers to
//! [`Proto::on_message`] (bulk-lane bytes to [`Proto::on_bulk`]) and does what the returned
//! [`Event`] asks: release a buffer the peer has read, answer a SrcAvail the peer withdrew.
//! Nothing here touches the pipe, memory protection or the clock, so the rules are tested with
//! two `Proto`s handing each other bytes in memory. What a SrcAvail of ours keeps alive until
//! its answer (a registration, a protected buffer) is the driver's `S`, carried untouched.
//!
//! A message breaking a rule is a [`ProtoError`]; the driver fails the connection on it, and
//! no state changes on an error (a SrcAvail whose answer is refused stays queued, so the driver
//! stops the transport before it lets the buffer go).

use std::collections::VecDeque;

use portability_verbs::copy::copy_slice;
use thiserror::Error;

use crate::wire::{Advert, Bsdh, Design, Message, Sequencer, WireError};

/// How a peer broke the protocol.
#[derive(Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProtoError {
    /// The message does not decode, or is out of sequence.
    #[error("malformed SDP message: {0}")]
    Wire(#[from] WireError),
    /// Data, a SrcAvail or an update after the peer's Disconnect.
    #[error("stream content after Disconnect")]
    AfterDisconnect,
    /// SinkAvail (the write-based zero-copy of the specification, not used here).
    #[error("SinkAvail is not used by this implementation")]
    SinkAvail,
    /// RdmaRdCompl while no SrcAvail of ours is outstanding.
    #[error("RdmaRdCompl with no SrcAvail outstanding")]
    NothingToAnswer,
    /// RdmaRdCompl for more bytes than the SrcAvail had, or for fewer of one we did not cancel.
    #[error("RdmaRdCompl for {read} bytes of a {len}-byte SrcAvail{}", if *.cancelled { "" } else { " not cancelled" })]
    BadAnswer {
        /// Bytes the peer says it read.
        read: u32,
        /// Bytes advertised.
        len: u32,
        /// Whether we had asked the peer to withdraw it (then fewer bytes are fine).
        cancelled: bool,
    },
    /// SrcAvailUpdate for a SrcAvail that is not waiting to be read, or with another length.
    #[error("SrcAvailUpdate for SrcAvail {0}, which it does not own or is not there")]
    BadUpdate(u64),
}

/// Received stream content, in arrival order.
#[derive(Debug, PartialEq, Eq)]
pub enum RxItem {
    /// Stream bytes and how many of them were read already.
    Bytes(Vec<u8>, usize),
    /// A peer buffer to RDMA-read.
    Src(SrcItem),
}

/// A SrcAvail of the peer's, queued as stream content.
#[derive(Debug, PartialEq, Eq)]
pub struct SrcItem {
    /// Where its bytes are.
    pub advert: Advert,
    /// Bytes read already.
    pub done: u32,
    /// Its number on the connection (from 0), which names its copy-on-write lock word.
    pub index: u64,
    /// We may read it: we took its lock word, or the peer moved it to a copy (SrcAvailUpdate).
    pub claimed: bool,
}

/// A SrcAvail of ours the peer has not answered yet.
#[derive(Debug)]
pub struct Outbound<S> {
    /// Bytes advertised.
    pub len: u32,
    /// Its number on the connection (from 0).
    pub index: u64,
    /// We asked the peer to withdraw it (SrcAvailCancel): its answer may cover fewer bytes.
    pub cancelled: bool,
    /// What the driver keeps alive until the answer.
    pub what: S,
}

/// What an incoming message asks of the driver.
#[derive(Debug)]
pub enum Event<S> {
    /// Nothing: stream content was queued, or the peer's announcements noted.
    None,
    /// The peer answered our oldest SrcAvail, having read `read` bytes of it (all of them
    /// unless we cancelled it): its buffer is ours again.
    Answered {
        /// The SrcAvail, off the queue.
        sent: Outbound<S>,
        /// Bytes the peer read.
        read: u32,
    },
    /// The peer withdrew its oldest SrcAvail not read to the end (now off the queue), `done`
    /// bytes in: once the reads started on it have landed, answer RdmaRdCompl with `done`.
    Withdrawn {
        /// Bytes read of it before.
        done: u32,
    },
    /// The peer dropped the connection.
    Aborted,
}

/// One connection's protocol state.
#[derive(Debug)]
pub struct Proto<S> {
    seq: Sequencer,
    rx: VecDeque<RxItem>,
    /// The peer sent Disconnect or Close (after everything in `rx`).
    eof: bool,
    /// The peer sent Close: it reads nothing more.
    peer_closed: bool,
    sends: VecDeque<Outbound<S>>,
    /// SrcAvails sent and received so far: the next ones' numbers.
    srcs_sent: u64,
    srcs_seen: u64,
    peer_design: Design,
    peer_locks: Option<Advert>,
    /// SrcAvails we may have outstanding: a peer lock table with fewer words is not used (two
    /// of them would share a word).
    max_outstanding: usize,
}

impl<S> Proto<S> {
    /// A new connection's state; we may have up to `max_outstanding` SrcAvails outstanding.
    pub fn new(max_outstanding: usize) -> Proto<S> {
        Proto {
            seq: Sequencer::default(),
            rx: VecDeque::new(),
            eof: false,
            peer_closed: false,
            sends: VecDeque::new(),
            srcs_sent: 0,
            srcs_seen: 0,
            peer_design: Design::Bsdp,
            peer_locks: None,
            max_outstanding,
        }
    }

    // ------------------------------------------------------------------ sending

    /// Stamps `m` with the next sequence number and encodes it into `out` (cleared first).
    pub fn encode(&mut self, m: &Message<'_>, out: &mut Vec<u8>) {
        let h = self.seq.stamp(0, 0);
        out.clear();
        m.encode(&h, out);
    }

    /// Takes back the last [`Proto::encode`]: flow control did not admit the message.
    pub fn unsend(&mut self) {
        self.seq.unstamp();
    }

    /// Notes that a SrcAvail of `len` bytes just went out, keeping `what` until its answer;
    /// returns its number on the connection.
    pub fn advertised(&mut self, len: u32, what: S) -> u64 {
        let index = self.srcs_sent;
        self.sends.push_back(Outbound { len, index, cancelled: false, what });
        self.srcs_sent += 1;
        index
    }

    /// Notes that we ask the peer to withdraw our oldest SrcAvail (call it before the
    /// SrcAvailCancel goes out: its answer may come at once).
    pub fn cancel_oldest(&mut self) {
        if let Some(o) = self.sends.front_mut() {
            o.cancelled = true;
        }
    }

    /// Our SrcAvails not answered yet, oldest first.
    pub fn sends(&self) -> &VecDeque<Outbound<S>> {
        &self.sends
    }

    /// The same, for the driver to change what it keeps for them (a copy-on-write copy).
    pub fn sends_mut(&mut self) -> impl Iterator<Item = &mut Outbound<S>> {
        self.sends.iter_mut()
    }

    /// Our SrcAvail at position `i` of [`Proto::sends`].
    pub fn send_mut(&mut self, i: usize) -> Option<&mut Outbound<S>> {
        self.sends.get_mut(i)
    }

    /// Forgets every SrcAvail of ours (the connection is down: nothing will answer them).
    pub fn drop_sends(&mut self) {
        self.sends.clear();
    }

    // ------------------------------------------------------------------ receiving

    /// Takes one message from the peer: checks it, queues its stream content, notes what it
    /// announces, and says what the driver must do.
    pub fn on_message(&mut self, bytes: &[u8]) -> Result<Event<S>, ProtoError> {
        let (h, m) = Message::decode(bytes)?;
        self.seq.check(&h)?;
        // After Disconnect the peer only answers and announces; after Close, it only answers.
        let allowed_after = match m {
            Message::RdmaRdCompl { .. } | Message::Abort => true,
            Message::ModeChange(_) | Message::LockTable(_) | Message::Close => !self.peer_closed,
            _ => false,
        };
        if self.eof && !allowed_after {
            return Err(ProtoError::AfterDisconnect);
        }
        let event = match m {
            Message::Data([]) => Event::None,
            Message::Data(d) => {
                self.rx.push_back(RxItem::Bytes(d.to_vec(), 0));
                Event::None
            }
            Message::SrcAvail(advert) => {
                self.rx.push_back(RxItem::Src(SrcItem { advert, done: 0, index: self.srcs_seen, claimed: false }));
                self.srcs_seen += 1;
                Event::None
            }
            Message::SinkAvail(_) => return Err(ProtoError::SinkAvail),
            Message::RdmaRdCompl { len: read } => {
                let o = self.sends.front().ok_or(ProtoError::NothingToAnswer)?;
                if read > o.len || (read < o.len && !o.cancelled) {
                    return Err(ProtoError::BadAnswer { read, len: o.len, cancelled: o.cancelled });
                }
                Event::Answered { sent: self.sends.pop_front().expect("checked above"), read }
            }
            Message::SrcAvailCancel => {
                // The oldest advertisement not fully read; none if it crossed our RdmaRdCompl,
                // which answered it already.
                match self.rx.iter().position(|r| matches!(r, RxItem::Src(..))) {
                    Some(i) => match self.rx.remove(i) {
                        Some(RxItem::Src(src)) => Event::Withdrawn { done: src.done },
                        _ => unreachable!("position found a SrcAvail"),
                    },
                    None => Event::None,
                }
            }
            Message::ModeChange(d) => {
                self.peer_design = d;
                Event::None
            }
            Message::LockTable(table) => {
                // Usable only if no two of our outstanding SrcAvails can share a word.
                if table.len as usize / 8 >= self.max_outstanding {
                    self.peer_locks = Some(table);
                } else {
                    log::debug!("SDP: the peer's lock table is too small for copy-on-write");
                }
                Event::None
            }
            Message::SrcAvailUpdate { index, advert } => {
                let src = self.rx.iter_mut().find_map(|r| match r {
                    RxItem::Src(s) if s.index == index => Some(s),
                    _ => None,
                });
                match src {
                    Some(s) if !s.claimed && s.advert.len == advert.len => {
                        s.advert = advert;
                        s.claimed = true;
                    }
                    _ => return Err(ProtoError::BadUpdate(index)),
                }
                Event::None
            }
            Message::Disconnect => {
                self.eof = true;
                Event::None
            }
            Message::Close => {
                self.eof = true;
                self.peer_closed = true;
                Event::None
            }
            Message::Abort => Event::Aborted,
        };
        self.seq.accept(&h).expect("checked above");
        Ok(event)
    }

    /// Takes bulk-lane bytes the reader left, as stream content.
    pub fn on_bulk(&mut self, bytes: &[u8]) -> Result<(), ProtoError> {
        if self.eof {
            return Err(ProtoError::AfterDisconnect);
        }
        if !bytes.is_empty() {
            self.rx.push_back(RxItem::Bytes(bytes.to_vec(), 0));
        }
        Ok(())
    }

    /// The bytes of `message` if it is the peer's next message and Data, checked but not taken
    /// (for a reader that copies them straight out of the pipe): `None` for anything else,
    /// which [`Proto::on_message`] takes (and fails on, if it is malformed).
    pub fn next_data<'a>(&self, message: &'a [u8]) -> Option<(Bsdh, &'a [u8])> {
        match Message::decode(message) {
            Ok((h, Message::Data(d))) if !self.eof && self.seq.check(&h).is_ok() => Some((h, d)),
            _ => None,
        }
    }

    /// Takes the Data message whose header [`Proto::next_data`] returned: its bytes were read.
    pub fn took_data(&mut self, h: &Bsdh) {
        self.seq.accept(h).expect("checked by next_data");
    }

    /// Whether the peer sent Disconnect (or Close).
    pub fn eof(&self) -> bool {
        self.eof
    }

    /// Whether the peer sent Close: it reads nothing more, so what we send is lost and the
    /// SrcAvails of ours it has not started reading will not be answered.
    pub fn peer_closed(&self) -> bool {
        self.peer_closed
    }

    /// The design the peer last announced (BSDP until it announces one).
    pub fn peer_design(&self) -> Design {
        self.peer_design
    }

    /// The peer's lock table, if it announced one we can use.
    pub fn peer_locks(&self) -> Option<Advert> {
        self.peer_locks
    }

    /// Received stream content not read yet.
    pub fn rx(&self) -> &VecDeque<RxItem> {
        &self.rx
    }

    /// The first item of received stream content.
    pub fn rx_front_mut(&mut self) -> Option<&mut RxItem> {
        self.rx.front_mut()
    }

    /// Copies queued stream bytes into `buf`, across items, as a TCP read does; stops at a
    /// SrcAvail, or before bytes `blocked(dst)` says cannot be copied into now (a held buffer).
    /// `None` if the very first copy is blocked, else the bytes copied.
    pub fn read_queued(&mut self, buf: &mut [u8], blocked: impl Fn(&[u8]) -> bool) -> Option<usize> {
        let mut n = 0;
        while let Some(RxItem::Bytes(v, off)) = self.rx.front_mut() {
            let k = (buf.len() - n).min(v.len() - *off);
            if k == 0 {
                break;
            }
            if blocked(&buf[n..n + k]) {
                return (n > 0).then_some(n);
            }
            copy_slice(&mut buf[n..n + k], &v[*off..*off + k]);
            *off += k;
            n += k;
            if *off == v.len() {
                self.rx.pop_front();
            }
        }
        Some(n)
    }

    /// Copies queued stream bytes into `buf` as [`Proto::read_queued`] does, leaving them
    /// queued (a peek); stops at a SrcAvail.
    pub fn peek_queued(&self, buf: &mut [u8]) -> usize {
        let mut n = 0;
        for item in &self.rx {
            let RxItem::Bytes(v, off) = item else { break };
            let k = (buf.len() - n).min(v.len() - off);
            copy_slice(&mut buf[n..n + k], &v[*off..*off + k]);
            n += k;
            if n == buf.len() {
                break;
            }
        }
        n
    }

    /// Notes that the SrcAvail at the front has been read up to `end`; drops it once read to
    /// its end.
    pub fn consume_front_src(&mut self, end: u32) {
        if let Some(RxItem::Src(src)) = self.rx.front_mut() {
            src.done = end;
            if end == src.advert.len {
                self.rx.pop_front();
            }
        }
    }

    /// Puts bytes read aside ahead of the rest of the stream content.
    pub fn push_front_bytes(&mut self, bytes: Vec<u8>) {
        self.rx.push_front(RxItem::Bytes(bytes, 0));
    }
}

/// AZ-SDP copy-on-write's lock words, one per SrcAvail in the receiver's table (the word of
/// SrcAvail `n` at `n % words`): the receiver takes a SrcAvail's word before it reads it, the
/// sender by compare-and-swap before it copies the buffer aside; whoever takes it first wins.
/// A word only ever moves to a later SrcAvail's value, so a word last taken for an earlier
/// SrcAvail is free for this one.
pub mod lock {
    /// Who took a lock word.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Taker {
        /// The receiver, reading the SrcAvail.
        Receiver = 0,
        /// The sender, copying its buffer aside.
        Sender = 1,
    }

    /// The value of a lock word taken for SrcAvail `index` by `who`.
    pub fn word(index: u64, who: Taker) -> u64 {
        (index + 1) << 1 | who as u64
    }

    /// The SrcAvail number a lock word was last taken for (`None`: never).
    pub fn index_of(word: u64) -> Option<u64> {
        (word >> 1).checked_sub(1)
    }

    fn free_for(old: u64, index: u64) -> bool {
        index_of(old).is_none_or(|i| i < index)
    }

    /// The receiver's atomic update of SrcAvail `index`'s word holding `old`: taken if free.
    pub fn receiver_take(old: u64, index: u64) -> u64 {
        if free_for(old, index) {
            word(index, Taker::Receiver)
        } else {
            old
        }
    }

    /// What the receiver's update found.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum ReceiverClaim {
        /// The word was free: read the SrcAvail.
        Won,
        /// The sender took it: its SrcAvailUpdate (a copy) is coming.
        Moved,
        /// A value no honest sender writes.
        Corrupt,
    }

    /// Judges the receiver's update of SrcAvail `index`'s word, which held `old`.
    pub fn receiver_claim(old: u64, index: u64) -> ReceiverClaim {
        if free_for(old, index) {
            ReceiverClaim::Won
        } else if old == word(index, Taker::Sender) {
            ReceiverClaim::Moved
        } else {
            ReceiverClaim::Corrupt
        }
    }

    /// The sender's guess of what SrcAvail `index`'s word holds in a table of `words` words:
    /// most likely the SrcAvail a table's length before, read by the peer.
    pub fn sender_guess(index: u64, words: u64) -> u64 {
        if index >= words {
            word(index - words, Taker::Receiver)
        } else {
            0
        }
    }

    /// What the sender's compare-and-swap (expecting `expected`, finding `old`) means.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum SenderClaim {
        /// We took the word: copy the buffer aside.
        Won,
        /// The receiver took it: it is reading, the store waits for its answer.
        Reading,
        /// The word held an older SrcAvail's value than guessed: try again expecting `old`.
        Retry(u64),
    }

    /// Judges the sender's compare-and-swap on SrcAvail `index`'s word.
    pub fn sender_claim(old: u64, expected: u64, index: u64) -> SenderClaim {
        if old == expected {
            SenderClaim::Won
        } else if free_for(old, index) {
            SenderClaim::Retry(old)
        } else {
            SenderClaim::Reading
        }
    }
}

#[cfg(test)]
mod tests {
    use super::lock::{self, ReceiverClaim, SenderClaim, Taker};
    use super::*;
    use proptest::collection::vec;
    use proptest::prelude::*;

    /// Two connection ends; `send` encodes at one and delivers at the other.
    struct Pair {
        a: Proto<&'static str>,
        b: Proto<&'static str>,
    }

    impl Pair {
        fn new() -> Pair {
            Pair { a: Proto::new(16), b: Proto::new(16) }
        }

        fn a_to_b(&mut self, m: Message<'_>) -> Result<Event<&'static str>, ProtoError> {
            let mut out = Vec::new();
            self.a.encode(&m, &mut out);
            self.b.on_message(&out)
        }

        fn b_to_a(&mut self, m: Message<'_>) -> Result<Event<&'static str>, ProtoError> {
            let mut out = Vec::new();
            self.b.encode(&m, &mut out);
            self.a.on_message(&out)
        }
    }

    fn advert(len: u32) -> Advert {
        Advert { len, rkey: 7, addr: 0x10000 }
    }

    fn read_all(p: &mut Proto<&'static str>) -> Vec<u8> {
        let mut buf = vec![0u8; 1 << 16];
        let n = p.read_queued(&mut buf, |_| false).expect("nothing blocked");
        buf.truncate(n);
        buf
    }

    #[test]
    fn data_is_queued_in_order_and_read_across_messages() {
        let mut p = Pair::new();
        assert!(matches!(p.a_to_b(Message::Data(b"hello ")), Ok(Event::None)));
        assert!(matches!(p.a_to_b(Message::Data(b"")), Ok(Event::None)), "a pure credit update");
        assert!(matches!(p.a_to_b(Message::Data(b"world")), Ok(Event::None)));
        let mut buf = [0u8; 8];
        assert_eq!(p.b.read_queued(&mut buf, |_| false), Some(8));
        assert_eq!(&buf, b"hello wo");
        assert_eq!(read_all(&mut p.b), b"rld");
        assert!(p.b.rx().is_empty());
    }

    #[test]
    fn a_peek_copies_across_messages_and_leaves_the_bytes_queued() {
        let mut p = Pair::new();
        p.a_to_b(Message::Data(b"abc")).unwrap();
        let mut one = [0u8; 1];
        p.b.read_queued(&mut one, |_| false);
        p.a_to_b(Message::Data(b"defg")).unwrap();
        p.a_to_b(Message::SrcAvail(advert(64))).unwrap();
        let mut buf = [0u8; 5];
        assert_eq!(p.b.peek_queued(&mut buf), 5);
        assert_eq!(&buf, b"bcdef");
        let mut big = [0u8; 32];
        assert_eq!(p.b.peek_queued(&mut big), 6, "up to the SrcAvail");
        assert_eq!(&big[..6], b"bcdefg");
        assert_eq!(read_all(&mut p.b), b"bcdefg");
        assert_eq!(p.b.peek_queued(&mut big), 0, "a SrcAvail in front");
    }

    #[test]
    fn a_blocked_destination_stops_the_copy_and_is_reported_only_first() {
        let mut p = Pair::new();
        p.a_to_b(Message::Data(b"abcd")).unwrap();
        p.a_to_b(Message::Data(b"efgh")).unwrap();
        let mut buf = [0u8; 8];
        assert_eq!(p.b.read_queued(&mut buf, |_| true), None);
        // The second message's destination is blocked: the first one's bytes are returned.
        let base = buf.as_ptr() as usize;
        assert_eq!(p.b.read_queued(&mut buf, |d| d.as_ptr() as usize != base), Some(4));
        assert_eq!(&buf[..4], b"abcd");
        assert_eq!(read_all(&mut p.b), b"efgh");
    }

    #[test]
    fn messages_out_of_sequence_are_refused_without_changing_state() {
        let mut p = Pair::new();
        let mut first = Vec::new();
        p.a.encode(&Message::Data(b"1"), &mut first);
        let mut second = Vec::new();
        p.a.encode(&Message::Data(b"2"), &mut second);
        assert!(matches!(p.b.on_message(&second), Err(ProtoError::Wire(WireError::OutOfOrder { .. }))));
        assert!(p.b.rx().is_empty());
        p.b.on_message(&first).unwrap();
        p.b.on_message(&second).unwrap();
        assert!(matches!(p.b.on_message(&second), Err(ProtoError::Wire(WireError::OutOfOrder { .. }))), "a replay");
        assert_eq!(read_all(&mut p.b), b"12");
    }

    #[test]
    fn an_unsent_message_gives_its_sequence_number_back() {
        let mut p = Pair::new();
        let mut out = Vec::new();
        p.a.encode(&Message::Data(b"refused"), &mut out);
        p.a.unsend();
        p.a_to_b(Message::Data(b"sent")).unwrap();
        assert_eq!(read_all(&mut p.b), b"sent");
    }

    #[test]
    fn nothing_but_control_follows_disconnect() {
        let mut p = Pair::new();
        p.a_to_b(Message::Data(b"last")).unwrap();
        p.a_to_b(Message::Disconnect).unwrap();
        assert!(p.b.eof());
        assert_eq!(p.a_to_b(Message::Data(b"more")).unwrap_err(), ProtoError::AfterDisconnect);
        let mut p = Pair::new();
        p.a_to_b(Message::Disconnect).unwrap();
        assert_eq!(p.a_to_b(Message::SrcAvail(advert(4096))).unwrap_err(), ProtoError::AfterDisconnect);
        assert_eq!(p.b.on_bulk(b"bulk").unwrap_err(), ProtoError::AfterDisconnect);
        let mut p = Pair::new();
        p.a_to_b(Message::Disconnect).unwrap();
        assert!(matches!(p.a_to_b(Message::ModeChange(Design::Zsdp)), Ok(Event::None)));
        assert!(matches!(p.a_to_b(Message::LockTable(advert(2048))), Ok(Event::None)));
        assert!(matches!(p.a_to_b(Message::Abort), Ok(Event::Aborted)));
        assert_eq!(read_all(&mut p.b), b"");
    }

    #[test]
    fn close_is_end_of_stream_and_only_answers_follow_it() {
        // Close on its own: the bytes before it are read, then end of stream.
        let mut p = Pair::new();
        p.a_to_b(Message::Data(b"last")).unwrap();
        assert!(!p.b.peer_closed());
        p.a_to_b(Message::Close).unwrap();
        assert!(p.b.eof() && p.b.peer_closed());
        assert_eq!(read_all(&mut p.b), b"last");
        // (Each refused message's sequence number is taken back, as the driver's would be.)
        for refused in [Message::Data(b"more"), Message::ModeChange(Design::Zsdp), Message::Close] {
            assert_eq!(p.a_to_b(refused).unwrap_err(), ProtoError::AfterDisconnect, "{refused:?}");
            p.a.unsend();
        }
        // A read the closer started before it closed is still answered.
        let mut p = Pair::new();
        p.b_to_a(Message::SrcAvail(advert(4096))).unwrap();
        p.b.advertised(4096, "buffer");
        p.a_to_b(Message::Close).unwrap();
        assert!(matches!(p.a_to_b(Message::RdmaRdCompl { len: 4096 }), Ok(Event::Answered { read: 4096, .. })));
        // Close after a shutdown of the writing side.
        let mut p = Pair::new();
        p.a_to_b(Message::Disconnect).unwrap();
        assert!(p.b.eof() && !p.b.peer_closed());
        p.a_to_b(Message::Close).unwrap();
        assert!(p.b.peer_closed());
        assert!(matches!(p.a_to_b(Message::Abort), Ok(Event::Aborted)));
    }

    #[test]
    fn an_answer_releases_the_oldest_srcavail_and_must_cover_it_unless_cancelled() {
        let mut p = Pair::new();
        assert_eq!(p.b_to_a(Message::RdmaRdCompl { len: 1 }).unwrap_err(), ProtoError::NothingToAnswer);
        let mut p = Pair::new();
        for (len, what) in [(4096, "first"), (8192, "second")] {
            p.a_to_b(Message::SrcAvail(advert(len))).unwrap();
            assert_eq!(p.a.advertised(len, what), if what == "first" { 0 } else { 1 });
        }
        // Too few bytes of an uncancelled one, or more than advertised: refused, still queued.
        let e = p.b_to_a(Message::RdmaRdCompl { len: 100 }).unwrap_err();
        assert_eq!(e, ProtoError::BadAnswer { read: 100, len: 4096, cancelled: false });
        assert_eq!(p.a.sends().len(), 2);
        let mut p2 = Pair::new();
        p2.a.advertised(4096, "x");
        let e = p2.b_to_a(Message::RdmaRdCompl { len: 4097 }).unwrap_err();
        assert_eq!(e, ProtoError::BadAnswer { read: 4097, len: 4096, cancelled: false });
        let mut p = Pair::new();
        p.a.advertised(4096, "first");
        p.a.advertised(8192, "second");
        match p.b_to_a(Message::RdmaRdCompl { len: 4096 }) {
            Ok(Event::Answered { sent, read: 4096 }) => assert_eq!((sent.what, sent.index), ("first", 0)),
            other => panic!("{other:?}"),
        }
        p.a.cancel_oldest();
        match p.b_to_a(Message::RdmaRdCompl { len: 0 }) {
            Ok(Event::Answered { sent, read: 0 }) => assert!(sent.cancelled && sent.what == "second"),
            other => panic!("{other:?}"),
        }
        assert!(p.a.sends().is_empty());
    }

    #[test]
    fn a_cancel_withdraws_the_oldest_unread_srcavail_or_crosses_the_answer() {
        let mut p = Pair::new();
        p.a_to_b(Message::Data(b"ab")).unwrap();
        p.a_to_b(Message::SrcAvail(advert(8192))).unwrap();
        p.a_to_b(Message::SrcAvail(advert(4096))).unwrap();
        p.b.read_queued(&mut [0u8; 2], |_| false);
        p.b.consume_front_src(1000);
        assert!(matches!(p.a_to_b(Message::SrcAvailCancel), Ok(Event::Withdrawn { done: 1000 })));
        match p.b.rx().front() {
            Some(RxItem::Src(s)) => assert_eq!((s.index, s.advert.len), (1, 4096)),
            other => panic!("{other:?}"),
        }
        p.b.consume_front_src(4096);
        assert!(p.b.rx().is_empty(), "read to its end, it is gone");
        assert!(matches!(p.a_to_b(Message::SrcAvailCancel), Ok(Event::None)), "crossed our answer");
    }

    #[test]
    fn an_update_moves_only_an_unclaimed_srcavail_of_the_same_length() {
        let mut p = Pair::new();
        p.a_to_b(Message::SrcAvail(advert(4096))).unwrap();
        p.a_to_b(Message::SrcAvail(advert(8192))).unwrap();
        let moved = Advert { len: 8192, rkey: 9, addr: 0x90000 };
        assert!(matches!(p.a_to_b(Message::SrcAvailUpdate { index: 1, advert: moved }), Ok(Event::None)));
        match &p.b.rx()[1] {
            RxItem::Src(s) => assert!(s.claimed && s.advert == moved),
            other => panic!("{other:?}"),
        }
        // Moved twice, wrong length, unknown number: each a protocol error.
        for (index, len) in [(1, 8192), (0, 100), (5, 4096)] {
            let mut q = Pair::new();
            q.a_to_b(Message::SrcAvail(advert(4096))).unwrap();
            q.a_to_b(Message::SrcAvail(advert(8192))).unwrap();
            q.a_to_b(Message::SrcAvailUpdate { index: 1, advert: moved }).unwrap();
            let e = q.a_to_b(Message::SrcAvailUpdate { index, advert: Advert { len, ..moved } }).unwrap_err();
            assert_eq!(e, ProtoError::BadUpdate(index));
        }
    }

    #[test]
    fn a_lock_table_too_small_for_our_outstanding_srcavails_is_ignored() {
        let mut p = Pair::new();
        p.a_to_b(Message::LockTable(advert(8 * 15))).unwrap();
        assert_eq!(p.b.peer_locks(), None);
        p.a_to_b(Message::LockTable(advert(8 * 16))).unwrap();
        assert_eq!(p.b.peer_locks(), Some(advert(128)));
        p.a_to_b(Message::ModeChange(Design::AzSdp)).unwrap();
        assert_eq!(p.b.peer_design(), Design::AzSdp);
    }

    #[test]
    fn sinkavail_is_refused() {
        let mut p = Pair::new();
        assert_eq!(p.a_to_b(Message::SinkAvail(advert(4096))).unwrap_err(), ProtoError::SinkAvail);
    }

    #[test]
    fn direct_data_is_checked_then_taken() {
        let mut p = Pair::new();
        let mut m = Vec::new();
        p.a.encode(&Message::Data(b"direct"), &mut m);
        let (h, d) = p.b.next_data(&m).expect("the next Data message");
        assert_eq!(d, b"direct");
        assert!(p.b.next_data(&m).is_some(), "checking takes nothing");
        p.b.took_data(&h);
        assert!(p.b.next_data(&m).is_none(), "taken: a second copy is out of sequence");
        let mut ctl = Vec::new();
        p.a.encode(&Message::Disconnect, &mut ctl);
        assert!(p.b.next_data(&ctl).is_none());
    }

    #[test]
    fn lock_words_let_exactly_one_side_win() {
        // Receiver first: the sender's guess fails and learns the peer is reading.
        let (index, words) = (600, 256);
        let mut w = lock::word(index - words, Taker::Receiver);
        let guess = lock::sender_guess(index, words);
        assert_eq!(guess, w);
        let old = w;
        w = lock::receiver_take(w, index);
        assert_eq!(lock::receiver_claim(old, index), ReceiverClaim::Won);
        assert_eq!(lock::sender_claim(w, guess, index), SenderClaim::Reading);
        // Sender first: its compare-and-swap wins, the receiver sees the move.
        let mut w = lock::word(index - words, Taker::Receiver);
        assert_eq!(lock::sender_claim(w, guess, index), SenderClaim::Won);
        w = lock::word(index, Taker::Sender);
        let old = w;
        assert_eq!(lock::receiver_take(w, index), old, "taken: left as it is");
        assert_eq!(lock::receiver_claim(old, index), ReceiverClaim::Moved);
        // A stale guess is retried with what the word held; a word from the future is corrupt.
        let older = lock::word(index - 2 * words, Taker::Receiver);
        assert_eq!(lock::sender_claim(older, guess, index), SenderClaim::Retry(older));
        assert_eq!(lock::sender_claim(0, lock::sender_guess(3, words), 3), SenderClaim::Won);
        assert_eq!(lock::receiver_claim(lock::word(index + 1, Taker::Receiver), index), ReceiverClaim::Corrupt);
        assert_eq!(lock::index_of(0), None);
        assert_eq!(lock::index_of(lock::word(41, Taker::Sender)), Some(41));
    }

    /// A peer's message, owned, with how its sequence number is off (0: right).
    #[derive(Debug, Clone)]
    enum PeerMsg {
        Data(Vec<u8>),
        Src(u32),
        Answer(u32),
        Cancel,
        Update(u64, u32),
        Table(u32),
        Mode,
        Disconnect,
        Close,
        Abort,
        Garbage(Vec<u8>),
    }

    fn arb_peer_msg() -> impl Strategy<Value = (PeerMsg, u8)> {
        let msg = prop_oneof![
            vec(any::<u8>(), 0..40).prop_map(PeerMsg::Data),
            (1u32..10_000).prop_map(PeerMsg::Src),
            prop_oneof![Just(4096u32), Just(100), Just(9999), 0u32..10_000].prop_map(PeerMsg::Answer),
            Just(PeerMsg::Cancel),
            (0u64..8, 1u32..10_000).prop_map(|(i, l)| PeerMsg::Update(i, l)),
            (0u32..512).prop_map(PeerMsg::Table),
            Just(PeerMsg::Mode),
            Just(PeerMsg::Disconnect),
            Just(PeerMsg::Close),
            Just(PeerMsg::Abort),
            vec(any::<u8>(), 0..40).prop_map(PeerMsg::Garbage),
        ];
        // Mostly in sequence, sometimes not.
        (msg, prop_oneof![8 => Just(0u8), 1 => 1u8..3])
    }

    proptest! {
        /// Whatever a peer sends is taken or refused, never a panic; a refused message leaves
        /// the state as it was, and an answer is accepted only for what was advertised.
        #[test]
        fn any_peer_message_is_taken_or_refused_cleanly(msgs in vec(arb_peer_msg(), 0..24)) {
            let mut p: Proto<u32> = Proto::new(16);
            for len in [4096, 100, 9999] {
                p.advertised(len, len);
            }
            let mut mseq = 0u32;
            for (m, off) in msgs {
                mseq += 1;
                let advert = |len| Advert { len, rkey: 1, addr: 0x1000 };
                let bytes = match &m {
                    PeerMsg::Garbage(g) => g.clone(),
                    m => {
                        let msg = match m {
                            PeerMsg::Data(d) => Message::Data(d),
                            PeerMsg::Src(l) => Message::SrcAvail(advert(*l)),
                            PeerMsg::Answer(l) => Message::RdmaRdCompl { len: *l },
                            PeerMsg::Cancel => Message::SrcAvailCancel,
                            PeerMsg::Update(i, l) => Message::SrcAvailUpdate { index: *i, advert: advert(*l) },
                            PeerMsg::Table(l) => Message::LockTable(advert(*l)),
                            PeerMsg::Mode => Message::ModeChange(Design::Zsdp),
                            PeerMsg::Disconnect => Message::Disconnect,
                            PeerMsg::Close => Message::Close,
                            PeerMsg::Abort => Message::Abort,
                            PeerMsg::Garbage(_) => unreachable!(),
                        };
                        let mut out = Vec::new();
                        msg.encode(&Bsdh { mseq: mseq + off as u32, ..Bsdh::default() }, &mut out);
                        out
                    }
                };
                let state = |p: &Proto<u32>| {
                    (p.rx().len(), p.sends().len(), p.eof(), p.peer_closed(), p.sends().front().map(|o| o.what))
                };
                let before = state(&p);
                match p.on_message(&bytes) {
                    Err(_) => {
                        prop_assert_eq!(before, state(&p));
                        mseq -= 1;
                    }
                    Ok(Event::Answered { sent, read }) => {
                        prop_assert_eq!(Some(sent.what), before.4);
                        prop_assert_eq!(read, sent.len, "none of ours was cancelled");
                    }
                    Ok(_) => {}
                }
            }
        }

        /// A stream cut into Data messages and bulk bytes arrives whole and in order, read in
        /// arbitrary pieces.
        #[test]
        fn a_stream_arrives_whole(
            pieces in vec((vec(any::<u8>(), 0..300), any::<bool>()), 0..20),
            reads in vec(1usize..500, 1..50),
        ) {
            let mut p = Pair::new();
            let mut sent = Vec::new();
            for (bytes, bulk) in &pieces {
                sent.extend_from_slice(bytes);
                if *bulk && !bytes.is_empty() {
                    p.b.on_bulk(bytes).unwrap();
                } else {
                    p.a_to_b(Message::Data(bytes)).unwrap();
                }
            }
            let mut got = Vec::new();
            for r in reads.iter().cycle().take(sent.len() + reads.len()) {
                let mut buf = vec![0u8; *r];
                let n = p.b.read_queued(&mut buf, |_| false).unwrap();
                got.extend_from_slice(&buf[..n]);
            }
            prop_assert_eq!(got, sent);
        }
    }
}
