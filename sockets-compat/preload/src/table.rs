//! Which descriptors are this library's, and what each is: a stream socket not yet connected
//! or listening (still the kernel's), an SDP connection (its number now a readiness eventfd),
//! a listening socket that also takes SDP clients, or an epoll set holding SDP connections.
//! Every other descriptor is passed straight to the C library after one atomic load
//! ([`maybe_ours`]).

use std::collections::BTreeMap;
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub use crate::connection::{Candidate, Connected};
use crate::epoll::EpollSet;
use crate::serve::Listening;

#[derive(Clone)]
pub enum Entry {
    Candidate(Candidate),
    Connected(Arc<Connected>),
    Listening(Arc<Listening>),
    /// An epoll set of the program's holding accelerated sockets.
    Epoll(Arc<EpollSet>),
}

/// Descriptors below this are looked up in a bitmap; above it, `HIGH` says whether any is ours.
const BITMAP_FDS: usize = 1 << 16;
static OURS: [AtomicU64; BITMAP_FDS / 64] = [const { AtomicU64::new(0) }; BITMAP_FDS / 64];
static HIGH: AtomicBool = AtomicBool::new(false);
static TABLE: Mutex<BTreeMap<c_int, Entry>> = Mutex::new(BTreeMap::new());

/// Whether `fd` may be ours (false: certainly not; one relaxed load).
#[inline]
pub fn maybe_ours(fd: c_int) -> bool {
    match usize::try_from(fd) {
        Ok(i) if i < BITMAP_FDS => OURS[i / 64].load(Ordering::Relaxed) & (1 << (i % 64)) != 0,
        Ok(_) => HIGH.load(Ordering::Relaxed),
        Err(_) => false,
    }
}

/// The descriptors below `n` that may be ours (`n` at most 65536), a word of the bitmap at a
/// time.
pub fn ours_below(n: c_int) -> impl Iterator<Item = c_int> {
    let n = n.clamp(0, BITMAP_FDS as c_int) as usize;
    (0..n.div_ceil(64)).flat_map(move |w| {
        let bits = OURS[w].load(Ordering::Relaxed);
        (0..64)
            .filter(move |b| bits & (1 << b) != 0)
            .map(move |b| (w * 64 + b) as c_int)
            .filter(move |&fd| (fd as usize) < n)
    })
}

fn mark(fd: c_int, on: bool) {
    match usize::try_from(fd) {
        Ok(i) if i < BITMAP_FDS => {
            let bit = 1u64 << (i % 64);
            if on {
                OURS[i / 64].fetch_or(bit, Ordering::Relaxed);
            } else {
                OURS[i / 64].fetch_and(!bit, Ordering::Relaxed);
            }
        }
        Ok(_) if on => HIGH.store(true, Ordering::Relaxed),
        _ => {}
    }
}

/// Set in a forked child (by the handler `fork` runs there: an atomic store only).
static FORKED: AtomicBool = AtomicBool::new(false);

/// Whether this process is a forked child of one that used the library (see `crate::fork`).
#[inline]
pub fn forked() -> bool {
    FORKED.load(Ordering::Relaxed)
}

/// This process is a forked child: the table is put right at the first call that reads it.
/// (Async-signal-safe.)
pub fn set_forked() {
    FORKED.store(true, Ordering::Relaxed);
}

fn table() -> std::sync::MutexGuard<'static, BTreeMap<c_int, Entry>> {
    let mut t = TABLE.lock().unwrap_or_else(|p| p.into_inner());
    if forked() && !t.is_empty() {
        // What a forked child inherited is its parent's.
        let inherited = std::mem::take(&mut *t);
        for fd in inherited.keys() {
            mark(*fd, false);
        }
        disown(inherited);
    }
    t
}

/// In a forked child: turns the inherited entries into what the child can use. Connections
/// become dead TCP sockets and are forgotten (dropping one would close the parent's
/// connection); listening sockets are the kernel's alone; candidates stay plain sockets.
fn disown(entries: BTreeMap<c_int, Entry>) {
    for (fd, e) in entries {
        match e {
            Entry::Connected(c) => {
                dead_socket_at(fd, c.domain);
                std::mem::forget(c);
            }
            Entry::Listening(l) => std::mem::forget(l),
            Entry::Candidate(_) | Entry::Epoll(_) => {}
        }
    }
}

/// Puts an unconnected TCP socket at `fd` (keeping its close-on-exec flag): reads see
/// `ENOTCONN`, writes `EPIPE`, `poll` `POLLHUP`.
fn dead_socket_at(fd: c_int, domain: c_int) {
    // SAFETY: a plain query of the caller's descriptor.
    let cloexec = unsafe { (crate::real::real().fcntl)(fd, libc::F_GETFD, 0) } & libc::FD_CLOEXEC != 0;
    crate::real::fresh_socket_at(fd, domain, libc::SOCK_STREAM, cloexec);
}

/// The listening sockets that take SDP clients.
pub fn listening() -> Vec<Arc<Listening>> {
    table()
        .values()
        .filter_map(|e| match e {
            Entry::Listening(l) => Some(l.clone()),
            _ => None,
        })
        .collect()
}

/// What `fd` is, if it is ours.
pub fn get(fd: c_int) -> Option<Entry> {
    if !maybe_ours(fd) {
        return None;
    }
    table().get(&fd).cloned()
}

/// The epoll sets that hold accelerated sockets, with their descriptors.
pub fn epoll_sets() -> Vec<(c_int, Arc<EpollSet>)> {
    table()
        .iter()
        .filter_map(|(fd, e)| match e {
            Entry::Epoll(s) => Some((*fd, s.clone())),
            _ => None,
        })
        .collect()
}

/// Makes `fd` ours as `e` (replacing what it was); returns what it was.
pub fn insert(fd: c_int, e: Entry) -> Option<Entry> {
    let mut t = table();
    mark(fd, true);
    t.insert(fd, e)
}

/// `fd` is no longer ours; returns what it was (dropped by the caller, outside the table's
/// lock: closing a connection may take a while).
pub fn remove(fd: c_int) -> Option<Entry> {
    if !maybe_ours(fd) {
        return None;
    }
    let mut t = table();
    mark(fd, false);
    t.remove(&fd)
}
