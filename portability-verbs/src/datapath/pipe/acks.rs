//! The acknowledgement slots: ring acknowledgements, release counts and notices written into
//! the peer's slots (stored through a window, or posted as counted sends).

use super::*;

/// Reads the latest notice the peer of a pipe sent ([`MsgPipe::notice_to`]): all zero before
/// the first. The last word is read first: a notice whose last word has changed is complete.
#[derive(Debug, Clone)]
pub struct NoticeBoard {
    slots: Arc<MemoryRegion>,
}

impl NoticeBoard {
    /// The notice's last word alone (one load: what a caller compares with the last one it saw).
    #[inline]
    pub fn last_word(&self) -> u64 {
        self.slots.read_u64(ACK_NOTICE + 8 * (NOTICE_WORDS - 1))
    }

    /// The whole latest notice.
    pub fn read(&self) -> [u64; NOTICE_WORDS] {
        let mut w = [0u64; NOTICE_WORDS];
        w[NOTICE_WORDS - 1] = self.last_word();
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        for (i, x) in w.iter_mut().take(NOTICE_WORDS - 1).enumerate() {
            *x = self.slots.read_u64(ACK_NOTICE + 8 * i);
        }
        w
    }
}

impl MsgPipe {
    /// Tells the peer how far we consumed one of our rings (RDMA write into its ack slot).
    pub(super) fn write_ack(&mut self, lane: Lane) -> Result<()> {
        let (pos, src, dst) = match lane {
            Lane::Message => (self.ring_rx.take_ack(), ACK_RING_SRC, ACK_RING),
            Lane::Bulk => (self.bulk_rx.take_ack(), ACK_BULK_SRC, ACK_BULK),
        };
        self.post_ack_word(src, dst, pos)
    }

    /// Writes `word` into the peer's acknowledgement slot `dst`: stored through the window onto
    /// the peer's slots where there is one (no request, no completion), else as a posted inline
    /// RDMA write from our slot `src`, counted in the send window like every other send.
    ///
    /// Counted, because a reader that keeps finding messages writes acknowledgements without
    /// ever passing through a full progress pass: were each signaled, their completions would
    /// pile up in the completion queue until it overran. Counted sends raise a completion only
    /// every [`SIGNAL_EVERY`], and once the window is full the completions are taken here, so
    /// the queue holds at most a window's worth whatever the reader does.
    pub(super) fn post_ack_word(&mut self, src: usize, dst: usize, word: u64) -> Result<()> {
        if let Some(window) = &self.ack_window {
            match window.write(dst, &[&word.to_ne_bytes()]) {
                Ok(()) => self.stats.control += 1,
                // The peer's queue pair is gone: closed once its last bytes were in our rings
                // (a sender's writes complete when placed), or failed. What it sent is still
                // ours to read and needs no acknowledgement; what we send it fails by itself.
                Err(WcStatus::RetryExcErr) => {}
                Err(st) => return Err(VerbsError::PeerUnreachable(format!("acknowledgement write failed: {st:?}"))),
            }
            return Ok(());
        }
        let (addr, rkey) = self.peer_acks.ok_or_else(|| VerbsError::Protocol("acknowledgement before setup".into()))?;
        if self.outstanding >= self.strategy.send_slots() {
            self.poll_completions()?;
        }
        self.ack_mr.write(src, &word.to_ne_bytes());
        let sge = self.ack_mr.sge(src, 8);
        self.post_inline_counted(SendWr::write(0, &[sge], addr + dst as u64, rkey))?;
        self.stats.control += 1;
        Ok(())
    }

    /// Sets the count the peer reads with [`MsgPipe::peer_released`]: a cumulative counter of
    /// the layer above (Madeleine's: how many of the peer's zero-copy buffers it has read), in
    /// the peer's acknowledgement slots rather than in a message. So it takes no ring space or
    /// credit, never waits behind messages the peer has not read yet, and costs the peer one
    /// load to look at. The latest write wins: callers keep it monotone. It wakes no sleeper:
    /// a peer waiting for it polls (or naps).
    pub fn release_to(&mut self, count: u64) -> Result<()> {
        self.check_failed()?;
        self.post_ack_word(ACK_RELEASE_SRC, ACK_RELEASE, count).map_err(|e| self.fail(e))
    }

    /// Tells the peer something out of band: `words`, of which the last should change with
    /// every notice (a count), land in the peer's notice slot, the last word placed last, where
    /// its [`NoticeBoard`] reads them without taking anything out of the pipe. Like
    /// [`MsgPipe::release_to`] it takes no ring space or credit, never waits behind messages,
    /// wakes nobody, and the latest notice overwrites an earlier one not yet read. (Madeleine's
    /// receiver tells the sender of a message that it unpacked it differently than packed.)
    pub fn notice_to(&mut self, words: [u64; NOTICE_WORDS]) -> Result<()> {
        self.check_failed()?;
        let mut bytes = [0u8; 8 * NOTICE_WORDS];
        for (b, w) in bytes.chunks_exact_mut(8).zip(words) {
            b.copy_from_slice(&w.to_ne_bytes());
        }
        let sent = if let Some(window) = &self.ack_window {
            window
                .write(ACK_NOTICE, &[&bytes])
                .map_err(|st| VerbsError::PeerUnreachable(format!("notice write failed: {st:?}")))
        } else {
            let (addr, rkey) = match self.peer_acks {
                Some(p) => p,
                None => return Err(VerbsError::Protocol("a notice before setup".into())),
            };
            if self.outstanding >= self.strategy.send_slots() {
                self.poll_completions()?;
            }
            self.ack_mr.write(ACK_NOTICE_SRC, &bytes);
            let sge = self.ack_mr.sge(ACK_NOTICE_SRC, bytes.len());
            self.post_inline_counted(SendWr::write(0, &[sge], addr + ACK_NOTICE as u64, rkey))
        };
        sent.map_err(|e| self.fail(e))?;
        self.stats.control += 1;
        Ok(())
    }

    /// A reader of the notices the peer sends with [`MsgPipe::notice_to`], usable without the
    /// pipe (from another thread, with no lock).
    pub fn notice_board(&self) -> NoticeBoard {
        NoticeBoard { slots: self.ack_mr.clone() }
    }

    /// The count the peer last set with [`MsgPipe::release_to`] (0 before it set any).
    #[inline]
    pub fn peer_released(&self) -> u64 {
        self.ack_mr.read_u64(ACK_RELEASE)
    }

    /// Sets the word the peer reads with [`MsgPipe::peer_copy_out`]: what copying out of our
    /// bulk ring has cost us so far ([`crate::datapath::CopyOut::word`]), so that the peer,
    /// choosing how to store into it, counts both ends' copies. Out of band, latest wins, as
    /// [`MsgPipe::release_to`].
    pub fn report_copy_out(&mut self, word: u64) -> Result<()> {
        self.check_failed()?;
        self.post_ack_word(ACK_COPY_OUT_SRC, ACK_COPY_OUT, word).map_err(|e| self.fail(e))
    }

    /// The word the peer last set with [`MsgPipe::report_copy_out`] (0 before it set any).
    #[inline]
    pub fn peer_copy_out(&self) -> u64 {
        self.ack_mr.read_u64(ACK_COPY_OUT)
    }
}
