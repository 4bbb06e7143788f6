//! Runs the copy benchmark with a coarse alignment grid, so it cannot silently rot: both rows
//! of each size must be there with positive figures.

use std::process::Command;

#[test]
fn prints_both_copies_for_every_size() {
    let run = Command::new(env!("CARGO_BIN_EXE_copy_bench"))
        .args(["--sizes", "8192,65536", "--step", "512", "--runs", "1"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "copy_bench failed: {}\n{stdout}", String::from_utf8_lossy(&run.stderr));
    for size in ["8 KiB", "64 KiB"] {
        for copy in ["memmove", "copy_bytes"] {
            let row = stdout
                .lines()
                .find(|l| l.trim_start().starts_with(size) && l.split_whitespace().nth(2) == Some(copy))
                .unwrap_or_else(|| panic!("no {copy} row for {size} in:\n{stdout}"));
            let f: Vec<&str> = row.split_whitespace().collect();
            let mean: f64 = f[3].parse().unwrap();
            let worst: f64 = f[4].parse().unwrap();
            assert!(mean > 0.0 && worst > 0.0 && worst <= mean, "{row}");
        }
    }
}
