"""DeepSeek-V3's MoE layer, disaggregated over xccl, checked against the model's own forward.

The layer is Hugging Face transformers' ``DeepseekV3MoE`` with a small ``DeepseekV3Config`` and
random weights from a fixed seed (nothing is downloaded). Every rank builds the same module from
the same seed, so every rank holds the same weights:

- attention ranks run the module's own router (``moe.gate``: sigmoid scores, group-limited
  top-k, normalised and scaled weights) and its shared experts (``moe.shared_experts``), send
  each token to its experts with ``a2e_send`` and add the combined rows from ``e2a_recv``;
- expert ranks receive the rows per local expert (``a2e_recv``), run the module's own experts
  (``moe.experts`` restricted to one expert at a time, weight 1) on the rows xccl hands them,
  and reply with ``e2a_send``; xccl applies the gating weights and sums across expert ranks.

Each attention rank compares its output with ``moe(x)``, the module's own forward on the same
tokens. Every step runs 2 microbatches in flight; token counts vary per rank and step and
include 0 (one rank, and in one step every rank). Expert loops end on the call tagged STOP
(the per-call tag of ``a2e_send``), not on a step count agreed in advance.

Error measure: for each output element, ``|out - ref| / B`` where ``B`` is the sum of the
magnitudes of the terms the layer adds (``sum_j |w_j * y_j| + |shared|``, computed with the
module's own code); a rounding error of a sum is bounded relative to ``B``, not to ``|ref|``,
which can cancel to ~0. Tolerances (``u`` is the dtype's unit roundoff, 2^-24 for f32, 2^-8
for bf16; ``k`` is top-k):

- f32: ``1e-5`` (about 170 ``u``): the sums run in another order and the experts' GEMMs over
  other row counts (an expert rank batches rows of several attention ranks), which changes
  results by some ``u`` of their inputs' magnitudes; measured 1.1e-6 to 1.5e-6.
- bf16: ``(k + 4) u``. The reference rounds each weighted term and each of its k - 1 partial
  sums and the final add of the shared expert to bf16 (at most ``(k + 1) u B``); xccl sums in
  f32 and rounds once per expert rank, once on the attention rank, and the shared add rounds
  once more (at most ``3 u B``); measured 3.7 ``u``.
- INT8 on the wire (f32 layer, rows quantized both ways): each row is rounded to a step of
  ``amax / 127`` of that row (error at most half a step) on the way to the experts, where it
  passes through an expert MLP (unit gain by construction) into k terms whose weights sum to
  ``routed_scaling_factor`` (2.5), and half a step of the reply's row on the way back; the
  tolerance is 4 steps of the token's largest ``B`` (``4 / 127`` of ``max B`` over the row);
  measured 1.7 to 2.4 steps.

Run: ``python deepseek_moe_disagg.py`` (forks its ranks after importing torch and transformers
once: up to 2 attention + 3 expert processes on shared memory; ``--help`` for the options).
``--device cuda``: the module, the tokens and every tensor xccl takes and returns live on the
GPU (rank ``r`` on GPU ``r % count``), and the ranks use xccl's ``cuda`` fabric (windows in GPU
memory, shared by CUDA IPC): the rows never leave the GPU; the same checks apply.
Needs ``xccl``, ``torch`` and ``transformers``; prints the measured errors of each run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HIDDEN = 64
TOPK = 4
NUM_EXPERTS = 16
MAX_TOKENS = 24
SEED = 1234
STOP = 1  # the tag of the attention ranks' last call (every other call carries tag 0)

# name -> (dtype, attention ranks, expert ranks, INT8 on the wire)
RUNS = {
    "f32": ("float32", 2, 3, False),
    "bf16": ("bfloat16", 2, 2, False),
    "int8": ("float32", 2, 3, True),
}


def moe_config():
    """A small DeepSeek-V3 MoE: 16 routed experts in 4 groups, top-2 groups, top-4 experts."""
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import (
        DeepseekV3Config,
    )

    cfg = DeepseekV3Config(
        hidden_size=HIDDEN,
        moe_intermediate_size=32,
        n_routed_experts=NUM_EXPERTS,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=TOPK,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        hidden_act="silu",
    )
    cfg._experts_implementation = "eager"  # the module's own loop over experts
    return cfg


def build_moe(dtype):
    """The module with random weights from SEED (the same on every rank)."""
    import torch
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    torch.manual_seed(SEED)
    moe = DeepseekV3MoE(moe_config())
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)  # unit-scale activations (fan-in scaling)
        # A non-zero score correction bias, so the biased group/expert choice is exercised.
        moe.gate.e_score_correction_bias.normal_(0.0, 0.05)
    return moe.to(dtype).eval()


def token_count(run, step, mb, rank, steps):
    """Tokens of attention `rank` in microbatch `mb` of `step` (every rank computes the same)."""
    if step == 1 and mb == 0 and rank == 0:
        return 0  # one rank sends nothing
    if step == steps - 1 and mb == 1:
        return 0  # a round in which no rank sends anything
    g = _generator(run, step, mb, rank, 0)
    import torch

    return int(torch.randint(1, MAX_TOKENS + 1, (1,), generator=g))


def tokens(run, step, mb, rank, n, dtype, device="cpu"):
    """The hidden states of that microbatch (drawn on the CPU, the same on any device)."""
    import torch

    g = _generator(run, step, mb, rank, 1)
    return torch.randn(n, HIDDEN, generator=g).to(dtype).to(device)


def _generator(run, step, mb, rank, what):
    import torch

    key = (((sorted(RUNS).index(run) * 1000 + step) * 2 + mb) * 64 + rank) * 2 + what
    return torch.Generator().manual_seed(SEED + key)


def magnitude_bound(moe, x, idx, w, shared):
    """B = sum_j |w_j * y_j| + |shared| per element, from the module's own experts."""

    b = shared.float().abs()
    for j in range(idx.shape[1]):
        b += moe.experts(x, idx[:, j : j + 1], w[:, j : j + 1]).float().abs()
    return b


def run_attention(comm, moe, run, steps, dtype, device="cpu"):
    """Router and shared experts here, routed experts over xccl; returns the worst errors."""
    import torch

    worst = {"max_err_over_B": 0.0, "max_err_over_max_ref": 0.0, "tokens": 0}
    with torch.no_grad():
        for step in range(steps):
            sent = []
            for mb in range(2):  # both microbatches in flight before any E2A
                n = token_count(run, step, mb, comm.rank, steps)
                x = tokens(run, step, mb, comm.rank, n, dtype, device)
                _, w, idx = moe.gate(x)  # the module's own router
                sent.append((x, w, idx, comm.a2e_send(x, idx, w)))
            for x, w, idx, handle in sent:
                shared = moe.shared_experts(x)  # overlaps the experts' work
                routed = torch.from_dlpack(comm.e2a_recv(handle))
                out = routed + shared
                ref = moe(x)  # the module's own forward on the same tokens
                assert out.shape == ref.shape and out.dtype == ref.dtype, (out, ref)
                worst["tokens"] += x.shape[0]
                if x.shape[0] == 0:
                    continue
                err = (out.float() - ref.float()).abs()
                b = magnitude_bound(moe, x, idx, w, shared).clamp_min(1e-30)
                if RUNS[run][3]:
                    # INT8: the quantization step is a fraction of the row's largest magnitude.
                    rel = err / b.amax(dim=1, keepdim=True)
                else:
                    rel = err / b
                worst["max_err_over_B"] = max(worst["max_err_over_B"], rel.max().item())
                worst["max_err_over_max_ref"] = max(
                    worst["max_err_over_max_ref"],
                    (err.max() / ref.float().abs().max()).item(),
                )
        # The last call: no tokens, tagged STOP, which ends the expert ranks' loops.
        empty = torch.empty(0, HIDDEN, dtype=dtype, device=device)
        no_idx = torch.empty(0, TOPK, dtype=torch.int64, device=device)
        no_w = torch.empty(0, TOPK, device=device)
        comm.e2a_recv(comm.a2e_send(empty, no_idx, no_w, tag=STOP))
    return worst


def expert_forward(moe, e, rows):
    """Expert `e` of the module on `rows`: its own experts code with only `e` selected, weight 1
    (the product with 1.0 and the add to zeros are exact, so this is the expert's output)."""
    import torch

    n = rows.shape[0]
    idx = torch.full((n, 1), e, dtype=torch.int64, device=rows.device)
    return moe.experts(rows, idx, torch.ones(n, 1, device=rows.device))


def run_expert(comm, moe):
    """Routed experts on the rows xccl hands this rank, until the call tagged STOP."""
    import torch

    local = list(comm.local_experts)
    calls = 0
    with torch.no_grad():
        while True:
            # Idle between requests: no deadline while the attention ranks live (a dead or
            # departed one, an abort or Ctrl-C ends the wait; never a TimeoutError).
            first = comm.a2e_recv(timeout=None)
            if first.tag == STOP:  # the attention ranks' last call: 0 tokens, reply and leave
                comm.e2a_send(first, torch.from_dlpack(first.rows))
                return {"calls": calls + 1}
            # A step's second microbatch is in flight too: receive both, then reply in order.
            batches = [first, comm.a2e_recv()]
            calls += 2
            for b in batches:
                rows = torch.from_dlpack(b.rows)
                out = torch.empty_like(rows)
                lo = b.expert_offsets
                for i, e in enumerate(local):
                    if lo[i + 1] > lo[i]:
                        out[lo[i] : lo[i + 1]] = expert_forward(moe, e, rows[lo[i] : lo[i + 1]])
                comm.e2a_send(b, out)


def rank_main(rank, args, conn):
    """One rank (a forked process): gets {run: unique id} over `conn`, runs each run it takes
    part in, sends back its results (or the error)."""
    import torch

    import xccl

    torch.set_num_threads(1)  # several ranks share few cores
    try:
        uids = conn.recv()
        results = {}
        for run in args.runs:
            dtype_name, na, ne, int8 = RUNS[run]
            if rank >= na + ne:
                continue
            dtype = getattr(torch, dtype_name)
            device = "cpu"
            if args.device == "cuda":
                device = f"cuda:{rank % torch.cuda.device_count()}"
                torch.cuda.set_device(device)
            moe = build_moe(dtype).to(device)
            topo = xccl.Topology(na, ne, NUM_EXPERTS)
            quant = "int8" if int8 else None
            cfg = xccl.Config(
                HIDDEN,
                dtype,
                TOPK,
                MAX_TOKENS,
                max_in_flight=2,
                timeout=30.0,
                a2e_quant=quant,
                e2a_quant=quant,
            )
            on_gpu = {"fabric": "cuda"} if args.device == "cuda" else {}
            with xccl.Communicator.init(
                topo, cfg, unique_id=uids[run], rank=rank, world_size=na + ne, **on_gpu
            ) as comm:
                if comm.role == "attention":
                    results[run] = run_attention(comm, moe, run, args.steps, dtype, device)
                else:
                    results[run] = run_expert(comm, moe)
        conn.send(("ok", results))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def tolerance(run):
    """The bound each run is checked against (see the module docstring)."""
    dtype_name, _, _, int8 = RUNS[run]
    if int8:
        return 4.0  # in quantization steps of the row's largest B
    if dtype_name == "bfloat16":
        return (TOPK + 4) * 2.0**-8
    return 1e-5


def launch(args):
    """Forks the ranks (torch and transformers are imported once, here), hands them the unique
    ids over pipes (never on a command line), collects and checks their results."""
    import multiprocessing

    import transformers.models.deepseek_v3.modeling_deepseek_v3  # noqa: F401 (for the forks)

    import xccl

    start = time.monotonic()
    world = max(na + ne for _, na, ne, _ in (RUNS[r] for r in args.runs))
    # Forked before any thread (the roots) starts here, and before CUDA is initialised in this
    # process (a fork may not inherit a CUDA context): each rank opens the GPU itself.
    ctx = multiprocessing.get_context("fork")
    procs, conns = [], []
    for rank in range(world):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=rank_main, args=(rank, args, theirs), name=f"rank {rank}")
        p.start()
        procs.append(p)
        conns.append(mine)
    # Each UniqueId runs its rendezvous root in this process while the object lives.
    roots = {run: xccl.UniqueId.new() for run in args.runs}
    for c in conns:
        c.send({run: uid.hex() for run, uid in roots.items()})
    outputs, failed = [], False
    deadline = time.monotonic() + args.timeout
    try:
        for rank, (p, c) in enumerate(zip(procs, conns)):
            if not c.poll(max(0.0, deadline - time.monotonic())):
                print(f"rank {rank}: no result within {args.timeout} s; killing every rank")
                return 1
            status, value = c.recv()
            p.join(max(1.0, deadline - time.monotonic()))
            if status != "ok" or p.exitcode != 0:
                print(f"rank {rank} failed (exit {p.exitcode}):\n{value if status != 'ok' else ''}")
                failed = True
            else:
                outputs.append(value)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    ok = not failed
    for run in args.runs:
        dtype_name, na, ne, int8 = RUNS[run]
        ranks = [o[run] for o in outputs if run in o]
        att = [r for r in ranks if "max_err_over_B" in r]
        if len(att) != na or len(ranks) != na + ne:
            print(f"{run}: results from {len(ranks)} of {na + ne} ranks")
            ok = False
            continue
        calls = [r["calls"] for r in ranks if "calls" in r]
        if calls != [2 * args.steps + 1] * ne:
            print(f"{run}: expert ranks served {calls} calls, expected {2 * args.steps + 1} each")
            ok = False
        worst = max(r["max_err_over_B"] for r in att)
        normwise = max(r["max_err_over_max_ref"] for r in att)
        ntok = sum(r["tokens"] for r in att)
        tol = tolerance(run)
        unit = "steps of max B" if int8 else "of B"
        measured = worst * 127 if int8 else worst
        verdict = "ok" if measured <= tol else "FAILED"
        ok &= measured <= tol
        wire = "int8" if int8 else dtype_name
        print(
            f"{run}: {na}A:{ne}E {dtype_name} on {args.device} wire={wire} "
            f"{args.steps} steps x 2 microbatches, "
            f"{ntok} tokens: max |out-ref| = {measured:.3g} {unit} (tolerance {tol:.3g}); "
            f"max |out-ref| / max |ref| = {normwise:.3g}: {verdict}"
        )
    print(f"{'ok' if ok else 'FAILED'} in {time.monotonic() - start:.1f} s")
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", choices=sorted(RUNS), default=["f32", "bf16", "int8"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=100.0, help="seconds for the whole job")
    ap.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: the layer and its tensors on the GPU, over xccl's cuda fabric",
    )
    return launch(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
