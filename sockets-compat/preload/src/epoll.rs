//! Which accelerated sockets one of the program's epoll sets holds (`epoll_ctl` is watched for
//! them, in `crate::waits`): `epoll_wait` polls those sockets before the kernel sleeps, and a
//! socket registered while still a plain candidate is registered again once `connect` made its
//! number an SDP connection's descriptor (the kernel dropped the old registration with the
//! socket it replaced).

use std::ffi::c_int;
use std::sync::{Arc, Mutex, Weak};

use libc::epoll_event;

use crate::connection::Connected;

/// One member of a set: the descriptor and the event mask the program registered.
#[derive(Debug)]
struct Member {
    fd: c_int,
    event: epoll_event,
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

    /// The program added `fd` (`conn` if it is a connection, none if a candidate) or changed
    /// its events (`EPOLL_CTL_ADD`, `EPOLL_CTL_MOD`), or removed it (`event` none).
    pub fn record(&self, fd: c_int, event: Option<epoll_event>, conn: Option<Weak<Connected>>) {
        let mut m = self.lock();
        m.retain(|x| x.fd != fd);
        if let Some(event) = event {
            m.push(Member { fd, event, conn });
        }
    }

    /// The candidate `fd` is gone or stays the kernel's: nothing is registered again for it.
    pub fn forget_candidate(&self, fd: c_int) {
        self.lock().retain(|x| x.fd != fd || x.conn.is_some());
    }

    /// The candidate `fd` is now the connection `conn`: the events to register its descriptor
    /// with again.
    pub fn adopt(&self, fd: c_int, conn: &Arc<Connected>) -> Vec<epoll_event> {
        let mut m = self.lock();
        let mut events = Vec::new();
        for x in m.iter_mut().filter(|x| x.fd == fd && x.conn.is_none()) {
            x.conn = Some(Arc::downgrade(conn));
            events.push(x.event);
        }
        events
    }

    /// The live connections in the set (for a wait to poll).
    pub fn connections(&self) -> Vec<Arc<Connected>> {
        let mut m = self.lock();
        m.retain(|x| x.conn.as_ref().is_none_or(|w| w.strong_count() > 0));
        m.iter().filter_map(|x| x.conn.as_ref().and_then(Weak::upgrade)).collect()
    }
}
