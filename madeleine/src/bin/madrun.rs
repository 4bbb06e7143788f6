//! `madrun -n N program [args...]`: starts a Madeleine job of N ranks on this machine, without
//! a cluster launcher. Each rank gets `MAD_RANK`, `MAD_SIZE`, a job key of its own (`MAD_JOB`,
//! random per run, so two runs never meet) and a private rendezvous directory; its output
//! lines are prefixed with `[rank]`. When a rank fails (a non-zero exit or a signal), the others
//! are ended and `madrun` exits non-zero; it exits 0 when every rank did.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

/// A signal that asked `madrun` to stop (0: none yet).
static STOP: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: i32) {
    // Async-signal-safe: one atomic store; the main loop ends the ranks.
    STOP.store(sig, Ordering::Relaxed);
}

fn usage() -> ! {
    eprintln!("usage: madrun -n <ranks> <program> [args...]");
    std::process::exit(2);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (n, rest) = match args.as_slice() {
        [flag, n, rest @ ..] if (flag == "-n" || flag == "-np") && !rest.is_empty() => (n, rest),
        _ => usage(),
    };
    let Ok(n) = n.parse::<usize>() else { usage() };
    if n == 0 {
        usage();
    }
    let job = format!("madrun-{}-{:x}", std::process::id(), random());
    let dir = std::env::temp_dir().join(format!("madeleine-{job}"));
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: installs a handler that only stores to an atomic.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
    let mut children: Vec<Child> = Vec::with_capacity(n);
    let mut forwarders = Vec::new();
    for rank in 0..n {
        let child = Command::new(&rest[0])
            .args(&rest[1..])
            .env("MAD_RANK", rank.to_string())
            .env("MAD_SIZE", n.to_string())
            .env("MAD_JOB", &job)
            .env("MAD_RENDEZVOUS", &dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // A group of its own per rank: ending a rank ends what it started too (whose
            // output would otherwise keep its pipe open).
            .process_group(0)
            .spawn();
        let mut child = match child {
            Ok(c) => c,
            Err(e) => {
                eprintln!("madrun: starting {}: {e}", rest[0]);
                end_all(&mut children);
                std::process::exit(1);
            }
        };
        let out = child.stdout.take().expect("piped");
        let err = child.stderr.take().expect("piped");
        forwarders.push(std::thread::spawn(move || forward(BufReader::new(out), rank, false)));
        forwarders.push(std::thread::spawn(move || forward(BufReader::new(err), rank, true)));
        children.push(child);
    }
    let mut status: Vec<Option<ExitStatus>> = vec![None; n];
    let mut failed = None;
    while status.iter().any(Option::is_none) {
        for (rank, c) in children.iter_mut().enumerate() {
            if status[rank].is_none() {
                if let Ok(Some(st)) = c.try_wait() {
                    status[rank] = Some(st);
                    if !st.success() && failed.is_none() {
                        failed = Some((rank, st));
                    }
                }
            }
        }
        let stop = STOP.load(Ordering::Relaxed);
        if stop != 0 {
            end_all(&mut children);
            let _ = std::fs::remove_dir_all(&dir);
            eprintln!("madrun: stopped by signal {stop}; the job was ended");
            std::process::exit(128 + stop);
        }
        if failed.is_some() {
            end_all(&mut children);
            for (rank, c) in children.iter_mut().enumerate() {
                if status[rank].is_none() {
                    status[rank] = c.wait().ok();
                }
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    for f in forwarders {
        let _ = f.join();
    }
    let _ = std::fs::remove_dir_all(&dir);
    if let Some((rank, st)) = failed {
        eprintln!("madrun: rank {rank} failed ({st}); the job was ended");
        std::process::exit(1);
    }
}

/// Copies a rank's output line by line, each prefixed with its rank.
fn forward(r: impl BufRead, rank: usize, to_stderr: bool) {
    for line in r.lines().map_while(Result::ok) {
        if to_stderr {
            let _ = writeln!(std::io::stderr().lock(), "[{rank}] {line}");
        } else {
            let _ = writeln!(std::io::stdout().lock(), "[{rank}] {line}");
        }
    }
}

/// Ends every rank still running, with what it started (SIGTERM to its process group, then
/// SIGKILL a moment later).
fn end_all(children: &mut [Child]) {
    let signal_all = |sig| {
        for c in children.iter() {
            // SAFETY: a plain signal to the process group of a child of ours.
            unsafe { libc::kill(-(c.id() as i32), sig) };
        }
    };
    signal_all(libc::SIGTERM);
    std::thread::sleep(Duration::from_millis(200));
    signal_all(libc::SIGKILL);
    for c in children.iter_mut() {
        let _ = c.try_wait();
    }
}

/// A job key's randomness: the clock and the address-space layout, mixed.
fn random() -> u64 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let a = &t as *const u64 as u64;
    (t ^ a.rotate_left(29)).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}
