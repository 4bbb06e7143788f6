//! The `ucx` layer: UCX's `ucx_perftest`, started for each block and read back.

use crate::*;

/// How long one ucx_perftest run may take before the run fails.
pub(crate) const UCX_LIMIT: Duration = Duration::from_secs(120);

/// What one block of a peer's benchmark reported (ucx_perftest, the C programs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct PeerResult {
    /// Median one-way latency, us.
    pub(crate) p50_us: f64,
    /// 99th percentile of the one-way latency, us (latency blocks).
    pub(crate) p99_us: Option<f64>,
    /// Bandwidth, GB/s.
    pub(crate) gbps: f64,
}

/// What one ucx_perftest run reported.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct UcxRun {
    /// The one-way latency at the percentile rank asked for (`-R`; its
    /// `<rank>_percentile_lat`, us), over the run's last 2048 iterations (its timing queue).
    pub(crate) percentile_us: f64,
    /// Overall bandwidth (its `overall_bw`, in MiB/s there), GB/s.
    pub(crate) gbps: f64,
}

/// The percentile ranks the `ucx` layer asks ucx_perftest for: one run each.
pub(crate) const UCX_MEDIAN: f64 = 50.0;
pub(crate) const UCX_P99: f64 = 99.0;

/// Reads ucx_perftest's `-v` output: a CSV header line starting with `iterations,` and the
/// values on the line after it, found by column name; the latency column is the one of
/// percentile `rank`.
pub(crate) fn parse_ucx_csv(out: &str, rank: f64) -> Result<UcxRun, String> {
    let lines: Vec<&str> = out.lines().map(str::trim).collect();
    let at = lines.iter().rposition(|l| l.starts_with("iterations,")).ok_or("no CSV header in its output")?;
    let values = lines.get(at + 1).ok_or("no CSV values after its header")?;
    let (names, values): (Vec<&str>, Vec<&str>) = (lines[at].split(',').collect(), values.split(',').collect());
    if names.len() != values.len() {
        return Err(format!("{} CSV columns but {} values", names.len(), values.len()));
    }
    let column = |name: &str| -> Result<f64, String> {
        let i = names.iter().position(|n| *n == name).ok_or_else(|| format!("no {name} column"))?;
        let v: f64 = values[i].parse().map_err(|_| format!("{name} is not a number: {:?}", values[i]))?;
        if v.is_finite() && v >= 0.0 {
            Ok(v)
        } else {
            Err(format!("{name} out of range: {v}"))
        }
    };
    Ok(UcxRun {
        percentile_us: column(&format!("{rank:.1}_percentile_lat"))?,
        gbps: column("overall_bw")? * 1_048_576.0 / 1e9,
    })
}

/// Whether `ucx_perftest` is on the PATH.
pub(crate) fn ucx_perftest_found() -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join("ucx_perftest").is_file()))
}

/// The transport sets the layer tries, the better of them reported per point (what a UCX user
/// tuning for this host would pick): plain shared-memory copies, and with cross-memory attach
/// for large messages. `UCX_TLS` in the environment replaces them.
pub(crate) const UCX_TLS_CHOICES: [&str; 2] = ["posix,self", "posix,cma,self"];

/// Messages of `size` bytes a peer's stream block sends at least (and ours beside a peer): a
/// few thousand, or about 2 GiB (a few hundred milliseconds here) for large messages, so that
/// its start-up, connection and first touches are not counted as bandwidth.
pub(crate) fn peer_stream_messages(size: usize, ours: u64) -> u64 {
    ours.max(5000.min(((2u64 << 30) / size.max(1) as u64).max(100)))
}

/// Round trips UCX's latency block makes at least.
pub(crate) const UCX_MIN_ROUND_TRIPS: u64 = 2000;

/// Runs `test` with the transport set `chosen` names, or, the first time (`None`), with each
/// ([`UCX_TLS_CHOICES`], or `UCX_TLS` alone), keeping the better (lower median latency for
/// `tag_lat`, higher bandwidth otherwise) in `chosen` for the point's later rounds. Returns the
/// median run's result and the set.
pub(crate) fn run_ucx_best(
    test: &str,
    size: usize,
    n: u64,
    warm: u64,
    cpus: Option<(usize, usize)>,
    chosen: &mut Option<String>,
) -> Result<(UcxRun, String), String> {
    if let Some(tls) = chosen.clone() {
        return run_ucx(test, size, n, warm, cpus, &tls, UCX_MEDIAN).map(|r| (r, tls));
    }
    let choices: Vec<String> = match std::env::var("UCX_TLS") {
        Ok(tls) => vec![tls],
        Err(_) => UCX_TLS_CHOICES.iter().map(|t| t.to_string()).collect(),
    };
    let mut best: Option<(UcxRun, String)> = None;
    for tls in choices {
        let got = run_ucx(test, size, n, warm, cpus, &tls, UCX_MEDIAN)?;
        let better = match &best {
            None => true,
            Some((b, _)) if test == "tag_lat" => got.percentile_us < b.percentile_us,
            Some((b, _)) => got.gbps > b.gbps,
        };
        if better {
            best = Some((got, tls));
        }
    }
    *chosen = best.as_ref().map(|(_, tls)| tls.clone());
    best.ok_or_else(|| "no UCX transport set to try".into())
}

/// Runs `c` with its output (stdout and stderr) written to `log`, waiting at most `limit`:
/// the exit status (`None`: killed at the limit) and the output.
pub(crate) fn run_captured(
    c: &mut Command,
    log: &std::path::Path,
    limit: Duration,
) -> Result<(Option<std::process::ExitStatus>, String), String> {
    let file = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
    let program = c.get_program().to_string_lossy().into_owned();
    let mut child = c
        .stdout(file.try_clone().map_err(|e| e.to_string())?)
        .stderr(file)
        .spawn()
        .map_err(|e| format!("starting {program}: {e}"))?;
    let status = wait_child(&mut child, limit);
    Ok((status, std::fs::read_to_string(log).unwrap_or_default()))
}

/// A `ucx_perftest` command over the transport set `tls`, pinned to `cpu` (with taskset) if
/// given.
pub(crate) fn ucx_command(cpu: Option<usize>, tls: &str) -> Command {
    let mut c = match cpu {
        Some(cpu) => {
            let mut c = Command::new("taskset");
            c.args(["-c", &cpu.to_string(), "ucx_perftest"]);
            c
        }
        None => Command::new("ucx_perftest"),
    };
    c.env("UCX_TLS", tls);
    c
}

/// Runs one ucx_perftest `test` of `n` iterations (after `warm` unrecorded ones) between a
/// server and a client process, pinned to the server's and the client's CPUs of `cpus`
/// (client, server) if given, its latency read at percentile `rank`. The client is retried
/// while the server is still coming up.
pub(crate) fn run_ucx(
    test: &str,
    size: usize,
    n: u64,
    warm: u64,
    cpus: Option<(usize, usize)>,
    tls: &str,
    rank: f64,
) -> Result<UcxRun, String> {
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("finding a free port: {e}"))?
        .port()
        .to_string();
    let log = std::env::temp_dir().join(format!("stack-bench-ucx-{}-{port}", std::process::id()));
    let mut server = ucx_command(cpus.map(|c| c.1), tls)
        .args(["-p", &port])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("starting ucx_perftest: {e}"))?;
    let started = Instant::now();
    let result = loop {
        let mut client = ucx_command(cpus.map(|c| c.0), tls);
        client.args(["127.0.0.1", "-p", &port, "-t", test, "-s", &size.to_string()]).args([
            "-n",
            &n.max(1).to_string(),
            "-w",
            &warm.to_string(),
            "-R",
            &rank.to_string(),
            "-v",
        ]);
        let (status, out) = run_captured(&mut client, &log, UCX_LIMIT)?;
        match status {
            Some(st) if st.success() => {
                break parse_ucx_csv(&out, rank).map_err(|e| format!("ucx_perftest {test}: {e}"));
            }
            // Not listening yet: the client gives up at once; try again for a while.
            Some(_) if matches!(server.try_wait(), Ok(None)) && started.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Some(st) => {
                let tail: Vec<&str> = out.lines().rev().take(3).collect();
                break Err(format!("ucx_perftest {test} failed ({st}): {}", tail.join(" / ")));
            }
            None => break Err(format!("ucx_perftest {test} took over {UCX_LIMIT:?}")),
        }
    };
    if wait_child(&mut server, Duration::from_secs(10)).is_none() {
        log::warn!("the ucx_perftest server did not end; killed");
    }
    let _ = std::fs::remove_file(&log);
    result
}

/// One of the UCX layer's blocks: tells the server to sleep on the layer's link, runs UCX
/// (`run`), then wakes the server.
pub(crate) fn ucx_block<T>(
    block: Block,
    links: &mut [Box<dyn Link>],
    run: impl FnOnce() -> Result<T, String>,
) -> Result<T, String> {
    let (Block::Latency { link, .. } | Block::Stream { link, .. }) = block else {
        return Err("not a measuring block".into());
    };
    block.announce(links[0].as_mut())?;
    let got = run();
    // Woken either way, so that a failure ends the run cleanly on both sides; UCX's own
    // failure is the one reported.
    links[link].put([0, 0]);
    let woken = links[link].send(CONTROL);
    let got = got?;
    woken.map(|()| got)
}
