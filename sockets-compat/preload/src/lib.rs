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
//! briefly, then waits on the descriptor, where a signal interrupts it (`EINTR`); a blocking
//! send waiting for room is ended by a signal too (the bytes so far, or `EINTR`). `poll`,
//! `select` and `epoll_wait` on sets holding accelerated sockets poll those sockets briefly
//! before the kernel sleeps (module `waits`); `epoll_ctl` is watched so that a socket
//! registered before `connect` stays registered after it (module `epoll`). `fork` (module
//! `fork`): listening sockets take new clients over TCP from then on, and a child's inherited
//! SDP connections are dead sockets to it (the parent's go on). Limits: a child cannot use an
//! SDP connection of its parent's; a zero-copy send (`SDP_DESIGN=zsdp` or `azsdp`) is not
//! ended by a signal.

#![allow(clippy::missing_safety_doc)] // C entry points: their contracts are the C library's.

mod addr;
mod config;
mod connection;
mod epoll;
mod fork;
mod guard;
mod io_calls;
mod options;
mod probe;
mod real;
mod rules;
mod serve;
mod signals;
mod stats;
mod table;
mod waits;

use std::ffi::{c_int, c_long, c_ulong, c_void};
use std::io;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use libc::{sockaddr, socklen_t};
use sockets_compat::SdpStream;

use addr::{addr_from, addr_to, kernel_name};
use config::config;
use guard::{inside, Inside};
use real::real;
use rules::Role;
use table::{Candidate, Connected, Entry};

/// How long an SDP connection's set-up may take before the client falls back to TCP.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

pub(crate) fn set_errno(e: c_int) {
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
        if config().enabled() && !table::forked() && !stack_thread() {
            fork::watch();
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
            let accelerate = |t: &SocketAddr| c.accelerates(config::program(), Role::Connect, *t);
            if let Some(t) = target.filter(|t| !t.ip().is_unspecified() && accelerate(t)) {
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
            waits::epoll_forget_candidate(fd);
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
    let c = Arc::new(Connected { stream, domain, local, peer, nonblocking: nonblocking.into() });
    table::insert(fd, Entry::Connected(c.clone()));
    // Epoll sets that held the candidate socket now hold the connection's descriptor.
    waits::epoll_adopt(fd, &c);
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    if inside() || !matches!(table::get(fd), Some(Entry::Candidate(_))) {
        // SAFETY: the caller's arguments, passed on.
        return unsafe { (real().listen)(fd, backlog) };
    }
    let _in = Inside::enter();
    let accelerated = |local: &SocketAddr| config().accelerates(config::program(), Role::Listen, *local);
    // A socket bound to its port gets its probe port before it listens (`Listening::bind`).
    // SAFETY: the caller's socket.
    let early = unsafe { kernel_name(fd) }
        .filter(|l| l.port() != 0 && accelerated(l))
        .and_then(|l| serve::Listening::bind(l).ok());
    // SAFETY: the caller's arguments, passed on.
    let r = unsafe { (real().listen)(fd, backlog) };
    if r != 0 {
        // The caller reads listen's errno, not what closing the twin may leave there.
        let errno = io::Error::last_os_error().raw_os_error().unwrap_or(libc::EINVAL);
        drop(early);
        // SAFETY: this thread's errno.
        unsafe { *libc::__errno_location() = errno };
        return r;
    }
    if let Some(Entry::Candidate(_)) = table::get(fd) {
        table::remove(fd);
        // SAFETY: the caller's (now listening) socket.
        let local = unsafe { kernel_name(fd) };
        if let Some(local) = local.filter(accelerated) {
            let started = match early {
                Some(bound) if bound.local == local => bound.open(),
                _ => serve::Listening::start(local),
            };
            match started {
                Ok(l) => {
                    table::insert(fd, Entry::Listening(l));
                }
                Err(e) => log::info!("sdp_preload: {local} stays plain TCP ({e})"),
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
pub(crate) fn connected(fd: c_int) -> Option<Arc<Connected>> {
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
    forget_if_candidate(fd, &gone);
    // SAFETY: the caller's descriptor.
    let r = unsafe { (real().close)(fd) };
    if gone.is_some() {
        // The last descriptor of a connection closes it (the peer reads every byte, then EOF).
        let _in = Inside::enter();
        drop(gone);
    }
    r
}

/// A candidate socket at `fd` is gone: epoll sets no longer hold it.
fn forget_if_candidate(fd: c_int, gone: &Option<Entry>) {
    if let Some(Entry::Candidate(_)) = gone {
        let _in = Inside::enter();
        waits::epoll_forget_candidate(fd);
    }
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
        forget_if_candidate(new, &before);
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
        forget_if_candidate(new, &before);
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
