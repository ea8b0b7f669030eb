//! From every rank's timestamps to the table, the JSON and the memcpy reference.

use std::hint::black_box;
use std::time::Instant;

use serde_json::json;

use crate::cli::Args;
use crate::limit::Limit;
use crate::run::{RankReport, WORDS};

/// The three measured operations.
pub const OPS: [&str; 3] = ["a2e", "e2a", "roundtrip"];

/// One row of the table.
#[derive(Clone, Debug)]
pub struct ResultRow {
    /// `a2e`, `e2a` or `roundtrip`.
    pub op: &'static str,
    /// Wire format: `none` (the dtype) or `int8`.
    pub quant: &'static str,
    /// Payload bytes one token row takes on the wire (hidden x dtype size, or the INT8 row with
    /// its scale).
    pub wire_bytes_per_token: u64,
    /// Tokens per attention rank.
    pub tokens: usize,
    /// Median latency in microseconds.
    pub p50_us: f64,
    /// 99th percentile latency in microseconds.
    pub p99_us: f64,
    /// Bytes per attention rank (twice the one-way bytes for the round trip).
    pub bytes_per_rank: u64,
    /// `bytes_per_rank / p50`, GB/s.
    pub algbw_gbps: f64,
    /// Bandwidth of a memcpy of `bytes_per_rank`, GB/s.
    pub memcpy_gbps: f64,
    /// Metadata records per call in the whole job.
    pub metadata_records: usize,
    /// p50 of the limit of the same bytes ([`crate::limit`]: the streaming limit, or on
    /// `--fabric cuda` the device-to-device copy), microseconds.
    pub limit_us: Option<f64>,
    /// p50 of the MPI baseline for the same routing (`--mpi-baseline`), microseconds.
    pub mpi_us: Option<f64>,
}

impl ResultRow {
    /// `algbw / memcpy bandwidth`.
    pub fn vs_memcpy(&self) -> f64 {
        if self.memcpy_gbps > 0.0 {
            self.algbw_gbps / self.memcpy_gbps
        } else {
            0.0
        }
    }

    /// `limit p50 / p50`: 1.0 is at the limit, above 1 is faster than it (possible when a mode
    /// makes fewer copies than the streaming limit's writer-copy plus reader-copy).
    pub fn vs_limit(&self) -> Option<f64> {
        self.limit_us
            .filter(|_| self.p50_us > 0.0)
            .map(|l| l / self.p50_us)
    }

    /// `MPI p50 / p50`: how many times faster than the MPI baseline.
    pub fn vs_mpi(&self) -> Option<f64> {
        self.mpi_us
            .filter(|_| self.p50_us > 0.0)
            .map(|m| m / self.p50_us)
    }
}

/// Index of `op` in [`OPS`].
pub fn op_index(op: &str) -> usize {
    OPS.iter().position(|o| *o == op).unwrap_or(0)
}

/// Fills in every row's limit (`limits[s]` is token count `s` of the sweep; measured
/// for rows in the dtype, so INT8 rows get none).
pub fn attach_limits(args: &Args, rows: &mut [ResultRow], limits: &[Limit]) {
    for r in rows.iter_mut().filter(|r| r.quant == "none") {
        if let Some(s) = args.tokens.iter().position(|&t| t == r.tokens) {
            r.limit_us = limits.get(s).map(|l| l.p50_us[op_index(r.op)]);
        }
    }
}

/// Fills in every row's MPI baseline figure, where the baseline has its token count (rows in
/// the dtype only: the baseline moves the dtype).
pub fn attach_mpi(rows: &mut [ResultRow], mpi: &MpiBaseline) {
    for r in rows.iter_mut().filter(|r| r.quant == "none") {
        r.mpi_us = mpi
            .points
            .iter()
            .find(|p| p.tokens == r.tokens)
            .map(|p| p.p50_us[op_index(r.op)]);
    }
}

/// What `benches/baselines/moe_alltoallv.c` printed: the library and one point per token count.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MpiBaseline {
    /// The `MPILIB` line (`MPI_Get_library_version`), if present.
    pub lib: Option<String>,
    /// One per `MPIBASE` line.
    pub points: Vec<MpiPoint>,
}

/// One `MPIBASE` line.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MpiPoint {
    /// Tokens per attention rank.
    pub tokens: usize,
    /// p50 of a2e, e2a, roundtrip in microseconds.
    pub p50_us: [f64; 3],
    /// p99 of a2e, e2a, roundtrip in microseconds.
    pub p99_us: [f64; 3],
    /// The baseline's own bit-exact combine check passed.
    pub check_passed: bool,
}

impl MpiBaseline {
    /// Parses the baseline's output; other lines are ignored.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut out = MpiBaseline::default();
        for line in text.lines() {
            if let Some(lib) = line.strip_prefix("MPILIB ") {
                out.lib = Some(lib.trim().to_string());
                continue;
            }
            let Some(rest) = line.strip_prefix("MPIBASE ") else {
                continue;
            };
            let kv: Vec<(&str, &str)> = rest
                .split_whitespace()
                .filter_map(|f| f.split_once('='))
                .collect();
            let get = |k: &str| {
                kv.iter()
                    .find(|(key, _)| *key == k)
                    .map(|(_, v)| *v)
                    .ok_or_else(|| format!("MPIBASE line without {k}: {line}"))
            };
            let num = |k: &str| -> Result<f64, String> {
                get(k)?
                    .parse::<f64>()
                    .map_err(|e| format!("MPIBASE {k}: {e}"))
            };
            let mut p = MpiPoint {
                tokens: get("tokens")?
                    .parse()
                    .map_err(|e| format!("MPIBASE tokens: {e}"))?,
                check_passed: get("check")? == "passed",
                ..MpiPoint::default()
            };
            for (i, op) in OPS.iter().enumerate() {
                p.p50_us[i] = num(&format!("{op}_p50_us"))?;
                p.p99_us[i] = num(&format!("{op}_p99_us"))?;
            }
            out.points.push(p);
        }
        if out.points.is_empty() {
            return Err("no MPIBASE line (is this the output of moe_alltoallv?)".into());
        }
        Ok(out)
    }
}

/// Nearest-rank percentile of sorted `v` (`q` in 0..=1).
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let idx = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[idx]
}

/// The sweep points in the order every rank ran them (and stored their words): per quant, per
/// token count.
fn sweep_points(args: &Args) -> impl Iterator<Item = (xccl::Quant, usize)> + '_ {
    args.quants()
        .into_iter()
        .flat_map(|q| args.tokens.iter().map(move |&t| (q, t)))
}

/// One measured call of a sweep point, from every rank's timestamps (ns).
struct CallStamps {
    /// Attention ranks that took part (DP domains leave some out), and the rows they sent.
    senders: u64,
    rows: u64,
    /// First `a2e_send` start and last `a2e_send` end of the attention ranks.
    a2e_start: u64,
    a2e_sent: u64,
    /// Last A2E receive end, first and last E2A send start and end of the expert ranks.
    received: u64,
    e2a_start: u64,
    replied: u64,
    /// Last `e2a_recv` end of the attention ranks.
    combined: u64,
    /// The longest `a2e_send` of an attention rank and E2A send of an expert rank, us.
    longest_a2e_send: f64,
    longest_e2a_send: f64,
}

/// The [`CallStamps`] of sweep point `p`'s measured calls (after the warmup).
fn measured_calls<'a>(
    args: &'a Args,
    reports: &'a [RankReport],
    p: usize,
) -> impl Iterator<Item = CallStamps> + 'a {
    let (m, rounds) = (args.attention, args.rounds());
    let at =
        move |rank: usize, it: usize, w: usize| reports[rank].words[(p * rounds + it) * WORDS + w];
    (args.warmup..rounds).map(move |it| {
        let att: Vec<usize> = (0..m).filter(|&r| at(r, it, 0) != u64::MAX).collect();
        let exp: Vec<usize> = (m..args.world_size()).collect();
        let first = |ranks: &[usize], w: usize| ranks.iter().map(|&r| at(r, it, w)).min();
        let last = |ranks: &[usize], w: usize| ranks.iter().map(|&r| at(r, it, w)).max();
        let longest = |ranks: &[usize], a: usize, b: usize| {
            ranks
                .iter()
                .map(|&r| us(at(r, it, a), at(r, it, b)))
                .fold(0.0, f64::max)
        };
        CallStamps {
            senders: att.len() as u64,
            rows: att.iter().map(|&r| at(r, it, 3)).sum(),
            a2e_start: first(&att, 0).unwrap_or(0),
            a2e_sent: last(&att, 1).unwrap_or(0),
            received: last(&exp, 0).unwrap_or(0),
            e2a_start: first(&exp, 1).unwrap_or(0),
            replied: last(&exp, 2).unwrap_or(0),
            combined: last(&att, 2).unwrap_or(0),
            longest_a2e_send: longest(&att, 0, 1),
            longest_e2a_send: longest(&exp, 1, 2),
        }
    })
}

/// Microseconds from `a` to `b` (ns; 0 if `b` is earlier).
fn us(a: u64, b: u64) -> f64 {
    b.saturating_sub(a) as f64 / 1e3
}

/// Median of `v` (sorted here).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    percentile(&v, 0.5)
}

/// Builds the rows (memcpy bandwidth still 0) from every rank's report, in rank order. An
/// attention rank a DP domain left out of an iteration ([`crate::run::SKIPPED`]) does not count
/// in it.
pub fn aggregate(args: &Args, reports: &[RankReport], records: usize) -> Vec<ResultRow> {
    let elem = args.dtype.size() as u64;
    let mut rows = Vec::new();
    for (p, (quant, tokens)) in sweep_points(args).enumerate() {
        let wire = match quant {
            xccl::Quant::None => args.hidden as u64 * elem,
            xccl::Quant::Int8 => xccl::moe::quant::int8_payload(args.hidden) as u64,
        };
        let mut lat: [Vec<f64>; 3] = Default::default();
        let mut sent_rows = 0u64;
        // Attention ranks that took part, summed over iterations.
        let mut senders = 0u64;
        for c in measured_calls(args, reports, p) {
            senders += c.senders;
            sent_rows += c.rows;
            lat[0].push(us(c.a2e_start, c.received));
            lat[1].push(us(c.e2a_start, c.combined));
            lat[2].push(us(c.a2e_start, c.combined));
        }
        let one_way = sent_rows * wire / senders.max(1);
        for (op, mut l) in OPS.into_iter().zip(lat) {
            l.sort_by(f64::total_cmp);
            let bytes = if op == "roundtrip" {
                2 * one_way
            } else {
                one_way
            };
            let p50 = percentile(&l, 0.5);
            rows.push(ResultRow {
                op,
                quant: quant.name(),
                wire_bytes_per_token: wire,
                tokens,
                p50_us: p50,
                p99_us: percentile(&l, 0.99),
                bytes_per_rank: bytes,
                algbw_gbps: if p50 > 0.0 {
                    bytes as f64 / (p50 * 1e3)
                } else {
                    0.0
                },
                memcpy_gbps: 0.0,
                metadata_records: records,
                limit_us: None,
                mpi_us: None,
            });
        }
    }
    rows.sort_by_key(|r| (r.quant, OPS.iter().position(|o| *o == r.op), r.tokens));
    rows
}

/// Where a point's round trip goes, from the timestamps every rank records (medians over the
/// measured iterations, microseconds): each phase is the last rank's, so the four add up to about
/// the round trip.
#[derive(Clone, Debug, PartialEq)]
pub struct PhaseLine {
    /// Tokens of the point.
    pub tokens: usize,
    /// Its quant name.
    pub quant: &'static str,
    /// The attention ranks' `a2e_send` (the longest one of each call).
    pub a2e_send: f64,
    /// From the last `a2e_send` returning to the last expert rank's receive returning: the
    /// signal's flight and the receive's own work once the rows are there.
    pub a2e_landed: f64,
    /// The expert ranks' E2A send (the longest one of each call).
    pub e2a_send: f64,
    /// From the last E2A send returning to the last attention rank's `e2a_recv` returning.
    pub e2a_landed: f64,
}

/// The [`PhaseLine`] of every sweep point.
pub fn phases(args: &Args, reports: &[RankReport]) -> Vec<PhaseLine> {
    sweep_points(args)
        .enumerate()
        .map(|(p, (quant, tokens))| {
            let mut v: [Vec<f64>; 4] = Default::default();
            for c in measured_calls(args, reports, p) {
                v[0].push(c.longest_a2e_send);
                v[1].push(us(c.a2e_sent, c.received));
                v[2].push(c.longest_e2a_send);
                v[3].push(us(c.replied, c.combined));
            }
            let [a2e_send, a2e_landed, e2a_send, e2a_landed] = v.map(median);
            PhaseLine {
                tokens,
                quant: quant.name(),
                a2e_send,
                a2e_landed,
                e2a_send,
                e2a_landed,
            }
        })
        .collect()
}

/// Median time of copying `bytes` between two buffers of that size, timed like the operations
/// (`iters` samples after `warmup`), as GB/s. Zero bytes give 0.
pub fn memcpy_gbps(bytes: u64, warmup: usize, iters: usize) -> f64 {
    if bytes == 0 {
        return 0.0;
    }
    let src: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
    let mut dst = vec![0u8; bytes as usize];
    let mut samples = Vec::with_capacity(iters);
    for it in 0..warmup + iters {
        let t0 = Instant::now();
        dst.copy_from_slice(black_box(&src));
        black_box(&mut dst);
        let dt = t0.elapsed().as_nanos() as f64;
        if it >= warmup {
            samples.push(dt);
        }
    }
    samples.sort_by(f64::total_cmp);
    bytes as f64 / percentile(&samples, 0.5).max(1.0)
}

/// Fills in the memcpy bandwidth of every row (one measurement per distinct size).
pub fn measure_memcpy(args: &Args, rows: &mut [ResultRow]) {
    let mut cache: Vec<(u64, f64)> = Vec::new();
    for r in rows.iter_mut() {
        let bw = match cache.iter().find(|(b, _)| *b == r.bytes_per_rank) {
            Some(&(_, bw)) => bw,
            None => {
                let bw = memcpy_gbps(r.bytes_per_rank, args.warmup.max(3), args.iters.max(10));
                cache.push((r.bytes_per_rank, bw));
                bw
            }
        };
        r.memcpy_gbps = bw;
    }
}

/// The host: cores, CPU model, kernel.
#[derive(Clone, Debug)]
pub struct Machine {
    /// Cores this process may use.
    pub cores: usize,
    /// `model name` of the first CPU in `/proc/cpuinfo`.
    pub cpu: String,
    /// Kernel release.
    pub kernel: String,
    /// `/proc/loadavg`'s 1-minute load average when the report was made (other work on the host
    /// shows here; above the core count, timings are noisy).
    pub load: Option<f64>,
}

impl Machine {
    /// Reads the host's description.
    pub fn detect() -> Self {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, v)| v.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "unknown".into());
        let load = std::fs::read_to_string("/proc/loadavg")
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse().ok());
        // Online CPUs of the host, not this process's affinity (rank 0 may be pinned to one).
        // SAFETY: sysconf only reads a system constant.
        let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
        Machine {
            cores: usize::try_from(online)
                .ok()
                .filter(|&n| n > 0)
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
            cpu,
            kernel,
            load,
        }
    }
}

/// What the table and the JSON show besides the rows.
#[derive(Clone, Debug, Default)]
pub struct Extras {
    /// The one-row exchange between every attention and every expert rank (the floor T=1
    /// calls are set against) and the one-row pair ping-pong ([`crate::limit::floors`]), when
    /// measured.
    pub floors: Option<(crate::limit::Floor, crate::limit::Floor)>,
    /// Attention and expert ranks of the exchange floor.
    pub floor_shape: (usize, usize),
    /// Pairs the pair floor ran at once.
    pub floor_pairs: usize,
    /// Per sweep point (tokens, quant): what an attention rank's and an expert rank's waits
    /// counted per call (means over the ranks of each role and the timed calls).
    pub waits: Vec<WaitLine>,
    /// Per sweep point, where the round trip goes ([`phases`]).
    pub phases: Vec<PhaseLine>,
    /// The MPI baseline given with `--mpi-baseline`.
    pub mpi: Option<MpiBaseline>,
    /// The wait policy of the ranks ([`xccl::fabric::WaitPolicy::describe`]).
    pub wait_policy: String,
    /// Over ofi: libfabric's `fi_pingpong` in the same run ([`crate::pingpong`]).
    pub fi: Option<FiLimit>,
    /// The token counts' limit: which one and its figures.
    pub limit: LimitPoints,
}

/// The limit of each token count as measured ([`crate::limit`]).
#[derive(Clone, Debug, Default)]
pub struct LimitPoints {
    /// Which limit: `"streaming"` or `"device-to-device copy"` ([`crate::limit::Plan::kind`]).
    pub kind: &'static str,
    /// Copying ranks at once (the streaming limit's pairs, or the ranks copying on their
    /// devices).
    pub ranks: usize,
    /// Device copies per timed sample (the device-to-device copy only).
    pub copies: Option<usize>,
    /// Per token count: the tokens and the limit measured for them.
    pub points: Vec<(usize, Limit)>,
}

impl LimitPoints {
    /// The limits of the token counts of `args` (the first of `limits`, in `plan`'s order).
    pub fn of(args: &Args, plan: &crate::limit::Plan, limits: &[Limit]) -> Self {
        let kind = plan.kind();
        LimitPoints {
            kind,
            ranks: args.attention.min(args.experts),
            copies: (plan.device_bytes() > 0).then_some(plan.copies),
            points: args
                .tokens
                .iter()
                .copied()
                .zip(limits.iter().copied())
                .collect(),
        }
    }

    /// How the limit was measured, in words.
    pub fn describe(&self) -> String {
        match self.copies {
            Some(c) => format!(
                "device-to-device copy of the same bytes on the device of each of {} attention \
                 rank(s) at once ({c} copies per sample, one synchronize, host clock)",
                self.ranks
            ),
            None => format!(
                "streaming the same bytes between processes, {} pair(s) at once",
                self.ranks
            ),
        }
    }
}

/// `fi_pingpong`'s figures of an ofi run, and the message size of each sweep point.
#[derive(Clone, Debug)]
pub struct FiLimit {
    /// Its measurements, or why there are none.
    pub runs: Result<Vec<crate::pingpong::PingPong>, String>,
    /// Per token count, the bytes of the fi_pingpong message set beside it (the call's bytes
    /// per attention rank, in whole rows).
    pub point_bytes: Vec<(usize, usize)>,
}

impl FiLimit {
    /// The figures of `runs` for the sweep of `args` (its points' message sizes from `plan`).
    pub fn of(
        runs: Result<Vec<crate::pingpong::PingPong>, String>,
        args: &Args,
        plan: &crate::limit::Plan,
    ) -> Self {
        let point_bytes = args
            .tokens
            .iter()
            .zip(&plan.measurements)
            .map(|(&t, m)| (t, m.bytes))
            .collect();
        FiLimit { runs, point_bytes }
    }

    /// The measurement of a message of `bytes`, if fi_pingpong ran it.
    pub fn at(&self, bytes: usize) -> Option<&crate::pingpong::PingPong> {
        self.runs.as_ref().ok()?.iter().find(|p| p.bytes == bytes)
    }

    /// Per token count: (tokens, bytes, xccl A2E p50 / fi one-way, xccl round-trip algbw / fi
    /// MB/s) over the dtype rows of `rows`.
    pub fn ratios(&self, rows: &[ResultRow]) -> Vec<(usize, usize, Option<f64>, Option<f64>)> {
        self.point_bytes
            .iter()
            .map(|&(t, bytes)| {
                let fi = self.at(bytes);
                let row = |op: &str| {
                    rows.iter()
                        .find(|r| r.op == op && r.tokens == t && r.quant == "none")
                };
                let lat = fi.zip(row("a2e")).map(|(f, r)| r.p50_us / f.usec_per_xfer);
                let bw = fi
                    .zip(row("roundtrip"))
                    .map(|(f, r)| r.algbw_gbps * 1e3 / f.mb_per_sec);
                (t, bytes, lat, bw)
            })
            .collect()
    }
}

/// One sweep point's wait counters per call, by role.
#[derive(Clone, Debug, Default)]
pub struct WaitLine {
    /// Tokens of the point.
    pub tokens: usize,
    /// Its quant name.
    pub quant: &'static str,
    /// Per role (attention, expert): waits, spin polls, yields, slow yields, sleeps per call,
    /// the mean wake-up latency estimate and spin budget (us) at the end of the point, then
    /// CPU time (us), voluntary and involuntary context switches per call, then phase restarts
    /// (a part of what a wait awaited landed) per call.
    pub roles: [[f64; 11]; 2],
}

fn opt(v: Option<f64>, width: usize, prec: usize) -> String {
    match v {
        Some(v) => format!("{v:>width$.prec$}"),
        None => format!("{:>width$}", "-"),
    }
}

/// The header and table, nccl-tests style.
pub fn table(
    args: &Args,
    machine: &Machine,
    rows: &[ResultRow],
    check: &str,
    extras: &Extras,
) -> String {
    let mut s = String::new();
    s += &format!(
        "# xccl-bench: {}A:{}E ranks, fabric {}, mode {}, layout {}, buffers {}, H={} {}, top-{} of {} experts{}\n",
        args.attention,
        args.experts,
        args.fabric.name(),
        args.mode.name(),
        args.layout.name(),
        args.buffers.name(),
        args.hidden,
        args.dtype.name(),
        args.topk,
        args.num_experts,
        args.skew
            .map_or(String::new(), |s| format!(", zipf skew {s}")),
    );
    if args.relays.is_some() || args.domains > 1 {
        s += &format!(
            "# relays {}, DP domains {}\n",
            args.relays.map_or("none".into(), |r| r.to_string()),
            args.domains
        );
    }
    s += &format!(
        "# iters {} warmup {} ({} blocks alternating with the limits') seed {} chunk {} B, in \
         flight {}, bind {}, check {}\n",
        args.iters,
        args.warmup,
        args.num_blocks(),
        args.seed,
        args.chunk_bytes,
        if args.domains > 1 { 1 } else { args.in_flight },
        args.bind.name(),
        check
    );
    s += &format!(
        "# machine: {} cores, {}, Linux {}, load average {}; wait policy {}\n",
        machine.cores,
        machine.cpu,
        machine.kernel,
        machine.load.map_or("?".into(), |l| format!("{l:.2}")),
        extras.wait_policy
    );
    if let Some(lib) = extras.mpi.as_ref().and_then(|m| m.lib.as_ref()) {
        s += &format!("# mpi baseline: {lib}\n");
    }
    s += "#\n";
    let with_mpi = extras.mpi.is_some();
    s += &format!(
        "# {:>9} {:>5} {:>7} {:>13} {:>10} {:>10} {:>12} {:>10} {:>10} {:>9}",
        "op",
        "quant",
        "tokens",
        "bytes/rank",
        "p50(us)",
        "p99(us)",
        "algbw(GB/s)",
        "vs_memcpy",
        "limit(us)",
        "vs_limit",
    );
    if with_mpi {
        s += &format!(" {:>10} {:>7}", "mpi(us)", "vs_mpi");
    }
    s += &format!(" {:>10}\n", "md_records");
    for r in rows {
        s += &format!(
            "  {:>9} {:>5} {:>7} {:>13} {:>10.2} {:>10.2} {:>12.3} {:>10.3} {} {}",
            r.op,
            r.quant,
            r.tokens,
            r.bytes_per_rank,
            r.p50_us,
            r.p99_us,
            r.algbw_gbps,
            r.vs_memcpy(),
            opt(r.limit_us, 10, 2),
            opt(r.vs_limit(), 9, 3),
        );
        if with_mpi {
            s += &format!(" {} {}", opt(r.mpi_us, 10, 2), opt(r.vs_mpi(), 7, 2));
        }
        s += &format!(" {:>10}\n", r.metadata_records);
    }
    for w in &extras.waits {
        s += &format!("# waits per call, T={} {}:", w.tokens, w.quant);
        for (role, v) in ["attention", "expert"].iter().zip(&w.roles) {
            s += &format!(
                " {role} {:.1} waits ({:.1} restarts), {:.0} spin polls, {:.1} yields ({:.2} \
                 slow), {:.2} sleeps, wake-up {:.1} us, spin budget {:.1} us, cpu {:.1} us, \
                 switches {:.2} voluntary {:.2} involuntary;",
                v[0], v[10], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9]
            );
        }
        s.pop();
        s += "\n";
    }
    for p in &extras.phases {
        s += &format!(
            "# phases per call, T={} {} (p50 us): a2e_send {:.2}, a2e_landed {:.2}, e2a_send \
             {:.2}, e2a_landed {:.2}\n",
            p.tokens, p.quant, p.a2e_send, p.a2e_landed, p.e2a_send, p.e2a_landed
        );
    }
    for (t, l) in &extras.limit.points {
        s += &format!(
            "# limit T={t}: {} ({} B per rank): p50/p99 us a2e {:.2}/{:.2}, e2a {:.2}/{:.2}, \
             roundtrip {:.2}/{:.2}\n",
            extras.limit.describe(),
            l.bytes,
            l.p50_us[0],
            l.p99_us[0],
            l.p50_us[1],
            l.p99_us[1],
            l.p50_us[2],
            l.p99_us[2]
        );
    }
    if let Some((exchange, pairs)) = &extras.floors {
        let smallest = rows
            .iter()
            .filter(|r| r.op == "roundtrip")
            .min_by_key(|r| r.tokens);
        let (m, n) = extras.floor_shape;
        let lines = [
            (
                "floor",
                exchange,
                format!("one row each way between each of {m} attention and {n} expert rank(s), the graph of a T=1 call"),
            ),
            (
                "pair floor",
                pairs,
                format!("one-row ping-pong, {} independent pair(s) at once", extras.floor_pairs),
            ),
        ];
        for (name, f, what) in lines {
            let all: Vec<String> = f
                .by_policy
                .iter()
                .map(|(p, l)| format!("{p} {:.2}", l.p50_us[2]))
                .collect();
            s += &format!(
                "# {name}: {what} ({} B): p50 {:.2} us, p99 {:.2} us (fastest of the policies, us: {})",
                f.best.bytes,
                f.best.p50_us[2],
                f.best.p99_us[2],
                all.join(", ")
            );
            if let Some(r) = smallest.filter(|_| f.best.p50_us[2] > 0.0) {
                s += &format!(
                    "; roundtrip T={} p50 {:.2} us = {:.2} x {name}",
                    r.tokens,
                    r.p50_us,
                    r.p50_us / f.best.p50_us[2]
                );
            }
            s += "\n";
        }
    }
    if let Some(fi) = &extras.fi {
        match &fi.runs {
            Ok(runs) => {
                let all: Vec<String> = runs
                    .iter()
                    .map(|p| {
                        format!(
                            "{} B {:.2} us/xfer {:.1} MB/s",
                            p.bytes, p.usec_per_xfer, p.mb_per_sec
                        )
                    })
                    .collect();
                s += &format!(
                    "# ofi limit: fi_pingpong -p tcp -e rdm, same run: {}\n",
                    all.join("; ")
                );
                for (t, bytes, lat, bw) in fi.ratios(rows) {
                    s += &format!(
                        "# vs fi_pingpong at {bytes} B (T={t}): a2e p50 = {} x its one-way time, roundtrip algbw = {} x its MB/s\n",
                        lat.map_or("-".into(), |v| format!("{v:.2}")),
                        bw.map_or("-".into(), |v| format!("{v:.2}")),
                    );
                }
            }
            Err(why) => s += &format!("# ofi limit: {why}\n"),
        }
    }
    s
}

/// With and without INT8 side by side (`--quant both`): wire bytes per token and each p50 as
/// the INT8 figure over the dtype one.
pub fn quant_summary(rows: &[ResultRow]) -> String {
    let mut s = String::from("# int8 vs none:");
    let find = |q: &str, op: &str, t: usize| {
        rows.iter()
            .find(|r| r.quant == q && r.op == op && r.tokens == t)
    };
    if let (Some(n), Some(i)) = (
        rows.iter().find(|r| r.quant == "none"),
        rows.iter().find(|r| r.quant == "int8"),
    ) {
        s += &format!(
            " wire bytes per token {} vs {} ({:.3}x);",
            i.wire_bytes_per_token,
            n.wire_bytes_per_token,
            i.wire_bytes_per_token as f64 / n.wire_bytes_per_token.max(1) as f64
        );
    }
    let mut tokens: Vec<usize> = rows.iter().map(|r| r.tokens).collect();
    tokens.sort_unstable();
    tokens.dedup();
    for t in tokens {
        for op in OPS {
            if let (Some(n), Some(i)) = (find("none", op, t), find("int8", op, t)) {
                s += &format!(
                    " {op} T={t} {:.1}/{:.1} us ({:.2}x);",
                    i.p50_us,
                    n.p50_us,
                    i.p50_us / n.p50_us.max(f64::MIN_POSITIVE)
                );
            }
        }
    }
    s.pop();
    s + "
"
}

/// The JSON document.
pub fn to_json(
    args: &Args,
    machine: &Machine,
    rows: &[ResultRow],
    check: &str,
    extras: &Extras,
) -> serde_json::Value {
    // The reference figure: memcpy of the largest message measured.
    let memcpy = rows
        .iter()
        .max_by_key(|r| r.bytes_per_rank)
        .map_or(0.0, |r| r.memcpy_gbps);
    json!({
        "config": {
            "attention": args.attention,
            "experts": args.experts,
            "num_experts": args.num_experts,
            "topk": args.topk,
            "hidden": args.hidden,
            "tokens": args.tokens,
            "dtype": args.dtype.name(),
            "quant": args.quants().iter().map(|q| q.name()).collect::<Vec<_>>(),
            "fabric": args.fabric.name(),
            "mode": args.mode.name(),
            "layout": args.layout.name(),
            "buffers": args.buffers.name(),
            "chunk_bytes": args.chunk_bytes,
            "in_flight": if args.domains > 1 { 1 } else { args.in_flight },
            "iters": args.iters,
            "warmup": args.warmup,
            "blocks": args.num_blocks(),
            "seed": args.seed,
            "skew": args.skew,
            "relays": args.relays,
            "domains": args.domains,
            "bind": args.bind.name(),
            "wait_policy": extras.wait_policy,
        },
        "machine": {"cores": machine.cores, "cpu": machine.cpu, "kernel": machine.kernel,
                    "load_average_1min": machine.load},
        "memcpy_gbps": memcpy,
        "check": check,
        "limit": {
            "kind": extras.limit.kind,
            "what": extras.limit.describe(),
            "ranks": extras.limit.ranks,
            "copies_per_sample": extras.limit.copies,
            "points": extras.limit.points.iter().map(|(t, l)| json!({
                "tokens": t,
                "bytes": l.bytes,
                "p50_us": op_json(&l.p50_us),
                "p99_us": op_json(&l.p99_us),
            })).collect::<Vec<_>>(),
        },
        "floor": extras.floors.as_ref().map(|(f, _)| json!({
            "pattern": "exchange",
            "attention": extras.floor_shape.0,
            "experts": extras.floor_shape.1,
            "bytes": f.best.bytes,
            "p50_us": f.best.p50_us[2],
            "p99_us": f.best.p99_us[2],
            "by_policy": floor_json(f),
        })),
        "pair_floor": extras.floors.as_ref().map(|(_, f)| json!({
            "pairs": extras.floor_pairs,
            "bytes": f.best.bytes,
            "p50_us": f.best.p50_us[2],
            "p99_us": f.best.p99_us[2],
            "by_policy": floor_json(f),
        })),
        "fi_pingpong": extras.fi.as_ref().map(|fi| json!({
            "runs": fi.runs.as_ref().ok().map(|r| r.iter().map(|p| json!({
                "bytes": p.bytes, "usec_per_xfer": p.usec_per_xfer, "mb_per_sec": p.mb_per_sec,
            })).collect::<Vec<_>>()),
            "error": fi.runs.as_ref().err(),
            "ratios": fi.ratios(rows).iter().map(|(t, b, lat, bw)| json!({
                "tokens": t, "bytes": b, "a2e_vs_one_way": lat, "roundtrip_algbw_vs_mb_per_sec": bw,
            })).collect::<Vec<_>>(),
        })),
        "waits": extras.waits.iter().map(|w| json!({
            "tokens": w.tokens, "quant": w.quant,
            "attention": wait_json(&w.roles[0]), "expert": wait_json(&w.roles[1]),
        })).collect::<Vec<_>>(),
        "phases": extras.phases.iter().map(|p| json!({
            "tokens": p.tokens, "quant": p.quant, "a2e_send_us": p.a2e_send,
            "a2e_landed_us": p.a2e_landed, "e2a_send_us": p.e2a_send,
            "e2a_landed_us": p.e2a_landed,
        })).collect::<Vec<_>>(),
        "mpi_baseline": extras.mpi.as_ref().map(|m| json!({
            "library": m.lib,
            "checks_passed": m.points.iter().all(|p| p.check_passed),
        })),
        "results": rows.iter().map(|r| json!({
            "op": r.op,
            "quant": r.quant,
            "wire_bytes_per_token": r.wire_bytes_per_token,
            "tokens": r.tokens,
            "p50_us": r.p50_us,
            "p99_us": r.p99_us,
            "algbw_gbps": r.algbw_gbps,
            "vs_memcpy": r.vs_memcpy(),
            "memcpy_gbps": r.memcpy_gbps,
            "limit_us": r.limit_us,
            "vs_limit": r.vs_limit(),
            "mpi_us": r.mpi_us,
            "vs_mpi": r.vs_mpi(),
            "bytes_per_rank": r.bytes_per_rank,
            "metadata_records": r.metadata_records,
        })).collect::<Vec<_>>(),
    })
}

fn op_json(v: &[f64; 3]) -> serde_json::Value {
    json!({"a2e": v[0], "e2a": v[1], "roundtrip": v[2]})
}

fn floor_json(f: &crate::limit::Floor) -> Vec<serde_json::Value> {
    f.by_policy
        .iter()
        .map(|(n, l)| json!({"policy": n, "p50_us": l.p50_us[2], "p99_us": l.p99_us[2]}))
        .collect()
}

fn wait_json(v: &[f64; 11]) -> serde_json::Value {
    json!({"waits": v[0], "spin_polls": v[1], "yields": v[2], "slow_yields": v[3],
           "sleeps": v[4], "wake_us": v[5], "spin_budget_us": v[6], "cpu_us": v[7],
           "voluntary_switches": v[8], "involuntary_switches": v[9], "restarts": v[10]})
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn phases_split_the_round_trip_at_the_last_ranks_timestamps_after_the_warmup() {
        let args = Args::parse_from([
            "xccl-bench",
            "-a",
            "1",
            "-e",
            "2",
            "-t",
            "1",
            "--iters",
            "2",
            "--warmup",
            "1",
        ]);
        // Per rank, per round: attention [send start, send end, combine end, rows], expert
        // [receive end, send start, send end, tokens]. The warmup round is far off.
        let report = |rounds: [[u64; WORDS]; 3]| RankReport {
            words: rounds.concat(),
            ..RankReport::default()
        };
        let reports = [
            report([
                [0, 9_000, 99_000, 2],
                [1_000, 2_000, 3_700, 2],
                [1_000, 2_200, 3_900, 2],
            ]),
            report([
                [50_000; 4],
                [2_300, 2_600, 2_900, 1],
                [2_500, 2_700, 3_000, 1],
            ]),
            report([
                [50_000; 4],
                [2_500, 2_500, 3_000, 1],
                [2_300, 2_400, 3_300, 1],
            ]),
        ];
        let p = &phases(&args, &reports)[0];
        // Round 1: 1.0, 0.5, 0.5, 0.7; round 2: 1.2, 0.3, 0.9, 0.6. The nearest-rank median of
        // two values is the lower one.
        assert_eq!(p.a2e_send, 1.0);
        assert_eq!((p.a2e_landed, p.e2a_send, p.e2a_landed), (0.3, 0.5, 0.6));
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&[7.0], 0.99), 7.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
    }

    #[test]
    fn mpi_baseline_output_parses() {
        let text = "noise\nMPILIB Open MPI v4.1.4, package: Debian\n\
            MPIBASE tokens=128 bytes_per_rank=1835008 a2e_p50_us=1.5 a2e_p99_us=2 e2a_p50_us=3 \
            e2a_p99_us=4 roundtrip_p50_us=5 roundtrip_p99_us=6 check=passed\n";
        let m = MpiBaseline::parse(text).unwrap();
        assert_eq!(m.lib.as_deref(), Some("Open MPI v4.1.4, package: Debian"));
        assert_eq!(
            m.points,
            vec![MpiPoint {
                tokens: 128,
                p50_us: [1.5, 3.0, 5.0],
                p99_us: [2.0, 4.0, 6.0],
                check_passed: true,
            }]
        );
        assert!(MpiBaseline::parse("nothing here").is_err());
        assert!(MpiBaseline::parse("MPIBASE tokens=1 check=passed").is_err());
    }
}
