//! One EXS connection's decisions, sans-IO: which advertisement a send's bytes go into, when
//! a receive is advertised, what arrived outside advertisements and which receive it fills,
//! credits, stream-buffer space, close. Plain state and functions: the driver
//! (`exs::conn`) feeds it the application's calls and the queue pair's completions and
//! carries out the [`Action`]s it returns, in order.
//!
//! The transfer is UNH-EXS's: `recv` advertises its buffer (address, length, key) in a
//! control message;
//! `send` matches its bytes against the advertisements in order and RDMA-writes with
//! immediate into them (the immediate gives the length). Besides that:
//! - a message of at most the small size goes in the control message itself when no
//!   advertisement is at hand, and a stream's bytes go into the receiver's stream buffer
//!   (copied once) when it has one; both are *unadvertised deliveries*;
//! - every advertisement carries the count of unadvertised deliveries the receiver had seen;
//!   a sender that made more rejects it (the receiver fills that buffer from what arrived
//!   first), so bytes and messages stay in order whatever crosses on the wire;
//! - a control message packs records: an advertisement rides with the small message after
//!   it, and a
//!   message of at most the small size answers an advertisement at hand inside a record
//!   (a fill) rather than by a write of its own;
//! - every control message and data write takes one of the peer's message credits (what
//!   bounds the unadvertised data a receiver holds for its application), under the credit
//!   accounting of [`Credits`] (grants ride on every record). The driver sends a write's
//!   immediate as a message of its own (a write note) where writes raise none; that note is
//!   the write's, not a control message of its own in this accounting.

use std::collections::VecDeque;

use portability_verbs::datapath::fc::{Credits, RingReceiver, RingSender};
use smallvec::SmallVec;

use super::wire::{self, Advert, Control, Hello, SocketKind, WireError, WriteNote, DATA_OVERHEAD, MAX_WRITE};

/// An error number, as `errno` gives it (`libc::E*`).
pub type Errno = i32;

/// What an operation came to: bytes moved, or an error number.
pub type Outcome = Result<u64, Errno>;

/// Which call an event completes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    /// `send`.
    Send,
    /// `recv`.
    Recv,
    /// `close`.
    Close,
}

/// A completed operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Done {
    /// The caller's request id.
    pub req: u64,
    /// The call.
    pub op: OpKind,
    /// Bytes (a receive's 0 is the end of the peer's data), or the error.
    pub outcome: Outcome,
    /// SOCK_SEQPACKET receive: the message was longer than the buffer; its tail is gone.
    pub truncated: bool,
}

/// Where a copy into a receive buffer comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CopySrc {
    /// Bytes of a small message.
    Bytes(Vec<u8>),
    /// The stream buffer, from this offset.
    Ring(u64),
}

/// Pieces of memory one record gathers at most (a work request's gather list).
const MAX_PIECES: usize = 4;

/// A piece of a send's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Address in the sender's memory.
    pub addr: u64,
    /// Bytes.
    pub len: u32,
    /// Local key of its region.
    pub lkey: u32,
}

/// One record of a control message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// A control record carrying `grant` credits.
    Control(Control<'static>, u16),
    /// A small message made of these pieces of the application's memory (copied into the
    /// message when it is sent), carrying `grant` credits: unadvertised ([`Control::Data`]),
    /// or filling the oldest advertisement ([`Control::Fill`], with its truncation flag).
    Small {
        /// `Some(truncated)`: a fill.
        fill: Option<bool>,
        /// Where the bytes are.
        pieces: SmallVec<[Piece; 1]>,
        /// Credits granted.
        grant: u16,
    },
}

impl Record {
    /// Whether this is our Close (the driver reports the delivery of the message carrying it
    /// with [`Proto::on_close_delivered`]).
    pub fn is_close(&self) -> bool {
        matches!(self, Record::Control(Control::Close, _))
    }

    /// Bytes of the record on the wire.
    pub fn encoded_len(&self) -> usize {
        match self {
            Record::Control(c, _) => c.encoded_len(),
            Record::Small { pieces, .. } => DATA_OVERHEAD + pieces.iter().map(|p| p.len as usize).sum::<usize>(),
        }
    }
}

/// What the driver must do, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send these records in one control message (one of the peer's message credits).
    Send(SmallVec<[Record; 2]>),
    /// RDMA-write a piece of send `send` (an id [`Proto::post_send`] returned), with
    /// immediate when `imm` is set; report its completion with [`Proto::on_write_done`].
    Write {
        /// The send it belongs to.
        send: u64,
        /// Local memory.
        piece: Piece,
        /// Target address.
        remote_addr: u64,
        /// Target key.
        rkey: u32,
        /// Immediate value, for the write that finishes a buffer.
        imm: Option<u32>,
    },
    /// Copy `len` bytes to `dst` (inside a posted receive buffer).
    Copy {
        /// Destination address.
        dst: u64,
        /// Source.
        src: CopySrc,
        /// Bytes.
        len: u64,
    },
    /// Report this completion (after every action before it was carried out).
    Done(Done),
}

/// A ping-pong's reply, handed to the driver by [`Proto::post_lone_send`]: one control
/// message (the short advertisement of the receive posted before it, if any, then the fill),
/// and the send's completion to report once the message is sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoneReply {
    /// The short advertisement and the credits its record grants.
    pub offer: Option<(u16, Advert)>,
    /// Credits the fill's record grants.
    pub grant: u16,
    /// The fill's bytes (none when `len` is 0).
    pub fill: Piece,
    /// The fill's truncation flag.
    pub truncated: bool,
    /// The send's completion.
    pub done: Done,
}

impl LoneReply {
    /// The actions [`Proto::post_send`] would have queued for it: the control message, then
    /// the completion.
    pub fn actions(&self) -> [Action; 2] {
        let mut recs: SmallVec<[Record; 2]> = SmallVec::new();
        if let Some((grant, ad)) = self.offer {
            recs.push(Record::Control(Control::Advertise(ad), grant));
        }
        let pieces = if self.fill.len > 0 { smallvec::smallvec![self.fill] } else { SmallVec::new() };
        recs.push(Record::Small { fill: Some(self.truncated), pieces, grant: self.grant });
        [Action::Send(recs), Action::Done(self.done)]
    }
}

/// What a connection end is set up with.
#[derive(Clone, Copy, Debug)]
pub struct ProtoConfig {
    /// Socket type.
    pub kind: SocketKind,
    /// Control messages we take unread at most (the peer's credits).
    pub msg_credits: u16,
    /// Largest small message we take inside a control message.
    pub small_max: u32,
    /// Bytes of our stream buffer (0: none).
    pub ring_len: u32,
    /// Advertisements outstanding at most.
    pub adv_credits: u32,
    /// The peer's handshake.
    pub peer: Hello,
}

/// A send not yet completed.
#[derive(Debug)]
struct OutSend {
    id: u64,
    req: u64,
    addr: u64,
    len: u64,
    lkey: u32,
    /// Bytes handed to writes or small messages.
    taken: u64,
    /// Writes posted and not yet completed.
    writes: u32,
}

/// A receive not yet completed.
#[derive(Debug)]
struct InRecv {
    req: u64,
    addr: u64,
    len: u64,
    rkey: u32,
    /// The advertisement standing for it, if any.
    ad: Option<u32>,
}

/// An advertisement sent and not yet answered (filled or rejected), in order.
#[derive(Debug)]
struct SentAd {
    seq: u32,
    len: u32,
    /// Unadvertised data arrived after it was made: the sender will reject it.
    doomed: bool,
    /// Its receive was completed otherwise (from unadvertised data, or at close).
    orphan: bool,
}

/// Unadvertised data not yet consumed.
#[derive(Debug)]
enum Early {
    /// A small message, bytes consumed so far, and whether its message's credit is held
    /// until it is consumed (the last small message of its control message holds it).
    Bytes(Vec<u8>, usize, bool),
    /// A stream-buffer chunk: offset, bytes, consumed so far, ring position after it.
    Ring { offset: u64, len: u64, used: u64, end: u64 },
}

/// Why a peer broke the protocol.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProtoError {
    /// A malformed message.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// A message the protocol does not allow now.
    #[error("peer broke the EXS protocol: {0}")]
    Violation(&'static str),
}

/// One end of a connection.
#[derive(Debug)]
pub struct Proto {
    cfg: ProtoConfig,
    credits: Credits,
    small_out: u32,
    /// The largest control message the peer takes.
    peer_message_max: usize,
    // Sending side.
    sends: VecDeque<OutSend>,
    /// Sends at the front of `sends` whose every byte was handed out (a SOCK_SEQPACKET
    /// message once matched, even empty or cut): bytes are matched in order, so the handed
    /// sends are always a prefix.
    handed: usize,
    next_send: u64,
    peer_ads: VecDeque<Advert>,
    next_peer_ad: u32,
    unadvertised_sent: u64,
    ring_out: Option<RingSender>,
    /// Bytes go into the stream buffer only after [`Proto::resume_ring`]: an advertisement
    /// was rejected, so the peer posts receives (see [`Proto::ring_waiting`]).
    ring_waits_for_ad: bool,
    /// Advertisements answered so far.
    ads_answered: u64,
    close_wanted: Option<u64>,
    close_sent: bool,
    /// The message carrying our Close was delivered: the peer has it (a process may exit now without
    /// the peer seeing anything but the end of the data).
    close_delivered: bool,
    close_reported: bool,
    // Receiving side.
    recvs: VecDeque<InRecv>,
    /// Receives in `recvs` without an advertisement standing for them (what
    /// [`Proto::advertise`] looks for).
    unadvertised_recvs: usize,
    ads: VecDeque<SentAd>,
    next_ad: u32,
    unadvertised_seen: u64,
    early: VecDeque<Early>,
    ring_in: RingReceiver,
    peer_closed: bool,
    failed: Option<Errno>,
    actions: VecDeque<Action>,
    /// A short advertisement alone in a control message at the very end of the actions, kept
    /// apart until anything follows it ([`Proto::settle_held`]): a ping-pong's next receive,
    /// which its reply takes along ([`Proto::post_lone_send`]) without the message ever being
    /// queued.
    held: Option<(u16, Advert)>,
    /// Bytes of the control message at the end of the actions, when one is there (what
    /// [`Proto::open_room`] would otherwise add up for every record queued).
    open_len: usize,
    /// Tests: the shortcuts of a ping-pong's calls are off (every call takes the pass), and
    /// how often they were taken.
    #[cfg(test)]
    generic_only: bool,
    #[cfg(test)]
    shortcuts_taken: u64,
}

impl Proto {
    /// A connected end.
    pub fn new(cfg: ProtoConfig) -> Proto {
        let ring_out =
            (cfg.kind == SocketKind::Stream && cfg.peer.ring_len >= 64 && cfg.peer.ring_len.is_power_of_two())
                .then(|| RingSender::new(cfg.peer.ring_len as u64));
        let ring_in = if cfg.kind == SocketKind::Stream && cfg.ring_len >= 64 && cfg.ring_len.is_power_of_two() {
            RingReceiver::new(cfg.ring_len as u64)
        } else {
            RingReceiver::new(0)
        };
        Proto {
            credits: Credits::new(cfg.peer.msg_credits.min(cfg.msg_credits) as u64),
            small_out: cfg.peer.small_max,
            peer_message_max: wire::message_max(cfg.peer.small_max),
            cfg,
            sends: VecDeque::new(),
            handed: 0,
            next_send: 0,
            peer_ads: VecDeque::new(),
            next_peer_ad: 0,
            unadvertised_sent: 0,
            ring_out,
            ring_waits_for_ad: false,
            ads_answered: 0,
            close_wanted: None,
            close_sent: false,
            close_delivered: false,
            close_reported: false,
            recvs: VecDeque::new(),
            unadvertised_recvs: 0,
            ads: VecDeque::new(),
            next_ad: 0,
            unadvertised_seen: 0,
            early: VecDeque::new(),
            ring_in,
            peer_closed: false,
            failed: None,
            actions: VecDeque::new(),
            held: None,
            open_len: 0,
            #[cfg(test)]
            generic_only: false,
            #[cfg(test)]
            shortcuts_taken: 0,
        }
    }

    /// The next action to carry out.
    pub fn next_action(&mut self) -> Option<Action> {
        if self.actions.is_empty() {
            self.settle_held();
        }
        self.actions.pop_front()
    }

    /// Whether the only action left is a control message that later records may still join (a driver
    /// that expects another call soon may hold it back to send them together).
    pub fn only_open_send(&self) -> bool {
        match self.held {
            Some(_) => self.actions.is_empty(),
            None => self.actions.len() == 1 && matches!(self.actions.front(), Some(Action::Send(_))),
        }
    }

    /// Whether actions wait to be carried out.
    pub fn has_actions(&self) -> bool {
        !self.actions.is_empty() || self.held.is_some()
    }

    /// Puts the held advertisement ([`Proto::held`]) in its place, a control message at the
    /// end of the actions, before anything is queued behind it or taken.
    #[inline]
    fn settle_held(&mut self) {
        if let Some((grant, ad)) = self.held.take() {
            self.actions.push_back(Action::Send(smallvec::smallvec![Record::Control(Control::Advertise(ad), grant)]));
        }
    }

    /// Queues an action other than a control message (see [`Proto::queue`]).
    fn push_action(&mut self, a: Action) {
        self.settle_held();
        self.actions.push_back(a);
    }

    /// Whether a record of `len` bytes may be queued now: it joins the control message at the
    /// end of the actions if that has room, or takes a new credit (the last kept back).
    fn may_queue(&self, len: usize) -> bool {
        self.open_room() >= len || self.credits.can_send_data()
    }

    /// Room left in the control message at the end of the actions (0 if none is open).
    fn open_room(&self) -> usize {
        if let Some((_, ad)) = &self.held {
            debug_assert_eq!(self.open_len, Control::Advertise(*ad).encoded_len());
            return self.peer_message_max.saturating_sub(self.open_len);
        }
        match self.actions.back() {
            Some(Action::Send(recs)) => {
                debug_assert_eq!(self.open_len, recs.iter().map(Record::encoded_len).sum::<usize>());
                self.peer_message_max.saturating_sub(self.open_len)
            }
            _ => 0,
        }
    }

    /// Queues a record: into the open control message if it fits, else into a new one (taking a
    /// credit). Callers checked [`Proto::may_queue`], or (credit records) that a credit is
    /// left. A short advertisement that starts a message is held apart ([`Proto::held`]).
    fn queue(&mut self, rec: impl FnOnce(u16) -> Record, len: usize) {
        if self.open_room() >= len {
            let grant = self.credits.take_grant();
            self.settle_held();
            if let Some(Action::Send(recs)) = self.actions.back_mut() {
                recs.push(rec(grant));
                self.open_len += len;
            }
        } else {
            let grant = self.credits.on_send();
            self.settle_held();
            match rec(grant) {
                Record::Control(Control::Advertise(ad), grant) if ad.fill_only => self.held = Some((grant, ad)),
                rec => self.actions.push_back(Action::Send(smallvec::smallvec![rec])),
            }
            self.open_len = len;
        }
    }

    /// Queues the completion of operation `req`.
    fn done(&mut self, req: u64, op: OpKind, outcome: Outcome, truncated: bool) {
        self.push_action(Action::Done(Done { req, op, outcome, truncated }));
    }

    fn queue_control(&mut self, c: Control<'static>) {
        let len = c.encoded_len();
        self.queue(|g| Record::Control(c, g), len);
    }

    /// Whether bytes that could go into the peer's stream buffer wait for advertisements.
    /// Once the peer rejected one (it posts receives, and a byte put into its stream buffer
    /// ahead of them dooms every advertisement it made before reading it: the stream would
    /// then stay in the buffer, copied at both ends), sends larger than a small message wait
    /// for advertisements, to be written once into the receives. The driver bounds
    /// each wait ([`Proto::resume_ring`] when no advertisement was answered for a while, see
    /// [`Proto::ads_answered`]): a send never needs its receiver for long, since the stream
    /// buffer exists to take bytes ahead of any receive.
    pub fn ring_waiting(&self) -> bool {
        self.ring_waits_for_ad && self.failed.is_none() && self.handed < self.sends.len()
    }

    /// Advertisements answered so far (what a driver timing [`Proto::ring_waiting`] watches).
    pub fn ads_answered(&self) -> u64 {
        self.ads_answered
    }

    /// Ends a wait of [`Proto::ring_waiting`]: the stream buffer takes bytes again (until the
    /// next rejection).
    pub fn resume_ring(&mut self) {
        if std::mem::take(&mut self.ring_waits_for_ad) {
            self.pump();
        }
    }

    /// The error number every call now fails with, once the connection failed.
    pub fn failure(&self) -> Option<Errno> {
        self.failed
    }

    /// The peer said it sends nothing more.
    pub fn peer_closed(&self) -> bool {
        self.peer_closed
    }

    /// Our Close reached the peer and every send completed.
    pub fn closed(&self) -> bool {
        self.close_delivered && self.sends.is_empty()
    }

    /// Operations not yet completed.
    pub fn outstanding(&self) -> usize {
        self.sends.len() + self.recvs.len() + usize::from(self.close_wanted.is_some() && !self.close_reported)
    }

    /// Starts a send of `len` bytes at `addr` (registered with `lkey`). Returns the error to
    /// give at once, if any; otherwise its completion comes as an action.
    pub fn post_send(&mut self, req: u64, addr: u64, len: u64, lkey: u32) -> Result<(), Errno> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        if self.close_wanted.is_some() {
            return Err(libc::EPIPE);
        }
        if self.cfg.kind == SocketKind::SeqPacket && len > MAX_WRITE as u64 {
            return Err(libc::EMSGSIZE);
        }
        if self.cfg.kind == SocketKind::Stream && len == 0 {
            self.done(req, OpKind::Send, Ok(0), false);
            return Ok(());
        }
        if self.shortcut_allowed() && self.answer_lone_ad(req, addr, len, lkey) {
            return Ok(());
        }
        let id = self.next_send;
        self.next_send += 1;
        self.sends.push_back(OutSend { id, req, addr, len, lkey, taken: 0, writes: 0 });
        self.pump();
        Ok(())
    }

    /// Starts a receive into `len` bytes at `addr` (registered with remote key `rkey`).
    pub fn post_recv(&mut self, req: u64, addr: u64, len: u64, rkey: u32) -> Result<(), Errno> {
        if let Some(e) = self.failed.filter(|_| !self.peer_closed) {
            return Err(e);
        }
        if self.close_wanted.is_some() {
            return Err(libc::EBADF);
        }
        self.recvs.push_back(InRecv { req, addr, len: len.min(MAX_WRITE as u64), rkey, ad: None });
        self.unadvertised_recvs += 1;
        if self.failed.is_some() {
            // The peer closed before the connection failed (it exited after its close): a
            // receive takes what arrived, then the end, as over TCP.
            self.serve_recvs();
        } else if !(self.shortcut_allowed() && self.advertise_lone_recv()) {
            self.pump();
        }
        Ok(())
    }

    /// Starts a close: Close follows every byte sent; receives still waiting are cancelled.
    /// Its completion comes once every send completed and the message carrying the Close was delivered (the
    /// peer has it: the process may exit then, and the peer reads the end of the data, not a
    /// reset).
    pub fn close(&mut self, req: u64) -> Result<(), Errno> {
        if self.close_wanted.is_some() {
            return Err(libc::EALREADY);
        }
        self.close_wanted = Some(req);
        for r in self.take_recvs() {
            self.orphan_ad(r.ad);
            self.done(r.req, OpKind::Recv, Err(libc::ECANCELED), false);
        }
        if self.failed.is_some() {
            self.finish_close();
            return Ok(());
        }
        self.pump();
        Ok(())
    }

    /// The connection failed (the queue pair broke, the peer vanished or broke the
    /// protocol): every operation completes with `errno`, and so does every later call.
    pub fn fail(&mut self, errno: Errno) {
        if self.failed.is_some() {
            return;
        }
        self.failed = Some(errno);
        self.handed = 0;
        for s in std::mem::take(&mut self.sends) {
            self.done(s.req, OpKind::Send, Err(errno), false);
        }
        if self.peer_closed {
            // The peer closed before it went: waiting receives take what arrived, then the end.
            self.serve_recvs();
        }
        for r in self.take_recvs() {
            self.done(r.req, OpKind::Recv, Err(errno), false);
        }
        self.close_sent = true;
        self.close_delivered = true;
        self.finish_close();
    }

    /// The message that carried our Close was delivered (the driver tells).
    pub fn on_close_delivered(&mut self) {
        self.close_delivered = true;
        self.finish_close();
    }

    /// A write of send `send` completed (successfully: a failed one fails the connection).
    pub fn on_write_done(&mut self, send: u64) {
        if let Some(s) = self.sends.iter_mut().find(|s| s.id == send) {
            s.writes = s.writes.saturating_sub(1);
        }
        self.pump();
    }

    /// A control message arrived.
    ///
    /// The bytes of a small message that fills a receive are stored at once through `place`
    /// (destination address, bytes), before the message's memory is reused; the receive's
    /// completion follows as an action.
    pub fn on_control(&mut self, bytes: &[u8], place: &mut dyn FnMut(u64, &[u8])) -> Result<(), ProtoError> {
        if self.shortcut_allowed() {
            if let Some(r) = self.take_lone_fill(bytes, place) {
                return r;
            }
        }
        let r = self.take_control(bytes, place);
        self.after_peer(r)
    }

    /// A write-with-immediate of the peer's landed.
    pub fn on_write_imm(&mut self, imm: u32) -> Result<(), ProtoError> {
        self.on_write_note(WriteNote::decode(imm))
    }

    /// A data write of the peer's landed, as its note (or its immediate) says.
    pub fn on_write_note(&mut self, note: WriteNote) -> Result<(), ProtoError> {
        let r = self.take_write(note);
        self.after_peer(r)
    }

    fn after_peer(&mut self, r: Result<(), ProtoError>) -> Result<(), ProtoError> {
        if r.is_err() {
            self.fail(libc::EPROTO);
        } else {
            self.pump();
        }
        r
    }

    /// Everything that may happen now: receives served from unadvertised data, receives
    /// advertised, sends matched, acknowledgements and credits returned.
    fn pump(&mut self) {
        if self.failed.is_some() {
            return;
        }
        debug_assert_eq!(self.unadvertised_recvs, self.recvs.iter().filter(|r| r.ad.is_none()).count());
        debug_assert!(self.handed <= self.sends.len() && self.sends.iter().take(self.handed).all(|s| s.taken == s.len));
        // Each stage only when its own first check would pass (a pass runs after every call
        // and arrival; most stages have nothing to do, and entering them costs more than
        // these checks).
        if !self.recvs.is_empty() && (!self.early.is_empty() || self.peer_closed) {
            self.serve_recvs();
        }
        if self.unadvertised_recvs > 0 {
            self.advertise();
        }
        if !self.peer_ads.is_empty() || self.handed < self.sends.len() {
            self.match_sends();
        }
        if self.handed > 0 {
            self.finish_sends();
        }
        if self.close_wanted.is_some() {
            self.send_close();
            self.finish_close();
        }
        self.return_credits();
    }

    /// Whether a call may take its shortcut past the pass (always, outside tests).
    #[inline]
    fn shortcut_allowed(&self) -> bool {
        #[cfg(test)]
        return !self.generic_only;
        #[cfg(not(test))]
        true
    }

    /// A call took its shortcut (counted in tests).
    #[inline]
    fn shortcut_taken(&mut self) {
        #[cfg(test)]
        {
            self.shortcuts_taken += 1;
        }
    }

    fn return_credits(&mut self) {
        if self.ring_in.received() > 0 && self.ring_in.needs_ack() && self.may_queue(wire::HEADER + 8) {
            let consumed = self.ring_in.take_ack();
            self.queue_control(Control::RingAck { consumed });
        }
        if self.credits.needs_update() && (self.open_room() >= wire::HEADER || self.credits.can_send_credit()) {
            self.queue_control(Control::Credit);
        }
    }
}

mod recv;
mod send;

#[cfg(test)]
mod tests;
