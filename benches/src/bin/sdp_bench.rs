//! The SDP paper's benchmarks on the software provider: BSDP, ZSDP and TCP loopback side by
//! side in one run (ping-pong latency, ttcp-style unidirectional throughput, and throughput
//! with computation between sends). Both ends are threads of this process, pinned to CPUs 0
//! and 1; TCP busy-polls nonblocking sockets, as SDP's receive path does.
//!
//!     cargo run --release -p benches --bin sdp_bench

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use benches::{cacheline_one_way_ns, fmt_size, io_whole, pin_to_cpu, sizes_between};
use clap::Parser;
use hdrhistogram::Histogram;
use sockets_compat::{Design, SdpConfig, SdpListener, SdpStream};

#[derive(Parser)]
#[command(about = "SDP designs against TCP loopback: latency, throughput, overlap")]
struct Args {
    /// Largest message of the latency and throughput sweeps.
    #[arg(long, default_value_t = 1 << 20)]
    max: usize,
    /// Round trips per latency point.
    #[arg(long, default_value_t = 2000)]
    iters: usize,
    /// Bytes moved per throughput point.
    #[arg(long, default_value_t = 256 << 20)]
    volume: usize,
    /// Computation between sends in the overlap test, microseconds (comma-separated).
    #[arg(long, default_value = "0,25,50,100,200", value_delimiter = ',')]
    compute_us: Vec<u64>,
    /// Which transports (bsdp, zsdp, tcp).
    #[arg(long, default_value = "bsdp,zsdp,tcp", value_delimiter = ',')]
    layers: Vec<String>,
    /// ZSDP's zero-copy threshold.
    #[arg(long, default_value_t = 16 * 1024)]
    zcopy_threshold: usize,
}

trait Stream: Read + Write + Send + 'static {}
impl<T: Read + Write + Send + 'static> Stream for T {}

fn read_full(s: &mut dyn Stream, buf: &mut [u8]) -> std::io::Result<()> {
    io_whole(buf.len(), Duration::from_secs(30), |off| s.read(&mut buf[off..]))
}

fn write_full(s: &mut dyn Stream, buf: &[u8]) -> std::io::Result<()> {
    io_whole(buf.len(), Duration::from_secs(30), |off| s.write(&buf[off..]))
}

/// A connected pair of the named transport: (client, server).
fn connect(layer: &str, zcopy_threshold: usize) -> (Box<dyn Stream>, Box<dyn Stream>) {
    if layer == "tcp" {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let a = l.local_addr().expect("addr");
        let c = TcpStream::connect(a).expect("connect");
        let s = l.accept().expect("accept").0;
        for x in [&c, &s] {
            x.set_nodelay(true).expect("nodelay");
            x.set_nonblocking(true).expect("nonblocking");
        }
        return (Box::new(c), Box::new(s));
    }
    let design = Design::by_name(layer).unwrap_or_else(|| panic!("unknown layer {layer}"));
    let cfg = SdpConfig { design, zcopy_threshold, ..SdpConfig::default() };
    let l = SdpListener::bind_with("127.0.0.1:0", cfg).expect("bind");
    let a = l.local_addr().expect("addr");
    let t = thread::spawn(move || SdpStream::connect_with(a, cfg).expect("connect"));
    let s = l.accept_timeout(Duration::from_secs(20)).expect("accept").0;
    let c = t.join().expect("connect thread");
    for x in [&c, &s] {
        x.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
        x.set_write_timeout(Some(Duration::from_secs(30))).expect("timeout");
    }
    (Box::new(c), Box::new(s))
}

/// Median one-way latency (half round trip) in microseconds.
fn pingpong(layer: &str, size: usize, iters: usize, zt: usize) -> f64 {
    let (mut c, mut s) = connect(layer, zt);
    let server = thread::spawn(move || {
        pin_to_cpu(1);
        let mut buf = vec![0u8; size];
        for _ in 0..iters + iters / 10 {
            read_full(&mut *s, &mut buf).expect("server read");
            write_full(&mut *s, &buf).expect("server write");
        }
        s
    });
    pin_to_cpu(0);
    let mut h = Histogram::<u64>::new(3).expect("histogram");
    let mut buf = vec![1u8; size];
    for i in 0..iters + iters / 10 {
        let t = Instant::now();
        write_full(&mut *c, &buf).expect("client write");
        read_full(&mut *c, &mut buf).expect("client read");
        if i >= iters / 10 {
            h.record(t.elapsed().as_nanos() as u64).expect("record");
        }
    }
    drop(server.join().expect("server"));
    h.value_at_quantile(0.5) as f64 / 2000.0
}

fn spin_for(d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

/// Unidirectional throughput in GB/s: `volume` bytes in writes of `size`, with `compute`
/// of busy work after each write (the overlap test); the receiver reads `size` at a time.
fn throughput(layer: &str, size: usize, volume: usize, compute: Duration, zt: usize) -> f64 {
    let (mut c, mut s) = connect(layer, zt);
    let count = (volume / size).max(8);
    let receiver = thread::spawn(move || {
        pin_to_cpu(1);
        let mut buf = vec![0u8; size];
        for _ in 0..count {
            read_full(&mut *s, &mut buf).expect("receiver read");
        }
        write_full(&mut *s, &[1]).expect("ack");
        s
    });
    pin_to_cpu(0);
    let buf = vec![7u8; size];
    let t = Instant::now();
    for _ in 0..count {
        write_full(&mut *c, &buf).expect("sender write");
        if !compute.is_zero() {
            spin_for(compute);
        }
    }
    let mut ack = [0u8];
    read_full(&mut *c, &mut ack).expect("ack");
    let secs = t.elapsed().as_secs_f64();
    drop(receiver.join().expect("receiver"));
    (count * size) as f64 / secs / 1e9
}

fn main() {
    env_logger::init();
    let a = Args::parse();
    let floor = cacheline_one_way_ns(0, 1);
    println!("# sdp_bench: threads on CPUs 0 and 1; cache-line one-way floor now {floor:.0} ns");
    println!("# zcopy threshold {} (ZSDP), BSDP buffers {:?}", fmt_size(a.zcopy_threshold), SdpConfig::CREDIT);
    let sizes = sizes_between(8, a.max);

    println!("\n## Ping-pong latency, one way, median (us)");
    print!("{:>8}", "size");
    for l in &a.layers {
        print!("{l:>10}");
    }
    println!();
    for &size in &sizes {
        print!("{:>8}", fmt_size(size));
        let iters = (a.iters * 64 * 1024 / size.max(64 * 1024)).max(50);
        for l in &a.layers {
            print!("{:>10.2}", pingpong(l, size, iters, a.zcopy_threshold));
        }
        println!();
    }

    println!("\n## Unidirectional throughput (GB/s)");
    print!("{:>8}", "size");
    for l in &a.layers {
        print!("{l:>10}");
    }
    println!();
    for &size in sizes.iter().filter(|&&s| s >= 1024) {
        print!("{:>8}", fmt_size(size));
        for l in &a.layers {
            let vol = a.volume.min(size * 20_000);
            print!("{:>10.2}", throughput(l, size, vol, Duration::ZERO, a.zcopy_threshold));
        }
        println!();
    }

    for size in [64 * 1024, 1 << 20] {
        println!("\n## Overlap: throughput at {} with computation between sends (GB/s)", fmt_size(size));
        print!("{:>10}", "compute");
        for l in &a.layers {
            print!("{l:>10}");
        }
        println!();
        for &us in &a.compute_us {
            print!("{:>8}us", us);
            for l in &a.layers {
                let per = Duration::from_micros(us);
                // Enough sends for a steady state, bounded in time.
                let n = if us == 0 { 2000 } else { (400_000 / us as usize).clamp(200, 4000) };
                print!("{:>10.2}", throughput(l, size, size * n, per, a.zcopy_threshold));
            }
            println!();
        }
    }
}
