//! The sender's and the receiver's state paired in memory: pipe messages go from one to the
//! other as byte vectors, with no pipe, no clock and no other process.

use std::time::Instant;

use portability_verbs::datapath::AdaptiveCrossover;
use proptest::prelude::*;

use super::recv::{OutOfSequence, RecvSide, WholeMsg};
use super::send::{Framing, InlineStep, Limits, Route, SendSide};
use super::{is_released, released, Mismatch};
use crate::wire::{self, Modes, Record};
use crate::{RecvMode, SendMode};

const LIMITS: Limits = Limits { threshold: 32 * 1024, max_msg: 4096, bulk_chunk: 0 };
const EXPRESS: Modes = Modes { send: SendMode::Safer, recv: RecvMode::Express };

/// What the packer does with the sending side's decisions, for inline and rendezvous packs
/// (the bulk lane is the pipe's business): returns the pipe messages of one message.
fn pack_message(tx: &mut SendSide, packs: &[(Vec<u8>, Modes)], next_rdv: &mut u32) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut has_rdv = false;
    tx.begin(&LIMITS);
    for (buf, modes) in packs {
        tx.packs += 1;
        if tx.fits_whole(buf.len(), &LIMITS) {
            tx.append_inline(buf, *modes);
            continue;
        }
        match tx.route(buf.len(), &LIMITS, Instant::now) {
            Route::Rendezvous => {
                let rec = Record::Rdv {
                    modes: *modes,
                    len: buf.len() as u64,
                    addr: 0x1000,
                    rkey: 7,
                    id: *next_rdv,
                    offer: false,
                };
                *next_rdv = next_rdv.wrapping_add(1);
                if tx.needs_flush_for(&rec, &LIMITS) {
                    flush(tx, &mut out);
                }
                rec.encode(&mut tx.agg);
                has_rdv = true;
            }
            Route::Bulk => unreachable!("no bulk lane in these limits"),
            Route::Inline => {
                let mut off = 0;
                loop {
                    match tx.inline_step(buf.len() - off, &LIMITS) {
                        InlineStep::Flush => flush(tx, &mut out),
                        InlineStep::Fragment { n, last } => {
                            tx.append_fragment(&buf[off..off + n], *modes, last, buf.len() as u64);
                            off += n;
                            if last {
                                break;
                            }
                        }
                    }
                }
            }
        }
    }
    match tx.framing(has_rdv) {
        Framing::One => out.push(tx.one_message().to_vec()),
        Framing::Whole => {
            tx.close_whole();
            flush(tx, &mut out);
        }
        Framing::End => {
            if tx.end_needs_flush(&LIMITS) {
                flush(tx, &mut out);
            }
            tx.append_end();
            flush(tx, &mut out);
        }
    }
    tx.agg.clear();
    tx.message_sent(0);
    out
}

fn flush(tx: &mut SendSide, out: &mut Vec<Vec<u8>>) {
    if !tx.agg.is_empty() {
        out.push(std::mem::take(&mut tx.agg));
        tx.flushed = true;
    }
}

/// What a receiver got of one message: each pack's bytes (a rendezvous: its id) and modes.
#[derive(Debug, PartialEq, Eq)]
enum Got {
    Bytes(Vec<u8>, Modes),
    Rdv(u32, u64, Modes),
}

/// What the unpacker does with the receiving side's decisions: takes one message's pipe
/// messages apart, unpacking each pack as `asked` says (sizes and modes), and ends it.
fn unpack_message(rx: &mut RecvSide, msgs: &[Vec<u8>], asked: &[(usize, Modes)]) -> Result<Vec<Got>, String> {
    let mut records: Vec<(Record, Vec<u8>)> = Vec::new();
    let first = &msgs[0];
    if let Some(one) = wire::decode_one_record(first) {
        let (seq, modes) = one.map_err(|e| e.to_string())?;
        rx.begin(seq, Some(WholeMsg::single(modes))).map_err(|e| format!("{e:?}"))?;
        let body = first[wire::ONE_HEADER..].to_vec();
        let (len, want) = asked.first().copied().ok_or("no unpack")?;
        rx.check(modes, body.len() as u64, want, len).map_err(|m| m.describe())?;
        rx.unpacks = 1;
        if let Some(w) = rx.whole.as_mut() {
            w.taken = 1;
        }
        if asked.len() > 1 {
            return Err(Mismatch::ExtraUnpack { packs: 1 }.describe());
        }
        assert!(rx.end_single(), "a one-pack message ends at once");
        return Ok(vec![Got::Bytes(body, modes)]);
    }
    for m in msgs {
        for (rec, range) in wire::decode(m).map_err(|e| e.to_string())? {
            match rec {
                // A whole message: its records follow in the same pipe message.
                Record::Whole { .. } => {
                    records.push((rec, Vec::new()));
                    for (r, d) in wire::decode(&m[range.clone()]).map_err(|e| e.to_string())? {
                        records.push((r, m[range.start + d.start..range.start + d.end].to_vec()));
                    }
                    break;
                }
                _ => records.push((rec, m[range].to_vec())),
            }
        }
    }
    let mut recs = records.into_iter();
    let packs_sent = match recs.next() {
        Some((Record::Begin { seq }, _)) => {
            rx.begin(seq, None).map_err(|e| format!("{e:?}"))?;
            None
        }
        Some((Record::Whole { seq, packs }, _)) => {
            rx.begin(seq, Some(WholeMsg::of(packs))).map_err(|e| format!("{e:?}"))?;
            Some(packs)
        }
        other => return Err(format!("a message starting with {other:?}")),
    };
    let mut got = Vec::new();
    let mut end = packs_sent;
    let mut extra = 0;
    let mut asks = asked.iter();
    // The inline pack being taken: its bytes so far, and whether an unpack asked for it.
    let mut inline: Option<(Vec<u8>, bool)> = None;
    for (rec, data) in recs {
        match rec {
            Record::Inline { modes, total, last, .. } => {
                let (bytes, wanted) = match inline.as_mut() {
                    Some(pack) => pack,
                    None => {
                        let wanted = match asks.next() {
                            Some(&(len, want)) => {
                                rx.check(modes, total, want, len).map_err(|m| m.describe())?;
                                true
                            }
                            None => false,
                        };
                        inline.insert((Vec::new(), wanted))
                    }
                };
                bytes.extend_from_slice(&data);
                if last {
                    if *wanted {
                        got.push(Got::Bytes(std::mem::take(bytes), modes));
                        rx.unpacks += 1;
                    } else {
                        extra += 1;
                    }
                    inline = None;
                }
            }
            Record::Rdv { modes, len, id, .. } => {
                rx.note_rdv(id).map_err(|e| format!("{e:?}"))?;
                match asks.next() {
                    Some(&(asked_len, want)) => {
                        rx.check(modes, len, want, asked_len).map_err(|m| m.describe())?;
                        rx.unpacks += 1;
                        got.push(Got::Rdv(id, len, modes));
                    }
                    None => extra += 1,
                }
            }
            Record::End { packs } => end = Some(packs),
            other => return Err(format!("{other:?} inside a message")),
        }
    }
    let packs = end.ok_or("a message without its end")?;
    if asked.len() as u32 > packs {
        return Err(Mismatch::ExtraUnpack { packs }.describe());
    }
    // Every rendezvous seen is released at the message's end (`Unpacker::release`).
    rx.rdv_released = rx.rdv_next;
    let counted = rx.check_end(packs, extra).map_err(|m| m.describe());
    rx.next_message();
    counted.map(|()| got)
}

fn side() -> (SendSide, RecvSide) {
    (SendSide::new(LIMITS.max_msg, AdaptiveCrossover::fixed(LIMITS.threshold)), RecvSide::default())
}

#[test]
fn a_message_of_one_small_pack_goes_as_one_record_and_arrives_in_order() {
    let (mut tx, mut rx) = side();
    let mut rdv = 0;
    for i in 0..3u8 {
        let msgs = pack_message(&mut tx, &[(vec![i; 8], EXPRESS)], &mut rdv);
        assert_eq!(msgs.len(), 1);
        assert_eq!(msgs[0].len(), wire::ONE_HEADER + 8, "header and bytes, nothing else");
        let got = unpack_message(&mut rx, &msgs, &[(8, EXPRESS)]).unwrap();
        assert_eq!(got, [Got::Bytes(vec![i; 8], EXPRESS)]);
    }
    assert_eq!((tx.seq, rx.seq), (3, 3));
}

#[test]
fn small_packs_share_one_whole_message_and_a_large_one_spreads_over_several() {
    let (mut tx, mut rx) = side();
    let mut rdv = 0;
    let packs = vec![(vec![1u8; 100], EXPRESS), (vec![2u8; 200], EXPRESS), (vec![3u8; 300], EXPRESS)];
    let msgs = pack_message(&mut tx, &packs, &mut rdv);
    assert_eq!(msgs.len(), 1, "three small packs, one pipe message");
    assert!(matches!(wire::decode_one(&msgs[0], 0).unwrap().0, Record::Whole { packs: 3, .. }));
    let asked: Vec<_> = packs.iter().map(|(b, m)| (b.len(), *m)).collect();
    let got = unpack_message(&mut rx, &msgs, &asked).unwrap();
    assert_eq!(got, packs.iter().map(|(b, m)| Got::Bytes(b.clone(), *m)).collect::<Vec<_>>());
    // 10 KiB, more than a pipe message: fragments, then an End.
    let big: Vec<u8> = (0..10_240u32).map(|i| i as u8).collect();
    let msgs = pack_message(&mut tx, &[(vec![9u8; 16], EXPRESS), (big.clone(), EXPRESS)], &mut rdv);
    assert!(msgs.len() >= 3, "{} pipe messages", msgs.len());
    assert!(msgs.iter().all(|m| m.len() <= LIMITS.max_msg));
    let got = unpack_message(&mut rx, &msgs, &[(16, EXPRESS), (big.len(), EXPRESS)]).unwrap();
    assert_eq!(got, [Got::Bytes(vec![9u8; 16], EXPRESS), Got::Bytes(big, EXPRESS)]);
}

#[test]
fn packs_from_the_threshold_on_go_by_rendezvous_in_id_order_and_are_released_by_one_count() {
    let (mut tx, mut rx) = side();
    let mut rdv = u32::MAX - 1; // across the wrap
    let cheaper = Modes { send: SendMode::Cheaper, recv: RecvMode::Cheaper };
    let n = LIMITS.threshold;
    let msgs =
        pack_message(&mut tx, &[(vec![0; 8], EXPRESS), (vec![0; n], cheaper), (vec![0; n + 1], cheaper)], &mut rdv);
    rx.rdv_next = u32::MAX - 1;
    let got = unpack_message(&mut rx, &msgs, &[(8, EXPRESS), (n, cheaper), (n + 1, cheaper)]).unwrap();
    assert_eq!(got[1..], [Got::Rdv(u32::MAX - 1, n as u64, cheaper), Got::Rdv(u32::MAX, n as u64 + 1, cheaper)]);
    // The receiver's count after both: the sender frees both, and refuses a count past them.
    let count = released(u32::MAX - 1, rx.rdv_next, rdv).unwrap();
    assert!(is_released(count, u32::MAX - 1) && is_released(count, u32::MAX));
    assert!(released(u32::MAX - 1, rx.rdv_next.wrapping_add(1), rdv).is_err());
}

#[test]
fn a_pack_is_routed_by_its_size_and_the_connection() {
    let (mut tx, _) = side();
    let now = || -> Instant { panic!("a fixed crossover asks no clock") };
    assert_eq!(tx.route(100, &LIMITS, now), Route::Inline);
    assert_eq!(tx.route(LIMITS.max_msg * 2, &LIMITS, now), Route::Inline, "no bulk lane: fragments");
    let bulk = Limits { bulk_chunk: 64 * 1024, ..LIMITS };
    assert_eq!(tx.route(LIMITS.max_msg * 2, &bulk, now), Route::Bulk);
    assert_eq!(tx.route(LIMITS.max_msg - 3 * wire::HEADER, &bulk, now), Route::Inline, "fits one message");
    assert_eq!(tx.route(LIMITS.threshold, &bulk, now), Route::Rendezvous);
    assert!(!tx.fits_whole(LIMITS.threshold, &LIMITS), "a rendezvous-sized pack never goes whole");
}

#[test]
fn what_an_unpack_asks_for_is_checked_against_what_was_packed() {
    let later = Modes { send: SendMode::Later, recv: RecvMode::Cheaper };
    let case = |packs: &[(Vec<u8>, Modes)], asked: &[(usize, Modes)]| {
        let (mut tx, mut rx) = side();
        let msgs = pack_message(&mut tx, packs, &mut 0);
        unpack_message(&mut rx, &msgs, asked).unwrap_err()
    };
    let e = case(&[(vec![1; 8], EXPRESS)], &[(9, EXPRESS)]);
    assert_eq!(e, Mismatch::Size { pack: 0, sent: 8, asked: 9 }.describe());
    let e = case(&[(vec![1; 8], EXPRESS), (vec![2; 8], later)], &[(8, EXPRESS), (8, EXPRESS)]);
    assert_eq!(e, Mismatch::Modes { pack: 1, sent: later, asked: EXPRESS }.describe());
    let e = case(&[(vec![1; 8], EXPRESS), (vec![2; 8], EXPRESS)], &[(8, EXPRESS)]);
    assert_eq!(e, Mismatch::Count { packs: 2, unpacks: 1 }.describe());
    let e = case(&[(vec![1; 8], EXPRESS)], &[(8, EXPRESS), (8, EXPRESS)]);
    assert_eq!(e, Mismatch::ExtraUnpack { packs: 1 }.describe());
}

#[test]
fn a_message_out_of_sequence_is_refused() {
    let (mut tx, mut rx) = side();
    let mut rdv = 0;
    let first = pack_message(&mut tx, &[(vec![1; 8], EXPRESS)], &mut rdv);
    let second = pack_message(&mut tx, &[(vec![2; 8], EXPRESS)], &mut rdv);
    let e = unpack_message(&mut rx, &second, &[(8, EXPRESS)]).unwrap_err();
    assert_eq!(e, format!("{:?}", OutOfSequence { got: 1, due: 0 }));
    unpack_message(&mut rx, &first, &[(8, EXPRESS)]).unwrap();
}

fn modes() -> impl Strategy<Value = Modes> {
    prop_oneof![
        Just(EXPRESS),
        Just(Modes { send: SendMode::Cheaper, recv: RecvMode::Express }),
        Just(Modes { send: SendMode::Later, recv: RecvMode::Cheaper }),
    ]
}

proptest! {
    /// Any run of messages of any packs (empty to several pipe messages and rendezvous
    /// sizes) arrives as packed: every byte, in order, with its modes, each message in its
    /// turn, and no pipe message over the limit.
    #[test]
    fn any_messages_arrive_as_packed(
        messages in prop::collection::vec(
            prop::collection::vec((prop_oneof![0usize..64, 64usize..5000, Just(40_000usize)], modes(), any::<u8>()), 1..6),
            1..5,
        )
    ) {
        let (mut tx, mut rx) = side();
        let mut rdv = 0;
        for (seq, message) in messages.iter().enumerate() {
            let packs: Vec<(Vec<u8>, Modes)> = message.iter().map(|&(len, m, b)| (vec![b; len], m)).collect();
            let msgs = pack_message(&mut tx, &packs, &mut rdv);
            prop_assert!(msgs.iter().all(|m| m.len() <= LIMITS.max_msg));
            let asked: Vec<_> = packs.iter().map(|(b, m)| (b.len(), *m)).collect();
            let got = unpack_message(&mut rx, &msgs, &asked).map_err(TestCaseError::fail)?;
            let want: Vec<Got> = packs.iter().map(|(b, m)| {
                if b.len() >= LIMITS.threshold { Got::Rdv(0, 0, *m) } else { Got::Bytes(b.clone(), *m) }
            }).collect();
            prop_assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(&want) {
                match (g, w) {
                    (Got::Rdv(_, len, m), Got::Rdv(_, _, wm)) => prop_assert!(*len as usize >= LIMITS.threshold && m == wm),
                    _ => prop_assert_eq!(g, w),
                }
            }
            prop_assert_eq!(rx.seq as usize, seq + 1);
        }
        prop_assert_eq!(rx.rdv_next, rdv, "every rendezvous counted in order");
    }
}

/// What the sender reads of a report is what the receiver found; words no receiver
/// writes are refused, not misread.
#[test]
fn mismatch_reports_round_trip_and_bad_words_are_refused() {
    let m = |send, recv| Modes { send, recv };
    for x in [
        Mismatch::ExtraUnpack { packs: 3 },
        Mismatch::Count { packs: 2, unpacks: 1 },
        Mismatch::Size { pack: 7, sent: 1 << 40, asked: 5 },
        Mismatch::Modes {
            pack: 1,
            sent: m(SendMode::Later, RecvMode::Cheaper),
            asked: m(SendMode::Safer, RecvMode::Express),
        },
    ] {
        assert_eq!(Mismatch::from_words(x.words()), Some(x));
    }
    assert_eq!(Mismatch::from_words([9 << 32, 0, 0]), None);
    assert_eq!(Mismatch::from_words([1 << 32, 1 << 33, 0]), None);
    assert_eq!(Mismatch::from_words([4 << 32, 200, 0]), None);
}

#[test]
fn release_counts_may_only_move_forward_up_to_what_was_issued() {
    assert_eq!(released(0, 0, 0).ok(), Some(0));
    assert_eq!(released(0, 2, 3).ok(), Some(2));
    assert_eq!(released(2, 3, 3).ok(), Some(3));
    assert!(released(0, 4, 3).is_err(), "past what was issued");
    assert!(released(2, 1, 3).is_err(), "back");
    assert!(released(0, 1, 0).is_err(), "nothing issued");
    // Across the wrap of the counters.
    assert_eq!(released(u32::MAX - 1, 1, 2).ok(), Some(1));
    assert!(released(u32::MAX - 1, 3, 2).is_err());
    assert!(is_released(3, 2) && !is_released(3, 3) && !is_released(3, 4));
    assert!(is_released(1, u32::MAX) && is_released(0, u32::MAX) && !is_released(u32::MAX, u32::MAX));
}
