//! [`WindowLayout`]: the byte offset of every region in every rank's window.
//!
//! Every rank computes every peer's layout from the same [`Topology`] and [`MoeConfig`], so no
//! offsets are exchanged at init; the handshake at init checks that the ranks agree. Each region
//! that a call uses exists `max_in_flight` times ("buffers"); call `e` uses buffer
//! `e % max_in_flight`, and a sender reuses a buffer only after every receiver has credited the
//! call that last used it. The receive areas of a call without relays or DP domains (an expert
//! rank's A2E receive area, an attention rank's E2A receive area) are the exception: the
//! attention rank picks their buffer, the call's landing buffer, and names it in its A2E
//! records (`DispatchSender::landing` in `dispatch.rs`).
//!
//! Attention rank: handshake | E2A record area (per expert rank, per buffer) | A2E staging (per
//! buffer, `max_tokens * min(topk, N)` rows, grouped by destination at the offsets the records
//! name) | E2A receive area (same shape: expert rank `d` writes its replies at the offset the A2E
//! record to `d` named) | registered A2E input (per buffer, `[max_tokens, hidden]`).
//!
//! Expert rank: handshake | A2E record area (per attention rank, per buffer) | A2E receive area
//! (per attention rank, per buffer, `recv_rows` rows: `max_tokens` unless
//! `MoeConfig::recv_capacity` is lower) | E2A staging (per buffer, `M * recv_rows` rows).
//!
//! With relays ([`crate::topology::RelayPlan`]) every expert rank also has, after its E2A
//! staging: relay headers (per relay, per buffer: one record plus a `(count, offset, flags)`
//! entry per member attention rank) and E2A record slots (per expert rank, per buffer: the
//! replies relayed through this rank); and a relay, per member attention rank and buffer: the
//! member's route table (its token count and its row count per expert rank), its A2E rows
//! (`max_tokens * min(topk, N)`, grouped by destination) and the E2A replies of every expert
//! rank for them (same shape).

use super::config::MoeConfig;
use super::rows::A2eRow;
use crate::topology::{Role, Topology};

/// Bytes a record slot takes in a window (one cache line).
pub const RECORD_SLOT: usize = 64;
/// Bytes reserved at the start of every window for the init handshake.
pub const HANDSHAKE_BYTES: usize = 256;

fn page(v: usize) -> usize {
    v.next_multiple_of(4096)
}

/// Byte offsets of every region in every rank's window.
#[derive(Clone, Debug)]
pub struct WindowLayout {
    /// The A2E row format.
    pub a2e: A2eRow,
    /// Bytes of one E2A row (the payload: staging and reply areas are dense `[rows, hidden]`).
    pub e2a_stride: usize,
    /// Bytes of one INT8 E2A row (payload and scale, 16-byte aligned); E2A areas are sized for
    /// the larger of the two strides.
    pub e2a_int8_stride: usize,
    /// Rows an attention rank's staging and reply areas hold per buffer.
    pub attention_rows: usize,
    /// Max tokens per attention rank.
    pub max_tokens: usize,
    /// Rows an expert rank's receive area holds per source and buffer
    /// ([`MoeConfig::recv_rows_per_source`]).
    pub recv_rows: usize,
    /// Buffers per region (`max_in_flight`).
    pub depth: usize,
    num_attention: usize,
    num_expert: usize,
    roles: Vec<Role>,
    /// For each attention index, its receive slot on expert ranks (its position in its DP
    /// domain; its index without domains).
    recv_slot: Vec<usize>,
    /// Sources an expert rank's receive areas hold (the largest domain; M without domains).
    recv_sources: usize,
    /// Relays: (number of relays, most members of one relay, members of each rank's relay
    /// role (0 for non-relays)).
    relays: Option<(usize, usize, Vec<usize>)>,
}

/// Bytes of one relay-header entry: `(count, offset, flags, reserved)` as u32, then the
/// member's user tag as u64.
pub const RELAY_ENTRY: usize = 24;

impl WindowLayout {
    /// Computes the layout for a topology and config.
    pub fn new(topo: &Topology, cfg: &MoeConfig) -> Self {
        let n = topo.expert_ranks().len();
        WindowLayout {
            a2e: A2eRow::new(cfg, topo),
            e2a_stride: cfg.hidden * cfg.dtype.size(),
            e2a_int8_stride: super::quant::int8_payload(cfg.hidden).next_multiple_of(16),
            attention_rows: cfg.max_tokens_per_rank * cfg.topk.min(n),
            max_tokens: cfg.max_tokens_per_rank,
            recv_rows: cfg.recv_rows_per_source(),
            depth: cfg.max_in_flight,
            num_attention: topo.attention_ranks().len(),
            num_expert: n,
            roles: (0..topo.world_size()).map(|r| topo.role(r)).collect(),
            recv_slot: (0..topo.attention_ranks().len())
                .map(|a| topo.domain_of(a).1)
                .collect(),
            recv_sources: topo.max_domain_size(),
            relays: topo.relay_plan().map(|p| {
                let members = (0..topo.world_size())
                    .map(|r| p.relay_index(r).map_or(0, |k| p.members(k).len()))
                    .collect();
                (p.count(), p.max_members(), members)
            }),
        }
    }

    /// Bytes from one E2A row to the next, INT8 or not.
    pub fn e2a_stride_for(&self, int8: bool) -> usize {
        if int8 {
            self.e2a_int8_stride
        } else {
            self.e2a_stride
        }
    }

    /// Bytes reserved per row in E2A areas: room for either row format.
    fn e2a_room(&self) -> usize {
        self.e2a_stride.max(self.e2a_int8_stride)
    }

    /// The buffer call `epoch` uses.
    pub fn buffer(&self, epoch: u64) -> usize {
        (epoch % self.depth as u64) as usize
    }

    /// The end of a `role` rank's handshake and record area (page aligned): the bytes a
    /// fabric may keep in host memory when the rest of the window is device memory (the cuda
    /// fabric's host prefix); every row lies past it.
    pub fn record_area_end(&self, role: Role) -> usize {
        self.records_end(role)
    }

    fn records_end(&self, role: Role) -> usize {
        let peers = match role {
            Role::Attention => self.num_expert,
            Role::Expert => self.num_attention,
        };
        page(HANDSHAKE_BYTES + self.depth * peers * RECORD_SLOT)
    }

    /// Offset of the record slot for `peer_index` (the peer's index among its role), `buffer`.
    pub fn record(&self, peer_index: usize, buffer: usize) -> usize {
        HANDSHAKE_BYTES + (self.depth * peer_index + buffer) * RECORD_SLOT
    }

    fn a2e_stage_bytes(&self) -> usize {
        page(self.attention_rows * self.a2e.stride.max(self.a2e.int8_stride))
    }

    /// Attention rank: start of the A2E staging area of `buffer`.
    pub fn a2e_stage(&self, buffer: usize) -> usize {
        self.records_end(Role::Attention) + buffer * self.a2e_stage_bytes()
    }

    /// Attention rank: start of the E2A receive area of `buffer`.
    pub fn e2a_recv(&self, buffer: usize) -> usize {
        self.a2e_stage(self.depth) + buffer * page(self.attention_rows * self.e2a_room())
    }

    /// Attention rank: start of the registered A2E input of `buffer`: `[max_tokens, hidden]`
    /// dense rows the caller writes and receivers gather from.
    pub fn a2e_input(&self, buffer: usize) -> usize {
        self.e2a_recv(self.depth) + buffer * page(self.max_tokens * self.a2e.payload)
    }

    pub(crate) fn a2e_recv_bytes(&self) -> usize {
        page(self.recv_rows * self.a2e.stride.max(self.a2e.int8_stride))
    }

    /// Expert rank: start of the A2E receive area of attention index `src_index`, `buffer`
    /// (with DP domains, the sources at one position of every domain share an area: one
    /// domain's call at a time uses it).
    pub fn a2e_recv(&self, src_index: usize, buffer: usize) -> usize {
        self.a2e_recv_slot(self.recv_slot[src_index], buffer)
    }

    fn a2e_recv_slot(&self, slot: usize, buffer: usize) -> usize {
        self.records_end(Role::Expert) + (self.depth * slot + buffer) * self.a2e_recv_bytes()
    }

    /// Rows an expert rank's E2A staging holds per buffer (one domain's tokens).
    pub fn expert_rows(&self) -> usize {
        self.recv_sources * self.recv_rows
    }

    /// Expert rank: start of the E2A staging area of `buffer`.
    pub fn e2a_stage(&self, buffer: usize) -> usize {
        self.a2e_recv_slot(self.recv_sources, 0)
            + buffer * page(self.expert_rows() * self.e2a_room())
    }

    /// Bytes of one relay header: a record and one entry per member (room for the largest
    /// relay), one cache line multiple.
    pub fn relay_header_bytes(&self) -> usize {
        let most = self.relays.as_ref().map_or(0, |r| r.1);
        (32 + RELAY_ENTRY * most).next_multiple_of(RECORD_SLOT)
    }

    /// Expert rank (relays only): start of the header relay `relay_index` writes for `buffer`.
    pub fn relay_header(&self, relay_index: usize, buffer: usize) -> usize {
        self.e2a_stage(self.depth) + (self.depth * relay_index + buffer) * self.relay_header_bytes()
    }

    /// Expert rank (relays only): the record slot for expert index `expert_index`'s E2A
    /// replies relayed through this rank, `buffer`.
    pub fn relay_e2a_record(&self, expert_index: usize, buffer: usize) -> usize {
        let r = self.relays.as_ref().map_or(0, |r| r.0);
        page(self.relay_header(r, 0)) + (self.depth * expert_index + buffer) * RECORD_SLOT
    }

    fn relay_areas_start(&self) -> usize {
        page(self.relay_e2a_record(self.num_expert, 0))
    }

    /// Bytes of a member's route table: its token count, then its row count per expert rank.
    pub fn route_table_bytes(&self) -> usize {
        (4 * (1 + self.num_expert)).next_multiple_of(RECORD_SLOT)
    }

    fn relay_member_bytes(&self) -> usize {
        page(self.route_table_bytes())
            + self.a2e_stage_bytes()
            + page(self.attention_rows * self.e2a_room())
    }

    fn relay_member(&self, slot: usize, buffer: usize) -> usize {
        self.relay_areas_start() + (self.depth * slot + buffer) * self.relay_member_bytes()
    }

    /// Relay: the route table of member `slot` (its position among the relay's members).
    pub fn relay_table(&self, slot: usize, buffer: usize) -> usize {
        self.relay_member(slot, buffer)
    }

    /// Relay: the A2E rows of member `slot`, grouped by destination.
    pub fn relay_a2e(&self, slot: usize, buffer: usize) -> usize {
        self.relay_member(slot, buffer) + page(self.route_table_bytes())
    }

    /// Relay: the E2A replies for member `slot`'s rows, at the rows' offsets.
    pub fn relay_e2a(&self, slot: usize, buffer: usize) -> usize {
        self.relay_a2e(slot, buffer) + self.a2e_stage_bytes()
    }

    /// Bytes of one E2A row's room in relay areas (either format).
    pub fn e2a_row_room(&self) -> usize {
        self.e2a_room()
    }

    /// Window size of `rank`.
    pub fn window_len(&self, rank: usize) -> usize {
        match (self.roles[rank], &self.relays) {
            (Role::Attention, _) => self.a2e_input(self.depth),
            (Role::Expert, None) => self.e2a_stage(self.depth),
            (Role::Expert, Some((_, _, members))) => self.relay_member(members[rank], 0),
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
    use crate::DType;

    #[test]
    fn window_regions_do_not_overlap_for_any_depth() {
        let topo = Topology::contiguous(3, 2, 8).unwrap();
        for depth in 1..=3 {
            let cfg = MoeConfig {
                max_in_flight: depth,
                ..MoeConfig::new(16, DType::F32, 4, 10)
            };
            let l = WindowLayout::new(&topo, &cfg);
            let last = depth - 1;
            assert!(HANDSHAKE_BYTES <= l.record(0, 0));
            assert!(l.record(1, last) + RECORD_SLOT <= l.a2e_stage(0));
            for b in 0..depth {
                assert!(l.a2e_stage(b) + l.attention_rows * l.a2e.stride <= l.a2e_stage(b + 1));
                assert!(l.e2a_recv(b) + l.attention_rows * l.e2a_stride <= l.e2a_recv(b + 1));
                assert!(l.a2e_input(b) + 10 * l.a2e.payload <= l.a2e_input(b + 1));
            }
            assert!(l.a2e_stage(depth) <= l.e2a_recv(0));
            assert!(l.e2a_recv(depth) <= l.a2e_input(0));
            assert!(l.a2e_input(depth) <= l.window_len(0));
            assert!(l.record(2, last) + RECORD_SLOT <= l.a2e_recv(0, 0));
            assert!(l.a2e_recv(2, last) + 10 * l.a2e.stride <= l.e2a_stage(0));
            assert!(l.e2a_stage(last) + l.expert_rows() * l.e2a_stride <= l.window_len(3));
        }
    }
}
