//! [`Communicator`]: one rank's handle on an xccl job. It builds the fabric and the protocol
//! types, checks at init that every peer was given the same topology and config, and delegates
//! each call to the protocol (`crate::moe`), keeping the one thing the protocol cannot: the state
//! a failed call leaves behind.
//!
//! # Pairing and order
//! Attention ranks call [`Communicator::a2e_send`] (or [`Communicator::a2e_input`] +
//! [`Communicator::a2e_send_input`]) and later [`Communicator::e2a_recv`] with the handle. Expert
//! ranks receive with [`Communicator::a2e_recv`] (expert-major), [`Communicator::a2e_recv_tokens`]
//! (token-major, per source as it arrives) or [`Communicator::a2e_recv_view`] (in place), and
//! reply with the matching E2A send. Every rank makes the same sequence of calls: A2E call `e`
//! on every attention rank meets A2E receive `e` on every expert rank, and its E2A is call `e`
//! too. E2A completes in A2E order: a handle or batch of another call is an error naming both
//! epochs. At most [`MoeConfig::max_in_flight`] calls may be between their A2E and their E2A on
//! a rank; one more fails at once. A call with 0 tokens is an ordinary call (every pair still
//! exchanges a record). An expert loop ends when the job's protocol says so: attention ranks
//! put a user tag on each A2E ([`Communicator::set_next_a2e_tag`], for example the step number
//! or a stop flag), and every expert rank reads it with the call's rows
//! ([`crate::SourceInfo::tag`], [`ExpertBatch::tag`]).
//!
//! # Polling instead of blocking
//! [`Communicator::e2a_ready`] and [`Communicator::a2e_ready`] say, without blocking, whether
//! the next E2A receive of a handle or the next A2E receive would wait for a peer: a
//! single-threaded engine overlaps communication with compute by polling them between kernels.
//! Through relays a relay rank's A2E is ready only once its members' rows are in, and an
//! expert rank's once every relay has forwarded (a relay forwards inside its own receive, so
//! with several relays do not wait for `a2e_ready` on a relay before calling its receive).
//!
//! # What a failed call leaves
//! - An error before the call published anything to a peer (bad arguments, wrong role or
//!   dtype, a call past `max_in_flight`, a timeout while waiting for a buffer to be free or for
//!   the first rows to arrive) changes nothing: fix the cause and call again; handles and
//!   batches stay valid.
//! - Any error after the call published something, and any peer failure, abort or protocol
//!   violation, **poisons** the communicator: the job is aborted (every peer's waits fail within
//!   a few milliseconds with [`Error::Aborted`] naming this rank and the reason), and every later
//!   call on this communicator returns the first error again.
//! - A view receive ([`Communicator::a2e_recv_view`]) takes its call once every source's rows
//!   are in: a failure after that (a read of rows not mapped here timing out) poisons, since no
//!   later receive sees that call again and nobody else can reply to it.
//! - A panic inside a call (in the library, or in a user's callback it runs, such as
//!   `on_arrival`) poisons the communicator and aborts the job naming this rank and the call,
//!   as any failure after publishing does; the panic then goes on unwinding to the caller.
//! - A call's E2A is checked whole before its first write: an E2A reply with a NaN or an
//!   infinity under INT8 is rejected with nothing sent (call again with finite rows).
//! - A live call given up on from outside (an [`A2eHandle`] dropped before its E2A receive, the
//!   last [`ExpertBatch`] or [`TokenBatch`] of a call dropped or refilled before its reply, a
//!   [`TokenView`] dropped unreplied) poisons the communicator and aborts the job at once, naming
//!   this rank and the epoch: the peers would otherwise wait for it until their deadline.
//!
//! # Shrink
//! After a peer failure the survivors can go on without restarting: every survivor calls
//! [`Communicator::shrink`], which agrees on the dead ranks through the bootstrap and builds a
//! new communicator over the survivors (module [`shrink`]).

use std::sync::Arc;
use std::time::Duration;

use crate::bootstrap::Exchange;
use crate::fabric::ascend::AscendFabric;
use crate::fabric::local::LocalFabric;
use crate::fabric::shm::ShmFabric;
use crate::fabric::{Capabilities, Fabric, Waiting};
use crate::moe::batch::{A2eHandle, ExpertBatch, TokenBatch};
use crate::moe::combine::{CombineReceiver, CombineSender, Replies};
use crate::moe::config::{MoeConfig, TransferMode};
use crate::moe::context::{CheckDue, Context};
use crate::moe::device_rows::OutRows;
use crate::moe::dispatch::{DispatchReceiver, DispatchSender};
use crate::moe::dtype::Element;
use crate::moe::progress::progress;
use crate::moe::slots::Slots;
use crate::moe::stats::Stats;
use crate::moe::view::{ViewParts, ViewRows};
use crate::moe::window_layout::{WindowLayout, HANDSHAKE_BYTES};
use crate::topology::{Role, Topology};
use crate::{Error, Result};

pub(crate) mod agree;
mod device;
pub use device::Routing;
pub mod shrink;
pub(crate) use shrink::Origin;
use shrink::ShrinkInfo;
pub use shrink::{ShrinkOptions, ShrinkStep};
mod view;
pub use view::TokenView;

const HANDSHAKE_MAGIC: u64 = u64::from_le_bytes(*b"XCCLHND2");
/// Words of the handshake: magic, topology fingerprint, world size, rank, then the config's
/// agreed fields.
const HANDSHAKE_WORDS: usize = 11;

/// Aborts a communicator's job from any thread: `Send + Sync`, obtained with
/// [`Communicator::abort_handle`], for a binding or a watchdog whose communicator is inside a
/// blocking call on another thread ([`Communicator::abort`] needs `&mut`).
///
/// [`AbortHandle::abort`] raises the fabric's abort flag: every rank's current and later waits
/// fail with [`Error::Aborted`] naming this rank and the reason, the blocked call on this rank
/// included (it fails and poisons the communicator, as any abort does), and the next call on
/// the communicator fails the same way. The handle does not keep the communicator's fabric
/// alive: once the communicator is dropped (or shrunk) it does nothing.
#[derive(Clone)]
pub struct AbortHandle {
    fabric: std::sync::Weak<dyn Fabric>,
}

impl AbortHandle {
    /// Aborts the job with `reason` (the first abort wins); returns `false` when the
    /// communicator is gone. Returns promptly (on libfabric after a bounded flush).
    pub fn abort(&self, reason: &str) -> bool {
        match self.fabric.upgrade() {
            Some(fabric) => {
                tracing::warn!(
                    rank = fabric.rank(),
                    reason,
                    "xccl: aborting the job (abort handle)"
                );
                fabric.abort(reason);
                true
            }
            None => false,
        }
    }

    /// The error the communicator's calls return once an abort (this rank's or a peer's) has
    /// reached this rank: [`Error::Aborted`], or [`Error::PeerFailed`] for an abort that reports
    /// a dead rank; `None` otherwise or when the communicator is gone.
    pub fn aborted(&self) -> Option<Error> {
        let fabric = self.fabric.upgrade()?;
        let notice = fabric.aborted()?;
        Some(notice.to_error(fabric.world_size()))
    }
}

impl std::fmt::Debug for AbortHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AbortHandle")
            .field("live", &(self.fabric.strong_count() > 0))
            .finish()
    }
}

/// Armed for the length of one call: dropped without [`UnwindGuard::finish`] (the call
/// unwound, from a panic in the library or in a user's callback run inside it), it poisons the
/// communicator and aborts the job naming this rank and the call, so the peers hear of it at
/// once rather than at their deadline, as the C ABI's calls do.
struct UnwindGuard<'a> {
    fabric: &'a dyn Fabric,
    poisoned: &'a mut Option<Error>,
    what: &'a str,
    finished: bool,
}

impl<'a> UnwindGuard<'a> {
    fn new(fabric: &'a dyn Fabric, poisoned: &'a mut Option<Error>, what: &'a str) -> Self {
        UnwindGuard {
            fabric,
            poisoned,
            what,
            finished: false,
        }
    }

    /// The call returned (with a result or an error): nothing to do.
    fn finish(mut self) {
        self.finished = true;
    }
}

impl Drop for UnwindGuard<'_> {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let rank = self.fabric.rank();
        let reason = format!("rank {rank}: panic inside {}", self.what);
        tracing::error!(
            rank,
            reason,
            "xccl: a call panicked; communicator poisoned, job aborted"
        );
        self.fabric.abort(&reason);
        self.poisoned
            .get_or_insert(Error::Aborted { by: rank, reason });
    }
}

/// The protocol state of one rank, by role.
enum Side {
    Attention {
        dispatch: DispatchSender,
        combine: CombineReceiver,
    },
    Expert {
        dispatch: DispatchReceiver,
        combine: CombineSender,
    },
}

/// One rank's communicator.
pub struct Communicator {
    ctx: Context,
    side: Side,
    /// The error that poisoned this communicator, returned by every later call.
    poisoned: Option<Error>,
    /// Generation of the last [`Communicator::barrier`].
    barrier_gen: u64,
    /// Counters of the last call, and of every call so far.
    last_stats: Stats,
    total_stats: Stats,
    /// A barrier is running: its waits are not MoE traffic and are not counted.
    in_barrier: bool,
    /// How the fabric was built (what a shrink builds the next one with).
    origin: Origin,
    /// Set on a communicator made by [`Communicator::shrink`].
    shrunk: Option<ShrinkInfo>,
}

/// The error for a call that relays do not support (nothing is written: the call may be
/// retried another way).
fn through_relays(ctx: &Context, what: &str) -> Result<()> {
    if ctx.topo.relay_plan().is_some() {
        return Err(Error::invalid(format!(
            "{what} is not supported through relays yet (relays take push transfers, \
             caller buffers, expert-major or token-major receives and replies in the dtype or INT8)"
        )));
    }
    Ok(())
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.ctx.rank)
            .field("role", &self.role())
            .field("fabric", &self.ctx.fabric.name())
            .field("poisoned", &self.poisoned)
            .finish()
    }
}

fn wrong_role(rank: usize, role: Role, call: &str) -> Error {
    let other = match role {
        Role::Attention => Role::Expert,
        Role::Expert => Role::Attention,
    };
    Error::WrongRole(format!(
        "{call} is for {other:?} ranks; rank {rank} is an {role:?} rank"
    ))
}

fn require_dtype<T: Element>(ctx: &Context) -> Result<()> {
    if T::DTYPE != ctx.cfg.dtype {
        return Err(Error::invalid(format!(
            "tensor dtype {} does not match the communicator's {}",
            T::DTYPE.name(),
            ctx.cfg.dtype.name()
        )));
    }
    Ok(())
}

/// E2A send of an expert rank through relays: its replies to every relay, then, on a relay, the
/// reduction and forwarding of its members' rows. Nothing is written before the checks pass.
/// Sends the E2A reply to call `epoch` through the relays when the topology has them, else
/// directly, then marks the call replied.
fn send_e2a(
    ctx: &Context,
    dispatch: &mut DispatchReceiver,
    combine: &mut CombineSender,
    epoch: u64,
    sources: &[crate::SourceInfo],
    mode: TransferMode,
    replies: Replies<'_>,
) -> Result<()> {
    if ctx.topo.relay_plan().is_some() {
        relayed_e2a(ctx, dispatch, combine, epoch, sources, mode, replies)?;
    } else {
        combine.send(ctx, epoch, sources, mode, replies, ctx.call_deadline())?;
    }
    dispatch.replied();
    Ok(())
}

fn relayed_e2a(
    ctx: &Context,
    dispatch: &mut DispatchReceiver,
    combine: &mut CombineSender,
    epoch: u64,
    sources: &[crate::SourceInfo],
    mode: TransferMode,
    replies: Replies<'_>,
) -> Result<()> {
    if mode == TransferMode::Pull {
        through_relays(ctx, "pull E2A")?;
    }
    let deadline = ctx.call_deadline();
    dispatch.release_relayed_e2a(ctx, deadline)?;
    let own = crate::moe::combine::own_replies_in_place(ctx, &replies);
    let send = |hook: &mut dyn FnMut() -> Result<()>| {
        combine.send_relayed(ctx, epoch, sources, replies, deadline, hook)
    };
    dispatch.relay_e2a(ctx, epoch, deadline, own.map(|rows| (rows, sources)), send)
}

fn check_len(what: &str, bytes: usize, rows: usize, payload: usize) -> Result<()> {
    if bytes != rows * payload {
        return Err(Error::invalid(format!(
            "{what} has {bytes} bytes; expected {rows} rows of {payload} bytes"
        )));
    }
    Ok(())
}

impl Communicator {
    /// Window size every rank's fabric must register, in rank order.
    pub fn window_lens(topo: &Topology, cfg: &MoeConfig) -> Result<Vec<usize>> {
        cfg.validate(topo)?;
        Ok(WindowLayout::new(topo, cfg).window_lens())
    }

    /// Per rank, the bytes of its window that the cuda fabric keeps in host memory: its
    /// handshake and records (`None` when the config does not fit the topology: init reports
    /// that).
    fn host_prefixes(topo: &Topology, cfg: &MoeConfig) -> Option<Vec<usize>> {
        cfg.validate(topo).ok()?;
        let layout = WindowLayout::new(topo, cfg);
        Some(
            (0..topo.world_size())
                .map(|r| layout.record_area_end(topo.role(r)))
                .collect(),
        )
    }

    /// Window size the fabric of bootstrap rank `rank` must register.
    fn own_window_len(rank: usize, topo: &Topology, cfg: &MoeConfig) -> Result<usize> {
        let lens = Self::window_lens(topo, cfg)?;
        lens.get(rank).copied().ok_or_else(|| {
            Error::invalid(format!(
                "bootstrap rank {rank} is outside the topology's {} ranks",
                lens.len()
            ))
        })
    }

    /// Signal slots every rank's fabric must have.
    pub fn signal_slots(topo: &Topology) -> usize {
        Slots::new(topo.world_size()).count()
    }

    /// Builds this rank's communicator on an initialised fabric. Collective: every rank calls it.
    /// The safe constructors ([`Communicator::init_shm`], [`Communicator::init_ofi`],
    /// [`Communicator::init_ascend`], [`Communicator::local_group`]) build the fabric themselves.
    ///
    /// Fails if the fabric's windows are too small, or if any peer was given a different
    /// topology or config (naming that peer, the field and both values).
    ///
    /// # Safety
    /// The communicator lends ranges of the windows out as slices (`a2e_input`, a view's reply):
    /// for as long as it lives, nothing in this process may use `fabric`'s windows except the
    /// communicators of this job — no other handle to `fabric` (a forwarding fabric's clone of
    /// its inner one) may put, get or borrow a window, nor may another endpoint of the same
    /// in-process world outside a communicator. `fabric` itself keeps the [`Fabric`] contract.
    pub unsafe fn new(
        fabric: Box<dyn Fabric>,
        topo: Arc<Topology>,
        cfg: MoeConfig,
    ) -> Result<Self> {
        Self::from_fabric(fabric, topo, cfg)
    }

    /// [`Communicator::new`] for the crate's own fabrics, which nothing else in the process uses
    /// (the C ABI's forwarding fabric keeps a clone only to abort).
    pub(crate) fn from_fabric(
        fabric: Box<dyn Fabric>,
        topo: Arc<Topology>,
        cfg: MoeConfig,
    ) -> Result<Self> {
        let ctx = Context::new(fabric, topo, cfg)?;
        let base = ctx.cfg.epoch_base;
        let side = match ctx.topo.role(ctx.rank) {
            Role::Attention => Side::Attention {
                dispatch: DispatchSender::new(base),
                combine: CombineReceiver::default(),
            },
            Role::Expert => Side::Expert {
                dispatch: DispatchReceiver::new(base),
                combine: CombineSender::default(),
            },
        };
        let comm = Communicator {
            ctx,
            side,
            poisoned: None,
            barrier_gen: 0,
            last_stats: Stats::default(),
            total_stats: Stats::default(),
            in_barrier: false,
            origin: Origin::Fabric,
            shrunk: None,
        };
        comm.init_slots()?;
        comm.handshake()?;
        tracing::info!(
            rank = comm.ctx.rank,
            role = ?comm.role(),
            fabric = comm.ctx.fabric.name(),
            world = comm.ctx.topo.world_size(),
            attention = comm.ctx.attention().len(),
            experts = comm.ctx.experts().len(),
            window_bytes = comm.ctx.layout.window_len(comm.ctx.rank),
            hidden = comm.ctx.cfg.hidden,
            dtype = comm.ctx.cfg.dtype.name(),
            topk = comm.ctx.cfg.topk,
            max_tokens = comm.ctx.cfg.max_tokens_per_rank,
            max_in_flight = comm.ctx.cfg.max_in_flight,
            "xccl communicator ready"
        );
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
        let origin = Origin::Shm(exchange.clone());
        Self::init_agreed(&exchange, topo, cfg, origin, &|len, slots| {
            Ok(Box::new(ShmFabric::new(exchange.clone(), len, slots)?))
        })
    }

    /// Init over a bootstrap: the agreement round first ([`agree`]: every field that must be
    /// equal compared by name on every rank, a rank's invalid config reported to all), then the
    /// fabric from `fabric(window_len, signal_slots)` and the communicator. A failure of this
    /// rank's own after the agreement (not one naming a peer) is broadcast as an abort naming
    /// this rank and its reason, so no peer waits for it until its timeout.
    pub(crate) fn init_agreed(
        exchange: &Arc<dyn Exchange>,
        topo: Arc<Topology>,
        cfg: MoeConfig,
        origin: Origin,
        fabric: &dyn Fn(usize, usize) -> Result<Box<dyn Fabric>>,
    ) -> Result<Self> {
        let rank = exchange.rank();
        let timeout = cfg.timeout.max(Duration::from_secs(10));
        let len = match Self::own_window_len(rank, &topo, &cfg) {
            Ok(len) => len,
            Err(e) => {
                agree::report_failure(&**exchange, &e.to_string(), timeout);
                return Err(e);
            }
        };
        agree::agree(&**exchange, &topo, &cfg, timeout)?;
        let built =
            fabric(len, Self::signal_slots(&topo)).and_then(|f| Self::from_fabric(f, topo, cfg));
        match built {
            Ok(mut comm) => {
                comm.origin = origin;
                Ok(comm)
            }
            Err(e) => {
                // A death seen during init is reported as that death, with the dead rank in the
                // abort record (every survivor names it, whichever noticed first; a death
                // reported by a peer's abort arrives here as that death already). A failure of
                // this rank's own (its fabric could not open, a system error) is news to the
                // peers; a protocol error, a timeout or a bootstrap failure they see too, and an
                // abort received needs no echo.
                let reason = match &e {
                    Error::PeerFailed { .. } => Some(e.abort_reason(rank)),
                    Error::Aborted { .. }
                    | Error::Protocol { .. }
                    | Error::Timeout { .. }
                    | Error::Bootstrap(_) => None,
                    other => Some(format!("rank {rank}'s init failed: {other}")),
                };
                if let Some(reason) = reason {
                    let _ = exchange.broadcast_abort_reporting(e.dead_rank(rank), &reason);
                }
                Err(e)
            }
        }
    }

    /// Joins a job over the libfabric fabric (`ofi`, ranks on any hosts): like
    /// [`Communicator::init_shm`], with the provider from `XCCL_OFI_PROVIDER` (default
    /// `tcp;ofi_rxm`) and the interface from `XCCL_OFI_ADDR` (default: the provider's first).
    pub fn init_ofi(
        exchange: Arc<dyn Exchange>,
        topo: Arc<Topology>,
        cfg: MoeConfig,
    ) -> Result<Self> {
        Self::init_ofi_with(
            exchange,
            topo,
            cfg,
            &crate::fabric::ofi::OfiOptions::default(),
        )
    }

    /// [`Communicator::init_ofi`] with explicit options (provider, interface, timeouts).
    pub fn init_ofi_with(
        exchange: Arc<dyn Exchange>,
        topo: Arc<Topology>,
        cfg: MoeConfig,
        opts: &crate::fabric::ofi::OfiOptions,
    ) -> Result<Self> {
        let origin = Origin::Ofi(exchange.clone(), opts.clone());
        Self::init_agreed(&exchange, topo, cfg, origin, &|len, slots| {
            let f =
                crate::fabric::ofi::OfiFabric::with_options(exchange.clone(), len, slots, opts)?;
            Ok(Box::new(f))
        })
    }

    /// Builds this rank's communicator over the Ascend fabric: its window in the device memory
    /// of NPU `device`, reached by its peers through IPC memory keys (see
    /// [`crate::fabric::ascend`]). Collective: every rank of `exchange` calls it with the same
    /// topology and config and its own device. Fails with [`Error::FabricUnavailable`] naming
    /// `libascendcl.so` and `ASCEND_HOME_PATH` where the CANN runtime is not installed. The
    /// window is device memory, so the protocol reaches it through `put`/`get` only.
    pub fn init_ascend(
        exchange: Arc<dyn Exchange>,
        topo: Arc<Topology>,
        cfg: MoeConfig,
        device: i32,
    ) -> Result<Self> {
        let origin = Origin::Ascend(exchange.clone(), device);
        Self::init_agreed(&exchange, topo, cfg, origin, &|len, slots| {
            Ok(Box::new(AscendFabric::new(
                exchange.clone(),
                len,
                slots,
                device,
            )?))
        })
    }

    /// Builds this rank's communicator over the cuda fabric: its window in the memory of GPU
    /// `device` (`None`: `rank % device count`), reached by its peers through CUDA IPC, the
    /// control area in host shared memory (see [`crate::fabric::cuda`]). Collective: every rank
    /// of `exchange` calls it with the same topology and config, one rank per process. Fails
    /// with [`Error::FabricUnavailable`] naming `libcuda.so.1` where there is no CUDA driver,
    /// or libnvrtc where the data plane's kernels cannot be compiled (every rank fails together,
    /// naming the rank). The host-buffer calls move rows through `put`/`get` on this fabric;
    /// the device-buffer calls ([`Communicator::a2e_send_device`] and the others) move them on
    /// the device.
    ///
    /// ```no_run
    /// # fn main() -> xccl::Result<()> {
    /// use std::sync::Arc;
    /// use xccl::cuda::{DeviceMemory, Stream};
    /// use xccl::{Communicator, DType, MoeConfig, Routing, Topology};
    /// # let exchange: Arc<dyn xccl::bootstrap::Exchange> = unimplemented!();
    /// let topo = Arc::new(Topology::contiguous(1, 1, 8)?);
    /// let cfg = MoeConfig::new(7168, DType::BF16, 8, 128);
    /// // One rank per process; the window on GPU `rank % device count`.
    /// let mut comm = Communicator::init_cuda(exchange, topo, cfg, None)?;
    /// let device = comm.cuda_device().expect("a cuda communicator").clone();
    /// let stream = Stream::new(&device)?; // the caller's stream (torch's current one, in Python)
    /// let (tokens, row) = (128, 7168 * 2);
    /// let x = DeviceMemory::alloc(&device, tokens * row, || "x".into())?;
    /// let mut out = DeviceMemory::alloc(&device, tokens * row, || "out".into())?;
    /// let (idx, w) = (vec![0i32; tokens * 8], vec![0.125f32; tokens * 8]);
    /// let routing = Routing::Host { topk_idx: &idx, topk_weights: &w };
    /// let handle = comm.a2e_send_device(x.as_slice(), routing, &stream)?;
    /// comm.e2a_recv_device(&handle, out.as_slice_mut(), &stream)?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn init_cuda(
        exchange: Arc<dyn Exchange>,
        topo: Arc<Topology>,
        cfg: MoeConfig,
        device: Option<usize>,
    ) -> Result<Self> {
        let origin = Origin::Cuda(exchange.clone(), device);
        let prefix = Self::cuda_host_prefix(&topo, &cfg, exchange.rank());
        let comm = Self::init_agreed(&exchange, topo, cfg, origin, &|len, slots| {
            Ok(Box::new(Self::cuda_fabric(
                &exchange,
                (len, prefix),
                slots,
                device,
            )?))
        })?;
        comm.build_data_plane(&*exchange)
    }

    /// The bytes of bootstrap rank `rank`'s window the cuda fabric keeps in host memory: its
    /// handshake and records, so reading or writing one is a host copy (no device copy, no
    /// stream wait); the rows past them are device memory.
    /// Callers that build the fabric themselves pass it to
    /// [`crate::fabric::cuda::CudaFabric::with_host_prefix`] (as [`Communicator::init_cuda`]
    /// does); 0 keeps the records in device memory, correct but a device copy and a stream wait
    /// per record.
    pub fn cuda_host_prefix(topo: &Topology, cfg: &MoeConfig, rank: usize) -> usize {
        Self::host_prefixes(topo, cfg)
            .and_then(|p| p.get(rank).copied())
            .unwrap_or(0)
    }

    /// This rank's cuda fabric with a window of `len` bytes, the first `prefix` in host memory.
    pub(crate) fn cuda_fabric(
        exchange: &Arc<dyn Exchange>,
        (len, prefix): (usize, usize),
        slots: usize,
        device: Option<usize>,
    ) -> Result<crate::fabric::cuda::CudaFabric> {
        crate::fabric::cuda::CudaFabric::with_host_prefix(
            exchange.clone(),
            (len, prefix.min(len)),
            slots,
            device,
            crate::fabric::cuda::DEFAULT_INIT_TIMEOUT,
        )
    }

    /// Builds the data plane of the device-buffer calls (NVRTC's kernels, loaded) on a new
    /// cuda communicator, collectively: a rank that cannot build it makes every rank fail now,
    /// naming it.
    pub(crate) fn build_data_plane(self, exchange: &dyn Exchange) -> Result<Self> {
        let plane = self.ctx.device_rows().map(drop);
        let timeout = crate::fabric::cuda::DEFAULT_INIT_TIMEOUT;
        let step = "build its data plane (kernels compiled by NVRTC)";
        crate::fabric::gather_outcomes(exchange, &plane, timeout, step)?;
        plane?;
        Ok(self)
    }

    /// Builds a whole job of ranks as threads of this process over the `local` fabric; returns
    /// one communicator per rank, in rank order (move each to its own thread).
    pub fn local_group(topo: &Topology, cfg: &MoeConfig) -> Result<Vec<Communicator>> {
        let lens = Self::window_lens(topo, cfg)?;
        let fabrics = LocalFabric::group(&lens, Self::signal_slots(topo))?;
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
        let fabrics = LocalFabric::group_with(&lens, Self::signal_slots(topo), caps)?;
        Self::init_group(fabrics, topo, cfg)
    }

    /// Builds a whole job of ranks as threads of this process over the cuda fabric's threads
    /// mode ([`crate::fabric::cuda::CudaFabric::local_group`]: every window in device memory
    /// of `device`, `None`: rank `r` on `r % device count`), for runtimes that refuse CUDA IPC
    /// between processes; with each rank's data plane built. Returns one communicator per rank,
    /// in rank order (move each to its own thread). Shrink needs a bootstrap: not in this mode.
    pub fn local_group_cuda(
        topo: &Topology,
        cfg: &MoeConfig,
        device: Option<usize>,
    ) -> Result<Vec<Communicator>> {
        let lens = Self::window_lens(topo, cfg)?;
        let slots = Self::signal_slots(topo);
        let prefixes = Self::host_prefixes(topo, cfg).unwrap_or_else(|| vec![0; lens.len()]);
        let fabrics =
            crate::fabric::cuda::CudaFabric::local_group(&lens, &prefixes, slots, device)?;
        let comms = Self::init_group(fabrics, topo, cfg)?;
        for comm in &comms {
            comm.ctx.device_rows().map(drop)?;
        }
        Ok(comms)
    }

    fn init_group<F: Fabric + 'static>(
        fabrics: Vec<F>,
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
                    s.spawn(move || Communicator::from_fabric(Box::new(f), topo, cfg))
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

    /// Sets this rank's progress slots to "epoch `epoch_base` complete", so the first call's
    /// progress compares correctly whatever the base (peers signal only after the handshake).
    fn init_slots(&self) -> Result<()> {
        let ctx = &self.ctx;
        let start = progress(ctx.cfg.epoch_base, 0);
        for r in 0..ctx.topo.world_size() {
            ctx.fabric.signal(ctx.rank, ctx.slots.a2e_ready(r), start)?;
            ctx.fabric.signal(ctx.rank, ctx.slots.e2a_ready(r), start)?;
        }
        Ok(())
    }

    fn handshake_words(&self) -> [u64; HANDSHAKE_WORDS] {
        let ctx = &self.ctx;
        let mut w = [0u64; HANDSHAKE_WORDS];
        w[0] = HANDSHAKE_MAGIC;
        w[1] = ctx.topo.fingerprint();
        w[2] = ctx.topo.world_size() as u64;
        w[3] = ctx.rank as u64;
        for (i, (_, v)) in ctx.cfg.agreed_fields().iter().enumerate() {
            w[4 + i] = *v;
        }
        w
    }

    /// Publishes this rank's topology and config in its window and checks every peer's, naming
    /// the first field that differs and both values.
    fn handshake(&self) -> Result<()> {
        let ctx = &self.ctx;
        let mine = self.handshake_words();
        const { assert!(8 * HANDSHAKE_WORDS <= HANDSHAKE_BYTES) };
        ctx.fabric.put(ctx.rank, 0, bytemuck::cast_slice(&mine))?;
        fault_point!("init.handshake");
        ctx.fabric.barrier(ctx.cfg.timeout)?;
        let mut theirs = [0u64; HANDSHAKE_WORDS];
        for peer in 0..ctx.topo.world_size() {
            ctx.fabric
                .get(peer, 0, bytemuck::cast_slice_mut(&mut theirs))?;
            let differs = |what: String| Error::Protocol {
                peer,
                detail: format!("rank {peer} was initialised with {what}"),
            };
            if theirs[0] != HANDSHAKE_MAGIC {
                return Err(differs(
                    "no handshake (not an xccl communicator of this version)".into(),
                ));
            }
            if theirs[1] != mine[1] {
                return Err(differs(
                    "a different topology (roles, expert placement or replicas)".into(),
                ));
            }
            if theirs[2] != mine[2] || theirs[3] != peer as u64 {
                return Err(differs(format!(
                    "world size {} and rank {}; here world size {} and rank {peer} expected",
                    theirs[2], theirs[3], mine[2]
                )));
            }
            let fields = ctx.cfg.agreed_fields();
            if let Some(i) = (0..fields.len()).find(|&i| theirs[4 + i] != mine[4 + i]) {
                let show = |v: u64| match fields[i].0 {
                    "dtype" => [crate::DType::F32, crate::DType::F16, crate::DType::BF16]
                        .into_iter()
                        .find(|d| *d as u64 == v)
                        .map_or(v.to_string(), |d| d.name().to_string()),
                    _ => v.to_string(),
                };
                return Err(differs(format!(
                    "{} = {}, this rank (rank {}) has {} = {}",
                    fields[i].0,
                    show(theirs[4 + i]),
                    ctx.rank,
                    fields[i].0,
                    show(mine[4 + i])
                )));
            }
        }
        ctx.fabric.barrier(ctx.cfg.timeout)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.ctx.rank
    }

    /// This rank's role.
    pub fn role(&self) -> Role {
        self.ctx.topo.role(self.ctx.rank)
    }

    /// The topology.
    pub fn topology(&self) -> &Topology {
        &self.ctx.topo
    }

    /// The MoE config.
    pub fn config(&self) -> &MoeConfig {
        &self.ctx.cfg
    }

    /// Name of the fabric underneath (`"shm"`, `"local"`, ...).
    pub fn fabric_name(&self) -> &'static str {
        self.ctx.fabric.name()
    }

    /// What the fabric underneath does cheaply.
    pub fn capabilities(&self) -> Capabilities {
        self.ctx.fabric.capabilities()
    }

    /// Window bytes this rank registered for the protocol.
    pub fn window_bytes(&self) -> usize {
        self.ctx.layout.window_len(self.ctx.rank)
    }

    /// The protocol context (views read their rows through it; the crate's tests look inside).
    pub(crate) fn ctx(&self) -> &Context {
        &self.ctx
    }

    /// The error that poisoned this communicator, if one did.
    pub fn poisoned(&self) -> Option<&Error> {
        self.poisoned.as_ref()
    }

    /// Changes the default transfer mode for later calls. Each sender picks per call; receivers
    /// follow what the record says, so ranks need not agree.
    pub fn set_mode(&mut self, mode: TransferMode) {
        self.ctx.cfg.mode = mode;
    }

    /// Changes how later A2E sends of this rank put rows on the wire (the receivers follow each
    /// record, so ranks need not agree).
    pub fn set_a2e_quant(&mut self, quant: crate::moe::quant::Quant) {
        self.ctx.cfg.a2e_quant = quant;
    }

    /// Changes how later E2A sends of this rank put reply rows on the wire.
    pub fn set_e2a_quant(&mut self, quant: crate::moe::quant::Quant) {
        self.ctx.cfg.e2a_quant = quant;
    }

    /// Installs (or, with `None`, removes) a check that every wait of later calls polls at least
    /// every 20 ms while it waits for a peer: when it returns `true` the wait stops and the call
    /// fails with [`Error::Interrupted`], with the usual failed-call state (retryable if the call
    /// had published nothing, else this communicator is poisoned and the job aborted). Bindings
    /// use it to deliver Ctrl-C to a blocked call; the check must be cheap and must not call
    /// into this communicator.
    pub fn set_interrupt_check(&mut self, check: Option<Arc<dyn Fn() -> bool + Send + Sync>>) {
        self.ctx.interrupt = check;
    }

    /// Changes the deadline of later calls (a whole call shares one deadline).
    pub fn set_timeout(&mut self, timeout: Duration) -> Result<()> {
        crate::moe::config::check_timeout(timeout)?;
        self.ctx.cfg.timeout = timeout;
        Ok(())
    }

    /// Runs `f` on this communicator with no call deadline (a year away), then restores the
    /// configured timeout: for a serving loop's idle receive, which waits for requests as long
    /// as its peers live. The waits inside still check the peers they wait for, so they end
    /// when one of them dies or leaves the job ([`Error::PeerFailed`] naming it), when the job
    /// is aborted, or when the interrupt check fires; never with [`Error::Timeout`].
    ///
    /// ```no_run
    /// # fn serve(comm: &mut xccl::Communicator) -> xccl::Result<()> {
    /// let mut batch = xccl::ExpertBatch::default();
    /// comm.without_deadline(|c| c.a2e_recv(&mut batch))?;
    /// # Ok(()) }
    /// ```
    pub fn without_deadline<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let timeout = self.ctx.cfg.timeout;
        // `deadline_after` saturates a deadline past the clock's range to a year from now.
        self.ctx.cfg.timeout = Duration::MAX;
        let r = f(self);
        self.ctx.cfg.timeout = timeout;
        r
    }

    /// Metadata records one A2E call writes in the whole job, by formula: one per (attention,
    /// expert) pair, or with relays one per attention rank plus one per (relay, expert rank);
    /// with DP domains only the largest domain's attention ranks count.
    /// [`Communicator::total_stats`] counts the records actually written.
    pub fn a2e_records_per_call(&self) -> usize {
        let (m, n) = (self.ctx.topo.max_domain_size(), self.ctx.experts().len());
        match self.ctx.topo.relay_plan() {
            Some(plan) => plan.records_per_call(m, n),
            None => m * n,
        }
    }

    /// What the last call on this communicator counted (records, rows, bytes and time waited
    /// per peer, relay forwards); a failed call's counts too. Barriers are not counted.
    pub fn last_call_stats(&self) -> &Stats {
        &self.last_stats
    }

    /// What every call on this communicator counted, added up.
    pub fn total_stats(&self) -> &Stats {
        &self.total_stats
    }

    /// Counters of this rank's waits since its fabric endpoint was made (spin polls, yields,
    /// sleeps) and the estimates the wait policy adapts to (`xccl::fabric::WaitState`); take
    /// the difference of two readings ([`crate::fabric::WaitCounters::since`]) for the calls
    /// between them.
    pub fn wait_counters(&self) -> crate::fabric::WaitCounters {
        self.ctx.fabric.wait_counters()
    }

    /// Clears the totals of [`Communicator::total_stats`].
    pub fn reset_stats(&mut self) {
        self.total_stats = Stats::default();
    }

    /// Aborts the job with `reason`: every rank's current and future waits fail with
    /// [`Error::Aborted`] naming this rank and carrying the reason; this communicator is
    /// poisoned. Returns promptly; callable while another thread of the job is blocked. The
    /// abort reports no death, whatever `reason` says: no rank takes it for a failure of
    /// another ([`crate::AbortNotice`]).
    pub fn abort(&mut self, reason: &str) {
        tracing::warn!(rank = self.ctx.rank, reason, "xccl: aborting the job");
        self.ctx.fabric.abort_reporting(None, reason);
        self.poisoned.get_or_insert(Error::Aborted {
            by: self.ctx.rank,
            reason: reason.to_string(),
        });
    }

    /// Leaves the job now, as dropping the communicator does, but keeps this rank's windows
    /// mapped until it is dropped: for a binding whose buffers (the registered A2E input) still
    /// point into them. Peers see this rank's departure at once (on fabrics that mark it
    /// early, [`Fabric::leave`]; the others mark it on drop), and every later call of this
    /// communicator fails.
    pub fn leave(&mut self) {
        self.ctx.fabric.leave();
        self.poisoned.get_or_insert(Error::invalid(
            "this communicator left the job (closed); its windows stay mapped while its buffers live",
        ));
    }

    /// Aborts the job because a live call was given up (a view dropped unreplied): like
    /// [`Communicator::abort`], but when the last call failed, the abort carries that failure
    /// first (and the death it reports), as a dropped handle's does (`AbortLink::abort`).
    pub(crate) fn abort_given_up(&mut self, reason: &str) {
        let cause = self
            .ctx
            .last_failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let Some((cause, dead)) = cause else {
            return self.abort(reason);
        };
        let reason = format!("{cause}; then {reason}");
        tracing::warn!(rank = self.ctx.rank, reason, "xccl: aborting the job");
        self.ctx.fabric.abort_reporting(dead, &reason);
        self.poisoned.get_or_insert(Error::Aborted {
            by: self.ctx.rank,
            reason,
        });
    }

    /// A handle that aborts this communicator's job from any thread, also while a call of this
    /// communicator blocks on another thread (see [`AbortHandle`]).
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle {
            fabric: Arc::downgrade(&self.ctx.fabric),
        }
    }

    /// Runs one call named `what`: fails fast when poisoned, and gives a failed call its
    /// defined state (see the module docs); a panic inside it (a user's callback, such as
    /// `on_arrival`) poisons the communicator and aborts the job ([`UnwindGuard`]).
    fn call<R>(
        &mut self,
        what: &str,
        f: impl FnOnce(&Context, &mut Side) -> Result<R>,
    ) -> Result<R> {
        if let Some(e) = &self.poisoned {
            return Err(e.duplicate());
        }
        if let Some(notice) = self.ctx.fabric.aborted() {
            return Err(self.fail(notice.to_error(self.ctx.topo.world_size())));
        }
        self.ctx.begin_call();
        let guard = UnwindGuard::new(&*self.ctx.fabric, &mut self.poisoned, what);
        let result = f(&self.ctx, &mut self.side);
        guard.finish();
        if !self.in_barrier {
            self.last_stats.clone_from(&self.ctx.stats.borrow());
            self.total_stats.add(&self.last_stats);
        }
        match result {
            Ok(r) => {
                self.note_failure(None);
                Ok(r)
            }
            Err(e) => Err(self.fail(e)),
        }
    }

    /// Keeps what the last call failed with when it did not poison (`None`: it succeeded), for
    /// the abort a dropped handle or batch may raise next (`Context::last_failure`).
    fn note_failure(&self, failure: Option<(String, Option<usize>)>) {
        *self
            .ctx
            .last_failure
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = failure;
    }

    /// Fails a call that had published something with `e`, as the protocol does (for tests of
    /// what a poisoning looks like from outside, such as the C ABI's result codes).
    #[cfg(test)]
    pub(crate) fn fail_after_publishing(&mut self, e: Error) -> Error {
        self.ctx.begin_call();
        self.ctx.note_written(self.ctx.rank, 0);
        self.fail(e)
    }

    /// Runs a non-blocking look (`e2a_ready`, `a2e_ready`): like [`Communicator::call`] but
    /// publishes nothing and counts nothing in the stats.
    fn probe<R>(
        &mut self,
        what: &str,
        f: impl FnOnce(&Context, &mut Side) -> Result<R>,
    ) -> Result<R> {
        if let Some(e) = &self.poisoned {
            return Err(e.duplicate());
        }
        if let Some(notice) = self.ctx.fabric.aborted() {
            return Err(self.fail(notice.to_error(self.ctx.topo.world_size())));
        }
        // Nothing of this look is a call: the last call's counters were copied already.
        self.ctx.begin_call();
        let guard = UnwindGuard::new(&*self.ctx.fabric, &mut self.poisoned, what);
        let result = f(&self.ctx, &mut self.side);
        guard.finish();
        result.map_err(|e| self.fail(e))
    }

    /// Poisons the communicator with `e` when the failed call left a state that cannot be
    /// retried; returns `e` either way.
    fn fail(&mut self, e: Error) -> Error {
        let e = self.first_failure(e);
        let fatal = matches!(
            e,
            Error::PeerFailed { .. }
                | Error::Aborted { .. }
                | Error::Protocol { .. }
                | Error::OutOfWindow { .. }
                | Error::Os { .. }
        );
        if fatal || self.ctx.has_published() {
            tracing::error!(rank = self.ctx.rank, error = %e, "xccl: call failed; communicator poisoned, job aborted");
            let me = self.ctx.rank;
            // An abort another rank raised is passed on as it is (its sender, death report and
            // reason), so that a rank its sender has not reached yet (or never will, having
            // heard of it only out of band) hears the same record first, never this rank's
            // account of it. Any other failure is this rank's own abort.
            let received = match (self.ctx.fabric.aborted(), &e) {
                (Some(n), _) if n.by != me => Some(n),
                (None, Error::Aborted { by, reason }) if *by != me => {
                    Some(crate::AbortNotice::raised_by(*by, reason.clone()))
                }
                _ => None,
            };
            match received {
                Some(notice) => self.ctx.fabric.forward_abort(&notice),
                None => self
                    .ctx
                    .fabric
                    .abort_reporting(e.dead_rank(me), &e.abort_reason(me)),
            }
            self.poisoned = Some(e.duplicate());
        } else {
            if matches!(e, Error::Timeout { .. }) {
                tracing::warn!(rank = self.ctx.rank, error = %e, "xccl: call timed out before publishing; it may be retried");
            }
            let me = self.ctx.rank;
            self.note_failure(Some((e.abort_reason(me), e.dead_rank(me))));
        }
        e
    }

    /// The failure to report for a call that failed with `e`: a peer failure or timeout seen
    /// after another rank aborted the job is reported as that abort, or as the death its record
    /// reports ([`crate::AbortNotice::to_error`]). The aborting rank may have left the job
    /// since, and a wait that finds it gone must not blame it: every rank names the first
    /// failure.
    pub(crate) fn first_failure(&self, e: Error) -> Error {
        let Some(notice) = self.ctx.fabric.aborted() else {
            return e;
        };
        if notice.by == self.ctx.rank
            || !matches!(e, Error::PeerFailed { .. } | Error::Timeout { .. })
        {
            return e;
        }
        match notice.to_error(self.ctx.topo.world_size()) {
            // This rank saw the same death itself: keep its own account of it.
            Error::PeerFailed { peer, .. } if matches!(e, Error::PeerFailed { peer: p, .. } if p == peer) => {
                e
            }
            abort => abort,
        }
    }

    /// Waits for every rank (collective), through the fabric's signals: on shared memory a
    /// release reaches every rank within microseconds. Fails naming the first rank that has not
    /// arrived.
    pub fn barrier(&mut self) -> Result<()> {
        self.barrier_gen += 1;
        let generation = self.barrier_gen;
        self.in_barrier = true;
        let r = self.barrier_call(generation);
        self.in_barrier = false;
        r
    }

    fn barrier_call(&mut self, generation: u64) -> Result<()> {
        self.call("barrier", |ctx, _| {
            let world = ctx.topo.world_size();
            for step in 1..world {
                let peer = (ctx.rank + step) % world;
                ctx.signal(peer, ctx.slots.barrier(ctx.rank), generation)?;
            }
            // Checked at the first miss, as before.
            let mut next = CheckDue::now();
            let mut failure = None;
            let arrived = |p: usize| ctx.slot_value(ctx.slots.barrier(p)) >= generation;
            ctx.wait(ctx.call_deadline(), &mut || {
                let missing = || (0..world).filter(|&p| p != ctx.rank && !arrived(p));
                let peer = missing().next()?;
                // A peer that arrived and left between the look at its slot and the liveness
                // check (it saw everyone, returned and dropped its communicator) is not a
                // failure: its slot is looked at again after the check.
                if let Err(e) = ctx.check_awaited_again(missing(), &mut next, &|p| !arrived(p)) {
                    failure = Some(e);
                    return None;
                }
                Some(Waiting::on(peer, "barrier"))
            })?;
            failure.map_or(Ok(()), Err)
        })
    }

    fn attention<R>(
        &mut self,
        call: &str,
        f: impl FnOnce(&Context, &mut DispatchSender, &mut CombineReceiver) -> Result<R>,
    ) -> Result<R> {
        let rank = self.ctx.rank;
        self.call(call, |ctx, side| match side {
            Side::Attention { dispatch, combine } => f(ctx, dispatch, combine),
            Side::Expert { .. } => Err(wrong_role(rank, Role::Expert, call)),
        })
    }

    /// Runs an expert rank's call `call` with its failure state (see the module docs); a view
    /// replies through it.
    pub(crate) fn expert<R>(
        &mut self,
        call: &str,
        f: impl FnOnce(&Context, &mut DispatchReceiver, &mut CombineSender) -> Result<R>,
    ) -> Result<R> {
        let rank = self.ctx.rank;
        self.call(call, |ctx, side| match side {
            Side::Expert { dispatch, combine } => f(ctx, dispatch, combine),
            Side::Attention { .. } => Err(wrong_role(rank, Role::Attention, call)),
        })
    }

    /// A2E on an attention rank: sends each token of `x` (`[T, hidden]`) to the expert ranks of
    /// its `topk_idx` (`[T, topk]`, `-1` = none) with `topk_weights` (`[T, topk]`, finite).
    ///
    /// Validates everything before anything is written to any peer. Returns the handle that
    /// [`Communicator::e2a_recv`] needs.
    pub fn a2e_send<T: Element>(
        &mut self,
        x: &[T],
        topk_idx: &[i32],
        topk_weights: &[f32],
    ) -> Result<A2eHandle> {
        let mode = self.ctx.cfg.mode;
        self.a2e_send_with(x, topk_idx, topk_weights, mode)
    }

    /// [`Communicator::a2e_send`] with an explicit transfer mode for this call.
    pub fn a2e_send_with<T: Element>(
        &mut self,
        x: &[T],
        topk_idx: &[i32],
        topk_weights: &[f32],
        mode: TransferMode,
    ) -> Result<A2eHandle> {
        if T::DTYPE != self.ctx.cfg.dtype {
            return Err(Error::invalid(format!(
                "tensor dtype {} does not match the communicator's {}",
                T::DTYPE.name(),
                self.ctx.cfg.dtype.name()
            )));
        }
        self.a2e_send_bytes(bytemuck::cast_slice(x), topk_idx, topk_weights, mode)
    }

    /// [`Communicator::a2e_send_with`] on raw bytes of the communicator's dtype (for bindings
    /// that know the dtype only at run time).
    pub fn a2e_send_bytes(
        &mut self,
        x: &[u8],
        topk_idx: &[i32],
        topk_weights: &[f32],
        mode: TransferMode,
    ) -> Result<A2eHandle> {
        self.attention("A2E send", |ctx, dispatch, _| {
            if mode == TransferMode::Pull {
                through_relays(ctx, "pull A2E")?;
            }
            let deadline = ctx.call_deadline();
            dispatch.send(ctx, x, topk_idx, topk_weights, mode.into(), deadline)
        })
    }

    /// The registered A2E input of the next call: `[max_tokens_per_rank, hidden]` rows in this
    /// rank's window. Write token `t`'s hidden state into row `t` (ideally the layer that
    /// produces it writes there directly), then call [`Communicator::a2e_send_input`]: expert
    /// ranks read the rows from here, so the dispatch costs one copy in all instead of two.
    ///
    /// Waits until the buffer's previous use has been consumed everywhere; fails on fabrics
    /// whose windows this process cannot address (use [`Communicator::a2e_send`] there).
    pub fn a2e_input<T: Element>(&mut self) -> Result<&mut [T]> {
        self.attention("A2E input", |ctx, dispatch, _| {
            require_dtype::<T>(ctx)?;
            through_relays(ctx, "the registered A2E input")?;
            dispatch.prepare_input(ctx, ctx.call_deadline())
        })?;
        let Side::Attention { dispatch, .. } = &mut self.side else {
            unreachable!("checked by `attention`")
        };
        let bytes = dispatch.input(&self.ctx)?.ok_or_else(|| {
            Error::invalid(format!(
                "the {} fabric's window is not host-addressable: use a2e_send",
                self.ctx.fabric.name()
            ))
        })?;
        bytemuck::try_cast_slice_mut(bytes).map_err(|e| {
            Error::invalid(format!(
                "registered input is not aligned for {}: {e}",
                T::DTYPE.name()
            ))
        })
    }

    /// A2E send of the first `num_tokens` rows of the registered input
    /// ([`Communicator::a2e_input`], which must have been called for this call). On fabrics
    /// with load/store access only the routing metadata is written and expert ranks gather the
    /// rows from the input; elsewhere rows are staged for them to pull.
    pub fn a2e_send_input(
        &mut self,
        num_tokens: usize,
        topk_idx: &[i32],
        topk_weights: &[f32],
    ) -> Result<A2eHandle> {
        self.attention("A2E send", |ctx, dispatch, _| {
            through_relays(ctx, "the registered A2E input")?;
            let deadline = ctx.call_deadline();
            dispatch.send_input(ctx, num_tokens, topk_idx, topk_weights, deadline)
        })
    }

    /// E2A on an attention rank: receives the expert outputs of the tokens sent with `handle`
    /// and writes `out[t] = sum_k topk_weights[t,k] * expert_k(x[t])` (`[T, hidden]`), combined
    /// exactly as the protocol documents (f32 sums in a fixed order, bitwise reproducible; see
    /// `docs/guide.md`, "Exact results"). `handle` must be the oldest unanswered A2E of this
    /// communicator; a rejected handle stays valid.
    pub fn e2a_recv<T: Element>(&mut self, handle: &A2eHandle, out: &mut [T]) -> Result<()> {
        if T::DTYPE != self.ctx.cfg.dtype {
            return Err(Error::invalid(format!(
                "output dtype {} does not match the communicator's {}",
                T::DTYPE.name(),
                self.ctx.cfg.dtype.name()
            )));
        }
        self.e2a_recv_bytes(handle, bytemuck::cast_slice_mut(out))
    }

    /// [`Communicator::e2a_recv`] on raw bytes of the communicator's dtype.
    pub fn e2a_recv_bytes(&mut self, handle: &A2eHandle, out: &mut [u8]) -> Result<()> {
        self.attention("E2A receive", |ctx, dispatch, combine| {
            let sent = dispatch.oldest(ctx, handle)?;
            check_len("out", out.len(), sent.num_tokens, ctx.layout.e2a_stride)?;
            combine.recv(ctx, sent, OutRows::Host(out), ctx.call_deadline())?;
            dispatch.retire();
            handle.answered();
            Ok(())
        })
    }

    /// Whether the E2A of `handle` has fully arrived, without blocking (attention ranks):
    /// `Ok(true)` means every contribution has landed, so the next [`Communicator::e2a_recv`]
    /// of `handle` (any variant) returns without waiting for a peer. Errors follow
    /// [`Communicator::e2a_recv`]'s rules: a wrong handle changes nothing; a dead peer or an
    /// abort poisons the communicator. Polling counts nothing in the stats.
    pub fn e2a_ready(&mut self, handle: &A2eHandle) -> Result<bool> {
        self.probe("E2A test", |ctx, side| match side {
            Side::Attention { dispatch, .. } => {
                CombineReceiver::ready(ctx, dispatch.oldest(ctx, handle)?)
            }
            Side::Expert { .. } => Err(wrong_role(ctx.rank, Role::Expert, "E2A test")),
        })
    }

    /// Whether the next A2E receive has all its rows, without blocking (expert ranks):
    /// `Ok(true)` means the next [`Communicator::a2e_recv`] (any variant) returns without
    /// waiting for a peer (on a relay: its members' rows and the credits to forward them are
    /// in). Errors follow the receive's rules: a dead peer, an abort or a bad record poisons
    /// the communicator. Polling counts nothing in the stats.
    pub fn a2e_ready(&mut self) -> Result<bool> {
        self.probe("A2E test", |ctx, side| match side {
            Side::Expert { dispatch, .. } => dispatch.ready(ctx),
            Side::Attention { .. } => Err(wrong_role(ctx.rank, Role::Attention, "A2E test")),
        })
    }

    /// Sets the user tag this rank's next A2E call (any variant: [`Communicator::a2e_send`],
    /// [`Communicator::a2e_send_input`], ...) carries to every expert rank it reaches, also
    /// those it sends 0 rows to, and through relays. Expert ranks read it with
    /// [`crate::SourceInfo::tag`] (and the call's first source's with
    /// [`ExpertBatch::tag`], [`TokenBatch::tag`], [`TokenView::tag`]). The tag is consumed by
    /// the call that publishes; a call that fails before publishing keeps it. Default 0 (each
    /// call that set none carries 0). No effect on expert ranks.
    pub fn set_next_a2e_tag(&mut self, tag: u64) {
        if let Side::Attention { dispatch, .. } = &mut self.side {
            dispatch.set_tag(tag);
        }
    }

    /// A2E calls of this attention rank waiting for their E2A.
    pub fn a2e_in_flight(&self) -> usize {
        match &self.side {
            Side::Attention { dispatch, .. } => dispatch.in_flight(),
            Side::Expert { .. } => 0,
        }
    }

    /// Checks, without waiting and without changing any state (no poisoning, no abort), that
    /// no peer an unanswered call of this rank still needs is gone (died, or left the job by
    /// dropping its communicator): on an attention rank, every expert rank (or relay) whose
    /// E2A contribution to a call in flight has not landed; on an expert rank, every attention
    /// rank of a received call not yet replied to. The error names that peer and the call's
    /// epoch. A peer that left after answering every call this rank has open is not an error
    /// (the normal end of a job); the next call that needs it fails naming it. The C ABI's
    /// `xcclCommGetAsyncError` reports what this finds.
    pub fn check_open_calls(&self) -> Result<()> {
        let with_epoch = |e: Error, epoch: u64, what: &str| match e {
            Error::PeerFailed { peer, detail } => Error::PeerFailed {
                peer,
                detail: format!("{detail}; {what} of call epoch {epoch} needs it"),
            },
            e => e,
        };
        match &self.side {
            Side::Attention { dispatch, .. } => dispatch.unanswered().try_for_each(|sent| {
                CombineReceiver::ready(&self.ctx, sent)
                    .map(drop)
                    .map_err(|e| with_epoch(e, sent.epoch, "the E2A receive"))
            }),
            Side::Expert { dispatch, .. } => dispatch.unreplied().try_for_each(|epoch| {
                let all = self.ctx.attention();
                self.ctx.call_sources(epoch).iter().try_for_each(|&i| {
                    self.ctx
                        .fabric
                        .check_peer(all[i])
                        .map_err(|e| with_epoch(e, epoch, "the E2A reply"))
                })
            }),
        }
    }

    /// A2E receive on an expert rank: fills `batch` with this call's rows, grouped by local
    /// expert. Collective with every attention rank's A2E send.
    pub fn a2e_recv(&mut self, batch: &mut ExpertBatch) -> Result<()> {
        self.expert("A2E receive", |ctx, dispatch, _| {
            dispatch.recv_expert_major(ctx, batch, None, ctx.call_deadline())
        })
    }

    /// A2E receive, token-major: fills `batch` with one row per received token, source by
    /// source as they arrive, calling `on_arrival(batch, tokens)` with the new tokens' range
    /// after each source lands.
    pub fn a2e_recv_tokens(
        &mut self,
        batch: &mut TokenBatch,
        on_arrival: &mut dyn FnMut(&TokenBatch, std::ops::Range<usize>),
    ) -> Result<()> {
        self.expert("A2E receive", |ctx, dispatch, _| {
            dispatch.recv_tokens(ctx, batch, None, on_arrival, ctx.call_deadline())
        })
    }

    /// Keeps the buffers of a view that replied for the next view (expert ranks).
    pub(crate) fn keep_view_buffers(&mut self, parts: (ViewRows, TokenBatch)) {
        if let Side::Expert { dispatch, .. } = &mut self.side {
            *dispatch.spare_view = Some(parts);
        }
    }

    /// A2E receive without a copy: waits for every attention rank's rows of this call and
    /// returns a view over them where they lie. Reply with [`TokenView::e2a_send`].
    pub fn a2e_recv_view(&mut self) -> Result<TokenView<'_>> {
        let parts = self.expert("A2E receive", |ctx, dispatch, _| {
            through_relays(ctx, "the A2E view")?;
            ViewParts::receive(ctx, dispatch, ctx.call_deadline())
        })?;
        Ok(TokenView::new(self, parts))
    }

    /// E2A on an expert rank: `expert_out` holds one output row per row of `batch` (same
    /// layout); reduces each token's local experts with its gating weights and sends one row per
    /// token back to its attention rank.
    pub fn e2a_send<T: Element>(&mut self, batch: &ExpertBatch, expert_out: &[T]) -> Result<()> {
        let mode = self.ctx.cfg.mode;
        self.e2a_send_with(batch, expert_out, mode)
    }

    /// [`Communicator::e2a_send`] with an explicit transfer mode for this call.
    pub fn e2a_send_with<T: Element>(
        &mut self,
        batch: &ExpertBatch,
        expert_out: &[T],
        mode: TransferMode,
    ) -> Result<()> {
        self.expert("E2A send", |ctx, dispatch, combine| {
            require_dtype::<T>(ctx)?;
            dispatch.check_reply(ctx, batch.recv.comm, batch.recv.epoch)?;
            let out: &[u8] = bytemuck::cast_slice(expert_out);
            check_len(
                "expert output",
                out.len(),
                batch.num_rows(),
                ctx.layout.e2a_stride,
            )?;
            let replies = Replies::Reduce { batch, out };
            let (epoch, sources) = (batch.recv.epoch, batch.sources());
            send_e2a(ctx, dispatch, combine, epoch, sources, mode, replies)?;
            batch.recv.answered();
            Ok(())
        })
    }

    /// E2A send, token-major: `reduced` holds one row per token of `batch` (`[num_tokens,
    /// hidden]`), each already the gating-weighted sum over the token's local experts.
    pub fn e2a_send_tokens<T: Element>(&mut self, batch: &TokenBatch, reduced: &[T]) -> Result<()> {
        if T::DTYPE != self.ctx.cfg.dtype {
            return Err(Error::invalid(format!(
                "tensor dtype {} does not match the communicator's {}",
                T::DTYPE.name(),
                self.ctx.cfg.dtype.name()
            )));
        }
        let mode = self.ctx.cfg.mode;
        self.e2a_send_tokens_bytes(batch, bytemuck::cast_slice(reduced), mode)
    }

    /// [`Communicator::e2a_send_tokens`] on raw bytes with an explicit transfer mode.
    pub fn e2a_send_tokens_bytes(
        &mut self,
        batch: &TokenBatch,
        reduced: &[u8],
        mode: TransferMode,
    ) -> Result<()> {
        self.expert("E2A send", |ctx, dispatch, combine| {
            dispatch.check_reply(ctx, batch.recv.comm, batch.recv.epoch)?;
            check_len(
                "reduced",
                reduced.len(),
                batch.num_tokens(),
                ctx.layout.e2a_stride,
            )?;
            let replies = Replies::Tokens(reduced);
            let (epoch, sources) = (batch.recv.epoch, batch.sources());
            send_e2a(ctx, dispatch, combine, epoch, sources, mode, replies)?;
            batch.recv.answered();
            Ok(())
        })
    }

    /// The registered E2A output of `batch`'s reply: `[batch.num_tokens(), hidden]` rows in
    /// this rank's window, row `i` for the batch's token `i`. Compute each token's reduced
    /// expert output straight into it, then call [`Communicator::e2a_send_output`]: attention
    /// ranks read the rows from here, so the combine costs one copy in all instead of two.
    ///
    /// Waits until the buffer's previous use has been consumed everywhere.
    pub fn e2a_output<T: Element>(&mut self, batch: &TokenBatch) -> Result<&mut [T]> {
        let epoch = batch.recv.epoch;
        self.expert("E2A output", |ctx, dispatch, combine| {
            require_dtype::<T>(ctx)?;
            through_relays(ctx, "the registered E2A output")?;
            dispatch.check_reply(ctx, batch.recv.comm, epoch)?;
            combine.prepare_output(ctx, epoch, ctx.call_deadline())
        })?;
        let Side::Expert { combine, .. } = &mut self.side else {
            unreachable!("checked by `expert`")
        };
        let bytes = combine
            .output(&self.ctx, epoch, batch.num_tokens())?
            .ok_or_else(|| {
                Error::invalid(format!(
                    "the {} fabric's window is not host-addressable: use e2a_send_tokens",
                    self.ctx.fabric.name()
                ))
            })?;
        bytemuck::try_cast_slice_mut(bytes).map_err(|e| {
            Error::invalid(format!(
                "registered output is not aligned for {}: {e}",
                T::DTYPE.name()
            ))
        })
    }

    /// E2A send of the rows written into [`Communicator::e2a_output`] (which must have been
    /// called for this batch): only records and signals go out; attention ranks pull the rows.
    pub fn e2a_send_output(&mut self, batch: &TokenBatch) -> Result<()> {
        self.expert("E2A send", |ctx, dispatch, combine| {
            through_relays(ctx, "the registered E2A output")?;
            dispatch.check_reply(ctx, batch.recv.comm, batch.recv.epoch)?;
            if !combine.output_prepared(batch.recv.epoch) {
                return Err(Error::invalid(
                    "e2a_send_output needs e2a_output first, for this batch",
                ));
            }
            let deadline = ctx.call_deadline();
            let mode = TransferMode::Pull;
            combine.send(
                ctx,
                batch.recv.epoch,
                batch.sources(),
                mode,
                Replies::Staged,
                deadline,
            )?;
            // Given up only once sent: a send that failed before writing (a credit wait timing
            // out) keeps the prepared output, so the documented retry works.
            combine.take_output(batch.recv.epoch);
            dispatch.replied();
            batch.recv.answered();
            Ok(())
        })
    }

    /// The wire mode a registered-input A2E uses on this fabric (for reports).
    pub fn registered_input_mode(&self) -> &'static str {
        if self.ctx.fabric.capabilities().load_store {
            "gather"
        } else {
            "pull"
        }
    }
}
