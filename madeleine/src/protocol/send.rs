//! The sending side of a connection as plain state: the message being packed, the pipe
//! message being filled, and the decisions the packer asks for (how a pack travels, whether it
//! goes whole into the current pipe message, how a message is framed and numbered). The
//! packer (`channel::packer`) moves the bytes: it sends [`SendSide::agg`] when told to flush.

use std::time::Instant;

use portability_verbs::datapath::AdaptiveCrossover;

use super::OfferPolicy;
use crate::wire::{self, Modes, Record};
use crate::{RecvMode, SendMode};

/// Packs from this size on that open a message, packed `Cheaper`, are not copied into it: if
/// the message turns out to be that pack alone, its bytes go from the application's buffer
/// straight into the pipe's frame ([`SendSide::gathers`]). Below it the copy costs less than
/// the frame's extra part: gathered, 8-64 B one way took 0.015-0.03 us longer between
/// processes though a message ran fewer instructions; from 256 B on it took less (decision
/// 026).
pub(crate) const GATHER_MIN: usize = 256;

/// Bulk packs below the large ones that their crossover times: one in this many (and the
/// receiver times as many of its copies out of the bulk lane).
pub(crate) const SMALL_PACK_SAMPLE: u32 = 4;

/// How a pack travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    /// Copied into pipe messages.
    Inline,
    /// Copied through the bulk lane.
    Bulk,
    /// Read by the receiver from the sender's memory (zero-copy).
    Rendezvous,
}

/// A connection's limits, fixed at set-up.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Packs from this size on may go zero-copy (the session's setting or the probe's).
    pub threshold: usize,
    /// The largest pipe message.
    pub max_msg: usize,
    /// The largest bulk-lane chunk (0: no bulk lane).
    pub bulk_chunk: usize,
}

impl Limits {
    /// Whether a pack of `len` bytes is more than fits one pipe message with its records.
    #[inline]
    pub fn too_large_for_a_message(&self, len: usize) -> bool {
        len > self.max_msg - 3 * wire::HEADER
    }
}

/// How a message ends on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Framing {
    /// One inline pack, alone: a `One` record (its header over the pack's `Inline` header).
    One,
    /// Every record in one pipe message: a `Whole` header over the `Begin` one.
    Whole,
    /// Records spread over pipe messages: an `End` closes them.
    End,
}

/// A step of an inline pack that does not fit the pipe message being filled whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum InlineStep {
    /// Send the pipe message being filled first.
    Flush,
    /// Append the next `n` bytes as one fragment (`last`: the pack's end).
    Fragment { n: usize, last: bool },
}

/// The sending direction of a connection, held by a packer for a whole message.
#[derive(Debug)]
pub(crate) struct SendSide {
    /// Sequence number of the next message.
    pub seq: u32,
    /// Records of the pipe message being filled.
    pub agg: Vec<u8>,
    /// Copy or zero-copy for large packs, from the probe and the copies timed since...
    pub crossover: AdaptiveCrossover,
    /// ...and the stores of the bulk packs below them
    /// ([`AdaptiveCrossover::for_smaller_packs`]), which times one such pack in
    /// [`SMALL_PACK_SAMPLE`] (two clock reads are not free at their size).
    pub small_crossover: AdaptiveCrossover,
    small_packs: u32,
    // The message being packed (here rather than in the `Packer`, which is returned by value
    // on every message and so stays a few words).
    /// Packs so far.
    pub packs: u32,
    /// Part of the message was handed to the network already (it cannot go whole).
    pub flushed: bool,
    /// Modes of the last pack appended whole inline (a message of that pack alone goes as
    /// one `One` record).
    pub inline_modes: Modes,
    /// `end_packing` ran (or the packer was dropped).
    pub finished: bool,
    /// The last word of the peer's latest mismatch report that was returned to a packer.
    pub notice_seen: u64,
    /// The connection carried packs that go as one pipe message only while the peer keeps
    /// up (`Conn::frame_while_caught_up`): each message then looks whether it does.
    pub mid_packs: bool,
    /// The message being packed keeps to the smaller messages of a peer that reads behind us.
    pub behind: bool,
    /// Which bulk packs of blocking sends go as offers.
    pub offers: OfferPolicy,
}

impl SendSide {
    /// A side with no message begun; pipe messages of up to `max_msg` bytes.
    pub fn new(max_msg: usize, crossover: AdaptiveCrossover) -> SendSide {
        SendSide {
            seq: 0,
            agg: Vec::with_capacity(max_msg),
            crossover,
            small_crossover: AdaptiveCrossover::for_smaller_packs(),
            small_packs: 0,
            packs: 0,
            flushed: false,
            inline_modes: Modes { send: SendMode::Safer, recv: RecvMode::Express },
            finished: true,
            notice_seen: 0,
            mid_packs: false,
            behind: false,
            offers: OfferPolicy::default(),
        }
    }

    /// Whether to time this bulk pack below the large ones (one in [`SMALL_PACK_SAMPLE`]).
    #[inline]
    pub fn sample_small_pack(&mut self) -> bool {
        self.small_packs = self.small_packs.wrapping_add(1);
        self.small_packs.is_multiple_of(SMALL_PACK_SAMPLE)
    }

    /// Begins a message: its `Begin` header opens the pipe message (overwritten by `Whole`
    /// or `One` if the message goes whole).
    #[inline]
    pub fn begin(&mut self, limits: &Limits) {
        self.agg.clear();
        self.agg.reserve(limits.max_msg);
        // One 16-byte append (`Record::encode` appends a header as two words, through a call:
        // 42 instructions a message here, callgrind).
        self.agg.extend_from_slice(&Record::Begin { seq: self.seq }.header());
        (self.packs, self.flushed, self.finished) = (0, false, false);
    }

    /// How a pack of `len` bytes travels: by rendezvous from the connection's crossover on
    /// (`now` is asked only where the crossover adapts), else by the bulk lane if it is more
    /// than fits one pipe message, else inline.
    #[inline]
    pub fn route(&mut self, len: usize, limits: &Limits, now: impl FnOnce() -> Instant) -> Route {
        let large = len >= AdaptiveCrossover::MIN_PACK.min(limits.threshold);
        // (Packs from the probed threshold on always go zero-copy: no clock read for them.)
        if large && (len >= self.crossover.probed() || self.crossover.zero_copy(len, now())) {
            Route::Rendezvous
        } else if limits.bulk_chunk > 0 && limits.too_large_for_a_message(len) {
            if !large {
                self.small_crossover.count(len);
            }
            Route::Bulk
        } else {
            Route::Inline
        }
    }

    /// Whether a pack of `len` bytes below the rendezvous threshold goes whole into the pipe
    /// message being filled.
    #[inline]
    pub fn fits_whole(&self, len: usize, limits: &Limits) -> bool {
        len < limits.threshold && self.fits_message(len, limits)
    }

    /// Whether an inline pack of `len` bytes goes whole, with its record header, into the pipe
    /// message being filled.
    #[inline]
    pub fn fits_message(&self, len: usize, limits: &Limits) -> bool {
        self.agg.len() + wire::HEADER + len <= limits.max_msg
    }

    /// Appends a whole inline pack to the pipe message being filled (the caller checked
    /// that it fits).
    #[inline]
    pub fn append_inline(&mut self, buf: &[u8], modes: Modes) {
        let rec = Record::Inline { modes, len: buf.len() as u32, last: true, total: buf.len() as u64 };
        self.agg.extend_from_slice(&rec.header());
        portability_verbs::copy::extend_vec(&mut self.agg, buf);
        self.inline_modes = modes;
    }

    /// Whether a pack of `len` bytes that fits whole goes without its bytes for now
    /// ([`SendSide::append_inline_header`]): the message's first pack, packed `Cheaper` (its
    /// buffer unchanged until `end_packing`), of at least [`GATHER_MIN`] bytes.
    #[inline]
    pub fn gathers(&self, len: usize, modes: Modes) -> bool {
        self.packs == 1 && len >= GATHER_MIN && modes.send == SendMode::Cheaper
    }

    /// Appends a whole inline pack's record header alone: its `len` bytes follow from the
    /// application's buffer, either joined to the message later ([`SendSide::join`]) or sent
    /// beside it ([`SendSide::one_message_head`]).
    #[inline]
    pub fn append_inline_header(&mut self, len: usize, modes: Modes) {
        let rec = Record::Inline { modes, len: len as u32, last: true, total: len as u64 };
        self.agg.extend_from_slice(&rec.header());
        self.inline_modes = modes;
    }

    /// Appends the bytes of the pack whose header [`SendSide::append_inline_header`] appended.
    #[inline]
    pub fn join(&mut self, held: &[u8]) {
        portability_verbs::copy::extend_vec(&mut self.agg, held);
    }

    /// The next step of an inline pack with `left` of its bytes still to append: a fragment
    /// as large as the pipe message has room for, or a flush where not even a header and a
    /// little data (64 bytes, or all that is left) fit.
    pub fn inline_step(&self, left: usize, limits: &Limits) -> InlineStep {
        let fits_header = self.agg.len() + wire::HEADER <= limits.max_msg;
        let room = limits.max_msg.saturating_sub(self.agg.len() + wire::HEADER);
        if !fits_header || room < 64.min(left) {
            return InlineStep::Flush;
        }
        let n = room.min(left);
        InlineStep::Fragment { n, last: n == left }
    }

    /// Appends a fragment of an inline pack of `total` bytes (after [`SendSide::inline_step`]).
    pub fn append_fragment(&mut self, data: &[u8], modes: Modes, last: bool, total: u64) {
        Record::Inline { modes, len: data.len() as u32, last, total }.encode(&mut self.agg);
        self.agg.extend_from_slice(data);
    }

    /// Whether `rec` needs the pipe message being filled sent first.
    pub fn needs_flush_for(&self, rec: &Record, limits: &Limits) -> bool {
        self.agg.len() + rec.encoded_len() > limits.max_msg
    }

    /// How the message ends: whole if nothing of it went out yet (as one `One` record if it is
    /// one inline pack and no rendezvous), else closed by an `End`.
    #[inline]
    pub fn framing(&self, has_rdv: bool) -> Framing {
        match (self.flushed, self.packs == 1 && !has_rdv) {
            (false, true) => Framing::One,
            (false, false) => Framing::Whole,
            (true, _) => Framing::End,
        }
    }

    /// A message of one inline pack, whole: its bytes behind a `One` header written over the
    /// second half of its `Inline` header. Returns what to send.
    #[inline]
    pub fn one_message(&mut self) -> &[u8] {
        debug_assert!(matches!(
            wire::decode_one(&self.agg, wire::HEADER),
            Ok((Record::Inline { last: true, .. }, _, n)) if n == self.agg.len()
        ));
        self.write_one_header()
    }

    /// [`SendSide::one_message`] for a pack whose `held` bytes were not appended: what goes
    /// before them.
    #[inline]
    pub fn one_message_head(&mut self, held: usize) -> &[u8] {
        // (The `Begin` header, then the pack's `Inline` header: its bytes are `held`.)
        debug_assert_eq!(self.agg.len(), 2 * wire::HEADER, "a header-only pack of {held} bytes");
        self.write_one_header()
    }

    /// Writes the `One` header over the second half of the pack's `Inline` header and returns
    /// the message from it on.
    #[inline]
    fn write_one_header(&mut self) -> &[u8] {
        let at = 2 * wire::HEADER - wire::ONE_HEADER;
        let one = Record::one_header(self.seq, self.inline_modes);
        self.agg[at..2 * wire::HEADER].copy_from_slice(&one);
        self.flushed = true;
        &self.agg[at..]
    }

    /// After [`SendSide::one_message_head`], for a pipe that would not take the two parts:
    /// joins `held` and returns the whole message.
    #[inline]
    pub fn one_message_joined(&mut self, held: &[u8]) -> &[u8] {
        self.join(held);
        &self.agg[2 * wire::HEADER - wire::ONE_HEADER..]
    }

    /// Turns the `Begin` header of a message that goes whole into its `Whole` header.
    pub fn close_whole(&mut self) {
        let whole = Record::Whole { seq: self.seq, packs: self.packs };
        whole.write_header((&mut self.agg[..wire::HEADER]).try_into().expect("a Begin header"));
    }

    /// Whether the `End` of a message whose records went out over several pipe messages needs
    /// the pipe message being filled sent first (it does not fit).
    pub fn end_needs_flush(&self, limits: &Limits) -> bool {
        self.agg.len() + wire::HEADER > limits.max_msg
    }

    /// Appends the message's `End` (after [`SendSide::end_needs_flush`] and its flush).
    pub fn append_end(&mut self) {
        Record::End { packs: self.packs }.encode(&mut self.agg);
    }

    /// The message went out: the next one takes the next sequence number.
    #[inline]
    pub fn message_sent(&mut self, received: u32) {
        self.seq = self.seq.wrapping_add(1);
        self.offers.sent(received);
    }
}
