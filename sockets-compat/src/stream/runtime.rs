//! Address resolution, the queue-pair sizes of a connection, and the mapping of verbs errors
//! to I/O errors.

use super::*;

pub(super) fn verbs_io(e: VerbsError) -> io::Error {
    let kind = match &e {
        VerbsError::Timeout(_) => io::ErrorKind::TimedOut,
        VerbsError::PeerUnreachable(_) => io::ErrorKind::ConnectionReset,
        VerbsError::Refused(_) => io::ErrorKind::ConnectionRefused,
        VerbsError::Protocol(_) => io::ErrorKind::ConnectionAborted,
        VerbsError::InvalidArgument(_) => io::ErrorKind::InvalidInput,
        VerbsError::Os { source, .. } => source.kind(),
        _ => io::ErrorKind::Other,
    };
    io::Error::new(kind, e)
}

pub(super) fn resolve(addr: impl ToSocketAddrs) -> io::Result<SocketAddr> {
    addr.to_socket_addrs()?.next().ok_or_else(|| invalid("address resolves to nothing".into()))
}

/// Every connection's queue pair and completion queue.
pub(super) fn qp_spec() -> cm::QpSpec {
    cm::QpSpec::with_depths(512, 512)
}
