//! A software device context: its control segment, its memory-region registrations, its slot
//! tables, and the peers it reaches.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use super::keys::{key_slot, KeyEntry, LocalKeys};
use super::layout::{Ctrl, CTRL_BYTES, CTRL_MAGIC, MR_SLOTS};
use super::peer::{PeerCtx, PeerKey};
use super::segment::Segment;
use crate::error::{Result, VerbsError};
use crate::os;
use crate::types::AccessFlags;

/// Tunables of the software provider.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SoftConfig {
    /// Bytes of each queue pair's inbound ring (a power of two, at least 8 KiB).
    pub ring_bytes: usize,
    /// Largest SEND whose data travels through the ring; larger ones are pulled by the receiver
    /// straight from the sender's registered memory (one copy).
    pub copy_threshold: usize,
    /// How long a blocking wait may spin before it sleeps on the eventfd.
    pub spin: Duration,
    /// Pulls by cross-memory attach (RDMA reads of another process's user memory, the data of
    /// large sends from it) of at least this many bytes offer their back half to the peer's
    /// polling thread (0: never).
    pub assist_min: usize,
    /// Use the TCP transport even between processes that could share memory.
    pub tcp_only: bool,
    /// Where the TCP transport accepts connections; None: every IPv4 interface, on a port
    /// the kernel picks.
    pub tcp_addr: Option<std::net::SocketAddr>,
    /// A TCP peer silent for this long (no frame, not even a keep-alive) is taken as gone:
    /// its queue pairs go to error.
    pub tcp_timeout: Duration,
}

impl Default for SoftConfig {
    fn default() -> Self {
        SoftConfig {
            ring_bytes: 128 * 1024,
            copy_threshold: 8 * 1024,
            spin: Duration::from_micros(50),
            assist_min: 32 * 1024,
            tcp_only: false,
            tcp_addr: None,
            tcp_timeout: Duration::from_secs(2),
        }
    }
}

impl SoftConfig {
    /// Reads overrides from `PV_SOFT_RING_BYTES`, `PV_SOFT_COPY_THRESHOLD`, `PV_SOFT_SPIN_US`,
    /// `PV_SOFT_ASSIST_MIN`, `PV_SOFT_TRANSPORT` (`auto` or `tcp`), `PV_SOFT_TCP_ADDR` and
    /// `PV_SOFT_TCP_TIMEOUT_MS` (a value that does not parse is an error naming it).
    pub fn from_env() -> Result<Self> {
        use crate::env::parse;
        let mut c = SoftConfig::default();
        if let Some(v) = parse("PV_SOFT_RING_BYTES", "bytes")? {
            c.ring_bytes = v;
        }
        if let Some(v) = parse("PV_SOFT_COPY_THRESHOLD", "bytes")? {
            c.copy_threshold = v;
        }
        if let Some(v) = parse("PV_SOFT_SPIN_US", "microseconds")? {
            c.spin = Duration::from_micros(v);
        }
        if let Some(v) = parse("PV_SOFT_ASSIST_MIN", "bytes")? {
            c.assist_min = v;
        }
        match crate::env::text("PV_SOFT_TRANSPORT")?.as_deref() {
            None | Some("auto") => {}
            Some("tcp") => c.tcp_only = true,
            Some(v) => return Err(VerbsError::invalid(format!("PV_SOFT_TRANSPORT={v:?}: expected auto or tcp"))),
        }
        c.tcp_addr = parse("PV_SOFT_TCP_ADDR", "an address such as 10.0.0.1:0")?;
        if let Some(v) = parse("PV_SOFT_TCP_TIMEOUT_MS", "milliseconds")? {
            c.tcp_timeout = Duration::from_millis(v);
        }
        Ok(c)
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.tcp_timeout < Duration::from_millis(100) {
            return Err(VerbsError::invalid("tcp_timeout under 100 ms would fail live peers"));
        }
        if !self.ring_bytes.is_power_of_two() || self.ring_bytes < 8192 || self.ring_bytes > (1 << 30) {
            return Err(VerbsError::invalid(format!(
                "ring_bytes {} must be a power of two in 8 KiB..1 GiB",
                self.ring_bytes
            )));
        }
        if self.copy_threshold > super::wire::max_record(self.ring_bytes) - super::wire::WRITE_HEADER_BYTES {
            return Err(VerbsError::invalid("copy_threshold does not fit in half the ring"));
        }
        Ok(())
    }
}

/// Slot bookkeeping for registration changes (changes only; checks read [`KeyEntry`]s).
struct KeySlots {
    generation: Vec<u8>,
    free: Vec<usize>,
    used: usize,
}

/// Hands out small integer slots (receive counters, doorbells, memory regions).
pub struct SlotAllocator {
    free: Vec<u32>,
}

impl SlotAllocator {
    pub fn new(n: usize) -> Self {
        SlotAllocator { free: (0..n as u32).rev().collect() }
    }
    pub fn take(&mut self, what: &str) -> Result<u32> {
        self.free.pop().ok_or_else(|| VerbsError::Exhausted(format!("no free {what} slot")))
    }
    pub fn give(&mut self, s: u32) {
        self.free.push(s);
    }
}

/// The shared part of a software context.
pub struct CtxInner {
    pub id: u64,
    pub pid: u32,
    pub start_time: u64,
    pub config: SoftConfig,
    pub ctrl: Segment,
    /// The local key table, one entry per memory-region slot (fixed, so lock-free readers never
    /// see it move).
    keys: Box<[KeyEntry]>,
    slots: Mutex<KeySlots>,
    /// Held shared by key-table readers that hold no queue-pair lock, exclusively by a
    /// deregistration.
    changing: RwLock<()>,
    pub rq_slots: Mutex<SlotAllocator>,
    pub bell_slots: Mutex<SlotAllocator>,
    pub next_qpn: AtomicU32,
    pub next_pd: AtomicU32,
    peers: Mutex<HashMap<PeerKey, Weak<PeerCtx>>>,
    /// Tag identifying this process as holder of a peer's atomic lock.
    pub lock_tag: u64,
    /// Waits out the lock holders of this context's queue pairs (see [`LockGrace`]).
    lock_grace: LockGrace,
}

/// Waits until every thread that held the lock of a queue pair of the context with this id
/// when called has let it go: a deregistration's grace period, since lock holders read the key
/// table without a lock. The queue pairs' registry provides it (the queue pairs are built on
/// contexts, so a context is handed the function instead of naming them).
pub type LockGrace = fn(u64);

impl CtxInner {
    pub fn open(config: SoftConfig, lock_grace: LockGrace) -> Result<Arc<CtxInner>> {
        config.validate()?;
        if !os::asymmetric_barriers() {
            log::info!("membarrier unavailable: wake-up handshakes use full fences on the hot path");
        }
        let pid = std::process::id();
        let start_time = os::process_start_time(pid)?;
        let id = crate::os::unique_id();
        let ctrl = Segment::create_named(&super::segment::ctrl_name(id), 0, CTRL_BYTES)?;
        Ctrl(&ctrl).header().magic.store(CTRL_MAGIC, Ordering::Release);
        Ok(Arc::new(CtxInner {
            id,
            pid,
            start_time,
            config,
            ctrl,
            keys: (0..MR_SLOTS).map(|_| KeyEntry::default()).collect(),
            slots: Mutex::new(KeySlots { generation: vec![0; MR_SLOTS], free: Vec::new(), used: 0 }),
            changing: RwLock::new(()),
            rq_slots: Mutex::new(SlotAllocator::new(super::layout::RQ_SLOTS)),
            bell_slots: Mutex::new(SlotAllocator::new(super::layout::BELL_SLOTS)),
            next_qpn: AtomicU32::new(1),
            next_pd: AtomicU32::new(1),
            peers: Mutex::new(HashMap::new()),
            lock_tag: ((pid as u64) << 32) | (id & 0xffff_ffff),
            lock_grace,
        }))
    }

    pub fn ctrl(&self) -> Ctrl<'_> {
        Ctrl(&self.ctrl)
    }

    /// Registers `[addr, addr+len)` and publishes it; returns the key (lkey = rkey).
    pub fn register(&self, addr: u64, len: u64, access: AccessFlags, pd: u32, seg: Option<&Segment>) -> Result<u32> {
        if addr.checked_add(len).is_none() {
            return Err(VerbsError::invalid("region wraps the address space"));
        }
        if (access.contains(AccessFlags::REMOTE_WRITE) || access.contains(AccessFlags::REMOTE_ATOMIC))
            && !access.contains(AccessFlags::LOCAL_WRITE)
        {
            return Err(VerbsError::invalid("remote write or atomic access needs LOCAL_WRITE (as in verbs)"));
        }
        let mut t = self.slots.lock().expect("key slot lock");
        let slot = match t.free.pop() {
            Some(s) => s,
            None if t.used < MR_SLOTS => {
                t.used += 1;
                t.used - 1
            }
            None => return Err(VerbsError::Exhausted(format!("all {MR_SLOTS} memory-region keys are in use"))),
        };
        let gen = t.generation[slot].wrapping_add(1).max(1);
        t.generation[slot] = gen;
        let key = ((slot as u32 + 1) << 8) | gen as u32;
        let e = self.ctrl().mr(slot).expect("slot in range");
        e.access.store(access.bits(), Ordering::Relaxed);
        e.pd.store(pd, Ordering::Relaxed);
        e.addr.store(addr, Ordering::Relaxed);
        e.len.store(len, Ordering::Relaxed);
        match seg {
            Some(s) => {
                e.seg_fd.store(s.fd(), Ordering::Relaxed);
                e.seg_id.store(s.id(), Ordering::Relaxed);
                e.seg_off.store(addr - s.ptr() as u64, Ordering::Relaxed);
            }
            None => {
                e.seg_fd.store(-1, Ordering::Relaxed);
                e.seg_id.store(0, Ordering::Relaxed);
                e.seg_off.store(0, Ordering::Relaxed);
            }
        }
        e.key.store(key, Ordering::Release);
        let local = &self.keys[slot];
        local.pd.store(pd, Ordering::Relaxed);
        local.access.store(access.bits(), Ordering::Relaxed);
        local.addr.store(addr, Ordering::Relaxed);
        local.len.store(len, Ordering::Relaxed);
        local.key.store(key, Ordering::Release);
        Ok(key)
    }

    /// Deregisters `key`: unpublishes it, then waits until no access is in progress: a peer's,
    /// a key-table reader's without a queue-pair lock (through [`CtxInner::changing`]), and
    /// every queue pair of this context (whose lock holders read the table without a lock).
    /// Returns false if a peer kept an access open past the grace period (the memory must then
    /// be leaked, not freed, since a dead or stuck peer might still copy into it).
    ///
    /// Must not be called while holding a queue pair's lock (it waits for every one).
    pub fn deregister(&self, key: u32) -> bool {
        let Some(slot) = key_slot(key) else {
            return true;
        };
        // First, so that a reader holding no queue-pair lock (`try_local_keys`), helping a peer
        // that holds an access to this region, backs off rather than keep that peer, and so
        // us, waiting.
        let changing = self.changing.write().expect("key table lock");
        let mut t = self.slots.lock().expect("key slot lock");
        let local = &self.keys[slot];
        if local.key.load(Ordering::Relaxed) != key {
            return true;
        }
        local.key.store(0, Ordering::SeqCst);
        let e = self.ctrl().mr(slot).expect("slot in range");
        e.key.store(0, Ordering::SeqCst);
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut clean = true;
        while e.inuse.load(Ordering::SeqCst) != 0 {
            if Instant::now() > deadline {
                log::error!("memory region {key:#x}: a peer access did not finish; leaking its memory");
                clean = false;
                e.inuse.store(0, Ordering::SeqCst);
                break;
            }
            std::thread::yield_now();
        }
        // Any queue-pair lock holder that saw the key before it was cleared still holds that lock.
        (self.lock_grace)(self.id);
        t.free.push(slot);
        drop(changing);
        clean
    }

    /// The key table for checks by a holder of a queue pair's lock of this context.
    ///
    /// # Safety
    /// The caller must hold the lock of a queue pair of this context (one that
    /// the context's [`LockGrace`] waits for) for as long as the view lives: a
    /// deregistration waits for that lock, so no region the view grants can be freed meanwhile.
    pub unsafe fn keys_under_qp_lock(&self) -> LocalKeys<'_> {
        LocalKeys::new(&self.keys, None)
    }

    /// The key table for a reader without a queue-pair lock, if no deregistration is under way
    /// (for work that must never wait for one); it holds deregistrations off while it lives.
    pub fn try_local_keys(&self) -> Option<LocalKeys<'_>> {
        self.changing.try_read().ok().map(|g| LocalKeys::new(&self.keys, Some(g)))
    }

    /// The peer context for an endpoint, mapped once and shared by every QP connected to it.
    pub fn peer(self: &Arc<Self>, ep: &crate::endpoint::SoftEndpoint) -> Result<Arc<PeerCtx>> {
        let key = (ep.pid, ep.start_time, ep.ctx_id);
        let mut peers = self.peers.lock().expect("peer table lock");
        if let Some(p) = peers.get(&key).and_then(Weak::upgrade) {
            return Ok(p);
        }
        peers.retain(|_, w| w.strong_count() > 0);
        let p = Arc::new(PeerCtx::attach(self.pid, self.lock_tag, ep)?);
        peers.insert(key, Arc::downgrade(&p));
        Ok(p)
    }
}
