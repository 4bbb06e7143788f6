//! The background progress engine of asynchronous zero-copy sockets.
//!
//! An AZ-SDP `write` returns while the peer still reads the (protected) buffer, and a `read`
//! returns before the data has landed. Something must notice the end of those transfers and
//! release the buffers even when the application makes no further socket call — in particular
//! when it is stopped in the fault handler, touching one of them. That is this one thread per
//! process: it visits the sockets with transfers in flight, never blocking on a socket lock
//! the application holds, and sleeps on the fault bell (`protect::wait_bell`), which the fault
//! handler rings when a thread starts waiting and sockets ring when they start a transfer.
//!
//! The engine never touches application memory itself (the provider reaches held pages the way
//! DMA does), so a thread waiting in a fault can never be waiting for it to get past that fault.

use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use portability_verbs::protect;

/// A socket the engine can drive.
pub(crate) trait Background: Send {
    /// Takes what has arrived and finishes what completed; `true` while transfers remain in
    /// flight (so the engine should come back soon).
    fn background_progress(&mut self) -> bool;
}

type Watched = Weak<Mutex<dyn Background>>;

struct Engine {
    sockets: Mutex<Vec<Watched>>,
}

fn engine() -> &'static Engine {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let spawned = std::thread::Builder::new().name("sdp-progress".into()).spawn(run);
        if let Err(e) = spawned {
            // Sockets still progress on their own calls; only waits in faults would depend on it.
            log::error!("cannot start the SDP progress thread: {e}");
        }
        Engine { sockets: Mutex::new(Vec::new()) }
    })
}

/// Puts a socket under the engine's watch (once per socket is enough) and wakes the engine.
pub(crate) fn watch(socket: &Arc<Mutex<dyn Background>>) {
    let e = engine();
    let mut s = e.sockets.lock().unwrap_or_else(|p| p.into_inner());
    let w = Arc::downgrade(socket);
    if !s.iter().any(|x| x.ptr_eq(&w)) {
        s.push(w);
    }
    drop(s);
    protect::ring_bell();
}

fn run() {
    let e = engine();
    let mut idle_rounds = 0u32;
    loop {
        let bell = protect::fault_bell();
        let sockets: Vec<Watched> = {
            let mut s = e.sockets.lock().unwrap_or_else(|p| p.into_inner());
            s.retain(|w| w.strong_count() > 0);
            s.clone()
        };
        let mut busy = false;
        for w in sockets {
            let Some(sock) = w.upgrade() else { continue };
            // A socket the application is using right now progresses on its own.
            let Ok(mut g) = sock.try_lock() else {
                busy = true;
                continue;
            };
            busy |= g.background_progress();
        }
        if busy {
            idle_rounds = 0;
            if protect::fault_waiters() > 0 {
                // A thread is stopped in a fault until these transfers end, and the peer may
                // need us to take its messages before it can finish them: no pause.
                std::thread::yield_now();
            } else {
                // Transfers in flight: look again soon, at once if someone starts waiting.
                protect::wait_bell(bell, Duration::from_micros(200));
            }
        } else {
            idle_rounds = idle_rounds.saturating_add(1);
            let nap = if idle_rounds < 100 { Duration::from_millis(1) } else { Duration::from_millis(100) };
            protect::wait_bell(bell, nap);
        }
    }
}
