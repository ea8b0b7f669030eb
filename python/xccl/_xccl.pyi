"""Typed stubs of the extension module ``xccl._xccl`` (re-exported by ``xccl``): the source of
truth for the package's API. Tensors in are any object with ``__dlpack__`` (torch CPU tensors,
numpy >= 1.22, JAX CPU arrays), numpy arrays of ``ml_dtypes.bfloat16``, or (through numpy) the
buffer protocol; on a communicator of the ``cuda`` fabric, CUDA tensors of its device (DLPack
``kDLCUDA``: torch, CuPy, JAX), taken on the current stream (torch's, else the legacy default
stream). Tensors out are :class:`Buffer` (host memory, or device memory on the ``cuda``
fabric)."""

from collections.abc import Sequence
from typing import Any

from typing_extensions import Self, TypeAlias

__version__: str
_debug_level: str

Tensor: TypeAlias = Any
"""Anything with ``__dlpack__`` (CPU memory; CUDA memory of the communicator's device on the
``cuda`` fabric), or the buffer protocol."""

class Buffer:
    """A block of memory exported through DLPack without a copy (``torch.from_dlpack(buf)``,
    ``np.from_dlpack(buf)`` for host memory). Its memory stays valid as long as Python holds
    the buffer or a tensor made from it. E2A results and batch metadata are yours (writable);
    batch rows are read-only; :meth:`Communicator.a2e_input` is writable until
    :meth:`Communicator.a2e_send_input`.

    On the ``cuda`` fabric, E2A results and batch rows are device memory of the communicator's
    GPU (``__dlpack_device__()`` is ``(2, id)``), complete when the call returned: every legal
    ``stream`` of ``__dlpack__`` (``None``, -1, 1, 2, a stream pointer) is honoured without a
    synchronization; 0 and values below -1 raise ``ValueError``, a request for another device
    or a copy ``BufferError``."""

    def __dlpack__(
        self,
        *,
        stream: Any | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> tuple[int, int]:
        """``(1, 0)`` for host memory, ``(2, id)`` for memory of CUDA device ``id``."""
    @property
    def device(self) -> str:
        """``"cpu"`` or ``"cuda:<id>"``."""
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> str:
        """``"float32"``, ``"float16"``, ``"bfloat16"``, ``"int32"``, ``"int8"``..."""
    @property
    def nbytes(self) -> int: ...
    @property
    def readonly(self) -> bool: ...
    def __len__(self) -> int: ...
    def numpy(self) -> Any:
        """This memory as a numpy array, no copy (bfloat16 as ``ml_dtypes.bfloat16``); host
        memory only."""
    def bits(self) -> Buffer:
        """The same memory as unsigned integers of the element's width, for bitwise checks."""

class Topology:
    """Roles of the ranks and placement of the experts (``xccl::Topology``)."""

    def __init__(
        self,
        num_attention: int,
        num_expert: int,
        num_experts: int,
        *,
        roles: Sequence[str] | None = None,
        placement: Sequence[Sequence[int]] | None = None,
        relays: int | Sequence[int] | None = None,
        domains: int = 1,
    ) -> None: ...
    @property
    def world_size(self) -> int: ...
    @property
    def attention_ranks(self) -> list[int]: ...
    @property
    def expert_ranks(self) -> list[int]: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def roles(self) -> list[str]: ...
    @property
    def relays(self) -> list[int]: ...
    @property
    def domains(self) -> int: ...
    def local_experts(self, rank: int) -> list[int]: ...
    def replicas(self, expert: int) -> list[int]: ...

class Config:
    """What every rank agrees on (``xccl::MoeConfig``)."""

    def __init__(
        self,
        hidden: int,
        dtype: Any,
        topk: int,
        max_tokens_per_rank: int,
        *,
        max_in_flight: int = 2,
        timeout: float = 30.0,
        mode: str = "push",
        a2e_quant: str | None = None,
        e2a_quant: str | None = None,
        keep_int8: bool = False,
        recv_capacity: int = 0,
    ) -> None: ...
    @property
    def hidden(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def topk(self) -> int: ...
    @property
    def max_tokens_per_rank(self) -> int: ...
    @property
    def max_in_flight(self) -> int: ...
    @property
    def timeout(self) -> float: ...
    @property
    def mode(self) -> str: ...
    @property
    def a2e_quant(self) -> str: ...
    @property
    def e2a_quant(self) -> str: ...
    @property
    def keep_int8(self) -> bool: ...

class UniqueId:
    """The rendezvous name; it carries the job's key (a secret): ``repr``/``str`` show the job
    id and root only, :meth:`hex` is the whole id (256 hex characters)."""

    @staticmethod
    def new() -> UniqueId:
        """Starts the rendezvous root in this process (which must live until every rank has
        joined) and returns its id."""
    @classmethod
    def from_string(cls, s: str) -> UniqueId:
        """The id written as :meth:`hex`."""
    @classmethod
    def from_env(cls) -> UniqueId:
        """The id in ``XCCL_UNIQUE_ID`` (as a launcher put it there); BootstrapError if unset."""
    def hex(self) -> str:
        """The whole id, key included: a secret (never on a command line)."""
    @property
    def job_id(self) -> int: ...
    @property
    def root(self) -> str: ...

class A2eHandle:
    """What an A2E call returns on an attention rank; pass it to ``e2a_recv`` once.

    Dropping a handle before its ``e2a_recv`` aborts the job at once (every rank's calls raise
    AbortedError naming this rank and the epoch): the call can no longer be answered."""

    @property
    def num_tokens(self) -> int: ...
    @property
    def epoch(self) -> int: ...
    @property
    def total_rows(self) -> int: ...

class ExpertBatch:
    """An expert rank's rows of one call, grouped by local expert (read-only buffers).

    Dropping a batch (and every buffer viewing it) before its ``e2a_send`` aborts the job at
    once, naming this rank and the epoch."""

    @property
    def num_rows(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_local_experts(self) -> int: ...
    @property
    def epoch(self) -> int: ...
    @property
    def hidden(self) -> int: ...
    @property
    def tag(self) -> int: ...
    @property
    def tags(self) -> list[int]: ...
    @property
    def rows(self) -> Buffer:
        """``[num_rows, hidden]`` of the dtype (``[0, hidden]`` with keep_int8); on the ``cuda``
        fabric a view of the device memory the rows were received into."""
    @property
    def int8_rows(self) -> Buffer | None: ...
    @property
    def scales(self) -> Buffer | None: ...
    @property
    def keep_int8(self) -> bool: ...
    @property
    def num_recv_tokens_per_expert_list(self) -> list[int]: ...
    @property
    def num_recv_tokens_per_expert(self) -> Buffer: ...
    @property
    def expert_offsets(self) -> list[int]: ...
    @property
    def src_rank(self) -> Buffer: ...
    @property
    def src_token(self) -> Buffer: ...
    @property
    def weights(self) -> Buffer: ...
    @property
    def sources(self) -> list[dict[str, Any]]: ...
    def token_rows(self, i: int) -> list[int]: ...

class TokenBatch:
    """An expert rank's tokens of one call, one row each (read-only buffers).

    Dropping it before its ``e2a_send_tokens`` aborts the job at once, as for ExpertBatch."""

    @property
    def num_tokens(self) -> int: ...
    @property
    def epoch(self) -> int: ...
    @property
    def tag(self) -> int: ...
    @property
    def tags(self) -> list[int]: ...
    @property
    def rows(self) -> Buffer:
        """``[num_tokens, hidden]`` of the dtype, row ``i`` token ``i`` (``[0, hidden]`` with
        keep_int8); on the ``cuda`` fabric a view of the device memory the rows were received
        into."""
    @property
    def int8_rows(self) -> Buffer | None: ...
    @property
    def scales(self) -> Buffer | None: ...
    @property
    def keep_int8(self) -> bool: ...
    @property
    def src_rank(self) -> Buffer: ...
    @property
    def src_token(self) -> Buffer: ...
    @property
    def expert_ids(self) -> Buffer:
        """``[num_tokens, topk]`` int32 local expert indices, ascending, padded with -1."""
    @property
    def expert_weights(self) -> Buffer:
        """``[num_tokens, topk]`` float32, padded with 0."""
    @property
    def sources(self) -> list[dict[str, Any]]: ...
    def experts_of(self, i: int) -> tuple[list[int], list[float]]: ...

class Communicator:
    """One rank's communicator (``xccl::Communicator``); a context manager."""

    @staticmethod
    def init(
        topology: Topology,
        config: Config,
        *,
        unique_id: str | UniqueId,
        rank: int,
        world_size: int,
        fabric: str = "shm",
        device: int | None = None,
        role: str | None = None,
        timeout: float = 60.0,
    ) -> Communicator:
        """Joins the job named by ``unique_id`` (collective); Ctrl-C while it waits raises
        KeyboardInterrupt and aborts the job. ``fabric="cuda"``: rows in GPU ``device``'s memory
        (default ``rank % device count``); the calls take and return CUDA tensors there."""
    @staticmethod
    def from_env(
        topology: Topology,
        config: Config,
        *,
        fabric: str = "shm",
        device: int | None = None,
        role: str | None = None,
        timeout: float = 60.0,
    ) -> Communicator:
        """Joins the job the launcher's environment describes (as :meth:`init`)."""
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def role(self) -> str: ...
    @property
    def local_experts(self) -> list[int]: ...
    @property
    def fabric(self) -> str:
        """``"shm"``, ``"ofi"``, ``"cuda"`` or ``"ascend"``."""
    @property
    def device(self) -> str:
        """Where the calls' tensors live: ``"cpu"``, or ``"cuda:<id>"`` on the ``cuda``
        fabric."""
    @property
    def dtype(self) -> str: ...
    @property
    def hidden(self) -> int: ...
    @property
    def topk(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def poisoned(self) -> bool: ...
    @property
    def error(self) -> str | None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def a2e_in_flight(self) -> int: ...
    # attention ranks
    def a2e_send(
        self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, *, tag: int = 0
    ) -> A2eHandle:
        """On the ``cuda`` fabric ``x`` is a CUDA tensor of :attr:`device`; the routing is on
        the CPU or on the device (int32/int64 ids, float32/float16/bfloat16 weights; int32 and
        float32 on the device are read as they are, others are read back and converted)."""
    def a2e_input(self) -> Buffer: ...
    def a2e_send_input(
        self, num_tokens: int, topk_idx: Tensor, topk_weights: Tensor, *, tag: int = 0
    ) -> A2eHandle: ...
    def e2a_ready(self, handle: A2eHandle) -> bool: ...
    def e2a_recv(self, handle: A2eHandle, out: Tensor | None = None) -> Any:
        """Returns ``out`` when given, else a new :class:`Buffer` ``[T, hidden]`` (device memory
        on the ``cuda`` fabric, where ``out`` is a CUDA tensor of :attr:`device`)."""
    # expert ranks
    def a2e_ready(self) -> bool: ...
    def a2e_recv(self, *, timeout: float | None = ...) -> ExpertBatch:
        """``timeout``: seconds (default: the config's), or ``None``: no deadline, waits while
        the attention ranks live (a dead or departed peer, an abort or Ctrl-C ends it)."""
    def a2e_recv_tokens(self, *, timeout: float | None = ...) -> TokenBatch:
        """``timeout`` as for :meth:`a2e_recv`. On the ``cuda`` fabric the rows are device
        memory of :attr:`device` (``TokenBatch.rows`` a CUDA buffer; not with keep_int8)."""
    def e2a_send(self, batch: ExpertBatch, expert_out: Tensor) -> None:
        """On the ``cuda`` fabric ``expert_out`` is a CUDA tensor of :attr:`device`."""
    def e2a_send_tokens(self, batch: TokenBatch, reduced: Tensor) -> None:
        """``reduced``: ``[batch.num_tokens, hidden]``; on the ``cuda`` fabric a CUDA tensor of
        :attr:`device`."""
    # both
    def barrier(self) -> None: ...
    def stats(self) -> dict[str, Any]: ...
    def total_stats(self) -> dict[str, Any]: ...
    def reset_stats(self) -> None: ...
    def abort(self, reason: str) -> None:
        """Aborts the job with ``reason`` (every rank's waits raise AbortedError naming this
        rank); callable from any thread, also to end a call blocked on another thread."""
    def shrink(self, *, drop_orphaned_experts: bool = False, timeout: float = 60.0) -> Communicator:
        """A new communicator over the survivors (collective). This communicator is closed by
        the call (use the one returned). Ctrl-C raises KeyboardInterrupt and a communicator the
        shrink still builds aborts its job."""
    def rank_after_shrink(self, old: int) -> int | None: ...
    def shrunk_past(self) -> list[int]: ...
    def close(self) -> None:
        """Leaves the job at once, also while buffers of ``a2e_input`` live (they keep only
        the window's memory and refuse new exports)."""
    def __enter__(self) -> Self: ...
    def __exit__(self, exc_type: object = None, exc: object = None, _tb: object = None) -> bool: ...
