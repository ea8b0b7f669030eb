//! Single-process reference of dispatch (A2E) and combine (E2A): the oracle the real protocol is
//! tested against, plus shared test helpers (a deterministic expert function and a routing generator).
//!
//! This module owns the *contract* of what the protocol delivers, written as plainly as possible and
//! independently of [`DispatchLayout`](crate::moe::routing::DispatchLayout):
//!
//! - [`expected_dispatch`]: for every expert rank, for every local expert, the rows it receives as
//!   `(source rank, source token, weight)`, ordered by source rank, then source token. The real A2E
//!   output follows this order (rows grouped expert-major).
//! - [`expected_combine_exact`]: what one attention rank gets back, bit for bit: it replays the
//!   protocol's documented order and roundings (expert outputs rounded to the dtype, f32 weighted
//!   sums over local experts in ascending order on each expert rank, one rounding, then f32 sums
//!   over expert ranks in ascending rank order, one rounding). Tests and `xccl-bench --check`
//!   compare bits against it.
//! - [`expected_combine`]: the same in f64 without intermediate roundings: the mathematical value,
//!   for error bounds.
//!
//! Duplicate expert ids in a row are merged (one row, weights summed in f32 in slot order, exactly as
//! the layout does), and `-1` means "no expert". Inputs are expected to be valid; these functions
//! panic with a message on bad input rather than return errors.

use crate::moe::dtype::Element;
use crate::moe::quant::Quant;
use crate::topology::Topology;

/// One attention rank's routing for one call.
#[derive(Clone, Debug, PartialEq)]
pub struct RankInput {
    /// Global rank of the (attention) source.
    pub rank: usize,
    /// Number of tokens `T`.
    pub num_tokens: usize,
    /// Top-k `K`: slots per token.
    pub k: usize,
    /// `[T, K]` row-major expert ids; `-1` = no expert.
    pub topk_idx: Vec<i32>,
    /// `[T, K]` row-major gating weights.
    pub topk_weights: Vec<f32>,
}

impl RankInput {
    /// Random routing for `rank` from [`random_routing`], with the seed mixed with the rank so every
    /// rank gets a different routing.
    pub fn random(
        rank: usize,
        seed: u64,
        num_tokens: usize,
        k: usize,
        num_experts: usize,
        skew: Option<f64>,
    ) -> Self {
        let seed = seed ^ (rank as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let (topk_idx, topk_weights) = random_routing(seed, num_tokens, k, num_experts, skew);
        RankInput {
            rank,
            num_tokens,
            k,
            topk_idx,
            topk_weights,
        }
    }

    /// Token `t`'s distinct experts with merged weights, in order of first appearance. Weights of
    /// duplicates are summed in f32 in slot order.
    ///
    /// # Panics
    ///
    /// If the lengths are inconsistent, `t >= num_tokens`, or an id other than `-1` is outside
    /// `0..num_experts`.
    pub fn merged_row(&self, t: usize, num_experts: usize) -> Vec<(usize, f32)> {
        self.check_lengths();
        assert!(
            t < self.num_tokens,
            "token {t} out of range 0..{}",
            self.num_tokens
        );
        let mut row: Vec<(usize, f32)> = Vec::with_capacity(self.k);
        for s in 0..self.k {
            let id = self.topk_idx[t * self.k + s];
            if id == -1 {
                continue;
            }
            assert!(
                id >= 0 && (id as usize) < num_experts,
                "rank {} token {t} slot {s}: expert {id} outside 0..{num_experts}",
                self.rank
            );
            let w = self.topk_weights[t * self.k + s];
            match row.iter_mut().find(|(e, _)| *e == id as usize) {
                Some(entry) => entry.1 += w,
                None => row.push((id as usize, w)),
            }
        }
        row
    }

    fn check_lengths(&self) {
        let n = self.num_tokens * self.k;
        assert_eq!(
            self.topk_idx.len(),
            n,
            "rank {}: topk_idx length",
            self.rank
        );
        assert_eq!(
            self.topk_weights.len(),
            n,
            "rank {}: topk_weights length",
            self.rank
        );
    }
}

/// One row an expert receives: `(source rank, source token, weight)`.
pub type DispatchRow = (u32, u32, f32);

/// What one expert rank receives in a dispatch.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertRankRows {
    /// Global rank of the expert rank.
    pub rank: usize,
    /// Indexed by local expert: rows ordered by source rank ascending, then source token ascending.
    pub per_local_expert: Vec<Vec<DispatchRow>>,
}

impl ExpertRankRows {
    /// Total rows over all local experts (a token selecting two local experts counts twice).
    pub fn total_rows(&self) -> usize {
        self.per_local_expert.iter().map(Vec::len).sum()
    }
}

/// The rows every expert rank receives when the attention ranks route `inputs` (at most one input
/// per attention rank; ranks without an input send nothing). One [`ExpertRankRows`] per expert rank,
/// in [`Topology::expert_ranks`] order. Replicas are chosen by [`Topology::route`].
///
/// # Panics
///
/// If an input's rank is not an attention rank or appears twice, or an input is malformed (see
/// [`RankInput::merged_row`]).
pub fn expected_dispatch(topo: &Topology, inputs: &[RankInput]) -> Vec<ExpertRankRows> {
    let mut out: Vec<ExpertRankRows> = topo
        .expert_ranks()
        .iter()
        .map(|&rank| ExpertRankRows {
            rank,
            per_local_expert: vec![Vec::new(); topo.local_experts(rank).len()],
        })
        .collect();
    let mut order: Vec<&RankInput> = inputs.iter().collect();
    order.sort_by_key(|input| input.rank);
    for pair in order.windows(2) {
        assert_ne!(
            pair[0].rank, pair[1].rank,
            "two inputs for rank {}",
            pair[0].rank
        );
    }
    for input in order {
        assert!(
            topo.attention_index(input.rank).is_some(),
            "input for rank {}, which is not an attention rank",
            input.rank
        );
        for t in 0..input.num_tokens {
            for (expert, weight) in input.merged_row(t, topo.num_experts()) {
                if topo.is_orphaned(expert) {
                    continue; // dropped by the sender, counted there
                }
                let (dst, local) = topo.route(input.rank, expert);
                let index = topo.expert_index(dst).expect("route gives an expert rank");
                out[index].per_local_expert[local].push((input.rank as u32, t as u32, weight));
            }
        }
    }
    out
}

/// An expert's computation: `(global expert id, input row, output row)`; both rows are `hidden`
/// long. [`test_expert`] is one.
pub type ExpertFn<'a> = dyn Fn(usize, &[f32], &mut [f32]) + 'a;

/// What attention rank `input.rank` gets back from combine: for each token `t`,
/// `out[t] = sum over distinct experts e of w(t, e) * expert_fn(e, x[t])`, with `w(t, e)` the sum of
/// the weights of the slots selecting `e`. Computed in f64, returned as f32 (`[T, hidden]`
/// row-major). The result does not depend on the placement; `topo` only bounds the expert ids
/// and names the experts without a replica after a shrink, whose selections contribute nothing.
///
/// # Panics
///
/// If `x.len() != input.num_tokens * hidden` or the input is malformed.
pub fn expected_combine(
    topo: &Topology,
    input: &RankInput,
    x: &[f32],
    hidden: usize,
    expert_fn: &ExpertFn<'_>,
) -> Vec<f32> {
    input.check_lengths();
    assert_eq!(
        x.len(),
        input.num_tokens * hidden,
        "x must be [num_tokens, hidden]"
    );
    let mut out = vec![0.0f32; x.len()];
    let mut y = vec![0.0f32; hidden];
    let mut acc = vec![0.0f64; hidden];
    for t in 0..input.num_tokens {
        let mut row: Vec<(usize, f64)> = Vec::with_capacity(input.k);
        for s in 0..input.k {
            let id = input.topk_idx[t * input.k + s];
            if id == -1 {
                continue;
            }
            assert!(
                id >= 0 && (id as usize) < topo.num_experts(),
                "rank {} token {t} slot {s}: expert {id} outside 0..{}",
                input.rank,
                topo.num_experts()
            );
            if topo.is_orphaned(id as usize) {
                continue;
            }
            let w = f64::from(input.topk_weights[t * input.k + s]);
            match row.iter_mut().find(|(e, _)| *e == id as usize) {
                Some(entry) => entry.1 += w,
                None => row.push((id as usize, w)),
            }
        }
        let xt = &x[t * hidden..][..hidden];
        acc.fill(0.0);
        for (expert, w) in row {
            y.fill(0.0);
            expert_fn(expert, xt, &mut y);
            for (a, &v) in acc.iter_mut().zip(&y) {
                *a += w * f64::from(v);
            }
        }
        for (o, &a) in out[t * hidden..][..hidden].iter_mut().zip(&acc) {
            *o = a as f32;
        }
    }
    out
}

/// The expert output the protocol carries: `expert_fn(expert, f32(x))` rounded to `T`.
pub fn expert_output<T: Element>(expert_fn: &ExpertFn<'_>, expert: usize, x: &[T]) -> Vec<T> {
    let x32: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let mut y = vec![0.0f32; x.len()];
    expert_fn(expert, &x32, &mut y);
    y.into_iter().map(T::from_f32).collect()
}

/// One expert rank's reply row for a token: `acc = 0`, then `acc = acc + w * f32(y)` over
/// `(weight, output row)` in the order given (ascending local expert), then one rounding to `T`.
pub fn reduce_on_expert<T: Element>(outputs: &[(f32, Vec<T>)], hidden: usize) -> Vec<T> {
    let mut acc = vec![0.0f32; hidden];
    for (w, y) in outputs {
        for (a, v) in acc.iter_mut().zip(y) {
            *a += *w * v.to_f32();
        }
    }
    acc.into_iter().map(T::from_f32).collect()
}

/// The INT8 quantizer as `moe::quant` specifies it, written plainly (scalar, independent of the
/// library's vectorised one): `(q, scale)`.
pub fn quantize_int8(x: &[f32]) -> (Vec<i8>, f32) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        return (vec![0; x.len()], 0.0);
    }
    let inv = 127.0f32 / amax;
    let q = x
        .iter()
        .map(|&v| (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8)
        .collect();
    (q, amax / 127.0f32)
}

/// `f32(q_i) * scale`.
pub fn dequantize_int8(q: &[i8], scale: f32) -> Vec<f32> {
    q.iter().map(|&v| v as f32 * scale).collect()
}

/// The row an expert rank sees of `x` when A2E uses `quant`: `x` itself, or `x` quantized,
/// dequantized and rounded once to `T`.
pub fn a2e_seen<T: Element>(x: &[T], quant: Quant) -> Vec<T> {
    match quant {
        Quant::None => x.to_vec(),
        Quant::Int8 => {
            let wide: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
            let (q, scale) = quantize_int8(&wide);
            dequantize_int8(&q, scale)
                .into_iter()
                .map(T::from_f32)
                .collect()
        }
    }
}

/// What attention rank `input.rank` gets back from combine, bit for bit as the protocol computes
/// it (see the module docs): `x` is `[T, hidden]` in the wire dtype. Replicas are chosen by
/// [`Topology::route`], so unlike [`expected_combine`] the result depends on the placement.
///
/// # Panics
///
/// If `x.len() != input.num_tokens * hidden` or the input is malformed.
pub fn expected_combine_exact<T: Element>(
    topo: &Topology,
    input: &RankInput,
    x: &[T],
    hidden: usize,
    expert_fn: &ExpertFn<'_>,
) -> Vec<T> {
    expected_combine_quant(topo, input, x, hidden, expert_fn, Quant::None, Quant::None)
}

/// [`expected_combine_exact`] with A2E rows quantized as `a2e` says and E2A replies as `e2a`
/// says: the expert computes on [`a2e_seen`] rows, and an INT8 reply enters the attention
/// rank's sum as `f32(q) * scale` (a single INT8 reply is dequantized and rounded once).
/// Through relays (`topo` has a relay plan), a token with several INT8 replies gets that f32
/// sum quantized once more by the relay, then dequantized and rounded once.
#[allow(clippy::too_many_arguments)]
pub fn expected_combine_quant<T: Element>(
    topo: &Topology,
    input: &RankInput,
    x: &[T],
    hidden: usize,
    expert_fn: &ExpertFn<'_>,
    a2e: Quant,
    e2a: Quant,
) -> Vec<T> {
    input.check_lengths();
    assert_eq!(
        x.len(),
        input.num_tokens * hidden,
        "x must be [num_tokens, hidden]"
    );
    let relayed_int8 = topo.relay_plan().is_some() && e2a == Quant::Int8;
    let mut out = Vec::with_capacity(x.len());
    for t in 0..input.num_tokens {
        let seen = a2e_seen(&x[t * hidden..(t + 1) * hidden], a2e);
        let xt = &seen[..];
        // Per expert rank (ascending): its (local expert, expert, merged weight), ascending.
        type Locals = Vec<(usize, usize, f32)>;
        let mut per_rank: Vec<(usize, Locals)> = Vec::new();
        for (expert, w) in input.merged_row(t, topo.num_experts()) {
            if topo.is_orphaned(expert) {
                continue; // dropped by the sender: no contribution
            }
            let (dst, local) = topo.route(input.rank, expert);
            match per_rank.iter_mut().find(|(d, _)| *d == dst) {
                Some((_, list)) => list.push((local, expert, w)),
                None => per_rank.push((dst, vec![(local, expert, w)])),
            }
        }
        per_rank.sort_by_key(|(d, _)| *d);
        let replies: Vec<Vec<T>> = per_rank
            .into_iter()
            .map(|(_, mut list)| {
                list.sort_by_key(|&(local, _, _)| local);
                let outputs: Vec<(f32, Vec<T>)> = list
                    .into_iter()
                    .map(|(_, e, w)| (w, expert_output(expert_fn, e, xt)))
                    .collect();
                reduce_on_expert(&outputs, hidden)
            })
            .collect();
        // Each reply as the attention rank adds it: f32 of the row, or its dequantized INT8.
        let values: Vec<Vec<f32>> = replies
            .iter()
            .map(|r| {
                let wide: Vec<f32> = r.iter().map(|v| v.to_f32()).collect();
                match e2a {
                    Quant::None => wide,
                    Quant::Int8 => {
                        let (q, scale) = quantize_int8(&wide);
                        dequantize_int8(&q, scale)
                    }
                }
            })
            .collect();
        match replies.len() {
            0 => out.extend(std::iter::repeat_n(T::from_f32(0.0), hidden)),
            1 if e2a == Quant::None => out.extend_from_slice(&replies[0]),
            _ => {
                let mut acc = values[0].clone();
                for v in &values[1..] {
                    for (a, &d) in acc.iter_mut().zip(v) {
                        *a += d;
                    }
                }
                if relayed_int8 && replies.len() > 1 {
                    // The relay sums and quantizes its sum once more; the attention rank
                    // dequantizes that.
                    let (q, scale) = quantize_int8(&acc);
                    acc = dequantize_int8(&q, scale);
                }
                out.extend(acc.into_iter().map(T::from_f32));
            }
        }
    }
    out
}

/// A cheap deterministic expert everyone can share in tests:
/// `out[i] = x[i] * (1 + expert / 8) + expert * 0.01`. Distinct per expert.
///
/// # Panics
///
/// If `x.len() != out.len()`.
pub fn test_expert(expert: usize, x: &[f32], out: &mut [f32]) {
    assert_eq!(
        x.len(),
        out.len(),
        "test_expert: x and out differ in length"
    );
    let scale = 1.0 + expert as f32 / 8.0;
    let bias = expert as f32 * 0.01;
    for (o, &v) in out.iter_mut().zip(x) {
        *o = v * scale + bias;
    }
}

/// A small self-contained PRNG (splitmix64) for tests and benchmarks: fast, deterministic per seed,
/// not cryptographic.
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator starting from `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `0..n` (multiply-shift; negligible bias for small `n`).
    ///
    /// # Panics
    ///
    /// If `n == 0`.
    pub fn below(&mut self, n: usize) -> usize {
        assert!(n > 0, "SplitMix64::below(0)");
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}

/// Random top-k routing of `num_tokens` tokens over `num_experts` experts: `(topk_idx, topk_weights)`,
/// both `[num_tokens, k]` row-major. Deterministic per seed.
///
/// - `skew: None`: experts uniform, distinct within a row. If `k > num_experts`, each row lists every
///   expert once (in random order) and the remaining slots are `-1` with weight 0.
/// - `skew: Some(s)`: Zipf-like, `P(e) ∝ 1 / (e + 1)^s` (expert 0 hottest; `s = 0` is uniform),
///   slots drawn independently, so duplicates are possible.
///
/// Weights are positive for every selected slot and sum to 1 per row (up to rounding).
///
/// # Panics
///
/// If `s` is negative or not finite, or `num_experts` exceeds `i32::MAX`.
pub fn random_routing(
    seed: u64,
    num_tokens: usize,
    k: usize,
    num_experts: usize,
    skew: Option<f64>,
) -> (Vec<i32>, Vec<f32>) {
    assert!(
        i32::try_from(num_experts).is_ok(),
        "num_experts exceeds i32"
    );
    let mut rng = SplitMix64::new(seed);
    let mut idx = vec![-1i32; num_tokens * k];
    let mut w = vec![0.0f32; num_tokens * k];
    let cdf: Option<Vec<f64>> = skew.map(|s| {
        assert!(
            s.is_finite() && s >= 0.0,
            "skew must be finite and >= 0, got {s}"
        );
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = (0..num_experts)
            .map(|e| {
                acc += 1.0 / ((e + 1) as f64).powf(s);
                acc
            })
            .collect();
        for c in &mut cdf {
            *c /= acc;
        }
        cdf
    });
    if num_experts == 0 {
        return (idx, w);
    }
    for t in 0..num_tokens {
        let row = &mut idx[t * k..][..k];
        match &cdf {
            None => {
                let chosen = k.min(num_experts);
                for s in 0..chosen {
                    loop {
                        let e = rng.below(num_experts) as i32;
                        if !row[..s].contains(&e) {
                            row[s] = e;
                            break;
                        }
                    }
                }
            }
            Some(cdf) => {
                for slot in row.iter_mut() {
                    let u = rng.next_f64();
                    let e = cdf.partition_point(|&c| c <= u).min(num_experts - 1);
                    *slot = e as i32;
                }
            }
        }
        let weights = &mut w[t * k..][..k];
        let mut sum = 0.0f32;
        for (wt, &e) in weights.iter_mut().zip(row.iter()) {
            if e >= 0 {
                *wt = 0.1 + 0.9 * rng.next_f64() as f32;
                sum += *wt;
            }
        }
        if sum > 0.0 {
            for wt in weights.iter_mut() {
                *wt /= sum;
            }
        }
    }
    (idx, w)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::routing::{mask_iter, DispatchLayout};
    use crate::topology::tests::arb_topology;
    use crate::topology::TopologyBuilder;
    use proptest::prelude::*;

    #[test]
    fn uniform_routing_has_distinct_experts_and_normalized_weights() {
        let (idx, w) = random_routing(7, 500, 6, 32, None);
        assert_eq!(idx.len(), 3000);
        for t in 0..500 {
            let row = &idx[t * 6..][..6];
            for (i, &e) in row.iter().enumerate() {
                assert!((0..32).contains(&e));
                assert!(!row[..i].contains(&e));
            }
            let ws = &w[t * 6..][..6];
            assert!(ws.iter().all(|&x| x > 0.0));
            assert!((ws.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        }
        // Every expert gets used.
        for e in 0..32 {
            assert!(idx.contains(&e), "expert {e} never chosen");
        }
    }

    #[test]
    fn routing_is_deterministic_per_seed() {
        assert_eq!(
            random_routing(3, 50, 4, 16, None),
            random_routing(3, 50, 4, 16, None)
        );
        assert_eq!(
            random_routing(3, 50, 4, 16, Some(1.0)),
            random_routing(3, 50, 4, 16, Some(1.0))
        );
        assert_ne!(
            random_routing(3, 50, 4, 16, None),
            random_routing(4, 50, 4, 16, None)
        );
    }

    #[test]
    fn k_above_num_experts_pads_with_minus_one() {
        let (idx, w) = random_routing(1, 10, 5, 3, None);
        for t in 0..10 {
            let mut row: Vec<i32> = idx[t * 5..][..5].to_vec();
            assert_eq!(&row[3..], &[-1, -1]);
            assert_eq!(&w[t * 5 + 3..][..2], &[0.0, 0.0]);
            row.truncate(3);
            row.sort_unstable();
            assert_eq!(row, vec![0, 1, 2]);
        }
    }

    #[test]
    fn skewed_routing_prefers_low_expert_ids() {
        let (idx, w) = random_routing(11, 2000, 4, 64, Some(1.2));
        let mut hits = [0usize; 64];
        for &e in &idx {
            assert!((0..64).contains(&e));
            hits[e as usize] += 1;
        }
        assert!(hits[0] > 5 * hits[63].max(1), "{hits:?}");
        assert!(hits[0] > hits[8]);
        for t in 0..2000 {
            assert!((w[t * 4..][..4].iter().sum::<f32>() - 1.0).abs() < 1e-5);
        }
    }

    #[test]
    fn test_expert_is_distinct_per_expert() {
        let x = [1.0f32, -2.0, 0.5];
        let mut a = [0.0; 3];
        let mut b = [0.0; 3];
        test_expert(0, &x, &mut a);
        assert_eq!(a, x);
        test_expert(8, &x, &mut b);
        for (got, want) in b.iter().zip([2.08f32, -3.92, 1.08]) {
            assert!((got - want).abs() < 1e-6, "{got} vs {want}");
        }
        for e in 1..20 {
            let mut c = [0.0; 3];
            test_expert(e, &x, &mut c);
            assert_ne!(c, a);
        }
    }

    #[test]
    fn expected_dispatch_orders_by_source_then_token() {
        // Attention 0, 1; expert ranks 2 (experts 0, 1) and 3 (experts 2, 3).
        let t = Topology::contiguous(2, 2, 4).unwrap();
        let in1 = RankInput {
            rank: 1,
            num_tokens: 2,
            k: 2,
            topk_idx: vec![1, 2, 1, -1],
            topk_weights: vec![0.5, 0.5, 1.0, 0.0],
        };
        let in0 = RankInput {
            rank: 0,
            num_tokens: 2,
            k: 2,
            topk_idx: vec![3, 3, 1, 0],
            topk_weights: vec![0.25, 0.5, 0.75, 0.125],
        };
        // Input order does not matter.
        let rows = expected_dispatch(&t, &[in1, in0]);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].rank, 2);
        assert_eq!(rows[0].per_local_expert[0], vec![(0, 1, 0.125)]);
        assert_eq!(
            rows[0].per_local_expert[1],
            vec![(0, 1, 0.75), (1, 0, 0.5), (1, 1, 1.0)]
        );
        assert_eq!(rows[1].rank, 3);
        assert_eq!(rows[1].per_local_expert[0], vec![(1, 0, 0.5)]);
        assert_eq!(rows[1].per_local_expert[1], vec![(0, 0, 0.75)]);
        assert_eq!(rows[0].total_rows() + rows[1].total_rows(), 6);
    }

    #[test]
    #[should_panic(expected = "two inputs for rank 0")]
    fn expected_dispatch_rejects_duplicate_sources() {
        let t = Topology::contiguous(1, 1, 1).unwrap();
        let i = RankInput::random(0, 1, 2, 1, 1, None);
        expected_dispatch(&t, &[i.clone(), i]);
    }

    #[test]
    fn expected_combine_merges_duplicates_and_skips_minus_one() {
        let t = Topology::contiguous(1, 2, 4).unwrap();
        let input = RankInput {
            rank: 0,
            num_tokens: 2,
            k: 3,
            topk_idx: vec![2, -1, 2, 0, 3, -1],
            topk_weights: vec![0.25, 9.0, 0.5, 0.5, 0.5, 9.0],
        };
        let x = [1.0f32, 2.0, -1.0, 4.0];
        let out = expected_combine(&t, &input, &x, 2, &test_expert);
        // token 0: 0.75 * (x * 1.25 + 0.02)
        let t0 = [0.75 * (1.25 + 0.02), 0.75 * (2.5 + 0.02)];
        // token 1: 0.5 * x + 0.5 * (x * 1.375 + 0.03)
        let t1 = [-0.5 + 0.5 * (-1.375 + 0.03), 0.5 * 4.0 + 0.5 * (5.5 + 0.03)];
        for (got, want) in out.iter().zip(t0.iter().chain(&t1)) {
            assert!((got - want).abs() < 1e-6, "{got} vs {want}");
        }
    }

    #[test]
    fn expected_combine_does_not_depend_on_placement() {
        let a = Topology::contiguous(2, 3, 8).unwrap();
        let b = TopologyBuilder::contiguous(2, 2, 8)
            .replicas(&[(0, 1), (5, 1)])
            .build()
            .unwrap();
        let input = RankInput::random(1, 5, 9, 3, 8, Some(0.8));
        let x: Vec<f32> = (0..9 * 4).map(|i| (i as f32).sin()).collect();
        assert_eq!(
            expected_combine(&a, &input, &x, 4, &test_expert),
            expected_combine(&b, &input, &x, 4, &test_expert)
        );
    }

    proptest! {
        #[test]
        fn expected_dispatch_matches_layouts(
            t in arb_topology(),
            seed in any::<u64>(),
            n in 0usize..20,
            k in 1usize..5,
            skew in proptest::option::of(0.0f64..2.0),
        ) {
            let inputs: Vec<RankInput> = t
                .attention_ranks()
                .iter()
                .map(|&r| RankInput::random(r, seed, n, k, t.num_experts(), skew))
                .collect();
            let want = expected_dispatch(&t, &inputs);

            let layouts: Vec<DispatchLayout> = inputs
                .iter()
                .map(|i| DispatchLayout::build(&t, i.rank, i.num_tokens, &i.topk_idx, &i.topk_weights, i.k).unwrap())
                .collect();
            prop_assert_eq!(want.len(), t.expert_ranks().len());
            for rows in &want {
                let d = rows.rank;
                let mut got = vec![Vec::new(); t.local_experts(d).len()];
                for (input, l) in inputs.iter().zip(&layouts) {
                    for i in l.entries(d) {
                        for (pos, j) in mask_iter(l.mask(i)).enumerate() {
                            got[j].push((input.rank as u32, l.tokens[i], l.weights(i)[pos]));
                        }
                    }
                }
                prop_assert_eq!(&rows.per_local_expert, &got);
            }
        }
    }
}
