//! The receiving side of a connection end: what the peer's records and writes say, which
//! receive they complete, and advertising the receives still waiting.

use smallvec::SmallVec;

use super::*;

impl Proto {
    pub(super) fn take_control(&mut self, bytes: &[u8], place: &mut dyn FnMut(u64, &[u8])) -> Result<(), ProtoError> {
        // Every record is checked before any is acted on.
        let mut recs: SmallVec<[Control<'_>; 4]> = SmallVec::new();
        let mut grant = 0u16;
        for r in wire::records(bytes) {
            let (g, c) = r?;
            grant = grant.checked_add(g).ok_or(ProtoError::Violation("credits past the limit"))?;
            recs.push(c);
        }
        if recs.is_empty() {
            return Err(ProtoError::Violation("an empty message"));
        }
        self.credits.on_receive(grant).map_err(|_| ProtoError::Violation("credits past the limit"))?;
        // The message's credit is held by the last small message in it until that is consumed.
        let last_data = recs.iter().rposition(|c| matches!(c, Control::Data(_)));
        for (i, c) in recs.into_iter().enumerate() {
            self.take_record(c, last_data == Some(i), place)?;
        }
        if last_data.is_none() {
            self.credits.on_buffer_freed();
        }
        Ok(())
    }

    /// A ping-pong's message, taken without the generic loop and the pass: the fill of our one
    /// advertisement, after at most one short advertisement of the peer's (its next receive),
    /// while nothing else is to do (no other receive or advertisement of ours, no send, nothing
    /// unread, no close). What [`Proto::take_control`] and the pass come to then: the
    /// receive's completion, the peer's offer kept, credits. `None`, nothing done, for any
    /// other message or state, or a message the generic path must refuse (it then does).
    pub(super) fn take_lone_fill(
        &mut self,
        bytes: &[u8],
        place: &mut dyn FnMut(u64, &[u8]),
    ) -> Option<Result<(), ProtoError>> {
        let quiet = self.recvs.len() == 1
            && self.ads.len() == 1
            && self.sends.is_empty()
            && self.peer_ads.is_empty()
            && self.early.is_empty()
            && !self.peer_closed
            && self.close_wanted.is_none()
            && self.failed.is_none();
        if !quiet {
            return None;
        }
        let wire::LoneFill { offer, grant, data, truncated } = wire::lone_fill(bytes)?;
        // Every check of the generic path, before anything changes.
        let grant = grant.checked_add(offer.map_or(0, |(g, _)| g))?;
        if let Some((_, a)) = &offer {
            // One the generic path refuses, or one it must reject.
            if a.len > self.small_out || self.small_out == 0 || !self.is_current(a) {
                return None;
            }
        }
        let (ad, r) = (&self.ads[0], &self.recvs[0]);
        let len = data.len() as u32;
        if ad.doomed
            || ad.orphan
            || r.ad != Some(ad.seq)
            || len > ad.len
            || (truncated && self.cfg.kind == SocketKind::Stream)
        {
            return None;
        }
        if self.credits.on_receive(grant).is_err() {
            return Some(Err(ProtoError::Violation("credits past the limit")));
        }
        if let Some((_, mut a)) = offer {
            a.seq = self.next_peer_ad;
            self.next_peer_ad = self.next_peer_ad.wrapping_add(1);
            self.peer_ads.push_back(a);
        }
        self.ads.pop_front();
        let r = self.recvs.pop_front().expect("checked");
        if !data.is_empty() {
            place(r.addr, data);
        }
        self.done(r.req, OpKind::Recv, Ok(len as u64), truncated);
        // The message held no small message: its credit is free.
        self.credits.on_buffer_freed();
        // The pass's other stages have nothing to do: no receive is left, the offer is
        // current and no send waits for it.
        self.return_credits();
        self.shortcut_taken();
        Some(Ok(()))
    }

    pub(super) fn take_record(
        &mut self,
        c: Control<'_>,
        holds_credit: bool,
        place: &mut dyn FnMut(u64, &[u8]),
    ) -> Result<(), ProtoError> {
        match c {
            Control::Data(d) => {
                if d.len() > self.cfg.small_max as usize {
                    return Err(ProtoError::Violation("small message larger than we take"));
                }
                self.unadvertised_arrived();
                self.early.push_back(Early::Bytes(d.to_vec(), 0, holds_credit));
            }
            Control::Fill { data, truncated } => {
                let r = self.answer_ad(data.len() as u32, truncated)?;
                if !data.is_empty() {
                    place(r.addr, data);
                }
                self.done(r.req, OpKind::Recv, Ok(data.len() as u64), truncated);
            }
            Control::Advertise(mut a) => {
                if a.fill_only {
                    // Filled by a record whatever comes: it must fit one.
                    if a.len > self.small_out || self.small_out == 0 {
                        return Err(ProtoError::Violation("a short advertisement larger than a small message"));
                    }
                    a.seq = self.next_peer_ad;
                } else if a.seq != self.next_peer_ad {
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
                        self.unadvertised_recvs += 1;
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
    pub(super) fn answer_ad(&mut self, len: u32, truncated: bool) -> Result<InRecv, ProtoError> {
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

    pub(super) fn take_write(&mut self, note: WriteNote) -> Result<(), ProtoError> {
        self.credits.on_receive(0).map_err(|_| ProtoError::Violation("write without a credit"))?;
        self.credits.on_buffer_freed();
        match note {
            WriteNote::Advertised { len, truncated } => {
                let r = self.answer_ad(len, truncated)?;
                self.done(r.req, OpKind::Recv, Ok(len as u64), truncated);
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
    pub(super) fn unadvertised_arrived(&mut self) {
        self.unadvertised_seen += 1;
        for ad in &mut self.ads {
            ad.doomed = true;
        }
    }

    /// Takes every receive waiting (to complete them otherwise).
    pub(super) fn take_recvs(&mut self) -> VecDeque<InRecv> {
        self.unadvertised_recvs = 0;
        std::mem::take(&mut self.recvs)
    }

    pub(super) fn orphan_ad(&mut self, ad: Option<u32>) {
        if let Some(seq) = ad {
            if let Some(a) = self.ads.iter_mut().find(|a| a.seq == seq) {
                a.orphan = true;
            }
        }
    }

    pub(super) fn serve_recvs(&mut self) {
        while !self.early.is_empty() && !self.recvs.is_empty() {
            let r = self.recvs.pop_front().expect("checked");
            self.unadvertised_recvs -= usize::from(r.ad.is_none());
            self.orphan_ad(r.ad);
            let (got, truncated) = match self.cfg.kind {
                SocketKind::SeqPacket => self.copy_message(&r),
                SocketKind::Stream => self.copy_stream(&r),
            };
            self.done(r.req, OpKind::Recv, Ok(got), truncated);
        }
        if self.peer_closed && self.early.is_empty() {
            // The end of the peer's data: nothing will fill these.
            for r in self.take_recvs() {
                self.orphan_ad(r.ad);
                self.done(r.req, OpKind::Recv, Ok(0), false);
            }
        }
    }

    pub(super) fn copy_message(&mut self, r: &InRecv) -> (u64, bool) {
        match self.early.pop_front() {
            Some(Early::Bytes(b, _, holds)) => {
                let n = (b.len() as u64).min(r.len);
                let truncated = (b.len() as u64) > r.len;
                if n > 0 {
                    let mut b = b;
                    b.truncate(n as usize);
                    self.push_action(Action::Copy { dst: r.addr, src: CopySrc::Bytes(b), len: n });
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

    pub(super) fn copy_stream(&mut self, r: &InRecv) -> (u64, bool) {
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
                        self.push_action(Action::Copy { dst: r.addr + got, src: CopySrc::Bytes(piece), len: n });
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
                    let src = CopySrc::Ring(*offset + *used);
                    *used += n;
                    let finished = (*used == *len).then_some(*end);
                    self.push_action(Action::Copy { dst: r.addr + got, src, len: n });
                    got += n;
                    if let Some(end) = finished {
                        self.early.pop_front();
                        self.ring_in.consume_to(end);
                    }
                }
            }
        }
        (got, false)
    }

    /// Advertises waiting receives in order, while advertisement credits and message credits
    /// last, and never past a receive whose advertisement awaits its rejection (bytes must
    /// land in the order receives were posted). The pass calls it only when some receive has
    /// no advertisement.
    pub(super) fn advertise(&mut self) {
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
            self.advertise_recv(i);
        }
    }

    /// Advertises receive `i` (one without an advertisement, with credits for it).
    fn advertise_recv(&mut self, i: usize) {
        let seq = self.next_ad;
        self.next_ad = self.next_ad.wrapping_add(1);
        let r = &mut self.recvs[i];
        r.ad = Some(seq);
        self.unadvertised_recvs -= 1;
        // A buffer that any small message fills is offered in the short form.
        let fill_only = r.len <= self.cfg.small_max as u64 && self.cfg.small_max > 0;
        let ad = Advert {
            seq,
            unadvertised_seen: self.unadvertised_seen,
            addr: r.addr,
            len: r.len as u32,
            rkey: r.rkey,
            fill_only,
        };
        self.ads.push_back(SentAd { seq, len: ad.len, doomed: false, orphan: false });
        self.queue_control(Control::Advertise(ad));
    }

    /// Advertises a new receive, the only one waiting, when nothing else is to do: what
    /// [`Proto::post_recv`]'s pass would come to (the advertisement, credits), without the
    /// pass. This is a ping-pong's next receive. False, nothing done, in any other state.
    pub(super) fn advertise_lone_recv(&mut self) -> bool {
        // Every other stage of the pass has nothing to do, before the advertisement and after
        // it: nothing arrived unread, no send queued, no stale advertisement to reject.
        let quiet = self.recvs.len() == 1
            && self.early.is_empty()
            && !self.peer_closed
            && self.sends.is_empty()
            && self.peer_ads.front().is_none_or(|ad| self.is_current(ad));
        if !quiet || self.ads.len() as u32 >= self.cfg.adv_credits.max(1) || !self.may_queue(wire::MAX_CONTROL) {
            return false;
        }
        self.advertise_recv(0);
        self.return_credits();
        self.shortcut_taken();
        true
    }
}
