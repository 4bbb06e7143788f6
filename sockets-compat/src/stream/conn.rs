//! A connection's core: taking in messages, control, failure and close, and what the
//! background engine does with it.

use super::*;
use crate::engine::{Quiet, Visit};

impl Background for Conn {
    /// Leaves a socket the application called into since the engine's last round to the
    /// application, unless a thread waits in a fault: on a loaded machine a third thread
    /// polling a busy socket only steals its CPU and its lock.
    fn background_progress(&mut self) -> Visit {
        let in_flight = self.in_flight();
        let app_active = std::mem::replace(&mut self.calls_seen, self.calls) != self.calls;
        if in_flight && protect::fault_waiters() == 0 && app_active {
            return Visit::AppActive;
        }
        if self.failed.is_none() && in_flight {
            // The application went quiet: what it sent without asking for completions is
            // settled now, or the pipe would count as busy (and this socket be visited every
            // 200 us) until hundreds of these visits passed. Errors are recorded in the
            // socket; its next call reports them.
            let _ = self.pipe.settle_unsignaled().map_err(|e| self.fail_verbs(e));
        }
        if self.failed.is_none() && (in_flight || self.disconnect_pending) {
            let _ = self.pump(); // (sends a pending Disconnect first)
        }
        if self.failed.is_some() {
            self.watched = false; // the engine lets go of it (see `Background`)
            Visit::Idle
        } else if self.in_flight() {
            Visit::Driven
        } else if self.disconnect_pending {
            Visit::Pending
        } else {
            self.watched = false;
            Visit::Idle
        }
    }

    fn quiet_visit(&mut self) -> Quiet {
        if self.closing.is_none() {
            // An application calling into its socket drives it itself.
            if std::mem::replace(&mut self.calls_quiet, self.calls) != self.calls {
                return Quiet::Stirring;
            }
            if self.failed.is_some() {
                return Quiet::Still;
            }
            let moves = |c: &Conn| {
                let s = c.pipe.stats();
                (s.received, s.sent, s.control)
            };
            let before = moves(self);
            // Errors are recorded in the socket; its next call reports them.
            let _ = self.pump_control().and_then(|()| self.send_pending_control());
            let pending = self.disconnect_pending || self.pipe.staged() > 0;
            return if pending || moves(self) != before { Quiet::Stirring } else { Quiet::Still };
        }
        if self.failed.is_none() {
            let _ = self.send_pending_control().and_then(|()| self.pump());
        }
        if self.close_finished() {
            Quiet::Finished
        } else {
            Quiet::Stirring
        }
    }

    fn begin_close(&mut self) {
        self.start_close();
    }
}

impl Conn {
    /// Transfers of ours still under way: sends not completed or staged, SrcAvails not
    /// answered, reads of the peer's memory not landed.
    pub(super) fn in_flight(&self) -> bool {
        !self.proto.sends().is_empty() || !self.reads.is_empty() || !self.pipe.idle()
    }

    /// Sends the Disconnect of `shutdown` and the Close of `close` once flow control admits
    /// them (in that order, each at most once, behind every byte written before).
    pub(super) fn send_pending_control(&mut self) -> io::Result<()> {
        if self.disconnect_pending && self.try_send(&Message::Disconnect)? {
            self.disconnect_pending = false;
        }
        if self.close_pending && !self.disconnect_pending && self.try_send(&Message::Close)? {
            self.close_pending = false;
        }
        self.flush_pipe()
    }

    /// The application let go of the socket: Close follows the bytes written (it is
    /// Disconnect too, and says we read nothing more).
    pub(super) fn start_close(&mut self) {
        if self.closing.is_none() {
            self.closing = Some(Instant::now());
            self.read_shut = true;
            self.close_pending = true;
            // Close says all Disconnect says.
            self.disconnect_pending = false;
            if self.failed.is_none() {
                let _ = self.send_pending_control().and_then(|()| self.pump());
            }
        }
    }

    /// Whether a closed socket is done: the peer took every byte (and read the buffers still
    /// held, for AZ-SDP) after our Close, or closed itself (it reads nothing more), or the
    /// connection failed; or the peer took nothing for [`engine::ORPHAN_LINGER`], and the
    /// connection is reset.
    pub(super) fn close_finished(&mut self) -> bool {
        if self.failed.is_some() || self.pipe.failure().is_some() || self.proto.peer_closed() {
            return true;
        }
        if !self.close_pending && !self.in_flight() {
            return true;
        }
        if self.closing.is_some_and(|t| t.elapsed() >= engine::ORPHAN_LINGER) {
            let why = "the peer took no bytes for as long as a closed socket waits";
            self.abort_locally();
            debug!("SDP socket {} -> {}: {why}", self.local, self.peer);
            return true;
        }
        false
    }

    /// The pipe's [`MsgPipe::prepare_sleep`] (false on an error: the next poll reports it).
    pub(super) fn prepare_sleep(&mut self) -> bool {
        self.pipe.prepare_sleep().unwrap_or(false)
    }

    pub(super) fn max_payload(&self) -> usize {
        self.config.flow.max_message() - BSDH_LEN
    }

    pub(super) fn effective_design(&self) -> Design {
        if self.fell_back {
            Design::Zsdp
        } else {
            self.config.design
        }
    }

    /// Counts the faults a released hold (or lazy range) saw; too many make an AZ-SDP socket
    /// fall back.
    pub(super) fn note_faults(&mut self, faults: u32) {
        self.faults = self.faults.saturating_add(faults);
        if !self.fell_back && self.config.design == Design::AzSdp && self.faults >= self.config.az_fault_limit {
            self.fell_back = true;
            log::info!(
                "SDP socket {} -> {}: {} page faults on held buffers, falling back to ZSDP",
                self.local,
                self.peer,
                self.faults
            );
            // Informational for the peer; a full pipe just skips the announcement.
            let _ = self.try_send(&Message::ModeChange(Design::Zsdp));
        }
    }

    /// Opens the lazily kept send buffer at `index`.
    pub(super) fn open_lazy(&mut self, index: usize) {
        if let Some(lazy) = self.lazy.remove(index) {
            self.note_faults(lazy.faults());
        }
    }

    /// Opens every lazily kept send buffer (the application may unmap them afterwards).
    pub(super) fn open_all_lazy(&mut self) {
        while !self.lazy.is_empty() {
            self.open_lazy(0);
        }
    }

    /// Ends every transfer in flight at once: the queue pair goes to error first, so nothing
    /// can still read or write the buffers, then the holds and registrations are dropped.
    pub(super) fn release_all(&mut self) {
        self.open_all_lazy();
        if self.proto.sends().is_empty() && self.reads.is_empty() {
            return;
        }
        let _ = self.pipe.qp().modify(portability_verbs::QpTransition::Error);
        self.proto.drop_sends();
        self.reads.clear();
    }

    /// The peer closed (it reads and sends nothing more) and nothing of ours waits for it: no
    /// SrcAvail of ours unanswered, no read of its memory in flight or still to start.
    pub(super) fn nothing_needs_the_peer(&self) -> bool {
        self.proto.peer_closed()
            && self.proto.sends().is_empty()
            && self.reads.is_empty()
            && self.proto.rx().iter().all(|item| matches!(item, RxItem::Bytes(..)))
    }

    pub(super) fn check_ok(&self) -> io::Result<()> {
        match &self.failed {
            Some((kind, why)) => Err(io::Error::new(*kind, why.clone())),
            None => Ok(()),
        }
    }

    pub(super) fn check_writable(&self) -> io::Result<()> {
        self.check_ok()?;
        if self.write_shut {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, "socket shut down for writing"));
        }
        if self.proto.peer_closed() {
            // TCP would answer the bytes with a reset, and the next write would see EPIPE.
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, "the peer closed the connection"));
        }
        Ok(())
    }

    pub(super) fn fail(&mut self, kind: io::ErrorKind, why: String) -> io::Error {
        if self.failed.is_none() {
            debug!("SDP socket {} -> {} failed: {why}", self.local, self.peer);
            self.failed = Some((kind, why));
            // Never leave application buffers inaccessible behind a dead connection.
            self.release_all();
        }
        let (k, w) = self.failed.clone().expect("set");
        io::Error::new(k, w)
    }

    /// Fails the socket on a transport error: a peer that closed and left (its Close taken,
    /// nothing of ours waiting for it) ends the connection instead (`ended_by_peer`).
    pub(super) fn fail_verbs(&mut self, e: VerbsError) -> io::Error {
        let gone = self.failed.is_none() && matches!(e, VerbsError::PeerUnreachable(_));
        if gone && !self.proto.peer_closed() && !self.taking_last_words {
            // Any call may find the peer gone before its Close, delivered earlier, was taken
            // in: take in what it sent first, then judge.
            self.taking_last_words = true;
            while let Ok(true) = self.take_one() {}
            self.taking_last_words = false;
        }
        if gone && self.failed.is_none() && self.nothing_needs_the_peer() {
            self.ended_by_peer = true;
            return self.fail(io::ErrorKind::BrokenPipe, format!("the peer closed the connection (then: {e})"));
        }
        let kind = match &e {
            VerbsError::Timeout(_) => io::ErrorKind::TimedOut,
            _ => io::ErrorKind::ConnectionReset,
        };
        self.fail(kind, format!("connection lost: {e}"))
    }

    /// Stops all traffic at once: the queue pair goes to error, so the peer can no longer read
    /// any buffer we advertised.
    pub(super) fn abort_locally(&mut self) {
        let _ = self.pipe.qp().modify(portability_verbs::QpTransition::Error);
        self.fail(io::ErrorKind::ConnectionAborted, "connection aborted".into());
    }

    pub(super) fn try_send(&mut self, m: &Message<'_>) -> io::Result<bool> {
        self.check_ok()?;
        self.proto.encode(m, &mut self.tx);
        match self.pipe.try_send(&self.tx) {
            Ok(true) => Ok(true),
            Ok(false) => {
                self.proto.unsend();
                Ok(false)
            }
            Err(e) => Err(self.fail_verbs(e)),
        }
    }

    /// Finishes the RDMA reads that completed, in order: releases their holds and answers
    /// the adverts they ended.
    pub(super) fn complete_reads(&mut self) -> io::Result<()> {
        if self.reads.is_empty() {
            return Ok(());
        }
        self.pipe.progress().map_err(|e| self.fail_verbs(e))?;
        while let Some(front) = self.reads.front() {
            match self.pipe.take_user_completion(front.token) {
                None => break,
                Some(WcStatus::Success) => {
                    let r = self.reads.pop_front().expect("front");
                    if let Some(h) = &r.hold {
                        self.note_faults(h.faults());
                        self.rx_holds.landed(r.ran_into || h.faults() > 0);
                    }
                    drop(r.hold);
                    if let Some(n) = r.answer {
                        self.answer_read(n)?;
                    }
                }
                Some(st) => {
                    // The peer advertised memory it does not let us read.
                    let _ = self.try_send(&Message::Abort);
                    let _ = self.pipe.flush();
                    return Err(self.fail(
                        io::ErrorKind::ConnectionAborted,
                        format!("the peer's SrcAvail could not be read: {st:?}"),
                    ));
                }
            }
        }
        Ok(())
    }

    pub(super) fn flush_pipe(&mut self) -> io::Result<()> {
        self.pipe.flush().map_err(|e| self.fail_verbs(e))
    }

    /// Takes in every message that has arrived, queueing stream content and applying control.
    pub(super) fn pump(&mut self) -> io::Result<()> {
        self.pump_until(None)
    }

    /// [`Conn::pump`] for a reader with `reader_room` bytes of buffer: stops at stream bytes it
    /// copies straight out of the pipe next (bulk-lane bytes, a Data message that fits). Taking
    /// them into the queue would cost a copy and an allocation, and once it holds anything every
    /// later message would follow the same way.
    pub(super) fn pump_until(&mut self, reader_room: Option<usize>) -> io::Result<()> {
        self.check_ok()?;
        if self.disconnect_pending || self.close_pending {
            self.send_pending_control()?;
        }
        if self.pipe.staged() > 0 {
            self.flush_pipe()?;
        }
        loop {
            // A reader stops only with nothing queued: what is queued goes first, and may wait
            // for control further on (a SrcAvail's update). The check looks at the pipe once:
            // an item arriving after it waits for the next pump, where a second look would take
            // it into the queue. (After Disconnect, stream bytes are a protocol error: taken in,
            // they fail the socket.)
            if let Some(room) = reader_room {
                if !self.proto.eof() && self.proto.rx().is_empty() {
                    match self.front_is_direct(room) {
                        Some(false) => {}
                        Some(true) | None => {
                            self.complete_reads()?;
                            return self.copy_on_write();
                        }
                    }
                }
            }
            if !self.take_one()? {
                self.complete_reads()?;
                return self.copy_on_write();
            }
        }
    }

    /// Takes in the next message or bulk bytes, if any arrived; whether one did.
    pub(super) fn take_one(&mut self) -> io::Result<bool> {
        let mut outcome: Result<Event<Sending>, ProtoError> = Ok(Event::None);
        let got = {
            let proto = &mut self.proto;
            self.pipe.recv_lane(|lane, bytes| {
                outcome = match lane {
                    Lane::Message => proto.on_message(bytes),
                    Lane::Bulk => proto.on_bulk(bytes).map(|()| Event::None),
                }
            })
        };
        match got {
            Ok(Some(())) => {}
            Ok(None) => return Ok(false),
            Err(e) => return Err(self.fail_verbs(e)),
        }
        match outcome {
            Ok(event) => self.apply(event)?,
            Err(e) => {
                // The peer broke the protocol: tell it, then fail.
                let _ = self.try_send(&Message::Abort);
                let _ = self.pipe.flush();
                return Err(self.fail(io::ErrorKind::InvalidData, e.to_string()));
            }
        }
        Ok(true)
    }

    /// Takes in the control messages that arrived, up to the first stream bytes (left in the
    /// pipe for the application's read: taking them would cost a copy and let the peer send
    /// more than the receive buffers hold). What the background engine does for a socket
    /// whose application is busy elsewhere: a peer's SrcAvailCancel is answered, its Close
    /// seen.
    pub(super) fn pump_control(&mut self) -> io::Result<()> {
        self.check_ok()?;
        loop {
            let stream_bytes = match self.pipe.front() {
                Ok(Some((Lane::Bulk, _))) | Ok(None) => true,
                Ok(Some((Lane::Message, bytes))) => self.proto.next_data(bytes).is_some(),
                Err(_) => false, // taken (and failed on) below
            };
            if stream_bytes || !self.take_one()? {
                break;
            }
        }
        self.complete_reads()?;
        self.copy_on_write()
    }

    /// Does what an incoming message asks.
    pub(super) fn apply(&mut self, event: Event<Sending>) -> io::Result<()> {
        match event {
            Event::None => {}
            Event::Answered { sent, read } => {
                self.answered_at = Instant::now();
                match sent.what {
                    Sending::Waited => self.zcopy_answer = Some(read),
                    Sending::Copied { .. } => {}
                    Sending::Held { hold, reg, .. } => {
                        self.note_faults(hold.faults());
                        drop(reg);
                        // SAFETY: the buffer stays mapped until `flush`, `wait_transfers` or
                        // close, by the AZ-SDP contract (module docs), and each of those opens
                        // `lazy` first.
                        if let Some(lazy) = unsafe { hold.release_lazily() } {
                            self.lazy.push_back(lazy);
                            if self.lazy.len() > LAZY_MAX {
                                self.open_lazy(0);
                            }
                        }
                    }
                }
            }
            Event::Withdrawn { done } => {
                // Answered with what was read, after the reads already started on it landed.
                self.finish_reads()?;
                self.answer_read(done)?;
            }
            Event::Aborted => {
                return Err(self.fail(io::ErrorKind::ConnectionReset, "the peer aborted the connection".into()))
            }
        }
        Ok(())
    }

    pub(super) fn answer_read(&mut self, n: u32) -> io::Result<()> {
        self.send_now(&Message::RdmaRdCompl { len: n })
    }

    /// Sends a control message from inside the protocol (no caller to come back later),
    /// driving the pipe until flow control admits it.
    pub(super) fn send_now(&mut self, m: &Message<'_>) -> io::Result<()> {
        let deadline = Instant::now() + SETUP_TIMEOUT;
        while !self.try_send(m)? {
            self.pipe.progress().map_err(|e| self.fail_verbs(e))?;
            if Instant::now() > deadline {
                return Err(self.fail(io::ErrorKind::TimedOut, "no credit to send a control message".into()));
            }
        }
        self.flush_pipe()
    }

    /// Sends a SrcAvail for `advert` if flow control admits it now, taking `what` (left in
    /// place otherwise) into the queue of SrcAvails awaiting an answer under its number.
    pub(super) fn advertise(&mut self, advert: Advert, what: &mut Option<Sending>) -> io::Result<()> {
        if self.try_send(&Message::SrcAvail(advert))? {
            self.proto.advertised(advert.len, what.take().expect("something to advertise"));
        }
        Ok(())
    }
}
