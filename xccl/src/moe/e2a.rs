//! E2A (combine): expert ranks send weighted sums back; attention ranks add them up.
//!
//! Sender (expert rank `d`, E2A epoch `f`, parity `q`): after credit `f - 2` from every attention
//! rank, for each source `s` it puts the record, then writes the reply rows in chunks — each the
//! gating-weighted sum of the token's local experts in f32, rounded once to the wire dtype (or
//! the caller's already-reduced row) — into `s`'s reply area at the offset `s` named in its A2E
//! record (push) or into its own staging at the token's index (pull), signalling
//! `e2a_ready[d] = progress(f, rows)` after each chunk.
//!
//! Receiver (attention rank `s`): one pass over every expert rank's progress per wake-up; every
//! token whose rows have all arrived (below the watermark) is reduced at once, its rows added in
//! expert-rank order into one H-wide f32 accumulator that stays in cache and rounded once to the
//! output dtype, so the result is bitwise reproducible run to run.

use super::batch::{A2eHandle, ExpertBatch, SourceInfo};
use super::wire::{chunk_rows, progress, Progress, Record, TransferMode, WireMode};
use crate::comm::Communicator;
use crate::fabric::Waiting;
use crate::topology::Role;
use crate::{Error, Result};

/// Writes the reply row of a received token: `(token index in the batch, row, f32 scratch)`.
pub(crate) type FillRow<'a> = dyn FnMut(usize, &mut [u8], &mut [f32]) + 'a;

impl Communicator {
    /// E2A send on raw bytes: `expert_out` is `[batch.num_rows(), hidden]` of the dtype.
    pub fn e2a_send_bytes(
        &mut self,
        batch: &ExpertBatch,
        expert_out: &[u8],
        mode: TransferMode,
    ) -> Result<()> {
        let payload = self.check_e2a_input(batch.epoch, expert_out.len(), batch.num_rows())?;
        let dtype = self.cfg.dtype;
        self.e2a_send_rows(
            &batch.sources,
            mode,
            Some(&mut |t, out, acc| {
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
            }),
        )
    }

    /// Checks an E2A send's input before anything is written: an expert rank, a batch that A2E
    /// filled, and `bytes` holding exactly `rows` rows. Returns the payload bytes per row.
    pub(crate) fn check_e2a_input(&self, epoch: u64, bytes: usize, rows: usize) -> Result<usize> {
        self.require_role(Role::Expert, "E2A send")?;
        let payload = self.cfg.hidden * self.cfg.dtype.size();
        if epoch == 0 {
            return Err(Error::invalid(
                "E2A send needs a batch filled by A2E receive",
            ));
        }
        if bytes != rows * payload {
            return Err(Error::invalid(format!(
                "expert output has {bytes} bytes; the batch has {rows} rows of {payload} bytes"
            )));
        }
        Ok(payload)
    }

    /// The E2A sender's core: for each source in `sources` (rank order, with the tokens it sent
    /// at `first_token..first_token+count`), `fill(token, row, scratch)` writes each reply row
    /// straight where it goes, then record and signal. Staged rows sit at their token's index
    /// (`first_token + i`) in the staging area. With `fill` `None` the rows are already staged
    /// ([`Communicator::e2a_output`]) and only records and signals go out (pull).
    pub(crate) fn e2a_send_rows(
        &mut self,
        sources: &[SourceInfo],
        mode: TransferMode,
        fill: Option<&mut FillRow<'_>>,
    ) -> Result<()> {
        let mut acc = std::mem::take(&mut self.acc);
        acc.resize(self.cfg.hidden, 0.0);
        let sent = self.e2a_transmit(sources, mode, fill, &mut acc);
        self.acc = acc;
        sent?;
        self.e2a_epoch += 1;
        Ok(())
    }

    /// [`Communicator::e2a_send_rows`] without the epoch update, on a shared borrow (so a
    /// [`crate::moe::view::TokenView`] can read its rows in place while it fills the replies).
    pub(crate) fn e2a_transmit(
        &self,
        sources: &[SourceInfo],
        mode: TransferMode,
        mut fill: Option<&mut FillRow<'_>>,
        acc: &mut [f32],
    ) -> Result<()> {
        let topo = self.topo.clone();
        let ranks = topo.attention_ranks();
        if sources.len() != ranks.len() || sources.iter().zip(ranks).any(|(s, &r)| s.rank != r) {
            return Err(Error::invalid("batch does not come from this communicator"));
        }
        let epoch = self.e2a_epoch + 1;
        let parity = (epoch & 1) as usize;
        self.wait_e2a_credits(epoch)?;

        let my_index = self.topo.expert_index(self.rank).expect("expert rank");
        let payload = self.cfg.hidden * self.cfg.dtype.size();
        let stride = self.layout.e2a_stride;
        let direct = self.fabric.capabilities().load_store;
        let mode = if fill.is_none() {
            TransferMode::Pull
        } else {
            mode
        };
        let n = ranks.len();
        for step in 0..n {
            let i = (my_index + step) % n;
            let s = ranks[i];
            let info = sources[i];
            let count = info.count;
            let bytes = count * stride;
            let stage_off = self.layout.e2a_stage(parity) + info.first_token * stride;
            let (dst, offset) = if mode == TransferMode::Push && direct {
                let mut win = self.fabric.peer_window(s).expect("load/store fabric");
                let at = self.layout.e2a_recv(parity) + info.reply_offset * stride;
                // SAFETY: the credit wait covers epoch - 2, the last E2A with this parity, so `s`
                // no longer reads this reply range; only we write it.
                (unsafe { win.slice_mut(at, bytes)? }, info.reply_offset)
            } else {
                let mut win = self.fabric.local_window().expect("host window");
                // SAFETY: our staging for this parity is read by peers only between our signal
                // and their credit; the credit wait above covers the previous such epoch.
                (
                    unsafe { win.slice_mut(stage_off, bytes)? },
                    info.first_token,
                )
            };
            // The record goes first: the receiver may start on the first chunk.
            let rec = Record::new(epoch, count as u32, offset as u32, mode);
            self.fabric.put(
                s,
                self.layout.record(my_index, parity),
                bytemuck::bytes_of(&rec),
            )?;
            let remote = self.layout.e2a_recv(parity) + info.reply_offset * stride;
            let slot = self.slots.e2a_ready(self.rank);
            let Some(fill) = fill.as_deref_mut() else {
                self.fabric.signal(s, slot, progress(epoch, count))?;
                continue;
            };
            let chunk = chunk_rows(stride, self.cfg.chunk_bytes);
            let mut done = 0;
            loop {
                let n = chunk.min(count - done);
                let part = &mut dst[done * stride..(done + n) * stride];
                let tokens = info.first_token + done..info.first_token + done + n;
                for (t, out) in tokens.zip(part.chunks_exact_mut(stride)) {
                    fill(t, &mut out[..payload], acc);
                }
                if mode == TransferMode::Push && !direct {
                    self.fabric.put(s, remote + done * stride, part)?;
                }
                done += n;
                self.fabric.signal(s, slot, progress(epoch, done))?;
                if done == count {
                    break;
                }
            }
        }
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
        let topo = self.topo.clone();
        let experts = topo.expert_ranks();
        let hidden = self.cfg.hidden;
        let dtype = self.cfg.dtype;
        let stride = self.layout.e2a_stride;
        let max_rows = self.layout.attention_rows;
        let direct = self.fabric.capabilities().load_store;

        // Each wake-up: one pass over every expert rank's progress, then every token whose rows
        // have all arrived (tokens below the watermark) is reduced, in expert-rank order, with
        // one H-wide f32 accumulator that stays in cache. Rows are read where they lie.
        let n = experts.len();
        let mut recs: Vec<Option<(Record, WireMode)>> = vec![None; n];
        let mut delivered = vec![0usize; n];
        let mut fetched = vec![0usize; n];
        let mut next_token = 0usize;
        let mut failure: Option<Error> = None;
        self.acc.resize(hidden, 0.0);
        self.cursors.clear();
        self.cursors
            .extend(experts.iter().map(|&d| handle.layout.entries(d).start));
        self.pull_buf.resize(
            if direct {
                0
            } else {
                handle.layout.total_entries() * stride
            },
            0,
        );
        {
            let f = &*self.fabric;
            let (slots, layout) = (self.slots, &self.layout);
            let own = f.local_window().expect("host window");
            let (acc, cursors, pull_buf) = (&mut self.acc, &mut self.cursors, &mut self.pull_buf);
            let hl = &handle.layout;
            let mut pass = || -> Result<Option<Waiting>> {
                let mut waiting = None;
                for (j, &d) in experts.iter().enumerate() {
                    let count = hl.count(d);
                    if recs[j].is_some() && delivered[j] == count {
                        continue;
                    }
                    let progress = Progress::of(f.signal_value(slots.e2a_ready(d)), epoch);
                    if progress == Progress::NotYet {
                        waiting.get_or_insert(Waiting {
                            peer: d,
                            what: "E2A rows",
                        });
                        continue;
                    }
                    if recs[j].is_none() {
                        let mut rec = Record::default();
                        own.read(layout.record(j, parity), bytemuck::bytes_of_mut(&mut rec))?;
                        let mode = rec.validate(d, epoch, max_rows)?;
                        if mode == WireMode::Gather {
                            return Err(Error::Protocol {
                                peer: d,
                                detail: "E2A record in gather mode (only A2E gathers)".into(),
                            });
                        }
                        if rec.count as usize != count {
                            return Err(Error::Protocol {
                                peer: d,
                                detail: format!(
                                    "E2A brings {} rows, {count} tokens were dispatched to it \
                                     (were A2E and E2A calls made in the same order everywhere?)",
                                    rec.count
                                ),
                            });
                        }
                        recs[j] = Some((rec, mode));
                    }
                    let (rec, mode) = recs[j].expect("set above");
                    delivered[j] = progress.rows(count);
                    if mode == WireMode::Pull && !direct && delivered[j] > fetched[j] {
                        let rows = fetched[j]..delivered[j];
                        let at =
                            layout.e2a_stage(parity) + (rec.offset as usize + rows.start) * stride;
                        let local = (handle.offsets[j] + rows.start) * stride;
                        f.get(d, at, &mut pull_buf[local..local + rows.len() * stride])?;
                        fetched[j] = delivered[j];
                    }
                    if delivered[j] < count {
                        waiting.get_or_insert(Waiting {
                            peer: d,
                            what: "E2A rows",
                        });
                    }
                }
                // Watermark: the first token some expert rank has not delivered yet.
                let watermark = experts
                    .iter()
                    .enumerate()
                    .map(|(j, &d)| {
                        let r = hl.entries(d);
                        if delivered[j] == r.len() {
                            t_count
                        } else {
                            hl.token(r.start + delivered[j])
                        }
                    })
                    .min()
                    .unwrap_or(t_count);
                while next_token < watermark {
                    let t = next_token;
                    let out_row = &mut out[t * payload..(t + 1) * payload];
                    let mut contributions = 0;
                    let mut single: Option<&[u8]> = None;
                    for (j, &d) in experts.iter().enumerate() {
                        let e = cursors[j];
                        let r = hl.entries(d);
                        if e >= r.end || hl.token(e) != t {
                            continue;
                        }
                        cursors[j] += 1;
                        let i = e - r.start;
                        let (rec, mode) = recs[j].expect("delivered rows have a record");
                        let row: &[u8] = match mode {
                            WireMode::Pull if !direct => {
                                let at = (handle.offsets[j] + i) * stride;
                                &pull_buf[at..at + payload]
                            }
                            WireMode::Push => {
                                let at = layout.e2a_recv(parity) + (handle.offsets[j] + i) * stride;
                                // SAFETY: the expert rank signalled progress past this row after
                                // writing it and writes this parity again only after our credit.
                                unsafe { own.slice(at, payload)? }
                            }
                            WireMode::Pull | WireMode::Gather => {
                                let win = f.peer_window(d).expect("load/store fabric");
                                let at =
                                    layout.e2a_stage(parity) + (rec.offset as usize + i) * stride;
                                // SAFETY: the expert rank's staging is stable from its progress
                                // signal until our credit.
                                unsafe { win.slice(at, payload)? }
                            }
                        };
                        match contributions {
                            0 => single = Some(row),
                            1 => {
                                dtype.to_f32(single.take().expect("first row"), acc);
                                dtype.accumulate(row, 1.0, acc);
                            }
                            _ => dtype.accumulate(row, 1.0, acc),
                        }
                        contributions += 1;
                    }
                    match (contributions, single) {
                        (0, _) => out_row.fill(0),
                        // One expert rank: its row is already the answer, in the output dtype.
                        (1, Some(row)) => out_row.copy_from_slice(row),
                        _ => dtype.from_f32(acc, out_row),
                    }
                    next_token += 1;
                }
                Ok(waiting)
            };
            f.wait_until(deadline, &mut || match pass() {
                Ok(w) => w,
                Err(e) => {
                    failure = Some(e);
                    None
                }
            })?;
        }
        if let Some(e) = failure {
            return Err(e);
        }
        for &d in experts {
            self.fabric
                .signal(d, self.slots.e2a_credit(self.rank), epoch)?;
        }
        self.e2a_epoch = epoch;
        self.spare_layout = Some(handle.layout);
        Ok(())
    }
}
