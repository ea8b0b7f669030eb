//! Reference workloads driven through a real [`Communicator`], checked against
//! [`crate::moe::reference`].
//!
//! One place for what tests, `xccl-bench --check` and the C ABI tests all do: generate a
//! deterministic routing and hidden states per (attention rank, round), run one A2E + E2A step on
//! each rank, and compare what arrived and what came back with the single-process reference.

use crate::moe::dtype::{slice_from_f32, slice_to_f32, Element};
use crate::moe::reference::{
    expected_combine, expected_dispatch, test_expert, ExpertRankRows, RankInput, SplitMix64,
};
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

    /// Routing of attention rank `rank` in `round`.
    pub fn input(&self, topo: &Topology, k: usize, rank: usize, round: u64) -> RankInput {
        RankInput::random(
            rank,
            self.mix(rank, round),
            self.num_tokens(rank, round),
            k,
            topo.num_experts(),
            self.skew,
        )
    }

    /// Hidden states (f32 values exactly representable in every dtype's rounding) of `rank`.
    pub fn hidden_states(
        &self,
        rank: usize,
        round: u64,
        num_tokens: usize,
        hidden: usize,
    ) -> Vec<f32> {
        let mut s = SplitMix64::new(self.mix(rank, round) ^ 0x5bd1_e995);
        (0..num_tokens * hidden)
            .map(|_| ((s.next_u64() % 2001) as f32 - 1000.0) / 512.0)
            .collect()
    }
}

/// Runs one attention-rank step (A2E send, then E2A receive) of `round` and checks the combined
/// output against the reference. Returns `Ok(Err(description))` on a mismatch.
pub fn attention_round<T: Element>(
    comm: &mut Communicator,
    wl: &Workload,
    round: u64,
) -> Result<std::result::Result<(), String>> {
    attention_round_with::<T>(comm, wl, round, Buffers::Copy)
}

/// Where A2E takes its rows from and where E2A puts its rows (see [`attention_round_with`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buffers {
    /// The caller's own memory: `a2e_send`, `e2a_send_tokens`.
    Copy,
    /// Registered buffers in the window: `a2e_input` + `a2e_send_input`, `e2a_output` +
    /// `e2a_send_output`.
    Registered,
}

/// [`attention_round`] with the A2E rows written to the registered input
/// ([`Communicator::a2e_input`]) when `buffers` is [`Buffers::Registered`].
pub fn attention_round_with<T: Element>(
    comm: &mut Communicator,
    wl: &Workload,
    round: u64,
    buffers: Buffers,
) -> Result<std::result::Result<(), String>> {
    let topo = comm.topology().clone();
    let (k, hidden) = (comm.config().topk, comm.config().hidden);
    let input = wl.input(&topo, k, comm.rank(), round);
    let x32 = wl.hidden_states(comm.rank(), round, input.num_tokens, hidden);
    let x: Vec<T> = slice_from_f32(&x32);
    let handle = match buffers {
        Buffers::Copy => comm.a2e_send(&x, &input.topk_idx, &input.topk_weights)?,
        Buffers::Registered => {
            comm.a2e_input::<T>()?[..x.len()].copy_from_slice(&x);
            comm.a2e_send_input(input.num_tokens, &input.topk_idx, &input.topk_weights)?
        }
    };
    let mut out = vec![T::from_f32(0.0); input.num_tokens * hidden];
    comm.e2a_recv(handle, &mut out)?;
    let got = slice_to_f32(&out);
    let xr = slice_to_f32(&x);
    let want = expected_combine(&topo, &input, &xr, hidden, &test_expert);
    let tol = tolerance::<T>();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        if (g - w).abs() > tol * (1.0 + w.abs()) || !g.is_finite() {
            return Ok(Err(format!(
                "rank {} round {round}: out[{}][{}] = {g}, reference {w}",
                comm.rank(),
                i / hidden,
                i % hidden
            )));
        }
    }
    Ok(Ok(()))
}

/// Relative tolerance of the combined output for `T` (three roundings to `T` on the way).
pub fn tolerance<T: Element>() -> f32 {
    match std::mem::size_of::<T>() {
        4 => 1e-5,
        _ if T::DTYPE == crate::DType::F16 => 4e-3,
        _ => 3e-2,
    }
}

/// Runs one expert-rank step of `round`: A2E receive into `batch`, checks it against the
/// reference dispatch, applies [`test_expert`] to every row, and sends E2A.
pub fn expert_round<T: Element>(
    comm: &mut Communicator,
    wl: &Workload,
    round: u64,
    batch: &mut ExpertBatch,
    check: bool,
) -> Result<std::result::Result<(), String>> {
    comm.a2e_recv(batch)?;
    let topo = comm.topology().clone();
    let hidden = comm.config().hidden;
    let rows: Vec<f32> = slice_to_f32(batch.rows::<T>()?);
    let mut verdict = Ok(());
    if check {
        verdict = check_batch::<T>(&Expecting::of(comm), wl, round, batch, &rows);
    }
    let locals = topo.local_experts(comm.rank()).to_vec();
    let mut out32 = vec![0f32; rows.len()];
    for (j, &e) in locals.iter().enumerate() {
        for r in batch.expert_rows(j) {
            test_expert(
                e,
                &rows[r * hidden..(r + 1) * hidden],
                &mut out32[r * hidden..(r + 1) * hidden],
            );
        }
    }
    let out: Vec<T> = slice_from_f32(&out32);
    comm.e2a_send(batch, &out)?;
    Ok(verdict)
}

fn check_batch<T: Element>(
    ctx: &Expecting,
    wl: &Workload,
    round: u64,
    batch: &ExpertBatch,
    rows: &[f32],
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
    let mut xs = std::collections::HashMap::new();
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
            if (batch.src_rank[r], batch.src_token[r], batch.weight[r]) != (src, tok, w) {
                return Err(format!(
                    "rank {rank} round {round}: expert {j} row {r} is ({}, {}, {}), reference ({src}, {tok}, {w})",
                    batch.src_rank[r], batch.src_token[r], batch.weight[r]
                ));
            }
            let x = xs.entry(src).or_insert_with(|| {
                let n = inputs
                    .iter()
                    .find(|i| i.rank == src as usize)
                    .map_or(0, |i| i.num_tokens);
                let x32 = wl.hidden_states(src as usize, round, n, hidden);
                slice_to_f32(&slice_from_f32::<T>(&x32))
            });
            let t = tok as usize;
            if rows[r * hidden..(r + 1) * hidden] != x[t * hidden..(t + 1) * hidden] {
                return Err(format!(
                    "rank {rank} round {round}: payload of row {r} (rank {src} token {tok}) differs"
                ));
            }
        }
    }
    Ok(())
}

/// Runs one expert-rank step of `round` on the token-major path: A2E receive into `batch`
/// (checked against the reference when `check`), the gating-weighted sum of [`test_expert`] over
/// each token's local experts, and a token-major E2A send.
pub fn expert_round_tokens<T: Element>(
    comm: &mut Communicator,
    wl: &Workload,
    round: u64,
    batch: &mut TokenBatch,
    check: bool,
) -> Result<std::result::Result<(), String>> {
    expert_round_tokens_with::<T>(comm, wl, round, batch, check, Buffers::Copy)
}

/// [`expert_round_tokens`] computing into the registered output ([`Communicator::e2a_output`])
/// when `buffers` is [`Buffers::Registered`].
pub fn expert_round_tokens_with<T: Element>(
    comm: &mut Communicator,
    wl: &Workload,
    round: u64,
    batch: &mut TokenBatch,
    check: bool,
    buffers: Buffers,
) -> Result<std::result::Result<(), String>> {
    let mut arrivals = 0usize;
    comm.a2e_recv_tokens(batch, &mut |_, _| arrivals += 1)?;
    let topo = comm.topology().clone();
    let hidden = comm.config().hidden;
    let rows: Vec<f32> = slice_to_f32(batch.rows::<T>()?);
    let mut verdict = Ok(());
    if arrivals != topo.attention_ranks().len() {
        verdict = Err(format!(
            "{arrivals} arrival callbacks for {} sources",
            topo.attention_ranks().len()
        ));
    }
    if check && verdict.is_ok() {
        verdict = check_tokens::<T>(&Expecting::of(comm), wl, round, batch, &rows);
    }
    let locals = topo.local_experts(comm.rank()).to_vec();
    let mut reduced = vec![0f32; rows.len()];
    let mut tmp = vec![0f32; hidden];
    for i in 0..batch.num_tokens() {
        let (experts, weights) = batch.experts_of(i);
        let x = &rows[i * hidden..(i + 1) * hidden];
        let acc = &mut reduced[i * hidden..(i + 1) * hidden];
        for (&j, &w) in experts.iter().zip(weights) {
            test_expert(locals[j as usize], x, &mut tmp);
            acc.iter_mut().zip(&tmp).for_each(|(a, v)| *a += w * v);
        }
    }
    let out: Vec<T> = slice_from_f32(&reduced);
    match buffers {
        Buffers::Copy => comm.e2a_send_tokens(batch, &out)?,
        Buffers::Registered => {
            comm.e2a_output::<T>(batch)?.copy_from_slice(&out);
            comm.e2a_send_output(batch)?;
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
}

impl Expecting {
    /// Every attention rank's routing of `round`, and what the reference says this rank gets.
    fn expected(
        &self,
        wl: &Workload,
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
        }
    }
}

/// Runs one expert-rank step of `round` through [`Communicator::a2e_recv_view`]: the rows are
/// read in place (checked against the reference when `check`), and the gating-weighted sum of
/// [`test_expert`] is computed straight into the reply rows.
pub fn expert_round_view<T: Element>(
    comm: &mut Communicator,
    wl: &Workload,
    round: u64,
    check: bool,
) -> Result<std::result::Result<(), String>> {
    let ctx = Expecting::of(comm);
    let locals = ctx.topo.local_experts(ctx.rank).to_vec();
    let hidden = ctx.hidden;
    let mode = comm.config().mode;
    let view = comm.a2e_recv_view()?;
    let mut rows = Vec::with_capacity(view.num_tokens() * hidden);
    for i in 0..view.num_tokens() {
        rows.extend(slice_to_f32(view.row::<T>(i)?));
    }
    let verdict = if check {
        check_tokens::<T>(&ctx, wl, round, view.meta(), &rows)
    } else {
        Ok(())
    };
    let meta = view.meta().clone();
    let mut tmp = vec![0f32; hidden];
    let mut acc = vec![0f32; hidden];
    view.e2a_send::<T>(mode, |i, input, output| {
        let x = slice_to_f32(input);
        acc.iter_mut().for_each(|a| *a = 0.0);
        let (experts, weights) = meta.experts_of(i);
        for (&j, &w) in experts.iter().zip(weights) {
            test_expert(locals[j as usize], &x, &mut tmp);
            acc.iter_mut().zip(&tmp).for_each(|(a, v)| *a += w * v);
        }
        for (o, &a) in output.iter_mut().zip(&acc) {
            *o = T::from_f32(a);
        }
    })?;
    Ok(verdict)
}

fn check_tokens<T: Element>(
    ctx: &Expecting,
    wl: &Workload,
    round: u64,
    batch: &TokenBatch,
    rows: &[f32],
) -> std::result::Result<(), String> {
    let (inputs, me) = ctx.expected(wl, round)?;
    let (hidden, rank) = (ctx.hidden, ctx.rank);
    let mut want: std::collections::BTreeMap<(u32, u32), Vec<(u32, f32)>> = Default::default();
    for (j, list) in me.per_local_expert.iter().enumerate() {
        for &(src, tok, w) in list {
            want.entry((src, tok)).or_default().push((j as u32, w));
        }
    }
    if want.len() != batch.num_tokens() {
        return Err(format!(
            "rank {rank} round {round}: {} tokens arrived, reference {}",
            batch.num_tokens(),
            want.len()
        ));
    }
    for i in 0..batch.num_tokens() {
        let key = (batch.src_rank[i], batch.src_token[i]);
        let (experts, weights) = batch.experts_of(i);
        let got: Vec<(u32, f32)> = experts
            .iter()
            .copied()
            .zip(weights.iter().copied())
            .collect();
        if want.get(&key) != Some(&got) {
            return Err(format!(
                "rank {rank} round {round}: token {key:?} has experts {got:?}, reference {:?}",
                want.get(&key)
            ));
        }
        let src = key.0 as usize;
        let n = inputs
            .iter()
            .find(|x| x.rank == src)
            .map_or(0, |x| x.num_tokens);
        let x = slice_to_f32(&slice_from_f32::<T>(
            &wl.hidden_states(src, round, n, hidden),
        ));
        let t = key.1 as usize;
        if rows[i * hidden..(i + 1) * hidden] != x[t * hidden..(t + 1) * hidden] {
            return Err(format!(
                "rank {rank} round {round}: payload of token {key:?} differs"
            ));
        }
    }
    Ok(())
}
