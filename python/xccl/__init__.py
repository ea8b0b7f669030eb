"""xccl: token exchange between attention and expert ranks for disaggregated MoE serving.

Attention ranks send tokens to the expert ranks hosting their top-k experts (A2E, dispatch)
and receive the gating-weighted sum of the expert outputs back (E2A, combine), over shared
memory (``"shm"``), libfabric (``"ofi"``) or Ascend (``"ascend"``). This package is a PyO3
extension over the Rust library: tensors go in and out through DLPack (torch, numpy, JAX; CPU
memory), every input is checked before anything is sent, and errors are the exceptions of
:mod:`xccl.errors`.

Quickstart (every rank runs this; ranks 0..1 attention, 2..3 expert)::

    import torch, xccl
    topo = xccl.Topology(2, 2, num_experts=8)
    cfg = xccl.Config(hidden=1024, dtype=torch.bfloat16, topk=2, max_tokens_per_rank=128)
    with xccl.Communicator.from_env(topo, cfg) as comm:   # torchrun / mpirun / srun
        if comm.role == "attention":
            handle = comm.a2e_send(x, topk_idx, topk_weights)
            y = torch.from_dlpack(comm.e2a_recv(handle))
        else:
            batch = comm.a2e_recv()
            rows = torch.from_dlpack(batch.rows)          # [num_rows, hidden], no copy
            comm.e2a_send(batch, run_experts(rows, batch.num_recv_tokens_per_expert_list))

Logging: the library logs to the ``logging`` logger ``xccl`` (and its children); the
environment variable ``XCCL_DEBUG`` (``off``, ``error``, ``warn`` (default), ``info``,
``debug``, ``trace``) sets the level, and when it is set and ``logging`` has no handler, a
stderr handler is added.
"""

from __future__ import annotations

import logging as _logging
import os as _os

from . import errors
from ._xccl import (
    A2eHandle,
    Buffer,
    Communicator,
    Config,
    ExpertBatch,
    TokenBatch,
    Topology,
    UniqueId,
    __version__,
    _debug_level,
)
from .errors import (
    AbortedError,
    BootstrapError,
    ExpertLostError,
    FabricUnavailableError,
    InterruptedError,
    InvalidArgumentError,
    OsError,
    PeerFailedError,
    ProtocolError,
    TimeoutError,
    WrongRoleError,
    XcclError,
)

__all__ = [
    "A2eHandle",
    "AbortedError",
    "BootstrapError",
    "Buffer",
    "Communicator",
    "Config",
    "ExpertBatch",
    "ExpertLostError",
    "FabricUnavailableError",
    "InterruptedError",
    "InvalidArgumentError",
    "OsError",
    "PeerFailedError",
    "ProtocolError",
    "TimeoutError",
    "TokenBatch",
    "Topology",
    "UniqueId",
    "WrongRoleError",
    "XcclError",
    "__version__",
    "errors",
    "init_from_process_group",
]

_LEVELS = {
    "off": _logging.CRITICAL + 10,
    "error": _logging.ERROR,
    "warn": _logging.WARNING,
    "info": _logging.INFO,
    "debug": _logging.DEBUG,
    "trace": _logging.DEBUG - 5,
}


def _configure_logging() -> None:
    logger = _logging.getLogger("xccl")
    if not _os.environ.get("XCCL_DEBUG"):
        return
    logger.setLevel(_LEVELS.get(_debug_level, _logging.WARNING))
    if not logger.handlers and not _logging.getLogger().handlers:
        handler = _logging.StreamHandler()
        handler.setFormatter(_logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)


_configure_logging()


def init_from_process_group(
    group,
    topology: Topology,
    config: Config,
    *,
    fabric: str = "shm",
    device: int | None = None,
    role: str | None = None,
    timeout: float = 60.0,
) -> Communicator:
    """Joins an xccl job over the ranks of an existing ``torch.distributed`` process group
    (``None`` for the default group), as engines do for NCCL: rank 0 of the group makes the
    :class:`UniqueId` (starting the rendezvous root in its process) and broadcasts its string
    over the group; every rank then calls :meth:`Communicator.init` with its group rank.

    Collective over ``group``. Other arguments as for :meth:`Communicator.init`.
    """
    import torch.distributed as dist

    rank = dist.get_rank(group)
    world_size = dist.get_world_size(group)
    box = [UniqueId.new().hex()] if rank == 0 else [None]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return Communicator.init(
        topology,
        config,
        unique_id=box[0],
        rank=rank,
        world_size=world_size,
        fabric=fabric,
        device=device,
        role=role,
        timeout=timeout,
    )
