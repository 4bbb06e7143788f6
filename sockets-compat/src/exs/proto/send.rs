//! The sending side of a connection end: matching queued bytes against the peer's
//! advertisements, small messages, the stream buffer, and completing sends and close.

use smallvec::SmallVec;

use super::*;

impl Proto {
    /// Whether the peer made advertisement `ad` having seen every unadvertised delivery of
    /// ours (compared on 32 bits, as the short form carries them).
    pub(super) fn is_current(&self, ad: &Advert) -> bool {
        ad.unadvertised_seen as u32 == self.unadvertised_sent as u32
    }

    pub(super) fn first_untaken(&self) -> Option<usize> {
        (self.handed < self.sends.len()).then_some(self.handed)
    }

    /// Matches queued bytes against advertisements, then small messages, then the stream
    /// buffer, while credits last.
    pub(super) fn match_sends(&mut self) {
        loop {
            // Stale advertisements are answered at once, data or not: the receiver waits for
            // their rejection before it advertises the receives behind them.
            while let Some(ad) = self.peer_ads.front() {
                if self.is_current(ad) || !self.may_queue(wire::MAX_CONTROL) {
                    break;
                }
                let seq = ad.seq;
                self.peer_ads.pop_front();
                self.queue_control(Control::Reject { seq });
                // The receiver has receives waiting and advertises them again once it read
                // what came unadvertised: bytes put into its stream buffer meanwhile would
                // doom those advertisements too, and keep the stream copied at both ends.
                self.ring_waits_for_ad = self.ring_out.is_some();
            }
            let Some(i) = self.first_untaken() else { return };
            if let Some(ad) = self.peer_ads.front().copied() {
                if !self.is_current(&ad) {
                    return;
                }
                if self.try_fill_inline(i, &ad) {
                    self.ads_answered += 1;
                    continue;
                }
                if ad.fill_only || !self.credits.can_send_data() {
                    // A short advertisement waits for room for its record.
                    return;
                }
                self.peer_ads.pop_front();
                self.credits.on_send_bare();
                self.ads_answered += 1;
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

    pub(super) fn fill_message(&mut self, i: usize, ad: &Advert) {
        let s = &mut self.sends[i];
        let n = s.len.min(ad.len as u64) as u32;
        let truncated = s.len > ad.len as u64;
        s.taken = s.len;
        s.writes += 1;
        let piece = Piece { addr: s.addr, len: n, lkey: s.lkey };
        let imm = WriteNote::Advertised { len: n, truncated }.encode();
        let send = s.id;
        self.handed += 1;
        self.push_action(Action::Write { send, piece, remote_addr: ad.addr, rkey: ad.rkey, imm: Some(imm) });
    }

    pub(super) fn fill_stream(&mut self, first: usize, ad: &Advert) {
        let mut room = ad.len as u64;
        let mut at = 0u64;
        let mut writes: SmallVec<[(u64, Piece); 4]> = SmallVec::new();
        let mut handed = 0;
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
            handed += usize::from(s.taken == s.len);
            s.writes += 1;
            room -= n;
        }
        self.handed += handed;
        let last = writes.len().saturating_sub(1);
        for (k, (send, piece)) in writes.into_iter().enumerate() {
            let remote_addr = ad.addr + at;
            at += piece.len as u64;
            let imm = (k == last).then(|| WriteNote::Advertised { len: at as u32, truncated: false }.encode());
            self.push_action(Action::Write { send, piece, remote_addr, rkey: ad.rkey, imm });
        }
    }

    /// Sends small messages in the control message itself, only while more than half the
    /// peer's message credits are ours (those it holds stay held until its application reads them;
    /// the other half keeps advertisements and credits moving).
    pub(super) fn try_small(&mut self, first: usize) -> bool {
        let limit = self.small_out as u64;
        let spare = self.credits.available() * 2 > self.cfg.peer.msg_credits.min(self.cfg.msg_credits) as u64 + 2;
        let s = &self.sends[first];
        if limit == 0 || !spare || s.len - s.taken > limit {
            return false;
        }
        let mut pieces: SmallVec<[Piece; 1]> = SmallVec::new();
        let (mut total, mut handed) = (0u64, 0);
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
            handed += 1;
        }
        self.handed += handed;
        self.unadvertised_sent += 1;
        // The bytes are copied when the message is posted: the sends complete after it.
        let len = DATA_OVERHEAD + total as usize;
        self.queue(|grant| Record::Small { fill: None, pieces, grant }, len);
        true
    }

    /// Answers the advertisement at hand with the bytes inside a record, when they are few
    /// (at most the small size): the receiver copies them into its buffer, and the record
    /// shares a control message with the records around it, where a write would be a
    /// request of its own.
    pub(super) fn try_fill_inline(&mut self, first: usize, ad: &Advert) -> bool {
        let limit = (self.small_out as u64).min(ad.len as u64);
        let (n, truncated) = match self.cfg.kind {
            SocketKind::SeqPacket => {
                let s = &self.sends[first];
                (s.len.min(ad.len as u64), s.len > ad.len as u64)
            }
            // Only when everything queued fits: a stream with more at hand fills the whole
            // advertisement by RDMA instead, unless it is a short one (filled whole inline).
            SocketKind::Stream => {
                let queued = self.sends.iter().skip(first).map(|s| s.len - s.taken).sum::<u64>();
                (if ad.fill_only { queued.min(ad.len as u64) } else { queued }, false)
            }
        };
        if self.small_out == 0 || n > limit || (n == 0 && self.cfg.kind == SocketKind::Stream) {
            return false;
        }
        if DATA_OVERHEAD + n as usize > self.peer_message_max || !self.may_queue(DATA_OVERHEAD + n as usize) {
            return false;
        }
        let mut pieces: SmallVec<[Piece; 1]> = SmallVec::new();
        let (mut left, mut handed) = (n, 0);
        for s in self.sends.iter_mut().skip(first) {
            if self.cfg.kind == SocketKind::SeqPacket {
                if n > 0 {
                    pieces.push(Piece { addr: s.addr, len: n as u32, lkey: s.lkey });
                }
                s.taken = s.len;
                handed = 1;
                break;
            }
            if left == 0 || (pieces.len() == MAX_PIECES) {
                // Never more pieces than a work request gathers: the rest goes next time.
                break;
            }
            let k = (s.len - s.taken).min(left);
            pieces.push(Piece { addr: s.addr + s.taken, len: k as u32, lkey: s.lkey });
            s.taken += k;
            handed += usize::from(s.taken == s.len);
            left -= k;
        }
        self.handed += handed;
        let len = DATA_OVERHEAD + pieces.iter().map(|p| p.len as usize).sum::<usize>();
        self.peer_ads.pop_front();
        self.queue(|grant| Record::Small { fill: Some(truncated), pieces, grant }, len);
        true
    }

    /// Whether a new send of `len` bytes is one that the one advertisement at hand takes whole
    /// inside a record, with nothing else to do before the fill or after it: the fill's bytes,
    /// its truncation flag and its record's length, or `None`.
    #[inline]
    fn lone_ad_fill(&self, len: u64) -> Option<(u64, bool, usize)> {
        let ad = self.peer_ads.front()?;
        // Every other stage of the pass has nothing to do, before the fill and after it: no
        // other send or advertisement, no receive to serve or advertise, no close.
        let quiet = self.peer_ads.len() == 1
            && self.sends.is_empty()
            && self.unadvertised_recvs == 0
            && self.early.is_empty()
            && !self.peer_closed
            && self.close_wanted.is_none();
        if !quiet || !self.is_current(ad) || self.small_out == 0 {
            return None;
        }
        // As `try_fill_inline` decides for a lone send.
        let (n, truncated) = match self.cfg.kind {
            SocketKind::SeqPacket => (len.min(ad.len as u64), len > ad.len as u64),
            SocketKind::Stream => (len, false),
        };
        let rec_len = DATA_OVERHEAD + n as usize;
        if n > (self.small_out as u64).min(ad.len as u64) || rec_len > self.peer_message_max || !self.may_queue(rec_len)
        {
            return None;
        }
        Some((n, truncated, rec_len))
    }

    /// A new send that the one advertisement at hand takes whole inside a record, with nothing
    /// else to do: what [`Proto::post_send`]'s pass would come to (the fill, the send's
    /// completion after it, credits), without the pass and the send's bookkeeping. This is a
    /// ping-pong's reply to the peer's short advertisement. False, nothing done, in any other
    /// state (the pass then handles the send).
    pub(super) fn answer_lone_ad(&mut self, req: u64, addr: u64, len: u64, lkey: u32) -> bool {
        let Some((n, truncated, rec_len)) = self.lone_ad_fill(len) else { return false };
        let mut pieces: SmallVec<[Piece; 1]> = SmallVec::new();
        if n > 0 {
            pieces.push(Piece { addr, len: n as u32, lkey });
        }
        // Numbered as a queued send would be, so that later sends' writes are named alike.
        self.next_send += 1;
        self.peer_ads.pop_front();
        self.ads_answered += 1;
        self.queue(|grant| Record::Small { fill: Some(truncated), pieces, grant }, rec_len);
        self.done(req, OpKind::Send, Ok(len), false);
        self.return_credits();
        self.shortcut_taken();
        true
    }

    /// [`Proto::post_send`] for a send that [`Proto::answer_lone_ad`] would take, when nothing
    /// else waits to be carried out but the open control message of the receive posted before it
    /// (its short advertisement): the control message is handed back to be sent at once, and
    /// the send's completion to be reported after it, instead of being queued as actions.
    /// What the caller carries out is what the actions would have been
    /// ([`LoneReply::actions`]). `None`, nothing done, in any other state.
    pub fn post_lone_send(&mut self, req: u64, addr: u64, len: u64, lkey: u32) -> Option<LoneReply> {
        let refused = self.failed.is_some()
            || self.close_wanted.is_some()
            || (self.cfg.kind == SocketKind::SeqPacket && len > MAX_WRITE as u64)
            || (self.cfg.kind == SocketKind::Stream && len == 0);
        if !self.shortcut_allowed() || refused {
            return None;
        }
        // Nothing may wait but the held advertisement of the receive posted before.
        if !self.actions.is_empty() {
            return None;
        }
        let offer = self.held;
        let (n, truncated, rec_len) = self.lone_ad_fill(len)?;
        // The fill joins the open message, as `queue` would put it; after it the pass would
        // queue nothing (the fill grants every credit owed), unless the stream buffer is due
        // an acknowledgement.
        let joins = offer.is_some();
        if (joins && self.open_room() < rec_len)
            || (!joins && !self.credits.can_send_data())
            || self.credits.owed() > u16::MAX as u64
            || (self.ring_in.received() > 0 && self.ring_in.needs_ack())
        {
            return None;
        }
        let grant = if joins { self.credits.take_grant() } else { self.credits.on_send() };
        debug_assert!(!self.credits.needs_update());
        self.held = None;
        self.open_len = 0;
        self.next_send += 1;
        self.peer_ads.pop_front();
        self.ads_answered += 1;
        self.shortcut_taken();
        Some(LoneReply {
            offer,
            grant,
            fill: Piece { addr, len: n as u32, lkey },
            truncated,
            done: Done { req, op: OpKind::Send, outcome: Ok(len), truncated: false },
        })
    }

    pub(super) fn try_ring(&mut self, first: usize) -> bool {
        if self.ring_waits_for_ad {
            return false;
        }
        let Some(ring) = self.ring_out.as_mut() else { return false };
        let s = &mut self.sends[first];
        let n = (s.len - s.taken).min(ring.max_chunk());
        let Some(place) = ring.reserve(n) else { return false };
        let piece = Piece { addr: s.addr + s.taken, len: n as u32, lkey: s.lkey };
        s.taken += n;
        let handed = s.taken == s.len;
        s.writes += 1;
        let imm = WriteNote::Ring { len: n as u32, wrapped: place.wrapped }.encode();
        let id = s.id;
        self.handed += usize::from(handed);
        self.unadvertised_sent += 1;
        self.credits.on_send_bare();
        let remote_addr = self.cfg.peer.ring_addr + place.offset;
        self.push_action(Action::Write { send: id, piece, remote_addr, rkey: self.cfg.peer.ring_rkey, imm: Some(imm) });
        true
    }

    /// Completes the sends at the front whose bytes all went and whose writes completed
    /// (sends complete in order, as a stream's bytes do).
    pub(super) fn finish_sends(&mut self) {
        while let Some(s) = self.sends.front() {
            if self.handed == 0 || s.writes > 0 {
                return;
            }
            let s = self.sends.pop_front().expect("checked");
            self.handed -= 1;
            self.done(s.req, OpKind::Send, Ok(s.len), false);
        }
    }

    pub(super) fn send_close(&mut self) {
        let Some(_) = self.close_wanted else { return };
        if self.close_sent || self.handed < self.sends.len() || !self.may_queue(wire::HEADER) {
            return;
        }
        self.close_sent = true;
        self.queue_control(Control::Close);
    }

    /// Reports the close once its message reached the peer and every send completed.
    pub(super) fn finish_close(&mut self) {
        if let Some(req) = self.close_wanted {
            if self.close_delivered && self.sends.is_empty() && !self.close_reported {
                self.close_reported = true;
                self.done(req, OpKind::Close, Ok(0), false);
            }
        }
    }
}
