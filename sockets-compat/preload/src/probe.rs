//! The client's question (`sockets_compat::discovery`): does the server at `host:port`
//! accept SDP? Asked in the UDP port space before the TCP connection is made, so that a plain
//! server never sees a byte it did not ask for. Answers are remembered: a "yes" (the SDP port)
//! for [`YES_FOR`], so that a client opening many connections asks once; a "no" for [`NO_FOR`]
//! (an ICMP port-unreachable, or no answer within the probe time from a server that never
//! answered: a busy server that answered before is asked again next time), so that a client
//! connecting again and again to a plain server pays the wait once.

use std::collections::HashMap;
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sockets_compat::discovery;

/// How long a server found plain is not asked again.
pub const NO_FOR: Duration = Duration::from_secs(5);
/// How long a server's SDP port is used without asking again.
pub const YES_FOR: Duration = Duration::from_secs(2);
/// How long a server that answered counts as one that does (its silence is then taken for
/// load, not for a plain server).
const ANSWERED_FOR: Duration = Duration::from_secs(60);

#[derive(Default)]
struct Known {
    plain: HashMap<SocketAddr, Instant>,
    /// The SDP port, until when it is used without asking, when the server last answered.
    sdp: HashMap<SocketAddr, (u16, Instant, Instant)>,
}

static KNOWN: Mutex<Option<Known>> = Mutex::new(None);

fn known<T>(f: impl FnOnce(&mut Known) -> T) -> T {
    let mut g = KNOWN.lock().unwrap_or_else(|p| p.into_inner());
    f(g.get_or_insert_with(Known::default))
}

fn nonce() -> u64 {
    static N: AtomicU64 = AtomicU64::new(0);
    let mut r = 0u64;
    // SAFETY: fills 8 bytes of a local.
    unsafe { libc::getrandom(&mut r as *mut u64 as *mut libc::c_void, 8, libc::GRND_NONBLOCK) };
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    r ^ t ^ N.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed)
}

/// What a probe found.
enum Found {
    Sdp(u16),
    /// Refused: nothing listens on the UDP port.
    Refused,
    Silence,
}

/// The SDP listener's port of the server at `target`, if it has one (waits at most `wait`).
pub fn sdp_port(target: SocketAddr, wait: Duration) -> Option<u16> {
    let now = Instant::now();
    let cached = known(|k| {
        k.plain.retain(|_, until| *until > now);
        if k.plain.contains_key(&target) {
            return Some(None);
        }
        match k.sdp.get(&target) {
            Some(&(port, until, _)) if until > now => Some(Some(port)),
            _ => None,
        }
    });
    if let Some(answer) = cached {
        return answer;
    }
    let found = ask(target, wait);
    known(|k| match found {
        Found::Sdp(port) => {
            k.sdp.insert(target, (port, now + YES_FOR, now));
            Some(port)
        }
        Found::Refused => {
            k.sdp.remove(&target);
            k.plain.insert(target, now + NO_FOR);
            None
        }
        Found::Silence => {
            let answered_lately = k.sdp.get(&target).is_some_and(|&(_, _, at)| now.duration_since(at) < ANSWERED_FOR);
            if !answered_lately {
                k.plain.insert(target, now + NO_FOR);
            }
            None
        }
    })
}

/// Forgets `target`'s SDP port (its listener refused: the server restarted, say).
pub fn forget(target: SocketAddr) {
    known(|k| k.sdp.remove(&target));
}

fn ask(target: SocketAddr, wait: Duration) -> Found {
    let any: SocketAddr =
        if target.is_ipv4() { ([0, 0, 0, 0], 0).into() } else { (std::net::Ipv6Addr::UNSPECIFIED, 0).into() };
    let Ok(sock) = UdpSocket::bind(any) else { return Found::Silence };
    let nonce = nonce();
    if sock.connect(target).and_then(|()| sock.send(&discovery::encode_probe(nonce))).is_err() {
        return Found::Refused;
    }
    let deadline = Instant::now() + wait;
    let mut buf = [0u8; 64];
    loop {
        let Some(left) = deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()) else {
            return Found::Silence;
        };
        if sock.set_read_timeout(Some(left)).is_err() {
            return Found::Silence;
        }
        match sock.recv(&mut buf) {
            Ok(n) => {
                if let Some(port) = discovery::decode_answer(&buf[..n], nonce) {
                    return Found::Sdp(port);
                }
                // Something else (a stale answer): keep listening until the deadline.
            }
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                log::debug!("sdp_preload: {target} is plain TCP");
                return Found::Refused;
            }
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                log::debug!("sdp_preload: {target} did not answer within {wait:?}");
                return Found::Silence;
            }
            Err(e) => {
                log::debug!("sdp_preload: probing {target}: {e}");
                return Found::Refused;
            }
        }
    }
}
