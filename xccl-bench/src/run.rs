//! What every rank does: the timed iterations of each token count, in `--blocks` blocks that
//! alternate with the limits' ([`run_rank`]), then (with `--check`) the same rounds again
//! through [`xccl::testing::harness`].

use std::ops::Range;
use std::sync::Arc;
use xccl::fabric::WaitCounters;

use indicatif::ProgressBar;
use xccl::cuda::{DeviceMemory, DeviceRegion, Stream};
use xccl::moe::dtype::slice_from_f32;
use xccl::testing::harness::{
    attention_round_with, expert_round, expert_round_device, expert_round_tokens_with,
    expert_round_view, Buffers, Workload,
};
use xccl::testing::reference::RankInput;
use xccl::{Communicator, Element, ExpertBatch, MoeConfig, Role, Stats, TokenBatch, Topology};
use xccl::{DeviceSlice, DeviceSliceMut, Routing};

use crate::stats::accumulate;

use crate::cli::{Args, BufferKind, ExpertLayout};

/// Words recorded per rank per iteration: three timestamps (ns) and the rows this rank sent.
pub const WORDS: usize = 4;

/// The words of an attention rank that a DP domain left out of the call: a start later and an
/// end earlier than any real one, and no rows, so the aggregation ignores it.
pub const SKIPPED: [u64; WORDS] = [u64::MAX, u64::MAX, 0, 0];

/// The topology of the run: ranks `0..M` attention, `M..M+N` expert, experts in contiguous
/// blocks (`e` on expert index `e * N / E`), through `--relays` relays when given, in
/// `--domains` DP domains.
pub fn topology(args: &Args) -> xccl::Result<Topology> {
    let topo = Topology::contiguous(args.attention, args.experts, args.num_experts)?;
    let topo = match args.relays {
        Some(r) => topo.with_relays(Some(r))?,
        None => topo,
    };
    topo.with_domains(args.domains)
}

/// The MoE config of the run (sized for the largest token count).
pub fn moe_config(args: &Args) -> MoeConfig {
    let mut cfg = MoeConfig::new(args.hidden, args.dtype, args.topk, args.max_tokens());
    cfg.mode = args.mode;
    cfg.timeout = args.timeout();
    cfg.chunk_bytes = args.chunk_bytes;
    cfg.max_in_flight = args.in_flight;
    if args.domains > 1 {
        // Domains take turns with one call in flight (the library rejects more).
        cfg.max_in_flight = 1;
    }
    cfg
}

/// The workload of one token count.
pub fn workload(args: &Args, tokens: usize) -> Workload {
    Workload {
        seed: args.seed,
        tokens,
        vary: false,
        skew: args.skew,
        shared_experts: 0,
    }
}

/// Round number of iteration `it` of sweep point `sweep`, the `call`-th call of the run (from
/// 0): routing and hidden states derive from it. With `domains` DP domains it is congruent to
/// `call` modulo `domains`, so the workload gives tokens to the attention ranks of the call's
/// domain only (`Topology::in_call`); with one domain it is `sweep << 32 | it`.
pub fn round(sweep: usize, it: usize, call: u64, domains: usize) -> u64 {
    let d = domains.max(1) as u64;
    (((sweep as u64) << 32) | it as u64) * d + call % d
}

/// What one rank measured.
#[derive(Clone, Debug, Default)]
pub struct RankReport {
    /// Per sweep point, per iteration (warmup included), [`WORDS`] words:
    /// attention `[a2e_send start, a2e_send end, e2a_recv end, rows sent]`,
    /// expert `[a2e_recv end, e2a_send start, e2a_send end, rows received]`.
    pub words: Vec<u64>,
    /// Reference mismatches found by `--check` (empty when none or when not checking).
    pub mismatches: Vec<String>,
    /// Per sweep point, what this rank's communicator counted over its timed iterations
    /// (warmup included): `[A2E calls, E2A calls]` (`a2e_send`/`a2e_recv*` and
    /// `e2a_recv`/`e2a_send*`; a view's receive and reply count as E2A). Not in
    /// [`RankReport::encode`]: `--stats` gathers them ([`crate::stats`]).
    pub phases: Vec<[Stats; 2]>,
    /// Per sweep point, what this rank's waits counted over its timed iterations (barriers
    /// left out; [`xccl::Communicator::wait_counters`]). Not in [`RankReport::encode`]: gathered
    /// on their own ([`encode_waits`]).
    pub waits: Vec<WaitCounters>,
    /// Per sweep point, what this rank's timed calls cost its thread (barriers left out).
    /// Gathered with `waits`.
    pub costs: Vec<CallCost>,
}

/// What calls cost the thread that made them: CPU time and context switches
/// (`getrusage(RUSAGE_THREAD)`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallCost {
    /// User and system CPU time, ns (microsecond resolution).
    pub cpu_ns: u64,
    /// Context switches where the thread blocked (futex sleeps).
    pub voluntary_switches: u64,
    /// Context switches where the thread stayed runnable (preemptions and `sched_yield`s that
    /// ran another task).
    pub involuntary_switches: u64,
}

impl CallCost {
    /// This thread's totals so far (zeros if `getrusage` fails, which it does not on Linux).
    pub fn now() -> CallCost {
        use nix::sys::resource::{getrusage, UsageWho};
        let Ok(u) = getrusage(UsageWho::RUSAGE_THREAD) else {
            return CallCost::default();
        };
        let ns = |t: nix::sys::time::TimeVal| {
            t.tv_sec() as u64 * 1_000_000_000 + t.tv_usec() as u64 * 1_000
        };
        CallCost {
            cpu_ns: ns(u.user_time()) + ns(u.system_time()),
            voluntary_switches: u.voluntary_context_switches() as u64,
            involuntary_switches: u.involuntary_context_switches() as u64,
        }
    }

    /// `self - earlier`, added to `total`.
    fn add_since(&self, earlier: &CallCost, total: &mut CallCost) {
        total.cpu_ns += self.cpu_ns.saturating_sub(earlier.cpu_ns);
        total.voluntary_switches += self
            .voluntary_switches
            .saturating_sub(earlier.voluntary_switches);
        total.involuntary_switches += self
            .involuntary_switches
            .saturating_sub(earlier.involuntary_switches);
    }
}

/// Words of one point's [`WaitCounters`] and [`CallCost`] in [`encode_waits`].
const WAIT_WORDS: usize = 12;

/// Serialises a rank's per-point wait counters and call costs for the bootstrap allgather.
pub fn encode_waits(report: &RankReport) -> Vec<u8> {
    report
        .waits
        .iter()
        .zip(&report.costs)
        .flat_map(|(w, c)| {
            [
                w.waits,
                w.polls,
                w.yields,
                w.slow_yields,
                w.sleeps,
                w.timed_wakes,
                w.wake_ns,
                w.spin_ns,
                c.cpu_ns,
                c.voluntary_switches,
                c.involuntary_switches,
                w.restarts,
            ]
        })
        .flat_map(u64::to_le_bytes)
        .collect()
}

/// Inverse of [`encode_waits`]: the waits and costs of `report`.
pub fn decode_waits(blob: &[u8], report: &mut RankReport) {
    let words: Vec<u64> = blob
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    for w in words.chunks_exact(WAIT_WORDS) {
        report.waits.push(WaitCounters {
            waits: w[0],
            polls: w[1],
            yields: w[2],
            slow_yields: w[3],
            sleeps: w[4],
            timed_wakes: w[5],
            restarts: w[11],
            wake_ns: w[6],
            spin_ns: w[7],
        });
        report.costs.push(CallCost {
            cpu_ns: w[8],
            voluntary_switches: w[9],
            involuntary_switches: w[10],
        });
    }
}

/// Adds `b` to `a` (the estimates are `b`'s).
fn add_waits(a: &mut WaitCounters, b: &WaitCounters) {
    a.waits += b.waits;
    a.polls += b.polls;
    a.yields += b.yields;
    a.slow_yields += b.slow_yields;
    a.sleeps += b.sleeps;
    a.timed_wakes += b.timed_wakes;
    a.restarts += b.restarts;
    a.wake_ns = b.wake_ns;
    a.spin_ns = b.spin_ns;
}

impl RankReport {
    /// Serialises for the bootstrap allgather.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + self.words.len() * 8);
        out.extend_from_slice(&(self.words.len() as u64).to_le_bytes());
        for w in &self.words {
            out.extend_from_slice(&w.to_le_bytes());
        }
        out.extend_from_slice(self.mismatches.join("\n").as_bytes());
        out
    }

    /// Inverse of [`RankReport::encode`].
    pub fn decode(blob: &[u8]) -> Result<Self, String> {
        let word = |i: usize| -> Result<u64, String> {
            blob.get(i * 8..i * 8 + 8)
                .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
                .ok_or_else(|| "truncated rank report".to_string())
        };
        let n = word(0)? as usize;
        let words = (1..=n).map(word).collect::<Result<Vec<_>, _>>()?;
        let text = String::from_utf8_lossy(&blob[(n + 1) * 8..]).into_owned();
        let mismatches = if text.is_empty() {
            Vec::new()
        } else {
            text.lines().map(str::to_owned).collect()
        };
        Ok(RankReport {
            words,
            mismatches,
            phases: Vec::new(),
            waits: Vec::new(),
            costs: Vec::new(),
        })
    }
}

/// CLOCK_MONOTONIC in nanoseconds: one clock for every process of the host.
pub fn now_ns() -> u64 {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .expect("CLOCK_MONOTONIC is always available");
    t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
}

/// The rounds (warmup included) of block `b` of `blocks` over `warmup` unmeasured then `iters`
/// measured rounds: the warmup is all in block 0, the measured rounds are shared evenly.
pub fn block_rounds(warmup: usize, iters: usize, blocks: usize, b: usize) -> Range<usize> {
    let edge = |b: usize| warmup + iters * b / blocks;
    let start = if b == 0 { 0 } else { edge(b) };
    start..edge(b + 1)
}

/// Runs every sweep point on this rank, dispatching on the dtype: the rounds of every point in
/// [`Args::num_blocks`] blocks, and after block `b` of every point, `between(b)` (the limits'
/// block `b`), so the two alternate.
/// The device buffers of a run on `--fabric cuda`: the calls take and return GPU memory, as an
/// engine's would (its tokens, routing and outputs on the GPU). Allocated once per run on the
/// communicator's device; the routing of each call is written into them before its barrier
/// (untimed, as a router on the GPU writes it).
struct DeviceBufs {
    stream: Stream,
    /// Attention: the hidden states (filled once), the outputs, the routing.
    x: DeviceMemory,
    out: DeviceMemory,
    idx: DeviceMemory,
    weights: DeviceMemory,
    /// Expert: the rows received (expert-major or token-major), replied as they are.
    rows: DeviceMemory,
}

impl DeviceBufs {
    /// For `comm`'s device, sized for `max_t` tokens of `x` (attention) or the most rows a
    /// receive may bring (expert).
    fn new<T: Element>(comm: &Communicator, x: &[T], max_t: usize, k: usize) -> xccl::Result<Self> {
        let device = comm
            .cuda_device()
            .ok_or_else(|| xccl::Error::invalid("device buffers need --fabric cuda"))?
            .clone();
        let stream = Stream::new(&device)?;
        let size = T::DTYPE.size() * comm.config().hidden;
        let alloc =
            |len: usize| DeviceMemory::alloc(&device, len.max(1), || "xccl-bench rows".into());
        let rows = comm.max_expert_rows().max(comm.max_recv_tokens()) * size;
        let bufs = DeviceBufs {
            x: alloc(std::mem::size_of_val(x))?,
            out: alloc(std::mem::size_of_val(x))?,
            idx: alloc(max_t * k * 4)?,
            weights: alloc(max_t * k * 4)?,
            rows: alloc(rows)?,
            stream,
        };
        bufs.write(&bufs.x, bytemuck::cast_slice(x))?;
        Ok(bufs)
    }

    /// Writes `bytes` at the start of `mem` (waits for it).
    fn write(&self, mem: &DeviceMemory, bytes: &[u8]) -> xccl::Result<()> {
        let deadline = xccl::fabric::deadline_after(std::time::Duration::from_secs(60));
        self.stream.write(mem, 0, bytes, deadline, usize::MAX, &|| {
            "xccl-bench routing".into()
        })
    }
}

/// The first `len` bytes of `mem`, lent for reading.
fn lend(mem: &DeviceMemory, len: usize) -> xccl::Result<DeviceSlice<'_>> {
    mem.as_slice()
        .range(0..len)
        .ok_or_else(|| xccl::Error::invalid("a device buffer of the bench is too short"))
}

/// The first `len` bytes of `mem`, lent for writing.
fn lend_mut(mem: &mut DeviceMemory, len: usize) -> xccl::Result<DeviceSliceMut<'_>> {
    mem.as_slice_mut()
        .range(0..len)
        .ok_or_else(|| xccl::Error::invalid("a device buffer of the bench is too short"))
}

pub fn run_rank(
    comm: &mut Communicator,
    args: &Args,
    progress: Option<&ProgressBar>,
    between: &mut dyn FnMut(usize) -> xccl::Result<()>,
) -> xccl::Result<RankReport> {
    match args.dtype {
        xccl::DType::BF16 => run_typed::<half::bf16>(comm, args, progress, between),
        xccl::DType::F16 => run_typed::<half::f16>(comm, args, progress, between),
        xccl::DType::F32 => run_typed::<f32>(comm, args, progress, between),
    }
}

fn run_typed<T: Element>(
    comm: &mut Communicator,
    args: &Args,
    progress: Option<&ProgressBar>,
    between: &mut dyn FnMut(usize) -> xccl::Result<()>,
) -> xccl::Result<RankReport> {
    let topo = Arc::new(comm.topology().clone());
    let (rank, hidden, k) = (comm.rank(), args.hidden, args.topk);
    let mut report = RankReport::default();
    let mut batch = ExpertBatch::new();
    let mut tokens_batch = TokenBatch::new();
    let max_t = args.max_tokens();
    // Payload contents do not change the traffic: one buffer of the largest size, from round 0.
    let x: Vec<T> = if comm.role() == Role::Attention {
        slice_from_f32(&workload(args, max_t).hidden_states(rank, 0, max_t, hidden))
    } else {
        Vec::new()
    };
    let mut out = vec![T::from_f32(0.0); x.len()];
    // `--fabric cuda`: the calls take and return GPU memory.
    // (`Args::validate` refused a registered buffer or a view there.)
    let mut dev = match comm.cuda_device() {
        Some(_) => Some(DeviceBufs::new(comm, &x, max_t, k)?),
        None => None,
    };
    let size = T::DTYPE.size() * hidden;
    // The routing of the next call (attention ranks).
    let (mut topk_idx, mut topk_weights) = (Vec::<i32>::new(), Vec::<f32>::new());
    let points: Vec<(usize, xccl::Quant, usize)> = args
        .quants()
        .into_iter()
        .flat_map(|q| {
            args.tokens
                .iter()
                .copied()
                .enumerate()
                .map(move |(s, t)| (s, q, t))
        })
        .collect();
    // Calls of the run so far: with DP domains the call decides which attention ranks take part.
    let mut call = 0u64;
    let domains = args.domains;
    let rounds = args.rounds();
    let blocks = args.num_blocks();
    // Per point: its words (every round's, in round order), phases, waits and costs.
    let mut words = vec![vec![0u64; rounds * WORDS]; points.len()];
    let mut phases = vec![<[Stats; 2]>::default(); points.len()];
    let mut waits = vec![WaitCounters::default(); points.len()];
    let mut costs = vec![CallCost::default(); points.len()];
    for b in 0..blocks {
        let its = block_rounds(args.warmup, args.iters, blocks, b);
        for (p, &(s, quant, tokens)) in points.iter().enumerate() {
            // Senders choose the wire format per call; every rank switches together.
            comm.set_a2e_quant(quant);
            comm.set_e2a_quant(quant);
            let wl = workload(args, tokens);
            let (phases, waits, cost) = (&mut phases[p], &mut waits[p], &mut costs[p]);
            for it in its.clone() {
                crate::launch::beat();
                // The call's routing is made into one buffer just before the call (before the
                // barrier, untimed), as a router writes it and as the MPI baseline reads it: an
                // input computed long before timed cache misses no engine has (they were most
                // of a T=1 dispatch layout inside the call). Made round by round, so the setup
                // does not grow with `--iters`.
                let input: Option<RankInput> = (comm.role() == Role::Attention)
                    .then(|| wl.input(&topo, k, rank, round(s, it, call, domains)));
                if let Some(inp) = &input {
                    topk_idx.clone_from(&inp.topk_idx);
                    topk_weights.clone_from(&inp.topk_weights);
                    if let Some(dev) = &dev {
                        dev.write(&dev.idx, bytemuck::cast_slice(&topk_idx))?;
                        dev.write(&dev.weights, bytemuck::cast_slice(&topk_weights))?;
                    }
                }
                comm.barrier()?;
                let waits_before = comm.wait_counters();
                let cost_before = CallCost::now();
                let this_call = call;
                call += 1;
                let w = match (comm.role(), dev.as_mut()) {
                    (Role::Attention, _) if !topo.in_call(rank, this_call) => SKIPPED,
                    (Role::Attention, Some(dev)) => {
                        let inp = input.as_ref().expect("an attention rank's input");
                        let (n, r) = (inp.num_tokens * size, topk_idx.len() * 4);
                        let t0 = now_ns();
                        let routing = Routing::Device {
                            topk_idx: lend(&dev.idx, r)?,
                            topk_weights: lend(&dev.weights, r)?,
                        };
                        let handle =
                            comm.a2e_send_device(lend(&dev.x, n)?, routing, &dev.stream)?;
                        let t1 = now_ns();
                        accumulate(&mut phases[0], comm.last_call_stats());
                        let rows = handle.total_rows() as u64;
                        comm.e2a_recv_device(&handle, lend_mut(&mut dev.out, n)?, &dev.stream)?;
                        let t2 = now_ns();
                        accumulate(&mut phases[1], comm.last_call_stats());
                        [t0, t1, t2, rows]
                    }
                    // The expert computation is the identity: the received rows go back.
                    (Role::Expert, Some(dev)) if args.layout == ExpertLayout::Expert => {
                        let len = dev.rows.len();
                        comm.a2e_recv_device(
                            &mut batch,
                            lend_mut(&mut dev.rows, len)?,
                            &dev.stream,
                        )?;
                        let t0 = now_ns();
                        accumulate(&mut phases[0], comm.last_call_stats());
                        let rows = lend(&dev.rows, batch.num_rows() * size)?;
                        comm.e2a_send_device(&batch, rows, &dev.stream)?;
                        let t2 = now_ns();
                        accumulate(&mut phases[1], comm.last_call_stats());
                        [t0, t0, t2, batch.num_tokens() as u64]
                    }
                    (Role::Expert, Some(dev)) => {
                        let (len, tb) = (dev.rows.len(), &mut tokens_batch);
                        let out = lend_mut(&mut dev.rows, len)?;
                        comm.a2e_recv_tokens_device(tb, out, &dev.stream, &mut |_, _| {})?;
                        let t0 = now_ns();
                        accumulate(&mut phases[0], comm.last_call_stats());
                        let rows = lend(&dev.rows, tokens_batch.num_tokens() * size)?;
                        comm.e2a_send_tokens_device(&tokens_batch, rows, &dev.stream)?;
                        let t2 = now_ns();
                        accumulate(&mut phases[1], comm.last_call_stats());
                        [t0, t0, t2, tokens_batch.num_tokens() as u64]
                    }
                    (Role::Attention, None) => {
                        let inp = input.as_ref().expect("an attention rank's input");
                        let n = inp.num_tokens * hidden;
                        let registered = args.buffers == BufferKind::Registered;
                        let t0 = now_ns();
                        if registered {
                            // The caller's copy into the registered input (and the credit wait
                            // inside `a2e_input`) is part of the A2E: these bytes move too.
                            comm.a2e_input::<T>()?[..n].copy_from_slice(&x[..n]);
                        }
                        let handle = if registered {
                            comm.a2e_send_input(inp.num_tokens, &topk_idx, &topk_weights)?
                        } else {
                            comm.a2e_send(&x[..n], &topk_idx, &topk_weights)?
                        };
                        let t1 = now_ns();
                        accumulate(&mut phases[0], comm.last_call_stats());
                        let rows = handle.total_rows() as u64;
                        comm.e2a_recv(&handle, &mut out[..n])?;
                        let t2 = now_ns();
                        accumulate(&mut phases[1], comm.last_call_stats());
                        [t0, t1, t2, rows]
                    }
                    // The expert computation is the identity: the received rows go back.
                    (Role::Expert, None) if args.layout == ExpertLayout::Expert => {
                        comm.a2e_recv(&mut batch)?;
                        let t0 = now_ns();
                        accumulate(&mut phases[0], comm.last_call_stats());
                        // One clock read between the calls (see the token layout's).
                        let t1 = t0;
                        comm.e2a_send(&batch, batch.rows::<T>()?)?;
                        let t2 = now_ns();
                        accumulate(&mut phases[1], comm.last_call_stats());
                        [t0, t1, t2, batch.num_tokens() as u64]
                    }
                    (Role::Expert, None) if args.layout == ExpertLayout::View => {
                        let mode = comm.config().mode;
                        let mut view = comm.a2e_recv_view()?;
                        let t0 = now_ns();
                        let n = view.num_tokens() as u64;
                        // The identity, computed straight into the reply rows.
                        view.e2a_send::<T>(mode, |_, input, output| output.copy_from_slice(input))?;
                        drop(view);
                        let t2 = now_ns();
                        // A view's receive and reply are counted together, as its E2A.
                        accumulate(&mut phases[1], comm.last_call_stats());
                        [t0, t0, t2, n]
                    }
                    (Role::Expert, None) if args.buffers == BufferKind::Registered => {
                        comm.a2e_recv_tokens(&mut tokens_batch, &mut |_, _| {})?;
                        let t0 = now_ns();
                        accumulate(&mut phases[0], comm.last_call_stats());
                        // The identity "computes" into the registered output: that copy (and the
                        // credit wait inside `e2a_output`) is part of the E2A, as the copy out of
                        // the caller's rows is with `--buffers copy`.
                        comm.e2a_output::<T>(&tokens_batch)?
                            .copy_from_slice(tokens_batch.rows::<T>()?);
                        comm.e2a_send_output(&tokens_batch)?;
                        let t2 = now_ns();
                        accumulate(&mut phases[1], comm.last_call_stats());
                        [t0, t0, t2, tokens_batch.num_tokens() as u64]
                    }
                    (Role::Expert, None) => {
                        comm.a2e_recv_tokens(&mut tokens_batch, &mut |_, _| {})?;
                        let t0 = now_ns();
                        accumulate(&mut phases[0], comm.last_call_stats());
                        // One clock read between the receive and the reply, which is on the
                        // round trip's critical path (the floor's ranks read none there): the
                        // E2A send phase includes the few ns of stats bookkeeping above.
                        let t1 = t0;
                        comm.e2a_send_tokens(&tokens_batch, tokens_batch.rows::<T>()?)?;
                        let t2 = now_ns();
                        accumulate(&mut phases[1], comm.last_call_stats());
                        [t0, t1, t2, tokens_batch.num_tokens() as u64]
                    }
                };
                if it >= args.warmup {
                    CallCost::now().add_since(&cost_before, cost);
                    add_waits(waits, &comm.wait_counters().since(&waits_before));
                }
                words[p][it * WORDS..(it + 1) * WORDS].copy_from_slice(&w);
                if let Some(pb) = progress {
                    pb.inc(1);
                }
            }
        }
        between(b)?;
    }
    report.words = words.concat();
    report.phases = phases;
    report.waits = waits;
    report.costs = costs;
    // `--check`: every point's rounds again, each result against the reference.
    let buffers = match (args.buffers, &dev) {
        (_, Some(_)) => Buffers::Device,
        (BufferKind::Copy, None) => Buffers::Copy,
        (BufferKind::Registered, None) => Buffers::Registered,
    };
    for &(s, quant, tokens) in points.iter().filter(|_| args.check) {
        comm.set_a2e_quant(quant);
        comm.set_e2a_quant(quant);
        let wl = workload(args, tokens);
        for it in 0..args.rounds() {
            let this_call = call;
            call += 1;
            let r = round(s, it, this_call, domains);
            let verdict = match comm.role() {
                Role::Attention if !topo.in_call(rank, this_call) => Ok(()),
                Role::Attention => attention_round_with::<T>(comm, &wl, r, buffers)?,
                Role::Expert if args.layout == ExpertLayout::Expert && dev.is_some() => {
                    expert_round_device::<T>(comm, &wl, r, &mut batch, true)?
                }
                Role::Expert if args.layout == ExpertLayout::Expert => {
                    expert_round::<T>(comm, &wl, r, &mut batch, true)?
                }
                Role::Expert if args.layout == ExpertLayout::View => {
                    expert_round_view::<T>(comm, &wl, r, true)?
                }
                Role::Expert => {
                    expert_round_tokens_with::<T>(comm, &wl, r, &mut tokens_batch, true, buffers)?
                }
            };
            if let Err(e) = verdict {
                report.mismatches.push(format!("tokens {tokens}: {e}"));
            }
            crate::launch::beat();
            if let Some(pb) = progress {
                pb.inc(1);
            }
        }
    }
    comm.barrier()?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_every_round_once_with_the_warmup_in_the_first() {
        for (warmup, iters, blocks) in [(20, 200, 5), (3, 7, 3), (0, 5, 5), (4, 1, 1), (2, 10, 4)] {
            let ranges: Vec<_> = (0..blocks)
                .map(|b| block_rounds(warmup, iters, blocks, b))
                .collect();
            assert_eq!(ranges[0].start, 0);
            assert!(ranges[0].end >= warmup);
            for w in ranges.windows(2) {
                assert_eq!(w[0].end, w[1].start, "{ranges:?}");
            }
            assert_eq!(ranges[blocks - 1].end, warmup + iters);
            // The measured rounds are shared evenly: sizes differ by at most one.
            let measured: Vec<usize> = ranges.iter().map(|r| r.end - r.start.max(warmup)).collect();
            let (lo, hi) = (
                measured.iter().min().unwrap(),
                measured.iter().max().unwrap(),
            );
            assert!(hi - lo <= 1, "{measured:?}");
        }
    }
}
