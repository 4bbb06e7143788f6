//! The C library's own socket calls, found behind ours (`dlsym(RTLD_NEXT, ..)`) at their first
//! use: nothing runs when the library is loaded.

use std::ffi::{c_char, c_int, c_long, c_ulong, c_void};
use std::sync::OnceLock;

use libc::{
    epoll_event, fd_set, iovec, msghdr, nfds_t, off_t, pollfd, sigset_t, size_t, sockaddr, socklen_t, ssize_t,
    timespec, timeval,
};

macro_rules! real {
    ($($name:ident : fn($($arg:ident : $ty:ty),*) -> $ret:ty;)*) => {
        /// The next definitions of the calls this library intercepts.
        #[allow(non_snake_case)]
        pub struct Real {
            $(pub $name: unsafe extern "C" fn($($ty),*) -> $ret,)*
        }

        fn resolve() -> Real {
            Real {
                $($name: {
                    let name = concat!(stringify!($name), "\0");
                    // SAFETY: a NUL-terminated name; RTLD_NEXT finds the C library's.
                    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr() as *const c_char) };
                    if p.is_null() {
                        // Without the C library's own call nothing can work: say so and stop.
                        let msg = concat!("sdp_preload: no ", stringify!($name), " behind this library\n");
                        // SAFETY: writes a static message to stderr.
                        unsafe { libc::syscall(libc::SYS_write, 2, msg.as_ptr(), msg.len()) };
                        std::process::abort();
                    }
                    // SAFETY: the C library's function of this name has this C signature.
                    unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($ty),*) -> $ret>(p) }
                },)*
            }
        }
    };
}

real! {
    socket: fn(domain: c_int, ty: c_int, proto: c_int) -> c_int;
    connect: fn(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int;
    listen: fn(fd: c_int, backlog: c_int) -> c_int;
    accept: fn(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int;
    accept4: fn(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int;
    close: fn(fd: c_int) -> c_int;
    read: fn(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t;
    write: fn(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t;
    readv: fn(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t;
    writev: fn(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t;
    recv: fn(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t;
    recvfrom: fn(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> ssize_t;
    recvmsg: fn(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t;
    send: fn(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t;
    sendto: fn(fd: c_int, buf: *const c_void, n: size_t, flags: c_int, addr: *const sockaddr, len: socklen_t) -> ssize_t;
    sendmsg: fn(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t;
    shutdown: fn(fd: c_int, how: c_int) -> c_int;
    getsockname: fn(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int;
    getpeername: fn(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int;
    getsockopt: fn(fd: c_int, level: c_int, name: c_int, val: *mut c_void, len: *mut socklen_t) -> c_int;
    setsockopt: fn(fd: c_int, level: c_int, name: c_int, val: *const c_void, len: socklen_t) -> c_int;
    fcntl: fn(fd: c_int, cmd: c_int, arg: c_long) -> c_int;
    fcntl64: fn(fd: c_int, cmd: c_int, arg: c_long) -> c_int;
    ioctl: fn(fd: c_int, req: c_ulong, arg: *mut c_void) -> c_int;
    dup: fn(fd: c_int) -> c_int;
    dup2: fn(old: c_int, new: c_int) -> c_int;
    dup3: fn(old: c_int, new: c_int, flags: c_int) -> c_int;
    sendfile: fn(out: c_int, input: c_int, off: *mut off_t, n: size_t) -> ssize_t;
    sendfile64: fn(out: c_int, input: c_int, off: *mut off_t, n: size_t) -> ssize_t;
    poll: fn(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int;
    __poll_chk: fn(fds: *mut pollfd, n: nfds_t, timeout: c_int, fdslen: size_t) -> c_int;
    select: fn(n: c_int, r: *mut fd_set, w: *mut fd_set, e: *mut fd_set, timeout: *mut timeval) -> c_int;
    epoll_wait: fn(epfd: c_int, events: *mut epoll_event, max: c_int, timeout: c_int) -> c_int;
    ppoll: fn(fds: *mut pollfd, n: nfds_t, timeout: *const timespec, mask: *const sigset_t) -> c_int;
    pselect: fn(n: c_int, r: *mut fd_set, w: *mut fd_set, e: *mut fd_set, timeout: *const timespec, mask: *const sigset_t) -> c_int;
    epoll_ctl: fn(epfd: c_int, op: c_int, fd: c_int, event: *mut epoll_event) -> c_int;
    epoll_pwait: fn(epfd: c_int, events: *mut epoll_event, max: c_int, timeout: c_int, mask: *const sigset_t) -> c_int;
}

/// The C library's calls (resolved once, at the first intercepted call).
#[inline]
pub fn real() -> &'static Real {
    static REAL: OnceLock<Real> = OnceLock::new();
    REAL.get_or_init(resolve)
}

/// Puts a new socket (`domain`, `ty`) at the number `fd`, in place of what was there (closed
/// unless another descriptor holds it): the number stays valid for whoever uses it. `cloexec`
/// is the number's close-on-exec flag.
pub fn fresh_socket_at(fd: c_int, domain: c_int, ty: c_int, cloexec: bool) {
    let r = real();
    // SAFETY: plain descriptor calls on a new socket and the caller's descriptor number.
    unsafe {
        let s = (r.socket)(domain, ty | libc::SOCK_CLOEXEC, 0);
        if s >= 0 {
            (r.dup3)(s, fd, if cloexec { libc::O_CLOEXEC } else { 0 });
            (r.close)(s);
        }
    }
}
