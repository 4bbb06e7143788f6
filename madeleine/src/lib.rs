//! # madeleine
//!
//! The Madeleine pack/unpack messaging API over `portability-verbs` (channels, connections,
//! send modes SAFER/LATER/CHEAPER, receive modes EXPRESS/CHEAPER). Not built yet: this crate
//! reserves the name and the place in the workspace; see `docs/ARCHITECTURE.md`.
