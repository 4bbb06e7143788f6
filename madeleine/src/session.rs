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
use std::time::Duration;

use portability_verbs::datapath::{FlowStrategy, RegistrationCache};
use portability_verbs::{cm, Context, ProtectionDomain};

use crate::channel::{Channel, Conn};
use crate::{MadError, Result};

/// How a session is set up.
#[derive(Clone, Debug)]
pub struct SessionConfig {
    /// This process's rank, 0-based.
    pub rank: usize,
    /// Number of processes.
    pub size: usize,
    /// Directory of the rendezvous sockets (shared by the group; unused with `root`).
    pub rendezvous_dir: PathBuf,
    /// Rank 0's TCP address for a job across hosts (`MAD_ROOT=host:port` in `from_env`): rank
    /// 0 listens there, every rank registers its own TCP address and gets everyone's. Pairs on
    /// one host still talk through shared memory; pairs on different hosts over the software
    /// provider's TCP transport (or the hardware provider).
    pub root: Option<std::net::SocketAddr>,
    /// Meet through the launcher's PMIx server (Open MPI's `mpirun`, `srun --mpi=pmix`):
    /// every rank publishes the TCP address it listens on, at `listen_ip` (`MAD_LISTEN_IP`;
    /// default: the source address of this host's default route). `from_env` chooses it where
    /// the launcher set `PMIX_NAMESPACE` and `PMIX_RANK` and libpmix loads, unless
    /// `MAD_ROOT`, `MAD_RENDEZVOUS` or `MAD_BOOTSTRAP=dir|root` say otherwise
    /// (`MAD_BOOTSTRAP=pmix` insists).
    pub pmix: bool,
    /// The IP a rank publishes for its peers when meeting through PMIx.
    pub listen_ip: Option<std::net::IpAddr>,
    /// This job's key, sent in every connection handshake: a rank of another job that finds
    /// our sockets (the same directory, by mistake) is turned away, never connected. From the
    /// launcher's job id in `from_env`; empty by default.
    pub job: String,
    /// Flow control of the eager path (default: polled, the fewest instructions and shared
    /// cache lines per small message; `MAD_FLOW=credit|rdma|window|polled` overrides in
    /// `from_env`).
    pub strategy: FlowStrategy,
    /// How long set-up (connecting the ranks, a channel) waits for a peer.
    pub timeout: Duration,
    /// How long a blocking send or receive waits (None, the default: as long as it takes, as
    /// MPI's do; a peer that dies or closes still ends the wait with `PeerLost` or
    /// `PeerClosed`). `MAD_TIMEOUT` (seconds) in `from_env`.
    pub wait_limit: Option<Duration>,
    /// Packs of at least this many bytes go by rendezvous (None: chosen per connection by a
    /// probe of the transport at set-up, see [`Channel::rendezvous_threshold`]).
    pub rendezvous_threshold: Option<usize>,
    /// Bytes of each connection's inbound bulk ring (a power of two, at least 4 KiB; 0: no
    /// bulk lane). Packs too large for one eager message and below the rendezvous threshold
    /// are copied through it in chunks of a quarter of it, the sender's copy in and the
    /// receiver's copy out overlapping (`MAD_BULK_RING` in `from_env`).
    pub bulk_ring_bytes: usize,
    /// How a blocking call on an OS thread waits (a coroutine yields instead): by default it
    /// polls while its thread has a CPU to itself and sleeps on the connections' completion
    /// queues while more threads are ready to run than there are CPUs; or it spins for a fixed
    /// time. `MAD_SPIN_US` in `from_env`.
    pub spin: Spin,
}

/// How a blocking call on an OS thread waits for its event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spin {
    /// Poll while the thread has a CPU to itself (for up to 10 ms, after which a wake-up costs
    /// about 1% of the wait); while threads ready to run outnumber the CPUs (more ranks or
    /// threads than cores, looked at every millisecond), sleep after 1 ms. Waking a sleeping
    /// thread costs 30-280 us here against 0.3 us for a polled message, and a polling thread
    /// yields its CPU now and then: `benches/src/bin/mad_waiting.rs` measures the choice
    /// (docs/PERFORMANCE.md).
    Adaptive,
    /// Poll this long, then sleep: `Duration::ZERO` sleeps at once, `Duration::MAX` never
    /// sleeps.
    For(Duration),
}

impl SessionConfig {
    /// Explicit configuration.
    pub fn new(rank: usize, size: usize, rendezvous_dir: impl Into<PathBuf>) -> SessionConfig {
        SessionConfig {
            rank,
            size,
            rendezvous_dir: rendezvous_dir.into(),
            root: None,
            pmix: false,
            listen_ip: None,
            job: String::new(),
            strategy: FlowStrategy::POLLED,
            timeout: Duration::from_secs(30),
            wait_limit: None,
            rendezvous_threshold: None,
            bulk_ring_bytes: 2 << 20,
            spin: Spin::Adaptive,
        }
    }

    /// What a blocking call of this session may wait, and how.
    pub(crate) fn patience(&self) -> crate::wait::Patience {
        crate::wait::Patience { timeout: self.wait_limit.unwrap_or(Duration::MAX), spin: self.spin }
    }

    /// From the environment: `MAD_RANK`/`MAD_SIZE` if set (an override), else what the
    /// launcher set, in this order: Open MPI's `mpirun` (`OMPI_COMM_WORLD_RANK`/`_SIZE`), a
    /// PMI launcher (`PMI_RANK`/`PMI_SIZE`), Slurm's `srun` (`SLURM_PROCID`/`SLURM_NTASKS`;
    /// last, since `mpirun` inside an allocation inherits them); the directory from
    /// `MAD_RENDEZVOUS` (default: a directory under the temporary directory named after the
    /// job, `SLURM_JOB_ID` when there is one); the optional `MAD_RENDEZVOUS_THRESHOLD`, `MAD_TIMEOUT`,
    /// `MAD_BULK_RING`, `MAD_SPIN_US` and `MAD_FLOW`. A value that does not parse is an error
    /// naming the variable.
    pub fn from_env() -> Result<SessionConfig> {
        use portability_verbs::env;
        let get = |k: &str| env::text(k).map_err(MadError::from);
        let pairs = [
            ("MAD_RANK", "MAD_SIZE"),
            ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
            ("PMI_RANK", "PMI_SIZE"),
            ("SLURM_PROCID", "SLURM_NTASKS"),
        ];
        let mut found = None;
        for (r, s) in pairs {
            if let (Some(rank), Some(size)) = (env::parse::<usize>(r, "a rank")?, env::parse::<usize>(s, "a size")?) {
                found = Some((rank, size));
                break;
            }
        }
        let (rank, size) = found.ok_or_else(|| {
            MadError::Invalid("no rank and size in the environment (MAD_RANK/MAD_SIZE, OMPI_*, PMI_*, SLURM_*)".into())
        })?;
        // The job: what `madrun` says, else the launcher's job id (PMIx namespace, set by
        // Open MPI's mpirun and by srun --mpi=pmix; Slurm's job and step).
        let job = match (get("MAD_JOB")?, get("PMIX_NAMESPACE")?, get("SLURM_JOB_ID")?) {
            (Some(j), _, _) | (None, Some(j), _) => j,
            (None, None, Some(j)) => format!("{j}.{}", get("SLURM_STEP_ID")?.unwrap_or_default()),
            (None, None, None) => String::new(),
        };
        let dir = match get("MAD_RENDEZVOUS")? {
            Some(d) => PathBuf::from(d),
            None => {
                let name: String =
                    job.chars().map(|c| if c.is_ascii_alphanumeric() || c == '.' { c } else { '_' }).collect();
                let name = if name.is_empty() { "default".into() } else { name };
                std::env::temp_dir().join(format!("madeleine-{name}"))
            }
        };
        let mut cfg = SessionConfig::new(rank, size, dir);
        cfg.job = job;
        // The launcher's PMIx server unless told otherwise: it spans hosts, where a directory
        // does not.
        match get("MAD_BOOTSTRAP")?.as_deref() {
            None if get("MAD_RENDEZVOUS")?.is_none() && crate::pmix::offered() => {
                cfg.pmix = crate::pmix::load().is_some();
                if !cfg.pmix {
                    log::warn!("madeleine: the launcher offers PMIx but libpmix cannot be loaded: ranks meet through a directory, on this host only");
                }
            }
            None => {}
            Some("dir") | Some("root") => {}
            Some("pmix") => cfg.pmix = true,
            Some(v) => return Err(MadError::Invalid(format!("MAD_BOOTSTRAP={v:?}: dir, root or pmix"))),
        }
        if let Some(ip) = get("MAD_LISTEN_IP")? {
            cfg.listen_ip = Some(ip.parse().map_err(|_| MadError::Invalid(format!("MAD_LISTEN_IP={ip:?}: an IP")))?);
        }
        if let Some(root) = get("MAD_ROOT")? {
            use std::net::ToSocketAddrs;
            let addr = root.to_socket_addrs().ok().and_then(|mut a| a.next());
            cfg.root = Some(addr.ok_or_else(|| MadError::Invalid(format!("MAD_ROOT={root:?}: expected host:port")))?);
        }
        if let Some(t) = env::parse("MAD_RENDEZVOUS_THRESHOLD", "bytes")? {
            cfg.rendezvous_threshold = Some(t);
        }
        if let Some(secs) = env::parse::<f64>("MAD_TIMEOUT", "seconds")? {
            if !(secs > 0.0 && secs.is_finite()) {
                return Err(MadError::Invalid(format!("MAD_TIMEOUT={secs}: seconds, more than 0")));
            }
            cfg.wait_limit = Some(Duration::from_secs_f64(secs));
        }
        if let Some(v) = env::parse("MAD_BULK_RING", "bytes")? {
            cfg.bulk_ring_bytes = v;
        }
        if let Some(v) = get("MAD_SPIN_US")? {
            cfg.spin = parse_spin(&v)?;
        }
        if let Some(name) = get("MAD_FLOW")? {
            cfg.strategy = FlowStrategy::by_name(&name)
                .ok_or_else(|| MadError::Invalid(format!("MAD_FLOW={name:?}: credit, rdma, window or polled")))?;
        }
        Ok(cfg)
    }
}

/// A way of waiting as `MAD_SPIN_US` gives it: `auto`, microseconds, or `max` to never sleep.
fn parse_spin(v: &str) -> Result<Spin> {
    match v.trim() {
        "auto" => Ok(Spin::Adaptive),
        "max" => Ok(Spin::For(Duration::MAX)),
        us => us.parse::<u64>().map(|us| Spin::For(Duration::from_micros(us))).map_err(|_| {
            MadError::Invalid(format!(
                "MAD_SPIN_US={v:?}: \"auto\", microseconds of polling before sleeping, or \"max\" to never sleep"
            ))
        }),
    }
}

pub(crate) struct SessionInner {
    pub cfg: SessionConfig,
    pub ctx: Context,
    pub pd: ProtectionDomain,
    pub regcache: Arc<RegistrationCache>,
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
                cfg,
                ctx,
                pd,
                regcache,
                listener: Mutex::new(listener),
                peers,
                next_channel: Mutex::new(0),
                stash: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.inner.cfg.rank
    }

    /// Number of processes.
    pub fn size(&self) -> usize {
        self.inner.cfg.size
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
                conns[peer] = Some(Arc::new(Conn::establish(&self.inner, peer, conn)?));
            }
        }
        Ok(Channel::new(self.inner.clone(), id, conns))
    }

    /// Every connection's queue pair and completion queue.
    fn qp_spec(&self) -> cm::QpSpec {
        cm::QpSpec::with_depths(1024, 1024)
    }

    fn private(&self, channel: u32) -> Vec<u8> {
        let mut v = channel.to_le_bytes().to_vec();
        v.extend_from_slice(&(self.rank() as u64).to_le_bytes());
        v.extend_from_slice(&job_tag(&self.inner.cfg.job).to_le_bytes());
        v
    }

    fn connect(&self, channel: u32, peer: usize) -> Result<cm::Connection> {
        let addr = self.inner.peers[peer].clone();
        // The peer may not listen yet: ranks start together, not in order.
        let conn = cm::connect_retrying(
            &addr,
            &self.inner.pd,
            &self.qp_spec(),
            &self.private(channel),
            self.inner.cfg.timeout,
        )?;
        Ok(conn)
    }

    fn accept(&self, channel: u32, peer: usize) -> Result<cm::Connection> {
        let deadline = std::time::Instant::now() + self.inner.cfg.timeout;
        loop {
            if let Some(c) = self.inner.stash.lock().expect("stash").remove(&(channel, peer)) {
                return Ok(c);
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(MadError::Timeout(format!("rank {peer} never connected for channel {channel}")));
            }
            let conn = self.inner.listener.lock().expect("listener").accept(
                &self.inner.pd,
                &self.qp_spec(),
                &self.private(channel),
                left,
            )?;
            let p = &conn.peer_private;
            let ours = job_tag(&self.inner.cfg.job).to_le_bytes();
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `mpirun` inside a Slurm allocation: the process inherits `SLURM_PROCID` of the
    /// allocation's one task, and Open MPI's own variables must win. `MAD_*` overrides both;
    /// a variable that does not parse is an error naming it.
    #[test]
    fn launcher_variables_by_precedence_and_strictly_parsed() {
        let set = |vars: &[(&str, &str)]| {
            for k in
                ["MAD_RANK", "MAD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"]
            {
                std::env::remove_var(k);
            }
            for (k, v) in vars {
                std::env::set_var(k, v);
            }
        };
        set(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
        ]);
        let c = SessionConfig::from_env().unwrap();
        assert_eq!((c.rank, c.size), (3, 4));
        set(&[("OMPI_COMM_WORLD_RANK", "3"), ("OMPI_COMM_WORLD_SIZE", "4"), ("MAD_RANK", "1"), ("MAD_SIZE", "2")]);
        let c = SessionConfig::from_env().unwrap();
        assert_eq!((c.rank, c.size), (1, 2));
        set(&[("MAD_RANK", "one"), ("MAD_SIZE", "2")]);
        let e = SessionConfig::from_env().unwrap_err().to_string();
        assert!(e.contains("MAD_RANK"), "{e}");
        set(&[]);
    }

    #[test]
    fn the_spin_phase_is_microseconds_or_max_and_anything_else_is_refused() {
        assert_eq!(parse_spin("0").unwrap(), Spin::For(Duration::ZERO));
        assert_eq!(parse_spin(" 150 ").unwrap(), Spin::For(Duration::from_micros(150)));
        assert_eq!(parse_spin("max").unwrap(), Spin::For(Duration::MAX));
        assert_eq!(parse_spin("auto").unwrap(), Spin::Adaptive);
        for bad in ["", "-1", "1.5", "200us", "forever"] {
            let e = parse_spin(bad).unwrap_err().to_string();
            assert!(e.contains("MAD_SPIN_US"), "{bad:?}: {e}");
        }
        assert_eq!(SessionConfig::new(0, 1, "").spin, Spin::Adaptive);
    }
}
