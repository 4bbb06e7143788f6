//! Registered memory (`exs_mhandle_t`): the buffers EXS sends from and receives into, so that
//! data moves by RDMA between the two applications' memory with no copy.

use std::sync::Arc;

use portability_verbs::{AccessFlags, MemoryRegion};

use super::error::{ExsError, ExsResult};
use crate::verbs_runtime::runtime;

/// What the application's clones share: the registration, which every operation in flight
/// holds too (so its count beyond this one is the operations in flight: one atomic count
/// kept by an operation's start and end, not two).
struct Inner {
    mr: Arc<MemoryRegion>,
}

/// A registered memory region. Clones share it; the registration ends when the last clone is
/// dropped or [`Memory::deregister`] succeeds (and the last operation on it completed).
#[derive(Clone)]
pub struct Memory(Arc<Inner>);

impl std::fmt::Debug for Memory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Memory({:#x}, {} bytes)", self.addr(), self.len())
    }
}

/// An operation's hold on a region: deregistering fails while one exists.
pub(crate) struct InFlight {
    _registration: Arc<MemoryRegion>,
}

impl Memory {
    /// Registers `len` bytes the caller owns at `addr` (`exs_mregister`).
    ///
    /// # Safety
    /// The memory must stay mapped for as long as the region is registered (until the last
    /// clone is dropped), and the caller accepts that receives write into it by RDMA while
    /// they are in flight.
    pub unsafe fn register(addr: *mut u8, len: usize) -> ExsResult<Memory> {
        if addr.is_null() || len == 0 {
            return Err(ExsError::Invalid("memory to register"));
        }
        let rt = runtime().map_err(ExsError::io)?;
        // SAFETY: forwarded contract.
        let mr = unsafe { rt.pd.register_raw(addr, len, AccessFlags::ALL) }.map_err(ExsError::verbs)?;
        Ok(Memory(Arc::new(Inner { mr: Arc::new(mr) })))
    }

    /// Allocates and registers `len` zeroed bytes the region owns.
    pub fn alloc(len: usize) -> ExsResult<Memory> {
        if len == 0 {
            return Err(ExsError::Invalid("memory to register"));
        }
        let rt = runtime().map_err(ExsError::io)?;
        let mr = rt.pd.alloc(len, AccessFlags::ALL).map_err(ExsError::verbs)?;
        Ok(Memory(Arc::new(Inner { mr: Arc::new(mr) })))
    }

    /// Where the region starts.
    pub fn addr(&self) -> u64 {
        self.0.mr.addr()
    }

    /// Its bytes.
    pub fn len(&self) -> usize {
        self.0.mr.len()
    }

    /// Whether it holds no bytes (never, for a registered region).
    pub fn is_empty(&self) -> bool {
        self.0.mr.is_empty()
    }

    /// A pointer to its first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.0.mr.as_ptr()
    }

    /// Copies bytes out of the region (for tests and simple programs; a receive's bytes are
    /// there once its event came).
    pub fn read(&self, offset: usize, dst: &mut [u8]) {
        self.0.mr.read(offset, dst)
    }

    /// Copies bytes into the region.
    pub fn write(&self, offset: usize, src: &[u8]) {
        self.0.mr.write(offset, src)
    }

    /// Ends the registration (`exs_mderegister`); refused while an operation uses the region,
    /// and the region is handed back.
    pub fn deregister(self) -> Result<(), (Memory, ExsError)> {
        // Operations in flight each hold the registration (the region itself outlives them
        // whatever this says: they keep it alive).
        if Arc::strong_count(&self.0.mr) > 1 {
            return Err((self, ExsError::Busy("the memory region")));
        }
        Ok(())
    }

    pub(crate) fn lkey(&self) -> u32 {
        self.0.mr.lkey()
    }

    pub(crate) fn rkey(&self) -> u32 {
        self.0.mr.rkey()
    }

    /// Checks that `[addr, addr + len)` lies in the region and takes a hold on it.
    pub(crate) fn hold(&self, addr: u64, len: u64) -> ExsResult<InFlight> {
        let end = addr.checked_add(len).ok_or(ExsError::OutsideRegion)?;
        if addr < self.addr() || end > self.addr() + self.len() as u64 {
            return Err(ExsError::OutsideRegion);
        }
        Ok(InFlight { _registration: self.0.mr.clone() })
    }

    /// Whether two handles name the same registration.
    pub fn same(&self, other: &Memory) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}
