//! `libsdp_preload.so`: unmodified programs' TCP sockets over SDP.
//!
//! ```sh
//! LD_PRELOAD=target/release/libsdp_preload.so python3 -m http.server 8000
//! LD_PRELOAD=target/release/libsdp_preload.so curl -o out http://127.0.0.1:8000/file
//! ```
//!
//! A stream socket the program makes is the kernel's until it connects or listens:
//! - `connect`: the client first asks the server's port in the UDP port space whether it takes
//!   SDP ([`sockets_compat::discovery`]; no byte reaches a plain server's TCP port). If it
//!   does, the connection is made over SDP and the descriptor's number becomes the connection's
//!   readiness eventfd (`poll`, `select` and `epoll` work on it unchanged); else the kernel
//!   connects it as ever.
//! - `listen`: the kernel listens as ever (plain clients connect to it); beside it an SDP
//!   listener and a UDP socket answering probes. An SDP client is announced by a *doorbell*
//!   connection to the program's listening socket; `accept` swaps it for the SDP connection.
//!
//! Calls on accelerated descriptors (`read`, `recv`, `send`, `writev`, `sendfile`, `shutdown`,
//! `getsockopt`, `fcntl`, `ioctl`, `dup`, `close`, ...) go to the SDP socket; everything else
//! goes to the C library after one atomic load. Settings: [`config`]. A blocking receive polls
//! briefly, then waits on the descriptor, where a signal interrupts it (`EINTR`). Limits: a
//! connection is not shared with a child after `fork` (the child must not use it); a blocking
//! send is not interrupted by a signal; a socket registered with `epoll` before `connect` must
//! be registered again after it.

#![allow(clippy::missing_safety_doc)] // C entry points: their contracts are the C library's.

mod config;
mod guard;
mod probe;
mod real;
mod serve;
mod stats;
mod table;

use std::ffi::{c_int, c_long, c_ulong, c_void};
use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use libc::{iovec, msghdr, off_t, size_t, sockaddr, socklen_t, ssize_t};
use sockets_compat::SdpStream;

use config::config;
use guard::{inside, Inside};
use real::real;
use table::{Candidate, Connected, Entry};

/// How long an SDP connection's set-up may take before the client falls back to TCP.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

fn set_errno(e: c_int) {
    // SAFETY: the calling thread's errno.
    unsafe { *libc::__errno_location() = e };
}

/// The errno a failed socket call reports, as Linux names it.
fn errno_of(e: &io::Error) -> c_int {
    if let Some(code) = e.raw_os_error() {
        return code;
    }
    use io::ErrorKind::*;
    match e.kind() {
        WouldBlock => libc::EAGAIN,
        BrokenPipe => libc::EPIPE,
        ConnectionReset => libc::ECONNRESET,
        ConnectionAborted => libc::ECONNABORTED,
        ConnectionRefused => libc::ECONNREFUSED,
        TimedOut => libc::ETIMEDOUT,
        NotConnected => libc::ENOTCONN,
        InvalidInput => libc::EINVAL,
        InvalidData => libc::EPROTO,
        Interrupted => libc::EINTR,
        AddrInUse => libc::EADDRINUSE,
        _ => libc::EIO,
    }
}

fn fail<T: From<i8>>(e: &io::Error) -> T {
    set_errno(errno_of(e));
    T::from(-1)
}

/// A socket address from C.
unsafe fn addr_from(addr: *const sockaddr, len: socklen_t) -> Option<SocketAddr> {
    if addr.is_null() {
        return None;
    }
    // SAFETY: the caller's address of `len` bytes, read by its family.
    unsafe {
        match (*addr).sa_family as c_int {
            libc::AF_INET if len as usize >= std::mem::size_of::<libc::sockaddr_in>() => {
                let a = &*(addr as *const libc::sockaddr_in);
                let ip = std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
                Some(SocketAddr::new(ip.into(), u16::from_be(a.sin_port)))
            }
            libc::AF_INET6 if len as usize >= std::mem::size_of::<libc::sockaddr_in6>() => {
                let a = &*(addr as *const libc::sockaddr_in6);
                let ip = std::net::Ipv6Addr::from(a.sin6_addr.s6_addr);
                Some(SocketAddr::new(ip.into(), u16::from_be(a.sin6_port)))
            }
            _ => None,
        }
    }
}

/// Writes `a` for C as `getsockname` does: truncated to `*len`, `*len` set to its full size.
/// An IPv4 address on an IPv6 socket is written mapped.
unsafe fn addr_to(a: SocketAddr, domain: c_int, out: *mut sockaddr, len: *mut socklen_t) {
    if out.is_null() || len.is_null() {
        return;
    }
    // SAFETY: zeroed sockaddr storage is valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let size = match (a, domain) {
        (SocketAddr::V4(v4), libc::AF_INET) => {
            // SAFETY: sockaddr_storage holds a sockaddr_in.
            let s = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in) };
            s.sin_family = libc::AF_INET as _;
            s.sin_port = v4.port().to_be();
            s.sin_addr.s_addr = u32::from(*v4.ip()).to_be();
            std::mem::size_of::<libc::sockaddr_in>()
        }
        _ => {
            let v6 = match a {
                SocketAddr::V4(v4) => std::net::SocketAddrV6::new(v4.ip().to_ipv6_mapped(), v4.port(), 0, 0),
                SocketAddr::V6(v6) => v6,
            };
            // SAFETY: sockaddr_storage holds a sockaddr_in6.
            let s = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in6) };
            s.sin6_family = libc::AF_INET6 as _;
            s.sin6_port = v6.port().to_be();
            s.sin6_addr.s6_addr = v6.ip().octets();
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    // SAFETY: the caller's buffer of `*len` bytes.
    unsafe {
        let n = (*len as usize).min(size);
        std::ptr::copy_nonoverlapping(&ss as *const _ as *const u8, out as *mut u8, n);
        *len = size as socklen_t;
    }
}

/// The kernel's name for a socket of ours.
unsafe fn kernel_name(fd: c_int) -> Option<SocketAddr> {
    // SAFETY: zeroed storage; the kernel fills at most its size.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as socklen_t;
    // SAFETY: as above.
    if unsafe { (real().getsockname)(fd, &mut ss as *mut _ as *mut sockaddr, &mut len) } != 0 {
        return None;
    }
    // SAFETY: filled by the kernel.
    unsafe { addr_from(&ss as *const _ as *const sockaddr, len) }
}

/// Whether this thread is one of the stack's own (its sockets are never candidates).
fn stack_thread() -> bool {
    let mut name = [0u8; 16];
    // SAFETY: a 16-byte buffer for the calling thread's name.
    if unsafe { libc::pthread_getname_np(libc::pthread_self(), name.as_mut_ptr() as *mut _, 16) } != 0 {
        return false;
    }
    name.starts_with(b"sdp-") || name.starts_with(b"pv-")
}

// ---- Making sockets, connecting, listening, accepting ----

#[no_mangle]
pub unsafe extern "C" fn socket(domain: c_int, ty: c_int, proto: c_int) -> c_int {
    // SAFETY: the caller's arguments, passed on.
    let fd = unsafe { (real().socket)(domain, ty, proto) };
    let tcp = (domain == libc::AF_INET || domain == libc::AF_INET6)
        && ty & 0xf == libc::SOCK_STREAM
        && (proto == 0 || proto == libc::IPPROTO_TCP);
    if fd >= 0 && tcp && !inside() {
        let _in = Inside::enter();
        let c = config();
        if (c.client || c.server) && !stack_thread() {
            table::insert(fd, Entry::Candidate(Candidate { domain }));
        }
    }
    fd
}

#[no_mangle]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    if !inside() {
        if let Some(Entry::Candidate(cand)) = table::get(fd) {
            let _in = Inside::enter();
            table::remove(fd);
            // SAFETY: the caller's address.
            let target = unsafe { addr_from(addr, len) };
            let c = config();
            if let Some(t) = target.filter(|t| c.client && c.port(t.port()) && !t.ip().is_unspecified()) {
                if let Some(port) = probe::sdp_port(t, c.probe) {
                    // SAFETY: `fd` is the caller's socket.
                    match unsafe { connect_sdp(fd, cand, t, port) } {
                        Ok(()) => {
                            stats::count(&stats::SDP_CONNECTS);
                            return 0;
                        }
                        Err(e) => {
                            probe::forget(t);
                            log::info!("sdp_preload: SDP to {t} failed ({e}): plain TCP");
                        }
                    }
                }
            }
            stats::count(&stats::TCP_CONNECTS);
        }
    }
    // SAFETY: the caller's arguments, passed on.
    unsafe { (real().connect)(fd, addr, len) }
}

/// Connects `fd` to `target` over SDP (its listener at `port`) and puts the connection's
/// readiness descriptor at `fd`'s number.
unsafe fn connect_sdp(fd: c_int, cand: Candidate, target: SocketAddr, port: u16) -> io::Result<()> {
    let r = real();
    // SAFETY: plain fcntl queries of the caller's descriptor.
    let (fl, fdfl) = unsafe { ((r.fcntl)(fd, libc::F_GETFL, 0), (r.fcntl)(fd, libc::F_GETFD, 0)) };
    let nonblocking = fl >= 0 && fl & libc::O_NONBLOCK != 0;
    let stream = SdpStream::connect_timeout(&SocketAddr::new(target.ip(), port), CONNECT_TIMEOUT)?;
    stream.set_nonblocking(nonblocking)?;
    let local = stream.local_addr()?;
    // SAFETY: `fd` is the caller's socket, replaced by our descriptor (the kernel socket,
    // never connected, goes).
    adopt(fd, stream, cand.domain, local, target, nonblocking, fdfl >= 0 && fdfl & libc::FD_CLOEXEC != 0)
}

/// Puts `stream`'s readiness descriptor at `fd`'s number and makes `fd` that connection.
unsafe fn adopt(
    fd: c_int,
    stream: SdpStream,
    domain: c_int,
    local: SocketAddr,
    peer: SocketAddr,
    nonblocking: bool,
    cloexec: bool,
) -> io::Result<()> {
    let efd = stream.as_raw_fd();
    // SAFETY: duplicates our eventfd over the caller's descriptor number.
    if unsafe { (real().dup3)(efd, fd, if cloexec { libc::O_CLOEXEC } else { 0 }) } < 0 {
        return Err(io::Error::last_os_error());
    }
    let c = Connected { stream, domain, local, peer, nonblocking: nonblocking.into() };
    table::insert(fd, Entry::Connected(Arc::new(c)));
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    // SAFETY: the caller's arguments, passed on.
    let r = unsafe { (real().listen)(fd, backlog) };
    if r == 0 && !inside() {
        if let Some(Entry::Candidate(_)) = table::get(fd) {
            let _in = Inside::enter();
            table::remove(fd);
            // SAFETY: the caller's (now listening) socket.
            let local = unsafe { kernel_name(fd) };
            let c = config();
            if let Some(local) = local.filter(|l| c.server && c.port(l.port())) {
                match serve::Listening::start(local) {
                    Ok(l) => {
                        table::insert(fd, Entry::Listening(l));
                    }
                    Err(e) => log::info!("sdp_preload: {local} stays plain TCP ({e})"),
                }
            }
        }
    }
    r
}

unsafe fn accept_any(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int, four: bool) -> c_int {
    let r = real();
    let listening = if inside() { None } else { table::get(fd) };
    let Some(Entry::Listening(l)) = listening else {
        // SAFETY: the caller's arguments, passed on.
        return unsafe {
            if four {
                (r.accept4)(fd, addr, len, flags)
            } else {
                (r.accept)(fd, addr, len)
            }
        };
    };
    // SAFETY: zeroed storage for the kernel to fill.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut sl = std::mem::size_of::<libc::sockaddr_storage>() as socklen_t;
    let sp = &mut ss as *mut _ as *mut sockaddr;
    // SAFETY: our storage; the caller's descriptor and flags.
    let cfd = unsafe {
        if four {
            (r.accept4)(fd, sp, &mut sl, flags)
        } else {
            (r.accept)(fd, sp, &mut sl)
        }
    };
    if cfd < 0 {
        return cfd;
    }
    let _in = Inside::enter();
    // SAFETY: filled by the kernel.
    let peer = unsafe { addr_from(sp, sl) };
    if let Some((stream, from)) = peer.and_then(|p| l.take(p)) {
        let domain = if l.local.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
        let nonblocking = flags & libc::SOCK_NONBLOCK != 0;
        let adopted = stream.set_nonblocking(nonblocking).and_then(|()| {
            // SAFETY: `cfd` is the doorbell's accepted end, ours to replace.
            unsafe { adopt(cfd, stream, domain, l.local, from, nonblocking, flags & libc::SOCK_CLOEXEC != 0) }
        });
        return match adopted {
            Ok(()) => {
                stats::count(&stats::SDP_ACCEPTS);
                // SAFETY: the caller's buffer.
                unsafe { addr_to(from, domain, addr, len) };
                cfd
            }
            Err(e) => {
                // SAFETY: our descriptor.
                unsafe { (r.close)(cfd) };
                log::info!("sdp_preload: cannot hand over an SDP connection: {e}");
                set_errno(libc::ECONNABORTED);
                -1
            }
        };
    }
    stats::count(&stats::TCP_ACCEPTS);
    if !addr.is_null() && !len.is_null() {
        // SAFETY: the caller's buffer of `*len` bytes.
        unsafe {
            let n = (*len as usize).min(sl as usize);
            std::ptr::copy_nonoverlapping(sp as *const u8, addr as *mut u8, n);
            *len = sl;
        }
    }
    cfd
}

#[no_mangle]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // SAFETY: forwarded contract.
    unsafe { accept_any(fd, addr, len, 0, false) }
}

#[no_mangle]
pub unsafe extern "C" fn accept4(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int {
    // SAFETY: forwarded contract.
    unsafe { accept_any(fd, addr, len, flags, true) }
}

// ---- Descriptors ----

/// The accelerated connection at `fd`, if it is one (and the call is the program's).
#[inline]
fn connected(fd: c_int) -> Option<Arc<Connected>> {
    if inside() || !table::maybe_ours(fd) {
        return None;
    }
    match table::get(fd) {
        Some(Entry::Connected(c)) => Some(c),
        _ => None,
    }
}

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    let gone = table::remove(fd);
    // SAFETY: the caller's descriptor.
    let r = unsafe { (real().close)(fd) };
    if gone.is_some() {
        // The last descriptor of a connection closes it (the peer reads every byte, then EOF).
        let _in = Inside::enter();
        drop(gone);
    }
    r
}

/// `new` now names what `old` names: ours too if `old` is.
fn alias(old: c_int, new: c_int) {
    if new >= 0 {
        if let Some(e) = table::get(old) {
            let before = table::insert(new, e);
            let _in = Inside::enter();
            drop(before);
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    // SAFETY: the caller's descriptor.
    let new = unsafe { (real().dup)(fd) };
    if !inside() {
        alias(fd, new);
    }
    new
}

#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    // SAFETY: the caller's descriptors.
    let r = unsafe { (real().dup2)(old, new) };
    if r >= 0 && old != new && !inside() {
        let before = table::remove(new);
        alias(old, new);
        let _in = Inside::enter();
        drop(before);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    // SAFETY: the caller's descriptors.
    let r = unsafe { (real().dup3)(old, new, flags) };
    if r >= 0 && !inside() {
        let before = table::remove(new);
        alias(old, new);
        let _in = Inside::enter();
        drop(before);
    }
    r
}

unsafe fn fcntl_any(fd: c_int, cmd: c_int, arg: c_long, sixty_four: bool) -> c_int {
    let r = real();
    let call = |cmd, arg| {
        // SAFETY: the caller's arguments, passed on.
        unsafe {
            if sixty_four {
                (r.fcntl64)(fd, cmd, arg)
            } else {
                (r.fcntl)(fd, cmd, arg)
            }
        }
    };
    if inside() || !table::maybe_ours(fd) {
        return call(cmd, arg);
    }
    match cmd {
        libc::F_DUPFD | libc::F_DUPFD_CLOEXEC => {
            let new = call(cmd, arg);
            alias(fd, new);
            new
        }
        libc::F_GETFL | libc::F_SETFL => match connected(fd) {
            // The eventfd's own flags never change (the library reads it without blocking).
            Some(c) if cmd == libc::F_GETFL => {
                libc::O_RDWR | if c.nonblocking.load(Ordering::Relaxed) { libc::O_NONBLOCK } else { 0 }
            }
            Some(c) => {
                let on = arg as c_int & libc::O_NONBLOCK != 0;
                let _in = Inside::enter();
                c.nonblocking.store(on, Ordering::Relaxed);
                match c.stream.set_nonblocking(on) {
                    Ok(()) => 0,
                    Err(e) => fail(&e),
                }
            }
            None => call(cmd, arg),
        },
        _ => call(cmd, arg),
    }
}

#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: c_long) -> c_int {
    // SAFETY: forwarded contract.
    unsafe { fcntl_any(fd, cmd, arg, false) }
}

#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: c_long) -> c_int {
    // SAFETY: forwarded contract.
    unsafe { fcntl_any(fd, cmd, arg, true) }
}

#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, req: c_ulong, arg: *mut c_void) -> c_int {
    let Some(c) = connected(fd) else {
        // SAFETY: the caller's arguments, passed on.
        return unsafe { (real().ioctl)(fd, req, arg) };
    };
    let _in = Inside::enter();
    match req {
        libc::FIONBIO if !arg.is_null() => {
            // SAFETY: FIONBIO's argument is an int.
            let on = unsafe { *(arg as *const c_int) } != 0;
            c.nonblocking.store(on, Ordering::Relaxed);
            match c.stream.set_nonblocking(on) {
                Ok(()) => 0,
                Err(e) => fail(&e),
            }
        }
        libc::FIONREAD if !arg.is_null() => {
            // What a read would return now: a nonblocking peek.
            let mut buf = vec![0u8; 256 * 1024];
            let n = c.stream.try_peek(&mut buf).unwrap_or(0);
            // SAFETY: FIONREAD's argument is an int.
            unsafe { *(arg as *mut c_int) = n as c_int };
            0
        }
        _ => {
            set_errno(libc::ENOTTY);
            -1
        }
    }
}

// ---- Reading and writing ----

/// How long a blocking receive polls before it waits on the descriptor (where a signal
/// interrupts it): a wake-up costs tens of microseconds, a poll a fraction of one.
const RECEIVE_SPIN: Duration = Duration::from_micros(50);

/// One receive attempt that never waits.
fn receive_once(c: &Connected, buf: &mut [u8], peek: bool) -> io::Result<usize> {
    if peek {
        c.stream.try_peek(buf)
    } else {
        c.stream.try_read(buf)
    }
}

/// A blocking receive as the kernel's: polls a while, then waits on the descriptor `fd` (the
/// socket's readiness eventfd), where a signal ends the wait with `EINTR` (the program's
/// handler has run; `SA_RESTART` does not restart socket waits with a timeout, and a program
/// that wants the retry loops). `SO_RCVTIMEO` ends it with `EAGAIN`.
fn receive_blocking(c: &Connected, fd: c_int, buf: &mut [u8], peek: bool) -> io::Result<usize> {
    let start = std::time::Instant::now();
    let limit = c.stream.read_timeout()?;
    let mut polls = 0u32;
    loop {
        match receive_once(c, buf, peek) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            other => return other,
        }
        polls = polls.wrapping_add(1);
        if !polls.is_multiple_of(64) || start.elapsed() < RECEIVE_SPIN {
            if polls.is_multiple_of(256) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            continue;
        }
        let wait_ms = match limit {
            None => -1,
            Some(t) => match t.checked_sub(start.elapsed()) {
                Some(left) => left.as_millis().clamp(1, i32::MAX as u128) as c_int,
                None => return Err(io::ErrorKind::WouldBlock.into()),
            },
        };
        c.stream.about_to_wait();
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd; `poll` is not intercepted.
        if unsafe { libc::poll(&mut p, 1, wait_ms) } < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) && (limit.is_some() || !handlers_restart()) {
                return Err(e);
            }
        }
    }
}

/// Whether every signal handler the program installed asks for `SA_RESTART` (then the kernel
/// would have restarted a receive without a timeout that a signal interrupted; the signal that
/// did cannot be known here, so one handler without it makes the receive return `EINTR`, which
/// is what Python's handlers, for one, expect).
fn handlers_restart() -> bool {
    (1..=libc::SIGRTMAX()).filter(|&s| s != libc::SIGKILL && s != libc::SIGSTOP).all(|sig| {
        // SAFETY: reads the disposition of `sig` into a zeroed struct.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        if unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) } != 0 {
            return true;
        }
        old.sa_sigaction == libc::SIG_DFL || old.sa_sigaction == libc::SIG_IGN || old.sa_flags & libc::SA_RESTART != 0
    })
}

fn receive(c: &Connected, fd: c_int, buf: &mut [u8], flags: c_int) -> ssize_t {
    let _in = Inside::enter();
    let peek = flags & libc::MSG_PEEK != 0;
    let dontwait = flags & libc::MSG_DONTWAIT != 0 || c.nonblocking.load(Ordering::Relaxed);
    let got = if dontwait { receive_once(c, buf, peek) } else { receive_blocking(c, fd, buf, peek) };
    let got = got.map(|mut n| {
        // MSG_WAITALL: the rest too, unless the stream ends, fails or a signal comes (the
        // bytes so far are returned; the error, if any, comes next time).
        if flags & libc::MSG_WAITALL != 0 && !peek && !dontwait {
            while n > 0 && n < buf.len() {
                match receive_blocking(c, fd, &mut buf[n..], false) {
                    Ok(0) | Err(_) => break,
                    Ok(k) => n += k,
                }
            }
        }
        n
    });
    match got {
        Ok(n) => n as ssize_t,
        Err(e) => fail(&e),
    }
}

/// Sends `buf`: all of it on a blocking socket (as the kernel does), what fits otherwise.
/// `EPIPE` raises `SIGPIPE` unless `MSG_NOSIGNAL`.
fn transmit(c: &Connected, buf: &[u8], flags: c_int) -> ssize_t {
    let _in = Inside::enter();
    let dontwait = flags & libc::MSG_DONTWAIT != 0;
    let blocking = !dontwait && !c.nonblocking.load(Ordering::Relaxed);
    let sent = if dontwait {
        c.stream.try_write(buf)
    } else {
        (&c.stream).write(buf).map(|mut n| {
            while blocking && n < buf.len() {
                match (&c.stream).write(&buf[n..]) {
                    Ok(k) => n += k,
                    Err(_) => break, // the bytes sent so far; the error comes next time
                }
            }
            n
        })
    };
    match sent {
        Ok(n) => n as ssize_t,
        Err(e) => {
            if e.kind() == io::ErrorKind::BrokenPipe && flags & libc::MSG_NOSIGNAL == 0 {
                // SAFETY: signals this thread, as the kernel does on EPIPE.
                unsafe { libc::pthread_kill(libc::pthread_self(), libc::SIGPIPE) };
            }
            fail(&e)
        }
    }
}

/// The caller's buffer as a slice (empty for a null pointer).
unsafe fn slice_mut<'a>(buf: *mut c_void, n: size_t) -> &'a mut [u8] {
    if buf.is_null() || n == 0 {
        return &mut [];
    }
    // SAFETY: the caller's buffer of `n` bytes.
    unsafe { std::slice::from_raw_parts_mut(buf as *mut u8, n) }
}

unsafe fn slice<'a>(buf: *const c_void, n: size_t) -> &'a [u8] {
    if buf.is_null() || n == 0 {
        return &[];
    }
    // SAFETY: the caller's buffer of `n` bytes.
    unsafe { std::slice::from_raw_parts(buf as *const u8, n) }
}

#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    match connected(fd) {
        // SAFETY: the caller's buffer.
        Some(c) => receive(&c, fd, unsafe { slice_mut(buf, n) }, 0),
        // SAFETY: the caller's arguments, passed on.
        None => unsafe { (real().read)(fd, buf, n) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    match connected(fd) {
        // SAFETY: the caller's buffer.
        Some(c) => receive(&c, fd, unsafe { slice_mut(buf, n) }, flags),
        // SAFETY: the caller's arguments, passed on.
        None => unsafe { (real().recv)(fd, buf, n, flags) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> ssize_t {
    match connected(fd) {
        Some(c) => {
            // A connected stream socket reports no source address.
            if !len.is_null() {
                // SAFETY: the caller's length.
                unsafe { *len = 0 };
            }
            // SAFETY: the caller's buffer.
            receive(&c, fd, unsafe { slice_mut(buf, n) }, flags)
        }
        // SAFETY: the caller's arguments, passed on.
        None => unsafe { (real().recvfrom)(fd, buf, n, flags, addr, len) },
    }
}

/// Reads into the first non-empty buffer of `iov` (a short read, as readv may return).
unsafe fn receive_vec(c: &Connected, fd: c_int, iov: *const iovec, cnt: c_int, flags: c_int) -> ssize_t {
    if iov.is_null() || cnt <= 0 {
        return 0;
    }
    // SAFETY: the caller's array of `cnt` iovecs.
    let iovs = unsafe { std::slice::from_raw_parts(iov, cnt as usize) };
    match iovs.iter().find(|v| v.iov_len > 0) {
        // SAFETY: the caller's buffer.
        Some(v) => receive(c, fd, unsafe { slice_mut(v.iov_base, v.iov_len) }, flags),
        None => 0,
    }
}

/// Writes the buffers of `iov` in turn, stopping at a short write.
unsafe fn transmit_vec(c: &Connected, iov: *const iovec, cnt: c_int, flags: c_int) -> ssize_t {
    if iov.is_null() || cnt <= 0 {
        return 0;
    }
    // SAFETY: the caller's array of `cnt` iovecs.
    let iovs = unsafe { std::slice::from_raw_parts(iov, cnt as usize) };
    let mut total: ssize_t = 0;
    for v in iovs.iter().filter(|v| v.iov_len > 0) {
        // SAFETY: the caller's buffer.
        let n = transmit(c, unsafe { slice(v.iov_base, v.iov_len) }, flags);
        if n < 0 {
            return if total > 0 { total } else { n };
        }
        total += n;
        if (n as usize) < v.iov_len {
            break;
        }
    }
    total
}

#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    match connected(fd) {
        // SAFETY: forwarded contract.
        Some(c) => unsafe { receive_vec(&c, fd, iov, cnt, 0) },
        // SAFETY: the caller's arguments, passed on.
        None => unsafe { (real().readv)(fd, iov, cnt) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    match connected(fd) {
        Some(c) if !msg.is_null() => {
            // SAFETY: the caller's message header.
            unsafe {
                (*msg).msg_namelen = 0;
                (*msg).msg_controllen = 0;
                (*msg).msg_flags = 0;
                receive_vec(&c, fd, (*msg).msg_iov, (*msg).msg_iovlen as c_int, flags)
            }
        }
        // SAFETY: the caller's arguments, passed on.
        _ => unsafe { (real().recvmsg)(fd, msg, flags) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    match connected(fd) {
        // SAFETY: the caller's buffer.
        Some(c) => transmit(&c, unsafe { slice(buf, n) }, 0),
        // SAFETY: the caller's arguments, passed on.
        None => unsafe { (real().write)(fd, buf, n) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    match connected(fd) {
        // SAFETY: the caller's buffer.
        Some(c) => transmit(&c, unsafe { slice(buf, n) }, flags),
        // SAFETY: the caller's arguments, passed on.
        None => unsafe { (real().send)(fd, buf, n, flags) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    n: size_t,
    flags: c_int,
    addr: *const sockaddr,
    len: socklen_t,
) -> ssize_t {
    match connected(fd) {
        // A connected stream socket ignores the address (Linux does, or says EISCONN).
        // SAFETY: the caller's buffer.
        Some(c) => transmit(&c, unsafe { slice(buf, n) }, flags),
        // SAFETY: the caller's arguments, passed on.
        None => unsafe { (real().sendto)(fd, buf, n, flags, addr, len) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    match connected(fd) {
        // SAFETY: forwarded contract.
        Some(c) => unsafe { transmit_vec(&c, iov, cnt, 0) },
        // SAFETY: the caller's arguments, passed on.
        None => unsafe { (real().writev)(fd, iov, cnt) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    match connected(fd) {
        // SAFETY: the caller's message header.
        Some(c) if !msg.is_null() => unsafe { transmit_vec(&c, (*msg).msg_iov, (*msg).msg_iovlen as c_int, flags) },
        // SAFETY: the caller's arguments, passed on.
        _ => unsafe { (real().sendmsg)(fd, msg, flags) },
    }
}

unsafe fn sendfile_any(out: c_int, input: c_int, off: *mut off_t, n: size_t, sixty_four: bool) -> ssize_t {
    let r = real();
    let Some(c) = connected(out) else {
        // SAFETY: the caller's arguments, passed on.
        return unsafe {
            if sixty_four {
                (r.sendfile64)(out, input, off, n)
            } else {
                (r.sendfile)(out, input, off, n)
            }
        };
    };
    let mut buf = vec![0u8; n.min(1 << 20)];
    // SAFETY: reads the caller's file into our buffer, at its offset if given.
    let got = unsafe {
        if off.is_null() {
            (r.read)(input, buf.as_mut_ptr() as *mut c_void, buf.len())
        } else {
            libc::pread(input, buf.as_mut_ptr() as *mut c_void, buf.len(), *off)
        }
    };
    if got <= 0 {
        return got;
    }
    let sent = transmit(&c, &buf[..got as usize], 0);
    if sent > 0 && !off.is_null() {
        // SAFETY: the caller's offset.
        unsafe { *off += sent as off_t };
    } else if sent > 0 && sent < got {
        // Read more than was sent: put the file position back.
        // SAFETY: the caller's file.
        unsafe { libc::lseek(input, (sent - got) as off_t, libc::SEEK_CUR) };
    }
    sent
}

#[no_mangle]
pub unsafe extern "C" fn sendfile(out: c_int, input: c_int, off: *mut off_t, n: size_t) -> ssize_t {
    // SAFETY: forwarded contract.
    unsafe { sendfile_any(out, input, off, n, false) }
}

#[no_mangle]
pub unsafe extern "C" fn sendfile64(out: c_int, input: c_int, off: *mut off_t, n: size_t) -> ssize_t {
    // SAFETY: forwarded contract.
    unsafe { sendfile_any(out, input, off, n, true) }
}

// ---- Socket state ----

#[no_mangle]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    let Some(c) = connected(fd) else {
        // SAFETY: the caller's arguments, passed on.
        return unsafe { (real().shutdown)(fd, how) };
    };
    let how = match how {
        libc::SHUT_RD => Shutdown::Read,
        libc::SHUT_WR => Shutdown::Write,
        libc::SHUT_RDWR => Shutdown::Both,
        _ => {
            set_errno(libc::EINVAL);
            return -1;
        }
    };
    let _in = Inside::enter();
    match c.stream.shutdown(how) {
        Ok(()) => 0,
        Err(e) => fail(&e),
    }
}

#[no_mangle]
pub unsafe extern "C" fn getsockname(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    match connected(fd) {
        Some(c) => {
            // SAFETY: the caller's buffer.
            unsafe { addr_to(c.local, c.domain, addr, len) };
            0
        }
        // SAFETY: the caller's arguments, passed on.
        None => unsafe { (real().getsockname)(fd, addr, len) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn getpeername(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    match connected(fd) {
        Some(c) => {
            // SAFETY: the caller's buffer.
            unsafe { addr_to(c.peer, c.domain, addr, len) };
            0
        }
        // SAFETY: the caller's arguments, passed on.
        None => unsafe { (real().getpeername)(fd, addr, len) },
    }
}

/// Writes an option's value for `getsockopt`: truncated to `*len`, `*len` set to its size.
unsafe fn option_out(bytes: &[u8], val: *mut c_void, len: *mut socklen_t) {
    if val.is_null() || len.is_null() {
        return;
    }
    // SAFETY: the caller's buffer of `*len` bytes.
    unsafe {
        let n = (*len as usize).min(bytes.len());
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), val as *mut u8, n);
        *len = n as socklen_t;
    }
}

fn timeval_of(t: Option<Duration>) -> [u8; std::mem::size_of::<libc::timeval>()] {
    let t = t.unwrap_or_default();
    let tv = libc::timeval { tv_sec: t.as_secs() as _, tv_usec: t.subsec_micros() as _ };
    // SAFETY: a plain C struct's bytes.
    unsafe { std::mem::transmute(tv) }
}

#[no_mangle]
pub unsafe extern "C" fn getsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    let Some(c) = connected(fd) else {
        // SAFETY: the caller's arguments, passed on.
        return unsafe { (real().getsockopt)(fd, level, name, val, len) };
    };
    let _in = Inside::enter();
    let int = |v: c_int| v.to_ne_bytes().to_vec();
    let bytes = match (level, name) {
        (libc::SOL_SOCKET, libc::SO_ERROR) => int(c.stream.take_error().ok().flatten().map_or(0, |e| errno_of(&e))),
        (libc::SOL_SOCKET, libc::SO_TYPE) => int(libc::SOCK_STREAM),
        (libc::SOL_SOCKET, libc::SO_DOMAIN) => int(c.domain),
        (libc::SOL_SOCKET, libc::SO_PROTOCOL) => int(libc::IPPROTO_TCP),
        (libc::SOL_SOCKET, libc::SO_RCVBUF | libc::SO_SNDBUF) => int(2 << 20),
        (libc::SOL_SOCKET, libc::SO_RCVTIMEO) => timeval_of(c.stream.read_timeout().ok().flatten()).to_vec(),
        (libc::SOL_SOCKET, libc::SO_SNDTIMEO) => timeval_of(c.stream.write_timeout().ok().flatten()).to_vec(),
        (libc::SOL_SOCKET, libc::SO_LINGER) => vec![0u8; std::mem::size_of::<libc::linger>()],
        (libc::IPPROTO_TCP, libc::TCP_NODELAY) => int(c.stream.nodelay().unwrap_or(true) as c_int),
        (libc::IPPROTO_TCP, libc::TCP_MAXSEG) => int(65483),
        // No segments, no retransmissions: a zeroed `struct tcp_info` of the size asked.
        // SAFETY: the caller's length.
        (libc::IPPROTO_TCP, libc::TCP_INFO) if !len.is_null() => vec![0u8; unsafe { *len } as usize],
        _ => int(0),
    };
    // SAFETY: the caller's buffer.
    unsafe { option_out(&bytes, val, len) };
    0
}

#[no_mangle]
pub unsafe extern "C" fn setsockopt(fd: c_int, level: c_int, name: c_int, val: *const c_void, len: socklen_t) -> c_int {
    let Some(c) = connected(fd) else {
        // SAFETY: the caller's arguments, passed on.
        return unsafe { (real().setsockopt)(fd, level, name, val, len) };
    };
    let _in = Inside::enter();
    let timeout = || -> Option<Option<Duration>> {
        if val.is_null() || (len as usize) < std::mem::size_of::<libc::timeval>() {
            return None;
        }
        // SAFETY: the caller's timeval.
        let tv = unsafe { *(val as *const libc::timeval) };
        let d = Duration::from_secs(tv.tv_sec.max(0) as u64) + Duration::from_micros(tv.tv_usec.max(0) as u64);
        Some((!d.is_zero()).then_some(d))
    };
    let r = match (level, name) {
        (libc::SOL_SOCKET, libc::SO_RCVTIMEO) => match timeout() {
            Some(t) => c.stream.set_read_timeout(t),
            None => Err(io::Error::from_raw_os_error(libc::EINVAL)),
        },
        (libc::SOL_SOCKET, libc::SO_SNDTIMEO) => match timeout() {
            Some(t) => c.stream.set_write_timeout(t),
            None => Err(io::Error::from_raw_os_error(libc::EINVAL)),
        },
        (libc::IPPROTO_TCP, libc::TCP_NODELAY) if !val.is_null() && len as usize >= 4 => {
            // SAFETY: the caller's int.
            c.stream.set_nodelay(unsafe { *(val as *const c_int) } != 0)
        }
        // Other options (buffer sizes, keep-alive, ...) have no SDP meaning: accepted.
        _ => Ok(()),
    };
    match r {
        Ok(()) => 0,
        Err(e) => fail(&e),
    }
}
