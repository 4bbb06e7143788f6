//! A rules file in the manner of libsdp.conf (`SDP_PRELOAD_RULES=path`): which connections
//! go over SDP and which stay TCP, by program, role, address and port. One rule a line, the
//! first that matches decides; a connection no rule matches follows `SDP_PRELOAD` and
//! `SDP_PRELOAD_PORTS`. `#` starts a comment.
//!
//! ```text
//! # use  sdp|tcp  connect|listen|both  program  address[/prefix]:port[-port]
//! use tcp both   sshd    *:*
//! use sdp listen *       0.0.0.0/0:8000-8999
//! use sdp connect curl   10.0.0.0/8:*
//! ```
//!
//! `program` is the program's name (`/proc/self/comm`'s, as `ps` shows it) or a prefix ending in
//! `*`; an address `*` or a port `*` matches any. Plain state and functions: the library reads
//! the file once and asks [`Rules::decide`].

use std::net::{IpAddr, SocketAddr};

/// Which side of a connection a call is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// `connect`.
    Connect,
    /// `listen`.
    Listen,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Rule {
    sdp: bool,
    connect: bool,
    listen: bool,
    program: String,
    net: Option<(IpAddr, u8)>,
    ports: Option<(u16, u16)>,
}

/// The rules of a file, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rules(Vec<Rule>);

impl Rules {
    /// No rules.
    pub const EMPTY: Rules = Rules(Vec::new());

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Parses a rules file; an error names the line.
    pub fn parse(text: &str) -> Result<Rules, String> {
        let mut rules = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let bad = |why: &str| format!("line {}: {why}: {line:?}", n + 1);
            let f: Vec<&str> = line.split_whitespace().collect();
            let [verb, how, role, program, target] = f[..] else {
                return Err(bad("expected `use sdp|tcp connect|listen|both program address:port`"));
            };
            if verb != "use" {
                return Err(bad("a rule starts with `use`"));
            }
            let sdp = match how {
                "sdp" => true,
                "tcp" => false,
                _ => return Err(bad("`sdp` or `tcp`")),
            };
            let (connect, listen) = match role {
                "connect" | "client" => (true, false),
                "listen" | "server" => (false, true),
                "both" => (true, true),
                _ => return Err(bad("`connect`, `listen` or `both`")),
            };
            let (addr, ports) = target.rsplit_once(':').ok_or_else(|| bad("address:port"))?;
            let net = match addr {
                "*" => None,
                a => {
                    let (ip, prefix) = match a.split_once('/') {
                        Some((ip, p)) => (ip, Some(p)),
                        None => (a, None),
                    };
                    let ip: IpAddr = ip.trim_matches(['[', ']']).parse().map_err(|_| bad("not an address"))?;
                    let max = if ip.is_ipv4() { 32 } else { 128 };
                    let prefix = match prefix {
                        Some(p) => {
                            p.parse::<u8>().ok().filter(|&p| p <= max).ok_or_else(|| bad("not a prefix length"))?
                        }
                        None => max,
                    };
                    Some((ip, prefix))
                }
            };
            let ports = match ports {
                "*" => None,
                p => {
                    let (a, b) = p.split_once('-').unwrap_or((p, p));
                    let (a, b) = (a.parse::<u16>(), b.parse::<u16>());
                    match (a, b) {
                        (Ok(a), Ok(b)) if a <= b => Some((a, b)),
                        _ => return Err(bad("not a port or a range a-b")),
                    }
                }
            };
            rules.push(Rule { sdp, connect, listen, program: program.to_string(), net, ports });
        }
        Ok(Rules(rules))
    }

    /// What the first matching rule says for `program` in `role` at `addr` (`Some(true)`: SDP,
    /// `Some(false)`: TCP), or `None` when no rule matches.
    pub fn decide(&self, program: &str, role: Role, addr: SocketAddr) -> Option<bool> {
        self.0.iter().find(|r| r.matches(program, role, addr)).map(|r| r.sdp)
    }
}

impl Rule {
    fn matches(&self, program: &str, role: Role, addr: SocketAddr) -> bool {
        let role_ok = match role {
            Role::Connect => self.connect,
            Role::Listen => self.listen,
        };
        let program_ok = match self.program.strip_suffix('*') {
            Some(prefix) => program.starts_with(prefix),
            None => self.program == program,
        };
        let port_ok = self.ports.is_none_or(|(a, b)| (a..=b).contains(&addr.port()));
        role_ok && program_ok && port_ok && self.net.is_none_or(|(net, len)| in_net(addr.ip(), net, len))
    }
}

/// Whether `ip` lies in `net`/`len` (an IPv4 address mapped in IPv6 counts as IPv4; a
/// wildcard `net`, 0.0.0.0 or ::, with any length matches its whole family).
fn in_net(ip: IpAddr, net: IpAddr, len: u8) -> bool {
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    };
    match (ip, net) {
        (IpAddr::V4(a), IpAddr::V4(n)) => {
            let mask = if len == 0 { 0 } else { u32::MAX << (32 - len as u32) };
            u32::from(a) & mask == u32::from(n) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(n)) => {
            let mask = if len == 0 { 0 } else { u128::MAX << (128 - len as u32) };
            u128::from(a) & mask == u128::from(n) & mask
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn the_first_matching_rule_decides_and_unmatched_connections_are_left_alone() {
        let r = Rules::parse(
            "# comment\n\
             use tcp both sshd *:*\n\
             use sdp listen * 0.0.0.0/0:8000-8999   # web\n\
             use sdp connect cur* 10.0.0.0/8:*\n\
             use tcp connect * [::1]:5201\n",
        )
        .unwrap();
        assert_eq!(r.decide("sshd", Role::Listen, at("0.0.0.0:8080")), Some(false), "first rule wins");
        assert_eq!(r.decide("python3", Role::Listen, at("127.0.0.1:8080")), Some(true));
        assert_eq!(r.decide("python3", Role::Connect, at("127.0.0.1:8080")), None, "listen only");
        assert_eq!(r.decide("curl", Role::Connect, at("10.1.2.3:80")), Some(true));
        assert_eq!(r.decide("curl", Role::Connect, at("11.1.2.3:80")), None);
        assert_eq!(r.decide("iperf3", Role::Connect, at("[::1]:5201")), Some(false));
        assert_eq!(r.decide("python3", Role::Listen, at("[::ffff:10.0.0.1]:8001")), Some(true), "mapped v4");
    }

    #[test]
    fn bad_lines_are_errors_naming_the_line() {
        for bad in [
            "use sdp both *",
            "uses sdp both * *:*",
            "use udp both * *:*",
            "use sdp sometimes * *:*",
            "use sdp both * 10.0.0.1",
            "use sdp both * 10.0.0.300:80",
            "use sdp both * 10.0.0.0/33:80",
            "use sdp both * *:90-80",
            "use sdp both * *:http",
        ] {
            let e = Rules::parse(&format!("\n{bad}\n")).unwrap_err();
            assert!(e.starts_with("line 2:"), "{bad}: {e}");
        }
        assert_eq!(Rules::parse("  # only a comment\n\n").unwrap(), Rules::default());
    }
}
