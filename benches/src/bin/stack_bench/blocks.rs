//! What one round measures per layer (a block of round trips, a block of streaming), and the
//! medians it is reduced to.

use crate::*;

/// What the client asks the server to serve next: a 16-byte message on the first layer's link,
/// outside the measurements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Block {
    /// `round_trips` ping-pongs of `size` bytes on link `link`.
    Latency { link: usize, size: usize, round_trips: u64 },
    /// `messages` of `size` bytes streamed on link `link`, then the server's acknowledgement
    /// carrying the CPU nanoseconds it spent.
    Stream { link: usize, size: usize, messages: u64 },
    /// The run is over.
    Done,
}

impl Block {
    pub(crate) fn encode(self) -> [u64; 2] {
        let head = |kind: u64, link: usize, size: usize| kind | (link as u64) << 8 | (size as u64) << 16;
        match self {
            Block::Latency { link, size, round_trips } => [head(1, link, size), round_trips],
            Block::Stream { link, size, messages } => [head(2, link, size), messages],
            Block::Done => [0, 0],
        }
    }

    /// Checks what the client sent against the links and sizes there are.
    pub(crate) fn decode(w: [u64; 2], links: usize) -> Result<Block, String> {
        let (kind, link, size) = (w[0] & 0xff, (w[0] >> 8 & 0xff) as usize, (w[0] >> 16) as usize);
        let block = match kind {
            0 => return Ok(Block::Done),
            1 => Block::Latency { link, size, round_trips: w[1] },
            2 => Block::Stream { link, size, messages: w[1] },
            k => return Err(format!("the client sent an unknown block kind {k}")),
        };
        if link >= links || size == 0 || size > MAX {
            return Err(format!("the client asked for link {link} of {links} with {size}-byte messages"));
        }
        Ok(block)
    }

    /// One message, so that a link whose `get` sees only the latest arrival reads it whole.
    pub(crate) fn announce(self, control: &mut dyn Link) -> Result<(), String> {
        control.put(self.encode());
        control.send(CONTROL)
    }
}

/// The `r`th of `parts` near-equal shares of `total`.
pub(crate) fn share(total: u64, parts: u64, r: u64) -> u64 {
    total / parts + u64::from(r < total % parts)
}

/// The median of a block's samples or of the rounds' differences (reordered).
pub(crate) fn median<T: Ord + Copy>(v: &mut [T]) -> T {
    quantile(v, 0.5)
}

/// The value at `q` (0 to 1) of a non-empty slice (reordered), as the C peers index theirs.
pub(crate) fn quantile<T: Ord + Copy>(v: &mut [T], q: f64) -> T {
    let at = ((v.len() as f64 * q) as usize).min(v.len() - 1);
    *v.select_nth_unstable(at).1
}

/// One layer's measurements at one size, summed over the rounds.
pub(crate) struct Tally {
    pub(crate) hist: Histogram<u64>,
    /// Each round's median one-way latency (ns).
    pub(crate) round_medians: Vec<u64>,
    /// Each round's 99th percentile (ns): a peer's as its program reports it.
    pub(crate) round_p99s: Vec<u64>,
    pub(crate) bytes: f64,
    pub(crate) secs: f64,
    pub(crate) cpu: f64,
}

/// Runs `warm` unrecorded round trips, then `n` recorded ones; returns their one-way times (ns).
pub(crate) fn latency_block(
    link: &mut dyn Link,
    clock: &TickClock,
    size: usize,
    warm: u64,
    n: u64,
) -> Result<Vec<u64>, String> {
    let mut ticks = Vec::with_capacity(n as usize);
    // One clock read per round trip, as ucx_perftest takes it, and as cheap a clock (the
    // time-stamp counter): each round trip ends where the next begins, so the loop's own
    // work is counted once and the timer once.
    let span = clock.span();
    let mut last = clock.now();
    for i in 0..warm + n {
        link.send(size)?;
        link.recv(size)?;
        let now = clock.now();
        if i >= warm {
            // (Saturating: an unpinned client moved to a CPU whose counter lags reads no
            // negative round trip as a huge one.)
            ticks.push(now.saturating_sub(last));
        }
        last = now;
    }
    let ns_per_tick = span.ns_per_tick();
    Ok(ticks.into_iter().map(|t| ((t as f64 * ns_per_tick / 2.0) as u64).max(1)).collect())
}
