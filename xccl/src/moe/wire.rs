//! What crosses the fabric: metadata records, row formats, the window layout and signal slots.
//!
//! Every rank computes every peer's layout from the same [`Topology`] and [`MoeConfig`], so no
//! offsets are exchanged at init; a fingerprint check at init catches ranks that disagree.
//!
//! ## Records
//! One [`Record`] per (source, destination, direction) per call, 32 bytes on its own cache line,
//! put into the destination's record area for the call's parity before any row, then the rows
//! follow in chunks of about [`CHUNK_BYTES`], each chunk signalled with [`progress`]`(epoch,
//! rows so far)` so the receiver copies while the sender writes. The epoch is the call's sequence
//! number (from 1): no reset pass, and a record with count 0 is a valid "nothing for you this
//! time".
//!
//! ## Rows
//! A2E row: `hidden` elements of payload, then [`A2E_META_FIXED`] bytes (source token index,
//! number of local experts) then `mask_words` u64 words of local-expert bitmask, then `topk` f32
//! weights (for the set bits, ascending), padded to 16 bytes. One row per (token, destination
//! rank): a token for three experts on one rank crosses the wire once.
//! E2A row: `hidden` elements, the destination rank's weighted sum over its local experts.
//!
//! ## Window layout
//! Attention rank: E2A record area (per expert rank, per parity) | A2E staging (per parity,
//! `max_tokens * min(topk, N)` rows, grouped by destination at the offsets the records name) |
//! E2A receive area (same shape: expert rank `d` writes its replies at the offset the A2E record
//! to `d` named).
//! Expert rank: A2E record area (per attention rank, per parity) | A2E receive area (per attention
//! rank, per parity, `max_tokens` rows) | E2A staging (per parity, `M * max_tokens` rows).

use std::time::Duration;

use bytemuck::{Pod, Zeroable};

use super::dtype::DType;
use crate::topology::{Role, Topology};
use crate::{Error, Result};

/// How rows move between ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum TransferMode {
    /// The sender writes rows into the receiver's window, then signals.
    Push = 0,
    /// The sender stages rows in its own window and signals; the receiver reads them
    /// (receiver-controlled incast, as in xDeepServe's dispatch).
    Pull = 1,
}

/// How a message's rows travel, as its record says (the receiver follows it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WireMode {
    /// Full rows (payload + metadata) were written into the receiver's window.
    Push,
    /// Full rows wait in the sender's staging area at the record's offset.
    Pull,
    /// Metadata rows wait in the sender's staging area; each payload is token `t`'s row of the
    /// sender's registered input ([`WindowLayout::a2e_input`]): the receiver gathers them.
    Gather,
}

impl WireMode {
    fn code(self) -> u32 {
        match self {
            WireMode::Push => 0,
            WireMode::Pull => 1,
            WireMode::Gather => 2,
        }
    }
}

impl From<TransferMode> for WireMode {
    fn from(m: TransferMode) -> Self {
        match m {
            TransferMode::Push => WireMode::Push,
            TransferMode::Pull => WireMode::Pull,
        }
    }
}

impl TransferMode {
    /// Parses `"push"` or `"pull"`.
    pub fn parse(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "push" => Ok(TransferMode::Push),
            "pull" => Ok(TransferMode::Pull),
            other => Err(Error::invalid(format!(
                "unknown transfer mode {other:?} (expected push or pull)"
            ))),
        }
    }

    /// `"push"` or `"pull"`.
    pub fn name(self) -> &'static str {
        match self {
            TransferMode::Push => "push",
            TransferMode::Pull => "pull",
        }
    }
}

/// Fixed parameters of a communicator's MoE exchange; every rank must pass the same values.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// Hidden size H: elements per token row.
    pub hidden: usize,
    /// Element type of rows on the wire and in the caller's tensors.
    pub dtype: DType,
    /// Top-k: routing entries per token.
    pub topk: usize,
    /// Most tokens one attention rank passes to one A2E call.
    pub max_tokens_per_rank: usize,
    /// Default transfer mode (each call may override it).
    pub mode: TransferMode,
    /// Deadline for every wait inside a call.
    pub timeout: Duration,
    /// Bytes a sender writes between progress signals, so receivers copy while senders write
    /// (a local choice: ranks need not agree).
    pub chunk_bytes: usize,
}

impl MoeConfig {
    /// A config with push mode and a 30 s timeout.
    pub fn new(hidden: usize, dtype: DType, topk: usize, max_tokens_per_rank: usize) -> Self {
        MoeConfig {
            hidden,
            dtype,
            topk,
            max_tokens_per_rank,
            mode: TransferMode::Push,
            timeout: Duration::from_secs(30),
            chunk_bytes: CHUNK_BYTES,
        }
    }

    /// Checks the values against each other and the topology.
    pub fn validate(&self, topo: &Topology) -> Result<()> {
        if self.hidden == 0 {
            return Err(Error::invalid("hidden size must be at least 1"));
        }
        if self.topk == 0 {
            return Err(Error::invalid("topk must be at least 1"));
        }
        if self.max_tokens_per_rank == 0 || self.max_tokens_per_rank > MAX_PROGRESS_ROWS {
            return Err(Error::invalid(format!(
                "max_tokens_per_rank {} must be in 1..={MAX_PROGRESS_ROWS}",
                self.max_tokens_per_rank
            )));
        }
        if self.timeout.is_zero() {
            return Err(Error::invalid("timeout must be positive"));
        }
        if self.chunk_bytes == 0 {
            return Err(Error::invalid("chunk_bytes must be positive"));
        }
        let layout = WindowLayout::new(topo, self)?;
        for r in 0..topo.world_size() {
            if layout.window_len(r) > (u32::MAX as usize) * 16 {
                return Err(Error::invalid(format!(
                    "rank {r} would need a {} byte window; lower max_tokens_per_rank or hidden",
                    layout.window_len(r)
                )));
            }
        }
        Ok(())
    }

    /// Stable hash of every field that affects the wire (for the init consistency check).
    pub fn fingerprint(&self) -> u64 {
        let mut h = Fnv::new();
        h.u64(self.hidden as u64);
        h.u64(self.dtype as u64);
        h.u64(self.topk as u64);
        h.u64(self.max_tokens_per_rank as u64);
        h.finish()
    }
}

/// FNV-1a, for fingerprints.
pub(crate) struct Fnv(u64);

impl Fnv {
    pub(crate) fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    pub(crate) fn u64(&mut self, v: u64) {
        for b in v.to_le_bytes() {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
    pub(crate) fn finish(&self) -> u64 {
        self.0
    }
}

/// The 32-byte metadata record of one (source, destination) pair for one call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct Record {
    /// The call's epoch (sequence number, from 1).
    pub epoch: u64,
    /// Rows in this message (0 is a valid empty message).
    pub count: u32,
    /// Row offset: in pull mode where the rows start in the sender's staging area; for A2E in
    /// push mode, where the destination's E2A replies go in the sender's E2A receive area.
    pub offset: u32,
    /// [`WireMode`] of this message (0 push, 1 pull, 2 gather).
    pub mode: u32,
    /// Check word over the fields above; catches torn records.
    pub check: u32,
    /// Reserved, zero.
    pub reserved: u64,
}

impl Record {
    /// A record with its check word filled in.
    pub fn new(epoch: u64, count: u32, offset: u32, mode: impl Into<WireMode>) -> Self {
        let mut r = Record {
            epoch,
            count,
            offset,
            mode: mode.into().code(),
            check: 0,
            reserved: 0,
        };
        r.check = r.expected_check();
        r
    }

    fn expected_check(&self) -> u32 {
        !(self.epoch as u32) ^ self.count ^ self.offset.rotate_left(7) ^ self.mode.rotate_left(13)
    }

    /// Checks a received record against the epoch the receiver expects and the row capacity.
    pub fn validate(&self, peer: usize, epoch: u64, max_rows: usize) -> Result<WireMode> {
        let bad = |detail: String| Err(Error::Protocol { peer, detail });
        if self.epoch != epoch {
            return bad(format!(
                "record for epoch {} where epoch {epoch} was expected",
                self.epoch
            ));
        }
        if self.check != self.expected_check() {
            return bad(format!("record for epoch {epoch} fails its check word"));
        }
        if self.count as usize > max_rows {
            return bad(format!(
                "record announces {} rows, capacity is {max_rows}",
                self.count
            ));
        }
        match self.mode {
            0 => Ok(WireMode::Push),
            1 => Ok(WireMode::Pull),
            2 => Ok(WireMode::Gather),
            m => bad(format!("record has unknown transfer mode {m}")),
        }
    }
}

/// Bits of a ready signal that carry the rows delivered so far (the rest carry the epoch).
pub const PROGRESS_ROW_BITS: u32 = 24;
/// Largest row count a ready signal can carry (and so the largest `max_tokens_per_rank`).
pub const MAX_PROGRESS_ROWS: usize = (1 << PROGRESS_ROW_BITS) - 1;

/// The value of a ready signal: `rows` of the call with `epoch` are in place.
///
/// Senders signal progress in chunks so receivers copy while senders write; 40 bits of epoch
/// last 10^12 calls.
pub fn progress(epoch: u64, rows: usize) -> u64 {
    debug_assert!(rows <= MAX_PROGRESS_ROWS);
    (epoch << PROGRESS_ROW_BITS) | rows as u64
}

/// How far a sender has got with the call of epoch `epoch`, read from its ready signal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// Nothing of this call yet.
    NotYet,
    /// The record is in place and this many rows.
    Rows(usize),
    /// The sender has moved on to a later call: every row of this one is in place.
    Done,
}

impl Progress {
    /// Decodes a ready signal's value for the call of epoch `epoch`.
    pub fn of(value: u64, epoch: u64) -> Self {
        let e = value >> PROGRESS_ROW_BITS;
        match e.cmp(&epoch) {
            std::cmp::Ordering::Less => Progress::NotYet,
            std::cmp::Ordering::Equal => {
                Progress::Rows((value & MAX_PROGRESS_ROWS as u64) as usize)
            }
            std::cmp::Ordering::Greater => Progress::Done,
        }
    }

    /// Rows in place out of `count`.
    pub fn rows(self, count: usize) -> usize {
        match self {
            Progress::NotYet => 0,
            Progress::Rows(r) => r.min(count),
            Progress::Done => count,
        }
    }
}

/// Rows per progress signal for rows of `stride` bytes and chunks of about `chunk_bytes`.
pub fn chunk_rows(stride: usize, chunk_bytes: usize) -> usize {
    (chunk_bytes / stride.max(1)).max(1)
}

/// Default bytes between progress signals ([`MoeConfig::chunk_bytes`]). Measured on the 2-core
/// development machine (1A:1E, T=512, H=7168 bf16): one signal per message gave 0.30x memcpy
/// for the round trip, 64 KiB and 256 KiB chunks 0.63x.
pub const CHUNK_BYTES: usize = 64 << 10;

/// Bytes a record slot takes in a window (one cache line).
pub const RECORD_SLOT: usize = 64;
/// Bytes of fixed A2E row metadata: source token index (u32) and expert count (u32).
pub const A2E_META_FIXED: usize = 8;

/// Byte layout of one A2E row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct A2eRow {
    /// Payload bytes (hidden * dtype size).
    pub payload: usize,
    /// u64 words of local-expert mask.
    pub mask_words: usize,
    /// f32 weight slots.
    pub topk: usize,
    /// Bytes from one row to the next (16-byte aligned).
    pub stride: usize,
    /// Bytes from one metadata-only row to the next (gather mode; 16-byte aligned).
    pub meta_stride: usize,
}

impl A2eRow {
    /// The row layout for a config and topology.
    pub fn new(cfg: &MoeConfig, topo: &Topology) -> Self {
        let payload = cfg.hidden * cfg.dtype.size();
        let mask_words = topo.mask_words();
        let meta = A2E_META_FIXED + 8 * mask_words + 4 * cfg.topk;
        let stride = (align_up(payload, 8) + meta).next_multiple_of(16);
        A2eRow {
            payload,
            mask_words,
            topk: cfg.topk,
            stride,
            meta_stride: meta.next_multiple_of(16),
        }
    }

    /// Offset of the metadata within a row.
    pub fn meta_offset(&self) -> usize {
        align_up(self.payload, 8)
    }

    /// Writes a row's metadata into `meta` (at least `stride - meta_offset` bytes).
    pub fn encode_meta(&self, meta: &mut [u8], token: u32, mask: &[u64], weights: &[f32]) {
        let n_bits: u32 = mask.iter().map(|w| w.count_ones()).sum();
        meta[0..4].copy_from_slice(&token.to_le_bytes());
        meta[4..8].copy_from_slice(&n_bits.to_le_bytes());
        let mut o = A2E_META_FIXED;
        for w in mask {
            meta[o..o + 8].copy_from_slice(&w.to_le_bytes());
            o += 8;
        }
        for w in weights.iter().take(self.topk) {
            meta[o..o + 4].copy_from_slice(&w.to_le_bytes());
            o += 4;
        }
    }

    /// Reads `(token, mask words, weights)` back from a row's metadata.
    pub fn decode_meta<'a>(&self, meta: &'a [u8]) -> (u32, &'a [u8], &'a [u8]) {
        let token = u32::from_le_bytes(meta[0..4].try_into().expect("4 bytes"));
        let m0 = A2E_META_FIXED;
        let w0 = m0 + 8 * self.mask_words;
        (token, &meta[m0..w0], &meta[w0..w0 + 4 * self.topk])
    }

    /// Decodes and validates a received row's metadata (`meta`, as [`A2eRow::encode_meta`]
    /// wrote it) from `src`: returns its source token index and fills `experts` with its
    /// `(local expert, weight)` pairs, ascending.
    ///
    /// A token index of `max_tokens` or more, a local expert of `local` or more, or more than
    /// `topk` experts is a [`Error::Protocol`] naming `src`.
    pub fn decode_row(
        &self,
        meta: &[u8],
        src: usize,
        max_tokens: usize,
        local: usize,
        experts: &mut Vec<(u32, f32)>,
    ) -> Result<u32> {
        let (token, mask, weights) = self.decode_meta(meta);
        let bad = |detail: String| Err(Error::Protocol { peer: src, detail });
        if token as usize >= max_tokens {
            return bad(format!(
                "row names token {token}, max_tokens is {max_tokens}"
            ));
        }
        experts.clear();
        let words = mask
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")));
        for (slot, j) in super::layout::mask_bits(words).enumerate() {
            if j >= local || slot >= self.topk {
                return bad(format!(
                    "row for local expert {j} (#{slot}); the rank hosts {local}, topk is {}",
                    self.topk
                ));
            }
            let w = f32::from_le_bytes(weights[4 * slot..4 * slot + 4].try_into().expect("4"));
            experts.push((j as u32, w));
        }
        Ok(token)
    }
}

/// Rounds `v` up to a multiple of `a` (a power of two).
pub fn align_up(v: usize, a: usize) -> usize {
    (v + a - 1) & !(a - 1)
}

/// Signal slot numbering: five groups of `world` slots, indexed by the peer's global rank.
#[derive(Clone, Copy, Debug)]
pub struct Slots {
    world: usize,
}

impl Slots {
    /// Slot numbering for a job of `world` ranks.
    pub fn new(world: usize) -> Self {
        Slots { world }
    }
    /// Total slots a rank needs.
    pub fn count(&self) -> usize {
        5 * self.world
    }
    /// On an expert rank: A2E record from `src` has arrived (value = epoch).
    pub fn a2e_ready(&self, src: usize) -> usize {
        src
    }
    /// On an attention rank: expert `dst` has consumed our A2E rows of that epoch.
    pub fn a2e_credit(&self, dst: usize) -> usize {
        self.world + dst
    }
    /// On an attention rank: E2A record from expert `src` has arrived.
    pub fn e2a_ready(&self, src: usize) -> usize {
        2 * self.world + src
    }
    /// On an expert rank: attention `dst` has consumed our E2A rows of that epoch.
    pub fn e2a_credit(&self, dst: usize) -> usize {
        3 * self.world + dst
    }
    /// On any rank: `src` has entered barrier generation (value).
    pub fn barrier(&self, src: usize) -> usize {
        4 * self.world + src
    }
}

/// Byte offsets of every region in every rank's window.
#[derive(Clone, Debug)]
pub struct WindowLayout {
    /// Rows of one A2E row format.
    pub a2e: A2eRow,
    /// Bytes of one E2A row (the payload: staging and reply areas are dense `[rows, hidden]`).
    pub e2a_stride: usize,
    /// Rows an attention rank's staging/reply area holds per parity.
    pub attention_rows: usize,
    /// Max tokens per attention rank.
    pub max_tokens: usize,
    num_attention: usize,
    num_expert: usize,
    roles: Vec<Role>,
}

/// Bytes reserved at the start of every window for the init handshake (fingerprints).
pub const HANDSHAKE_BYTES: usize = 64;

impl WindowLayout {
    /// Computes the layout for a topology and config.
    pub fn new(topo: &Topology, cfg: &MoeConfig) -> Result<Self> {
        let n = topo.expert_ranks().len();
        let a2e = A2eRow::new(cfg, topo);
        Ok(WindowLayout {
            a2e,
            e2a_stride: cfg.hidden * cfg.dtype.size(),
            attention_rows: cfg.max_tokens_per_rank * cfg.topk.min(n),
            max_tokens: cfg.max_tokens_per_rank,
            num_attention: topo.attention_ranks().len(),
            num_expert: n,
            roles: (0..topo.world_size()).map(|r| topo.role(r)).collect(),
        })
    }

    fn records_end(&self, role: Role) -> usize {
        let peers = match role {
            Role::Attention => self.num_expert,
            Role::Expert => self.num_attention,
        };
        align_up(HANDSHAKE_BYTES + 2 * peers * RECORD_SLOT, 4096)
    }

    /// Offset of the record slot for `peer_index` (the peer's index among its role) and parity.
    pub fn record(&self, peer_index: usize, parity: usize) -> usize {
        HANDSHAKE_BYTES + (2 * peer_index + parity) * RECORD_SLOT
    }

    fn a2e_stage_bytes(&self) -> usize {
        align_up(self.attention_rows * self.a2e.stride, 4096)
    }

    /// Attention rank: start of the A2E staging area for `parity`.
    pub fn a2e_stage(&self, parity: usize) -> usize {
        self.records_end(Role::Attention) + parity * self.a2e_stage_bytes()
    }

    /// Attention rank: start of the E2A receive area for `parity`.
    pub fn e2a_recv(&self, parity: usize) -> usize {
        self.a2e_stage(2) + parity * align_up(self.attention_rows * self.e2a_stride, 4096)
    }

    /// Attention rank: start of the registered A2E input for `parity`: `[max_tokens, hidden]`
    /// dense rows the caller writes (`Communicator::a2e_input`) and receivers gather from.
    pub fn a2e_input(&self, parity: usize) -> usize {
        self.e2a_recv(2) + parity * align_up(self.max_tokens * self.a2e.payload, 4096)
    }

    fn a2e_recv_bytes(&self) -> usize {
        align_up(self.max_tokens * self.a2e.stride, 4096)
    }

    /// Expert rank: start of the A2E receive area of attention index `src_index`, `parity`.
    pub fn a2e_recv(&self, src_index: usize, parity: usize) -> usize {
        self.records_end(Role::Expert) + (2 * src_index + parity) * self.a2e_recv_bytes()
    }

    /// Rows an expert rank's E2A staging holds per parity.
    pub fn expert_rows(&self) -> usize {
        self.num_attention * self.max_tokens
    }

    /// Expert rank: start of the E2A staging area for `parity`.
    pub fn e2a_stage(&self, parity: usize) -> usize {
        self.a2e_recv(self.num_attention, 0)
            + parity * align_up(self.expert_rows() * self.e2a_stride, 4096)
    }

    /// Window size of `rank`.
    pub fn window_len(&self, rank: usize) -> usize {
        match self.roles[rank] {
            Role::Attention => self.a2e_input(2),
            Role::Expert => self.e2a_stage(2),
        }
    }

    /// Window sizes of every rank, in rank order.
    pub fn window_lens(&self) -> Vec<usize> {
        (0..self.roles.len()).map(|r| self.window_len(r)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_is_32_bytes_and_rejects_wrong_epoch_and_torn_fields() {
        assert_eq!(std::mem::size_of::<Record>(), 32);
        let r = Record::new(7, 3, 12, TransferMode::Pull);
        assert_eq!(r.validate(1, 7, 10).unwrap(), WireMode::Pull);
        assert!(matches!(
            r.validate(1, 8, 10),
            Err(Error::Protocol { peer: 1, .. })
        ));
        assert!(r.validate(1, 7, 2).is_err(), "count above capacity");
        let mut torn = r;
        torn.count = 4;
        assert!(torn.validate(1, 7, 10).is_err(), "check word");
    }

    #[test]
    fn config_rejects_zero_sizes_and_oversized_token_caps() {
        let topo = Topology::contiguous(1, 1, 4).unwrap();
        let ok = MoeConfig::new(8, DType::F32, 2, 4);
        ok.validate(&topo).unwrap();
        for bad in [
            MoeConfig {
                hidden: 0,
                ..ok.clone()
            },
            MoeConfig {
                topk: 0,
                ..ok.clone()
            },
            MoeConfig {
                max_tokens_per_rank: 0,
                ..ok.clone()
            },
            MoeConfig {
                max_tokens_per_rank: MAX_PROGRESS_ROWS + 1,
                ..ok.clone()
            },
            MoeConfig {
                timeout: Duration::ZERO,
                ..ok.clone()
            },
            MoeConfig {
                chunk_bytes: 0,
                ..ok.clone()
            },
        ] {
            assert!(
                matches!(bad.validate(&topo), Err(Error::InvalidArgument(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn progress_signals_order_by_epoch_then_rows() {
        assert_eq!(Progress::of(0, 1), Progress::NotYet);
        assert_eq!(Progress::of(progress(1, 0), 1), Progress::Rows(0));
        assert_eq!(Progress::of(progress(3, 17), 3), Progress::Rows(17));
        assert_eq!(Progress::of(progress(3, 17), 4), Progress::NotYet);
        assert_eq!(Progress::of(progress(4, 0), 3), Progress::Done);
        assert_eq!(Progress::of(progress(4, 0), 3).rows(9), 9);
        assert_eq!(Progress::Rows(12).rows(9), 9);
        let big = (1u64 << 40) - 1;
        assert_eq!(
            Progress::of(progress(big, MAX_PROGRESS_ROWS), big),
            Progress::Rows(MAX_PROGRESS_ROWS)
        );
        assert!(progress(2, MAX_PROGRESS_ROWS) < progress(3, 0));
    }

    #[test]
    fn a2e_row_meta_round_trips() {
        let topo = Topology::contiguous(1, 1, 100).unwrap();
        let cfg = MoeConfig::new(5, DType::BF16, 3, 4);
        let row = A2eRow::new(&cfg, &topo);
        assert_eq!(row.mask_words, 2);
        assert_eq!(row.stride % 16, 0);
        let mut meta = vec![0u8; row.stride - row.meta_offset()];
        row.encode_meta(&mut meta, 9, &[0b101, 1 << 35], &[0.5, 0.25, 0.25]);
        let (tok, mask, w) = row.decode_meta(&meta);
        assert_eq!(tok, 9);
        assert_eq!(u64::from_le_bytes(mask[0..8].try_into().unwrap()), 0b101);
        assert_eq!(u64::from_le_bytes(mask[8..16].try_into().unwrap()), 1 << 35);
        assert_eq!(f32::from_le_bytes(w[4..8].try_into().unwrap()), 0.25);
    }

    #[test]
    fn window_regions_do_not_overlap() {
        let topo = Topology::contiguous(3, 2, 8).unwrap();
        let cfg = MoeConfig::new(16, DType::F32, 4, 10);
        let l = WindowLayout::new(&topo, &cfg).unwrap();
        assert!(l.record(1, 1) + RECORD_SLOT <= l.a2e_stage(0));
        assert!(l.a2e_stage(0) + l.attention_rows * l.a2e.stride <= l.a2e_stage(1));
        assert!(l.a2e_stage(1) + l.attention_rows * l.a2e.stride <= l.e2a_recv(0));
        assert!(l.e2a_recv(1) + l.attention_rows * l.e2a_stride <= l.window_len(0));
        assert!(l.record(2, 1) + RECORD_SLOT <= l.a2e_recv(0, 0));
        assert!(l.a2e_recv(2, 1) + 10 * l.a2e.stride <= l.e2a_stage(0));
        assert!(l.e2a_stage(1) + l.expert_rows() * l.e2a_stride <= l.window_len(3));
    }
}
