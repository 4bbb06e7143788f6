//! Fuzzes what an EXS peer sends (`sockets_compat::exs`): pipe messages (records or write
//! notes), write notes as immediates and handshake data, fed to a connection end with receives posted. Whatever arrives, the end
//! never panics, and every copy it orders lands inside a posted receive buffer (from inside its
//! stream buffer): a malformed peer gets an error, never a write outside a registration.
#![no_main]
use libfuzzer_sys::fuzz_target;
use sockets_compat::exs::proto::{Action, CopySrc, Proto, ProtoConfig};
use sockets_compat::exs::wire::{Control, Hello, Message, SocketKind, WriteNote};

const RING: u32 = 4096;
const BUFFERS: [(u64, u64); 3] = [(0x1000, 100), (0x2000, 5000), (0x9000, 1)];

fuzz_target!(|data: &[u8]| {
    let _ = Hello::decode(data);
    if let Ok((g, c)) = Control::decode(data) {
        let mut b = vec![0u8; c.encoded_len()];
        c.encode(g, &mut b);
        assert_eq!(Control::decode(&b).unwrap(), (g, c));
    }
    let Some((&kind_byte, mut rest)) = data.split_first() else { return };
    let kind = if kind_byte & 1 == 0 { SocketKind::Stream } else { SocketKind::SeqPacket };
    let peer = Hello { kind, msg_credits: 16, small_max: 64, ring_addr: 0x10_0000, ring_len: RING, ring_rkey: 1 };
    let mut p = Proto::new(ProtoConfig { kind, msg_credits: 16, small_max: 64, ring_len: RING, adv_credits: 4, peer });
    // Three receives and a send, or a ping-pong's state: one receive alone (its fill is taken
    // by the shortcut `Proto::on_control` takes for a ping-pong's message).
    if kind_byte & 2 == 0 {
        for (i, (addr, len)) in BUFFERS.iter().enumerate() {
            p.post_recv(i as u64, *addr, *len, 7).unwrap();
        }
        p.post_send(9, 0x5_0000, 300, 3).unwrap();
    } else {
        p.post_recv(0, BUFFERS[0].0, BUFFERS[0].1, 7).unwrap();
    }
    // Each step: a tag byte, then a length byte and that many bytes (a control message), or
    // four bytes (an immediate).
    while let Some((&tag, r)) = rest.split_first() {
        rest = r;
        let _ = if tag & 1 == 0 {
            let Some((&n, r)) = rest.split_first() else { break };
            let n = (n as usize).min(r.len());
            rest = &r[n..];
            // As the connection's driver takes a message of its pipe.
            match Message::decode(&r[..n]) {
                Ok(Message::Written(note)) => p.on_write_imm(note.encode()),
                Ok(Message::Records(b)) => p.on_control(b, &mut |dst, data| {
                    let len = data.len() as u64;
                    let inside = BUFFERS.iter().any(|(a, l)| dst >= *a && dst + len <= a + l);
                    assert!(inside, "{len} bytes placed at {dst:#x}, outside every receive buffer");
                }),
                Err(_) => Ok(()),
            }
        } else {
            let Some(b) = rest.get(..4) else { break };
            rest = &rest[4..];
            p.on_write_imm(u32::from_le_bytes(b.try_into().unwrap()))
        };
        if tag & 2 != 0 {
            p.on_write_done(0);
        }
        while let Some(a) = p.next_action() {
            if let Action::Copy { dst, src, len } = a {
                let inside = BUFFERS.iter().any(|(a, l)| dst >= *a && dst + len <= a + l);
                assert!(inside, "a copy of {len} bytes to {dst:#x} outside every receive buffer");
                match src {
                    CopySrc::Ring(off) => assert!(off + len <= RING as u64, "a copy from past the stream buffer"),
                    CopySrc::Bytes(b) => assert_eq!(b.len() as u64, len),
                }
            }
        }
    }
    let _ = WriteNote::decode(data.len() as u32);
});
