//! E2A (combine): expert ranks send weighted sums back; attention ranks add them up.
//!
//! Sender (expert rank `d`, E2A epoch `f`, parity `q`): after credit `f - 2` from every attention
//! rank, for each source `s` and each token it sent, sums the outputs of the token's local experts
//! weighted by the gating weights that came with it (f32), rounds once to the wire dtype and
//! writes the row — into `s`'s reply area at the offset `s` named in its A2E record (push), or
//! into local staging (pull) — then puts the record and signals `e2a_ready[d] = f`.
//!
//! Receiver (attention rank `s`): adds expert ranks' rows into f32 accumulators strictly in
//! expert-rank order, starting on each rank as soon as it and all lower ranks have arrived, so the
//! result is bitwise reproducible and work overlaps the wait for stragglers.

use super::batch::{A2eHandle, ExpertBatch};
use super::wire::{Record, TransferMode};
use crate::comm::Communicator;
use crate::fabric::Waiting;
use crate::topology::Role;
use crate::{Error, Result};

impl Communicator {
    /// E2A send on raw bytes: `expert_out` is `[batch.num_rows(), hidden]` of the dtype.
    pub fn e2a_send_bytes(
        &mut self,
        batch: &ExpertBatch,
        expert_out: &[u8],
        mode: TransferMode,
    ) -> Result<()> {
        self.require_role(Role::Expert, "E2A send")?;
        let payload = self.cfg.hidden * self.cfg.dtype.size();
        if batch.epoch == 0 {
            return Err(Error::invalid(
                "E2A send needs a batch filled by A2E receive",
            ));
        }
        if expert_out.len() != batch.num_rows() * payload {
            return Err(Error::invalid(format!(
                "expert_out has {} bytes; the batch has {} rows of {payload} bytes",
                expert_out.len(),
                batch.num_rows()
            )));
        }
        let sources = self.topo.attention_ranks().to_vec();
        if batch.sources.len() != sources.len() {
            return Err(Error::invalid("batch does not come from this communicator"));
        }
        let epoch = self.e2a_epoch + 1;
        let parity = (epoch & 1) as usize;
        let deadline = self.deadline();
        if epoch > 2 {
            let need = epoch - 2;
            let (f, slots) = (&*self.fabric, self.slots);
            f.wait_until(deadline, &mut || {
                sources
                    .iter()
                    .find(|&&s| f.signal_value(slots.e2a_credit(s)) < need)
                    .map(|&peer| Waiting {
                        peer,
                        what: "E2A credit (attention rank has not consumed an earlier combine)",
                    })
            })?;
        }

        let my_index = self.topo.expert_index(self.rank).expect("expert rank");
        let hidden = self.cfg.hidden;
        let dtype = self.cfg.dtype;
        let stride = self.layout.e2a_stride;
        let direct = self.fabric.capabilities().load_store;
        self.acc.resize(hidden, 0.0);
        let mut stage_rows = 0usize;
        let n = sources.len();
        for step in 0..n {
            let i = (my_index + step) % n;
            let s = sources[i];
            let info = batch.sources[i];
            let count = info.count;
            let bytes = count * stride;
            let stage_off = self.layout.e2a_stage(parity) + stage_rows * stride;
            let (dst, offset) = if mode == TransferMode::Push && direct {
                let win = self.fabric.peer_window(s).expect("load/store fabric");
                let at = self.layout.e2a_recv(parity) + info.reply_offset * stride;
                // SAFETY: the credit wait covers epoch - 2, the last E2A with this parity, so `s`
                // no longer reads this reply range; only we write it.
                (unsafe { win.slice_mut(at, bytes)? }, info.reply_offset)
            } else {
                stage_rows += count;
                let win = self.fabric.local_window();
                // SAFETY: our staging for this parity is read by peers only between our signal
                // and their credit; the credit wait above covers the previous such epoch.
                (
                    unsafe { win.slice_mut(stage_off, bytes)? },
                    stage_rows - count,
                )
            };
            let tokens = info.first_token..info.first_token + count;
            for (t, out) in tokens.zip(dst.chunks_exact_mut(stride)) {
                self.acc.iter_mut().for_each(|a| *a = 0.0);
                let rows = batch.token_row_start[t] as usize..batch.token_row_start[t + 1] as usize;
                for &r in &batch.token_rows[rows] {
                    let r = r as usize;
                    dtype.accumulate(
                        &expert_out[r * payload..(r + 1) * payload],
                        batch.weight[r],
                        &mut self.acc,
                    );
                }
                dtype.from_f32(&self.acc, &mut out[..payload]);
            }
            if mode == TransferMode::Push && !direct {
                let at = self.layout.e2a_recv(parity) + info.reply_offset * stride;
                let win = self.fabric.local_window();
                // SAFETY: the staged rows were written just above and are not shared yet.
                let staged = unsafe { win.slice(stage_off, bytes)? };
                self.fabric.put(s, at, staged)?;
            }
            let rec = Record::new(epoch, count as u32, offset as u32, mode);
            self.fabric.put(
                s,
                self.layout.record(my_index, parity),
                bytemuck::bytes_of(&rec),
            )?;
            self.fabric
                .signal(s, self.slots.e2a_ready(self.rank), epoch)?;
        }
        self.e2a_epoch = epoch;
        Ok(())
    }

    /// E2A receive on raw bytes: `out` is `[handle.num_tokens(), hidden]` of the dtype.
    pub fn e2a_recv_bytes(&mut self, handle: A2eHandle, out: &mut [u8]) -> Result<()> {
        self.require_role(Role::Attention, "E2A receive")?;
        let payload = self.cfg.hidden * self.cfg.dtype.size();
        let t_count = handle.num_tokens;
        if out.len() != t_count * payload {
            return Err(Error::invalid(format!(
                "out has {} bytes; {t_count} tokens of {payload} bytes were dispatched",
                out.len()
            )));
        }
        let epoch = self.e2a_epoch + 1;
        let parity = (epoch & 1) as usize;
        let deadline = self.deadline();
        let experts = self.topo.expert_ranks().to_vec();
        let hidden = self.cfg.hidden;
        let dtype = self.cfg.dtype;
        let stride = self.layout.e2a_stride;
        let max_rows = self.layout.attention_rows;
        let direct = self.fabric.capabilities().load_store;

        self.acc.clear();
        self.acc.resize(t_count * hidden, 0.0);
        let mut next = 0usize;
        let mut failure: Option<Error> = None;
        {
            let f = &*self.fabric;
            let slots = self.slots;
            let layout = &self.layout;
            let acc = &mut self.acc;
            let pull_buf = &mut self.pull_buf;
            let own = f.local_window();
            let mut add_rank = |j: usize| -> Result<()> {
                let d = experts[j];
                let mut rec = Record::default();
                own.read(layout.record(j, parity), bytemuck::bytes_of_mut(&mut rec))?;
                let mode = rec.validate(d, epoch, max_rows)?;
                let want = handle.layout.count(d);
                if rec.count as usize != want {
                    return Err(Error::Protocol {
                        peer: d,
                        detail: format!(
                            "E2A brings {} rows, {want} tokens were dispatched to it \
                             (were A2E and E2A calls made in the same order everywhere?)",
                            rec.count
                        ),
                    });
                }
                let bytes = want * stride;
                let rows: &[u8] = match mode {
                    TransferMode::Push => {
                        let at = layout.e2a_recv(parity) + handle.offsets[j] * stride;
                        // SAFETY: `d` signalled epoch `f` after writing these rows and writes this
                        // parity again only after our credit for `f`.
                        unsafe { own.slice(at, bytes)? }
                    }
                    TransferMode::Pull => {
                        let at = layout.e2a_stage(parity) + rec.offset as usize * stride;
                        if direct {
                            let win = f.peer_window(d).expect("load/store fabric");
                            // SAFETY: `d`'s staging for this parity is stable from its signal
                            // until our credit.
                            unsafe { win.slice(at, bytes)? }
                        } else {
                            pull_buf.resize(bytes, 0);
                            f.get(d, at, pull_buf)?;
                            &pull_buf[..]
                        }
                    }
                };
                for (e, r) in handle.layout.entries(d).zip(rows.chunks_exact(stride)) {
                    let t = handle.layout.token(e);
                    dtype.accumulate(&r[..payload], 1.0, &mut acc[t * hidden..(t + 1) * hidden]);
                }
                Ok(())
            };
            f.wait_until(deadline, &mut || {
                while next < experts.len() {
                    let d = experts[next];
                    if f.signal_value(slots.e2a_ready(d)) < epoch {
                        return Some(Waiting {
                            peer: d,
                            what: "E2A record",
                        });
                    }
                    if let Err(e) = add_rank(next) {
                        failure = Some(e);
                        return None;
                    }
                    next += 1;
                }
                None
            })?;
        }
        if let Some(e) = failure {
            return Err(e);
        }
        dtype.from_f32(&self.acc, out);
        for &d in &experts {
            self.fabric
                .signal(d, self.slots.e2a_credit(self.rank), epoch)?;
        }
        self.e2a_epoch = epoch;
        self.spare_layout = Some(handle.layout);
        Ok(())
    }
}
