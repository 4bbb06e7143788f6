//! A pool of pre-registered, fixed-size buffers for small messages (Madeleine's static-buffer
//! path, the SDP buffer-copy path).
//!
//! Registration is far too expensive per message, so one region is registered once and cut into
//! `count` buffers of `buf_size` bytes. A sender fills the next buffer while earlier ones are
//! still in flight, so the copy overlaps the transfer. The pool may serve one connection or be
//! shared by many (an `Arc<BufferPool>`), so that its memory does not grow with the number of
//! peers. Acquire and release are lock-free (a tagged Treiber stack).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::error::{Result, VerbsError};
use crate::types::{AccessFlags, Sge};
use crate::verbs::{MemoryRegion, ProtectionDomain};

use pv_sync::stack::{IndexStack, NIL};

/// A pool of registered buffers.
pub struct BufferPool {
    mr: MemoryRegion,
    buf_size: usize,
    count: u32,
    /// The free buffers.
    free: IndexStack,
    in_use: AtomicUsize,
    high_water: AtomicUsize,
    acquires: AtomicU64,
    exhausted: AtomicU64,
}

impl std::fmt::Debug for BufferPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufferPool").field("stats", &self.stats()).finish_non_exhaustive()
    }
}

/// Occupancy figures of a pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolStats {
    /// Buffers in the pool.
    pub capacity: usize,
    /// Bytes per buffer.
    pub buf_size: usize,
    /// Buffers handed out now.
    pub in_use: usize,
    /// Most buffers ever handed out at once.
    pub high_water: usize,
    /// Successful acquisitions so far.
    pub acquires: u64,
    /// Acquisitions that found the pool empty.
    pub exhausted: u64,
}

impl BufferPool {
    /// Allocates and registers `count` buffers of `buf_size` bytes (provider memory: on the
    /// software provider a shared segment, the fastest target for peers' RDMA).
    pub fn new(pd: &ProtectionDomain, buf_size: usize, count: usize, access: AccessFlags) -> Result<Arc<BufferPool>> {
        if buf_size == 0 || count == 0 || count >= NIL as usize {
            return Err(VerbsError::invalid("a pool needs buf_size > 0 and 0 < count < 2^32-1"));
        }
        let total = buf_size.checked_mul(count).ok_or_else(|| VerbsError::invalid("pool size overflows"))?;
        let mr = pd.alloc(total, access | AccessFlags::LOCAL_WRITE)?;
        Ok(Arc::new(BufferPool {
            mr,
            buf_size,
            count: count as u32,
            free: IndexStack::full(count as u32),
            in_use: AtomicUsize::new(0),
            high_water: AtomicUsize::new(0),
            acquires: AtomicU64::new(0),
            exhausted: AtomicU64::new(0),
        }))
    }

    /// Bytes per buffer.
    pub fn buf_size(&self) -> usize {
        self.buf_size
    }

    /// Number of buffers.
    pub fn capacity(&self) -> usize {
        self.count as usize
    }

    /// The registration behind every buffer (its rkey lets peers write into pool buffers).
    pub fn region(&self) -> &MemoryRegion {
        &self.mr
    }

    /// Takes a free buffer, or None if all are in use.
    pub fn try_acquire(self: &Arc<Self>) -> Option<PoolBuf> {
        let index = self.pop()?;
        Some(PoolBuf { pool: self.clone(), index, len: 0, in_flight: false })
    }

    fn pop(&self) -> Option<u32> {
        let Some(index) = self.free.pop() else {
            self.exhausted.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let used = self.in_use.fetch_add(1, Ordering::Relaxed) + 1;
        self.high_water.fetch_max(used, Ordering::Relaxed);
        self.acquires.fetch_add(1, Ordering::Relaxed);
        Some(index)
    }

    fn push(&self, index: u32) {
        self.free.push(index);
        self.in_use.fetch_sub(1, Ordering::Relaxed);
    }

    /// Takes a free buffer by index, without a handle (the fast path for senders that track
    /// buffers in work-request ids): fill it with [`BufferPool::write`], name it with
    /// [`BufferPool::sge`], give it back with [`BufferPool::release_index`].
    pub fn acquire_index(&self) -> Option<u32> {
        self.pop()
    }

    /// Copies `data` into buffer `index` at `offset`.
    pub fn write(&self, index: u32, offset: usize, data: &[u8]) {
        assert!(index < self.count && offset + data.len() <= self.buf_size, "write outside the buffer");
        self.mr.write(self.offset(index) + offset, data);
    }

    /// An SGE over `len` bytes of buffer `index`.
    pub fn sge(&self, index: u32, len: usize) -> Sge {
        assert!(index < self.count && len <= self.buf_size, "SGE outside the buffer");
        self.mr.sge(self.offset(index), len)
    }

    /// An SGE over the whole of buffer `index` (for receives posted by index; its `addr` is
    /// where the buffer lies in this process). An error for an index outside the pool.
    pub fn sge_full_of(&self, index: u32) -> Result<Sge> {
        if index >= self.count {
            return Err(VerbsError::Protocol(format!("buffer index {index} outside a pool of {}", self.count)));
        }
        Ok(self.mr.sge(self.offset(index), self.buf_size))
    }

    /// Returns a buffer that was turned into an index with [`PoolBuf::into_index`] (for example
    /// carried in a work request id while in flight).
    ///
    /// Returns an error for an index this pool never handed out as such (a protocol bug or a
    /// peer naming an unknown buffer), instead of corrupting the free list.
    pub fn release_index(&self, index: u32) -> Result<()> {
        if index >= self.count {
            return Err(VerbsError::Protocol(format!("buffer index {index} outside a pool of {}", self.count)));
        }
        self.push(index);
        Ok(())
    }

    /// Takes back ownership of an in-flight buffer by index.
    pub fn reclaim(self: &Arc<Self>, index: u32) -> Result<PoolBuf> {
        if index >= self.count {
            return Err(VerbsError::Protocol(format!("buffer index {index} outside a pool of {}", self.count)));
        }
        Ok(PoolBuf { pool: self.clone(), index, len: 0, in_flight: false })
    }

    /// Occupancy figures.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            capacity: self.count as usize,
            buf_size: self.buf_size,
            in_use: self.in_use.load(Ordering::Relaxed),
            high_water: self.high_water.load(Ordering::Relaxed),
            acquires: self.acquires.load(Ordering::Relaxed),
            exhausted: self.exhausted.load(Ordering::Relaxed),
        }
    }

    fn offset(&self, index: u32) -> usize {
        index as usize * self.buf_size
    }
}

/// One buffer of a pool; goes back to the pool when dropped.
pub struct PoolBuf {
    pool: Arc<BufferPool>,
    index: u32,
    len: usize,
    /// Given up by [`PoolBuf::into_index`]: dropping the handle leaves the free list alone.
    in_flight: bool,
}

impl std::fmt::Debug for PoolBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolBuf").field("index", &self.index).field("len", &self.len).finish_non_exhaustive()
    }
}

impl PoolBuf {
    /// Index of the buffer in its pool.
    pub fn index(&self) -> u32 {
        self.index
    }
    /// Bytes filled so far (what [`PoolBuf::sge`] covers).
    pub fn len(&self) -> usize {
        self.len
    }
    /// True when nothing was filled.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Bytes still free.
    pub fn remaining(&self) -> usize {
        self.pool.buf_size - self.len
    }
    /// Appends bytes; returns how many fitted.
    pub fn push(&mut self, data: &[u8]) -> usize {
        let n = data.len().min(self.remaining());
        self.pool.mr.write(self.pool.offset(self.index) + self.len, &data[..n]);
        self.len += n;
        n
    }
    /// Sets the filled length (after writing through [`PoolBuf::as_mut_ptr`]).
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.pool.buf_size, "length beyond the buffer");
        self.len = len;
    }
    /// Start of the buffer.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.pool.mr.as_ptr().wrapping_add(self.pool.offset(self.index))
    }
    /// Copies the first `dst.len()` bytes out.
    pub fn read(&self, dst: &mut [u8]) {
        assert!(dst.len() <= self.pool.buf_size, "read beyond the buffer");
        self.pool.mr.read(self.pool.offset(self.index), dst);
    }
    /// An SGE over the filled bytes.
    pub fn sge(&self) -> Sge {
        self.pool.mr.sge(self.pool.offset(self.index), self.len)
    }
    /// An SGE over the whole buffer (for receives).
    pub fn sge_full(&self) -> Sge {
        self.pool.mr.sge(self.pool.offset(self.index), self.pool.buf_size)
    }
    /// Address of the buffer (for peers' RDMA, with the pool region's rkey).
    pub fn addr(&self) -> u64 {
        self.pool.mr.addr() + self.pool.offset(self.index) as u64
    }
    /// Keeps the buffer out of the pool while it is in flight; get it back with
    /// [`BufferPool::reclaim`] or [`BufferPool::release_index`].
    pub fn into_index(mut self) -> u32 {
        self.in_flight = true;
        self.index
    }
}

impl Drop for PoolBuf {
    fn drop(&mut self) {
        if !self.in_flight {
            self.pool.push(self.index);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Context, Provider};

    fn pool(size: usize, count: usize) -> Arc<BufferPool> {
        let ctx = Context::open(Provider::Software).unwrap();
        BufferPool::new(&ctx.alloc_pd().unwrap(), size, count, AccessFlags::ALL).unwrap()
    }

    #[test]
    fn hands_out_each_buffer_once_and_counts() {
        let p = pool(64, 4);
        let bufs: Vec<PoolBuf> = (0..4).map(|_| p.try_acquire().unwrap()).collect();
        let mut idx: Vec<u32> = bufs.iter().map(|b| b.index()).collect();
        idx.sort();
        assert_eq!(idx, vec![0, 1, 2, 3]);
        assert!(p.try_acquire().is_none());
        assert_eq!(p.stats().in_use, 4);
        drop(bufs);
        let s = p.stats();
        assert_eq!((s.in_use, s.high_water, s.acquires, s.exhausted), (0, 4, 4, 1));
    }

    #[test]
    fn fills_and_reads_back_and_survives_flight_by_index() {
        let p = pool(16, 2);
        let mut b = p.try_acquire().unwrap();
        assert_eq!(b.push(b"hello world, this is long"), 16);
        assert_eq!(b.remaining(), 0);
        let i = b.into_index();
        assert_eq!(p.stats().in_use, 1);
        let b = p.reclaim(i).unwrap();
        let mut out = [0u8; 16];
        b.read(&mut out);
        assert_eq!(&out, b"hello world, thi");
        drop(b);
        assert_eq!(p.stats().in_use, 0);
        assert!(p.reclaim(7).is_err());
        // Handles given up in flight and taken back hold no reference to the pool: it (and its
        // registered memory) goes when its last owner does.
        for _ in 0..10 {
            let i = p.try_acquire().unwrap().into_index();
            drop(p.reclaim(i).unwrap());
        }
        assert_eq!(Arc::strong_count(&p), 1);
    }

    #[test]
    fn concurrent_acquire_release_never_hands_a_buffer_twice() {
        let p = pool(8, 16);
        let owners: Vec<std::sync::atomic::AtomicU32> = (0..16).map(|_| std::sync::atomic::AtomicU32::new(0)).collect();
        std::thread::scope(|s| {
            for t in 1..=4u32 {
                let (p, owners) = (&p, &owners);
                s.spawn(move || {
                    for _ in 0..20_000 {
                        if let Some(b) = p.try_acquire() {
                            assert_eq!(owners[b.index() as usize].swap(t, Ordering::AcqRel), 0);
                            owners[b.index() as usize].store(0, Ordering::Release);
                        }
                    }
                });
            }
        });
        assert_eq!(p.stats().in_use, 0);
    }
}
