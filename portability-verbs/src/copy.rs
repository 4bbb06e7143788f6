//! Bulk memory copies that keep their speed whatever the two buffers' relative alignment.
//!
//! glibc copies blocks of a few KiB and more with `rep movsb`. On this kind of CPU (AMD EPYC,
//! fast short `rep movsb`) that string copy runs at 3-4 GB/s instead of 40-55 when the
//! destination lies 1 to 15 bytes above the source modulo 4 KiB: each load of the source looks
//! as if it might read a store just made (4K aliasing), and waits. Which alignment a transfer
//! gets depends on where the application's buffer and a ring slot happen to fall, so the same
//! benchmark ran at 20 GB/s or at 3 from one connection to the next. Below its `rep movsb`
//! threshold (2048 bytes at the lowest, 2112 with fast short `rep movsb`) glibc copies with a
//! vector loop, which measured 40-46 GB/s at every relative alignment: so a copy in the slow
//! window goes in pieces below the threshold. Every other copy is one plain `memmove`.
//!
//! Copies of at most 128 bytes (a small message's header and payload, the commonest copies on
//! the latency path) go through registers inline instead of a call into glibc (whose call,
//! dispatch and return cost a 64-byte message about 5 ns per copy, three copies a message).
//!
//! `memmove` against [`copy_bytes`] per relative alignment, side by side:
//! `cargo run --release -p benches --bin copy_bench`.

/// The relative alignments (destination minus source, modulo 4 KiB) copied in pieces: the
/// measured slow window is 1..=15; the margin covers CPUs with wider store-forwarding checks
/// and costs little (pieces run at 40-46 GB/s here against 41-57 whole).
const ALIAS_WINDOW: usize = 64;
/// Piece size: below every glibc `rep movsb` threshold, and a whole number of cache lines.
const PIECE: usize = 1984;

/// Copies of at most this many bytes go through registers ([`copy_small`]).
const SMALL: usize = 128;

/// Whether a copy of `len` bytes from `src` to `dst` would take glibc's slow string copy.
#[inline]
fn aliased(dst: usize, src: usize, len: usize) -> bool {
    let rel = dst.wrapping_sub(src) & 4095;
    len > PIECE && rel != 0 && rel < ALIAS_WINDOW
}

/// Copies `len` bytes from `src` to `dst` as `std::ptr::copy` does (the ranges may overlap),
/// in pieces where the relative alignment would make one `memmove` crawl (module docs).
///
/// # Safety
/// As `std::ptr::copy`: `src` valid for reads and `dst` for writes of `len` bytes.
#[inline]
pub unsafe fn copy_bytes(dst: *mut u8, src: *const u8, len: usize) {
    if len <= SMALL {
        // SAFETY: the caller's contract.
        unsafe { copy_small(dst, src, len) };
        return;
    }
    if !aliased(dst as usize, src as usize, len) {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy(src, dst, len) };
        return;
    }
    // SAFETY: the caller's contract.
    unsafe { copy_in_pieces(dst, src, len) }
}

/// A copy of at most [`SMALL`] bytes as two possibly overlapping loads of the largest width
/// that fits and two stores (one to three byte loads below 4 bytes), every load before any
/// store, so overlapping ranges copy as `memmove` copies them.
///
/// # Safety
/// As [`copy_bytes`], with `len <= SMALL`.
#[inline(always)]
unsafe fn copy_small(dst: *mut u8, src: *const u8, len: usize) {
    use std::ptr::{read_unaligned as rd, write_unaligned as wr};
    debug_assert!(len <= SMALL);
    // SAFETY (every block): each access lies in `src[..len]` or `dst[..len]` (`len - W` with
    // `len >= W` for a width W), which the caller vouches for; unaligned accesses are allowed.
    unsafe {
        if len > 64 {
            let (a, b) = (rd(src as *const u128), rd(src.add(16) as *const u128));
            let (c, d) = (rd(src.add(32) as *const u128), rd(src.add(48) as *const u128));
            let (e, f) = (rd(src.add(len - 64) as *const u128), rd(src.add(len - 48) as *const u128));
            let (g, h) = (rd(src.add(len - 32) as *const u128), rd(src.add(len - 16) as *const u128));
            wr(dst as *mut u128, a);
            wr(dst.add(16) as *mut u128, b);
            wr(dst.add(32) as *mut u128, c);
            wr(dst.add(48) as *mut u128, d);
            wr(dst.add(len - 64) as *mut u128, e);
            wr(dst.add(len - 48) as *mut u128, f);
            wr(dst.add(len - 32) as *mut u128, g);
            wr(dst.add(len - 16) as *mut u128, h);
        } else if len > 32 {
            let (a, b) = (rd(src as *const u128), rd(src.add(16) as *const u128));
            let (c, d) = (rd(src.add(len - 32) as *const u128), rd(src.add(len - 16) as *const u128));
            wr(dst as *mut u128, a);
            wr(dst.add(16) as *mut u128, b);
            wr(dst.add(len - 32) as *mut u128, c);
            wr(dst.add(len - 16) as *mut u128, d);
        } else if len >= 16 {
            let (a, b) = (rd(src as *const u128), rd(src.add(len - 16) as *const u128));
            wr(dst as *mut u128, a);
            wr(dst.add(len - 16) as *mut u128, b);
        } else if len >= 8 {
            let (a, b) = (rd(src as *const u64), rd(src.add(len - 8) as *const u64));
            wr(dst as *mut u64, a);
            wr(dst.add(len - 8) as *mut u64, b);
        } else if len >= 4 {
            let (a, b) = (rd(src as *const u32), rd(src.add(len - 4) as *const u32));
            wr(dst as *mut u32, a);
            wr(dst.add(len - 4) as *mut u32, b);
        } else if len > 0 {
            let (a, m, b) = (*src, *src.add(len / 2), *src.add(len - 1));
            *dst = a;
            *dst.add(len / 2) = m;
            *dst.add(len - 1) = b;
        }
    }
}

/// The piecewise copy. With the destination above an overlapping source the pieces go from
/// the end, so no piece reads bytes an earlier one wrote; each piece is itself a `memmove`.
///
/// # Safety
/// As [`copy_bytes`].
#[cold]
unsafe fn copy_in_pieces(dst: *mut u8, src: *const u8, len: usize) {
    let backward = (dst as usize) > (src as usize) && (dst as usize) - (src as usize) < len;
    let pieces = len.div_ceil(PIECE);
    for i in 0..pieces {
        let k = if backward { pieces - 1 - i } else { i };
        let off = k * PIECE;
        let n = PIECE.min(len - off);
        // SAFETY: `off + n <= len`, inside both ranges the caller vouches for.
        unsafe { std::ptr::copy(src.add(off), dst.add(off), n) };
    }
}

/// `dst.copy_from_slice(src)` through [`copy_bytes`].
///
/// # Panics
/// If the lengths differ, as `copy_from_slice` does.
#[inline]
pub fn copy_slice(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_slice: source and destination lengths differ");
    // SAFETY: two live slices of equal length; `&mut` excludes overlap, which is allowed anyway.
    unsafe { copy_bytes(dst.as_mut_ptr(), src.as_ptr(), src.len()) }
}

/// `v.extend_from_slice(src)` through [`copy_bytes`] (a small append, such as a message's
/// payload into the buffer being filled, goes through registers instead of a glibc call).
#[inline]
pub fn extend_vec(v: &mut Vec<u8>, src: &[u8]) {
    v.reserve(src.len());
    let len = v.len();
    // SAFETY: `reserve` made room for `src.len()` more bytes after `len`; `src` cannot overlap
    // the spare capacity of `v` (a shared borrow of it would conflict with `&mut v`). Every
    // byte up to the new length is initialized by the copy before `set_len`.
    unsafe {
        copy_bytes(v.as_mut_ptr().add(len), src.as_ptr(), src.len());
        v.set_len(len + src.len());
    }
}

/// Copies `len` bytes from `src` to `dst` (disjoint ranges) with non-temporal stores where the
/// CPU has them: the destination's lines go to memory instead of this CPU's cache.
///
/// For data another CPU reads next and this one does not, such as a copy into a peer's ring.
/// When the two CPUs share no cache level, a cached copy leaves every line dirty here, and the
/// reader's loads then each wait for a transfer out of this cache (and the next lap's stores
/// each for the reader's copy to be invalidated). Measured on this kind of VM between cores of
/// different dies (a cache-line transfer near 280 ns), a ring with a 64 KiB slot copied in and
/// out ran at 1.6-3 GB/s with cached stores and at 6-11 with these. Between cores that share a
/// cache it ran at 12 GB/s cached and 6-7 streaming, so which to use is a measured choice.
///
/// # Safety
/// `src` valid for reads and `dst` for writes of `len` bytes; the ranges must not overlap.
pub unsafe fn copy_streaming(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        const LINE: usize = 64;
        // Cached stores up to the destination's first line boundary, streaming stores for the
        // whole lines, cached stores for the tail.
        let head = (dst as usize).wrapping_neg() % LINE;
        if len < head + LINE {
            // SAFETY: the caller's contract.
            unsafe { copy_bytes(dst, src, len) };
            return;
        }
        // SAFETY: `head <= len`; the caller's contract covers both ranges.
        unsafe { copy_bytes(dst, src, head) };
        let lines = (len - head) / LINE;
        // SAFETY: `head + lines * LINE <= len`, inside both ranges; SSE2 is part of x86_64; every
        // store lands on a 16-byte aligned address (`dst + head` is line aligned).
        unsafe {
            let (mut d, mut s) = (dst.add(head) as *mut __m128i, src.add(head) as *const __m128i);
            for _ in 0..lines {
                let (a, b, c, e) = (
                    _mm_loadu_si128(s),
                    _mm_loadu_si128(s.add(1)),
                    _mm_loadu_si128(s.add(2)),
                    _mm_loadu_si128(s.add(3)),
                );
                _mm_stream_si128(d, a);
                _mm_stream_si128(d.add(1), b);
                _mm_stream_si128(d.add(2), c);
                _mm_stream_si128(d.add(3), e);
                d = d.add(4);
                s = s.add(4);
            }
            // Streaming stores are weakly ordered: fence them before anything that publishes
            // the data (the caller's release store of a ring position).
            _mm_sfence();
        }
        let done = head + lines * LINE;
        // SAFETY: the tail `done..len` lies inside both ranges.
        unsafe { copy_bytes(dst.add(done), src.add(done), len - done) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: the caller's contract.
    unsafe {
        copy_bytes(dst, src, len)
    }
}

/// Copies into another CPU's lines gain from [`prefetch_for_write`] from more than this many
/// bytes (four cache lines) up to [`PREFETCH_WRITE_MAX`] (decision 029).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const PREFETCH_WRITE_MIN: usize = 257;
/// Larger copies gained nothing measurable (decision 029).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const PREFETCH_WRITE_MAX: usize = 4096;

/// Before a copy of `len` bytes into `dst` that another CPU's cache may hold (a peer's ring,
/// whose reader last read it), asks for its cache lines in a writable state, all at once
/// (x86's `PREFETCHW`). Each store into such a line waits for the line to come over, and the
/// store queue lets only some of those transfers overlap: a copy of 512 B to 2 KiB into a
/// peer's ring waited for them in two or three rounds instead of one. Only for copies of 257
/// B to 4 KiB, where that was measured (decision 029); nothing for others, on other
/// architectures, or on CPUs without the instruction. A hint: it reads and writes no byte
/// and faults on no address, mapped or not.
#[inline]
pub fn prefetch_for_write(dst: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if (PREFETCH_WRITE_MIN..=PREFETCH_WRITE_MAX).contains(&len) && has_prefetchw() {
        const LINE: usize = 64;
        let end = (dst as usize).saturating_add(len);
        let mut line = dst as usize & !(LINE - 1);
        while line < end {
            // SAFETY: `PREFETCHW` (present: `has_prefetchw`) is a hint: it reads and writes
            // no memory, raises no fault on any address, and changes no register or flag.
            unsafe { std::arch::asm!("prefetchw [{0}]", in(reg) line, options(nostack, readonly, preserves_flags)) };
            let Some(next) = line.checked_add(LINE) else { break };
            line = next;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (dst, len);
}

/// Whether this CPU has `PREFETCHW` (CPUID 8000_0001h, ECX bit 8), asked once.
#[cfg(target_arch = "x86_64")]
#[inline]
fn has_prefetchw() -> bool {
    use std::sync::atomic::{AtomicU8, Ordering};
    static KNOWN: AtomicU8 = AtomicU8::new(0); // 0: not asked yet, 1: no, 2: yes
    match KNOWN.load(Ordering::Relaxed) {
        0 => {
            // (Leaf 8000_0000h gives the highest extended leaf, asked before 8000_0001h.)
            use std::arch::x86_64::__cpuid;
            let yes = __cpuid(0x8000_0000).eax >= 0x8000_0001 && __cpuid(0x8000_0001).ecx & (1 << 8) != 0;
            KNOWN.store(if yes { 2 } else { 1 }, Ordering::Relaxed);
            yes
        }
        known => known == 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_write_prefetch_touches_nothing_and_never_faults() {
        // Lines that may not be written, and lines not mapped at all: a hint, no fault.
        let page = 4096;
        // SAFETY: a fresh anonymous mapping of two pages, made read-only, then its second page
        // unmapped; only addresses are used below, nothing is read or written through them.
        let base = unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                2 * page,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            assert_eq!(libc::munmap((p as *mut u8).add(page) as *mut libc::c_void, page), 0);
            p as *const u8
        };
        prefetch_for_write(base, PREFETCH_WRITE_MAX);
        prefetch_for_write(base.wrapping_add(page - 100), 1000);
        prefetch_for_write(std::ptr::null(), PREFETCH_WRITE_MAX);
        prefetch_for_write((usize::MAX - 100) as *const u8, PREFETCH_WRITE_MAX);
        let mut buf = vec![7u8; 3000];
        prefetch_for_write(buf.as_ptr().wrapping_add(5), 2000);
        buf[0] = 1;
        assert!(buf[1..].iter().all(|&b| b == 7));
        // SAFETY: the first page of the mapping made above, still mapped.
        assert_eq!(unsafe { *base }, 0);
        // SAFETY: unmapping the page still mapped.
        assert_eq!(unsafe { libc::munmap(base as *mut libc::c_void, page) }, 0);
    }

    #[test]
    fn the_slow_window_is_copied_in_pieces_and_nothing_else() {
        assert!(aliased(0x1008, 0x1000, 8192));
        assert!(aliased(0x2001, 0x5000, 4096)); // modulo 4 KiB
        assert!(!aliased(0x1000, 0x1000, 8192)); // same alignment: glibc's fast case
        assert!(!aliased(0x1040, 0x1000, 8192)); // past the window
        assert!(!aliased(0x1000, 0x1008, 8192)); // destination below the source
        assert!(!aliased(0x1008, 0x1000, PIECE)); // short copies never take the string copy
    }

    /// A copy of `len` bytes from `src_at` to `dst_at` inside one buffer (ranges may overlap),
    /// against the same copy by `std::ptr::copy` on a twin buffer.
    fn check_within(len: usize, src_at: usize, dst_at: usize) {
        let size = src_at.max(dst_at) + len;
        let mut a: Vec<u8> = (0..size).map(|i| (i * 7 + i / 251) as u8).collect();
        let mut b = a.clone();
        // SAFETY: both ranges lie inside `a` (and `b`), which are `size` bytes long.
        unsafe {
            copy_bytes(a.as_mut_ptr().add(dst_at), a.as_ptr().add(src_at), len);
            std::ptr::copy(b.as_ptr().add(src_at), b.as_mut_ptr().add(dst_at), len);
        }
        assert!(a == b, "copy of {len} bytes from {src_at} to {dst_at} differs from memmove");
    }

    #[test]
    fn overlapping_copies_in_the_window_match_memmove_both_ways() {
        for len in [PIECE + 1, 2 * PIECE, 3 * PIECE + 17, 65536] {
            for shift in [1, 8, 15, 63] {
                check_within(len, 0, shift); // destination just above: pieces from the end
                check_within(len, shift, 0); // just below: plain memmove
                check_within(len, 0, 4096 + shift); // aliased, overlapping further up
            }
        }
    }

    #[test]
    fn small_copies_match_memmove_at_every_length_and_overlap() {
        for len in 0..=SMALL + 1 {
            for (src_at, dst_at) in [
                (0, 0),
                (0, 140),
                (140, 0),
                (0, 70),
                (70, 0),
                (0, 40),
                (40, 0),
                (3, 0),
                (0, 3),
                (0, 1),
                (1, 0),
                (5, 13),
                (17, 0),
                (0, 33),
            ] {
                check_within(len, src_at, dst_at);
            }
        }
    }

    /// A streaming copy of `len` bytes between disjoint buffers at the given offsets leaves
    /// exactly the source's bytes and nothing around them.
    fn check_streaming(len: usize, src_at: usize, dst_at: usize) {
        let src: Vec<u8> = (0..src_at + len).map(|i| (i * 13 + i / 253) as u8).collect();
        let mut dst = vec![0x5Au8; dst_at + len + 64];
        // SAFETY: both ranges lie inside their own vectors.
        unsafe { copy_streaming(dst.as_mut_ptr().add(dst_at), src.as_ptr().add(src_at), len) };
        assert!(dst[dst_at..dst_at + len] == src[src_at..], "{len} bytes from {src_at} to {dst_at}");
        assert!(dst[..dst_at].iter().chain(&dst[dst_at + len..]).all(|&b| b == 0x5A), "spill");
    }

    #[test]
    fn streaming_copies_place_exactly_their_bytes_at_every_alignment() {
        for len in (0..300).chain([1023, 1024, 4096, 4097, 65536 + 5]) {
            for (src_at, dst_at) in [(0, 0), (1, 0), (0, 1), (7, 63), (63, 7), (32, 16), (5, 64)] {
                check_streaming(len, src_at, dst_at);
            }
        }
    }

    proptest! {
        #[test]
        fn any_streaming_copy_is_exact(len in 0usize..20_000, src_at in 0usize..200, dst_at in 0usize..200) {
            check_streaming(len, src_at, dst_at);
        }

        #[test]
        fn any_copy_matches_memmove(len in 0usize..20_000, src_at in 0usize..9000, dst_at in 0usize..9000) {
            check_within(len, src_at, dst_at);
        }

        #[test]
        fn disjoint_slices_copy_exactly(len in 0usize..20_000, rel in 0usize..4096) {
            let src: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
            let mut dst = vec![0u8; len + 4096];
            let at = (src.as_ptr() as usize + rel).wrapping_sub(dst.as_ptr() as usize) & 4095;
            copy_slice(&mut dst[at..at + len], &src);
            prop_assert!(dst[at..at + len] == src[..]);
            prop_assert!(dst[..at].iter().chain(&dst[at + len..]).all(|&b| b == 0));
        }

        #[test]
        fn extend_vec_appends_as_extend_from_slice_does(
            head in proptest::collection::vec(any::<u8>(), 0..100),
            tail in proptest::collection::vec(any::<u8>(), 0..3000),
            spare in 0usize..64,
        ) {
            let mut v = Vec::with_capacity(head.len() + spare);
            v.extend_from_slice(&head);
            extend_vec(&mut v, &tail);
            let mut want = head.clone();
            want.extend_from_slice(&tail);
            prop_assert_eq!(v, want);
        }
    }
}
