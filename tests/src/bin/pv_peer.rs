//! The peer process of the cross-process tests: `pv_peer target <bootstrap-address>`.
//!
//! It accepts one connection, tells the client (in the private data) where its two regions are —
//! one in user memory (reached by cross-memory attach) and one provider-allocated (reached by
//! direct stores) — and serves small commands that arrive as SENDs, answering each with a SEND.

use std::time::Duration;

use portability_verbs::*;
use tests::peer_proto::*;

fn main() {
    env_logger::init();
    let args: Vec<String> = std::env::args().collect();
    let result = match (args.get(1).map(String::as_str), args.len()) {
        (Some("target"), 3) => serve(&args[2]),
        (Some("pipe"), 4) => echo_pipe(&args[2], &args[3]),
        _ => {
            eprintln!("usage: pv_peer target <addr> | pv_peer pipe <credit|rdma|window> <addr>");
            std::process::exit(2);
        }
    };
    if let Err(e) = result {
        eprintln!("pv_peer: {e}");
        std::process::exit(1);
    }
}

/// Echoes every message of a flow-controlled pipe until an empty one arrives.
fn echo_pipe(strategy: &str, addr: &str) -> Result<()> {
    use portability_verbs::datapath::{FlowStrategy, MsgPipe};
    let strategy =
        FlowStrategy::by_name(strategy).ok_or_else(|| VerbsError::InvalidArgument("unknown strategy".into()))?;
    let addr: cm::CmAddr = addr.parse()?;
    let ctx = Context::open_default()?;
    let pd = ctx.alloc_pd()?;
    let spec = cm::QpSpec::with_depths(512, 512);
    let conn = cm::Listener::bind(&addr)?.accept(&pd, &spec, b"", Duration::from_secs(20))?;
    let mut pipe = MsgPipe::establish(conn.qp, conn.cq, &pd, strategy, Duration::from_secs(20))?;
    loop {
        let m = pipe.recv(Duration::from_secs(60))?;
        if m.is_empty() {
            return Ok(());
        }
        pipe.send(&m, Duration::from_secs(20))?;
        pipe.flush()?;
    }
}

fn serve(addr: &str) -> Result<()> {
    let addr: cm::CmAddr = addr.parse()?;
    let ctx = Context::open_default()?;
    let pd = ctx.alloc_pd()?;
    let user = pd.register(vec![0u8; REGION].into_boxed_slice(), AccessFlags::ALL)?;
    let seg = pd.alloc(REGION, AccessFlags::ALL)?;
    let ctrl = pd.register(vec![0u8; 32 * CTRL_SLOT].into_boxed_slice(), AccessFlags::LOCAL_WRITE)?;
    let layout = Layout { user_addr: user.addr(), user_rkey: user.rkey(), seg_addr: seg.addr(), seg_rkey: seg.rkey() };
    let listener = cm::Listener::bind(&addr)?;
    let conn = listener.accept(&pd, &cm::QpSpec::default(), &layout.encode(), Duration::from_secs(20))?;
    let (qp, cq) = (conn.qp, conn.cq);
    for i in 0..32u64 {
        qp.post_recv(&[RecvWr::new(i, &[ctrl.sge(i as usize * CTRL_SLOT, CTRL_SLOT)])])?;
    }
    let mut protected: Option<protect::ProtectedRange> = None;
    let mut wcs = [WorkCompletion::EMPTY; 16];
    let mut reply_id = 1000u64;
    loop {
        let n = cq.poll_blocking(&mut wcs, Duration::from_secs(60))?;
        for wc in &wcs[..n] {
            if wc.status != WcStatus::Success {
                return Err(VerbsError::PeerUnreachable(format!("completion failed: {wc:?}")));
            }
            if wc.opcode == WcOpcode::Send {
                continue;
            }
            let slot = wc.wr_id as usize * CTRL_SLOT;
            let mut msg = vec![0u8; wc.byte_len as usize];
            ctrl.read(slot, &mut msg);
            let reply: Vec<u8> = if wc.opcode == WcOpcode::RecvRdmaWithImm {
                Reply::Imm(wc.imm.unwrap_or(0), wc.byte_len).encode()
            } else {
                log::debug!("command {:?} from {wc:?}", msg.first());
                match Command::decode(&msg) {
                    Some(Command::Echo(data)) => data,
                    Some(Command::Checksum { segment, offset, len }) => {
                        let r = if segment { &seg } else { &user };
                        let mut buf = vec![0u8; len as usize];
                        r.read(offset as usize, &mut buf);
                        Reply::Checksum(fnv(&buf)).encode()
                    }
                    Some(Command::Protect { offset, len }) => {
                        let base = user.addr() as usize + offset as usize;
                        // SAFETY: pages inside our own user region, which only the provider
                        // touches until the matching Unprotect.
                        protected = Some(unsafe { protect::protect(base, len as usize, protect::Protection::None) }?);
                        Reply::Ok.encode()
                    }
                    Some(Command::Unprotect) => {
                        protected = None;
                        Reply::Ok.encode()
                    }
                    Some(Command::Read64 { segment, offset }) => {
                        let r = if segment { &seg } else { &user };
                        Reply::Value(r.read_u64(offset as usize)).encode()
                    }
                    Some(Command::Exit) => {
                        drop(protected);
                        return Ok(());
                    }
                    None => return Err(VerbsError::Protocol("bad command".into())),
                }
            };
            qp.post_recv(&[RecvWr::new(wc.wr_id, &[ctrl.sge(slot, CTRL_SLOT)])])?;
            reply_id += 1;
            // Replies fit the inline limit or go from the control buffer.
            let out = pd.register(reply.into_boxed_slice(), AccessFlags::NONE)?;
            qp.post_send(&[SendWr::send(reply_id, &[out.sge_all()])])?;
            let mut w = [WorkCompletion::EMPTY; 1];
            // Wait for our reply to be consumed before its buffer goes away.
            loop {
                let k = cq.poll_blocking(&mut w, Duration::from_secs(20))?;
                if k == 1 && w[0].opcode == WcOpcode::Send && w[0].wr_id == reply_id {
                    if w[0].status != WcStatus::Success {
                        return Err(VerbsError::PeerUnreachable(format!("reply failed: {:?}", w[0])));
                    }
                    break;
                }
                if k == 1 {
                    return Err(VerbsError::Protocol(format!("client sent before reading our reply: {:?}", w[0])));
                }
            }
        }
    }
}
