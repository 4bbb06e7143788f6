//! # sockets-compat
//!
//! Sockets Direct Protocol stream sockets (buffer-copy, zero-copy, asynchronous zero-copy) over
//! `portability-verbs`. Not built yet: this crate reserves the name and the place in the
//! workspace; see `docs/ARCHITECTURE.md`.
