//! Errors of the verbs layer.
//!
//! Synchronous failures (bad arguments, exhausted resources, a dead peer at connection time) are
//! returned as [`VerbsError`]. Failures of a posted work request are reported the verbs way: as a
//! completion with a non-success [`crate::WcStatus`].

use std::io;

/// Result alias of this crate.
pub type Result<T, E = VerbsError> = std::result::Result<T, E>;

/// Everything a verbs call can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VerbsError {
    /// An argument is out of range or inconsistent (the verbs `EINVAL`).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The object is not in a state that allows the call (for example posting a send before RTS).
    #[error("invalid state: {0}")]
    InvalidState(String),
    /// A fixed-size resource is exhausted (queue full, key table full, too many objects).
    #[error("resource exhausted: {0}")]
    Exhausted(String),
    /// The completion queue overflowed: completions were lost, the queue and its QPs are in error.
    #[error("completion queue overrun: a completion did not fit, the CQ is in error")]
    CqOverrun,
    /// No device of the asked provider exists on this machine.
    #[error("no device: {0}")]
    NoDevice(String),
    /// Objects of different providers or contexts were mixed.
    #[error("objects from different providers or contexts were mixed: {0}")]
    ProviderMismatch(String),
    /// The peer sent malformed data (bootstrap message or shared-ring record).
    #[error("protocol error from peer: {0}")]
    Protocol(String),
    /// Nobody listens at the address, or the listener turned the connection down (the
    /// `ECONNREFUSED` of connection set-up).
    #[error("connection refused: {0}")]
    Refused(String),
    /// The peer process is gone or its queue pair is no longer usable.
    #[error("peer unreachable: {0}")]
    PeerUnreachable(String),
    /// The provider cannot do this (the operation is valid, the device or provider lacks it).
    #[error("not supported by this provider: {0}")]
    Unsupported(String),
    /// A wait ran out of time.
    #[error("timed out after {0:?}")]
    Timeout(std::time::Duration),
    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Os {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

impl VerbsError {
    /// Wraps the current `errno` with a description of the failed step.
    pub(crate) fn last_os(context: impl Into<String>) -> Self {
        VerbsError::Os { context: context.into(), source: io::Error::last_os_error() }
    }
    pub(crate) fn os(context: impl Into<String>, source: io::Error) -> Self {
        VerbsError::Os { context: context.into(), source }
    }
    pub(crate) fn invalid(msg: impl Into<String>) -> Self {
        VerbsError::InvalidArgument(msg.into())
    }
}
