//! Sessions: this process's membership in a group (rank, size), and the out-of-band rendezvous
//! that connects every pair of processes for each channel.
//!
//! The rendezvous goes through a directory every process can reach (a shared file system, or
//! `/tmp` on one host): rank `r` listens on `DIR/rank-r.sock`; or, for jobs across hosts,
//! through rank 0 at a TCP address (`root`, see `rendezvous`): every rank listens on a TCP port
//! and learns the others' from rank 0. For each pair the higher rank connects to the lower. Channels are created collectively, in the same order everywhere, and
//! pairs are connected in one global order, which cannot deadlock.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use portability_verbs::datapath::RegistrationCache;
use portability_verbs::{cm, Context};

use crate::channel::{Channel, Conn};
use crate::config::SessionConfig;
use crate::resources::Resources;
use crate::{MadError, Result};

pub(crate) struct SessionInner {
    pub res: Arc<Resources>,
    listener: Mutex<cm::Listener>,
    /// Where each rank listens.
    peers: Vec<cm::CmAddr>,
    next_channel: Mutex<u32>,
    /// Connections accepted ahead of their turn: (channel, rank) -> connection.
    stash: Mutex<HashMap<(u32, usize), cm::Connection>>,
}

/// A process's membership in a group.
#[derive(Clone)]
pub struct Session {
    pub(crate) inner: Arc<SessionInner>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").field("rank", &self.rank()).field("size", &self.size()).finish_non_exhaustive()
    }
}

/// What a handshake carries of the job key (FNV-1a: a mix, not a secret).
fn job_tag(job: &str) -> u64 {
    job.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

fn sock(dir: &std::path::Path, rank: usize) -> PathBuf {
    dir.join(format!("rank-{rank}.sock"))
}

impl Session {
    /// Joins the group described by `cfg` (starts listening; connections are made per channel).
    pub fn new(cfg: SessionConfig) -> Result<Session> {
        if cfg.size == 0 || cfg.rank >= cfg.size {
            return Err(MadError::Invalid(format!("rank {} outside a group of {}", cfg.rank, cfg.size)));
        }
        let ctx = Context::open_default()?;
        let pd = ctx.alloc_pd()?;
        let (listener, peers) = match cfg.root {
            Some(root) => {
                let listener = cm::Listener::bind(&cm::CmAddr::Tcp(std::net::SocketAddr::from(([0, 0, 0, 0], 0))))?;
                let cm::CmAddr::Tcp(local) = listener.local_addr().clone() else {
                    unreachable!("a TCP listener has a TCP address")
                };
                let me = crate::rendezvous::Registration {
                    job_tag: job_tag(&cfg.job),
                    rank: cfg.rank,
                    size: cfg.size,
                    addr: local,
                };
                let table = crate::rendezvous::exchange(root, me, cfg.timeout)?;
                (listener, table.into_iter().map(cm::CmAddr::Tcp).collect())
            }
            None if cfg.pmix => {
                let listener = cm::Listener::bind(&cm::CmAddr::Tcp(std::net::SocketAddr::from(([0, 0, 0, 0], 0))))?;
                let cm::CmAddr::Tcp(local) = listener.local_addr().clone() else {
                    unreachable!("a TCP listener has a TCP address")
                };
                let ip = cfg.listen_ip.unwrap_or_else(crate::pmix::local_ip);
                let table = crate::pmix::exchange(
                    std::net::SocketAddr::new(ip, local.port()),
                    cfg.rank,
                    cfg.size,
                    cfg.timeout,
                )?;
                (listener, table.into_iter().map(cm::CmAddr::Tcp).collect())
            }
            None => {
                std::fs::create_dir_all(&cfg.rendezvous_dir).map_err(|e| {
                    MadError::Invalid(format!("rendezvous directory {}: {e}", cfg.rendezvous_dir.display()))
                })?;
                let listener = cm::Listener::bind(&cm::CmAddr::Unix(sock(&cfg.rendezvous_dir, cfg.rank)))?;
                let peers = (0..cfg.size).map(|r| cm::CmAddr::Unix(sock(&cfg.rendezvous_dir, r))).collect();
                (listener, peers)
            }
        };
        let regcache = Arc::new(RegistrationCache::new(&pd, 1 << 30));
        Ok(Session {
            inner: Arc::new(SessionInner {
                res: Arc::new(Resources::new(cfg, ctx, pd, regcache)),
                listener: Mutex::new(listener),
                peers,
                next_channel: Mutex::new(0),
                stash: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.inner.res.cfg.rank
    }

    /// Number of processes.
    pub fn size(&self) -> usize {
        self.inner.res.cfg.size
    }

    /// Opens the next channel: collective, every process calls it in the same order. Connects
    /// this process to every other one for the channel.
    pub fn channel(&self) -> Result<Channel> {
        let id = {
            let mut n = self.inner.next_channel.lock().expect("channel counter");
            *n += 1;
            *n
        };
        let (rank, size) = (self.rank(), self.size());
        let mut conns: Vec<Option<Arc<Conn>>> = (0..size).map(|_| None).collect();
        // Every pair in one global order (i < j): no cycle of waits.
        for i in 0..size {
            for j in i + 1..size {
                if i != rank && j != rank {
                    continue;
                }
                let peer = if i == rank { j } else { i };
                let conn = if rank == j { self.connect(id, peer)? } else { self.accept(id, peer)? };
                conns[peer] = Some(Arc::new(Conn::establish(&self.inner.res, peer, conn)?));
            }
        }
        Ok(Channel::new(self.inner.res.clone(), id, conns))
    }

    /// Every connection's queue pair and completion queue.
    fn qp_spec(&self) -> cm::QpSpec {
        cm::QpSpec::with_depths(1024, 1024)
    }

    fn private(&self, channel: u32) -> Vec<u8> {
        let mut v = channel.to_le_bytes().to_vec();
        v.extend_from_slice(&(self.rank() as u64).to_le_bytes());
        v.extend_from_slice(&job_tag(&self.inner.res.cfg.job).to_le_bytes());
        v
    }

    fn connect(&self, channel: u32, peer: usize) -> Result<cm::Connection> {
        let addr = self.inner.peers[peer].clone();
        // The peer may not listen yet: ranks start together, not in order.
        let conn = cm::connect_retrying(
            &addr,
            &self.inner.res.pd,
            &self.qp_spec(),
            &self.private(channel),
            self.inner.res.cfg.timeout,
        )?;
        Ok(conn)
    }

    fn accept(&self, channel: u32, peer: usize) -> Result<cm::Connection> {
        let deadline = std::time::Instant::now() + self.inner.res.cfg.timeout;
        loop {
            if let Some(c) = self.inner.stash.lock().expect("stash").remove(&(channel, peer)) {
                return Ok(c);
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(MadError::Timeout(format!("rank {peer} never connected for channel {channel}")));
            }
            let conn = self.inner.listener.lock().expect("listener").accept(
                &self.inner.res.pd,
                &self.qp_spec(),
                &self.private(channel),
                left,
            )?;
            let p = &conn.peer_private;
            let ours = job_tag(&self.inner.res.cfg.job).to_le_bytes();
            if p.len() != 20 || p[12..20] != ours {
                // A rank of another job (or no rank at all): turned away, never connected.
                log::warn!("madeleine: turned away a connection that is not of this job");
                continue;
            }
            let ch = u32::from_le_bytes(p[0..4].try_into().expect("4 bytes"));
            let from = u64::from_le_bytes(p[4..12].try_into().expect("8 bytes")) as usize;
            if from >= self.size() || from <= self.rank() {
                return Err(MadError::Protocol {
                    rank: from,
                    why: format!("connection from rank {from} not expected here"),
                });
            }
            if (ch, from) == (channel, peer) {
                return Ok(conn);
            }
            self.inner.stash.lock().expect("stash").insert((ch, from), conn);
        }
    }
}
