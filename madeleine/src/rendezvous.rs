//! The root rendezvous: how the ranks of a job that spans hosts learn each other's connection
//! addresses, through rank 0 at a TCP address every rank can reach (`MAD_ROOT=host:port`), as
//! NCCL's and torch.distributed's bootstraps do for launchers that give no other channel.
//!
//! Every rank listens for its peers' connections on a TCP port of its own and sends rank 0 a
//! registration (job tag, rank, size, that address); rank 0 answers every rank with the table
//! of all addresses once all have registered. The codec is plain data with validated decoding;
//! `exchange` moves its bytes.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::{MadError, Result};

const MAGIC: [u8; 4] = *b"MADR";
/// Bytes of an encoded address: IPv6 (IPv4 mapped) and port.
const ADDR: usize = 18;
/// A registration: magic, job tag, rank, size, address.
pub const REGISTRATION: usize = 4 + 8 + 8 + 8 + ADDR;
/// Largest group a table may describe (a bound on what a peer can make us allocate).
pub const MAX_RANKS: usize = 1 << 20;

/// A rank's registration with the root.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Registration {
    pub job_tag: u64,
    pub rank: usize,
    pub size: usize,
    pub addr: SocketAddr,
}

fn put_addr(out: &mut Vec<u8>, a: &SocketAddr) {
    let ip = match a.ip() {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    };
    out.extend_from_slice(&ip.octets());
    out.extend_from_slice(&a.port().to_le_bytes());
}

fn get_addr(b: &[u8]) -> SocketAddr {
    let ip = Ipv6Addr::from(<[u8; 16]>::try_from(&b[..16]).expect("16 bytes"));
    let ip = ip.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(IpAddr::V6(ip));
    SocketAddr::new(ip, u16::from_le_bytes([b[16], b[17]]))
}

fn bad(why: impl Into<String>) -> MadError {
    MadError::Protocol { rank: 0, why: format!("root rendezvous: {}", why.into()) }
}

impl Registration {
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(REGISTRATION);
        v.extend_from_slice(&MAGIC);
        v.extend_from_slice(&self.job_tag.to_le_bytes());
        v.extend_from_slice(&(self.rank as u64).to_le_bytes());
        v.extend_from_slice(&(self.size as u64).to_le_bytes());
        put_addr(&mut v, &self.addr);
        v
    }

    pub fn decode(b: &[u8]) -> Result<Registration> {
        if b.len() != REGISTRATION || b[..4] != MAGIC {
            return Err(bad("not a registration"));
        }
        let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let (rank, size) = (word(12), word(20));
        if size == 0 || size > MAX_RANKS as u64 || rank >= size {
            return Err(bad(format!("rank {rank} of {size}")));
        }
        Ok(Registration { job_tag: word(4), rank: rank as usize, size: size as usize, addr: get_addr(&b[28..]) })
    }
}

/// The table rank 0 sends: magic, count, then the addresses by rank.
pub fn encode_table(addrs: &[SocketAddr]) -> Vec<u8> {
    let mut v = Vec::with_capacity(12 + addrs.len() * ADDR);
    v.extend_from_slice(&MAGIC);
    v.extend_from_slice(&(addrs.len() as u64).to_le_bytes());
    for a in addrs {
        put_addr(&mut v, a);
    }
    v
}

/// Bytes of a table of `size` ranks.
pub fn table_len(size: usize) -> usize {
    12 + size * ADDR
}

/// Decodes the table of a group of `size` ranks.
pub fn decode_table(b: &[u8], size: usize) -> Result<Vec<SocketAddr>> {
    if b.len() != table_len(size) || b[..4] != MAGIC {
        return Err(bad("not an address table"));
    }
    if u64::from_le_bytes(b[4..12].try_into().expect("8 bytes")) != size as u64 {
        return Err(bad("a table for another group size"));
    }
    Ok(b[12..].chunks_exact(ADDR).map(get_addr).collect())
}

/// Learns every rank's address: rank 0 serves at `root` until all registered; the others
/// register there (retrying while rank 0 starts). `listen` is this rank's own address for its
/// peers (its IP is replaced by the one the root sees us from when unspecified). Rank 0's own
/// entry gets the IP its peers reached the root at.
pub fn exchange(root: SocketAddr, me: Registration, timeout: Duration) -> Result<Vec<SocketAddr>> {
    let deadline = Instant::now() + timeout;
    if me.rank == 0 {
        serve(root, me, deadline)
    } else {
        register(root, me, deadline)
    }
}

fn io(what: &str) -> impl Fn(std::io::Error) -> MadError + '_ {
    move |e| MadError::Invalid(format!("root rendezvous, {what}: {e}"))
}

fn serve(root: SocketAddr, me: Registration, deadline: Instant) -> Result<Vec<SocketAddr>> {
    let listener = TcpListener::bind(root).map_err(io("binding the root address"))?;
    listener.set_nonblocking(true).map_err(io("root listener"))?;
    let mut addrs: Vec<Option<SocketAddr>> = vec![None; me.size];
    let mut streams: Vec<(usize, TcpStream)> = Vec::new();
    while streams.len() + 1 < me.size {
        if Instant::now() > deadline {
            let missing: Vec<usize> = (1..me.size).filter(|r| addrs[*r].is_none()).collect();
            return Err(MadError::Timeout(format!("root rendezvous: ranks {missing:?} never registered")));
        }
        let (mut s, from) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            Err(e) => return Err(io("accepting")(e)),
        };
        // A client that says nothing in time, or not a registration, costs only its connection.
        let read = (|| {
            s.set_nonblocking(false)?;
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            let mut b = [0u8; REGISTRATION];
            s.read_exact(&mut b)?;
            Ok::<_, std::io::Error>(b)
        })();
        let r = match read.map_err(io("reading a registration")).and_then(|b| Registration::decode(&b)) {
            Ok(r) => r,
            Err(e) => {
                log::warn!("madeleine: {e} (from {from}); ignored");
                continue;
            }
        };
        if r.job_tag != me.job_tag || r.size != me.size || r.rank == 0 {
            log::warn!("madeleine: root rendezvous turned away {from} (another job, size or rank 0)");
            continue;
        }
        if addrs[r.rank].is_some() {
            return Err(bad(format!("rank {} registered twice", r.rank)));
        }
        let mut a = r.addr;
        if a.ip().is_unspecified() {
            a.set_ip(from.ip());
        }
        addrs[r.rank] = Some(a);
        streams.push((r.rank, s));
    }
    addrs[0] = Some(me.addr);
    let mut table: Vec<SocketAddr> = addrs.into_iter().map(|a| a.expect("every rank registered")).collect();
    for (_, s) in &mut streams {
        // Rank 0's entry as this rank reached us.
        let mut t = table.clone();
        if t[0].ip().is_unspecified() {
            if let Ok(local) = s.local_addr() {
                t[0].set_ip(local.ip());
            }
        }
        // A rank that stops reading cannot hold the root (and so the job) here.
        s.set_write_timeout(Some(Duration::from_secs(5))).map_err(io("sending the table"))?;
        s.write_all(&encode_table(&t)).map_err(io("sending the table"))?;
    }
    if table[0].ip().is_unspecified() {
        table[0].set_ip(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST));
    }
    Ok(table)
}

fn register(root: SocketAddr, me: Registration, deadline: Instant) -> Result<Vec<SocketAddr>> {
    let mut s = loop {
        match TcpStream::connect_timeout(&root, Duration::from_secs(1)) {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline => {
                log::debug!("madeleine: root {root} not there yet: {e}");
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(MadError::Timeout(format!("root rendezvous: no root at {root}: {e}"))),
        }
    };
    let mut reg = me;
    if reg.addr.ip().is_unspecified() {
        // The address the root sees us from reaches us from the other ranks too (one network).
        reg.addr.set_ip(s.local_addr().map_err(io("local address"))?.ip());
    }
    s.write_all(&reg.encode()).map_err(io("registering"))?;
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    s.set_read_timeout(Some(left)).map_err(io("waiting for the table"))?;
    let mut b = vec![0u8; table_len(me.size)];
    s.read_exact(&mut b).map_err(io("waiting for the table"))?;
    decode_table(&b, me.size)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn registrations_round_trip(tag in any::<u64>(), size in 1usize..1000, r in any::<usize>(), ip in any::<[u8; 4]>(), port in any::<u16>()) {
            let reg = Registration { job_tag: tag, rank: r % size, size, addr: SocketAddr::from((ip, port)) };
            prop_assert_eq!(Registration::decode(&reg.encode()).unwrap(), reg);
        }

        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..200), size in 1usize..8) {
            let _ = Registration::decode(&b);
            let _ = decode_table(&b, size);
        }
    }

    #[test]
    fn ranks_learn_every_address_through_the_root() {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let root: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let size = 4;
        let tables: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..size)
                .map(|rank| {
                    s.spawn(move || {
                        let addr: SocketAddr = format!("0.0.0.0:{}", 9000 + rank).parse().unwrap();
                        let me = Registration { job_tag: 7, rank, size, addr };
                        exchange(root, me, Duration::from_secs(10)).unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for t in &tables {
            let ports: Vec<u16> = t.iter().map(|a| a.port()).collect();
            assert_eq!(ports, [9000, 9001, 9002, 9003]);
            assert!(t.iter().all(|a| a.ip().is_loopback()), "{t:?}");
        }
    }

    #[test]
    fn a_rank_of_another_job_is_turned_away_and_a_missing_rank_times_out() {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let root: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let any: SocketAddr = "0.0.0.0:1".parse().unwrap();
        std::thread::scope(|s| {
            let r0 = s.spawn(move || {
                exchange(root, Registration { job_tag: 1, rank: 0, size: 2, addr: any }, Duration::from_secs(2))
            });
            let other = s.spawn(move || {
                exchange(root, Registration { job_tag: 2, rank: 1, size: 2, addr: any }, Duration::from_secs(2))
            });
            assert!(matches!(r0.join().unwrap(), Err(MadError::Timeout(_))));
            assert!(other.join().unwrap().is_err());
        });
    }
}
