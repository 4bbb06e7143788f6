//! The results: the terminal table, JSON, CSV and SVG plots.

use crate::*;

pub(crate) fn find(points: &[Point], layer: Layer, size: usize) -> Option<&Point> {
    points.iter().find(|p| p.layer == layer && p.size == size)
}

pub(crate) fn print_table(points: &[Point], layers: &[Layer]) {
    let with_ucx = layers.contains(&Layer::Ucx);
    println!(
        "{:>10} {:>9} {:>10} {:>9} {:>9} {:>10} {:>9} {:>9} {:>9}{}",
        "layer",
        "size",
        "median us",
        "p99 us",
        "-raw us",
        "GB/s",
        "MB/CPU-s",
        "lat/tcp",
        "bw/raw",
        if with_ucx { format!(" {:>9} {:>9}", "-ucx us", "bw/ucx") } else { String::new() }
    );
    for &layer in layers {
        for p in points.iter().filter(|p| p.layer == layer) {
            let tcp = find(points, Layer::Tcp, p.size);
            let raw = find(points, Layer::RawSend, p.size);
            let ucx = find(points, Layer::Ucx, p.size);
            // An absent value prints as a dash.
            let dash = |a: Option<String>| a.unwrap_or_else(|| "-".into());
            let r = |a: Option<f64>| dash(a.map(|v| format!("{v:.2}")));
            let us = |a: Option<f64>| dash(a.map(|v| format!("{v:+.3}")));
            println!(
                "{:>10} {:>9} {:>10.3} {:>9} {:>9} {:>9.2} {:>10} {:>9} {:>9}{}",
                layer.name(),
                fmt_size(p.size),
                p.median_us,
                dash(p.p99_us.map(|v| format!("{v:.3}"))),
                us(p.minus_raw_us),
                p.gbps,
                dash(p.mb_per_cpu_s.map(|v| format!("{v:.0}"))),
                r(tcp.map(|t| p.median_us / t.median_us)),
                r(raw.map(|t| p.gbps / t.gbps)),
                if with_ucx {
                    format!(" {:>9} {:>9}", us(p.minus_ucx_us), r(ucx.map(|t| p.gbps / t.gbps)))
                } else {
                    String::new()
                }
            );
        }
    }
}

/// One point as the results files hold it.
#[derive(serde::Serialize)]
struct PointRow {
    layer: &'static str,
    size: usize,
    median_us: f64,
    p99_us: Option<f64>,
    minus_raw_us: Option<f64>,
    gbps: f64,
    mb_per_cpu_s: Option<f64>,
    minus_ucx_us: Option<f64>,
}

/// The run's own settings, beside its figures in results.json.
#[derive(serde::Serialize)]
pub(crate) struct Settings {
    pub provider: String,
    pub wait: String,
    pub timer_ns: f64,
    pub floor_ns: Option<f64>,
}

pub(crate) fn write_results(dir: &std::path::Path, points: &[Point], settings: &Settings) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let rows: Vec<PointRow> = points
        .iter()
        .map(|p| PointRow {
            layer: p.layer.name(),
            size: p.size,
            median_us: p.median_us,
            p99_us: p.p99_us,
            minus_raw_us: p.minus_raw_us,
            gbps: p.gbps,
            mb_per_cpu_s: p.mb_per_cpu_s,
            minus_ucx_us: p.minus_ucx_us,
        })
        .collect();
    benches::results::write_csv(&dir.join("results.csv"), &rows)?;
    benches::results::write_json(&dir.join("results.json"), settings, &rows)?;
    std::fs::write(dir.join("latency.svg"), svg_plot(points, "one-way latency (us, median)", |p| p.median_us))?;
    std::fs::write(dir.join("bandwidth.svg"), svg_plot(points, "bandwidth (GB/s)", |p| p.gbps))?;
    Ok(())
}

/// A log-log line chart of `value` against message size, one line per layer.
pub(crate) fn svg_plot(points: &[Point], title: &str, value: impl Fn(&Point) -> f64) -> String {
    // Each layer once, in the order it first appears (points come size by size, the layers
    // taking turns within each size).
    let mut layers: Vec<Layer> = Vec::new();
    for p in points {
        if !layers.contains(&p.layer) {
            layers.push(p.layer);
        }
    }
    let series: Vec<Series> = layers
        .iter()
        .map(|l| Series {
            name: l.name().to_string(),
            points: points.iter().filter(|p| p.layer == *l).map(|p| (p.size as f64, value(p))).collect(),
        })
        .collect();
    line_chart(&Axes { title, x_label: "message size", x_sizes: true, log_y: true }, &series)
}

pub(crate) fn report(args: &Args, points: &[Point], floor: Option<f64>) -> Result<(), String> {
    let clock = TickClock::new();
    let timer = clock.cost_ns();
    println!(
        "# stack_bench: {} provider, {}, {:?} waiting",
        match args.provider {
            ProviderArg::Software => "software",
            ProviderArg::Hardware => "hardware",
        },
        if args.mad_dir.is_some() || args.role == Role::Both {
            "two processes on one host".to_string()
        } else {
            format!("client and server apart (server {})", args.connect.as_deref().unwrap_or("?"))
        },
        args.wait
    );
    println!(
        "# timer cost {timer:.1} ns ({}; included in latencies, not subtracted){}",
        if clock.is_tsc() { "time-stamp counter" } else { "Instant" },
        floor.map(|f| format!("; cache-line floor {f:.0} ns one way")).unwrap_or_default()
    );
    print_table(points, &args.layers);
    if let Some(p) = points.iter().find(|p| p.layer == Layer::RawSend && p.size <= 64) {
        let rtt = Duration::from_nanos((2.0 * p.median_us * 1e3) as u64);
        let x = portability_verbs::datapath::crossover::crossover_from(
            portability_verbs::datapath::crossover::copy_curve(),
            rtt,
        );
        println!("# copy/zero-copy crossover chosen for this peer: {} (copy curve of this process, round trip {:.2} us of this run)", fmt_size(x), 2.0 * p.median_us);
    }
    match MAD_PROBED_THRESHOLD.get() {
        Some(&usize::MAX) => println!("# madeleine's transport probe: zero-copy never pays to this peer (large packs copied through the bulk lane)"),
        Some(&t) => println!("# madeleine's transport probe: packs of {} and more go zero-copy to this peer", fmt_size(t)),
        None => {}
    }
    let out = args.out.clone().unwrap_or_else(|| {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        PathBuf::from("results").join(format!("stack-{t}"))
    });
    let settings = Settings {
        provider: format!("{:?}", args.provider),
        wait: format!("{:?}", args.wait),
        timer_ns: timer,
        floor_ns: floor,
    };
    write_results(&out, points, &settings).map_err(|e| format!("writing {}: {e}", out.display()))?;
    println!("# results (JSON, CSV, latency.svg, bandwidth.svg) in {}", out.display());
    Ok(())
}
