//! Reference workloads driven through a real [`Communicator`], checked bit for bit against
//! [`super::reference`].
//!
//! One place for what tests, `xccl-bench --check` and the C ABI tests all do: generate a
//! deterministic routing and hidden states per (attention rank, round), run one A2E + E2A step on
//! each rank, and compare what arrived and what came back with the single-process reference,
//! which replays the protocol's order and roundings: every comparison is of bits, for every
//! dtype, mode, layout and buffer kind.

use std::collections::BTreeMap;

use super::reference::{
    a2e_seen, expected_combine_quant, expected_dispatch, expert_output, reduce_on_expert,
    test_expert, ExpertRankRows, RankInput, SplitMix64,
};
use crate::cuda::{Device, DeviceMemory, DeviceSlice, DeviceSliceMut, Stream};
use crate::moe::dtype::Element;
use crate::moe::quant::Quant;
use crate::topology::Topology;
use crate::{Communicator, ExpertBatch, Result, TokenBatch};

/// A deterministic MoE workload.
#[derive(Clone, Debug)]
pub struct Workload {
    /// Seed of every random choice.
    pub seed: u64,
    /// Tokens per attention rank per round: fixed, or random in `0..=max` when `vary` is set.
    pub tokens: usize,
    /// Draw T uniformly in `0..=tokens` per (rank, round) instead of using `tokens`.
    pub vary: bool,
    /// Hot-expert skew (Zipf exponent), or uniform routing.
    pub skew: Option<f64>,
    /// Shared experts: the last `shared_experts` expert ids take every token (weight 1.0, in
    /// the last slots of its routing); the other `K - shared_experts` slots are routed over the
    /// remaining ids. 0 for none.
    pub shared_experts: usize,
}

impl Workload {
    fn mix(&self, rank: usize, round: u64) -> u64 {
        let mut s = SplitMix64::new(
            self.seed ^ (round.wrapping_mul(0x2545_f491_4f6c_dd1d)) ^ ((rank as u64) << 40),
        );
        s.next_u64()
    }

    /// Token count of `rank` in `round`.
    pub fn num_tokens(&self, rank: usize, round: u64) -> usize {
        if self.vary {
            (self.mix(rank, round) % (self.tokens as u64 + 1)) as usize
        } else {
            self.tokens
        }
    }

    /// Routing of attention rank `rank` in `round` (no tokens when DP domains leave `rank` out
    /// of `round`).
    pub fn input(&self, topo: &Topology, k: usize, rank: usize, round: u64) -> RankInput {
        let tokens = if topo.in_call(rank, round) {
            self.num_tokens(rank, round)
        } else {
            0
        };
        let shared = self.shared_experts;
        assert!(
            shared < k && shared < topo.num_experts(),
            "{shared} shared experts need K and E above it (K = {k}, E = {})",
            topo.num_experts()
        );
        let routed = topo.num_experts() - shared;
        let mut input = RankInput::random(
            rank,
            self.mix(rank, round),
            tokens,
            k - shared,
            routed,
            self.skew,
        );
        if shared > 0 {
            let kr = k - shared;
            let (idx, w) = (input.topk_idx, input.topk_weights);
            input.topk_idx = Vec::with_capacity(tokens * k);
            input.topk_weights = Vec::with_capacity(tokens * k);
            for t in 0..tokens {
                input.topk_idx.extend_from_slice(&idx[t * kr..(t + 1) * kr]);
                input
                    .topk_idx
                    .extend((routed..routed + shared).map(|e| e as i32));
                input
                    .topk_weights
                    .extend_from_slice(&w[t * kr..(t + 1) * kr]);
                input
                    .topk_weights
                    .extend(std::iter::repeat_n(1.0f32, shared));
            }
            input.k = k;
        }
        input
    }

    /// Hidden states of `rank` in `round`, in the wire dtype (drawn in f32, rounded once).
    pub fn hidden_states<T: Element>(
        &self,
        rank: usize,
        round: u64,
        num_tokens: usize,
        hidden: usize,
    ) -> Vec<T> {
        let mut s = SplitMix64::new(self.mix(rank, round) ^ 0x5bd1_e995);
        (0..num_tokens * hidden)
            .map(|_| T::from_f32(((s.next_u64() % 200_001) as f32 - 100_000.0) / 51_200.0))
            .collect()
    }
}

/// Where the rounds' routing and hidden states come from: a [`Workload`], or one with empty
/// ranks and unrouted tokens ([`Sparse`]). Every check of this module takes it.
pub trait Routes {
    /// Routing of attention rank `rank` in `round`.
    fn input(&self, topo: &Topology, k: usize, rank: usize, round: u64) -> RankInput;
    /// Hidden states of `rank` in `round` (`num_tokens` rows of `hidden` elements).
    fn hidden_states<T: Element>(
        &self,
        rank: usize,
        round: u64,
        num_tokens: usize,
        hidden: usize,
    ) -> Vec<T>;
}

impl Routes for Workload {
    fn input(&self, topo: &Topology, k: usize, rank: usize, round: u64) -> RankInput {
        Workload::input(self, topo, k, rank, round)
    }

    fn hidden_states<T: Element>(
        &self,
        rank: usize,
        round: u64,
        num_tokens: usize,
        hidden: usize,
    ) -> Vec<T> {
        Workload::hidden_states(self, rank, round, num_tokens, hidden)
    }
}

/// A [`Workload`] with holes: attention rank `r` sends no token in the rounds where
/// `(round + r) % empty_every == 0`, no attention rank sends any in the rounds where
/// `round % silent_every == silent_every - 1` (every expert rank receives nothing), and every
/// token `t` with `t % unrouted_every == 1` is routed to no expert (every id `-1`, weight 0).
/// A knob of 0 is off.
#[derive(Clone, Debug)]
pub struct Sparse {
    /// The workload the holes are punched in.
    pub base: Workload,
    /// Period of each attention rank's empty rounds (staggered by rank).
    pub empty_every: u64,
    /// Period of the rounds in which no attention rank sends.
    pub silent_every: u64,
    /// Period of the tokens routed to no expert.
    pub unrouted_every: usize,
}

impl Routes for Sparse {
    fn input(&self, topo: &Topology, k: usize, rank: usize, round: u64) -> RankInput {
        let mut input = self.base.input(topo, k, rank, round);
        let empty = self.empty_every > 0 && (round + rank as u64).is_multiple_of(self.empty_every);
        let silent = self.silent_every > 0 && round % self.silent_every == self.silent_every - 1;
        if empty || silent {
            input.num_tokens = 0;
            input.topk_idx.clear();
            input.topk_weights.clear();
        }
        if self.unrouted_every > 0 {
            for t in (1..input.num_tokens).step_by(self.unrouted_every) {
                input.topk_idx[t * k..(t + 1) * k].fill(-1);
                input.topk_weights[t * k..(t + 1) * k].fill(0.0);
            }
        }
        input
    }

    fn hidden_states<T: Element>(
        &self,
        rank: usize,
        round: u64,
        num_tokens: usize,
        hidden: usize,
    ) -> Vec<T> {
        self.base.hidden_states(rank, round, num_tokens, hidden)
    }
}

/// Where A2E takes its rows from and where E2A puts its rows (see [`attention_round_with`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buffers {
    /// The caller's own memory: `a2e_send`, `e2a_send_tokens`.
    Copy,
    /// Registered buffers in the window: `a2e_input` + `a2e_send_input`, `e2a_output` +
    /// `e2a_send_output`.
    Registered,
    /// Device memory of a communicator on the cuda fabric: `a2e_send_device`,
    /// `e2a_recv_device` (the routing in device memory too), with the caller's rows written and
    /// read back by the test ([`DeviceRows`]).
    Device,
}

/// Device memory of a test that runs the device-buffer calls: each buffer allocated on the
/// communicator's device, filled from and read back to the host on a stream of the test's own
/// (the caller's stream of the calls).
pub struct DeviceRows {
    device: Device,
    stream: Stream,
}

impl DeviceRows {
    /// For `comm`'s device (an error on a communicator that is not on the cuda fabric).
    pub fn of(comm: &Communicator) -> Result<Self> {
        let device = comm
            .cuda_device()
            .ok_or_else(|| crate::Error::invalid("device rows need a cuda communicator"))?
            .clone();
        let stream = Stream::new(&device)?;
        Ok(DeviceRows { device, stream })
    }

    /// The caller's stream of the calls.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// A new device buffer holding `data` (at least one byte is allocated).
    pub fn upload<T: bytemuck::Pod>(&self, data: &[T]) -> Result<DeviceMemory> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let mem = self.alloc(bytes.len())?;
        let deadline = crate::fabric::deadline_after(std::time::Duration::from_secs(30));
        self.stream
            .write(&mem, 0, bytes, deadline, usize::MAX, &|| "test rows".into())?;
        Ok(mem)
    }

    /// A new device buffer of `len` bytes (at least one), not initialised.
    pub fn alloc(&self, len: usize) -> Result<DeviceMemory> {
        DeviceMemory::alloc(&self.device, len.max(1), || "test rows".into())
    }

    /// The first `len` elements of `mem`, read back.
    pub fn download<T: bytemuck::Pod>(&self, mem: &DeviceMemory, len: usize) -> Result<Vec<T>> {
        let mut out = vec![<T as bytemuck::Zeroable>::zeroed(); len];
        let deadline = crate::fabric::deadline_after(std::time::Duration::from_secs(30));
        self.stream.read(
            mem,
            0,
            bytemuck::cast_slice_mut(&mut out),
            deadline,
            usize::MAX,
            &|| "test rows".into(),
        )?;
        Ok(out)
    }
}

/// The first `len` bytes of `mem` lent for reading (panics when `len` is past its end).
pub fn lend(mem: &DeviceMemory, len: usize) -> DeviceSlice<'_> {
    mem.as_slice().range(0..len).expect("inside the allocation")
}

/// The first `len` bytes of `mem` lent for writing (panics when `len` is past its end).
pub fn lend_mut(mem: &mut DeviceMemory, len: usize) -> DeviceSliceMut<'_> {
    mem.as_slice_mut()
        .range(0..len)
        .expect("inside the allocation")
}

/// Runs one attention-rank step (A2E send, then E2A receive) of `round` and checks the combined
/// output against the reference, bit for bit. Returns `Ok(Err(description))` on a mismatch.
pub fn attention_round<T: Element>(
    comm: &mut Communicator,
    wl: &impl Routes,
    round: u64,
) -> Result<std::result::Result<(), String>> {
    attention_round_with::<T>(comm, wl, round, Buffers::Copy)
}

/// The first difference between `got` and `want` (compared as bits), described.
pub fn first_difference<T: Element>(got: &[T], want: &[T], hidden: usize) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("{} elements, reference {}", got.len(), want.len()));
    }
    let (gb, wb): (&[u8], &[u8]) = (bytemuck::cast_slice(got), bytemuck::cast_slice(want));
    let size = std::mem::size_of::<T>();
    (0..got.len())
        .find(|&i| gb[i * size..(i + 1) * size] != wb[i * size..(i + 1) * size])
        .map(|i| {
            format!(
                "[{}][{}] = {} ({:02x?}), reference {} ({:02x?})",
                i / hidden,
                i % hidden,
                got[i].to_f32(),
                &gb[i * size..(i + 1) * size],
                want[i].to_f32(),
                &wb[i * size..(i + 1) * size]
            )
        })
}

/// [`attention_round`] with the A2E rows written to the registered input
/// ([`Communicator::a2e_input`]) when `buffers` is [`Buffers::Registered`].
pub fn attention_round_with<T: Element>(
    comm: &mut Communicator,
    wl: &impl Routes,
    round: u64,
    buffers: Buffers,
) -> Result<std::result::Result<(), String>> {
    let topo = comm.topology().clone();
    let (k, hidden) = (comm.config().topk, comm.config().hidden);
    let input = wl.input(&topo, k, comm.rank(), round);
    let x: Vec<T> = wl.hidden_states(comm.rank(), round, input.num_tokens, hidden);
    let mut out = vec![T::from_f32(0.0); input.num_tokens * hidden];
    let handle = match buffers {
        Buffers::Copy => comm.a2e_send(&x, &input.topk_idx, &input.topk_weights)?,
        Buffers::Registered => {
            comm.a2e_input::<T>()?[..x.len()].copy_from_slice(&x);
            comm.a2e_send_input(input.num_tokens, &input.topk_idx, &input.topk_weights)?
        }
        Buffers::Device => {
            let dev = DeviceRows::of(comm)?;
            let (bytes, xs) = (std::mem::size_of_val(x.as_slice()), dev.upload(&x)?);
            let idx = dev.upload(&input.topk_idx)?;
            let w = dev.upload(&input.topk_weights)?;
            let routing = crate::Routing::Device {
                topk_idx: lend(&idx, input.topk_idx.len() * 4),
                topk_weights: lend(&w, input.topk_weights.len() * 4),
            };
            let handle = comm.a2e_send_device(lend(&xs, bytes), routing, dev.stream())?;
            let mut o = dev.alloc(bytes)?;
            comm.e2a_recv_device(&handle, lend_mut(&mut o, bytes), dev.stream())?;
            out = dev.download(&o, out.len())?;
            handle
        }
    };
    if buffers != Buffers::Device {
        comm.e2a_recv(&handle, &mut out)?;
    }
    let (a2e, e2a) = (comm.config().a2e_quant, comm.config().e2a_quant);
    let want = expected_combine_quant(&topo, &input, &x, hidden, &test_expert, a2e, e2a);
    Ok(match first_difference(&out, &want, hidden) {
        None => Ok(()),
        Some(d) => Err(format!("rank {} round {round}: out{d}", comm.rank())),
    })
}

/// Runs one expert-rank step of `round`: A2E receive into `batch`, checks it against the
/// reference dispatch, applies [`test_expert`] to every row (its output rounded to the dtype),
/// and sends E2A.
pub fn expert_round<T: Element>(
    comm: &mut Communicator,
    wl: &impl Routes,
    round: u64,
    batch: &mut ExpertBatch,
    check: bool,
) -> Result<std::result::Result<(), String>> {
    comm.a2e_recv(batch)?;
    let rows: &[T] = batch.rows::<T>()?;
    let (verdict, out) = expert_step(comm, wl, round, batch, rows, check);
    comm.e2a_send(batch, &out)?;
    Ok(verdict)
}

/// [`expert_round`] with the rows in device memory: `a2e_recv_device` into a device buffer,
/// read back for the check and [`test_expert`], whose output goes back with `e2a_send_device`.
pub fn expert_round_device<T: Element>(
    comm: &mut Communicator,
    wl: &impl Routes,
    round: u64,
    batch: &mut ExpertBatch,
    check: bool,
) -> Result<std::result::Result<(), String>> {
    let dev = DeviceRows::of(comm)?;
    let size = comm.config().hidden * comm.config().dtype.size();
    let len = comm.max_expert_rows() * size;
    let mut rows_mem = dev.alloc(len)?;
    comm.a2e_recv_device(batch, lend_mut(&mut rows_mem, len), dev.stream())?;
    if !batch.row_bytes().is_empty() {
        return Ok(Err("a device receive left rows on the host".into()));
    }
    let n = batch.num_rows() * comm.config().hidden;
    let rows: Vec<T> = dev.download(&rows_mem, n)?;
    let (verdict, out) = expert_step(comm, wl, round, batch, &rows, check);
    let out = dev.upload(&out)?;
    comm.e2a_send_device(batch, lend(&out, n * T::DTYPE.size()), dev.stream())?;
    Ok(verdict)
}

/// The check of a received batch (when `check`) against the reference, and the expert outputs
/// of its `rows` ([`test_expert`], rounded to the dtype), one per row: what [`expert_round`]
/// sends back.
pub fn expert_step<T: Element>(
    comm: &Communicator,
    wl: &impl Routes,
    round: u64,
    batch: &ExpertBatch,
    rows: &[T],
    check: bool,
) -> (std::result::Result<(), String>, Vec<T>) {
    let ctx = Expecting::of(comm);
    let hidden = ctx.hidden;
    let verdict = if check {
        check_batch::<T>(&ctx, wl, round, batch, rows)
    } else {
        Ok(())
    };
    let locals = ctx.topo.local_experts(ctx.rank).to_vec();
    let mut out: Vec<T> = Vec::with_capacity(rows.len());
    for (j, &e) in locals.iter().enumerate() {
        for r in batch.expert_rows(j) {
            out.extend(expert_output(
                &test_expert,
                e,
                &rows[r * hidden..(r + 1) * hidden],
            ));
        }
    }
    (verdict, out)
}

fn check_batch<T: Element>(
    ctx: &Expecting,
    wl: &impl Routes,
    round: u64,
    batch: &ExpertBatch,
    rows: &[T],
) -> std::result::Result<(), String> {
    let (inputs, me) = ctx.expected(wl, round)?;
    let (hidden, rank) = (ctx.hidden, ctx.rank);
    if batch.num_local_experts() != me.per_local_expert.len() {
        return Err(format!(
            "rank {rank}: {} local experts, reference {}",
            batch.num_local_experts(),
            me.per_local_expert.len()
        ));
    }
    let mut xs = BTreeMap::new();
    for (j, want) in me.per_local_expert.iter().enumerate() {
        let got = batch.expert_rows(j);
        if got.len() != want.len() {
            return Err(format!(
                "rank {rank} round {round}: local expert {j} got {} rows, reference {}",
                got.len(),
                want.len()
            ));
        }
        for (r, &(src, tok, w)) in got.zip(want) {
            let seen = (batch.src_rank()[r], batch.src_token()[r], batch.weight()[r]);
            if seen.0 != src || seen.1 != tok || seen.2.to_bits() != w.to_bits() {
                return Err(format!(
                    "rank {rank} round {round}: expert {j} row {r} is {seen:?}, reference ({src}, {tok}, {w})"
                ));
            }
            let x = xs
                .entry(src)
                .or_insert_with(|| source_states::<T>(ctx, wl, &inputs, src as usize, round));
            let t = tok as usize;
            if first_difference(
                &rows[r * hidden..(r + 1) * hidden],
                &x[t * hidden..(t + 1) * hidden],
                hidden,
            )
            .is_some()
            {
                return Err(format!(
                    "rank {rank} round {round}: payload of row {r} (rank {src} token {tok}) differs"
                ));
            }
        }
    }
    Ok(())
}

/// The hidden states attention rank `src` sent in `round`, as an expert rank sees them (after
/// INT8 quantization when A2E uses it).
fn source_states<T: Element>(
    ctx: &Expecting,
    wl: &impl Routes,
    inputs: &[RankInput],
    src: usize,
    round: u64,
) -> Vec<T> {
    let n = inputs
        .iter()
        .find(|i| i.rank == src)
        .map_or(0, |i| i.num_tokens);
    let hidden = ctx.hidden;
    let x: Vec<T> = wl.hidden_states(src, round, n, hidden);
    x.chunks(hidden.max(1))
        .flat_map(|row| a2e_seen(row, ctx.a2e))
        .collect()
}

/// The reply of one received token: [`test_expert`] of each local expert (rounded to the
/// dtype), weighted and summed as the protocol documents ([`reduce_on_expert`]). `experts` are
/// the token's local experts (indices into `locals`, the rank's global expert ids).
pub fn token_reply<T: Element>(
    locals: &[usize],
    experts: &[u32],
    weights: &[f32],
    x: &[T],
) -> Vec<T> {
    let outputs: Vec<(f32, Vec<T>)> = experts
        .iter()
        .zip(weights)
        .map(|(&j, &w)| (w, expert_output(&test_expert, locals[j as usize], x)))
        .collect();
    reduce_on_expert(&outputs, x.len())
}

/// The replies of every token of `batch`, as [`expert_round_tokens`] computes them (`locals`:
/// the rank's local experts' global ids).
pub fn token_replies<T: Element>(locals: &[usize], batch: &TokenBatch) -> Vec<T> {
    token_replies_of(locals, batch, batch.rows::<T>().unwrap_or(&[]))
}

/// [`token_replies`] of `rows` (the batch's rows where they were read back from elsewhere).
fn token_replies_of<T: Element>(locals: &[usize], batch: &TokenBatch, rows: &[T]) -> Vec<T> {
    let hidden = batch.recv.hidden;
    let mut out = Vec::with_capacity(rows.len());
    for i in 0..batch.num_tokens() {
        let (experts, weights) = batch.experts_of(i);
        out.extend(token_reply(
            locals,
            experts,
            weights,
            &rows[i * hidden..(i + 1) * hidden],
        ));
    }
    out
}

/// Runs one expert-rank step of `round` on the token-major path: A2E receive into `batch`
/// (checked against the reference when `check`), each token's reply computed as
/// [`reduce_on_expert`] does, and a token-major E2A send.
pub fn expert_round_tokens<T: Element>(
    comm: &mut Communicator,
    wl: &impl Routes,
    round: u64,
    batch: &mut TokenBatch,
    check: bool,
) -> Result<std::result::Result<(), String>> {
    expert_round_tokens_with::<T>(comm, wl, round, batch, check, Buffers::Copy)
}

/// [`expert_round_tokens`] computing into the registered output ([`Communicator::e2a_output`])
/// when `buffers` is [`Buffers::Registered`] — unless E2A uses INT8, whose replies cannot come
/// from the registered output (it holds dtype rows, which travel unquantized): then the copy
/// path, so every reply is quantized as the reference expects.
pub fn expert_round_tokens_with<T: Element>(
    comm: &mut Communicator,
    wl: &impl Routes,
    round: u64,
    batch: &mut TokenBatch,
    check: bool,
    buffers: Buffers,
) -> Result<std::result::Result<(), String>> {
    let mut arrivals = 0usize;
    // With device buffers: received into device memory, read back for the checks.
    let dev = match buffers {
        Buffers::Device => Some(DeviceRows::of(comm)?),
        _ => None,
    };
    let mut device_rows: Option<(DeviceMemory, Vec<T>)> = None;
    match &dev {
        Some(dev) => {
            let len = comm.max_recv_tokens() * comm.config().hidden * T::DTYPE.size();
            let mut mem = dev.alloc(len)?;
            let out = lend_mut(&mut mem, len);
            comm.a2e_recv_tokens_device(batch, out, dev.stream(), &mut |_, _| arrivals += 1)?;
            if !batch.row_bytes().is_empty() {
                return Ok(Err("a device receive left rows on the host".into()));
            }
            let rows = dev.download(&mem, batch.num_tokens() * comm.config().hidden)?;
            device_rows = Some((mem, rows));
        }
        None => comm.a2e_recv_tokens(batch, &mut |_, _| arrivals += 1)?,
    }
    let ctx = Expecting::of(comm);
    let rows: &[T] = match &device_rows {
        Some((_, rows)) => rows,
        None => batch.rows::<T>()?,
    };
    let mut verdict = Ok(());
    let sources = ctx.topo.call_sources(round).len();
    if arrivals != sources {
        verdict = Err(format!(
            "{arrivals} arrival callbacks for {sources} sources"
        ));
    }
    if check && verdict.is_ok() {
        verdict = check_tokens::<T>(&ctx, wl, round, batch, rows);
    }
    let locals = ctx.topo.local_experts(ctx.rank).to_vec();
    let reduced: Vec<T> = token_replies_of(&locals, batch, rows);
    let buffers = match (comm.config().e2a_quant, buffers) {
        (Quant::Int8, Buffers::Registered) => Buffers::Copy,
        (_, buffers) => buffers,
    };
    match buffers {
        Buffers::Copy => comm.e2a_send_tokens(batch, &reduced)?,
        Buffers::Registered => {
            comm.e2a_output::<T>(batch)?.copy_from_slice(&reduced);
            comm.e2a_send_output(batch)?;
        }
        Buffers::Device => {
            let dev = dev.as_ref().expect("made above");
            let bytes = std::mem::size_of_val(reduced.as_slice());
            let mem = dev.upload(&reduced)?;
            comm.e2a_send_tokens_device(batch, lend(&mem, bytes), dev.stream())?;
        }
    }
    Ok(verdict)
}

/// What a check needs to know about the expert rank that received a batch.
struct Expecting {
    topo: Topology,
    k: usize,
    hidden: usize,
    rank: usize,
    /// How the attention ranks quantize A2E rows (tests give every rank the same config).
    a2e: Quant,
}

impl Expecting {
    /// Every attention rank's routing of `round`, and what the reference says this rank gets.
    fn expected(
        &self,
        wl: &impl Routes,
        round: u64,
    ) -> std::result::Result<(Vec<RankInput>, ExpertRankRows), String> {
        let topo = &self.topo;
        let inputs: Vec<RankInput> = topo
            .attention_ranks()
            .iter()
            .map(|&a| wl.input(topo, self.k, a, round))
            .collect();
        let me = expected_dispatch(topo, &inputs)
            .into_iter()
            .find(|e| e.rank == self.rank)
            .ok_or("no reference for this rank")?;
        Ok((inputs, me))
    }

    fn of(comm: &Communicator) -> Self {
        Expecting {
            topo: comm.topology().clone(),
            k: comm.config().topk,
            hidden: comm.config().hidden,
            rank: comm.rank(),
            a2e: comm.config().a2e_quant,
        }
    }
}

/// Runs one expert-rank step of `round` through [`Communicator::a2e_recv_view`]: the rows are
/// read in place (checked against the reference when `check`), and each token's reply is
/// computed straight into the reply row.
pub fn expert_round_view<T: Element>(
    comm: &mut Communicator,
    wl: &impl Routes,
    round: u64,
    check: bool,
) -> Result<std::result::Result<(), String>> {
    let ctx = Expecting::of(comm);
    let locals = ctx.topo.local_experts(ctx.rank).to_vec();
    let hidden = ctx.hidden;
    let mode = comm.config().mode;
    let mut view = comm.a2e_recv_view()?;
    let mut rows: Vec<T> = Vec::with_capacity(view.num_tokens() * hidden);
    for i in 0..view.num_tokens() {
        rows.extend_from_slice(view.row::<T>(i)?);
    }
    let verdict = if check {
        check_tokens::<T>(&ctx, wl, round, view.meta(), &rows)
    } else {
        Ok(())
    };
    let meta = view.meta().clone();
    view.e2a_send::<T>(mode, |i, input, output| {
        let (experts, weights) = meta.experts_of(i);
        output.copy_from_slice(&token_reply(&locals, experts, weights, input));
    })?;
    Ok(verdict)
}

/// Checks a token-major batch against the reference: every expected (source, token) exactly
/// once, with its experts, weights (as bits) and payload (as bits), and nothing else.
fn check_tokens<T: Element>(
    ctx: &Expecting,
    wl: &impl Routes,
    round: u64,
    batch: &TokenBatch,
    rows: &[T],
) -> std::result::Result<(), String> {
    let (inputs, me) = ctx.expected(wl, round)?;
    let (hidden, rank) = (ctx.hidden, ctx.rank);
    let mut want: BTreeMap<(u32, u32), Vec<(u32, u32)>> = BTreeMap::new();
    for (j, list) in me.per_local_expert.iter().enumerate() {
        for &(src, tok, w) in list {
            want.entry((src, tok))
                .or_default()
                .push((j as u32, w.to_bits()));
        }
    }
    if want.len() != batch.num_tokens() {
        return Err(format!(
            "rank {rank} round {round}: {} tokens arrived, reference {}",
            batch.num_tokens(),
            want.len()
        ));
    }
    let mut xs = BTreeMap::new();
    for i in 0..batch.num_tokens() {
        let key = (batch.src_rank()[i], batch.src_token()[i]);
        let (experts, weights) = batch.experts_of(i);
        let got: Vec<(u32, u32)> = experts
            .iter()
            .zip(weights)
            .map(|(&j, w)| (j, w.to_bits()))
            .collect();
        // Each expected token exactly once: remove it, so a duplicate finds nothing.
        match want.remove(&key) {
            Some(w) if w == got => {}
            Some(w) => {
                return Err(format!(
                    "rank {rank} round {round}: token {key:?} has experts {got:?}, reference {w:?}"
                ))
            }
            None => {
                return Err(format!(
                    "rank {rank} round {round}: token {key:?} arrived twice or was never sent"
                ))
            }
        }
        let src = key.0 as usize;
        let x = xs
            .entry(src)
            .or_insert_with(|| source_states::<T>(ctx, wl, &inputs, src, round));
        let t = key.1 as usize;
        if first_difference(
            &rows[i * hidden..(i + 1) * hidden],
            &x[t * hidden..(t + 1) * hidden],
            hidden,
        )
        .is_some()
        {
            return Err(format!(
                "rank {rank} round {round}: payload of token {key:?} differs"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::batch::TokenBatch;

    /// A batch of the tokens `keys`, each with one expert (local 0) and weight 1, rows zero.
    fn batch_of(keys: &[(u32, u32)]) -> TokenBatch {
        let mut b = TokenBatch::new();
        b.reset(1, crate::DType::F32, 1, 1);
        b.grow(keys.len(), 4, true);
        for (i, &(src, tok)) in keys.iter().enumerate() {
            b.set_token(i, src as usize, tok, &[(0, 1.0)]);
        }
        b
    }

    #[test]
    fn a_sparse_workload_has_its_empty_ranks_silent_rounds_and_unrouted_tokens() {
        let topo = Topology::contiguous(2, 1, 8).unwrap();
        let base = Workload {
            seed: 9,
            tokens: 8,
            vary: false,
            skew: None,
            shared_experts: 0,
        };
        let wl = Sparse {
            base: base.clone(),
            empty_every: 3,
            silent_every: 5,
            unrouted_every: 4,
        };
        for round in 0..10u64 {
            for rank in 0..2 {
                let got = Routes::input(&wl, &topo, 4, rank, round);
                let full = base.input(&topo, 4, rank, round);
                let empty = (round + rank as u64).is_multiple_of(3) || round % 5 == 4;
                assert_eq!(got.num_tokens, if empty { 0 } else { 8 }, "{rank} {round}");
                assert_eq!(got.topk_idx.len(), got.num_tokens * 4);
                assert_eq!(got.topk_weights.len(), got.num_tokens * 4);
                for t in 0..got.num_tokens {
                    let (ids, ws) = (&got.topk_idx[t * 4..][..4], &got.topk_weights[t * 4..][..4]);
                    if t % 4 == 1 {
                        assert!(ids.iter().all(|&e| e == -1) && ws.iter().all(|&w| w == 0.0));
                    } else {
                        assert_eq!(ids, &full.topk_idx[t * 4..][..4]);
                        assert_eq!(ws, &full.topk_weights[t * 4..][..4]);
                    }
                }
                let x: Vec<f32> = Routes::hidden_states(&wl, rank, round, 3, 2);
                assert_eq!(x, base.hidden_states::<f32>(rank, round, 3, 2));
            }
        }
    }

    #[test]
    fn check_tokens_rejects_a_duplicated_pair_standing_in_for_a_missing_one() {
        // One attention rank (0), one expert rank (1) with one expert; two tokens of T=2.
        let topo = Topology::contiguous(1, 1, 1).unwrap();
        let wl = Workload {
            seed: 3,
            tokens: 2,
            vary: false,
            skew: None,
            shared_experts: 0,
        };
        let ctx = Expecting {
            topo,
            k: 1,
            hidden: 1,
            rank: 1,
            a2e: Quant::None,
        };
        let x: Vec<f32> = wl.hidden_states(0, 0, 2, 1);
        let good = batch_of(&[(0, 0), (0, 1)]);
        check_tokens::<f32>(&ctx, &wl, 0, &good, &x).unwrap();
        let dup = batch_of(&[(0, 0), (0, 0)]);
        let err = check_tokens::<f32>(&ctx, &wl, 0, &dup, &[x[0], x[0]]).unwrap_err();
        assert!(err.contains("twice"), "{err}");
    }
}
