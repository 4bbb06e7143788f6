//! The hardware provider: rdma-core's libibverbs through the raw `ibverbs-sys` bindings (the
//! safe `ibverbs` crate covers send/receive only; one-sided operations and atomics need the raw
//! work-request layout).
//!
//! Every call is a thin translation of this crate's types to `ibv_*` structures. libibverbs is
//! thread-safe, so the handles are `Send + Sync`.

use std::ffi::CStr;
use std::os::fd::RawFd;
use std::ptr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ibverbs_sys as ffi;
use smallvec::SmallVec;

use crate::endpoint::{EndpointInfo, HwEndpoint};
use crate::error::{Result, VerbsError};
use crate::types::*;

const PORT: u8 = 1;

fn errno_err(what: &str) -> VerbsError {
    VerbsError::last_os(what)
}

fn ret_err(what: &str, rc: i32) -> VerbsError {
    VerbsError::os(what, std::io::Error::from_raw_os_error(if rc > 0 { rc } else { libc::EIO }))
}

/// Names of the RDMA devices libibverbs sees.
pub fn device_names() -> Vec<String> {
    let mut n = 0i32;
    // SAFETY: ibv_get_device_list writes the count and returns a NULL-terminated array or NULL.
    let list = unsafe { ffi::ibv_get_device_list(&mut n) };
    if list.is_null() {
        return Vec::new();
    }
    let mut names = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: `i < n` entries are valid device pointers; names are NUL-terminated.
        unsafe {
            let dev = *list.add(i);
            let name = ffi::ibv_get_device_name(dev);
            if !name.is_null() {
                names.push(CStr::from_ptr(name).to_string_lossy().into_owned());
            }
        }
    }
    // SAFETY: frees the list returned above.
    unsafe { ffi::ibv_free_device_list(list) };
    names
}

/// An open device and the addressing of its port 1.
pub struct HwContext {
    ctx: *mut ffi::ibv_context,
    lid: u16,
    gid: [u8; 16],
    gid_index: u8,
    mtu: u8,
}

// SAFETY: libibverbs contexts may be used from any thread.
unsafe impl Send for HwContext {}
// SAFETY: as above.
unsafe impl Sync for HwContext {}

impl HwContext {
    /// Opens the device called `name`, or the first one (`PV_HW_DEVICE` picks one by name).
    pub fn open(name: Option<&str>) -> Result<HwContext> {
        let wanted = match name {
            Some(n) => Some(n.to_owned()),
            None => crate::env::text("PV_HW_DEVICE")?,
        };
        let mut n = 0i32;
        // SAFETY: as in `device_names`.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() || n <= 0 {
            if !list.is_null() {
                // SAFETY: frees the list returned above.
                unsafe { ffi::ibv_free_device_list(list) };
            }
            return Err(VerbsError::NoDevice(
                "libibverbs found no RDMA device on this machine (no HCA, or no kernel RDMA support); use the software provider".into(),
            ));
        }
        let mut chosen = ptr::null_mut();
        for i in 0..n as usize {
            // SAFETY: valid entries of the list.
            let dev = unsafe { *list.add(i) };
            // SAFETY: device names are NUL-terminated strings owned by the list.
            let dname = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(dev)) }.to_string_lossy().into_owned();
            if wanted.as_deref().is_none_or(|w| w == dname) {
                chosen = dev;
                break;
            }
        }
        if chosen.is_null() {
            // SAFETY: frees the list returned above.
            unsafe { ffi::ibv_free_device_list(list) };
            return Err(VerbsError::NoDevice(format!("no RDMA device named {wanted:?}")));
        }
        // SAFETY: `chosen` is a device of the live list.
        let ctx = unsafe { ffi::ibv_open_device(chosen) };
        // SAFETY: the context keeps what it needs; the list can go.
        unsafe { ffi::ibv_free_device_list(list) };
        if ctx.is_null() {
            return Err(errno_err("ibv_open_device"));
        }
        let mut port = ffi::ibv_port_attr::default();
        // SAFETY: valid context and output structure.
        let rc = unsafe { ffi::ibv_query_port(ctx, PORT, &mut port as *mut _ as *mut _) };
        if rc != 0 {
            // SAFETY: closing the context opened above.
            unsafe { ffi::ibv_close_device(ctx) };
            return Err(ret_err("ibv_query_port", rc));
        }
        let gid_index: u8 = match crate::env::parse("PV_HW_GID_INDEX", "a GID table index (0-255)") {
            Ok(v) => v.unwrap_or(0),
            Err(e) => {
                // SAFETY: closing the context opened above.
                unsafe { ffi::ibv_close_device(ctx) };
                return Err(e);
            }
        };
        let mut gid = ffi::ibv_gid::default();
        // SAFETY: valid context and output union.
        let rc = unsafe { ffi::ibv_query_gid(ctx, PORT, gid_index as i32, &mut gid) };
        if rc != 0 {
            // SAFETY: closing the context opened above.
            unsafe { ffi::ibv_close_device(ctx) };
            return Err(ret_err("ibv_query_gid", rc));
        }
        // SAFETY: every bit pattern of the union is a valid raw GID.
        let raw = unsafe { gid.raw };
        Ok(HwContext { ctx, lid: port.lid, gid: raw, gid_index, mtu: port.active_mtu as u8 })
    }
}

impl Drop for HwContext {
    fn drop(&mut self) {
        // SAFETY: every child object holds an Arc to the context, so none is left.
        unsafe { ffi::ibv_close_device(self.ctx) };
    }
}

/// A protection domain.
pub struct HwPd {
    ctx: Arc<HwContext>,
    pd: *mut ffi::ibv_pd,
}

// SAFETY: libibverbs objects may be used from any thread.
unsafe impl Send for HwPd {}
// SAFETY: as above.
unsafe impl Sync for HwPd {}

impl HwPd {
    pub fn new(ctx: &Arc<HwContext>) -> Result<HwPd> {
        // SAFETY: valid context.
        let pd = unsafe { ffi::ibv_alloc_pd(ctx.ctx) };
        if pd.is_null() {
            return Err(errno_err("ibv_alloc_pd"));
        }
        Ok(HwPd { ctx: ctx.clone(), pd })
    }

    /// The context the domain was allocated in.
    pub fn context(&self) -> Arc<HwContext> {
        self.ctx.clone()
    }
}

impl Drop for HwPd {
    fn drop(&mut self) {
        // SAFETY: children hold Arcs to the PD, so none is left.
        unsafe { ffi::ibv_dealloc_pd(self.pd) };
    }
}

/// A memory registration.
pub struct HwMr {
    _pd: Arc<HwPd>,
    mr: *mut ffi::ibv_mr,
    _backing: Option<Box<[u8]>>,
}

// SAFETY: libibverbs objects may be used from any thread.
unsafe impl Send for HwMr {}
// SAFETY: as above.
unsafe impl Sync for HwMr {}

impl HwMr {
    pub fn register(pd: &Arc<HwPd>, buf: Box<[u8]>, access: AccessFlags) -> Result<HwMr> {
        // SAFETY: the buffer is owned by the registration and lives as long as it.
        let mut mr = unsafe { Self::register_raw(pd, buf.as_ptr() as *mut u8, buf.len(), access)? };
        mr._backing = Some(buf);
        Ok(mr)
    }

    /// # Safety
    /// The memory must outlive the registration.
    pub unsafe fn register_raw(pd: &Arc<HwPd>, addr: *mut u8, len: usize, access: AccessFlags) -> Result<HwMr> {
        // SAFETY: valid PD; the caller vouches for the memory.
        let mr = unsafe { ffi::ibv_reg_mr(pd.pd, addr.cast(), len, access.bits() as i32) };
        if mr.is_null() {
            return Err(errno_err("ibv_reg_mr"));
        }
        Ok(HwMr { _pd: pd.clone(), mr, _backing: None })
    }

    fn mr(&self) -> &ffi::ibv_mr {
        // SAFETY: valid until drop.
        unsafe { &*self.mr }
    }
    pub fn addr(&self) -> u64 {
        self.mr().addr as u64
    }
    pub fn len(&self) -> usize {
        self.mr().length
    }
    pub fn lkey(&self) -> u32 {
        self.mr().lkey
    }
    pub fn rkey(&self) -> u32 {
        self.mr().rkey
    }
}

impl Drop for HwMr {
    fn drop(&mut self) {
        // SAFETY: deregistering our registration; the backing buffer is dropped after this.
        unsafe { ffi::ibv_dereg_mr(self.mr) };
    }
}

/// A completion queue with its completion channel.
pub struct HwCq {
    _ctx: Arc<HwContext>,
    channel: *mut ffi::ibv_comp_channel,
    cq: *mut ffi::ibv_cq,
    capacity: usize,
}

// SAFETY: libibverbs objects may be used from any thread.
unsafe impl Send for HwCq {}
// SAFETY: as above.
unsafe impl Sync for HwCq {}

impl HwCq {
    pub fn new(ctx: &Arc<HwContext>, capacity: usize) -> Result<HwCq> {
        // SAFETY: valid context.
        let channel = unsafe { ffi::ibv_create_comp_channel(ctx.ctx) };
        if channel.is_null() {
            return Err(errno_err("ibv_create_comp_channel"));
        }
        // SAFETY: valid context and channel.
        let cq = unsafe { ffi::ibv_create_cq(ctx.ctx, capacity as i32, ptr::null_mut(), channel, 0) };
        if cq.is_null() {
            let e = errno_err("ibv_create_cq");
            // SAFETY: destroying the channel created above.
            unsafe { ffi::ibv_destroy_comp_channel(channel) };
            return Err(e);
        }
        // SAFETY: the channel's fd is valid; nonblocking so ack_event never blocks.
        unsafe {
            let fd = (*channel).fd;
            let fl = libc::fcntl(fd, libc::F_GETFL);
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
        Ok(HwCq { _ctx: ctx.clone(), channel, cq, capacity })
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let mut raw: SmallVec<[ffi::ibv_wc; 32]> = SmallVec::new();
        let want = out.len().min(32);
        // SAFETY: ibv_wc is plain data; zeroed entries are valid before the provider fills them.
        raw.resize(want, unsafe { std::mem::zeroed() });
        // SAFETY: valid CQ, its context's ops table, and `want` writable entries.
        let n = unsafe {
            let ops = &mut (*(*self.cq).context).ops;
            ops.poll_cq.expect("provider implements poll_cq")(self.cq, want as i32, raw.as_mut_ptr())
        };
        if n < 0 {
            return Err(VerbsError::CqOverrun);
        }
        for (o, w) in out.iter_mut().zip(&raw[..n as usize]) {
            *o = convert_wc(w);
        }
        Ok(n as usize)
    }

    pub fn req_notify(&self) -> Result<()> {
        // SAFETY: valid CQ and ops table.
        let rc = unsafe {
            let ops = &mut (*(*self.cq).context).ops;
            ops.req_notify_cq.expect("provider implements req_notify_cq")(self.cq, 0)
        };
        if rc != 0 {
            return Err(ret_err("ibv_req_notify_cq", rc));
        }
        Ok(())
    }

    pub fn event_fd(&self) -> RawFd {
        // SAFETY: valid channel.
        unsafe { (*self.channel).fd }
    }

    pub fn wait_event(&self, timeout: Option<Duration>) -> Result<bool> {
        crate::os::wait_readable(self.event_fd(), timeout)
    }

    pub fn ack_event(&self) {
        let mut cq = ptr::null_mut();
        let mut ctx = ptr::null_mut();
        // SAFETY: nonblocking channel; on success the event is acknowledged at once.
        unsafe {
            if ffi::ibv_get_cq_event(self.channel, &mut cq, &mut ctx) == 0 {
                ffi::ibv_ack_cq_events(cq, 1);
            }
        }
    }

    pub fn poll_blocking(&self, out: &mut [WorkCompletion], timeout: Duration) -> Result<usize> {
        let start = Instant::now();
        loop {
            let n = self.poll(out)?;
            if n > 0 {
                return Ok(n);
            }
            if start.elapsed() >= timeout {
                return Err(VerbsError::Timeout(timeout));
            }
            if start.elapsed() < Duration::from_micros(50) {
                std::hint::spin_loop();
                continue;
            }
            self.req_notify()?;
            let n = self.poll(out)?;
            if n > 0 {
                return Ok(n);
            }
            let left = timeout.saturating_sub(start.elapsed());
            if self.wait_event(Some(left))? {
                self.ack_event();
            }
        }
    }
}

impl Drop for HwCq {
    fn drop(&mut self) {
        // SAFETY: QPs hold Arcs to their CQs, so none uses it any more.
        unsafe {
            ffi::ibv_destroy_cq(self.cq);
            ffi::ibv_destroy_comp_channel(self.channel);
        }
    }
}

fn convert_wc(w: &ffi::ibv_wc) -> WorkCompletion {
    use ffi::ibv_wc_opcode::*;
    use ffi::ibv_wc_status::*;
    let status = match w.error() {
        None => WcStatus::Success,
        Some((s, _)) => match s {
            IBV_WC_LOC_LEN_ERR => WcStatus::LocLenErr,
            IBV_WC_LOC_QP_OP_ERR => WcStatus::LocQpOpErr,
            IBV_WC_LOC_PROT_ERR => WcStatus::LocProtErr,
            IBV_WC_WR_FLUSH_ERR => WcStatus::WrFlushErr,
            IBV_WC_REM_INV_REQ_ERR => WcStatus::RemInvReqErr,
            IBV_WC_REM_ACCESS_ERR => WcStatus::RemAccessErr,
            IBV_WC_REM_OP_ERR => WcStatus::RemOpErr,
            IBV_WC_RETRY_EXC_ERR => WcStatus::RetryExcErr,
            IBV_WC_RNR_RETRY_EXC_ERR => WcStatus::RnrRetryExcErr,
            _ => WcStatus::GeneralErr,
        },
    };
    let opcode = match w.opcode() {
        IBV_WC_SEND => WcOpcode::Send,
        IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
        IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
        IBV_WC_COMP_SWAP => WcOpcode::CompSwap,
        IBV_WC_FETCH_ADD => WcOpcode::FetchAdd,
        IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
        _ => WcOpcode::Recv,
    };
    WorkCompletion {
        wr_id: w.wr_id(),
        status,
        opcode,
        byte_len: w.len() as u32,
        imm: w.imm_data().map(u32::from_be),
        qp_num: w.qp_num,
        src_qp: w.src_qp,
    }
}

/// A shared receive queue.
pub struct HwSrq {
    _pd: Arc<HwPd>,
    srq: *mut ffi::ibv_srq,
}

// SAFETY: libibverbs objects may be used from any thread.
unsafe impl Send for HwSrq {}
// SAFETY: as above.
unsafe impl Sync for HwSrq {}

impl HwSrq {
    pub fn new(pd: &Arc<HwPd>, max_wr: u32, max_sge: u32) -> Result<HwSrq> {
        let mut attr = ffi::ibv_srq_init_attr {
            srq_context: ptr::null_mut(),
            attr: ffi::ibv_srq_attr { max_wr, max_sge, srq_limit: 0 },
        };
        // SAFETY: valid PD and attributes.
        let srq = unsafe { ffi::ibv_create_srq(pd.pd, &mut attr) };
        if srq.is_null() {
            return Err(errno_err("ibv_create_srq"));
        }
        Ok(HwSrq { _pd: pd.clone(), srq })
    }

    pub fn post_recv(&self, wrs: &[RecvWr]) -> Result<()> {
        post_recvs(wrs, "ibv_post_srq_recv", |raw| {
            let mut bad = ptr::null_mut();
            // SAFETY: valid SRQ; the request and its SGE array outlive the call.
            unsafe {
                let ops = &mut (*(*self.srq).context).ops;
                ops.post_srq_recv.expect("provider implements post_srq_recv")(self.srq, raw, &mut bad)
            }
        })
    }
}

impl Drop for HwSrq {
    fn drop(&mut self) {
        // SAFETY: QPs hold Arcs to the SRQ, so none uses it any more.
        unsafe { ffi::ibv_destroy_srq(self.srq) };
    }
}

/// Posts receives one by one through `post` (a QP's or an SRQ's post function).
fn post_recvs(wrs: &[RecvWr], what: &str, mut post: impl FnMut(&mut ffi::ibv_recv_wr) -> i32) -> Result<()> {
    for wr in wrs {
        let mut sges = to_sges(&wr.sg_list);
        let mut raw = ffi::ibv_recv_wr {
            wr_id: wr.wr_id,
            next: ptr::null_mut(),
            sg_list: sges.as_mut_ptr(),
            num_sge: sges.len() as i32,
        };
        let rc = post(&mut raw);
        if rc != 0 {
            return Err(match rc {
                libc::ENOMEM => VerbsError::Exhausted(format!("{what}: queue is full")),
                _ => VerbsError::InvalidArgument(format!("{what}: {}", std::io::Error::from_raw_os_error(rc))),
            });
        }
    }
    Ok(())
}

fn to_sges(list: &[Sge]) -> SmallVec<[ffi::ibv_sge; 4]> {
    list.iter().map(|s| ffi::ibv_sge { addr: s.addr, length: s.length, lkey: s.lkey }).collect()
}

/// A reliable-connected queue pair.
pub struct HwQp {
    pd: Arc<HwPd>,
    qp: *mut ffi::ibv_qp,
    _cqs: (Arc<HwCq>, Arc<HwCq>),
    _srq: Option<Arc<HwSrq>>,
    caps: QpCaps,
    psn: u32,
}

// SAFETY: libibverbs objects may be used from any thread.
unsafe impl Send for HwQp {}
// SAFETY: as above.
unsafe impl Sync for HwQp {}

impl HwQp {
    pub fn new(
        pd: &Arc<HwPd>,
        send_cq: &Arc<HwCq>,
        recv_cq: &Arc<HwCq>,
        srq: Option<Arc<HwSrq>>,
        caps: QpCaps,
    ) -> Result<HwQp> {
        let mut init = ffi::ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: send_cq.cq,
            recv_cq: recv_cq.cq,
            srq: srq.as_ref().map_or(ptr::null_mut(), |s| s.srq),
            cap: ffi::ibv_qp_cap {
                max_send_wr: caps.max_send_wr,
                max_recv_wr: caps.max_recv_wr,
                max_send_sge: caps.max_send_sge,
                max_recv_sge: caps.max_recv_sge,
                max_inline_data: caps.max_inline_data,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: valid PD, CQs and SRQ.
        let qp = unsafe { ffi::ibv_create_qp(pd.pd, &mut init) };
        if qp.is_null() {
            return Err(errno_err("ibv_create_qp"));
        }
        let psn = (crate::os::unique_id() & 0x00ff_ffff) as u32;
        Ok(HwQp { pd: pd.clone(), qp, _cqs: (send_cq.clone(), recv_cq.clone()), _srq: srq, caps, psn })
    }

    pub fn qpn(&self) -> u32 {
        // SAFETY: valid until drop.
        unsafe { (*self.qp).qp_num }
    }

    pub fn caps(&self) -> QpCaps {
        self.caps
    }

    pub fn endpoint(&self) -> HwEndpoint {
        let c = &self.pd.ctx;
        HwEndpoint {
            lid: c.lid,
            gid: c.gid,
            gid_index: c.gid_index,
            port: PORT,
            qpn: self.qpn(),
            psn: self.psn,
            mtu: c.mtu.clamp(1, 5),
        }
    }

    pub fn state(&self) -> QpState {
        let mut attr = ffi::ibv_qp_attr::default();
        let mut init = ffi::ibv_qp_init_attr::default();
        // SAFETY: valid QP and output structures.
        let rc =
            unsafe { ffi::ibv_query_qp(self.qp, &mut attr, ffi::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32, &mut init) };
        if rc != 0 {
            return QpState::Error;
        }
        use ffi::ibv_qp_state::*;
        match attr.qp_state {
            IBV_QPS_RESET => QpState::Reset,
            IBV_QPS_INIT => QpState::Init,
            IBV_QPS_RTR => QpState::ReadyToReceive,
            IBV_QPS_RTS => QpState::ReadyToSend,
            _ => QpState::Error,
        }
    }

    pub fn modify(&self, t: QpTransition) -> Result<()> {
        use ffi::ibv_qp_attr_mask as m;
        let mut attr = ffi::ibv_qp_attr::default();
        let mask = match t {
            QpTransition::Reset => {
                attr.qp_state = ffi::ibv_qp_state::IBV_QPS_RESET;
                m::IBV_QP_STATE
            }
            QpTransition::Error => {
                attr.qp_state = ffi::ibv_qp_state::IBV_QPS_ERR;
                m::IBV_QP_STATE
            }
            QpTransition::Init { access, port } => {
                attr.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
                attr.pkey_index = 0;
                attr.port_num = port;
                attr.qp_access_flags = access.bits();
                m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS
            }
            QpTransition::Rtr(rtr) => {
                let EndpointInfo::Hardware(r) = rtr.remote else {
                    return Err(VerbsError::ProviderMismatch(
                        "a hardware QP can only connect to a hardware endpoint".into(),
                    ));
                };
                attr.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
                attr.path_mtu = r.mtu.min(self.pd.ctx.mtu.max(1)) as ffi::ibv_mtu;
                attr.dest_qp_num = r.qpn;
                attr.rq_psn = r.psn;
                attr.max_dest_rd_atomic = rtr.max_dest_rd_atomic;
                attr.min_rnr_timer = rtr.min_rnr_timer;
                attr.ah_attr.dlid = r.lid;
                attr.ah_attr.port_num = PORT;
                if r.gid != [0; 16] {
                    attr.ah_attr.is_global = 1;
                    attr.ah_attr.grh.dgid.raw = r.gid;
                    attr.ah_attr.grh.sgid_index = self.pd.ctx.gid_index;
                    attr.ah_attr.grh.hop_limit = 64;
                }
                m::IBV_QP_STATE
                    | m::IBV_QP_AV
                    | m::IBV_QP_PATH_MTU
                    | m::IBV_QP_DEST_QPN
                    | m::IBV_QP_RQ_PSN
                    | m::IBV_QP_MAX_DEST_RD_ATOMIC
                    | m::IBV_QP_MIN_RNR_TIMER
            }
            QpTransition::Rts(rts) => {
                attr.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
                attr.timeout = rts.timeout;
                attr.retry_cnt = rts.retry_cnt;
                attr.rnr_retry = rts.rnr_retry;
                attr.sq_psn = self.psn;
                attr.max_rd_atomic = rts.max_rd_atomic;
                m::IBV_QP_STATE
                    | m::IBV_QP_TIMEOUT
                    | m::IBV_QP_RETRY_CNT
                    | m::IBV_QP_RNR_RETRY
                    | m::IBV_QP_SQ_PSN
                    | m::IBV_QP_MAX_QP_RD_ATOMIC
            }
        };
        // SAFETY: valid QP and attributes for the mask.
        let rc = unsafe { ffi::ibv_modify_qp(self.qp, &mut attr, mask.0 as i32) };
        if rc != 0 {
            return Err(VerbsError::InvalidState(format!("ibv_modify_qp: {}", std::io::Error::from_raw_os_error(rc))));
        }
        Ok(())
    }

    pub fn post_send(&self, wrs: &[SendWr]) -> Result<()> {
        for wr in wrs {
            let mut sges = to_sges(&wr.sg_list);
            // SAFETY: ibv_send_wr is plain data; all-zero is a valid empty request.
            let mut raw: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
            raw.wr_id = wr.wr_id;
            raw.sg_list = sges.as_mut_ptr();
            raw.num_sge = sges.len() as i32;
            use ffi::ibv_wr_opcode::*;
            raw.opcode = match wr.opcode {
                WrOpcode::Send => IBV_WR_SEND,
                WrOpcode::SendWithImm => IBV_WR_SEND_WITH_IMM,
                WrOpcode::RdmaWrite => IBV_WR_RDMA_WRITE,
                WrOpcode::RdmaWriteWithImm => IBV_WR_RDMA_WRITE_WITH_IMM,
                WrOpcode::RdmaRead => IBV_WR_RDMA_READ,
                WrOpcode::AtomicCmpAndSwp => IBV_WR_ATOMIC_CMP_AND_SWP,
                WrOpcode::AtomicFetchAndAdd => IBV_WR_ATOMIC_FETCH_AND_ADD,
            };
            let mut flags = 0;
            if wr.flags.signaled {
                flags |= ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
            }
            if wr.flags.inline {
                flags |= ffi::ibv_send_flags::IBV_SEND_INLINE.0;
            }
            if wr.flags.fence {
                flags |= ffi::ibv_send_flags::IBV_SEND_FENCE.0;
            }
            raw.send_flags = flags;
            raw.__bindgen_anon_1.imm_data = wr.imm.to_be();
            if wr.opcode.is_atomic() {
                raw.wr.atomic = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
                    remote_addr: wr.remote_addr,
                    compare_add: wr.compare_add,
                    swap: wr.swap,
                    rkey: wr.rkey,
                };
            } else {
                raw.wr.rdma =
                    ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr: wr.remote_addr, rkey: wr.rkey };
            }
            let mut bad = ptr::null_mut();
            // SAFETY: valid QP; the request and its SGE array outlive the call.
            let rc = unsafe {
                let ops = &mut (*(*self.qp).context).ops;
                ops.post_send.expect("provider implements post_send")(self.qp, &mut raw, &mut bad)
            };
            if rc != 0 {
                return Err(match rc {
                    libc::ENOMEM => VerbsError::Exhausted("send queue is full".into()),
                    _ => {
                        VerbsError::InvalidArgument(format!("ibv_post_send: {}", std::io::Error::from_raw_os_error(rc)))
                    }
                });
            }
        }
        Ok(())
    }

    pub fn post_recv(&self, wrs: &[RecvWr]) -> Result<()> {
        post_recvs(wrs, "ibv_post_recv", |raw| {
            let mut bad = ptr::null_mut();
            // SAFETY: valid QP; the request and its SGE array outlive the call.
            unsafe {
                let ops = &mut (*(*self.qp).context).ops;
                ops.post_recv.expect("provider implements post_recv")(self.qp, raw, &mut bad)
            }
        })
    }
}

impl Drop for HwQp {
    fn drop(&mut self) {
        // SAFETY: destroying our QP; the CQs/SRQ/PD it used are kept alive by the Arcs above.
        unsafe { ffi::ibv_destroy_qp(self.qp) };
    }
}
