//! The verbs objects every socket of the process shares, SDP's and EXS's alike: the device,
//! one protection domain (so that memory registered once serves every connection) and the
//! registration cache.

use std::io;
use std::sync::OnceLock;

use portability_verbs::datapath::RegistrationCache;
use portability_verbs::{Context, ProtectionDomain};

/// The process's verbs objects.
pub(crate) struct Runtime {
    pub(crate) pd: ProtectionDomain,
    pub(crate) regcache: RegistrationCache,
}

/// Opens them on first use.
pub(crate) fn runtime() -> io::Result<&'static Runtime> {
    static RT: OnceLock<std::result::Result<Runtime, String>> = OnceLock::new();
    let rt = RT.get_or_init(|| {
        let ctx = Context::open_default().map_err(|e| e.to_string())?;
        let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
        let regcache = RegistrationCache::new(&pd, 1 << 30);
        Ok(Runtime { pd, regcache })
    });
    rt.as_ref().map_err(|e| io::Error::other(format!("opening the verbs device: {e}")))
}
