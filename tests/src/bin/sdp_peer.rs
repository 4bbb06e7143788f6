//! The other process of the SDP cross-process tests.
//!
//! ```text
//! sdp_peer <addr> send-then-die <bytes>   connect, write <bytes> bytes, exit without closing
//! sdp_peer <addr> send-then-wait <bytes>  connect, write <bytes> bytes, wait to be killed
//! sdp_peer <addr> records <n>             a TLS-like client (`tests::send_records`)
//! sdp_peer <addr> soak <seed> <ms>        <seed>, then frames of random sizes for <ms>
//!                                         (`tests::soak`), then exit (which closes the socket)
//! sdp_peer <addr> echo                    connect, echo everything until EOF, then close
//! sdp_peer <addr> write-store-read <n>    <n> rounds of: write a 16-page buffer, store
//!                                         into it at once, read 16 pages (see
//!                                         `tests::write_store_read`)
//! ```
//!
//! The socket's settings come from the environment (`SDP_DESIGN`, `SDP_ZCOPY_THRESHOLD`, ...).

use std::io::{Read, Write};

use sockets_compat::{SdpConfig, SdpStream};

fn main() {
    env_logger::init();
    let args: Vec<String> = std::env::args().collect();
    let (addr, mode) = (&args[1], args[2].as_str());
    let mut s =
        SdpStream::connect_with(addr.as_str(), SdpConfig::from_env().expect("SDP_* settings")).expect("connect");
    s.set_read_timeout(Some(std::time::Duration::from_secs(20))).expect("timeout");
    match mode {
        "send-then-die" => {
            let n: usize = args[3].parse().expect("byte count");
            let data: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
            s.write_all(&data).expect("write");
            // Wait until the peer has read it all (it says so), then die without closing.
            let mut ok = [0u8; 1];
            s.read_exact(&mut ok).expect("go-ahead");
            std::process::exit(0);
        }
        "send-then-wait" => {
            let n: usize = args[3].parse().expect("byte count");
            let data: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
            s.write_all(&data).expect("write");
            std::thread::sleep(std::time::Duration::from_secs(30));
            std::process::exit(3);
        }
        "soak" => {
            let (seed, ms): (u64, u64) = (args[3].parse().expect("seed"), args[4].parse().expect("ms"));
            s.write_all(&seed.to_le_bytes()).expect("seed");
            tests::soak::write_frames(&mut s, seed, 300_000, std::time::Duration::from_millis(ms)).expect("frames");
        }
        "records" => {
            let n: usize = args[3].parse().expect("record count");
            tests::send_records(&mut s, n).expect("records");
            s.flush().expect("flush");
        }
        "echo" => {
            let mut buf = vec![0u8; 1 << 16];
            loop {
                let n = s.read(&mut buf).expect("read");
                if n == 0 {
                    break;
                }
                s.write_all(&buf[..n]).expect("write");
            }
        }
        "write-store-read" => {
            let rounds: u64 = args[3].parse().expect("round count");
            tests::write_store_read(&mut s, 2, rounds).expect("write-store-read");
            s.flush().expect("flush");
        }
        other => panic!("unknown mode {other}"),
    }
}
