//! [`Proto`] pairs over an in-memory wire whose deliveries the test schedules: every order in
//! which control messages and writes can cross is reachable.

use std::collections::VecDeque;

use proptest::prelude::*;

use super::*;
use crate::exs::wire::{self, HELLO_LEN};

const BASE: u64 = 0x1_0000;
const MEM: usize = 1 << 20;
const RING_OFF: u64 = 0xC_0000;
const KEY: u32 = 0x77;

/// What travels from one end to the other, in order.
enum Msg {
    /// A control message's bytes, and whether it carries the sender's Close (its completion is reported).
    Control(Vec<u8>, bool),
    Write {
        send: u64,
        data: Vec<u8>,
        remote_addr: u64,
        rkey: u32,
        imm: Option<u32>,
    },
}

struct End {
    proto: Proto,
    mem: Vec<u8>,
    events: Vec<Done>,
    /// Writes delivered whose completion the sender has not seen yet.
    acks: VecDeque<u64>,
    /// Every action it took, in order.
    log: Vec<Action>,
}

struct Pair {
    small_max: u32,
    ends: [End; 2],
    wires: [VecDeque<Msg>; 2],
    failures: Vec<ProtoError>,
    /// Sends that [`Proto::post_lone_send`] took.
    lone_sends: u64,
}

fn hello(kind: SocketKind, msg_credits: u16, small_max: u32, ring_len: u32) -> Hello {
    let _ = HELLO_LEN;
    Hello { kind, msg_credits, small_max, ring_addr: BASE + RING_OFF, ring_len, ring_rkey: KEY }
}

impl Pair {
    fn new(kind: SocketKind, msg_credits: u16, small_max: u32, ring_len: u32, adv_credits: u32) -> Pair {
        let h = hello(kind, msg_credits, small_max, ring_len);
        let end = || End {
            proto: Proto::new(ProtoConfig { kind, msg_credits, small_max, ring_len, adv_credits, peer: h }),
            mem: vec![0u8; MEM],
            events: Vec::new(),
            acks: VecDeque::new(),
            log: Vec::new(),
        };
        Pair {
            small_max,
            ends: [end(), end()],
            wires: [VecDeque::new(), VecDeque::new()],
            failures: Vec::new(),
            lone_sends: 0,
        }
    }

    /// Carries out end `i`'s actions: what goes to the peer joins the wire.
    fn act(&mut self, i: usize) {
        self.act_holding(i, false)
    }

    /// [`Pair::act`], leaving a control message at the end open for later records when `hold` (as the
    /// driver does after a receive while the application polls).
    fn act_holding(&mut self, i: usize, hold: bool) {
        loop {
            if hold && self.ends[i].proto.only_open_send() {
                return;
            }
            let Some(a) = self.ends[i].proto.next_action() else { return };
            self.carry_out(i, a);
        }
    }

    /// Starts a send at end `i` as the driver does: a ping-pong's reply handed back by
    /// [`Proto::post_lone_send`] is carried out at once (as the actions it stands for), any
    /// other through [`Proto::post_send`]; then the end's actions are carried out.
    fn send(&mut self, i: usize, req: u64, addr: u64, len: u64) {
        match self.ends[i].proto.post_lone_send(req, addr, len, 1) {
            Some(reply) => {
                self.lone_sends += 1;
                for a in reply.actions() {
                    self.carry_out(i, a);
                }
            }
            None => self.ends[i].proto.post_send(req, addr, len, 1).unwrap(),
        }
        self.act(i);
    }

    /// Carries out one action of end `i`'s.
    fn carry_out(&mut self, i: usize, a: Action) {
        {
            let e = &mut self.ends[i];
            e.log.push(a.clone());
            match a {
                Action::Send(records) => {
                    let close = records.iter().any(Record::is_close);
                    let mut b = Vec::new();
                    for r in records {
                        let (c, grant, data);
                        match r {
                            Record::Control(ctl, g) => {
                                (c, grant) = (ctl, g);
                            }
                            Record::Small { fill, pieces, grant: g } => {
                                let mut bytes = Vec::new();
                                for p in pieces {
                                    let at = (p.addr - BASE) as usize;
                                    bytes.extend_from_slice(&e.mem[at..at + p.len as usize]);
                                }
                                data = bytes;
                                grant = g;
                                c = match fill {
                                    Some(truncated) => Control::Fill { data: &data, truncated },
                                    None => Control::Data(&data),
                                };
                            }
                        }
                        let at = b.len();
                        b.resize(at + c.encoded_len(), 0);
                        c.encode(grant, &mut b[at..]);
                    }
                    assert!(
                        b.len() <= wire::message_max(self.small_max),
                        "a control message larger than the peer takes"
                    );
                    self.wires[i].push_back(Msg::Control(b, close));
                }
                Action::Write { send, piece, remote_addr, rkey, imm } => {
                    let at = (piece.addr - BASE) as usize;
                    let data = e.mem[at..at + piece.len as usize].to_vec();
                    self.wires[i].push_back(Msg::Write { send, data, remote_addr, rkey, imm });
                }
                Action::Copy { dst, src, len } => {
                    let at = (dst - BASE) as usize;
                    let bytes = match src {
                        CopySrc::Bytes(b) => b,
                        CopySrc::Ring(off) => {
                            let from = (RING_OFF + off) as usize;
                            e.mem[from..from + len as usize].to_vec()
                        }
                    };
                    assert_eq!(bytes.len() as u64, len);
                    e.mem[at..at + len as usize].copy_from_slice(&bytes);
                }
                Action::Done(d) => e.events.push(d),
            }
        }
    }

    /// Delivers the oldest message from end `from` to its peer; false if none.
    fn deliver(&mut self, from: usize) -> bool {
        let to = 1 - from;
        let Some(m) = self.wires[from].pop_front() else { return false };
        let mut close_delivered = false;
        let r = match m {
            Msg::Control(b, close) => {
                close_delivered = close;
                let mem = &mut self.ends[to].mem;
                self.ends[to].proto.on_control(&b, &mut |dst, data| {
                    let at = (dst - BASE) as usize;
                    mem[at..at + data.len()].copy_from_slice(data);
                })
            }
            Msg::Write { send, data, remote_addr, rkey, imm } => {
                assert_eq!(rkey, KEY);
                let at = (remote_addr - BASE) as usize;
                self.ends[to].mem[at..at + data.len()].copy_from_slice(&data);
                self.ends[from].acks.push_back(send);
                match imm {
                    Some(imm) => self.ends[to].proto.on_write_imm(imm),
                    None => Ok(()),
                }
            }
        };
        if let Err(e) = r {
            eprintln!("end {to}: {e}");
            self.failures.push(e);
        }
        self.act(to);
        if close_delivered {
            // The delivery of the message at the sender, now that the peer has it.
            self.ends[from].proto.on_close_delivered();
            self.act(from);
        }
        true
    }

    fn complete_write(&mut self, i: usize) -> bool {
        let Some(send) = self.ends[i].acks.pop_front() else { return false };
        self.ends[i].proto.on_write_done(send);
        self.act(i);
        true
    }

    fn settle(&mut self) {
        self.act(0);
        self.act(1);
        while self.deliver(0) | self.deliver(1) | self.complete_write(0) | self.complete_write(1) {}
    }

    fn fill(&mut self, i: usize, at: u64, bytes: &[u8]) {
        let off = (at - BASE) as usize;
        self.ends[i].mem[off..off + bytes.len()].copy_from_slice(bytes);
    }

    fn read(&self, i: usize, at: u64, len: u64) -> &[u8] {
        let off = (at - BASE) as usize;
        &self.ends[i].mem[off..off + len as usize]
    }
}

fn done(pair: &Pair, i: usize, op: OpKind) -> Vec<Done> {
    pair.ends[i].events.iter().copied().filter(|d| d.op == op).collect()
}

#[test]
fn a_posted_receive_takes_the_message_by_one_write_into_its_buffer() {
    let mut p = Pair::new(SocketKind::SeqPacket, 16, 64, 0, 4);
    p.ends[1].proto.post_recv(7, BASE + 0x100, 4096, KEY).unwrap();
    p.settle();
    let msg = vec![0xAB; 1000];
    p.fill(0, BASE, &msg);
    p.ends[0].proto.post_send(3, BASE, 1000, 1).unwrap();
    p.act(0);
    assert!(
        matches!(p.wires[0].front(), Some(Msg::Write { imm: Some(_), .. })),
        "an advertised buffer is written, not copied"
    );
    p.settle();
    assert_eq!(done(&p, 1, OpKind::Recv), vec![Done { req: 7, op: OpKind::Recv, outcome: Ok(1000), truncated: false }]);
    assert_eq!(p.read(1, BASE + 0x100, 1000), &msg[..]);
    assert_eq!(done(&p, 0, OpKind::Send), vec![Done { req: 3, op: OpKind::Send, outcome: Ok(1000), truncated: false }]);
}

/// A receive no larger than a small message is offered in the short form (no address, no
/// key) and filled by a record in the sender's control message: one message of 24 bytes
/// carries a ping-pong's reply and the next receive's offer. A longer message is cut to it.
#[test]
fn a_small_receive_is_offered_short_and_filled_by_a_record() {
    let mut p = Pair::new(SocketKind::SeqPacket, 16, 64, 0, 4);
    p.ends[1].proto.post_recv(1, BASE + 0x100, 8, KEY).unwrap();
    p.act(1);
    let Some(Msg::Control(b, _)) = p.wires[1].front() else { panic!("an advertisement goes") };
    assert_eq!(b.len(), 10, "the short form");
    p.settle();
    p.fill(0, BASE, b"12345678abcd");
    p.ends[0].proto.post_recv(2, BASE + 0x200, 8, KEY).unwrap();
    p.ends[0].proto.post_send(3, BASE, 12, 1).unwrap();
    p.act(0);
    assert_eq!(p.wires[0].len(), 1, "no write: one control message");
    let Some(Msg::Control(b, _)) = p.wires[0].front() else { panic!("a control message") };
    assert_eq!(b.len(), 10 + wire::DATA_OVERHEAD + 8, "the short offer and the cut message's fill");
    p.fill(1, BASE + 0x108, &[0x5A; 4]);
    p.settle();
    assert_eq!(done(&p, 1, OpKind::Recv), vec![Done { req: 1, op: OpKind::Recv, outcome: Ok(8), truncated: true }]);
    assert_eq!(p.read(1, BASE + 0x100, 12), b"12345678\x5a\x5a\x5a\x5a", "nothing past the buffer");
}

#[test]
fn a_message_longer_than_the_buffer_is_cut_and_says_so_without_overrunning() {
    let mut p = Pair::new(SocketKind::SeqPacket, 16, 64, 0, 4);
    p.fill(1, BASE + 0x100 + 100, &[0x5A; 16]);
    p.ends[1].proto.post_recv(1, BASE + 0x100, 100, KEY).unwrap();
    p.settle();
    p.fill(0, BASE, &[1; 500]);
    p.ends[0].proto.post_send(2, BASE, 500, 1).unwrap();
    p.settle();
    assert_eq!(done(&p, 1, OpKind::Recv), vec![Done { req: 1, op: OpKind::Recv, outcome: Ok(100), truncated: true }]);
    assert_eq!(p.read(1, BASE + 0x100 + 100, 16), &[0x5A; 16], "nothing past the buffer");
    assert_eq!(done(&p, 0, OpKind::Send)[0].outcome, Ok(500));
}

#[test]
fn a_small_message_goes_before_any_receive_and_waits_holding_its_credit() {
    let mut p = Pair::new(SocketKind::SeqPacket, 16, 64, 0, 4);
    p.fill(0, BASE, b"hello");
    p.ends[0].proto.post_send(1, BASE, 5, 1).unwrap();
    p.settle();
    assert_eq!(done(&p, 0, OpKind::Send)[0].outcome, Ok(5), "copied into the message: complete at once");
    p.ends[1].proto.post_recv(9, BASE + 0x200, 64, KEY).unwrap();
    p.settle();
    assert_eq!(done(&p, 1, OpKind::Recv)[0].outcome, Ok(5));
    assert_eq!(p.read(1, BASE + 0x200, 5), b"hello");
}

#[test]
fn a_large_seqpacket_message_waits_for_a_receive() {
    let mut p = Pair::new(SocketKind::SeqPacket, 16, 64, 0, 4);
    p.fill(0, BASE, &[3; 300]);
    p.ends[0].proto.post_send(1, BASE, 300, 1).unwrap();
    p.settle();
    assert!(done(&p, 0, OpKind::Send).is_empty());
    p.ends[1].proto.post_recv(2, BASE + 0x1000, 300, KEY).unwrap();
    p.settle();
    assert_eq!(done(&p, 0, OpKind::Send)[0].outcome, Ok(300));
    assert_eq!(done(&p, 1, OpKind::Recv)[0].outcome, Ok(300));
    assert_eq!(p.read(1, BASE + 0x1000, 300), &[3; 300][..]);
}

/// Once the peer rejected an advertisement (stream bytes went ahead of it), the next bytes
/// wait for advertisements instead of going into the stream buffer, which would doom the
/// peer's next ones too; `resume_ring` (the driver's bound on the wait) lets them in again.
#[test]
fn after_a_rejection_stream_bytes_wait_for_an_advertisement_until_resumed() {
    let mut p = Pair::new(SocketKind::Stream, 16, 64, 4096, 4);
    p.fill(0, BASE, &[7; 400]);
    p.ends[1].proto.post_recv(1, BASE + 0x1000, 100, KEY).unwrap();
    p.ends[1].proto.post_recv(2, BASE + 0x2000, 1000, KEY).unwrap();
    p.act(1);
    // The first send crosses the advertisements: into the stream buffer.
    p.ends[0].proto.post_send(1, BASE, 200, 1).unwrap();
    p.act(0);
    assert!(matches!(p.wires[0].front(), Some(Msg::Write { .. })), "into the stream buffer");
    // The stale advertisements arrive and are rejected.
    while p.deliver(1) {}
    p.act(0);
    assert!(!p.ends[0].proto.ring_waiting(), "nothing queued waits");
    p.ends[0].proto.post_send(2, BASE + 200, 200, 1).unwrap();
    p.act(0);
    assert!(p.ends[0].proto.ring_waiting(), "the second send waits for an advertisement");
    let writes = |p: &Pair| p.wires[0].iter().filter(|m| matches!(m, Msg::Write { .. })).count();
    assert_eq!(writes(&p), 1, "nothing more into the stream buffer");
    // Bounded: resumed, the bytes go into the stream buffer after all.
    let answered = p.ends[0].proto.ads_answered();
    p.ends[0].proto.resume_ring();
    p.act(0);
    assert!(!p.ends[0].proto.ring_waiting());
    assert_eq!(writes(&p), 2);
    assert_eq!(p.ends[0].proto.ads_answered(), answered);
    // A stream receive takes the bytes at hand: a third one takes the rest.
    p.settle();
    p.ends[1].proto.post_recv(3, BASE + 0x3000, 1000, KEY).unwrap();
    p.settle();
    let got: u64 = done(&p, 1, OpKind::Recv).iter().map(|d| d.outcome.unwrap()).sum();
    assert_eq!(got, 400, "every byte, in order");
    assert_eq!(p.read(1, BASE + 0x1000, 100), &[7; 100][..]);
}

#[test]
fn stream_bytes_run_ahead_of_receives_through_the_stream_buffer() {
    let mut p = Pair::new(SocketKind::Stream, 16, 64, 4096, 4);
    let data: Vec<u8> = (0..6000u32).map(|i| (i % 251) as u8).collect();
    p.fill(0, BASE, &data);
    p.ends[0].proto.post_send(1, BASE, 6000, 1).unwrap();
    p.settle();
    // A quarter of the buffer per write, until half of it is unacknowledged.
    assert!(done(&p, 0, OpKind::Send).is_empty());
    let mut got = Vec::new();
    let mut req = 0;
    while got.len() < 6000 {
        req += 1;
        p.ends[1].proto.post_recv(req, BASE + 0x4000, 700, KEY).unwrap();
        p.settle();
        let d = *done(&p, 1, OpKind::Recv).last().unwrap();
        assert_eq!(d.req, req);
        let n = d.outcome.unwrap();
        assert!(n > 0);
        got.extend_from_slice(p.read(1, BASE + 0x4000, n));
    }
    assert_eq!(got, data);
    assert_eq!(done(&p, 0, OpKind::Send)[0].outcome, Ok(6000));
}

#[test]
fn a_receive_after_the_peers_close_sees_the_end() {
    let mut p = Pair::new(SocketKind::Stream, 16, 64, 0, 4);
    p.fill(0, BASE, b"bye");
    p.ends[0].proto.post_send(1, BASE, 3, 1).unwrap();
    p.ends[0].proto.close(2).unwrap();
    p.settle();
    assert_eq!(done(&p, 0, OpKind::Close)[0].outcome, Ok(0));
    p.ends[1].proto.post_recv(5, BASE + 0x100, 10, KEY).unwrap();
    p.ends[1].proto.post_recv(6, BASE + 0x200, 10, KEY).unwrap();
    p.settle();
    let r = done(&p, 1, OpKind::Recv);
    assert_eq!((r[0].req, r[0].outcome), (5, Ok(3)));
    assert_eq!((r[1].req, r[1].outcome), (6, Ok(0)));
    assert_eq!(p.ends[0].proto.post_send(9, BASE, 1, 1), Err(libc::EPIPE));
}

/// A peer that closed and then went away (its process exited at its close event, and our
/// next advertisement to it failed) leaves its data and the end readable, as over TCP; sends
/// fail.
#[test]
fn a_peer_gone_after_its_close_leaves_the_data_and_the_end() {
    let mut p = Pair::new(SocketKind::Stream, 16, 64, 0, 4);
    p.fill(0, BASE, b"bye");
    p.ends[0].proto.post_send(1, BASE, 3, 1).unwrap();
    p.ends[0].proto.close(2).unwrap();
    p.settle();
    p.ends[1].proto.post_recv(4, BASE + 0x100, 10, KEY).unwrap();
    p.ends[1].proto.fail(libc::ECONNRESET);
    p.ends[1].proto.post_recv(5, BASE + 0x200, 10, KEY).unwrap();
    p.act(1);
    let r = done(&p, 1, OpKind::Recv);
    assert_eq!((r[0].req, r[0].outcome), (4, Ok(3)));
    assert_eq!((r[1].req, r[1].outcome), (5, Ok(0)));
    assert_eq!(p.read(1, BASE + 0x100, 3), b"bye");
    assert_eq!(p.ends[1].proto.post_send(9, BASE, 1, 1), Err(libc::ECONNRESET));
}

/// A close completes only once the message carrying the Close was delivered (the peer has it): a program
/// that exits at its close event leaves the peer the end of the data, never a reset.
#[test]
fn a_close_completes_once_the_peer_has_it() {
    let mut p = Pair::new(SocketKind::Stream, 16, 64, 0, 4);
    p.fill(0, BASE, b"last");
    p.ends[0].proto.post_send(1, BASE, 4, 1).unwrap();
    p.ends[0].proto.close(2).unwrap();
    p.act(0);
    assert!(done(&p, 0, OpKind::Close).is_empty(), "closed before the Close left");
    while p.deliver(0) {}
    assert_eq!(done(&p, 0, OpKind::Close)[0].outcome, Ok(0));
    assert!(p.ends[0].proto.closed());
}

#[test]
fn closing_cancels_the_receives_still_waiting() {
    let mut p = Pair::new(SocketKind::SeqPacket, 16, 64, 0, 4);
    p.ends[1].proto.post_recv(5, BASE + 0x100, 10, KEY).unwrap();
    p.ends[1].proto.close(6).unwrap();
    p.settle();
    assert_eq!(done(&p, 1, OpKind::Recv)[0].outcome, Err(libc::ECANCELED));
    assert_eq!(done(&p, 1, OpKind::Close)[0].outcome, Ok(0));
}

#[test]
fn a_failed_connection_fails_every_operation() {
    let mut p = Pair::new(SocketKind::Stream, 16, 64, 0, 4);
    p.ends[0].proto.post_send(1, BASE, 100, 1).unwrap();
    p.ends[0].proto.post_recv(2, BASE + 0x1000, 100, KEY).unwrap();
    p.ends[0].proto.fail(libc::ECONNRESET);
    p.act(0);
    assert_eq!(p.ends[0].events.len(), 2);
    assert!(p.ends[0].events.iter().all(|d| d.outcome == Err(libc::ECONNRESET)));
    assert_eq!(p.ends[0].proto.post_send(3, BASE, 1, 1), Err(libc::ECONNRESET));
}

#[test]
fn peer_messages_the_protocol_forbids_fail_the_connection() {
    let imm = WriteNote::Advertised { len: 10, truncated: false }.encode();
    // A write into no advertisement.
    let mut p = Pair::new(SocketKind::SeqPacket, 16, 64, 0, 4);
    p.ends[1].proto.post_recv(1, BASE, 10, KEY).unwrap();
    assert!(p.ends[0].proto.on_write_imm(imm).is_err());
    assert_eq!(p.ends[0].proto.failure(), Some(libc::EPROTO));
    // A write longer than the advertisement.
    let mut p = Pair::new(SocketKind::SeqPacket, 16, 64, 0, 4);
    p.ends[1].proto.post_recv(1, BASE, 8, KEY).unwrap();
    assert!(p.ends[1].proto.on_write_imm(imm).is_err());
    // A stream-buffer write on a socket without one, a rejection of a good advertisement,
    // an advertisement out of sequence, more credits than the limit.
    let mut p = Pair::new(SocketKind::Stream, 16, 64, 0, 4);
    assert!(p.ends[1].proto.on_write_imm(WriteNote::Ring { len: 8, wrapped: false }.encode()).is_err());
    let mut p = Pair::new(SocketKind::Stream, 16, 64, 0, 4);
    p.ends[1].proto.post_recv(1, BASE, 8, KEY).unwrap();
    let mut b = [0u8; 8];
    let n = Control::Reject { seq: 0 }.encode(0, &mut b);
    assert!(p.ends[1].proto.on_control(&b[..n], &mut |_, _| {}).is_err());
    let mut p = Pair::new(SocketKind::Stream, 16, 64, 0, 4);
    let mut b = [0u8; 64];
    let n = Control::Advertise(Advert { seq: 5, unadvertised_seen: 0, addr: 0, len: 1, rkey: 0, fill_only: false })
        .encode(0, &mut b);
    assert!(p.ends[0].proto.on_control(&b[..n], &mut |_, _| {}).is_err());
    let mut p = Pair::new(SocketKind::Stream, 16, 64, 0, 4);
    let n = Control::Credit.encode(u16::MAX, &mut b);
    assert!(p.ends[0].proto.on_control(&b[..n], &mut |_, _| {}).is_err());
    assert!(p.ends[0].proto.post_recv(1, BASE, 1, KEY).is_err());
}

/// One step of a random schedule.
#[derive(Clone, Debug)]
enum Step {
    Send { from: usize, len: u64 },
    Recv { at: usize, len: u64 },
    Deliver(usize),
    Complete(usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0..2usize, prop_oneof![1u64..80, 80u64..3000]).prop_map(|(from, len)| Step::Send { from, len }),
        (0..2usize, prop_oneof![1u64..80, 80u64..3000]).prop_map(|(at, len)| Step::Recv { at, len }),
        (0..2usize).prop_map(Step::Deliver),
        (0..2usize).prop_map(Step::Complete),
    ]
}

/// A ping-pong's turn at end `from`: the next receive, the reply, its delivery.
fn turn(from: usize, recv_len: u64, send_len: u64) -> Vec<Step> {
    vec![Step::Recv { at: from, len: recv_len }, Step::Send { from, len: send_len }, Step::Deliver(from)]
}

/// A few steps of a random schedule of small messages: mostly a ping-pong's turns, or one
/// call or delivery that crosses them (the states where the shortcuts apply, and those beside
/// them).
fn small_steps() -> impl Strategy<Value = Vec<Step>> {
    prop_oneof![
        1 => (0..2usize, 1u64..80).prop_map(|(from, len)| vec![Step::Send { from, len }]),
        1 => (0..2usize, 1u64..80).prop_map(|(at, len)| vec![Step::Recv { at, len }]),
        1 => (0..2usize).prop_map(|from| vec![Step::Deliver(from)]),
        3 => (0..2usize, 1u64..80, 1u64..80).prop_map(|(from, recv_len, send_len)| turn(from, recv_len, send_len)),
        3 => (1u64..80, 1u64..80).prop_map(|(a, b)| [turn(0, a, b), turn(1, b, a)].concat()),
    ]
}

/// One direction's messages sent, and those received (with their truncation flags).
type Traffic = (Vec<Vec<u8>>, Vec<(Vec<u8>, bool)>);

/// Runs a schedule both ways; returns each direction's traffic.
fn run(kind: SocketKind, ring: u32, steps: &[Step]) -> [Traffic; 2] {
    run_logged(kind, ring, steps, false).0
}

/// [`run`], every call taking the pass when `generic_only`; also returns each end's actions.
fn run_logged(kind: SocketKind, ring: u32, steps: &[Step], generic_only: bool) -> ([Traffic; 2], [Vec<Action>; 2]) {
    let mut p = Pair::new(kind, 8, 64, ring, 3);
    for e in &mut p.ends {
        e.proto.generic_only = generic_only;
    }
    // Each end sends from its own area and receives into another; buffers are never reused
    // while in flight.
    let mut send_at = [BASE; 2];
    let mut recv_at = [BASE + 0x40000; 2];
    let mut sent: [Vec<Vec<u8>>; 2] = [Vec::new(), Vec::new()];
    let mut recvs: [Vec<(u64, u64)>; 2] = [Vec::new(), Vec::new()];
    let mut seed = 1u8;
    for s in steps {
        match *s {
            Step::Send { from, len } => {
                let data: Vec<u8> = (0..len).map(|i| seed.wrapping_add(i as u8)).collect();
                seed = seed.wrapping_add(37);
                p.fill(from, send_at[from], &data);
                let req = sent[from].len() as u64;
                p.send(from, req, send_at[from], len);
                send_at[from] += len;
                sent[from].push(data);
            }
            Step::Recv { at, len } => {
                let req = recvs[at].len() as u64;
                p.ends[at].proto.post_recv(req, recv_at[at], len, KEY).unwrap();
                recvs[at].push((recv_at[at], len));
                recv_at[at] += len;
                // The advertisement may wait for the next call to share its SEND.
                p.act_holding(at, true);
                continue;
            }
            Step::Deliver(from) => {
                p.deliver(from);
            }
            Step::Complete(i) => {
                p.complete_write(i);
            }
        }
        p.act(0);
        p.act(1);
    }
    // Receives until every send completed (a stream's receive may take a part), then close.
    for _ in 0..10_000 {
        p.settle();
        let mut busy = false;
        for at in 0..2 {
            let sends_done = done(&p, 1 - at, OpKind::Send).len();
            let got = done(&p, at, OpKind::Recv);
            let recvs_done = got.len();
            let unread = match kind {
                SocketKind::Stream => {
                    got.iter().map(|d| d.outcome.unwrap_or(0)).sum::<u64>()
                        < sent[1 - at].iter().map(|m| m.len() as u64).sum::<u64>()
                }
                SocketKind::SeqPacket => recvs_done < sent[1 - at].len(),
            };
            if sends_done < sent[1 - at].len() || unread {
                busy = true;
                if recvs_done == recvs[at].len() {
                    let req = recvs[at].len() as u64;
                    p.ends[at].proto.post_recv(req, recv_at[at], 3000, KEY).unwrap();
                    recvs[at].push((recv_at[at], 3000));
                    recv_at[at] += 3000;
                }
            }
        }
        if !busy {
            break;
        }
    }
    p.settle();
    p.ends[0].proto.close(1000).unwrap();
    p.ends[1].proto.close(1000).unwrap();
    p.settle();
    assert!(p.failures.is_empty(), "{:?}", p.failures);
    let mut out: [Traffic; 2] = Default::default();
    for i in 0..2 {
        let sends = done(&p, i, OpKind::Send);
        assert_eq!(sends.len(), sent[i].len(), "every send completes");
        assert!(sends.iter().enumerate().all(|(k, d)| d.req == k as u64 && d.outcome == Ok(sent[i][k].len() as u64)));
        let at = 1 - i;
        let mut got = Vec::new();
        for d in done(&p, at, OpKind::Recv) {
            if let Ok(n) = d.outcome {
                if n > 0 {
                    let (addr, _) = recvs[at][d.req as usize];
                    got.push((p.read(at, addr, n).to_vec(), d.truncated));
                }
            }
        }
        out[i] = (std::mem::take(&mut sent[i]), got);
    }
    let logs = [std::mem::take(&mut p.ends[0].log), std::mem::take(&mut p.ends[1].log)];
    (out, logs)
}

#[test]
fn a_ping_pong_takes_the_shortcuts_and_one_message_a_way() {
    let mut p = Pair::new(SocketKind::SeqPacket, 8, 64, 0, 3);
    p.ends[1].proto.post_recv(0, BASE + 0x40000, 8, KEY).unwrap();
    p.act(1);
    p.deliver(1);
    for k in 0..10u64 {
        let (from, to) = ((k % 2) as usize, 1 - (k % 2) as usize);
        // The echo's order: the next receive (held for the send), then the reply.
        p.ends[from].proto.post_recv(k + 1, BASE + 0x40000 + 64 * (k + 1), 8, KEY).unwrap();
        p.act_holding(from, true);
        p.fill(from, BASE + 8 * k, &k.to_le_bytes());
        p.send(from, k, BASE + 8 * k, 8);
        assert_eq!(p.wires[from].len(), 1, "one control message a way");
        assert!(p.deliver(from));
        p.act(to);
        let got = done(&p, to, OpKind::Recv);
        let last = got.last().expect("the receive completed");
        assert_eq!(last.outcome, Ok(8));
        let addr = BASE + 0x40000 + 64 * last.req;
        assert_eq!(p.read(to, addr, 8), k.to_le_bytes());
    }
    let taken: u64 = p.ends.iter().map(|e| e.proto.shortcuts_taken).sum();
    // Every send after the first at each end, every receive after the first, and every
    // arrival after the first.
    assert!(taken >= 25, "shortcuts taken {taken} times");
    // Every reply went straight to the wire, with the receive's advertisement before it.
    assert_eq!(p.lone_sends, 10);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn a_stream_delivers_every_byte_in_order_whatever_crosses(steps in proptest::collection::vec(step(), 0..60), ring in prop_oneof![Just(0u32), Just(256u32), Just(4096u32)]) {
        for (sent, got) in run(SocketKind::Stream, ring, &steps) {
            let sent: Vec<u8> = sent.concat();
            let got: Vec<u8> = got.into_iter().flat_map(|(b, _)| b).collect();
            prop_assert_eq!(got, sent);
        }
    }

    #[test]
    fn the_shortcuts_do_what_the_pass_does(steps in proptest::collection::vec(step(), 0..60), stream in any::<bool>(), ring in prop_oneof![Just(0u32), Just(256u32)]) {
        let kind = if stream { SocketKind::Stream } else { SocketKind::SeqPacket };
        let (traffic, logs) = run_logged(kind, ring, &steps, false);
        let (generic_traffic, generic_logs) = run_logged(kind, ring, &steps, true);
        prop_assert_eq!(logs, generic_logs);
        prop_assert_eq!(traffic, generic_traffic);
    }

    #[test]
    fn the_shortcuts_do_what_the_pass_does_in_ping_pongs(steps in proptest::collection::vec(small_steps(), 0..30), stream in any::<bool>()) {
        let steps = steps.concat();
        let kind = if stream { SocketKind::Stream } else { SocketKind::SeqPacket };
        let (traffic, logs) = run_logged(kind, 0, &steps, false);
        let (generic_traffic, generic_logs) = run_logged(kind, 0, &steps, true);
        prop_assert_eq!(logs, generic_logs);
        prop_assert_eq!(traffic, generic_traffic);
    }

    #[test]
    fn seqpacket_keeps_every_message_whole_and_in_order(steps in proptest::collection::vec(step(), 0..60)) {
        for (sent, got) in run(SocketKind::SeqPacket, 0, &steps) {
            let empty = sent.iter().filter(|m| m.is_empty()).count();
            prop_assert_eq!(empty, 0);
            prop_assert_eq!(got.len(), sent.len());
            for (m, (g, truncated)) in sent.iter().zip(&got) {
                if *truncated {
                    prop_assert!(g.len() < m.len());
                    prop_assert_eq!(&m[..g.len()], &g[..]);
                } else {
                    prop_assert_eq!(m, g);
                }
            }
        }
    }
}
