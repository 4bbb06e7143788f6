//! This process's side of a session: its configuration and the verbs resources every channel
//! uses (the session builds channels and connections, and hands them these).

use std::sync::Arc;

use portability_verbs::datapath::RegistrationCache;
use portability_verbs::{Context, ProtectionDomain};

use crate::config::SessionConfig;

/// The configuration and verbs resources shared by a session's channels.
pub(crate) struct Resources {
    pub cfg: SessionConfig,
    pub ctx: Context,
    pub pd: ProtectionDomain,
    pub regcache: Arc<RegistrationCache>,
}
