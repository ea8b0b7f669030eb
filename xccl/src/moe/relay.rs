//! A2E and E2A through relays ("trampolines"): the relay's side of both hops.
//!
//! With a [`crate::topology::RelayPlan`], attention rank `a` (member slot `m` of relay `r`)
//! sends its whole A2E call to `r` only: its route table (token count, rows per expert rank)
//! into `r`'s table area, one [`Record`] (the total row count), then its rows, grouped by
//! destination in expert-rank order, in chunks into `r`'s member area, signalling
//! `a2e_ready[a]` on `r` as it goes. Rows are the direct path's rows (one per (token,
//! destination rank), payload, token index, local-expert mask and weights, INT8 or not).
//!
//! The relay ([`Relay::forward_a2e`], inside its own A2E receive) forwards each member's rows
//! chunk by chunk as they stream in (not after the whole call, nor after a whole source): the
//! route table is checked when the record arrives, and the rows for expert rank `d` go straight
//! into `d`'s receive area for attention rank `a`, exactly where the direct path would have
//! pushed them. Once every member is forwarded it writes one header
//! per expert rank: a record (total rows, a hash of the entries in its offset field) and one
//! `(count, reply offset, flags)` entry per member, then one signal `a2e_ready[r]`. An expert rank
//! therefore polls one record per relay, not one per attention rank. The relay keeps the token
//! index of every forwarded row for the E2A.
//!
//! E2A: every expert rank writes its replies for the tokens of relay `r`'s members into `r`'s
//! member areas at the offsets the header named, then one record per relay. The relay
//! ([`Relay::combine_e2a`], inside its own E2A send) waits for every expert rank, then for each
//! member and token replays the attention side's arithmetic of the direct path exactly (see
//! `moe::combine`): no contribution gives zeros, one is copied as it is, several are summed in
//! f32 in ascending expert-rank order starting from the first, then rounded once. It forwards one
//! fully reduced row per token; the attention rank copies it as it is. The result is therefore
//! identical bit for bit to the direct path's.
//!
//! Every record, route table and header is checked against the exact region it may address
//! (counts against the member's token count and the area's rows, sums against the record, the
//! header's entries against the hash in its record, token indices against the member's token
//! count, tokens strictly ascending within one destination), and errors name the peer that
//! wrote them.
//!
//! INT8: A2E rows are forwarded as they are. INT8 E2A replies are summed as above after
//! dequantization (`f32(q) * scale`), and a token with several contributions has its f32 sum
//! quantized once more ([`Relay::reduce_member`]); the attention rank dequantizes it. That
//! second quantization is the only difference from the direct INT8 path (within `scale' / 2`
//! per element, `scale'` of the sum), and the reference replays it.
//!
//! Not through relays (rejected with an error by the communicator): pull transfers, registered
//! input and output, views.

use std::collections::VecDeque;
use std::time::Instant;

use super::context::{Context, AWAITED_CHECK_EVERY};
use super::hash::Fnv;
use super::progress::{progress, Progress};
use super::quant::{dequantize, dequantize_add, int8_payload, Quantizer};
use super::record::{Record, WireMode};
use super::window_layout::RELAY_ENTRY;
use crate::fabric::Waiting;
use crate::{DType, Error, Result};

/// What a relay keeps of one member's A2E call until its E2A.
#[derive(Debug, Default)]
pub(crate) struct MemberCall {
    /// The member's token count.
    pub(crate) num_tokens: usize,
    /// Rows per expert index.
    pub(crate) counts: Vec<u32>,
    /// Row offset of each expert index's rows (prefix sums of `counts`).
    pub(crate) offsets: Vec<u32>,
    /// Token index of every row, in wire order.
    pub(crate) tokens: Vec<u32>,
    /// The rows are INT8.
    pub(crate) int8: bool,
    /// The member's user tag, forwarded in the headers.
    pub(crate) tag: u64,
}

/// What a relay keeps of one A2E call until its E2A.
#[derive(Debug, Default)]
pub(crate) struct RelayCall {
    pub(crate) epoch: u64,
    pub(crate) members: Vec<MemberCall>,
}

/// The relay's state: calls forwarded and not yet reduced, and scratch space.
#[derive(Debug, Default)]
pub(crate) struct Relay {
    calls: VecDeque<RelayCall>,
    spare: Vec<RelayCall>,
    scratch: Vec<u8>,
    acc: Vec<f32>,
    out: Vec<u8>,
    count: Vec<u32>,
    first: Vec<u32>,
    quant: Quantizer,
}

/// The hash of a header's entries, carried in its record's offset field.
pub(crate) fn entries_hash(entries: &[u8]) -> u32 {
    let mut h = Fnv::new();
    for c in entries.chunks(8) {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        h.u64(u64::from_le_bytes(w));
    }
    let v = h.finish();
    (v ^ (v >> 32)) as u32
}

/// One member's entry of a relay header, as an expert rank reads it.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct HeaderEntry {
    /// Rows for this expert rank.
    pub(crate) count: usize,
    /// Where its replies go (row offset in the member's E2A area on the relay).
    pub(crate) offset: usize,
    /// The rows are INT8.
    pub(crate) int8: bool,
    /// The member's user tag.
    pub(crate) tag: u64,
}

/// Reads and checks the header relay `relay` (index `k`) wrote for call `epoch` into this
/// expert rank's window: every entry's rows must fit the receive area (`recv_rows`) and its
/// reply offset the member's reply area (`attention_rows`), the counts must add up to the
/// record's and the entries hash to the value the record carries.
pub(crate) fn read_header(
    ctx: &Context,
    relay: usize,
    k: usize,
    epoch: u64,
    out: &mut Vec<HeaderEntry>,
) -> Result<Record> {
    let l = &ctx.layout;
    let plan = ctx.topo.relay_plan().expect("relayed");
    let g = plan.members(k).len();
    let buf = l.buffer(epoch);
    let at = l.relay_header(k, buf);
    let rec = ctx.read_record(at)?;
    let (max_tokens, rows) = (l.recv_rows, l.attention_rows);
    let mode = rec.validate(relay, epoch, g * max_tokens)?;
    let bad = |detail: String| {
        Err(Error::Protocol {
            peer: relay,
            detail,
        })
    };
    if mode != WireMode::Push {
        return bad(format!(
            "relay header of epoch {epoch} is not a push message"
        ));
    }
    let mut bytes = vec![0u8; g * RELAY_ENTRY];
    ctx.get(ctx.rank, at + 32, &mut bytes)?;
    if entries_hash(&bytes) != rec.offset {
        return bad(format!(
            "relay header of epoch {epoch}: its entries do not match the hash in its record"
        ));
    }
    out.clear();
    let mut sum = 0;
    for (m, e) in bytes.chunks_exact(RELAY_ENTRY).enumerate() {
        let word =
            |i: usize| u32::from_le_bytes(e[4 * i..4 * i + 4].try_into().expect("4")) as usize;
        let entry = HeaderEntry {
            count: word(0),
            offset: word(1),
            int8: word(2) & 1 != 0,
            tag: u64::from_le_bytes(e[16..24].try_into().expect("8")),
        };
        if entry.count > max_tokens || entry.offset + entry.count > rows {
            return bad(format!(
                "relay header of epoch {epoch}: member {m} has {} rows at offset {}, the areas \
                 hold {max_tokens} rows per source and {rows} reply rows",
                entry.count, entry.offset
            ));
        }
        sum += entry.count;
        out.push(entry);
    }
    if sum != rec.count as usize {
        return bad(format!(
            "relay header of epoch {epoch}: entries add up to {sum} rows, the record says {}",
            rec.count
        ));
    }
    ctx.note_rows_received(relay, sum);
    Ok(rec)
}

impl Relay {
    /// Relay side of A2E call `epoch`: waits for each member's message, forwards its rows to
    /// their final expert ranks as soon as it is complete, then writes one header per expert
    /// rank and credits the members.
    pub(crate) fn forward_a2e(
        &mut self,
        ctx: &Context,
        epoch: u64,
        deadline: Instant,
    ) -> Result<()> {
        let plan = ctx.topo.relay_plan().expect("relayed");
        let k = plan.relay_index(ctx.rank).expect("a relay");
        let members = plan.members(k);
        let l = &ctx.layout;
        let buf = l.buffer(epoch);
        let experts = ctx.experts();
        let attention = ctx.attention();
        let n = experts.len();
        ctx.wait_credits(
            epoch,
            experts,
            ctx.slots.a2e_credit(0),
            "A2E credit (expert has not consumed an earlier relayed dispatch)",
            deadline,
        )?;
        let g = members.len();
        let mut call = self.spare.pop().unwrap_or_default();
        call.epoch = epoch;
        call.members.resize_with(g, MemberCall::default);
        let mut recs: Vec<Option<Record>> = vec![None; g];
        // With DP domains, members outside the call's domain send nothing: empty routes.
        let call_no = ctx.call_of(epoch);
        let mut done: Vec<bool> = members
            .iter()
            .map(|&ai| !ctx.topo.in_call(attention[ai], call_no))
            .collect();
        for (mc, _) in call.members.iter_mut().zip(&done).filter(|(_, d)| **d) {
            mc.num_tokens = 0;
            mc.int8 = false;
            mc.tag = 0;
            mc.counts.clear();
            mc.counts.resize(n, 0);
            mc.offsets.clear();
            mc.offsets.resize(n, 0);
            mc.tokens.clear();
        }
        let mut missing = done.iter().filter(|d| !**d).count();
        let mut forwarded = vec![0usize; g];
        let mut failure = None;
        let mut next_check = Instant::now() + AWAITED_CHECK_EVERY;
        let scratch = &mut self.scratch;
        let mut pass = || -> Result<Option<Waiting>> {
            let mut waiting = None;
            for (m, &ai) in members.iter().enumerate() {
                if done[m] {
                    continue;
                }
                let a = attention[ai];
                let p = Progress::of(ctx.slot_value(ctx.slots.a2e_ready(a)), epoch);
                if p == Progress::NotYet {
                    waiting.get_or_insert(Waiting {
                        peer: a,
                        what: "relayed A2E record",
                    });
                    continue;
                }
                if recs[m].is_none() {
                    let rec = ctx.read_record(l.record(ai, buf))?;
                    let mode = rec.validate(a, epoch, l.attention_rows)?;
                    if mode != WireMode::Push {
                        return Err(Error::Protocol {
                            peer: a,
                            detail: format!("A2E of epoch {epoch} to its relay is not a push"),
                        });
                    }
                    ctx.note_rows_received(a, rec.count as usize);
                    begin_member(ctx, epoch, m, ai, &rec, &mut call.members[m])?;
                    recs[m] = Some(rec);
                }
                let count = recs[m].expect("set above").count as usize;
                // Forward whatever arrived since the last look (per chunk, as it streams in).
                let ready = p.rows(count);
                if ready > forwarded[m] {
                    let rows = forwarded[m]..ready;
                    forward_rows(ctx, epoch, m, ai, &mut call.members[m], rows, scratch)?;
                    forwarded[m] = ready;
                }
                if ready < count {
                    waiting.get_or_insert(Waiting {
                        peer: a,
                        what: "relayed A2E rows",
                    });
                    continue;
                }
                done[m] = true;
                missing -= 1;
            }
            if missing == 0 {
                return Ok(None);
            }
            let awaited = (0..g).filter(|&m| !done[m]).map(|m| attention[members[m]]);
            let still = |a: usize| {
                let v = ctx.slot_value(ctx.slots.a2e_ready(a));
                let i = attention.iter().position(|&x| x == a).expect("member");
                let m = members.iter().position(|&x| x == i).expect("member");
                let count = recs[m].map_or(usize::MAX, |r| r.count as usize);
                Progress::of(v, epoch).rows(count) < count
            };
            ctx.check_awaited_again(awaited, &mut next_check, &still)?;
            Ok(waiting)
        };
        ctx.wait(deadline, &mut || match pass() {
            Ok(w) => w,
            Err(e) => {
                failure = Some(e);
                None
            }
        })?;
        if let Some(e) = failure {
            return Err(e);
        }
        // One header per expert rank (rotated by the relay's index to spread incast).
        let mut entries = vec![0u8; g * RELAY_ENTRY];
        for step in 0..n {
            let j = (k + step) % n;
            let d = experts[j];
            let mut total = 0u32;
            for (mc, e) in call
                .members
                .iter()
                .zip(entries.chunks_exact_mut(RELAY_ENTRY))
            {
                let words = [mc.counts[j], mc.offsets[j], u32::from(mc.int8), 0];
                total += mc.counts[j];
                for (w, v) in e.chunks_exact_mut(4).zip(words) {
                    w.copy_from_slice(&v.to_le_bytes());
                }
                e[16..24].copy_from_slice(&mc.tag.to_le_bytes());
            }
            let at = l.relay_header(k, buf);
            let rec = Record::new(epoch, total, entries_hash(&entries), WireMode::Push);
            ctx.put(d, at + 32, &entries)?;
            ctx.put_record(d, at, &rec)?;
            ctx.signal(
                d,
                ctx.slots.a2e_ready(ctx.rank),
                progress(epoch, total as usize),
            )?;
            fault_point!("relay.header");
        }
        // The members' rows are out of this rank's areas: their buffers may be reused.
        for &ai in members {
            ctx.signal(attention[ai], ctx.slots.a2e_credit(ctx.rank), epoch)?;
        }
        self.calls.push_back(call);
        Ok(())
    }

    /// Relay side of E2A call `epoch`: waits for every expert rank's replies for this relay's
    /// members, reduces each token exactly as the direct path's attention rank would, sends one
    /// row per token to each member and credits the expert ranks.
    pub(crate) fn combine_e2a(
        &mut self,
        ctx: &Context,
        epoch: u64,
        deadline: Instant,
    ) -> Result<()> {
        let Some(call) = self.calls.front() else {
            return Err(Error::invalid(format!(
                "relay has no forwarded A2E for the E2A of epoch {epoch}"
            )));
        };
        if call.epoch != epoch {
            return Err(Error::invalid(format!(
                "relay's oldest forwarded A2E is epoch {}, the E2A is for epoch {epoch}",
                call.epoch
            )));
        }
        let plan = ctx.topo.relay_plan().expect("relayed");
        let k = plan.relay_index(ctx.rank).expect("a relay");
        let members = plan.members(k);
        let l = &ctx.layout;
        let buf = l.buffer(epoch);
        let experts = ctx.experts();
        let attention = ctx.attention();
        let n = experts.len();
        let expected: Vec<usize> = (0..n)
            .map(|j| call.members.iter().map(|mc| mc.counts[j] as usize).sum())
            .collect();
        // INT8 or not follows the replies (a local choice of each expert rank), but one call's
        // replies through a relay must agree: the first record read sets it.
        let mut int8: Option<bool> = None;
        let mut seen = vec![false; n];
        let mut complete = vec![false; n];
        let mut missing = n;
        let mut failure = None;
        let mut next_check = Instant::now() + AWAITED_CHECK_EVERY;
        let mut pass = || -> Result<Option<Waiting>> {
            let mut waiting = None;
            for (j, &d) in experts.iter().enumerate() {
                if complete[j] {
                    continue;
                }
                let p = Progress::of(ctx.slot_value(ctx.slots.e2a_ready(d)), epoch);
                if p == Progress::NotYet {
                    waiting.get_or_insert(Waiting {
                        peer: d,
                        what: "relayed E2A record",
                    });
                    continue;
                }
                if !seen[j] {
                    let rec = ctx.read_record(l.relay_e2a_record(j, buf))?;
                    let mode = rec.validate(d, epoch, expected[j])?;
                    let agreed = *int8.get_or_insert(rec.int8());
                    if rec.count as usize != expected[j]
                        || mode != WireMode::Push
                        || rec.int8() != agreed
                    {
                        return Err(Error::Protocol {
                            peer: d,
                            detail: format!(
                                "relayed E2A of epoch {epoch} brings {} rows ({mode:?}, int8 {}), \
                                 {} were dispatched to it through this relay (push; the other \
                                 replies through it are int8 {agreed}: every expert rank must \
                                 use the same e2a_quant through relays)",
                                rec.count,
                                rec.int8(),
                                expected[j]
                            ),
                        });
                    }
                    ctx.note_rows_received(d, expected[j]);
                    seen[j] = true;
                }
                if p.rows(expected[j]) < expected[j] {
                    waiting.get_or_insert(Waiting {
                        peer: d,
                        what: "relayed E2A rows",
                    });
                    continue;
                }
                complete[j] = true;
                missing -= 1;
            }
            if missing == 0 {
                return Ok(None);
            }
            let awaited = (0..n).filter(|&j| !complete[j]).map(|j| experts[j]);
            let still = |d: usize| {
                let j = ctx.topo.expert_index(d).expect("expert");
                let p = Progress::of(ctx.slot_value(ctx.slots.e2a_ready(d)), epoch);
                p.rows(expected[j]) < expected[j] || (p == Progress::NotYet)
            };
            ctx.check_awaited_again(awaited, &mut next_check, &still)?;
            Ok(waiting)
        };
        ctx.wait(deadline, &mut || match pass() {
            Ok(w) => w,
            Err(e) => {
                failure = Some(e);
                None
            }
        })?;
        if let Some(e) = failure {
            return Err(e);
        }
        let member_ranks: Vec<usize> = members.iter().map(|&ai| attention[ai]).collect();
        let previous = ctx.previous_sources(epoch);
        let credit_from: Vec<usize> = (member_ranks.iter().copied())
            .filter(|a| previous.contains(a))
            .collect();
        ctx.wait_credits(
            epoch,
            &credit_from,
            ctx.slots.e2a_credit(0),
            "E2A credit (attention rank has not consumed an earlier relayed combine)",
            deadline,
        )?;
        let int8 = int8.unwrap_or(false);
        let my_index = ctx.topo.expert_index(ctx.rank).expect("expert rank");
        let call = self.calls.pop_front().expect("checked above");
        let call_no = ctx.call_of(epoch);
        for (m, mc) in call.members.iter().enumerate() {
            let a = member_ranks[m];
            if !ctx.topo.in_call(a, call_no) {
                continue;
            }
            self.reduce_member(ctx, buf, (m, a), mc, int8)?;
            let t = mc.num_tokens;
            ctx.put(a, l.e2a_recv(buf), &self.out[..t * l.e2a_stride_for(int8)])?;
            let rec = Record::with_payload(epoch, t as u32, 0, WireMode::Push, int8);
            ctx.put_record(a, l.record(my_index, buf), &rec)?;
            ctx.signal(a, ctx.slots.e2a_ready(ctx.rank), progress(epoch, t))?;
            fault_point!("relay.reply");
            ctx.stats.borrow_mut().relay_rows_forwarded += t as u64;
        }
        for &d in experts {
            ctx.signal(d, ctx.slots.e2a_credit(ctx.rank), epoch)?;
        }
        self.spare.push(call);
        Ok(())
    }

    /// Reduces member `m`'s (attention rank `member`) replies into `self.out`, one row per
    /// token, in the direct path's order: no contribution gives a zero row, one is forwarded
    /// as it is, several are summed in f32 in ascending expert-rank order starting from the
    /// first (`f32(r)`, or `f32(q) * scale` for INT8 rows), then rounded once to the dtype, or,
    /// for INT8 replies, quantized once more (the quantizer of `moe::quant` on the f32 sum;
    /// the attention rank dequantizes it).
    fn reduce_member(
        &mut self,
        ctx: &Context,
        buf: usize,
        (m, member): (usize, usize),
        mc: &MemberCall,
        int8: bool,
    ) -> Result<()> {
        let l = &ctx.layout;
        let (s, hidden, dtype) = (l.e2a_stride_for(int8), ctx.cfg.hidden, ctx.cfg.dtype);
        let payload = if int8 { int8_payload(hidden) } else { s };
        let t_count = mc.num_tokens;
        let rows = mc.tokens.len();
        self.scratch.resize(rows * s, 0);
        ctx.get(ctx.rank, l.relay_e2a(m, buf), &mut self.scratch)?;
        self.count.clear();
        self.count.resize(t_count, 0);
        self.first.clear();
        self.first.resize(t_count, 0);
        for (i, &t) in mc.tokens.iter().enumerate() {
            let t = t as usize;
            if self.count[t] == 0 {
                self.first[t] = i as u32;
            }
            self.count[t] += 1;
        }
        self.acc.clear();
        self.acc.resize(t_count * hidden, 0.0);
        // Rows are in expert-rank order, so this visits each token's contributions in the
        // direct path's order.
        for (i, &t) in mc.tokens.iter().enumerate() {
            let t = t as usize;
            if self.count[t] < 2 {
                continue;
            }
            let row = &self.scratch[i * s..i * s + payload];
            let acc = &mut self.acc[t * hidden..(t + 1) * hidden];
            match (self.first[t] as usize == i, int8) {
                (true, false) => dtype.to_f32(row, acc),
                (true, true) => dequantize(row, hidden, acc),
                (false, false) => dtype.accumulate(row, 1.0, acc),
                (false, true) => dequantize_add(row, hidden, acc),
            }
        }
        self.out.clear();
        self.out.resize(t_count * s, 0);
        for t in 0..t_count {
            let out = &mut self.out[t * s..(t + 1) * s];
            match self.count[t] {
                // All zero bytes: zeros in the dtype, or an INT8 row of zeros with scale 0.
                0 => {}
                1 => {
                    let i = self.first[t] as usize;
                    out.copy_from_slice(&self.scratch[i * s..(i + 1) * s]);
                }
                _ if !int8 => dtype.from_f32(&self.acc[t * hidden..(t + 1) * hidden], out),
                _ => {
                    let acc: &[u8] = bytemuck::cast_slice(&self.acc[t * hidden..(t + 1) * hidden]);
                    let amax = self.quant.amax(DType::F32, acc).map_err(|i| {
                        Error::invalid(format!(
                            "the relayed INT8 E2A sum for attention rank {member} token {t} is \
                             not finite at element {i}: INT8 needs finite rows"
                        ))
                    })?;
                    self.quant
                        .quantize_amax(DType::F32, acc, amax, &mut out[..payload]);
                }
            }
        }
        Ok(())
    }
}

/// Reads and checks member `m`'s (attention index `ai`) route table for call `epoch` against
/// its record, noting its token count and rows per expert rank in `mc`.
fn begin_member(
    ctx: &Context,
    epoch: u64,
    m: usize,
    ai: usize,
    rec: &Record,
    mc: &mut MemberCall,
) -> Result<()> {
    let l = &ctx.layout;
    let buf = l.buffer(epoch);
    let experts = ctx.experts();
    let n = experts.len();
    let a = ctx.attention()[ai];
    let bad = |detail: String| Err(Error::Protocol { peer: a, detail });
    let mut table = vec![0u8; 4 * (n + 1)];
    ctx.get(ctx.rank, l.relay_table(m, buf), &mut table)?;
    let word = |i: usize| u32::from_le_bytes(table[4 * i..4 * i + 4].try_into().expect("4"));
    let t_count = word(0) as usize;
    if t_count > ctx.cfg.max_tokens_per_rank {
        return bad(format!(
            "route table of epoch {epoch} names {t_count} tokens, max_tokens is {}",
            ctx.cfg.max_tokens_per_rank
        ));
    }
    mc.num_tokens = t_count;
    mc.int8 = rec.int8();
    mc.tag = rec.tag;
    mc.counts.clear();
    mc.offsets.clear();
    mc.tokens.clear();
    let mut sum = 0usize;
    for (j, &d) in experts.iter().enumerate() {
        let c = word(j + 1);
        if c as usize > t_count || c as usize > l.recv_rows {
            return bad(format!(
                "route table of epoch {epoch} sends {c} rows to rank {d}, it has {t_count} \
                 tokens and rank {d} receives at most {} rows per source",
                l.recv_rows
            ));
        }
        mc.offsets.push(sum as u32);
        mc.counts.push(c);
        sum += c as usize;
    }
    if sum != rec.count as usize {
        return bad(format!(
            "route table of epoch {epoch} adds up to {sum} rows, its record says {}",
            rec.count
        ));
    }
    Ok(())
}

/// Forwards rows `rows` of member `m`'s (attention index `ai`) message of call `epoch` (checked
/// route in `mc`): notes each row's token (below the member's token count, ascending within a
/// destination) and puts each destination's part into that rank's receive area for `ai`, at
/// the row's place in it.
fn forward_rows(
    ctx: &Context,
    epoch: u64,
    m: usize,
    ai: usize,
    mc: &mut MemberCall,
    rows: std::ops::Range<usize>,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let l = &ctx.layout;
    let buf = l.buffer(epoch);
    let experts = ctx.experts();
    let a = ctx.attention()[ai];
    let stride = l.a2e.stride_for(mc.int8);
    let meta = l.a2e.meta_offset_for(mc.int8);
    scratch.resize(rows.len() * stride, 0);
    ctx.get(ctx.rank, l.relay_a2e(m, buf) + rows.start * stride, scratch)?;
    let t_count = mc.num_tokens as u32;
    for (j, &d) in experts.iter().enumerate() {
        let (start, c) = (mc.offsets[j] as usize, mc.counts[j] as usize);
        // This destination's rows within the chunk.
        let (lo, hi) = (start.max(rows.start), (start + c).min(rows.end));
        if lo >= hi {
            continue;
        }
        for i in lo..hi {
            let at = (i - rows.start) * stride + meta;
            let t = u32::from_le_bytes(scratch[at..at + 4].try_into().expect("4"));
            let prev = (i > start).then(|| mc.tokens[i - 1]);
            if t >= t_count || prev.is_some_and(|p| t <= p) {
                return Err(Error::Protocol {
                    peer: a,
                    detail: format!(
                        "A2E row {i} of epoch {epoch} names token {t}: tokens for one rank must \
                         be ascending and below the {t_count} sent"
                    ),
                });
            }
            mc.tokens.push(t);
        }
        let part = &scratch[(lo - rows.start) * stride..(hi - rows.start) * stride];
        ctx.put(d, l.a2e_recv(ai, buf) + (lo - start) * stride, part)?;
        fault_point!("relay.forward");
        ctx.stats.borrow_mut().relay_rows_forwarded += (hi - lo) as u64;
    }
    Ok(())
}
