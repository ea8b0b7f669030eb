//! The traffic the routing of a run implies, link by link, and its check against what the
//! communicators counted (`--stats` on a fabric without load/store access, where every row is
//! staged whole and put: ofi).
//!
//! Per call, with `rows(a, d)` the tokens of attention rank `a` that go to expert rank `d` (one
//! row per (token, destination rank)), `T_a` its tokens, `s` the A2E row stride and `e` the E2A
//! row stride:
//! - direct: A2E `a -> d` one record and `rows(a, d)` rows (`32 + rows x s` bytes) for every
//!   expert rank, also those that get none; E2A `d -> a` one record and `32 + rows x e` bytes;
//! - through relays (relay `r` of `a`, `g` members): A2E `a -> r` the route table (`4 x (1 + N)`
//!   bytes), one record and every row; `r -> d` the members' rows for `d` and one header (a
//!   record and `24 x g` bytes of entries), the header only for `d = r` (the relay reads its
//!   own rows where they landed: `xccl::moe::relay`); E2A `d -> r` one record and the replies for the
//!   members' rows; `r -> a` one record and one reduced row per token. A relay's replies to its
//!   own members' rows (`r -> r`) announce their rows in the record but stay where its caller
//!   has them when they are token rows in the dtype (`--layout token`, no INT8): the record's
//!   bytes only.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use xccl::moe::window_layout::{WindowLayout, RELAY_ENTRY};
use xccl::{Quant, Topology};

use crate::cli::{Args, ExpertLayout};
use crate::stats::RankStats;

/// Records, rows and bytes one rank put into one peer's window.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Link {
    /// Metadata records.
    pub records: u64,
    /// Rows announced in them.
    pub rows: u64,
    /// Bytes put.
    pub bytes: u64,
}

impl Link {
    fn add(&mut self, records: u64, rows: u64, bytes: u64) {
        self.records += records;
        self.rows += rows;
        self.bytes += bytes;
    }
}

/// `[A2E, E2A]`, each `[from][to]`: the links of one sweep point's timed and warmup calls.
pub type Plan = [Vec<Vec<Link>>; 2];

const RECORD: u64 = 32;

/// The plan of sweep point `sweep` (`tokens` per attention rank, wire format `quant`) over its
/// `args.rounds()` calls, from the same workload the ranks ran.
pub fn plan(args: &Args, topo: &Topology, sweep: usize, quant: Quant, tokens: usize) -> Plan {
    let cfg = crate::run::moe_config(args);
    let layout = WindowLayout::new(topo, &cfg);
    let int8 = quant == Quant::Int8;
    let (s, e) = (
        layout.a2e.stride_for(int8) as u64,
        layout.e2a_stride_for(int8) as u64,
    );
    let world = topo.world_size();
    let experts = topo.expert_ranks();
    let n = experts.len();
    let mut out: Plan = [
        vec![vec![Link::default(); world]; world],
        vec![vec![Link::default(); world]; world],
    ];
    let wl = crate::run::workload(args, tokens);
    for it in 0..args.rounds() {
        let round = crate::run::round(sweep, it, 0, 1);
        // rows[a][j]: rows of attention index a for expert index j.
        let mut rows = vec![vec![0u64; n]; topo.attention_ranks().len()];
        let mut count = vec![0u64; topo.attention_ranks().len()];
        for (ai, &a) in topo.attention_ranks().iter().enumerate() {
            let inp = wl.input(topo, args.topk, a, round);
            count[ai] = inp.num_tokens as u64;
            for t in 0..inp.num_tokens {
                let dests: BTreeSet<usize> = inp.topk_idx[t * inp.k..(t + 1) * inp.k]
                    .iter()
                    .filter(|&&x| x >= 0)
                    .map(|&x| topo.route(a, x as usize).0)
                    .collect();
                for d in dests {
                    rows[ai][topo.expert_index(d).expect("expert rank")] += 1;
                }
            }
        }
        let [a2e, e2a] = &mut out;
        match topo.relay_plan() {
            None => {
                for (ai, &a) in topo.attention_ranks().iter().enumerate() {
                    for (j, &d) in experts.iter().enumerate() {
                        let r = rows[ai][j];
                        a2e[a][d].add(1, r, RECORD + r * s);
                        e2a[d][a].add(1, r, RECORD + r * e);
                    }
                }
            }
            Some(relays) => {
                for (k, &r) in relays.relays().iter().enumerate() {
                    let members = relays.members(k);
                    for &ai in members {
                        let a = topo.attention_ranks()[ai];
                        let total: u64 = rows[ai].iter().sum();
                        a2e[a][r].add(1, total, 4 * (1 + n as u64) + RECORD + total * s);
                        e2a[r][a].add(1, count[ai], RECORD + count[ai] * e);
                    }
                    for (j, &d) in experts.iter().enumerate() {
                        let via: u64 = members.iter().map(|&ai| rows[ai][j]).sum();
                        let header = RECORD + (RELAY_ENTRY * members.len()) as u64;
                        // Its own rows stay where they landed in its member areas.
                        let rows_bytes = if d == r { 0 } else { via * s };
                        a2e[r][d].add(1, via, header + rows_bytes);
                        let in_place = d == r && args.layout == ExpertLayout::Token && !int8;
                        e2a[d][r].add(1, via, RECORD + if in_place { 0 } else { via * e });
                    }
                }
            }
        }
    }
    out
}

/// Checks every link of every sweep point against its plan; returns the report lines (every
/// link that carries anything, counted beside planned) and whether all matched.
pub fn check(args: &Args, topo: &Topology, ranks: &[RankStats]) -> (String, bool) {
    let mut text = String::new();
    let mut ok = true;
    let points = (args.quants().into_iter())
        .flat_map(|q| args.tokens.iter().enumerate().map(move |(s, &t)| (s, q, t)));
    for (p, (sweep, quant, tokens)) in points.enumerate() {
        let want = plan(args, topo, sweep, quant, tokens);
        let _ = writeln!(
            text,
            "# links, {} T={tokens}, {} calls: {:>4} {:>4} {:>5} {:>8} {:>8} {:>10} {:>10}",
            quant.name(),
            args.rounds(),
            "from",
            "to",
            "dir",
            "records",
            "rows",
            "bytes",
            "planned"
        );
        let (mut links, mut bad) = (0, 0);
        for (d, dir) in ["a2e", "e2a"].iter().enumerate() {
            for (from, r) in ranks.iter().enumerate() {
                let got = r.phases.get(p).map(|ph| &ph[d]);
                for (to, w) in want[d][from].iter().enumerate() {
                    let g = got
                        .and_then(|s| s.peers.get(to))
                        .map_or(Link::default(), |x| Link {
                            records: x.records,
                            rows: x.rows_sent,
                            bytes: x.bytes_put,
                        });
                    if g == Link::default() && *w == Link::default() {
                        continue;
                    }
                    links += 1;
                    let mark = if g == *w {
                        ""
                    } else {
                        bad += 1;
                        " MISMATCH"
                    };
                    let _ = writeln!(
                        text,
                        "#                              {from:>4} {to:>4} {dir:>5} {:>8} {:>8} {:>10} \
                         {:>10}{mark}",
                        g.records,
                        g.rows,
                        g.bytes,
                        format!("{}/{}/{}", w.records, w.rows, w.bytes),
                    );
                }
            }
        }
        let _ = writeln!(
            text,
            "# links checked against the plan: {links} links, {} match{}",
            links - bad,
            if bad == 0 { " (all)" } else { "; MISMATCH" }
        );
        ok &= bad == 0;
    }
    (text, ok)
}
