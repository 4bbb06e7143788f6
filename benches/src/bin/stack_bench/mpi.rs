//! The `mpi` layer: Open MPI's point-to-point over its default shared-memory path (`ob1` with
//! the `vader` BTL), measured by `benches/peers/mpi_pingpong.c` (compiled with `mpicc` at the
//! run's first use), two ranks started by `mpirun` for each block, pinned as ours are.

use std::sync::OnceLock;

use crate::*;

/// How long one MPI run may take before the run fails.
const MPI_LIMIT: Duration = Duration::from_secs(120);

/// Whether `mpicc` and `mpirun` are on the PATH.
pub(crate) fn mpi_found() -> bool {
    let on_path = |p: &str| {
        std::env::var_os("PATH").is_some_and(|path| std::env::split_paths(&path).any(|d| d.join(p).is_file()))
    };
    on_path("mpicc") && on_path("mpirun")
}

/// The ping-pong program, compiled once per run.
fn program() -> Result<&'static std::path::Path, String> {
    static BUILT: OnceLock<Result<std::path::PathBuf, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let src = concat!(env!("CARGO_MANIFEST_DIR"), "/peers/mpi_pingpong.c");
            let exe = std::env::temp_dir().join(format!("stack-bench-mpi-{}", std::process::id()));
            let out = Command::new("mpicc")
                .args(["-O2", "-o"])
                .arg(&exe)
                .arg(src)
                .output()
                .map_err(|e| format!("running mpicc: {e}"))?;
            if !out.status.success() {
                return Err(format!("mpicc {src}: {}", String::from_utf8_lossy(&out.stderr).trim()));
            }
            Ok(exe)
        })
        .as_ref()
        .map(|p| p.as_path())
        .map_err(|e| e.clone())
}

/// Runs the MPI program's `test` (`lat` or `bw`) for `n` iterations after `warm`, the ranks on
/// `cpus` (client, server) if given.
pub(crate) fn run_mpi(
    test: &str,
    size: usize,
    n: u64,
    warm: u64,
    cpus: Option<(usize, usize)>,
) -> Result<PeerResult, String> {
    let exe = program()?;
    let mut c = Command::new("mpirun");
    c.args([
        "--allow-run-as-root",
        "-np",
        "2",
        "--bind-to",
        "none",
        "--mca",
        "pml",
        "ob1",
        "--mca",
        "btl",
        "self,vader",
    ]);
    if let Some((a, b)) = cpus {
        c.env("STACK_BENCH_CPUS", format!("{a},{b}")).args(["-x", "STACK_BENCH_CPUS"]);
    }
    let log = std::env::temp_dir().join(format!("stack-bench-mpi-{}-{test}-{size}.out", std::process::id()));
    c.arg(exe).args([test, &size.to_string(), &n.max(1).to_string(), &warm.to_string()]);
    let (status, out) = run_captured(&mut c, &log, MPI_LIMIT)?;
    let _ = std::fs::remove_file(&log);
    match status {
        Some(st) if st.success() => {}
        Some(st) => return Err(format!("mpirun {test} {size} failed ({st}): {}", out.trim())),
        None => return Err(format!("mpirun {test} {size} took over {MPI_LIMIT:?}")),
    }
    let value: f64 = out
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .next_back()
        .filter(|v: &f64| v.is_finite() && *v > 0.0)
        .ok_or_else(|| format!("mpirun {test} {size} printed no figure: {}", out.trim()))?;
    Ok(if test == "lat" { PeerResult { p50_us: value, gbps: 0.0 } } else { PeerResult { p50_us: 0.0, gbps: value } })
}
