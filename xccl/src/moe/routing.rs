//! Dispatch layout: turns one attention rank's top-k routing into per-destination token lists.
//!
//! This module owns the step between "token `t` picked experts `idx[t, ..]` with weights
//! `w[t, ..]`" and what crosses the wire: one entry per (token, destination rank), carrying the
//! token's source index, a bitmask of the local experts it selected at that destination, and the
//! gating weights of those experts. A token that picks three experts hosted by one rank becomes one
//! entry with three bits set, so it crosses the wire once (see DESIGN.md, "Wire protocol").
//!
//! Pure data: no I/O. [`DispatchLayout::build_into`] reuses its allocations, so the hot path can
//! call it every layer without allocating once the buffers have grown.
//!
//! # Semantics
//!
//! - `topk_idx` is `[num_tokens, k]` row-major. `-1` means "no expert" and is skipped. Any other id
//!   outside `0..num_experts` is rejected, and nothing is built.
//! - The replica used for each expert is [`Topology::route`]'s choice for the source rank.
//! - The same expert appearing twice in a row is merged into one bit; its weights are summed in f32
//!   in slot order.
//! - Gating weights must be finite: a NaN or infinite weight of a selected expert is rejected
//!   (naming the token and slot), since it would silently poison the combined row; so is an
//!   expert selected twice whose weights sum to infinity. Negative and
//!   zero weights are accepted and used as given (some routers produce them); the weight of a
//!   `-1` slot is ignored.
//! - Within a destination, entries are in ascending source-token order. Within an entry, the
//!   weights are those of the set bits in ascending local-expert order; the remaining of the `k`
//!   slots are `0.0`.

use std::ops::Range;

use crate::topology::{RouteKey, Topology};
use crate::{Error, Result};

/// One attention rank's routing for one call, grouped by destination rank.
///
/// Entries for destination rank `d` are `dest_start[d]..dest_start[d + 1]`; entry `i` has source
/// token `tokens[i]`, mask `masks[i * mask_words..][..mask_words]` and weights
/// `weights[i * k..][..k]`. Attention ranks (and expert ranks the source sends nothing to) have no
/// entries.
#[derive(Clone, Debug, Default)]
pub struct DispatchLayout {
    /// `u64` words per entry mask (= [`Topology::mask_words`]).
    pub mask_words: usize,
    /// Weight slots per entry (= top-k `K`).
    pub k: usize,
    /// Length `world_size + 1`; entries for destination rank `d` are `dest_start[d]..dest_start[d + 1]`.
    pub dest_start: Vec<usize>,
    /// Per entry: source token index, ascending within a destination.
    pub tokens: Vec<u32>,
    /// Per entry, `mask_words` words: bit `j` set = local expert `j` at that destination.
    pub masks: Vec<u64>,
    /// Per entry, `k` slots: weights of the set bits in ascending local-expert order, rest `0.0`.
    pub weights: Vec<f32>,
    /// Number of source tokens of the call the layout was built for.
    num_tokens: usize,
    /// Scratch: per destination rank, the last token (stamp) that made an entry for it, and
    /// that entry while the token is filled in.
    dst_stamp: Vec<usize>,
    entry_of: Vec<usize>,
    /// Scratch: per expert, the last token (stamp) that selected it (duplicates are merged).
    expert_stamp: Vec<usize>,
    /// Stamps taken by the calls so far: a call's stamps are above every stamp in the tables.
    stamp_base: usize,
    /// Scratch: one token's route keys, one per slot ([`RouteKey::ORPHANED`] for `-1` too).
    keys: Vec<RouteKey>,
    /// Scratch: entries per destination while counting (at `d + 1`), then the next free entry
    /// per destination while filling.
    cursor: Vec<usize>,
    /// Slots that selected an expert without a replica ([`Topology::is_orphaned`]), dropped.
    dropped: usize,
}

impl DispatchLayout {
    /// Builds the layout of `num_tokens` tokens routed by `topk_idx` / `topk_weights` (both
    /// `[num_tokens, k]` row-major) from attention rank `src_rank`.
    ///
    /// # Errors
    ///
    /// See [`build_into`](DispatchLayout::build_into).
    pub fn build(
        topo: &Topology,
        src_rank: usize,
        num_tokens: usize,
        topk_idx: &[i32],
        topk_weights: &[f32],
        k: usize,
    ) -> Result<Self> {
        let mut layout = DispatchLayout::default();
        layout.build_into(topo, src_rank, num_tokens, topk_idx, topk_weights, k)?;
        Ok(layout)
    }

    /// Like [`build`](DispatchLayout::build), but rebuilds `self` in place, reusing its buffers.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if `src_rank` is not an attention rank, `topk_idx` or
    /// `topk_weights` does not have `num_tokens * k` elements, `num_tokens` does not fit in a `u32`,
    /// or an expert id other than `-1` is outside `0..num_experts` (the message names the token, the
    /// slot and the id), or a selected expert's weight (or the sum of the weights of an expert
    /// selected twice) is not finite. On error `self` is left unchanged.
    pub fn build_into(
        &mut self,
        topo: &Topology,
        src_rank: usize,
        num_tokens: usize,
        topk_idx: &[i32],
        topk_weights: &[f32],
        k: usize,
    ) -> Result<()> {
        let Some(attention_index) = topo.attention_index(src_rank) else {
            return Err(Error::invalid(format!(
                "dispatch layout: source rank {src_rank} is not an attention rank"
            )));
        };
        let n = num_tokens.checked_mul(k).ok_or_else(|| {
            Error::invalid(format!(
                "dispatch layout: num_tokens {num_tokens} x k {k} overflows"
            ))
        })?;
        if topk_idx.len() != n {
            return Err(Error::invalid(format!(
                "dispatch layout: topk_idx has {} elements, expected num_tokens {num_tokens} x k {k} = {n}",
                topk_idx.len()
            )));
        }
        if topk_weights.len() != n {
            return Err(Error::invalid(format!(
                "dispatch layout: topk_weights has {} elements, expected num_tokens {num_tokens} x k {k} = {n}",
                topk_weights.len()
            )));
        }
        if u32::try_from(num_tokens).is_err() {
            return Err(Error::invalid(format!(
                "dispatch layout: num_tokens {num_tokens} does not fit in u32"
            )));
        }
        // Pass 1, which also validates: route every slot and count the entries per destination
        // (into `cursor`, scratch), one per (token, destination). `self`'s results are untouched
        // until every slot has passed, so an error leaves them as they were. Stamps (base +
        // token + 1 here, base + num_tokens + token + 1 in pass 2) mark the destinations and
        // experts a token has already touched, so no slot list is stored or sorted: each call
        // brings a new routing, whose sort branches the predictor cannot learn (sorting each
        // token's slots, as this did before, took 1.3-1.4x as long in `benches/protocol.rs`
        // `layout/T` and 1.5-1.9x as long timed inside the A2E send, docs/performance.md).
        let num_experts = topo.num_experts();
        let world = topo.world_size();
        // The topology keeps every expert's route where it does not depend on the source.
        let route = |e: usize| topo.route_key(attention_index, e);
        self.cursor.clear();
        self.cursor.resize(world + 1, 0);
        // Stamps only grow from call to call, so a stamp table holds no value of this call
        // before this call writes it: the tables are cleared only when their sizes change (or,
        // in theory, when the stamps would run out), not per call (at T=1 the clearing was a
        // good part of the layout). The call's stamps are taken before anything can fail.
        let stamps = 2 * num_tokens;
        if self.dst_stamp.len() != world
            || self.expert_stamp.len() != num_experts
            || self.stamp_base > usize::MAX - stamps
        {
            self.dst_stamp.clear();
            self.dst_stamp.resize(world, 0);
            self.entry_of.clear();
            self.entry_of.resize(world, 0);
            self.expert_stamp.clear();
            self.expert_stamp.resize(num_experts, 0);
            self.stamp_base = 0;
        }
        let base = self.stamp_base;
        self.stamp_base += stamps;
        let mut dropped = 0;
        let mut valid = true;
        let (cursor, dst_stamp) = (&mut self.cursor[..], &mut self.dst_stamp[..]);
        let expert_stamp = &mut self.expert_stamp[..];
        if k > 0 {
            let rows = topk_idx.chunks_exact(k).zip(topk_weights.chunks_exact(k));
            for (t, (ids, ws)) in rows.enumerate() {
                let stamp = base + t + 1;
                let mut repeats = false;
                for (&id, &w) in ids.iter().zip(ws) {
                    if id == -1 {
                        continue;
                    }
                    // A negative id other than -1 is out of range too (huge as usize).
                    let e = id as usize;
                    if e >= num_experts || !w.is_finite() {
                        valid = false;
                        continue;
                    }
                    let key = route(e);
                    if key == RouteKey::ORPHANED {
                        dropped += 1;
                        continue;
                    }
                    repeats |= expert_stamp[e] == stamp;
                    expert_stamp[e] = stamp;
                    let dst = key.split().0;
                    if dst_stamp[dst] != stamp {
                        dst_stamp[dst] = stamp;
                        cursor[dst + 1] += 1;
                    }
                }
                // An expert selected twice: its weights, summed in slot order, must be finite
                // (checked only while every id so far is in range: the call fails otherwise).
                if repeats && valid {
                    valid &= overflowing_merge(topo, ids, ws).is_none();
                }
            }
        }
        if !valid {
            // Rare: the slow checks name the first offending token and slot.
            validate(topo, topk_idx, topk_weights, k)?;
            return Err(Error::invalid(
                "dispatch layout: invalid routing (an expert id or a gating weight)",
            ));
        }

        // Everything is valid: from here on nothing fails.
        let mask_words = topo.mask_words();
        self.mask_words = mask_words;
        self.k = k;
        self.num_tokens = num_tokens;
        self.dropped = dropped;
        self.dest_start.clear();
        self.dest_start.extend_from_slice(&self.cursor);
        for d in 0..world {
            self.dest_start[d + 1] += self.dest_start[d];
        }
        let total = self.dest_start[world];

        // Pass 2: fill entries, tokens in ascending order per destination. Per token, first
        // every mask bit; then each weight goes to the place of its bit among the entry's set
        // bits (ascending local-expert order), a repeated expert's weight added in slot order.
        self.tokens.clear();
        self.tokens.resize(total, 0);
        self.masks.clear();
        self.masks.resize(total * mask_words, 0);
        self.weights.clear();
        self.weights.resize(total * k, 0.0);
        self.cursor.clear();
        self.cursor.extend_from_slice(&self.dest_start[..world]);
        self.keys.clear();
        self.keys.resize(k, RouteKey::ORPHANED);
        let (cursor, dst_stamp) = (&mut self.cursor[..], &mut self.dst_stamp[..]);
        let (entry_of, expert_stamp) = (&mut self.entry_of[..], &mut self.expert_stamp[..]);
        let (tokens, masks) = (&mut self.tokens[..], &mut self.masks[..]);
        let (weights, keys) = (&mut self.weights[..], &mut self.keys[..]);
        for t in 0..num_tokens {
            let stamp = base + num_tokens + t + 1;
            let ids = &topk_idx[t * k..][..k];
            let ws = &topk_weights[t * k..][..k];
            for (key, &id) in keys.iter_mut().zip(ids) {
                *key = if id == -1 {
                    RouteKey::ORPHANED
                } else {
                    route(id as usize)
                };
                if *key == RouteKey::ORPHANED {
                    continue;
                }
                let (dst, local) = key.split();
                if dst_stamp[dst] != stamp {
                    dst_stamp[dst] = stamp;
                    entry_of[dst] = cursor[dst];
                    tokens[cursor[dst]] = t as u32;
                    cursor[dst] += 1;
                }
                masks[entry_of[dst] * mask_words + local / 64] |= 1u64 << (local % 64);
            }
            for ((&key, &id), &w) in keys.iter().zip(ids).zip(ws) {
                if key == RouteKey::ORPHANED {
                    continue;
                }
                let (dst, local) = key.split();
                let entry = entry_of[dst];
                let mask = &masks[entry * mask_words..][..mask_words];
                let below = mask[..local / 64]
                    .iter()
                    .map(|m| m.count_ones())
                    .sum::<u32>()
                    + (mask[local / 64] & ((1u64 << (local % 64)) - 1)).count_ones();
                let slot = &mut weights[entry * k + below as usize];
                let e = id as usize;
                if expert_stamp[e] == stamp {
                    *slot += w;
                } else {
                    expert_stamp[e] = stamp;
                    *slot = w;
                }
            }
        }
        Ok(())
    }

    /// Number of destination ranks the layout covers (the topology's world size).
    pub fn world_size(&self) -> usize {
        self.dest_start.len().saturating_sub(1)
    }

    /// Expert selections the layout dropped because their expert has no replica left after a
    /// shrink ([`Topology::is_orphaned`]).
    pub fn dropped(&self) -> usize {
        self.dropped
    }

    /// Number of source tokens of the call.
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// Number of entries (tokens) for destination rank `dst`.
    ///
    /// # Panics
    ///
    /// If `dst >= world_size()`.
    pub fn count(&self, dst: usize) -> usize {
        self.dest_start[dst + 1] - self.dest_start[dst]
    }

    /// Entry indices for destination rank `dst`.
    ///
    /// # Panics
    ///
    /// If `dst >= world_size()`.
    pub fn entries(&self, dst: usize) -> Range<usize> {
        self.dest_start[dst]..self.dest_start[dst + 1]
    }

    /// Source token index of entry `entry`.
    pub fn token(&self, entry: usize) -> usize {
        self.tokens[entry] as usize
    }

    /// Local-expert bitmask of entry `entry` (`mask_words` words).
    pub fn mask(&self, entry: usize) -> &[u64] {
        &self.masks[entry * self.mask_words..][..self.mask_words]
    }

    /// Weights of entry `entry` (`k` slots): one per set mask bit in ascending local-expert order,
    /// then zeros.
    pub fn weights(&self, entry: usize) -> &[f32] {
        &self.weights[entry * self.k..][..self.k]
    }

    /// Total number of entries over all destinations.
    pub fn total_entries(&self) -> usize {
        self.tokens.len()
    }
}

/// The first expert that `ids` selects more than once whose weights, summed in slot order, are
/// not finite, with that sum. Orphaned experts are skipped: their selections are dropped, so
/// their sums never reach the layout. Every id is `-1` or in range.
fn overflowing_merge(topo: &Topology, ids: &[i32], ws: &[f32]) -> Option<(i32, f32)> {
    for (s, (&id, &w)) in ids.iter().zip(ws).enumerate() {
        if id == -1 || ids[..s].contains(&id) || topo.is_orphaned(id as usize) {
            continue;
        }
        let later = ids[s + 1..].iter().zip(&ws[s + 1..]);
        let sum = later
            .filter(|(&i, _)| i == id)
            .fold(w, |acc, (_, &x)| acc + x);
        if !sum.is_finite() {
            return Some((id, sum));
        }
    }
    None
}

/// The checks of [`DispatchLayout::build_into`] one slot at a time, for the error message: the
/// first expert id outside `0..num_experts`, non-finite weight of a selected expert, or expert
/// selected in several slots whose weights (summed in slot order) are not finite, skipping
/// orphaned experts as the layout does.
fn validate(topo: &Topology, topk_idx: &[i32], topk_weights: &[f32], k: usize) -> Result<()> {
    let num_experts = topo.num_experts();
    for (i, (&id, &w)) in topk_idx.iter().zip(topk_weights).enumerate() {
        if id != -1 && usize::try_from(id).map_or(true, |e| e >= num_experts) {
            return Err(Error::invalid(format!(
                "dispatch layout: token {} slot {} selects expert {id}, outside 0..{num_experts} (use -1 for none)",
                i / k,
                i % k
            )));
        }
        if id != -1 && !w.is_finite() {
            return Err(Error::invalid(format!(
                "dispatch layout: token {} slot {} (expert {id}) has gating weight {w}; weights must be finite",
                i / k,
                i % k
            )));
        }
    }
    if k == 0 {
        return Ok(());
    }
    let rows = topk_idx.chunks_exact(k).zip(topk_weights.chunks_exact(k));
    for (t, (ids, ws)) in rows.enumerate() {
        if let Some((id, sum)) = overflowing_merge(topo, ids, ws) {
            return Err(Error::invalid(format!(
                "dispatch layout: token {t} selects expert {id} in several slots whose gating weights sum to {sum}; the merged weight must be finite"
            )));
        }
    }
    Ok(())
}

/// Positions of the set bits of a multi-word mask, ascending (bit `j` is bit `j % 64` of word
/// `j / 64`).
pub fn mask_iter(mask: &[u64]) -> impl Iterator<Item = usize> + '_ {
    mask_bits(mask.iter().copied())
}

/// Positions of the set bits of a mask given as a sequence of 64-bit words, ascending.
pub fn mask_bits(words: impl IntoIterator<Item = u64>) -> impl Iterator<Item = usize> {
    words.into_iter().enumerate().flat_map(|(w, word)| {
        let mut bits = word;
        std::iter::from_fn(move || {
            if bits == 0 {
                return None;
            }
            let b = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            Some(w * 64 + b)
        })
    })
}

/// Number of set bits in a multi-word mask.
pub fn mask_count(mask: &[u64]) -> usize {
    mask.iter().map(|w| w.count_ones() as usize).sum()
}

/// Sets bit `j` of a multi-word mask.
///
/// # Panics
///
/// If `j >= 64 * mask.len()`.
pub fn mask_set(mask: &mut [u64], j: usize) {
    mask[j / 64] |= 1u64 << (j % 64);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::reference::random_routing;
    use crate::topology::tests::arb_topology;
    use crate::topology::TopologyBuilder;
    use proptest::prelude::*;

    /// (token, dst, local experts, weights) of every entry, in entry order.
    fn dump(l: &DispatchLayout) -> Vec<(usize, usize, Vec<usize>, Vec<f32>)> {
        let mut out = Vec::new();
        for d in 0..l.world_size() {
            for i in l.entries(d) {
                out.push((
                    l.token(i),
                    d,
                    mask_iter(l.mask(i)).collect(),
                    l.weights(i).to_vec(),
                ));
            }
        }
        out
    }

    fn invalid_msg(r: Result<DispatchLayout>) -> String {
        match r {
            Err(Error::InvalidArgument(m)) => m,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    /// Ranks 0 attention; 1, 2 expert; experts 0..4 (rank 1: 0, 1; rank 2: 2, 3).
    fn small() -> Topology {
        Topology::contiguous(1, 2, 4).unwrap()
    }

    #[test]
    fn minus_one_slots_are_skipped() {
        let t = small();
        let l =
            DispatchLayout::build(&t, 0, 2, &[-1, 2, -1, -1], &[0.5, 0.25, 0.5, 0.5], 2).unwrap();
        assert_eq!(l.total_entries(), 1);
        assert_eq!(dump(&l), vec![(0, 2, vec![0], vec![0.25, 0.0])]);
        assert_eq!(l.count(0), 0);
        assert_eq!(l.count(1), 0);
        assert_eq!(l.count(2), 1);
    }

    #[test]
    fn a_repeated_expert_beside_an_out_of_range_id_is_an_error_not_a_panic() {
        let t = small();
        let m = invalid_msg(DispatchLayout::build(&t, 0, 1, &[1, -2, 1], &[0.5; 3], 3));
        assert!(m.contains("slot 1") && m.contains("expert -2"), "{m}");
    }

    #[test]
    fn out_of_range_expert_is_rejected_and_nothing_is_built() {
        let t = small();
        let m = invalid_msg(DispatchLayout::build(&t, 0, 2, &[0, 1, 2, 4], &[0.0; 4], 2));
        assert!(
            m.contains("token 1") && m.contains("slot 1") && m.contains("expert 4"),
            "{m}"
        );
        let m = invalid_msg(DispatchLayout::build(
            &t,
            0,
            2,
            &[0, -2, 2, 3],
            &[0.0; 4],
            2,
        ));
        assert!(
            m.contains("token 0") && m.contains("slot 1") && m.contains("expert -2"),
            "{m}"
        );

        let mut l = DispatchLayout::build(&t, 0, 1, &[0, 3], &[0.5, 0.5], 2).unwrap();
        let before = dump(&l);
        assert!(l.build_into(&t, 0, 2, &[1, 2, 0, 9], &[0.1; 4], 2).is_err());
        assert_eq!(dump(&l), before);
        assert_eq!(l.num_tokens(), 1);
    }

    #[test]
    fn non_finite_gating_weights_are_rejected_naming_token_and_slot() {
        let t = small();
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let m = invalid_msg(DispatchLayout::build(
                &t,
                0,
                2,
                &[0, 1, 2, 3],
                &[0.5, 0.5, 0.5, bad],
                2,
            ));
            assert!(m.contains("token 1") && m.contains("slot 1"), "{m}");
        }
        // A -1 slot's weight is ignored; negative weights are used as given.
        let l = DispatchLayout::build(&t, 0, 1, &[0, -1], &[-0.5, f32::NAN], 2).unwrap();
        assert_eq!(dump(&l), vec![(0, 1, vec![0], vec![-0.5, 0.0])]);
    }

    /// Found by the `routing` fuzz target: each weight was finite, their merged sum was not.
    #[test]
    fn duplicate_weights_summing_to_infinity_are_rejected_and_nothing_is_built() {
        let t = small();
        let mut l = DispatchLayout::build(&t, 0, 1, &[0, 3], &[0.5, 0.5], 2).unwrap();
        let before = dump(&l);
        let err = l
            .build_into(&t, 0, 2, &[1, -1, 2, 2], &[0.5, 0.0, f32::MAX, f32::MAX], 2)
            .unwrap_err();
        let m = invalid_msg(Err(err));
        assert!(
            m.contains("token 1") && m.contains("expert 2") && m.contains("sum to inf"),
            "{m}"
        );
        assert_eq!(dump(&l), before);
        // Large weights whose sum stays finite are merged as before.
        let l = DispatchLayout::build(&t, 0, 1, &[2, 2], &[f32::MAX, -f32::MAX], 2).unwrap();
        assert_eq!(dump(&l), vec![(0, 2, vec![0], vec![0.0, 0.0])]);
    }

    #[test]
    fn length_mismatches_are_rejected() {
        let t = small();
        let m = invalid_msg(DispatchLayout::build(&t, 0, 2, &[0, 1, 2], &[0.0; 4], 2));
        assert!(m.contains("topk_idx has 3"), "{m}");
        let m = invalid_msg(DispatchLayout::build(&t, 0, 2, &[0, 1, 2, 3], &[0.0; 3], 2));
        assert!(m.contains("topk_weights has 3"), "{m}");
    }

    #[test]
    fn non_attention_source_is_rejected() {
        let t = small();
        let m = invalid_msg(DispatchLayout::build(&t, 1, 1, &[0], &[1.0], 1));
        assert!(
            m.contains("rank 1") && m.contains("not an attention rank"),
            "{m}"
        );
        let m = invalid_msg(DispatchLayout::build(&t, 7, 1, &[0], &[1.0], 1));
        assert!(m.contains("rank 7"), "{m}");
    }

    #[test]
    fn duplicate_experts_are_merged_with_summed_weights() {
        let t = small();
        let l =
            DispatchLayout::build(&t, 0, 1, &[3, 0, 3, 3], &[0.125, 0.25, 0.5, 0.0625], 4).unwrap();
        assert_eq!(
            dump(&l),
            vec![
                (0, 1, vec![0], vec![0.25, 0.0, 0.0, 0.0]),
                (0, 2, vec![1], vec![0.6875, 0.0, 0.0, 0.0]),
            ]
        );
    }

    #[test]
    fn k_larger_than_experts_on_one_rank() {
        // One expert rank hosting 2 experts, K = 8 with -1 padding and duplicates.
        let t = Topology::contiguous(1, 1, 2).unwrap();
        let idx = [1, 0, -1, 1, -1, -1, 0, -1];
        let w = [1.0, 2.0, 0.0, 4.0, 0.0, 0.0, 8.0, 0.0];
        let l = DispatchLayout::build(&t, 0, 1, &idx, &w, 8).unwrap();
        assert_eq!(
            dump(&l),
            vec![(
                0,
                1,
                vec![0, 1],
                vec![10.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
            )]
        );
    }

    #[test]
    fn all_tokens_to_one_expert() {
        let t = Topology::contiguous(2, 3, 6).unwrap();
        let n = 100;
        let idx = vec![4; n];
        let w: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let l = DispatchLayout::build(&t, 1, n, &idx, &w, 1).unwrap();
        let (dst, j) = t.route(1, 4);
        assert_eq!(l.count(dst), n);
        assert_eq!(l.total_entries(), n);
        for (i, e) in l.entries(dst).enumerate() {
            assert_eq!(l.token(e), i);
            assert_eq!(mask_iter(l.mask(e)).collect::<Vec<_>>(), vec![j]);
            assert_eq!(l.weights(e), &[i as f32]);
        }
    }

    #[test]
    fn zero_tokens_give_an_empty_layout() {
        let t = small();
        let l = DispatchLayout::build(&t, 0, 0, &[], &[], 4).unwrap();
        assert_eq!(l.total_entries(), 0);
        assert_eq!(l.world_size(), 3);
        assert_eq!(l.dest_start, vec![0, 0, 0, 0]);
        assert_eq!(l.k, 4);
        assert_eq!(l.mask_words, 1);
    }

    #[test]
    fn one_entry_per_token_and_destination() {
        let t = small();
        // token 0: experts 0,1 (rank 1) and 2 (rank 2); token 1: 3, 2 (rank 2); token 2: 1 (rank 1).
        let idx = [0, 2, 1, 3, 2, -1, 1, -1, -1];
        let w = [0.1, 0.2, 0.3, 0.4, 0.5, 0.0, 0.6, 0.0, 0.0];
        let l = DispatchLayout::build(&t, 0, 3, &idx, &w, 3).unwrap();
        assert_eq!(l.dest_start, vec![0, 0, 2, 4]);
        assert_eq!(
            dump(&l),
            vec![
                (0, 1, vec![0, 1], vec![0.1, 0.3, 0.0]),
                (2, 1, vec![1], vec![0.6, 0.0, 0.0]),
                (0, 2, vec![0], vec![0.2, 0.0, 0.0]),
                (1, 2, vec![0, 1], vec![0.5, 0.4, 0.0]),
            ]
        );
    }

    #[test]
    fn weights_follow_ascending_local_expert_order() {
        let t = Topology::contiguous(1, 1, 5).unwrap();
        let l = DispatchLayout::build(&t, 0, 1, &[4, 3, 0, 2, 1], &[4.0, 3.0, 0.0, 2.0, 1.0], 5)
            .unwrap();
        assert_eq!(
            dump(&l),
            vec![(0, 1, vec![0, 1, 2, 3, 4], vec![0.0, 1.0, 2.0, 3.0, 4.0])]
        );
    }

    #[test]
    fn replicas_are_chosen_by_source_rank() {
        // Attention ranks 0, 1; expert ranks 2, 3; expert 0 replicated on both.
        let t = TopologyBuilder::contiguous(2, 2, 2)
            .placement(vec![vec![2, 3], vec![3]])
            .build()
            .unwrap();
        let from0 = DispatchLayout::build(&t, 0, 1, &[0], &[1.0], 1).unwrap();
        let from1 = DispatchLayout::build(&t, 1, 1, &[0], &[1.0], 1).unwrap();
        assert_eq!(dump(&from0), vec![(0, 2, vec![0], vec![1.0])]);
        assert_eq!(dump(&from1), vec![(0, 3, vec![0], vec![1.0])]);
    }

    /// A call's layout is its tokens' one-token layouts put together (entries per destination in
    /// token order), replicas and orphaned experts included.
    #[test]
    fn a_calls_layout_is_the_layouts_of_its_tokens_one_by_one() {
        // Attention ranks 0, 1; expert ranks 2, 3, 4; experts 0 and 1 on 2 and 3, experts 4 and 5
        // on 4 only (orphaned once 4 has left).
        let t = TopologyBuilder::contiguous(2, 3, 6)
            .placement(vec![
                vec![2, 3],
                vec![3, 2],
                vec![2],
                vec![3],
                vec![4],
                vec![4],
            ])
            .build()
            .unwrap()
            .shrink(&[4], true)
            .unwrap()
            .topology;
        let (idx, w) = random_routing(3, 40, 3, 6, None);
        for src in [0, 1] {
            let all = DispatchLayout::build(&t, src, 40, &idx, &w, 3).unwrap();
            assert!(
                all.dropped() > 0,
                "the routing selects the orphaned experts"
            );
            let mut per_token = Vec::new();
            let mut dropped = 0;
            for tok in 0..40 {
                let one =
                    &DispatchLayout::build(&t, src, 1, &idx[tok * 3..][..3], &w[tok * 3..][..3], 3)
                        .unwrap();
                dropped += one.dropped();
                per_token.extend(dump(one).into_iter().map(|(_, d, m, ws)| (tok, d, m, ws)));
            }
            per_token.sort_by_key(|e| (e.1, e.0));
            assert_eq!(dump(&all), per_token, "source {src}");
            assert_eq!(all.dropped(), dropped);
        }
    }

    /// Range and finiteness of every slot are checked before sums of duplicates, whatever token
    /// comes first: the error names the same slot as the one-slot-at-a-time checks.
    #[test]
    fn a_bad_slot_of_a_later_token_is_named_before_an_earlier_tokens_overflowing_sum() {
        let t = small();
        let m = invalid_msg(DispatchLayout::build(
            &t,
            0,
            2,
            &[1, 1, 0, 7],
            &[f32::MAX, f32::MAX, 0.5, 0.5],
            2,
        ));
        assert!(
            m.contains("token 1") && m.contains("slot 1") && m.contains("expert 7"),
            "{m}"
        );
    }

    #[test]
    fn masks_span_several_words() {
        let t = Topology::contiguous(1, 1, 130).unwrap();
        assert_eq!(t.mask_words(), 3);
        let l = DispatchLayout::build(&t, 0, 1, &[129, 64, 3], &[0.5, 0.25, 0.125], 3).unwrap();
        assert_eq!(l.mask(0), &[1 << 3, 1, 1 << 1]);
        assert_eq!(mask_iter(l.mask(0)).collect::<Vec<_>>(), vec![3, 64, 129]);
        assert_eq!(l.weights(0), &[0.125, 0.25, 0.5]);
    }

    #[test]
    fn build_into_reuses_buffers_and_matches_fresh_build() {
        let t = Topology::contiguous(2, 3, 12).unwrap();
        let (i1, w1) = random_routing(1, 200, 4, 12, None);
        let (i2, w2) = random_routing(2, 7, 4, 12, Some(1.2));
        let mut l = DispatchLayout::build(&t, 1, 200, &i1, &w1, 4).unwrap();
        l.build_into(&t, 1, 7, &i2, &w2, 4).unwrap();
        let fresh = DispatchLayout::build(&t, 1, 7, &i2, &w2, 4).unwrap();
        assert_eq!(dump(&l), dump(&fresh));
        assert_eq!(l.dest_start, fresh.dest_start);
        assert_eq!(l.tokens, fresh.tokens);
        assert_eq!(l.masks, fresh.masks);
        assert_eq!(l.weights, fresh.weights);
        assert_eq!(l.num_tokens(), 7);
    }

    /// One layout rebuilt call after call (as an attention rank's is), with failed calls and a
    /// change of topology between them, gives every call the layout a fresh one gives: the
    /// stamps a call leaves behind never pass for the next call's.
    #[test]
    fn a_layout_rebuilt_call_after_call_matches_fresh_builds() {
        let small = Topology::contiguous(2, 3, 12).unwrap();
        let wide = Topology::contiguous(1, 5, 40).unwrap();
        let mut l = DispatchLayout::default();
        for call in 0..60u64 {
            let (topo, src, experts) = if call % 20 < 10 {
                (&small, 1, 12)
            } else {
                (&wide, 0, 40)
            };
            let tokens = 1 + (call as usize * 7) % 13;
            let skew = (call % 3 == 0).then_some(1.5);
            let (mut idx, w) = random_routing(call, tokens, 4, experts, skew);
            if call % 7 == 3 {
                // A bad id in the last token: the call fails in the first pass.
                idx[tokens * 4 - 1] = experts as i32;
                assert!(l.build_into(topo, src, tokens, &idx, &w, 4).is_err());
                continue;
            }
            l.build_into(topo, src, tokens, &idx, &w, 4).unwrap();
            let fresh = DispatchLayout::build(topo, src, tokens, &idx, &w, 4).unwrap();
            assert_eq!(dump(&l), dump(&fresh), "call {call}");
            assert_eq!(l.dest_start, fresh.dest_start, "call {call}");
            assert_eq!(l.weights, fresh.weights, "call {call}");
        }
    }

    #[test]
    fn mask_helpers() {
        let mut m = [0u64; 2];
        assert_eq!(mask_iter(&m).count(), 0);
        mask_set(&mut m, 127);
        mask_set(&mut m, 0);
        mask_set(&mut m, 63);
        mask_set(&mut m, 64);
        assert_eq!(mask_iter(&m).collect::<Vec<_>>(), vec![0, 63, 64, 127]);
        assert_eq!(mask_count(&m), 4);
    }

    /// Routing with -1 holes and duplicate ids, expert ids in range, finite weights of any sign.
    fn arb_case() -> impl Strategy<Value = (Topology, usize, usize, usize, Vec<i32>, Vec<f32>)> {
        arb_topology().prop_flat_map(|t| {
            let srcs = t.attention_ranks().to_vec();
            let e = t.num_experts() as i32;
            (0usize..24, 0usize..7).prop_flat_map(move |(n, k)| {
                (
                    Just(t.clone()),
                    proptest::sample::select(srcs.clone()),
                    Just(n),
                    Just(k),
                    proptest::collection::vec(-1i32..e, n * k),
                    // Signed zeros and negative weights too: a merged weight keeps the bits of
                    // a sum in slot order (a lone -0.0 stays -0.0).
                    proptest::collection::vec(
                        prop_oneof![-1.0f32..1.0, Just(-0.0f32), Just(0.0f32), Just(1e30f32)],
                        n * k,
                    ),
                )
            })
        })
    }

    proptest! {
        #[test]
        fn layout_reconstructs_merged_routing(
            (t, src, n, k, idx, w) in arb_case()
        ) {
            let l = DispatchLayout::build(&t, src, n, &idx, &w, k).unwrap();
            prop_assert_eq!(l.dest_start.len(), t.world_size() + 1);
            prop_assert_eq!(l.mask_words, t.mask_words());

            // Expected: per token, merged (expert, weight) in slot order of first appearance.
            let mut want = Vec::new();
            for tok in 0..n {
                let mut row: Vec<(usize, f32)> = Vec::new();
                for s in 0..k {
                    let id = idx[tok * k + s];
                    if id < 0 { continue; }
                    match row.iter_mut().find(|(e, _)| *e == id as usize) {
                        Some(p) => p.1 += w[tok * k + s],
                        None => row.push((id as usize, w[tok * k + s])),
                    }
                }
                for (e, wt) in row { want.push((tok, e, wt.to_bits())); }
            }
            want.sort_unstable();

            let mut got = Vec::new();
            let mut pairs = std::collections::HashSet::new();
            for d in 0..t.world_size() {
                let r = l.entries(d);
                prop_assert!(l.tokens[r.clone()].windows(2).all(|p| p[0] < p[1]));
                for i in r {
                    let tok = l.token(i);
                    prop_assert!(pairs.insert((tok, d)), "two entries for token {} dest {}", tok, d);
                    let bits: Vec<usize> = mask_iter(l.mask(i)).collect();
                    prop_assert!(!bits.is_empty());
                    prop_assert!(bits.len() <= k);
                    for (pos, &j) in bits.iter().enumerate() {
                        let e = t.local_experts(d)[j];
                        prop_assert_eq!(t.route(src, e), (d, j));
                        got.push((tok, e, l.weights(i)[pos].to_bits()));
                    }
                    prop_assert!(l.weights(i)[bits.len()..].iter().all(|&x| x == 0.0));
                }
            }
            got.sort_unstable();
            prop_assert_eq!(got, want);
        }
    }

    /// One attention and two expert ranks, 4 experts, shrunk past expert rank 2: experts 2 and
    /// 3 lived there and are orphaned.
    fn orphaning_topology() -> Topology {
        TopologyBuilder::contiguous(1, 2, 4)
            .build()
            .unwrap()
            .shrink(&[2], true)
            .unwrap()
            .topology
    }

    #[test]
    fn selections_of_an_orphaned_expert_are_dropped_and_counted() {
        let t = orphaning_topology();
        // Experts 2 and 3 lived on the dead rank 2.
        let idx = [0, 2, 3, 1, -1, 3];
        let w = [0.5f32; 6];
        let l = DispatchLayout::build(&t, 0, 3, &idx, &w, 2).unwrap();
        assert_eq!(l.dropped(), 3);
        assert_eq!(l.count(1), 2, "tokens 0 and 1 still reach expert rank 1");
        let tokens: Vec<usize> = l.entries(1).map(|e| l.token(e)).collect();
        assert_eq!(tokens, vec![0, 1]);
    }

    #[test]
    fn an_overflowing_merge_of_an_orphaned_expert_is_dropped_and_the_error_names_the_real_one() {
        let t = orphaning_topology();
        // Token 0 selects orphaned expert 2 twice (dropped, so its sum does not matter);
        // token 1 selects the live expert 1 twice, and that sum overflows.
        let w = [3e38f32; 4];
        let l = DispatchLayout::build(&t, 0, 1, &[2, 2], &w[..2], 2).unwrap();
        assert_eq!(l.dropped(), 2);
        let m = invalid_msg(DispatchLayout::build(&t, 0, 2, &[2, 2, 1, 1], &w, 2));
        assert!(m.contains("token 1") && m.contains("expert 1"), "{m}");
    }
}
