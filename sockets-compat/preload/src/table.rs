//! Which descriptors are this library's, and what each is: a stream socket not yet connected
//! or listening (still the kernel's), an SDP connection (its number now a readiness eventfd),
//! a listening socket that also takes SDP clients, or an epoll set holding SDP connections.
//! Every other descriptor is passed straight to the C library after one atomic load
//! ([`maybe_ours`]).

use std::collections::BTreeMap;
use std::ffi::c_int;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use sockets_compat::SdpStream;

use crate::epoll::EpollSet;
use crate::serve::Listening;

/// A TCP socket the program made, not yet connected or listening.
#[derive(Clone, Copy, Debug)]
pub struct Candidate {
    pub domain: c_int,
}

/// An accelerated connection, shared by the descriptors `dup` made of it (the last one closed
/// closes it).
pub struct Connected {
    pub stream: SdpStream,
    pub domain: c_int,
    /// What `getsockname` and `getpeername` report.
    pub local: SocketAddr,
    pub peer: SocketAddr,
    /// `O_NONBLOCK` as the program set it (the eventfd's own flag is never changed).
    pub nonblocking: AtomicBool,
}

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

/// The descriptors below `n` that may be ours (`n` at most 65536), a word of the bitmap at a time.
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

fn table() -> std::sync::MutexGuard<'static, BTreeMap<c_int, Entry>> {
    let mut t = TABLE.lock().unwrap_or_else(|p| p.into_inner());
    if crate::fork::forked() && !t.is_empty() {
        // A forked child: what it inherited is its parent's (see `crate::fork`).
        let inherited = std::mem::take(&mut *t);
        for fd in inherited.keys() {
            mark(*fd, false);
        }
        crate::fork::disown(inherited);
    }
    t
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
    crate::fork::watch();
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
