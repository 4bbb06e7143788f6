//! `SdpListener`: accepting SDP connections.

use super::*;

/// A listening SDP socket.
pub struct SdpListener {
    inner: cm::Listener,
    local: SocketAddr,
    config: SdpConfig,
    nonblocking: std::sync::atomic::AtomicBool,
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
        Ok(SdpListener { inner, local, config, nonblocking: false.into() })
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local)
    }

    /// Nonblocking mode: `accept` returns `WouldBlock` when no client is waiting.
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        self.nonblocking.store(on, std::sync::atomic::Ordering::Relaxed);
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
        let rt = runtime()?;
        loop {
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

    /// An endless iterator over accepted connections.
    pub fn incoming(&self) -> impl Iterator<Item = io::Result<SdpStream>> + '_ {
        std::iter::repeat_with(move || self.accept().map(|(s, _)| s))
    }
}

impl std::fmt::Debug for SdpListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SdpListener").field("local", &self.local).field("design", &self.config.design).finish()
    }
}
