//! The peers measured by C programs of ours, compiled at the run's first use and started for
//! each of the layer's blocks, pinned as ours are, while ours sleep: Open MPI's point-to-point
//! over its default shared-memory path (`ob1` with the `vader` BTL; `benches/peers/
//! mpi_pingpong.c`, two ranks by `mpirun`) and libfabric's `shm` provider (reliable-datagram
//! messages; `benches/peers/fi_pingpong.c`, a process and the child it forks). Both print the
//! median and 99th percentile of the one-way latency (`lat`) or the bandwidth of windows of 64
//! messages (`bw`).

use std::sync::OnceLock;

use crate::*;

/// How long one run of a peer's program may take before the run fails.
const PEER_LIMIT: Duration = Duration::from_secs(120);

/// A peer measured by a C program of ours.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CPeer {
    /// Open MPI, `ob1`/`vader`.
    Mpi,
    /// libfabric, the `shm` provider.
    Libfabric,
}

fn on_path(p: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|path| std::env::split_paths(&path).any(|d| d.join(p).is_file()))
}

impl CPeer {
    fn name(self) -> &'static str {
        match self {
            CPeer::Mpi => "mpi",
            CPeer::Libfabric => "libfabric",
        }
    }

    /// What building and running it needs, if something is missing (with the Debian packages).
    pub(crate) fn missing(self) -> Option<&'static str> {
        match self {
            CPeer::Mpi if !(on_path("mpicc") && on_path("mpirun")) => {
                Some("the mpi layer needs mpicc and mpirun on the PATH (Debian: libopenmpi-dev)")
            }
            CPeer::Libfabric if !(on_path("cc") && std::path::Path::new("/usr/include/rdma/fabric.h").is_file()) => {
                Some("the libfabric layer needs cc and libfabric's headers (Debian: libfabric-dev)")
            }
            _ => None,
        }
    }

    /// The program, compiled once per run.
    fn program(self) -> Result<&'static std::path::Path, String> {
        static BUILT: [OnceLock<Result<std::path::PathBuf, String>>; 2] = [OnceLock::new(), OnceLock::new()];
        BUILT[self as usize]
            .get_or_init(|| {
                let exe = std::env::temp_dir().join(format!("stack-bench-{}-{}", self.name(), std::process::id()));
                let (compiler, src, libs): (_, _, &[&str]) = match self {
                    CPeer::Mpi => ("mpicc", concat!(env!("CARGO_MANIFEST_DIR"), "/peers/mpi_pingpong.c"), &[]),
                    CPeer::Libfabric => {
                        ("cc", concat!(env!("CARGO_MANIFEST_DIR"), "/peers/fi_pingpong.c"), &["-lfabric"])
                    }
                };
                let out = Command::new(compiler)
                    .args(["-O2", "-o"])
                    .arg(&exe)
                    .arg(src)
                    .args(libs)
                    .output()
                    .map_err(|e| format!("running {compiler}: {e}"))?;
                if !out.status.success() {
                    return Err(format!("{compiler} {src}: {}", String::from_utf8_lossy(&out.stderr).trim()));
                }
                Ok(exe)
            })
            .as_ref()
            .map(|p| p.as_path())
            .map_err(|e| e.clone())
    }

    /// Runs the program's `test` (`lat` or `bw`) for `n` iterations after `warm`, its two
    /// processes on `cpus` (client, server) if given.
    pub(crate) fn run(
        self,
        test: &str,
        size: usize,
        n: u64,
        warm: u64,
        cpus: Option<(usize, usize)>,
    ) -> Result<PeerResult, String> {
        let exe = self.program()?;
        let tag = format!("{}-{}-{test}-{size}", self.name(), std::process::id());
        // Open MPI's session files in a directory of this run's own: jobs started at the same
        // moment in a shared one can race over it (open-mpi/ompi#8510).
        let session_dir = std::env::temp_dir().join(format!("stack-bench-{tag}.ompi"));
        let mut c = match self {
            CPeer::Mpi => {
                std::fs::create_dir_all(&session_dir).map_err(|e| format!("{}: {e}", session_dir.display()))?;
                let mut c = Command::new("mpirun");
                c.args(["--allow-run-as-root", "-np", "2", "--bind-to", "none"])
                    .arg("--mca")
                    .arg("orte_tmpdir_base")
                    .arg(&session_dir)
                    .args(["--mca", "pml", "ob1", "--mca", "btl", "self,vader"]);
                if cpus.is_some() {
                    c.args(["-x", "STACK_BENCH_CPUS"]);
                }
                c.arg(exe);
                c
            }
            CPeer::Libfabric => Command::new(exe),
        };
        if let Some((a, b)) = cpus {
            c.env("STACK_BENCH_CPUS", format!("{a},{b}"));
        }
        let log = std::env::temp_dir().join(format!("stack-bench-{tag}.out"));
        c.args([test, &size.to_string(), &n.max(1).to_string(), &warm.to_string()]);
        let ran = run_captured(&mut c, &log, PEER_LIMIT);
        let _ = std::fs::remove_file(&log);
        let _ = std::fs::remove_dir_all(&session_dir);
        let (status, out) = ran?;
        let name = self.name();
        match status {
            Some(st) if st.success() => {}
            Some(st) => return Err(format!("{name} {test} {size} failed ({st}): {}", out.trim())),
            None => return Err(format!("{name} {test} {size} took over {PEER_LIMIT:?}")),
        }
        // The last line of figures: the median and the 99th percentile (`lat`), or the
        // bandwidth (`bw`).
        let figures: Vec<f64> = out
            .lines()
            .filter_map(|l| l.split_whitespace().map(str::parse).collect::<Result<Vec<f64>, _>>().ok())
            .rfind(|v| !v.is_empty())
            .filter(|v| v.iter().all(|x| x.is_finite() && *x > 0.0))
            .ok_or_else(|| format!("{name} {test} {size} printed no figure: {}", out.trim()))?;
        match (test, figures.as_slice()) {
            ("lat", &[p50_us, p99_us]) => Ok(PeerResult { p50_us, p99_us: Some(p99_us), gbps: 0.0 }),
            ("bw", &[gbps]) => Ok(PeerResult { p50_us: 0.0, p99_us: None, gbps }),
            _ => Err(format!("{name} {test} {size}: unexpected figures {figures:?}")),
        }
    }
}
