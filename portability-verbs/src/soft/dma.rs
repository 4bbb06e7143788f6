//! The software provider's stand-in for a NIC's DMA: copies between registered ranges of this
//! process that a memory-protection hold (`crate::protect`) turns into a `false` instead of a
//! fault, going through `/proc/self/mem` where a range is held, as a NIC ignores page
//! protection.

use crate::os;

/// Copies `len` bytes from `src` to `dst`, both in this process. The provider's stand-in for DMA:
/// where a range is held by `protect` it goes through `/proc/self/mem`, which ignores protection.
/// Returns `false` if a held range could not be reached (the application unmapped a buffer the
/// transport still owned): the caller reports an access error instead of faulting.
///
/// # Safety
/// Both ranges must be valid mapped memory of this process that the caller has checked against a
/// registration (or provider-owned memory), except that held ranges may have been unmapped.
#[must_use]
#[inline]
pub unsafe fn local_copy(dst: *mut u8, src: *const u8, len: usize) -> bool {
    if !crate::protect::any_active() {
        // No hold anywhere (the usual case): a plain copy, inlined into every provider path.
        // SAFETY: the caller guarantees both ranges are valid.
        unsafe { crate::copy::copy_bytes(dst, src, len) };
        return true;
    }
    // SAFETY: forwarded from the caller.
    unsafe { local_copy_held(dst, src, len) }
}

/// [`local_copy`] with non-temporal stores ([`crate::copy::copy_streaming`]) where it would
/// make a plain copy of disjoint ranges (a write within one process may overlap its source,
/// which only the plain copy handles).
///
/// # Safety
/// As [`local_copy`].
pub unsafe fn local_copy_streaming(dst: *mut u8, src: *const u8, len: usize) -> bool {
    let disjoint = (dst as usize).abs_diff(src as usize) >= len;
    if !disjoint {
        // SAFETY: forwarded from the caller.
        return unsafe { local_copy(dst, src, len) };
    }
    if !crate::protect::any_active() {
        // SAFETY: the caller guarantees both ranges are valid and disjoint.
        unsafe { crate::copy::copy_streaming(dst, src, len) };
        return true;
    }
    // SAFETY: forwarded from the caller.
    unsafe { local_copy_held(dst, src, len) }
}

/// [`local_copy`] while some range of this process is held.
#[cold]
#[inline(never)]
unsafe fn local_copy_held(dst: *mut u8, src: *const u8, len: usize) -> bool {
    if len == 0 {
        return true;
    }
    let holds = crate::protect::copy_holds(dst as usize, src as usize, len);
    let (dst_held, src_blocked) = (holds.dst_held, holds.src_read_blocked);
    if !dst_held && !src_blocked && holds.src_held {
        // A source under a send hold: readable, unless the application unmapped it against
        // its contract, which the guard turns into an access error rather than a crash.
        // SAFETY: as below; a load from a vanished page reads a zero page the guard maps.
        let ((), intact) = crate::protect::guarded_read(|| unsafe { crate::copy::copy_bytes(dst, src, len) });
        return intact;
    }
    if dst_held || src_blocked {
        // SAFETY: these slices are only handed to the kernel, which checks the addresses itself
        // (EFAULT rather than a fault) and copies through /proc/self/mem regardless of protection.
        let (d, s) = unsafe { (std::slice::from_raw_parts_mut(dst, len), std::slice::from_raw_parts(src, len)) };
        // One copy where the kernel can read the source (not held, or held read-only)...
        let direct = if dst_held {
            os::write_self_mem(dst as u64, s)
        } else {
            os::read_self_vm(src as u64, d).or_else(|_| os::read_self_mem(src as u64, d))
        };
        if direct.is_ok() {
            return true;
        }
        // ...else bounce (an inaccessible source into a held destination), or report it gone.
        let mut tmp = vec![0u8; len];
        return os::read_self_mem(src as u64, &mut tmp).is_ok() && os::write_self_mem(dst as u64, &tmp).is_ok();
    }
    // SAFETY: the caller guarantees both ranges are valid; overlapping registered buffers are the
    // caller's own business, so use the overlap-tolerant copy.
    unsafe { crate::copy::copy_bytes(dst, src, len) };
    true
}
