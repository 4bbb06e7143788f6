//! Which accelerated sockets each of the program's epoll sets holds (`epoll_ctl` is watched
//! for them): `epoll_wait` polls those sockets before the kernel sleeps ([`crate::waits`]),
//! and a socket registered while still a plain candidate is registered again once `connect`
//! made its number an SDP connection's descriptor (the kernel dropped the old registration
//! with the socket it replaced).

use std::ffi::c_int;
use std::sync::{Arc, Mutex, Weak};

use crate::table::{self, Connected, Entry};

/// One member of a set: the descriptor and the event mask the program registered.
#[derive(Debug)]
struct Member {
    fd: c_int,
    event: libc::epoll_event,
    /// The connection, once `fd` is one (a candidate has none yet). A dropped connection's
    /// registration went with its last descriptor, as the kernel's does.
    conn: Option<Weak<Connected>>,
}

/// The accelerated (or still candidate) members of one epoll set.
#[derive(Debug, Default)]
pub struct EpollSet {
    members: Mutex<Vec<Member>>,
}

impl EpollSet {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Member>> {
        self.members.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The live connections in the set (for a wait to poll).
    pub fn connections(&self) -> Vec<Arc<Connected>> {
        let mut m = self.lock();
        m.retain(|x| x.conn.as_ref().is_none_or(|w| w.strong_count() > 0));
        m.iter().filter_map(|x| x.conn.as_ref().and_then(Weak::upgrade)).collect()
    }
}

/// The program changed `epfd`'s set (after the kernel accepted the change): remembers the
/// members that are ours.
pub fn changed(epfd: c_int, op: c_int, fd: c_int, event: *const libc::epoll_event) {
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
    let mut m = set.lock();
    m.retain(|x| x.fd != fd);
    if op != libc::EPOLL_CTL_DEL && !event.is_null() {
        // SAFETY: the kernel just read the program's event from this pointer.
        let event = unsafe { std::ptr::read_unaligned(event) };
        m.push(Member { fd, event, conn });
    }
}

/// The candidate `fd` is gone (closed, replaced) or stays the kernel's (a plain connection):
/// nothing is registered again for it.
pub fn forget_candidate(fd: c_int) {
    for (_, set) in table::epoll_sets() {
        set.lock().retain(|x| x.fd != fd || x.conn.is_some());
    }
}

/// `fd`, registered in epoll sets while a candidate, is now the connection `conn`: registers
/// its descriptor again with the events the program asked for.
pub fn connected(fd: c_int, conn: &Arc<Connected>) {
    for (epfd, set) in table::epoll_sets() {
        let mut m = set.lock();
        for x in m.iter_mut().filter(|x| x.fd == fd && x.conn.is_none()) {
            x.conn = Some(Arc::downgrade(conn));
            let mut ev = x.event;
            // SAFETY: a valid event for the program's epoll set and descriptor.
            if unsafe { (crate::real::real().epoll_ctl)(epfd, libc::EPOLL_CTL_ADD, fd, &mut ev) } != 0 {
                log::info!("sdp_preload: cannot register descriptor {fd} in epoll set {epfd} again");
            }
        }
    }
}
