//! What `libsdp_preload.so` costs a call on a descriptor it does not accelerate: the program
//! runs its loop of socket calls (on a plain UDP socket: `fcntl(F_GETFL)`, `getsockopt`,
//! `recv` that finds nothing, `poll` and `epoll_wait` that find nothing) once plain and once
//! under the library, alternating rounds in one run, and reports nanoseconds per call of each
//! and the difference.
//!
//!     cargo build --release -p benches -p sdp-preload
//!     target/release/preload_overhead --library target/release/libsdp_preload.so

use std::process::Command;
use std::time::Instant;

use clap::Parser;

/// Per-call overhead of the preload library on plain descriptors.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// The preload library.
    #[arg(long)]
    library: Option<std::path::PathBuf>,
    /// Calls of each kind per round.
    #[arg(long, default_value_t = 2_000_000)]
    calls: u64,
    /// Rounds per mode (the best is reported: this machine is noisy).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Run one round here and print its figures (used by the parent run).
    #[arg(long, hide = true)]
    child: bool,
}

/// The calls measured, in order.
const CALLS: [&str; 5] =
    ["fcntl(F_GETFL)", "getsockopt(SO_TYPE)", "recv(MSG_DONTWAIT)", "poll(1 fd, 0)", "epoll_wait(0)"];

/// ns per call of each kind, one round.
fn round(calls: u64) -> [f64; CALLS.len()] {
    let sock = std::net::UdpSocket::bind("127.0.0.1:0").expect("a UDP socket");
    let fd = std::os::fd::AsRawFd::as_raw_fd(&sock);
    let mut out = [0f64; CALLS.len()];
    let t = Instant::now();
    for _ in 0..calls {
        // SAFETY: a plain query of our own socket.
        std::hint::black_box(unsafe { libc::fcntl(fd, libc::F_GETFL) });
    }
    out[0] = t.elapsed().as_nanos() as f64 / calls as f64;
    let t = Instant::now();
    for _ in 0..calls {
        let (mut v, mut len) = (0i32, 4 as libc::socklen_t);
        // SAFETY: an int-sized option of our own socket.
        std::hint::black_box(unsafe {
            libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_TYPE, &mut v as *mut i32 as *mut libc::c_void, &mut len)
        });
    }
    out[1] = t.elapsed().as_nanos() as f64 / calls as f64;
    let mut buf = [0u8; 64];
    let t = Instant::now();
    for _ in 0..calls {
        // SAFETY: our buffer; nothing arrives, so EAGAIN.
        std::hint::black_box(unsafe {
            libc::recv(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len(), libc::MSG_DONTWAIT)
        });
    }
    out[2] = t.elapsed().as_nanos() as f64 / calls as f64;
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    let t = Instant::now();
    for _ in 0..calls {
        // SAFETY: one valid pollfd; nothing arrives, so 0.
        std::hint::black_box(unsafe { libc::poll(&mut p, 1, 0) });
    }
    out[3] = t.elapsed().as_nanos() as f64 / calls as f64;
    // SAFETY: a new epoll set holding our socket; closed below.
    let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: 0 };
    // SAFETY: valid descriptors and event.
    unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) };
    let mut events = [libc::epoll_event { events: 0, u64: 0 }; 4];
    let t = Instant::now();
    for _ in 0..calls {
        // SAFETY: our epoll set and event array; nothing arrives, so 0.
        std::hint::black_box(unsafe { libc::epoll_wait(ep, events.as_mut_ptr(), 4, 0) });
    }
    out[4] = t.elapsed().as_nanos() as f64 / calls as f64;
    // SAFETY: our epoll set.
    unsafe { libc::close(ep) };
    out
}

fn main() {
    let args = Args::parse();
    if args.child {
        let r = round(args.calls);
        println!("{}", r.map(|x| x.to_string()).join(" "));
        return;
    }
    let Some(lib) = args.library.as_ref() else {
        eprintln!("--library: the path of libsdp_preload.so (cargo build --release -p sdp-preload)");
        std::process::exit(2);
    };
    let exe = std::env::current_exe().expect("own path");
    let mut best = [[f64::MAX; CALLS.len()]; 2];
    for _ in 0..args.rounds {
        for (mode, preload) in [false, true].into_iter().enumerate() {
            let mut c = Command::new(&exe);
            c.args(["--child", "--calls", &args.calls.to_string()]).env_remove("LD_PRELOAD");
            if preload {
                c.env("LD_PRELOAD", lib);
            }
            let out = c.output().expect("run a round");
            let text = String::from_utf8_lossy(&out.stdout);
            let v: Vec<f64> = text.split_whitespace().filter_map(|x| x.parse().ok()).collect();
            assert_eq!(v.len(), CALLS.len(), "a round printed {text:?}");
            for (b, x) in best[mode].iter_mut().zip(v) {
                *b = b.min(x);
            }
        }
    }
    println!("# ns per call on a plain UDP socket, best of {} rounds of {} calls", args.rounds, args.calls);
    println!("{:>22} {:>10} {:>10} {:>10}", "call", "plain", "preloaded", "overhead");
    for (k, name) in CALLS.iter().enumerate() {
        println!("{name:>22} {:>10.1} {:>10.1} {:>10.1}", best[0][k], best[1][k], best[1][k] - best[0][k]);
    }
}
