//! The Extended Sockets API for C: `libexs.so`, declared by `include/exs.h`. Thin entry
//! points over [`sockets_compat::exs`]: tables map the numbers C holds (sockets, queues,
//! memory handles) to the Rust objects, and every failure becomes `-1` with `errno`.

use std::collections::HashMap;
use std::ffi::{c_int, c_long, c_void};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use libc::{size_t, sockaddr, socklen_t, ssize_t, timespec};
use sockets_compat::exs::{self, Event, EventKind, EventQueue, ExsError, ExsSocket, Memory, SocketKind, Tunable};
use sockets_compat::sockaddr::{addr_from, addr_to};

/// `exs_event_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ExsEventC {
    /// `exs_evt_type_t`.
    pub kind: c_int,
    /// 0 or the error number.
    pub errno: c_int,
    /// The socket.
    pub fd: c_int,
    /// `MSG_TRUNC` for a cut message.
    pub flags: c_int,
    /// Bytes, the accepted socket, or -1.
    pub result: ssize_t,
    /// The caller's context.
    pub context: *mut c_void,
}

/// `exs_qstatus_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ExsQStatusC {
    /// Capacity.
    pub depth: c_int,
    /// Events waiting.
    pub queued: c_int,
    /// Operations in flight.
    pub pending: c_int,
    /// The readable descriptor.
    pub fd: c_int,
}

const EXS_F_GET: c_int = 0x100;

struct Tables {
    sockets: HashMap<c_int, ExsSocket>,
    queues: HashMap<c_int, EventQueue>,
    memory: HashMap<usize, Memory>,
}

fn tables() -> MutexGuard<'static, Tables> {
    static T: OnceLock<Mutex<Tables>> = OnceLock::new();
    T.get_or_init(|| Mutex::new(Tables { sockets: HashMap::new(), queues: HashMap::new(), memory: HashMap::new() }))
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

fn fail<T>(errno: c_int, ret: T) -> T {
    // SAFETY: errno is this thread's.
    unsafe { *libc::__errno_location() = errno };
    ret
}

fn status<T>(r: Result<T, ExsError>) -> c_int {
    match r {
        Ok(_) => 0,
        Err(e) => fail(e.errno(), -1),
    }
}

fn socket(fd: c_int) -> Result<ExsSocket, ExsError> {
    tables().sockets.get(&fd).cloned().ok_or(ExsError::State { what: "not an EXS socket", errno: libc::EBADF })
}

fn queue(q: c_int) -> Result<EventQueue, ExsError> {
    tables().queues.get(&q).cloned().ok_or(ExsError::Invalid("not an event queue"))
}

fn memory(m: *mut c_void) -> Result<Memory, ExsError> {
    tables().memory.get(&(m as usize)).cloned().ok_or(ExsError::Invalid("not a memory handle"))
}

/// `exs_init`.
#[no_mangle]
pub extern "C" fn exs_init(version: c_int) -> c_int {
    let _ = env_logger::try_init();
    if version != 1 {
        return fail(libc::EINVAL, -1);
    }
    status(exs::init())
}

/// `exs_socket`.
#[no_mangle]
pub extern "C" fn exs_socket(domain: c_int, ty: c_int, _protocol: c_int) -> c_int {
    if domain != libc::AF_INET && domain != libc::AF_INET6 {
        return fail(libc::EAFNOSUPPORT, -1);
    }
    let kind = match ty & !(libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK) {
        libc::SOCK_STREAM => SocketKind::Stream,
        libc::SOCK_SEQPACKET => SocketKind::SeqPacket,
        _ => return fail(libc::EPROTONOSUPPORT, -1),
    };
    match ExsSocket::new(kind) {
        Ok(s) => {
            let id = s.id();
            tables().sockets.insert(id, s);
            id
        }
        Err(e) => fail(e.errno(), -1),
    }
}

/// `exs_bind`.
///
/// # Safety
/// `addr` points to `len` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn exs_bind(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    // SAFETY: the caller's address.
    let Some(a) = (unsafe { addr_from(addr, len) }) else { return fail(libc::EINVAL, -1) };
    status(socket(fd).and_then(|s| s.bind(a)))
}

/// `exs_listen`.
#[no_mangle]
pub extern "C" fn exs_listen(fd: c_int, backlog: c_int) -> c_int {
    status(socket(fd).and_then(|s| s.listen(backlog.max(1) as usize)))
}

/// `exs_getsockname`.
///
/// # Safety
/// `addr` and `len` as for `getsockname`.
#[no_mangle]
pub unsafe extern "C" fn exs_getsockname(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    let s = match socket(fd) {
        Ok(s) => s,
        Err(e) => return fail(e.errno(), -1),
    };
    let Some(a) = s.local_addr() else { return fail(libc::EINVAL, -1) };
    let domain = if a.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    // SAFETY: the caller's buffer.
    unsafe { addr_to(a, domain, addr, len) };
    0
}

/// `exs_accept`.
#[no_mangle]
pub extern "C" fn exs_accept(fd: c_int, q: c_int, context: *mut c_void) -> c_int {
    status(socket(fd).and_then(|s| s.accept(&queue(q)?, context as u64)))
}

/// `exs_connect`.
///
/// # Safety
/// `addr` points to `len` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn exs_connect(
    fd: c_int,
    addr: *const sockaddr,
    len: socklen_t,
    q: c_int,
    context: *mut c_void,
) -> c_int {
    // SAFETY: the caller's address.
    let Some(a) = (unsafe { addr_from(addr, len) }) else { return fail(libc::EINVAL, -1) };
    status(socket(fd).and_then(|s| s.connect(a, &queue(q)?, context as u64)))
}

/// `exs_close`: the number is free for no other use until the event; calls on it fail with
/// `EBADF` from now on.
#[no_mangle]
pub extern "C" fn exs_close(fd: c_int, q: c_int, context: *mut c_void) -> c_int {
    let r = socket(fd).and_then(|s| {
        s.close(&queue(q)?, context as u64)?;
        tables().sockets.remove(&fd);
        Ok(())
    });
    status(r)
}

/// `exs_fcntl`.
#[no_mangle]
pub extern "C" fn exs_fcntl(fd: c_int, cmd: c_int, value: c_long) -> c_long {
    let t = match cmd & !EXS_F_GET {
        1 => Tunable::SmallMax,
        2 => Tunable::InlineMax,
        3 => Tunable::BusyPoll,
        4 => Tunable::CompletionCpu,
        5 => Tunable::RecvBuffer,
        6 => Tunable::AdvCredits,
        _ => return fail(libc::EINVAL, -1),
    };
    let s = match socket(fd) {
        Ok(s) => s,
        Err(e) => return fail(e.errno(), -1),
    };
    if cmd & EXS_F_GET != 0 {
        return s.get(t) as c_long;
    }
    status(s.set(t, value)) as c_long
}

/// `exs_qcreate`.
#[no_mangle]
pub extern "C" fn exs_qcreate(depth: c_int) -> c_int {
    static NEXT: AtomicI32 = AtomicI32::new(1);
    let Ok(depth) = usize::try_from(depth) else { return fail(libc::EINVAL, -1) };
    match EventQueue::new(depth) {
        Ok(q) => {
            let id = NEXT.fetch_add(1, Ordering::Relaxed);
            tables().queues.insert(id, q);
            id
        }
        Err(e) => fail(e.errno(), -1),
    }
}

/// `exs_qdelete`: refused (`EBUSY`) while events wait or operations will report to it.
#[no_mangle]
pub extern "C" fn exs_qdelete(q: c_int) -> c_int {
    let mut t = tables();
    match t.queues.get(&q) {
        None => fail(libc::EINVAL, -1),
        Some(queue) if !queue.is_idle() => fail(libc::EBUSY, -1),
        Some(_) => {
            t.queues.remove(&q);
            0
        }
    }
}

fn to_c(e: Event) -> ExsEventC {
    let kind = match e.kind {
        EventKind::Send => 1,
        EventKind::Recv => 2,
        EventKind::Accept => 3,
        EventKind::Connect => 4,
        EventKind::Close => 5,
    };
    let result = match (&e.outcome, e.accepted) {
        (Err(_), _) => -1,
        (Ok(_), Some(s)) => {
            let id = s.id();
            tables().sockets.insert(id, s);
            id as ssize_t
        }
        (Ok(n), None) => *n as ssize_t,
    };
    ExsEventC {
        kind,
        errno: e.outcome.err().unwrap_or(0),
        fd: e.socket.id(),
        flags: if e.truncated { libc::MSG_TRUNC } else { 0 },
        result,
        context: e.req as *mut c_void,
    }
}

/// `exs_qdequeue`.
///
/// # Safety
/// `events` points to `max` writable events; `timeout` is null or readable.
#[no_mangle]
pub unsafe extern "C" fn exs_qdequeue(q: c_int, events: *mut ExsEventC, max: c_int, timeout: *const timespec) -> c_int {
    let queue = match queue(q) {
        Ok(q) => q,
        Err(e) => return fail(e.errno(), -1),
    };
    if events.is_null() || max <= 0 {
        return fail(libc::EINVAL, -1);
    }
    let timeout = if timeout.is_null() {
        None
    } else {
        // SAFETY: the caller's timespec.
        let t = unsafe { *timeout };
        if t.tv_sec < 0 || !(0..1_000_000_000).contains(&t.tv_nsec) {
            return fail(libc::EINVAL, -1);
        }
        Some(Duration::new(t.tv_sec as u64, t.tv_nsec as u32))
    };
    let got = queue.dequeue(max as usize, timeout);
    let n = got.len();
    for (i, e) in got.into_iter().enumerate() {
        // SAFETY: i < n <= max slots of the caller's array.
        unsafe { events.add(i).write(to_c(e)) };
    }
    n as c_int
}

/// `exs_qmodify`: a new capacity.
#[no_mangle]
pub extern "C" fn exs_qmodify(q: c_int, depth: c_int) -> c_int {
    let Ok(depth) = usize::try_from(depth) else { return fail(libc::EINVAL, -1) };
    status(queue(q).and_then(|q| q.set_capacity(depth)))
}

/// `exs_qstatus`.
///
/// # Safety
/// `out` points to a writable `exs_qstatus_t`.
#[no_mangle]
pub unsafe extern "C" fn exs_qstatus(q: c_int, out: *mut ExsQStatusC) -> c_int {
    let queue = match queue(q) {
        Ok(q) => q,
        Err(e) => return fail(e.errno(), -1),
    };
    if out.is_null() {
        return fail(libc::EINVAL, -1);
    }
    let s = queue.status();
    let st = ExsQStatusC {
        depth: s.capacity as c_int,
        queued: s.queued as c_int,
        pending: s.pending as c_int,
        fd: queue.as_raw_fd(),
    };
    // SAFETY: the caller's struct.
    unsafe { out.write(st) };
    0
}

/// `exs_mregister`: the handle is a number of the table's, never a pointer to dereference, so
/// a stale or made-up handle is refused (`EINVAL`).
///
/// # Safety
/// `[addr, addr + len)` is the caller's memory and stays mapped until deregistered.
#[no_mangle]
pub unsafe extern "C" fn exs_mregister(addr: *mut c_void, len: size_t, _flags: c_int) -> *mut c_void {
    static NEXT: AtomicUsize = AtomicUsize::new(0x1000);
    // SAFETY: forwarded contract.
    match unsafe { Memory::register(addr.cast(), len) } {
        Ok(m) => {
            let h = NEXT.fetch_add(16, Ordering::Relaxed);
            tables().memory.insert(h, m);
            h as *mut c_void
        }
        Err(e) => fail(e.errno(), std::ptr::null_mut()),
    }
}

/// `exs_mderegister`: refused (`EBUSY`) while a send or receive uses the region.
#[no_mangle]
pub extern "C" fn exs_mderegister(m: *mut c_void) -> c_int {
    let mut t = tables();
    let Some(mem) = t.memory.remove(&(m as usize)) else { return fail(libc::EINVAL, -1) };
    match mem.deregister() {
        Ok(()) => 0,
        Err((mem, e)) => {
            t.memory.insert(m as usize, mem);
            fail(e.errno(), -1)
        }
    }
}

/// Starts a send or receive after looking up its socket, queue and memory.
fn transfer(
    fd: c_int,
    flags: c_int,
    q: c_int,
    m: *mut c_void,
    start: impl FnOnce(&ExsSocket, &EventQueue, &Memory) -> Result<(), ExsError>,
) -> ssize_t {
    if flags != 0 {
        return fail(libc::EINVAL, -1);
    }
    let r = (|| start(&socket(fd)?, &queue(q)?, &memory(m)?))();
    status(r) as ssize_t
}

/// `exs_send`.
#[no_mangle]
pub extern "C" fn exs_send(
    fd: c_int,
    buf: *const c_void,
    len: size_t,
    flags: c_int,
    q: c_int,
    context: *mut c_void,
    m: *mut c_void,
) -> ssize_t {
    transfer(fd, flags, q, m, |s, q, mem| s.send_at(q, context as u64, mem, buf as u64, len))
}

/// `exs_recv`.
#[no_mangle]
pub extern "C" fn exs_recv(
    fd: c_int,
    buf: *mut c_void,
    len: size_t,
    flags: c_int,
    q: c_int,
    context: *mut c_void,
    m: *mut c_void,
) -> ssize_t {
    transfer(fd, flags, q, m, |s, q, mem| s.recv_at(q, context as u64, mem, buf as u64, len))
}
