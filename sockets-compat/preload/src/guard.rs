//! Calls the library makes itself (the SDP stack opens sockets, reads and writes them) must
//! reach the C library directly: while a thread runs inside an intercepted call, the calls it
//! makes pass through.

use std::cell::Cell;

thread_local! {
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Whether this thread is inside the library (its calls pass through). A thread whose
/// thread-locals are gone (exiting) counts as inside.
#[inline]
pub fn inside() -> bool {
    DEPTH.try_with(|d| d.get() > 0).unwrap_or(true)
}

/// Marks this thread inside the library until dropped.
pub struct Inside(());

impl Inside {
    pub fn enter() -> Inside {
        let _ = DEPTH.try_with(|d| d.set(d.get() + 1));
        Inside(())
    }

    /// Marks a thread of the library's own inside for good.
    pub fn forever() {
        std::mem::forget(Inside::enter());
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        let _ = DEPTH.try_with(|d| d.set(d.get().saturating_sub(1)));
    }
}
