//! The cost model of A2E and E2A: a call's time predicted from the protocol's own counters
//! (records written and polled, rows and bytes per link, relay hops) and four fabric
//! parameters (per-hop latency, link bandwidth, copy bandwidth, per-record cost), with the
//! calibration that fits the parameters to measured runs.
//!
//! **The model.** A call is one or two hops: direct, attention -> expert (A2E) or expert ->
//! attention (E2A); through relays, A2E attention -> relay -> expert and E2A expert -> relay ->
//! attention. In hop `h` rank `r` works
//!
//! ```text
//! work(r, h) = max(out(r, h), in(r, h)) / link + (in(r, h) + own(r, h)) / copy
//!              + records(r, h) x record
//! ```
//!
//! where `out` are the bytes it puts into other ranks' windows, `in` the bytes others put into
//! its window (its link carries both, one per direction; it then copies them out or reduces
//! them), `own` the bytes it puts into its own window (a local copy), and `records` the records it writes (charged to the last hop it sends in) and
//! polls (charged to the first hop it receives in). A hop takes `stage(h) = max_r work(r, h)`:
//! senders and receivers stream concurrently (chunks with a progress signal each). A2E hops
//! pipeline (a relay forwards as rows arrive), so A2E takes `hops x latency + max_h stage(h)`;
//! the relayed E2A does not (a relay reduces once every expert rank's replies are in), so it
//! takes `hops x latency + sum_h stage(h)`. When ranks share `cores` CPUs (shm on this machine)
//! the call takes at least `hops x latency + sum of all work / cores`.
//!
//! **Counts.** [`Counts`] is one call's traffic as the communicators counted it (`--stats`):
//! per rank its records and, per peer, the rows announced and the bytes put. Bytes at another
//! row size follow from the rows: [`Counts::rescaled`] adds `rows x (new stride - old stride)` to
//! every link, so a run at a small hidden size gives the traffic of the real one
//! ([`counted`] runs the protocol on the local fabric for that).

use serde_json::Value;
use xccl::moe::rows::A2eRow;
use xccl::testing::reference::random_routing;
use xccl::{Communicator, DType, MoeConfig, Quant, Role, Stats, TokenBatch, Topology};

/// Fabric parameters of the model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FabricParams {
    /// Latency of one hop: a put and its signal becoming visible to the receiver, microseconds.
    pub latency_us: f64,
    /// Bandwidth of one rank's puts into other ranks' windows, one direction, GB/s.
    pub link_gbps: f64,
    /// Bandwidth of a rank's copies of its own memory (out of its window, into its own window,
    /// reductions), GB/s.
    pub copy_gbps: f64,
    /// Cost of one record written or polled, microseconds.
    pub record_us: f64,
    /// CPUs the ranks share (`None`: every rank has its own engines).
    pub cores: Option<f64>,
}

impl FabricParams {
    /// The four fitted parameters in log space (latency, link, copy, record).
    fn logs(&self) -> [f64; 4] {
        [
            self.latency_us.ln(),
            self.link_gbps.ln(),
            self.copy_gbps.ln(),
            self.record_us.ln(),
        ]
    }

    fn with_logs(&self, v: [f64; 4]) -> Self {
        FabricParams {
            latency_us: v[0].exp(),
            link_gbps: v[1].exp(),
            copy_gbps: v[2].exp(),
            record_us: v[3].exp(),
            cores: self.cores,
        }
    }
}

/// Which exchange a call is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Dispatch: attention ranks to expert ranks.
    A2e,
    /// Combine: expert ranks to attention ranks.
    E2a,
}

impl Direction {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Direction::A2e => "a2e",
            Direction::E2a => "e2a",
        }
    }
}

/// What one rank put into one peer's window in one call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    /// The peer (global rank; this rank's own for local copies).
    pub to: usize,
    /// Rows announced to it.
    pub rows: f64,
    /// Bytes put into its window (rows, metadata, records).
    pub bytes: f64,
}

/// One rank's part of one call.
#[derive(Clone, Debug, PartialEq)]
pub struct RankCounts {
    /// Its role.
    pub role: Role,
    /// Whether it is a relay.
    pub relay: bool,
    /// Records it wrote.
    pub records_written: f64,
    /// Records it polled.
    pub records_polled: f64,
    /// What it put into each window.
    pub links: Vec<Link>,
}

/// One call's traffic, as counted.
#[derive(Clone, Debug, PartialEq)]
pub struct Counts {
    /// A2E or E2A.
    pub direction: Direction,
    /// Whether the call went through relays.
    pub relayed: bool,
    /// Every rank, in rank order.
    pub ranks: Vec<RankCounts>,
}

/// A predicted call time and its parts.
#[derive(Clone, Debug, PartialEq)]
pub struct Prediction {
    /// Hops of the call.
    pub hops: usize,
    /// Time of each hop's slowest rank, microseconds.
    pub stages_us: Vec<f64>,
    /// The shared-CPU bound (0 when ranks do not share CPUs), microseconds.
    pub cpu_us: f64,
    /// The predicted time, microseconds.
    pub total_us: f64,
}

impl Counts {
    /// Hops of the call: 2 through relays, else 1.
    pub fn hops(&self) -> usize {
        if self.relayed {
            2
        } else {
            1
        }
    }

    /// The hop (0 or 1) of a put from `from` to `to`.
    pub fn hop(&self, from: usize, to: usize) -> usize {
        if !self.relayed {
            return 0;
        }
        match self.direction {
            // Attention -> relay, then relay -> expert ranks (its own included).
            Direction::A2e => usize::from(self.ranks[from].role == Role::Expert),
            // Expert ranks -> relay, then relay -> attention.
            Direction::E2a => usize::from(self.ranks[to].role == Role::Attention),
        }
    }

    /// Records written, in the whole job.
    pub fn records(&self) -> f64 {
        self.ranks.iter().map(|r| r.records_written).sum()
    }

    /// The same call with every link's bytes changed by `rows x delta_per_row`: the traffic at
    /// another row size (`delta_per_row` = new row stride - old row stride, in bytes).
    pub fn rescaled(&self, delta_per_row: f64) -> Counts {
        let mut c = self.clone();
        for r in &mut c.ranks {
            for l in &mut r.links {
                l.bytes += l.rows * delta_per_row;
            }
        }
        c
    }

    /// Per rank and hop: (bytes out to others, bytes into its own window, bytes in from
    /// others, records).
    fn loads(&self) -> Vec<Vec<[f64; 4]>> {
        let hops = self.hops();
        let mut w = vec![vec![[0.0; 4]; hops]; self.ranks.len()];
        for (from, r) in self.ranks.iter().enumerate() {
            let mut last_out = None;
            for l in r.links.iter().filter(|l| l.bytes > 0.0) {
                let h = self.hop(from, l.to);
                last_out = last_out.max(Some(h));
                if l.to == from {
                    w[from][h][1] += l.bytes;
                } else {
                    w[from][h][0] += l.bytes;
                    w[l.to][h][2] += l.bytes;
                }
            }
            w[from][last_out.unwrap_or(0)][3] += r.records_written;
        }
        for (me, r) in self.ranks.iter().enumerate() {
            // Polled records go with the first hop this rank receives in.
            let first_in = (0..hops).find(|&h| w[me][h][2] + w[me][h][1] > 0.0);
            w[me][first_in.unwrap_or(0)][3] += r.records_polled;
        }
        w
    }
}

/// The model's prediction of one call.
pub fn predict(p: &FabricParams, c: &Counts) -> Prediction {
    let hops = c.hops();
    let mut stages = vec![0.0f64; hops];
    let mut all = 0.0;
    for rank in c.loads() {
        for (h, [out, own, inn, rec]) in rank.into_iter().enumerate() {
            // Bytes / (GB/s) = ns; / 1e3 = us. Its link carries what it sends and what it
            // receives (each direction at `link`); it copies what arrives and its own rows.
            let work = out.max(inn) / p.link_gbps / 1e3
                + (own + inn) / p.copy_gbps / 1e3
                + rec * p.record_us;
            stages[h] = stages[h].max(work);
            all += work;
        }
    }
    let lat = hops as f64 * p.latency_us;
    let pipelined = c.direction == Direction::A2e || hops == 1;
    let path = lat
        + if pipelined {
            stages.iter().copied().fold(0.0, f64::max)
        } else {
            stages.iter().sum()
        };
    let cpu = p.cores.map_or(0.0, |n| lat + all / n);
    Prediction {
        hops,
        stages_us: stages,
        cpu_us: cpu,
        total_us: path.max(cpu),
    }
}

/// One measured call: its counted traffic and its measured p50.
#[derive(Clone, Debug)]
pub struct Sample {
    /// Where it came from (`1A:2E r1 T=128 a2e`).
    pub label: String,
    /// The traffic.
    pub counts: Counts,
    /// Measured p50, microseconds.
    pub measured_us: f64,
}

/// Squared log error of `p` over `samples`.
fn loss(p: &FabricParams, samples: &[Sample]) -> f64 {
    samples
        .iter()
        .map(|s| {
            (predict(p, &s.counts).total_us / s.measured_us)
                .ln()
                .powi(2)
        })
        .sum()
}

/// Fits latency, link and copy bandwidth and record cost to `samples` (least squares of the log
/// error, `p.cores` kept, each within [`BOUNDS`]): Nelder-Mead in log space from `start`,
/// restarted from its best point until a restart gains nothing. Deterministic.
pub fn calibrate(start: &FabricParams, samples: &[Sample]) -> FabricParams {
    let f = |v: &[f64; 4]| loss(&start.with_logs(bounded(*v)), samples);
    let mut best = start.logs();
    for _ in 0..20 {
        let before = f(&best);
        best = nelder_mead(&f, best, 1.0, 2000);
        if before - f(&best) < 1e-12 {
            break;
        }
    }
    start.with_logs(bounded(best))
}

/// Bounds of the fitted parameters, in their units: latency and record cost 1 ns to 10 ms,
/// bandwidths 1 MB/s to 10 TB/s. Noisy samples cannot push a parameter to 0 or infinity.
const BOUNDS: [(f64, f64); 4] = [(1e-3, 1e4), (1e-3, 1e4), (1e-3, 1e4), (1e-3, 1e4)];

/// `v` (log parameters) clamped to [`BOUNDS`].
fn bounded(v: [f64; 4]) -> [f64; 4] {
    std::array::from_fn(|i| v[i].clamp(BOUNDS[i].0.ln(), BOUNDS[i].1.ln()))
}

/// Minimises `f` from `x0` with Nelder-Mead (reflection 1, expansion 2, contraction and
/// shrink 1/2), the first simplex `step` apart along each axis, at most `iters` steps.
fn nelder_mead(f: &dyn Fn(&[f64; 4]) -> f64, x0: [f64; 4], step: f64, iters: usize) -> [f64; 4] {
    let mut pts: Vec<([f64; 4], f64)> = (0..5)
        .map(|i| {
            let mut x = x0;
            if i > 0 {
                x[i - 1] += step;
            }
            (x, f(&x))
        })
        .collect();
    let along = |a: &[f64; 4], b: &[f64; 4], t: f64| -> [f64; 4] {
        std::array::from_fn(|k| a[k] + t * (b[k] - a[k]))
    };
    for _ in 0..iters {
        pts.sort_by(|a, b| a.1.total_cmp(&b.1));
        if pts[4].1 - pts[0].1 < 1e-14 {
            break;
        }
        let c: [f64; 4] =
            std::array::from_fn(|k| pts[..4].iter().map(|p| p.0[k]).sum::<f64>() / 4.0);
        let worst = pts[4].0;
        let r = along(&c, &worst, -1.0);
        let fr = f(&r);
        if fr < pts[0].1 {
            let e = along(&c, &worst, -2.0);
            let fe = f(&e);
            pts[4] = if fe < fr { (e, fe) } else { (r, fr) };
        } else if fr < pts[3].1 {
            pts[4] = (r, fr);
        } else {
            let k = along(&c, &worst, 0.5);
            let fk = f(&k);
            if fk < pts[4].1 {
                pts[4] = (k, fk);
            } else {
                let b = pts[0].0;
                for p in pts.iter_mut().skip(1) {
                    p.0 = along(&b, &p.0, 0.5);
                    p.1 = f(&p.0);
                }
            }
        }
    }
    pts.sort_by(|a, b| a.1.total_cmp(&b.1));
    pts[0].0
}

/// Reads the samples of one `xccl-bench --stats --json` report: per sweep point, the A2E and
/// the E2A with the traffic each rank counted (per call it took part in) and the measured p50.
/// Also returns the report's core count.
pub fn samples_from_report(doc: &Value) -> Result<(Vec<Sample>, f64), String> {
    let cfg = &doc["config"];
    let ranks = doc["stats"]["ranks"]
        .as_array()
        .ok_or("no stats.ranks: run xccl-bench with --stats --json")?;
    let quants: Vec<&str> = cfg["quant"]
        .as_array()
        .ok_or("no config.quant")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let tokens: Vec<u64> = cfg["tokens"]
        .as_array()
        .ok_or("no config.tokens")?
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    let relayed = !cfg["relays"].is_null();
    let shape = format!(
        "{}A:{}E{}",
        cfg["attention"],
        cfg["experts"],
        if relayed {
            format!(" r{}", cfg["relays"])
        } else {
            String::new()
        }
    );
    let cores = doc["machine"]["cores"].as_f64().unwrap_or(1.0);
    // Every row carries at least `hidden` bytes (an INT8 payload).
    let row_floor = cfg["hidden"].as_f64().unwrap_or(1.0);
    let mut out = Vec::new();
    let points = quants
        .iter()
        .flat_map(|q| tokens.iter().map(move |t| (*q, *t)));
    for (p, (quant, t)) in points.enumerate() {
        for direction in [Direction::A2e, Direction::E2a] {
            let mut counts = Counts {
                direction,
                relayed,
                ranks: Vec::new(),
            };
            for (rank, r) in ranks.iter().enumerate() {
                let ph = &r["points"][p][direction.name()];
                let calls = ph["calls"].as_f64().unwrap_or(0.0).max(1.0);
                let num = |v: &Value, k: &str| v[k].as_f64().unwrap_or(0.0);
                counts.ranks.push(RankCounts {
                    role: if r["role"] == "attention" {
                        Role::Attention
                    } else {
                        Role::Expert
                    },
                    relay: r["relay"].as_bool().unwrap_or(false),
                    records_written: num(ph, "records_written") / calls,
                    records_polled: num(ph, "records_polled") / calls,
                    links: ph["peers"]
                        .as_array()
                        .map(|peers| {
                            peers
                                .iter()
                                .map(|x| {
                                    let to = x["peer"].as_u64().unwrap_or(0) as usize;
                                    let rows = moved_rows(
                                        to == rank,
                                        num(x, "rows_sent"),
                                        num(x, "bytes_put"),
                                        row_floor,
                                    );
                                    Link {
                                        to,
                                        rows: rows / calls,
                                        bytes: num(x, "bytes_put") / calls,
                                    }
                                })
                                .collect()
                        })
                        .unwrap_or_default(),
                });
            }
            let measured = doc["results"]
                .as_array()
                .and_then(|rs| {
                    rs.iter().find(|r| {
                        r["op"] == direction.name() && r["quant"] == quant && r["tokens"] == t
                    })
                })
                .and_then(|r| r["p50_us"].as_f64())
                .ok_or_else(|| format!("no {} result for T={t}", direction.name()))?;
            out.push(Sample {
                label: format!("{shape} {quant} T={t} {}", direction.name()),
                counts,
                measured_us: measured,
            });
        }
    }
    Ok((out, cores))
}

/// The shape of a projection: the xDeepServe decode layout.
#[derive(Clone, Debug)]
pub struct Shape {
    /// Attention ranks M.
    pub attention: usize,
    /// Expert ranks N: `routed` with one routed expert each, the rest replicas of the shared
    /// expert.
    pub experts: usize,
    /// Routed experts.
    pub routed: usize,
    /// Routed experts per token (every token also goes to the shared expert).
    pub topk: usize,
    /// Tokens per attention rank.
    pub tokens: usize,
    /// Relays (`None`: direct).
    pub relays: Option<usize>,
}

impl Shape {
    /// The topology: expert `e < routed` on expert rank `e`, the shared expert (`routed`) on
    /// every other expert rank; attention rank `a` reaches shared replica `a mod replicas`.
    pub fn topology(&self) -> xccl::Result<Topology> {
        let (m, n) = (self.attention, self.experts);
        if self.routed >= n {
            return Err(xccl::Error::invalid(format!(
                "{} routed experts need more than {} expert ranks (the rest host the shared expert)",
                self.routed, n
            )));
        }
        let mut map: Vec<Vec<usize>> = (0..self.routed).map(|e| vec![m + e]).collect();
        map.push((m + self.routed..m + n).collect());
        let topo = xccl::TopologyBuilder::contiguous(m, n, self.routed + 1)
            .placement(map)
            .build()?;
        match self.relays {
            Some(r) => topo.with_relays(Some(r)),
            None => Ok(topo),
        }
    }

    /// The config of a run at hidden size `hidden`: the shared expert is one more slot.
    pub fn config(&self, hidden: usize) -> MoeConfig {
        let mut cfg = MoeConfig::new(hidden, DType::BF16, self.topk + 1, self.tokens);
        cfg.max_in_flight = 1;
        cfg.a2e_quant = Quant::Int8;
        cfg
    }

    /// Bytes one A2E row (INT8) and one E2A row (bf16) take more at `hidden` than at `small`.
    pub fn row_deltas(&self, topo: &Topology, small: usize, hidden: usize) -> (f64, f64) {
        let a = |h: usize| A2eRow::new(&self.config(h), topo).int8_stride as f64;
        (a(hidden) - a(small), (2 * (hidden - small)) as f64)
    }
}

/// Runs one call of `shape` at hidden size `hidden` on the local fabric (every rank a thread;
/// INT8 A2E, bf16 E2A, the identity as expert) and returns its A2E and E2A as counted. The
/// fabric takes the network path's ways (no load/store access to peers' windows), so a relay
/// forwards rows as it does over ofi rather than leaving them for its readers.
pub fn counted(shape: &Shape, hidden: usize, seed: u64) -> Result<(Counts, Counts), String> {
    let e = |e: xccl::Error| e.to_string();
    let topo = shape.topology().map_err(e)?;
    let cfg = shape.config(hidden);
    let network = xccl::fabric::Capabilities {
        load_store: false,
        remote_read: true,
        chunk_floor: 0,
    };
    let comms = Communicator::local_group_with(&topo, &cfg, network).map_err(e)?;
    let relay = |r: usize| {
        topo.relay_plan()
            .is_some_and(|p| p.relay_index(r).is_some())
    };
    let (k, t, routed) = (shape.topk, shape.tokens, shape.routed);
    // The smallest row of each direction: an INT8 A2E row, a bf16 E2A row.
    let row_bytes = [
        A2eRow::new(&cfg, &topo).int8_stride as f64,
        2.0 * hidden as f64,
    ];
    let per_rank: Vec<Result<[Stats; 2], String>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut comm| {
                s.spawn(move || {
                    let r = comm.rank();
                    let res = one_call(&mut comm, k, t, routed, hidden, seed);
                    if let Err(err) = &res {
                        comm.abort(err);
                    }
                    res.map_err(|err| format!("rank {r}: {err}"))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a rank panicked".into())))
            .collect()
    });
    let per_rank = per_rank.into_iter().collect::<Result<Vec<_>, _>>()?;
    let build = |d: usize, direction| Counts {
        direction,
        relayed: topo.relay_plan().is_some(),
        ranks: per_rank
            .iter()
            .enumerate()
            .map(|(r, st)| RankCounts {
                role: topo.role(r),
                relay: relay(r),
                records_written: st[d].records_written as f64,
                records_polled: st[d].records_polled as f64,
                links: st[d]
                    .peers
                    .iter()
                    .enumerate()
                    .filter(|(_, x)| x.bytes_put > 0)
                    .map(|(to, x)| Link {
                        to,
                        rows: moved_rows(
                            to == r,
                            x.rows_sent as f64,
                            x.bytes_put as f64,
                            row_bytes[d],
                        ),
                        bytes: x.bytes_put as f64,
                    })
                    .collect(),
            })
            .collect(),
    };
    Ok((build(0, Direction::A2e), build(1, Direction::E2a)))
}

/// The rows a link moved: the rows its records announced, but none on a link to the rank
/// itself that carried less than a row's bytes (`row_bytes`, the smallest row) per row: a
/// relay's own A2E rows and E2A replies, which stay where they are (in its member areas, where
/// the caller has them: `xccl::moe::relay`), so its records and header only; rescaling to
/// another row size leaves such a link alone.
fn moved_rows(to_itself: bool, rows: f64, bytes: f64, row_bytes: f64) -> f64 {
    if to_itself && bytes < rows * row_bytes {
        0.0
    } else {
        rows
    }
}

/// One rank's A2E and E2A of [`counted`]: routing `k` distinct routed experts plus the shared
/// one per token.
fn one_call(
    comm: &mut Communicator,
    k: usize,
    t: usize,
    routed: usize,
    hidden: usize,
    seed: u64,
) -> Result<[Stats; 2], String> {
    let e = |e: xccl::Error| e.to_string();
    let rank = comm.rank();
    match comm.role() {
        Role::Attention => {
            let (idx, w) = random_routing(seed ^ rank as u64, t, k, routed, None);
            let (mut topk_idx, mut topk_w) = (Vec::new(), Vec::new());
            for tok in 0..t {
                topk_idx.extend_from_slice(&idx[tok * k..(tok + 1) * k]);
                topk_idx.push(routed as i32);
                topk_w.extend_from_slice(&w[tok * k..(tok + 1) * k]);
                topk_w.push(1.0);
            }
            let x = vec![half::bf16::from_f32(0.5); t * hidden];
            let mut out = vec![half::bf16::ZERO; t * hidden];
            let h = comm.a2e_send(&x, &topk_idx, &topk_w).map_err(e)?;
            let a2e = comm.last_call_stats().clone();
            comm.e2a_recv(&h, &mut out).map_err(e)?;
            Ok([a2e, comm.last_call_stats().clone()])
        }
        Role::Expert => {
            let mut batch = TokenBatch::new();
            comm.a2e_recv_tokens(&mut batch, &mut |_, _| {})
                .map_err(e)?;
            let a2e = comm.last_call_stats().clone();
            let rows = batch.rows::<half::bf16>().map_err(e)?.to_vec();
            comm.e2a_send_tokens(&batch, &rows).map_err(e)?;
            Ok([a2e, comm.last_call_stats().clone()])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(to: usize, rows: f64, bytes: f64) -> Link {
        Link { to, rows, bytes }
    }

    fn rank(role: Role, relay: bool, w: f64, p: f64, links: Vec<Link>) -> RankCounts {
        RankCounts {
            role,
            relay,
            records_written: w,
            records_polled: p,
            links,
        }
    }

    const UNIT: FabricParams = FabricParams {
        latency_us: 1.0,
        link_gbps: 1.0,
        copy_gbps: 2.0,
        record_us: 0.5,
        cores: None,
    };

    /// 1A:2E direct A2E: 1000 bytes to each expert rank (1 us each at 1 GB/s), one record each.
    fn direct_a2e() -> Counts {
        Counts {
            direction: Direction::A2e,
            relayed: false,
            ranks: vec![
                rank(
                    Role::Attention,
                    false,
                    2.0,
                    0.0,
                    vec![link(1, 10.0, 1000.0), link(2, 10.0, 1000.0)],
                ),
                rank(Role::Expert, false, 0.0, 1.0, vec![]),
                rank(Role::Expert, false, 0.0, 1.0, vec![]),
            ],
        }
    }

    #[test]
    fn a_direct_call_is_one_latency_plus_its_slowest_rank() {
        let p = predict(&UNIT, &direct_a2e());
        // Sender: 2000 B / 1 GB/s = 2 us + 2 records x 0.5; each receiver: 1000 B over its
        // link (1 us), its copy (0.5 us), one record (0.5 us).
        assert_eq!(p.hops, 1);
        assert!((p.stages_us[0] - 3.0).abs() < 1e-9, "{p:?}");
        assert!((p.total_us - 4.0).abs() < 1e-9, "{p:?}");
        // Shared CPUs: all work (3 + 2 x 2) on one core exceeds the path.
        let one_core = FabricParams {
            cores: Some(1.0),
            ..UNIT
        };
        assert!((predict(&one_core, &direct_a2e()).total_us - 8.0).abs() < 1e-9);
    }

    /// 2A:2E through relay rank 2: each attention rank sends 1000 B to it; it forwards 1000 B
    /// to rank 3 and keeps 1000 B (a local copy).
    fn relayed(direction: Direction) -> Counts {
        let (a, e) = (Role::Attention, Role::Expert);
        match direction {
            Direction::A2e => Counts {
                direction,
                relayed: true,
                ranks: vec![
                    rank(a, false, 1.0, 0.0, vec![link(2, 10.0, 1000.0)]),
                    rank(a, false, 1.0, 0.0, vec![link(2, 10.0, 1000.0)]),
                    rank(
                        e,
                        true,
                        2.0,
                        2.0,
                        vec![link(2, 10.0, 1000.0), link(3, 10.0, 1000.0)],
                    ),
                    rank(e, false, 0.0, 1.0, vec![]),
                ],
            },
            Direction::E2a => Counts {
                direction,
                relayed: true,
                ranks: vec![
                    rank(a, false, 0.0, 1.0, vec![]),
                    rank(a, false, 0.0, 1.0, vec![]),
                    rank(
                        e,
                        true,
                        3.0,
                        2.0,
                        vec![link(0, 5.0, 500.0), link(1, 5.0, 500.0)],
                    ),
                    rank(e, false, 1.0, 0.0, vec![link(2, 10.0, 1000.0)]),
                ],
            },
        }
    }

    #[test]
    fn relayed_a2e_pipelines_its_hops_and_relayed_e2a_adds_them() {
        let c = relayed(Direction::A2e);
        assert_eq!((c.hop(0, 2), c.hop(2, 3), c.hop(2, 2)), (0, 1, 1));
        let p = predict(&UNIT, &c);
        // Hop 0: 2000 B reach the relay over its link (2 us), it copies them (1 us) and polls
        // 2 records (1 us) = 4 us.
        // Hop 1: it puts 1000 B (1 us), copies 1000 B of its own (0.5 us), writes 2 (1 us).
        assert_eq!(p.stages_us.len(), 2);
        assert!((p.stages_us[0] - 4.0).abs() < 1e-9, "{p:?}");
        assert!((p.stages_us[1] - 2.5).abs() < 1e-9, "{p:?}");
        assert!((p.total_us - (2.0 + 4.0)).abs() < 1e-9, "pipelined: {p:?}");
        let e = relayed(Direction::E2a);
        assert_eq!((e.hop(3, 2), e.hop(2, 0)), (0, 1));
        let q = predict(&UNIT, &e);
        // Hop 0: rank 3 puts 1000 B + 1 record = 1.5; the relay receives 1000 B (1 us), copies
        // them (0.5 us), polls 2 (1 us) = 2.5. Hop 1: the relay puts 1000 B + writes 3 = 2.5.
        assert!(
            (q.total_us - (2.0 + 2.5 + 2.5)).abs() < 1e-9,
            "summed: {q:?}"
        );
    }

    #[test]
    fn rescaling_adds_the_row_size_difference_to_every_link() {
        let c = direct_a2e().rescaled(100.0);
        assert_eq!(c.ranks[0].links[0].bytes, 2000.0);
        assert_eq!(c.records(), 2.0);
    }

    #[test]
    fn counts_at_a_small_hidden_size_rescale_exactly_to_a_larger_one() {
        for relays in [None, Some(2)] {
            let shape = Shape {
                attention: 4,
                experts: 6,
                routed: 4,
                topk: 2,
                tokens: 5,
                relays,
            };
            let topo = shape.topology().unwrap();
            let (a2e_delta, e2a_delta) = shape.row_deltas(&topo, 16, 48);
            let (a_small, e_small) = counted(&shape, 16, 7).unwrap();
            let (a_big, e_big) = counted(&shape, 48, 7).unwrap();
            assert!(a_small.records() > 0.0 && e_small.records() > 0.0);
            assert_eq!(a_small.rescaled(a2e_delta), a_big, "A2E, relays {relays:?}");
            assert_eq!(e_small.rescaled(e2a_delta), e_big, "E2A, relays {relays:?}");
            assert_eq!(a_small.relayed, relays.is_some());
        }
    }

    #[test]
    fn calibration_recovers_the_parameters_that_made_the_samples() {
        let truth = FabricParams {
            latency_us: 2.0,
            link_gbps: 8.0,
            copy_gbps: 20.0,
            record_us: 0.3,
            cores: None,
        };
        let mut samples = Vec::new();
        for scale in [0.0, 1e3, 1e4, 1e5, 1e6] {
            for c in [
                direct_a2e(),
                relayed(Direction::A2e),
                relayed(Direction::E2a),
            ] {
                let c = c.rescaled(scale / 10.0);
                samples.push(Sample {
                    label: String::new(),
                    measured_us: predict(&truth, &c).total_us,
                    counts: c,
                });
            }
        }
        let start = FabricParams {
            latency_us: 1.0,
            link_gbps: 1.0,
            copy_gbps: 1.0,
            record_us: 1.0,
            cores: None,
        };
        let fit = calibrate(&start, &samples);
        assert!(loss(&fit, &samples) < 1e-6, "{fit:?}");
        for s in &samples {
            let got = predict(&fit, &s.counts).total_us;
            assert!(
                (got / s.measured_us - 1.0).abs() < 1e-3,
                "{got} vs {}",
                s.measured_us
            );
        }
    }
}
