//! How a client finds out, without a byte on the TCP connection, that the server at
//! `host:port` accepts SDP: it asks `host:port` in the UDP port space (the way RDMA CM's
//! port space sits beside TCP's). A server that accelerates its TCP port `P` answers on UDP
//! `P` with the port of its SDP listener; no answer (an ICMP port-unreachable, at once on a
//! LAN, or silence) means plain TCP. The messages, with no I/O:
//!
//! - probe, client to server: `SDPQ`, version 1, a nonce (u64 LE): 13 bytes;
//! - answer, server to client: `SDPA`, version 1, the probe's nonce, the SDP listener's port
//!   (u16 LE): 15 bytes.

/// Bytes of a probe.
pub const PROBE_LEN: usize = 13;
/// Bytes of an answer.
pub const ANSWER_LEN: usize = 15;
const VERSION: u8 = 1;

/// A probe asking whether the port is accelerated.
pub fn encode_probe(nonce: u64) -> [u8; PROBE_LEN] {
    let mut b = [0u8; PROBE_LEN];
    b[..4].copy_from_slice(b"SDPQ");
    b[4] = VERSION;
    b[5..].copy_from_slice(&nonce.to_le_bytes());
    b
}

/// The nonce of a well-formed probe of our version (anything else: `None`, to be ignored).
pub fn decode_probe(b: &[u8]) -> Option<u64> {
    if b.len() != PROBE_LEN || &b[..4] != b"SDPQ" || b[4] != VERSION {
        return None;
    }
    Some(u64::from_le_bytes(b[5..13].try_into().ok()?))
}

/// The answer to the probe carrying `nonce`: SDP is at `port`.
pub fn encode_answer(nonce: u64, port: u16) -> [u8; ANSWER_LEN] {
    let mut b = [0u8; ANSWER_LEN];
    b[..4].copy_from_slice(b"SDPA");
    b[4] = VERSION;
    b[5..13].copy_from_slice(&nonce.to_le_bytes());
    b[13..].copy_from_slice(&port.to_le_bytes());
    b
}

/// The SDP port of a well-formed answer to the probe carrying `nonce` (a stale answer, another
/// version, port 0 or anything malformed: `None`).
pub fn decode_answer(b: &[u8], nonce: u64) -> Option<u16> {
    if b.len() != ANSWER_LEN || &b[..4] != b"SDPA" || b[4] != VERSION {
        return None;
    }
    if u64::from_le_bytes(b[5..13].try_into().ok()?) != nonce {
        return None;
    }
    let port = u16::from_le_bytes(b[13..15].try_into().ok()?);
    (port != 0).then_some(port)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn probes_and_answers_round_trip(nonce: u64, port in 1u16..) {
            prop_assert_eq!(decode_probe(&encode_probe(nonce)), Some(nonce));
            prop_assert_eq!(decode_answer(&encode_answer(nonce, port), nonce), Some(port));
            prop_assert_eq!(decode_answer(&encode_answer(nonce, port), nonce ^ 1), None);
        }

        #[test]
        fn anything_else_is_ignored(b in proptest::collection::vec(any::<u8>(), 0..40), nonce: u64) {
            if let Some(n) = decode_probe(&b) {
                prop_assert_eq!(encode_probe(n).to_vec(), b.clone());
            }
            if let Some(p) = decode_answer(&b, nonce) {
                prop_assert_eq!(encode_answer(nonce, p).to_vec(), b);
            }
        }
    }

    #[test]
    fn malformed_messages_are_refused() {
        let mut p = encode_probe(7);
        p[4] = 2;
        assert_eq!(decode_probe(&p), None, "another version");
        assert_eq!(decode_probe(&encode_probe(7)[..12]), None, "short");
        assert_eq!(decode_answer(&encode_answer(7, 0), 7), None, "port 0");
        assert_eq!(decode_answer(&encode_probe(7), 7), None, "a probe is no answer");
    }
}
