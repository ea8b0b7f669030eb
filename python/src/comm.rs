//! [`PyComm`] (`xccl.Communicator`): one rank's communicator, and what its calls hand back
//! ([`PyA2eHandle`], [`PyExpertBatch`], [`PyTokenBatch`]).
//!
//! Every blocking call releases the GIL while it waits; the communicator's interrupt check
//! (`xccl::Communicator::set_interrupt_check`) takes the GIL back every 20 ms to run Python's
//! signal handlers, so Ctrl-C raises `KeyboardInterrupt` from a waiting call within about
//! 40 ms, leaving the documented state (retryable if the call had published nothing, else
//! poisoned and the job aborted: see `Communicator.poisoned`).
//!
//! On the `cuda` fabric the calls take CUDA tensors of the communicator's device (imported as
//! a DLPack consumer on the current stream, `crate::tensor`), call the Rust API's
//! device-buffer calls (`a2e_send_device`, `e2a_recv_device`, `a2e_recv_device`,
//! `e2a_send_device`, and token-major `a2e_recv_tokens_device`, `e2a_send_tokens_device`) on
//! that stream, and hand back device memory as CUDA [`Buffer`]s: E2A results own a
//! [`DeviceMemory`], a received batch's rows view the allocation it was received into
//! (recycled with the batch).

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, TryLockError};
use std::time::Duration;

use half::{bf16, f16};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList};
use xccl::bootstrap::{Exchange, LaunchEnv, TcpBootstrap};
use xccl::cuda::{Device, DeviceMemory, DeviceRegion, Stream};
use xccl::{Communicator, DType, DeviceSliceMut, ExpertBatch, Role, TokenBatch, Topology};

use crate::buffer::{Buffer, HostBytes, Owner};
use crate::errors::{invalid, panic_message, panicked, to_py};
use crate::tensor::{device_routing, expect_rows, topk_ids, CudaPlace, Elem, Place, Tensor};
use crate::topo::{parse_role, role_name, seconds, PyConfig, PyTopology};

/// A communicator shared by its Python object and the buffers over its window.
struct Shared {
    comm: Mutex<Communicator>,
    /// Set when a call panicked (a bug): every later call is refused.
    broken: AtomicBool,
    /// What the interrupt check caught (KeyboardInterrupt), raised when the call returns.
    pending: Arc<Mutex<Option<PyErr>>>,
}

impl Shared {
    /// Wraps `comm`, installing the interrupt check that runs Python's signal handlers.
    fn new(mut comm: Communicator) -> Arc<Shared> {
        let pending: Arc<Mutex<Option<PyErr>>> = Arc::default();
        let slot = pending.clone();
        comm.set_interrupt_check(Some(Arc::new(move || {
            Python::attach(|py| match py.check_signals() {
                Ok(()) => false,
                Err(e) => {
                    *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    true
                }
            })
        })));
        Arc::new(Shared {
            comm: Mutex::new(comm),
            broken: AtomicBool::new(false),
            pending,
        })
    }
}

impl Shared {
    /// Lets go of this reference to the communicator; when buffers over its registered input
    /// still hold it (they keep its window mapped), it leaves the job now
    /// (`Communicator::leave`) rather than when the last buffer goes. A call running on another
    /// thread holds it too: then nothing is done here, and the communicator leaves when that
    /// call's reference goes.
    fn release(me: Arc<Shared>) {
        if Arc::strong_count(&me) > 1 {
            if let Ok(mut c) = me.comm.try_lock() {
                c.leave();
            }
        }
        drop(me);
    }
}

/// Why a call could not start.
enum Busy {
    /// Another thread is inside a call on this communicator.
    InUse,
    /// A call panicked earlier (a bug): the communicator is unusable.
    Broken,
    /// This call panicked (a bug): the job was aborted; the payload says why.
    Panicked(Box<dyn std::any::Any + Send>),
}

/// Fixed facts of a communicator, kept outside its lock.
struct Info {
    rank: usize,
    world_size: usize,
    role: Role,
    local_experts: Vec<usize>,
    fabric: &'static str,
    dtype: DType,
    hidden: usize,
    topk: usize,
    max_tokens: usize,
    num_experts: usize,
    keep_int8: bool,
    /// The GPU of a communicator on the `cuda` fabric, whose memory its tensors are.
    cuda: Option<Device>,
    /// The config's timeout (bounds the device-to-host reads of the binding).
    timeout: Duration,
}

/// One rank's communicator (`xccl::Communicator`).
///
/// Make one with :meth:`Communicator.init` (unique id), :meth:`Communicator.from_env`
/// (torchrun, mpirun, srun, or ``XCCL_RANK``/``XCCL_SIZE``/``XCCL_ROOT``) or
/// :func:`xccl.init_from_process_group` (an existing ``torch.distributed`` group).
///
/// Attention ranks call :meth:`a2e_send` (or :meth:`a2e_input` + :meth:`a2e_send_input`) and
/// later :meth:`e2a_recv` with the handle; expert ranks receive with :meth:`a2e_recv`
/// (expert-major) or :meth:`a2e_recv_tokens` (token-major) and reply with :meth:`e2a_send` /
/// :meth:`e2a_send_tokens`. Every rank makes the same sequence of calls; at most
/// ``config.max_in_flight`` calls are between their A2E and their E2A.
///
/// A failed call raises an :class:`xccl.XcclError` and leaves a defined state: nothing
/// published and retryable (``e.retryable``), or the communicator poisoned
/// (``e.poisoned``, :attr:`poisoned`): the job is aborted and every later call raises the
/// first error again. Blocking calls release the GIL; Ctrl-C raises ``KeyboardInterrupt`` within
/// about 40 ms, with the same rule (init and shrink: see there). One call at a time: a call
/// while another thread is inside one raises ``XcclError``, except :meth:`abort`, which
/// another thread may call to end a blocked call.
///
/// Also a context manager: leaving the ``with`` block closes the communicator, and aborts the
/// job first when the block raised.
#[pyclass(frozen, module = "xccl", name = "Communicator")]
pub struct PyComm {
    shared: Mutex<Option<Arc<Shared>>>,
    /// Aborts the job from any thread, also while a call blocks on another one.
    abort: xccl::AbortHandle,
    /// Cleared when the registered input handed out last may no longer be exported.
    input_live: Mutex<Option<Arc<AtomicBool>>>,
    info: Info,
    /// Batches Python has let go of, reused by the next receive so that steady-state receives
    /// do not allocate (as the C ABI does).
    spares: Arc<Spares>,
    /// The last batches replied to, whose memory the next receive may take ([`Held`]).
    recycle: Recycle,
}

/// At most this many spare batches of each layout are kept.
const MAX_SPARES: usize = 4;

/// Batches returned by dropped [`PyExpertBatch`] and [`PyTokenBatch`] objects.
#[derive(Default)]
struct Spares {
    expert: Mutex<Vec<ExpertRows>>,
    token: Mutex<Vec<TokenRows>>,
}

impl Spares {
    fn take<B: Default>(pool: &Mutex<Vec<B>>) -> B {
        pool.lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .unwrap_or_default()
    }

    fn give<B>(pool: &Mutex<Vec<B>>, batch: B) {
        let mut pool = pool.lock().unwrap_or_else(|p| p.into_inner());
        if pool.len() < MAX_SPARES {
            pool.push(batch);
        }
    }

    /// [`Spares::give`] of a batch with device rows: of the spares' device rows (the largest
    /// part of a batch on the cuda fabric: `max_expert_rows` or `max_recv_tokens` rows), one
    /// allocation is kept.
    fn give_rows<B>(pool: &Mutex<Vec<WithRows<B>>>, mut batch: WithRows<B>) {
        let kept = pool
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|b| b.device.is_some());
        if kept {
            batch.device = None;
        }
        Spares::give(pool, batch);
    }
}

impl Drop for PyComm {
    fn drop(&mut self) {
        let shared = self
            .shared
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(shared) = shared {
            // Leaving the job waits (bounded) for the bootstrap root, which may be a thread of
            // this process that logs through Python: release the GIL meanwhile.
            Python::attach(|py| py.detach(move || Shared::release(shared)));
        }
    }
}

impl PyComm {
    fn wrap(comm: Communicator) -> PyComm {
        let cfg = comm.config();
        let rank = comm.rank();
        let topo = comm.topology();
        let info = Info {
            rank,
            world_size: topo.world_size(),
            role: comm.role(),
            local_experts: topo.local_experts(rank).to_vec(),
            fabric: comm.fabric_name(),
            dtype: cfg.dtype,
            hidden: cfg.hidden,
            topk: cfg.topk,
            max_tokens: cfg.max_tokens_per_rank,
            num_experts: topo.num_experts(),
            keep_int8: cfg.keep_int8,
            cuda: comm.cuda_device().cloned(),
            timeout: cfg.timeout,
        };
        PyComm {
            abort: comm.abort_handle(),
            shared: Mutex::new(Some(Shared::new(comm))),
            input_live: Mutex::new(None),
            info,
            spares: Arc::default(),
            recycle: Recycle::default(),
        }
    }

    fn shared(&self, py: Python<'_>) -> PyResult<Arc<Shared>> {
        self.shared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| invalid(py, "the communicator is closed"))
    }

    fn elem(&self) -> Elem {
        Elem::of_dtype(self.info.dtype)
    }

    /// Runs `f` on the communicator with the GIL released; maps its error (or the
    /// KeyboardInterrupt its interrupt check caught) to the Python exception.
    fn run<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Communicator) -> xccl::Result<R> + Send,
    ) -> PyResult<R> {
        let shared = self.shared(py)?;
        shared
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let abort = &self.abort;
        let rank = self.info.rank;
        let outcome = py.detach(|| {
            let mut comm = match shared.comm.try_lock() {
                Ok(_) if shared.broken.load(Ordering::Acquire) => return Err(Busy::Broken),
                Ok(c) => c,
                Err(TryLockError::WouldBlock) => return Err(Busy::InUse),
                Err(TryLockError::Poisoned(_)) => return Err(Busy::Broken),
            };
            // The panic boundary, as the C ABI's: a panic marks the communicator broken (every
            // later call is refused) and aborts the job at once, so that no peer waits for its
            // deadline.
            let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
                crate::testing::maybe_panic(crate::testing::Site::Call);
                f(&mut comm)
            }));
            match r {
                Ok(r) => Ok((r, comm.poisoned().is_some())),
                Err(payload) => {
                    abort.abort(&format!(
                        "rank {rank}: a call panicked ({}), a bug in xccl",
                        panic_message(payload.as_ref())
                    ));
                    shared.broken.store(true, Ordering::Release);
                    Err(Busy::Panicked(payload))
                }
            }
        });
        match outcome {
            Ok((Ok(v), _)) => Ok(v),
            Ok((Err(e), poisoned)) => {
                if matches!(e, xccl::Error::Interrupted { .. }) {
                    let caught = shared
                        .pending
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .take();
                    if let Some(k) = caught {
                        return Err(k);
                    }
                }
                Err(to_py(py, &e, poisoned))
            }
            Err(Busy::InUse) => Err(to_py(
                py,
                &xccl::Error::WrongRole(
                    "the communicator is inside a call on another thread (one call at a time)"
                        .into(),
                ),
                false,
            )),
            Err(Busy::Panicked(payload)) => Err(panicked(
                py,
                "a call",
                &panic_message(payload.as_ref()),
                true,
            )),
            Err(Busy::Broken) => Err(to_py(
                py,
                &xccl::Error::InvalidArgument(
                    "the communicator is unusable: an earlier call panicked (a bug in xccl)".into(),
                ),
                true,
            )),
        }
    }

    /// Takes the communicator out of this object (closing it), if nothing else holds it.
    fn take(&self, py: Python<'_>) -> PyResult<Communicator> {
        let mut guard = self.shared.lock().unwrap_or_else(|p| p.into_inner());
        let shared = guard
            .take()
            .ok_or_else(|| invalid(py, "the communicator is closed"))?;
        match Arc::try_unwrap(shared) {
            Ok(s) => Ok(s.comm.into_inner().unwrap_or_else(|p| p.into_inner())),
            Err(shared) => {
                *guard = Some(shared);
                Err(invalid(
                    py,
                    "buffers over this communicator's registered input (a2e_input) are still \
                     alive: delete them (and tensors made from them) first",
                ))
            }
        }
    }

    /// Marks the registered input handed out last as sent (no more exports).
    fn retire_input(&self) {
        if let Some(live) = self
            .input_live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            live.store(false, Ordering::Release);
        }
    }
}

/// How often a Python thread waiting for a helper thread ([`interruptible`]) runs Python's
/// signal handlers.
const SIGNAL_POLL: Duration = Duration::from_millis(20);

/// Where a blocking step on a helper thread leaves its result for the waiting Python thread.
enum Slot<R> {
    Waiting,
    /// The step's result, or the message of its panic (a bug).
    Done(Result<R, String>),
    /// The Python thread was interrupted and left: the helper hands its result to this.
    Abandoned(Box<dyn FnOnce(R) + Send>),
}

/// Runs `work` on a helper thread while this thread waits with the GIL released, running
/// Python's signal handlers every [`SIGNAL_POLL`], so that Ctrl-C reaches a wait the library
/// cannot interrupt itself (the bootstrap's rounds in init and shrink). When a handler raises
/// (KeyboardInterrupt), `interrupted` runs at once, the result `work` returns later goes to
/// `abandon` (on whichever thread has it), and the exception is raised here. A panic of `work`
/// (a bug) ends the wait with an `XcclError` saying so: the helper always hands over a result,
/// so this wait lasts as long as `work`, whose own waits are bounded.
fn interruptible<R: Send + 'static>(
    py: Python<'_>,
    what: &str,
    work: impl FnOnce() -> R + Send + 'static,
    interrupted: impl FnOnce() + Send,
    abandon: impl FnOnce(R) + Send + 'static,
) -> PyResult<R> {
    let hand = Arc::new((Mutex::new(Slot::<R>::Waiting), std::sync::Condvar::new()));
    let helper = hand.clone();
    std::thread::Builder::new()
        .name(format!("xccl-{what}"))
        .spawn(move || {
            let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
                crate::testing::maybe_panic(crate::testing::Site::Helper);
                work()
            }))
            .map_err(|p| panic_message(p.as_ref()));
            let (slot, cv) = &*helper;
            let mut slot = slot.lock().unwrap_or_else(|p| p.into_inner());
            match std::mem::replace(&mut *slot, Slot::Waiting) {
                Slot::Abandoned(f) => {
                    drop(slot);
                    if let Ok(r) = r {
                        f(r);
                    }
                }
                _ => {
                    *slot = Slot::Done(r);
                    cv.notify_all();
                }
            }
        })
        .map_err(|e| {
            to_py(
                py,
                &xccl::Error::os(format!("starting the {what} thread"), e),
                false,
            )
        })?;
    let take = |wait: Duration| {
        let (slot, cv) = &*hand;
        let slot = slot.lock().unwrap_or_else(|p| p.into_inner());
        let mut slot = cv
            .wait_timeout_while(slot, wait, |s| matches!(s, Slot::Waiting))
            .unwrap_or_else(|p| p.into_inner())
            .0;
        match std::mem::replace(&mut *slot, Slot::Waiting) {
            Slot::Done(r) => Ok(r),
            other => {
                *slot = other;
                Err(slot)
            }
        }
    };
    let done = |r: Result<R, String>| {
        r.map_err(|m| panicked(py, &format!("the {what} thread"), &m, false))
    };
    loop {
        if let Some(r) = py.detach(|| take(SIGNAL_POLL).ok()) {
            return done(r);
        }
        if let Err(e) = py.check_signals() {
            py.detach(|| {
                interrupted();
                match take(Duration::ZERO) {
                    Ok(Ok(r)) => abandon(r),
                    Ok(Err(_)) => {}
                    Err(mut slot) => *slot = Slot::Abandoned(Box::new(abandon)),
                }
            });
            return Err(e);
        }
    }
}

/// What becomes of a communicator an interrupted `call` (init, shrink) still builds: it aborts
/// its job, naming this rank, and is freed.
fn abort_abandoned(call: &'static str) -> impl FnOnce(xccl::Result<Communicator>) + Send {
    move |built| {
        if let Ok(mut c) = built {
            let reason = format!(
                "rank {} left the job: its {call} was interrupted (KeyboardInterrupt)",
                c.rank()
            );
            c.abort(&reason);
        }
    }
}

/// A join in progress, shared by the thread running it and the Python thread waiting for it:
/// an interrupted join aborts the job through the bootstrap as soon as there is one.
#[derive(Default)]
struct Joining {
    cancelled: bool,
    exchange: Option<Arc<dyn Exchange>>,
}

impl Joining {
    fn reason(exchange: &dyn Exchange) -> String {
        format!(
            "rank {} left the job: its init was interrupted (KeyboardInterrupt)",
            exchange.rank()
        )
    }

    /// The waiting thread was interrupted: tells the job if this rank has joined it.
    fn cancel(me: &Mutex<Joining>) {
        let exchange = {
            let mut j = me.lock().unwrap_or_else(|p| p.into_inner());
            j.cancelled = true;
            j.exchange.clone()
        };
        if let Some(x) = exchange {
            let _ = x.broadcast_abort(&Joining::reason(x.as_ref()));
        }
    }

    /// The join has its bootstrap: kept for [`Joining::cancel`], or, if the wait was
    /// interrupted already, the job is told and the join stops.
    fn publish(me: &Mutex<Joining>, exchange: &Arc<dyn Exchange>) -> xccl::Result<()> {
        let mut j = me.lock().unwrap_or_else(|p| p.into_inner());
        if !j.cancelled {
            j.exchange = Some(exchange.clone());
            return Ok(());
        }
        drop(j);
        let reason = Joining::reason(exchange.as_ref());
        let _ = exchange.broadcast_abort(&reason);
        Err(xccl::Error::Aborted {
            by: exchange.rank(),
            reason,
        })
    }
}

/// Joins the job on a helper thread ([`interruptible`]): `connect` makes the bootstrap, then
/// [`join`]. An interrupted join aborts the job (peers that joined see `AbortedError` naming
/// this rank) and a communicator it still builds is aborted and freed.
#[allow(clippy::too_many_arguments)]
fn join_interruptible(
    py: Python<'_>,
    connect: impl FnOnce() -> xccl::Result<TcpBootstrap> + Send + 'static,
    topology: Py<PyTopology>,
    cfg: xccl::MoeConfig,
    fabric: String,
    device: Option<i32>,
    role: Option<Role>,
    timeout: Duration,
) -> PyResult<PyComm> {
    let joining = Arc::new(Mutex::new(Joining::default()));
    let (mine, theirs) = (joining.clone(), joining);
    let comm = interruptible(
        py,
        "init",
        move || {
            let boot = connect()?;
            let exchange: Arc<dyn Exchange> = Arc::new(boot);
            Joining::publish(&mine, &exchange)?;
            join(
                exchange,
                topology.get(),
                cfg,
                &fabric,
                device,
                role,
                timeout,
            )
        },
        move || Joining::cancel(&theirs),
        abort_abandoned("init"),
    )?;
    comm.map(PyComm::wrap).map_err(|e| to_py(py, &e, false))
}

/// The rendezvous under torchrun, whose agent store already listens on `MASTER_PORT`
/// (`TORCHELASTIC_USE_AGENT_STORE=True`) unless `XCCL_ROOT` names another address: rank 0
/// starts the root on a port the OS picks, on `MASTER_ADDR`, and hands the port (not a secret)
/// to the other ranks through the agent store (`xccl._torchrun`); the key stays in each
/// rank's environment (`XCCL_JOB_KEY`), the job id is derived as for any launcher. Returns the
/// id to join with, this rank and the world size; `None` when not under torchrun's agent.
fn torchrun_root(
    py: Python<'_>,
    timeout: Duration,
) -> PyResult<Option<(xccl::bootstrap::UniqueId, usize, usize)>> {
    use xccl::bootstrap::{Launcher, RootConfig, UniqueId, ROOT_ENV};
    let set = |k: &str| std::env::var(k).is_ok_and(|v| !v.trim().is_empty());
    let agent = std::env::var("TORCHELASTIC_USE_AGENT_STORE").is_ok_and(|v| v == "True");
    if !agent || set(ROOT_ENV) {
        return Ok(None);
    }
    let env = match LaunchEnv::detect().map_err(|e| to_py(py, &e, false))? {
        Some(env) if env.launcher == Launcher::Torchrun => env,
        _ => return Ok(None),
    };
    let store = py.import("xccl._torchrun")?;
    let secs = timeout.as_secs_f64();
    let root = |port| std::net::SocketAddr::new(env.root.ip(), port);
    let id = if env.rank == 0 {
        let mut config = RootConfig::with_key(env.job_id, env.key.clone());
        config.size = Some(env.size);
        // The root runs detached until every rank has joined and left (or stays idle).
        let (id, _detached) = py
            .detach(|| UniqueId::start_root(root(0), config))
            .map_err(|e| to_py(py, &e, false))?;
        store.call_method1("publish_root_port", (id.root_addr().port(), secs))?;
        id
    } else {
        let port: u16 = store
            .call_method1("root_port", (env.rank, secs))?
            .extract()?;
        UniqueId::from_parts(env.job_id, &env.key, root(port))
    };
    Ok(Some((id, env.rank, env.size)))
}

/// Joins a job on `fabric` over `exchange`, with the topology built from gathered roles when
/// `role` is given.
fn join(
    exchange: Arc<dyn Exchange>,
    topology: &PyTopology,
    cfg: xccl::MoeConfig,
    fabric: &str,
    device: Option<i32>,
    role: Option<Role>,
    timeout: Duration,
) -> xccl::Result<Communicator> {
    let topo: Arc<Topology> = match role {
        None => topology.built.clone(),
        Some(mine) => {
            let roles = xccl::bootstrap::gather_roles(exchange.as_ref(), mine, timeout)?;
            topology.with_roles(roles)?
        }
    };
    if exchange.size() != topo.world_size() {
        return Err(xccl::Error::invalid(format!(
            "the job has {} ranks, the topology {}",
            exchange.size(),
            topo.world_size()
        )));
    }
    match fabric {
        "shm" => Communicator::init_shm(exchange, topo, cfg),
        "ofi" => Communicator::init_ofi(exchange, topo, cfg),
        "cuda" => {
            let device = device
                .map(|d| {
                    usize::try_from(d).map_err(|_| {
                        xccl::Error::invalid(format!("device {d} is not a CUDA device ordinal"))
                    })
                })
                .transpose()?;
            Communicator::init_cuda(exchange, topo, cfg, device)
        }
        "ascend" => {
            let device = device.unwrap_or_else(|| {
                std::env::var("LOCAL_RANK")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0)
            });
            Communicator::init_ascend(exchange, topo, cfg, device)
        }
        other => Err(xccl::Error::invalid(format!(
            "unknown fabric {other:?} (expected \"shm\", \"ofi\", \"cuda\" or \"ascend\")"
        ))),
    }
}

/// The ``timeout`` argument of a receive.
#[derive(Clone, Copy, Debug)]
pub(crate) enum RecvTimeout {
    /// Not given: the config's timeout.
    Config,
    /// ``None``: no deadline; the waits end only at a dead or departed peer, an abort or an
    /// interrupt ([`Communicator::without_deadline`]).
    Never,
    /// Seconds, as given (checked by [`RecvTimeout::checked`]).
    Seconds(f64),
}

impl<'a, 'py> FromPyObject<'a, 'py> for RecvTimeout {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if obj.is_none() {
            return Ok(RecvTimeout::Never);
        }
        obj.extract::<f64>().map(RecvTimeout::Seconds).map_err(|_| {
            invalid(
                obj.py(),
                "timeout must be a number of seconds or None (no deadline)",
            )
        })
    }
}

/// A checked [`RecvTimeout`]: `None` the config's, `Some(None)` no deadline.
#[derive(Clone, Copy)]
struct CallTimeout(Option<Option<Duration>>);

impl RecvTimeout {
    /// Checks the seconds (`(0, MAX_TIMEOUT_S]`, else a `ValueError` naming the range).
    fn checked(self, py: Python<'_>) -> PyResult<CallTimeout> {
        Ok(CallTimeout(match self {
            RecvTimeout::Config => None,
            RecvTimeout::Never => Some(None),
            RecvTimeout::Seconds(s) => Some(Some(seconds(py, "timeout", s)?)),
        }))
    }
}

impl CallTimeout {
    /// Runs `f` on `c` under this timeout; the config's applies again afterwards.
    fn apply<R>(
        self,
        c: &mut Communicator,
        f: impl FnOnce(&mut Communicator) -> xccl::Result<R>,
    ) -> xccl::Result<R> {
        match self.0 {
            None => f(c),
            Some(None) => c.without_deadline(f),
            Some(Some(t)) => {
                let configured = c.config().timeout;
                c.set_timeout(t)?;
                let r = f(c);
                c.set_timeout(configured)?;
                r
            }
        }
    }
}

/// Hex runs this long or longer are taken for secrets (a job key is 64 digits, a unique id
/// 256) by [`without_hex_runs`].
const SECRET_HEX_DIGITS: usize = 32;

/// `text` with every run of [`SECRET_HEX_DIGITS`] or more hex digits replaced by
/// `<hex hidden>`.
fn without_hex_runs(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut run = String::new();
    let flush = |run: &mut String, out: &mut String| {
        if run.len() >= SECRET_HEX_DIGITS {
            out.push_str("<hex hidden>");
        } else {
            out.push_str(run);
        }
        run.clear();
    };
    for c in text.chars() {
        if c.is_ascii_hexdigit() {
            run.push(c);
        } else {
            flush(&mut run, &mut out);
            out.push(c);
        }
    }
    flush(&mut run, &mut out);
    out
}

/// Stats as a dict.
fn stats_dict<'py>(py: Python<'py>, s: &xccl::Stats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("calls", s.calls)?;
    d.set_item("records_written", s.records_written)?;
    d.set_item("records_polled", s.records_polled)?;
    d.set_item("relay_rows_forwarded", s.relay_rows_forwarded)?;
    d.set_item("dropped_slots", s.dropped_slots)?;
    let peers = PyList::empty(py);
    for p in &s.peers {
        let pd = PyDict::new(py);
        pd.set_item("rows_sent", p.rows_sent)?;
        pd.set_item("rows_received", p.rows_received)?;
        pd.set_item("bytes_put", p.bytes_put)?;
        pd.set_item("bytes_got", p.bytes_got)?;
        pd.set_item("waited", p.waited.as_secs_f64())?;
        peers.append(pd)?;
    }
    d.set_item("peers", peers)?;
    Ok(d)
}

#[pymethods]
impl PyComm {
    /// Joins the job named by ``unique_id`` (a :class:`UniqueId` or its string) as ``rank`` of
    /// ``world_size``. Collective: every rank calls it with the same topology and config.
    ///
    /// ``fabric``: ``"shm"`` (ranks on one host), ``"ofi"`` (libfabric; ``XCCL_OFI_PROVIDER``,
    /// ``XCCL_OFI_ADDR``), ``"cuda"`` (ranks on one host, rows in the memory of CUDA GPU
    /// ``device``, default ``rank % device count``; the calls then take and return CUDA
    /// tensors of that device) or ``"ascend"`` (NPU ``device``, default ``LOCAL_RANK`` or 0).
    /// ``role``: this rank's role (``"attention"``/``"expert"``) when the topology's rank order
    /// is not the launcher's: every rank states its own, and the topology is built from the
    /// gathered roles (its counts must match). ``timeout``: seconds to wait for the other ranks
    /// to join (default 60).
    ///
    /// Ctrl-C while it waits raises ``KeyboardInterrupt`` within about 20 ms and leaves no
    /// communicator: the job is aborted (peers that joined, or join later, see
    /// :class:`AbortedError` naming this rank, at their init or their first call); to retry,
    /// every rank joins a new job (a new unique id).
    #[staticmethod]
    #[pyo3(signature = (topology, config, *, unique_id, rank, world_size, fabric = "shm", device = None, role = None, timeout = 60.0))]
    #[allow(clippy::too_many_arguments)]
    fn init(
        py: Python<'_>,
        topology: &Bound<'_, PyTopology>,
        config: &Bound<'_, PyConfig>,
        unique_id: &Bound<'_, PyAny>,
        rank: usize,
        world_size: usize,
        fabric: &str,
        device: Option<i32>,
        role: Option<&str>,
        timeout: f64,
    ) -> PyResult<PyComm> {
        let id = crate::topo::unique_id(py, unique_id)?;
        let role = role.map(|r| parse_role(py, r)).transpose()?;
        let timeout = seconds(py, "timeout", timeout)?;
        let cfg = config.get().cfg.clone();
        join_interruptible(
            py,
            move || TcpBootstrap::connect(&id, rank, world_size, timeout),
            topology.clone().unbind(),
            cfg,
            fabric.to_string(),
            device,
            role,
            timeout,
        )
    }

    /// Joins the job the launcher's environment describes: torchrun (``RANK``,
    /// ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), mpirun or srun (their rank variables
    /// plus ``XCCL_ROOT=host:port``), or ``XCCL_RANK``/``XCCL_SIZE``/``XCCL_ROOT``; rank 0 hosts
    /// the rendezvous on that port. Every rank's environment holds the job's key
    /// (``XCCL_JOB_KEY``). Arguments (and Ctrl-C) as for :meth:`init`.
    ///
    /// Under torchrun, whose agent store already listens on ``MASTER_PORT``
    /// (``TORCHELASTIC_USE_AGENT_STORE=True``), rank 0 hosts the rendezvous on a port the OS
    /// picks on ``MASTER_ADDR`` and the other ranks learn it through torchrun's store (the
    /// port only; the key never leaves the environment): no port to choose. ``XCCL_ROOT``
    /// still overrides.
    #[staticmethod]
    #[pyo3(signature = (topology, config, *, fabric = "shm", device = None, role = None, timeout = 60.0))]
    fn from_env(
        py: Python<'_>,
        topology: &Bound<'_, PyTopology>,
        config: &Bound<'_, PyConfig>,
        fabric: &str,
        device: Option<i32>,
        role: Option<&str>,
        timeout: f64,
    ) -> PyResult<PyComm> {
        let role = role.map(|r| parse_role(py, r)).transpose()?;
        let timeout = seconds(py, "timeout", timeout)?;
        let cfg = config.get().cfg.clone();
        let connect: Box<dyn FnOnce() -> xccl::Result<TcpBootstrap> + Send> =
            match torchrun_root(py, timeout)? {
                Some((id, rank, size)) => {
                    Box::new(move || TcpBootstrap::connect(&id, rank, size, timeout))
                }
                None => Box::new(move || {
                    let env = LaunchEnv::detect()?.ok_or_else(|| {
                        xccl::Error::Bootstrap(
                            "no launcher environment: set XCCL_RANK, XCCL_SIZE and XCCL_ROOT, \
                             or launch with torchrun, mpirun or srun (plus XCCL_ROOT)"
                                .into(),
                        )
                    })?;
                    env.connect(timeout)
                }),
            };
        join_interruptible(
            py,
            connect,
            topology.clone().unbind(),
            cfg,
            fabric.to_string(),
            device,
            role,
            timeout,
        )
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> usize {
        self.info.rank
    }

    /// Number of ranks.
    #[getter]
    fn world_size(&self) -> usize {
        self.info.world_size
    }

    /// ``"attention"`` or ``"expert"``.
    #[getter]
    fn role(&self) -> &'static str {
        role_name(self.info.role)
    }

    /// The global ids of the experts this rank hosts, ascending (local expert ``j`` is
    /// ``local_experts[j]``); empty on an attention rank.
    #[getter]
    fn local_experts(&self) -> Vec<usize> {
        self.info.local_experts.clone()
    }

    /// The fabric underneath (``"shm"``, ``"ofi"``, ``"cuda"``, ``"ascend"``).
    #[getter]
    fn fabric(&self) -> &'static str {
        self.info.fabric
    }

    /// Where this communicator's tensors live: ``"cpu"``, or ``"cuda:<id>"`` on the ``cuda``
    /// fabric (torch's spelling: ``torch.device(comm.device)``).
    #[getter]
    fn device(&self) -> String {
        match &self.info.cuda {
            Some(d) => format!("cuda:{}", d.ordinal()),
            None => "cpu".into(),
        }
    }

    /// The dtype of rows: ``"f32"``, ``"f16"`` or ``"bf16"``.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.info.dtype.name()
    }

    /// Elements per row.
    #[getter]
    fn hidden(&self) -> usize {
        self.info.hidden
    }

    /// Routing entries per token.
    #[getter]
    fn topk(&self) -> usize {
        self.info.topk
    }

    /// Number of global experts.
    #[getter]
    fn num_experts(&self) -> usize {
        self.info.num_experts
    }

    /// Whether a failed call poisoned this communicator (the job was aborted; every later
    /// call raises the first error again).
    #[getter]
    fn poisoned(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(self.error(py)?.is_some())
    }

    /// The message of the error that poisoned this communicator, or ``None``.
    #[getter]
    fn error(&self, py: Python<'_>) -> PyResult<Option<String>> {
        let shared = self.shared(py)?;
        if let Ok(c) = shared.comm.try_lock() {
            if let Some(e) = c.poisoned() {
                return Ok(Some(e.to_string()));
            }
        }
        // An abort that reached this rank (its own from another thread, or a peer's) poisons
        // the next call; say so already, also while a call runs on another thread.
        Ok(self.abort.aborted().map(|e| e.to_string()))
    }

    /// Whether :meth:`close` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.shared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
    }

    /// A2E calls of this attention rank waiting for their E2A.
    #[getter]
    fn a2e_in_flight(&self, py: Python<'_>) -> PyResult<usize> {
        self.run(py, |c| Ok(c.a2e_in_flight()))
    }

    /// A2E on an attention rank: sends each token of ``x`` (``[T, hidden]`` of the
    /// communicator's dtype, C-contiguous, CPU; on the ``cuda`` fabric a CUDA tensor of the
    /// communicator's device, see :attr:`device`) to the ranks of its experts ``topk_idx``
    /// (``[T, topk]``, int32 or int64 (converted exactly), ``-1`` = none) with gating weights
    /// ``topk_weights`` (``[T, topk]``, float32; float16/bfloat16 are widened exactly, float64
    /// is rejected). Every input is checked before anything is sent. Returns the handle for
    /// :meth:`e2a_recv`. ``tag``: a user value this call carries to every expert rank it
    /// reaches (:attr:`ExpertBatch.tag`, :attr:`ExpertBatch.tags`), for example a shutdown
    /// flag or a request id. The inputs are read during the call only (do not write them from
    /// another thread meanwhile).
    ///
    /// On the ``cuda`` fabric the routing may be on the CPU or on the device, of the same dtypes
    /// (int32 ids and float32 weights on the device are read by the call with one small
    /// device-to-host copy each; other dtypes are read back first and converted as on the
    /// host). CUDA tensors are taken as a
    /// DLPack consumer on the current stream (torch's current stream when torch uses CUDA, else
    /// the legacy default stream): the call runs after the work queued on it and returns with
    /// the rows sent, so ``x`` may be reused at once.
    #[pyo3(signature = (x, topk_idx, topk_weights, *, tag = 0))]
    fn a2e_send(
        &self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        topk_idx: &Bound<'_, PyAny>,
        topk_weights: &Bound<'_, PyAny>,
        tag: u64,
    ) -> PyResult<PyA2eHandle> {
        self.require(py, Role::Attention, "A2E send")?;
        if let Some(c) = self.cuda_place(py)? {
            return self.a2e_send_device(py, c, x, topk_idx, topk_weights, tag);
        }
        let xt = Tensor::import(py, x, "x")?;
        let t = expect_rows(py, &xt, "x", self.elem(), None, self.info.hidden)?;
        let xb = xt.bytes();
        let handle = self.with_routing(py, topk_idx, topk_weights, t, |ids, w| {
            self.run(py, |c| {
                let mode = c.config().mode;
                c.set_next_a2e_tag(tag);
                c.a2e_send_bytes(xb, ids, w, mode)
            })
        })?;
        Ok(PyA2eHandle { handle })
    }

    /// The registered A2E input of the next call: a writable :class:`Buffer`
    /// ``[max_tokens_per_rank, hidden]`` in this rank's window. Write token ``t`` into row
    /// ``t`` (``torch.from_dlpack(buf)[:T].copy_(x)``, or let the layer producing ``x`` write
    /// there), then call :meth:`a2e_send_input`: expert ranks read the rows from here (one
    /// copy in all instead of two).
    ///
    /// Valid until :meth:`a2e_send_input` succeeds: after it the rows belong to the call in
    /// flight (writing them corrupts what the expert ranks read), the buffer refuses new
    /// exports, and the next call's input comes from ``a2e_input()`` again. The memory stays
    /// mapped as long as the buffer or a tensor made from it lives, even past :meth:`close`.
    /// Waits until the previous use of the buffer has been consumed everywhere. Not available
    /// through relays or on fabrics whose window is not host memory (use :meth:`a2e_send`).
    fn a2e_input(&self, py: Python<'_>) -> PyResult<Buffer> {
        let shared = self.shared(py)?;
        let dtype = self.info.dtype;
        let (ptr, _len) = self.run(py, move |c| {
            let s: &mut [u8] = match dtype {
                DType::F32 => bytemuck::cast_slice_mut(c.a2e_input::<f32>()?),
                DType::F16 => bytemuck::cast_slice_mut(c.a2e_input::<f16>()?),
                DType::BF16 => bytemuck::cast_slice_mut(c.a2e_input::<bf16>()?),
            };
            Ok((s.as_mut_ptr() as usize, s.len()))
        })?;
        self.retire_input();
        let live = Arc::new(AtomicBool::new(true));
        *self.input_live.lock().unwrap_or_else(|p| p.into_inner()) = Some(live.clone());
        let keep: Arc<dyn std::any::Any + Send + Sync> = shared;
        Ok(Buffer::new(
            Owner::Keep(keep),
            ptr as *const u8,
            &[self.info.max_tokens, self.info.hidden],
            self.elem(),
            false,
            Some(live),
        ))
    }

    /// A2E send of the first ``num_tokens`` rows of the registered input (:meth:`a2e_input`,
    /// which must have been called for this call), routed by ``topk_idx``/``topk_weights`` as
    /// in :meth:`a2e_send` (``tag`` too). Returns the handle for :meth:`e2a_recv`.
    #[pyo3(signature = (num_tokens, topk_idx, topk_weights, *, tag = 0))]
    fn a2e_send_input(
        &self,
        py: Python<'_>,
        num_tokens: usize,
        topk_idx: &Bound<'_, PyAny>,
        topk_weights: &Bound<'_, PyAny>,
        tag: u64,
    ) -> PyResult<PyA2eHandle> {
        self.require(py, Role::Attention, "A2E send")?;
        let result = self.with_routing(py, topk_idx, topk_weights, num_tokens, |ids, w| {
            Ok(self.run(py, |c| {
                c.set_next_a2e_tag(tag);
                c.a2e_send_input(num_tokens, ids, w)
            }))
        })?;
        match &result {
            Ok(_) => self.retire_input(),
            Err(e) => {
                let poisoned = e
                    .value(py)
                    .getattr("poisoned")
                    .and_then(|p| p.extract::<bool>())
                    .unwrap_or(true);
                if poisoned {
                    self.retire_input();
                }
            }
        }
        Ok(PyA2eHandle { handle: result? })
    }

    /// Non-blocking E2A check on an attention rank: ``True`` when every contribution of
    /// ``handle``'s E2A has landed, so :meth:`e2a_recv` with it returns without waiting on a
    /// peer. Never blocks. Errors (a handle that is not the oldest, a dead peer, an abort)
    /// follow the same retryable/poisoned rules as :meth:`e2a_recv`.
    fn e2a_ready(&self, py: Python<'_>, handle: &Bound<'_, PyA2eHandle>) -> PyResult<bool> {
        self.require(py, Role::Attention, "E2A test")?;
        let h = &handle.get().handle;
        self.run(py, |c| c.e2a_ready(h))
    }

    /// Non-blocking A2E check on an expert rank: ``True`` when the next A2E receive (either
    /// path) has all its rows and returns without waiting. Never blocks.
    fn a2e_ready(&self, py: Python<'_>) -> PyResult<bool> {
        self.require(py, Role::Expert, "A2E test")?;
        self.run(py, |c| c.a2e_ready())
    }

    /// E2A on an attention rank: waits for the expert outputs of the tokens sent with
    /// ``handle`` (the oldest unanswered A2E) and returns ``out[t] = sum_k w[t,k] *
    /// expert_k(x[t])`` as ``[T, hidden]`` of the dtype, combined exactly as the protocol
    /// documents (bitwise reproducible). ``out``: a writable C-contiguous CPU tensor
    /// ``[T, hidden]`` to write into (returned), or ``None`` for a new :class:`Buffer` (yours,
    /// writable). A rejected handle stays valid.
    ///
    /// On the ``cuda`` fabric ``out`` is a CUDA tensor of the communicator's device, and the new
    /// :class:`Buffer` is device memory there (exported as CUDA DLPack, no copy); the rows are
    /// in place when the call returns (ordered after the current stream's work, see
    /// :meth:`a2e_send`).
    #[pyo3(signature = (handle, out = None))]
    fn e2a_recv<'py>(
        &self,
        py: Python<'py>,
        handle: &Bound<'py, PyA2eHandle>,
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        self.require(py, Role::Attention, "E2A receive")?;
        let h = &handle.get().handle;
        let (t, hidden) = (h.num_tokens(), self.info.hidden);
        if let Some(c) = self.cuda_place(py)? {
            return self.e2a_recv_device(py, c, h, out);
        }
        match out {
            Some(o) => {
                let mut ot = Tensor::import(py, o, "out")?;
                expect_rows(py, &ot, "out", self.elem(), Some(t), hidden)?;
                let ob = ot.bytes_mut(py, "out")?;
                self.run(py, |c| c.e2a_recv_bytes(h, ob))?;
                Ok(o.clone().unbind())
            }
            None => {
                let mut bytes = HostBytes::zeroed(t * hidden * self.info.dtype.size());
                let ob = bytes.as_mut_slice();
                self.run(py, |c| c.e2a_recv_bytes(h, ob))?;
                let buf = Buffer::host(bytes, &[t, hidden], self.elem());
                Ok(Bound::new(py, buf)?.into_any().unbind())
            }
        }
    }

    /// A2E receive on an expert rank, expert-major: waits for this call's rows from every
    /// attention rank and returns them grouped by local expert (:class:`ExpertBatch`).
    ///
    /// ``timeout``: seconds for this receive (default: the config's ``timeout``), or ``None``:
    /// no deadline, for a serving loop waiting for requests. It then waits as long as the
    /// attention ranks live: only a dead peer or one that left the job
    /// (:class:`PeerFailedError` naming it), an abort (:class:`AbortedError`) or Ctrl-C
    /// (``KeyboardInterrupt``) ends it, never :class:`TimeoutError`.
    ///
    /// On the ``cuda`` fabric the rows are received into device memory of the communicator's
    /// device (:attr:`ExpertBatch.rows` is a CUDA :class:`Buffer`), complete when the call
    /// returns; the metadata stays on the host. Not with ``keep_int8``.
    #[pyo3(signature = (*, timeout = RecvTimeout::Config))]
    fn a2e_recv(&self, py: Python<'_>, timeout: RecvTimeout) -> PyResult<PyExpertBatch> {
        let timeout = timeout.checked(py)?;
        let mut batch = recycle(py, &self.recycle.expert, |b| &b.inner)
            .unwrap_or_else(|| Spares::take(&self.spares.expert));
        self.receive(
            py,
            timeout,
            &mut batch,
            (
                Communicator::max_expert_rows,
                "the rows of an expert-major receive",
            ),
            |c, b| c.a2e_recv(b),
            |c, b, rows, stream| c.a2e_recv_device(b, rows, stream),
        )?;
        Ok(PyExpertBatch {
            inner: Held::new(batch),
            spares: self.spares.clone(),
            elem: self.elem(),
            keep_int8: self.info.keep_int8,
            device: self.info.cuda.as_ref().map(Device::ordinal),
        })
    }

    /// A2E receive on an expert rank, token-major: one row per received token, with its local
    /// experts and weights (:class:`TokenBatch`). ``timeout`` as for :meth:`a2e_recv`
    /// (``None``: no deadline while the peers live).
    ///
    /// On the ``cuda`` fabric the rows are received into device memory of the communicator's
    /// device (:attr:`TokenBatch.rows` is a CUDA :class:`Buffer`, row ``i`` token ``i``),
    /// complete when the call returns, ordered after the current stream's work (see
    /// :meth:`a2e_send`); the metadata stays on the host. Not with ``keep_int8``.
    #[pyo3(signature = (*, timeout = RecvTimeout::Config))]
    fn a2e_recv_tokens(&self, py: Python<'_>, timeout: RecvTimeout) -> PyResult<PyTokenBatch> {
        let timeout = timeout.checked(py)?;
        let mut batch = recycle(py, &self.recycle.token, |b| &b.inner)
            .unwrap_or_else(|| Spares::take(&self.spares.token));
        self.receive(
            py,
            timeout,
            &mut batch,
            (
                Communicator::max_recv_tokens,
                "the rows of a token-major receive",
            ),
            |c, b| c.a2e_recv_tokens(b, &mut |_, _| {}),
            |c, b, rows, stream| c.a2e_recv_tokens_device(b, rows, stream, &mut |_, _| {}),
        )?;
        Ok(PyTokenBatch {
            inner: Held::new(batch),
            spares: self.spares.clone(),
            elem: self.elem(),
            hidden: self.info.hidden,
            topk: self.info.topk,
            keep_int8: self.info.keep_int8,
            device: self.info.cuda.as_ref().map(Device::ordinal),
        })
    }

    /// E2A on an expert rank, expert-major: ``expert_out`` holds one output row per row of
    /// ``batch`` (``[batch.num_rows, hidden]`` of the dtype, same order); each token's rows are
    /// reduced with its gating weights (f32, ascending local expert, rounded once) and sent
    /// back to its attention rank. On the ``cuda`` fabric ``expert_out`` is a CUDA tensor of
    /// the communicator's device, read after the current stream's work (see :meth:`a2e_send`).
    fn e2a_send(
        &self,
        py: Python<'_>,
        batch: &Bound<'_, PyExpertBatch>,
        expert_out: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.require(py, Role::Expert, "E2A send")?;
        let held = &batch.get().inner;
        let guard = held.get(py)?;
        let b = &guard.batch;
        let cuda = self.cuda_place(py)?;
        let place = cuda.map_or(Place::HOST, Place::cuda);
        let ot = Tensor::import_at(py, expert_out, "expert_out", &place)?;
        expect_rows(
            py,
            &ot,
            "expert_out",
            self.elem(),
            Some(b.num_rows()),
            self.info.hidden,
        )?;
        match (cuda, ot.device_slice()) {
            (Some(c), Some(out)) => self.run_on(py, c, |comm, _, stream| {
                comm.e2a_send_device(b, out, stream)
            }),
            _ => self.e2a_send_host(py, b, &ot),
        }?;
        drop(guard);
        held.set_replied();
        *self
            .recycle
            .expert
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(batch.clone().unbind());
        Ok(())
    }

    /// E2A on an expert rank, token-major: ``reduced`` holds one row per token of ``batch``
    /// (``[batch.num_tokens, hidden]``), each already the gating-weighted sum over the token's
    /// local experts. On the ``cuda`` fabric ``reduced`` is a CUDA tensor of the
    /// communicator's device, read after the current stream's work (see :meth:`a2e_send`).
    fn e2a_send_tokens(
        &self,
        py: Python<'_>,
        batch: &Bound<'_, PyTokenBatch>,
        reduced: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.require(py, Role::Expert, "E2A send")?;
        let held = &batch.get().inner;
        let guard = held.get(py)?;
        let b = &guard.batch;
        let cuda = self.cuda_place(py)?;
        let place = cuda.map_or(Place::HOST, Place::cuda);
        let rt = Tensor::import_at(py, reduced, "reduced", &place)?;
        expect_rows(
            py,
            &rt,
            "reduced",
            self.elem(),
            Some(b.num_tokens()),
            self.info.hidden,
        )?;
        match (cuda, rt.device_slice()) {
            (Some(c), Some(rows)) => self.run_on(py, c, |comm, _, stream| {
                comm.e2a_send_tokens_device(b, rows, stream)
            }),
            _ => {
                let bytes = rt.bytes();
                self.run(py, |c| {
                    let mode = c.config().mode;
                    c.e2a_send_tokens_bytes(b, bytes, mode)
                })
            }
        }?;
        drop(guard);
        held.set_replied();
        *self.recycle.token.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(batch.clone().unbind());
        Ok(())
    }

    /// Waits for every rank (collective).
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, |c| c.barrier())
    }

    /// What the last call counted: ``calls``, ``records_written``, ``records_polled``,
    /// ``relay_rows_forwarded``, ``dropped_slots`` and ``peers`` (per rank: ``rows_sent``,
    /// ``rows_received``, ``bytes_put``, ``bytes_got``, ``waited`` in seconds).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.run(py, |c| Ok(c.last_call_stats().clone()))?;
        stats_dict(py, &s)
    }

    /// :meth:`stats` added up over every call so far.
    fn total_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.run(py, |c| Ok(c.total_stats().clone()))?;
        stats_dict(py, &s)
    }

    /// Clears the totals of :meth:`total_stats`.
    fn reset_stats(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, |c| {
            c.reset_stats();
            Ok(())
        })
    }

    /// Aborts the job with ``reason``: every rank's current and later waits fail with
    /// :class:`AbortedError` naming this rank and the reason; this communicator is poisoned.
    /// Returns promptly. Callable from any thread, also while another thread is blocked in a
    /// call on this communicator: that call raises :class:`AbortedError` (this rank, the
    /// reason) within milliseconds, and the peers are told at once.
    fn abort(&self, py: Python<'_>, reason: &str) -> PyResult<()> {
        let shared = self.shared(py)?;
        let handle = &self.abort;
        py.detach(|| {
            handle.abort(reason);
            // A call running on another thread poisons the communicator itself when its wait
            // sees the abort; with none running, record it here.
            if let Ok(mut c) = shared.comm.try_lock() {
                c.abort(reason);
            }
        });
        Ok(())
    }

    /// After a peer failure: every survivor calls ``shrink()``, which agrees on the dead ranks
    /// and returns a new communicator over the survivors (ranks renumbered densely; see
    /// :meth:`rank_after_shrink`). This communicator is closed by the call, whatever its
    /// outcome: use the one returned from now on. ``drop_orphaned_experts``: drop
    /// the selections of experts left without a replica instead of raising
    /// :class:`ExpertLostError`. ``timeout``: seconds per agreement round (default 60).
    ///
    /// Ctrl-C while it waits raises ``KeyboardInterrupt`` within about 20 ms; this
    /// communicator stays closed and no new one is returned. The survivors' agreement goes on
    /// without this thread: if it completes, the communicator it builds aborts its job at once
    /// (the survivors' calls on it raise :class:`AbortedError` naming this rank; they can
    /// shrink again), and a process that exits instead is counted dead by the agreement.
    #[pyo3(signature = (*, drop_orphaned_experts = false, timeout = 60.0))]
    fn shrink(
        &self,
        py: Python<'_>,
        drop_orphaned_experts: bool,
        timeout: f64,
    ) -> PyResult<PyComm> {
        let timeout = seconds(py, "timeout", timeout)?;
        self.retire_input();
        let comm = self.take(py)?;
        let opts = xccl::ShrinkOptions {
            drop_orphaned_experts,
            timeout,
            ..Default::default()
        };
        let new = interruptible(
            py,
            "shrink",
            move || comm.shrink(&opts),
            || {},
            abort_abandoned("shrink"),
        )?;
        new.map(PyComm::wrap).map_err(|e| to_py(py, &e, true))
    }

    /// On a communicator made by :meth:`shrink`: the new rank of the rank numbered ``old``
    /// before it, or ``None`` if that rank died.
    fn rank_after_shrink(&self, py: Python<'_>, old: usize) -> PyResult<Option<usize>> {
        self.run(py, |c| Ok(c.rank_after_shrink(old)))
    }

    /// On a communicator made by :meth:`shrink`: the dead ranks (old numbering).
    fn shrunk_past(&self, py: Python<'_>) -> PyResult<Vec<usize>> {
        self.run(py, |c| Ok(c.shrunk_past().to_vec()))
    }

    /// Leaves the job and frees the communicator: the peers see this rank leave at once, also
    /// while buffers from :meth:`a2e_input` (or tensors made from them) live, which keep only
    /// the window's memory mapped (they refuse new exports). Later calls raise; closing twice
    /// is fine.
    fn close(&self, py: Python<'_>) {
        self.retire_input();
        let shared = self.shared.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(shared) = shared {
            py.detach(move || Shared::release(shared));
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Closes the communicator; aborts the job first if the block raised.
    #[pyo3(signature = (exc_type = None, exc = None, _tb = None))]
    fn __exit__(
        &self,
        py: Python<'_>,
        exc_type: Option<&Bound<'_, PyAny>>,
        exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        if exc_type.is_some_and(|t| !t.is_none()) && !self.closed() {
            // The exception's text goes to every peer: a key or an id in it (a long run of hex
            // digits) is left out.
            let what = exc
                .and_then(|e| e.repr().ok())
                .map(|r| without_hex_runs(&r.to_string_lossy()))
                .unwrap_or_else(|| "an exception".into());
            let _ = self.abort(
                py,
                &format!("rank {} left its with block with {what}", self.info.rank),
            );
        }
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        format!(
            "xccl.Communicator(rank={} of {}, {}, {}, hidden={}, dtype={})",
            self.info.rank,
            self.info.world_size,
            role_name(self.info.role),
            self.info.fabric,
            self.info.hidden,
            self.info.dtype.name()
        )
    }
}

impl PyComm {
    /// On a `cuda` communicator: its device and the stream its next call orders after
    /// ([`consumer_stream`]); `None` on other fabrics.
    fn cuda_place(&self, py: Python<'_>) -> PyResult<Option<CudaPlace>> {
        let Some(device) = &self.info.cuda else {
            return Ok(None);
        };
        let device = device.ordinal();
        Ok(Some(CudaPlace {
            device,
            stream: consumer_stream(py, device)?,
        }))
    }

    /// [`PyComm::run`] of a device call: `f` gets the communicator's device and the call's
    /// stream (`place.stream`, borrowed).
    fn run_on<R: Send>(
        &self,
        py: Python<'_>,
        place: CudaPlace,
        f: impl FnOnce(&mut Communicator, &Device, &Stream) -> xccl::Result<R> + Send,
    ) -> PyResult<R> {
        let Some(device) = self.info.cuda.clone() else {
            return Err(invalid(py, "not a communicator on the cuda fabric"));
        };
        self.run(py, move |c| {
            // SAFETY: `place.stream` is 0 (the legacy default stream) or torch's current stream
            // of this device (`consumer_stream`), a stream of the device's primary context,
            // which torch keeps alive while it is current; it is used for this call only.
            let stream = unsafe { Stream::borrowed(&device, place.stream) };
            f(c, &device, &stream)
        })
    }

    /// A receive into `batch` under `timeout`: `host(comm, batch)` on other fabrics; on a `cuda`
    /// communicator `device(comm, batch, rows, stream)` into the batch's device rows, sized for
    /// `rows.0(comm)` rows (kept with the batch; `rows.1` names them in an allocation error).
    fn receive<B: Send>(
        &self,
        py: Python<'_>,
        timeout: CallTimeout,
        batch: &mut WithRows<B>,
        rows: (fn(&Communicator) -> usize, &'static str),
        host: impl FnOnce(&mut Communicator, &mut B) -> xccl::Result<()> + Send,
        device: impl FnOnce(&mut Communicator, &mut B, DeviceSliceMut<'_>, &Stream) -> xccl::Result<()>
            + Send,
    ) -> PyResult<()> {
        let Some(place) = self.cuda_place(py)? else {
            return self.run(py, |c| timeout.apply(c, |c| host(c, &mut batch.batch)));
        };
        let elem = self.elem().size() * self.info.hidden;
        self.run_on(py, place, |c, dev, stream| {
            timeout.apply(c, |c| {
                let need = rows.0(c) * elem;
                let (b, out) = batch.device_rows(dev, need, rows.1)?;
                device(c, b, out, stream)
            })
        })
    }

    /// `a2e_send` on a `cuda` communicator: `x` on its device, the routing on the CPU or there.
    fn a2e_send_device(
        &self,
        py: Python<'_>,
        c: CudaPlace,
        x: &Bound<'_, PyAny>,
        topk_idx: &Bound<'_, PyAny>,
        topk_weights: &Bound<'_, PyAny>,
        tag: u64,
    ) -> PyResult<PyA2eHandle> {
        let (hidden, topk) = (self.info.hidden, self.info.topk);
        let xt = Tensor::import_at(py, x, "x", &Place::cuda(c))?;
        let t = expect_rows(py, &xt, "x", self.elem(), None, hidden)?;
        let routing = Place::host_or(c);
        let it = Tensor::import_at(py, topk_idx, "topk_idx", &routing)?;
        let wt = Tensor::import_at(py, topk_weights, "topk_weights", &routing)?;
        let Some(xs) = xt.device_slice() else {
            return Err(invalid(py, "x is not device memory"));
        };
        // Routing the Rust API reads on the device as it is; else on the host (a device tensor
        // of another dtype read back on the call's stream), converted as host routing.
        let on_host;
        let routing = match device_routing(&it, &wt, t, topk) {
            Some(r) => r,
            None => {
                let timeout = self.info.timeout;
                let copies = (
                    it.host_copy(py, c.stream, timeout)?,
                    wt.host_copy(py, c.stream, timeout)?,
                );
                let it_host = copies.0.map(|b| Bound::new(py, b)).transpose()?;
                let wt_host = copies.1.map(|b| Bound::new(py, b)).transpose()?;
                let it = match &it_host {
                    Some(b) => Tensor::import(py, b.as_any(), "topk_idx")?,
                    None => it,
                };
                let wt = match &wt_host {
                    Some(b) => Tensor::import(py, b.as_any(), "topk_weights")?,
                    None => wt,
                };
                on_host = (
                    topk_ids(py, &it, t, topk, self.info.num_experts)?.into_owned(),
                    crate::tensor::topk_weights(py, &wt, t, topk)?.into_owned(),
                );
                xccl::Routing::Host {
                    topk_idx: &on_host.0,
                    topk_weights: &on_host.1,
                }
            }
        };
        let handle = self.run_on(py, c, |comm, _, stream| {
            comm.set_next_a2e_tag(tag);
            comm.a2e_send_device(xs, routing, stream)
        })?;
        Ok(PyA2eHandle { handle })
    }

    /// `e2a_recv` on a `cuda` communicator: into `out` (a CUDA tensor of its device), or into
    /// new device memory returned as a CUDA [`Buffer`].
    fn e2a_recv_device(
        &self,
        py: Python<'_>,
        c: CudaPlace,
        h: &xccl::A2eHandle,
        out: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let (t, hidden) = (h.num_tokens(), self.info.hidden);
        if let Some(o) = out {
            let mut ot = Tensor::import_at(py, o, "out", &Place::cuda(c))?;
            expect_rows(py, &ot, "out", self.elem(), Some(t), hidden)?;
            let Some(os) = ot.device_slice_mut(py, "out")? else {
                return Err(invalid(py, "out is not device memory"));
            };
            self.run_on(py, c, |comm, _, stream| comm.e2a_recv_device(h, os, stream))?;
            return Ok(o.clone().unbind());
        }
        let len = t * hidden * self.info.dtype.size();
        let memory = self.run_on(py, c, |comm, device, stream| {
            let mut memory = match len {
                0 => None,
                _ => Some(DeviceMemory::alloc(device, len, || {
                    "the result of e2a_recv".into()
                })?),
            };
            let out = match memory.as_mut() {
                Some(m) => m.as_slice_mut(),
                // SAFETY: an empty slice addresses nothing.
                None => unsafe { DeviceSliceMut::from_raw(0, 0, device.ordinal()) },
            };
            comm.e2a_recv_device(h, out, stream)?;
            Ok(memory)
        })?;
        let (owner, ptr) = match memory {
            Some(m) => {
                let ptr = m.ptr().addr();
                (Owner::Device(Arc::new(m)), ptr)
            }
            None => (Owner::Host(Arc::new(HostBytes::zeroed(0))), 0),
        };
        let buf = Buffer::on_device(owner, ptr, c.device, &[t, hidden], self.elem(), false);
        Ok(Bound::new(py, buf)?.into_any().unbind())
    }

    /// `e2a_send` of host rows `ot` (`[batch.num_rows(), hidden]` of the dtype, checked).
    fn e2a_send_host(&self, py: Python<'_>, b: &ExpertBatch, ot: &Tensor<'_>) -> PyResult<()> {
        match self.info.dtype {
            DType::F32 => {
                let s = ot.elements::<f32>();
                self.run(py, |c| c.e2a_send(b, &s))
            }
            DType::F16 => {
                let s = ot.elements::<f16>();
                self.run(py, |c| c.e2a_send(b, &s))
            }
            DType::BF16 => {
                let s = ot.elements::<bf16>();
                self.run(py, |c| c.e2a_send(b, &s))
            }
        }
    }

    /// Fails with `WrongRoleError` unless this rank has role `need` (checked before the
    /// tensors, so a call on the wrong rank says so first).
    fn require(&self, py: Python<'_>, need: Role, call: &str) -> PyResult<()> {
        if self.info.role == need {
            return Ok(());
        }
        Err(to_py(
            py,
            &xccl::Error::WrongRole(format!(
                "{call} is for {need:?} ranks; rank {} is an {:?} rank",
                self.info.rank, self.info.role
            )),
            false,
        ))
    }

    /// Calls `f` with `topk_idx` and `topk_weights` checked and converted for `tokens` tokens
    /// (borrowed where they already are int32 and float32).
    fn with_routing<'py, R>(
        &self,
        py: Python<'py>,
        topk_idx: &Bound<'py, PyAny>,
        topk_weights: &Bound<'py, PyAny>,
        tokens: usize,
        f: impl FnOnce(&[i32], &[f32]) -> PyResult<R>,
    ) -> PyResult<R> {
        let it = Tensor::import(py, topk_idx, "topk_idx")?;
        let ids = topk_ids(py, &it, tokens, self.info.topk, self.info.num_experts)?;
        let wt = Tensor::import(py, topk_weights, "topk_weights")?;
        let w = crate::tensor::topk_weights(py, &wt, tokens, self.info.topk)?;
        f(&ids, &w)
    }
}

/// What an attention rank keeps between an A2E call and its E2A: pass it to
/// :meth:`Communicator.e2a_recv` once.
///
/// Dropping a handle before its E2A receive aborts the job at once: that call can no longer
/// be answered, so every rank's current and later calls raise :class:`AbortedError` naming
/// this rank and the call's epoch (the Rust API's rule).
#[pyclass(frozen, module = "xccl", name = "A2eHandle")]
pub struct PyA2eHandle {
    handle: xccl::A2eHandle,
}

#[pymethods]
impl PyA2eHandle {
    /// Tokens sent in that A2E call.
    #[getter]
    fn num_tokens(&self) -> usize {
        self.handle.num_tokens()
    }

    /// The A2E epoch.
    #[getter]
    fn epoch(&self) -> u64 {
        self.handle.epoch()
    }

    /// Rows sent (one per (token, destination rank)).
    #[getter]
    fn total_rows(&self) -> usize {
        self.handle.total_rows()
    }

    fn __repr__(&self) -> String {
        format!(
            "xccl.A2eHandle(epoch={}, num_tokens={})",
            self.handle.epoch(),
            self.handle.num_tokens()
        )
    }
}

/// The raw `CUstream` a call on CUDA device `device` orders after: `xccl._cuda.current_stream`
/// (torch's current stream when torch has initialised CUDA, else 0, the legacy default stream).
fn consumer_stream(py: Python<'_>, device: usize) -> PyResult<u64> {
    static MODULE: PyOnceLock<Py<PyModule>> = PyOnceLock::new();
    let module = MODULE.get_or_try_init(py, || py.import("xccl._cuda").map(Bound::unbind))?;
    module
        .bind(py)
        .getattr(pyo3::intern!(py, "current_stream"))?
        .call1((device,))?
        .extract::<u64>()
        .map_err(|_| invalid(py, "xccl._cuda.current_stream returned no stream handle"))
}

/// A received batch (expert-major [`ExpertBatch`] or token-major [`TokenBatch`]) and, on a
/// `cuda` communicator, the device memory its rows were received into: recycled and kept as
/// spares together, so that steady-state receives reuse both.
#[derive(Default)]
struct WithRows<B> {
    batch: B,
    device: Option<DeviceMemory>,
}

/// An expert-major batch and its device rows.
type ExpertRows = WithRows<ExpertBatch>;

/// A token-major batch and its device rows.
type TokenRows = WithRows<TokenBatch>;

impl<B> std::ops::Deref for WithRows<B> {
    type Target = B;

    fn deref(&self) -> &B {
        &self.batch
    }
}

impl<B> WithRows<B> {
    /// The batch, and at least `need` bytes of device memory of `device` for its rows (the
    /// memory it has when large enough, else a new allocation, named `what` in an error).
    fn device_rows(
        &mut self,
        device: &Device,
        need: usize,
        what: &'static str,
    ) -> xccl::Result<(&mut B, DeviceSliceMut<'_>)> {
        let fits = |m: &DeviceMemory| m.len() >= need && m.device().ordinal() == device.ordinal();
        if need > 0 && !self.device.as_ref().is_some_and(fits) {
            // The old allocation goes first: both need not fit at once.
            self.device = None;
            self.device = Some(DeviceMemory::alloc(device, need, || what.into())?);
        }
        let rows = match self.device.as_mut() {
            Some(m) if need > 0 => m.as_slice_mut(),
            // SAFETY: an empty slice addresses nothing.
            _ => unsafe { DeviceSliceMut::from_raw(0, 0, device.ordinal()) },
        };
        Ok((&mut self.batch, rows))
    }
}

/// `values` (all below 2^31: ranks and token indices) as int32.
fn as_i32(values: &[u32]) -> Vec<i32> {
    values.iter().map(|&v| v as i32).collect()
}

/// A buffer viewing `bytes` of batch `owner` (read-only; the batch never changes), counted in
/// the batch's `views`.
fn batch_view(
    owner: &Bound<'_, PyAny>,
    views: &Arc<()>,
    bytes: &[u8],
    shape: &[usize],
    elem: Elem,
) -> Buffer {
    Buffer::new(
        Owner::Object(owner.clone().unbind(), views.clone()),
        bytes.as_ptr(),
        shape,
        elem,
        true,
        None,
    )
}

/// The rows of batch `owner` (`held`, locked as `rows`) as a read-only buffer counted in the
/// batch's views: on CUDA `device`, `shape` (`[rows, hidden]`) over its device rows (address 0
/// when there are none); else over its host rows `bytes` (`[0, hidden]` with `keep_int8`).
fn rows_view<B>(
    owner: &Bound<'_, PyAny>,
    held: &Held<WithRows<B>>,
    rows: &WithRows<B>,
    device: Option<usize>,
    shape: [usize; 2],
    bytes: &[u8],
    elem: Elem,
) -> Buffer {
    let Some(device) = device else {
        let host_rows = bytes.len() / (shape[1].max(1) * elem.size());
        return batch_view(owner, &held.views, bytes, &[host_rows, shape[1]], elem);
    };
    let ptr = match &rows.device {
        Some(m) if shape[0] > 0 => m.ptr().addr(),
        _ => 0,
    };
    let owner = Owner::Object(owner.clone().unbind(), held.views.clone());
    Buffer::on_device(owner, ptr, device, &shape, elem, true)
}

/// Per-source info as a list of dicts (``rank``, ``count``, ``first_token``).
fn sources_list<'py>(
    py: Python<'py>,
    sources: &[xccl::SourceInfo],
) -> PyResult<Bound<'py, PyList>> {
    let l = PyList::empty(py);
    for s in sources {
        let d = PyDict::new(py);
        d.set_item("rank", s.rank())?;
        d.set_item("count", s.count())?;
        d.set_item("first_token", s.first_token())?;
        d.set_item("tag", s.tag())?;
        d.set_item("arrived_after", s.arrived_after().as_secs_f64())?;
        l.append(d)?;
    }
    Ok(l)
}

/// A received batch as its Python object holds it: the batch (locked while a call or a getter
/// reads it), whether its reply went out, and whether a later receive took its memory.
///
/// A replied batch that nothing but the loop variable refers to (no buffer views it) gives its
/// memory to the next receive of its kind on its communicator ([`Recycle`]), so that a loop
/// `batch = comm.a2e_recv(); ...; comm.e2a_send(batch, out)` refills one batch, as a Rust loop
/// does, instead of alternating two (twice the memory the receive writes and the reply reads,
/// which costs cache misses at large calls). Reading the batch afterwards raises.
struct Held<B> {
    batch: Mutex<B>,
    replied: AtomicBool,
    recycled: AtomicBool,
    /// One more reference per live buffer viewing the batch ([`batch_view`]).
    views: Arc<()>,
}

impl<B: Default> Held<B> {
    fn new(batch: B) -> Self {
        Held {
            batch: Mutex::new(batch),
            replied: AtomicBool::new(false),
            recycled: AtomicBool::new(false),
            views: Arc::new(()),
        }
    }

    /// The batch, or an error once a later receive took its memory.
    fn get(&self, py: Python<'_>) -> PyResult<std::sync::MutexGuard<'_, B>> {
        if self.recycled.load(Ordering::Acquire) {
            return Err(invalid(
                py,
                "this batch was replied to and a later receive reused its memory (no buffer \
                 of it was alive): keep a buffer (batch.rows...) or a copy to read it after \
                 the next receive",
            ));
        }
        Ok(self.batch.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Its reply went out.
    fn set_replied(&self) {
        self.replied.store(true, Ordering::Release);
    }

    /// The batch's memory for a new receive, if it was replied to and nothing uses it now.
    fn take_replied(&self) -> Option<B> {
        let viewed = Arc::strong_count(&self.views) > 1;
        if viewed || !self.replied.load(Ordering::Acquire) || self.recycled.load(Ordering::Acquire)
        {
            return None;
        }
        let mut batch = self.batch.try_lock().ok()?;
        self.recycled.store(true, Ordering::Release);
        Some(std::mem::take(&mut *batch))
    }

    /// For the spare pool when the object goes: the batch if it was replied to (and not
    /// recycled); an unreplied one is dropped here, which aborts the job (Rust's rule).
    fn take_spare(&mut self) -> Option<B> {
        let batch = std::mem::take(self.batch.get_mut().unwrap_or_else(|p| p.into_inner()));
        let reusable = *self.replied.get_mut() && !*self.recycled.get_mut();
        reusable.then_some(batch)
    }
}

/// The batch a receive may refill: the last one this communicator saw replied to, of each
/// kind (a strong reference, taken back at the next receive).
#[derive(Default)]
struct Recycle {
    expert: Mutex<Option<Py<PyExpertBatch>>>,
    token: Mutex<Option<Py<PyTokenBatch>>>,
}

/// Takes the memory of the batch in `slot` when nothing but one other reference (the caller's
/// loop variable) holds it and it was replied to; `held` reaches its [`Held`].
fn recycle<T, B: Default>(
    py: Python<'_>,
    slot: &Mutex<Option<Py<T>>>,
    held: impl FnOnce(&T) -> &Held<B>,
) -> Option<B>
where
    T: pyo3::PyClass<Frozen = pyo3::pyclass::boolean_struct::True> + Sync,
{
    let last = slot.lock().unwrap_or_else(|p| p.into_inner()).take()?;
    // SAFETY: `last` is a live object (we hold a reference) and the GIL is held, which
    // `Py_REFCNT` needs to read a consistent count.
    let refs = unsafe { pyo3::ffi::Py_REFCNT(last.bind(py).as_ptr()) };
    // Ours and at most one more (the loop variable), and no buffer views it.
    if refs <= 2 {
        held(last.get()).take_replied()
    } else {
        None
    }
}

/// The rows an expert rank received in one A2E call, grouped by local expert
/// (:meth:`Communicator.a2e_recv`).
///
/// Local expert ``j`` (global id ``comm.local_experts[j]``) has rows
/// ``expert_offsets[j]:expert_offsets[j+1]`` (``num_recv_tokens_per_expert_list[j]`` of them),
/// ordered by source rank, then source token. The batch owns its memory: :attr:`rows` and the
/// other buffers view it without a copy, stay valid as long as Python holds them (or the
/// batch), and never change (no peer writes them; they are read-only). Reply with
/// :meth:`Communicator.e2a_send` once.
///
/// Dropping the batch (with every buffer viewing it) before its reply aborts the job at once,
/// naming this rank and the epoch: the attention ranks would otherwise wait out their timeout.
#[pyclass(frozen, module = "xccl", name = "ExpertBatch")]
pub struct PyExpertBatch {
    inner: Held<ExpertRows>,
    /// Where the batch's memory goes once Python drops it (after every buffer viewing it).
    spares: Arc<Spares>,
    elem: Elem,
    keep_int8: bool,
    /// The CUDA device whose memory holds the rows (a `cuda` communicator's batch).
    device: Option<usize>,
}

impl Drop for PyExpertBatch {
    /// A replied batch goes to the spare pool; an unreplied one is dropped here, which aborts
    /// the job at once naming this rank and the epoch (Rust's rule for a batch dropped before
    /// its reply). Of the spares' device rows, one allocation is kept (`Spares::give_rows`).
    fn drop(&mut self) {
        if let Some(batch) = self.inner.take_spare() {
            Spares::give_rows(&self.spares.expert, batch);
        }
    }
}

#[pymethods]
impl PyExpertBatch {
    /// The user tag of the call (:meth:`Communicator.a2e_send`'s ``tag``): the tag its first
    /// source sent (the lowest attention rank taking part; :attr:`tags` has every source's).
    #[getter]
    fn tag(&self, py: Python<'_>) -> PyResult<u64> {
        let inner = self.inner.get(py)?;
        Ok(inner.tag())
    }

    /// The tag of each source attention rank, in rank order (as :attr:`sources`).
    #[getter]
    fn tags(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        let inner = self.inner.get(py)?;
        Ok(inner.sources().iter().map(|s| s.tag()).collect())
    }

    /// Number of rows (received (token, local expert) pairs).
    #[getter]
    fn num_rows(&self, py: Python<'_>) -> PyResult<usize> {
        let inner = self.inner.get(py)?;
        Ok(inner.num_rows())
    }

    /// Number of received tokens.
    #[getter]
    fn num_tokens(&self, py: Python<'_>) -> PyResult<usize> {
        let inner = self.inner.get(py)?;
        Ok(inner.num_tokens())
    }

    /// Number of local experts.
    #[getter]
    fn num_local_experts(&self, py: Python<'_>) -> PyResult<usize> {
        let inner = self.inner.get(py)?;
        Ok(inner.num_local_experts())
    }

    /// The A2E epoch this batch came from.
    #[getter]
    fn epoch(&self, py: Python<'_>) -> PyResult<u64> {
        let inner = self.inner.get(py)?;
        Ok(inner.epoch())
    }

    /// Elements per row.
    #[getter]
    fn hidden(&self, py: Python<'_>) -> PyResult<usize> {
        let inner = self.inner.get(py)?;
        Ok(inner.hidden())
    }

    /// The rows, ``[num_rows, hidden]`` of the dtype, read-only, no copy (``[0, hidden]``
    /// with ``keep_int8``: see :attr:`int8_rows`). On the ``cuda`` fabric a CUDA
    /// :class:`Buffer`: a view of the device memory the rows were received into.
    #[getter]
    fn rows(slf: &Bound<'_, Self>) -> PyResult<Buffer> {
        let b = slf.get();
        let inner = b.inner.get(slf.py())?;
        let shape = [inner.num_rows(), inner.hidden()];
        let bytes = inner.row_bytes();
        Ok(rows_view(
            slf.as_any(),
            &b.inner,
            &inner,
            b.device,
            shape,
            bytes,
            b.elem,
        ))
    }

    /// With ``keep_int8``: the rows as ``[num_rows, hidden]`` int8 (a value is ``q *
    /// scales[row]``); ``None`` otherwise.
    #[getter]
    fn int8_rows(slf: &Bound<'_, Self>) -> PyResult<Option<Buffer>> {
        let b = slf.get();
        let inner = b.inner.get(slf.py())?;
        let (q, _) = match inner.int8_rows() {
            Some(v) => v,
            None => return Ok(None),
        };
        let bytes: &[u8] = bytemuck::cast_slice(q);
        Ok(Some(batch_view(
            slf.as_any(),
            &slf.get().inner.views,
            bytes,
            &[inner.num_rows(), inner.hidden()],
            Elem::I8,
        )))
    }

    /// With ``keep_int8``: one float32 scale per row; ``None`` otherwise.
    #[getter]
    fn scales(slf: &Bound<'_, Self>) -> PyResult<Option<Buffer>> {
        let b = slf.get();
        let inner = b.inner.get(slf.py())?;
        let (_, s) = match inner.int8_rows() {
            Some(v) => v,
            None => return Ok(None),
        };
        Ok(Some(batch_view(
            slf.as_any(),
            &slf.get().inner.views,
            bytemuck::cast_slice(s),
            &[s.len()],
            Elem::F32,
        )))
    }

    /// Whether rows were kept as INT8 (``Config(keep_int8=True)``).
    #[getter]
    fn keep_int8(&self) -> bool {
        self.keep_int8
    }

    /// Rows per local expert, as a list (like DeepEP's ``num_recv_tokens_per_expert_list``).
    #[getter]
    fn num_recv_tokens_per_expert_list(&self, py: Python<'_>) -> PyResult<Vec<usize>> {
        let inner = self.inner.get(py)?;
        Ok({
            (0..inner.num_local_experts())
                .map(|j| inner.expert_rows(j).len())
                .collect()
        })
    }

    /// Rows per local expert, as an int32 :class:`Buffer`.
    #[getter]
    fn num_recv_tokens_per_expert(&self, py: Python<'_>) -> PyResult<Buffer> {
        let inner = self.inner.get(py)?;
        Ok({
            let counts: Vec<i32> = (0..inner.num_local_experts())
                .map(|j| inner.expert_rows(j).len() as i32)
                .collect();
            Buffer::copy_of(&counts, &[counts.len()], Elem::I32)
        })
    }

    /// ``expert_offsets[j]:expert_offsets[j+1]`` are the rows of local expert ``j``.
    #[getter]
    fn expert_offsets(&self, py: Python<'_>) -> PyResult<Vec<usize>> {
        let inner = self.inner.get(py)?;
        Ok({
            let l = inner.num_local_experts();
            let mut v: Vec<usize> = (0..l).map(|j| inner.expert_rows(j).start).collect();
            v.push(if l == 0 {
                0
            } else {
                inner.expert_rows(l - 1).end
            });
            v
        })
    }

    /// Per row: the attention rank it came from (int32).
    #[getter]
    fn src_rank(&self, py: Python<'_>) -> PyResult<Buffer> {
        let inner = self.inner.get(py)?;
        Ok({
            let v = as_i32(inner.src_rank());
            Buffer::copy_of(&v, &[v.len()], Elem::I32)
        })
    }

    /// Per row: its token index at that attention rank (int32).
    #[getter]
    fn src_token(&self, py: Python<'_>) -> PyResult<Buffer> {
        let inner = self.inner.get(py)?;
        Ok({
            let v = as_i32(inner.src_token());
            Buffer::copy_of(&v, &[v.len()], Elem::I32)
        })
    }

    /// Per row: the gating weight of its (token, expert), float32, read-only, no copy.
    #[getter]
    fn weights(slf: &Bound<'_, Self>) -> PyResult<Buffer> {
        let inner = slf.get().inner.get(slf.py())?;
        let w = inner.weight();
        Ok(batch_view(
            slf.as_any(),
            &slf.get().inner.views,
            bytemuck::cast_slice(w),
            &[w.len()],
            Elem::F32,
        ))
    }

    /// Row indices of received token ``i`` (one per local expert it selected, ascending).
    fn token_rows(&self, py: Python<'_>, i: usize) -> PyResult<Vec<u32>> {
        let inner = self.inner.get(py)?;
        if i >= inner.num_tokens() {
            return Err(invalid(
                py,
                format!(
                    "token {i} is outside the batch's {} tokens",
                    inner.num_tokens()
                ),
            ));
        }
        Ok(inner.token_rows(i).to_vec())
    }

    /// Per source attention rank, in rank order: ``rank``, ``count`` (tokens),
    /// ``first_token``, ``arrived_after`` (seconds).
    #[getter]
    fn sources<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let inner = self.inner.get(py)?;
        sources_list(py, inner.sources())
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let Ok(inner) = self.inner.get(py) else {
            return "xccl.ExpertBatch(recycled by a later receive)".into();
        };
        let per_expert: Vec<usize> = (0..inner.num_local_experts())
            .map(|j| inner.expert_rows(j).len())
            .collect();
        format!(
            "xccl.ExpertBatch(epoch={}, rows={}, tokens={}, per_expert={per_expert:?})",
            inner.epoch(),
            inner.num_rows(),
            inner.num_tokens(),
        )
    }
}

/// The tokens an expert rank received in one A2E call, one row each
/// (:meth:`Communicator.a2e_recv_tokens`), each source's tokens consecutive.
///
/// Token ``i`` selected local experts ``expert_ids[i, :]`` (ascending, padded with -1) with
/// weights ``expert_weights[i, :]`` (padded with 0). Buffers as for :class:`ExpertBatch`.
/// Reply with :meth:`Communicator.e2a_send_tokens` once; dropping it before the reply aborts
/// the job at once, as for :class:`ExpertBatch`.
#[pyclass(frozen, module = "xccl", name = "TokenBatch")]
pub struct PyTokenBatch {
    inner: Held<TokenRows>,
    /// As [`PyExpertBatch::spares`].
    spares: Arc<Spares>,
    elem: Elem,
    hidden: usize,
    topk: usize,
    keep_int8: bool,
    /// The CUDA device whose memory holds the rows (a `cuda` communicator's batch).
    device: Option<usize>,
}

impl Drop for PyTokenBatch {
    /// A replied batch goes to the spare pool; an unreplied one is dropped here, which aborts
    /// the job at once naming this rank and the epoch (Rust's rule for a batch dropped before
    /// its reply). Of the spares' device rows, one allocation is kept (`Spares::give_rows`).
    fn drop(&mut self) {
        if let Some(batch) = self.inner.take_spare() {
            Spares::give_rows(&self.spares.token, batch);
        }
    }
}

#[pymethods]
impl PyTokenBatch {
    /// The user tag of the call (:meth:`Communicator.a2e_send`'s ``tag``): the tag its first
    /// source sent (the lowest attention rank taking part; :attr:`tags` has every source's).
    #[getter]
    fn tag(&self, py: Python<'_>) -> PyResult<u64> {
        let inner = self.inner.get(py)?;
        Ok(inner.tag())
    }

    /// The tag of each source attention rank, in rank order (as :attr:`sources`).
    #[getter]
    fn tags(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        let inner = self.inner.get(py)?;
        Ok(inner.sources().iter().map(|s| s.tag()).collect())
    }

    /// Number of received tokens.
    #[getter]
    fn num_tokens(&self, py: Python<'_>) -> PyResult<usize> {
        let inner = self.inner.get(py)?;
        Ok(inner.num_tokens())
    }

    /// The A2E epoch this batch came from.
    #[getter]
    fn epoch(&self, py: Python<'_>) -> PyResult<u64> {
        let inner = self.inner.get(py)?;
        Ok(inner.epoch())
    }

    /// The rows, ``[num_tokens, hidden]`` of the dtype, read-only, no copy (``[0, hidden]``
    /// with ``keep_int8``). On the ``cuda`` fabric a CUDA :class:`Buffer`: a view of the
    /// device memory the rows were received into (row ``i`` is token ``i``).
    #[getter]
    fn rows(slf: &Bound<'_, Self>) -> PyResult<Buffer> {
        let b = slf.get();
        let inner = b.inner.get(slf.py())?;
        let shape = [inner.num_tokens(), b.hidden];
        let bytes = inner.row_bytes();
        Ok(rows_view(
            slf.as_any(),
            &b.inner,
            &inner,
            b.device,
            shape,
            bytes,
            b.elem,
        ))
    }

    /// With ``keep_int8``: the rows as ``[num_tokens, hidden]`` int8; ``None`` otherwise.
    #[getter]
    fn int8_rows(slf: &Bound<'_, Self>) -> PyResult<Option<Buffer>> {
        let b = slf.get();
        let inner = b.inner.get(slf.py())?;
        let (q, s) = match inner.int8_rows() {
            Some(v) => v,
            None => return Ok(None),
        };
        let shape = [s.len(), b.hidden];
        Ok(Some(batch_view(
            slf.as_any(),
            &slf.get().inner.views,
            bytemuck::cast_slice(q),
            &shape,
            Elem::I8,
        )))
    }

    /// With ``keep_int8``: one float32 scale per token; ``None`` otherwise.
    #[getter]
    fn scales(slf: &Bound<'_, Self>) -> PyResult<Option<Buffer>> {
        let b = slf.get();
        let inner = b.inner.get(slf.py())?;
        let (_, s) = match inner.int8_rows() {
            Some(v) => v,
            None => return Ok(None),
        };
        Ok(Some(batch_view(
            slf.as_any(),
            &slf.get().inner.views,
            bytemuck::cast_slice(s),
            &[s.len()],
            Elem::F32,
        )))
    }

    /// Whether rows were kept as INT8.
    #[getter]
    fn keep_int8(&self) -> bool {
        self.keep_int8
    }

    /// Per token: the attention rank it came from (int32).
    #[getter]
    fn src_rank(&self, py: Python<'_>) -> PyResult<Buffer> {
        let inner = self.inner.get(py)?;
        Ok({
            let v = as_i32(inner.src_rank());
            Buffer::copy_of(&v, &[v.len()], Elem::I32)
        })
    }

    /// Per token: its index at that attention rank (int32).
    #[getter]
    fn src_token(&self, py: Python<'_>) -> PyResult<Buffer> {
        let inner = self.inner.get(py)?;
        Ok({
            let v = as_i32(inner.src_token());
            Buffer::copy_of(&v, &[v.len()], Elem::I32)
        })
    }

    /// Per token: its local expert indices, ``[num_tokens, topk]`` int32, ascending, padded
    /// with -1.
    #[getter]
    fn expert_ids(&self, py: Python<'_>) -> PyResult<Buffer> {
        let inner = self.inner.get(py)?;
        Ok({
            let (t, k) = (inner.num_tokens(), self.topk);
            let mut v = vec![-1i32; t * k];
            for i in 0..t {
                let (ids, _) = inner.experts_of(i);
                for (c, &j) in ids.iter().enumerate() {
                    v[i * k + c] = j as i32;
                }
            }
            Buffer::copy_of(&v, &[t, k], Elem::I32)
        })
    }

    /// Per token: the gating weights of its local experts, ``[num_tokens, topk]`` float32,
    /// padded with 0.
    #[getter]
    fn expert_weights(&self, py: Python<'_>) -> PyResult<Buffer> {
        let inner = self.inner.get(py)?;
        Ok({
            let (t, k) = (inner.num_tokens(), self.topk);
            let mut v = vec![0f32; t * k];
            for i in 0..t {
                let (_, ws) = inner.experts_of(i);
                v[i * k..i * k + ws.len()].copy_from_slice(ws);
            }
            Buffer::copy_of(&v, &[t, k], Elem::F32)
        })
    }

    /// Local expert indices and weights of token ``i``, as two lists.
    fn experts_of(&self, py: Python<'_>, i: usize) -> PyResult<(Vec<u32>, Vec<f32>)> {
        let inner = self.inner.get(py)?;
        if i >= inner.num_tokens() {
            return Err(invalid(
                py,
                format!(
                    "token {i} is outside the batch's {} tokens",
                    inner.num_tokens()
                ),
            ));
        }
        let (ids, ws) = inner.experts_of(i);
        Ok((ids.to_vec(), ws.to_vec()))
    }

    /// Per source attention rank, in rank order (as :attr:`ExpertBatch.sources`).
    #[getter]
    fn sources<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let inner = self.inner.get(py)?;
        sources_list(py, inner.sources())
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        match self.inner.get(py) {
            Ok(inner) => format!(
                "xccl.TokenBatch(epoch={}, tokens={})",
                inner.epoch(),
                inner.num_tokens()
            ),
            Err(_) => "xccl.TokenBatch(recycled by a later receive)".into(),
        }
    }
}
