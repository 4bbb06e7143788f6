//! Shared receive queues: receives several queue pairs take from, counted in the control
//! segment so that a requester can tell receiver-not-ready.

use super::*;

/// A shared receive queue.
pub struct SrqInner {
    pub ctx: Arc<CtxInner>,
    pub pd: u32,
    pub rq_slot: u32,
    pub max_wr: u32,
    pub max_sge: u32,
    pub(in crate::soft::qp) queue: Mutex<VecDeque<RecvWr>>,
}

impl SrqInner {
    pub fn new(ctx: &Arc<CtxInner>, pd: u32, max_wr: u32, max_sge: u32) -> Result<Arc<SrqInner>> {
        if max_wr == 0 || max_sge == 0 {
            return Err(VerbsError::invalid("a shared receive queue needs max_wr and max_sge > 0"));
        }
        let rq_slot = ctx.rq_slots.lock().expect("slot lock").take("receive queue")?;
        let c = ctx.ctrl().rq(rq_slot as usize).expect("slot in range");
        c.posted.store(0, Ordering::Relaxed);
        c.consumed.store(0, Ordering::Relaxed);
        Ok(Arc::new(SrqInner { ctx: ctx.clone(), pd, rq_slot, max_wr, max_sge, queue: Mutex::new(VecDeque::new()) }))
    }

    pub fn post_recv(&self, wrs: &[RecvWr]) -> Result<()> {
        let mut q = self.queue.lock().expect("srq lock");
        for wr in wrs {
            if wr.sg_list.len() > self.max_sge as usize {
                return Err(VerbsError::invalid(format!(
                    "{} SGEs over the SRQ's max_sge {}",
                    wr.sg_list.len(),
                    self.max_sge
                )));
            }
            if q.len() >= self.max_wr as usize {
                return Err(VerbsError::Exhausted("shared receive queue is full".into()));
            }
            q.push_back(RecvWr { wr_id: wr.wr_id, sg_list: crate::types::sg_list_of(&wr.sg_list) });
            self.ctx.ctrl().rq(self.rq_slot as usize).expect("slot").posted.fetch_add(1, Ordering::Release);
        }
        Ok(())
    }
}

impl Drop for SrqInner {
    fn drop(&mut self) {
        self.ctx.rq_slots.lock().expect("slot lock").give(self.rq_slot);
    }
}
