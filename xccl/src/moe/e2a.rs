//! E2A (combine): expert ranks send weighted sums back; attention ranks add them up.
//!
//! Sender (expert rank `d`, E2A epoch `f`, parity `q`): after credit `f - 2` from every attention
//! rank, for each source `s` and each token it sent, sums the outputs of the token's local experts
//! weighted by the gating weights that came with it (f32), rounds once to the wire dtype and
//! writes the row — into `s`'s reply area at the offset `s` named in its A2E record (push), or
//! into local staging (pull) — then puts the record and signals `e2a_ready[d] = f`.
//!
//! Receiver (attention rank `s`): scans every expert rank's record in one pass per wake-up until
//! all are in, then reduces token by token: each token's rows are added in expert-rank order into
//! one H-wide f32 accumulator that stays in cache, and rounded once to the output dtype, so the
//! result is bitwise reproducible run to run.

use super::batch::{A2eHandle, ExpertBatch, SourceInfo};
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
        let dtype = self.cfg.dtype;
        self.e2a_send_rows(&batch.sources, mode, &mut |t, out, acc| {
            let rows = batch.token_row_start[t] as usize..batch.token_row_start[t + 1] as usize;
            acc.iter_mut().for_each(|a| *a = 0.0);
            for &r in &batch.token_rows[rows] {
                let r = r as usize;
                dtype.accumulate(
                    &expert_out[r * payload..(r + 1) * payload],
                    batch.weight[r],
                    acc,
                );
            }
            dtype.from_f32(acc, out);
        })
    }

    /// The E2A sender's core: for each source in `sources` (rank order, with the tokens it sent
    /// at `first_token..first_token+count`), `fill(token, row, scratch)` writes each reply row
    /// straight where it goes; then record and signal.
    pub(crate) fn e2a_send_rows(
        &mut self,
        sources: &[SourceInfo],
        mode: TransferMode,
        fill: &mut dyn FnMut(usize, &mut [u8], &mut [f32]),
    ) -> Result<()> {
        let ranks = self.topo.attention_ranks().to_vec();
        if sources.len() != ranks.len() || sources.iter().zip(&ranks).any(|(s, &r)| s.rank != r) {
            return Err(Error::invalid("batch does not come from this communicator"));
        }
        let epoch = self.e2a_epoch + 1;
        let parity = (epoch & 1) as usize;
        let deadline = self.deadline();
        if epoch > 2 {
            let need = epoch - 2;
            let (f, slots) = (&*self.fabric, self.slots);
            f.wait_until(deadline, &mut || {
                ranks
                    .iter()
                    .find(|&&s| f.signal_value(slots.e2a_credit(s)) < need)
                    .map(|&peer| Waiting {
                        peer,
                        what: "E2A credit (attention rank has not consumed an earlier combine)",
                    })
            })?;
        }

        let my_index = self.topo.expert_index(self.rank).expect("expert rank");
        let payload = self.cfg.hidden * self.cfg.dtype.size();
        let stride = self.layout.e2a_stride;
        let direct = self.fabric.capabilities().load_store;
        self.acc.resize(self.cfg.hidden, 0.0);
        let mut stage_rows = 0usize;
        let n = ranks.len();
        for step in 0..n {
            let i = (my_index + step) % n;
            let s = ranks[i];
            let info = sources[i];
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
                fill(t, &mut out[..payload], &mut self.acc);
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

        // One pass over all records per wake-up until every expert rank's is in.
        let mut arrived: Vec<Option<Record>> = vec![None; experts.len()];
        let mut missing = experts.len();
        let mut failure: Option<Error> = None;
        {
            let f = &*self.fabric;
            let (slots, layout) = (self.slots, &self.layout);
            let own = f.local_window();
            f.wait_until(deadline, &mut || {
                let mut first_missing = None;
                for (j, &d) in experts.iter().enumerate() {
                    if arrived[j].is_some() {
                        continue;
                    }
                    if f.signal_value(slots.e2a_ready(d)) < epoch {
                        first_missing.get_or_insert(d);
                        continue;
                    }
                    let mut rec = Record::default();
                    let checked = own
                        .read(layout.record(j, parity), bytemuck::bytes_of_mut(&mut rec))
                        .and_then(|_| rec.validate(d, epoch, max_rows));
                    if let Err(e) = checked {
                        failure = Some(e);
                        return None;
                    }
                    let want = handle.layout.count(d);
                    if rec.count as usize != want {
                        failure = Some(Error::Protocol {
                            peer: d,
                            detail: format!(
                                "E2A brings {} rows, {want} tokens were dispatched to it \
                                 (were A2E and E2A calls made in the same order everywhere?)",
                                rec.count
                            ),
                        });
                        return None;
                    }
                    arrived[j] = Some(rec);
                    missing -= 1;
                }
                if missing == 0 {
                    return None;
                }
                first_missing.map(|peer| Waiting {
                    peer,
                    what: "E2A record",
                })
            })?;
        }
        if let Some(e) = failure {
            return Err(e);
        }

        // Where each expert rank's rows lie (own reply area, peer staging, or fetched).
        let f = &*self.fabric;
        let own = f.local_window();
        let mut fetched = Vec::with_capacity(experts.len());
        let mut total = 0;
        for rec in &arrived {
            let rec = rec.as_ref().expect("all arrived");
            let pulled = rec.mode == TransferMode::Pull as u32 && !direct;
            fetched.push(pulled.then_some(total));
            if pulled {
                total += rec.count as usize * stride;
            }
        }
        self.pull_buf.resize(total, 0);
        for (j, rec) in arrived.iter().enumerate() {
            let rec = rec.as_ref().expect("all arrived");
            if let Some(at) = fetched[j] {
                let bytes = rec.count as usize * stride;
                let src = self.layout.e2a_stage(parity) + rec.offset as usize * stride;
                f.get(experts[j], src, &mut self.pull_buf[at..at + bytes])?;
            }
        }
        let mut views: Vec<&[u8]> = Vec::with_capacity(experts.len());
        for (j, rec) in arrived.iter().enumerate() {
            let rec = rec.as_ref().expect("all arrived");
            let bytes = rec.count as usize * stride;
            let view = if let Some(at) = fetched[j] {
                &self.pull_buf[at..at + bytes]
            } else if rec.mode == TransferMode::Push as u32 {
                let at = self.layout.e2a_recv(parity) + handle.offsets[j] * stride;
                // SAFETY: the expert rank signalled this epoch after writing these rows and
                // writes this parity again only after our credit for it.
                unsafe { own.slice(at, bytes)? }
            } else {
                let win = f.peer_window(experts[j]).expect("load/store fabric");
                let at = self.layout.e2a_stage(parity) + rec.offset as usize * stride;
                // SAFETY: the expert rank's staging for this parity is stable from its signal
                // until our credit.
                unsafe { win.slice(at, bytes)? }
            };
            views.push(view);
        }

        // Token-major reduction: each token's rows added in expert-rank order (reproducible),
        // with one H-wide f32 accumulator that stays in cache.
        self.acc.resize(hidden, 0.0);
        self.cursors.clear();
        self.cursors
            .extend(experts.iter().map(|&d| handle.layout.entries(d).start));
        for (t, out_row) in out.chunks_exact_mut(payload).enumerate() {
            let mut contributions = 0;
            for (j, &d) in experts.iter().enumerate() {
                let e = self.cursors[j];
                if e >= handle.layout.entries(d).end || handle.layout.token(e) != t {
                    continue;
                }
                self.cursors[j] += 1;
                let i = e - handle.layout.entries(d).start;
                let row = &views[j][i * stride..i * stride + payload];
                if contributions == 0 {
                    dtype.to_f32(row, &mut self.acc);
                } else {
                    dtype.accumulate(row, 1.0, &mut self.acc);
                }
                contributions += 1;
            }
            match contributions {
                0 => out_row.fill(0),
                _ => dtype.from_f32(&self.acc, out_row),
            }
        }
        for &d in &experts {
            self.fabric
                .signal(d, self.slots.e2a_credit(self.rank), epoch)?;
        }
        self.e2a_epoch = epoch;
        self.spare_layout = Some(handle.layout);
        Ok(())
    }
}
