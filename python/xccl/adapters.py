"""Adapters that give xccl the shape of interfaces engines already call.

- :class:`AFDConnector`: vLLM's attention-FFN disaggregation connector (``AFDConnectorBase``):
  ``send_attn_output`` / ``recv_ffn_output`` on attention ranks, ``recv_attn_output`` /
  ``send_ffn_output`` on FFN (expert) ranks, over xccl's token-major calls.
- :class:`LowLatencyBuffer`: DeepEP's low-latency ``Buffer.low_latency_dispatch`` /
  ``Buffer.low_latency_combine`` with its packed expert-major layout
  (``[num_local_experts, num_max_dispatch_tokens_per_rank * num_attention_ranks, hidden]``),
  over xccl's expert-major calls.

Both wrap an initialised :class:`xccl.Communicator` and add no communication of their own:
every method is one xccl call plus tensor reshaping. ``docs/python.md`` gives the full mapping
and where the semantics differ (xccl takes the gating weights at dispatch; attention and
experts are different processes). Tensors are torch tensors: on the CPU, or on a communicator of
the ``cuda`` fabric CUDA tensors of its device (``comm.device``), which the adapters hand back
too. On CUDA, expert ids given as int64 (what ``torch.topk`` returns) are converted to the int32
xccl's device routing reads, on the current stream (xccl's call runs after it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _routing(topk_idx: Any, topk_weights: Any) -> tuple[Any, Any]:
    """The routing as xccl's device calls read it: torch CUDA expert ids as int32 and weights as
    float32 (converted on the current stream, which xccl's call orders after); anything else
    as given (xccl converts host routing itself)."""
    if isinstance(topk_idx, torch.Tensor) and topk_idx.is_cuda:
        topk_idx = topk_idx.to(torch.int32)
    if isinstance(topk_weights, torch.Tensor) and topk_weights.is_cuda:
        topk_weights = topk_weights.to(torch.float32)
    return topk_idx, topk_weights


__all__ = [
    "AFDConnector",
    "AFDConnectorMetadata",
    "LowLatencyBuffer",
    "LowLatencyHandle",
]


@dataclass
class AFDConnectorMetadata:
    """What travels with one AFD exchange (the fields of vLLM's metadata that xccl uses).

    Attention side: ``topk_idx`` ``[T, k]`` (global expert ids, -1 for none) and
    ``topk_weights`` ``[T, k]`` float32 are required by :meth:`AFDConnector.send_attn_output`.
    FFN side: :meth:`AFDConnector.recv_attn_output` fills ``seq_lens`` (tokens received from
    each attention rank of the call, in the order of the rows: ``hidden_states.split(seq_lens)``
    gives each rank's rows) with ``src_ranks`` (the attention rank of each ``seq_lens`` entry),
    ``topk_idx`` / ``topk_weights`` (per token
    the global ids of this rank's experts it selected and their weights, ``[N, k]`` int64 /
    float32 padded with -1 / 0.0, on the communicator's device), ``layer_idx`` / ``stage_idx`` (sent as the call's tag, ``stage_idx << 32 |
    layer_idx``; those of the lowest attention rank of the call) and ``handle`` (the batch to
    reply to).
    """

    layer_idx: int = 0
    stage_idx: int = 0
    seq_lens: list[int] = field(default_factory=list)
    src_ranks: list[int] = field(default_factory=list)
    topk_idx: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None
    handle: Any = None

    @property
    def total_tokens(self) -> int:
        """Number of tokens in the exchange (the sum of ``seq_lens``)."""
        return sum(self.seq_lens)


class AFDConnector:
    """vLLM's ``AFDConnectorBase`` interface over an xccl communicator.

    Attention ranks call :meth:`send_attn_output` then :meth:`recv_ffn_output`; FFN ranks call
    :meth:`recv_attn_output`, compute the MoE of their local experts per token, and
    :meth:`send_ffn_output`. Microbatches (``ubatch_idx``) are xccl calls in flight, answered
    in the order they were sent (at most the config's ``max_in_flight``).
    """

    def __init__(self, comm: Any) -> None:
        """Wraps ``comm`` (an initialised :class:`xccl.Communicator`; closed by :meth:`close`)."""
        self.comm = comm
        self._pending: dict[int | None, Any] = {}

    @property
    def is_initialized(self) -> bool:
        """True until :meth:`close`."""
        return self.comm is not None

    @property
    def is_attention(self) -> bool:
        """Whether this rank is an attention rank (else an FFN / expert rank)."""
        return self._comm().role == "attention"

    def _comm(self) -> Any:
        if self.comm is None:
            raise RuntimeError("the AFD connector is closed")
        return self.comm

    def get_connector_rank(self) -> int:
        """This rank in the xccl job."""
        return self._comm().rank

    def send_attn_output(
        self,
        hidden_states: torch.Tensor,
        metadata: AFDConnectorMetadata,
        ubatch_idx: int | None = None,
    ) -> Any:
        """Attention: sends ``hidden_states`` ``[T, hidden]`` to the experts of each token
        (``metadata.topk_idx`` / ``metadata.topk_weights``); returns the handle that
        :meth:`recv_ffn_output` takes (also remembered under ``ubatch_idx``)."""
        if metadata.topk_idx is None or metadata.topk_weights is None:
            raise ValueError("send_attn_output needs metadata.topk_idx and metadata.topk_weights")
        if ubatch_idx in self._pending:
            raise ValueError(f"ubatch_idx {ubatch_idx} has a send whose output is not received")
        if not (0 <= metadata.layer_idx < 1 << 32 and 0 <= metadata.stage_idx < 1 << 32):
            raise ValueError(
                f"layer_idx {metadata.layer_idx} / stage_idx {metadata.stage_idx} must fit 32 bits"
            )
        tag = metadata.stage_idx << 32 | metadata.layer_idx
        comm = self._comm()
        idx, weights = _routing(metadata.topk_idx, metadata.topk_weights)
        handle = comm.a2e_send(hidden_states, idx, weights, tag=tag)
        self._pending[ubatch_idx] = handle
        return handle

    def recv_ffn_output(self, handle: Any = None, ubatch_idx: int | None = None) -> torch.Tensor:
        """Attention: waits for and returns the combined FFN output ``[T, hidden]`` of ``handle``
        (or of the last send under ``ubatch_idx``): the gating-weighted sum over the token's
        experts (on the communicator's device). A receive that failed and can be retried keeps
        the handle pending."""
        if handle is None:
            if ubatch_idx not in self._pending:
                raise ValueError(f"no send_attn_output pending for ubatch_idx {ubatch_idx}")
            handle = self._pending[ubatch_idx]
        out = torch.from_dlpack(self._comm().e2a_recv(handle))
        if self._pending.get(ubatch_idx) is handle:
            del self._pending[ubatch_idx]
        return out

    def recv_attn_output(
        self, timeout_ms: int | None = None, ubatch_idx: int | None = None
    ) -> tuple[torch.Tensor, AFDConnectorMetadata]:
        """FFN: waits for the next call's tokens; returns ``(hidden_states [N, hidden],
        metadata)``, one row per (attention rank, token) that selected a local expert here, each
        attention rank's rows consecutive, the ranks in the order their rows arrived:
        ``metadata.seq_lens`` counts them in that order and ``metadata.src_ranks`` names each
        segment's attention rank, so ``hidden_states.split(metadata.seq_lens)`` gives the ranks'
        rows. ``timeout_ms`` must be None (the communicator's timeout applies).

        On the ``cuda`` fabric ``hidden_states`` is a read-only view of the device memory the
        rows were received into (no copy; kept alive by the tensor), and the metadata's
        ``topk_idx`` / ``topk_weights`` are copied to the same device."""
        if timeout_ms is not None:
            raise ValueError("timeout_ms is set per communicator (Config(timeout=...))")
        comm = self._comm()
        batch = comm.a2e_recv_tokens()
        rows = torch.from_dlpack(batch.rows)  # [N, hidden], also when N is 0
        # Local expert indices -> global expert ids (-1 stays -1: it picks the appended -1).
        to_global = torch.tensor([*comm.local_experts, -1], dtype=torch.int64)
        # The sources in the order of their rows (each source's rows are consecutive).
        in_rows = sorted(batch.sources, key=lambda s: (s["first_token"], s["rank"]))
        topk_idx = to_global[torch.from_dlpack(batch.expert_ids).to(torch.int64)]
        meta = AFDConnectorMetadata(
            layer_idx=batch.tag & 0xFFFF_FFFF,
            stage_idx=batch.tag >> 32,
            seq_lens=[s["count"] for s in in_rows],
            src_ranks=[s["rank"] for s in in_rows],
            topk_idx=topk_idx.to(rows.device),
            topk_weights=torch.from_dlpack(batch.expert_weights).to(rows.device),
            handle=batch,
        )
        return rows, meta

    def send_ffn_output(
        self,
        ffn_output: torch.Tensor,
        metadata: AFDConnectorMetadata,
        ubatch_idx: int | None = None,
    ) -> None:
        """FFN: replies to the call ``metadata`` came from with ``ffn_output`` ``[N, hidden]``,
        one row per received row: the sum over that token's local experts of
        ``weight * expert(row)`` (xccl adds the other expert ranks' rows). On the ``cuda``
        fabric a CUDA tensor of the communicator's device, read after the current stream's
        work."""
        if metadata.handle is None:
            raise ValueError("send_ffn_output needs the metadata recv_attn_output returned")
        self._comm().e2a_send_tokens(metadata.handle, ffn_output)
        metadata.handle = None

    def close(self) -> None:
        """Closes the communicator (idempotent)."""
        if self.comm is not None:
            self.comm.close()
            self.comm = None


@dataclass
class LowLatencyHandle:
    """What :meth:`LowLatencyBuffer.low_latency_combine` needs back: on attention ranks the
    xccl A2E handle and the weights given to dispatch; on expert ranks the xccl batch."""

    xccl: Any
    topk_weights: torch.Tensor | None = None
    num_tokens: int = 0


class LowLatencyBuffer:
    """DeepEP's low-latency ``Buffer`` calls over xccl, for disaggregated ranks.

    In DeepEP every rank both dispatches and computes experts; here attention ranks dispatch
    and combine, expert ranks receive and reply, and each method does its role's half:

    - attention: ``low_latency_dispatch(x, topk_idx, topk_weights=w)`` sends and returns
      ``(None, None, handle, None, None)`` (nothing is received here);
      ``low_latency_combine(None, topk_idx, w, handle)`` returns ``(combined_x, None, hook)``.
    - expert: ``low_latency_dispatch()`` returns ``(recv_x, recv_count, handle, None, None)``
      in DeepEP's packed layout; ``low_latency_combine(expert_out, None, None, handle)``
      replies with ``expert_out`` in the same layout and returns ``(None, None, None)``.

    Differences from DeepEP: the gating weights go with dispatch (xccl weights on the expert
    rank), and combine checks they are the ones dispatch got; rows past ``recv_count[e]`` in
    ``recv_x`` are zeros; no FP8 (INT8 on the wire is ``Config(a2e_quant="int8")``).
    """

    def __init__(self, comm: Any, topology: Any, config: Any) -> None:
        """Wraps ``comm``, made from ``topology`` and ``config``: DeepEP's sizes are
        ``num_max_dispatch_tokens_per_rank = config.max_tokens_per_rank``, ``hidden`` and
        ``num_experts`` (the calls check the values they are given against them)."""
        self.comm = comm
        self.num_max_dispatch_tokens_per_rank = config.max_tokens_per_rank
        self.hidden = config.hidden
        self.num_experts = topology.num_experts
        self.num_attention_ranks = len(topology.attention_ranks)
        self.local_experts = list(comm.local_experts)
        self.dtype = _DTYPES[config.dtype]

    def _check(self, num_max_dispatch_tokens_per_rank, num_experts) -> None:
        for name, got, want in (
            (
                "num_max_dispatch_tokens_per_rank",
                num_max_dispatch_tokens_per_rank,
                self.num_max_dispatch_tokens_per_rank,
            ),
            ("num_experts", num_experts, self.num_experts),
        ):
            if got is not None and got != want:
                raise ValueError(f"{name} is {got}, this buffer was made for {want}")

    def low_latency_dispatch(
        self,
        x: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        num_max_dispatch_tokens_per_rank: int | None = None,
        num_experts: int | None = None,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        use_fp8: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        *,
        topk_weights: torch.Tensor | None = None,
    ) -> tuple[Any, torch.Tensor | None, LowLatencyHandle, None, None]:
        """Attention: sends ``x`` ``[T, hidden]`` to ``topk_idx`` ``[T, k]`` (int64, -1 for
        none) with ``topk_weights`` ``[T, k]`` float32. Expert: receives the next call's rows
        as ``recv_x`` ``[num_local_experts, num_max_dispatch_tokens_per_rank *
        num_attention_ranks, hidden]`` and ``recv_count`` ``[num_local_experts]`` int32 (and
        adds the counts to ``cumulative_local_expert_recv_stats`` when given), both on the
        communicator's device."""
        self._check(num_max_dispatch_tokens_per_rank, num_experts)
        if use_fp8:
            raise ValueError("xccl has no FP8 on the wire; INT8 is Config(a2e_quant='int8')")
        if async_finish or return_recv_hook:
            raise ValueError("dispatch is synchronous on CPU (no async_finish / recv hook)")
        if self.comm.role == "attention":
            if x is None or topk_idx is None or topk_weights is None:
                raise ValueError("attention ranks dispatch x, topk_idx and topk_weights")
            handle = self.comm.a2e_send(x, *_routing(topk_idx, topk_weights))
            return (
                None,
                None,
                LowLatencyHandle(handle, topk_weights, x.shape[0]),
                None,
                None,
            )
        if x is not None or topk_idx is not None:
            raise ValueError("expert ranks receive: low_latency_dispatch() takes no tokens")
        batch = self.comm.a2e_recv()
        rows = torch.from_dlpack(batch.rows)
        counts = list(batch.num_recv_tokens_per_expert_list)
        cap = self.num_max_dispatch_tokens_per_rank * self.num_attention_ranks
        recv_x = rows.new_zeros(len(self.local_experts), cap, self.hidden)
        for i, (lo, n) in enumerate(zip(batch.expert_offsets, counts)):
            recv_x[i, :n] = rows[lo : lo + n]
        recv_count = torch.tensor(counts, dtype=torch.int32, device=rows.device)
        if cumulative_local_expert_recv_stats is not None:
            stats = cumulative_local_expert_recv_stats
            stats += recv_count.to(device=stats.device, dtype=stats.dtype)
        return recv_x, recv_count, LowLatencyHandle(batch), None, None

    def low_latency_combine(
        self,
        x: torch.Tensor | None,
        topk_idx: torch.Tensor | None,
        topk_weights: torch.Tensor | None,
        handle: LowLatencyHandle,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, None, Callable[[], None] | None]:
        """Attention: returns ``combined_x`` ``[T, hidden]`` (into ``out`` when given, else a new
        tensor on the communicator's device); with ``return_recv_hook`` the receive waits until
        the returned hook is called. Expert:
        replies with ``x`` in the packed layout (only the first ``recv_count[e]`` rows of each
        expert are read)."""
        if zero_copy or async_finish:
            raise ValueError("zero_copy / async_finish have no xccl counterpart here")
        if self.comm.role == "attention":
            if topk_weights is not None and not torch.equal(topk_weights, handle.topk_weights):
                raise ValueError("xccl weights at dispatch: topk_weights differ from dispatch's")
            if out is None:
                device = torch.device(self.comm.device)
                out = torch.empty(handle.num_tokens, self.hidden, dtype=self.dtype, device=device)

            def hook() -> None:
                self.comm.e2a_recv(handle.xccl, out=out)

            if return_recv_hook:
                return out, None, hook
            hook()
            return out, None, None
        if return_recv_hook or out is not None:
            raise ValueError("expert ranks reply: no out tensor or hook")
        batch = handle.xccl
        counts = list(batch.num_recv_tokens_per_expert_list)
        flat = x.new_empty(sum(counts), self.hidden)
        for i, (lo, n) in enumerate(zip(batch.expert_offsets, counts)):
            flat[lo : lo + n] = x[i, :n]
        self.comm.e2a_send(batch, flat)
        return None, None, None
