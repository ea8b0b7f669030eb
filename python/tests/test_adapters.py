"""xccl.adapters in real processes: vLLM's AFD connector and DeepEP's low-latency Buffer.

Each test forks 2 attention + 2 expert ranks (processes, over shared memory; the unique id
goes over a pipe), 3 steps of 2 microbatches in flight with token counts that include
0. Hidden states are small integers, weights multiples of 1/4 and expert ``e`` computes
``(e + 1) * x``, so every combined row is exact in f32 and is compared bit for bit.
"""

from __future__ import annotations

import multiprocessing
import time
import traceback

import torch

import xccl
from xccl.adapters import AFDConnector, AFDConnectorMetadata, LowLatencyBuffer

HIDDEN = 16
TOPK = 2
EXPERTS = 8
MAX_TOKENS = 6
ATTENTION = 2
WORLD = 4
# COUNTS[step][microbatch][attention rank]
COUNTS = [[[3, 0], [6, 2]], [[0, 0], [1, 5]], [[4, 4], [0, 6]]]


def inputs(step: int, mb: int, rank: int):
    """x [T, HIDDEN] f32 small integers, topk_idx [T, 2] int64 (some -1), weights [T, 2]."""
    n = COUNTS[step][mb][rank]
    t = torch.arange(n).unsqueeze(1)
    h = torch.arange(HIDDEN).unsqueeze(0)
    x = ((t * 7 + h * 3 + rank * 5 + step + mb) % 9 - 4).float()
    first = (torch.arange(n) + step + 3 * mb + rank) % EXPERTS
    second = torch.where(torch.arange(n) % 4 == 3, -1, (first + 3) % EXPERTS)
    idx = torch.stack([first, second], dim=1)
    w = torch.where(idx[:, 1:] >= 0, torch.tensor([0.75, 0.25]), torch.tensor([1.0, 0.0]))
    return x, idx, w


def expected(x, idx, w):
    """sum_j w_j * (e_j + 1) * x, exact."""
    coef = (w * (idx + 1) * (idx >= 0)).sum(dim=1, keepdim=True)
    return coef * x


def communicator(rank: int, uid: str):
    topo = xccl.Topology(ATTENTION, WORLD - ATTENTION, EXPERTS)
    cfg = xccl.Config(HIDDEN, torch.float32, TOPK, MAX_TOKENS, max_in_flight=2)
    comm = xccl.Communicator.init(topo, cfg, unique_id=uid, rank=rank, world_size=WORLD)
    return topo, cfg, comm


def afd_rank(rank: int, uid: str) -> None:
    _, _, comm = communicator(rank, uid)
    conn = AFDConnector(comm)
    assert conn.is_initialized
    for step in range(len(COUNTS)):
        if conn.is_attention:
            sent = []
            for mb in range(2):
                x, idx, w = inputs(step, mb, rank)
                meta = AFDConnectorMetadata(
                    layer_idx=3 + step, stage_idx=mb, topk_idx=idx, topk_weights=w
                )
                conn.send_attn_output(x, meta, ubatch_idx=mb)
                try:
                    conn.send_attn_output(x, meta, ubatch_idx=mb)
                    raise AssertionError("a second send under a pending ubatch_idx was accepted")
                except ValueError:
                    pass  # rejected before anything was sent
                sent.append((x, idx, w))
            for mb, (x, idx, w) in enumerate(sent):
                out = conn.recv_ffn_output(ubatch_idx=mb)
                assert torch.equal(out, expected(x, idx, w)), (step, mb, out)
        else:
            local = set(comm.local_experts)
            got = [conn.recv_attn_output(ubatch_idx=mb) for mb in range(2)]
            for mb, (rows, meta) in enumerate(got):
                # Tokens from each attention rank that selected one of this rank's experts.
                want = []
                for a in range(ATTENTION):
                    _, idx, _ = inputs(step, mb, a)
                    want.append(sum(any(int(e) in local for e in row) for row in idx))
                # Per attention rank, in the order of the rows: each segment of the split is
                # that rank's rows.
                assert dict(zip(meta.src_ranks, meta.seq_lens)) == dict(enumerate(want)), meta
                src = torch.from_dlpack(meta.handle.src_rank)
                for r, part in zip(meta.src_ranks, src.split(meta.seq_lens)):
                    assert bool((part == r).all()), (meta.src_ranks, meta.seq_lens, src)
                assert (meta.layer_idx, meta.stage_idx) == (3 + step, mb), meta
                assert rows.shape == (sum(want), HIDDEN), (rows.shape, want)
                assert set(meta.topk_idx[meta.topk_idx >= 0].tolist()) <= local
                conn.send_ffn_output(expected(rows, meta.topk_idx, meta.topk_weights), meta)
    conn.close()
    assert not conn.is_initialized


def deepep_rank(rank: int, uid: str) -> None:
    topo, cfg, comm = communicator(rank, uid)
    buf = LowLatencyBuffer(comm, topo, cfg)
    local = list(comm.local_experts)
    stats = torch.zeros(len(local), dtype=torch.int32)
    total = torch.zeros(len(local), dtype=torch.int32)
    for step in range(len(COUNTS)):
        if comm.role == "attention":
            sent = []
            for mb in range(2):
                x, idx, w = inputs(step, mb, rank)
                try:
                    buf.low_latency_dispatch(
                        x, idx, MAX_TOKENS, EXPERTS, use_fp8=True, topk_weights=w
                    )
                    raise AssertionError("use_fp8=True was accepted")
                except ValueError:
                    pass  # rejected before anything was sent
                recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(
                    x, idx, MAX_TOKENS, EXPERTS, topk_weights=w
                )
                assert recv_x is None and recv_count is None and event is None and hook is None
                sent.append((x, idx, w, handle))
            for mb, (x, idx, w, handle) in enumerate(sent):
                if x.shape[0] > 0:
                    try:
                        buf.low_latency_combine(None, idx, w + 1, handle)
                        raise AssertionError("weights other than dispatch's were accepted")
                    except ValueError:
                        pass  # the handle stays valid
                if mb == 0:
                    out, _, hook = buf.low_latency_combine(
                        None, idx, w, handle, return_recv_hook=True
                    )
                    hook()
                else:
                    out, _, hook = buf.low_latency_combine(None, idx, w, handle)
                    assert hook is None
                assert torch.equal(out, expected(x, idx, w)), (step, mb, out)
        else:
            got = [
                buf.low_latency_dispatch(cumulative_local_expert_recv_stats=stats) for _ in range(2)
            ]
            for mb, (recv_x, recv_count, handle, _, _) in enumerate(got):
                assert recv_x.shape == (len(local), MAX_TOKENS * ATTENTION, HIDDEN)
                want = torch.zeros(len(local), dtype=torch.int32)
                for a in range(ATTENTION):
                    _, idx, _ = inputs(step, mb, a)
                    for i, e in enumerate(local):
                        want[i] += int((idx == e).any(dim=1).sum())
                assert torch.equal(recv_count, want), (recv_count, want)
                total += want
                out = torch.empty_like(recv_x)
                for i, e in enumerate(local):
                    n = int(recv_count[i])
                    assert not recv_x[i, n:].any(), "rows past recv_count are not zeros"
                    out[i] = (e + 1) * recv_x[i]
                assert buf.low_latency_combine(out, None, None, handle) == (None, None, None)
    assert torch.equal(stats, total), (stats, total)
    comm.close()


def rank_entry(mode: str, rank: int, conn) -> None:
    """A forked rank: gets the unique id over `conn`, runs, sends back None or the traceback."""
    torch.set_num_threads(1)
    try:
        {"afd": afd_rank, "deepep": deepep_rank}[mode](rank, conn.recv())
        conn.send(None)
    except BaseException:
        conn.send(traceback.format_exc())
        raise


def run_ranks(mode: str, timeout: float = 60.0) -> None:
    """Forks WORLD ranks of `mode` (torch is imported once, here) and fails with every rank's
    traceback if any failed."""
    ctx = multiprocessing.get_context("fork")  # forked before this process starts the root
    procs, conns = [], []
    for rank in range(WORLD):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=rank_entry, args=(mode, rank, theirs))
        p.start()
        procs.append(p)
        conns.append(mine)
    root = xccl.UniqueId.new()  # the rendezvous root lives as long as this object
    failed = []
    deadline = time.monotonic() + timeout
    try:
        for c in conns:
            c.send(root.hex())
        for rank, (p, c) in enumerate(zip(procs, conns)):
            if not c.poll(max(0.0, deadline - time.monotonic())):
                failed.append(f"rank {rank}: no result within {timeout} s")
                break
            err = c.recv()
            p.join(max(1.0, deadline - time.monotonic()))
            if err is not None or p.exitcode != 0:
                failed.append(f"rank {rank} (exit {p.exitcode}):\n{err}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert not failed, "\n".join(failed)


def test_afd_connector_2a2e_two_microbatches_exact_seq_lens_and_rejected_resend():
    run_ranks("afd")


def test_low_latency_buffer_2a2e_deepep_layout_counts_hook_and_rejected_misuse():
    run_ranks("deepep")
