//! `--stats`: what each rank's communicator counted (records written and polled, rows, bytes and
//! time waited per peer, relay forwards), over the whole run and per sweep point and direction,
//! gathered on rank 0 and reported as text and JSON beside the formulas they should match: the
//! records per A2E and E2A, the attention side's fan-out, window bytes per rank and the routing
//! metadata bytes per token against the naive encoding.

use std::fmt::Write as _;
use std::time::Duration;

use serde_json::{json, Value};
use xccl::moe::rows::{A2eRow, A2E_META_FIXED};
use xccl::{Communicator, PeerStats, Role, Stats, Topology};

use crate::cli::{Args, FabricKind};

/// One rank's counters and window size, as rank 0 receives them.
#[derive(Clone, Debug, Default)]
pub struct RankStats {
    /// Bytes of the rank's window.
    pub window_bytes: u64,
    /// What it counted over the whole run.
    pub stats: Stats,
    /// Per sweep point, `[A2E, E2A]` counts of its timed iterations
    /// ([`crate::run::RankReport::phases`]).
    pub phases: Vec<[Stats; 2]>,
}

/// Adds `s` to `acc` (the library's own sum is crate-private).
pub fn accumulate(acc: &mut Stats, s: &Stats) {
    acc.calls += s.calls;
    acc.records_written += s.records_written;
    acc.records_polled += s.records_polled;
    acc.relay_rows_forwarded += s.relay_rows_forwarded;
    acc.relay_forward += s.relay_forward;
    acc.relay_combine += s.relay_combine;
    acc.relay_reduce += s.relay_reduce;
    if acc.peers.len() < s.peers.len() {
        acc.peers.resize(s.peers.len(), PeerStats::default());
    }
    for (a, b) in acc.peers.iter_mut().zip(&s.peers) {
        a.records += b.records;
        a.rows_sent += b.rows_sent;
        a.rows_received += b.rows_received;
        a.bytes_put += b.bytes_put;
        a.bytes_got += b.bytes_got;
        a.waited += b.waited;
    }
}

fn push_stats(w: &mut Vec<u64>, s: &Stats) {
    w.extend([
        s.calls,
        s.records_written,
        s.records_polled,
        s.relay_rows_forwarded,
        s.relay_forward.as_nanos() as u64,
        s.relay_combine.as_nanos() as u64,
        s.relay_reduce.as_nanos() as u64,
        s.peers.len() as u64,
    ]);
    for p in &s.peers {
        w.extend([
            p.records,
            p.rows_sent,
            p.rows_received,
            p.bytes_put,
            p.bytes_got,
            p.waited.as_nanos() as u64,
        ]);
    }
}

/// Serialises `comm`'s totals and the per-point `phases` for the bootstrap allgather.
pub fn encode(comm: &Communicator, phases: &[[Stats; 2]]) -> Vec<u8> {
    let mut w = vec![comm.window_bytes() as u64, phases.len() as u64];
    push_stats(&mut w, comm.total_stats());
    for p in phases.iter().flatten() {
        push_stats(&mut w, p);
    }
    w.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Reads words one after the other.
struct Words {
    w: Vec<u64>,
    at: usize,
}

impl Words {
    fn next(&mut self) -> Result<u64, String> {
        let v = self.w.get(self.at).copied().ok_or("truncated stats")?;
        self.at += 1;
        Ok(v)
    }

    fn stats(&mut self) -> Result<Stats, String> {
        let mut s = Stats {
            calls: self.next()?,
            records_written: self.next()?,
            records_polled: self.next()?,
            relay_rows_forwarded: self.next()?,
            relay_forward: Duration::from_nanos(self.next()?),
            relay_combine: Duration::from_nanos(self.next()?),
            relay_reduce: Duration::from_nanos(self.next()?),
            peers: Vec::new(),
            ..Stats::default()
        };
        let n = self.next()? as usize;
        for _ in 0..n {
            s.peers.push(PeerStats {
                records: self.next()?,
                rows_sent: self.next()?,
                rows_received: self.next()?,
                bytes_put: self.next()?,
                bytes_got: self.next()?,
                waited: Duration::from_nanos(self.next()?),
            });
        }
        Ok(s)
    }
}

/// Inverse of [`encode`].
pub fn decode(blob: &[u8]) -> Result<RankStats, String> {
    let w = blob
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    let mut r = Words { w, at: 0 };
    let window_bytes = r.next()?;
    let points = r.next()? as usize;
    let stats = r.stats()?;
    let mut phases = Vec::with_capacity(points);
    for _ in 0..points {
        phases.push([r.stats()?, r.stats()?]);
    }
    Ok(RankStats {
        window_bytes,
        stats,
        phases,
    })
}

/// Peers (other than `me`) this rank wrote anything into.
fn fan_out(s: &Stats, me: usize) -> usize {
    s.peers
        .iter()
        .enumerate()
        .filter(|&(p, x)| p != me && x.bytes_put > 0)
        .count()
}

/// The report: per rank, records, forwards, window bytes, fan-out and the slowest peer; then
/// rank 0's per-peer table. `rounds` A2E+E2A round trips ran (warmup and checks included),
/// `formula` is the records one A2E writes by formula (E2A writes as many).
pub fn table(ranks: &[RankStats], rounds: u64, formula: usize) -> String {
    let mut out = String::new();
    let written: u64 = ranks.iter().map(|r| r.stats.records_written).sum();
    let polled: u64 = ranks.iter().map(|r| r.stats.records_polled).sum();
    let _ = writeln!(
        out,
        "# stats: {written} records written, {polled} polled over {rounds} round trips: {:.1} per \
         A2E+E2A (formula 2 x {formula} = {})",
        written as f64 / rounds.max(1) as f64,
        2 * formula
    );
    let _ = writeln!(
        out,
        "# {:>5} {:>9} {:>9} {:>9} {:>12} {:>7} {:>12} {:>12}",
        "rank", "written", "polled", "forwards", "window_B", "fan_out", "slowest", "waited_us"
    );
    for (r, s) in ranks.iter().enumerate() {
        let (slow, waited) = s.stats.slowest_peer().unwrap_or((r, Duration::ZERO));
        let straggler = match s.stats.straggler() {
            Some(p) => format!(" straggler: rank {p}"),
            None => String::new(),
        };
        let _ = writeln!(
            out,
            "# {r:>5} {:>9} {:>9} {:>9} {:>12} {:>7} {:>12} {:>12.1}{straggler}",
            s.stats.records_written,
            s.stats.records_polled,
            s.stats.relay_rows_forwarded,
            s.window_bytes,
            fan_out(&s.stats, r),
            format!("rank {slow}"),
            waited.as_secs_f64() * 1e6
        );
    }
    if let Some(r0) = ranks.first() {
        let _ = writeln!(
            out,
            "# rank 0 per peer: {:>5} {:>10} {:>10} {:>12} {:>12} {:>11}",
            "peer", "rows_sent", "rows_recv", "bytes_put", "bytes_got", "waited_us"
        );
        for (p, x) in r0.stats.peers.iter().enumerate() {
            if *x == PeerStats::default() {
                continue;
            }
            let _ = writeln!(
                out,
                "#                   {p:>5} {:>10} {:>10} {:>12} {:>12} {:>11.1}",
                x.rows_sent,
                x.rows_received,
                x.bytes_put,
                x.bytes_got,
                x.waited.as_secs_f64() * 1e6
            );
        }
    }
    out
}

/// Per relay and sweep point, the relay's own time per timed call: forwarding the A2E rows
/// (waits for its members' rows included), the whole E2A reduction (waits for the expert ranks'
/// replies included) and the part of it spent reducing and writing rows.
pub fn relay_phases(args: &Args, topo: &Topology, ranks: &[RankStats]) -> String {
    let mut out = String::new();
    let Some(plan) = topo.relay_plan() else {
        return out;
    };
    let points: Vec<(&str, usize)> = (args.quants().into_iter())
        .flat_map(|q| args.tokens.iter().map(move |&t| (q.name(), t)))
        .collect();
    let _ = writeln!(
        out,
        "# relay phases per call: {:>5} {:>5} {:>7} {:>11} {:>11} {:>10}",
        "relay", "quant", "tokens", "forward_us", "combine_us", "reduce_us"
    );
    for &r in plan.relays() {
        let Some(rs) = ranks.get(r) else { continue };
        for (ph, (quant, tokens)) in rs.phases.iter().zip(&points) {
            let per =
                |d: std::time::Duration, calls: u64| d.as_secs_f64() * 1e6 / calls.max(1) as f64;
            let _ = writeln!(
                out,
                "#                       {r:>5} {quant:>5} {tokens:>7} {:>11.1} {:>11.1} {:>10.1}",
                per(ph[0].relay_forward, ph[0].calls),
                per(ph[1].relay_combine, ph[1].calls),
                per(ph[1].relay_reduce, ph[1].calls),
            );
        }
    }
    out
}

/// The straggler of the job: the peer named by the rank whose slowest wait was the longest
/// (`(waiting rank, straggler)`), if that rank has one ([`Stats::straggler`]).
pub fn job_straggler(ranks: &[RankStats]) -> Option<(usize, usize)> {
    ranks
        .iter()
        .enumerate()
        .filter_map(|(r, s)| Some((r, s.stats.straggler()?, s.stats.slowest_peer()?.1)))
        .max_by_key(|&(_, _, w)| w)
        .map(|(r, p, _)| (r, p))
}

/// The sizes of one sweep point, counted from its timed iterations, with their formulas.
#[derive(Clone, Debug, PartialEq)]
pub struct Sizes {
    /// Wire format of the point (`none` or `int8`).
    pub quant: &'static str,
    /// Tokens per attention rank.
    pub tokens: usize,
    /// A2E calls counted (iterations, warmup included).
    pub calls: u64,
    /// Records written per A2E in the whole job, counted.
    pub a2e_records: f64,
    /// Records written per E2A in the whole job, counted.
    pub e2a_records: f64,
    /// Records per call by formula (`Communicator::a2e_records_per_call`).
    pub records_formula: usize,
    /// Most peers one attention rank wrote into during A2E, counted.
    pub fan_out: usize,
    /// Fan-out by formula: 1 through relays, N direct (a record to every expert rank).
    pub fan_out_formula: usize,
    /// Routing metadata bytes per token an attention rank sent (everything it put in A2E but
    /// the payloads: row metadata and padding, records, route tables), counted.
    pub metadata_per_token: f64,
    /// The same by formula: rows per token x metadata per row (the row stride minus the
    /// payload when rows are staged, the bare metadata when a relay's member writes them in
    /// place) + (records x 32 bytes + the route table through relays, 4 x (1 + N)) per call /
    /// tokens.
    pub metadata_formula: f64,
    /// The naive encoding: K x (expert id + weight + source index), 4 bytes each.
    pub metadata_naive: usize,
}

/// The sizes of every sweep point from every rank's per-point counts.
pub fn sizes(args: &Args, topo: &Topology, ranks: &[RankStats], formula: usize) -> Vec<Sizes> {
    let cfg = crate::run::moe_config(args);
    let row = A2eRow::new(&cfg, topo);
    let n = topo.expert_ranks().len();
    let points = args
        .quants()
        .into_iter()
        .flat_map(|q| args.tokens.iter().map(move |&t| (q, t)));
    let mut out = Vec::new();
    for (p, (quant, tokens)) in points.enumerate() {
        let int8 = quant == xccl::Quant::Int8;
        let phase = |r: &RankStats, d: usize| r.phases.get(p).map(|ph| ph[d].clone());
        let sum = |d: usize, f: &dyn Fn(&Stats) -> u64| -> u64 {
            ranks
                .iter()
                .filter_map(|r| phase(r, d))
                .map(|s| f(&s))
                .sum()
        };
        let calls = args.rounds() as u64;
        let mut fan = 0;
        let (mut sent_bytes, mut sent_rows, mut sends, mut att_records) = (0u64, 0u64, 0u64, 0u64);
        for &a in topo.attention_ranks() {
            let Some(s) = ranks.get(a).and_then(|r| phase(r, 0)) else {
                continue;
            };
            fan = fan.max(fan_out(&s, a));
            sent_bytes += s.peers.iter().map(|x| x.bytes_put).sum::<u64>();
            sent_rows += s.peers.iter().map(|x| x.rows_sent).sum::<u64>();
            sends += s.calls;
            att_records += s.records_written;
        }
        let tokens_sent = (sends * tokens as u64).max(1) as f64;
        let payload = row.payload_for(int8) as u64;
        // Through relays an attention rank also puts its route table: its token count and a
        // row count per expert rank, u32 each.
        let table = match topo.relay_plan() {
            Some(_) => 4 * (1 + n),
            None => 0,
        };
        let record = std::mem::size_of::<xccl::moe::record::Record>() as f64;
        // Per row beyond the payload: the direct path stages whole rows (stride - payload);
        // through a relay on a load/store fabric rows go straight in, payload then metadata
        // (source index and count, the local-expert mask, K weights).
        let meta = A2E_META_FIXED + 8 * topo.mask_words() + 4 * args.topk;
        let load_store = !matches!(
            args.fabric,
            FabricKind::Ofi | FabricKind::Ascend | FabricKind::Cuda
        );
        let per_row = if topo.relay_plan().is_some() && load_store {
            meta as u64
        } else {
            row.stride_for(int8) as u64 - payload
        };
        let per_call = att_records as f64 / sends.max(1) as f64;
        out.push(Sizes {
            quant: quant.name(),
            tokens,
            calls,
            a2e_records: sum(0, &|s| s.records_written) as f64 / calls as f64,
            e2a_records: sum(1, &|s| s.records_written) as f64 / calls as f64,
            records_formula: formula,
            fan_out: fan,
            fan_out_formula: if topo.relay_plan().is_some() { 1 } else { n },
            metadata_per_token: sent_bytes.saturating_sub(sent_rows * payload) as f64 / tokens_sent,
            metadata_formula: (sent_rows as f64 * per_row as f64
                + sends as f64 * (per_call * record + table as f64))
                / tokens_sent,
            metadata_naive: args.topk * 12,
        });
    }
    out
}

/// The sizes as text lines under the stats table.
pub fn sizes_table(sizes: &[Sizes], windows: &Windows) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# window bytes per rank: attention {}, expert {}{}",
        windows.attention,
        windows.expert,
        windows
            .relay
            .map_or(String::new(), |r| format!(", relay {r}"))
    );
    let _ = writeln!(
        out,
        "# {:>5} {:>7} {:>12} {:>12} {:>8} {:>12} {:>13} {:>13} {:>9}",
        "quant",
        "tokens",
        "a2e_records",
        "e2a_records",
        "formula",
        "fan_out(f)",
        "md_B/token",
        "md_formula",
        "md_naive"
    );
    for s in sizes {
        let _ = writeln!(
            out,
            "# {:>5} {:>7} {:>12.1} {:>12.1} {:>8} {:>12} {:>13.1} {:>13.1} {:>9}",
            s.quant,
            s.tokens,
            s.a2e_records,
            s.e2a_records,
            s.records_formula,
            format!("{} ({})", s.fan_out, s.fan_out_formula),
            s.metadata_per_token,
            s.metadata_formula,
            s.metadata_naive
        );
    }
    out
}

/// Window bytes by role, from what the ranks registered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Windows {
    /// Largest attention rank window.
    pub attention: u64,
    /// Largest window of an expert rank that is not a relay (of a relay when all are).
    pub expert: u64,
    /// Largest relay window, with relays.
    pub relay: Option<u64>,
}

impl Windows {
    /// The windows of `ranks` by role in `topo`.
    pub fn of(topo: &Topology, ranks: &[RankStats]) -> Self {
        let plan = topo.relay_plan();
        let is_relay = |r: usize| plan.is_some_and(|p| p.relay_index(r).is_some());
        let max = |f: &dyn Fn(usize) -> bool| {
            ranks
                .iter()
                .enumerate()
                .filter(|&(r, _)| f(r))
                .map(|(_, s)| s.window_bytes)
                .max()
        };
        let relay = max(&|r| is_relay(r));
        Windows {
            attention: max(&|r| topo.role(r) == Role::Attention).unwrap_or(0),
            expert: max(&|r| topo.role(r) == Role::Expert && !is_relay(r))
                .or(relay)
                .unwrap_or(0),
            relay,
        }
    }
}

fn peer_json(p: usize, x: &PeerStats) -> Value {
    json!({
        "peer": p,
        "records": x.records,
        "rows_sent": x.rows_sent,
        "rows_received": x.rows_received,
        "bytes_put": x.bytes_put,
        "bytes_got": x.bytes_got,
        "waited_us": x.waited.as_secs_f64() * 1e6,
    })
}

/// One rank's counts as JSON: totals and its non-zero peers.
fn stats_json(s: &Stats) -> Value {
    json!({
        "calls": s.calls,
        "records_written": s.records_written,
        "records_polled": s.records_polled,
        "relay_rows_forwarded": s.relay_rows_forwarded,
        "relay_forward_us": s.relay_forward.as_secs_f64() * 1e6,
        "relay_combine_us": s.relay_combine.as_secs_f64() * 1e6,
        "relay_reduce_us": s.relay_reduce.as_secs_f64() * 1e6,
        "peers": s.peers.iter().enumerate()
            .filter(|(_, x)| **x != PeerStats::default())
            .map(|(p, x)| peer_json(p, x))
            .collect::<Vec<_>>(),
    })
}

/// The `stats` object of the JSON report: every rank's totals and per-point counts by direction
/// (what `xccl-bench model --calibrate` reads), the straggler, the window bytes and the sizes.
pub fn to_json(topo: &Topology, ranks: &[RankStats], sizes: &[Sizes], windows: &Windows) -> Value {
    let plan = topo.relay_plan();
    let straggler = job_straggler(ranks);
    json!({
        "straggler": straggler.map(|(r, p)| json!({"rank": p, "named_by": r})),
        "windows": {
            "attention": windows.attention,
            "expert": windows.expert,
            "relay": windows.relay,
        },
        "ranks": ranks.iter().enumerate().map(|(r, s)| {
            let (slow, waited) = s.stats.slowest_peer().unwrap_or((r, Duration::ZERO));
            json!({
                "rank": r,
                "role": if topo.role(r) == Role::Attention { "attention" } else { "expert" },
                "relay": plan.is_some_and(|p| p.relay_index(r).is_some()),
                "window_bytes": s.window_bytes,
                "fan_out": fan_out(&s.stats, r),
                "slowest_peer": slow,
                "slowest_waited_us": waited.as_secs_f64() * 1e6,
                "straggler": s.stats.straggler(),
                "total": stats_json(&s.stats),
                "points": s.phases.iter().map(|[a, e]| json!({
                    "a2e": stats_json(a),
                    "e2a": stats_json(e),
                })).collect::<Vec<_>>(),
            })
        }).collect::<Vec<_>>(),
        "sizes": sizes.iter().map(|s| json!({
            "quant": s.quant,
            "tokens": s.tokens,
            "calls": s.calls,
            "a2e_records_per_call": s.a2e_records,
            "e2a_records_per_call": s.e2a_records,
            "records_per_call_formula": s.records_formula,
            "attention_fan_out": s.fan_out,
            "attention_fan_out_formula": s.fan_out_formula,
            "metadata_bytes_per_token": s.metadata_per_token,
            "metadata_bytes_per_token_formula": s.metadata_formula,
            "metadata_bytes_per_token_naive": s.metadata_naive,
        })).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Stats {
        let mut s = Stats {
            calls: 3,
            records_written: 7,
            records_polled: 5,
            relay_rows_forwarded: 11,
            peers: vec![PeerStats::default(); 2],
            ..Stats::default()
        };
        s.peers[1].waited = Duration::from_micros(250);
        s.peers[1].rows_sent = 4;
        s.peers[1].bytes_put = 4096;
        s
    }

    #[test]
    fn stats_round_trip_through_the_encoding() {
        let s = sample();
        let mut w = vec![4096u64, 1];
        for x in [&s, &s, &s] {
            push_stats(&mut w, x);
        }
        let blob: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let got = decode(&blob).unwrap();
        assert_eq!(got.stats, s);
        assert_eq!(got.phases, vec![[s.clone(), s.clone()]]);
        assert_eq!(got.window_bytes, 4096);
        assert!(table(&[got], 1, 3).contains("records written"));
        assert!(decode(&blob[..blob.len() - 8]).is_err(), "truncated blob");
    }

    #[test]
    fn accumulate_adds_every_counter_and_grows_the_peer_list() {
        let mut acc = Stats::default();
        accumulate(&mut acc, &sample());
        accumulate(&mut acc, &sample());
        assert_eq!(acc.calls, 6);
        assert_eq!(acc.records_written, 14);
        assert_eq!(acc.relay_rows_forwarded, 22);
        assert_eq!(acc.peers[1].rows_sent, 8);
        assert_eq!(acc.peers[1].waited, Duration::from_micros(500));
    }

    #[test]
    fn the_job_straggler_is_the_one_named_by_the_longest_wait() {
        let mut slow = Stats {
            peers: vec![PeerStats::default(); 4],
            ..Stats::default()
        };
        for p in 1..3 {
            slow.peers[p].waited = Duration::from_micros(300);
        }
        slow.peers[3].waited = Duration::from_millis(9);
        let calm = RankStats {
            stats: Stats {
                peers: vec![PeerStats::default(); 4],
                ..Stats::default()
            },
            ..RankStats::default()
        };
        let ranks = vec![
            calm.clone(),
            RankStats {
                stats: slow,
                ..RankStats::default()
            },
            calm,
        ];
        assert_eq!(job_straggler(&ranks), Some((1, 3)));
        assert_eq!(job_straggler(&ranks[..1]), None);
    }
}
