//! What every benchmark writes besides its terminal table: JSON (and CSV) through serde, with
//! the run's metadata (the benchmark and its arguments, the host, the commit), so that a
//! figure found in a file later says where it came from. serde_json writes a value that is
//! not a number (NaN, infinity) as `null`, never as invalid JSON.

use std::path::Path;

use serde::Serialize;

/// The machine a run was on.
#[derive(Clone, Debug, Serialize)]
pub struct Host {
    pub hostname: String,
    pub cpu_model: String,
    pub cpus: usize,
    pub kernel: String,
}

/// Where a run's figures come from.
#[derive(Clone, Debug, Serialize)]
pub struct RunMeta {
    /// The program and its arguments.
    pub command: Vec<String>,
    pub host: Host,
    /// `git describe --always --dirty` of the working tree the benchmark ran from, if any.
    pub commit: Option<String>,
    /// Seconds since the Unix epoch when the run ended.
    pub unix_time: u64,
}

fn read_trimmed(path: &str) -> String {
    std::fs::read_to_string(path).map(|s| s.trim().to_string()).unwrap_or_default()
}

/// This machine.
pub fn host() -> Host {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|m| m.trim().to_string())
        .unwrap_or_default();
    Host {
        hostname: read_trimmed("/proc/sys/kernel/hostname"),
        cpu_model,
        cpus: crate::online_cpus(),
        kernel: read_trimmed("/proc/sys/kernel/osrelease"),
    }
}

/// The commit of the source tree this crate was built from (asked of git at run time, in the
/// crate's directory; `None` outside a git checkout).
pub fn commit() -> Option<String> {
    let out = std::process::Command::new("git")
        .args(["describe", "--always", "--dirty", "--abbrev=12"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// This run's metadata.
pub fn meta() -> RunMeta {
    RunMeta {
        command: std::env::args().collect(),
        host: host(),
        commit: commit(),
        unix_time: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
    }
}

/// A results file: the run's metadata, the benchmark's own settings and its figures.
#[derive(Debug, Serialize)]
pub struct Results<'a, S: Serialize, P: Serialize> {
    pub meta: RunMeta,
    pub settings: &'a S,
    pub results: &'a P,
}

/// Writes `results` with this run's metadata and `settings` as pretty JSON.
pub fn write_json<S: Serialize, P: Serialize>(path: &Path, settings: &S, results: &P) -> std::io::Result<()> {
    let doc = Results { meta: meta(), settings, results };
    let text = serde_json::to_string_pretty(&doc).map_err(std::io::Error::other)?;
    std::fs::write(path, text + "\n")
}

/// Writes `rows` as CSV, one column per field (the header from the field names).
pub fn write_csv<R: Serialize>(path: &Path, rows: &[R]) -> std::io::Result<()> {
    let mut w = csv::Writer::from_path(path).map_err(std::io::Error::other)?;
    for r in rows {
        w.serialize(r).map_err(std::io::Error::other)?;
    }
    w.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize)]
    struct Row {
        size: usize,
        gbps: f64,
        p99_us: Option<f64>,
    }

    /// A figure that is not a number becomes `null` (valid JSON), an absent one too; CSV gets
    /// a header from the field names and an empty cell for an absent value.
    #[test]
    fn json_with_meta_stays_valid_and_csv_has_a_header() {
        let dir = std::env::temp_dir().join(format!("bench-results-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let rows = [Row { size: 8, gbps: f64::NAN, p99_us: None }, Row { size: 64, gbps: 1.5, p99_us: Some(0.25) }];
        write_json(&dir.join("r.json"), &"settings", &rows).unwrap();
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("r.json")).unwrap()).unwrap();
        assert!(v["results"][0]["gbps"].is_null() && v["results"][0]["p99_us"].is_null());
        assert_eq!(v["results"][1]["gbps"], 1.5);
        assert!(v["meta"]["host"]["cpus"].as_u64().unwrap() >= 1);
        assert!(!v["meta"]["command"].as_array().unwrap().is_empty());
        write_csv(&dir.join("r.csv"), &rows).unwrap();
        let csv = std::fs::read_to_string(dir.join("r.csv")).unwrap();
        assert_eq!(csv, "size,gbps,p99_us\n8,NaN,\n64,1.5,0.25\n");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
