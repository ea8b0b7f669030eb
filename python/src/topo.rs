//! What every rank agrees on before it joins: [`PyTopology`] (roles, expert placement, relays,
//! domains), [`PyConfig`] (the MoE config) and [`PyUniqueId`] (the rendezvous name).

use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyType;
use xccl::bootstrap::{UniqueId, UNIQUE_ID_ENV};
use xccl::{DType, MoeConfig, Quant, Role, Topology, TopologyBuilder, TransferMode};

use crate::errors::{invalid, to_py};

/// The longest timeout a call takes, in seconds (a year): longer ones would overflow a
/// deadline; a receive that waits while its peers live takes ``timeout=None`` instead.
pub(crate) const MAX_TIMEOUT_S: f64 = 365.0 * 86_400.0;

/// `s` seconds, in `(0, MAX_TIMEOUT_S]`, else a `ValueError` (`InvalidArgumentError`) naming
/// the range.
pub(crate) fn seconds(py: Python<'_>, what: &str, s: f64) -> PyResult<Duration> {
    if s > 0.0 && s <= MAX_TIMEOUT_S {
        Ok(Duration::from_secs_f64(s))
    } else {
        Err(invalid(
            py,
            format!(
                "{what} must be in (0, {MAX_TIMEOUT_S:.0}] seconds (a year at most), got {s:?}"
            ),
        ))
    }
}

/// Parses a role name.
pub(crate) fn parse_role(py: Python<'_>, s: &str) -> PyResult<Role> {
    match s.to_ascii_lowercase().as_str() {
        "attention" | "a" => Ok(Role::Attention),
        "expert" | "e" => Ok(Role::Expert),
        other => Err(invalid(
            py,
            format!("unknown role {other:?} (expected \"attention\" or \"expert\")"),
        )),
    }
}

/// The name of a role.
pub(crate) fn role_name(r: Role) -> &'static str {
    match r {
        Role::Attention => "attention",
        Role::Expert => "expert",
    }
}

/// Relays asked for.
#[derive(Clone, Debug)]
enum Relays {
    None,
    Count(usize),
    Ranks(Vec<usize>),
}

/// The roles of a job's ranks and where its experts live (`xccl::Topology`).
///
/// ``Topology(num_attention, num_expert, num_experts)`` puts attention ranks first (ranks
/// ``0..num_attention``) and spreads the experts contiguously over the expert ranks. Keyword
/// arguments:
///
/// - ``roles``: the role of each rank (``"attention"``/``"expert"``) for any other order;
///   ``num_attention``/``num_expert`` must match its counts. Instead, a rank may state its own
///   role at init (``Communicator.init(..., role=...)``): the roles are then gathered from every
///   rank and the topology built from them.
/// - ``placement``: ``placement[e]`` lists the ranks hosting a replica of expert ``e`` (the
///   first is the primary).
/// - ``relays``: a number of relays spread over the expert ranks, or the list of relay ranks.
/// - ``domains``: DP domains: attention ranks in that many groups taking calls in turn.
#[pyclass(frozen, module = "xccl", name = "Topology")]
pub struct PyTopology {
    num_attention: usize,
    num_expert: usize,
    num_experts: usize,
    placement: Option<Vec<Vec<usize>>>,
    relays: Relays,
    domains: usize,
    pub(crate) built: Arc<Topology>,
}

impl PyTopology {
    /// Builds the topology with `roles` (rank order), or attention-first when `None`.
    fn build(&self, roles: Option<Vec<Role>>) -> xccl::Result<Topology> {
        let roles = roles.unwrap_or_else(|| {
            let mut r = vec![Role::Attention; self.num_attention];
            r.resize(self.num_attention + self.num_expert, Role::Expert);
            r
        });
        let count = |role| roles.iter().filter(|&&r| r == role).count();
        let (m, n) = (count(Role::Attention), count(Role::Expert));
        if (m, n) != (self.num_attention, self.num_expert) {
            return Err(xccl::Error::invalid(format!(
                "the roles name {m} attention and {n} expert ranks; the topology was declared \
                 with {} and {}",
                self.num_attention, self.num_expert
            )));
        }
        let mut b = TopologyBuilder::new(roles, self.num_experts);
        if let Some(p) = &self.placement {
            b = b.placement(p.clone());
        }
        let mut topo = b.build()?;
        topo = match &self.relays {
            Relays::None => topo,
            Relays::Count(c) => topo.with_relays(Some(*c))?,
            Relays::Ranks(ranks) => {
                let plan = xccl::RelayPlan::explicit(&topo, ranks.clone())?;
                topo.with_relay_plan(plan)?
            }
        };
        if self.domains != 1 {
            topo = topo.with_domains(self.domains)?;
        }
        Ok(topo)
    }

    /// The topology with the roles gathered at init.
    pub(crate) fn with_roles(&self, roles: Vec<Role>) -> xccl::Result<Arc<Topology>> {
        self.build(Some(roles)).map(Arc::new)
    }
}

#[pymethods]
impl PyTopology {
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (num_attention, num_expert, num_experts, *, roles = None, placement = None, relays = None, domains = 1))]
    fn new(
        py: Python<'_>,
        num_attention: usize,
        num_expert: usize,
        num_experts: usize,
        roles: Option<Vec<String>>,
        placement: Option<Vec<Vec<usize>>>,
        relays: Option<&Bound<'_, PyAny>>,
        domains: usize,
    ) -> PyResult<Self> {
        let relays = match relays {
            None => Relays::None,
            Some(r) if r.is_none() => Relays::None,
            Some(r) => match r.extract::<usize>() {
                Ok(c) => Relays::Count(c),
                Err(_) => Relays::Ranks(r.extract::<Vec<usize>>().map_err(|_| {
                    invalid(
                        py,
                        "relays must be a number of relays or a list of relay ranks",
                    )
                })?),
            },
        };
        let roles = roles
            .map(|rs| {
                rs.iter()
                    .map(|s| parse_role(py, s))
                    .collect::<PyResult<Vec<_>>>()
            })
            .transpose()?;
        let mut t = PyTopology {
            num_attention,
            num_expert,
            num_experts,
            placement,
            relays,
            domains,
            built: Arc::new(Topology::contiguous(1, 1, 1).map_err(|e| to_py(py, &e, false))?),
        };
        t.built = Arc::new(t.build(roles).map_err(|e| to_py(py, &e, false))?);
        Ok(t)
    }

    /// Number of ranks.
    #[getter]
    fn world_size(&self) -> usize {
        self.built.world_size()
    }

    /// The attention ranks, ascending.
    #[getter]
    fn attention_ranks(&self) -> Vec<usize> {
        self.built.attention_ranks().to_vec()
    }

    /// The expert ranks, ascending.
    #[getter]
    fn expert_ranks(&self) -> Vec<usize> {
        self.built.expert_ranks().to_vec()
    }

    /// Number of (global) experts.
    #[getter]
    fn num_experts(&self) -> usize {
        self.built.num_experts()
    }

    /// The role of each rank (``"attention"``/``"expert"``).
    #[getter]
    fn roles(&self) -> Vec<&'static str> {
        (0..self.built.world_size())
            .map(|r| role_name(self.built.role(r)))
            .collect()
    }

    /// The relay ranks (empty without relays).
    #[getter]
    fn relays(&self) -> Vec<usize> {
        self.built
            .relay_plan()
            .map(|p| p.relays().to_vec())
            .unwrap_or_default()
    }

    /// Number of DP domains.
    #[getter]
    fn domains(&self) -> usize {
        self.built.num_domains()
    }

    /// The global ids of the experts `rank` hosts, ascending (their local index is their
    /// position in this list; empty for an attention rank).
    fn local_experts(&self, rank: usize) -> Vec<usize> {
        if rank >= self.built.world_size() {
            return Vec::new();
        }
        self.built.local_experts(rank).to_vec()
    }

    /// The ranks hosting a replica of `expert` (the first is the primary).
    fn replicas(&self, expert: usize) -> Vec<usize> {
        if expert >= self.built.num_experts() {
            return Vec::new();
        }
        self.built.replicas(expert).to_vec()
    }

    fn __repr__(&self) -> String {
        format!(
            "xccl.Topology({} attention, {} expert ranks, {} experts{}{})",
            self.num_attention,
            self.num_expert,
            self.num_experts,
            match &self.relays {
                Relays::None => String::new(),
                _ => format!(", relays {:?}", self.relays()),
            },
            if self.domains != 1 {
                format!(", {} domains", self.domains)
            } else {
                String::new()
            }
        )
    }
}

/// A dtype given as a string (``"bf16"``, ``"float32"``), a ``torch.dtype`` or a numpy dtype.
pub(crate) fn parse_dtype(py: Python<'_>, d: &Bound<'_, PyAny>) -> PyResult<DType> {
    let name: String = if let Ok(s) = d.extract::<String>() {
        s
    } else if let Ok(n) = d.getattr("name").and_then(|n| n.extract::<String>()) {
        n
    } else if let Ok(n) = d.getattr("__name__").and_then(|n| n.extract::<String>()) {
        n
    } else {
        d.str()?.to_string_lossy().into_owned()
    };
    let name = name.trim_start_matches("torch.").to_string();
    DType::parse(&name).map_err(|e| to_py(py, &e, false))
}

/// What every rank of a job agrees on for its exchanges (`xccl::MoeConfig`).
///
/// ``Config(hidden, dtype, topk, max_tokens_per_rank)``: rows of ``hidden`` elements of
/// ``dtype`` (``"f32"``, ``"f16"``, ``"bf16"``, or a torch/numpy dtype), ``topk`` routing
/// entries per token, at most ``max_tokens_per_rank`` tokens per attention rank and call.
/// Keyword arguments: ``max_in_flight`` (microbatches between their A2E and E2A, default 2),
/// ``timeout`` (seconds per call, default 30), ``mode`` (``"push"``/``"pull"``), ``a2e_quant``
/// / ``e2a_quant`` (``"int8"`` for INT8 rows with one f32 scale per token on the wire),
/// ``keep_int8`` (expert ranks receive rows as INT8 plus scales), ``recv_capacity`` (rows an
/// expert rank takes from one attention rank per call; 0 = the worst case).
#[pyclass(frozen, module = "xccl", name = "Config")]
pub struct PyConfig {
    pub(crate) cfg: MoeConfig,
}

#[pymethods]
impl PyConfig {
    #[new]
    #[pyo3(signature = (hidden, dtype, topk, max_tokens_per_rank, *, max_in_flight = 2, timeout = 30.0, mode = "push", a2e_quant = None, e2a_quant = None, keep_int8 = false, recv_capacity = 0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        hidden: usize,
        dtype: &Bound<'_, PyAny>,
        topk: usize,
        max_tokens_per_rank: usize,
        max_in_flight: usize,
        timeout: f64,
        mode: &str,
        a2e_quant: Option<&str>,
        e2a_quant: Option<&str>,
        keep_int8: bool,
        recv_capacity: usize,
    ) -> PyResult<Self> {
        let err = |e: xccl::Error| to_py(py, &e, false);
        let mut cfg = MoeConfig::new(hidden, parse_dtype(py, dtype)?, topk, max_tokens_per_rank);
        cfg.max_in_flight = max_in_flight;
        cfg.timeout = seconds(py, "timeout", timeout)?;
        cfg.mode = TransferMode::parse(mode).map_err(err)?;
        cfg.a2e_quant = a2e_quant
            .map(Quant::parse)
            .transpose()
            .map_err(err)?
            .unwrap_or_default();
        cfg.e2a_quant = e2a_quant
            .map(Quant::parse)
            .transpose()
            .map_err(err)?
            .unwrap_or_default();
        cfg.keep_int8 = keep_int8;
        cfg.recv_capacity = recv_capacity;
        Ok(PyConfig { cfg })
    }

    /// Elements per token row.
    #[getter]
    fn hidden(&self) -> usize {
        self.cfg.hidden
    }

    /// The dtype's name: ``"f32"``, ``"f16"`` or ``"bf16"``.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.cfg.dtype.name()
    }

    /// Routing entries per token.
    #[getter]
    fn topk(&self) -> usize {
        self.cfg.topk
    }

    /// Most tokens per attention rank and call.
    #[getter]
    fn max_tokens_per_rank(&self) -> usize {
        self.cfg.max_tokens_per_rank
    }

    /// Microbatches in flight.
    #[getter]
    fn max_in_flight(&self) -> usize {
        self.cfg.max_in_flight
    }

    /// Deadline of a call, in seconds.
    #[getter]
    fn timeout(&self) -> f64 {
        self.cfg.timeout.as_secs_f64()
    }

    /// ``"push"`` or ``"pull"``.
    #[getter]
    fn mode(&self) -> &'static str {
        self.cfg.mode.name()
    }

    /// Wire format of A2E rows: ``"none"`` or ``"int8"``.
    #[getter]
    fn a2e_quant(&self) -> &'static str {
        self.cfg.a2e_quant.name()
    }

    /// Wire format of E2A rows: ``"none"`` or ``"int8"``.
    #[getter]
    fn e2a_quant(&self) -> &'static str {
        self.cfg.e2a_quant.name()
    }

    /// Whether expert ranks keep received rows as INT8 plus scales.
    #[getter]
    fn keep_int8(&self) -> bool {
        self.cfg.keep_int8
    }

    fn __repr__(&self) -> String {
        format!(
            "xccl.Config(hidden={}, dtype={:?}, topk={}, max_tokens_per_rank={}, max_in_flight={})",
            self.cfg.hidden,
            self.cfg.dtype.name(),
            self.cfg.topk,
            self.cfg.max_tokens_per_rank,
            self.cfg.max_in_flight
        )
    }
}

/// The name of a job's rendezvous, like NCCL's unique id: made once (:meth:`new`, which starts
/// the rendezvous root in the calling process; that process must outlive every rank's join)
/// and handed to every rank as its hex string (:meth:`hex`, 256 characters).
///
/// The id carries the job's secret key: whoever holds it can join the job. ``repr()`` and
/// ``str()`` show the job id and the root's address only, never the key; :meth:`hex` is the
/// one way to the whole id. Hand it to other processes in their environment
/// (``XCCL_UNIQUE_ID``, read by :meth:`from_env`), a pipe or a broadcast, never on a command
/// line.
#[pyclass(frozen, module = "xccl", name = "UniqueId")]
pub struct PyUniqueId {
    pub(crate) id: UniqueId,
}

#[pymethods]
impl PyUniqueId {
    /// Starts a rendezvous root in this process (on ``XCCL_SOCKET_ADDR``, default 127.0.0.1)
    /// and returns the id naming it. The root runs on a thread of this process: the process
    /// must live until every rank has joined (a launcher that forks its ranks makes the id
    /// first and puts :meth:`hex` in their environment as ``XCCL_UNIQUE_ID``).
    #[staticmethod]
    fn new(py: Python<'_>) -> PyResult<Self> {
        let id = py.detach(UniqueId::new).map_err(|e| to_py(py, &e, false))?;
        Ok(PyUniqueId { id })
    }

    /// The id written as :meth:`hex` (surrounding whitespace allowed).
    #[classmethod]
    fn from_string(_cls: &Bound<'_, PyType>, py: Python<'_>, s: &str) -> PyResult<Self> {
        let id = s
            .trim()
            .parse::<UniqueId>()
            .map_err(|e| to_py(py, &e, false))?;
        Ok(PyUniqueId { id })
    }

    /// The id in the environment variable ``XCCL_UNIQUE_ID`` (its :meth:`hex`), as a launcher
    /// put it there; :class:`BootstrapError` when it is unset or malformed.
    #[classmethod]
    fn from_env(_cls: &Bound<'_, PyType>, py: Python<'_>) -> PyResult<Self> {
        match UniqueId::from_env() {
            Ok(Some(id)) => Ok(PyUniqueId { id }),
            Ok(None) => Err(to_py(
                py,
                &xccl::Error::Bootstrap(format!(
                    "{UNIQUE_ID_ENV} is not set: the launcher puts the id's hex() there"
                )),
                false,
            )),
            Err(e) => Err(to_py(py, &e, false)),
        }
    }

    /// The whole id as 256 hex characters, key included: a secret (see the class docs).
    fn hex(&self) -> String {
        self.id.to_string()
    }

    /// The job id (not a secret: it names the job in logs and errors).
    #[getter]
    fn job_id(&self) -> u64 {
        self.id.job_id()
    }

    /// The rendezvous root's address, ``"host:port"``.
    #[getter]
    fn root(&self) -> String {
        self.id.root_addr().to_string()
    }

    fn __str__(&self) -> String {
        self.__repr__()
    }

    fn __repr__(&self) -> String {
        format!(
            "xccl.UniqueId(job_id={:016x}, root={}, key hidden)",
            self.id.job_id(),
            self.id.root_addr()
        )
    }
}

/// A unique id given as a `UniqueId` or its string.
pub(crate) fn unique_id(py: Python<'_>, v: &Bound<'_, PyAny>) -> PyResult<UniqueId> {
    if let Ok(u) = v.cast::<PyUniqueId>() {
        return Ok(u.get().id);
    }
    let s: String = v
        .extract()
        .map_err(|_| invalid(py, "unique_id must be a UniqueId or its hex() string"))?;
    s.trim()
        .parse::<UniqueId>()
        .map_err(|e| to_py(py, &e, false))
}
