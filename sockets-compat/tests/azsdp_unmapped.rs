//! An AZ-SDP buffer unmapped before the peer read it (against the contract) fails the socket
//! with an error at both ends, never a hang.
//!
//! A binary of its own: with other tests running in the same process, another mapping can take
//! the freed addresses before the peer reads them, and the read then succeeds with whatever that
//! mapping holds (real hardware would read the still-pinned old pages instead).

use std::io::{ErrorKind, Read, Write};
use std::thread;
use std::time::{Duration, Instant};

use sockets_compat::{Design, SdpConfig};

mod common;
use common::{pair, Pages};

const PAGE: usize = 4096;

fn az() -> SdpConfig {
    SdpConfig {
        design: Design::AzSdp,
        zcopy_threshold: PAGE,
        az_hold_min: PAGE,
        az_fault_limit: u32::MAX,
        ..SdpConfig::default()
    }
}

#[test]
fn a_buffer_unmapped_under_the_transport_fails_the_socket_cleanly() {
    let (mut c, s) = pair(az(), az());
    let mut mem = Pages::new(16 * PAGE);
    mem.bytes().fill(5);
    c.write_all(mem.bytes()).unwrap();
    // Against the contract: unmapped before the peer read it (no flush).
    drop(mem);
    let mut s = s;
    let mut got = vec![0u8; 16 * PAGE];
    let err = s.read_exact(&mut got).unwrap_err();
    assert!(matches!(err.kind(), ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset), "{err:?}");
    // The writer learns of it too, and never hangs.
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        match c.write(&[1]) {
            Err(_) => break,
            Ok(_) if Instant::now() < end => thread::sleep(Duration::from_millis(10)),
            Ok(_) => panic!("the writer never heard of the failed transfer"),
        }
    }
}
