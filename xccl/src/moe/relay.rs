//! A2E and E2A through relays ("trampolines"): the relay's side of both hops.
//!
//! With a [`crate::topology::RelayPlan`], attention rank `a` (member slot `m` of relay `r`)
//! sends its whole A2E call to `r` only: its route table (token count, rows per expert rank)
//! into `r`'s table area, one [`Record`] (the total row count), then its rows, grouped by
//! destination in the relay's [`wire_order`] (the expert ranks after `r` first, `r`'s own rows
//! last), in chunks into `r`'s member area, signalling `a2e_ready[a]` on `r` as it goes. Rows
//! are the direct path's rows (one per (token, destination rank), payload, token index,
//! local-expert mask and weights, INT8 or not).
//!
//! The relay ([`Relay::begin_forward`] and [`Relay::forward_pass`], inside the loop of its own A2E
//! receive) checks each member's rows chunk by chunk as they stream in (not after the whole call,
//! nor after a whole source): the route table when the record arrives, then every row's token. Rows
//! for an expert rank that maps this rank's window (every expert rank on a load/store fabric such
//! as shm, and the relay itself) stay where the member pushed them: that rank reads them there, so
//! a relayed row is copied no more often than a direct one. Rows for any other expert rank `d` go
//! straight into `d`'s receive area for attention rank `a`, exactly where the direct path would
//! have pushed them. Once every member's route table is in it writes one header per expert rank: a
//! record (total rows, a hash of the entries in its offset field) and one `(count, offset, flags)`
//! entry per member (the offset locates the rows in the member's area and the replies in its reply
//! area; a flag says whether the rows stayed there). Then, as each chunk is checked (and
//! forwarded), it signals `a2e_ready[r]` on every expert rank with the rows of its members that
//! rank may read, counted in member order, so expert ranks read while the members write. An expert
//! rank therefore polls one signal per relay, not one per attention rank. The relay keeps the token
//! index of every row for the E2A. While rows are read in place the members' A2E buffers here stay
//! reserved: their credit goes out when the readers have credited the call, at the end of its E2A
//! ([`Relay::combine_e2a`]).
//!
//! E2A: every expert rank writes one record per relay (the rows it sends through it), then its
//! replies for the tokens of relay `r`'s members into `r`'s member areas at the offsets the
//! header named, member after member, in chunks with a progress signal each. The relay
//! ([`Relay::combine_e2a`], around its own E2A send, with a pass after each chunk of its own
//! replies) counts the contributions as the chunks land ([`Reduction`]). On a fabric with
//! load/store access and replies in the dtype
//! ([`super::combine::relay_sums_at_members`]) the replies stay where they landed: the relay
//! writes each member a pull record and signals how many of its tokens are complete, a chunk
//! at a time, and the member sums each token's contributions on the relay exactly as the direct
//! path sums its own window's, straight into its output (so a relayed reply is copied as often
//! as a direct one, and every rank's own replies are written into its member areas like
//! anyone's). The expert ranks' E2A credit for such a call goes out once its members have
//! credited it, at the relay's next E2A ([`Relay::release_e2a`]). Otherwise the relay reduces:
//! for each member and token it replays the attention side's arithmetic of the direct path
//! exactly (see `moe::combine`): no contribution gives zeros, one is copied as it is, several are
//! summed in f32 in ascending expert-rank order starting from the first, then rounded once. A
//! contribution is summed once it has landed and the token's earlier ones are in; reply rows are
//! read where they landed when this rank's window is mapped (no staging copy). Complete tokens go
//! out in token order, a chunk at a time (the member's record first, a progress signal per
//! chunk), written straight into the member's reply area when its window is mapped here; the
//! attention rank copies each chunk as its signal arrives. The result is therefore identical bit
//! for bit to the direct path's.
//!
//! Every record, route table and header is checked against the exact region it may address
//! (counts against the member's token count and the area's rows, sums against the record, the
//! header's entries against the hash in its record, token indices against the member's token
//! count, tokens strictly ascending within one destination), and errors name the peer that
//! wrote them.
//!
//! INT8: A2E rows are forwarded as they are. INT8 E2A replies are summed as above after
//! dequantization (`f32(q) * scale`), and a token with several contributions has its f32 sum
//! quantized once more ([`Reduction`]); the attention rank dequantizes it. That
//! second quantization is the only difference from the direct INT8 path (within `scale' / 2`
//! per element, `scale'` of the sum), and the reference replays it.
//!
//! Not through relays (rejected with an error by the communicator): pull transfers, registered
//! input and output, views.

use std::collections::VecDeque;
use std::time::Instant;

use super::combine::relay_sums_at_members;
use super::context::{CheckDue, Context};
use super::dataplane::{CopyRun, DataPlane, QuantRow, SumRow, SumTerm};
use super::device_rows::Scratch;
use super::dtype::MAX_FUSED_ROWS;
use super::hash::Fnv;
use super::progress::{chunk_rows, progress, Progress};
use super::quant::{dequantize, dequantize_add, int8_payload, Quantizer};
use super::record::{Record, WireMode};
use super::window_layout::RELAY_ENTRY;
use crate::fabric::Waiting;
use crate::{DType, Error, Result, SourceInfo};

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
    /// The expert ranks that read their rows where the members pushed them (in this relay's
    /// member areas): the members' A2E credit waits for theirs.
    pub(crate) readers: Vec<usize>,
}

/// The relay's state: calls forwarded and not yet reduced, and scratch space.
#[derive(Debug, Default)]
pub(crate) struct Relay {
    calls: VecDeque<RelayCall>,
    /// The A2E call being forwarded ([`Relay::begin_forward`]).
    forwarding: Option<Forwarding>,
    /// The last call's forwarding state, kept so the next one reuses its vectors.
    spare_forwarding: Option<Forwarding>,
    /// The E2A call whose replies its members may still be summing here
    /// ([`relay_sums_at_members`]): the expert ranks' credit for it waits for theirs
    /// ([`Relay::release_e2a`]).
    unreleased: Option<u64>,
    spare: Vec<RelayCall>,
    scratch: Vec<u8>,
    reductions: Vec<Reduction>,
    work: Work,
    /// The per-call lists of [`Relay::combine_e2a`], kept between calls.
    combining: Combining,
}

/// What [`Relay::combine_e2a`] keeps per expert rank and per member during one call: lists
/// kept in the relay between calls, so a relayed E2A allocates nothing for them.
#[derive(Debug, Default)]
struct Combining {
    /// Per expert index: rows dispatched to it through this relay, whether its record was
    /// read, rows of it landed, and its rows for the members before the current one.
    expected: Vec<usize>,
    seen: Vec<bool>,
    landed: Vec<usize>,
    before: Vec<usize>,
    /// Per member: its global rank, whether it takes part in the call, whether it has all
    /// its rows.
    member_ranks: Vec<usize>,
    in_call: Vec<bool>,
    finished: Vec<bool>,
    /// The members whose reply areas were in use by the call this one's buffers follow.
    credit_from: Vec<usize>,
}

/// The order in which a member of relay `relay` sends its rows, and so their order in its
/// member area there: expert indices after the relay's own first (wrapping), the relay's own
/// last. A relay's receive ends only once every row of its members is in (it checks them all,
/// and forwards those it must), so its own rows coming last costs it nothing, while every other
/// expert rank gets its rows as early as the direct path's first destination does (with the
/// relay's own rows first, they all waited for the relay's share as well).
pub(crate) fn wire_order(ctx: &Context, relay: usize) -> impl Iterator<Item = usize> {
    let n = ctx.experts().len();
    let own = ctx
        .topo
        .expert_index(relay)
        .expect("relays are expert ranks");
    (1..=n).map(move |s| (own + s) % n)
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
    /// The rows stayed in the member's A2E area on the relay, at `offset` (not forwarded into
    /// this rank's receive area).
    pub(crate) in_place: bool,
}

/// Header entry flag: the rows are INT8.
const ENTRY_INT8: u32 = 1;
/// Header entry flag: the rows stayed on the relay ([`HeaderEntry::in_place`]).
const ENTRY_IN_PLACE: u32 = 2;

/// Reads and checks the header relay `relay` (index `k`) wrote for call `epoch` into this
/// expert rank's window: every entry's rows must fit the receive area (`recv_rows`) and its
/// reply offset the member's reply area (`attention_rows`), the counts must add up to the
/// record's and the entries hash to the value the record carries. The entries go to `out`;
/// `bytes` is scratch.
pub(crate) fn read_header(
    ctx: &Context,
    (relay, k): (usize, usize),
    epoch: u64,
    out: &mut Vec<HeaderEntry>,
    bytes: &mut Vec<u8>,
) -> Result<Record> {
    let l = &ctx.layout;
    let plan = ctx.topo.relay_plan().expect("relayed");
    let g = plan.members(k).len();
    let buf = l.buffer(epoch);
    let at = l.relay_header(k, buf);
    let rec = ctx.read_record(at)?;
    let (max_tokens, rows) = (l.recv_rows, l.attention_rows);
    let mode = rec.validate(relay, epoch, g * max_tokens, 1)?;
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
    bytes.clear();
    bytes.resize(g * RELAY_ENTRY, 0);
    ctx.get(ctx.rank, at + 32, bytes)?;
    if entries_hash(bytes) != rec.offset {
        return bad(format!(
            "relay header of epoch {epoch}: its entries do not match the hash in its record"
        ));
    }
    out.clear();
    let mut sum = 0;
    for (m, e) in bytes.chunks_exact(RELAY_ENTRY).enumerate() {
        let word =
            |i: usize| u32::from_le_bytes(e[4 * i..4 * i + 4].try_into().expect("4")) as usize;
        let flags = word(2) as u32;
        if flags & !(ENTRY_INT8 | ENTRY_IN_PLACE) != 0 {
            return bad(format!(
                "relay header of epoch {epoch}: member {m} has unknown flags {flags:#x}"
            ));
        }
        let entry = HeaderEntry {
            count: word(0),
            offset: word(1),
            int8: flags & ENTRY_INT8 != 0,
            tag: u64::from_le_bytes(e[16..24].try_into().expect("8")),
            in_place: flags & ENTRY_IN_PLACE != 0,
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
    /// Starts the relay side of A2E call `epoch`: waits for the expert ranks' credits, then
    /// [`Relay::forward_pass`] does the rest, one look at a time: it waits for each member's
    /// message, writes one header per expert rank once every route table is in, checks the rows
    /// as they land (forwarding those no reader takes in place) and signals each expert rank
    /// how many it may read; then credits the members (at once when every row was forwarded,
    /// else after the E2A).
    pub(crate) fn begin_forward(
        &mut self,
        ctx: &Context,
        epoch: u64,
        deadline: Instant,
    ) -> Result<()> {
        let started = Instant::now();
        let plan = ctx.topo.relay_plan().expect("relayed");
        let k = plan.relay_index(ctx.rank).expect("a relay");
        let members = plan.members(k);
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
        // Expert ranks that load from this rank's window read their rows where the members
        // pushed them: nothing to forward to them.
        call.readers.clear();
        call.readers
            .extend(experts.iter().copied().filter(|&d| ctx.mapped(d)));
        // The last call's state, its vectors reused: a call allocates nothing here.
        let mut f = self.spare_forwarding.take().unwrap_or_else(|| Forwarding {
            call: RelayCall::default(),
            started,
            recs: Vec::new(),
            done: Vec::new(),
            missing: 0,
            unread: 0,
            told: Vec::new(),
            forwarded: Vec::new(),
            next_check: CheckDue::default(),
            bytes: Vec::new(),
        });
        // With DP domains, members outside the call's domain send nothing: empty routes.
        let call_no = ctx.call_of(epoch);
        f.done.clear();
        f.done
            .extend((members.iter()).map(|&ai| !ctx.topo.in_call(attention[ai], call_no)));
        for (mc, _) in call.members.iter_mut().zip(&f.done).filter(|(_, d)| **d) {
            mc.num_tokens = 0;
            mc.int8 = false;
            mc.tag = 0;
            mc.counts.clear();
            mc.counts.resize(n, 0);
            mc.offsets.clear();
            mc.offsets.resize(n, 0);
            mc.tokens.clear();
        }
        f.missing = f.done.iter().filter(|d| !**d).count();
        f.unread = f.missing;
        f.recs.clear();
        f.recs.resize(g, None);
        f.told.clear();
        f.told.resize(n, None);
        f.forwarded.clear();
        f.forwarded.resize(g, 0);
        f.call = call;
        f.started = started;
        f.next_check = CheckDue::default();
        self.forwarding = Some(f);
        Ok(())
    }

    /// One look at the A2E call [`Relay::begin_forward`] started: handles whatever arrived;
    /// `Some` while a member's message is incomplete (what it waits for), `None` once the
    /// call is forwarded (or none is being forwarded). An error ends the forwarding.
    pub(crate) fn forward_pass(&mut self, ctx: &Context) -> Result<Option<Waiting>> {
        let Some(mut f) = self.forwarding.take() else {
            return Ok(None);
        };
        let waiting = f.pass(ctx, &mut self.scratch)?;
        if waiting.is_some() {
            self.forwarding = Some(f);
            return Ok(waiting);
        }
        // When every row is forwarded, the members' buffers here may be reused at once;
        // otherwise once the readers are done ([`Relay::combine_e2a`]).
        let plan = ctx.topo.relay_plan().expect("relayed");
        let k = plan.relay_index(ctx.rank).expect("a relay");
        if f.call.readers.is_empty() {
            credit_members(ctx, plan.members(k), f.call.epoch)?;
        }
        ctx.stats.borrow_mut().relay_forward += f.started.elapsed();
        self.calls.push_back(std::mem::take(&mut f.call));
        self.spare_forwarding = Some(f);
        Ok(None)
    }

    /// Relay side of E2A call `epoch`: reduces each member's tokens as the expert ranks' replies
    /// land, exactly as the direct path's attention rank would (see [`Reduction`]), and streams
    /// the reduced rows to each member in chunks (its record first, a progress signal per
    /// chunk); then credits the expert ranks. `own` is this relay's own replies (one row per
    /// token of its batch) and its batch's sources when they stayed where the caller has them
    /// (`combine::own_replies_in_place`): its contributions are read from there.
    pub(crate) fn combine_e2a(
        &mut self,
        ctx: &Context,
        epoch: u64,
        deadline: Instant,
        own: Option<(&[u8], &[SourceInfo])>,
        send_own: impl FnOnce(&mut dyn FnMut() -> Result<()>) -> Result<()>,
    ) -> Result<()> {
        let start = Instant::now();
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
        let g = members.len();
        // The lists go back into `self.combining` at the end (an error drops them).
        let mut lists = std::mem::take(&mut self.combining);
        let Combining {
            expected,
            seen,
            landed,
            before,
            member_ranks,
            in_call,
            finished,
            credit_from,
        } = &mut lists;
        expected.clear();
        expected.extend((0..n).map(|j| {
            call.members
                .iter()
                .map(|mc| mc.counts[j] as usize)
                .sum::<usize>()
        }));
        member_ranks.clear();
        member_ranks.extend(members.iter().map(|&ai| attention[ai]));
        let call_no = ctx.call_of(epoch);
        in_call.clear();
        in_call.extend(member_ranks.iter().map(|&a| ctx.topo.in_call(a, call_no)));
        // The members' reply areas must be free before the first reduced row goes out.
        let previous = ctx.previous_sources(epoch);
        credit_from.clear();
        credit_from.extend((member_ranks.iter().copied()).filter(|a| previous.contains(a)));
        ctx.wait_credits(
            epoch,
            credit_from,
            ctx.slots.e2a_credit(0),
            "E2A credit (attention rank has not consumed an earlier relayed combine)",
            deadline,
        )?;
        self.reductions.resize_with(g, Reduction::default);
        let hidden = ctx.cfg.hidden;
        // Expert rank `j` writes the replies for the members in member order: its rows for
        // member `m` follow those for the members before it.
        before.clear();
        before.resize(n, 0);
        let my_index = ctx
            .topo
            .expert_index(ctx.rank)
            .expect("a relay is an expert rank");
        for (m, (red, mc)) in self.reductions.iter_mut().zip(&call.members).enumerate() {
            red.begin(mc, before, hidden);
            for (b, &c) in before.iter_mut().zip(&mc.counts) {
                *b += c as usize;
            }
            // This relay's own rows for the member: where its batch holds them.
            red.own = None;
            if let (Some((_, sources)), true) = (own, in_call[m]) {
                let info = &sources[members[m]];
                let (lo, count) = (mc.offsets[my_index] as usize, mc.counts[my_index] as usize);
                if info.count != count || info.reply_offset != lo {
                    return Err(Error::invalid(format!(
                        "relayed E2A of epoch {epoch}: this relay's batch has {} rows at {} for \
                         attention rank {}, its forwarded A2E {count} at {lo}",
                        info.count, info.reply_offset, member_ranks[m]
                    )));
                }
                red.own = Some((lo..lo + count, info.first_token));
            }
        }
        let own_rows = own.map(|(rows, _)| rows);
        // Where the members sum their tokens themselves the replies stay in the dtype.
        // Elsewhere INT8 or not follows the replies (a local choice of each expert rank), but
        // one call's replies through a relay must agree: the first record read sets it.
        let at_members = relay_sums_at_members(ctx);
        let mut int8: Option<bool> = at_members.then_some(false);
        seen.clear();
        seen.resize(n, false);
        let mut unseen = n;
        landed.clear();
        landed.resize(n, 0);
        finished.clear();
        finished.extend(in_call.iter().map(|&c| !c));
        let mut unfinished = finished.iter().filter(|f| !**f).count();
        let mut failure = None;
        let mut next_check = CheckDue::default();
        let mut busy = std::time::Duration::ZERO;
        let (reductions, work) = (&mut self.reductions, &mut self.work);
        let mut pass = || -> Result<Option<Waiting>> {
            let mut waiting = None;
            for (j, &d) in experts.iter().enumerate() {
                if landed[j] == expected[j] && seen[j] {
                    continue;
                }
                let p = Progress::of(ctx.slot_value(ctx.slots.e2a_ready(d)), epoch);
                if p == Progress::NotYet {
                    waiting.get_or_insert(Waiting::on(d, "relayed E2A record"));
                    continue;
                }
                if !seen[j] {
                    let rec = ctx.read_record(l.relay_e2a_record(j, buf))?;
                    let mode = rec.validate(d, epoch, expected[j], 1)?;
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
                    unseen -= 1;
                }
                landed[j] = p.rows(expected[j]);
                if landed[j] < expected[j] {
                    waiting.get_or_insert(Waiting::on(d, "relayed E2A rows"));
                }
            }
            // Every record first: they say whether the replies are INT8 (the row stride).
            if unseen == 0 {
                let began = Instant::now();
                let int8 = int8.unwrap_or(false);
                for m in 0..g {
                    if finished[m] {
                        continue;
                    }
                    let (red, mc) = (&mut reductions[m], &call.members[m]);
                    let at = (member_ranks[m], l.relay_e2a(m, buf));
                    for (j, &got) in landed.iter().enumerate() {
                        let mine = got.saturating_sub(red.before[j]);
                        red.absorb(mc, j, mine.min(mc.counts[j] as usize));
                    }
                    let complete = if at_members {
                        red.publish(ctx, epoch, buf, mc, at.0)?
                    } else {
                        red.emit(ctx, epoch, buf, mc, at, int8, work, own_rows)?
                    };
                    if complete {
                        finished[m] = true;
                        unfinished -= 1;
                    }
                }
                busy += began.elapsed();
            }
            // Done when every member has its rows and every expert rank's record is checked
            // (a relay without members of this call still checks that nothing came).
            if unfinished == 0 && unseen == 0 {
                return Ok(None);
            }
            let awaited = (0..n)
                .filter(|&j| !seen[j] || landed[j] < expected[j])
                .map(|j| experts[j]);
            let still = |d: usize| {
                let j = ctx.topo.expert_index(d).expect("expert");
                let p = Progress::of(ctx.slot_value(ctx.slots.e2a_ready(d)), epoch);
                p.rows(expected[j]) < expected[j] || (p == Progress::NotYet)
            };
            ctx.check_awaited_again(awaited, &mut next_check, &still)?;
            match waiting {
                // Records and rows seen so far (`Waiting::progress`).
                Some(w) => Ok(Some(
                    w.at((landed.iter().sum::<usize>() + n - unseen) as u64),
                )),
                // Every reply is in, so every token is complete and out: unreachable.
                None => Err(Error::invalid(format!(
                    "relayed E2A of epoch {epoch}: every reply is in, {unfinished} members are \
                     not complete"
                ))),
            }
        };
        // This rank's own replies go out first, with a pass after each chunk, so its members
        // sum the tokens complete so far while it still writes (not after all of its replies).
        let sent = send_own(&mut || pass().map(drop));
        let waited = sent.and_then(|()| {
            ctx.wait(deadline, &mut || match pass() {
                Ok(w) => w,
                Err(e) => {
                    failure = Some(e);
                    None
                }
            })
        });
        let finish = |stats: &mut crate::moe::stats::Stats| {
            stats.relay_combine += start.elapsed();
            stats.relay_reduce += busy;
        };
        finish(&mut ctx.stats.borrow_mut());
        waited?;
        if let Some(e) = failure {
            return Err(e);
        }
        if at_members {
            self.unreleased = Some(epoch);
        } else {
            credit_experts(ctx, epoch)?;
        }
        self.combining = lists;
        let call = self.calls.pop_front().expect("checked above");
        if !call.readers.is_empty() {
            // Every expert rank replied, so each has read its rows of this call in place (an
            // A2E receive copies them out before it credits, and views are not relayed): wait
            // for those credits, then free the members' buffers here.
            let need = ctx.wait_credited(
                epoch,
                &call.readers,
                ctx.slots.a2e_credit(0),
                "A2E credit (expert has not finished reading its rows on this relay)",
                deadline,
            );
            let credited = need.and_then(|()| credit_members(ctx, members, epoch));
            self.spare.push(call);
            return credited;
        }
        self.spare.push(call);
        Ok(())
    }

    /// Credits the expert ranks for the last E2A call whose replies this relay's members summed
    /// where they landed here ([`relay_sums_at_members`]), once every member of that call has
    /// credited it (it has read them all); nothing when there is none. Called at the start of
    /// this relay's next E2A, before its own replies wait for that credit.
    pub(crate) fn release_e2a(&mut self, ctx: &Context, deadline: Instant) -> Result<()> {
        let Some(epoch) = self.unreleased else {
            return Ok(());
        };
        let plan = ctx.topo.relay_plan().expect("relayed");
        let k = plan.relay_index(ctx.rank).expect("a relay");
        let call = ctx.call_of(epoch);
        let members = &mut self.combining.credit_from;
        members.clear();
        members.extend(
            (plan.members(k).iter())
                .map(|&ai| ctx.attention()[ai])
                .filter(|&a| ctx.topo.in_call(a, call)),
        );
        ctx.wait_credited(
            epoch,
            members,
            ctx.slots.e2a_credit(0),
            "E2A credit (attention rank is still summing its replies on this relay)",
            deadline,
        )?;
        credit_experts(ctx, epoch)?;
        self.unreleased = None;
        Ok(())
    }
}

/// Where one member's reduction stands within one relayed E2A call.
///
/// Rows are counted as they land; a token is complete when all its contributions are in, and
/// complete tokens go out in token order, one chunk at a time. A complete token's
/// contributions are summed as it goes out, read where they landed, in the direct path's order
/// (ascending expert rank, from the first: see `moe::combine`) into one f32 row, rounded once
/// into the member's reply row: one pass over the contributions, as the direct path's
/// attention rank makes, and no `[tokens, hidden]` f32 sum (summing each row as it landed
/// wrote and read such a sum, 14.7 MB at T=512, H=7168: 3.6 of the relay's 4.3 ms per call
/// at 1A:2E, K=2).
#[derive(Debug, Default)]
pub(crate) struct Reduction {
    /// Contributions per token.
    count: Vec<u32>,
    /// Contributions landed so far per token.
    have: Vec<u32>,
    /// Where each token's contributions start in `rows`.
    start: Vec<u32>,
    /// Each token's contribution rows (indices into the member's reply area), in ascending
    /// expert order, `start[t]..start[t] + count[t]`.
    rows: Vec<u32>,
    /// Rows of each expert index taken so far.
    taken: Vec<usize>,
    /// Rows each expert index wrote for the members before this one.
    before: Vec<usize>,
    /// Tokens complete (a prefix of the member's tokens).
    ready: usize,
    /// Tokens written to the member and signalled.
    sent: usize,
    /// The member's record is written.
    announced: bool,
    hidden: usize,
    /// Rows of this relay's own replies in the member's reply area, and the first of its
    /// batch's tokens they answer, when they stayed in the caller's replies (not copied into
    /// the window).
    own: Option<(std::ops::Range<usize>, usize)>,
}

/// Scratch space of a relay's E2A: one chunk of reduced rows (when the member's window is not
/// mapped here), one reply row (when this rank's own window is not), one f32 sum row, the
/// quantizer.
#[derive(Debug, Default)]
pub(crate) struct Work {
    out: Vec<u8>,
    row: Vec<u8>,
    acc: Vec<f32>,
    quant: Quantizer,
}

impl Reduction {
    /// Starts the reduction of one member's call `mc`; expert index `j` wrote `before[j]` rows
    /// for the members before it.
    fn begin(&mut self, mc: &MemberCall, before: &[usize], hidden: usize) {
        let t = mc.num_tokens;
        self.count.clear();
        self.count.resize(t, 0);
        for &tok in &mc.tokens {
            self.count[tok as usize] += 1;
        }
        self.start.clear();
        let mut at = 0u32;
        self.start.extend(self.count.iter().map(|&c| {
            at += c;
            at - c
        }));
        // Each token's list in ascending expert index (the rows are in the wire order).
        self.have.clear();
        self.have.resize(t, 0);
        self.rows.clear();
        self.rows.resize(mc.tokens.len(), 0);
        for (&lo, &c) in mc.offsets.iter().zip(&mc.counts) {
            for i in lo as usize..(lo + c) as usize {
                let tok = mc.tokens[i] as usize;
                self.rows[(self.start[tok] + self.have[tok]) as usize] = i as u32;
                self.have[tok] += 1;
            }
        }
        self.have.fill(0);
        self.taken.clear();
        self.taken.resize(before.len(), 0);
        self.before.clear();
        self.before.extend_from_slice(before);
        self.ready = 0;
        self.sent = 0;
        self.announced = false;
        self.hidden = hidden;
    }

    /// Counts expert index `j`'s replies for this member up to its `landed` rows as landed,
    /// and moves `ready` past the tokens now complete.
    fn absorb(&mut self, mc: &MemberCall, j: usize, landed: usize) {
        while self.taken[j] < landed {
            let i = mc.offsets[j] as usize + self.taken[j];
            self.have[mc.tokens[i] as usize] += 1;
            self.taken[j] += 1;
        }
        while self.ready < mc.num_tokens && self.have[self.ready] == self.count[self.ready] {
            self.ready += 1;
        }
    }

    /// Writes and signals the complete tokens to the member, a chunk at a time (the last one
    /// partial; the member's record before the first); `true` once every token is out.
    #[allow(clippy::too_many_arguments)]
    fn emit(
        &mut self,
        ctx: &Context,
        epoch: u64,
        buf: usize,
        mc: &MemberCall,
        (a, area): (usize, usize),
        int8: bool,
        work: &mut Work,
        own: Option<&[u8]>,
    ) -> Result<bool> {
        let l = &ctx.layout;
        let t_count = mc.num_tokens;
        let s = l.e2a_stride_for(int8);
        let my_index = ctx.topo.expert_index(ctx.rank).expect("expert rank");
        if !self.announced {
            let rec = Record::with_payload(epoch, t_count as u32, 0, WireMode::Push, int8);
            ctx.put_record(a, l.record(my_index, buf), &rec)?;
            self.announced = true;
            if t_count == 0 {
                ctx.signal(a, ctx.slots.e2a_ready(ctx.rank), progress(epoch, 0))?;
                fault_point!("relay.reply");
                return Ok(true);
            }
        }
        let chunk = chunk_rows(s, ctx.cfg.chunk_bytes);
        while self.sent < t_count && (self.ready - self.sent >= chunk || self.ready == t_count) {
            let rows = self.sent..(self.sent + chunk).min(self.ready);
            let at = l.e2a_recv(buf) + rows.start * s;
            let len = rows.len() * s;
            let on_device = ctx.fabric.as_cuda().is_some() && own.is_none();
            // SAFETY: this relay waited for the member's E2A credit of the call that last used
            // this buffer; the member reads these rows only once a signal of this relay covers
            // them (the one below, after the slice is gone), and with relays no other rank
            // writes the member's reply area.
            match unsafe { super::regions::exclusive(ctx, a, at, len)? } {
                // The cuda fabric: summed on the device, straight into the member's window.
                _ if on_device => {
                    self.write_rows_device(ctx, rows.clone(), area, int8, (a, at))?;
                    ctx.note_written(a, len);
                }
                Some(dst) => {
                    self.write_rows(ctx, a, rows.clone(), area, int8, dst, work, own)?;
                    ctx.note_written(a, len);
                }
                None => {
                    let mut out = std::mem::take(&mut work.out);
                    out.resize(len, 0);
                    let written =
                        self.write_rows(ctx, a, rows.clone(), area, int8, &mut out, work, own);
                    let put = written.and_then(|()| ctx.put(a, at, &out));
                    work.out = out;
                    put?;
                }
            }
            self.sent = rows.end;
            ctx.signal(a, ctx.slots.e2a_ready(ctx.rank), progress(epoch, self.sent))?;
            fault_point!("relay.reply");
            ctx.stats.borrow_mut().relay_rows_forwarded += rows.len() as u64;
        }
        Ok(self.sent == t_count)
    }

    /// Where the member sums its tokens itself ([`relay_sums_at_members`]): tells it how many
    /// of its tokens are complete (every contribution landed in its reply area here), a chunk
    /// at a time (its record first: a pull record, the rows stay here); `true` once every token
    /// is.
    fn publish(
        &mut self,
        ctx: &Context,
        epoch: u64,
        buf: usize,
        mc: &MemberCall,
        a: usize,
    ) -> Result<bool> {
        let l = &ctx.layout;
        let t_count = mc.num_tokens;
        let slot = ctx.slots.e2a_ready(ctx.rank);
        if !self.announced {
            let my_index = ctx.topo.expert_index(ctx.rank).expect("expert rank");
            let rec = Record::with_payload(epoch, t_count as u32, 0, WireMode::Pull, false);
            ctx.put_record(a, l.record(my_index, buf), &rec)?;
            self.announced = true;
            if t_count == 0 {
                ctx.signal(a, slot, progress(epoch, 0))?;
                fault_point!("relay.reply");
                return Ok(true);
            }
        }
        let chunk = chunk_rows(l.e2a_stride, ctx.cfg.chunk_bytes);
        if self.ready > self.sent && (self.ready - self.sent >= chunk || self.ready == t_count) {
            self.sent = self.ready;
            ctx.signal(a, slot, progress(epoch, self.sent))?;
            fault_point!("relay.reply");
        }
        Ok(self.sent == t_count)
    }

    /// `len` bytes of reply row `i` of the member's reply area (`area`, rows `stride` apart)
    /// where they are, without a copy: in this relay's own replies (`own`) when the row is one
    /// of them and they stayed there, or where they landed in this rank's window when it is
    /// mapped here; `None` when reading them needs a copy (the window is not mapped).
    ///
    /// # Safety
    /// Row `i` has landed, and its writer leaves it alone while the slice lives (rows a sender
    /// has signalled and writes again only after this relay's credit).
    unsafe fn lent_reply_row<'a>(
        &self,
        ctx: &'a Context,
        own: Option<&'a [u8]>,
        (area, stride): (usize, usize),
        i: usize,
        len: usize,
    ) -> Result<Option<&'a [u8]>> {
        if let (Some(replies), Some((range, first))) = (own, &self.own) {
            if range.contains(&i) {
                let row = first + i - range.start;
                let at = row * ctx.layout.e2a_stride;
                return match replies.get(at..at + len) {
                    Some(bytes) => Ok(Some(bytes)),
                    None => Err(Error::invalid(format!(
                        "this relay's own replies end before row {row}"
                    ))),
                };
            }
        }
        // SAFETY: forwarded from the caller's contract.
        unsafe { super::regions::landed(ctx, ctx.rank, area + i * stride, len) }
    }

    /// Runs `f` on reply row `i` ([`Reduction::lent_reply_row`]): where it is, or on a copy in
    /// `tmp` when this rank's window is not mapped here.
    ///
    /// # Safety
    /// As [`Reduction::lent_reply_row`], while `f` runs.
    #[allow(clippy::too_many_arguments)]
    unsafe fn with_reply_row<R>(
        &self,
        ctx: &Context,
        own: Option<&[u8]>,
        (area, stride): (usize, usize),
        i: usize,
        len: usize,
        tmp: &mut Vec<u8>,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R> {
        // SAFETY: forwarded from the caller's contract.
        if let Some(row) = unsafe { self.lent_reply_row(ctx, own, (area, stride), i, len)? } {
            return Ok(f(row));
        }
        tmp.resize(len, 0);
        ctx.get(ctx.rank, area + i * stride, tmp)?;
        Ok(f(tmp))
    }

    /// [`Reduction::write_rows`] on the device (cuda fabric): the reduced rows of tokens
    /// `rows` into `a`'s window at `at`, planned here and run by the data plane, the same bits:
    /// no contribution gives zero bytes, one is copied as it is, several are one [`SumRow`]
    /// (from the first, in ascending expert order) rounded once to the dtype or, INT8, summed
    /// in f32 into scratch and quantized from there. Complete when it returns.
    fn write_rows_device(
        &self,
        ctx: &Context,
        rows: std::ops::Range<usize>,
        area: usize,
        int8: bool,
        (a, at): (usize, usize),
    ) -> Result<()> {
        let s = ctx.layout.e2a_stride_for(int8);
        let hidden = self.hidden;
        let payload = if int8 { int8_payload(hidden) } else { s };
        let deadline = ctx.call_deadline();
        let mut dev = ctx.device_rows()?;
        let into = dev.window(a, at, rows.len() * s)?;
        // INT8 sums in f32 (one row of `hidden` f32 per token) before they are quantized.
        let wide = if int8 {
            dev.scratch(Scratch::Relay, rows.len() * hidden * 4, deadline)?
        } else {
            0
        };
        let (mut copies, mut zeros) = (Vec::new(), Vec::new());
        let (mut sums, mut terms, mut quantized) = (Vec::new(), Vec::new(), Vec::new());
        for (k, t) in rows.enumerate() {
            let dst = into + (k * s) as u64;
            let first = self.start[t] as usize;
            let mine = &self.rows[first..first + self.count[t] as usize];
            let reply = |i: u32| dev.window(ctx.rank, area + i as usize * s, payload);
            match mine {
                [] => zeros.push(CopyRun {
                    src: 0,
                    dst,
                    len: s as u64,
                }),
                [i] => copies.push(CopyRun {
                    src: reply(*i)?,
                    dst,
                    len: s as u64,
                }),
                several => {
                    let first_term = terms.len() as u32;
                    for &i in several {
                        terms.push(SumTerm {
                            src: reply(i)?,
                            weight: 1.0,
                            int8: int8 as u32,
                        });
                    }
                    let sum_at = if int8 {
                        wide + (k * hidden * 4) as u64
                    } else {
                        dst
                    };
                    sums.push(SumRow {
                        dst: sum_at,
                        first_term,
                        num_terms: several.len() as u32,
                        init_first: 1,
                        reserved: 0,
                    });
                    if int8 {
                        quantized.push(QuantRow { src: sum_at, dst });
                        if s > payload {
                            zeros.push(CopyRun {
                                src: 0,
                                dst: dst + payload as u64,
                                len: (s - payload) as u64,
                            });
                        }
                    }
                }
            }
        }
        let zero = vec![0u8; s];
        let sum_dtype = if int8 { DType::F32 } else { ctx.cfg.dtype };
        // SAFETY: every source is a landed reply row inside this relay's window (range-checked)
        // that its writer leaves alone until this relay's credit, sent once the call is
        // reduced; every destination is a distinct row (or its padding) inside the member's
        // reply area (range-checked), reserved by the member's credit, or of the relay scratch.
        unsafe {
            dev.plane.copy_runs(&copies)?;
            dev.plane.scatter(&zero, &zeros)?;
            dev.plane.sum_rows(sum_dtype, hidden, &sums, &terms)?;
            dev.plane.quantize(DType::F32, hidden, &quantized)?;
        }
        dev.plane.complete(deadline)
    }

    /// Writes the reduced rows of tokens `rows` (complete) into `dst`, one after the other: no
    /// contribution gives a zero row, one is copied as it is, several are the f32 sum rounded
    /// once to the dtype or, for INT8 replies, quantized once more (the quantizer of
    /// `moe::quant` on the f32 sum; the attention rank dequantizes it).
    #[allow(clippy::too_many_arguments)]
    fn write_rows(
        &self,
        ctx: &Context,
        member: usize,
        rows: std::ops::Range<usize>,
        area: usize,
        int8: bool,
        dst: &mut [u8],
        work: &mut Work,
        own: Option<&[u8]>,
    ) -> Result<()> {
        let s = ctx.layout.e2a_stride_for(int8);
        let hidden = self.hidden;
        let payload = if int8 { int8_payload(hidden) } else { s };
        for (t, out) in rows.zip(dst.chunks_exact_mut(s)) {
            match self.count[t] {
                // All zero bytes: zeros in the dtype, or an INT8 row of zeros with scale 0.
                0 => out.fill(0),
                1 => {
                    let i = self.rows[self.start[t] as usize] as usize;
                    // SAFETY: a landed reply row (the token is complete) that its writer
                    // leaves alone until this relay's credit, which goes out once the call is
                    // reduced.
                    unsafe {
                        self.with_reply_row(ctx, own, (area, s), i, s, &mut work.row, |row| {
                            crate::fabric::copy::copy_slice(out, row)
                        })?;
                    }
                }
                n => {
                    let dtype = ctx.cfg.dtype;
                    let first = self.start[t] as usize;
                    // Up to `MAX_FUSED_ROWS` rows in the dtype that need no copy (this relay's
                    // own, or landed in its window mapped here): one pass, `DType::sum_rows`.
                    if !int8 && n as usize <= MAX_FUSED_ROWS {
                        let mut rows: [&[u8]; MAX_FUSED_ROWS] = [&[]; MAX_FUSED_ROWS];
                        let mut lent = 0;
                        for (slot, &i) in rows.iter_mut().zip(&self.rows[first..][..n as usize]) {
                            // SAFETY: as above.
                            match unsafe {
                                self.lent_reply_row(ctx, own, (area, s), i as usize, s)?
                            } {
                                Some(row) => *slot = row,
                                None => break,
                            }
                            lent += 1;
                        }
                        if lent == n as usize {
                            work.acc.resize(hidden, 0.0);
                            dtype.sum_rows(&rows[..lent], &mut work.acc, out);
                            continue;
                        }
                    }
                    let Work { row, acc, .. } = &mut *work;
                    acc.resize(hidden, 0.0);
                    for (k, &i) in self.rows[first..first + n as usize].iter().enumerate() {
                        // SAFETY: as above.
                        unsafe {
                            let at = (area, s);
                            self.with_reply_row(
                                ctx,
                                own,
                                at,
                                i as usize,
                                payload,
                                row,
                                |row| match (k, int8) {
                                    (0, false) => dtype.to_f32(row, acc),
                                    (0, true) => dequantize(row, hidden, acc),
                                    (_, false) => dtype.accumulate(row, 1.0, acc),
                                    (_, true) => dequantize_add(row, hidden, acc),
                                },
                            )?;
                        }
                    }
                    if !int8 {
                        dtype.from_f32(acc, out);
                        continue;
                    }
                    let acc: &[u8] = bytemuck::cast_slice(&work.acc[..]);
                    let amax = work.quant.amax(DType::F32, acc).map_err(|i| {
                        Error::invalid(format!(
                            "the relayed INT8 E2A sum for attention rank {member} token {t} is \
                             not finite at element {i}: INT8 needs finite rows"
                        ))
                    })?;
                    work.quant
                        .quantize_amax(DType::F32, acc, amax, &mut out[..payload]);
                    out[payload..].fill(0);
                }
            }
        }
        Ok(())
    }
}

/// One A2E call a relay is forwarding: what its looks have seen so far.
#[derive(Debug)]
struct Forwarding {
    call: RelayCall,
    started: Instant,
    /// Each member's record, once read.
    recs: Vec<Option<Record>>,
    /// Members whose rows are all in (or that are outside the call's DP domain).
    done: Vec<bool>,
    missing: usize,
    /// Members whose route table is not read yet; the headers go out once none is left, and
    /// then each chunk's rows as they are checked (and forwarded), so expert ranks read while
    /// the members write.
    unread: usize,
    /// Per expert index, the rows it was last told it may read.
    told: Vec<Option<usize>>,
    /// Per member, its rows checked (and forwarded) so far.
    forwarded: Vec<usize>,
    next_check: CheckDue,
    /// Scratch of a route table read and of the header entries written.
    bytes: Vec<u8>,
}

impl Forwarding {
    /// One look at every member; `None` once every member's rows are in.
    fn pass(&mut self, ctx: &Context, scratch: &mut Vec<u8>) -> Result<Option<Waiting>> {
        let plan = ctx.topo.relay_plan().expect("relayed");
        let k = plan.relay_index(ctx.rank).expect("a relay");
        let members = plan.members(k);
        let l = &ctx.layout;
        let epoch = self.call.epoch;
        let buf = l.buffer(epoch);
        let attention = ctx.attention();
        let g = members.len();
        let mut waiting = None;
        for (m, &ai) in members.iter().enumerate() {
            if self.done[m] {
                continue;
            }
            let a = attention[ai];
            let p = Progress::of(ctx.slot_value(ctx.slots.a2e_ready(a)), epoch);
            if p == Progress::NotYet {
                waiting.get_or_insert(Waiting::on(a, "relayed A2E record"));
                continue;
            }
            if self.recs[m].is_none() {
                let rec = ctx.read_record(l.record(ai, buf))?;
                let mode = rec.validate(a, epoch, l.attention_rows, 1)?;
                if mode != WireMode::Push {
                    return Err(Error::Protocol {
                        peer: a,
                        detail: format!("A2E of epoch {epoch} to its relay is not a push"),
                    });
                }
                ctx.note_rows_received(a, rec.count as usize);
                let mc = &mut self.call.members[m];
                begin_member(ctx, epoch, (m, ai), &rec, mc, &mut self.bytes)?;
                self.recs[m] = Some(rec);
                self.unread -= 1;
            }
            let count = self.recs[m].expect("set above").count as usize;
            // Forward whatever arrived since the last look (per chunk, as it streams in).
            let ready = p.rows(count);
            if ready > self.forwarded[m] {
                let rows = self.forwarded[m]..ready;
                let (mc, readers) = (&mut self.call.members[m], &self.call.readers);
                forward_rows(ctx, epoch, (m, ai), mc, rows, readers, scratch)?;
                self.forwarded[m] = ready;
            }
            if ready < count {
                waiting.get_or_insert(Waiting::on(a, "relayed A2E rows"));
                continue;
            }
            self.done[m] = true;
            self.missing -= 1;
        }
        if self.unread == 0 {
            if self.told.iter().all(Option::is_none) {
                let (members, readers) = (&self.call.members, &self.call.readers);
                write_headers(ctx, k, epoch, (members, readers), &mut self.bytes)?;
            }
            let (members, told) = (&self.call.members, &mut self.told);
            signal_progress(ctx, epoch, members, &self.forwarded, told)?;
        }
        if self.missing == 0 {
            return Ok(None);
        }
        // Records and rows seen so far (`Waiting::progress`).
        let parts = self.forwarded.iter().sum::<usize>() + self.recs.iter().flatten().count();
        let waiting = waiting.map(|w| w.at(parts as u64));
        let (done, recs) = (&self.done, &self.recs);
        let awaited = (0..g).filter(|&m| !done[m]).map(|m| attention[members[m]]);
        let still = |a: usize| {
            let v = ctx.slot_value(ctx.slots.a2e_ready(a));
            let i = attention.iter().position(|&x| x == a).expect("member");
            let m = members.iter().position(|&x| x == i).expect("member");
            let count = recs[m].map_or(usize::MAX, |r| r.count as usize);
            Progress::of(v, epoch).rows(count) < count
        };
        ctx.check_awaited_again(awaited, &mut self.next_check, &still)?;
        // Unreachable with members left: a member not done was waited for above.
        Ok(Some(
            waiting.unwrap_or_else(|| Waiting::on(ctx.rank, "relayed A2E")),
        ))
    }
}

/// Writes relay `k`'s header of call `epoch` into every expert rank's window: a record (rows
/// for that rank, the hash of the entries) and one `(count, offset, flags)` entry per member of
/// `members` (route tables read); rotated by `k` to spread incast. Each rank learns of it from the
/// first progress signal [`signal_progress`] sends. `readers` read their rows in place;
/// `entries` is scratch.
fn write_headers(
    ctx: &Context,
    k: usize,
    epoch: u64,
    (members, readers): (&[MemberCall], &[usize]),
    entries: &mut Vec<u8>,
) -> Result<()> {
    let l = &ctx.layout;
    let experts = ctx.experts();
    let n = experts.len();
    entries.clear();
    entries.resize(members.len() * RELAY_ENTRY, 0);
    for step in 0..n {
        let j = (k + step) % n;
        let d = experts[j];
        let in_place = readers.contains(&d);
        let mut total = 0u32;
        for (mc, e) in members.iter().zip(entries.chunks_exact_mut(RELAY_ENTRY)) {
            let flags =
                if mc.int8 { ENTRY_INT8 } else { 0 } | if in_place { ENTRY_IN_PLACE } else { 0 };
            let words = [mc.counts[j], mc.offsets[j], flags, 0];
            total += mc.counts[j];
            for (w, v) in e.chunks_exact_mut(4).zip(words) {
                w.copy_from_slice(&v.to_le_bytes());
            }
            e[16..24].copy_from_slice(&mc.tag.to_le_bytes());
        }
        let at = l.relay_header(k, l.buffer(epoch));
        let rec = Record::new(epoch, total, entries_hash(entries), WireMode::Push);
        ctx.put(d, at + 32, entries)?;
        ctx.put_record(d, at, &rec)?;
        fault_point!("relay.header");
    }
    Ok(())
}

/// Signals every expert rank the rows of call `epoch` it may read now, when more than it was
/// told (`told`, per expert index): the members' rows for it in member order, up to the first
/// member whose rows for it are not all in (`checked`: rows of each member checked, and
/// forwarded where they are forwarded).
fn signal_progress(
    ctx: &Context,
    epoch: u64,
    members: &[MemberCall],
    checked: &[usize],
    told: &mut [Option<usize>],
) -> Result<()> {
    for (j, &d) in ctx.experts().iter().enumerate() {
        let mut ready = 0;
        for (mc, &have) in members.iter().zip(checked) {
            let (at, count) = (mc.offsets[j] as usize, mc.counts[j] as usize);
            let rows = have.saturating_sub(at).min(count);
            ready += rows;
            if rows < count {
                break;
            }
        }
        if told[j] != Some(ready) {
            ctx.signal(d, ctx.slots.a2e_ready(ctx.rank), progress(epoch, ready))?;
            told[j] = Some(ready);
        }
    }
    Ok(())
}

/// Credits E2A call `epoch` to every expert rank: their replies' buffers here may be written
/// again.
fn credit_experts(ctx: &Context, epoch: u64) -> Result<()> {
    for &d in ctx.experts() {
        ctx.signal(d, ctx.slots.e2a_credit(ctx.rank), epoch)?;
    }
    Ok(())
}

/// Credits call `epoch` to the relay's `members` (attention indices): their A2E buffers of it
/// on this rank may be written again.
fn credit_members(ctx: &Context, members: &[usize], epoch: u64) -> Result<()> {
    for &ai in members {
        ctx.signal(ctx.attention()[ai], ctx.slots.a2e_credit(ctx.rank), epoch)?;
    }
    Ok(())
}

/// Reads and checks member `m`'s (attention index `ai`) route table for call `epoch` against
/// its record, noting its token count and rows per expert rank in `mc` (`table`: scratch).
fn begin_member(
    ctx: &Context,
    epoch: u64,
    (m, ai): (usize, usize),
    rec: &Record,
    mc: &mut MemberCall,
    table: &mut Vec<u8>,
) -> Result<()> {
    let l = &ctx.layout;
    let buf = l.buffer(epoch);
    let experts = ctx.experts();
    let n = experts.len();
    let a = ctx.attention()[ai];
    let bad = |detail: String| Err(Error::Protocol { peer: a, detail });
    table.clear();
    table.resize(4 * (n + 1), 0);
    ctx.get(ctx.rank, l.relay_table(m, buf), table)?;
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
    mc.offsets.resize(n, 0);
    mc.tokens.clear();
    for (j, &d) in experts.iter().enumerate() {
        let c = word(j + 1);
        if c as usize > t_count || c as usize > l.recv_rows {
            return bad(format!(
                "route table of epoch {epoch} sends {c} rows to rank {d}, it has {t_count} \
                 tokens and rank {d} receives at most {} rows per source",
                l.recv_rows
            ));
        }
        mc.counts.push(c);
    }
    // The rows come in the wire order: each destination's offset in the member's area.
    let mut sum = 0usize;
    for j in wire_order(ctx, ctx.rank) {
        mc.offsets[j] = sum as u32;
        sum += mc.counts[j] as usize;
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
/// the row's place in it, unless the destination is one of `readers` (it reads them here).
fn forward_rows(
    ctx: &Context,
    epoch: u64,
    (m, ai): (usize, usize),
    mc: &mut MemberCall,
    rows: std::ops::Range<usize>,
    readers: &[usize],
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let l = &ctx.layout;
    let buf = l.buffer(epoch);
    let experts = ctx.experts();
    let a = ctx.attention()[ai];
    let stride = l.a2e.stride_for(mc.int8);
    let meta = l.a2e.meta_offset_for(mc.int8);
    let (src, len) = (
        l.relay_a2e(m, buf) + rows.start * stride,
        rows.len() * stride,
    );
    // On the cuda fabric the rows stay on the device: only their tokens come to the host
    // (each where its row's metadata would be in `scratch`), and each destination's part is
    // one device copy between the windows.
    let mut dev = match ctx.fabric.as_cuda() {
        Some(_) => Some(ctx.device_rows()?),
        None => None,
    };
    // Where row `i`'s token is in `chunk`: its metadata in a full row, or packed (4 bytes a
    // row) where only the tokens came from the device.
    let packed = dev.is_some();
    let token_at = |i: usize| if packed { i * 4 } else { i * stride + meta };
    let chunk = match dev.as_deref_mut() {
        Some(dev) => {
            scratch.resize(rows.len() * 4, 0);
            let mut runs = std::mem::take(&mut dev.runs);
            runs.clear();
            for i in 0..rows.len() {
                let at = src + i * stride + meta;
                let (dst, len) = ((i * 4) as u64, 4);
                match dev.window(ctx.rank, at, 4) {
                    Ok(src) => runs.push(CopyRun { src, dst, len }),
                    Err(e) => {
                        dev.runs = runs;
                        return Err(e);
                    }
                }
            }
            // SAFETY: the sources lie in this rank's window (range-checked), below the
            // member's progress signal; the member writes them again only after this relay's
            // credit, sent once they are forwarded.
            let gathered = unsafe { dev.plane.gather(&runs, scratch, ctx.call_deadline()) };
            dev.runs = runs;
            gathered?;
            &scratch[..]
        }
        // SAFETY: the rows are below the member's progress signal, and the member writes this
        // buffer again only after this relay's A2E credit for the call, sent once it is
        // forwarded.
        None => match unsafe { super::regions::landed(ctx, ctx.rank, src, len)? } {
            Some(bytes) => bytes,
            None => {
                scratch.resize(len, 0);
                ctx.get(ctx.rank, src, scratch)?;
                &scratch[..]
            }
        },
    };
    let t_count = mc.num_tokens as u32;
    // In the wire order, so the tokens are noted in the order of the rows.
    for j in wire_order(ctx, ctx.rank) {
        let d = experts[j];
        let (start, c) = (mc.offsets[j] as usize, mc.counts[j] as usize);
        // This destination's rows within the chunk.
        let (lo, hi) = (start.max(rows.start), (start + c).min(rows.end));
        if lo >= hi {
            continue;
        }
        for i in lo..hi {
            let at = token_at(i - rows.start);
            let t = u32::from_le_bytes(chunk[at..at + 4].try_into().expect("4"));
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
        if readers.contains(&d) {
            continue;
        }
        let (from, bytes) = ((lo - rows.start) * stride, (hi - lo) * stride);
        let to = l.a2e_recv(ai, buf) + (lo - start) * stride;
        match dev.as_deref_mut() {
            Some(dev) => {
                let run = CopyRun {
                    src: dev.window(ctx.rank, src + from, bytes)?,
                    dst: dev.window(d, to, bytes)?,
                    len: bytes as u64,
                };
                ctx.note_written(d, bytes);
                // SAFETY: the source rows lie in this rank's window (see the gather above),
                // the destination in `d`'s receive area for this member (range-checked),
                // reserved for this call by `d`'s credit.
                unsafe { dev.plane.copy_runs(&[run])? };
            }
            None => ctx.put(d, to, &chunk[from..from + bytes])?,
        }
        fault_point!("relay.forward");
        ctx.stats.borrow_mut().relay_rows_forwarded += (hi - lo) as u64;
    }
    match dev.as_deref_mut() {
        // Forwarded before the caller signals the destinations.
        Some(dev) => dev.plane.complete(ctx.call_deadline()),
        None => Ok(()),
    }
}
