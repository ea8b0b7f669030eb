//! The A2E row codec: one row per (token, destination rank).
//!
//! A row is `hidden` elements of payload, then [`A2E_META_FIXED`] bytes (source token index,
//! number of local experts), then `mask_words` u64 words of local-expert bitmask, then `topk` f32
//! weights (for the set bits, ascending), padded to 64 bytes (a cache line: every row's payload
//! starts on a line of its own; INT8 rows to 16). A token for three experts on one rank
//! crosses the wire once. In gather mode only the metadata travels (`meta_stride` apart) and the
//! payload is the token's row of the sender's registered input. E2A rows are bare payloads.

use super::config::MoeConfig;
use super::routing::mask_bits;
use crate::topology::Topology;
use crate::{Error, Result};

/// Bytes of fixed A2E row metadata: source token index (u32) and expert count (u32).
pub const A2E_META_FIXED: usize = 8;
/// Alignment of full A2E rows in the dtype (payload and metadata): one cache line.
pub const ROW_ALIGN: usize = 64;

/// Byte layout of one A2E row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct A2eRow {
    /// Elements per row.
    pub hidden: usize,
    /// Payload bytes (hidden * dtype size).
    pub payload: usize,
    /// Payload bytes of an INT8 row ([`super::quant::int8_payload`]).
    pub int8_payload: usize,
    /// Bytes from one INT8 row to the next (16-byte aligned).
    pub int8_stride: usize,
    /// u64 words of local-expert mask.
    pub mask_words: usize,
    /// f32 weight slots.
    pub topk: usize,
    /// Bytes from one row to the next (64-byte aligned, [`ROW_ALIGN`]).
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
        // Rows are 64-byte aligned (a cache line): each row's payload starts on a line of its
        // own, so the copies in and out of windows never straddle lines shared by two rows.
        let stride = (payload.next_multiple_of(8) + meta).next_multiple_of(ROW_ALIGN);
        let int8_payload = super::quant::int8_payload(cfg.hidden);
        A2eRow {
            hidden: cfg.hidden,
            payload,
            int8_payload,
            // INT8 rows stay 16-byte aligned: every row then grows by exactly the hidden-size
            // difference (the cost model rescales counts by it; `xccl-bench model`).
            int8_stride: (int8_payload.next_multiple_of(8) + meta).next_multiple_of(16),
            mask_words,
            topk: cfg.topk,
            stride,
            meta_stride: meta.next_multiple_of(16),
        }
    }

    /// Offset of the metadata within a full row.
    pub fn meta_offset(&self) -> usize {
        self.payload.next_multiple_of(8)
    }

    /// Payload bytes of a row, INT8 or not.
    pub fn payload_for(&self, int8: bool) -> usize {
        if int8 {
            self.int8_payload
        } else {
            self.payload
        }
    }

    /// Bytes from one row to the next, INT8 or not.
    pub fn stride_for(&self, int8: bool) -> usize {
        if int8 {
            self.int8_stride
        } else {
            self.stride
        }
    }

    /// Offset of the metadata within a row, INT8 or not.
    pub fn meta_offset_for(&self, int8: bool) -> usize {
        self.payload_for(int8).next_multiple_of(8)
    }

    /// Bytes of metadata (without padding).
    pub fn meta_len(&self) -> usize {
        A2E_META_FIXED + 8 * self.mask_words + 4 * self.topk
    }

    /// Writes a row's metadata into `meta` (at least [`A2eRow::meta_len`] bytes).
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

    /// Decodes and validates a received row's metadata (`meta`, as [`A2eRow::encode_meta`]
    /// wrote it) from `src`: returns its source token index and fills `experts` with its
    /// `(local expert, weight)` pairs, ascending.
    ///
    /// A token index of `max_tokens` or more, a local expert of `local` or more, or more than
    /// `topk` experts is an [`Error::Protocol`] naming `src`.
    pub fn decode_row(
        &self,
        meta: &[u8],
        src: usize,
        max_tokens: usize,
        local: usize,
        experts: &mut Vec<(u32, f32)>,
    ) -> Result<u32> {
        let token = u32::from_le_bytes(meta[0..4].try_into().expect("4 bytes"));
        let m0 = A2E_META_FIXED;
        let w0 = m0 + 8 * self.mask_words;
        let (mask, weights) = (&meta[m0..w0], &meta[w0..w0 + 4 * self.topk]);
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
        for (slot, j) in mask_bits(words).enumerate() {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    #[test]
    fn a2e_row_meta_round_trips_and_bad_rows_name_the_sender() {
        let topo = Topology::contiguous(1, 1, 100).unwrap();
        let cfg = MoeConfig::new(5, DType::BF16, 3, 4);
        let row = A2eRow::new(&cfg, &topo);
        assert_eq!(row.mask_words, 2);
        assert_eq!(row.stride % ROW_ALIGN, 0);
        let mut meta = vec![0u8; row.stride - row.meta_offset()];
        row.encode_meta(&mut meta, 3, &[0b101, 1 << 35], &[0.5, 0.25, 0.125]);
        let mut experts = Vec::new();
        let tok = row.decode_row(&meta, 7, 4, 100, &mut experts).unwrap();
        assert_eq!(tok, 3);
        assert_eq!(experts, vec![(0, 0.5), (2, 0.25), (99, 0.125)]);
        assert!(matches!(
            row.decode_row(&meta, 7, 3, 100, &mut experts),
            Err(Error::Protocol { peer: 7, .. })
        ));
        assert!(matches!(
            row.decode_row(&meta, 7, 4, 99, &mut experts),
            Err(Error::Protocol { peer: 7, .. })
        ));
    }
}
