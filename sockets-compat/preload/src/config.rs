//! What the library accelerates, from the environment (read once): `SDP_PRELOAD`
//! (`both`, the default; `client`; `server`; `off`), `SDP_PRELOAD_PORTS` (ports or ranges,
//! `8000,9000-9100`; every port by default), `SDP_PRELOAD_PROBE_MS` (how long a client waits
//! for a server's answer, 50 by default), `SDP_PRELOAD_RULES` (a rules file, see [`crate::rules`],
//! consulted first), `SDP_PRELOAD_LOG` (a `log` filter for messages on stderr, e.g. `info`;
//! none by default), `SDP_PRELOAD_POLL_US` (how long `poll`, `select` and `epoll_wait` poll
//! the accelerated sockets of their set before the thread sleeps, 50 by default; 0: never).
//! A value that does not parse turns the library off (with a message): a
//! program must never run differently because of a typo.

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use crate::rules::{Role, Rules};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub client: bool,
    pub server: bool,
    /// Inclusive ranges; empty: every port.
    pub ports: Vec<(u16, u16)>,
    pub probe: Duration,
    pub rules: Rules,
    /// How long a waiting call polls its set's accelerated sockets before it sleeps.
    pub poll_spin: Duration,
}

impl Config {
    const OFF: Config = Config {
        client: false,
        server: false,
        ports: Vec::new(),
        probe: Duration::ZERO,
        rules: Rules::EMPTY,
        poll_spin: Duration::ZERO,
    };

    /// Whether anything may be accelerated (else sockets are never looked at).
    pub fn enabled(&self) -> bool {
        self.client || self.server || !self.rules.is_empty()
    }

    /// Whether `program`'s connection in `role` at `addr` goes over SDP: the rules file's
    /// first matching rule, else the roles and ports of `SDP_PRELOAD` and `SDP_PRELOAD_PORTS`.
    pub fn accelerates(&self, program: &str, role: Role, addr: SocketAddr) -> bool {
        self.rules.decide(program, role, addr).unwrap_or_else(|| {
            let role_on = match role {
                Role::Connect => self.client,
                Role::Listen => self.server,
            };
            role_on && self.port(addr.port())
        })
    }

    /// Whether connections to or from `port` are accelerated.
    pub fn port(&self, port: u16) -> bool {
        self.ports.is_empty() || self.ports.iter().any(|&(a, b)| a <= port && port <= b)
    }

    /// Parses the settings (`get` reads a variable).
    pub fn parse(get: impl Fn(&str) -> Option<String>) -> Result<Config, String> {
        let (client, server) = match get("SDP_PRELOAD").as_deref().map(str::trim) {
            None | Some("both") | Some("") => (true, true),
            Some("client") => (true, false),
            Some("server") => (false, true),
            Some("off") => (false, false),
            Some(v) => return Err(format!("SDP_PRELOAD={v:?}: both, client, server or off")),
        };
        let mut ports = Vec::new();
        if let Some(list) = get("SDP_PRELOAD_PORTS") {
            for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                let bad = || format!("SDP_PRELOAD_PORTS: {item:?} is not a port or a range a-b");
                let (a, b) = match item.split_once('-') {
                    Some((a, b)) => (a.trim().parse().map_err(|_| bad())?, b.trim().parse().map_err(|_| bad())?),
                    None => {
                        let p: u16 = item.parse().map_err(|_| bad())?;
                        (p, p)
                    }
                };
                if a > b {
                    return Err(bad());
                }
                ports.push((a, b));
            }
        }
        let probe = match get("SDP_PRELOAD_PROBE_MS") {
            None => Duration::from_millis(50),
            Some(v) => match v.trim().parse::<u64>() {
                Ok(ms) if ms > 0 => Duration::from_millis(ms),
                _ => return Err(format!("SDP_PRELOAD_PROBE_MS={v:?}: milliseconds, more than 0")),
            },
        };
        let rules = match get("SDP_PRELOAD_RULES").filter(|p| !p.is_empty()) {
            None => Rules::EMPTY,
            Some(path) => {
                let text = std::fs::read_to_string(&path).map_err(|e| format!("SDP_PRELOAD_RULES={path:?}: {e}"))?;
                Rules::parse(&text).map_err(|e| format!("SDP_PRELOAD_RULES={path:?}: {e}"))?
            }
        };
        let poll_spin = match get("SDP_PRELOAD_POLL_US") {
            None => Duration::from_micros(50),
            Some(v) => match v.trim().parse::<u64>() {
                Ok(us) if us <= 1_000_000 => Duration::from_micros(us),
                _ => return Err(format!("SDP_PRELOAD_POLL_US={v:?}: microseconds, 0 to 1000000")),
            },
        };
        Ok(Config { client, server, ports, probe, rules, poll_spin })
    }
}

/// The program's name, as `ps` shows it (`/proc/self/comm`), for the rules.
pub fn program() -> &'static str {
    static NAME: OnceLock<String> = OnceLock::new();
    NAME.get_or_init(|| std::fs::read_to_string("/proc/self/comm").map(|s| s.trim().to_string()).unwrap_or_default())
}

/// The process's settings.
pub fn config() -> &'static Config {
    static CONFIG: OnceLock<Config> = OnceLock::new();
    CONFIG.get_or_init(|| {
        if let Some(filter) = std::env::var("SDP_PRELOAD_LOG").ok().filter(|f| !f.is_empty()) {
            let _ = env_logger::Builder::new().parse_filters(&filter).try_init();
        }
        match Config::parse(|k| std::env::var(k).ok()) {
            Ok(c) => c,
            Err(why) => {
                eprintln!("sdp_preload: {why}; nothing is accelerated");
                Config::OFF
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(vars: &[(&str, &str)]) -> Result<Config, String> {
        Config::parse(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string()))
    }

    #[test]
    fn defaults_accelerate_both_roles_on_every_port() {
        let c = parse(&[]).unwrap();
        assert!(c.client && c.server && c.port(1) && c.port(65535));
        assert_eq!(c.probe, Duration::from_millis(50));
        assert_eq!(c.poll_spin, Duration::from_micros(50));
        assert_eq!(parse(&[("SDP_PRELOAD_POLL_US", "0")]).unwrap().poll_spin, Duration::ZERO);
    }

    #[test]
    fn roles_ports_and_probe_time_parse_and_bad_values_are_errors() {
        let c =
            parse(&[("SDP_PRELOAD", "client"), ("SDP_PRELOAD_PORTS", "80, 8000-8002"), ("SDP_PRELOAD_PROBE_MS", "3")])
                .unwrap();
        assert!(c.client && !c.server);
        assert!(c.port(80) && c.port(8001) && !c.port(8003) && !c.port(81));
        assert_eq!(c.probe, Duration::from_millis(3));
        assert!(!parse(&[("SDP_PRELOAD", "off")]).unwrap().client);
        let rules = std::env::temp_dir().join(format!("sdp-preload-rules-{}", std::process::id()));
        std::fs::write(&rules, "use tcp connect curl *:80\nuse sdp listen * *:*\n").unwrap();
        let c = parse(&[("SDP_PRELOAD", "client"), ("SDP_PRELOAD_RULES", rules.to_str().unwrap())]).unwrap();
        let at = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert!(!c.accelerates("curl", Role::Connect, at("10.0.0.1:80")), "the rule keeps it on TCP");
        assert!(c.accelerates("wget", Role::Connect, at("10.0.0.1:80")), "no rule: SDP_PRELOAD=client");
        assert!(c.accelerates("nginx", Role::Listen, at("0.0.0.0:80")), "a rule enables a role SDP_PRELOAD left off");
        std::fs::write(&rules, "use sdp sometimes * *:*\n").unwrap();
        let e = parse(&[("SDP_PRELOAD_RULES", rules.to_str().unwrap())]).unwrap_err();
        assert!(e.contains("SDP_PRELOAD_RULES") && e.contains("line 1"), "{e}");
        let _ = std::fs::remove_file(&rules);
        assert!(parse(&[("SDP_PRELOAD_RULES", "/nonexistent/rules")]).is_err());
        for bad in [
            ("SDP_PRELOAD", "yes"),
            ("SDP_PRELOAD_PORTS", "80-"),
            ("SDP_PRELOAD_PORTS", "9-8"),
            ("SDP_PRELOAD_PROBE_MS", "0"),
            ("SDP_PRELOAD_POLL_US", "-1"),
            ("SDP_PRELOAD_POLL_US", "2000000"),
        ] {
            assert!(parse(&[bad]).is_err(), "{bad:?}");
        }
    }
}
