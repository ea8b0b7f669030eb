//! Command-line flags.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use xccl::{DType, TransferMode};

/// How the timings are defined; printed at the end of `--help`.
const TIMING_HELP: &str = "\
TIMING
  Every iteration starts with a barrier of all ranks (outside the timed region). Each rank then
  records CLOCK_MONOTONIC timestamps (one clock for every process of a host):
    attention: a2e_send start, a2e_send end, e2a_recv end
    expert:    a2e_recv end, e2a_send start, e2a_send end
  a2e       = max(expert a2e_recv end)    - min(attention a2e_send start)
  e2a       = max(attention e2a_recv end) - min(expert e2a_send start)
  roundtrip = max(attention e2a_recv end) - min(attention a2e_send start)
  The expert computation is the identity (received rows are sent back), so the round trip is
  communication only. p50/p99 are over the measured iterations (nearest rank).
  bytes_per_rank = mean over attention ranks and iterations of rows sent x hidden x dtype size
  (one row per (token, destination rank)); the round trip counts twice that.
  algbw = bytes_per_rank / p50. vs_memcpy = algbw / bandwidth of a memcpy of the same bytes
  between two buffers of that size, timed the same way (p50) on rank 0 after the run.
  With --buffers registered the caller's copy into a2e_input / e2a_output (and their credit
  waits) is part of the A2E / E2A.

LIMITS (same run, same fabric, same wait policy)
  limit(us): p50 of streaming the same bytes between processes: attention rank a writes them
  into expert rank M+a's window in --chunk-bytes chunks with a signal per chunk, the expert
  copies each chunk out, then streams them back the same way (min(M,N) pairs at once).
  With --fabric cuda, limit(us) is instead the device-to-device copy of the same bytes on the
  devices of those min(M,N) attention ranks (16 copies each way per sample, one synchronize,
  host clock); without a GPU that fabric runs on the stand-in driver (host memory), whose
  figures say nothing about GPU speed.
  vs_limit = limit p50 / xccl p50 (1.0 = at the limit). floor: one row each way between every
  attention and every expert rank (the graph of a T=1 call; at 1A:1E a ping-pong), fastest of
  the wait policies, printed beside the T=1 round trip; pair floor: one row per pair, min(M,N)
  independent pairs (the floor of earlier versions).

LAUNCHING
  Without a launcher, xccl-bench starts M+N rank processes itself (--fabric shm) or runs the
  ranks as threads (--fabric local). Under mpirun, srun or torchrun (OMPI_COMM_WORLD_SIZE,
  SLURM_NTASKS, WORLD_SIZE, PMI_SIZE) each launched process is one rank; the world size must be
  M+N. Rank 0 prints the report.";

/// `xccl-bench`: A2E, E2A and round-trip latency and bandwidth between M attention and N expert
/// ranks, nccl-tests style.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "xccl-bench",
    version,
    about,
    after_long_help = TIMING_HELP,
    args_conflicts_with_subcommands = true
)]
pub struct Args {
    /// A subcommand that runs no ranks: `memory` (window bytes per rank at a shape) or `model`
    /// (the cost model: calibration against measured runs and the CloudMatrix384 projection).
    #[command(subcommand)]
    pub command: Option<Command>,

    /// Attention ranks M.
    #[arg(long, short = 'a', default_value_t = 2)]
    pub attention: usize,

    /// Expert ranks N.
    #[arg(long, short = 'e', default_value_t = 2)]
    pub experts: usize,

    /// Routed experts E, placed in contiguous blocks over the expert ranks.
    #[arg(long, default_value_t = 64)]
    pub num_experts: usize,

    /// Experts per token K.
    #[arg(long, short = 'k', default_value_t = 8)]
    pub topk: usize,

    /// Hidden size H.
    #[arg(long, default_value_t = 7168)]
    pub hidden: usize,

    /// Tokens per attention rank per call; a comma-separated list is a sweep (`1,32,128,512`).
    #[arg(long, short = 't', value_delimiter = ',', default_value = "128")]
    pub tokens: Vec<usize>,

    /// Element type of the hidden states.
    #[arg(long, default_value = "bf16", value_parser = parse_dtype)]
    pub dtype: DType,

    /// Transport: `shm` (one process per rank, shared memory) or `local` (threads of one process).
    #[arg(long, value_enum, default_value_t = FabricKind::Shm)]
    pub fabric: FabricKind,

    /// Transfer mode of both directions.
    #[arg(long, default_value = "push", value_parser = parse_mode)]
    pub mode: TransferMode,

    /// Layout of what expert ranks receive: `token` (one row per token as it crossed the wire,
    /// E2A takes one reduced row per token), `expert` (rows expanded per local expert,
    /// expert-major; E2A reduces them with the gating weights) or `view` (token rows read in
    /// place, replies computed straight into the reply rows).
    #[arg(long, value_enum, default_value_t = ExpertLayout::Token)]
    pub layout: ExpertLayout,

    /// Send A2E and E2A through R relay ranks among the expert ranks (spread evenly; each
    /// attention rank uses one): M + R x N records per call instead of M x N. Push, caller
    /// buffers and the token or expert layout only.
    #[arg(long, value_name = "R")]
    pub relays: Option<usize>,

    /// Spread the rank processes over K network namespaces ("hosts", rank r in host r mod K)
    /// joined by veth pairs through a bridge namespace; each rank opens its ofi endpoint on its
    /// host's veth. `--fabric ofi` with this launcher only; needs root and iproute2. With
    /// `--stats` every link's records, rows and bytes are checked against the routing's plan.
    #[arg(long, value_name = "K")]
    pub netns: Option<usize>,

    /// The cost model's fabric parameters for the prediction printed under `--stats` (hop
    /// latency us, link GB/s, copy GB/s, record us). The defaults are libfabric's `fi_pingpong`
    /// over the tcp provider on the 2-core development machine (13 us for 64 bytes, 1.38 GB/s
    /// at 1 MiB), a copy bandwidth of 5 GB/s and 1 us per record.
    #[arg(long, value_delimiter = ',', num_args = 4, value_name = "LAT,LINK,COPY,REC",
          default_values_t = [13.0, 1.38, 5.0, 1.0])]
    pub model_params: Vec<f64>,

    /// Partition the attention ranks into D DP domains taking turns (call i belongs to domain
    /// i mod D; expert receive areas hold one domain). Needs D <= M; runs one call in flight.
    #[arg(long, value_name = "D", default_value_t = 1)]
    pub domains: usize,

    /// Print what every rank's communicator counted (records written and polled, relay
    /// forwards, window bytes, fan-out, the slowest peer and a straggler) and rank 0's per-peer
    /// table, beside the records formula; the sizes of each sweep point (records per A2E and
    /// E2A, fan-out, routing metadata bytes per token); all of it in the JSON too.
    #[arg(long)]
    pub stats: bool,

    /// Where rows come from and go to: `copy` (the caller's memory: `a2e_send`,
    /// `e2a_send_tokens`) or `registered` (buffers in the window: the attention rank writes x
    /// into `a2e_input` and expert ranks gather from it; the expert computes into `e2a_output`
    /// and attention ranks pull from it). Registered needs `--layout token`.
    #[arg(long, value_enum, default_value_t = BufferKind::Copy)]
    pub buffers: BufferKind,

    /// Bytes a sender writes between progress signals (receivers copy while senders write);
    /// the communicators raise it to the fabric's chunk floor (4 MiB over ofi's tcp provider).
    #[arg(long, default_value_t = xccl::moe::progress::CHUNK_BYTES, value_parser = clap::value_parser!(usize))]
    pub chunk_bytes: usize,

    /// Calls a communicator lets be in flight (`MoeConfig::max_in_flight`): the window holds
    /// this many buffers, which calls take in turn. The library's default is 2 (double
    /// buffering); a run of one call at a time can take 1, and then its calls touch the same
    /// memory as the streaming limit, which streams through one buffer. With `--domains` it
    /// is 1.
    #[arg(long, default_value_t = 2)]
    pub in_flight: usize,

    /// Measured iterations per token count.
    #[arg(long, default_value_t = 200)]
    pub iters: usize,

    /// Unmeasured iterations before them.
    #[arg(long, default_value_t = 20)]
    pub warmup: usize,

    /// Blocks the measured iterations of every token count, and of every limit measurement,
    /// run in: xccl's block b of every token count, then the limits' block b, alternating, so
    /// a slow spell of a shared machine slows xccl and its limits alike (1: all of xccl's
    /// iterations, then all of the limits', as before).
    #[arg(long, default_value_t = 5)]
    pub blocks: usize,

    /// Seed of the routing and the hidden states.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,

    /// Hot-expert routing: Zipf exponent S (P(expert e) ~ 1/(e+1)^S); uniform without it.
    #[arg(long, value_name = "S")]
    pub skew: Option<f64>,

    /// Rows on the wire: `none` (the dtype), `int8` (INT8 with a per-token scale, A2E and E2A),
    /// or `both` (the whole sweep without, then with INT8, in the same run and processes).
    #[arg(long, value_enum, default_value_t = QuantChoice::None)]
    pub quant: QuantChoice,

    /// Replay every iteration through `xccl::testing::harness` (reference expert, untimed) and compare
    /// with the reference; exit non-zero on any mismatch.
    #[arg(long)]
    pub check: bool,

    /// Write the results as JSON.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,

    /// Write an SVG plot of the sweep: p50 latency and algbw vs tokens (log scale), with the
    /// streaming limit and, with `--mpi-baseline`, the MPI baseline.
    #[arg(long, value_name = "PATH")]
    pub plot: Option<PathBuf>,

    /// Output of `benches/baselines/moe_alltoallv.c` (its `MPIBASE` lines, as `ci/mpi-baseline.sh`
    /// saves them) for the same routing: adds `mpi(us)` and `vs_mpi` to the table and JSON and
    /// the MPI lines to the plot.
    #[arg(long, value_name = "PATH")]
    pub mpi_baseline: Option<PathBuf>,

    /// Write the routing of every iteration (format in xccl-bench/README.md) so another program
    /// replays the same traffic.
    #[arg(long, value_name = "PATH")]
    pub routing_out: Option<PathBuf>,

    /// Only write `--routing-out` and exit (no ranks are started), so the MPI baseline can run
    /// first and its output be given to the measured run with `--mpi-baseline`.
    #[arg(long, requires = "routing_out")]
    pub routing_only: bool,

    /// Pinning of the rank processes this launcher starts (`--fabric shm`, no external
    /// launcher): `auto` pins rank r to the r-th allowed CPU when every rank has one (as
    /// `mpirun --bind-to core`) and leaves them unpinned when ranks outnumber CPUs (as
    /// `--bind-to none`); `core` always pins (round robin); `none` never does.
    #[arg(long, value_enum, default_value_t = Bind::Auto)]
    pub bind: Bind,

    /// Deadline in seconds of every wait and rendezvous step. The launcher kills every rank when
    /// one fails or when a running rank makes no progress for 3 x SECS + 10 s (liveness).
    #[arg(long, value_name = "SECS", default_value_t = 60.0)]
    pub timeout: f64,
}

/// Which wire formats a run measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum QuantChoice {
    /// Rows in the dtype.
    None,
    /// INT8 rows with a per-token f32 scale (A2E and E2A).
    Int8,
    /// Both, one sweep after the other.
    Both,
}

/// Which fabric carries the traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum FabricKind {
    /// Shared memory between processes of one host.
    Shm,
    /// Threads of one process.
    Local,
    /// libfabric (`XCCL_OFI_PROVIDER`, default `tcp;ofi_rxm`; `XCCL_OFI_ADDR` picks the interface).
    Ofi,
    /// Ascend NPUs through the CANN runtime (`libascendcl.so`, found through
    /// `ASCEND_HOME_PATH`); rank r uses device `LOCAL_RANK` when set, else r.
    Ascend,
    /// NVIDIA GPUs through the CUDA driver (`libcuda.so.1`, or `XCCL_CUDA_LIBRARY`), windows
    /// in device memory shared by CUDA IPC; rank r uses device `LOCAL_RANK` when set, else
    /// r % device count. Host buffers move through put/get. Its limit is the
    /// device-to-device copy of the same bytes.
    Cuda,
}

impl FabricKind {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            FabricKind::Shm => "shm",
            FabricKind::Local => "local",
            FabricKind::Ofi => "ofi",
            FabricKind::Ascend => "ascend",
            FabricKind::Cuda => "cuda",
        }
    }
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    DType::parse(s).map_err(|e| e.to_string())
}

/// CPU pinning of rank processes (see `--bind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Bind {
    /// Pin when ranks <= allowed CPUs.
    Auto,
    /// Pin rank r to allowed CPU r mod CPUs.
    Core,
    /// Never pin.
    None,
}

impl Bind {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Bind::Auto => "auto",
            Bind::Core => "core",
            Bind::None => "none",
        }
    }
}

/// Where rows come from and go to (see `--buffers`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BufferKind {
    /// The caller's own memory.
    Copy,
    /// Registered buffers in the fabric window.
    Registered,
}

impl BufferKind {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            BufferKind::Copy => "copy",
            BufferKind::Registered => "registered",
        }
    }
}

/// How expert ranks receive tokens (see `--layout`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ExpertLayout {
    /// `a2e_recv_tokens` + `e2a_send_tokens`: one row per (token, expert rank).
    Token,
    /// `a2e_recv` + `e2a_send`: one row per (token, local expert).
    Expert,
    /// `a2e_recv_view` + `TokenView::e2a_send`: rows read where they landed, replies written
    /// where they go.
    View,
}

impl ExpertLayout {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            ExpertLayout::Token => "token",
            ExpertLayout::Expert => "expert",
            ExpertLayout::View => "view",
        }
    }
}

fn parse_mode(s: &str) -> Result<TransferMode, String> {
    TransferMode::parse(s).map_err(|e| e.to_string())
}

impl Args {
    /// Checks values clap cannot; returns a message naming the flag.
    pub fn validate(&self) -> Result<(), String> {
        if self.attention == 0 || self.experts == 0 {
            return Err("--attention and --experts must be at least 1".into());
        }
        if self.num_experts == 0 || self.topk == 0 || self.hidden == 0 {
            return Err("--num-experts, --topk and --hidden must be at least 1".into());
        }
        if self.tokens.is_empty() {
            return Err("--tokens needs at least one value".into());
        }
        if self.iters == 0 {
            return Err("--iters must be at least 1".into());
        }
        if self.blocks == 0 {
            return Err("--blocks must be at least 1".into());
        }
        if !(1..=xccl::moe::config::MAX_IN_FLIGHT).contains(&self.in_flight) {
            return Err(format!(
                "--in-flight must be in 1..={}",
                xccl::moe::config::MAX_IN_FLIGHT
            ));
        }
        if let Some(r) = self.relays {
            if r == 0 || r > self.experts {
                return Err(format!(
                    "--relays must be in 1..={} (the expert ranks)",
                    self.experts
                ));
            }
            if self.mode != TransferMode::Push
                || self.buffers != BufferKind::Copy
                || self.layout == ExpertLayout::View
            {
                return Err(
                    "--relays takes --mode push, --buffers copy and --layout token or expert \
                     (relays do not support the others yet)"
                        .into(),
                );
            }
        }
        if let Some(k) = self.netns {
            if k == 0 || self.fabric != FabricKind::Ofi {
                return Err("--netns takes K >= 1 hosts and --fabric ofi".into());
            }
        }
        if self.model_params.len() != 4 || self.model_params.iter().any(|v| v.is_nan() || *v <= 0.0)
        {
            return Err("--model-params takes four positive numbers: LAT,LINK,COPY,REC".into());
        }
        if self.domains == 0 || self.domains > self.attention {
            return Err(format!(
                "--domains must be in 1..={} (the attention ranks)",
                self.attention
            ));
        }
        if self.domains > 1 && self.routing_out.is_some() {
            return Err(
                "--routing-out replays every attention rank in every call; it does not \
                        take --domains"
                    .into(),
            );
        }
        if let Some(s) = self.skew {
            if !(s.is_finite() && s >= 0.0) {
                return Err(format!("--skew must be finite and >= 0, got {s}"));
            }
        }
        if !(self.timeout.is_finite() && self.timeout > 0.0) {
            return Err(format!("--timeout must be positive, got {}", self.timeout));
        }
        if let Some(p) = &self.plot {
            let ext = p.extension().and_then(|e| e.to_str()).unwrap_or("");
            if !ext.eq_ignore_ascii_case("svg") {
                return Err(format!(
                    "--plot writes SVG: give a .svg path, not {} (render a PNG with \
                     `rsvg-convert -o plot.png plot.svg`)",
                    p.display()
                ));
            }
        }
        if self.fabric == FabricKind::Cuda
            && (self.buffers == BufferKind::Registered || self.layout == ExpertLayout::View)
        {
            return Err(
                "--fabric cuda runs the device-buffer calls: --buffers copy and --layout token \
                 or expert (a registered buffer or a view is host memory)"
                    .into(),
            );
        }
        if self.buffers == BufferKind::Registered && self.layout == ExpertLayout::Expert {
            return Err(
                "--buffers registered needs --layout token (expert-major rows are reduced \
                        by xccl, not computed into a registered output)"
                    .into(),
            );
        }
        Ok(())
    }

    /// `--timeout` as a duration.
    pub fn timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.timeout)
    }

    /// World size M + N.
    pub fn world_size(&self) -> usize {
        self.attention + self.experts
    }

    /// Largest token count of the sweep.
    pub fn max_tokens(&self) -> usize {
        self.tokens.iter().copied().max().unwrap_or(1).max(1)
    }

    /// The wire formats of the run, in order: each runs the whole token sweep.
    pub fn quants(&self) -> Vec<xccl::Quant> {
        match self.quant {
            QuantChoice::None => vec![xccl::Quant::None],
            QuantChoice::Int8 => vec![xccl::Quant::Int8],
            QuantChoice::Both => vec![xccl::Quant::None, xccl::Quant::Int8],
        }
    }

    /// Sweep points of the run: every token count once per wire format.
    pub fn points(&self) -> usize {
        self.tokens.len() * self.quants().len()
    }

    /// Iterations run per token count (warmup plus measured).
    pub fn rounds(&self) -> usize {
        self.warmup + self.iters
    }

    /// Blocks the iterations run in (`--blocks`, at most one per measured iteration).
    pub fn num_blocks(&self) -> usize {
        self.blocks.clamp(1, self.iters.max(1))
    }
}

/// The subcommands: computations that start no ranks.
#[derive(clap::Subcommand, Debug, Clone)]
pub enum Command {
    /// Window bytes an attention rank, an expert rank and a relay need at a shape, direct and
    /// with relays and DP domains, from the library's own layout (`Communicator::window_lens`);
    /// nothing is allocated.
    Memory(MemoryArgs),
    /// The cost model (`src/model.rs`): fit its fabric parameters to measured `--stats --json`
    /// runs and print prediction beside measurement, then project A2E and E2A at a shape (the
    /// CloudMatrix384 decode shape by default) with the given fabric parameters, direct and
    /// through relays, for a sweep of M.
    Model(ModelArgs),
}

/// Flags of `xccl-bench memory`.
#[derive(clap::Args, Debug, Clone)]
pub struct MemoryArgs {
    /// Attention ranks M.
    #[arg(long, short = 'a', default_value_t = 160)]
    pub attention: usize,
    /// Expert ranks N.
    #[arg(long, short = 'e', default_value_t = 288)]
    pub experts: usize,
    /// Routed experts E (contiguous blocks over the expert ranks; sets the bitmask width).
    #[arg(long, default_value_t = 288)]
    pub num_experts: usize,
    /// Experts per token K.
    #[arg(long, short = 'k', default_value_t = 9)]
    pub topk: usize,
    /// Hidden size H.
    #[arg(long, default_value_t = 7168)]
    pub hidden: usize,
    /// Tokens per attention rank (the receive areas' capacity).
    #[arg(long, short = 't', default_value_t = 96)]
    pub tokens: usize,
    /// Element type of the hidden states.
    #[arg(long, default_value = "bf16", value_parser = parse_dtype)]
    pub dtype: DType,
    /// Relay counts to show (0: direct), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "0,16")]
    pub relays: Vec<usize>,
    /// DP domain counts to show, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,3")]
    pub domains: Vec<usize>,
    /// Receive capacities to show: rows an expert rank can take from one attention rank per
    /// call (`MoeConfig::recv_capacity`; 0: the worst case, every token), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    pub recv_capacity: Vec<usize>,
    /// Calls in flight without domains (domains need 1).
    #[arg(long, default_value_t = 2)]
    pub in_flight: usize,
    /// Wire format of the rows (the window keeps room for either; shown for the record).
    #[arg(long, value_enum, default_value_t = QuantChoice::None)]
    pub quant: QuantChoice,
}

/// Flags of `xccl-bench model`.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// `xccl-bench --stats --json` outputs of measured runs: the model's fabric parameters are
    /// fitted to them and each prediction printed beside its measurement.
    #[arg(long, value_name = "JSON", num_args = 1..)]
    pub calibrate: Vec<PathBuf>,
    /// Attention ranks M of the projection; a list is a sweep (the plot's x axis).
    #[arg(
        long,
        short = 'a',
        value_delimiter = ',',
        default_value = "10,20,40,80,120,160"
    )]
    pub attention: Vec<usize>,
    /// Expert ranks N: `routed` dies with one routed expert each, the rest host replicas of
    /// one shared expert that every token also goes to.
    #[arg(long, short = 'e', default_value_t = 288)]
    pub experts: usize,
    /// Routed experts (one per die; the dies after them host the shared expert).
    #[arg(long, default_value_t = 256)]
    pub routed: usize,
    /// Routed experts per token (the shared expert comes on top).
    #[arg(long, short = 'k', default_value_t = 8)]
    pub topk: usize,
    /// Hidden size H of the projection.
    #[arg(long, default_value_t = 7168)]
    pub hidden: usize,
    /// Tokens per attention rank.
    #[arg(long, short = 't', default_value_t = 96)]
    pub tokens: usize,
    /// Relay counts of the relayed projections: `auto` (the library's default, one relay per
    /// 10 attention ranks), `m` (one relay per attention rank, as xDeepServe's trampoline) or
    /// a number; comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "auto,m")]
    pub relays: Vec<RelayChoice>,
    /// Link bandwidth per rank, one direction, GB/s (UB: about 196 per die).
    #[arg(long, default_value_t = 196.0)]
    pub link_gbps: f64,
    /// Latency of one hop (a put and its signal becoming visible), microseconds.
    #[arg(long, default_value_t = 1.5)]
    pub latency_us: f64,
    /// Bandwidth of a rank's own copies (out of its window, the relay's scratch, reductions), GB/s.
    #[arg(long, default_value_t = 400.0)]
    pub copy_gbps: f64,
    /// Cost of one metadata record written or polled, microseconds.
    #[arg(long, default_value_t = 0.1)]
    pub record_us: f64,
    /// Write an SVG plot of projected A2E and E2A time against M, direct and relayed.
    #[arg(long, value_name = "PATH")]
    pub plot: Option<PathBuf>,
    /// Write the calibration and projection as JSON.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
}

/// How many relays a projected shape uses (see `xccl-bench model --relays`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RelayChoice {
    /// `RelayPlan::default_count(M, N)`.
    Auto,
    /// One per attention rank (at most N).
    PerAttention,
    /// This many.
    Count(usize),
}

impl RelayChoice {
    /// The relay count at `m` attention and `n` expert ranks.
    pub fn count(self, m: usize, n: usize) -> usize {
        match self {
            RelayChoice::Auto => xccl::RelayPlan::default_count(m, n),
            RelayChoice::PerAttention => m.min(n),
            RelayChoice::Count(r) => r,
        }
    }

    /// How the choice reads in tables and legends.
    pub fn label(self) -> String {
        match self {
            RelayChoice::Auto => "R=M/10".into(),
            RelayChoice::PerAttention => "R=M".into(),
            RelayChoice::Count(r) => format!("R={r}"),
        }
    }
}

impl std::str::FromStr for RelayChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "auto" => Ok(RelayChoice::Auto),
            "m" | "M" => Ok(RelayChoice::PerAttention),
            n => match n.parse() {
                Ok(r) if r > 0 => Ok(RelayChoice::Count(r)),
                _ => Err(format!("relays: `{s}` is not auto, m or a count >= 1")),
            },
        }
    }
}
