//! Madeleine between two processes: this test is rank 0, a `mad_peer` child is rank 1.

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use madeleine::*;

/// Kills the child if the test fails before it exits.
struct Reap(Child);

impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(mode: &str, tag: &str) -> (Session, Channel, Child) {
    start_with(mode, tag, 4096)
}

/// As [`start`], packs from `threshold` bytes on going zero-copy both ways.
fn start_with(mode: &str, tag: &str, threshold: usize) -> (Session, Channel, Child) {
    let dir = std::env::temp_dir().join(format!("mad-cross-{}-{tag}", std::process::id()));
    let child = Command::new(env!("CARGO_BIN_EXE_mad_peer"))
        .arg(mode)
        .env("MAD_RENDEZVOUS_THRESHOLD", threshold.to_string())
        .env("MAD_RANK", "1")
        .env("MAD_SIZE", "2")
        .env("MAD_RENDEZVOUS", &dir)
        .spawn()
        .unwrap();
    let mut cfg = SessionConfig::new(0, 2, dir);
    cfg.timeout = Duration::from_secs(15);
    cfg.wait_limit = Some(Duration::from_secs(15));
    cfg.rendezvous_threshold = Some(threshold);
    let session = Session::new(cfg).unwrap();
    let ch = session.channel().unwrap();
    (session, ch, child)
}

#[test]
fn messages_of_every_size_cross_processes() {
    echo_every_size(start("echo", "echo"), &[1usize, 100, 4095, 4096, 30_000, 200_000, 1 << 20]);
}

/// Packs from 16 KiB to below the threshold in a ping-pong go as offers both ways (each
/// message answers one), claimed and read across processes; now and then one is withdrawn
/// and copied (a receiver slow to come).
#[test]
fn offered_packs_cross_processes() {
    let sizes: Vec<usize> = (0..40).map(|i| [16_384, 30_000, 65_536, 200_000][i % 4]).collect();
    echo_every_size(start_with("echo", "offers", 1 << 20), &sizes);
}

fn echo_every_size((_s, ch, child): (Session, Channel, Child), sizes: &[usize]) {
    let mut child = Reap(child);
    for (i, &n) in sizes.iter().enumerate() {
        let body: Vec<u8> = (0..n).map(|k| (k * 13 + i) as u8).collect();
        let len = (n as u64).to_le_bytes();
        let mut p = ch.begin_packing(1).unwrap();
        p.pack(&len, SendMode::Cheaper, RecvMode::Express).unwrap();
        p.pack(&body, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
        p.end_packing().unwrap();
        let mut back = vec![0u8; n];
        let mut u = ch.begin_unpacking().unwrap();
        assert_eq!(u.source(), 1);
        let mut l = [0u8; 8];
        u.unpack_express(&mut l, SendMode::Cheaper).unwrap();
        u.unpack(&mut back, SendMode::Cheaper, RecvMode::Cheaper).unwrap();
        u.end_unpacking().unwrap();
        assert_eq!(back, body, "{n} bytes");
    }
    let zero = 0u64.to_le_bytes();
    let mut p = ch.begin_packing(1).unwrap();
    p.pack(&zero, SendMode::Cheaper, RecvMode::Express).unwrap();
    p.pack(&[], SendMode::Cheaper, RecvMode::Cheaper).unwrap();
    p.end_packing().unwrap();
    ch.barrier().unwrap();
    assert!(child.0.wait().unwrap().success());
}

#[test]
fn a_peer_killed_mid_message_gives_an_error_not_a_hang() {
    let (_s, ch, child) = start("half", "half");
    let mut child = Reap(child);
    let mut u = ch.begin_unpacking().unwrap();
    let mut first = [0u8; 16];
    u.unpack_express(&mut first, SendMode::Safer).unwrap();
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    let start = Instant::now();
    let mut second = [0u8; 16];
    let r = u.unpack_express(&mut second, SendMode::Safer);
    assert!(r.is_err(), "the rest of the message cannot come");
    assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
    std::mem::forget(u); // its connection is dead; nothing to complete
}

/// Whether `mpirun` is here (CI installs it; elsewhere the tests that need it say so).
fn have_mpirun() -> bool {
    let there = Command::new("mpirun").arg("--version").output().is_ok();
    if !there {
        eprintln!("skipping: no mpirun (Debian: openmpi-bin; .ci/run installs it)");
    }
    there
}

/// Starts `mpirun -np <ranks>` of the ring example (bounded by `timeout 120`), with no
/// Madeleine variable set but `MAD_RENDEZVOUS` if given.
fn mpirun_ring(ranks: usize, rendezvous: Option<&std::path::Path>) -> Child {
    mpirun_ring_with(ranks, rendezvous, &[])
}

/// [`mpirun_ring`] with more `mpirun` arguments.
fn mpirun_ring_with(ranks: usize, rendezvous: Option<&std::path::Path>, extra: &[&str]) -> Child {
    mpirun_ring_cmd(ranks, rendezvous, extra).spawn().unwrap()
}

/// The command [`mpirun_ring_with`] starts. Each `mpirun` keeps its session files in a
/// directory of its own, removed after it: Open MPI 4 creates `$TMPDIR/ompi.<host>.<uid>`
/// racily, and of two jobs started at once one can fail with "mkdir ... File exists"
/// (open-mpi/ompi#8510; seen here with the CPUs busy).
fn mpirun_ring_cmd(ranks: usize, rendezvous: Option<&std::path::Path>, extra: &[&str]) -> Command {
    const RUN: &str = r#"d=$(mktemp -d) || exit 1
timeout 120 mpirun --mca orte_tmpdir_base "$d" "$@"
rc=$?
rm -rf "$d"
exit $rc"#;
    let mut c = Command::new("sh");
    c.args(["-c", RUN, "sh", "--allow-run-as-root", "--oversubscribe", "-np", &ranks.to_string()])
        .args(extra)
        .arg(env!("CARGO_BIN_EXE_mad_ring"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for v in ["MAD_RANK", "MAD_SIZE", "MAD_RENDEZVOUS", "MAD_JOB", "MAD_BOOTSTRAP", "MAD_ROOT"] {
        c.env_remove(v);
    }
    if let Some(dir) = rendezvous {
        c.env("MAD_RENDEZVOUS", dir);
    }
    c
}

/// Waits for a ring job and checks that it ended well and said so.
fn ring_succeeded(job: Child, ranks: usize) {
    let out = job.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains(&format!("ring of {ranks} ranks: ok")),
        "mpirun: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Open MPI's `mpirun` starts four ranks of a Madeleine program (a ring, any-source receives, a
/// barrier) with no Madeleine variable set: the ranks find each other from `OMPI_COMM_WORLD_*`.
#[test]
fn mpirun_starts_a_madeleine_job() {
    if have_mpirun() {
        let dir = std::env::temp_dir().join(format!("mad-mpirun-{}", std::process::id()));
        ring_succeeded(mpirun_ring(4, Some(&dir)), 4);
    }
}

/// Two `mpirun` jobs of the same program started at once on one host, meeting through a
/// directory (`MAD_BOOTSTRAP=dir`, no other Madeleine variable): each finds its own ranks (the
/// launcher's job id names the rendezvous directory and rides in every handshake), and both
/// succeed.
#[test]
fn two_mpirun_jobs_at_once_stay_apart() {
    if have_mpirun() {
        let dir = ["-x", "MAD_BOOTSTRAP=dir"];
        let jobs = [mpirun_ring_with(2, None, &dir), mpirun_ring_with(2, None, &dir)];
        for job in jobs {
            ring_succeeded(job, 2);
        }
    }
}

/// With no Madeleine variable set, the ranks of an `mpirun` job meet through its PMIx server
/// (each publishes its TCP address; the job could span hosts): no rendezvous directory is
/// made. Two jobs at once stay apart.
#[test]
fn mpirun_jobs_meet_through_pmix_by_default() {
    if have_mpirun() {
        let tmp = std::env::temp_dir().join(format!("mad-pmix-tmp-{}", std::process::id()));
        std::fs::create_dir_all(&tmp).unwrap();
        let with_tmp = |n: usize| {
            let mut c = mpirun_ring_cmd(n, None, &[]);
            c.env("TMPDIR", &tmp);
            c.spawn().unwrap()
        };
        let jobs = [with_tmp(3), with_tmp(2)];
        ring_succeeded_all(jobs, [3, 2]);
        let dirs: Vec<_> = std::fs::read_dir(&tmp)
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("madeleine-"))
            .collect();
        let _ = std::fs::remove_dir_all(&tmp);
        assert!(dirs.is_empty(), "the ranks met through a directory: {dirs:?}");
    }
}

fn ring_succeeded_all<const N: usize>(jobs: [Child; N], ranks: [usize; N]) {
    for (job, n) in jobs.into_iter().zip(ranks) {
        ring_succeeded(job, n);
    }
}

/// `madrun` starts a job on this machine without a launcher: every rank's output prefixed with
/// its rank, the exit status the job's; a failing rank ends the others and the job fails.
#[test]
fn madrun_starts_a_job_and_ends_it_when_a_rank_fails() {
    let out = Command::new(env!("CARGO_BIN_EXE_madrun-for-tests"))
        .args(["-n", "3", env!("CARGO_BIN_EXE_mad_ring")])
        .env_remove("MAD_RENDEZVOUS")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.contains("[0] ring of 3 ranks: ok"), "{}\n{stdout}", out.status);
    // Rank 1 fails once rank 0 is up (a file says so; 5 s at most), so that both said it.
    let flag = std::env::temp_dir().join(format!("madrun-up-{}", std::process::id()));
    let script = "echo up; if [ \"$MAD_RANK\" = 1 ]; then for i in $(seq 500); do [ -e \"$0\" ] && break; \
                  sleep 0.01; done; exit 3; fi; touch \"$0\"; sleep 60";
    let start = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_madrun-for-tests"))
        .args(["-n", "2", "/bin/sh", "-c", script])
        .arg(&flag)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&flag);
    assert_eq!(out.status.code(), Some(1));
    assert!(start.elapsed() < Duration::from_secs(10), "the other rank was not ended");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("[0] up") && stdout.contains("[1] up"), "{stdout}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("rank 1 failed"));
}

/// A one-node Slurm cluster of our own (its controller and node daemon, configuration and state
/// in a temporary directory, free ports), stopped when dropped; `None` (the test says why)
/// where Slurm is not installed.
struct Slurm {
    dir: std::path::PathBuf,
    conf: std::path::PathBuf,
    daemons: Vec<Reap>,
}

impl Drop for Slurm {
    fn drop(&mut self) {
        self.daemons.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Slurm {
    fn start() -> Option<Slurm> {
        let there = ["slurmctld", "slurmd", "srun"].iter().all(|p| Command::new(p).arg("--version").output().is_ok());
        if !there {
            eprintln!("skipping: no Slurm (Debian: slurmctld, slurmd, slurm-client; .ci/run installs them)");
            return None;
        }
        let dir = std::env::temp_dir().join(format!("mad-slurm-{}", std::process::id()));
        for sub in ["state", "spool"] {
            std::fs::create_dir_all(dir.join(sub)).unwrap();
        }
        let free_port = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let host = String::from_utf8(Command::new("hostname").arg("-s").output().unwrap().stdout).unwrap();
        let (host, d) = (host.trim(), dir.display());
        // No authentication daemon (auth/none), no cgroups (process groups track the tasks),
        // the node's CPUs as configured (4 ranks on a 2-CPU runner), PMIx for `--mpi=pmix`.
        let conf = format!(
            "ClusterName=madtest\nSlurmctldHost={host}(127.0.0.1)\nAuthType=auth/none\nCredType=cred/none\n\
             SlurmUser=root\nSlurmdUser=root\nSlurmctldPort={}\nSlurmdPort={}\nStateSaveLocation={d}/state\n\
             SlurmdSpoolDir={d}/spool\nSlurmctldPidFile={d}/ctld.pid\nSlurmdPidFile={d}/d.pid\n\
             SlurmctldLogFile={d}/ctld.log\nSlurmdLogFile={d}/d.log\nProctrackType=proctrack/pgid\n\
             TaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\nSelectType=select/linear\n\
             MpiDefault=none\nReturnToService=2\nSlurmdParameters=config_overrides\n\
             NodeName={host} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN\n\
             PartitionName=madtest Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8\n",
            free_port(),
            free_port()
        );
        let conf_path = dir.join("slurm.conf");
        std::fs::write(&conf_path, conf).unwrap();
        let mut slurm = Slurm { dir, conf: conf_path, daemons: Vec::new() };
        for daemon in ["slurmctld", "slurmd"] {
            let child = Command::new(daemon)
                .arg("-D")
                .env("SLURM_CONF", &slurm.conf)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap();
            slurm.daemons.push(Reap(child));
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let out = Command::new("sinfo").args(["-h", "-o", "%T"]).env("SLURM_CONF", &slurm.conf).output().unwrap();
            if String::from_utf8_lossy(&out.stdout).trim() == "idle" {
                return Some(slurm);
            }
            let log = std::fs::read_to_string(slurm.dir.join("ctld.log")).unwrap_or_default();
            assert!(Instant::now() < deadline, "the Slurm node never became idle:\n{log}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// `srun` of the ring example with `args`, bounded by `timeout 120`, with no Madeleine
    /// variable set and `TMPDIR` ours.
    fn srun_ring(&self, args: &[&str]) -> Child {
        let mut c = Command::new("timeout");
        c.args(["120", "srun"])
            .args(args)
            .arg(env!("CARGO_BIN_EXE_mad_ring"))
            .env("SLURM_CONF", &self.conf)
            .env("TMPDIR", self.tmp())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        for v in ["MAD_RANK", "MAD_SIZE", "MAD_RENDEZVOUS", "MAD_JOB", "MAD_BOOTSTRAP", "MAD_ROOT"] {
            c.env_remove(v);
        }
        c.spawn().unwrap()
    }

    /// The jobs' temporary directory.
    fn tmp(&self) -> std::path::PathBuf {
        let tmp = self.dir.join("tmp");
        std::fs::create_dir_all(&tmp).unwrap();
        tmp
    }

    /// The rendezvous directories jobs made.
    fn rendezvous_dirs(&self) -> Vec<String> {
        let entries = std::fs::read_dir(self.tmp()).unwrap().filter_map(|e| e.ok());
        entries.map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.starts_with("madeleine-")).collect()
    }
}

/// Slurm's `srun` starts a Madeleine program with no Madeleine variable set, as the README
/// shows: with `--mpi=pmix` the ranks meet through Slurm's PMIx server; without it they take
/// their rank from `SLURM_PROCID` and meet in a directory named after the job and step. Two
/// jobs at once stay apart.
#[test]
fn srun_starts_a_madeleine_job_with_and_without_pmix() {
    let Some(slurm) = Slurm::start() else { return };
    ring_succeeded(slurm.srun_ring(&["-n", "4", "--mpi=pmix"]), 4);
    assert_eq!(slurm.rendezvous_dirs(), Vec::<String>::new(), "the ranks met through a directory, not PMIx");
    let jobs = [slurm.srun_ring(&["-n", "3"]), slurm.srun_ring(&["-n", "2", "--mpi=pmix"])];
    ring_succeeded_all(jobs, [3, 2]);
}
