//! What `TcpStream` offers besides reading and writing, on an SDP stream: its addresses,
//! nonblocking mode, timeouts, `TCP_NODELAY`, and the pending error (`SO_ERROR`).

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use super::config::invalid;
use super::SdpStream;

impl SdpStream {
    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.lock().peer)
    }

    /// This end's address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.lock().local)
    }

    /// Nonblocking mode: reads and writes that would wait return `WouldBlock` instead. (A
    /// nonblocking ZSDP socket copies: it cannot hold the caller's buffer past the call.)
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        self.lock().nonblocking = on;
        Ok(())
    }

    /// Bounds how long `read` waits (`None`: forever). A zero duration is invalid, as in std.
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        if t == Some(Duration::ZERO) {
            return Err(invalid("zero read timeout".into()));
        }
        self.lock().read_timeout = t;
        Ok(())
    }

    /// Bounds how long `write` waits (`None`: forever). A zero duration is invalid, as in std.
    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        if t == Some(Duration::ZERO) {
            return Err(invalid("zero write timeout".into()));
        }
        self.lock().write_timeout = t;
        Ok(())
    }

    /// The read timeout (`None`: reads wait forever).
    pub fn read_timeout(&self) -> io::Result<Option<Duration>> {
        Ok(self.lock().read_timeout)
    }

    /// The write timeout (`None`: writes wait forever).
    pub fn write_timeout(&self) -> io::Result<Option<Duration>> {
        Ok(self.lock().write_timeout)
    }

    /// Accepted for `TcpStream` compatibility: SDP never holds a small write back to join it
    /// with the next (every write is handed to the transport at once), so there is no Nagle
    /// algorithm to turn off; [`SdpStream::nodelay`] returns what was set.
    pub fn set_nodelay(&self, on: bool) -> io::Result<()> {
        self.lock().nodelay = on;
        Ok(())
    }

    /// What [`SdpStream::set_nodelay`] set last (`true` until then: writes are never delayed).
    pub fn nodelay(&self) -> io::Result<bool> {
        Ok(self.lock().nodelay)
    }

    /// The error that failed the socket, once (as `SO_ERROR` reports and clears it); `None`
    /// while it works, and after the error was taken.
    pub fn take_error(&self) -> io::Result<Option<io::Error>> {
        let mut c = self.lock();
        if c.error_taken {
            return Ok(None);
        }
        let Some((kind, why)) = c.failed.clone() else { return Ok(None) };
        c.error_taken = true;
        Ok(Some(io::Error::new(kind, why)))
    }
}
