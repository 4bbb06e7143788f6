//! What every socket of the process shares (the verbs device, protection domain and
//! registration cache), and the mapping of verbs errors to I/O errors.

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

/// The verbs objects every socket of the process shares.
pub(super) struct Runtime {
    pub(super) pd: ProtectionDomain,
    pub(super) regcache: RegistrationCache,
}

pub(super) fn runtime() -> io::Result<&'static Runtime> {
    static RT: OnceLock<std::result::Result<Runtime, String>> = OnceLock::new();
    let rt = RT.get_or_init(|| {
        let ctx = Context::open_default().map_err(|e| e.to_string())?;
        let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
        let regcache = RegistrationCache::new(&pd, 1 << 30);
        Ok(Runtime { pd, regcache })
    });
    rt.as_ref().map_err(|e| io::Error::other(format!("opening the verbs device: {e}")))
}

pub(super) fn resolve(addr: impl ToSocketAddrs) -> io::Result<SocketAddr> {
    addr.to_socket_addrs()?.next().ok_or_else(|| invalid("address resolves to nothing".into()))
}

/// Every connection's queue pair and completion queue.
pub(super) fn qp_spec() -> cm::QpSpec {
    cm::QpSpec::with_depths(512, 512)
}
