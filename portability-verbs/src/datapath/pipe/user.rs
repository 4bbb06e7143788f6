//! Requests of the layer above on the pipe's queue pair (the RDMA reads of a rendezvous),
//! tagged and handed back by token.

use super::*;

impl MsgPipe {
    /// Posts a request of the caller's on the pipe's queue pair (for example the RDMA read of a
    /// rendezvous), its `wr_id` replaced by a token; its completion is collected by
    /// [`MsgPipe::progress`] and handed out by [`MsgPipe::take_user_completion`].
    pub fn post_user(&mut self, mut wr: SendWr) -> Result<u64> {
        self.check_failed()?;
        let token = self.tag_user(&mut wr);
        self.qp.post_send(&[wr])?;
        self.user_posted();
        Ok(token)
    }

    /// Posts the bulk chunk held back for its announcing frame, if that frame did not take it
    /// along (it waits for room in the ring or a staging buffer): the chunk goes now, ahead of
    /// the frame.
    pub(super) fn post_held_chunk(&mut self) -> Result<()> {
        match self.held_chunk.take() {
            Some(chunk) => self.qp.post_send(&[chunk]),
            None => Ok(()),
        }
    }

    /// Gives a user request the next token as its `wr_id`, signaled (its completion is how
    /// the token is handed back).
    pub(super) fn tag_user(&self, wr: &mut SendWr) -> u64 {
        let token = self.next_user;
        wr.wr_id = wr_id(TAG_USER, token);
        wr.flags.signaled = true;
        token
    }

    /// A user request tagged by [`MsgPipe::tag_user`] was posted and will complete.
    pub(super) fn user_posted(&mut self) {
        self.next_user = (self.next_user + 1) & ((1 << TAG_SHIFT) - 1);
        self.user_in_flight += 1;
    }

    /// Posts a request of the caller's as [`MsgPipe::post_user`] does, unless the provider
    /// carries it out at once ([`QueuePair::post_send_completing`]): then `None`, and there is
    /// no completion to wait for (the software provider's rendezvous reads). Else the token to
    /// wait on.
    pub fn post_user_completing(&mut self, mut wr: SendWr) -> Result<Option<u64>> {
        self.check_failed()?;
        let token = self.tag_user(&mut wr);
        match self.qp.post_send_completing(&wr)? {
            Posted::Completed => Ok(None),
            Posted::Pending => {
                self.user_posted();
                Ok(Some(token))
            }
        }
    }

    /// Requests of the caller's ([`MsgPipe::post_user`]) not settled yet: in flight, or
    /// completed with their status not taken.
    pub fn user_unsettled(&self) -> usize {
        self.user_in_flight + self.user_done.len()
    }

    /// The status of a request posted with [`MsgPipe::post_user`] once it completed, polling
    /// the completion queue even after the pipe failed (where [`MsgPipe::poll_user_completion`]
    /// reports the failure): for a caller that must know its request no longer uses its memory
    /// before it lets the memory go. A failed pipe's queue pair is in error, so every request
    /// of it completes (flushed) soon.
    pub fn settle_user(&mut self, token: u64) -> Option<WcStatus> {
        if let Some(st) = self.take_user_completion(token) {
            return Some(st);
        }
        if let Err(e) = self.poll_completions() {
            self.fail(e);
        }
        self.take_user_completion(token)
    }

    /// The status of a request posted with [`MsgPipe::post_user`], once it completed.
    pub fn take_user_completion(&mut self, token: u64) -> Option<WcStatus> {
        self.user_done.remove(&token)
    }

    /// The status of a request posted with [`MsgPipe::post_user`]: taken at once if it
    /// completed, else after one poll of the completion queue (not a whole
    /// [`MsgPipe::progress`] pass: a waiter for its own read need not move the pipe's flow
    /// control on every poll, and a receiver's read completes at post on the software
    /// provider, so this is the path every zero-copy message takes).
    pub fn poll_user_completion(&mut self, token: u64) -> Result<Option<WcStatus>> {
        if let Some(st) = self.take_user_completion(token) {
            return Ok(Some(st));
        }
        self.check_failed()?;
        let polled = self.poll_completions();
        match self.take_user_completion(token) {
            // Its own status says more than the pipe failure a failed request causes.
            Some(st) => Ok(Some(st)),
            None => polled.map(|()| None).map_err(|e| self.fail(e)),
        }
    }
}
