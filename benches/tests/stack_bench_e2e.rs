//! Runs the main benchmark end to end with tiny sizes, so it cannot silently rot: its output
//! must be complete and well formed, and bad arguments must give a clear usage error.

use std::path::Path;
use std::process::{Command, Output};

/// Runs the benchmark with `args`, without pinning, its results in `out`.
fn stack_bench(args: &[&str], out: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_stack_bench")).args(args).arg("--no-pin").arg("--out").arg(out).output().unwrap()
}

#[test]
fn runs_end_to_end_and_writes_complete_results() {
    let out = std::env::temp_dir().join(format!("stack-bench-e2e-{}", std::process::id()));
    // A generous duration cap: a loaded machine slows the debug build's sweeps a lot.
    let run = stack_bench(
        &["--max-size", "4096", "--iters", "40", "--warmup", "5", "--stream-bytes", "200000", "--duration-cap", "300"],
        &out,
    );
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "stack_bench failed: {}\n{stdout}", String::from_utf8_lossy(&run.stderr));
    let layers = ["raw-send", "raw-wwi", "madeleine", "mad-copy", "mad-zcopy", "tcp", "sdp"];
    let sizes = 13; // 1 B .. 4 KiB
    for l in layers {
        let rows = stdout.lines().filter(|line| line.split_whitespace().next() == Some(l)).count();
        assert_eq!(rows, sizes, "{l} rows in:\n{stdout}");
    }
    let csv = std::fs::read_to_string(out.join("results.csv")).unwrap();
    assert_eq!(csv.lines().count(), 1 + layers.len() * sizes);
    for line in csv.lines().skip(1) {
        // layer,size,median_us,p99_us,minus_raw_us,gbps,mb_per_cpu_s,minus_ucx_us
        let f: Vec<&str> = line.split(',').collect();
        assert_eq!(f.len(), 8, "{line}");
        assert_eq!(f[7], "", "no ucx layer ran: {line}");
        for (i, v) in f.iter().enumerate().skip(1).take(6) {
            if i == 4 {
                // Raw SEND/RECV has no difference to itself; the others' may be negative.
                let x: Option<f64> = (!v.is_empty()).then(|| v.parse().unwrap());
                assert_eq!(x.is_none(), f[0] == "raw-send", "{line}");
                assert!(x.is_none_or(f64::is_finite), "{line}");
                continue;
            }
            let x: f64 = v.parse().unwrap_or_else(|_| panic!("not a number in {line}"));
            assert!(x.is_finite() && x >= 0.0, "{line}");
        }
        let lat: f64 = f[2].parse().unwrap();
        assert!(lat > 0.0, "a latency of zero measures nothing: {line}");
    }
    assert!(stdout.contains("crossover chosen"), "{stdout}");
    let json = std::fs::read_to_string(out.join("results.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&json).expect("valid JSON");
    assert!(json["meta"]["host"]["cpus"].as_u64().is_some_and(|n| n >= 1), "{json}");
    assert!(json["meta"]["command"].as_array().is_some_and(|c| c.iter().any(|a| a == "--max-size")), "{json}");
    assert!(json["settings"]["timer_ns"].is_number(), "{json}");
    let rows = json["results"].as_array().expect("the points");
    assert_eq!(rows.len(), layers.len() * sizes);
    assert_eq!(rows.iter().filter(|r| r["minus_raw_us"].is_null()).count(), sizes, "raw-send's own rows only");
    for svg in ["latency.svg", "bandwidth.svg"] {
        let s = std::fs::read_to_string(out.join(svg)).unwrap();
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"), "{svg}");
        // One line per layer, each with a point per size.
        assert_eq!(s.matches("<polyline").count(), layers.len(), "{svg}");
        for line in s.lines().filter(|l| l.starts_with("<polyline")) {
            let points = line.split("points=\"").nth(1).unwrap().split('"').next().unwrap();
            assert_eq!(points.split_whitespace().count(), sizes, "{svg}: {line}");
        }
    }
    let _ = std::fs::remove_dir_all(out);
}

#[test]
fn layers_outside_the_default_run_too_with_messages_over_several_pipe_messages() {
    // The pipe layer splits 32 KiB over 2 KiB pipe messages: the last of a reply is coalesced
    // behind the ones in flight, and must still leave while the server serves another link.
    let out = std::env::temp_dir().join(format!("stack-bench-layers-{}", std::process::id()));
    let run = stack_bench(
        &[
            "--layers",
            "raw-send,pipe,madeleine",
            "--min-size",
            "32768",
            "--max-size",
            "32768",
            "--iters",
            "40",
            "--warmup",
            "5",
            "--stream-bytes",
            "400000",
            "--rounds",
            "3",
            "--duration-cap",
            "300",
        ],
        &out,
    );
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "stack_bench failed: {}\n{stdout}", String::from_utf8_lossy(&run.stderr));
    for l in ["raw-send", "pipe", "madeleine"] {
        let rows = stdout.lines().filter(|line| line.split_whitespace().next() == Some(l)).count();
        assert_eq!(rows, 1, "{l} rows in:\n{stdout}");
    }
    let _ = std::fs::remove_dir_all(out);
}

/// UCX's ucx_perftest runs as a layer in the same rounds as ours (CI installs it); without
/// it, asking for the layer is a clear error.
#[test]
fn the_ucx_layer_runs_in_the_same_rounds_as_ours() {
    let out = std::env::temp_dir().join(format!("stack-bench-ucx-{}", std::process::id()));
    let args = ["--layers", "raw-send,madeleine,ucx", "--min-size", "8", "--max-size", "64", "--iters", "200"];
    // UCX's blocks run long enough for its steady state whatever the sizes asked (and try two
    // transport sets): no duration cap may cut a size on a loaded machine.
    let run = stack_bench(
        &[&args[..], &["--rounds", "2", "--stream-bytes", "200000", "--duration-cap", "600"]].concat(),
        &out,
    );
    let (stdout, stderr) = (String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    let found = std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join("ucx_perftest").is_file()));
    if !found {
        assert!(!run.status.success() && stderr.contains("needs ucx_perftest"), "{stderr}");
        return;
    }
    assert!(run.status.success(), "stack_bench failed: {stderr}\n{stdout}");
    assert!(stdout.contains("-ucx us"), "{stdout}");
    let csv = std::fs::read_to_string(out.join("results.csv")).unwrap();
    let sizes = 4; // 8 .. 64 B
    assert_eq!(csv.lines().count(), 1 + 3 * sizes, "{csv}");
    for line in csv.lines().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        let num = |i: usize| -> Option<f64> { (!f[i].is_empty()).then(|| f[i].parse().unwrap()) };
        assert!(num(2).is_some_and(|l| l > 0.0) && num(5).is_some_and(|b| b > 0.0), "{line}");
        if f[0] == "ucx" {
            // Its p99 comes from a second run (`-R 99`), which the host may run faster than
            // the median's. ucx_perftest reports no CPU time; UCX has no difference to itself.
            assert!(num(3).is_some_and(|p99| p99 > 0.0), "{line}");
            assert_eq!((num(6), num(7)), (None, None), "{line}");
            assert!(num(4).is_some_and(f64::is_finite), "{line}");
        } else {
            assert!(num(3).is_some_and(|p99| p99 >= num(2).unwrap()), "{line}");
            assert!(num(6).is_some() && num(7).is_some_and(f64::is_finite), "{line}");
        }
    }
    let _ = std::fs::remove_dir_all(out);
}

#[test]
fn a_duration_cap_cuts_every_sweep_and_the_run_still_ends_cleanly() {
    let out = std::env::temp_dir().join(format!("stack-bench-cap-{}", std::process::id()));
    let run = stack_bench(&["--layers", "raw-send,pipe,mad-copy,tcp", "--max-size", "64", "--duration-cap", "0"], &out);
    let stderr = String::from_utf8_lossy(&run.stderr);
    // The server learns that each layer ended early, instead of waiting for sizes that never come.
    assert!(run.status.success(), "stack_bench failed: {stderr}");
    assert_eq!(stderr.matches("duration cap reached").count(), 4, "{stderr}");
    let _ = std::fs::remove_dir_all(out);
}

#[test]
fn bad_arguments_give_a_clear_usage_error() {
    let run = Command::new(env!("CARGO_BIN_EXE_stack_bench")).args(["--layers", "carrier-pigeon"]).output().unwrap();
    assert!(!run.status.success());
    assert!(String::from_utf8_lossy(&run.stderr).contains("invalid value"));
    let run = Command::new(env!("CARGO_BIN_EXE_stack_bench"))
        .args(["--min-size", "100", "--max-size", "10"])
        .output()
        .unwrap();
    assert!(!run.status.success());
    assert!(String::from_utf8_lossy(&run.stderr).contains("sizes must satisfy"));
    let run = Command::new(env!("CARGO_BIN_EXE_stack_bench")).args(["--layers", "tcp,raw-send,tcp"]).output().unwrap();
    assert!(!run.status.success());
    assert!(String::from_utf8_lossy(&run.stderr).contains("layer tcp given twice"));
    let run = Command::new(env!("CARGO_BIN_EXE_stack_bench")).args(["--rounds", "0"]).output().unwrap();
    assert!(!run.status.success());
    assert!(String::from_utf8_lossy(&run.stderr).contains("--rounds"));
}

/// A peer layer measured by a C program of ours (compiled and started by the run) takes its
/// turn in the same rounds, or the run says clearly what it lacks (`missing` in its error).
fn c_peer_layer_runs_in_the_same_rounds_as_ours(layer: &str, available: bool, missing: &str) {
    let out = std::env::temp_dir().join(format!("stack-bench-{layer}-{}", std::process::id()));
    let layers = format!("raw-send,{layer}");
    let args = ["--layers", &layers, "--min-size", "8", "--max-size", "64", "--iters", "200"];
    let run = stack_bench(
        &[&args[..], &["--rounds", "2", "--stream-bytes", "200000", "--duration-cap", "600"]].concat(),
        &out,
    );
    let (stdout, stderr) = (String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    if !available {
        assert!(!run.status.success() && stderr.contains(missing), "{stderr}");
        return;
    }
    assert!(run.status.success(), "stack_bench failed: {stderr}\n{stdout}");
    let csv = std::fs::read_to_string(out.join("results.csv")).unwrap();
    let rows: Vec<&str> = csv.lines().filter(|l| l.starts_with(&format!("{layer},"))).collect();
    assert_eq!(rows.len(), 4, "{csv}"); // 8 .. 64 B
    for line in rows {
        let f: Vec<&str> = line.split(',').collect();
        let num = |i: usize| -> Option<f64> { (!f[i].is_empty()).then(|| f[i].parse().unwrap()) };
        assert!(num(2).is_some_and(|l| l > 0.0) && num(5).is_some_and(|b| b > 0.0), "{line}");
        assert!(num(3).is_some_and(|p99| p99 >= num(2).unwrap()), "a p99 from {layer}: {line}");
        assert_eq!(num(6), None, "no CPU time from {layer}: {line}");
    }
    let _ = std::fs::remove_dir_all(out);
}

fn on_path(p: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|path| std::env::split_paths(&path).any(|d| d.join(p).is_file()))
}

/// The `mpi` layer: Open MPI over `vader`, two ranks by `mpirun`.
#[test]
fn the_mpi_layer_runs_in_the_same_rounds_as_ours() {
    c_peer_layer_runs_in_the_same_rounds_as_ours("mpi", on_path("mpicc") && on_path("mpirun"), "needs mpicc");
}

/// The `libfabric` layer: the `shm` provider's reliable-datagram messages.
#[test]
fn the_libfabric_layer_runs_in_the_same_rounds_as_ours() {
    let available = on_path("cc") && std::path::Path::new("/usr/include/rdma/fabric.h").is_file();
    c_peer_layer_runs_in_the_same_rounds_as_ours("libfabric", available, "libfabric's headers");
}
