//! The client side of `pv_peer target`: a queue pair to the peer, its command protocol
//! (`peer_proto`), and the verbs scenarios run against it. Shared by the cross-process tests
//! (peer on this host) and the two-host tests (peer in another namespace, over TCP).

use std::time::{Duration, Instant};

use portability_verbs::*;

use crate::peer_proto::*;
use crate::{pattern, WAIT};

/// A connection to a `pv_peer target`.
pub struct PeerClient {
    pub ctx: Context,
    pub pd: ProtectionDomain,
    pub cq: CompletionQueue,
    pub qp: QueuePair,
    pub layout: Layout,
    pub replies: MemoryRegion,
    pub out: MemoryRegion,
    pub next_id: u64,
}

impl PeerClient {
    /// Connects to the peer listening at `addr` (retrying while it starts).
    pub fn connect(addr: &str) -> PeerClient {
        let ctx = Context::open(Provider::Software).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let conn = cm::connect_retrying(&addr.parse().unwrap(), &pd, &cm::QpSpec::default(), b"", WAIT).unwrap();
        let cq = conn.cq.clone();
        let layout = Layout::decode(&conn.peer_private).expect("layout in private data");
        let replies = pd.register(vec![0u8; 4 * CTRL_SLOT].into_boxed_slice(), AccessFlags::ALL).unwrap();
        let out = pd.register(vec![0u8; 2 << 20].into_boxed_slice(), AccessFlags::ALL).unwrap();
        for i in 0..4 {
            conn.qp.post_recv(&[RecvWr::new(i, &[replies.sge(i as usize * CTRL_SLOT, CTRL_SLOT)])]).unwrap();
        }
        PeerClient { ctx, pd, cq, qp: conn.qp, layout, replies, out, next_id: 100 }
    }

    /// Waits for the next receive completion (send completions must be successes).
    pub fn next_recv(&mut self) -> WorkCompletion {
        let deadline = Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let wc = {
                let mut w = [WorkCompletion::EMPTY; 1];
                self.cq.poll_blocking(&mut w, left).expect("peer answered");
                w[0]
            };
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            if wc.opcode != WcOpcode::Send && wc.opcode != WcOpcode::RdmaWrite {
                return wc;
            }
        }
    }

    pub fn take_reply(&mut self, wc: WorkCompletion) -> Vec<u8> {
        let slot = wc.wr_id as usize * CTRL_SLOT;
        let mut b = vec![0u8; wc.byte_len as usize];
        self.replies.read(slot, &mut b);
        self.qp.post_recv(&[RecvWr::new(wc.wr_id, &[self.replies.sge(slot, CTRL_SLOT)])]).unwrap();
        b
    }

    /// Sends a command without waiting for anything.
    pub fn post(&mut self, cmd: &Command) {
        let bytes = cmd.encode();
        self.out.write(0, &bytes);
        self.next_id += 1;
        self.qp.post_send(&[SendWr::send(self.next_id, &[self.out.sge(0, bytes.len())])]).unwrap();
    }

    pub fn call(&mut self, cmd: &Command) -> Vec<u8> {
        self.post(cmd);
        let wc = self.next_recv();
        self.take_reply(wc)
    }

    pub fn checksum(&mut self, segment: bool, offset: usize, len: usize) -> u64 {
        match Reply::decode(&self.call(&Command::Checksum { segment, offset: offset as u64, len: len as u64 })) {
            Some(Reply::Checksum(c)) => c,
            other => panic!("bad reply {other:?}"),
        }
    }

    pub fn region(&self, segment: bool) -> (u64, u32) {
        if segment {
            (self.layout.seg_addr, self.layout.seg_rkey)
        } else {
            (self.layout.user_addr, self.layout.user_rkey)
        }
    }

    /// Posts `wr` and waits for its completion (earlier ones must be successes).
    pub fn one_sided(&mut self, wr: SendWr) -> WorkCompletion {
        self.qp.post_send(&[wr]).unwrap();
        let deadline = Instant::now() + WAIT;
        loop {
            let mut w = [WorkCompletion::EMPTY; 1];
            self.cq.poll_blocking(&mut w, deadline.saturating_duration_since(Instant::now())).unwrap();
            if w[0].wr_id == self.next_id {
                return w[0];
            }
            assert_eq!(w[0].status, WcStatus::Success);
        }
    }
}

/// Echoes messages of every size, across the transports' thresholds.
pub fn sends_at_every_size(peer: &mut PeerClient) {
    for (i, len) in [0usize, 1, 7, 64, 1000, 8191, 8192, 8193, 30_000, 60_000].into_iter().enumerate() {
        let data = pattern(i as u64, len);
        let reply = peer.call(&Command::Echo(data.clone()));
        assert_eq!(reply, data, "echo of {len} bytes");
    }
}

/// Writes, reads and writes with immediate into the peer's user memory (`segment` false) or
/// provider segment, checked by the peer; ends with a write out of bounds, which must fail
/// with a remote access error (the queue pair is then in error).
pub fn one_sided_operations(peer: &mut PeerClient, segment: bool) {
    let (base, rkey) = peer.region(segment);
    for (i, len) in [1usize, 8, 4096, 65_536, 1 << 20].into_iter().enumerate() {
        let data = pattern(100 + i as u64, len);
        peer.out.write(0, &data);
        peer.next_id += 1;
        let wc = peer.one_sided(SendWr::write(peer.next_id, &[peer.out.sge(0, len)], base, rkey));
        assert_eq!(wc.status, WcStatus::Success);
        assert_eq!(peer.checksum(segment, 0, len), fnv(&data), "write {len} (segment {segment})");
        // Read it back.
        peer.out.write(1 << 20, &vec![0u8; len]);
        peer.next_id += 1;
        let wc = peer.one_sided(SendWr::read(peer.next_id, &[peer.out.sge(1 << 20, len)], base, rkey));
        assert_eq!(wc.status, WcStatus::Success);
        let mut got = vec![0u8; len];
        peer.out.read(1 << 20, &mut got);
        assert_eq!(got, data, "read {len} (segment {segment})");
    }
    // Writes with immediate: small ones travel in the ring, large ones are placed directly.
    for (imm, len) in [(7u32, 16usize), (8, 100_000)] {
        let data = pattern(imm as u64, len);
        peer.out.write(0, &data);
        peer.next_id += 1;
        peer.qp
            .post_send(&[SendWr::write_with_imm(peer.next_id, &[peer.out.sge(0, len)], base + 64, rkey, imm)])
            .unwrap();
        let wc = peer.next_recv();
        assert_eq!(Reply::decode(&peer.take_reply(wc)), Some(Reply::Imm(imm, len as u32)));
        assert_eq!(peer.checksum(segment, 64, len), fnv(&data));
    }
    // A zero-byte one names no memory, so any key and address will do (IBA C9-88).
    peer.next_id += 1;
    peer.qp.post_send(&[SendWr::write_with_imm(peer.next_id, &[], 0xdead_0000, rkey ^ 0x7700, 9)]).unwrap();
    let wc = peer.next_recv();
    assert_eq!(Reply::decode(&peer.take_reply(wc)), Some(Reply::Imm(9, 0)));
    // Bounds are checked at the target.
    peer.next_id += 1;
    let wc = peer.one_sided(SendWr::write(peer.next_id, &[peer.out.sge(0, 16)], base + REGION as u64 - 8, rkey));
    assert_eq!(wc.status, WcStatus::RemAccessErr);
}

/// Fetch-and-adds and a compare-and-swap on both of the peer's regions, checked by the peer.
pub fn atomics(peer: &mut PeerClient) {
    for segment in [false, true] {
        let (base, rkey) = peer.region(segment);
        let target = base + 128;
        for i in 0..200u64 {
            peer.next_id += 1;
            let wc = peer.one_sided(SendWr::fetch_and_add(peer.next_id, peer.out.sge(0, 8), target, rkey, 3));
            assert_eq!(wc.status, WcStatus::Success);
            assert_eq!(peer.out.read_u64(0), i * 3);
        }
        peer.next_id += 1;
        let wc = peer.one_sided(SendWr::compare_and_swap(peer.next_id, peer.out.sge(8, 8), target, rkey, 600, 1));
        assert_eq!(wc.status, WcStatus::Success);
        assert_eq!(peer.out.read_u64(8), 600);
        match Reply::decode(&peer.call(&Command::Read64 { segment, offset: 128 })) {
            Some(Reply::Value(v)) => assert_eq!(v, 1),
            other => panic!("{other:?}"),
        }
    }
}

/// Waits until a completion queue reports `n` completions or `limit` passes; returns them.
pub fn completions_within(cq: &CompletionQueue, n: usize, limit: Duration) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + limit;
    let mut got = Vec::new();
    let mut w = [WorkCompletion::EMPTY; 16];
    while got.len() < n && Instant::now() < deadline {
        if let Ok(k) = cq.poll_blocking(&mut w, deadline.saturating_duration_since(Instant::now())) {
            got.extend_from_slice(&w[..k]);
        }
    }
    got
}
