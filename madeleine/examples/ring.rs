//! A ring, any-source receives and a barrier: each rank sends its right neighbour a message
//! (a length, then a body of that many bytes), receives its left neighbour's, then rank 0
//! gathers one word from every other rank in whatever order they come.
//!
//! Started by a launcher, one process per rank, on one host:
//!
//!     cargo build --release -p madeleine --example ring
//!     mpirun -np 4 target/release/examples/ring          # Open MPI (add --oversubscribe
//!                                                        #  beyond the cores)
//!     srun -n 4 target/release/examples/ring             # Slurm
//!     madrun -n 4 target/release/examples/ring           # no launcher (this workspace's
//!                                                        #  `cargo run -p madeleine --bin madrun`)

use madeleine::*;

fn main() -> Result<()> {
    let session = Session::new(SessionConfig::from_env()?)?;
    let ch = session.channel()?;
    // The barrier's empty messages get a channel of their own: on `ch` they could meet rank
    // 0's any-source receives.
    let control = session.channel()?;
    let (rank, size) = (session.rank(), session.size());
    if size < 2 {
        return Err(MadError::Invalid("run at least two ranks".into()));
    }
    // The ring: send right (without waiting for the receiver), then receive from the left.
    let body: Vec<u8> = (0..1 << 20).map(|i| (i * 7 + rank) as u8).collect();
    let len = (body.len() as u64).to_le_bytes();
    let mut p = ch.begin_packing((rank + 1) % size)?;
    p.pack(&len, SendMode::Cheaper, RecvMode::Express)?;
    p.pack(&body, SendMode::Cheaper, RecvMode::Cheaper)?;
    let pending = p.end_packing_nowait()?;
    let left = (rank + size - 1) % size;
    let mut got = Vec::new();
    let mut u = ch.begin_unpacking_from(left)?;
    let mut n = [0u8; 8];
    u.unpack_express(&mut n, SendMode::Cheaper)?;
    got.resize(u64::from_le_bytes(n) as usize, 0);
    u.unpack(&mut got, SendMode::Cheaper, RecvMode::Cheaper)?;
    u.end_unpacking()?;
    pending.wait()?;
    let ok = got.iter().enumerate().all(|(i, &b)| b == (i * 7 + left) as u8);
    // Any-source: rank 0 takes one word from every other rank, in arrival order.
    if rank == 0 {
        let mut all_ok = ok;
        for _ in 1..size {
            let mut u = ch.begin_unpacking()?;
            let mut w = [0u8; 1];
            u.unpack_express(&mut w, SendMode::Safer)?;
            let from = u.source();
            u.end_unpacking()?;
            all_ok &= w[0] == 1;
            println!("rank 0: rank {from} reports its ring message {}", if w[0] == 1 { "intact" } else { "CORRUPT" });
        }
        println!("ring of {size} ranks: {}", if all_ok { "ok" } else { "FAILED" });
    } else {
        let mut p = ch.begin_packing(0)?;
        p.pack_safer(&[ok as u8], RecvMode::Express)?;
        p.end_packing()?;
    }
    control.barrier()?;
    if ok {
        Ok(())
    } else {
        Err(MadError::Invalid(format!("rank {rank}: the message from rank {left} was corrupted")))
    }
}
