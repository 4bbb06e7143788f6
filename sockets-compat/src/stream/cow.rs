//! AZ-SDP copy-on-write: the lock word per SrcAvail, and copying a buffer aside.

use super::*;

impl Conn {
    /// Takes the lock word of the SrcAvail at the front of the queue before its first read:
    /// `false` if the peer took it first (it copies the buffer aside and re-advertises it: wait
    /// for its SrcAvailUpdate).
    pub(super) fn claim_front(&mut self) -> io::Result<bool> {
        let Some(RxItem::Src(src)) = self.proto.rx().front() else { return Ok(true) };
        if src.claimed {
            return Ok(true);
        }
        let index = src.index;
        let Some(locks) = &self.locks else { return Ok(true) }; // the peer cannot copy
        let off = 8 * (index % LOCK_WORDS) as usize;
        let old = locks.local_atomic(off, |w| lock::receiver_take(w, index)).map_err(|e| self.fail_verbs(e))?;
        match lock::receiver_claim(old, index) {
            ReceiverClaim::Won => {
                if let Some(RxItem::Src(src)) = self.proto.rx_front_mut() {
                    src.claimed = true;
                }
                Ok(true)
            }
            ReceiverClaim::Moved => Ok(false),
            ReceiverClaim::Corrupt => {
                let why = format!("lock word of SrcAvail {index} holds {old:#x}");
                Err(self.fail(io::ErrorKind::InvalidData, why))
            }
        }
    }

    /// AZ-SDP copy-on-write, the sender's side: when a thread waits in the fault handler to
    /// write a buffer of ours the peer has not read yet, take its lock word at the peer by
    /// compare-and-swap; if we win, copy the buffer aside, release the application's pages and
    /// re-advertise the copy (SrcAvailUpdate). If the peer took the word first it is reading
    /// the buffer, and the writer waits for that. One compare-and-swap in flight at a time.
    pub(super) fn copy_on_write(&mut self) -> io::Result<()> {
        if !self.send_updates()? {
            return Ok(());
        }
        // Our lock memory holds the compare-and-swap results (a peer announcing a table to a
        // socket without one is ignored).
        let Some(table) = self.proto.peer_locks().filter(|_| self.config.az_copy_on_write && self.locks.is_some())
        else {
            return Ok(());
        };
        if let Some((index, token, expected)) = self.cow_try {
            self.pipe.progress().map_err(|e| self.fail_verbs(e))?;
            match self.pipe.take_user_completion(token) {
                None => return Ok(()),
                Some(WcStatus::Success) => self.cow_try = None,
                Some(st) => {
                    let why = format!("the peer's lock table could not be reached: {st:?}");
                    return Err(self.fail(io::ErrorKind::ConnectionAborted, why));
                }
            }
            let old = self.locks.as_ref().expect("checked above").read_u64(CAS_RESULT);
            let Some(i) = self.proto.sends().iter().position(|o| o.index == index) else { return Ok(()) };
            match lock::sender_claim(old, expected, index) {
                SenderClaim::Won => return self.copy_aside(i),
                SenderClaim::Reading => {
                    // The peer is reading it: the writer waits for its answer.
                    if let Some(Sending::Held { lost, .. }) = self.proto.send_mut(i).map(|o| &mut o.what) {
                        *lost = true;
                    }
                }
                // The word held an older SrcAvail's value than we guessed: try again with it.
                SenderClaim::Retry(old) => return self.try_lock(table, index, old),
            }
        }
        // A store that has waited longer than copying the buffer would take, while the peer
        // answered none of our SrcAvails: it is not reading (a peer that is, even behind other
        // buffers of ours, ends the wait sooner than copies would).
        // The clock only once a store waits: `pump` runs on every socket call. No thread stopped
        // in the fault handler, no store waits on any hold (one load instead of a look at
        // every outstanding hold's counter, lines the fault handler and other threads write).
        if protect::fault_waiters() == 0 {
            return Ok(());
        }
        let (mut now, answered_at) = (None, self.answered_at);
        let wanted = self.proto.sends_mut().find_map(|o| match &mut o.what {
            Sending::Held { hold, lost: false, waited_since, .. } if hold.faults() > 0 => {
                let now = *now.get_or_insert_with(Instant::now);
                let since = (*waited_since.get_or_insert(now)).max(answered_at);
                (now - since >= copy_cost(hold.len())).then_some(o.index)
            }
            _ => None,
        });
        if let Some(index) = wanted {
            self.try_lock(table, index, lock::sender_guess(index, table.len as u64 / 8))?;
        }
        Ok(())
    }

    /// Posts the compare-and-swap that takes SrcAvail `index`'s lock word in the peer's
    /// `table`, if it holds `expected`.
    pub(super) fn try_lock(&mut self, table: Advert, index: u64, expected: u64) -> io::Result<()> {
        let locks = self.locks.as_ref().expect("copy_on_write checks our lock memory first");
        let word = table.addr + 8 * (index % (table.len as u64 / 8));
        let mine = lock::word(index, Taker::Sender);
        let wr = SendWr::compare_and_swap(0, locks.sge(CAS_RESULT, 8), word, table.rkey, expected, mine);
        let token = self.pipe.post_user(wr).map_err(|e| self.fail_verbs(e))?;
        self.cow_try = Some((index, token, expected));
        Ok(())
    }

    /// We hold the lock word of our SrcAvail at `i` (of `proto.sends()`): copy its buffer
    /// aside, let the application have its pages back, and tell the peer where the bytes are
    /// now.
    pub(super) fn copy_aside(&mut self, i: usize) -> io::Result<()> {
        let rt = runtime()?;
        let Some(Sending::Held { hold, .. }) = self.proto.sends().get(i).map(|o| &o.what) else { return Ok(()) };
        let mut copy = vec![0u8; hold.len()].into_boxed_slice();
        // SAFETY: the held pages are read-only, not inaccessible (a receive into them waits for
        // this send), so plain loads do not fault; pages unmapped against the contract are
        // reported instead of crashing.
        let ((), intact) =
            protect::guarded_read(|| unsafe { copy_bytes(copy.as_mut_ptr(), hold.addr() as *const u8, copy.len()) });
        if !intact {
            return Err(self.fail(io::ErrorKind::ConnectionAborted, "a held send buffer was unmapped".into()));
        }
        let mr = rt.pd.register(copy, AccessFlags::REMOTE_READ).map_err(verbs_io)?;
        let advert = Advert { len: mr.len() as u32, rkey: mr.rkey(), addr: mr.addr() };
        let sent = self.proto.send_mut(i).expect("looked up above");
        let index = sent.index;
        let held = std::mem::replace(&mut sent.what, Sending::Copied { _copy: mr });
        if let Sending::Held { hold, reg, .. } = held {
            self.note_faults(hold.faults());
            drop(reg);
            drop(hold); // the writer waiting in the fault handler goes on
        }
        self.cow_unsent.push_back((index, advert));
        self.send_updates()?;
        self.flush_pipe()
    }

    /// Sends the SrcAvailUpdates waiting for flow control, in order; `false` if some still wait.
    pub(super) fn send_updates(&mut self) -> io::Result<bool> {
        while let Some(&(index, advert)) = self.cow_unsent.front() {
            if !self.try_send(&Message::SrcAvailUpdate { index, advert })? {
                return Ok(false);
            }
            self.cow_unsent.pop_front();
        }
        Ok(true)
    }
}

/// What copying `len` bytes aside costs (a fresh buffer's page faults and the copy: about
/// 20 us plus 4 bytes a nanosecond): a store waits this long for the peer's read before an
/// AZ-SDP sender copies the buffer instead.
pub(super) fn copy_cost(len: usize) -> Duration {
    Duration::from_nanos(20_000 + len as u64 / 4)
}
