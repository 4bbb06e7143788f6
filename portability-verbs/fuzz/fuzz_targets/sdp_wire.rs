//! Fuzzes what an SDP peer's messages meet: the message decoder and sequence checker, and the
//! connection's protocol state that takes them (`sockets_compat::proto`).
#![no_main]
use libfuzzer_sys::fuzz_target;
use sockets_compat::proto::Proto;
use sockets_compat::wire::{Message, Sequencer};

fuzz_target!(|data: &[u8]| {
    let mut seq = Sequencer::default();
    let mut proto: Proto<()> = Proto::new(16);
    // One SrcAvail of ours outstanding, for answers to meet.
    proto.advertised(1 << 16, ());
    // The input is a run of messages, each prefixed by a one-byte length.
    let mut rest = data;
    while let Some((&n, tail)) = rest.split_first() {
        let n = (n as usize).min(tail.len());
        let (msg, tail) = tail.split_at(n);
        rest = tail;
        if let Ok((h, m)) = Message::decode(msg) {
            // What decodes re-encodes to the same bytes.
            let mut out = Vec::new();
            m.encode(&h, &mut out);
            assert_eq!(out, msg);
            let _ = seq.accept(&h);
        }
        // Taken or refused, never a panic; a refused message changes nothing.
        let before = (proto.rx().len(), proto.sends().len(), proto.eof(), proto.peer_closed());
        if proto.on_message(msg).is_err() {
            assert_eq!(before, (proto.rx().len(), proto.sends().len(), proto.eof(), proto.peer_closed()));
        }
        let mut buf = [0u8; 64];
        let _ = proto.read_queued(&mut buf, |_| false);
    }
});
