//! The receiving side of a connection as plain state: which message is due, how far the one
//! being unpacked got, which rendezvous is due and how many were released, and the checks an
//! unpack makes against what was packed. The unpacker (`channel::unpacker`) takes the records
//! out of the pipe and the bytes into the application's buffers.

use super::mismatch::Mismatch;
use crate::wire::Modes;

/// A message that came whole (its packs' records are in [`RecvSide::body`], or a large `One`
/// message's bytes still in the pipe): how far they were unpacked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WholeMsg {
    pub at: usize,
    /// Records taken (by unpacks, matching or not).
    pub taken: u32,
    pub packs: u32,
    /// A `One` message: the pack's modes (the buffer holds its bytes alone, unless...)
    pub single: Option<Modes>,
    /// ...its bytes (this many) are still at the head of the connection, for its unpack to
    /// copy straight into the application's buffer.
    pub in_pipe: Option<usize>,
}

impl WholeMsg {
    /// A message of `packs` packs whose records were taken out of the pipe at once.
    pub fn of(packs: u32) -> WholeMsg {
        WholeMsg { at: 0, taken: 0, packs, single: None, in_pipe: None }
    }

    /// A message of one pack sent with `modes`, its bytes alone in the buffer.
    pub fn single(modes: Modes) -> WholeMsg {
        WholeMsg { at: 0, taken: 0, packs: 1, single: Some(modes), in_pipe: None }
    }

    /// A message of one pack sent with `modes`, its `len` bytes left in the pipe.
    pub fn single_in_pipe(modes: Modes, len: usize) -> WholeMsg {
        WholeMsg { in_pipe: Some(len), ..WholeMsg::single(modes) }
    }

    /// Bytes of a `One` message's pack (`body_len`: what the buffer holds).
    pub fn single_len(&self, body_len: usize) -> usize {
        self.in_pipe.unwrap_or(body_len)
    }
}

/// A message that came out of order: `got` where `due` was due.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OutOfSequence {
    pub got: u32,
    pub due: u32,
}

/// A rendezvous record that is not the one the sender issued next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RendezvousOutOfOrder {
    pub got: u32,
    pub due: u32,
}

/// The receiving direction of a connection, held by an unpacker for a whole message.
#[derive(Debug)]
pub(crate) struct RecvSide {
    /// Sequence number of the next message.
    pub seq: u32,
    /// The records of a message that came whole, taken out of the pipe at once.
    pub body: Vec<u8>,
    // The message being unpacked (here rather than in the `Unpacker`, which is returned by
    // value on every message and so stays a few words).
    /// Unpacks so far.
    pub unpacks: u32,
    /// The message's `End` (its pack count), once taken.
    pub end: Option<u32>,
    /// The message, if it came whole (its records are in `body`).
    pub whole: Option<WholeMsg>,
    /// `end_unpacking` ran (or the unpacker was dropped).
    pub finished: bool,
    /// The id of the sender's next rendezvous (they come in the order it issued them)...
    pub rdv_next: u32,
    /// ...and how many we told it we read (`Unpacker::release`).
    pub rdv_released: u32,
    /// Mismatches reported to the sender so far (the count in each notice)...
    pub notices: u32,
    /// ...the last of them about this message (sequence number).
    pub told: Option<u32>,
    /// Our claim word as the peer's last offer left it (what our next claim expects).
    pub claim_word: u64,
}

impl Default for RecvSide {
    fn default() -> Self {
        RecvSide {
            seq: 0,
            body: Vec::new(),
            unpacks: 0,
            end: None,
            whole: None,
            finished: true,
            rdv_next: 0,
            rdv_released: 0,
            notices: 0,
            told: None,
            claim_word: super::offer::NONE,
        }
    }
}

impl RecvSide {
    /// Begins message `seq` (`whole`: it came whole): it must be the one due.
    #[inline]
    pub fn begin(&mut self, seq: u32, whole: Option<WholeMsg>) -> Result<(), OutOfSequence> {
        if seq != self.seq {
            return Err(OutOfSequence { got: seq, due: self.seq });
        }
        (self.unpacks, self.end, self.whole, self.finished) = (0, None, whole, false);
        Ok(())
    }

    /// Checks a pack `sent` with `sent_len` bytes against the current unpack, which asks for
    /// `len` bytes with modes `asked`.
    #[inline]
    pub fn check(&self, sent: Modes, sent_len: u64, asked: Modes, len: usize) -> Result<(), Mismatch> {
        let pack = self.unpacks;
        if sent != asked {
            return Err(Mismatch::Modes { pack, sent, asked });
        }
        if sent_len != len as u64 {
            return Err(Mismatch::Size { pack, sent: sent_len, asked: len as u64 });
        }
        Ok(())
    }

    /// Counts rendezvous `id`, which must be the one the sender issued next.
    pub fn note_rdv(&mut self, id: u32) -> Result<(), RendezvousOutOfOrder> {
        let due = self.rdv_next;
        if id != due {
            return Err(RendezvousOutOfOrder { got: id, due });
        }
        self.rdv_next = due.wrapping_add(1);
        Ok(())
    }

    /// Whether the pack just read was the message's last (its sender's buffers may then be
    /// released before `end_unpacking`).
    pub fn read_last(&self) -> bool {
        match self.whole {
            Some(w) => w.taken == w.packs,
            None => self.end == Some(self.unpacks),
        }
    }

    /// Ends a `One` message whose pack was unpacked, with no rendezvous left to release:
    /// nothing to check (the unpack was). False for any other message.
    #[inline]
    pub fn end_single(&mut self) -> bool {
        let single = !self.finished
            && self.rdv_next == self.rdv_released
            && self.unpacks == 1
            && matches!(self.whole, Some(WholeMsg { single: Some(_), taken: 1, .. }));
        if single {
            self.next_message();
        }
        single
    }

    /// Checks the end of the message: `packs` were sent, `extra` of them not unpacked. (Then
    /// [`RecvSide::next_message`], whatever the outcome: a mismatch is about this message.)
    pub fn check_end(&self, packs: u32, extra: u32) -> Result<(), Mismatch> {
        if packs != self.unpacks || extra > 0 {
            return Err(Mismatch::Count { packs, unpacks: self.unpacks });
        }
        Ok(())
    }

    /// The message is over: the next one is due.
    #[inline]
    pub fn next_message(&mut self) {
        self.finished = true;
        self.seq = self.seq.wrapping_add(1);
    }
}
