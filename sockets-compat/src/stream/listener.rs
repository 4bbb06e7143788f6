//! `SdpListener`: accepting SDP connections.

use super::*;

/// A listening SDP socket.
pub struct SdpListener {
    shared: Arc<Shared>,
}

/// What the listener and the readiness watcher share.
pub(super) struct Shared {
    inner: cm::Listener,
    local: SocketAddr,
    config: SdpConfig,
    nonblocking: std::sync::atomic::AtomicBool,
    /// Connections the watcher accepted for the application's next `accept`, and the
    /// readiness descriptor (kept current once asked for).
    accepted: Mutex<(VecDeque<(SdpStream, SocketAddr)>, ready::Readiness)>,
}

impl SdpListener {
    /// Binds to `addr` (port 0 picks a free port) with the settings from the environment.
    pub fn bind(addr: impl ToSocketAddrs) -> io::Result<SdpListener> {
        Self::bind_with(addr, SdpConfig::from_env()?)
    }

    /// Binds with explicit settings (accepted sockets send with `config.design`).
    pub fn bind_with(addr: impl ToSocketAddrs, config: SdpConfig) -> io::Result<SdpListener> {
        config.validate()?;
        runtime()?;
        let inner = cm::Listener::bind(&CmAddr::Tcp(resolve(addr)?)).map_err(verbs_io)?;
        let local = match inner.local_addr() {
            CmAddr::Tcp(a) => *a,
            CmAddr::Unix(_) => unreachable!("bound a TCP address"),
        };
        let shared = Shared {
            inner,
            local,
            config,
            nonblocking: false.into(),
            accepted: Mutex::new((VecDeque::new(), ready::Readiness::new()?)),
        };
        Ok(SdpListener { shared: Arc::new(shared) })
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.shared.local)
    }

    /// Nonblocking mode: `accept` returns `WouldBlock` when no client is waiting.
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        self.shared.nonblocking.store(on, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Waits for a connection and returns the connected socket and the peer's address.
    pub fn accept(&self) -> io::Result<(SdpStream, SocketAddr)> {
        self.accept_until(None)
    }

    /// [`SdpListener::accept`] that gives up with `TimedOut` after `limit` (an extension to
    /// the std API: lets tests and tools wait for a peer that may have failed to start).
    pub fn accept_timeout(&self, limit: Duration) -> io::Result<(SdpStream, SocketAddr)> {
        self.accept_until(Some(Instant::now() + limit))
    }

    fn accept_until(&self, deadline: Option<Instant>) -> io::Result<(SdpStream, SocketAddr)> {
        self.shared.accept_until(deadline)
    }

    /// An endless iterator over accepted connections.
    pub fn incoming(&self) -> impl Iterator<Item = io::Result<SdpStream>> + '_ {
        std::iter::repeat_with(move || self.accept().map(|(s, _)| s))
    }
}

impl Shared {
    fn accept_until(&self, deadline: Option<Instant>) -> io::Result<(SdpStream, SocketAddr)> {
        let rt = runtime()?;
        loop {
            if let Some(got) = self.take_accepted() {
                return Ok(got);
            }
            let nonblocking = self.nonblocking.load(std::sync::atomic::Ordering::Relaxed);
            // Each client's bootstrap runs on its own inside the listener: a nonblocking accept
            // takes one that finished, a blocking one waits (in slices, to notice a switch to
            // nonblocking mode) for the next. A client that fails its bootstrap is dropped
            // there and never seen here, as a TCP listener never shows a failed handshake.
            let wait = match (nonblocking, deadline) {
                (true, _) => Duration::ZERO,
                (false, None) => Duration::from_millis(200),
                (false, Some(d)) => d.saturating_duration_since(Instant::now()).min(Duration::from_millis(200)),
            };
            match self.inner.accept(&rt.pd, &qp_spec(), SDP_MAGIC, wait) {
                Ok(conn) => {
                    if conn.peer_private != SDP_MAGIC {
                        debug!("rejecting a non-SDP bootstrap peer");
                        continue;
                    }
                    match SdpStream::establish(conn, self.config) {
                        Ok(s) => {
                            let peer = s.peer_addr()?;
                            return Ok((s, peer));
                        }
                        // The client's failure, not the listener's.
                        Err(e) => debug!("an SDP client failed its set-up: {e}"),
                    }
                }
                Err(VerbsError::Timeout(_)) if nonblocking => return Err(io::ErrorKind::WouldBlock.into()),
                Err(VerbsError::Timeout(_)) if deadline.is_some_and(|d| Instant::now() >= d) => {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, "no connection in time"))
                }
                // No client yet: keep listening, as a blocking accept does.
                Err(VerbsError::Timeout(_)) => continue,
                Err(e) => return Err(verbs_io(e)),
            }
        }
    }

    /// A connection the watcher accepted, if any (the readiness shown updated).
    fn take_accepted(&self) -> Option<(SdpStream, SocketAddr)> {
        let mut g = self.accepted.lock().unwrap_or_else(|p| p.into_inner());
        let got = g.0.pop_front();
        if got.is_some() {
            let readable = !g.0.is_empty();
            if g.1.active {
                g.1.show(readable, true);
            }
        }
        got
    }

    /// The watcher's turn: accepts what finished its handshake (kept for the application's
    /// next `accept`) and shows it. Returns whether to look again soon (handshakes under
    /// way) and the descriptor to sleep on (the listening socket's).
    pub(super) fn background_accept(&self) -> (bool, i32) {
        let fd = self.inner.raw_fd();
        let Ok(rt) = runtime() else { return (false, fd) };
        loop {
            match self.inner.accept(&rt.pd, &qp_spec(), SDP_MAGIC, Duration::ZERO) {
                Ok(conn) if conn.peer_private == SDP_MAGIC => match SdpStream::establish(conn, self.config) {
                    Ok(s) => match s.peer_addr() {
                        Ok(peer) => self.accepted.lock().unwrap_or_else(|p| p.into_inner()).0.push_back((s, peer)),
                        Err(e) => debug!("an accepted SDP socket has no peer address: {e}"),
                    },
                    Err(e) => debug!("an SDP client failed its set-up: {e}"),
                },
                Ok(_) => debug!("rejecting a non-SDP bootstrap peer"),
                Err(_) => break,
            }
        }
        let mut g = self.accepted.lock().unwrap_or_else(|p| p.into_inner());
        let readable = !g.0.is_empty();
        g.1.show(readable, true);
        (self.inner.pending() > 0, fd)
    }
}

impl std::os::fd::AsRawFd for SdpListener {
    /// A descriptor that polls readable while a connection waits to be accepted (an eventfd
    /// kept current by this crate's readiness thread from the first time it is asked for; see
    /// the `ready` module).
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        let mut g = self.shared.accepted.lock().unwrap_or_else(|p| p.into_inner());
        let fd = g.1.raw();
        if !std::mem::replace(&mut g.1.active, true) {
            drop(g);
            if let Err(e) = ready::watch_listener(&self.shared) {
                log::error!("SDP listener readiness: {e}");
            }
        }
        fd
    }
}

impl std::os::fd::AsFd for SdpListener {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        // SAFETY: the descriptor lives as long as the listener (owned by its shared state).
        unsafe { std::os::fd::BorrowedFd::borrow_raw(std::os::fd::AsRawFd::as_raw_fd(self)) }
    }
}

impl std::fmt::Debug for SdpListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SdpListener")
            .field("local", &self.shared.local)
            .field("design", &self.shared.config.design)
            .finish()
    }
}
