//! Waiting calls on sets that hold accelerated sockets: `poll`, `ppoll`, `select`, `pselect`,
//! `epoll_wait`, `epoll_pwait`.
//!
//! The kernel still says what is ready (an accelerated socket's descriptor is its readiness
//! eventfd), but nothing in the kernel moves SDP data: left alone, a program sleeping in
//! `select` sees the next arrival only once the readiness thread has woken, taken it in and
//! written the eventfd (tens of microseconds), and a peer's bulk transfer completes only then.
//! So, as libvma does, the program's own thread first takes in what arrived for the set's
//! accelerated sockets and polls them for `SDP_PRELOAD_POLL_US` (asking the kernel again
//! whenever one changes, and every 32 rounds for the plain descriptors), and only then lets
//! the kernel put it to sleep, with the readiness thread told to keep watch.
//!
//! Signals: while it polls, the thread's signals are blocked, and the kernel's calls are
//! made with the mask the program waits with (its own, or the one it gave `ppoll`,
//! `pselect`, `epoll_pwait`): a signal that comes while the library polls is delivered by the
//! next of them, which returns `EINTR`, as the kernel's wait would have.

use std::ffi::c_int;
use std::sync::Arc;
use std::time::{Duration, Instant};

use libc::{epoll_event, fd_set, nfds_t, pollfd, sigset_t, size_t, timespec, timeval};
use sockets_compat::ReadyState;

use crate::config::config;
use crate::connected;
use crate::epoll::EpollSet;
use crate::guard::{inside, Inside};
use crate::real::real;
use crate::signals::{pending_for, Blocked};
use crate::table::{self, Connected, Entry};

/// Rounds of polling between two looks at the plain descriptors of a set.
const PLAIN_EVERY: u32 = 32;

/// Makes the program's waiting call, `call(timeout, mask)` (`None`: no time limit; zero: never
/// sleeps; `mask`: the signal mask to wait with, null for the thread's), over a set holding
/// the accelerated connections `socks`, having polled them first. Returns the call's result
/// with its `errno`.
fn wait_polling(
    socks: &[Arc<Connected>],
    timeout: Option<Duration>,
    program_mask: *const sigset_t,
    call: &mut dyn FnMut(Option<Duration>, *const sigset_t) -> c_int,
) -> c_int {
    let _in = Inside::enter();
    let limit = timeout.map_or(config().poll_spin, |t| t.min(config().poll_spin));
    if limit.is_zero() {
        for s in socks {
            s.stream.poll_ready();
        }
        if timeout != Some(Duration::ZERO) {
            about_to_sleep(socks);
        }
        return call(timeout, program_mask);
    }
    let blocked = Blocked::new();
    let mask: *const sigset_t = if program_mask.is_null() { blocked.previous_mask() } else { program_mask };
    let start = Instant::now();
    let mut seen: Vec<Option<ReadyState>> = vec![None; socks.len()];
    let mut round = 0u32;
    let result = loop {
        let mut ask = round.is_multiple_of(PLAIN_EVERY);
        for (s, seen) in socks.iter().zip(seen.iter_mut()) {
            let now = s.stream.poll_ready();
            if now.is_some() && now != *seen {
                ask = true;
                *seen = now;
            }
        }
        if ask {
            let r = call(Some(Duration::ZERO), mask);
            if r != 0 {
                break r;
            }
        }
        round = round.wrapping_add(1);
        let spent = start.elapsed();
        // A signal the wait lets in ends the polling (not every call with no timeout
        // reports one: `epoll_pwait` does not): the call below then reports it.
        if spent >= limit || (ask && pending_for(mask)) {
            about_to_sleep(socks);
            break call(timeout.map(|t| t.saturating_sub(spent)), mask);
        }
        std::hint::spin_loop();
    };
    drop(blocked); // a signal that came is delivered now, after the call that reported it
    result
}

/// Tells the readiness thread that the program sleeps on these sockets (it keeps every
/// socket whose descriptor was asked for current: one word to it is enough).
fn about_to_sleep(socks: &[Arc<Connected>]) {
    if let Some(s) = socks.first() {
        s.stream.about_to_wait();
    }
}

fn from_ms(ms: c_int) -> Option<Duration> {
    (ms >= 0).then(|| Duration::from_millis(ms as u64))
}

/// Milliseconds for an epoll wait, rounded up (so a wait never ends early); -1 for none.
fn to_ms(t: Option<Duration>) -> c_int {
    match t {
        None => -1,
        Some(t) => t.as_nanos().div_ceil(1_000_000).min(i32::MAX as u128) as c_int,
    }
}

fn to_timespec(t: Option<Duration>) -> Option<timespec> {
    t.map(|t| timespec { tv_sec: t.as_secs().min(i64::MAX as u64) as libc::time_t, tv_nsec: t.subsec_nanos() as _ })
}

fn from_timespec(ts: *const timespec) -> Option<Duration> {
    if ts.is_null() {
        return None;
    }
    // SAFETY: the caller's timespec.
    let ts = unsafe { *ts };
    Some(Duration::new(ts.tv_sec.max(0) as u64, ts.tv_nsec.clamp(0, 999_999_999) as u32))
}

/// The accelerated connections among a `poll` set's descriptors.
unsafe fn poll_members(fds: *const pollfd, n: nfds_t) -> Vec<Arc<Connected>> {
    if inside() || fds.is_null() {
        return Vec::new();
    }
    // SAFETY: the caller's array of `n` pollfd.
    let fds = unsafe { std::slice::from_raw_parts(fds, n as usize) };
    fds.iter().filter(|p| table::maybe_ours(p.fd)).filter_map(|p| connected(p.fd)).collect()
}

unsafe fn poll_polling(fds: *mut pollfd, n: nfds_t, timeout: Option<Duration>, mask: *const sigset_t) -> Option<c_int> {
    // SAFETY: the caller's array.
    let socks = unsafe { poll_members(fds, n) };
    if socks.is_empty() {
        return None;
    }
    Some(wait_polling(&socks, timeout, mask, &mut |t, m| {
        let ts = to_timespec(t);
        // SAFETY: the caller's array; a local timespec or null.
        unsafe { (real().ppoll)(fds, n, ts.as_ref().map_or(std::ptr::null(), |t| t as *const _), m) }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn poll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int {
    // SAFETY: the caller's arguments.
    match unsafe { poll_polling(fds, n, from_ms(timeout), std::ptr::null()) } {
        Some(r) => r,
        // SAFETY: the caller's arguments, passed on.
        None => unsafe { (real().poll)(fds, n, timeout) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn __poll_chk(fds: *mut pollfd, n: nfds_t, timeout: c_int, fdslen: size_t) -> c_int {
    if fdslen / std::mem::size_of::<pollfd>() < n as usize {
        // SAFETY: the C library's check reports the overflow as it would.
        return unsafe { (real().__poll_chk)(fds, n, timeout, fdslen) };
    }
    // SAFETY: the caller's arguments.
    unsafe { poll(fds, n, timeout) }
}

#[no_mangle]
pub unsafe extern "C" fn ppoll(fds: *mut pollfd, n: nfds_t, ts: *const timespec, mask: *const sigset_t) -> c_int {
    // SAFETY: the caller's arguments.
    match unsafe { poll_polling(fds, n, from_timespec(ts), mask) } {
        Some(r) => r,
        // SAFETY: the caller's arguments, passed on.
        None => unsafe { (real().ppoll)(fds, n, ts, mask) },
    }
}

/// The accelerated connections among a `select`'s descriptors.
unsafe fn select_members(n: c_int, sets: [*mut fd_set; 3]) -> Vec<Arc<Connected>> {
    let mut socks = Vec::new();
    if inside() {
        return socks;
    }
    for fd in table::ours_below(n.clamp(0, libc::FD_SETSIZE as c_int)) {
        // SAFETY: the caller's sets, each of at least `n` bits.
        if sets.iter().any(|s| !s.is_null() && unsafe { libc::FD_ISSET(fd, *s) }) {
            socks.extend(connected(fd));
        }
    }
    socks
}

unsafe fn select_polling(
    n: c_int,
    sets: [*mut fd_set; 3],
    timeout: Option<Duration>,
    mask: *const sigset_t,
) -> Option<(c_int, Option<Duration>)> {
    // SAFETY: the caller's sets.
    let socks = unsafe { select_members(n, sets) };
    if socks.is_empty() {
        return None;
    }
    // Each try overwrites the sets: every one starts from the program's.
    // SAFETY: fd_set is plain data; copied from the caller's sets where given.
    let asked: [Option<fd_set>; 3] = sets.map(|s| (!s.is_null()).then(|| unsafe { *s }));
    let start = Instant::now();
    let r = wait_polling(&socks, timeout, mask, &mut |t, m| {
        for (s, a) in sets.iter().zip(&asked) {
            if let Some(a) = a {
                // SAFETY: the caller's set.
                unsafe { **s = *a };
            }
        }
        let ts = to_timespec(t);
        // SAFETY: the caller's sets; a local timespec or null.
        unsafe { (real().pselect)(n, sets[0], sets[1], sets[2], ts.as_ref().map_or(std::ptr::null(), |t| t), m) }
    });
    Some((r, timeout.map(|t| t.saturating_sub(start.elapsed()))))
}

#[no_mangle]
pub unsafe extern "C" fn select(n: c_int, r: *mut fd_set, w: *mut fd_set, e: *mut fd_set, tv: *mut timeval) -> c_int {
    let timeout = if tv.is_null() {
        None
    } else {
        // SAFETY: the caller's timeval.
        let t = unsafe { *tv };
        Some(Duration::from_secs(t.tv_sec.max(0) as u64) + Duration::from_micros(t.tv_usec.clamp(0, 999_999) as u64))
    };
    // SAFETY: the caller's arguments.
    match unsafe { select_polling(n, [r, w, e], timeout, std::ptr::null()) } {
        Some((result, left)) => {
            if let Some(left) = left {
                // Linux's select leaves the time not slept in the timeval.
                // SAFETY: the caller's timeval (not null when there is a timeout).
                unsafe {
                    (*tv).tv_sec = left.as_secs() as libc::time_t;
                    (*tv).tv_usec = left.subsec_micros() as libc::suseconds_t;
                }
            }
            result
        }
        // SAFETY: the caller's arguments, passed on.
        None => unsafe { (real().select)(n, r, w, e, tv) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn pselect(
    n: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    e: *mut fd_set,
    ts: *const timespec,
    mask: *const sigset_t,
) -> c_int {
    // SAFETY: the caller's arguments.
    match unsafe { select_polling(n, [r, w, e], from_timespec(ts), mask) } {
        Some((result, _)) => result,
        // SAFETY: the caller's arguments, passed on.
        None => unsafe { (real().pselect)(n, r, w, e, ts, mask) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_ctl(epfd: c_int, op: c_int, fd: c_int, event: *mut epoll_event) -> c_int {
    // SAFETY: the caller's arguments, passed on.
    let r = unsafe { (real().epoll_ctl)(epfd, op, fd, event) };
    if r == 0 && !inside() && (table::maybe_ours(fd) || table::maybe_ours(epfd)) {
        let _in = Inside::enter();
        epoll_changed(epfd, op, fd, event);
    }
    r
}

/// The program changed `epfd`'s set (the kernel accepted the change): remembers the members
/// that are ours.
fn epoll_changed(epfd: c_int, op: c_int, fd: c_int, event: *const epoll_event) {
    let conn = match table::get(fd) {
        Some(Entry::Connected(c)) => Some(Arc::downgrade(&c)),
        Some(Entry::Candidate(_)) => None,
        _ if op == libc::EPOLL_CTL_DEL => None,
        _ => return,
    };
    let set = match table::get(epfd) {
        Some(Entry::Epoll(s)) => s,
        _ if op == libc::EPOLL_CTL_DEL => return,
        _ => {
            let s = Arc::new(EpollSet::default());
            table::insert(epfd, Entry::Epoll(s.clone()));
            s
        }
    };
    // SAFETY: the kernel just read the program's event from this pointer.
    let event = (op != libc::EPOLL_CTL_DEL && !event.is_null()).then(|| unsafe { std::ptr::read_unaligned(event) });
    set.record(fd, event, conn);
}

/// The candidate `fd` is gone (closed, replaced) or stays the kernel's (a plain connection):
/// no epoll set registers it again.
pub fn epoll_forget_candidate(fd: c_int) {
    for (_, set) in table::epoll_sets() {
        set.forget_candidate(fd);
    }
}

/// `fd`, registered in epoll sets while a candidate, is now the connection `conn`: registers
/// its descriptor again with the events the program asked for.
pub fn epoll_adopt(fd: c_int, conn: &Arc<Connected>) {
    for (epfd, set) in table::epoll_sets() {
        for mut ev in set.adopt(fd, conn) {
            // SAFETY: a valid event for the program's epoll set and descriptor.
            if unsafe { (real().epoll_ctl)(epfd, libc::EPOLL_CTL_ADD, fd, &mut ev) } != 0 {
                log::info!("sdp_preload: cannot register descriptor {fd} in epoll set {epfd} again");
            }
        }
    }
}

/// The accelerated connections in the epoll set `epfd`.
fn epoll_members(epfd: c_int) -> Vec<Arc<Connected>> {
    if inside() || !table::maybe_ours(epfd) {
        return Vec::new();
    }
    match table::get(epfd) {
        Some(Entry::Epoll(set)) => set.connections(),
        _ => Vec::new(),
    }
}

fn epoll_polling(
    epfd: c_int,
    events: *mut epoll_event,
    max: c_int,
    timeout: c_int,
    mask: *const sigset_t,
) -> Option<c_int> {
    let socks = epoll_members(epfd);
    if socks.is_empty() {
        return None;
    }
    Some(wait_polling(&socks, from_ms(timeout), mask, &mut |t, m| {
        // SAFETY: the caller's arguments.
        unsafe { (real().epoll_pwait)(epfd, events, max, to_ms(t), m) }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn epoll_wait(epfd: c_int, events: *mut epoll_event, max: c_int, timeout: c_int) -> c_int {
    match epoll_polling(epfd, events, max, timeout, std::ptr::null()) {
        Some(r) => r,
        // SAFETY: the caller's arguments, passed on.
        None => unsafe { (real().epoll_wait)(epfd, events, max, timeout) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_pwait(
    epfd: c_int,
    events: *mut epoll_event,
    max: c_int,
    timeout: c_int,
    mask: *const sigset_t,
) -> c_int {
    match epoll_polling(epfd, events, max, timeout, mask) {
        Some(r) => r,
        // SAFETY: the caller's arguments, passed on.
        None => unsafe { (real().epoll_pwait)(epfd, events, max, timeout, mask) },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epoll_timeouts_round_up_and_none_is_minus_one() {
        assert_eq!(to_ms(None), -1);
        assert_eq!(to_ms(Some(Duration::ZERO)), 0);
        assert_eq!(to_ms(Some(Duration::from_micros(1))), 1);
        assert_eq!(to_ms(Some(Duration::from_millis(7))), 7);
        assert_eq!(from_ms(-1), None);
        assert_eq!(from_ms(5), Some(Duration::from_millis(5)));
    }
}
