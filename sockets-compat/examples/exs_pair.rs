//! The Extended Sockets API in one process: a SOCK_SEQPACKET connection, a receive advertised
//! to the sender and a send written straight into it, each completing as an event.
//!
//!     cargo run --release -p sockets-compat --example exs_pair

use sockets_compat::exs::{EventQueue, ExsSocket, Memory, SocketKind};
use std::time::Duration;

fn main() -> Result<(), sockets_compat::exs::ExsError> {
    let q = EventQueue::new(16)?;
    let listener = ExsSocket::new(SocketKind::SeqPacket)?;
    listener.bind("127.0.0.1:0")?;
    listener.listen(4)?;
    listener.accept(&q, 1)?; // request ids come back in events
    let client = ExsSocket::new(SocketKind::SeqPacket)?;
    client.connect(listener.local_addr().unwrap(), &q, 2)?;
    let mut events = Vec::new();
    while events.len() < 2 {
        // dequeue waits for the first
        events.extend(q.dequeue(2 - events.len(), Some(Duration::from_secs(10))));
    }
    let server = events.into_iter().find_map(|ev| ev.accepted).expect("accepted");
    let (tx, rx) = (Memory::alloc(1 << 20)?, Memory::alloc(1 << 20)?); // registered memory
    tx.write(0, b"hello");
    server.recv(&q, 3, &rx, 0, 1 << 20)?; // advertised to the sender
    client.send(&q, 4, &tx, 0, 5)?; // written straight into rx
    let mut done = 0;
    while done < 2 {
        for ev in q.dequeue(2, Some(Duration::from_secs(10))) {
            assert_eq!(ev.outcome, Ok(5));
            done += 1;
        }
    }
    let mut got = [0u8; 5];
    rx.read(0, &mut got);
    assert_eq!(&got, b"hello");
    Ok(())
}
