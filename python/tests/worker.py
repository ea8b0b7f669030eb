"""One rank of a test job (started by harness.py): joins the job the way the test asks and runs
its scenario; prints ``RESULT <json>`` last."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import reference as ref
import torch

import xccl

ARGS = json.loads(os.environ["XCCL_TEST_ARGS"])
TORCH = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def result(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def touch(name: str):
    Path(ARGS["tmp"], name).write_text("")


def wait_file(name: str, timeout: float = 60.0):
    path = Path(ARGS["tmp"], name)
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} never appeared")
        time.sleep(0.005)


def topology():
    a = ARGS
    return xccl.Topology(
        a["m"],
        a["n"],
        a["E"],
        roles=a.get("roles"),
        relays=a.get("relays"),
        domains=a.get("domains", 1),
    )


def config():
    a = ARGS
    return xccl.Config(
        a["H"],
        a.get("dtype_arg", a["dtype"]),
        a["topk"],
        a["max_tokens"],
        timeout=a.get("call_timeout", 20.0),
        a2e_quant=a.get("a2e_quant"),
        e2a_quant=a.get("e2a_quant"),
        keep_int8=a.get("keep_int8", False),
        mode=a.get("mode", "push"),
        max_in_flight=a.get("max_in_flight", 2),
    )


def join():
    a = ARGS
    topo, cfg = topology(), config()
    role = None
    if a.get("role_of"):
        role = a["role_of"][a["rank"]]
    if a["join"] == "uid":
        return xccl.Communicator.init(
            topo, cfg, unique_id=a["uid"], rank=a["rank"], world_size=a["world"], role=role
        )
    if a["join"] in ("env", "torchrun"):
        return xccl.Communicator.from_env(topo, cfg, role=role)
    if a["join"] == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=a["rank"], world_size=a["world"])
        try:
            return xccl.init_from_process_group(None, topo, cfg, role=role)
        finally:
            dist.barrier()
    raise ValueError(a["join"])


def to_torch(x, dtype: str):
    """A numpy array of the dtype as a torch tensor (bf16 through its bits)."""
    if dtype == "bf16":
        return torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def to_numpy(t, dtype: str):
    """A torch tensor (or xccl.Buffer) of the dtype as numpy (bf16 as ml_dtypes.bfloat16)."""
    if isinstance(t, xccl.Buffer):
        return t.numpy()
    if dtype == "bf16":
        return t.view(torch.int16).numpy().view(ref.DTYPES["bf16"])
    return t.numpy()


def rank_of_expert(comm_topo):
    return {e: comm_topo.replicas(e)[0] for e in range(ARGS["E"])}


def tokens_of(rnd: int, a_index: int) -> int:
    tokens = ARGS["tokens"]
    return tokens[rnd % len(tokens)][a_index % len(tokens[0])]


def expert_major_reply(comm, batch, dtype):
    rows = torch.from_dlpack(batch.rows)
    if batch.keep_int8:
        q = torch.from_dlpack(batch.int8_rows).float()
        s = torch.from_dlpack(batch.scales)
        rows = (q * s[:, None]).to(TORCH[dtype])
    assert rows.shape == (batch.num_rows, ARGS["H"]), rows.shape
    counts = batch.num_recv_tokens_per_expert_list
    assert torch.from_dlpack(batch.num_recv_tokens_per_expert).tolist() == counts
    offs = batch.expert_offsets
    assert [offs[j + 1] - offs[j] for j in range(len(counts))] == counts
    out = torch.empty_like(rows)
    for j, e in enumerate(comm.local_experts):
        r = slice(offs[j], offs[j + 1])
        out[r] = (rows[r].float() * float(ref.expert_scale(e))).to(TORCH[dtype])
    comm.e2a_send(batch, out)
    return batch.num_rows


def token_major_reply(comm, batch, dtype):
    rows = torch.from_dlpack(batch.rows)
    if batch.keep_int8:
        q = torch.from_dlpack(batch.int8_rows).float()
        s = torch.from_dlpack(batch.scales)
        rows = (q * s[:, None]).to(TORCH[dtype])
    ids = torch.from_dlpack(batch.expert_ids)
    ws = torch.from_dlpack(batch.expert_weights)
    comm.e2a_send_tokens(batch, token_outputs(rows, ids, ws, comm.local_experts, dtype))
    return batch.num_tokens


def token_outputs(rows, ids, ws, experts, dtype):
    """The test experts' token-major replies to ``rows`` (a CPU torch tensor, one row per token)
    whose experts are ``ids`` ``[T, topk]`` (indices into ``experts``, the global ids; -1 =
    none) with weights ``ws``: per token the f32 sum, in column order, of ``weight * expert(row)``
    (each expert's output rounded to the dtype), rounded once."""
    acc = torch.zeros((rows.shape[0], ARGS["H"]), dtype=torch.float32)
    scales = torch.tensor([float(ref.expert_scale(e)) for e in experts] + [0.0])
    for c in range(ARGS["topk"]):
        j = ids[:, c].long()
        valid = j >= 0
        s = scales[torch.where(valid, j, len(experts))]
        y = (rows.float() * s[:, None]).to(TORCH[dtype]).float()
        contrib = ws[:, c : c + 1] * y
        acc = torch.where(valid[:, None], acc + contrib, acc)
    return acc.to(TORCH[dtype])


def check_result(got, x, idx, w, owner, dtype, label):
    want = ref.combine(x, idx, w, owner, dtype)
    if ARGS.get("a2e_quant") or ARGS.get("e2a_quant") or ARGS.get("keep_int8"):
        # INT8 on the wire: each quantization step errs by at most half a step (row max/254)
        # per element; bound the difference by 3% of the reference row's largest magnitude.
        g = got.astype(np.float32)
        r = want.astype(np.float32)
        bound = 0.03 * np.maximum(np.abs(r).max(axis=1, keepdims=True), 1e-3)
        bad = np.argwhere(np.abs(g - r) > bound)
        return None if len(bad) == 0 else (label, [int(v) for v in bad[0]])
    d = ref.first_difference(got, want, dtype)
    return None if d is None else (label, d)


def attention_rounds(comm):
    a = ARGS
    dtype = a["dtype"]
    owner = rank_of_expert(topology_of(comm))
    a_index = comm_topo_attention(comm).index(comm.rank)
    inflight = a.get("inflight", 1)
    mismatches = []
    rnd = 0
    domains = a.get("domains", 1)
    m = len(comm_topo_attention(comm))
    mine = [r for r in range(a["rounds"]) if r % domains == a_index * domains // m]
    while rnd < len(mine):
        batch = []
        for r in mine[rnd : rnd + inflight]:
            t = tokens_of(r, a_index)
            x, idx, w = ref.workload(a["seed"], r, a_index, t, a["H"], a["topk"], a["E"], dtype)
            ids = idx.astype(np.int32) if r % 2 else torch.from_numpy(idx)
            if a.get("registered"):
                buf = comm.a2e_input()
                torch.from_dlpack(buf)[:t].copy_(to_torch(x, dtype))
                h = comm.a2e_send_input(t, ids, torch.from_numpy(w), tag=call_tag(r, a_index))
                try:
                    buf.__dlpack__()
                    mismatches.append(("registered input still exported after its send", r))
                except xccl.InvalidArgumentError:
                    pass
            elif r % 3 == 2:
                # numpy in: float32/float16 through DLPack, bfloat16 as ml_dtypes' dtype.
                h = comm.a2e_send(x, idx, w, tag=call_tag(r, a_index))
            else:
                tag = call_tag(r, a_index)
                h = comm.a2e_send(to_torch(x, dtype), ids, torch.from_numpy(w), tag=tag)
            batch.append((r, h, x, idx, w))
        for r, h, x, idx, w in batch:
            if r % 2 == 1 and poll(lambda h=h: comm.e2a_ready(h)) is None:
                mismatches.append(("e2a_ready never became True", r))
            if a.get("out") and r % 2 == 0:
                out = torch.empty((x.shape[0], a["H"]), dtype=TORCH[dtype])
                got = comm.e2a_recv(h, out=out)
                assert got is out
                got = to_numpy(out, dtype)
            else:
                buf = comm.e2a_recv(h)
                got = to_numpy(torch.from_dlpack(buf), dtype)
            d = check_result(got, x, idx, w, owner, dtype, f"round {r}")
            if d:
                mismatches.append(d)
        rnd += inflight
    return mismatches


def topology_of(comm):
    """The topology the job runs (with the gathered roles when ranks stated theirs)."""
    if ARGS.get("role_of"):
        return xccl.Topology(
            ARGS["m"], ARGS["n"], ARGS["E"], roles=ARGS["role_of"], relays=ARGS.get("relays")
        )
    return topology()


def comm_topo_attention(comm):
    return topology_of(comm).attention_ranks


def expert_rounds(comm):
    a = ARGS
    rows = 0
    token_major = a.get("token_major", "alternate")
    for r in range(a["rounds"]):
        use_tokens = token_major is True or (
            token_major == "alternate" and (r + comm.rank) % 2 == 1
        )
        batch = comm.a2e_recv_tokens() if use_tokens else comm.a2e_recv()
        m = len(comm_topo_attention(comm))
        domains = a.get("domains", 1)
        want = [call_tag(r, i) if r % domains == i * domains // m else 0 for i in range(m)]
        first = next(t for t in want if t)
        if (batch.tag, batch.tags) != (first, want):
            raise AssertionError(f"round {r}: tags {batch.tag}, {batch.tags}; want {want}")
        if use_tokens:
            rows += token_major_reply(comm, batch, a["dtype"])
        else:
            rows += expert_major_reply(comm, batch, a["dtype"])
    return rows


def call_tag(r: int, a_index: int) -> int:
    """The tag attention index ``a_index`` sends with call ``r``."""
    return (r + 1) * 1000 + a_index + (1 << 40)


class Records:
    """Collects the records of the ``xccl`` logger."""

    def __init__(self):
        import logging

        self.records = []
        h = logging.Handler()
        h.emit = lambda r: self.records.append([r.name, r.levelname, r.getMessage()])
        logging.getLogger("xccl").addHandler(h)


def scenario_roundtrip():
    """Runs each case of ``cases`` (argument overrides: topology, dtype, paths...) on a
    communicator of its own, one after the other, in the same processes."""
    logs = Records() if ARGS.get("capture_logs") else None
    base = dict(ARGS)
    out = []
    for i, case in enumerate(base.get("cases") or [{}]):
        ARGS.clear()
        ARGS.update(base, **case)
        if base.get("uids"):
            ARGS["uid"] = base["uids"][i]
        comm = join()
        with comm:
            if comm.role == "attention":
                out.append({"role": "attention", "mismatches": attention_rounds(comm)})
            else:
                rows = expert_rounds(comm)
                out.append({"role": "expert", "rows": rows, "calls": comm.total_stats()["calls"]})
    result(cases=out, logs=logs.records if logs else None)


def expect(exc, fn, *words):
    """Calls ``fn``; returns None if it raised ``exc`` whose message has every word, else what
    happened."""
    try:
        fn()
    except exc as e:
        missing = [w for w in words if w not in str(e)]
        if missing:
            return f"{exc.__name__} without {missing}: {e}"
        if getattr(e, "poisoned", False):
            return f"{e} poisoned the communicator"
        return None
    except Exception as e:  # noqa: BLE001
        return f"expected {exc.__name__}, got {type(e).__name__}: {e}"
    return f"expected {exc.__name__}, nothing raised"


class FakeCudaTensor:
    """Speaks the DLPack protocol of a CUDA tensor (this machine has no GPU): the device query
    says cuda:0; an export would hand over device memory."""

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, **kw):
        raise AssertionError("xccl exported a CUDA tensor instead of rejecting it")


def scenario_misuse():
    """1A:1E (f32, hidden 8, topk 2, 4 experts): every misuse of the issue, then a good round."""
    a = ARGS
    comm = join()
    H = a["H"]
    failures = []
    with comm:
        if comm.role == "attention":
            x = torch.ones((2, H), dtype=torch.float32)
            idx = torch.tensor([[0, 1], [2, 3]])
            w = torch.full((2, 2), 0.5)
            checks = {
                "int64 id beyond int32": (
                    xccl.InvalidArgumentError,
                    lambda: comm.a2e_send(x, torch.tensor([[0, 1], [2, 2**32 + 1]]), w),
                    "topk_idx[1, 1]",
                    str(2**32 + 1),
                    "in [0, 4)",
                ),
                "expert id out of range": (
                    xccl.InvalidArgumentError,
                    lambda: comm.a2e_send(x, np.array([[0, 4], [1, 2]], dtype=np.int32), w),
                    "token 0 slot 1",
                    "expert 4",
                    "outside [0, 4)",
                ),
                "float64 weights": (
                    xccl.InvalidArgumentError,
                    lambda: comm.a2e_send(x, idx, w.double()),
                    "float64",
                ),
                "int weights": (
                    xccl.InvalidArgumentError,
                    lambda: comm.a2e_send(x, idx, torch.ones((2, 2), dtype=torch.int32)),
                    "int32",
                ),
                "float16 x with an f32 config": (
                    xccl.InvalidArgumentError,
                    lambda: comm.a2e_send(x.half(), idx, w),
                    "float16",
                    "float32",
                ),
                "uint8 ids": (
                    xccl.InvalidArgumentError,
                    lambda: comm.a2e_send(x, idx.to(torch.uint8), w),
                    "uint8",
                ),
                "wrong hidden": (
                    xccl.InvalidArgumentError,
                    lambda: comm.a2e_send(torch.ones((2, H + 1)), idx, w),
                    f"[T, {H}]",
                ),
                "1-D x": (
                    xccl.InvalidArgumentError,
                    lambda: comm.a2e_send(torch.ones(2 * H), idx, w),
                    "shape",
                ),
                "ids of the wrong shape": (
                    xccl.InvalidArgumentError,
                    lambda: comm.a2e_send(x, torch.tensor([0, 1]), w),
                    "[2, 2]",
                ),
                "weights of the wrong shape": (
                    xccl.InvalidArgumentError,
                    lambda: comm.a2e_send(x, idx, torch.ones((3, 2))),
                    "topk_weights",
                ),
                "non-contiguous x": (
                    xccl.InvalidArgumentError,
                    lambda: comm.a2e_send(torch.ones((H, 2)).t(), idx, w),
                    "not C-contiguous",
                ),
                "too many tokens": (
                    xccl.InvalidArgumentError,
                    lambda: comm.a2e_send(
                        torch.ones((a["max_tokens"] + 1, H)),
                        torch.zeros((a["max_tokens"] + 1, 2), dtype=torch.int32),
                        torch.ones((a["max_tokens"] + 1, 2)),
                    ),
                    str(a["max_tokens"]),
                ),
                "a CUDA tensor": (
                    xccl.InvalidArgumentError,
                    lambda: comm.a2e_send(FakeCudaTensor(), idx, w),
                    "cuda:0",
                ),
                "a meta tensor": (
                    xccl.InvalidArgumentError,
                    lambda: comm.a2e_send(torch.ones((2, H), device="meta"), idx, w),
                    "x is on meta; xccl's communicator here takes CPU tensors",
                ),
                "a meta out": (
                    xccl.InvalidArgumentError,
                    lambda: comm.a2e_send(x, idx, w.to("meta")),
                    "topk_weights is on meta",
                ),
                "not a tensor": (
                    xccl.InvalidArgumentError,
                    lambda: comm.a2e_send("hello", idx, w),
                    "str",
                ),
                "expert call on an attention rank": (
                    xccl.WrongRoleError,
                    lambda: comm.a2e_recv(),
                    "wrong role",
                ),
            }
            for name, (exc, fn, *words) in checks.items():
                f = expect(exc, fn, *words)
                if f:
                    failures.append(f"{name}: {f}")
            # The producer's C++ stack trace stays out of the message.
            try:
                comm.a2e_send(torch.ones((2, H), device="meta"), idx, w)
            except xccl.InvalidArgumentError as e:
                if "\n" in str(e) or "frame #" in str(e):
                    failures.append(f"a meta tensor: a multi-line message: {e}")
            if comm.poisoned:
                failures.append(f"poisoned after the misuses: {comm.error}")
            # A good round now, with inputs in other accepted forms: x through the buffer
            # protocol (a memoryview), ids as numpy int64, weights as float16 (widened exactly).
            xs = np.arange(2 * H, dtype=np.float32).reshape(2, H)
            ids = np.array([[0, 3], [1, -1]], dtype=np.int64)
            w16 = np.array([[0.5, 0.25], [0.75, 0.0]], dtype=np.float16)
            h = comm.a2e_send(memoryview(xs), ids, w16)
            # e2a_recv misuses, then the good receive.
            for name, (exc, fn, *words) in {
                "out of the wrong dtype": (
                    xccl.InvalidArgumentError,
                    lambda: comm.e2a_recv(h, out=torch.empty((2, H), dtype=torch.float16)),
                    "float16",
                ),
                "out of the wrong shape": (
                    xccl.InvalidArgumentError,
                    lambda: comm.e2a_recv(h, out=torch.empty((3, H))),
                    f"[2, {H}]",
                ),
                "read-only out": (
                    xccl.InvalidArgumentError,
                    lambda: comm.e2a_recv(h, out=readonly(np.zeros((2, H), np.float32))),
                    "read-only",
                ),
            }.items():
                f = expect(exc, fn, *words)
                if f:
                    failures.append(f"{name}: {f}")
            got = np.from_dlpack(comm.e2a_recv(h))
            owner = rank_of_expert(topology())
            want = ref.combine(xs, ids, w16.astype(np.float32), owner, "f32")
            d = ref.first_difference(got, want, "f32")
            if d:
                failures.append(f"good round after the misuses differs: {d}")
            # Round 2: the expert checks that its view of round 1's rows did not change.
            # The non-blocking checks: the expert has not replied yet (it waits for our file).
            wait_file("expert-checked")
            x2 = -np.ones((2, H), dtype=np.float32)
            h2 = comm.a2e_send(x2, ids, w16, tag=77)
            if comm.e2a_ready(h2):
                failures.append("e2a_ready was True before the expert replied")
            touch("attention-polled")
            polls = poll(lambda: comm.e2a_ready(h2))
            if polls is None:
                failures.append("e2a_ready never became True")
            np.from_dlpack(comm.e2a_recv(h2))
            stats = comm.stats()
            if stats["calls"] != 1 or len(stats["peers"]) != 2 or comm.total_stats()["calls"] < 4:
                failures.append(f"stats: {stats}")
            if (
                stats["peers"][1]["rows_received"] <= 0
                or comm.total_stats()["peers"][1]["bytes_put"] <= 0
            ):
                failures.append(f"stats per peer: {comm.total_stats()}")
            comm.abort("misuse test over")
            try:
                comm.a2e_send(xs, ids, w16)
                failures.append("a call after abort() did not raise")
            except xccl.AbortedError as e:
                if (e.by, e.reason, e.poisoned) != (0, "misuse test over", True):
                    failures.append(f"call after abort: {e.by}, {e.reason!r}, {e.poisoned}")
        else:
            batch = comm.a2e_recv()
            view = np.from_dlpack(batch.rows)
            before = view.copy()
            if view.flags.writeable:
                failures.append("batch rows are exported writable")
            out = torch.from_dlpack(batch.rows).clone()
            for j, e in enumerate(comm.local_experts):
                lo, hi = batch.expert_offsets[j], batch.expert_offsets[j + 1]
                out[lo:hi] = out[lo:hi] * float(ref.expert_scale(e))
            for name, (exc, fn, *words) in {
                "expert_out of the wrong dtype": (
                    xccl.InvalidArgumentError,
                    lambda: comm.e2a_send(batch, out.half()),
                    "float16",
                ),
                "expert_out of the wrong shape": (
                    xccl.InvalidArgumentError,
                    lambda: comm.e2a_send(batch, out[:-1]),
                    f"[{batch.num_rows}, {H}]",
                ),
                "attention call on an expert rank": (
                    xccl.WrongRoleError,
                    lambda: comm.a2e_send(out, np.zeros((1, 2), np.int32), np.ones((1, 2))),
                    "wrong role",
                ),
            }.items():
                f = expect(exc, fn, *words)
                if f:
                    failures.append(f"{name}: {f}")
            comm.e2a_send(batch, out)
            f = expect(xccl.InvalidArgumentError, lambda: comm.e2a_send(batch, out), "epoch")
            if f:
                failures.append(f"second reply to a batch: {f}")
            del batch
            if comm.a2e_ready():
                failures.append("a2e_ready was True before the attention rank sent")
            touch("expert-checked")
            if poll(comm.a2e_ready) is None:
                failures.append("a2e_ready never became True")
            # The next round overwrites the receive areas; round 1's view keeps its own memory.
            b2 = comm.a2e_recv()
            if (b2.tag, b2.tags) != (77, [77]):
                failures.append(f"tags of round 2: {b2.tag}, {b2.tags}")
            wait_file("attention-polled")
            o2 = torch.from_dlpack(b2.rows).clone()
            for j, e in enumerate(comm.local_experts):
                lo, hi = b2.expert_offsets[j], b2.expert_offsets[j + 1]
                o2[lo:hi] = o2[lo:hi] * float(ref.expert_scale(e))
            comm.e2a_send(b2, o2)
            if not np.array_equal(view, before):
                failures.append("a view of a batch's rows changed after the reply")
            try:
                comm.a2e_recv()
                failures.append("a2e_recv returned after the attention rank aborted")
            except xccl.AbortedError as e:
                if (e.by, e.reason.startswith("misuse test over"), e.poisoned) != (0, True, True):
                    failures.append(f"abort seen as {e.by}, {e.reason!r}, {e.poisoned}")
        result(role=comm.role, failures=failures)


def poll(ready, timeout: float = 20.0):
    """Calls ``ready()`` until it is True; returns the number of calls, or None at the timeout."""
    deadline = time.monotonic() + timeout
    n = 0
    while time.monotonic() < deadline:
        n += 1
        if ready():
            return n
        time.sleep(0.001)
    return None


def readonly(a):
    a.setflags(write=False)
    return a


def scenario_kill():
    """The last expert rank receives one call and SIGKILLs itself before replying."""
    comm = join()
    victim = ARGS["world"] - 1
    a = ARGS
    try:
        if comm.role == "attention":
            a_index = topology().attention_ranks.index(comm.rank)
            x, idx, w = ref.workload(1, 0, a_index, 4, a["H"], a["topk"], a["E"], a["dtype"])
            h = comm.a2e_send(to_torch(x, a["dtype"]), torch.from_numpy(idx), torch.from_numpy(w))
            comm.e2a_recv(h)
            result(error=None)
        else:
            batch = comm.a2e_recv()
            if comm.rank == victim:
                os.kill(os.getpid(), signal.SIGKILL)
            out = torch.from_dlpack(batch.rows).clone()
            comm.e2a_send(batch, out)
            comm.a2e_recv()
            result(error=None)
    except xccl.XcclError as e:
        out = {
            "error": type(e).__name__,
            "peer": e.peer,
            "poisoned": e.poisoned,
            "message": str(e),
            "comm_poisoned": comm.poisoned,
        }
        # The survivors go on: shrink past the dead rank (its experts 2 and 3 had no other
        # replica: their selections are dropped) and run a round on the new communicator.
        new = comm.shrink(drop_orphaned_experts=True, timeout=30)
        out["closed_after_shrink"] = comm.closed
        out["new_rank"] = new.rank
        out["new_world"] = new.world_size
        out["shrunk_past"] = new.shrunk_past()
        with new:
            if new.role == "attention":
                x = np.full((2, a["H"]), 1.5, dtype=np.float32)
                idx = np.array([[0, 2], [1, -1]], dtype=np.int64)
                w = np.array([[0.5, 0.25], [2.0, 0.0]], dtype=np.float32)
                got = np.from_dlpack(new.e2a_recv(new.a2e_send(x, idx, w)))
                # Expert 2 is orphaned: token 0 gets only expert 0's 0.5 * 1.5 (identity
                # experts), token 1 expert 1's 2.0 * 1.5.
                out["after_shrink_ok"] = bool(
                    np.array_equal(got[0], np.full(a["H"], 0.75, np.float32))
                    and np.array_equal(got[1], np.full(a["H"], 3.0, np.float32))
                )
                out["dropped"] = new.total_stats()["dropped_slots"]
            else:
                b = new.a2e_recv()
                new.e2a_send(b, torch.from_dlpack(b.rows).clone())
                out["after_shrink_ok"] = True
        result(**out)


def scenario_sigint():
    """1A:1E. The expert waits in a2e_recv until the test's SIGINT: KeyboardInterrupt, not
    poisoned; then the round runs. Then the attention rank waits in a barrier (which signals its
    peers first) until SIGINT: KeyboardInterrupt and poisoned; the expert's next call raises
    the abort."""
    comm = join()
    a = ARGS
    out = {}
    if comm.role == "expert":
        touch("expert-waiting")
        start = time.monotonic()
        try:
            comm.a2e_recv()
            out["first"] = "returned"
        except KeyboardInterrupt:
            out["first"] = "KeyboardInterrupt"
            out["caught_at"] = time.monotonic()
            out["waited"] = out["caught_at"] - start
        out["poisoned_after_first"] = comm.poisoned
        touch("expert-interrupted")
        batch = comm.a2e_recv()
        comm.e2a_send(batch, torch.from_dlpack(batch.rows).clone())
        touch("round-done")
        try:
            comm.a2e_recv()
            out["after_poison"] = "returned"
        except xccl.XcclError as e:
            out["after_poison"] = type(e).__name__
            out["after_poison_by"] = getattr(e, "by", None)
    else:
        wait_file("expert-interrupted")
        x = np.ones((2, a["H"]), dtype=np.float32)
        h = comm.a2e_send(x, np.array([[0, 1], [2, 3]], np.int32), np.ones((2, 2), np.float32))
        got = np.from_dlpack(comm.e2a_recv(h))
        out["round_ok"] = bool(np.all(got == 2.0))
        wait_file("round-done")
        touch("attention-waiting")
        try:
            comm.barrier()
            out["barrier"] = "returned"
        except KeyboardInterrupt:
            out["barrier"] = "KeyboardInterrupt"
            out["caught_at"] = time.monotonic()
        out["poisoned"] = comm.poisoned
        out["error"] = comm.error
    comm.close()
    result(**out)


def scenario_abort_thread():
    """1A:1E. The expert blocks in a2e_recv; another thread of it calls ``comm.abort``: the
    blocked call raises AbortedError (this rank, the reason); the attention rank, blocked in a
    barrier, raises AbortedError naming the expert."""
    comm = join()
    out = {}
    if comm.role == "expert":
        aborted = {}

        def watchdog():
            time.sleep(0.3)
            aborted["at"] = time.monotonic()
            comm.abort("watchdog: the expert gives up")

        t = threading.Thread(target=watchdog)
        t.start()
        try:
            comm.a2e_recv()
            out["error"] = "returned"
        except xccl.XcclError as e:
            out.update(error=type(e).__name__, by=getattr(e, "by", None), poisoned=e.poisoned)
            out["reason"] = getattr(e, "reason", None)
            out["after_abort"] = time.monotonic() - aborted["at"]
        t.join()
        out["comm_poisoned"] = comm.poisoned
    else:
        try:
            comm.barrier()
            out["error"] = "returned"
        except xccl.XcclError as e:
            out.update(error=type(e).__name__, by=getattr(e, "by", None))
    comm.close()
    result(**out)


def scenario_sigint_join():
    """2 ranks. Rank 0 waits in init for rank 1 until the test's SIGINT: KeyboardInterrupt.
    Rank 1 joins after it: its init or its first call raises AbortedError naming rank 0."""
    out = {}
    if ARGS["rank"] == 0:
        touch("joining")
        try:
            join()
            out["first"] = "returned"
        except KeyboardInterrupt:
            out["first"] = "KeyboardInterrupt"
            out["caught_at"] = time.monotonic()
        touch("rank0-interrupted")
        wait_file("rank1-done")
    else:
        wait_file("rank0-interrupted")
        out.update(after_interrupt(join))
        touch("rank1-done")
    result(**out)


def after_interrupt(make):
    """What rank 1 sees after its peer was interrupted: the error of ``make()`` or of a barrier
    on the communicator it made (``at`` says which)."""
    at = "make"
    try:
        comm = make()
        at = "barrier"
        comm.barrier()
        return {"error": "returned"}
    except xccl.XcclError as e:
        return {"error": type(e).__name__, "by": getattr(e, "by", None), "at": at}


def scenario_sigint_shrink():
    """1A:1E. Rank 0 waits in shrink for rank 1 until the test's SIGINT: KeyboardInterrupt, its
    communicator closed. Rank 1 shrinks after it: its shrink or its first call on the new
    communicator raises AbortedError naming rank 0."""
    comm = join()
    out = {}
    if comm.rank == 0:
        touch("shrinking")
        try:
            comm.shrink(timeout=30)
            out["first"] = "returned"
        except KeyboardInterrupt:
            out["first"] = "KeyboardInterrupt"
            out["caught_at"] = time.monotonic()
        out["closed"] = comm.closed
        touch("rank0-interrupted")
        wait_file("rank1-done")
    else:
        wait_file("rank0-interrupted")
        out.update(after_interrupt(lambda: comm.shrink(timeout=30)))
        touch("rank1-done")
    result(**out)


def small_round(comm):
    """The inputs of one small call: x [2, H] f32, ids, weights."""
    H = ARGS["H"]
    x = torch.ones((2, H), dtype=torch.float32)
    idx = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    w = torch.full((2, 2), 0.5)
    return x, idx, w


def error_name(call) -> str:
    """The class name of the ``XcclError`` ``call()`` raises, or ``"returned"``."""
    try:
        call()
    except xccl.XcclError as e:
        return type(e).__name__
    return "returned"


def timed_error(call) -> dict:
    """Calls ``call()``: ``error`` (the ``XcclError`` class name, or ``"returned"``), its
    ``by``, ``peer`` and ``message``, and ``after``, the seconds it took."""
    t0 = time.monotonic()
    out = {"error": "returned"}
    try:
        call()
    except xccl.XcclError as e:
        out.update(error=type(e).__name__, by=getattr(e, "by", None), peer=e.peer, message=str(e))
    out["after"] = time.monotonic() - t0
    return out


def send_small(comm):
    """Sends one small call (:func:`small_round`); returns its handle."""
    return comm.a2e_send(*small_round(comm))


def scenario_swap_out():
    """1A:1E. While the attention rank waits in ``e2a_recv(h, out=o)`` (the expert holds its
    reply), another of its threads gives ``o`` other storage (``o.set_``) and collects the
    old one. ``o``'s storage is 64 MiB (memory the allocator maps for it alone and unmaps when
    freed): a call that kept only the Python object would write unmapped memory and crash."""
    comm = join()
    out = {}
    with comm:
        if comm.role == "attention":
            h = send_small(comm)
            # [2, H] at offset 0 of a 64 MiB storage that only `o` holds (no view of a base).
            H = ARGS["H"]
            o = torch.empty(0).set_(torch.empty(16 << 20).untyped_storage(), 0, (2, H), (H, 1))

            def swap():
                time.sleep(0.5)  # the main thread waits inside e2a_recv by now
                o.set_(torch.empty(0))
                import gc

                gc.collect()
                touch("swapped")

            t = threading.Thread(target=swap)
            t.start()
            got = comm.e2a_recv(h, out=o)
            t.join()
            out["returned_out"] = got is o
            out["numel_after"] = o.numel()
        else:
            batch = comm.a2e_recv()
            wait_file("swapped")
            comm.e2a_send(batch, batch.rows)
    result(**out)


def scenario_drop_unreplied():
    """1A:1E. The expert drops a received batch without replying: the job aborts at once,
    naming the expert rank and the epoch; the attention rank's e2a_recv ends with it long
    before the 20 s timeout."""
    comm = join()
    out = {}
    with comm:
        if comm.role == "attention":
            h = send_small(comm)
            out.update(timed_error(lambda: comm.e2a_recv(h)))
            touch("attention-done")
        else:
            batch = comm.a2e_recv()
            out["epoch"] = batch.epoch
            del batch
            import gc

            gc.collect()
            # No further call until the attention rank has its answer.
            wait_file("attention-done")
            out["next"] = error_name(comm.a2e_recv)
    result(**out)


def scenario_panic_call():
    """1A:1E. A call of the attention rank panics (a fault injected by the test): an
    ``XcclError`` saying so, poisoned, never ``PanicException``; the job is aborted at once, so
    the expert waiting in a2e_recv learns it long before its 20 s timeout."""
    comm = join()
    out = {}
    with comm:
        if comm.role == "attention":
            touch("attention-joined")
            wait_file("expert-waiting")
            time.sleep(0.3)
            x, idx, w = small_round(comm)
            xccl._xccl._inject_panic("call")
            try:
                comm.a2e_send(x, idx, w)
                out["error"] = "returned"
            except BaseException as e:  # noqa: BLE001 - PanicException is a BaseException
                out.update(
                    error=type(e).__name__,
                    message=str(e),
                    poisoned=getattr(e, "poisoned", None),
                )
            try:
                comm.barrier()
                out["next"] = "returned"
            except xccl.XcclError as e:
                out["next"] = str(e)
        else:
            wait_file("attention-joined")
            touch("expert-waiting")
            out.update(timed_error(comm.a2e_recv))
    result(**out)


def scenario_secret():
    """1A:1E, every string the package produces in a failing job: the unique id's repr, str
    and format, the library's log at trace level, the exception the attention rank leaves its
    ``with`` block with (its message holds the whole id) and what the expert is told of it,
    the tracebacks. The test looks for the key in all of them and in the ranks' stderr."""
    logs = []

    class Keep(logging.Handler):
        def emit(self, record):
            logs.append(self.format(record))

    logging.getLogger("xccl").addHandler(Keep())
    logging.getLogger("xccl").setLevel(logging.DEBUG - 5)
    uid = xccl.UniqueId.from_string(ARGS["uid"])
    texts = [repr(uid), str(uid), f"{uid}", format(uid)]
    comm = join()
    try:
        with comm:
            if comm.role == "attention":
                raise RuntimeError(f"request for job {uid.hex()} failed")
            comm.a2e_recv()
    except xccl.XcclError as e:
        texts += [repr(e), str(e), traceback.format_exc()]
        texts += [str(getattr(e, a, "")) for a in ("reason", "message")]
    except RuntimeError:
        pass  # the attention rank's own exception: its text is the user's, not the package's
    texts.append(repr(comm))
    result(texts=texts, logs=logs)


def scenario_idle_expert():
    """1A:1E, 1 s call timeout. The expert waits with ``a2e_recv(timeout=None)`` while the
    attention rank stays idle for 2 s, then gets the call; then the attention rank leaves the
    job and the expert's next such wait ends naming it. A receive with ``timeout=0.3``
    before that gives up after its own timeout."""
    comm = join()
    out = {}
    if comm.role == "attention":
        time.sleep(2.0)
        comm.e2a_recv(send_small(comm))
        wait_file("expert-timed-out")
        comm.close()
        touch("attention-left")
    else:
        logs = []

        class Keep(logging.Handler):
            def emit(self, record):
                logs.append(f"{record.levelname}: {record.getMessage()}")

        logging.getLogger("xccl").addHandler(Keep())
        t0 = time.monotonic()
        batch = comm.a2e_recv(timeout=None)
        out["waited"] = time.monotonic() - t0
        out["warnings_while_idle"] = [m for m in logs if m.startswith("WARNING")]
        comm.e2a_send(batch, batch.rows)
        t0 = time.monotonic()
        try:
            comm.a2e_recv(timeout=0.3)
            out["short"] = "returned"
        except xccl.TimeoutError as e:
            out["short"] = "TimeoutError"
            out["short_retryable"] = e.retryable
        out["short_after"] = time.monotonic() - t0
        touch("expert-timed-out")
        wait_file("attention-left")
        try:
            comm.a2e_recv(timeout=None)
            out["after_leave"] = "returned"
        except xccl.XcclError as e:
            out.update(after_leave=type(e).__name__, peer=e.peer)
        comm.close()
    result(**out)


def scenario_close_with_input_alive():
    """1A:1E. The attention rank closes its communicator while a tensor made from its
    registered input (``a2e_input``) lives: the expert sees it leave at once (not at its 20 s
    timeout); the tensor's memory stays usable and the buffer refuses new exports."""
    comm = join()
    out = {}
    if comm.role == "attention":
        buf = comm.a2e_input()
        t = torch.from_dlpack(buf)
        comm.close()
        t.fill_(1.0)  # still mapped
        out["sum"] = float(t.sum())
        out["export"] = error_name(lambda: torch.from_dlpack(buf))
        touch("attention-closed")
        wait_file("expert-done")
    else:
        wait_file("attention-closed")
        out.update(timed_error(comm.a2e_recv))
        touch("expert-done")
        comm.close()
    result(**out)


# ---- the cuda fabric (stand-in driver; CUDA tensors from cuda_tensor.DeviceTensor) ----


def join_on(fabric: str):
    """``join()`` on ``fabric`` (unique id)."""
    a = ARGS
    return xccl.Communicator.init(
        topology(),
        config(),
        unique_id=a["uid"],
        rank=a["rank"],
        world_size=a["world"],
        fabric=fabric,
    )


def device_of(comm) -> int:
    return int(comm.device.split(":")[1])


def digest(a) -> str:
    import hashlib

    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8).tobytes()).hexdigest()


def expert_outputs(comm, rows, offs, dtype):
    """The test experts' outputs (expert ``e`` scales by ``ref.expert_scale(e)``) of expert-major
    ``rows`` (a CPU torch tensor) grouped by ``offs``."""
    res = torch.empty_like(rows)
    for j, e in enumerate(comm.local_experts):
        s = slice(offs[j], offs[j + 1])
        res[s] = (rows[s].float() * float(ref.expert_scale(e))).to(TORCH[dtype])
    return res


def cuda_expert_reply(comm, batch, dev, dtype):
    """Replies to ``batch`` on the cuda fabric: its rows read back to the host, the test
    experts' outputs sent from device memory. Returns the tensor sent."""
    from cuda_tensor import DeviceTensor, to_host

    rows = torch.from_dlpack(to_host(batch.rows, dev))
    res = DeviceTensor.of(expert_outputs(comm, rows, batch.expert_offsets, dtype), dev)
    comm.e2a_send(batch, res)
    return res


def attention_workloads(comm):
    """Per round of ``rounds``: the round, the rank owning each expert, and this attention
    rank's inputs ``(x, idx, w)`` of the reference workload."""
    a = ARGS
    owner = rank_of_expert(topology_of(comm))
    a_index = comm_topo_attention(comm).index(comm.rank)
    for r in range(a["rounds"]):
        t = tokens_of(r, a_index)
        yield (
            r,
            owner,
            ref.workload(a["seed"], r, a_index, t, a["H"], a["topk"], a["E"], a["dtype"]),
        )


def record(out, got, inputs, owner, dtype, r):
    """Checks round ``r``'s result ``got`` of ``inputs`` (x, idx, w) against the reference and
    keeps its digest, in ``out``."""
    x, idx, w = inputs
    d = check_result(got, x, idx, w, owner, dtype, f"round {r}")
    if d:
        out["mismatches"].append(d)
    out["digests"].append(digest(got.view(np.uint8)))


def token_major(r: int) -> bool:
    """Whether expert ranks receive round ``r`` token-major (``major``: "expert" (default),
    "token", or "alternate": odd rounds)."""
    major = ARGS.get("major", "expert")
    return major == "token" or (major == "alternate" and r % 2 == 1)


def cuda_token_reply(comm, batch, dev, dtype):
    """Replies to token-major ``batch`` on the cuda fabric: its rows (a CUDA buffer, checked)
    read back to the host, the test experts' reduced rows sent from device memory. Returns
    the tensor sent, the rows buffer and its host copy."""
    from cuda_tensor import DeviceTensor, to_host

    buf = batch.rows
    assert buf.device == comm.device, (buf.device, comm.device)
    assert buf.__dlpack_device__() == (2, dev)
    assert buf.shape == (batch.num_tokens, ARGS["H"]) and buf.readonly, buf
    rows = torch.from_dlpack(to_host(buf, dev))
    ids = torch.from_dlpack(batch.expert_ids)
    ws = torch.from_dlpack(batch.expert_weights)
    res = DeviceTensor.of(token_outputs(rows, ids, ws, comm.local_experts, dtype), dev)
    comm.e2a_send_tokens(batch, res)
    return res, buf, rows


def scenario_device_rounds():
    """``rounds`` A2E/E2A calls on ``fabric`` ("cuda": every tensor a CUDA tensor of the
    communicator's device, the routing on the CPU (int64 ids) or on the device (int32 ids, or
    int64 ids read back) in turn, results into new buffers or ``out=``; "shm": the same job with
    CPU tensors). Expert ranks receive expert-major or token-major (``token_major``). Each
    attention rank checks its results against the reference and reports their digests; every
    DLPack export xccl asked for is reported with its stream argument."""
    from cuda_tensor import DeviceTensor, to_host

    a = ARGS
    fabric = a["fabric"]
    comm = join_on(fabric)
    dtype, H = a["dtype"], a["H"]
    out = {"digests": [], "mismatches": [], "streams": [], "errors": []}
    with comm:
        cuda = fabric == "cuda"
        dev = device_of(comm) if cuda else None
        out["device"] = comm.device
        if comm.role == "attention":
            for r, owner, (x, idx, w) in attention_workloads(comm):
                t = x.shape[0]
                xt = to_torch(x, dtype)
                if not cuda:
                    h = comm.a2e_send(xt, torch.from_numpy(idx), torch.from_numpy(w))
                    got = to_numpy(torch.from_dlpack(comm.e2a_recv(h)), dtype)
                else:
                    xd = DeviceTensor.of(xt, dev)
                    if r % 4 == 1:
                        # As the Rust API reads it on the device: int32 ids, float32 weights.
                        ids = DeviceTensor.of(torch.from_numpy(idx).int(), dev)
                        ws = DeviceTensor.of(torch.from_numpy(w), dev)
                    elif r % 4 == 3:
                        # int64 ids on the device: read back and converted as on the host.
                        ids = DeviceTensor.of(torch.from_numpy(idx), dev)
                        ws = DeviceTensor.of(torch.from_numpy(w), dev)
                    else:
                        ids, ws = torch.from_numpy(idx), torch.from_numpy(w)
                    h = comm.a2e_send(xd, ids, ws)
                    out["streams"] += xd.streams
                    if r % 3 == 1:
                        o = DeviceTensor.of(torch.zeros((t, H), dtype=TORCH[dtype]), dev)
                        assert comm.e2a_recv(h, out=o) is o
                        out["streams"] += o.streams
                        res = o.host()
                    else:
                        buf = comm.e2a_recv(h)
                        assert buf.device == comm.device, (buf.device, comm.device)
                        assert buf.__dlpack_device__() == (2, dev)
                        assert buf.shape == (t, H) and not buf.readonly, buf
                        res = to_host(buf, dev)
                    got = to_numpy(torch.from_dlpack(res), dtype)
                record(out, got, (x, idx, w), owner, dtype, r)
        else:
            kept = None
            for r in range(a["rounds"]):
                if token_major(r):
                    batch = comm.a2e_recv_tokens()
                    if not cuda:
                        token_major_reply(comm, batch, dtype)
                        continue
                    if kept is not None:
                        # A rows buffer kept past the next receive still views its own rows:
                        # the receive did not refill the batch it keeps alive.
                        again = torch.from_dlpack(to_host(kept[0], dev))
                        assert torch.equal(again.view(torch.uint8), kept[1].view(torch.uint8))
                    res, buf, rows = cuda_token_reply(comm, batch, dev, dtype)
                    out["streams"] += res.streams
                    kept = (buf, rows) if kept is None and rows.shape[0] > 0 else None
                    continue
                batch = comm.a2e_recv()
                if cuda:
                    rows_buf = batch.rows
                    assert rows_buf.device == comm.device, rows_buf
                    assert rows_buf.shape == (batch.num_rows, H) and rows_buf.readonly
                    out["streams"] += cuda_expert_reply(comm, batch, dev, dtype).streams
                else:
                    rows = torch.from_dlpack(batch.rows)
                    comm.e2a_send(batch, expert_outputs(comm, rows, batch.expert_offsets, dtype))
    result(**out)


def scenario_torch_cuda_rounds():
    """``device_rounds`` with real torch CUDA tensors (a GPU; every rank on ``rank % GPUs``):
    each attention rank makes its inputs on a side stream that is busy first
    (``torch.cuda._sleep``), then calls xccl with that stream current: xccl must order after
    it (else it reads the inputs before they are written). Routing alternates CPU int64, CUDA
    int32/float32 and CUDA int64 (``torch.topk``'s dtype); results come as CUDA buffers
    (``torch.from_dlpack``) or into ``out=``. Expert ranks compute on the GPU."""
    a = ARGS
    comm = join_on("cuda")
    dtype, H = a["dtype"], a["H"]
    out = {"digests": [], "mismatches": [], "device": comm.device}
    dev = torch.device(comm.device)
    side = torch.cuda.Stream(dev)
    with comm:
        if comm.role == "attention":
            for r, owner, (x, idx, w) in attention_workloads(comm):
                t = x.shape[0]
                staged = [to_torch(x, dtype).to(dev), torch.from_numpy(idx).to(dev)]
                staged.append(torch.from_numpy(w).to(dev))
                torch.cuda.synchronize(dev)
                with torch.cuda.stream(side):
                    torch.cuda._sleep(20_000_000)
                    xd, ids, ws = (v.clone() for v in staged)
                    if r % 3 == 0:
                        ids, ws = torch.from_numpy(idx), torch.from_numpy(w)
                    elif r % 3 == 1:
                        ids = ids.int()
                    h = comm.a2e_send(xd, ids, ws)
                    if r % 2:
                        o = torch.empty((t, H), dtype=TORCH[dtype], device=dev)
                        assert comm.e2a_recv(h, out=o) is o
                    else:
                        buf = comm.e2a_recv(h)
                        assert buf.device == comm.device, buf
                        o = torch.from_dlpack(buf)
                    got = to_numpy(o.cpu(), dtype)
                record(out, got, (x, idx, w), owner, dtype, r)
        else:
            for _ in range(a["rounds"]):
                batch = comm.a2e_recv()
                rows = torch.from_dlpack(batch.rows)
                assert rows.device == dev, rows.device
                comm.e2a_send(batch, expert_outputs(comm, rows, batch.expert_offsets, dtype))
    result(**out)


def scenario_device_misuse():
    """1A:1E on the cuda fabric (the attention rank on device 0 of 2): tensors on the CPU, on
    the other device, on ``meta``; device routing of a wrong dtype or shape; replies (expert- and
    token-major) on the CPU, on the other device, of the wrong shape (or dtype, or strides);
    CUDA buffer exports with every legal and illegal stream; the stream of a (stand-in) torch.
    Each misuse raises naming what is wrong and sends nothing: a good round follows, checked."""
    from cuda_tensor import ColumnMajorDeviceTensor, DeviceTensor, to_host

    import xccl._cuda

    a = ARGS
    comm = join_on("cuda")
    H, dtype = a["H"], a["dtype"]
    failures = []

    def check(why, exc, fn, *words):
        f = expect(exc, fn, *words)
        if f:
            failures.append(f"{why}: {f}")

    with comm:
        dev = device_of(comm)
        other = 1 - dev
        if comm.role == "attention":
            x, idx, w = ref.workload(a["seed"], 0, 0, 4, H, a["topk"], a["E"], dtype)
            xt, it, wt = to_torch(x, dtype), torch.from_numpy(idx), torch.from_numpy(w)
            xd = DeviceTensor.of(xt, dev)
            bad = xccl.InvalidArgumentError
            here = f"cuda:{dev}"
            check("cpu x", bad, lambda: comm.a2e_send(xt, it, wt), "x is on cpu", here)
            check("numpy x", bad, lambda: comm.a2e_send(x.view(np.uint8), it, wt), "cpu", here)
            check(
                "x on the other gpu",
                bad,
                lambda: comm.a2e_send(DeviceTensor.of(xt, other), it, wt),
                f"x is on cuda:{other}",
                here,
            )
            meta = torch.empty((4, H), dtype=TORCH[dtype], device="meta")
            check("meta x", bad, lambda: comm.a2e_send(meta, it, wt), "x is on meta", here)
            check(
                "float64 weights on the device",
                bad,
                lambda: comm.a2e_send(xd, it, DeviceTensor.of(wt.double(), dev)),
                "topk_weights has dtype float64",
            )
            check(
                "ids on the device of the wrong shape",
                bad,
                lambda: comm.a2e_send(xd, DeviceTensor.of(it[:3].int(), dev), wt),
                "topk_idx has shape [3,",
            )
            check(
                "weights on the other gpu",
                bad,
                lambda: comm.a2e_send(xd, it, DeviceTensor.of(wt, other)),
                f"topk_weights is on cuda:{other}",
            )
            # A (stand-in) torch whose current stream is a stream of ours: xccl asks the
            # producer for exactly that stream.
            stream = xccl._xccl._new_stream(dev)
            real = xccl._cuda.current_stream
            xccl._cuda.current_stream = lambda d: stream if d == dev else -5
            xs = DeviceTensor.of(xt, dev)
            try:
                h = comm.a2e_send(xs, it, wt)
            finally:
                xccl._cuda.current_stream = real
            asked = list(xs.streams)
            if asked != [stream]:
                failures.append(f"torch's stream {stream}: the producer was asked for {asked}")
            o_cpu = torch.empty((4, H), dtype=TORCH[dtype])
            check("cpu out", bad, lambda: comm.e2a_recv(h, out=o_cpu), "out is on cpu", here)
            check(
                "out on the other gpu",
                bad,
                lambda: comm.e2a_recv(h, out=DeviceTensor.of(o_cpu, other)),
                f"out is on cuda:{other}",
            )
            buf = comm.e2a_recv(h)
            got = to_numpy(torch.from_dlpack(to_host(buf, dev)), dtype)
            owner = rank_of_expert(topology_of(comm))
            d = check_result(got, x, idx, w, owner, dtype, "after the misuse")
            if d:
                failures.append(str(d))
            # Exports of a CUDA buffer: every legal stream (None, -1, 1, 2, a stream pointer),
            # both ABIs; the capsule read back through xccl's import (device, shape, strides).
            for s in (None, -1, 1, 2, stream):
                for mv in (None, (1, 0)):
                    cap = buf.__dlpack__(stream=s, max_version=mv)
                    back = to_numpy(torch.from_dlpack(to_host(cap, dev)), dtype)
                    if not np.array_equal(back.view(np.uint8), got.view(np.uint8)):
                        failures.append(f"export with stream {s}, max_version {mv} differs")
            for s in (0, -2):
                check(f"stream {s}", ValueError, lambda s=s: buf.__dlpack__(stream=s), "stream")
            check(
                "export to the cpu",
                BufferError,
                lambda: buf.__dlpack__(max_version=(1, 0), dl_device=(1, 0)),
                "cross-device",
            )
            check("copy=True", BufferError, lambda: buf.__dlpack__(copy=True), "copy")
            check("numpy of a cuda buffer", bad, buf.numpy, "device memory", here)
            check(
                "a cuda buffer on the other gpu's reader",
                bad,
                lambda: to_host(buf, other),
                f"cuda:{dev}",
                f"cuda:{other}",
            )
            failures += [] if repr(buf).find(f"device=cuda:{dev}") > 0 else [repr(buf)]
            # A second round, which the expert rank receives token-major.
            buf = comm.e2a_recv(comm.a2e_send(xd, it, wt))
            got = to_numpy(torch.from_dlpack(to_host(buf, dev)), dtype)
            d = check_result(got, x, idx, w, owner, dtype, "after the token-major misuse")
            if d:
                failures.append(str(d))
        else:
            batch = comm.a2e_recv()
            rows = torch.from_dlpack(to_host(batch.rows, dev))
            res = expert_outputs(comm, rows, batch.expert_offsets, dtype)
            bad = xccl.InvalidArgumentError
            check(
                "cpu expert_out",
                bad,
                lambda: comm.e2a_send(batch, res),
                "expert_out is on cpu",
                f"cuda:{dev}",
            )
            check(
                "expert_out of the wrong shape",
                bad,
                lambda: comm.e2a_send(batch, DeviceTensor.of(res[:-1], dev)),
                "expert_out has shape",
            )
            comm.e2a_send(batch, DeviceTensor.of(res, dev))
            tokens = comm.a2e_recv_tokens()
            rows = torch.from_dlpack(to_host(tokens.rows, dev))
            ids = torch.from_dlpack(tokens.expert_ids)
            ws = torch.from_dlpack(tokens.expert_weights)
            red = token_outputs(rows, ids, ws, comm.local_experts, dtype)
            check(
                "cpu reduced",
                bad,
                lambda: comm.e2a_send_tokens(tokens, red),
                "reduced is on cpu",
                f"cuda:{dev}",
            )
            check(
                "reduced on the other gpu",
                bad,
                lambda: comm.e2a_send_tokens(tokens, DeviceTensor.of(red, other)),
                f"reduced is on cuda:{other}",
                f"cuda:{dev}",
            )
            check(
                "reduced of the wrong shape",
                bad,
                lambda: comm.e2a_send_tokens(tokens, DeviceTensor.of(red[:-1], dev)),
                "reduced has shape",
            )
            check(
                "reduced of the wrong dtype",
                bad,
                lambda: comm.e2a_send_tokens(tokens, DeviceTensor.of(red.double(), dev)),
                "reduced has dtype float64",
            )
            check(
                "reduced not C-contiguous",
                bad,
                lambda: comm.e2a_send_tokens(tokens, ColumnMajorDeviceTensor.of(red, dev)),
                "reduced is not C-contiguous",
            )
            comm.e2a_send_tokens(tokens, DeviceTensor.of(red, dev))
    result(failures=failures)


def scenario_afd_rounds():
    """``rounds`` exchanges through ``xccl.adapters.AFDConnector`` on ``fabric``, both sides
    (``send_attn_output``/``recv_ffn_output``, ``recv_attn_output``/``send_ffn_output``); on
    "cuda" every tensor is a CUDA tensor of the communicator's device, each checked to be there:
    torch's on a GPU, else ``DeviceTensor``s (torch's CUDA operations in the adapter stood in by
    ``cuda_tensor.standin_torch_cuda``).
    Attention ranks check their results against the reference; every rank reports digests of
    what it got (results; rows, expert ids, weights, seq_lens) to compare with the host job."""
    from cuda_tensor import DeviceTensor, standin_torch_cuda

    from xccl.adapters import AFDConnector, AFDConnectorMetadata

    a = ARGS
    cuda = a["fabric"] == "cuda"
    gpu = cuda and torch.cuda.is_available()
    if cuda and not gpu:
        standin_torch_cuda()
    comm = join_on(a["fabric"])
    dtype = a["dtype"]
    out = {"digests": [], "mismatches": []}
    dev = device_of(comm) if cuda else None
    conn = AFDConnector(comm)

    def to_host(t, what):
        if not cuda:
            return t
        if gpu and isinstance(t, torch.Tensor) and t.device == torch.device(comm.device):
            return t.cpu()
        if not gpu and isinstance(t, DeviceTensor) and t.device == dev:
            return torch.from_dlpack(t.host())
        raise AssertionError(f"{what} is not a CUDA tensor of cuda:{dev}: {t!r}")

    def on_device(t):
        if not cuda:
            return t
        return t.to(comm.device) if gpu else DeviceTensor.of(t, dev)

    def bits(t):
        return digest(t.contiguous().view(torch.uint8).numpy())

    if conn.is_attention:
        for r, owner, (x, idx, w) in attention_workloads(comm):
            it, wt = torch.from_numpy(idx), torch.from_numpy(w)
            meta = AFDConnectorMetadata(layer_idx=r, stage_idx=7, topk_idx=it, topk_weights=wt)
            conn.send_attn_output(on_device(to_torch(x, dtype)), meta)
            got = to_host(conn.recv_ffn_output(), "the combined output")
            record(out, to_numpy(got, dtype), (x, idx, w), owner, dtype, r)
    else:
        for r in range(a["rounds"]):
            rows, meta = conn.recv_attn_output()
            rows = to_host(rows, "hidden_states")
            ids = to_host(meta.topk_idx, "topk_idx")
            ws = to_host(meta.topk_weights, "topk_weights")
            if (meta.layer_idx, meta.stage_idx) != (r, 7):
                out["mismatches"].append(f"round {r}: {meta.layer_idx}, {meta.stage_idx}")
            b = meta.handle
            src = torch.from_dlpack(b.src_rank).long() * (1 << 32) + torch.from_dlpack(b.src_token)
            reply = token_outputs(rows, ids, ws, range(a["E"]), dtype)
            conn.send_ffn_output(on_device(reply), meta)
            # Each source's tokens are consecutive, the sources in arrival order: compare in
            # (source rank, token) order.
            p = torch.argsort(src)
            lens = sorted(zip(meta.src_ranks, meta.seq_lens))  # the rows' order is arrival's
            got = [bits(rows[p]), bits(ids[p]), bits(ws[p]), src[p].tolist(), lens]
            out["digests"].append(got)
    conn.close()
    result(**out)


def scenario_cuda_tensor_on_host_comm():
    """1A:1E on shm: a CUDA tensor is refused naming its device and the CPU; a good round
    follows."""
    from cuda_tensor import DeviceTensor

    a = ARGS
    comm = join_on("shm")
    failures = []
    with comm:
        if comm.role == "attention":
            x, idx, w = ref.workload(a["seed"], 0, 0, 4, a["H"], a["topk"], a["E"], a["dtype"])
            xt = to_torch(x, a["dtype"])
            f = expect(
                xccl.InvalidArgumentError,
                lambda: comm.a2e_send(DeviceTensor.of(xt, 0), idx, w),
                "x is on cuda:0",
                "CPU tensors",
            )
            if f:
                failures.append(f)
            if comm.device != "cpu":
                failures.append(f"device {comm.device}")
            h = comm.a2e_send(xt, idx, w)
            comm.e2a_recv(h)
        else:
            expert_major_reply(comm, comm.a2e_recv(), a["dtype"])
    result(failures=failures)


def scenario_low_latency_attention_on_cuda():
    """1A:1E on the cuda fabric: the attention rank dispatches and combines through
    ``xccl.adapters.LowLatencyBuffer`` with CUDA tensors (the routing on the CPU, int64 ids;
    the combined rows into a CUDA ``out``), the expert rank replies with the device calls;
    ``rounds`` calls checked against the reference."""
    from cuda_tensor import DeviceTensor

    from xccl.adapters import LowLatencyBuffer

    a = ARGS
    comm = join_on("cuda")
    dtype, H = a["dtype"], a["H"]
    mismatches = []
    with comm:
        dev = device_of(comm)
        if comm.role == "attention":
            buf = LowLatencyBuffer(comm, topology(), config())
            owner = rank_of_expert(topology_of(comm))
            for r in range(a["rounds"]):
                t = tokens_of(r, 0)
                x, idx, w = ref.workload(a["seed"], r, 0, t, H, a["topk"], a["E"], dtype)
                xd = DeviceTensor.of(to_torch(x, dtype), dev)
                _, _, handle, _, _ = buf.low_latency_dispatch(
                    xd, torch.from_numpy(idx), topk_weights=torch.from_numpy(w)
                )
                out = DeviceTensor.of(torch.zeros((t, H), dtype=TORCH[dtype]), dev)
                combined, _, hook = buf.low_latency_combine(
                    None, None, None, handle, out=out, return_recv_hook=True
                )
                hook()
                assert combined is out
                got = to_numpy(torch.from_dlpack(out.host()), dtype)
                d = check_result(got, x, idx, w, owner, dtype, f"round {r}")
                if d:
                    mismatches.append(d)
        else:
            for _ in range(a["rounds"]):
                cuda_expert_reply(comm, comm.a2e_recv(), dev, dtype)
    result(mismatches=mismatches)


if __name__ == "__main__":
    try:
        globals()["scenario_" + ARGS["scenario"]]()
    except BaseException:  # noqa: BLE001 - a rank reports any failure through its exit code
        traceback.print_exc()
        sys.exit(1)
