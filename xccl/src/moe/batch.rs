//! What A2E hands back: [`ExpertBatch`] on expert ranks, [`A2eHandle`] on attention ranks.

use std::time::Duration;

use super::dtype::Element;
use super::layout::DispatchLayout;
use crate::{Error, Result};

/// A byte buffer aligned for any element type xccl moves (backed by `u64`s).
#[derive(Clone, Debug, Default)]
pub struct AlignedBytes {
    words: Vec<u64>,
    len: usize,
}

impl AlignedBytes {
    /// Resizes to `len` bytes. The backing store only grows (new bytes zeroed once), so
    /// steady-state calls neither allocate nor clear: bytes past the previous length keep
    /// whatever an earlier call left there until the caller overwrites them.
    pub fn resize(&mut self, len: usize) {
        let words = len.div_ceil(8);
        if self.words.len() < words {
            self.words.resize(words, 0);
        }
        self.len = len;
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    /// The bytes, mutable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// What one attention rank sent to this expert rank in one A2E call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SourceInfo {
    /// Global rank of the attention rank.
    pub rank: usize,
    /// Tokens (rows on the wire) received from it.
    pub count: usize,
    /// Where its E2A replies go (row offset in its E2A receive area).
    pub reply_offset: usize,
    /// Index of its first token in [`ExpertBatch::token_row_start`].
    pub first_token: usize,
    /// Time from the start of the receive call until its record was seen.
    pub arrived_after: Duration,
}

/// The rows an expert rank received in one A2E call, grouped by local expert (expert-major).
///
/// Within a local expert, rows are ordered by source rank, then by source token index. Reuse one
/// batch across calls: its buffers keep their capacity.
#[derive(Clone, Debug, Default)]
pub struct ExpertBatch {
    pub(crate) epoch: u64,
    pub(crate) hidden: usize,
    pub(crate) elem: usize,
    pub(crate) rows: AlignedBytes,
    /// `expert_offsets[j]..expert_offsets[j+1]` are the rows of local expert `j`.
    pub expert_offsets: Vec<usize>,
    /// Per row: the attention rank it came from.
    pub src_rank: Vec<u32>,
    /// Per row: the token index at that attention rank.
    pub src_token: Vec<u32>,
    /// Per row: the gating weight of this (token, expert).
    pub weight: Vec<f32>,
    /// Per source attention rank, in rank order: what came and when.
    pub sources: Vec<SourceInfo>,
    /// Order in which sources were seen to arrive (indices into `sources`): straggler visibility.
    pub arrival_order: Vec<u32>,
    /// Per received token (grouped by source, in wire order): its rows are
    /// `token_rows[token_row_start[i]..token_row_start[i+1]]`.
    pub token_row_start: Vec<u32>,
    /// Row indices of each received token's local experts.
    pub token_rows: Vec<u32>,
    /// Scratch: next free row per local expert while rows are placed.
    pub(crate) cursors: Vec<usize>,
}

impl ExpertBatch {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of rows (received (token, local expert) pairs).
    pub fn num_rows(&self) -> usize {
        self.src_rank.len()
    }

    /// Number of received tokens (one per (source, token)).
    pub fn num_tokens(&self) -> usize {
        self.token_row_start.len().saturating_sub(1)
    }

    /// Number of local experts.
    pub fn num_local_experts(&self) -> usize {
        self.expert_offsets.len().saturating_sub(1)
    }

    /// Rows of local expert `j`, as a range of row indices.
    pub fn expert_rows(&self, j: usize) -> std::ops::Range<usize> {
        self.expert_offsets[j]..self.expert_offsets[j + 1]
    }

    /// The A2E epoch this batch came from.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Hidden size of the rows.
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// All rows as raw bytes (`num_rows * hidden * dtype size`).
    pub fn row_bytes(&self) -> &[u8] {
        self.rows.bytes()
    }

    /// All rows as elements of `T` (`num_rows * hidden`); `T` must be the communicator's dtype.
    pub fn rows<T: Element>(&self) -> Result<&[T]> {
        if std::mem::size_of::<T>() != self.elem && self.num_rows() > 0 {
            return Err(Error::invalid(format!(
                "batch holds {}-byte elements, asked for {}",
                self.elem,
                T::DTYPE.name()
            )));
        }
        Ok(bytemuck::cast_slice(self.rows.bytes()))
    }
}

/// What an attention rank keeps between its A2E and the matching E2A.
#[derive(Debug)]
pub struct A2eHandle {
    pub(crate) epoch: u64,
    pub(crate) num_tokens: usize,
    pub(crate) layout: DispatchLayout,
    /// Row offset of each expert rank's rows (by expert index) in staging and reply areas.
    pub(crate) offsets: Vec<usize>,
}

impl A2eHandle {
    /// Tokens sent in that A2E call.
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// The A2E epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Rows sent to global rank `dst` (one per token routed there).
    pub fn rows_to(&self, dst: usize) -> usize {
        self.layout.count(dst)
    }

    /// Total rows sent (sum over destinations).
    pub fn total_rows(&self) -> usize {
        self.layout.total_entries()
    }
}
