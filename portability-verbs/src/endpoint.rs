//! What one side of a reliable connection tells the other so that the two queue pairs can be
//! connected (what `rdma_cm` or a hand-written bootstrap exchanges: QP number, addresses, keys).
//!
//! Plain data and a byte codec, no I/O: the connection manager ([`crate::cm`]) moves the bytes.
//! Decoding validates everything, because the bytes come from a peer.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use crate::error::{Result, VerbsError};

/// Connection information of the software provider: where the peer finds our shared segments.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SoftEndpoint {
    /// Owning process.
    pub pid: u32,
    /// Start time of that process (clock ticks since boot), so a recycled pid is never mistaken.
    pub start_time: u64,
    /// Unique id of the device context inside that process.
    pub ctx_id: u64,
    /// Descriptor number, in the owner, of the context's control segment (keys, doorbells).
    pub ctrl_fd: i32,
    /// Descriptor number, in the owner, of the queue pair's segment (state and inbound ring).
    pub qp_fd: i32,
    /// Queue-pair number.
    pub qpn: u32,
    /// Bytes of the inbound ring.
    pub ring_bytes: u32,
    /// Protection domain of the queue pair.
    pub pd: u32,
    /// Slot of the receive queue (own or shared) in the control segment's receive-counter table.
    pub rq_slot: u32,
    /// Doorbell slot of the completion queue that gets our send completions.
    pub send_cq_bell: u32,
    /// Doorbell slot of the completion queue that gets our receive completions.
    pub recv_cq_bell: u32,
    /// Host identity ([`crate::soft::host_identity`]): a peer with another one is reached
    /// over TCP, never through shared memory.
    pub host: u64,
    /// Where the owner's TCP transport accepts connections. An unspecified IP (the owner
    /// listens on every interface) is filled in by whoever knows how the peer reached it
    /// ([`EndpointInfo::with_tcp_ip`]), else taken as this host's loopback.
    pub tcp: SocketAddr,
    /// The owner asks for the TCP transport even where memory could be shared.
    pub tcp_only: bool,
}

impl SoftEndpoint {
    /// True when a queue pair connecting this endpoint and `other` must use TCP: they are on
    /// different hosts (or PID namespaces), or either side asks for it. Both sides decide the
    /// same.
    pub fn needs_tcp(&self, other: &SoftEndpoint) -> bool {
        self.host != other.host || self.tcp_only || other.tcp_only
    }
}

/// Connection information of the hardware provider (InfiniBand or RoCE addressing).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HwEndpoint {
    /// Port LID (InfiniBand).
    pub lid: u16,
    /// Port GID (RoCE and routed InfiniBand).
    pub gid: [u8; 16],
    /// GID table index used.
    pub gid_index: u8,
    /// Physical port number.
    pub port: u8,
    /// Queue-pair number.
    pub qpn: u32,
    /// Initial packet sequence number.
    pub psn: u32,
    /// Path MTU enum value (1 = 256 B ... 5 = 4096 B).
    pub mtu: u8,
}

/// Connection information of either provider.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EndpointInfo {
    /// Software provider.
    Soft(SoftEndpoint),
    /// Hardware provider.
    Hardware(HwEndpoint),
}

const MAGIC: [u8; 4] = *b"PVEP";
const VERSION: u8 = 2;
const KIND_SOFT: u8 = 1;
const KIND_HW: u8 = 2;
const SOFT_BODY: usize = 4 + 8 + 8 + 4 + 4 + 4 + 4 + 4 + 4 + 4 + 4 + 8 + 16 + 2 + 1;
const HW_BODY: usize = 2 + 16 + 1 + 1 + 4 + 4 + 1;
/// Bytes of the header before the body.
const HEADER: usize = 4 + 1 + 1 + 2;
/// Largest encoding, for callers that size a buffer.
pub const MAX_ENCODED_LEN: usize = HEADER + SOFT_BODY;

impl EndpointInfo {
    /// The queue-pair number.
    pub fn qpn(&self) -> u32 {
        match self {
            EndpointInfo::Soft(s) => s.qpn,
            EndpointInfo::Hardware(h) => h.qpn,
        }
    }

    /// The endpoint with `ip` as its TCP address's IP where that is unspecified: the
    /// connection manager passes the address its peer reached it at.
    pub fn with_tcp_ip(mut self, ip: IpAddr) -> EndpointInfo {
        if let EndpointInfo::Soft(s) = &mut self {
            if s.tcp.ip().is_unspecified() && !ip.is_unspecified() {
                s.tcp.set_ip(ip);
            }
        }
        self
    }

    /// Encodes to the wire form: magic, version, kind, body length, little-endian body.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(MAX_ENCODED_LEN);
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        match self {
            EndpointInfo::Soft(s) => {
                out.push(KIND_SOFT);
                out.extend_from_slice(&(SOFT_BODY as u16).to_le_bytes());
                out.extend_from_slice(&s.pid.to_le_bytes());
                out.extend_from_slice(&s.start_time.to_le_bytes());
                out.extend_from_slice(&s.ctx_id.to_le_bytes());
                out.extend_from_slice(&s.ctrl_fd.to_le_bytes());
                out.extend_from_slice(&s.qp_fd.to_le_bytes());
                out.extend_from_slice(&s.qpn.to_le_bytes());
                out.extend_from_slice(&s.ring_bytes.to_le_bytes());
                out.extend_from_slice(&s.pd.to_le_bytes());
                out.extend_from_slice(&s.rq_slot.to_le_bytes());
                out.extend_from_slice(&s.send_cq_bell.to_le_bytes());
                out.extend_from_slice(&s.recv_cq_bell.to_le_bytes());
                out.extend_from_slice(&s.host.to_le_bytes());
                let ip = match s.tcp.ip() {
                    IpAddr::V4(v4) => v4.to_ipv6_mapped(),
                    IpAddr::V6(v6) => v6,
                };
                out.extend_from_slice(&ip.octets());
                out.extend_from_slice(&s.tcp.port().to_le_bytes());
                out.push(s.tcp_only as u8);
            }
            EndpointInfo::Hardware(h) => {
                out.push(KIND_HW);
                out.extend_from_slice(&(HW_BODY as u16).to_le_bytes());
                out.extend_from_slice(&h.lid.to_le_bytes());
                out.extend_from_slice(&h.gid);
                out.push(h.gid_index);
                out.push(h.port);
                out.extend_from_slice(&h.qpn.to_le_bytes());
                out.extend_from_slice(&h.psn.to_le_bytes());
                out.push(h.mtu);
            }
        }
        out
    }

    /// Decodes and validates the wire form. Every malformation is an error, never a panic.
    pub fn decode(bytes: &[u8]) -> Result<EndpointInfo> {
        let bad = |why: &str| VerbsError::Protocol(format!("endpoint info: {why}"));
        if bytes.len() < HEADER {
            return Err(bad("shorter than its header"));
        }
        if bytes[0..4] != MAGIC {
            return Err(bad("bad magic"));
        }
        if bytes[4] != VERSION {
            return Err(bad(&format!("unsupported version {}", bytes[4])));
        }
        let kind = bytes[5];
        let body_len = u16::from_le_bytes([bytes[6], bytes[7]]) as usize;
        let body = &bytes[HEADER..];
        if body.len() != body_len {
            return Err(bad("length field does not match the bytes"));
        }
        let mut r = Reader(body);
        match kind {
            KIND_SOFT if body_len == SOFT_BODY => {
                let s = SoftEndpoint {
                    pid: r.u32(),
                    start_time: r.u64(),
                    ctx_id: r.u64(),
                    ctrl_fd: r.u32() as i32,
                    qp_fd: r.u32() as i32,
                    qpn: r.u32(),
                    ring_bytes: r.u32(),
                    pd: r.u32(),
                    rq_slot: r.u32(),
                    send_cq_bell: r.u32(),
                    recv_cq_bell: r.u32(),
                    host: r.u64(),
                    tcp: {
                        let ip = Ipv6Addr::from(<[u8; 16]>::try_from(r.take(16)).expect("16 bytes"));
                        let ip = ip.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(IpAddr::V6(ip));
                        SocketAddr::new(ip, r.u16())
                    },
                    tcp_only: match r.u8() {
                        0 => false,
                        1 => true,
                        _ => return Err(bad("invalid transport flag")),
                    },
                };
                if s.pid == 0 || s.ctrl_fd < 0 || s.qp_fd < 0 {
                    return Err(bad("invalid process id or descriptor"));
                }
                Ok(EndpointInfo::Soft(s))
            }
            KIND_HW if body_len == HW_BODY => {
                let lid = r.u16();
                let mut gid = [0u8; 16];
                gid.copy_from_slice(r.take(16));
                let h = HwEndpoint {
                    lid,
                    gid,
                    gid_index: r.u8(),
                    port: r.u8(),
                    qpn: r.u32(),
                    psn: r.u32() & 0x00ff_ffff,
                    mtu: r.u8(),
                };
                if !(1..=5).contains(&h.mtu) {
                    return Err(bad("invalid path MTU"));
                }
                Ok(EndpointInfo::Hardware(h))
            }
            KIND_SOFT | KIND_HW => Err(bad("body length does not fit the kind")),
            other => Err(bad(&format!("unknown provider kind {other}"))),
        }
    }
}

/// Little-endian reader over a slice whose length was checked beforehand.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> &'a [u8] {
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        head
    }
    fn u8(&mut self) -> u8 {
        self.take(1)[0]
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.take(2).try_into().expect("2 bytes"))
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take(4).try_into().expect("4 bytes"))
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take(8).try_into().expect("8 bytes"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn soft() -> impl Strategy<Value = EndpointInfo> {
        (
            1u32..,
            any::<u64>(),
            any::<u64>(),
            0i32..,
            0i32..,
            any::<u32>(),
            any::<u32>(),
            any::<u32>(),
            any::<[u32; 3]>(),
            (any::<u64>(), any::<[u8; 4]>(), any::<u16>(), any::<bool>()),
        )
            .prop_map(
                |(
                    pid,
                    start_time,
                    ctx_id,
                    ctrl_fd,
                    qp_fd,
                    qpn,
                    ring_bytes,
                    pd,
                    [rq_slot, s, r],
                    (host, ip, port, tcp_only),
                )| {
                    EndpointInfo::Soft(SoftEndpoint {
                        pid,
                        start_time,
                        ctx_id,
                        ctrl_fd,
                        qp_fd,
                        qpn,
                        ring_bytes,
                        pd,
                        rq_slot,
                        send_cq_bell: s,
                        recv_cq_bell: r,
                        host,
                        tcp: SocketAddr::from((ip, port)),
                        tcp_only,
                    })
                },
            )
    }

    fn hw() -> impl Strategy<Value = EndpointInfo> {
        (any::<u16>(), any::<[u8; 16]>(), any::<u8>(), any::<u8>(), any::<u32>(), 0u32..0x0100_0000, 1u8..=5).prop_map(
            |(lid, gid, gid_index, port, qpn, psn, mtu)| {
                EndpointInfo::Hardware(HwEndpoint { lid, gid, gid_index, port, qpn, psn, mtu })
            },
        )
    }

    proptest! {
        #[test]
        fn round_trips(info in prop_oneof![soft(), hw()]) {
            prop_assert_eq!(EndpointInfo::decode(&info.encode()).unwrap(), info);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..120)) {
            let _ = EndpointInfo::decode(&bytes);
        }

        #[test]
        fn every_truncation_is_rejected(info in prop_oneof![soft(), hw()], cut in 0usize..MAX_ENCODED_LEN) {
            let bytes = info.encode();
            if cut < bytes.len() {
                prop_assert!(EndpointInfo::decode(&bytes[..cut]).is_err());
            }
        }
    }
}
