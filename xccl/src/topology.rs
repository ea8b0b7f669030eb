//! Roles and expert placement: which global rank is an attention rank, which is an expert rank, and
//! which expert ranks host a replica of each expert.
//!
//! This module owns the *static* description of a job that every rank must agree on. It is pure data:
//! no I/O, no fabric, no threads. A [`Topology`] is built once with a [`TopologyBuilder`] (or
//! [`Topology::contiguous`]), validated, and then answers the questions the wire protocol asks on
//! its hot path in O(1):
//!
//! - which rank and local-expert index a token from a given source goes to for a given expert
//!   ([`Topology::route`]);
//! - which global experts a rank hosts, in local-expert-index order ([`Topology::local_experts`]);
//! - how many `u64` words a per-token local-expert bitmask needs ([`Topology::mask_words`]).
//!
//! # Replica choice
//!
//! An expert may have several replicas (the first is the primary). A token from attention rank `src`
//! going to expert `e` uses `replicas(e)[attention_index(src) % replicas(e).len()]`. The choice
//! depends only on the source rank, never on the token or on load, so it is deterministic and every
//! rank computes the same answer; with `R` replicas the attention ranks are spread evenly over them.
//!
//! # Agreement
//!
//! [`Topology::fingerprint`] is a stable hash of the roles and the placement (including replica
//! order) so ranks can check during bootstrap that they were all given the same topology.

use crate::{Error, Result};

/// What a rank does in a disaggregated MoE job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Runs attention; sends tokens to experts (A2E) and receives their outputs (E2A).
    Attention,
    /// Hosts experts; receives tokens (A2E) and sends expert outputs back (E2A).
    Expert,
}

impl Role {
    /// A stable one-byte code, used by the fingerprint.
    fn code(self) -> u8 {
        match self {
            Role::Attention => 1,
            Role::Expert => 2,
        }
    }
}

/// The validated roles and expert placement of a job. Build it with [`TopologyBuilder`] or
/// [`Topology::contiguous`].
///
/// Ranks are global ranks `0..world_size()`. Experts are global expert ids `0..num_experts()`. On an
/// expert rank, the experts it hosts are numbered by *local index* `0..local_experts(rank).len()` in
/// ascending global id order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    /// Role of each global rank.
    roles: Vec<Role>,
    /// For each global rank, its index among the ranks of the same role.
    role_index: Vec<usize>,
    /// Global ranks with role attention, ascending.
    attention: Vec<usize>,
    /// Global ranks with role expert, ascending.
    expert: Vec<usize>,
    /// Number of global experts.
    num_experts: usize,
    /// Replicas of expert `e` are `replica_rank[replica_start[e]..replica_start[e + 1]]`.
    replica_start: Vec<usize>,
    /// Global rank of each replica (flattened over experts; first of each expert = primary).
    replica_rank: Vec<usize>,
    /// Local-expert index of each replica at its rank (parallel to `replica_rank`).
    replica_local: Vec<usize>,
    /// For each global rank, the global experts it hosts, ascending (empty for attention ranks).
    local: Vec<Vec<usize>>,
    /// Maximum of `local[r].len()` over all ranks.
    max_local: usize,
    /// Per expert, its [`RouteKey`] when that does not depend on the source (one replica, or
    /// none: [`RouteKey::ORPHANED`]), else [`RouteKey::REPLICATED`]: the dispatch layout routes
    /// each selection with one load instead of two lookups and a branch on the replica count.
    route_keys: Vec<RouteKey>,
    /// Precomputed [`Topology::fingerprint`].
    fingerprint: u64,
    /// The relay plan, when A2E and E2A go through relays ([`Topology::with_relays`]).
    relays: Option<RelayPlan>,
    /// Attention indices per DP domain ([`Topology::with_domains`]); one domain of every
    /// attention rank without domains.
    domains: Vec<Vec<usize>>,
    /// The global ranks of each domain's attention ranks (`domains` mapped to ranks).
    domain_ranks: Vec<Vec<usize>>,
    /// For each attention index, its domain and its position in it.
    domain_of: Vec<(usize, usize)>,
}

/// Where one selection of an expert goes: (destination rank, local expert) packed as
/// `dst << 32 | local` (both are counted in `u32` on the wire), or one of two markers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RouteKey(u64);

impl RouteKey {
    /// An expert without a replica ([`Topology::is_orphaned`]): its selections are dropped.
    pub(crate) const ORPHANED: RouteKey = RouteKey(u64::MAX);
    /// An expert with several replicas: the route depends on the source.
    const REPLICATED: RouteKey = RouteKey(u64::MAX - 1);

    fn new(dst: usize, local: usize) -> Self {
        RouteKey(((dst as u64) << 32) | local as u64)
    }

    /// The destination rank and local expert (not for [`RouteKey::ORPHANED`]).
    #[inline(always)]
    pub(crate) fn split(self) -> (usize, usize) {
        (
            (self.0 >> 32) as usize,
            (self.0 & u64::from(u32::MAX)) as usize,
        )
    }
}

/// A topology after ranks left it ([`Topology::shrink`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShrunkTopology {
    /// The survivors' topology.
    pub topology: Topology,
    /// Old rank -> new rank; `None` for a rank that left.
    pub new_rank: Vec<Option<usize>>,
    /// Experts left without a replica (their tokens are dropped), ascending.
    pub orphaned: Vec<usize>,
}

/// Which expert ranks relay ("trampoline") the traffic of which attention ranks.
///
/// With a plan, each attention rank sends its whole A2E to one relay (fan-out 1), which forwards
/// each row to its final expert rank; E2A goes back the same way, the relay summing each token's
/// contributions before it forwards one row per token. A relay is also an ordinary expert rank.
///
/// Attention ranks are assigned to relays in contiguous blocks of their attention index, as
/// equal as possible (sizes differ by at most one): relay `k` serves attention indices
/// `k * M / R .. (k + 1) * M / R`. Pure data: every rank computes the same plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RelayPlan {
    /// Global ranks of the relays, ascending.
    relays: Vec<usize>,
    /// For each attention index, its relay's index in `relays`.
    of_attention: Vec<usize>,
    /// For each relay index, the attention indices it serves, ascending.
    members: Vec<Vec<usize>>,
    /// For each global rank, its index among the relays.
    relay_index: Vec<Option<usize>>,
    /// For each attention index, its position among its relay's members.
    member_slot: Vec<usize>,
}

/// Attention ranks one relay serves by default ([`RelayPlan::default_count`]).
pub const ATTENTION_PER_RELAY: usize = 10;

impl RelayPlan {
    /// The default number of relays for `m` attention and `n` expert ranks: one per
    /// [`ATTENTION_PER_RELAY`] attention ranks, at least 1 and at most `n` (16 for 160 x 288:
    /// 160 + 16 x 288 = 4,768 records per A2E instead of 46,080).
    pub fn default_count(m: usize, n: usize) -> usize {
        m.div_ceil(ATTENTION_PER_RELAY).clamp(1, n.max(1))
    }

    /// `count` relays spread evenly over the expert ranks of `topo` (relay `k` is expert index
    /// `k * N / count`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] unless `1 <= count <= N`.
    pub fn spread(topo: &Topology, count: usize) -> Result<RelayPlan> {
        let n = topo.expert.len();
        if count == 0 || count > n {
            return Err(Error::invalid(format!(
                "{count} relays requested; the job has {n} expert ranks (1 to {n} relays)"
            )));
        }
        let ranks = (0..count).map(|k| topo.expert[k * n / count]).collect();
        Self::explicit(topo, ranks)
    }

    /// Relays at the given global ranks (expert ranks, distinct; any order).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the rank when one is not an expert rank or is listed
    /// twice, or when the list is empty.
    pub fn explicit(topo: &Topology, mut ranks: Vec<usize>) -> Result<RelayPlan> {
        if ranks.is_empty() {
            return Err(Error::invalid("a relay plan needs at least one relay"));
        }
        ranks.sort_unstable();
        for w in ranks.windows(2) {
            if w[0] == w[1] {
                return Err(Error::invalid(format!(
                    "rank {} is listed as a relay twice",
                    w[0]
                )));
            }
        }
        let mut relay_index = vec![None; topo.world_size()];
        for (k, &r) in ranks.iter().enumerate() {
            if r >= topo.world_size() || topo.roles[r] != Role::Expert {
                return Err(Error::invalid(format!(
                    "relay rank {r} is not an expert rank of this job"
                )));
            }
            relay_index[r] = Some(k);
        }
        let (m, count) = (topo.attention.len(), ranks.len());
        let mut members = vec![Vec::new(); count];
        let mut of_attention = Vec::with_capacity(m);
        let mut member_slot = Vec::with_capacity(m);
        for a in 0..m {
            // Contiguous balanced blocks: attention index a goes to relay floor(a * R / M).
            let k = a * count / m;
            of_attention.push(k);
            member_slot.push(members[k].len());
            members[k].push(a);
        }
        Ok(RelayPlan {
            relays: ranks,
            of_attention,
            members,
            relay_index,
            member_slot,
        })
    }

    /// Global ranks of the relays, ascending.
    pub fn relays(&self) -> &[usize] {
        &self.relays
    }

    /// Number of relays.
    pub fn count(&self) -> usize {
        self.relays.len()
    }

    /// The relay index (into [`RelayPlan::relays`]) of attention index `attention_index`.
    pub fn relay_of(&self, attention_index: usize) -> usize {
        self.of_attention[attention_index]
    }

    /// The global rank of attention index `attention_index`'s relay.
    pub fn relay_rank_of(&self, attention_index: usize) -> usize {
        self.relays[self.of_attention[attention_index]]
    }

    /// Relay `k`'s forwarding table: the attention indices it serves, ascending. Every one of
    /// them sends it all of its A2E rows; it forwards each to its final expert rank.
    pub fn members(&self, k: usize) -> &[usize] {
        &self.members[k]
    }

    /// Most attention ranks one relay serves.
    pub fn max_members(&self) -> usize {
        self.members.iter().map(Vec::len).max().unwrap_or(0)
    }

    /// Position of attention index `attention_index` among its relay's members.
    pub fn member_slot(&self, attention_index: usize) -> usize {
        self.member_slot[attention_index]
    }

    /// Global rank `rank`'s index among the relays, if it is one.
    pub fn relay_index(&self, rank: usize) -> Option<usize> {
        self.relay_index.get(rank).copied().flatten()
    }

    /// Metadata records of one A2E call through this plan: one per attention rank (to its
    /// relay) plus one per (relay, expert rank). E2A writes as many.
    pub fn records_per_call(&self, num_attention: usize, num_expert: usize) -> usize {
        num_attention + self.count() * num_expert
    }
}

/// Builds and validates a [`Topology`].
///
/// Without [`placement`](TopologyBuilder::placement) the experts are spread contiguously over the
/// expert ranks (see [`Topology::contiguous`]). [`replicas`](TopologyBuilder::replicas) then adds
/// redundant copies of hot experts. Nothing is checked until [`build`](TopologyBuilder::build).
#[derive(Clone, Debug)]
pub struct TopologyBuilder {
    roles: Vec<Role>,
    num_experts: usize,
    placement: Option<Vec<Vec<usize>>>,
    extra: Vec<(usize, usize)>,
    /// Experts without a replica are allowed (only [`Topology::shrink`] builds such topologies).
    allow_orphans: bool,
}

impl TopologyBuilder {
    /// Starts a topology with `roles[r]` the role of global rank `r` and `num_experts` global experts.
    pub fn new(roles: Vec<Role>, num_experts: usize) -> Self {
        TopologyBuilder {
            roles,
            num_experts,
            placement: None,
            extra: Vec::new(),
            allow_orphans: false,
        }
    }

    /// Starts a topology whose ranks `0..m` are attention ranks and `m..m + n` expert ranks, with the
    /// default contiguous placement (see [`Topology::contiguous`]).
    pub fn contiguous(m: usize, n: usize, num_experts: usize) -> Self {
        let mut roles = vec![Role::Attention; m];
        roles.resize(m + n, Role::Expert);
        Self::new(roles, num_experts)
    }

    /// Sets an explicit placement: `map[e]` lists the global ranks (all expert ranks) hosting a
    /// replica of expert `e`; the first is the primary. `map.len()` must equal `num_experts`.
    pub fn placement(mut self, map: Vec<Vec<usize>>) -> Self {
        self.placement = Some(map);
        self
    }

    /// Adds redundant replicas: for each `(expert, copies)`, `copies` more replicas of `expert`.
    ///
    /// Entries are applied in order, after the base placement. Each new replica goes to the expert
    /// rank hosting the fewest experts among those not already hosting that expert; ties are broken
    /// round-robin (a cursor that moves past the rank chosen last, scanning expert ranks in
    /// ascending order). The result is deterministic. May be called several times; entries accumulate.
    pub fn replicas(mut self, extra: &[(usize, usize)]) -> Self {
        self.extra.extend_from_slice(extra);
        self
    }

    /// Validates and builds the topology.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the offending expert or rank when: `num_experts` is 0; there
    /// is no attention rank or no expert rank; the placement does not list exactly `num_experts`
    /// experts; an expert has no replica; a replica is on a rank outside the world or on an attention
    /// rank; a rank hosts the same expert twice; an extra replica names an unknown expert or cannot be
    /// placed because every expert rank already hosts that expert.
    pub fn build(self) -> Result<Topology> {
        let TopologyBuilder {
            roles,
            num_experts,
            placement,
            extra,
            allow_orphans,
        } = self;
        let world = roles.len();
        if num_experts == 0 {
            return Err(Error::invalid("topology: num_experts must be at least 1"));
        }
        let mut role_index = Vec::with_capacity(world);
        let mut attention = Vec::new();
        let mut expert = Vec::new();
        for (rank, role) in roles.iter().enumerate() {
            match role {
                Role::Attention => {
                    role_index.push(attention.len());
                    attention.push(rank);
                }
                Role::Expert => {
                    role_index.push(expert.len());
                    expert.push(rank);
                }
            }
        }
        if attention.is_empty() {
            return Err(Error::invalid(format!(
                "topology: no attention rank among {world} ranks"
            )));
        }
        if expert.is_empty() {
            return Err(Error::invalid(format!(
                "topology: no expert rank among {world} ranks"
            )));
        }

        let mut map = match placement {
            Some(map) => {
                if map.len() != num_experts {
                    return Err(Error::invalid(format!(
                        "topology: placement lists {} experts but num_experts is {num_experts}",
                        map.len()
                    )));
                }
                map
            }
            None => contiguous_placement(&expert, num_experts),
        };
        validate_placement(&roles, &map, allow_orphans)?;

        // Load = number of experts hosted, per expert-rank index.
        let mut load = vec![0usize; expert.len()];
        for replicas in &map {
            for &r in replicas {
                load[role_index[r]] += 1;
            }
        }
        let mut cursor = 0usize;
        for &(e, copies) in &extra {
            if e >= num_experts {
                return Err(Error::invalid(format!(
                    "topology: extra replicas for expert {e}, but num_experts is {num_experts}"
                )));
            }
            for _ in 0..copies {
                let n = expert.len();
                let mut best: Option<usize> = None;
                for step in 0..n {
                    let i = (cursor + step) % n;
                    if map[e].contains(&expert[i]) {
                        continue;
                    }
                    match best {
                        Some(b) if load[b] <= load[i] => {}
                        _ => best = Some(i),
                    }
                }
                let Some(i) = best else {
                    return Err(Error::invalid(format!(
                        "topology: cannot add a replica of expert {e}: all {n} expert ranks already host it"
                    )));
                };
                map[e].push(expert[i]);
                load[i] += 1;
                cursor = (i + 1) % n;
            }
        }
        validate_placement(&roles, &map, allow_orphans)?;

        let mut local: Vec<Vec<usize>> = vec![Vec::new(); world];
        let mut replica_start = Vec::with_capacity(num_experts + 1);
        let mut replica_rank = Vec::new();
        let mut replica_local = Vec::new();
        replica_start.push(0);
        for (e, replicas) in map.iter().enumerate() {
            for &r in replicas {
                replica_rank.push(r);
                replica_local.push(local[r].len());
                local[r].push(e);
            }
            replica_start.push(replica_rank.len());
        }
        let max_local = local.iter().map(Vec::len).max().unwrap_or(0);

        let num_attention = attention.len();
        let attention_ranks = attention.clone();
        let fingerprint = fingerprint_of(&roles, &map);
        let route_keys = replica_start
            .windows(2)
            .map(|w| match w[1] - w[0] {
                0 => RouteKey::ORPHANED,
                1 => RouteKey::new(replica_rank[w[0]], replica_local[w[0]]),
                _ => RouteKey::REPLICATED,
            })
            .collect();
        Ok(Topology {
            roles,
            role_index,
            attention,
            expert,
            num_experts,
            replica_start,
            replica_rank,
            replica_local,
            local,
            max_local,
            route_keys,
            fingerprint,
            relays: None,
            domains: vec![(0..num_attention).collect()],
            domain_ranks: vec![attention_ranks],
            domain_of: (0..num_attention).map(|a| (0, a)).collect(),
        })
    }
}

/// Expert `e` on expert-rank index `e * n / num_experts`: contiguous blocks as equal as possible.
fn contiguous_placement(expert_ranks: &[usize], num_experts: usize) -> Vec<Vec<usize>> {
    let n = expert_ranks.len() as u128;
    (0..num_experts)
        .map(|e| {
            let i = (e as u128 * n / num_experts as u128) as usize;
            vec![expert_ranks[i]]
        })
        .collect()
}

fn validate_placement(roles: &[Role], map: &[Vec<usize>], allow_orphans: bool) -> Result<()> {
    let world = roles.len();
    for (e, replicas) in map.iter().enumerate() {
        if replicas.is_empty() && !allow_orphans {
            return Err(Error::invalid(format!(
                "topology: expert {e} has no replica"
            )));
        }
        for (i, &r) in replicas.iter().enumerate() {
            if r >= world {
                return Err(Error::invalid(format!(
                    "topology: expert {e} has a replica on rank {r}, but the world has {world} ranks"
                )));
            }
            if roles[r] != Role::Expert {
                return Err(Error::invalid(format!(
                    "topology: expert {e} has a replica on rank {r}, which is an attention rank"
                )));
            }
            if replicas[..i].contains(&r) {
                return Err(Error::invalid(format!(
                    "topology: rank {r} hosts expert {e} twice"
                )));
            }
        }
    }
    Ok(())
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn fnv(hash: &mut u64, bytes: &[u8]) {
    for &b in bytes {
        *hash ^= u64::from(b);
        *hash = hash.wrapping_mul(FNV_PRIME);
    }
}

/// FNV-1a over a version tag, the roles and the placement, all as little-endian u64 / u8.
fn fingerprint_of(roles: &[Role], map: &[Vec<usize>]) -> u64 {
    let mut h = FNV_OFFSET;
    fnv(&mut h, b"xccl-topology-v1");
    fnv(&mut h, &(roles.len() as u64).to_le_bytes());
    for role in roles {
        fnv(&mut h, &[role.code()]);
    }
    fnv(&mut h, &(map.len() as u64).to_le_bytes());
    for replicas in map {
        fnv(&mut h, &(replicas.len() as u64).to_le_bytes());
        for &r in replicas {
            fnv(&mut h, &(r as u64).to_le_bytes());
        }
    }
    h
}

impl Topology {
    /// Ranks `0..m` attention, `m..m + n` expert; expert `e` on expert-rank index
    /// `e * n / num_experts` (contiguous blocks as equal as possible; with fewer experts than expert
    /// ranks some ranks host none). No replicas.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if `m`, `n` or `num_experts` is 0.
    pub fn contiguous(m: usize, n: usize, num_experts: usize) -> Result<Topology> {
        TopologyBuilder::contiguous(m, n, num_experts).build()
    }

    /// Number of ranks (attention plus expert).
    pub fn world_size(&self) -> usize {
        self.roles.len()
    }

    /// Role of global rank `rank`.
    ///
    /// # Panics
    ///
    /// If `rank >= world_size()`.
    pub fn role(&self, rank: usize) -> Role {
        self.roles[rank]
    }

    /// Global ranks with role [`Role::Attention`], ascending.
    pub fn attention_ranks(&self) -> &[usize] {
        &self.attention
    }

    /// Global ranks with role [`Role::Expert`], ascending.
    pub fn expert_ranks(&self) -> &[usize] {
        &self.expert
    }

    /// Index of `rank` among the attention ranks, or `None` if it is not an attention rank (or out of
    /// range).
    pub fn attention_index(&self, rank: usize) -> Option<usize> {
        match self.roles.get(rank)? {
            Role::Attention => Some(self.role_index[rank]),
            Role::Expert => None,
        }
    }

    /// Index of `rank` among the expert ranks, or `None` if it is not an expert rank (or out of
    /// range).
    pub fn expert_index(&self, rank: usize) -> Option<usize> {
        match self.roles.get(rank)? {
            Role::Expert => Some(self.role_index[rank]),
            Role::Attention => None,
        }
    }

    /// Number of global experts.
    pub fn num_experts(&self) -> usize {
        self.num_experts
    }

    /// Global expert ids hosted by `rank`, ascending; position `j` is local-expert index `j`. Empty
    /// for attention ranks.
    ///
    /// # Panics
    ///
    /// If `rank >= world_size()`.
    pub fn local_experts(&self, rank: usize) -> &[usize] {
        &self.local[rank]
    }

    /// Local-expert index of `expert` at `rank`, or `None` if `rank` does not host it.
    pub fn local_index(&self, rank: usize, expert: usize) -> Option<usize> {
        self.local.get(rank)?.binary_search(&expert).ok()
    }

    /// Largest number of experts hosted by one rank.
    pub fn max_local_experts(&self) -> usize {
        self.max_local
    }

    /// Global ranks hosting a replica of `expert`; the first is the primary.
    ///
    /// # Panics
    ///
    /// If `expert >= num_experts()`.
    pub fn replicas(&self, expert: usize) -> &[usize] {
        &self.replica_rank[self.replica_start[expert]..self.replica_start[expert + 1]]
    }

    /// Whether `expert` has no replica: only after a shrink with
    /// `ShrinkOptions::drop_orphaned_experts`, when every rank hosting it died. Tokens for it are
    /// dropped (and counted, [`crate::Stats::dropped_slots`]); [`Topology::route`] panics for it.
    ///
    /// # Panics
    ///
    /// If `expert >= num_experts()`.
    pub fn is_orphaned(&self, expert: usize) -> bool {
        self.replica_start[expert] == self.replica_start[expert + 1]
    }

    /// The topology of this job once ranks `dead` have left it, for [`crate::Communicator::shrink`].
    ///
    /// The survivors are renumbered densely in ascending order of their old rank and keep their
    /// roles; each expert keeps its surviving replicas in their order (the first surviving one
    /// becomes the primary), so an expert rank hosts the same experts, in the same local order,
    /// as before. A relay plan is rebuilt with the same number of relays (at most the surviving
    /// expert ranks), DP domains with the same count (at most the surviving attention ranks).
    ///
    /// # Errors
    /// [`Error::ExpertLost`] naming the first expert whose replicas are all dead, unless
    /// `drop_orphaned` (then it stays without a replica, see [`Topology::is_orphaned`]);
    /// [`Error::InvalidArgument`] when a dead rank is out of range or no attention or no expert
    /// rank survives.
    pub fn shrink(&self, dead: &[usize], drop_orphaned: bool) -> Result<ShrunkTopology> {
        let world = self.world_size();
        if let Some(&r) = dead.iter().find(|&&r| r >= world) {
            return Err(Error::invalid(format!(
                "shrink: dead rank {r} is outside the world of {world} ranks"
            )));
        }
        let mut new_rank = vec![None; world];
        let mut roles = Vec::new();
        for r in (0..world).filter(|r| !dead.contains(r)) {
            new_rank[r] = Some(roles.len());
            roles.push(self.roles[r]);
        }
        let map: Vec<Vec<usize>> = (0..self.num_experts)
            .map(|e| {
                self.replicas(e)
                    .iter()
                    .filter_map(|&r| new_rank[r])
                    .collect()
            })
            .collect();
        let orphaned: Vec<usize> = (0..self.num_experts)
            .filter(|&e| map[e].is_empty())
            .collect();
        if let (Some(&expert), false) = (orphaned.first(), drop_orphaned) {
            let others = if orphaned.len() > 1 {
                format!(" (so have experts {:?})", &orphaned[1..])
            } else {
                String::new()
            };
            return Err(Error::ExpertLost {
                expert,
                ranks: self.replicas(expert).to_vec(),
                others,
            });
        }
        let mut builder = TopologyBuilder::new(roles, self.num_experts).placement(map);
        builder.allow_orphans = drop_orphaned;
        let mut topology = builder
            .build()
            .map_err(|e| Error::invalid(format!("shrink: {e}")))?;
        if let Some(plan) = &self.relays {
            let count = plan.count().min(topology.expert.len());
            topology = topology.with_relays(Some(count))?;
        }
        if self.num_domains() > 1 {
            let count = self.num_domains().min(topology.attention.len());
            topology = topology.with_domains(count)?;
        }
        Ok(ShrunkTopology {
            topology,
            new_rank,
            orphaned,
        })
    }

    /// Where a token from attention rank `src_rank` for `expert` goes: `(destination rank,
    /// local-expert index there)`.
    ///
    /// The replica is `replicas(expert)[attention_index(src_rank) % replicas(expert).len()]`:
    /// deterministic by source rank, spreading attention ranks evenly over the replicas. O(1).
    ///
    /// # Panics
    ///
    /// If `src_rank` is not an attention rank or `expert >= num_experts()`.
    pub fn route(&self, src_rank: usize, expert: usize) -> (usize, usize) {
        let Some(ai) = self.attention_index(src_rank) else {
            panic!("Topology::route: rank {src_rank} is not an attention rank");
        };
        self.route_from_index(ai, expert)
    }

    /// [`route`](Topology::route) with the source given by its attention index instead of its
    /// global rank (saves a lookup on the hot path).
    ///
    /// # Panics
    ///
    /// If `expert >= num_experts()`.
    #[inline]
    pub fn route_from_index(&self, attention_index: usize, expert: usize) -> (usize, usize) {
        assert!(
            expert < self.num_experts,
            "Topology::route: expert {expert} out of range 0..{}",
            self.num_experts
        );
        let start = self.replica_start[expert];
        let count = self.replica_start[expert + 1] - start;
        assert!(
            count > 0,
            "Topology::route: expert {expert} has no replica left (dropped by a shrink)"
        );
        // Most experts have one replica: no division (a 64-bit `div` per selection, twice per
        // selection, was about a quarter of a one-token dispatch layout).
        let r = if count == 1 {
            start
        } else {
            start + attention_index % count
        };
        (self.replica_rank[r], self.replica_local[r])
    }

    /// [`route_from_index`](Topology::route_from_index) as a [`RouteKey`], or
    /// [`RouteKey::ORPHANED`] for an expert without a replica (no panic).
    ///
    /// # Panics
    ///
    /// If `expert >= num_experts()`.
    #[inline(always)]
    pub(crate) fn route_key(&self, attention_index: usize, expert: usize) -> RouteKey {
        match self.route_keys[expert] {
            RouteKey::REPLICATED => {
                let (dst, local) = self.route_from_index(attention_index, expert);
                RouteKey::new(dst, local)
            }
            key => key,
        }
    }

    /// Number of `u64` words in a per-token local-expert bitmask: `ceil(max_local_experts / 64)`,
    /// at least 1.
    pub fn mask_words(&self) -> usize {
        self.max_local.div_ceil(64).max(1)
    }

    /// A stable 64-bit hash (FNV-1a) of the roles and the placement, replica order included, and
    /// of the relay plan when there is one. Equal topologies have equal fingerprints on every
    /// platform and in every process.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// This topology with A2E and E2A going through `plan`'s relays (see [`RelayPlan`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `plan` was made for a different set of ranks.
    pub fn with_relay_plan(mut self, plan: RelayPlan) -> Result<Topology> {
        if plan.of_attention.len() != self.attention.len()
            || plan.relay_index.len() != self.world_size()
            || plan.relays.iter().any(|&r| self.roles[r] != Role::Expert)
        {
            return Err(Error::invalid(
                "the relay plan was made for a different topology",
            ));
        }
        let mut h = self.fingerprint;
        fnv(&mut h, b"relays");
        for &r in &plan.relays {
            fnv(&mut h, &(r as u64).to_le_bytes());
        }
        self.fingerprint = h;
        self.relays = Some(plan);
        Ok(self)
    }

    /// This topology with `count` relays spread over the expert ranks ([`RelayPlan::spread`]);
    /// `None` picks [`RelayPlan::default_count`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] unless `1 <= count <= N`.
    pub fn with_relays(self, count: Option<usize>) -> Result<Topology> {
        let count = count
            .unwrap_or_else(|| RelayPlan::default_count(self.attention.len(), self.expert.len()));
        let plan = RelayPlan::spread(&self, count)?;
        self.with_relay_plan(plan)
    }

    /// The relay plan, if A2E and E2A go through relays.
    pub fn relay_plan(&self) -> Option<&RelayPlan> {
        self.relays.as_ref()
    }

    /// This topology with its attention ranks partitioned into `count` DP domains: contiguous
    /// blocks of attention index, sizes within one. Calls take turns: call `i` (the `i`-th after
    /// `epoch_base`, from 0) belongs to domain `i % count`, and only that domain's attention
    /// ranks take part in it (the others skip it), so an expert rank's receive areas hold one
    /// domain's rows.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] unless `1 <= count <= M`.
    pub fn with_domains(mut self, count: usize) -> Result<Topology> {
        let m = self.attention.len();
        if count == 0 || count > m {
            return Err(Error::invalid(format!(
                "{count} DP domains requested; the job has {m} attention ranks (1 to {m} domains)"
            )));
        }
        self.domains = vec![Vec::new(); count];
        self.domain_ranks = vec![Vec::new(); count];
        self.domain_of.clear();
        for a in 0..m {
            let d = a * count / m;
            self.domain_of.push((d, self.domains[d].len()));
            self.domains[d].push(a);
            self.domain_ranks[d].push(self.attention[a]);
        }
        let mut h = self.fingerprint;
        fnv(&mut h, b"domains");
        fnv(&mut h, &(count as u64).to_le_bytes());
        self.fingerprint = h;
        Ok(self)
    }

    /// Number of DP domains (1 without domains).
    pub fn num_domains(&self) -> usize {
        self.domains.len()
    }

    /// The attention indices of domain `d`, ascending.
    pub fn domain(&self, d: usize) -> &[usize] {
        &self.domains[d]
    }

    /// The domain of attention index `attention_index`, and its position in it.
    pub fn domain_of(&self, attention_index: usize) -> (usize, usize) {
        self.domain_of[attention_index]
    }

    /// Most attention ranks in one domain: the sources an expert rank's receive areas hold.
    pub fn max_domain_size(&self) -> usize {
        self.domains.iter().map(Vec::len).max().unwrap_or(0)
    }

    /// The attention indices taking part in call `call` (0 for the first call after
    /// `epoch_base`): every attention rank without domains, else domain `call % D`'s.
    pub fn call_sources(&self, call: u64) -> &[usize] {
        &self.domains[(call % self.domains.len() as u64) as usize]
    }

    /// [`call_sources`](Topology::call_sources) as global ranks.
    pub fn call_source_ranks(&self, call: u64) -> &[usize] {
        &self.domain_ranks[(call % self.domains.len() as u64) as usize]
    }

    /// Whether global rank `rank` (an attention rank) takes part in call `call`.
    pub fn in_call(&self, rank: usize, call: u64) -> bool {
        self.attention_index(rank)
            .is_some_and(|a| self.domain_of[a].0 as u64 == call % self.domains.len() as u64)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    fn err_msg(r: Result<Topology>) -> String {
        match r {
            Err(Error::InvalidArgument(m)) => m,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn relay_plans_are_balanced_and_checked() {
        let t = Topology::contiguous(160, 288, 288).unwrap();
        assert_eq!(RelayPlan::default_count(160, 288), 16);
        assert_eq!(RelayPlan::default_count(3, 2), 1);
        assert_eq!(RelayPlan::default_count(32, 2), 2);
        let p = RelayPlan::spread(&t, 16).unwrap();
        assert_eq!(p.records_per_call(160, 288), 4_768);
        for k in 0..16 {
            assert_eq!(p.members(k).len(), 10);
            assert_eq!(p.relays()[k], 160 + k * 18);
        }
        let p = RelayPlan::spread(&t, 7).unwrap();
        let sizes: Vec<usize> = (0..7).map(|k| p.members(k).len()).collect();
        assert!(
            sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1,
            "{sizes:?}"
        );
        for a in 0..160 {
            let k = p.relay_of(a);
            assert_eq!(p.members(k)[p.member_slot(a)], a);
            assert_eq!(p.relay_index(p.relay_rank_of(a)), Some(k));
        }
        assert!(RelayPlan::spread(&t, 0).is_err());
        assert!(RelayPlan::spread(&t, 289).is_err());
        assert!(
            RelayPlan::explicit(&t, vec![3]).is_err(),
            "attention rank as relay"
        );
        assert!(RelayPlan::explicit(&t, vec![200, 200]).is_err());
        let relayed = t.clone().with_relays(None).unwrap();
        assert_ne!(relayed.fingerprint(), t.fingerprint());
        assert_eq!(relayed.relay_plan().unwrap().count(), 16);
        let small = Topology::contiguous(2, 3, 6).unwrap();
        assert!(t
            .clone()
            .with_relay_plan(RelayPlan::spread(&small, 1).unwrap())
            .is_err());
    }

    #[test]
    fn domains_partition_attention_ranks_in_balanced_blocks() {
        let t = Topology::contiguous(7, 2, 4).unwrap();
        assert_eq!(t.num_domains(), 1);
        assert_eq!(t.call_sources(5).len(), 7);
        let d = t.clone().with_domains(3).unwrap();
        assert_ne!(d.fingerprint(), t.fingerprint());
        let sizes: Vec<usize> = (0..3).map(|i| d.domain(i).len()).collect();
        assert_eq!(sizes.iter().sum::<usize>(), 7);
        assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
        assert_eq!(d.max_domain_size(), 3);
        for a in 0..7 {
            let (dom, pos) = d.domain_of(a);
            assert_eq!(d.domain(dom)[pos], a);
            assert!(d.in_call(a, dom as u64) && d.in_call(a, dom as u64 + 3));
            assert!(!d.in_call(a, dom as u64 + 1));
        }
        assert!(t.clone().with_domains(0).is_err());
        assert!(t.with_domains(8).is_err());
    }

    #[test]
    fn contiguous_places_equal_blocks() {
        let t = Topology::contiguous(2, 4, 10).unwrap();
        assert_eq!(t.world_size(), 6);
        assert_eq!(t.attention_ranks(), &[0, 1]);
        assert_eq!(t.expert_ranks(), &[2, 3, 4, 5]);
        assert_eq!(t.local_experts(2), &[0, 1, 2]);
        assert_eq!(t.local_experts(3), &[3, 4]);
        assert_eq!(t.local_experts(4), &[5, 6, 7]);
        assert_eq!(t.local_experts(5), &[8, 9]);
        assert!(t.local_experts(0).is_empty());
        assert_eq!(t.max_local_experts(), 3);
        assert_eq!(t.mask_words(), 1);
        for e in 0..10 {
            assert_eq!(t.replicas(e).len(), 1);
        }
        assert_eq!(t.role(0), Role::Attention);
        assert_eq!(t.role(5), Role::Expert);
        assert_eq!(t.attention_index(1), Some(1));
        assert_eq!(t.attention_index(2), None);
        assert_eq!(t.expert_index(4), Some(2));
        assert_eq!(t.expert_index(0), None);
        assert_eq!(t.expert_index(99), None);
    }

    #[test]
    fn contiguous_with_fewer_experts_than_ranks_leaves_some_empty() {
        let t = Topology::contiguous(1, 4, 2).unwrap();
        assert_eq!(t.local_experts(1), &[0]);
        assert!(t.local_experts(2).is_empty());
        assert_eq!(t.local_experts(3), &[1]);
        assert!(t.local_experts(4).is_empty());
        assert_eq!(t.mask_words(), 1);
    }

    #[test]
    fn mask_words_grow_past_64_local_experts() {
        assert_eq!(Topology::contiguous(1, 1, 64).unwrap().mask_words(), 1);
        assert_eq!(Topology::contiguous(1, 1, 65).unwrap().mask_words(), 2);
        assert_eq!(Topology::contiguous(1, 2, 300).unwrap().mask_words(), 3);
    }

    #[test]
    fn interleaved_roles_are_indexed_by_role() {
        use Role::*;
        let t = TopologyBuilder::new(vec![Expert, Attention, Expert, Attention], 4)
            .build()
            .unwrap();
        assert_eq!(t.attention_ranks(), &[1, 3]);
        assert_eq!(t.expert_ranks(), &[0, 2]);
        assert_eq!(t.attention_index(3), Some(1));
        assert_eq!(t.expert_index(2), Some(1));
        assert_eq!(t.local_experts(0), &[0, 1]);
        assert_eq!(t.local_experts(2), &[2, 3]);
    }

    #[test]
    fn build_rejects_zero_experts() {
        let m = err_msg(Topology::contiguous(1, 1, 0));
        assert!(m.contains("num_experts"), "{m}");
    }

    #[test]
    fn build_rejects_missing_roles() {
        assert!(err_msg(Topology::contiguous(0, 2, 4)).contains("no attention rank"));
        assert!(err_msg(Topology::contiguous(2, 0, 4)).contains("no expert rank"));
        assert!(err_msg(TopologyBuilder::new(vec![], 1).build()).contains("no attention rank"));
    }

    #[test]
    fn build_rejects_placement_of_wrong_length() {
        let m = err_msg(
            TopologyBuilder::contiguous(1, 2, 3)
                .placement(vec![vec![1], vec![2]])
                .build(),
        );
        assert!(m.contains("lists 2 experts") && m.contains("3"), "{m}");
    }

    #[test]
    fn build_rejects_expert_without_replica() {
        let m = err_msg(
            TopologyBuilder::contiguous(1, 2, 2)
                .placement(vec![vec![1], vec![]])
                .build(),
        );
        assert!(m.contains("expert 1 has no replica"), "{m}");
    }

    #[test]
    fn build_rejects_replica_on_attention_rank() {
        let m = err_msg(
            TopologyBuilder::contiguous(2, 2, 2)
                .placement(vec![vec![2], vec![3, 1]])
                .build(),
        );
        assert!(
            m.contains("expert 1") && m.contains("rank 1") && m.contains("attention"),
            "{m}"
        );
    }

    #[test]
    fn build_rejects_replica_outside_world() {
        let m = err_msg(
            TopologyBuilder::contiguous(1, 2, 2)
                .placement(vec![vec![7], vec![2]])
                .build(),
        );
        assert!(m.contains("expert 0") && m.contains("rank 7"), "{m}");
    }

    #[test]
    fn build_rejects_rank_hosting_expert_twice() {
        let m = err_msg(
            TopologyBuilder::contiguous(1, 2, 2)
                .placement(vec![vec![1], vec![2, 2]])
                .build(),
        );
        assert!(m.contains("rank 2 hosts expert 1 twice"), "{m}");
    }

    #[test]
    fn build_rejects_extra_replicas_of_unknown_expert() {
        let m = err_msg(
            TopologyBuilder::contiguous(1, 2, 2)
                .replicas(&[(5, 1)])
                .build(),
        );
        assert!(m.contains("expert 5"), "{m}");
    }

    #[test]
    fn build_rejects_more_replicas_than_expert_ranks() {
        let m = err_msg(
            TopologyBuilder::contiguous(1, 3, 3)
                .replicas(&[(0, 3)])
                .build(),
        );
        assert!(
            m.contains("expert 0") && m.contains("all 3 expert ranks"),
            "{m}"
        );
        // Exactly filling every expert rank is fine.
        let t = TopologyBuilder::contiguous(1, 3, 3)
            .replicas(&[(0, 2)])
            .build()
            .unwrap();
        assert_eq!(t.replicas(0), &[1, 2, 3]);
    }

    #[test]
    fn explicit_placement_orders_local_experts_by_id() {
        let t = TopologyBuilder::contiguous(1, 2, 4)
            .placement(vec![vec![2], vec![1, 2], vec![1], vec![2]])
            .build()
            .unwrap();
        assert_eq!(t.local_experts(1), &[1, 2]);
        assert_eq!(t.local_experts(2), &[0, 1, 3]);
        assert_eq!(t.replicas(1), &[1, 2]);
        assert_eq!(t.local_index(2, 3), Some(2));
        assert_eq!(t.local_index(1, 3), None);
        assert_eq!(t.max_local_experts(), 3);
    }

    #[test]
    fn extra_replicas_go_to_least_loaded_ranks_deterministically() {
        // 4 expert ranks (1..=4), 8 experts -> 2 each.
        let b = || TopologyBuilder::contiguous(1, 4, 8).replicas(&[(0, 2), (7, 1)]);
        let t = b().build().unwrap();
        assert_eq!(t, b().build().unwrap());
        // Expert 0 lives on rank 1; all others equally loaded -> round-robin from the cursor.
        assert_eq!(t.replicas(0), &[1, 2, 3]);
        // Ranks 2 and 3 now host 3; rank 1 hosts 2, rank 4 hosts 2 but already has expert 7.
        assert_eq!(t.replicas(7), &[4, 1]);
        let loads: Vec<usize> = (1..=4).map(|r| t.local_experts(r).len()).collect();
        assert_eq!(loads, vec![3, 3, 3, 2]);
    }

    #[test]
    fn replica_routing_is_deterministic_and_spreads_sources() {
        let t = TopologyBuilder::contiguous(6, 3, 3)
            .replicas(&[(1, 2)])
            .build()
            .unwrap();
        assert_eq!(t.replicas(1).len(), 3);
        let mut hits = vec![0usize; t.world_size()];
        for src in 0..6 {
            let a = t.route(src, 1);
            assert_eq!(a, t.route(src, 1));
            assert_eq!(a.0, t.replicas(1)[src % 3]);
            hits[a.0] += 1;
        }
        for &r in t.replicas(1) {
            assert_eq!(hits[r], 2, "each replica serves 2 of 6 sources");
        }
        // Single-replica experts always go to the primary.
        for src in 0..6 {
            assert_eq!(t.route(src, 0).0, t.replicas(0)[0]);
        }
    }

    #[test]
    #[should_panic(expected = "not an attention rank")]
    fn route_from_expert_rank_panics() {
        let t = Topology::contiguous(1, 1, 1).unwrap();
        t.route(1, 0);
    }

    #[test]
    fn fingerprint_is_stable_and_sensitive() {
        let a = Topology::contiguous(2, 2, 4).unwrap();
        let b = Topology::contiguous(2, 2, 4).unwrap();
        assert_eq!(a.fingerprint(), b.fingerprint());
        let c = Topology::contiguous(2, 2, 5).unwrap();
        let d = TopologyBuilder::contiguous(2, 2, 4)
            .replicas(&[(0, 1)])
            .build()
            .unwrap();
        let e = TopologyBuilder::contiguous(2, 2, 4)
            .placement(vec![vec![2], vec![3], vec![2], vec![3]])
            .build()
            .unwrap();
        let f = Topology::contiguous(1, 3, 4).unwrap();
        let fps = [
            a.fingerprint(),
            c.fingerprint(),
            d.fingerprint(),
            e.fingerprint(),
            f.fingerprint(),
        ];
        for i in 0..fps.len() {
            for j in i + 1..fps.len() {
                assert_ne!(fps[i], fps[j], "{i} vs {j}");
            }
        }
        // Replica order matters (it changes routing).
        let g = TopologyBuilder::contiguous(1, 2, 1)
            .placement(vec![vec![1, 2]])
            .build()
            .unwrap();
        let h = TopologyBuilder::contiguous(1, 2, 1)
            .placement(vec![vec![2, 1]])
            .build()
            .unwrap();
        assert_ne!(g.fingerprint(), h.fingerprint());
    }

    /// Random roles (at least one of each), expert count, placement and extra replicas.
    pub(crate) fn arb_topology() -> impl Strategy<Value = Topology> {
        (
            1usize..6,
            1usize..6,
            1usize..20,
            any::<u64>(),
            any::<bool>(),
        )
            .prop_map(|(m, n, e, seed, explicit)| {
                let mut s = seed;
                let mut next = move || {
                    s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
                    let mut z = s;
                    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                    z ^ (z >> 31)
                };
                let mut roles = vec![Role::Attention; m];
                roles.resize(m + n, Role::Expert);
                for i in (1..roles.len()).rev() {
                    let j = (next() % (i as u64 + 1)) as usize;
                    roles.swap(i, j);
                }
                let experts: Vec<usize> = (0..roles.len())
                    .filter(|&r| roles[r] == Role::Expert)
                    .collect();
                let mut b = TopologyBuilder::new(roles, e);
                if explicit {
                    let map = (0..e)
                        .map(|_| {
                            let copies = 1 + (next() % n as u64) as usize;
                            let mut pool = experts.clone();
                            let mut out = Vec::new();
                            for _ in 0..copies {
                                let i = (next() % pool.len() as u64) as usize;
                                out.push(pool.swap_remove(i));
                            }
                            out
                        })
                        .collect();
                    b = b.placement(map);
                } else {
                    let hot = (next() % e as u64) as usize;
                    let copies = (next() % n as u64) as usize;
                    b = b.replicas(&[(hot, copies)]);
                }
                b.build().expect("generated topology is valid")
            })
    }

    proptest! {
        #[test]
        fn route_agrees_with_local_experts(t in arb_topology()) {
            for e in 0..t.num_experts() {
                let reps = t.replicas(e);
                prop_assert!(!reps.is_empty());
                for &src in t.attention_ranks() {
                    let (dst, j) = t.route(src, e);
                    let index = t.attention_index(src).unwrap();
                    prop_assert_eq!(t.route_key(index, e).split(), (dst, j));
                    prop_assert_eq!(t.role(dst), Role::Expert);
                    prop_assert!(reps.contains(&dst));
                    prop_assert_eq!(t.local_experts(dst)[j], e);
                    prop_assert!(j < t.max_local_experts());
                    prop_assert!(j < 64 * t.mask_words());
                }
            }
            for r in 0..t.world_size() {
                let local = t.local_experts(r);
                prop_assert!(local.windows(2).all(|w| w[0] < w[1]));
                for (j, &e) in local.iter().enumerate() {
                    prop_assert!(t.replicas(e).contains(&r));
                    prop_assert_eq!(t.local_index(r, e), Some(j));
                }
            }
            let total: usize = (0..t.num_experts()).map(|e| t.replicas(e).len()).sum();
            let hosted: usize = t.expert_ranks().iter().map(|&r| t.local_experts(r).len()).sum();
            prop_assert_eq!(total, hosted);
        }
    }

    /// 2 attention ranks, expert ranks 2..5, 6 experts two per rank; experts 0..4 also have a
    /// second replica.
    fn shrinkable() -> Topology {
        TopologyBuilder::contiguous(2, 3, 6)
            .replicas(&[(0, 1), (1, 1), (2, 1), (3, 1)])
            .build()
            .unwrap()
    }

    /// The layout's route keys: the replica [`Topology::route`] picks for each source, through
    /// the per-expert keys the topology keeps (one replica) or the replica choice (several),
    /// and the orphaned marker for an expert no rank hosts any more.
    #[test]
    fn route_keys_follow_each_sources_replica_and_mark_orphaned_experts() {
        let t = shrinkable();
        for e in 0..6 {
            for index in 0..2 {
                let key = t.route_key(index, e);
                assert_ne!(key, RouteKey::ORPHANED);
                assert_eq!(key.split(), t.route_from_index(index, e), "expert {e}");
            }
        }
        // Experts 0..4 have two replicas: the two sources take different ones.
        assert_ne!(t.route_key(0, 0), t.route_key(1, 0));
        let s = t.shrink(&[4], true).unwrap();
        let n = &s.topology;
        for e in 0..6 {
            for index in 0..2 {
                let key = n.route_key(index, e);
                if s.orphaned.contains(&e) {
                    assert_eq!(key, RouteKey::ORPHANED, "expert {e}");
                } else {
                    assert_eq!(key.split(), n.route_from_index(index, e), "expert {e}");
                }
            }
        }
        assert_eq!(s.orphaned, vec![4, 5]);
    }

    #[test]
    fn shrink_renumbers_survivors_densely_and_moves_experts_to_their_surviving_replicas() {
        let t = shrinkable();
        let s = t.shrink(&[0, 3], false).unwrap();
        assert_eq!(s.new_rank, vec![None, Some(0), Some(1), None, Some(2)]);
        assert!(s.orphaned.is_empty());
        let n = &s.topology;
        assert_eq!(n.world_size(), 3);
        assert_eq!(n.attention_ranks(), &[0]);
        assert_eq!(n.expert_ranks(), &[1, 2]);
        for e in 0..6 {
            let want: Vec<usize> = t
                .replicas(e)
                .iter()
                .filter_map(|&r| s.new_rank[r])
                .collect();
            assert_eq!(n.replicas(e), want.as_slice(), "expert {e}");
            assert!(!want.is_empty());
            // A surviving rank hosts the same experts as before, in the same local order.
            for &r in t.replicas(e) {
                if let Some(nr) = s.new_rank[r] {
                    assert_eq!(n.local_experts(nr), t.local_experts(r));
                }
            }
        }
        assert_ne!(n.fingerprint(), t.fingerprint());
    }

    #[test]
    fn shrink_names_an_expert_with_no_replica_left_or_drops_it_when_asked() {
        let t = shrinkable();
        match t.shrink(&[4], false) {
            Err(Error::ExpertLost {
                expert: 4,
                ranks,
                others,
            }) => {
                assert_eq!(ranks, vec![4]);
                assert!(others.contains("[5]"), "{others}");
            }
            other => panic!("expected ExpertLost naming expert 4, got {other:?}"),
        }
        let s = t.shrink(&[4], true).unwrap();
        assert_eq!(s.orphaned, vec![4, 5]);
        assert!(s.topology.is_orphaned(4) && s.topology.is_orphaned(5));
        assert!(!s.topology.is_orphaned(0));
        // Ordinary topologies never have orphans.
        assert!((0..6).all(|e| !t.is_orphaned(e)));
        let err = err_msg(
            TopologyBuilder::contiguous(1, 1, 2)
                .placement(vec![vec![1], vec![]])
                .build(),
        );
        assert!(err.contains("expert 1 has no replica"), "{err}");
    }

    #[test]
    fn shrink_rejects_out_of_range_ranks_and_a_job_without_a_role_left() {
        let t = shrinkable();
        assert!(matches!(
            t.shrink(&[5], false),
            Err(Error::InvalidArgument(_))
        ));
        let err = t.shrink(&[0, 1], true).unwrap_err();
        assert!(err.to_string().contains("no attention rank"), "{err}");
        let err = t.shrink(&[2, 3, 4], true).unwrap_err();
        assert!(err.to_string().contains("no expert rank"), "{err}");
    }

    #[test]
    fn shrink_keeps_relays_and_domains_within_the_survivors() {
        let t = TopologyBuilder::contiguous(3, 3, 6)
            .replicas(&[(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1)])
            .build()
            .unwrap()
            .with_relays(Some(3))
            .unwrap()
            .with_domains(3)
            .unwrap();
        let s = t.shrink(&[1, 4], false).unwrap().topology;
        assert_eq!(s.relay_plan().map(RelayPlan::count), Some(2));
        assert_eq!(s.num_domains(), 2);
    }
}
