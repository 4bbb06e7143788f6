//! Data-path building blocks shared by Madeleine and the SDP sockets: a pipelined pool of
//! pre-registered buffers, a registration cache, flow control, and copy/zero-copy crossover
//! tuning. Each lives in one module and is reused, never rewritten, by the upper layers.

pub mod crossover;
pub mod fc;
pub mod pipe;
pub mod pool;
pub mod regcache;
pub mod signals;

pub use crossover::{AdaptiveCrossover, CopyOut, Crossover, CrossoverSource, Stores};
pub use pipe::{FlowStrategy, Lane, MsgPipe, NoticeBoard, PipeOptions, PipeStats, NOTICE_WORDS};
pub use pool::{BufferPool, PoolBuf, PoolStats};
pub use regcache::{CacheStats, CachedBuffer, Registration, RegistrationCache};
