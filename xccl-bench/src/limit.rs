//! The real limits of the machine, measured in the same run as the calls, through the same
//! fabric (shared memory between the rank processes, or threads with `--fabric local`):
//!
//! - **Streaming limit** of each token count: attention rank `a` writes the call's bytes (one
//!   direction, in whole rows) into expert rank `M + a`'s window in chunks of `--chunk-bytes`
//!   ([`Fabric::put`]), with a [`Fabric::signal`] per chunk; the expert waits for each signal and
//!   copies the chunk out into its own memory ([`Fabric::get`] of its window), as the protocol's
//!   receiver does. Once every row is out, the expert streams the same bytes back the same way.
//!   `min(M, N)` such pairs run at once, each moving `bytes_per_rank * M / min(M, N)` bytes, so
//!   the job moves as many bytes as the call. Timed like the calls: `a2e` = last expert done
//!   reading - first attention start, `e2a` = last attention done - first expert start,
//!   `roundtrip` = last attention done - first attention start.
//! - **Latency floor**: one row (H elements) each way over the communication graph of a T=1
//!   call ([`Pattern::Exchange`]): every attention rank puts one row into every expert rank's
//!   window and signals it; each expert waits for all M, copies the M rows out, puts one row back
//!   into every attention rank's window and signals it; each attention rank waits for all N and
//!   copies the N rows out. At 1A:1E that is a one-row ping-pong. It runs once under the run's
//!   wait policy and once under each policy a user can pick ([`FLOOR_POLICIES`]); the floor is
//!   the fastest of them, so a policy is measured against the best this machine gave, not
//!   against itself.
//! - **Pair floor**: the same one row per pair with `min(M, N)` independent pairs (the floor of
//!   earlier versions, [`Pattern::Pairs`]), under the same policies. With more than one pair the
//!   pairs need not wait for each other (with two cores, one pair per core), so it is lower than
//!   what any call whose ranks all exchange can reach; it is printed beside the floor.
//!
//! - **Device-to-device copy** (`--fabric cuda`, in place of the streaming limit): the rows
//!   live in device memory there, so the limit of each token count is what the device itself
//!   does with the same bytes. Attention rank `a` (for `a` below `min(M, N)`, the pairs of the
//!   streaming limit) queues [`Plan::copies`] copies of the pair's bytes between two buffers
//!   of its own device on a stream of its own (`cuMemcpyDtoDAsync`), synchronizes once and reads
//!   the host clock: `a2e` is that time over the number of copies; `e2a` the same copies back;
//!   `roundtrip` both. Per iteration the slowest rank counts ([`aggregate`]).
//!
//! Every iteration starts with a barrier through the fabric's own signals (as the calls'
//! `Communicator::barrier` does), and every wait uses the fabric's wait policy, so the limit
//! and the calls are measured under the same rules.

use std::time::Duration;

use xccl::cuda::{Device, DeviceMemory, Stream};
use xccl::fabric::{deadline_after, Fabric, WaitPolicy, Waiting};

use crate::cli::{Args, FabricKind};
use crate::report::percentile;
use crate::run::{block_rounds, now_ns, round, topology, workload};

/// Signal slot carrying stream progress (a running chunk count) into the reader's control area.
const PROGRESS: usize = 0;
/// Slot where rank 0 collects barrier arrivals; rank `r` signals slot `ARRIVE + r`.
const ARRIVE: usize = 1;

/// Signal slots the limit fabric needs for `size` ranks.
pub fn slots(size: usize) -> usize {
    ARRIVE + 2 * size + 1
}

fn release_slot(size: usize) -> usize {
    ARRIVE + size
}

/// Slot where a rank receives the exchange signal of rank `from` (the round's epoch).
fn exchange_slot(size: usize, from: usize) -> usize {
    ARRIVE + size + 1 + from
}

/// Who moves bytes to whom in a measurement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    /// Attention rank `a` with expert rank `M + a`, for `a` below the count, independently.
    Pairs(usize),
    /// Every attention rank with every expert rank, one row each way (a T=1 call's graph).
    Exchange,
    /// Attention rank `a`, for `a` below the count, copies the bytes between two buffers of its
    /// own device and back ([`DeviceCopy`]); no peer takes part.
    DeviceCopy(usize),
}

/// Device-to-device copies queued per timed sample of a [`Pattern::DeviceCopy`] measurement,
/// before its one synchronize.
pub const DEVICE_COPIES: usize = 16;

/// One measurement: `bytes` each way per pair of ranks that exchange.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Measurement {
    /// Bytes each pair moves in each direction (whole rows).
    pub bytes: usize,
    /// Which ranks exchange.
    pub pattern: Pattern,
    /// The wait policy of the measurement (`None`: the run's own).
    pub policy: Option<(&'static str, WaitPolicy)>,
}

impl Measurement {
    /// The writing (attention) and reading (expert) ranks of the measurement, for `m`
    /// attention and `n` expert ranks.
    fn ranks(&self, m: usize, n: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        match self.pattern {
            Pattern::Pairs(p) => (0..p, m..m + p),
            Pattern::Exchange => (0..m, m..m + n),
            Pattern::DeviceCopy(p) => (0..p, m..m),
        }
    }
}

/// The policies the floor is measured under besides the run's own (`XCCL_WAIT` names).
pub const FLOOR_POLICIES: [(&str, WaitPolicy); 3] = [
    ("spin", WaitPolicy::DEDICATED),
    ("yield", WaitPolicy::OVERSUBSCRIBED),
    ("sleep", WaitPolicy::SHARED),
];

/// A fabric whose wait policy the limit run may switch between measurements.
pub trait LimitFabric: Fabric {
    /// Sets this rank's wait policy.
    fn set_policy(&mut self, policy: WaitPolicy);
}

impl LimitFabric for xccl::fabric::shm::ShmFabric {
    fn set_policy(&mut self, policy: WaitPolicy) {
        self.set_wait_policy(policy);
    }
}

impl LimitFabric for xccl::fabric::local::LocalFabric {
    fn set_policy(&mut self, policy: WaitPolicy) {
        self.set_wait_policy(policy);
    }
}

/// What the limit run measures: one streaming measurement per token count, then the floor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Bytes of one row (H x dtype size).
    pub row: usize,
    /// Per token count (pairs), then the pair floor and the floor (one row, [`Pattern`]), each
    /// under the run's policy, then under each of [`FLOOR_POLICIES`].
    pub measurements: Vec<Measurement>,
    /// Rows of the largest exchange window (`max(M, N)`: one per peer).
    pub exchange_rows: usize,
    /// Iterations per measurement: warmup, then measured.
    pub warmup: usize,
    /// Measured iterations per measurement.
    pub iters: usize,
    /// Bytes a writer moves between signals (rounded down to whole rows, at least one).
    pub chunk: usize,
    /// Device copies per timed sample of the [`Pattern::DeviceCopy`] measurements.
    pub copies: usize,
}

impl Plan {
    /// The plan of a run: per token count, the mean one-way bytes per attention rank of the
    /// measured iterations (the routing is deterministic; with DP domains, domains taking turns
    /// from the first iteration, which is the calls' share on average), then one row for the
    /// pair floor and the floor. On `--fabric cuda` the token counts' measurements are
    /// [`Pattern::DeviceCopy`] instead of streams.
    pub fn of(args: &Args) -> xccl::Result<Plan> {
        let topo = topology(args)?;
        let (m, n) = (args.attention, args.experts);
        let pairs = m.min(n);
        let row = args.hidden * args.dtype.size();
        let mut measurements = Vec::new();
        for (s, &tokens) in args.tokens.iter().enumerate() {
            let wl = workload(args, tokens);
            let mut rows = 0u64;
            let sample = sampled_rounds(args.warmup, args.iters);
            for &it in &sample {
                for &a in topo.attention_ranks() {
                    let input =
                        wl.input(&topo, args.topk, a, round(s, it, it as u64, args.domains));
                    rows += destination_rows(args, &input.topk_idx) as u64;
                }
            }
            // Rows per pair: the job's rows of one call, shared by the pairs.
            let per_pair = (rows as f64 / sample.len() as f64 / pairs as f64).round() as usize;
            let pattern = if args.fabric == FabricKind::Cuda {
                Pattern::DeviceCopy(pairs)
            } else {
                Pattern::Pairs(pairs)
            };
            measurements.push(Measurement {
                bytes: per_pair.max(1) * row,
                pattern,
                policy: None,
            });
        }
        for pattern in [Pattern::Pairs(pairs), Pattern::Exchange] {
            let policies = std::iter::once(None).chain(FLOOR_POLICIES.map(Some));
            measurements.extend(policies.map(|policy| Measurement {
                bytes: row,
                pattern,
                policy,
            }));
        }
        Ok(Plan {
            row,
            measurements,
            exchange_rows: m.max(n),
            warmup: args.warmup.max(3),
            iters: args.iters,
            chunk: (args.chunk_bytes / row).max(1) * row,
            copies: DEVICE_COPIES,
        })
    }

    /// What the token counts' limit is: `"device-to-device copy"` or `"streaming"`.
    pub fn kind(&self) -> &'static str {
        if self.device_bytes() > 0 {
            "device-to-device copy"
        } else {
            "streaming"
        }
    }

    /// Bytes of the largest [`Pattern::DeviceCopy`] measurement (0: none): the size of each
    /// of the two device buffers of a [`DeviceCopy`].
    pub fn device_bytes(&self) -> usize {
        self.measurements
            .iter()
            .filter(|m| matches!(m.pattern, Pattern::DeviceCopy(_)))
            .map(|m| m.bytes)
            .max()
            .unwrap_or(0)
    }

    /// Whether `rank` copies on its device in the plan's [`Pattern::DeviceCopy`] measurements.
    pub fn copies_on_device(&self, rank: usize) -> bool {
        self.measurements.iter().any(|m| match m.pattern {
            Pattern::DeviceCopy(p) => rank < p,
            _ => false,
        })
    }

    /// Window bytes every rank of the limit fabric needs (device copies need none).
    pub fn window_len(&self) -> usize {
        self.measurements
            .iter()
            .filter(|m| !matches!(m.pattern, Pattern::DeviceCopy(_)))
            .map(|m| m.bytes)
            .max()
            .unwrap_or(self.row)
            .max(self.exchange_rows * self.row)
    }

    fn rounds(&self) -> usize {
        self.warmup + self.iters
    }
}

/// Most measured rounds whose routing sets the plan's rows per call: a plan costs the same for
/// any `--iters` (all rounds up to this many, else this many spread evenly over them).
const PLAN_SAMPLE: usize = 256;

/// The measured rounds (after `warmup`, `iters` of them) a plan averages over: every one up to
/// [`PLAN_SAMPLE`], else [`PLAN_SAMPLE`] spread evenly; at least one.
fn sampled_rounds(warmup: usize, iters: usize) -> Vec<usize> {
    let n = iters.clamp(1, PLAN_SAMPLE);
    (0..n)
        .map(|j| warmup + (j as u128 * iters as u128 / n as u128) as usize)
        .collect()
}

/// Rows one attention rank sends for `topk_idx` (`[T, K]`): one per (token, destination rank).
fn destination_rows(args: &Args, topk_idx: &[i32]) -> usize {
    let (n, e) = (args.experts, args.num_experts);
    let mut seen = vec![usize::MAX; n];
    let mut rows = 0;
    for (t, ids) in topk_idx.chunks(args.topk).enumerate() {
        for &id in ids {
            if id < 0 {
                continue;
            }
            let d = id as usize * n / e;
            if seen[d] != t {
                seen[d] = t;
                rows += 1;
            }
        }
    }
    rows
}

/// Words recorded per rank per iteration: `[start, reader done, end]` in ns (0 when not this
/// rank's part); for a [`Pattern::DeviceCopy`], the copying rank's `[start, copies done,
/// copies back done]`.
pub const WORDS: usize = 3;

/// A barrier through the fabric's signals: everyone signals rank 0, rank 0 releases everyone.
fn barrier(f: &dyn Fabric, epoch: u64, timeout: Duration) -> xccl::Result<()> {
    let (rank, size) = (f.rank(), f.world_size());
    let deadline = deadline_after(timeout);
    if rank == 0 {
        for r in 1..size {
            f.wait_signal(ARRIVE + r, r, "limit barrier", deadline, &|v| v >= epoch)?;
        }
        for r in 1..size {
            f.signal(r, release_slot(size), epoch)?;
        }
    } else {
        f.signal(0, ARRIVE + rank, epoch)?;
        f.wait_signal(release_slot(size), 0, "limit barrier", deadline, &|v| {
            v >= epoch
        })?;
    }
    Ok(())
}

/// Writes `src` into `peer`'s window from offset 0 in chunks, signalling `base + chunks done`.
fn stream_out(
    f: &dyn Fabric,
    peer: usize,
    src: &[u8],
    chunk: usize,
    base: u64,
) -> xccl::Result<u64> {
    let mut n = 0u64;
    for (i, part) in src.chunks(chunk).enumerate() {
        f.put(peer, i * chunk, part)?;
        n += 1;
        f.signal(peer, PROGRESS, base + n)?;
    }
    Ok(base + n)
}

/// Copies `dst.len()` bytes out of this rank's window as `peer` signals each chunk.
fn stream_in(
    f: &dyn Fabric,
    peer: usize,
    dst: &mut [u8],
    chunk: usize,
    base: u64,
    timeout: Duration,
) -> xccl::Result<u64> {
    let me = f.rank();
    let chunks = dst.len().div_ceil(chunk) as u64;
    let deadline = deadline_after(timeout);
    let mut got = 0u64;
    while got < chunks {
        let mut seen = 0;
        f.wait_until(deadline, &mut || {
            seen = f.signal_value(PROGRESS);
            if seen > base + got {
                None
            } else {
                Some(Waiting::on(peer, "limit stream chunk"))
            }
        })?;
        let upto = (seen - base).min(chunks);
        let from = got as usize * chunk;
        let to = (upto as usize * chunk).min(dst.len());
        f.get(me, from, &mut dst[from..to])?;
        got = upto;
    }
    Ok(base + chunks)
}

/// Puts `row` into every rank of `to`, at this rank's place among the ranks of its role
/// (`place` rows in), and signals each with `epoch`.
fn exchange_out(
    f: &dyn Fabric,
    to: std::ops::Range<usize>,
    row: &[u8],
    place: usize,
    epoch: u64,
) -> xccl::Result<()> {
    let (me, size) = (f.rank(), f.world_size());
    for peer in to {
        f.put(peer, place * row.len(), row)?;
        f.signal(peer, exchange_slot(size, me), epoch)?;
    }
    Ok(())
}

/// Waits for the `epoch` signal of every rank of `from` (in one wait, naming the first missing
/// one), then copies their rows (one each, `row` bytes, in rank order) out of this rank's window.
fn exchange_in(
    f: &dyn Fabric,
    from: std::ops::Range<usize>,
    dst: &mut [u8],
    row: usize,
    epoch: u64,
    timeout: Duration,
) -> xccl::Result<()> {
    let size = f.world_size();
    let deadline = deadline_after(timeout);
    let mut next = from.start;
    f.wait_until(deadline, &mut || {
        while next < from.end && f.signal_value(exchange_slot(size, next)) >= epoch {
            next += 1;
        }
        (next < from.end).then_some(Waiting::on(next, "limit exchange row"))
    })?;
    let len = from.len() * row;
    f.get(f.rank(), 0, &mut dst[..len])
}

/// Two buffers of one device and a stream of their own: where a rank times the
/// [`Pattern::DeviceCopy`] measurements.
pub struct DeviceCopy {
    a: DeviceMemory,
    b: DeviceMemory,
    stream: Stream,
    rank: usize,
}

impl DeviceCopy {
    /// Allocates two buffers of `bytes` (at least 1) on `device` for rank `rank`, and a stream.
    pub fn new(device: &Device, bytes: usize, rank: usize) -> xccl::Result<Self> {
        let what = |which: &str| format!("rank {rank}'s device-copy limit ({which} buffer)");
        let a = DeviceMemory::alloc(device, bytes.max(1), || what("source"))?;
        let b = DeviceMemory::alloc(device, bytes.max(1), || what("destination"))?;
        Ok(DeviceCopy {
            a,
            b,
            stream: Stream::new(device)?,
            rank,
        })
    }

    /// Queues `copies` copies of `bytes` from one buffer into the other (`back`: the other
    /// way), then waits once (bounded by `timeout`) until the device ran them all.
    fn copy(&self, bytes: usize, copies: usize, back: bool, timeout: Duration) -> xccl::Result<()> {
        let (dst, src) = if back {
            (&self.a, &self.b)
        } else {
            (&self.b, &self.a)
        };
        let what = || {
            format!(
                "rank {}'s device-to-device copy limit ({bytes} bytes)",
                self.rank
            )
        };
        for _ in 0..copies {
            self.stream.copy(dst, 0, src, 0, bytes, &what)?;
        }
        self.stream
            .synchronize(deadline_after(timeout), self.rank, &what)
    }
}

/// One rank's run of a [`Plan`], block by block ([`crate::run::block_rounds`]): block `b` of
/// every measurement at a time, so the limits' blocks can alternate with the calls'.
pub struct LimitRun<'a> {
    args: &'a Args,
    plan: &'a Plan,
    /// The run's own wait policy (measurements without one of their own use it).
    own: WaitPolicy,
    src: Vec<u8>,
    dst: Vec<u8>,
    /// Per measurement, per round, [`WORDS`] words.
    words: Vec<u64>,
    /// Running chunk counts of the stream into this rank and out of it.
    seq_in: u64,
    seq_out: u64,
    /// The last barrier's (and exchange's) epoch.
    epoch: u64,
    /// Where this rank times its [`Pattern::DeviceCopy`] measurements, if it has any.
    device: Option<DeviceCopy>,
}

impl<'a> LimitRun<'a> {
    /// The run of `plan` on rank `rank`, before its first block.
    pub fn new(rank: usize, args: &'a Args, plan: &'a Plan) -> Self {
        let max = plan.window_len();
        LimitRun {
            args,
            plan,
            own: run_policy(args),
            src: (0..max).map(|i| (i * 31 + rank) as u8).collect(),
            dst: vec![0u8; max],
            words: vec![0; plan.measurements.len() * plan.rounds() * WORDS],
            seq_in: 0,
            seq_out: 0,
            epoch: 0,
            device: None,
        }
    }

    /// Gives the run the device buffers its [`Pattern::DeviceCopy`] measurements copy between
    /// (needed on every rank [`Plan::copies_on_device`] names).
    pub fn set_device(&mut self, device: DeviceCopy) {
        self.device = Some(device);
    }

    /// Runs block `b` (of [`Args::num_blocks`]) of every measurement. Every rank of the
    /// fabric must run the same blocks in the same order.
    pub fn block(&mut self, f: &mut dyn LimitFabric, b: usize) -> xccl::Result<()> {
        let (args, plan) = (self.args, self.plan);
        let (rank, m) = (f.rank(), args.attention);
        let timeout = args.timeout();
        let its = block_rounds(plan.warmup, plan.iters, args.num_blocks(), b);
        for (mi, meas) in plan.measurements.iter().enumerate() {
            f.set_policy(meas.policy.map_or(self.own, |p| p.1));
            let f: &dyn Fabric = f;
            // Which side this rank is, if any.
            let (writers, readers) = meas.ranks(m, args.experts);
            let writer_first = writers.contains(&rank);
            let reader_first = readers.contains(&rank);
            for it in its.clone() {
                self.epoch += 1;
                let epoch = self.epoch;
                barrier(f, epoch, timeout)?;
                let mut w = [0u64; WORDS];
                if let Pattern::DeviceCopy(_) = meas.pattern {
                    if writer_first {
                        let dev = self.device.as_ref().ok_or_else(|| {
                            xccl::Error::invalid(format!(
                                "rank {rank}: the device-to-device copy limit has no device"
                            ))
                        })?;
                        w[0] = now_ns();
                        dev.copy(meas.bytes, plan.copies, false, timeout)?;
                        w[1] = now_ns();
                        dev.copy(meas.bytes, plan.copies, true, timeout)?;
                        w[2] = now_ns();
                    }
                    self.record(mi, it, w);
                    continue;
                }
                let (src, dst) = (&self.src[..meas.bytes], &mut self.dst);
                if meas.pattern == Pattern::Exchange {
                    if writer_first {
                        w[0] = now_ns();
                        exchange_out(f, readers.clone(), src, rank, epoch)?;
                        exchange_in(f, readers.clone(), dst, src.len(), epoch, timeout)?;
                        w[2] = now_ns();
                    } else if reader_first {
                        exchange_in(f, writers.clone(), dst, src.len(), epoch, timeout)?;
                        w[1] = now_ns();
                        exchange_out(f, writers.clone(), src, rank - m, epoch)?;
                    }
                } else if writer_first {
                    let peer = m + rank;
                    w[0] = now_ns();
                    self.seq_out = stream_out(f, peer, src, plan.chunk, self.seq_out)?;
                    let dst = &mut dst[..meas.bytes];
                    self.seq_in = stream_in(f, peer, dst, plan.chunk, self.seq_in, timeout)?;
                    w[2] = now_ns();
                } else if reader_first {
                    let peer = rank - m;
                    let dst = &mut dst[..meas.bytes];
                    self.seq_in = stream_in(f, peer, dst, plan.chunk, self.seq_in, timeout)?;
                    w[1] = now_ns();
                    self.seq_out = stream_out(f, peer, src, plan.chunk, self.seq_out)?;
                }
                self.record(mi, it, w);
            }
        }
        f.set_policy(self.own);
        Ok(())
    }

    /// Stores the words of round `it` of measurement `mi`.
    fn record(&mut self, mi: usize, it: usize, w: [u64; WORDS]) {
        let at = (mi * self.plan.rounds() + it) * WORDS;
        self.words[at..at + WORDS].copy_from_slice(&w);
    }

    /// Ends the run (a last barrier, so no rank leaves while another still reads its window)
    /// and returns this rank's words (per measurement, per round, [`WORDS`] each).
    pub fn finish(mut self, f: &mut dyn LimitFabric) -> xccl::Result<Vec<u64>> {
        self.epoch += 1;
        barrier(f, self.epoch, self.args.timeout())?;
        Ok(self.words)
    }
}

/// The wait policy of the run's ranks ([`WaitPolicy::for_ranks_on_host`]).
pub fn run_policy(args: &Args) -> WaitPolicy {
    WaitPolicy::for_ranks_on_host(args.world_size())
}

/// One floor of a run: its one-row measurements under every policy and the fastest of them.
#[derive(Clone, Debug, PartialEq)]
pub struct Floor {
    /// The fastest round trip (p50) of the measurements.
    pub best: Limit,
    /// Every measurement, by policy (`run`: the run's own, then [`FLOOR_POLICIES`]).
    pub by_policy: Vec<(&'static str, Limit)>,
}

/// The floors of a run: the exchange floor ([`Pattern::Exchange`], the one T=1 calls are set
/// against) and the pair floor ([`Pattern::Pairs`]), each the fastest of its policies.
pub fn floors(plan: &Plan, limits: &[Limit]) -> Option<(Floor, Floor)> {
    // The plan ends with the pair floor's measurements, then the exchange floor's.
    let per = 1 + FLOOR_POLICIES.len();
    let end = plan.measurements.len().min(limits.len());
    let of = |range: std::ops::Range<usize>| {
        let by_policy: Vec<(&'static str, Limit)> = range
            .map(|i| {
                (
                    plan.measurements[i].policy.map_or("run", |p| p.0),
                    limits[i],
                )
            })
            .collect();
        let best = by_policy
            .iter()
            .map(|p| p.1)
            .min_by(|a, b| a.p50_us[2].total_cmp(&b.p50_us[2]))?;
        Some(Floor { best, by_policy })
    };
    let exchange = of(end.checked_sub(per)?..end)?;
    let pairs = of(end.checked_sub(2 * per)?..end - per)?;
    Some((exchange, pairs))
}

/// The limit of one measurement, in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Limit {
    /// Bytes per pair each way.
    pub bytes: usize,
    /// Median and 99th percentile of `a2e`, `e2a` and `roundtrip`, in microseconds.
    pub p50_us: [f64; 3],
    /// See `p50_us`.
    pub p99_us: [f64; 3],
}

/// Every measurement's limit from every rank's words (in rank order).
pub fn aggregate(args: &Args, plan: &Plan, words: &[Vec<u64>]) -> Vec<Limit> {
    let m = args.attention;
    let rounds = plan.rounds();
    plan.measurements
        .iter()
        .enumerate()
        .map(|(k, meas)| {
            let at = |r: usize, it: usize, w: usize| words[r][(k * rounds + it) * WORDS + w];
            let mut lat: [Vec<f64>; 3] = Default::default();
            let (writers, readers) = meas.ranks(m, args.experts);
            for it in plan.warmup..rounds {
                if let Pattern::DeviceCopy(_) = meas.pattern {
                    // Per copy, the slowest copying rank.
                    let per_copy = |a: usize, b: usize| {
                        let ns = writers
                            .clone()
                            .map(|r| at(r, it, b).saturating_sub(at(r, it, a)));
                        ns.max().unwrap_or(0) as f64 / plan.copies.max(1) as f64 / 1e3
                    };
                    lat[0].push(per_copy(0, 1));
                    lat[1].push(per_copy(1, 2));
                    lat[2].push(per_copy(0, 2));
                    continue;
                }
                let (writers, readers) = (writers.clone(), readers.clone());
                let start = writers.clone().map(|r| at(r, it, 0)).min().unwrap_or(0);
                let end = writers.map(|r| at(r, it, 2)).max().unwrap_or(0);
                let read_end = readers.clone().map(|r| at(r, it, 1)).max().unwrap_or(0);
                let back_start = readers.map(|r| at(r, it, 1)).min().unwrap_or(0);
                let us = |a: u64, b: u64| b.saturating_sub(a) as f64 / 1e3;
                lat[0].push(us(start, read_end));
                lat[1].push(us(back_start, end));
                lat[2].push(us(start, end));
            }
            let mut out = Limit {
                bytes: meas.bytes,
                ..Limit::default()
            };
            for (i, mut l) in lat.into_iter().enumerate() {
                l.sort_by(f64::total_cmp);
                out.p50_us[i] = percentile(&l, 0.5);
                out.p99_us[i] = percentile(&l, 0.99);
            }
            out
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn args(extra: &[&str]) -> Args {
        let mut v = vec!["xccl-bench"];
        v.extend_from_slice(extra);
        Args::parse_from(v)
    }

    /// Found by review: the plan made every measured round's routing, so `--iters 100000000`
    /// spent more than 15 s before the first call.
    #[test]
    fn a_plan_costs_the_same_for_any_iteration_count() {
        let few = Plan::of(&args(&["-a", "2", "-e", "2", "-t", "64", "--iters", "256"])).unwrap();
        let start = std::time::Instant::now();
        let many = ["-a", "2", "-e", "2", "-t", "64", "--iters", "100000000"];
        let many = Plan::of(&args(&many)).unwrap();
        assert!(
            start.elapsed() < std::time::Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
        assert_eq!(many.iters, 100_000_000);
        assert_eq!(few.measurements.len(), many.measurements.len());
        assert_eq!(sampled_rounds(5, 3), vec![5, 6, 7]);
        let spread = sampled_rounds(1, 1_000_000);
        assert_eq!(
            (spread.len(), spread[0], spread[255]),
            (256, 1, 1 + 996_093)
        );
    }

    /// Runs the whole plan on this rank; returns its words (per measurement, per iteration,
    /// [`WORDS`] each). Every rank of the fabric must call it.
    fn run(f: &mut dyn LimitFabric, args: &Args, plan: &Plan) -> xccl::Result<Vec<u64>> {
        let mut run = LimitRun::new(f.rank(), args, plan);
        for b in 0..args.num_blocks() {
            run.block(f, b)?;
        }
        run.finish(f)
    }

    /// Runs the plan alone (no calls between its blocks) on threads over a local fabric; returns
    /// every rank's words in rank order.
    fn run_local(args: &Args, plan: &Plan) -> Result<Vec<Vec<u64>>, String> {
        let size = args.world_size();
        // SAFETY: a world of its own, used only by the plan, whose ranks order every access to
        // a window range by a signal they waited for (module docs); no communicator uses it.
        let mut fabrics = unsafe {
            xccl::fabric::local::LocalFabric::create(&vec![plan.window_len(); size], slots(size))
        }
        .map_err(|e| e.to_string())?;
        std::thread::scope(|s| {
            let handles: Vec<_> = fabrics
                .iter_mut()
                .map(|f| {
                    s.spawn(move || {
                        let r = run(f, args, plan);
                        if let Err(e) = &r {
                            f.abort(&format!("xccl-bench limit: {e}"));
                        }
                        r
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| match h.join() {
                    Ok(r) => r.map_err(|e| format!("limit run: {e}")),
                    Err(_) => Err("a limit thread panicked".to_string()),
                })
                .collect()
        })
    }

    #[test]
    fn plan_moves_the_calls_bytes_in_whole_rows_and_ends_with_both_floors_under_every_policy() {
        let a = args(&[
            "-a",
            "2",
            "-e",
            "3",
            "--num-experts",
            "9",
            "-k",
            "3",
            "--hidden",
            "16",
            "-t",
            "1,8",
            "--iters",
            "4",
            "--warmup",
            "1",
            "--dtype",
            "f32",
        ]);
        let p = Plan::of(&a).unwrap();
        assert_eq!(p.row, 64);
        let per = 1 + FLOOR_POLICIES.len();
        assert_eq!(p.measurements.len(), 2 + 2 * per);
        for m in &p.measurements {
            assert_eq!(m.bytes % p.row, 0);
        }
        assert_eq!(p.measurements[0].pattern, Pattern::Pairs(2));
        let policies = std::iter::once(None).chain(FLOOR_POLICIES.map(Some));
        for (i, policy) in policies.enumerate() {
            let pair = p.measurements[2 + i];
            assert_eq!(
                (pair.bytes, pair.pattern, pair.policy),
                (64, Pattern::Pairs(2), policy)
            );
            let ex = p.measurements[2 + per + i];
            assert_eq!(
                (ex.bytes, ex.pattern, ex.policy),
                (64, Pattern::Exchange, policy)
            );
        }
        // 8 tokens, each to 1 to 3 expert ranks: between 8 and 24 rows per attention rank,
        // shared by 2 pairs (the job's rows: 16 to 48).
        assert!((8 * 64..=24 * 64).contains(&p.measurements[1].bytes));
        // The exchange window holds a row from each of the 3 expert ranks.
        assert!(p.window_len() >= 3 * 64);
    }

    #[test]
    fn cuda_plan_copies_on_the_attention_ranks_devices_and_counts_the_slowest_per_copy() {
        let a = args(&[
            "--fabric",
            "cuda",
            "-a",
            "2",
            "-e",
            "3",
            "--num-experts",
            "6",
            "-k",
            "2",
            "--hidden",
            "16",
            "-t",
            "4",
            "--iters",
            "2",
            "--warmup",
            "1",
        ]);
        let p = Plan::of(&a).unwrap();
        assert_eq!(p.kind(), "device-to-device copy");
        assert_eq!(p.measurements[0].pattern, Pattern::DeviceCopy(2));
        assert!(p.copies_on_device(0) && p.copies_on_device(1) && !p.copies_on_device(2));
        // The shm window holds only the floors' rows; the device buffers the copies' bytes.
        assert_eq!(p.window_len(), 3 * p.row);
        assert_eq!(p.device_bytes(), p.measurements[0].bytes);
        // Rank 0 takes 160 ns per copy there and 320 back, rank 1 twice that: rank 1 counts.
        let rounds = p.warmup + p.iters;
        let c = p.copies as u64;
        let mut words = vec![vec![0u64; p.measurements.len() * rounds * WORDS]; 5];
        for (r, w) in words.iter_mut().enumerate().take(2) {
            for it in 0..rounds {
                let k = r as u64 + 1;
                let start = 1_000_000 * (it as u64 + 1);
                w[it * WORDS..(it + 1) * WORDS].copy_from_slice(&[
                    start,
                    start + 160 * k * c,
                    start + 480 * k * c,
                ]);
            }
        }
        let l = aggregate(&a, &p, &words)[0];
        assert_eq!(l.p50_us, [0.32, 0.64, 0.96]);
        assert_eq!(l.p99_us, [0.32, 0.64, 0.96]);
        assert_eq!(Plan::of(&args(&[])).unwrap().kind(), "streaming");
    }

    #[test]
    fn destination_rows_dedup_per_rank() {
        let a = args(&["-a", "1", "-e", "2", "--num-experts", "4", "-k", "2"]);
        // Token 0: experts 0, 1 -> rank 0 once; token 1: experts 0, 3 -> two ranks; -1 skipped.
        assert_eq!(destination_rows(&a, &[0, 1, 0, 3, -1, 2]), 4);
    }

    #[test]
    fn local_limit_run_measures_every_point() {
        let a = args(&[
            "--fabric",
            "local",
            "-a",
            "2",
            "-e",
            "1",
            "--num-experts",
            "4",
            "-k",
            "2",
            "--hidden",
            "32",
            "-t",
            "1,4",
            "--iters",
            "3",
            "--warmup",
            "1",
            "--chunk-bytes",
            "64",
        ]);
        let plan = Plan::of(&a).unwrap();
        let words = run_local(&a, &plan).unwrap();
        let limits = aggregate(&a, &plan, &words);
        assert_eq!(limits.len(), 2 + 2 * (1 + FLOOR_POLICIES.len()));
        let (exchange, pairs) = floors(&plan, &limits).unwrap();
        for f in [&exchange, &pairs] {
            let names: Vec<_> = f.by_policy.iter().map(|p| p.0).collect();
            assert_eq!(names, ["run", "spin", "yield", "sleep"]);
            assert!(f
                .by_policy
                .iter()
                .all(|p| p.1.p50_us[2] >= f.best.p50_us[2]));
        }
        for l in limits {
            assert!(l.p50_us[2] > 0.0 && l.p99_us[2] >= l.p50_us[2], "{l:?}");
        }
    }
}
