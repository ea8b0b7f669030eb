//! [`MoeConfig`]: what every rank of a communicator agrees on, and [`TransferMode`].

use std::time::Duration;

use super::dtype::DType;
use super::hash::Fnv;
use super::progress::{CHUNK_BYTES, EPOCH_MASK, MAX_PROGRESS_ROWS};
use super::quant::Quant;
use super::window_layout::WindowLayout;
use crate::fabric::MAX_TIMEOUT;
use crate::topology::Topology;
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

/// Largest [`MoeConfig::window_bound`] a config may have: far above any window the 16 GiB
/// limit of `validate` lets through, far below where the layout's arithmetic could overflow.
const WINDOW_BOUND_LIMIT: u128 = 1 << 56;

/// Most microbatches a communicator lets be in flight ([`MoeConfig::max_in_flight`]).
pub const MAX_IN_FLIGHT: usize = 8;

/// Fixed parameters of a communicator's MoE exchange.
///
/// `hidden`, `dtype`, `topk`, `max_tokens_per_rank`, `recv_capacity`, `max_in_flight` and
/// `epoch_base` must be equal on every rank (init checks them and names the field that differs); `mode`, `timeout`,
/// `chunk_bytes`, the quantization fields and `keep_int8` are local choices (a receiver follows
/// what each record says).
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
    /// Rows an expert rank can receive from one attention rank in one call; 0 (the default)
    /// means `max_tokens_per_rank`, the worst case (every token routed to this rank). A lower
    /// value shrinks every expert window (receive areas and E2A staging scale with it) at the
    /// price of a bound: an A2E call that would send more rows than this to one expert rank
    /// fails before it writes anything, naming the rank, the rows and the capacity (the call
    /// may be retried with fewer tokens). It never overflows into another region.
    pub recv_capacity: usize,
    /// Microbatches in flight: on an attention rank, A2E calls whose E2A has not been received;
    /// on an expert rank, received A2E calls not yet replied to. One set of buffers each, so the
    /// windows grow with it. A call past it fails at once (it never waits for a credit that
    /// cannot come). 1 to [`MAX_IN_FLIGHT`]; 2 by default (double buffering).
    pub max_in_flight: usize,
    /// Default transfer mode (each call may override it).
    pub mode: TransferMode,
    /// Deadline of a whole call: every wait inside one call shares it. Positive and at most
    /// [`crate::fabric::MAX_TIMEOUT`] (365 days).
    pub timeout: Duration,
    /// Bytes a sender writes between progress signals, so receivers copy while senders write.
    /// A communicator raises it to its fabric's [`crate::fabric::Capabilities::chunk_floor`]
    /// (4 MiB over libfabric's tcp provider).
    pub chunk_bytes: usize,
    /// How this rank's A2E sends put rows on the wire ([`Quant::Int8`]: INT8 with one f32 scale
    /// per token, about half the bytes of bf16).
    pub a2e_quant: Quant,
    /// How this rank's E2A sends put reply rows on the wire; the attention rank dequantizes
    /// inside its sum. Replies sent from the registered output (`e2a_output`) always travel in
    /// the dtype.
    pub e2a_quant: Quant,
    /// On an expert rank: receive A2E rows as INT8 plus one f32 scale per row
    /// (`ExpertBatch::int8_rows`, `TokenBatch::int8_rows`, the shape int8 GEMMs take) instead
    /// of rows dequantized to the dtype; rows that arrive unquantized are quantized on receipt
    /// with the same quantizer.
    pub keep_int8: bool,
    /// The epoch numbering starts after this value (0). The first call is epoch
    /// `epoch_base + 1`. Tests set it just below 2^40 to cross the wrap-around of the 40-bit
    /// epoch carried by progress signals.
    pub epoch_base: u64,
}

impl MoeConfig {
    /// A config with push mode, 2 microbatches in flight and a 30 s timeout per call.
    pub fn new(hidden: usize, dtype: DType, topk: usize, max_tokens_per_rank: usize) -> Self {
        MoeConfig {
            hidden,
            dtype,
            topk,
            max_tokens_per_rank,
            recv_capacity: 0,
            max_in_flight: 2,
            mode: TransferMode::Push,
            timeout: Duration::from_secs(30),
            chunk_bytes: CHUNK_BYTES,
            a2e_quant: Quant::None,
            e2a_quant: Quant::None,
            keep_int8: false,
            epoch_base: 0,
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
        if let Some(plan) = topo.relay_plan() {
            // A member's hop carries its rows for every expert rank in one message; a relay's
            // forward carries up to `recv_rows` rows of each of its members to one expert rank.
            let hop = self
                .max_tokens_per_rank
                .saturating_mul(self.topk.min(topo.expert_ranks().len()));
            if hop > MAX_PROGRESS_ROWS {
                return Err(Error::invalid(format!(
                    "with relays one hop carries up to max_tokens_per_rank * min(topk, expert \
                     ranks) = {hop} rows in one message, more than a progress signal counts \
                     ({MAX_PROGRESS_ROWS}); lower max_tokens_per_rank or topk"
                )));
            }
            let forward = plan
                .max_members()
                .saturating_mul(self.recv_rows_per_source());
            if forward > MAX_PROGRESS_ROWS {
                return Err(Error::invalid(format!(
                    "with relays a relay forwards up to (members of a relay) * rows per source = \
                     {} * {} = {forward} rows in one message, more than a progress signal \
                     counts ({MAX_PROGRESS_ROWS}); lower max_tokens_per_rank or \
                     recv_capacity, or use more relays",
                    plan.max_members(),
                    self.recv_rows_per_source()
                )));
            }
        }
        if self.recv_capacity > self.max_tokens_per_rank {
            return Err(Error::invalid(format!(
                "recv_capacity {} is more than max_tokens_per_rank {} (the worst case); use 0 \
                 for the worst case",
                self.recv_capacity, self.max_tokens_per_rank
            )));
        }
        if !(1..=MAX_IN_FLIGHT).contains(&self.max_in_flight) {
            return Err(Error::invalid(format!(
                "max_in_flight {} must be in 1..={MAX_IN_FLIGHT}",
                self.max_in_flight
            )));
        }
        check_timeout(self.timeout)?;
        if self.chunk_bytes == 0 {
            return Err(Error::invalid("chunk_bytes must be positive"));
        }
        if self.epoch_base > u64::MAX / 2 {
            return Err(Error::invalid(format!(
                "epoch_base {} is too large (at most {}; the 40-bit wire epoch {:#x} wraps harmlessly)",
                self.epoch_base,
                u64::MAX / 2,
                EPOCH_MASK
            )));
        }
        if topo.num_domains() > 1 && self.max_in_flight != 1 {
            return Err(Error::invalid(format!(
                "DP domains take turns one call at a time: max_in_flight must be 1 with {} \
                 domains (it is {})",
                topo.num_domains(),
                self.max_in_flight
            )));
        }
        // An upper bound of every window, in u128, before the layout is computed in usize: a
        // huge hidden size or token count would overflow that computation (found by the
        // `config` fuzz target: `hidden * dtype size` wrapped around).
        let bound = self.window_bound(topo);
        if bound > WINDOW_BOUND_LIMIT {
            return Err(Error::invalid(format!(
                "the windows could need up to {bound} bytes (limit {WINDOW_BOUND_LIMIT}); lower \
                 max_tokens_per_rank, hidden, topk or max_in_flight"
            )));
        }
        let layout = WindowLayout::new(topo, self);
        for r in 0..topo.world_size() {
            if layout.window_len(r) > (u32::MAX as usize) * 16 {
                return Err(Error::invalid(format!(
                    "rank {r} would need a {} byte window; lower max_tokens_per_rank, hidden or max_in_flight",
                    layout.window_len(r)
                )));
            }
        }
        Ok(())
    }

    /// An upper bound of any rank's window bytes, computed without overflow: every region
    /// (records, staging, receive, reply, relay areas) of every buffer holds at most
    /// `max_tokens * (M + 1) * (topk + 1)` rows of at most `4 * hidden + 64 + 8 * mask_words +
    /// 4 * topk` bytes (padding included), plus a page of rounding each.
    fn window_bound(&self, topo: &Topology) -> u128 {
        let w = |v: usize| v as u128;
        let row = 4 * w(self.hidden) + 64 + 8 * w(topo.mask_words()) + 4 * w(self.topk);
        let rows = w(self.max_tokens_per_rank)
            .saturating_mul(w(topo.attention_ranks().len()) + 1)
            .saturating_mul(w(self.topk) + 1);
        let regions = 8 * (w(topo.world_size()) + 4);
        // Saturating: three factors near 2^64 overflow even u128 (the `config` fuzz target's
        // second crash).
        w(self.max_in_flight)
            .saturating_mul(regions)
            .saturating_mul(rows.saturating_mul(row).saturating_add(4096))
    }

    /// Rows an expert rank receives from one attention rank per call at most
    /// ([`MoeConfig::recv_capacity`], or `max_tokens_per_rank` when that is 0).
    pub fn recv_rows_per_source(&self) -> usize {
        match self.recv_capacity {
            0 => self.max_tokens_per_rank,
            c => c.min(self.max_tokens_per_rank),
        }
    }

    /// The fields every rank must agree on, named, as they go into the init handshake.
    pub(crate) fn agreed_fields(&self) -> [(&'static str, u64); 7] {
        [
            ("hidden", self.hidden as u64),
            ("dtype", self.dtype as u64),
            ("topk", self.topk as u64),
            ("max_tokens_per_rank", self.max_tokens_per_rank as u64),
            ("recv_rows_per_source", self.recv_rows_per_source() as u64),
            ("max_in_flight", self.max_in_flight as u64),
            ("epoch_base", self.epoch_base),
        ]
    }

    /// Stable hash of every field that every rank must agree on.
    pub fn fingerprint(&self) -> u64 {
        let mut h = Fnv::new();
        for (_, v) in self.agreed_fields() {
            h.u64(v);
        }
        h.finish()
    }
}

/// A call timeout is positive and at most [`MAX_TIMEOUT`] (365 days): the error names the limit.
pub(crate) fn check_timeout(timeout: Duration) -> Result<()> {
    if timeout.is_zero() {
        return Err(Error::invalid("timeout must be positive"));
    }
    if timeout > MAX_TIMEOUT {
        return Err(Error::invalid(format!(
            "timeout {timeout:?} is too long: at most {} s (365 days)",
            MAX_TIMEOUT.as_secs()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
                max_in_flight: 0,
                ..ok.clone()
            },
            MoeConfig {
                max_in_flight: MAX_IN_FLIGHT + 1,
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
            MoeConfig {
                recv_capacity: ok.max_tokens_per_rank + 1,
                ..ok.clone()
            },
        ] {
            assert!(
                matches!(bad.validate(&topo), Err(Error::InvalidArgument(_))),
                "{bad:?}"
            );
        }
    }

    /// Found by review: `validate` bounded a member's hop but not a relay's forward, which
    /// carries every member's rows for one expert rank in one message (top-1, 2-member relays,
    /// `max_tokens_per_rank > 2^23` passed and overflowed the 24-bit progress count).
    #[test]
    fn a_relays_forward_is_bounded_by_what_a_progress_signal_counts() {
        let topo = Topology::contiguous(2, 1, 2)
            .unwrap()
            .with_relays(Some(1))
            .unwrap();
        assert_eq!(topo.relay_plan().unwrap().max_members(), 2);
        let at = |tokens: usize| MoeConfig::new(8, DType::F32, 1, tokens);
        // At the real per-message maximum: 2 members x rows per source.
        at(MAX_PROGRESS_ROWS / 2).validate(&topo).unwrap();
        let err = at(MAX_PROGRESS_ROWS / 2 + 1)
            .validate(&topo)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("relay forwards") && err.contains("2 * "),
            "{err}"
        );
        // A lower receive capacity brings it back under the bound.
        let capped = MoeConfig {
            recv_capacity: MAX_PROGRESS_ROWS / 2,
            ..at(MAX_PROGRESS_ROWS / 2 + 1)
        };
        capped.validate(&topo).unwrap();
    }

    #[test]
    fn a_timeout_past_the_limit_is_refused_naming_the_limit() {
        let topo = Topology::contiguous(1, 1, 4).unwrap();
        let cfg = MoeConfig {
            timeout: Duration::MAX,
            ..MoeConfig::new(8, DType::F32, 2, 4)
        };
        let err = cfg.validate(&topo).unwrap_err().to_string();
        assert!(err.contains("365 days") && err.contains("timeout"), "{err}");
        let at_limit = MoeConfig {
            timeout: MAX_TIMEOUT,
            ..cfg
        };
        at_limit.validate(&topo).unwrap();
    }

    /// Found by the `config` fuzz target: `hidden * dtype size` overflowed inside the layout
    /// (a panic with overflow checks, a wrapped, too small layout without).
    #[test]
    fn sizes_whose_window_arithmetic_would_overflow_are_rejected() {
        let topo = Topology::contiguous(2, 3, 16).unwrap();
        for bad in [
            MoeConfig::new(usize::MAX / 2 + 3, DType::BF16, 2, 4),
            MoeConfig::new(1 << 40, DType::F32, 2, 4),
            MoeConfig::new(8, DType::F32, usize::MAX / 4, 4),
            MoeConfig::new(1 << 24, DType::F32, 1 << 20, MAX_PROGRESS_ROWS),
            // Found by the fuzzer in the first version of the bound: hidden and topk near
            // 2^64 overflowed its u128 product.
            MoeConfig::new(usize::MAX, DType::F32, usize::MAX, MAX_PROGRESS_ROWS),
        ] {
            match bad.validate(&topo) {
                Err(Error::InvalidArgument(m)) => assert!(m.contains("byte"), "{m}"),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        // A large token count with a modest row still passes.
        MoeConfig::new(8, DType::F32, 2, 1 << 20)
            .validate(&topo)
            .unwrap();
    }

    #[test]
    fn fingerprint_covers_every_agreed_field_and_nothing_local() {
        let c = MoeConfig::new(8, DType::F32, 2, 4);
        let local = MoeConfig {
            mode: TransferMode::Pull,
            timeout: Duration::from_secs(1),
            chunk_bytes: 7,
            ..c.clone()
        };
        assert_eq!(c.fingerprint(), local.fingerprint());
        for other in [
            MoeConfig {
                hidden: 9,
                ..c.clone()
            },
            MoeConfig {
                dtype: DType::BF16,
                ..c.clone()
            },
            MoeConfig {
                topk: 3,
                ..c.clone()
            },
            MoeConfig {
                max_tokens_per_rank: 5,
                ..c.clone()
            },
            MoeConfig {
                max_in_flight: 1,
                ..c.clone()
            },
            MoeConfig {
                epoch_base: 1,
                ..c.clone()
            },
        ] {
            assert_ne!(c.fingerprint(), other.fingerprint(), "{other:?}");
        }
    }

    #[test]
    fn relayed_messages_must_fit_a_progress_signal_at_the_boundary() {
        let topo = Topology::contiguous(1, 2, 4)
            .unwrap()
            .with_relays(Some(1))
            .unwrap();
        let at = |tokens: usize| MoeConfig::new(8, DType::F32, 2, tokens).validate(&topo);
        // 1A:2E, topk 2: one hop carries 2 * max_tokens rows.
        at(MAX_PROGRESS_ROWS / 2).unwrap();
        let err = at(MAX_PROGRESS_ROWS / 2 + 1).unwrap_err();
        assert!(err.to_string().contains("one hop carries"), "{err}");
        // Without relays the same count is fine (one message per expert rank).
        let direct = Topology::contiguous(1, 2, 4).unwrap();
        MoeConfig::new(8, DType::F32, 2, MAX_PROGRESS_ROWS / 2 + 1)
            .validate(&direct)
            .unwrap();
    }
}
