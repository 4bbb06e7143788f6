//! Channels, connections, and the packing and unpacking of messages.

use std::cell::Cell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;

use portability_verbs::copy::{self, copy_slice};
use portability_verbs::datapath::{
    AdaptiveCrossover, CopyOut, FlowStrategy, Lane, MsgPipe, NoticeBoard, PipeOptions, Registration, Stores,
};
use portability_verbs::{cm, AccessFlags, CompletionQueue, SendWr, Sge, WcStatus};
use smallvec::SmallVec;

use crate::resources::Resources;
use crate::wait::{Patience, Waiter};
use crate::wire::{self, Modes, Record};
use crate::{MadError, RecvMode, Result, SendMode};

mod cold_drop;
mod conn;
mod offer;
mod packer;
mod token;
mod unpacker;

use crate::protocol::offer::Outcome;
use crate::protocol::{is_released, Framing, InlineStep, Limits, Mismatch, RecvSide, Route, SendSide, WholeMsg};
use cold_drop::ColdDrop;
pub(crate) use conn::Conn;
use conn::*;
use packer::*;
pub use packer::{LaterPack, Packer, PendingSend};
use token::*;
pub use unpacker::Unpacker;

/// A communication context with a connection to every other process of the session.
pub struct Channel {
    res: Arc<Resources>,
    id: u32,
    conns: Vec<Option<Arc<Conn>>>,
    next_source: AtomicUsize,
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel")
            .field("id", &self.id)
            .field("rank", &self.rank())
            .field("size", &self.size())
            .finish_non_exhaustive()
    }
}

impl Channel {
    pub(crate) fn new(res: Arc<Resources>, id: u32, conns: Vec<Option<Arc<Conn>>>) -> Channel {
        Channel { res, id, conns, next_source: AtomicUsize::new(0) }
    }

    /// The channel's number (channels are numbered in creation order from 1).
    pub fn id(&self) -> u32 {
        self.id
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.res.cfg.rank
    }

    /// Number of processes.
    pub fn size(&self) -> usize {
        self.res.cfg.size
    }

    #[inline]
    fn conn(&self, rank: usize) -> Result<&Conn> {
        match self.conns.get(rank) {
            Some(Some(c)) => Ok(c),
            _ => Err(self.no_conn(rank)),
        }
    }

    #[cold]
    fn no_conn(&self, rank: usize) -> MadError {
        MadError::Invalid(format!("no connection to rank {rank} (size {}, self {})", self.size(), self.rank()))
    }

    /// Starts a message to `dest`. Other senders to `dest` on this channel wait until
    /// `end_packing`: a message is packed atomically.
    // Always in line: returned from a call, the packer is written field by field and read
    // back in 16-byte moves that wait for those stores to reach the cache (store forwarding
    // fails), the largest single cost of a small message's code (decision 026).
    #[inline(always)]
    pub fn begin_packing(&self, dest: usize) -> Result<Packer<'_>> {
        let conn = self.conn(dest)?;
        let mut tx = conn.send_side.claim(self.res.patience())?;
        let reported = conn.notices.last_word();
        if reported != tx.notice_seen {
            tx.notice_seen = reported;
            return Err(conn.reported_mismatch());
        }
        // A connection that carries packs the size of the larger frames looks whether the peer
        // keeps up (one more claim of the pipe a message, on such connections alone).
        tx.behind = tx.mid_packs && conn.peer_behind();
        let limits = conn.limits(tx.behind);
        tx.begin(&limits);
        Ok(Packer { ch: self, conn, tx, more: ColdDrop::default(), rdv: ColdDrop::default(), held: None })
    }

    /// Waits until every process of the session reached this call on this channel (an empty
    /// message gathered by rank 0 and answered). Call it when no other message is in flight on
    /// the channel, for example before tearing a session down.
    pub fn barrier(&self) -> Result<()> {
        if self.rank() == 0 {
            for r in 1..self.size() {
                self.begin_unpacking_from(r)?.end_unpacking()?;
            }
            for r in 1..self.size() {
                self.begin_packing(r)?.end_packing()?;
            }
        } else if self.size() > 1 {
            self.begin_packing(0)?.end_packing()?;
            self.begin_unpacking_from(0)?.end_unpacking()?;
        }
        Ok(())
    }

    /// Packs of at least this many bytes to `rank` go by rendezvous (zero-copy): the session's
    /// setting, or what the connection's probe chose (`usize::MAX`: never, copying through
    /// the bulk lane is faster to that peer). Without a setting, packs of at least
    /// [`AdaptiveCrossover::MIN_PACK`] also go zero-copy while the sender's copies into the
    /// bulk lane run slower than the probe's reads (a trial copy now and then).
    pub fn rendezvous_threshold(&self, rank: usize) -> Result<usize> {
        Ok(self.conn(rank)?.threshold)
    }

    /// Takes the next message from any sender (each caller gets a different message; messages
    /// of one sender arrive in order).
    pub fn begin_unpacking(&self) -> Result<Unpacker<'_>> {
        let mut w = Waiter::new(self.res.patience(), "waiting for a message");
        let conns: SmallVec<[&Conn; 8]> = self.conns.iter().flatten().map(|c| &**c).collect();
        loop {
            if let Some(u) = self.try_begin_unpacking()? {
                return Ok(u);
            }
            w.pause_on(&conns)?;
        }
    }

    /// Takes the next message from any sender if one has begun arriving, without waiting:
    /// `Ok(None)` if none has (or every sender with one is being read by another thread). For
    /// event loops that poll several channels or do their own work between looks, where
    /// [`Channel::begin_unpacking`] would block; the sources are looked at in turn from call
    /// to call, so a busy one does not hide the others.
    pub fn try_begin_unpacking(&self) -> Result<Option<Unpacker<'_>>> {
        let n = self.conns.len();
        let start = self.next_source.fetch_add(1, Ordering::Relaxed);
        let mut open = false;
        for k in 0..n {
            let Some(conn) = self.conns[(start + k) % n].as_deref() else { continue };
            // Not holding the claim between looks: a thread waiting for this source only may
            // take it.
            let Some(mut rx) = conn.recv_side.try_claim() else {
                open = true;
                continue;
            };
            match self.try_begin(conn, &mut rx) {
                Ok(true) => {
                    return Ok(Some(Unpacker {
                        ch: self,
                        conn,
                        rx,
                        pending: ColdDrop::default(),
                        note: Cell::new(None),
                    }))
                }
                Ok(false) => open = true,
                // A sender that closed its end has no more to give; the others may.
                Err(MadError::PeerClosed { .. }) => {}
                Err(e) => return Err(conn.poison(e)),
            }
        }
        if !open && n > 1 {
            return Err(MadError::AllPeersClosed);
        }
        Ok(None)
    }

    /// Takes the next message from `source`; fails with [`MadError::PeerClosed`] once `source`
    /// closed its end and what it sent before was read.
    // Always in line, as `begin_packing` is, for its unpacker.
    #[inline(always)]
    pub fn begin_unpacking_from(&self, source: usize) -> Result<Unpacker<'_>> {
        let conn = self.conn(source)?;
        // Claimed once for the whole wait: whoever else wants this source's next message
        // would wait behind us anyway.
        let mut rx = conn.recv_side.claim(self.res.patience())?;
        if !self.try_begin(conn, &mut rx).map_err(|e| conn.poison(e))? {
            let mut w = Waiter::new(self.res.patience(), "waiting for a message");
            loop {
                w.pause_on(&[conn])?;
                if self.try_begin(conn, &mut rx).map_err(|e| conn.poison(e))? {
                    break;
                }
            }
        }
        Ok(Unpacker { ch: self, conn, rx, pending: ColdDrop::default(), note: Cell::new(None) })
    }

    /// Takes the next message from `source` if it has begun arriving, without waiting:
    /// `Ok(None)` if it has not, or if another unpacker (of another thread, or an unfinished
    /// one of this thread) is reading from `source` now. Errors as
    /// [`Channel::begin_unpacking_from`]: a bad rank, a failed connection, a dead peer, a peer
    /// that closed its end ([`MadError::PeerClosed`], once what it sent before was read).
    pub fn try_begin_unpacking_from(&self, source: usize) -> Result<Option<Unpacker<'_>>> {
        let conn = self.conn(source)?;
        let Some(mut rx) = conn.recv_side.try_claim() else { return Ok(None) };
        if self.try_begin(conn, &mut rx).map_err(|e| conn.poison(e))? {
            return Ok(Some(Unpacker { ch: self, conn, rx, pending: ColdDrop::default(), note: Cell::new(None) }));
        }
        Ok(None)
    }

    /// Takes the start of the connection's next message into `rx` if it has begun arriving
    /// (`false` if nothing is there yet): its records follow, or it came whole.
    #[inline]
    fn try_begin(&self, conn: &Conn, rx: &mut RecvSide) -> Result<bool> {
        let mut io = conn.io();
        let (seq, whole) = match io.take_one(&mut rx.body) {
            OneMsg::Taken(seq, modes) => (seq, WholeMsg::single(modes)),
            OneMsg::Left(seq, modes, len) => (seq, WholeMsg::single_in_pipe(modes, len)),
            OneMsg::Nothing => return Ok(false),
            OneMsg::Other => return self.try_begin_other(conn, rx, io),
        };
        drop(io);
        rx.begin(seq, Some(whole)).map_err(|e| conn.out_of_sequence(e))?;
        Ok(true)
    }

    /// [`Channel::try_begin`] for anything but a message of one small pack.
    #[inline(never)]
    fn try_begin_other(&self, conn: &Conn, rx: &mut RecvSide, mut io: Claim<'_, ConnIo>) -> Result<bool> {
        /// What the next record says (small and plain: it travels back through the record
        /// reader's results on every message).
        #[derive(Clone, Copy)]
        enum Start {
            Begin(u32),
            Whole(u32, u32),
            One(u32, Modes),
            Other,
        }
        let body = &mut rx.body;
        let got = conn.next_with(&mut io, Pump::StopAtBulk, |n| match n {
            Next::Rec(Record::Begin { seq }, _) => Start::Begin(seq),
            // A small message, taken out of the pipe at once: its unpacks need no lock.
            Next::Rec(Record::Whole { seq, packs }, data) => {
                body.clear();
                copy::extend_vec(body, data);
                Start::Whole(seq, packs)
            }
            Next::Rec(Record::One { seq, modes }, data) => {
                body.clear();
                copy::extend_vec(body, data);
                Start::One(seq, modes)
            }
            _ => Start::Other,
        })?;
        let (seq, whole) = match got {
            Err(_) => return Ok(false),
            Ok(Start::Begin(seq)) => (seq, None),
            Ok(Start::Whole(seq, packs)) => (seq, Some(WholeMsg::of(packs))),
            Ok(Start::One(seq, modes)) => (seq, Some(WholeMsg::single(modes))),
            Ok(Start::Other) => {
                return Err(MadError::Protocol { rank: conn.peer, why: "data outside a message".into() })
            }
        };
        drop(io);
        rx.begin(seq, whole).map_err(|e| conn.out_of_sequence(e))?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::{Session, SessionConfig};
    use std::time::Duration;

    /// Runs `f(rank, channel)` on three ranks (threads, each with its own session).
    fn trio(tag: &str, f: impl Fn(usize, &Channel) + Sync) {
        trio_with(tag, |_| {}, f)
    }

    /// As [`trio`], each rank's configuration set by `set`.
    fn trio_with(tag: &str, set: impl Fn(&mut SessionConfig) + Sync, f: impl Fn(usize, &Channel) + Sync) {
        let dir = std::env::temp_dir().join(format!("mad-unit-{tag}-{}", std::process::id()));
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|rank| {
                    let (dir, f, set) = (dir.clone(), &f, &set);
                    s.spawn(move || {
                        let mut cfg = SessionConfig::new(rank, 3, dir);
                        cfg.timeout = Duration::from_secs(10);
                        cfg.wait_limit = Some(Duration::from_secs(10));
                        set(&mut cfg);
                        let session = Session::new(cfg).unwrap();
                        let ch = session.channel().unwrap();
                        f(rank, &ch);
                        // Keep the session up until everyone is done with it.
                        let ctl = session.channel().unwrap();
                        if rank == 0 {
                            for r in [1, 2] {
                                ctl.begin_unpacking_from(r).unwrap().end_unpacking().unwrap();
                            }
                        } else {
                            ctl.begin_packing(0).unwrap().end_packing().unwrap();
                        }
                    })
                })
                .collect();
            for h in hs {
                h.join().unwrap();
            }
        });
        let _ = std::fs::remove_dir_all(dir);
    }

    fn encoded(recs: &[(Record, &[u8])]) -> Vec<u8> {
        let mut m = Vec::new();
        for (r, d) in recs {
            r.encode(&mut m);
            m.extend_from_slice(d);
        }
        m
    }

    /// What a peer sending `raw` as one pipe message does to rank 0's connection to it: the
    /// error rank 0 gets, after which its connection to rank 2 must still carry messages.
    fn malformed(tag: &str, raw: Vec<u8>, unpacks: usize) -> MadError {
        let got = std::sync::Mutex::new(None);
        trio(tag, |rank, ch| match rank {
            0 => {
                let r = (|| {
                    let mut u = ch.begin_unpacking_from(1)?;
                    for _ in 0..unpacks {
                        let mut b = [0u8; 8];
                        u.unpack_express(&mut b, SendMode::Cheaper)?;
                    }
                    u.end_unpacking()
                })();
                *got.lock().unwrap() = Some(r.expect_err("malformed data accepted"));
                // The connection stays failed...
                assert!(ch.begin_unpacking_from(1).is_err());
                // ...and the others work.
                let mut u = ch.begin_unpacking_from(2).unwrap();
                let mut b = [0u8; 4];
                u.unpack_express(&mut b, SendMode::Safer).unwrap();
                u.end_unpacking().unwrap();
                assert_eq!(b, [1, 2, 3, 4]);
            }
            1 => ch.conn(0).unwrap().send_msg(&raw, ch.res.patience()).unwrap(),
            _ => {
                let mut p = ch.begin_packing(0).unwrap();
                p.pack_safer(&[1, 2, 3, 4], RecvMode::Express).unwrap();
                p.end_packing().unwrap();
            }
        });
        got.into_inner().unwrap().unwrap()
    }

    const EXPRESS: Modes = Modes { send: SendMode::Cheaper, recv: RecvMode::Express };

    #[test]
    fn malformed_peer_data_fails_that_connection_only() {
        let cases: Vec<(&str, Vec<u8>, usize)> = vec![
            ("unknown-tag", vec![9; 16], 0),
            ("short-header", vec![1, 0, 0], 0),
            (
                "fragment-past-message",
                {
                    let mut m = encoded(&[(Record::Begin { seq: 0 }, &[])]);
                    Record::Inline { modes: EXPRESS, len: 64, last: true, total: 64 }.encode(&mut m);
                    m.extend_from_slice(&[0; 8]);
                    m
                },
                1,
            ),
            (
                "fragments-short-of-pack",
                encoded(&[
                    (Record::Begin { seq: 0 }, &[]),
                    (Record::Inline { modes: EXPRESS, len: 4, last: true, total: 8 }, &[0; 4]),
                    (Record::End { packs: 1 }, &[]),
                ]),
                1,
            ),
            ("data-outside-a-message", encoded(&[(Record::End { packs: 0 }, &[])]), 0),
            ("wrong-sequence-number", encoded(&[(Record::Begin { seq: 7 }, &[])]), 0),
            ("one-pack-wrong-sequence-number", encoded(&[(Record::One { seq: 7, modes: EXPRESS }, &[0; 8])]), 0),
            ("one-pack-bad-modes", vec![8, 0xff, 0, 0, 0, 0, 0, 0, 1, 2, 3], 0),
            ("one-pack-short-header", vec![8, 0, 0, 0, 0], 0),
            (
                "fragment-in-a-whole-message",
                encoded(&[
                    (Record::Whole { seq: 0, packs: 1 }, &[]),
                    (Record::Inline { modes: EXPRESS, len: 4, last: false, total: 8 }, &[0; 4]),
                ]),
                1,
            ),
            (
                "bulk-in-a-whole-message",
                encoded(&[(Record::Whole { seq: 0, packs: 1 }, &[]), (Record::Bulk { modes: EXPRESS, total: 8 }, &[])]),
                1,
            ),
            (
                "rendezvous-out-of-order-in-a-whole-message",
                encoded(&[
                    (Record::Whole { seq: 0, packs: 1 }, &[]),
                    (Record::Rdv { modes: EXPRESS, len: 8, addr: 0x1000, rkey: 1, id: 3, offer: false }, &[]),
                ]),
                1,
            ),
            (
                "unread-rendezvous-out-of-order-in-a-whole-message",
                encoded(&[
                    (Record::Whole { seq: 0, packs: 1 }, &[]),
                    (Record::Rdv { modes: EXPRESS, len: 8, addr: 0x1000, rkey: 1, id: 3, offer: false }, &[]),
                ]),
                0,
            ),
            (
                "whole-message-pack-count-off",
                encoded(&[
                    (Record::Whole { seq: 0, packs: 2 }, &[]),
                    (Record::Inline { modes: EXPRESS, len: 8, last: true, total: 8 }, &[0; 8]),
                ]),
                1,
            ),
            (
                "bulk-not-last",
                encoded(&[
                    (Record::Begin { seq: 0 }, &[]),
                    (Record::Bulk { modes: EXPRESS, total: 8 }, &[]),
                    (Record::End { packs: 1 }, &[]),
                ]),
                1,
            ),
            // Rendezvous come numbered from 0 in the order their sender issued them.
            (
                "rendezvous-out-of-order",
                encoded(&[
                    (Record::Begin { seq: 0 }, &[]),
                    (Record::Rdv { modes: EXPRESS, len: 8, addr: 0x1000, rkey: 1, id: 5, offer: false }, &[]),
                    (Record::End { packs: 1 }, &[]),
                ]),
                1,
            ),
            // The tag a `Fin` had.
            ("retired-tag", vec![5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], 0),
        ];
        for (tag, raw, unpacks) in cases {
            let e = malformed(tag, raw, unpacks);
            assert!(matches!(e, MadError::Protocol { rank: 1, .. }), "{tag}: {e}");
        }
    }

    /// A peer that says it read rendezvous we never issued fails that connection only.
    #[test]
    fn a_release_count_past_what_was_issued_fails_that_connection_only() {
        trio("release-past", |rank, ch| match rank {
            0 => {
                // Rank 1 said it read 5 before we issued any: our first rendezvous sees it.
                let buf = vec![3u8; 4096];
                let mut p = ch.begin_packing(1).unwrap();
                p.tx.packs += 1;
                p.emit_by(&buf, Modes { send: SendMode::Cheaper, recv: RecvMode::Cheaper }, Route::Rendezvous).unwrap();
                let e = p.end_packing().expect_err("a release of rendezvous never issued accepted");
                assert!(matches!(e, MadError::Protocol { rank: 1, .. }), "{e}");
                let mut p = ch.begin_packing(2).unwrap();
                p.pack_safer(&[1, 2, 3, 4], RecvMode::Express).unwrap();
                p.end_packing().unwrap();
            }
            1 => {
                ch.conn(0).unwrap().io().pipe.release_to(5).unwrap();
                // Rank 0's message still comes. Left unfinished (forgotten): finishing it would
                // release the rendezvous in it, overwriting the bogus count before rank 0 looked.
                if let Ok(u) = ch.begin_unpacking_from(0) {
                    std::mem::forget(u);
                }
            }
            _ => {
                let mut u = ch.begin_unpacking_from(0).unwrap();
                let mut b = [0u8; 4];
                u.unpack_express(&mut b, SendMode::Safer).unwrap();
                u.end_unpacking().unwrap();
                assert_eq!(b, [1, 2, 3, 4]);
            }
        });
    }

    /// A rendezvous pack longer than one read request is read in several (`READ_CHUNK`, 4 KiB
    /// in unit tests), each from its own part of the sender's buffer; one to memory the sender
    /// never registered fails, every request of it waited for.
    #[test]
    fn rendezvous_packs_are_read_in_requests_of_read_chunk_bytes() {
        let len = 5 * unpacker::READ_CHUNK / 2;
        let body: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
        let cheaper = Modes { send: SendMode::Cheaper, recv: RecvMode::Cheaper };
        trio("read-chunks", |rank, ch| match rank {
            1 => {
                for _ in 0..2 {
                    let mut p = ch.begin_packing(0).unwrap();
                    p.tx.packs += 1;
                    p.emit_by(&body, cheaper, Route::Rendezvous).unwrap();
                    p.end_packing().unwrap();
                }
            }
            0 => {
                for _ in 0..2 {
                    let mut got = vec![0u8; len];
                    let mut u = ch.begin_unpacking_from(1).unwrap();
                    u.unpack(&mut got, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
                    u.end_unpacking().unwrap();
                    assert!(got == body, "a chunked read differs");
                }
                let mut got = vec![0u8; len];
                let r = (|| {
                    let mut u = ch.begin_unpacking_from(2)?;
                    u.unpack(&mut got, SendMode::Cheaper, RecvMode::Cheaper)?;
                    u.end_unpacking()
                })();
                assert!(matches!(r, Err(MadError::PeerLost { rank: 2, .. })), "{r:?}");
                // Every request of the failed read was waited for, not only the first.
                assert_eq!(ch.conn(2).unwrap().io().pipe.user_unsettled(), 0);
            }
            _ => {
                let rdv =
                    Record::Rdv { modes: cheaper, len: len as u64, addr: 0x10000, rkey: 0xdead, id: 0, offer: false };
                let raw = encoded(&[(Record::Whole { seq: 0, packs: 1 }, &[]), (rdv, &[])]);
                ch.conn(0).unwrap().send_msg(&raw, ch.res.patience()).unwrap();
            }
        });
    }

    #[test]
    fn a_rendezvous_to_memory_the_peer_never_registered_fails_that_connection_only() {
        let rdv = Record::Rdv { modes: EXPRESS, len: 8, addr: 0x1000, rkey: 0xdead, id: 0, offer: false };
        let raw = encoded(&[(Record::Begin { seq: 0 }, &[]), (rdv, &[]), (Record::End { packs: 1 }, &[])]);
        let e = malformed("unknown-buffer", raw, 1);
        assert!(matches!(e, MadError::PeerLost { rank: 1, .. }), "{e}");
        let raw = encoded(&[(Record::Whole { seq: 0, packs: 1 }, &[]), (rdv, &[])]);
        let e = malformed("unknown-buffer-whole", raw, 1);
        assert!(matches!(e, MadError::PeerLost { rank: 1, .. }), "{e}");
    }

    /// A pack of `len` bytes from `from` to `to` (both call it), checked against `body`.
    fn one_pack(ch: &Channel, rank: usize, from: usize, to: usize, body: &[u8]) {
        if rank == from {
            // Past the reports of mismatches the tests make on purpose.
            let mut p = loop {
                match ch.begin_packing(to) {
                    Err(MadError::Mismatch { .. }) => {}
                    p => break p.unwrap(),
                }
            };
            p.pack(body, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
            p.end_packing().unwrap();
        } else if rank == to {
            let mut got = vec![0u8; body.len()];
            let mut u = ch.begin_unpacking_from(from).unwrap();
            u.unpack(&mut got, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
            u.end_unpacking().unwrap();
            assert!(got == body, "{} bytes from {from} differ", body.len());
        }
    }

    fn offers_of(ch: &Channel, peer: usize) -> (u32, u32) {
        let c = ch.conn(peer).unwrap();
        (c.offers_claimed.load(Ordering::Relaxed), c.offers_withdrawn.load(Ordering::Relaxed))
    }

    /// How long the tests' senders offer: a receiver that waits claims in time even on a
    /// loaded machine; a late one sleeps for [`LATE`].
    const PATIENCE: Duration = Duration::from_millis(300);
    const LATE: Duration = Duration::from_millis(700);

    /// Packs below the threshold go through the bulk lane, or as offers.
    fn bulk_only(cfg: &mut SessionConfig) {
        cfg.rendezvous_threshold = Some(1 << 20);
        cfg.offer_patience = PATIENCE;
    }

    /// A barrier of ranks 0 and 1 on `ch` that leaves the offers' policy as it was: `to`
    /// answers a small message of `from` (neither is an offer).
    fn rendezvous_small(ch: &Channel, rank: usize, from: usize, to: usize) {
        one_pack(ch, rank, from, to, &[1u8; 8]);
    }

    #[test]
    fn offers_are_read_in_a_ping_pong_and_copied_when_the_receiver_comes_late() {
        use crate::protocol::offer::OFFER_MIN;
        let sizes = [OFFER_MIN, 40_000, 100_000];
        let body = |n: usize, seed: usize| -> Vec<u8> { (0..n).map(|i| (i * 31 + seed + i / 4093) as u8).collect() };
        trio_with("offers", bulk_only, |rank, ch| {
            if rank == 2 {
                return;
            }
            // A ping-pong: every message answers one, so every large one is offered, and the
            // receiver, waiting for it, claims and reads it.
            for round in 0..6 {
                for &n in &sizes {
                    one_pack(ch, rank, 0, 1, &body(n, round));
                    one_pack(ch, rank, 1, 0, &body(n, round + 1));
                }
            }
            let (claimed, withdrawn) = offers_of(ch, 1 - rank);
            assert_eq!(withdrawn, 0, "rank {rank}");
            // The first message of rank 0 answers nothing.
            assert!(claimed >= 3 * sizes.len() as u32, "rank {rank}: {claimed} offers claimed");
            // Two ranks that each send before they receive: neither waits for the other (an
            // offer whose receiver sends too is withdrawn; once that sender copied, it receives
            // and claims the other's offer if still open).
            static HEAD_TO_HEAD_WITHDRAWN: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let withdrawn_before = offers_of(ch, 1 - rank).1;
            for round in 0..8 {
                let (mine, theirs) = (body(OFFER_MIN, rank + round), body(OFFER_MIN, 1 - rank + round));
                let mut p = ch.begin_packing(1 - rank).unwrap();
                p.pack(&mine, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
                p.end_packing().unwrap();
                let mut got = vec![0u8; OFFER_MIN];
                let mut u = ch.begin_unpacking_from(1 - rank).unwrap();
                u.unpack(&mut got, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
                u.end_unpacking().unwrap();
                assert!(got == theirs, "round {round}");
            }
            HEAD_TO_HEAD_WITHDRAWN.fetch_add(offers_of(ch, 1 - rank).1 - withdrawn_before, Ordering::Relaxed);
            rendezvous_small(ch, rank, 0, 1);
            rendezvous_small(ch, rank, 1, 0);
            assert!(HEAD_TO_HEAD_WITHDRAWN.load(Ordering::Relaxed) >= 1, "no offer withdrawn head to head");
            // A receiver that comes late: the sender withdraws and copies.
            resume_offers(ch, rank);
            rendezvous_small(ch, rank, 1, 0);
            let (claimed, withdrawn) = offers_of(ch, 1 - rank);
            if rank == 1 {
                std::thread::sleep(LATE);
            }
            one_pack(ch, rank, 0, 1, &body(40_000, 9));
            if rank == 0 {
                assert_eq!(offers_of(ch, 1), (claimed, withdrawn + 1));
            }
            // An offer behind packs already sent (the message ends with `End`, not whole),
            // claimed, then withdrawn.
            for late in [false, true] {
                resume_offers(ch, rank);
                rendezvous_small(ch, rank, 1, 0);
                let before = offers_of(ch, 1 - rank);
                let big = body(40_000, late as usize);
                if rank == 0 {
                    let mut p = ch.begin_packing(1).unwrap();
                    p.pack(&[5u8; 8], SendMode::Cheaper, RecvMode::Express).unwrap();
                    p.flush().unwrap();
                    p.pack(&big, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
                    p.end_packing().unwrap();
                    let want = if late { (before.0, before.1 + 1) } else { (before.0 + 1, before.1) };
                    assert_eq!(offers_of(ch, 1), want, "late {late}");
                } else {
                    if late {
                        std::thread::sleep(LATE);
                    }
                    let (mut head, mut got) = ([0u8; 8], vec![0u8; big.len()]);
                    let mut u = ch.begin_unpacking_from(0).unwrap();
                    u.unpack_express(&mut head, SendMode::Cheaper).unwrap();
                    u.unpack(&mut got, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
                    u.end_unpacking().unwrap();
                    assert!(head == [5u8; 8] && got == big, "late {late}");
                }
            }
            rendezvous_small(ch, rank, 0, 1);
            rendezvous_small(ch, rank, 1, 0);
        });
    }

    /// Lets rank 0's offers to rank 1 resume after withdrawals: answered large messages
    /// until the longest pause is over.
    fn resume_offers(ch: &Channel, rank: usize) {
        for _ in 0..crate::protocol::offer::LONGEST_PAUSE {
            rendezvous_small(ch, rank, 1, 0);
            one_pack(ch, rank, 0, 1, &[3u8; crate::protocol::offer::OFFER_MIN]);
        }
    }

    #[test]
    fn an_offer_unpacked_otherwise_or_not_at_all_is_settled_and_the_connection_survives() {
        let body: Vec<u8> = (0..40_000).map(|i| (i * 13 + i / 999) as u8).collect();
        trio_with("offers-unread", bulk_only, |rank, ch| {
            if rank == 2 {
                return;
            }
            for late in [false, true] {
                for unpacked in [false, true] {
                    resume_offers(ch, rank);
                    rendezvous_small(ch, rank, 1, 0);
                    if rank == 0 {
                        let before = offers_of(ch, 1);
                        let mut p = ch.begin_packing(1).unwrap();
                        p.pack(&body, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
                        p.end_packing().unwrap();
                        let after = offers_of(ch, 1);
                        let want = if late { (before.0, before.1 + 1) } else { (before.0 + 1, before.1) };
                        assert_eq!(after, want, "late {late}, unpacked {unpacked}");
                    } else {
                        if late {
                            std::thread::sleep(LATE);
                        }
                        let mut u = ch.begin_unpacking_from(0).unwrap();
                        if unpacked {
                            let mut short = vec![0u8; body.len() - 1];
                            let e = u.unpack_express(&mut short, SendMode::Cheaper).unwrap_err();
                            assert!(matches!(e, MadError::Mismatch { .. }), "{e}");
                            drop(u);
                        } else {
                            let e = u.end_unpacking().unwrap_err();
                            assert!(matches!(e, MadError::Mismatch { .. }), "{e}");
                        }
                    }
                    // The connection goes on: the next message (its mismatch report first).
                    if rank == 0 {
                        loop {
                            match ch.begin_packing(1) {
                                Ok(mut p) => {
                                    p.pack(&body, SendMode::Cheaper, RecvMode::Express).unwrap();
                                    p.end_packing().unwrap();
                                    break;
                                }
                                Err(MadError::Mismatch { .. }) => {}
                                Err(e) => panic!("{e}"),
                            }
                        }
                    } else {
                        let mut got = vec![0u8; body.len()];
                        let mut u = ch.begin_unpacking_from(0).unwrap();
                        u.unpack(&mut got, SendMode::Cheaper, RecvMode::Express).unwrap();
                        u.end_unpacking().unwrap();
                        assert!(got == body, "late {late}, unpacked {unpacked}");
                    }
                }
            }
        });
    }
}
