//! One EXS connection's decisions, sans-IO: which advertisement a send's bytes go into, when
//! a receive is advertised, what arrived outside advertisements and which receive it fills,
//! credits, stream-buffer space, close. Plain state and functions: the driver
//! ([`super::conn`]) feeds it the application's calls and the queue pair's completions and
//! carries out the [`Action`]s it returns, in order.
//!
//! The transfer is UNH-EXS's: `recv` advertises its buffer (address, length, key) by SEND;
//! `send` matches its bytes against the advertisements in order and RDMA-writes with
//! immediate into them (the immediate gives the length). Besides that:
//! - a message of at most the small size goes in the control message itself when no
//!   advertisement is at hand, and a stream's bytes go into the receiver's stream buffer
//!   (copied once) when it has one; both are *unadvertised deliveries*;
//! - every advertisement carries the count of unadvertised deliveries the receiver had seen;
//!   a sender that made more rejects it (the receiver fills that buffer from what arrived
//!   first), so bytes and messages stay in order whatever crosses on the wire;
//! - every SEND and write-with-immediate takes one of the peer's posted slots, under the
//!   credit accounting of [`fc::Credits`] (grants ride on every control message).

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

/// One record of a SEND.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// A control record carrying `grant` credits.
    Control(Control<'static>, u16),
    /// A small message made of these pieces of the application's memory (copied into the
    /// SEND when it is posted), carrying `grant` credits: unadvertised ([`Control::Data`]),
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
    /// SEND these records in one message (one of the peer's slots).
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

/// What a connection end is set up with.
#[derive(Clone, Copy, Debug)]
pub struct ProtoConfig {
    /// Socket type.
    pub kind: SocketKind,
    /// Control slots we posted.
    pub slots: u16,
    /// Largest small message our slots hold.
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
    /// Every byte was handed out (a SOCK_SEQPACKET message once matched, even empty or cut).
    handed: bool,
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
    /// A small message, bytes consumed so far, and whether its slot's credit is held until
    /// it is consumed (the last small message of its SEND holds it).
    Bytes(Vec<u8>, usize, bool),
    /// A stream-buffer chunk: offset, bytes, consumed so far, ring position after it.
    Ring { offset: u64, len: u64, used: u64, end: u64 },
}

/// Why a peer broke the protocol.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
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
    /// Bytes of the peer's receive slots: the largest SEND.
    peer_slot: usize,
    // Sending side.
    sends: VecDeque<OutSend>,
    next_send: u64,
    peer_ads: VecDeque<Advert>,
    next_peer_ad: u32,
    unadvertised_sent: u64,
    ring_out: Option<RingSender>,
    close_wanted: Option<u64>,
    close_sent: bool,
    close_reported: bool,
    // Receiving side.
    recvs: VecDeque<InRecv>,
    ads: VecDeque<SentAd>,
    next_ad: u32,
    unadvertised_seen: u64,
    early: VecDeque<Early>,
    ring_in: RingReceiver,
    peer_closed: bool,
    failed: Option<Errno>,
    actions: VecDeque<Action>,
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
            credits: Credits::new(cfg.peer.slots.min(cfg.slots) as u64),
            small_out: cfg.peer.small_max,
            peer_slot: wire::slot_size(cfg.peer.small_max),
            cfg,
            sends: VecDeque::new(),
            next_send: 0,
            peer_ads: VecDeque::new(),
            next_peer_ad: 0,
            unadvertised_sent: 0,
            ring_out,
            close_wanted: None,
            close_sent: false,
            close_reported: false,
            recvs: VecDeque::new(),
            ads: VecDeque::new(),
            next_ad: 0,
            unadvertised_seen: 0,
            early: VecDeque::new(),
            ring_in,
            peer_closed: false,
            failed: None,
            actions: VecDeque::new(),
        }
    }

    /// The next action to carry out.
    pub fn next_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Whether the only action left is a SEND that later records may still join (a driver
    /// that expects another call soon may hold it back to send them together).
    pub fn only_open_send(&self) -> bool {
        self.actions.len() == 1 && matches!(self.actions.front(), Some(Action::Send(_)))
    }

    /// Whether actions wait to be carried out.
    pub fn has_actions(&self) -> bool {
        !self.actions.is_empty()
    }

    /// Whether a record of `len` bytes may be queued now: it joins the SEND at the end of
    /// the actions if that has room, or takes a new slot credit (the last kept back).
    fn may_queue(&self, len: usize) -> bool {
        self.open_room() >= len || self.credits.can_send_data()
    }

    /// Room left in the SEND at the end of the actions (0 if none is open).
    fn open_room(&self) -> usize {
        match self.actions.back() {
            Some(Action::Send(recs)) => {
                self.peer_slot.saturating_sub(recs.iter().map(Record::encoded_len).sum::<usize>())
            }
            _ => 0,
        }
    }

    /// Queues a record: into the open SEND if it fits, else into a new one (taking a
    /// credit). Callers checked [`Proto::may_queue`], or (credit records) that a credit is
    /// left.
    fn queue(&mut self, rec: impl FnOnce(u16) -> Record, len: usize) {
        if self.open_room() >= len {
            let grant = self.credits.take_grant();
            if let Some(Action::Send(recs)) = self.actions.back_mut() {
                recs.push(rec(grant));
            }
        } else {
            let grant = self.credits.on_send();
            self.actions.push_back(Action::Send(smallvec::smallvec![rec(grant)]));
        }
    }

    fn queue_control(&mut self, c: Control<'static>) {
        let len = c.encoded_len();
        self.queue(|g| Record::Control(c, g), len);
    }

    /// The error number every call now fails with, once the connection failed.
    pub fn failure(&self) -> Option<Errno> {
        self.failed
    }

    /// The peer said it sends nothing more.
    pub fn peer_closed(&self) -> bool {
        self.peer_closed
    }

    /// Our Close went and every send completed.
    pub fn closed(&self) -> bool {
        self.close_sent && self.sends.is_empty()
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
            self.actions.push_back(Action::Done(Done { req, op: OpKind::Send, outcome: Ok(0), truncated: false }));
            return Ok(());
        }
        let id = self.next_send;
        self.next_send += 1;
        self.sends.push_back(OutSend { id, req, addr, len, lkey, taken: 0, handed: false, writes: 0 });
        self.pump();
        Ok(())
    }

    /// Starts a receive into `len` bytes at `addr` (registered with remote key `rkey`).
    pub fn post_recv(&mut self, req: u64, addr: u64, len: u64, rkey: u32) -> Result<(), Errno> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        if self.close_wanted.is_some() {
            return Err(libc::EBADF);
        }
        self.recvs.push_back(InRecv { req, addr, len: len.min(MAX_WRITE as u64), rkey, ad: None });
        self.pump();
        Ok(())
    }

    /// Starts a close: Close follows every byte sent; receives still waiting are cancelled.
    /// Its completion comes once the Close went and every send completed.
    pub fn close(&mut self, req: u64) -> Result<(), Errno> {
        if self.close_wanted.is_some() {
            return Err(libc::EALREADY);
        }
        self.close_wanted = Some(req);
        for r in std::mem::take(&mut self.recvs) {
            self.orphan_ad(r.ad);
            self.actions.push_back(Action::Done(Done {
                req: r.req,
                op: OpKind::Recv,
                outcome: Err(libc::ECANCELED),
                truncated: false,
            }));
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
        for s in std::mem::take(&mut self.sends) {
            self.actions.push_back(Action::Done(Done {
                req: s.req,
                op: OpKind::Send,
                outcome: Err(errno),
                truncated: false,
            }));
        }
        for r in std::mem::take(&mut self.recvs) {
            self.actions.push_back(Action::Done(Done {
                req: r.req,
                op: OpKind::Recv,
                outcome: Err(errno),
                truncated: false,
            }));
        }
        self.close_sent = true;
        self.finish_close();
    }

    /// A write of send `send` completed (successfully: a failed one fails the connection).
    pub fn on_write_done(&mut self, send: u64) {
        if let Some(s) = self.sends.iter_mut().find(|s| s.id == send) {
            s.writes = s.writes.saturating_sub(1);
        }
        self.pump();
    }

    /// A control message arrived in one of our slots.
    ///
    /// The bytes of a small message that fills a receive are stored at once through `place`
    /// (destination address, bytes), before the message's slot is reused; the receive's
    /// completion follows as an action.
    pub fn on_control(&mut self, bytes: &[u8], place: &mut dyn FnMut(u64, &[u8])) -> Result<(), ProtoError> {
        let r = self.take_control(bytes, place);
        self.after_peer(r)
    }

    /// A write-with-immediate of the peer's landed.
    pub fn on_write_imm(&mut self, imm: u32) -> Result<(), ProtoError> {
        let r = self.take_write(imm);
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

    fn take_control(&mut self, bytes: &[u8], place: &mut dyn FnMut(u64, &[u8])) -> Result<(), ProtoError> {
        // Every record is checked before any is acted on.
        let mut recs: SmallVec<[Control<'_>; 4]> = SmallVec::new();
        let mut grant = 0u16;
        for r in wire::records(bytes) {
            let (g, c) = r?;
            grant = grant.checked_add(g).ok_or(ProtoError::Violation("credits past the slots"))?;
            recs.push(c);
        }
        if recs.is_empty() {
            return Err(ProtoError::Violation("an empty message"));
        }
        self.credits.on_receive(grant).map_err(|_| ProtoError::Violation("credits past the slots"))?;
        // The slot's credit is held by the last small message in it until that is consumed.
        let last_data = recs.iter().rposition(|c| matches!(c, Control::Data(_)));
        for (i, c) in recs.into_iter().enumerate() {
            self.take_record(c, last_data == Some(i), place)?;
        }
        if last_data.is_none() {
            self.credits.on_buffer_freed();
        }
        Ok(())
    }

    fn take_record(
        &mut self,
        c: Control<'_>,
        holds_slot: bool,
        place: &mut dyn FnMut(u64, &[u8]),
    ) -> Result<(), ProtoError> {
        match c {
            Control::Data(d) => {
                if d.len() > self.cfg.small_max as usize {
                    return Err(ProtoError::Violation("small message larger than our slots"));
                }
                self.unadvertised_arrived();
                self.early.push_back(Early::Bytes(d.to_vec(), 0, holds_slot));
            }
            Control::Fill { data, truncated } => {
                let r = self.answer_ad(data.len() as u32, truncated)?;
                if !data.is_empty() {
                    place(r.addr, data);
                }
                self.actions.push_back(Action::Done(Done {
                    req: r.req,
                    op: OpKind::Recv,
                    outcome: Ok(data.len() as u64),
                    truncated,
                }));
            }
            Control::Advertise(a) => {
                if a.seq != self.next_peer_ad {
                    return Err(ProtoError::Violation("advertisement out of sequence"));
                }
                self.next_peer_ad = self.next_peer_ad.wrapping_add(1);
                self.peer_ads.push_back(a);
            }
            Control::Reject { seq } => {
                let ad = self.ads.pop_front().ok_or(ProtoError::Violation("rejection of no advertisement"))?;
                if ad.seq != seq {
                    return Err(ProtoError::Violation("rejection out of sequence"));
                }
                if !ad.doomed {
                    return Err(ProtoError::Violation("rejection of a current advertisement"));
                }
                if !ad.orphan {
                    if let Some(r) = self.recvs.iter_mut().find(|r| r.ad == Some(seq)) {
                        r.ad = None;
                    }
                }
            }
            Control::RingAck { consumed } => {
                let ring =
                    self.ring_out.as_mut().ok_or(ProtoError::Violation("stream-buffer acknowledgement without one"))?;
                ring.on_ack(consumed)
                    .map_err(|_| ProtoError::Violation("stream-buffer acknowledgement past what was sent"))?;
            }
            Control::Credit => {}
            Control::Close => self.peer_closed = true,
        }
        Ok(())
    }

    /// The oldest advertisement not yet answered got `len` bytes: checks it may and takes its
    /// receive (the first one waiting).
    fn answer_ad(&mut self, len: u32, truncated: bool) -> Result<InRecv, ProtoError> {
        let ad = self.ads.pop_front().ok_or(ProtoError::Violation("write into no advertisement"))?;
        if ad.doomed || ad.orphan {
            return Err(ProtoError::Violation("write into an advertisement that had to be rejected"));
        }
        if len > ad.len || (truncated && self.cfg.kind == SocketKind::Stream) {
            return Err(ProtoError::Violation("write past the advertised buffer"));
        }
        let at = self
            .recvs
            .iter()
            .position(|r| r.ad == Some(ad.seq))
            .ok_or(ProtoError::Violation("advertisement of no receive"))?;
        if at != 0 {
            return Err(ProtoError::Violation("advertisements answered out of order"));
        }
        Ok(self.recvs.pop_front().expect("found"))
    }

    fn take_write(&mut self, imm: u32) -> Result<(), ProtoError> {
        self.credits.on_receive(0).map_err(|_| ProtoError::Violation("write without a slot"))?;
        self.credits.on_buffer_freed();
        match WriteNote::decode(imm) {
            WriteNote::Advertised { len, truncated } => {
                let r = self.answer_ad(len, truncated)?;
                self.actions.push_back(Action::Done(Done {
                    req: r.req,
                    op: OpKind::Recv,
                    outcome: Ok(len as u64),
                    truncated,
                }));
            }
            WriteNote::Ring { len, wrapped } => {
                if self.cfg.kind != SocketKind::Stream {
                    return Err(ProtoError::Violation("stream-buffer write on a SOCK_SEQPACKET socket"));
                }
                let offset = self
                    .ring_in
                    .on_chunk(len as u64, wrapped)
                    .map_err(|_| ProtoError::Violation("stream-buffer write past its space"))?;
                self.unadvertised_arrived();
                self.early.push_back(Early::Ring { offset, len: len as u64, used: 0, end: self.ring_in.received() });
            }
        }
        Ok(())
    }

    /// Data outside advertisements arrived: every advertisement not yet answered was made
    /// before it, and the sender will reject them all.
    fn unadvertised_arrived(&mut self) {
        self.unadvertised_seen += 1;
        for ad in &mut self.ads {
            ad.doomed = true;
        }
    }

    fn orphan_ad(&mut self, ad: Option<u32>) {
        if let Some(seq) = ad {
            if let Some(a) = self.ads.iter_mut().find(|a| a.seq == seq) {
                a.orphan = true;
            }
        }
    }

    /// Everything that may happen now: receives served from unadvertised data, receives
    /// advertised, sends matched, acknowledgements and credits returned.
    fn pump(&mut self) {
        if self.failed.is_some() {
            return;
        }
        self.serve_recvs();
        self.advertise();
        self.match_sends();
        self.finish_sends();
        self.send_close();
        self.finish_close();
        self.return_credits();
    }

    fn serve_recvs(&mut self) {
        while !self.early.is_empty() && !self.recvs.is_empty() {
            let r = self.recvs.pop_front().expect("checked");
            self.orphan_ad(r.ad);
            let (got, truncated) = match self.cfg.kind {
                SocketKind::SeqPacket => self.copy_message(&r),
                SocketKind::Stream => self.copy_stream(&r),
            };
            self.actions.push_back(Action::Done(Done { req: r.req, op: OpKind::Recv, outcome: Ok(got), truncated }));
        }
        if self.peer_closed && self.early.is_empty() {
            // The end of the peer's data: nothing will fill these.
            for r in std::mem::take(&mut self.recvs) {
                self.orphan_ad(r.ad);
                self.actions.push_back(Action::Done(Done {
                    req: r.req,
                    op: OpKind::Recv,
                    outcome: Ok(0),
                    truncated: false,
                }));
            }
        }
    }

    fn copy_message(&mut self, r: &InRecv) -> (u64, bool) {
        match self.early.pop_front() {
            Some(Early::Bytes(b, _, holds)) => {
                let n = (b.len() as u64).min(r.len);
                let truncated = (b.len() as u64) > r.len;
                if n > 0 {
                    let mut b = b;
                    b.truncate(n as usize);
                    self.actions.push_back(Action::Copy { dst: r.addr, src: CopySrc::Bytes(b), len: n });
                }
                if holds {
                    self.credits.on_buffer_freed();
                }
                (n, truncated)
            }
            // Refused on arrival: SOCK_SEQPACKET has no stream buffer.
            Some(Early::Ring { .. }) | None => (0, false),
        }
    }

    fn copy_stream(&mut self, r: &InRecv) -> (u64, bool) {
        let mut got = 0u64;
        while got < r.len {
            let Some(front) = self.early.front_mut() else { break };
            match front {
                Early::Bytes(b, used, holds) => {
                    let n = ((b.len() - *used) as u64).min(r.len - got);
                    let piece = b[*used..*used + n as usize].to_vec();
                    *used += n as usize;
                    let (finished, holds) = (*used == b.len(), *holds);
                    if n > 0 {
                        self.actions.push_back(Action::Copy { dst: r.addr + got, src: CopySrc::Bytes(piece), len: n });
                    }
                    got += n;
                    if finished {
                        self.early.pop_front();
                        if holds {
                            self.credits.on_buffer_freed();
                        }
                    }
                }
                Early::Ring { offset, len, used, end } => {
                    let n = (*len - *used).min(r.len - got);
                    self.actions.push_back(Action::Copy {
                        dst: r.addr + got,
                        src: CopySrc::Ring(*offset + *used),
                        len: n,
                    });
                    *used += n;
                    got += n;
                    if *used == *len {
                        let end = *end;
                        self.early.pop_front();
                        self.ring_in.consume_to(end);
                    }
                }
            }
        }
        (got, false)
    }

    /// Advertises waiting receives in order, while advertisement credits and slot credits
    /// last, and never past a receive whose advertisement awaits its rejection (bytes must
    /// land in the order receives were posted).
    fn advertise(&mut self) {
        if self.peer_closed || !self.early.is_empty() {
            return;
        }
        for i in 0..self.recvs.len() {
            if let Some(seq) = self.recvs[i].ad {
                if self.ads.iter().any(|a| a.seq == seq && a.doomed) {
                    return;
                }
                continue;
            }
            if self.ads.len() as u32 >= self.cfg.adv_credits.max(1) || !self.may_queue(wire::MAX_CONTROL) {
                return;
            }
            let seq = self.next_ad;
            self.next_ad = self.next_ad.wrapping_add(1);
            let r = &mut self.recvs[i];
            r.ad = Some(seq);
            let ad = Advert {
                seq,
                unadvertised_seen: self.unadvertised_seen,
                addr: r.addr,
                len: r.len as u32,
                rkey: r.rkey,
            };
            self.ads.push_back(SentAd { seq, len: ad.len, doomed: false, orphan: false });
            self.queue_control(Control::Advertise(ad));
        }
    }

    fn first_untaken(&self) -> Option<usize> {
        self.sends.iter().position(|s| !s.handed)
    }

    /// Matches queued bytes against advertisements, then small messages, then the stream
    /// buffer, while credits last.
    fn match_sends(&mut self) {
        loop {
            // Stale advertisements are answered at once, data or not: the receiver waits for
            // their rejection before it advertises the receives behind them.
            while let Some(ad) = self.peer_ads.front() {
                if ad.unadvertised_seen == self.unadvertised_sent || !self.may_queue(wire::MAX_CONTROL) {
                    break;
                }
                let seq = ad.seq;
                self.peer_ads.pop_front();
                self.queue_control(Control::Reject { seq });
            }
            let Some(i) = self.first_untaken() else { return };
            if let Some(ad) = self.peer_ads.front().copied() {
                if ad.unadvertised_seen != self.unadvertised_sent {
                    return;
                }
                if self.try_fill_inline(i, &ad) {
                    continue;
                }
                if !self.credits.can_send_data() {
                    return;
                }
                self.peer_ads.pop_front();
                self.credits.on_send_bare();
                match self.cfg.kind {
                    SocketKind::SeqPacket => self.fill_message(i, &ad),
                    SocketKind::Stream => self.fill_stream(i, &ad),
                }
                continue;
            }
            if !self.credits.can_send_data() {
                return;
            }
            if self.try_small(i) || self.try_ring(i) {
                continue;
            }
            return;
        }
    }

    fn fill_message(&mut self, i: usize, ad: &Advert) {
        let s = &mut self.sends[i];
        let n = s.len.min(ad.len as u64) as u32;
        let truncated = s.len > ad.len as u64;
        s.taken = s.len;
        s.handed = true;
        s.writes += 1;
        let piece = Piece { addr: s.addr, len: n, lkey: s.lkey };
        let imm = WriteNote::Advertised { len: n, truncated }.encode();
        self.actions.push_back(Action::Write {
            send: s.id,
            piece,
            remote_addr: ad.addr,
            rkey: ad.rkey,
            imm: Some(imm),
        });
    }

    fn fill_stream(&mut self, first: usize, ad: &Advert) {
        let mut room = ad.len as u64;
        let mut at = 0u64;
        let mut writes: SmallVec<[(u64, Piece); 4]> = SmallVec::new();
        for s in self.sends.iter_mut().skip(first) {
            if room == 0 {
                break;
            }
            let n = (s.len - s.taken).min(room);
            if n == 0 {
                continue;
            }
            writes.push((s.id, Piece { addr: s.addr + s.taken, len: n as u32, lkey: s.lkey }));
            s.taken += n;
            s.handed = s.taken == s.len;
            s.writes += 1;
            room -= n;
        }
        let last = writes.len().saturating_sub(1);
        for (k, (send, piece)) in writes.into_iter().enumerate() {
            let remote_addr = ad.addr + at;
            at += piece.len as u64;
            let imm = (k == last).then(|| WriteNote::Advertised { len: at as u32, truncated: false }.encode());
            self.actions.push_back(Action::Write { send, piece, remote_addr, rkey: ad.rkey, imm });
        }
    }

    /// Sends small messages in the control message itself, only while more than half the
    /// peer's slots are free (the slots it holds stay held until its application reads them;
    /// the other half keeps advertisements and credits moving).
    fn try_small(&mut self, first: usize) -> bool {
        let limit = self.small_out as u64;
        let spare = self.credits.available() * 2 > self.cfg.peer.slots.min(self.cfg.slots) as u64 + 2;
        let s = &self.sends[first];
        if limit == 0 || !spare || s.len - s.taken > limit {
            return false;
        }
        let mut pieces: SmallVec<[Piece; 1]> = SmallVec::new();
        let mut total = 0u64;
        for (k, s) in self.sends.iter_mut().skip(first).enumerate() {
            let n = s.len - s.taken;
            if total + n > limit || (self.cfg.kind == SocketKind::SeqPacket && k > 0) || pieces.len() == MAX_PIECES {
                break;
            }
            if n > 0 {
                pieces.push(Piece { addr: s.addr + s.taken, len: n as u32, lkey: s.lkey });
            }
            total += n;
            s.taken = s.len;
            s.handed = true;
        }
        self.unadvertised_sent += 1;
        // The bytes are copied when the message is posted: the sends complete after it.
        let len = DATA_OVERHEAD + total as usize;
        self.queue(|grant| Record::Small { fill: None, pieces, grant }, len);
        true
    }

    /// Answers the advertisement at hand with the bytes inside a record, when they are few
    /// (at most the small size): the receiver copies them into its buffer, and the record
    /// shares a SEND with the control records around it, where a write would be a request
    /// of its own.
    fn try_fill_inline(&mut self, first: usize, ad: &Advert) -> bool {
        let limit = (self.small_out as u64).min(ad.len as u64);
        let (n, truncated) = match self.cfg.kind {
            SocketKind::SeqPacket => {
                let s = &self.sends[first];
                (s.len.min(ad.len as u64), s.len > ad.len as u64)
            }
            // Only when everything queued fits: a stream with more at hand fills the whole
            // advertisement by RDMA instead.
            SocketKind::Stream => (self.sends.iter().skip(first).map(|s| s.len - s.taken).sum::<u64>(), false),
        };
        if self.small_out == 0 || n > limit || (n == 0 && self.cfg.kind == SocketKind::Stream) {
            return false;
        }
        if DATA_OVERHEAD + n as usize > self.peer_slot || !self.may_queue(DATA_OVERHEAD + n as usize) {
            return false;
        }
        let mut pieces: SmallVec<[Piece; 1]> = SmallVec::new();
        let mut left = n;
        for s in self.sends.iter_mut().skip(first) {
            if self.cfg.kind == SocketKind::SeqPacket {
                if n > 0 {
                    pieces.push(Piece { addr: s.addr, len: n as u32, lkey: s.lkey });
                }
                s.taken = s.len;
                s.handed = true;
                break;
            }
            if left == 0 || (pieces.len() == MAX_PIECES) {
                // Never more pieces than a work request gathers: the rest goes next time.
                break;
            }
            let k = (s.len - s.taken).min(left);
            pieces.push(Piece { addr: s.addr + s.taken, len: k as u32, lkey: s.lkey });
            s.taken += k;
            s.handed = s.taken == s.len;
            left -= k;
        }
        let len = DATA_OVERHEAD + pieces.iter().map(|p| p.len as usize).sum::<usize>();
        self.peer_ads.pop_front();
        self.queue(|grant| Record::Small { fill: Some(truncated), pieces, grant }, len);
        true
    }

    fn try_ring(&mut self, first: usize) -> bool {
        let Some(ring) = self.ring_out.as_mut() else { return false };
        let s = &mut self.sends[first];
        let n = (s.len - s.taken).min(ring.max_chunk());
        let Some(place) = ring.reserve(n) else { return false };
        let piece = Piece { addr: s.addr + s.taken, len: n as u32, lkey: s.lkey };
        s.taken += n;
        s.handed = s.taken == s.len;
        s.writes += 1;
        let imm = WriteNote::Ring { len: n as u32, wrapped: place.wrapped }.encode();
        let id = s.id;
        self.unadvertised_sent += 1;
        self.credits.on_send_bare();
        let remote_addr = self.cfg.peer.ring_addr + place.offset;
        self.actions.push_back(Action::Write {
            send: id,
            piece,
            remote_addr,
            rkey: self.cfg.peer.ring_rkey,
            imm: Some(imm),
        });
        true
    }

    /// Completes the sends at the front whose bytes all went and whose writes completed
    /// (sends complete in order, as a stream's bytes do).
    fn finish_sends(&mut self) {
        while let Some(s) = self.sends.front() {
            if !s.handed || s.writes > 0 {
                return;
            }
            let s = self.sends.pop_front().expect("checked");
            self.actions.push_back(Action::Done(Done {
                req: s.req,
                op: OpKind::Send,
                outcome: Ok(s.len),
                truncated: false,
            }));
        }
    }

    fn send_close(&mut self) {
        let Some(_) = self.close_wanted else { return };
        if self.close_sent || self.sends.iter().any(|s| !s.handed) || !self.may_queue(wire::HEADER) {
            return;
        }
        self.close_sent = true;
        self.queue_control(Control::Close);
    }

    /// Reports the close once its message went and every send completed.
    fn finish_close(&mut self) {
        if let Some(req) = self.close_wanted {
            if self.close_sent && self.sends.is_empty() && !self.close_reported {
                self.close_reported = true;
                self.actions.push_back(Action::Done(Done { req, op: OpKind::Close, outcome: Ok(0), truncated: false }));
            }
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

#[cfg(test)]
#[path = "proto_tests.rs"]
mod tests;
