//! Runs the SDP benchmark end to end with tiny sizes: every table complete, every figure a
//! positive number.

use std::process::Command;

/// The numbers of each table row of the benchmark's output (not headers or comments).
fn table_rows(stdout: &str) -> Vec<Vec<f64>> {
    stdout
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty() && !l.contains("bsdp"))
        .map(|l| l.split_whitespace().filter_map(|w| w.parse::<f64>().ok()).collect())
        .collect()
}

#[test]
fn sdp_bench_runs_end_to_end() {
    let out = std::env::temp_dir().join(format!("sdp-bench-e2e-{}", std::process::id()));
    let run = Command::new(env!("CARGO_BIN_EXE_sdp_bench"))
        .args(["--max", "4096", "--iters", "60", "--volume", "400000", "--compute-us", "0,20"])
        .args(["--windows", "1,4", "--connections", "1,2"])
        .args(["--tests", "latency,throughput,overlap,window,hotspot,multi"])
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "sdp_bench failed: {}\n{stdout}", String::from_utf8_lossy(&run.stderr));
    let rows = table_rows(&stdout);
    // Latency: 8 B .. 4 KiB (10 rows); throughput: 1 KiB .. 4 KiB (3); overlap 2 x 2; fault
    // window 2 x 2; hot-spot 2 x 2; multi-stream 2; multi-client 2.
    assert_eq!(rows.len(), 10 + 3 + 4 + 4 + 4 + 2 + 2, "{stdout}");
    for r in &rows {
        let figures = &r[r.len() - 4..];
        assert!(figures.iter().all(|&x| x > 0.0 && x.is_finite()), "{r:?} in\n{stdout}");
    }
    let json = std::fs::read_to_string(out.join("results.json")).unwrap();
    assert_eq!(json.matches("\"key\"").count(), 10, "{json}");
    for key in ["latency", "throughput", "multi_client"] {
        let svg = std::fs::read_to_string(out.join(format!("{key}.svg"))).unwrap();
        assert_eq!(svg.matches("<polyline").count(), 4, "{key}.svg");
    }
    std::fs::remove_dir_all(&out).ok();
}

/// Runs `sdp_bench` with `args` (its results in a directory of its own) and returns its table
/// rows and output.
fn run_sdp_bench(name: &str, args: &[&str]) -> (Vec<Vec<f64>>, String) {
    let out = std::env::temp_dir().join(format!("sdp-bench-{name}-{}", std::process::id()));
    let run = Command::new(env!("CARGO_BIN_EXE_sdp_bench")).args(args).arg("--out").arg(&out).output().unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout).into_owned();
    assert!(run.status.success(), "sdp_bench failed: {}\n{stdout}", String::from_utf8_lossy(&run.stderr));
    std::fs::remove_dir_all(&out).ok();
    (table_rows(&stdout), stdout)
}

/// The idle test: one row, a CPU share per layer (TCP's may be 0: it sleeps in the kernel).
#[test]
fn sdp_bench_measures_an_idle_reader() {
    let (rows, stdout) = run_sdp_bench("idle", &["--tests", "idle"]);
    assert_eq!(rows.len(), 1, "{stdout}");
    assert_eq!(rows[0].len(), 5, "{stdout}");
    assert!(rows[0][1..].iter().all(|&x| (0.0..=100.0).contains(&x)), "{stdout}");
}

/// The idle-many test: a row per pair count, a CPU share of the process per layer.
#[test]
fn sdp_bench_measures_idle_connections() {
    let args = ["--tests", "idle-many", "--idle-pairs", "4", "--layers", "bsdp,tcp", "--repeat", "1"];
    let (rows, stdout) = run_sdp_bench("idle-many", &args);
    assert_eq!(rows.len(), 1, "{stdout}");
    assert_eq!(rows[0].len(), 3, "{stdout}");
    assert!(rows[0][1..].iter().all(|&x| (0.0..=100.0).contains(&x)), "{stdout}");
}
