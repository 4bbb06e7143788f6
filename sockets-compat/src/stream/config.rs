//! Per-socket settings (`SdpConfig`), from code or the environment.

use super::*;

/// Per-socket settings, by default from the environment: `SDP_DESIGN` (`bsdp`, `zsdp`,
/// `azsdp`), `SDP_FLOW` (`credit`, `rdma`, `window`, `polled`: must be the same at both ends),
/// `SDP_ZCOPY_THRESHOLD` (bytes), `SDP_AZ_OUTSTANDING`, `SDP_AZ_FAULT_LIMIT`, `SDP_AZ_HOLD_MIN`, `SDP_AZ_COW`
/// (`1` or `0`), `SDP_BULK_RING` and `SDP_BULK_MIN` (bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SdpConfig {
    /// How this end sends.
    pub design: Design,
    /// The buffer-copy flow control (both ends must use the same).
    pub flow: FlowStrategy,
    /// Writes of at least this many bytes go zero-copy (ZSDP, AZ-SDP).
    pub zcopy_threshold: usize,
    /// AZ-SDP: SrcAvails a socket may have outstanding before `write` waits.
    pub az_max_outstanding: usize,
    /// AZ-SDP: page faults on held buffers after which the socket falls back to ZSDP.
    pub az_fault_limit: u32,
    /// AZ-SDP: the smallest transfer whose buffer is held (memory-protected) while in flight;
    /// smaller zero-copy writes are copied (as BSDP sends them) and smaller reads wait for
    /// their data. Buffers below the allocator's mmap threshold (128 KiB in glibc) live in
    /// heap memory the allocator reuses once the program frees them, and a TLS library, say,
    /// frees each record right after writing it: the allocator's next use of those pages,
    /// inside this library's own locked code, would wait for a transfer only that code can
    /// finish. Copying them costs less than protecting them anyway.
    pub az_hold_min: usize,
    /// AZ-SDP: a store into a buffer the peer has not started reading copies it aside (the
    /// paper's copy-on-write) instead of waiting for the peer to read it (block-on-write).
    pub az_copy_on_write: bool,
    /// Bytes of this socket's inbound bulk ring (0: none; else a power of two, 4 KiB to
    /// 1 GiB). The peer's large buffer-copy writes land there straight from its buffer.
    pub bulk_ring: usize,
    /// Buffer-copy writes of at least this many bytes go through the peer's bulk ring, when
    /// it has one: copied once by the sender into the ring and once out by the receiver's
    /// `read` (Data messages cost a third copy, through the pipe's private buffers). A
    /// nonblocking socket always sends Data: the bulk lane would hold its buffer past the call.
    pub bulk_min: usize,
}

impl SdpConfig {
    /// Credit-based defaults sized for streams: 16 private buffers of 8 KiB.
    pub const CREDIT: FlowStrategy = FlowStrategy::Credit { buffers: 16, buf_size: 8192 + 16 };
    /// RDMA-ring defaults: a 128 KiB ring, 4 KiB coalescing.
    pub const RDMA: FlowStrategy = FlowStrategy::Rdma { ring_bytes: 128 * 1024, coalesce: 4096 };
    /// Window defaults: 16 receives of 8 KiB.
    pub const WINDOW: FlowStrategy = FlowStrategy::Window { window: 8192, buffers: 16 };
    /// Polled defaults: a 128 KiB ring, 4 KiB coalescing.
    pub const POLLED: FlowStrategy = FlowStrategy::Polled { ring_bytes: 128 * 1024, coalesce: 4096 };

    /// The settings from the environment (invalid values are an error, not ignored).
    pub fn from_env() -> io::Result<SdpConfig> {
        use portability_verbs::env;
        let strict = |e: portability_verbs::VerbsError| invalid(e.to_string());
        let mut c = SdpConfig::default();
        if let Some(v) = env::text("SDP_DESIGN").map_err(strict)? {
            c.design = Design::by_name(&v).ok_or_else(|| invalid(format!("SDP_DESIGN={v:?}: bsdp, zsdp or azsdp")))?;
        }
        if let Some(v) = env::text("SDP_FLOW").map_err(strict)? {
            c.flow = match v.as_str() {
                "credit" => Self::CREDIT,
                "rdma" => Self::RDMA,
                "window" => Self::WINDOW,
                "polled" => Self::POLLED,
                _ => return Err(invalid(format!("SDP_FLOW={v:?}: credit, rdma, window or polled"))),
            };
        }
        let bytes = |name: &str, into: &mut usize| -> io::Result<()> {
            if let Some(v) = env::parse(name, "bytes").map_err(strict)? {
                *into = v;
            }
            Ok(())
        };
        bytes("SDP_ZCOPY_THRESHOLD", &mut c.zcopy_threshold)?;
        bytes("SDP_AZ_HOLD_MIN", &mut c.az_hold_min)?;
        bytes("SDP_BULK_RING", &mut c.bulk_ring)?;
        bytes("SDP_BULK_MIN", &mut c.bulk_min)?;
        if let Some(v) = env::parse("SDP_AZ_OUTSTANDING", "a count").map_err(strict)? {
            c.az_max_outstanding = v;
        }
        if let Some(v) = env::parse("SDP_AZ_FAULT_LIMIT", "a count").map_err(strict)? {
            c.az_fault_limit = v;
        }
        c.az_copy_on_write = env::flag("SDP_AZ_COW", c.az_copy_on_write).map_err(strict)?;
        c.validate()?;
        Ok(c)
    }

    pub(super) fn validate(&self) -> io::Result<()> {
        if self.az_max_outstanding == 0 || self.az_max_outstanding > LOCK_WORDS as usize {
            return Err(invalid(format!("az_max_outstanding must be 1..={LOCK_WORDS}")));
        }
        if self.flow.max_message() <= BSDH_LEN {
            return Err(invalid("flow-control messages too small for an SDP header".into()));
        }
        let ring = self.bulk_ring;
        if ring > 0 && (!(4096..=1 << 30).contains(&ring) || !ring.is_power_of_two()) {
            return Err(invalid(format!("bulk_ring of {ring} bytes: 0, or a power of two from 4 KiB to 1 GiB")));
        }
        if self.bulk_min == 0 {
            return Err(invalid("bulk_min must be at least 1 byte".into()));
        }
        Ok(())
    }
}

impl Default for SdpConfig {
    fn default() -> Self {
        SdpConfig {
            design: Design::Bsdp,
            flow: Self::CREDIT,
            zcopy_threshold: 64 * 1024,
            az_max_outstanding: 16,
            az_fault_limit: 64,
            az_hold_min: 128 * 1024,
            az_copy_on_write: true,
            bulk_ring: 2 << 20,
            bulk_min: 16 * 1024,
        }
    }
}

pub(super) fn invalid(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, why)
}
