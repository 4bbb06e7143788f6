//! The Linux calls the stack is built on, each wrapped once with its error handling: the page
//! size, memfd segments, eventfd doorbells, epoll and poll, pidfd (liveness and descriptor
//! fetching), process-unique ids, the stack's own threads (signals blocked), and copies into and out of another process (cross-memory attach, with `/proc/PID/mem` as the fallback that
//! reaches memory-protected pages the way a NIC's DMA does).

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

use crate::error::{Result, VerbsError};

/// Signals never blocked by [`AsyncSignalsBlocked`]: a fault in the thread must reach its
/// handler.
const SYNCHRONOUS_SIGNALS: [libc::c_int; 6] =
    [libc::SIGSEGV, libc::SIGBUS, libc::SIGFPE, libc::SIGILL, libc::SIGTRAP, libc::SIGSYS];

/// The calling thread's asynchronous signals blocked until this is dropped, which restores
/// its mask (a signal that came meanwhile is delivered then) and keeps `errno`.
#[derive(Debug)]
pub struct AsyncSignalsBlocked {
    old: libc::sigset_t,
}

impl AsyncSignalsBlocked {
    /// Blocks them now.
    pub fn new() -> AsyncSignalsBlocked {
        let mut all = empty_sigset();
        let mut old = empty_sigset();
        // SAFETY: valid sets; changes this thread's mask only (restored on drop).
        unsafe {
            libc::sigfillset(&mut all);
            for sig in SYNCHRONOUS_SIGNALS {
                libc::sigdelset(&mut all, sig);
            }
            libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old);
        }
        AsyncSignalsBlocked { old }
    }

    /// The mask the thread had before.
    pub fn previous_mask(&self) -> &libc::sigset_t {
        &self.old
    }
}

impl Default for AsyncSignalsBlocked {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for AsyncSignalsBlocked {
    fn drop(&mut self) {
        // SAFETY: the calling thread's errno, kept across the mask's restoration.
        let errno = unsafe { *libc::__errno_location() };
        // SAFETY: restores the mask saved by `new`.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.old, std::ptr::null_mut()) };
        // SAFETY: as above.
        unsafe { *libc::__errno_location() = errno };
    }
}

/// Starts one of the stack's own threads (progress, readiness, completion threads) with
/// every asynchronous signal blocked in it, so that the program's signals reach the program's
/// threads as they would without the stack (a signal sent to the process goes to a thread
/// that does not block it: a waiting call the stack makes with the program's signals blocked
/// must still be the one that reports it). Faults (SIGSEGV, SIGBUS, ...) stay deliverable.
pub fn spawn_quiet<T: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> io::Result<std::thread::JoinHandle<T>> {
    // The new thread inherits the blocked mask; ours is restored when this drops.
    let _blocked = AsyncSignalsBlocked::new();
    std::thread::Builder::new().name(name.into()).spawn(f)
}

fn empty_sigset() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; all zeroes is the empty set.
    unsafe { std::mem::zeroed() }
}

/// The system page size.
pub fn page_size() -> usize {
    // SAFETY: sysconf with a valid name has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// Sleeps while `*word == seen`, at most `timeout` (spurious wakeups are fine for callers).
pub fn futex_wait(word: &AtomicU32, seen: u32, timeout: Duration) {
    let ts = libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as _ };
    // SAFETY: FUTEX_WAIT on a valid aligned u32 with a valid timeout; async-signal-safe.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            seen,
            &ts as *const libc::timespec,
        )
    };
}

/// Wakes every sleeper on `word`.
pub fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a valid aligned u32.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG, i32::MAX) };
}

/// Sets the protection of `[addr, addr + len)` (`libc::PROT_*`); false if the kernel refused
/// (a hole in the range, say). Async-signal-safe.
///
/// # Safety
/// The range must be whole pages of memory whose protection the caller may change: nothing
/// else of the process may rely on the pages' protection meanwhile.
pub unsafe fn mprotect(addr: usize, len: usize, prot: i32) -> bool {
    // SAFETY: forwarded from the caller; mprotect checks the range itself.
    unsafe { libc::mprotect(addr as *mut libc::c_void, len, prot) == 0 }
}

/// A fresh, process-unique and reboot-unique 64-bit id.
pub fn unique_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{fence, AtomicU32, Ordering};
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u32(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    fence(Ordering::SeqCst);
    h.finish() | 1
}

/// Creates an anonymous shared-memory file of `len` bytes. It never appears in `/dev/shm`, so a
/// killed process leaves nothing behind; peers reach it through `pidfd_getfd`.
pub fn memfd(name: &str, len: usize) -> Result<File> {
    let cname = std::ffi::CString::new(name).map_err(|_| VerbsError::invalid("segment name has a NUL"))?;
    // SAFETY: `cname` is a valid NUL-terminated string; the flags are valid for memfd_create.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(VerbsError::last_os("memfd_create"));
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(len as u64).map_err(|e| VerbsError::os("sizing a shared segment", e))?;
    Ok(file)
}

/// The descriptor name of a fetched descriptor, for checking that it is the memfd we expect.
pub fn fd_target(fd: RawFd) -> io::Result<String> {
    Ok(std::fs::read_link(format!("/proc/self/fd/{fd}"))?.to_string_lossy().into_owned())
}

/// A nonblocking, close-on-exec eventfd.
pub fn eventfd() -> Result<OwnedFd> {
    // SAFETY: plain syscall with valid flags.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(VerbsError::last_os("eventfd"));
    }
    // SAFETY: fresh descriptor owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Adds one to an eventfd counter (wakes its pollers). Errors are ignored: the counter saturating
/// (EAGAIN) still leaves it readable, which is all a wake-up needs.
pub fn eventfd_signal(fd: RawFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a valid u64 to a descriptor we hold.
    unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

/// Resets an eventfd counter to zero; returns whether it was nonzero.
pub fn eventfd_drain(fd: RawFd) -> bool {
    let mut v: u64 = 0;
    // SAFETY: reads 8 bytes into a valid u64 from a nonblocking descriptor we hold.
    let n = unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
    n == 8 && v != 0
}

/// An epoll instance.
pub fn epoll_create() -> Result<OwnedFd> {
    // SAFETY: plain syscall.
    let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if fd < 0 {
        return Err(VerbsError::last_os("epoll_create1"));
    }
    // SAFETY: fresh descriptor owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Adds `fd` to `epfd` for readability; an fd already present is not an error.
pub fn epoll_add(epfd: RawFd, fd: RawFd) -> Result<()> {
    let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: fd as u64 };
    // SAFETY: `ev` is a valid epoll_event; both descriptors are ours.
    let r = unsafe { libc::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, fd, &mut ev) };
    if r < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EEXIST) {
        return Err(VerbsError::last_os("epoll_ctl(ADD)"));
    }
    Ok(())
}

/// Removes `fd` from `epfd`, ignoring absence.
pub fn epoll_del(epfd: RawFd, fd: RawFd) {
    // SAFETY: both descriptors are ours; a null event is allowed for DEL.
    unsafe { libc::epoll_ctl(epfd, libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()) };
}

/// Waits until `fd` is readable or `timeout` passes (None: for ever). Returns readability.
pub fn wait_readable(fd: RawFd, timeout: Option<Duration>) -> Result<bool> {
    let mut pfd = [libc::pollfd { fd, events: libc::POLLIN, revents: 0 }];
    wait_any_readable(&mut pfd, timeout)
}

/// Sleeps until one of `fds` is readable (their `revents` say which) or `timeout` passes
/// (rounded up to whole milliseconds); returns whether one is.
pub fn wait_any_readable(fds: &mut [libc::pollfd], timeout: Option<Duration>) -> Result<bool> {
    let ms = match timeout {
        None => -1,
        Some(t) => t.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32,
    };
    loop {
        // SAFETY: `fds` is a valid array of pollfds of that length.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if r >= 0 {
            return Ok(r > 0);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(VerbsError::os("poll", e));
        }
    }
}

/// A descriptor that refers to a process and becomes readable when it exits.
pub fn pidfd_open(pid: u32) -> Result<OwnedFd> {
    // SAFETY: plain syscall with integer arguments.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(VerbsError::last_os(format!("pidfd_open({pid})")));
    }
    // SAFETY: fresh descriptor owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Duplicates descriptor `target_fd` of the process behind `pidfd` into this process.
pub fn pidfd_getfd(pidfd: RawFd, target_fd: i32) -> Result<OwnedFd> {
    // SAFETY: plain syscall with integer arguments.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd, target_fd, 0) };
    if fd < 0 {
        return Err(VerbsError::last_os(format!("pidfd_getfd(fd {target_fd})")));
    }
    // SAFETY: fresh descriptor owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// A duplicate of one of this process's descriptors (what `pidfd_getfd` on ourselves gives,
/// without needing a pidfd).
pub fn dup_fd(fd: i32) -> Result<OwnedFd> {
    // SAFETY: plain fcntl with integer arguments; a bad descriptor is reported as EBADF.
    let new = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if new < 0 {
        return Err(VerbsError::last_os(format!("duplicating fd {fd}")));
    }
    // SAFETY: fresh descriptor owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(new) })
}

/// True while the process behind `pidfd` runs (a pidfd turns readable at exit).
pub fn pidfd_alive(pidfd: &OwnedFd) -> bool {
    !matches!(wait_readable(pidfd.as_raw_fd(), Some(Duration::ZERO)), Ok(true))
}

/// Start time of a process in clock ticks since boot (field 22 of `/proc/PID/stat`).
pub fn process_start_time(pid: u32) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map_err(|e| VerbsError::os(format!("reading /proc/{pid}/stat"), e))?;
    // The command name (field 2) may hold spaces and parentheses: parse after the last ')'.
    let after = stat.rfind(')').map(|i| &stat[i + 1..]).unwrap_or("");
    after
        .split_whitespace()
        .nth(19)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| VerbsError::Protocol(format!("unparsable /proc/{pid}/stat")))
}

/// Copies between this process and another one: cross-memory attach first (fast, one copy),
/// `/proc/PID/mem` for what it refuses (pages the owner protected, which a NIC would still reach).
pub struct RemoteMemory {
    pid: libc::pid_t,
    mem: File,
}

impl std::fmt::Debug for RemoteMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteMemory").finish_non_exhaustive()
    }
}

impl RemoteMemory {
    /// Opens access to process `pid`'s memory.
    pub fn open(pid: u32) -> Result<RemoteMemory> {
        let mem = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/{pid}/mem"))
            .map_err(|e| VerbsError::os(format!("opening /proc/{pid}/mem"), e))?;
        Ok(RemoteMemory { pid: pid as libc::pid_t, mem })
    }

    /// Writes local `src` to `remote_addr` in the peer.
    pub fn write(&self, remote_addr: u64, src: &[u8]) -> io::Result<()> {
        let mut done = 0usize;
        while done < src.len() {
            let local = libc::iovec { iov_base: src[done..].as_ptr() as *mut _, iov_len: src.len() - done };
            let remote = libc::iovec { iov_base: (remote_addr as usize + done) as *mut _, iov_len: src.len() - done };
            // SAFETY: `local` describes readable memory of `src`; the remote range is validated by
            // the kernel against the peer's address space (EFAULT if unmapped or not writable).
            let n = unsafe { libc::process_vm_writev(self.pid, &local, 1, &remote, 1, 0) };
            if n <= 0 {
                // Refused (protected page, or an error): finish through /proc/PID/mem.
                return self.mem.write_all_at(&src[done..], remote_addr + done as u64);
            }
            done += n as usize;
        }
        Ok(())
    }

    /// Reads `dst.len()` bytes at `remote_addr` in the peer into `dst`.
    pub fn read(&self, remote_addr: u64, dst: &mut [u8]) -> io::Result<()> {
        let mut done = 0usize;
        while done < dst.len() {
            let local = libc::iovec { iov_base: dst[done..].as_mut_ptr().cast(), iov_len: dst.len() - done };
            let remote = libc::iovec { iov_base: (remote_addr as usize + done) as *mut _, iov_len: dst.len() - done };
            // SAFETY: `local` describes writable memory of `dst`; the kernel validates the remote.
            let n = unsafe { libc::process_vm_readv(self.pid, &local, 1, &remote, 1, 0) };
            if n <= 0 {
                return self.mem.read_exact_at(&mut dst[done..], remote_addr + done as u64);
            }
            done += n as usize;
        }
        Ok(())
    }
}

const MEMBARRIER_CMD_QUERY: libc::c_long = 0;
const MEMBARRIER_CMD_GLOBAL_EXPEDITED: libc::c_long = 1 << 1;
const MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED: libc::c_long = 1 << 2;

static ASYMMETRIC: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// Registers this process for expedited global memory barriers (once). Returns whether the
/// asymmetric scheme is usable: then the hot path pays only a compiler fence and the rare
/// sleeper pays a `membarrier` syscall that runs a full barrier on every registered CPU.
pub fn asymmetric_barriers() -> bool {
    *ASYMMETRIC.get_or_init(|| {
        match crate::env::flag("PV_SOFT_NO_MEMBARRIER", false) {
            Ok(false) => {}
            Ok(true) => return false,
            Err(e) => {
                log::warn!("{e}; using the membarrier scheme");
            }
        }
        // SAFETY: plain syscalls with integer arguments.
        let supported = unsafe { libc::syscall(libc::SYS_membarrier, MEMBARRIER_CMD_QUERY, 0, 0) };
        supported > 0
            && supported & MEMBARRIER_CMD_GLOBAL_EXPEDITED != 0
            // SAFETY: as above.
            && unsafe { libc::syscall(libc::SYS_membarrier, MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED, 0, 0) } == 0
    })
}

/// The hot-path half of the wake-up handshake: orders a producer's publish before its check of
/// the sleeper's doorbell.
#[inline]
pub fn producer_barrier() {
    if asymmetric_barriers() {
        std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
    } else {
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }
}

/// The sleeper's half: after arming a doorbell and before checking for work, makes every
/// producer's earlier publishes visible (or its later doorbell checks see the arm).
pub fn sleeper_barrier() {
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    if asymmetric_barriers() {
        // SAFETY: plain syscall with integer arguments.
        let r = unsafe { libc::syscall(libc::SYS_membarrier, MEMBARRIER_CMD_GLOBAL_EXPEDITED, 0, 0) };
        if r != 0 {
            log::error!("membarrier failed: {}", io::Error::last_os_error());
        }
    }
}

/// Writes `src` into this process's own memory at `addr` through `/proc/self/mem`, which reaches
/// pages protected against the process itself (the in-process stand-in for a NIC's DMA).
pub fn write_self_mem(addr: u64, src: &[u8]) -> io::Result<()> {
    thread_local! {
        static SELF_MEM: Option<File> = std::fs::OpenOptions::new().read(true).write(true).open("/proc/self/mem").ok();
    }
    SELF_MEM.with(|f| match f {
        Some(f) => f.write_all_at(src, addr),
        None => Err(io::Error::other("cannot open /proc/self/mem")),
    })
}

/// Reads from this process's own memory by cross-memory attach: one kernel copy that fails with
/// `EFAULT` (instead of faulting) where `addr` is unmapped or unreadable.
pub fn read_self_vm(addr: u64, dst: &mut [u8]) -> io::Result<()> {
    let mut done = 0usize;
    while done < dst.len() {
        let local = libc::iovec { iov_base: dst[done..].as_mut_ptr().cast(), iov_len: dst.len() - done };
        let remote = libc::iovec { iov_base: (addr as usize + done) as *mut _, iov_len: dst.len() - done };
        // SAFETY: `local` describes writable memory of `dst`; the kernel validates the remote range.
        let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
        if n <= 0 {
            return Err(if n == 0 { io::ErrorKind::UnexpectedEof.into() } else { io::Error::last_os_error() });
        }
        done += n as usize;
    }
    Ok(())
}

/// Reads from this process's own memory through `/proc/self/mem` (reaches read-protected pages).
pub fn read_self_mem(addr: u64, dst: &mut [u8]) -> io::Result<()> {
    thread_local! {
        static SELF_MEM: Option<File> = std::fs::OpenOptions::new().read(true).open("/proc/self/mem").ok();
    }
    SELF_MEM.with(|f| match f {
        Some(f) => f.read_exact_at(dst, addr),
        None => Err(io::Error::other("cannot open /proc/self/mem")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_start_time_parses() {
        let t = process_start_time(std::process::id()).unwrap();
        assert!(t > 0);
    }

    #[test]
    fn eventfd_signals_and_drains() {
        let fd = eventfd().unwrap();
        assert!(!eventfd_drain(fd.as_raw_fd()));
        eventfd_signal(fd.as_raw_fd());
        assert!(wait_readable(fd.as_raw_fd(), Some(Duration::ZERO)).unwrap());
        assert!(eventfd_drain(fd.as_raw_fd()));
        assert!(!wait_readable(fd.as_raw_fd(), Some(Duration::ZERO)).unwrap());
    }

    #[test]
    fn self_mem_reaches_a_protected_page() {
        let page = 4096;
        // SAFETY: anonymous private mapping of one page, unmapped at the end of the test.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), page, libc::PROT_READ, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        assert_ne!(p, libc::MAP_FAILED);
        write_self_mem(p as u64, b"dma").unwrap();
        // SAFETY: the page is readable and 3 bytes were written.
        let got = unsafe { std::slice::from_raw_parts(p as *const u8, 3) };
        assert_eq!(got, b"dma");
        // SAFETY: unmapping the page mapped above.
        unsafe { libc::munmap(p, page) };
    }
}
