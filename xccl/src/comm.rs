//! [`Communicator`]: one rank's handle on an xccl job; ties fabric, topology and the MoE
//! protocol together.
//!
//! Every rank builds its communicator from the same [`Topology`] and [`MoeConfig`]; the window
//! each fabric needs comes from [`Communicator::window_lens`]. At init every rank checks that all
//! peers were given the same topology and config (fingerprints exchanged through the windows).
//!
//! Attention ranks call [`Communicator::a2e_send`] (or [`Communicator::a2e_input`] +
//! [`Communicator::a2e_send_input`]) then [`Communicator::e2a_recv`]. Expert ranks receive with
//! [`Communicator::a2e_recv`] (expert-major), [`Communicator::a2e_recv_tokens`] (token-major, per
//! source as it arrives) or [`Communicator::a2e_recv_view`] (in place), and reply with the
//! matching E2A send. Calls are collective in order: every rank makes the same sequence of A2E
//! and E2A calls.

use std::sync::Arc;
use std::time::Duration;

use crate::bootstrap::Exchange;
use crate::fabric::ascend::AscendFabric;
use crate::fabric::local::LocalFabric;
use crate::fabric::shm::ShmFabric;
use crate::fabric::{deadline_after, Capabilities, Fabric};
use crate::moe::batch::{A2eHandle, ExpertBatch};
use crate::moe::dtype::Element;
use crate::moe::layout::DispatchLayout;
use crate::moe::wire::{MoeConfig, Slots, TransferMode, WindowLayout, HANDSHAKE_BYTES};
use crate::topology::{Role, Topology};
use crate::{Error, Result};

const HANDSHAKE_MAGIC: u64 = u64::from_le_bytes(*b"XCCLHAND");
/// Whether the protocol reaches its own window through `put`/`get` when the fabric has no host
/// view of it (`local_window()` is `None`, the ascend fabric). Set it to `true` once it does;
/// `init_ascend` refuses to build a communicator until then.
const PROTOCOL_REACHES_DEVICE_WINDOWS: bool = false;

/// One rank's communicator.
pub struct Communicator {
    pub(crate) fabric: Box<dyn Fabric>,
    pub(crate) topo: Arc<Topology>,
    pub(crate) cfg: MoeConfig,
    pub(crate) layout: WindowLayout,
    pub(crate) slots: Slots,
    pub(crate) rank: usize,
    pub(crate) a2e_epoch: u64,
    pub(crate) e2a_epoch: u64,
    /// The A2E epoch whose registered input was handed out by `a2e_input`.
    pub(crate) input_epoch: Option<u64>,
    /// The E2A epoch whose output staging `e2a_output` handed out, and its batch's A2E epoch.
    pub(crate) output_epoch: Option<(u64, u64)>,
    /// Generation of the last [`Communicator::barrier`].
    pub(crate) barrier_gen: u64,
    /// f32 accumulators reused by E2A.
    pub(crate) acc: Vec<f32>,
    /// Landing buffer for pull mode on fabrics without load/store access.
    pub(crate) pull_buf: Vec<u8>,
    /// Per-local-expert cursors reused by A2E receive.
    pub(crate) cursors: Vec<usize>,
    /// `(local expert, weight)` pairs of the row being decoded, reused by A2E receive.
    pub(crate) experts_scratch: Vec<(u32, f32)>,
    /// Layout reused by A2E send when the caller hands handles back.
    pub(crate) spare_layout: Option<DispatchLayout>,
}

impl Communicator {
    /// Window size every rank's fabric must register, in rank order.
    pub fn window_lens(topo: &Topology, cfg: &MoeConfig) -> Result<Vec<usize>> {
        cfg.validate(topo)?;
        Ok(WindowLayout::new(topo, cfg)?.window_lens())
    }

    /// Signal slots every rank's fabric must have.
    pub fn signal_slots(topo: &Topology) -> usize {
        Slots::new(topo.world_size()).count()
    }

    /// Builds this rank's communicator on an initialised fabric. Collective: every rank calls it.
    ///
    /// Fails if the fabric's windows are too small or if any peer was given a different topology
    /// or config (naming that peer).
    pub fn new(fabric: Box<dyn Fabric>, topo: Arc<Topology>, cfg: MoeConfig) -> Result<Self> {
        cfg.validate(&topo)?;
        let layout = WindowLayout::new(&topo, &cfg)?;
        let slots = Slots::new(topo.world_size());
        if fabric.world_size() != topo.world_size() {
            return Err(Error::invalid(format!(
                "fabric has {} ranks, topology {}",
                fabric.world_size(),
                topo.world_size()
            )));
        }
        if fabric.num_signal_slots() < slots.count() {
            return Err(Error::invalid(format!(
                "fabric has {} signal slots per rank, the protocol needs {}",
                fabric.num_signal_slots(),
                slots.count()
            )));
        }
        for r in 0..topo.world_size() {
            if fabric.window_len(r) < layout.window_len(r) {
                return Err(Error::invalid(format!(
                    "rank {r}'s window is {} bytes, the protocol needs {}",
                    fabric.window_len(r),
                    layout.window_len(r)
                )));
            }
        }
        let rank = fabric.rank();
        let comm = Communicator {
            fabric,
            topo,
            cfg,
            layout,
            slots,
            rank,
            a2e_epoch: 0,
            e2a_epoch: 0,
            barrier_gen: 0,
            input_epoch: None,
            output_epoch: None,
            acc: Vec::new(),
            pull_buf: Vec::new(),
            cursors: Vec::new(),
            experts_scratch: Vec::new(),
            spare_layout: None,
        };
        comm.handshake()?;
        Ok(comm)
    }

    /// Builds this rank's communicator over shared memory (ranks are processes on one host).
    /// Collective: every rank of `exchange` calls it with the same topology and config.
    ///
    /// ```no_run
    /// use std::{sync::Arc, time::Duration};
    /// use xccl::bootstrap::{TcpBootstrap, UniqueId};
    /// use xccl::{Communicator, DType, MoeConfig, Topology};
    ///
    /// // One process makes the id and hands its hex form to every rank (env var, file, ...).
    /// let id: UniqueId = std::env::var("XCCL_ID").unwrap().parse()?;
    /// let rank: usize = std::env::var("RANK").unwrap().parse().unwrap();
    /// let boot = TcpBootstrap::connect(&id, rank, 4, Duration::from_secs(60))?;
    /// let topo = Arc::new(Topology::contiguous(2, 2, 64)?);
    /// let cfg = MoeConfig::new(7168, DType::BF16, 8, 128);
    /// let comm = Communicator::init_shm(Arc::new(boot), topo, cfg)?;
    /// # Ok::<(), xccl::Error>(())
    /// ```
    pub fn init_shm(
        exchange: Arc<dyn Exchange>,
        topo: Arc<Topology>,
        cfg: MoeConfig,
    ) -> Result<Self> {
        let lens = Self::window_lens(&topo, &cfg)?;
        let len = *lens.get(exchange.rank()).ok_or_else(|| {
            Error::invalid(format!(
                "bootstrap rank {} is outside the topology's {} ranks",
                exchange.rank(),
                lens.len()
            ))
        })?;
        let fabric = ShmFabric::new(exchange, len, Self::signal_slots(&topo))?;
        Self::new(Box::new(fabric), topo, cfg)
    }

    /// Builds this rank's communicator over the Ascend fabric: its window in the device memory
    /// of NPU `device`, reached by its peers through IPC memory keys (see
    /// [`crate::fabric::ascend`]). Collective: every rank of `exchange` calls it with the same
    /// topology and config and its own device. Fails with [`Error::FabricUnavailable`] naming
    /// `libascendcl.so` and `ASCEND_HOME_PATH` where the CANN runtime is not installed; in this
    /// build also after the fabric came up, because the MoE protocol does not yet reach a
    /// device-memory window through `put`/`get` (the fabric itself is usable on its own).
    pub fn init_ascend(
        exchange: Arc<dyn Exchange>,
        topo: Arc<Topology>,
        cfg: MoeConfig,
        device: i32,
    ) -> Result<Self> {
        let lens = Self::window_lens(&topo, &cfg)?;
        let len = *lens.get(exchange.rank()).ok_or_else(|| {
            Error::invalid(format!(
                "bootstrap rank {} is outside the topology's {} ranks",
                exchange.rank(),
                lens.len()
            ))
        })?;
        let fabric = AscendFabric::new(exchange, len, Self::signal_slots(&topo), device)?;
        if !PROTOCOL_REACHES_DEVICE_WINDOWS && fabric.local_window().is_none() {
            // Refuse here rather than panic in the handshake or the first A2E.
            return Err(Error::FabricUnavailable {
                fabric: "ascend".into(),
                detail: "the MoE protocol of this build loads and stores its own window, and \
                         the ascend window is device memory (local_window() is None)"
                    .into(),
            });
        }
        Self::new(Box::new(fabric), topo, cfg)
    }

    /// Builds a whole job of ranks as threads of this process over the `local` fabric; returns
    /// one communicator per rank, in rank order (move each to its own thread).
    pub fn local_group(topo: &Topology, cfg: &MoeConfig) -> Result<Vec<Communicator>> {
        let lens = Self::window_lens(topo, cfg)?;
        let fabrics = LocalFabric::create(&lens, Self::signal_slots(topo))?;
        Self::init_group(fabrics, topo, cfg)
    }

    /// Like [`Communicator::local_group`] over a local fabric advertising `caps` (tests use it
    /// to run the paths of fabrics without load/store access).
    pub fn local_group_with(
        topo: &Topology,
        cfg: &MoeConfig,
        caps: Capabilities,
    ) -> Result<Vec<Communicator>> {
        let lens = Self::window_lens(topo, cfg)?;
        let fabrics = LocalFabric::create_with(&lens, Self::signal_slots(topo), caps)?;
        Self::init_group(fabrics, topo, cfg)
    }

    fn init_group(
        fabrics: Vec<LocalFabric>,
        topo: &Topology,
        cfg: &MoeConfig,
    ) -> Result<Vec<Communicator>> {
        let topo = Arc::new(topo.clone());
        // Init is collective (a barrier inside), so each rank initialises on its own thread.
        std::thread::scope(|s| {
            let handles: Vec<_> = fabrics
                .into_iter()
                .map(|f| {
                    let topo = topo.clone();
                    let cfg = cfg.clone();
                    s.spawn(move || Communicator::new(Box::new(f), topo, cfg))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .map_err(|_| Error::invalid("a rank panicked during init"))?
                })
                .collect()
        })
    }

    fn fingerprint_words(&self) -> [u64; 5] {
        [
            HANDSHAKE_MAGIC,
            self.topo.fingerprint(),
            self.cfg.fingerprint(),
            self.topo.world_size() as u64,
            self.rank as u64,
        ]
    }

    /// Publishes this rank's fingerprints in its window and checks every peer's.
    fn handshake(&self) -> Result<()> {
        let mine = self.fingerprint_words();
        let bytes: &[u8] = bytemuck::cast_slice(&mine);
        debug_assert!(bytes.len() <= HANDSHAKE_BYTES);
        self.fabric
            .local_window()
            .expect("host window")
            .write(0, bytes)?;
        self.fabric.barrier(self.cfg.timeout)?;
        let mut theirs = [0u64; 5];
        for peer in 0..self.topo.world_size() {
            self.fabric
                .get(peer, 0, bytemuck::cast_slice_mut(&mut theirs))?;
            let what = if theirs[0] != HANDSHAKE_MAGIC {
                "no handshake (not an xccl communicator of this version)"
            } else if theirs[1] != mine[1] {
                "a different topology"
            } else if theirs[2] != mine[2] {
                "a different MoE config (hidden, dtype, topk or max tokens)"
            } else if theirs[3] != mine[3] || theirs[4] != peer as u64 {
                "a different world size or rank numbering"
            } else {
                continue;
            };
            return Err(Error::Protocol {
                peer,
                detail: format!("rank {peer} was initialised with {what}"),
            });
        }
        self.fabric.barrier(self.cfg.timeout)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// This rank's role.
    pub fn role(&self) -> Role {
        self.topo.role(self.rank)
    }

    /// The topology.
    pub fn topology(&self) -> &Topology {
        &self.topo
    }

    /// The MoE config.
    pub fn config(&self) -> &MoeConfig {
        &self.cfg
    }

    /// The fabric (for diagnostics and benchmarks).
    pub fn fabric(&self) -> &dyn Fabric {
        &*self.fabric
    }

    /// Changes the default transfer mode for later calls. Each sender picks per call; receivers
    /// follow what the record says, so ranks need not agree.
    pub fn set_mode(&mut self, mode: TransferMode) {
        self.cfg.mode = mode;
    }

    /// Changes the deadline of every wait in later calls.
    pub fn set_timeout(&mut self, timeout: Duration) -> Result<()> {
        if timeout.is_zero() {
            return Err(Error::invalid("timeout must be positive"));
        }
        self.cfg.timeout = timeout;
        Ok(())
    }

    /// Metadata records one A2E call writes in the whole job (one per (attention, expert) pair).
    pub fn a2e_records_per_call(&self) -> usize {
        self.topo.attention_ranks().len() * self.topo.expert_ranks().len()
    }

    /// Aborts the job with `reason`: every rank's current and future waits fail with
    /// [`Error::Aborted`] naming this rank and carrying the reason.
    pub fn abort(&self, reason: &str) {
        self.fabric.abort(reason);
    }

    /// Waits for every rank (collective), through the fabric's signals: on shared memory a
    /// release reaches every rank within microseconds (the bootstrap's TCP barrier is used only
    /// at init). Fails naming the first rank that has not arrived.
    pub fn barrier(&mut self) -> Result<()> {
        self.barrier_gen += 1;
        let generation = self.barrier_gen;
        let world = self.topo.world_size();
        for step in 1..world {
            let peer = (self.rank + step) % world;
            self.fabric
                .signal(peer, self.slots.barrier(self.rank), generation)?;
        }
        let (f, slots) = (&*self.fabric, self.slots);
        f.wait_until(self.deadline(), &mut || {
            (0..world)
                .find(|&p| p != self.rank && f.signal_value(slots.barrier(p)) < generation)
                .map(|peer| crate::fabric::Waiting {
                    peer,
                    what: "barrier",
                })
        })
    }

    /// Waits until every expert rank has consumed the A2E call two before `epoch` (the last
    /// user of `epoch`'s buffers).
    pub(crate) fn wait_a2e_credits(&self, epoch: u64) -> Result<()> {
        self.wait_credits(
            epoch,
            self.topo.expert_ranks(),
            self.slots.a2e_credit(0),
            "A2E credit (expert has not consumed an earlier dispatch)",
        )
    }

    /// Waits until every attention rank has consumed the E2A call two before `epoch`.
    pub(crate) fn wait_e2a_credits(&self, epoch: u64) -> Result<()> {
        self.wait_credits(
            epoch,
            self.topo.attention_ranks(),
            self.slots.e2a_credit(0),
            "E2A credit (attention rank has not consumed an earlier combine)",
        )
    }

    /// Waits until every rank of `peers` has signalled at least `epoch - 2` into its slot of
    /// the credit group starting at slot `base` (slot `base + peer`).
    fn wait_credits(
        &self,
        epoch: u64,
        peers: &[usize],
        base: usize,
        what: &'static str,
    ) -> Result<()> {
        if epoch <= 2 {
            return Ok(());
        }
        let need = epoch - 2;
        let f = &*self.fabric;
        f.wait_until(self.deadline(), &mut || {
            peers
                .iter()
                .find(|&&p| f.signal_value(base + p) < need)
                .map(|&peer| crate::fabric::Waiting { peer, what })
        })
    }

    pub(crate) fn deadline(&self) -> std::time::Instant {
        deadline_after(self.cfg.timeout)
    }

    pub(crate) fn require_role(&self, role: Role, call: &str) -> Result<()> {
        if self.role() != role {
            return Err(Error::WrongRole(format!(
                "{call} is for {role:?} ranks; rank {} is an {:?} rank",
                self.rank,
                self.role()
            )));
        }
        Ok(())
    }

    pub(crate) fn require_dtype<T: Element>(&self) -> Result<()> {
        if T::DTYPE != self.cfg.dtype {
            return Err(Error::invalid(format!(
                "tensor dtype {} does not match the communicator's {}",
                T::DTYPE.name(),
                self.cfg.dtype.name()
            )));
        }
        Ok(())
    }

    /// A2E on an attention rank: sends each token of `x` (`[T, hidden]`) to the expert ranks of
    /// its `topk_idx` (`[T, topk]`, `-1` = none) with `topk_weights` (`[T, topk]`).
    ///
    /// Validates everything before anything is written to any peer. Returns the handle that
    /// [`Communicator::e2a_recv`] needs.
    pub fn a2e_send<T: Element>(
        &mut self,
        x: &[T],
        topk_idx: &[i32],
        topk_weights: &[f32],
    ) -> Result<A2eHandle> {
        self.require_dtype::<T>()?;
        let mode = self.cfg.mode;
        self.a2e_send_bytes(bytemuck::cast_slice(x), topk_idx, topk_weights, mode)
    }

    /// [`Communicator::a2e_send`] with an explicit transfer mode for this call.
    pub fn a2e_send_with<T: Element>(
        &mut self,
        x: &[T],
        topk_idx: &[i32],
        topk_weights: &[f32],
        mode: TransferMode,
    ) -> Result<A2eHandle> {
        self.require_dtype::<T>()?;
        self.a2e_send_bytes(bytemuck::cast_slice(x), topk_idx, topk_weights, mode)
    }

    /// E2A on an attention rank: receives the expert outputs of the tokens sent with `handle`
    /// and writes `out[t] = sum_k topk_weights[t,k] * expert_k(x[t])` (`[T, hidden]`), summed in
    /// f32 in expert-rank order (bitwise reproducible).
    pub fn e2a_recv<T: Element>(&mut self, handle: A2eHandle, out: &mut [T]) -> Result<()> {
        self.require_dtype::<T>()?;
        self.e2a_recv_bytes(handle, bytemuck::cast_slice_mut(out))
    }

    /// E2A on an expert rank: `expert_out` holds one output row per row of `batch` (same
    /// layout); reduces each token's local experts with its gating weights and sends one row per
    /// token back to its attention rank.
    pub fn e2a_send<T: Element>(&mut self, batch: &ExpertBatch, expert_out: &[T]) -> Result<()> {
        self.require_dtype::<T>()?;
        let mode = self.cfg.mode;
        self.e2a_send_bytes(batch, bytemuck::cast_slice(expert_out), mode)
    }

    /// [`Communicator::e2a_send`] with an explicit transfer mode for this call.
    pub fn e2a_send_with<T: Element>(
        &mut self,
        batch: &ExpertBatch,
        expert_out: &[T],
        mode: TransferMode,
    ) -> Result<()> {
        self.require_dtype::<T>()?;
        self.e2a_send_bytes(batch, bytemuck::cast_slice(expert_out), mode)
    }

    /// Hands a finished handle back so the next A2E reuses its buffers (optional).
    pub fn recycle(&mut self, handle: A2eHandle) {
        self.spare_layout = Some(handle.layout);
    }
}
