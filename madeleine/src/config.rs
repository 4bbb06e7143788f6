//! How a session is set up: rank and size, the rendezvous, the job key, the transport's
//! strategy and sizes, and how calls wait, from the launcher's variables or given directly.

use std::path::PathBuf;
use std::time::Duration;

use portability_verbs::datapath::FlowStrategy;

use crate::wait::{Patience, Spin};
use crate::{MadError, Result};

/// Madeleine's eager path: the polled strategy with a 512 KiB ring, so that a stream of
/// small messages rarely waits for the reader's acknowledgements (decision 028).
pub(crate) const POLLED: FlowStrategy = FlowStrategy::Polled { ring_bytes: 512 * 1024, coalesce: 4096 };

/// Madeleine's largest polled frame, whatever the ring: a 64 KiB ring's (16 KiB less its
/// framing), so that a message of one 8 KiB pack goes as one frame written from the
/// application's buffer, as a 4 KiB one does, instead of through the bulk lane (decision
/// 025), while larger packs keep the bulk lane, which pipelines them (decision 028).
pub(crate) const FRAME_MAX: usize = FlowStrategy::Polled { ring_bytes: 64 * 1024, coalesce: 4096 }.max_message();

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
    /// Flow control of the eager path (default: polled with a 512 KiB ring, the fewest
    /// instructions and shared cache lines per small message; `MAD_FLOW=credit|rdma|window|polled`
    /// overrides in `from_env`). A polled ring's frames carry at most 16 KiB here, whatever its
    /// size.
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
    /// How long a blocking send offers a bulk pack of 16 KiB or more to a receiver on this
    /// host before copying it (zero: never offers). A receiver waiting for the message claims
    /// it and reads it in one copy; one that comes later gets it copied, and the sender has
    /// waited this long (`MAD_OFFER_US` in `from_env`; decision 030).
    pub offer_patience: Duration,
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
            strategy: POLLED,
            timeout: Duration::from_secs(30),
            wait_limit: None,
            rendezvous_threshold: None,
            bulk_ring_bytes: 2 << 20,
            spin: Spin::Adaptive,
            offer_patience: crate::protocol::offer::OFFER_PATIENCE,
        }
    }

    /// What a blocking call of this session may wait, and how.
    pub(crate) fn patience(&self) -> Patience {
        Patience { timeout: self.wait_limit.unwrap_or(Duration::MAX), spin: self.spin }
    }

    /// From the environment: `MAD_RANK`/`MAD_SIZE` if set (an override), else what the
    /// launcher set, in this order: Open MPI's `mpirun` (`OMPI_COMM_WORLD_RANK`/`_SIZE`), a
    /// PMI launcher (`PMI_RANK`/`PMI_SIZE`), Slurm's `srun` (`SLURM_PROCID`/`SLURM_NTASKS`;
    /// last, since `mpirun` inside an allocation inherits them); the directory from
    /// `MAD_RENDEZVOUS` (default: a directory under the temporary directory named after the
    /// job, `SLURM_JOB_ID` when there is one); the optional `MAD_RENDEZVOUS_THRESHOLD`,
    /// `MAD_TIMEOUT`, `MAD_BULK_RING`, `MAD_SPIN_US`, `MAD_OFFER_US` and `MAD_FLOW`. A value
    /// that does not parse is an error naming the variable.
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
        if let Some(us) = env::parse::<u64>("MAD_OFFER_US", "microseconds")? {
            cfg.offer_patience = Duration::from_micros(us);
        }
        if let Some(name) = get("MAD_FLOW")? {
            cfg.strategy = (name == "polled")
                .then_some(POLLED)
                .or_else(|| FlowStrategy::by_name(&name))
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// `mpirun` inside a Slurm allocation: the process inherits `SLURM_PROCID` of the
    /// allocation's one task, and Open MPI's own variables must win. `MAD_*` overrides both;
    /// a variable that does not parse is an error naming it.
    #[test]
    fn launcher_variables_by_precedence_and_strictly_parsed() {
        let set = |vars: &[(&str, &str)]| {
            for k in [
                "MAD_RANK",
                "MAD_SIZE",
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "SLURM_PROCID",
                "SLURM_NTASKS",
                "MAD_OFFER_US",
            ] {
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
        // Offers: microseconds of patience, 0 for none.
        let patience = |v: &str| {
            set(&[("MAD_RANK", "0"), ("MAD_SIZE", "1"), ("MAD_OFFER_US", v)]);
            SessionConfig::from_env().map(|c| c.offer_patience)
        };
        assert_eq!(patience("0").unwrap(), Duration::ZERO);
        assert_eq!(patience("150").unwrap(), Duration::from_micros(150));
        assert!(patience("20us").unwrap_err().to_string().contains("MAD_OFFER_US"));
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
