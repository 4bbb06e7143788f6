//! The layers' two ends: a `Link` per layer (raw verbs, the pipe, Madeleine, TCP, SDP), each able
//! to run a ping-pong and a stream against its peer.

use crate::*;

/// Bytes of a control message (a block's announcement, a stream's acknowledgement).
pub(crate) const CONTROL: usize = 16;

pub(crate) fn put_words(b: &mut [u8], w: [u64; 2]) {
    b[..8].copy_from_slice(&w[0].to_le_bytes());
    b[8..CONTROL].copy_from_slice(&w[1].to_le_bytes());
}

pub(crate) fn words(b: &[u8]) -> [u64; 2] {
    let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    [word(0), word(8)]
}

/// A connected transport of one layer, from one side.
pub(crate) trait Link {
    /// Sends `len` bytes of the buffer.
    fn send(&mut self, len: usize) -> Result<(), String>;
    /// Receives one message of `len` bytes.
    fn recv(&mut self, len: usize) -> Result<(), String>;
    /// Sends `count` messages of `len` bytes (a stream), all handed over when it returns.
    fn send_stream(&mut self, len: usize, count: u64) -> Result<(), String> {
        (0..count).try_for_each(|_| self.send(len))
    }
    /// Writes a control message (two words) at the start of the send buffer.
    fn put(&mut self, w: [u64; 2]);
    /// Reads the control message at the start of the last received message.
    fn get(&self) -> [u64; 2];
}

pub(crate) struct RawLink {
    pub(crate) qp: QueuePair,
    pub(crate) cq: CompletionQueue,
    pub(crate) send_buf: MemoryRegion,
    pub(crate) recv_buf: MemoryRegion,
    pub(crate) target: (u64, u32),
    pub(crate) wwi: bool,
    pub(crate) wait: Wait,
    pub(crate) posted: u64,
    pub(crate) wcs: Vec<WorkCompletion>,
    /// Receives completed, and those handed to the caller.
    pub(crate) recvs: u64,
    pub(crate) taken: u64,
    pub(crate) sends_done: u64,
    pub(crate) sends: u64,
}

impl RawLink {
    pub(crate) fn setup(
        ctx: &Context,
        conn_fn: impl FnOnce(&ProtectionDomain, &cm::QpSpec, &[u8]) -> Result<cm::Connection>,
        wwi: bool,
        wait: Wait,
    ) -> Result<RawLink> {
        let pd = ctx.alloc_pd()?;
        let send_buf = pd.register(vec![0x5a; MAX].into_boxed_slice(), AccessFlags::ALL)?;
        let recv_buf = pd.alloc(MAX, AccessFlags::ALL)?;
        let spec = cm::QpSpec { cq_capacity: 4096, ..cm::QpSpec::with_depths(1024, 1024) };
        let mut private = recv_buf.addr().to_le_bytes().to_vec();
        private.extend_from_slice(&recv_buf.rkey().to_le_bytes());
        let conn = conn_fn(&pd, &spec, &private)?;
        let cq = conn.cq.clone();
        let p = &conn.peer_private;
        if p.len() != 12 {
            return Err(VerbsError::Protocol("bad private data".into()));
        }
        let target =
            (u64::from_le_bytes(p[..8].try_into().expect("8")), u32::from_le_bytes(p[8..12].try_into().expect("4")));
        let mut l = RawLink {
            qp: conn.qp,
            cq,
            send_buf,
            recv_buf,
            target,
            wwi,
            wait,
            posted: 0,
            wcs: vec![WorkCompletion::EMPTY; 64],
            recvs: 0,
            taken: 0,
            sends_done: 0,
            sends: 0,
        };
        for _ in 0..512 {
            l.post_recv()?;
        }
        Ok(l)
    }

    pub(crate) fn post_recv(&mut self) -> Result<()> {
        self.posted += 1;
        self.qp.post_recv(&[RecvWr::new(self.posted, &[self.recv_buf.sge(0, MAX)])])
    }

    pub(crate) fn poll(&mut self) -> Result<(), String> {
        let n = match self.wait {
            Wait::Busy => self.cq.poll(&mut self.wcs).map_err(|e| e.to_string())?,
            Wait::Interrupt => self.cq.poll_blocking(&mut self.wcs, T).map_err(|e| e.to_string())?,
        };
        for wc in &self.wcs[..n] {
            if wc.status != WcStatus::Success {
                return Err(format!("completion failed: {wc:?}"));
            }
            match wc.opcode {
                WcOpcode::Recv | WcOpcode::RecvRdmaWithImm => self.recvs += 1,
                _ => self.sends_done += 1,
            }
        }
        Ok(())
    }
}

impl Link for RawLink {
    fn send(&mut self, len: usize) -> Result<(), String> {
        // Keep at most 256 sends in flight (signal every 64th).
        let mut patience = Patience::default();
        while self.sends - self.sends_done * 64 >= 256 {
            self.poll()?;
            if patience.expired() {
                return Err("send queue stuck".into());
            }
        }
        self.sends += 1;
        let signaled = self.sends.is_multiple_of(64);
        let sge = [self.send_buf.sge(0, len)];
        let wr = if self.wwi {
            SendWr::write_with_imm(self.sends, &sge, self.target.0, self.target.1, len as u32)
        } else {
            SendWr::send(self.sends, &sge)
        };
        self.qp.post_send(&[wr.inline(len <= 64).signaled(signaled)]).map_err(|e| e.to_string())
    }

    fn recv(&mut self, _len: usize) -> Result<(), String> {
        let mut patience = Patience::default();
        while self.recvs == self.taken {
            self.poll()?;
            if patience.expired() {
                return Err("no message within the timeout".into());
            }
        }
        self.taken += 1;
        self.post_recv().map_err(|e| e.to_string())
    }

    fn put(&mut self, w: [u64; 2]) {
        let mut b = [0u8; CONTROL];
        put_words(&mut b, w);
        self.send_buf.write(0, &b);
    }

    fn get(&self) -> [u64; 2] {
        [self.recv_buf.read_u64(0), self.recv_buf.read_u64(8)]
    }
}

/// A busy wait's timeout ([`T`]), starting at the first check and read from the clock only
/// every 1024th: a clock read costs about a tenth of a small message's one-way latency, and
/// the benchmark should measure the stack, not its own timeouts.
#[derive(Default)]
pub(crate) struct Patience {
    pub(crate) checks: u32,
    pub(crate) deadline: Option<Instant>,
}

impl Patience {
    pub(crate) fn expired(&mut self) -> bool {
        self.checks = self.checks.wrapping_add(1);
        if self.checks % 1024 != 1 {
            return false;
        }
        let now = Instant::now();
        now > *self.deadline.get_or_insert(now + T)
    }
}

pub(crate) struct PipeLink {
    pub(crate) pipe: datapath::MsgPipe,
    pub(crate) _pd: ProtectionDomain,
    pub(crate) wait: Wait,
    pub(crate) buf: Vec<u8>,
    pub(crate) rbuf: Vec<u8>,
}

impl PipeLink {
    pub(crate) fn setup(
        ctx: &Context,
        conn_fn: impl FnOnce(&ProtectionDomain, &cm::QpSpec, &[u8]) -> Result<cm::Connection>,
        wait: Wait,
    ) -> Result<PipeLink> {
        let pd = ctx.alloc_pd()?;
        let conn = conn_fn(&pd, &cm::QpSpec { cq_capacity: 4096, ..cm::QpSpec::default() }, &[])?;
        let strategy = flow_strategy().map_err(VerbsError::InvalidArgument)?;
        let pipe = datapath::MsgPipe::establish(conn.qp, conn.cq, &pd, strategy, SETUP)?;
        Ok(PipeLink { pipe, _pd: pd, wait, buf: vec![0x5a; MAX], rbuf: vec![0; MAX] })
    }

    /// Waits a little for the pipe's next completion (nothing, when busy-polling).
    pub(crate) fn pause(&mut self, patience: &mut Patience, what: &str) -> Result<(), String> {
        if patience.expired() {
            return Err(format!("pipe: {what} within {T:?}"));
        }
        if self.wait == Wait::Interrupt && self.pipe.prepare_sleep().map_err(|e| e.to_string())? {
            wait_any(&[self.pipe.cq()], Duration::from_millis(1)).map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

impl Link for PipeLink {
    fn send(&mut self, len: usize) -> Result<(), String> {
        let mut patience = Patience::default();
        let max = self.pipe.strategy().max_message();
        let mut off = 0;
        loop {
            let end = (off + max).min(len);
            if self.pipe.try_send(&self.buf[off..end]).map_err(|e| e.to_string())? {
                off = end;
                if off == len {
                    break;
                }
                continue;
            }
            self.pipe.progress().map_err(|e| e.to_string())?;
            self.pause(&mut patience, "no room to send")?;
        }
        // Accepted is not sent: what the pipe coalesced behind outstanding sends leaves at a
        // later completion, and the peer must not wait for it while this side serves another
        // layer's link (as Madeleine's send does).
        loop {
            self.pipe.flush().map_err(|e| e.to_string())?;
            if self.pipe.staged() == 0 {
                return Ok(());
            }
            self.pipe.progress().map_err(|e| e.to_string())?;
            self.pause(&mut patience, "message not handed to the transport")?;
        }
    }

    fn recv(&mut self, len: usize) -> Result<(), String> {
        let mut patience = Patience::default();
        let mut got = 0;
        loop {
            let rbuf = &mut self.rbuf;
            let n = self
                .pipe
                .recv_with(|m| {
                    let n = m.len().min(len - got);
                    rbuf[got..got + n].copy_from_slice(&m[..n]);
                    (n == m.len()).then_some(n)
                })
                .map_err(|e| e.to_string())?;
            match n {
                Some(Some(n)) => {
                    got += n;
                    if got == len {
                        return Ok(());
                    }
                }
                Some(None) => return Err(format!("pipe: more than the {len} bytes expected")),
                None => self.pause(&mut patience, "no message")?,
            }
        }
    }

    fn put(&mut self, w: [u64; 2]) {
        put_words(&mut self.buf, w);
    }

    fn get(&self) -> [u64; 2] {
        words(&self.rbuf)
    }
}

pub(crate) struct MadLink {
    pub(crate) ch: madeleine::Channel,
    pub(crate) _session: Session,
    pub(crate) peer: usize,
    pub(crate) buf: Vec<u8>,
    pub(crate) rbuf: Vec<u8>,
    /// Messages a stream leaves pending at most (0: each message's `end_packing` waits).
    pub(crate) in_flight: usize,
}

impl Link for MadLink {
    fn send(&mut self, len: usize) -> Result<(), String> {
        let mut p = self.ch.begin_packing(self.peer).map_err(|e| e.to_string())?;
        p.pack(&self.buf[..len], SendMode::Cheaper, RecvMode::Cheaper).map_err(|e| e.to_string())?;
        p.end_packing().map_err(|e| e.to_string())
    }
    fn send_stream(&mut self, len: usize, count: u64) -> Result<(), String> {
        if self.in_flight == 0 {
            return (0..count).try_for_each(|_| self.send(len));
        }
        let mut pending = std::collections::VecDeque::with_capacity(self.in_flight);
        for _ in 0..count {
            if pending.len() == self.in_flight {
                pending.pop_front().map_or(Ok(()), madeleine::PendingSend::wait).map_err(|e| e.to_string())?;
            }
            let mut p = self.ch.begin_packing(self.peer).map_err(|e| e.to_string())?;
            p.pack(&self.buf[..len], SendMode::Cheaper, RecvMode::Cheaper).map_err(|e| e.to_string())?;
            pending.push_back(p.end_packing_nowait().map_err(|e| e.to_string())?);
        }
        pending.into_iter().try_for_each(madeleine::PendingSend::wait).map_err(|e| e.to_string())
    }
    fn recv(&mut self, len: usize) -> Result<(), String> {
        let mut u = self.ch.begin_unpacking_from(self.peer).map_err(|e| e.to_string())?;
        u.unpack(&mut self.rbuf[..len], SendMode::Cheaper, RecvMode::Cheaper).map_err(|e| e.to_string())?;
        u.end_unpacking().map_err(|e| e.to_string())
    }
    fn put(&mut self, w: [u64; 2]) {
        put_words(&mut self.buf, w);
    }
    fn get(&self) -> [u64; 2] {
        words(&self.rbuf)
    }
}

/// The rendezvous threshold Madeleine's transport probe chose (when the `madeleine` layer ran).
pub(crate) static MAD_PROBED_THRESHOLD: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

/// The flow strategy of the pipe and Madeleine layers: Madeleine's default, or `MAD_FLOW`.
pub(crate) fn flow_strategy() -> Result<datapath::FlowStrategy, String> {
    match std::env::var("MAD_FLOW") {
        Ok(name) => datapath::FlowStrategy::by_name(&name)
            .ok_or_else(|| format!("MAD_FLOW={name:?}: credit, rdma, window or polled")),
        Err(_) => Ok(SessionConfig::new(0, 1, "").strategy),
    }
}

/// A Madeleine session of two ranks meeting in `dir` (one host) or, with `root`, through rank 0
/// at that TCP address (across hosts).
pub(crate) fn mad_link(
    layer: Layer,
    rank: usize,
    dir: PathBuf,
    root: Option<std::net::SocketAddr>,
    in_flight: usize,
) -> Result<MadLink, String> {
    let mut cfg = SessionConfig::new(rank, 2, dir);
    cfg.root = root;
    cfg.job = format!("stack-bench-{}", layer.name());
    // The session's one timeout bounds its rendezvous as well as its waits for messages.
    cfg.timeout = SETUP;
    cfg.wait_limit = Some(SETUP);
    if let Some(t) = layer.mad_threshold() {
        cfg.rendezvous_threshold = Some(t);
    }
    cfg.strategy = flow_strategy()?;
    let s = Session::new(cfg).map_err(|e| e.to_string())?;
    let ch = s.channel().map_err(|e| e.to_string())?;
    if layer == Layer::Madeleine && rank == 0 {
        let t = ch.rendezvous_threshold(1).map_err(|e| e.to_string())?;
        let _ = MAD_PROBED_THRESHOLD.set(t);
    }
    let in_flight = if layer.nowait() { in_flight.max(1) } else { 0 };
    Ok(MadLink { ch, _session: s, peer: 1 - rank, buf: vec![0x5a; MAX], rbuf: vec![0; MAX], in_flight })
}

/// A byte stream both ends of a layer set up alike: kernel TCP, or SDP.
pub(crate) trait ByteStream: Read + Write {
    /// What errors name it.
    const NAME: &'static str;
    /// No batching of small writes; nonblocking for busy waiting; each call bounded by
    /// `limit` (a dead peer cannot hang the run).
    fn configure(&self, nonblocking: bool, limit: Duration) -> std::io::Result<()>;
}

impl ByteStream for TcpStream {
    const NAME: &'static str = "TCP";
    fn configure(&self, nonblocking: bool, limit: Duration) -> std::io::Result<()> {
        self.set_nodelay(true)?;
        self.set_nonblocking(nonblocking)?;
        self.set_read_timeout(Some(limit))?;
        self.set_write_timeout(Some(limit))
    }
}

impl ByteStream for sockets_compat::SdpStream {
    const NAME: &'static str = "SDP";
    fn configure(&self, nonblocking: bool, limit: Duration) -> std::io::Result<()> {
        self.set_nodelay(true)?;
        self.set_nonblocking(nonblocking)?;
        self.set_read_timeout(Some(limit))?;
        self.set_write_timeout(Some(limit))
    }
}

/// A stream layer's link (TCP, SDP): messages are runs of bytes read and written whole.
pub(crate) struct StreamLink<S> {
    pub(crate) s: S,
    pub(crate) buf: Vec<u8>,
    /// How long one message may take.
    pub(crate) limit: Duration,
}

/// The TCP layer's link, also the peers' (their programs run while ours sleep in a read).
pub(crate) type TcpLink = StreamLink<TcpStream>;

impl<S: ByteStream> StreamLink<S> {
    /// Busy waiting: a nonblocking socket polled in a loop; interrupt waiting: blocking calls
    /// (with timeouts, so a dead peer cannot hang the run).
    pub(crate) fn new(s: S, wait: Wait) -> std::io::Result<StreamLink<S>> {
        Self::with_limit(s, wait, T)
    }

    pub(crate) fn with_limit(s: S, wait: Wait, limit: Duration) -> std::io::Result<StreamLink<S>> {
        s.configure(wait == Wait::Busy, limit)?;
        Ok(StreamLink { s, buf: vec![0x5a; MAX], limit })
    }

    /// The peer layers' link: blocking, so the server sleeps in a read while the peer's
    /// processes run, until the client's message says they are done.
    pub(crate) fn sleeper(s: S) -> std::io::Result<StreamLink<S>> {
        Self::with_limit(s, Wait::Interrupt, UCX_LIMIT + Duration::from_secs(30))
    }
}

impl<S: ByteStream> Link for StreamLink<S> {
    fn send(&mut self, len: usize) -> Result<(), String> {
        let (s, buf) = (&mut self.s, &self.buf);
        benches::io_whole(len, self.limit, |off| s.write(&buf[off..len])).map_err(|e| format!("{} send: {e}", S::NAME))
    }
    fn recv(&mut self, len: usize) -> Result<(), String> {
        let (s, buf) = (&mut self.s, &mut self.buf);
        benches::io_whole(len, self.limit, |off| s.read(&mut buf[off..len]))
            .map_err(|e| format!("{} receive: {e}", S::NAME))
    }
    fn put(&mut self, w: [u64; 2]) {
        put_words(&mut self.buf, w);
    }
    fn get(&self) -> [u64; 2] {
        words(&self.buf)
    }
}
