//! Two "hosts" on one machine, for tests across a machine boundary: each is its own network,
//! PID and mount namespace (with a private `/tmp`), and the two are joined only by a veth pair,
//! so nothing but the network connects them, as with two machines. Everything is removed when
//! the value drops, also when a test fails. Needs root, `ip` and `unshare`.

use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

/// Mounts a private `/tmp` and runs the program (`$0`), keeping `$PV_HOST_KEEP` reachable
/// (opened before the mount, bound back after it through `/proc/self/fd`; not canonicalized,
/// which would resolve the descriptor's path in the new `/tmp`).
const PRIVATE_TMP: &str = r#"
if [ -n "$PV_HOST_KEEP" ]; then exec 5<"$PV_HOST_KEEP" || exit 1; fi
mount -t tmpfs tmpfs /tmp || exit 1
if [ -n "$PV_HOST_KEEP" ]; then
    mkdir -p "$PV_HOST_KEEP" && mount --no-canonicalize --bind /proc/self/fd/5 "$PV_HOST_KEEP" || exit 1
    exec 5<&-
fi
exec "$0" "$@"
"#;

/// One of the two hosts.
pub struct Host {
    /// Its network namespace's name.
    pub netns: String,
    /// Its address on the link.
    pub ip: Ipv4Addr,
    /// Its end of the veth pair.
    pub dev: String,
}

/// Two hosts joined by a veth pair.
pub struct TwoHosts {
    pub a: Host,
    pub b: Host,
}

fn run(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

impl TwoHosts {
    /// Makes the two hosts, or says why it cannot (not root, tools missing).
    pub fn new() -> Result<TwoHosts, String> {
        // SAFETY: a plain getter.
        if unsafe { libc::geteuid() } != 0 {
            return Err("making network namespaces needs root".into());
        }
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let tag = format!("{}-{n}", std::process::id());
        let subnet = (std::process::id() % 200 + n) % 250;
        let mk = |side: &str, last: u8| Host {
            netns: format!("pv{side}-{tag}"),
            ip: Ipv4Addr::new(10, 213, subnet as u8, last),
            dev: format!("pv{side}{}", n % 10_000),
        };
        let hosts = TwoHosts { a: mk("a", 1), b: mk("b", 2) };
        for h in [&hosts.a, &hosts.b] {
            run(&["ip", "netns", "add", &h.netns])?;
        }
        // Dropping `hosts` removes whatever was made so far if a step fails.
        run(&[
            "ip",
            "link",
            "add",
            &hosts.a.dev,
            "netns",
            &hosts.a.netns,
            "type",
            "veth",
            "peer",
            "name",
            &hosts.b.dev,
            "netns",
            &hosts.b.netns,
        ])?;
        for h in [&hosts.a, &hosts.b] {
            run(&["ip", "-n", &h.netns, "addr", "add", &format!("{}/24", h.ip), "dev", &h.dev])?;
            run(&["ip", "-n", &h.netns, "link", "set", &h.dev, "up"])?;
            run(&["ip", "-n", &h.netns, "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }

    /// A command that runs `program` on `host`: in its network namespace, in a new PID and
    /// mount namespace with its own `/tmp`. Killing the command kills everything it started.
    /// A program under `/tmp` (a build directory there) stays reachable: its directory is
    /// bound back into the private `/tmp` (env `PV_HOST_KEEP` names another directory to keep,
    /// for a program that starts others).
    pub fn command(host: &Host, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &host.netns, "unshare", "--pid", "--mount", "--fork", "--kill-child", "--mount-proc"])
            .args(["sh", "-c", PRIVATE_TMP, program]);
        let dir = std::path::Path::new(program).parent().filter(|d| d.starts_with("/tmp"));
        if let Some(d) = dir {
            c.env("PV_HOST_KEEP", d);
        }
        c
    }

    /// Takes `host`'s link down (`false`) or up: packets stop as if a cable were pulled.
    pub fn set_link(host: &Host, up: bool) -> Result<(), String> {
        run(&["ip", "-n", &host.netns, "link", "set", &host.dev, if up { "up" } else { "down" }])
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for h in [&self.a, &self.b] {
            let _ = run(&["ip", "netns", "del", &h.netns]);
        }
    }
}

/// Makes two hosts, or prints why the test is skipped and returns None (CI runs as root, so
/// there every such test runs).
pub fn two_hosts_or_skip(test: &str) -> Option<TwoHosts> {
    match TwoHosts::new() {
        Ok(h) => Some(h),
        Err(why) => {
            eprintln!("SKIPPED {test}: cannot make two hosts: {why}");
            None
        }
    }
}
