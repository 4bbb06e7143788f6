//! This process's side of a session: its configuration and the verbs resources every channel
//! uses (the session builds channels and connections, and hands them these).

use std::sync::Arc;

use portability_verbs::datapath::RegistrationCache;
use portability_verbs::{Context, ProtectionDomain};

use crate::config::SessionConfig;
use crate::wait::Patience;

/// The configuration and verbs resources shared by a session's channels.
pub(crate) struct Resources {
    pub cfg: SessionConfig,
    pub ctx: Context,
    pub pd: ProtectionDomain,
    pub regcache: Arc<RegistrationCache>,
    /// `cfg.patience()`, worked out once: every message's claims take it.
    patience: Patience,
}

impl Resources {
    pub fn new(cfg: SessionConfig, ctx: Context, pd: ProtectionDomain, regcache: Arc<RegistrationCache>) -> Resources {
        Resources { patience: cfg.patience(), cfg, ctx, pd, regcache }
    }

    /// What a blocking call of this session may wait, and how.
    #[inline]
    pub fn patience(&self) -> &Patience {
        &self.patience
    }
}
