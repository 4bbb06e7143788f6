//! A registration cache for dynamically registered large buffers (WSDLite's hash table of
//! registered ranges, made robust).
//!
//! A lookup has three outcomes, as in WSDLite: **hit** (a cached registration covers the
//! page-aligned range with the rights asked), **grow** (cached registrations overlap or touch
//! it but do not cover it: the union is registered and replaces them) and **miss** (the range is
//! registered). Registrations in use are reference-counted and never deregistered; unused ones
//! are evicted least-recently-used first when the pinned bytes exceed the cap (WSDLite's
//! garbage collection).
//!
//! # Stale entries (the same address, different memory)
//!
//! The classic bug of every registration cache: memory is freed, new memory lands at the same
//! address, and a cached registration still names the old pages. How this cache prevents it:
//!
//! - A [`Registration`] borrows the buffer it covers (`get` takes `&'a [u8]`), so the buffer
//!   cannot be freed while the registration is in use: nothing stale can be handed out for a
//!   live transfer.
//! - Once no registration is in use, a cached entry may outlive its memory. On the **software
//!   provider** that is harmless by construction: a registration names virtual addresses and is
//!   resolved at every access, never pinning pages, so new memory at the same address is exactly
//!   what a later `get` of that address means.
//! - On the **hardware provider** a registration pins physical pages, so memory that was
//!   registered through the cache must be invalidated before it is unmapped or freed:
//!   [`RegistrationCache::invalidate`] drops every unused entry overlapping a range (and marks
//!   used ones to be dropped when released). Buffers allocated by the cache itself
//!   ([`RegistrationCache::alloc`]) do this automatically when dropped. The cache never
//!   deregisters anything from a signal handler or allocator hook.

use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{Result, VerbsError};
use crate::types::AccessFlags;
use crate::verbs::{MemoryRegion, ProtectionDomain, Provider};

/// Counters of a cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups served by a cached registration.
    pub hits: u64,
    /// Lookups that registered a new range.
    pub misses: u64,
    /// Lookups that replaced cached registrations with a larger one.
    pub grows: u64,
    /// Registrations dropped to respect the pinned-bytes cap.
    pub evictions: u64,
    /// Registrations dropped by invalidation.
    pub invalidations: u64,
    /// Bytes registered now (cached and in use).
    pub pinned_bytes: u64,
    /// Registrations cached now.
    pub entries: u64,
}

struct Entry {
    end: u64,
    access: AccessFlags,
    mr: Arc<MemoryRegion>,
    users: usize,
    last_use: u64,
}

struct Inner {
    /// Entries by start address; ranges never overlap.
    entries: BTreeMap<u64, Entry>,
    /// Replaced or invalidated while in use: no longer found by lookups, dropped when their
    /// last user releases them.
    retired: Vec<(u64, Entry)>,
    pinned: u64,
    clock: u64,
    stats: CacheStats,
}

/// A registration cache.
pub struct RegistrationCache {
    pd: ProtectionDomain,
    cap: u64,
    page: u64,
    inner: Mutex<Inner>,
    id: u64,
}

impl std::fmt::Debug for RegistrationCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistrationCache").finish_non_exhaustive()
    }
}

/// A registration in use, covering at least the buffer asked for. Borrowing the buffer keeps it
/// alive (and its memory unchanged) while the registration is used.
pub struct Registration<'a> {
    cache: &'a RegistrationCache,
    start: u64,
    mr: Arc<MemoryRegion>,
    _buf: PhantomData<&'a [u8]>,
}

impl std::fmt::Debug for Registration<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration").finish_non_exhaustive()
    }
}

impl Registration<'_> {
    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }
    /// The registered region (at least the buffer, page-aligned).
    pub fn region(&self) -> &MemoryRegion {
        &self.mr
    }
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        self.cache.release(self.start, &self.mr);
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl RegistrationCache {
    /// A cache registering in `pd`, evicting unused registrations beyond `pinned_cap` bytes.
    pub fn new(pd: &ProtectionDomain, pinned_cap: u64) -> RegistrationCache {
        RegistrationCache {
            pd: pd.clone(),
            cap: pinned_cap,
            page: crate::page_size() as u64,
            inner: Mutex::new(Inner {
                entries: BTreeMap::new(),
                retired: Vec::new(),
                pinned: 0,
                clock: 0,
                stats: CacheStats::default(),
            }),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// A registration covering `buf` with at least `access` (plus local write).
    pub fn get<'a>(&'a self, buf: &'a [u8], access: AccessFlags) -> Result<Registration<'a>> {
        // SAFETY: the returned registration borrows `buf` for its whole life.
        unsafe { self.get_raw(buf.as_ptr() as u64, buf.len() as u64, access) }
    }

    /// A registration covering `[addr, addr+len)`.
    ///
    /// # Safety
    /// The range must stay mapped, and be memory the caller may expose to the provider, for as
    /// long as the returned registration lives.
    pub unsafe fn get_raw(&self, addr: u64, len: u64, access: AccessFlags) -> Result<Registration<'_>> {
        if len == 0 {
            return Err(VerbsError::invalid("cannot register an empty buffer"));
        }
        let access = access | AccessFlags::LOCAL_WRITE;
        let start = addr / self.page * self.page;
        let end = addr
            .checked_add(len)
            .and_then(|e| e.checked_add(self.page - 1))
            .ok_or_else(|| VerbsError::invalid("buffer wraps the address space"))?
            / self.page
            * self.page;
        let mut g = self.inner.lock().expect("registration cache lock");
        g.clock += 1;
        let now = g.clock;
        // Hit: the entry starting at or before `start` covers the range.
        if let Some((&s, e)) = g.entries.range_mut(..=start).next_back() {
            if e.end >= end && e.access.contains(access) {
                e.users += 1;
                e.last_use = now;
                let mr = e.mr.clone();
                g.stats.hits += 1;
                return Ok(Registration { cache: self, start: s, mr, _buf: PhantomData });
            }
        }
        // Grow or miss: merge with every entry overlapping or touching the range.
        let mut new_start = start;
        let mut new_end = end;
        let mut new_access = access;
        let touching: Vec<u64> = g.entries.range(..=end).filter(|(_, e)| e.end >= start).map(|(&s, _)| s).collect();
        for s in &touching {
            let e = &g.entries[s];
            new_start = new_start.min(*s);
            new_end = new_end.max(e.end);
            new_access |= e.access;
        }
        // Registering the union is safe as far as the caller's range goes; the parts that come
        // from other entries are memory those entries' callers vouched for, and still mapped
        // only if nothing was freed without invalidation (the contract above).
        // SAFETY: see above and the function's contract.
        let mr = Arc::new(unsafe {
            self.pd.register_raw(new_start as usize as *mut u8, (new_end - new_start) as usize, new_access)?
        });
        let grew = !touching.is_empty();
        for s in touching {
            let old = g.entries.remove(&s).expect("listed above");
            if old.users == 0 {
                g.pinned -= old.end - s;
            } else {
                // Still in use: it stays registered (its users hold it) until its last user
                // releases it; it just is no longer found by lookups.
                g.retired.push((s, old));
            }
        }
        g.pinned += new_end - new_start;
        g.entries
            .insert(new_start, Entry { end: new_end, access: new_access, mr: mr.clone(), users: 1, last_use: now });
        if grew {
            g.stats.grows += 1;
        } else {
            g.stats.misses += 1;
        }
        self.evict(&mut g);
        Ok(Registration { cache: self, start: new_start, mr, _buf: PhantomData })
    }

    /// Evicts unused registrations, least recently used first, while over the cap.
    fn evict(&self, g: &mut Inner) {
        while g.pinned > self.cap {
            let victim =
                g.entries.iter().filter(|(_, e)| e.users == 0).min_by_key(|(_, e)| e.last_use).map(|(&s, _)| s);
            let Some(s) = victim else { break };
            let e = g.entries.remove(&s).expect("found above");
            g.pinned -= e.end - s;
            g.stats.evictions += 1;
        }
    }

    fn release(&self, start: u64, mr: &Arc<MemoryRegion>) {
        let mut g = self.inner.lock().expect("registration cache lock");
        match g.entries.get_mut(&start) {
            Some(e) if Arc::ptr_eq(&e.mr, mr) => e.users -= 1,
            _ => {
                if let Some(i) = g.retired.iter().position(|(_, e)| Arc::ptr_eq(&e.mr, mr)) {
                    g.retired[i].1.users -= 1;
                    if g.retired[i].1.users == 0 {
                        let (s, e) = g.retired.swap_remove(i);
                        g.pinned -= e.end - s;
                    }
                }
            }
        }
        self.evict(&mut g);
    }

    /// Drops every cached registration overlapping `[addr, addr+len)`: call it before unmapping
    /// or freeing memory that was registered through the cache (needed on the hardware
    /// provider, harmless on the software one). Registrations in use are dropped when released.
    pub fn invalidate(&self, addr: u64, len: u64) {
        let end = addr.saturating_add(len);
        let mut g = self.inner.lock().expect("registration cache lock");
        let hit: Vec<u64> = g.entries.range(..end).filter(|(_, e)| e.end > addr).map(|(&s, _)| s).collect();
        for s in hit {
            let e = g.entries.remove(&s).expect("listed");
            g.stats.invalidations += 1;
            if e.users == 0 {
                g.pinned -= e.end - s;
            } else {
                g.retired.push((s, e));
            }
        }
    }

    /// Allocates a buffer whose registration the cache manages; dropping it invalidates it.
    pub fn alloc(self: &Arc<Self>, len: usize) -> CachedBuffer {
        CachedBuffer { cache: self.clone(), buf: vec![0u8; len].into_boxed_slice() }
    }

    /// Counters.
    pub fn stats(&self) -> CacheStats {
        let g = self.inner.lock().expect("registration cache lock");
        CacheStats { pinned_bytes: g.pinned, entries: (g.entries.len() + g.retired.len()) as u64, ..g.stats }
    }

    /// True when stale entries cannot occur on this cache's provider (see the module docs).
    pub fn stale_entries_harmless(&self) -> bool {
        self.pd.provider() == Provider::Software
    }

    /// A process-unique id of this cache.
    pub fn id(&self) -> u64 {
        self.id
    }
}

/// A heap buffer tied to a cache: dropping it invalidates its registrations.
pub struct CachedBuffer {
    cache: Arc<RegistrationCache>,
    buf: Box<[u8]>,
}

impl std::fmt::Debug for CachedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachedBuffer").finish_non_exhaustive()
    }
}

impl CachedBuffer {
    /// A registration covering the buffer.
    pub fn register(&self, access: AccessFlags) -> Result<Registration<'_>> {
        self.cache.get(&self.buf, access)
    }
}

impl std::ops::Deref for CachedBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf
    }
}

impl std::ops::DerefMut for CachedBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }
}

impl Drop for CachedBuffer {
    fn drop(&mut self) {
        self.cache.invalidate(self.buf.as_ptr() as u64, self.buf.len() as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Context;
    use proptest::prelude::*;

    fn cache(cap: u64) -> RegistrationCache {
        let ctx = Context::open(Provider::Software).unwrap();
        RegistrationCache::new(&ctx.alloc_pd().unwrap(), cap)
    }

    #[test]
    fn hit_grow_miss() {
        let c = cache(1 << 30);
        let buf = vec![0u8; 64 * 1024];
        let r1 = c.get(&buf[..4096], AccessFlags::REMOTE_READ).unwrap();
        let k1 = r1.lkey();
        drop(r1);
        let r2 = c.get(&buf[100..200], AccessFlags::REMOTE_READ).unwrap();
        assert_eq!(r2.lkey(), k1, "hit reuses the registration");
        drop(r2);
        let r3 = c.get(&buf[..], AccessFlags::REMOTE_READ).unwrap();
        assert_ne!(r3.lkey(), k1);
        let s = c.stats();
        assert_eq!((s.hits, s.misses, s.grows), (1, 1, 1));
        assert_eq!(s.entries, 1, "the grown registration replaced the smaller one");
        // More rights than cached: a new, merged registration.
        drop(r3);
        let r4 = c.get(&buf[..], AccessFlags::REMOTE_WRITE).unwrap();
        assert!(r4.region().len() >= buf.len());
    }

    #[test]
    fn registrations_in_use_are_never_evicted_and_lru_goes_first() {
        let page = crate::page_size();
        let c = cache(3 * page as u64);
        let bufs: Vec<Vec<u8>> = (0..5).map(|_| vec![0u8; 8 * page]).collect();
        // Page-aligned single-page slices of separate buffers.
        let slice = |b: &Vec<u8>| {
            let off = (page - b.as_ptr() as usize % page) % page;
            (b.as_ptr() as usize + off, page)
        };
        let held = unsafe { c.get_raw(slice(&bufs[0]).0 as u64, page as u64, AccessFlags::NONE) }.unwrap();
        for b in &bufs[1..] {
            let (a, l) = slice(b);
            drop(unsafe { c.get_raw(a as u64, l as u64, AccessFlags::NONE) }.unwrap());
        }
        let s = c.stats();
        assert!(s.pinned_bytes <= 3 * page as u64, "{s:?}");
        assert!(s.evictions >= 2);
        // The held one is still cached and hits.
        let again = unsafe { c.get_raw(slice(&bufs[0]).0 as u64, 8, AccessFlags::NONE) }.unwrap();
        assert_eq!(again.lkey(), held.lkey());
        // The most recently used unheld one survived; the oldest did not.
        let (a4, _) = slice(&bufs[4]);
        let hits = c.stats().hits;
        drop(unsafe { c.get_raw(a4 as u64, 8, AccessFlags::NONE) }.unwrap());
        assert_eq!(c.stats().hits, hits + 1);
    }

    #[test]
    fn invalidation_drops_cached_and_defers_used() {
        let c = Arc::new(cache(1 << 30));
        let b = c.alloc(10_000);
        let r = b.register(AccessFlags::NONE).unwrap();
        let key = r.lkey();
        c.invalidate(b.as_ptr() as u64, 1);
        assert_eq!(c.stats().entries, 1, "in use: kept until released");
        drop(r);
        assert_eq!(c.stats().entries, 0);
        let r = b.register(AccessFlags::NONE).unwrap();
        assert_ne!(r.lkey(), key);
        drop(r);
        drop(b);
        assert_eq!(c.stats().entries, 0, "dropping the buffer invalidated it");
        assert_eq!(c.stats().pinned_bytes, 0);
    }

    proptest! {
        /// Random lookups over one arena: every registration covers what was asked, entries
        /// never overlap, and the pinned count matches the entries.
        #[test]
        fn ranges_stay_disjoint_and_covering(ops in proptest::collection::vec((0usize..60_000, 1usize..20_000, any::<bool>()), 1..60)) {
            let c = cache(200_000);
            let arena = vec![0u8; 100_000];
            let mut held = Vec::new();
            for (off, len, keep) in ops {
                let len = len.min(arena.len() - off);
                if len == 0 { continue; }
                let r = c.get(&arena[off..off + len], AccessFlags::NONE).unwrap();
                let m = r.region();
                prop_assert!(m.addr() <= arena.as_ptr() as u64 + off as u64);
                prop_assert!(m.addr() + m.len() as u64 >= arena.as_ptr() as u64 + (off + len) as u64);
                if keep { held.push(r); }
                let g = c.inner.lock().unwrap();
                let mut last_end = 0u64;
                let mut pinned = 0u64;
                for (&s, e) in g.entries.iter() {
                    prop_assert!(s >= last_end, "overlapping live entries");
                    last_end = e.end;
                    pinned += e.end - s;
                }
                pinned += g.retired.iter().map(|(s, e)| e.end - s).sum::<u64>();
                prop_assert_eq!(pinned, g.pinned);
            }
        }
    }
}
