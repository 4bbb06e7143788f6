//! Madeleine ping-pong between two processes.
//!
//! `cargo run --release -p madeleine --example pingpong` starts both ranks (it launches rank 1
//! itself); or run it in two shells with `MAD_RANK=0 MAD_SIZE=2` and `MAD_RANK=1 MAD_SIZE=2`
//! (and the same `MAD_RENDEZVOUS` directory).

use std::time::Instant;

use madeleine::*;

fn main() -> Result<()> {
    let mut child = None;
    let cfg = match SessionConfig::from_env() {
        Ok(c) => c,
        Err(_) => {
            // Launch rank 1 and be rank 0.
            let dir = std::env::temp_dir().join(format!("mad-pingpong-{}", std::process::id()));
            child = Some(
                std::process::Command::new(std::env::current_exe().expect("own path"))
                    .env("MAD_RANK", "1")
                    .env("MAD_SIZE", "2")
                    .env("MAD_RENDEZVOUS", &dir)
                    .spawn()
                    .expect("start rank 1"),
            );
            let mut cfg = SessionConfig::new(0, 2, dir);
            if let Some(f) =
                std::env::var("MAD_FLOW").ok().and_then(|n| portability_verbs::datapath::FlowStrategy::by_name(&n))
            {
                cfg.strategy = f;
            }
            cfg
        }
    };
    let session = Session::new(cfg)?;
    let ch = session.channel()?;
    let peer = 1 - session.rank();
    if session.rank() == 0 {
        match ch.rendezvous_threshold(peer)? {
            usize::MAX => println!("# zero-copy never pays to rank {peer}: large packs go through the bulk lane"),
            t => println!("# packs of {t} B and more go zero-copy to rank {peer}"),
        }
    }
    // The first round warms up (page faults, first registrations) and is not printed.
    for (round, size) in [8usize, 8, 1024, 64 * 1024, 1 << 20].into_iter().enumerate() {
        let mut buf = vec![7u8; size];
        let iters = 2000usize.min((64 << 20) / size.max(1)).max(20);
        let t = Instant::now();
        for _ in 0..iters {
            if session.rank() == 0 {
                let mut p = ch.begin_packing(peer)?;
                p.pack(&buf, SendMode::Cheaper, RecvMode::Cheaper)?;
                p.end_packing()?;
                let mut u = ch.begin_unpacking_from(peer)?;
                u.unpack(&mut buf, SendMode::Cheaper, RecvMode::Cheaper)?;
                u.end_unpacking()?;
            } else {
                let mut u = ch.begin_unpacking_from(peer)?;
                u.unpack(&mut buf, SendMode::Cheaper, RecvMode::Cheaper)?;
                u.end_unpacking()?;
                let mut p = ch.begin_packing(peer)?;
                p.pack(&buf, SendMode::Cheaper, RecvMode::Cheaper)?;
                p.end_packing()?;
            }
        }
        if session.rank() == 0 && round > 0 {
            let one_way = t.elapsed().as_secs_f64() / iters as f64 / 2.0;
            println!("{size:>8} B  one-way {:>8.3} us  {:>8.2} GB/s", one_way * 1e6, size as f64 / one_way / 1e9);
        }
    }
    ch.barrier()?;
    if let Some(mut c) = child {
        c.wait().expect("rank 1 exits");
    }
    Ok(())
}
