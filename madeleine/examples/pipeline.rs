//! A small multithreaded distributed pipeline: rank 0 produces records of varying length,
//! rank 1 transforms them, rank 2 checks them. Each stage runs several worker threads that
//! share the channel; every message carries its length EXPRESS (it decides the allocation) and
//! its body CHEAPER (zero-copy when large).
//!
//! `cargo run --release -p madeleine --example pipeline` runs the three ranks as three
//! processes (rank 0 launches the others).

use madeleine::*;

const RECORDS: u64 = 600;
const WORKERS: u64 = 3;

fn record(i: u64) -> Vec<u8> {
    let len = (i * 7919 % 70_000) as usize;
    (0..len).map(|k| (i as usize + k) as u8).collect()
}

fn send(ch: &Channel, to: usize, id: u64, body: &[u8]) -> Result<()> {
    let head = [id.to_le_bytes(), (body.len() as u64).to_le_bytes()].concat();
    let mut p = ch.begin_packing(to)?;
    p.pack(&head, SendMode::Cheaper, RecvMode::Express)?;
    p.pack(body, SendMode::Cheaper, RecvMode::Cheaper)?;
    p.end_packing()
}

fn recv(ch: &Channel) -> Result<(u64, Vec<u8>)> {
    let mut body = Vec::new();
    let mut u = ch.begin_unpacking()?;
    let mut head = [0u8; 16];
    u.unpack_express(&mut head, SendMode::Cheaper)?;
    let id = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
    body.resize(u64::from_le_bytes(head[8..].try_into().expect("8 bytes")) as usize, 0);
    u.unpack(&mut body, SendMode::Cheaper, RecvMode::Cheaper)?;
    u.end_unpacking()?;
    Ok((id, body))
}

fn main() -> Result<()> {
    let mut children = Vec::new();
    let cfg = match SessionConfig::from_env() {
        Ok(c) => c,
        Err(_) => {
            let dir = std::env::temp_dir().join(format!("mad-pipeline-{}", std::process::id()));
            for r in 1..3 {
                children.push(
                    std::process::Command::new(std::env::current_exe().expect("own path"))
                        .env("MAD_RANK", r.to_string())
                        .env("MAD_SIZE", "3")
                        .env("MAD_RENDEZVOUS", &dir)
                        .spawn()
                        .expect("start a rank"),
                );
            }
            SessionConfig::new(0, 3, dir)
        }
    };
    let session = Session::new(cfg)?;
    let ch = session.channel()?;
    let per_worker = RECORDS / WORKERS;
    let rank = session.rank();
    std::thread::scope(|s| -> Result<()> {
        let mut hs = Vec::new();
        for w in 0..WORKERS {
            let ch = &ch;
            hs.push(s.spawn(move || -> Result<u64> {
                let mut checked = 0;
                for k in 0..per_worker {
                    match rank {
                        0 => send(ch, 1, w * per_worker + k, &record(w * per_worker + k))?,
                        1 => {
                            let (id, mut body) = recv(ch)?;
                            body.iter_mut().for_each(|b| *b = b.wrapping_add(1));
                            send(ch, 2, id, &body)?;
                        }
                        _ => {
                            let (id, body) = recv(ch)?;
                            let want: Vec<u8> = record(id).iter().map(|b| b.wrapping_add(1)).collect();
                            assert_eq!(body, want, "record {id}");
                            checked += 1;
                        }
                    }
                }
                Ok(checked)
            }));
        }
        let checked: u64 = hs.into_iter().map(|h| h.join().expect("worker")).sum::<Result<u64>>()?;
        if rank == 2 {
            println!("rank 2 checked {checked} records through the pipeline");
        }
        Ok(())
    })?;
    ch.barrier()?;
    for mut c in children {
        c.wait().expect("a rank exits");
    }
    Ok(())
}
