//! The flow-control strategies a pipe can use, their defaults and what each costs.

use super::*;

/// Which flow control a pipe uses (both ends must agree; the setup exchange checks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlowStrategy {
    /// Credit-based: `buffers` pre-posted receive buffers of `buf_size` bytes, one message each.
    Credit {
        /// Receive buffers posted (= initial credits).
        buffers: u32,
        /// Bytes per buffer (largest message + 16).
        buf_size: usize,
    },
    /// RDMA-based: the sender places chunks in the receiver's `ring_bytes` ring with RDMA
    /// write-with-immediate, coalescing small messages up to `coalesce` bytes.
    Rdma {
        /// Bytes of each side's inbound ring.
        ring_bytes: usize,
        /// Immediate-send threshold: chunks are flushed once this many bytes are staged.
        coalesce: usize,
    },
    /// NIC-assisted virtual window: `buffers` receives of `window` bytes; segments of at most
    /// `window` go out without credits, the transport queueing what finds no receive.
    Window {
        /// Segment (and receive buffer) size.
        window: usize,
        /// Receives posted (N/W).
        buffers: u32,
    },
    /// Polled RDMA: the sender RDMA-writes each message (or, while the ring is short of room,
    /// a coalesced batch of up to `coalesce` bytes) as a frame into the receiver's
    /// `ring_bytes` ring, and the receiver finds it by polling the ring's memory: no receive,
    /// no immediate, no completion per message (see [`super::fc::frame_word`]). The fastest
    /// small-message path; it relies on a write's last bytes being placed last, as the
    /// software provider guarantees and RDMA NICs do. A receiver about to sleep on the
    /// completion queue must say so first ([`MsgPipe::prepare_sleep`]): the sender then
    /// raises a completion for it.
    Polled {
        /// Bytes of each side's inbound ring.
        ring_bytes: usize,
        /// Largest coalesced batch (frame body).
        coalesce: usize,
    },
}

impl FlowStrategy {
    /// Credit-based defaults: 32 buffers of 2 KiB.
    pub const CREDIT: FlowStrategy = FlowStrategy::Credit { buffers: 32, buf_size: 2048 };
    /// RDMA-based defaults: a 32 KiB ring (8 KiB chunks), 4 KiB coalescing threshold.
    pub const RDMA: FlowStrategy = FlowStrategy::Rdma { ring_bytes: 32 * 1024, coalesce: 4096 };
    /// NIC-assisted defaults: 32 receives of 2 KiB.
    pub const WINDOW: FlowStrategy = FlowStrategy::Window { window: 2048, buffers: 32 };
    /// Polled defaults: a 32 KiB ring (frames of up to 8 KiB), 4 KiB batches.
    pub const POLLED: FlowStrategy = FlowStrategy::Polled { ring_bytes: 32 * 1024, coalesce: 4096 };

    /// The default of a strategy by name: `credit`, `rdma` or `window`.
    pub fn by_name(name: &str) -> Option<FlowStrategy> {
        match name {
            "credit" => Some(FlowStrategy::CREDIT),
            "rdma" => Some(FlowStrategy::RDMA),
            "window" | "nic" => Some(FlowStrategy::WINDOW),
            "polled" => Some(FlowStrategy::POLLED),
            _ => None,
        }
    }

    /// Short name.
    pub fn name(&self) -> &'static str {
        match self {
            FlowStrategy::Credit { .. } => "credit",
            FlowStrategy::Rdma { .. } => "rdma",
            FlowStrategy::Window { .. } => "window",
            FlowStrategy::Polled { .. } => "polled",
        }
    }

    /// Largest message the pipe carries.
    pub const fn max_message(&self) -> usize {
        match *self {
            FlowStrategy::Credit { buf_size, .. } => buf_size - RECORD_HEADER,
            FlowStrategy::Rdma { ring_bytes, .. } => ring_bytes / 4 - RECORD_HEADER,
            FlowStrategy::Window { window, .. } => window - RECORD_HEADER,
            FlowStrategy::Polled { ring_bytes, .. } => fc::frame_body_max(ring_bytes as u64) - RECORD_HEADER,
        }
    }

    pub(super) fn validate(&self) -> Result<()> {
        let ok = match *self {
            FlowStrategy::Credit { buffers, buf_size } => buffers >= 2 && buf_size > RECORD_HEADER,
            FlowStrategy::Rdma { ring_bytes, coalesce } => {
                ring_bytes >= 4096
                    && ring_bytes.is_power_of_two()
                    && coalesce > RECORD_HEADER
                    && coalesce <= ring_bytes / 4
            }
            FlowStrategy::Window { window, buffers } => buffers >= 1 && window > RECORD_HEADER,
            FlowStrategy::Polled { ring_bytes, coalesce } => {
                (4096..=fc::MAX_POLLED_RING as usize).contains(&ring_bytes)
                    && ring_bytes.is_power_of_two()
                    && coalesce > RECORD_HEADER
                    && coalesce <= fc::frame_body_max(ring_bytes as u64)
            }
        };
        if ok {
            Ok(())
        } else {
            Err(VerbsError::invalid(format!("flow strategy {self:?} out of range")))
        }
    }

    pub(super) fn code(&self) -> (u8, u64, u64) {
        match *self {
            FlowStrategy::Credit { buffers, buf_size } => (1, buffers as u64, buf_size as u64),
            FlowStrategy::Rdma { ring_bytes, coalesce } => (2, ring_bytes as u64, coalesce as u64),
            FlowStrategy::Window { window, buffers } => (3, buffers as u64, window as u64),
            FlowStrategy::Polled { ring_bytes, coalesce } => (4, ring_bytes as u64, coalesce as u64),
        }
    }

    /// Sends outstanding at most (staging buffers of one pipe end).
    pub(super) fn send_slots(&self) -> usize {
        match self {
            FlowStrategy::Rdma { .. } => 4,
            FlowStrategy::Polled { .. } => 8,
            _ => 16,
        }
    }

    /// Sends that may go straight to the transport while earlier ones are outstanding (the
    /// window strategy also stops at the peer's receive buffers; later messages coalesce).
    pub(super) fn straight_sends(&self) -> usize {
        match *self {
            FlowStrategy::Window { buffers, .. } => (buffers as usize).min(self.send_slots()),
            _ => self.send_slots(),
        }
    }

    /// Bytes of one staging buffer.
    pub(super) fn send_slot_bytes(&self) -> usize {
        match *self {
            FlowStrategy::Credit { buf_size, .. } => buf_size,
            FlowStrategy::Rdma { ring_bytes, .. } => ring_bytes / 4,
            FlowStrategy::Window { window, .. } => window,
            FlowStrategy::Polled { ring_bytes, .. } => ring_bytes / 4,
        }
    }

    /// Memory one pipe end registers: receive buffers or ring, send staging, setup.
    pub fn memory_per_end(&self) -> usize {
        let recv = match *self {
            FlowStrategy::Credit { buffers, buf_size } => buffers as usize * buf_size,
            FlowStrategy::Rdma { ring_bytes, .. } => ring_bytes,
            FlowStrategy::Window { window, buffers } => buffers as usize * window,
            FlowStrategy::Polled { ring_bytes, .. } => ring_bytes,
        };
        recv + self.send_slots() * self.send_slot_bytes() + 2 * SETUP_BYTES + 16
    }
}
