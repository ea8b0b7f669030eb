"""A2E/E2A from Python through the ctypes wrapper, one process per rank.

Run it under a launcher (rank 0 hosts the rendezvous on the given port):
    torchrun --nproc-per-node 4 --master-port 29500 moe_demo.py
    XCCL_JOB_KEY=$(openssl rand -hex 32) XCCL_ROOT=127.0.0.1:29500 mpirun -x XCCL_JOB_KEY -n 2 python3 moe_demo.py
or by hand, one shell per rank: XCCL_RANK=r XCCL_SIZE=n XCCL_ROOT=127.0.0.1:29500 XCCL_JOB_KEY=<the same 64 hex digits> python3 moe_demo.py

Half the ranks are attention ranks, half expert ranks; expert e scales its rows by (e + 1), so
each attention rank checks its combined output exactly. Uses numpy when it is installed, plain
`array` otherwise.
"""

import os
import sys
from array import array

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import xccl  # noqa: E402

HIDDEN, TOPK, EXPERTS, MAX_TOKENS, ROUNDS = 16, 2, 8, 6, 3


def size_from_env():
    for k in ("XCCL_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        if k in os.environ:
            return int(os.environ[k])
    sys.exit("no launcher environment (see the module docstring)")


def main():
    nranks = size_from_env()
    cfg = xccl.Config(numAttentionRanks=nranks // 2, numExperts=EXPERTS, topk=TOPK,
                      hidden=HIDDEN, maxTokensPerRank=MAX_TOKENS, dtype=xccl.FLOAT32,
                      timeoutMs=20000)
    with xccl.Comm(cfg) as comm:
        assert xccl.version() >= 100, xccl.version()
        for rnd in range(ROUNDS):
            if comm.role == xccl.ROLE_ATTENTION:
                attention_round(comm, rnd)
            else:
                expert_round(comm)
        assert comm.async_error() == xccl.SUCCESS
        print(f"rank {comm.rank}: ok", flush=True)


def attention_round(comm, rnd):
    T = MAX_TOKENS - rnd
    x = array("f", [float((t + h + comm.rank + rnd) % 9 - 4) for t in range(T) for h in range(HIDDEN)])
    idx = array("i", [(t * 3 + k + comm.rank + rnd) % EXPERTS for t in range(T) for k in range(TOPK)])
    w = array("f", [0.5, 0.25] * T)
    out = array("f", [0.0]) * (T * HIDDEN)
    handle = comm.a2e_send(x, T, idx, w)
    comm.e2a_recv(handle, out)
    for i, got in enumerate(out):
        t = i // HIDDEN
        want = sum(w[t * TOPK + k] * x[i] * (idx[t * TOPK + k] + 1) for k in range(TOPK))
        if got != want:
            sys.exit(f"rank {comm.rank} round {rnd}: out[{i}] = {got}, expected {want}")


def expert_round(comm):
    batch = comm.a2e_recv()
    rows = array("f")
    rows.frombytes(batch.rows)
    y = array("f", [0.0]) * len(rows)
    for j, e in enumerate(comm.local_experts):
        for r in range(batch.offsets[j], batch.offsets[j + 1]):
            for h in range(HIDDEN):
                y[r * HIDDEN + h] = rows[r * HIDDEN + h] * (e + 1)
    if len(y) == 0:
        y = array("f", [0.0])
    comm.e2a_send(batch, y)


if __name__ == "__main__":
    try:
        main()
    except xccl.XcclError as e:
        sys.exit(f"xccl error: {e}")
