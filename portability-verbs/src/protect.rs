//! Memory protection of registered memory, the one place that calls `mprotect` on it.
//!
//! Protecting a buffer (as asynchronous zero-copy sockets do until a transfer completes) must not
//! stop the provider from reaching it, just as it does not stop a NIC's DMA. The software provider
//! asks [`any_active`] before copying into or out of its own process's memory and, while any range
//! is protected, goes through `/proc/self/mem`, which ignores page protection.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::error::{Result, VerbsError};

static ACTIVE: AtomicUsize = AtomicUsize::new(0);

/// True while some range of this process is protected through this module.
#[inline]
pub fn any_active() -> bool {
    ACTIVE.load(Ordering::Acquire) != 0
}

/// The protection to apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protection {
    /// No access (reads and writes fault).
    None,
    /// Read-only (writes fault).
    ReadOnly,
}

/// A protected range; dropping it makes the range readable and writable again.
#[derive(Debug)]
pub struct ProtectedRange {
    addr: usize,
    len: usize,
}

impl ProtectedRange {
    /// Start of the range.
    pub fn addr(&self) -> usize {
        self.addr
    }
    /// Bytes in the range.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True for an empty range.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Protects the page-aligned range `[addr, addr + len)`.
///
/// # Safety
/// The range must be memory this process owns and nobody accesses with plain loads or stores
/// that a fault would break (the caller installs whatever handles such faults).
pub unsafe fn protect(addr: usize, len: usize, prot: Protection) -> Result<ProtectedRange> {
    let page = crate::soft::page_size();
    if !addr.is_multiple_of(page) || !len.is_multiple_of(page) || len == 0 {
        return Err(VerbsError::invalid("protected ranges must be whole pages"));
    }
    let p = match prot {
        Protection::None => libc::PROT_NONE,
        Protection::ReadOnly => libc::PROT_READ,
    };
    // Count first, so the provider switches to the protection-proof path before a page closes.
    ACTIVE.fetch_add(1, Ordering::AcqRel);
    // SAFETY: the caller guarantees the range is ours and may be protected.
    if unsafe { libc::mprotect(addr as *mut libc::c_void, len, p) } != 0 {
        ACTIVE.fetch_sub(1, Ordering::AcqRel);
        return Err(VerbsError::last_os("mprotect"));
    }
    Ok(ProtectedRange { addr, len })
}

impl Drop for ProtectedRange {
    fn drop(&mut self) {
        // SAFETY: restores ordinary access to a range `protect` validated and protected.
        unsafe { libc::mprotect(self.addr as *mut libc::c_void, self.len, libc::PROT_READ | libc::PROT_WRITE) };
        ACTIVE.fetch_sub(1, Ordering::AcqRel);
    }
}
