//! What an EXS call can fail with, and the `errno` value each failure is in C.

use thiserror::Error;

use super::proto::Errno;

/// A failed EXS call.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ExsError {
    /// An argument out of range or a flag not supported.
    #[error("invalid argument: {0}")]
    Invalid(&'static str),
    /// The buffer does not lie inside the memory region passed with it.
    #[error("buffer outside its memory region")]
    OutsideRegion,
    /// The event queue has no room for the completion of another operation.
    #[error("event queue full")]
    QueueFull,
    /// The object still has operations in flight.
    #[error("{0} still has operations in flight")]
    Busy(&'static str),
    /// The socket is not in a state that allows the call.
    #[error("{what}")]
    State {
        /// What is wrong.
        what: &'static str,
        /// Its errno.
        errno: Errno,
    },
    /// The connection failed or was closed (the error number of the failure).
    #[error("connection: {}", std::io::Error::from_raw_os_error(*.0))]
    Connection(Errno),
    /// The operating system or the verbs layer refused.
    #[error("{0}")]
    System(String, Errno),
}

impl ExsError {
    /// The `errno` value the C API sets.
    pub fn errno(&self) -> Errno {
        match self {
            ExsError::Invalid(_) => libc::EINVAL,
            ExsError::OutsideRegion => libc::EFAULT,
            ExsError::QueueFull => libc::EAGAIN,
            ExsError::Busy(_) => libc::EBUSY,
            ExsError::State { errno, .. } => *errno,
            ExsError::Connection(e) => *e,
            ExsError::System(_, e) => *e,
        }
    }

    pub(crate) fn state(what: &'static str, errno: Errno) -> ExsError {
        ExsError::State { what, errno }
    }

    pub(crate) fn io(e: std::io::Error) -> ExsError {
        let errno = e.raw_os_error().unwrap_or(libc::EIO);
        ExsError::System(e.to_string(), errno)
    }

    pub(crate) fn verbs(e: portability_verbs::VerbsError) -> ExsError {
        use portability_verbs::VerbsError as V;
        let errno = match &e {
            V::Timeout(_) => libc::ETIMEDOUT,
            V::PeerUnreachable(_) => libc::ECONNREFUSED,
            V::Refused(_) => libc::ECONNREFUSED,
            V::Protocol(_) => libc::EPROTO,
            V::InvalidArgument(_) => libc::EINVAL,
            V::Os { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            _ => libc::EIO,
        };
        ExsError::System(e.to_string(), errno)
    }
}

/// A result of an EXS call.
pub type ExsResult<T> = Result<T, ExsError>;
