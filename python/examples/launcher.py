"""A launcher that starts the ranks itself (here 2 attention and 2 expert ranks on this host).

It makes the job's :class:`xccl.UniqueId` first: ``UniqueId.new()`` starts the rendezvous root
on a thread of this process, so this process lives until every rank has joined (it waits for
them all). It hands the id to each child in its environment, ``XCCL_UNIQUE_ID`` (the id holds
the job's key: never put it on a command line, where every local user can read it), and each
rank reads it back with ``xccl.UniqueId.from_env()``. A launcher that forks instead
(``multiprocessing``) makes the id the same way, before it starts the ranks or in another
process that outlives them, never in a rank that may exit first.

    python python/examples/launcher.py
"""

from __future__ import annotations

import os
import subprocess
import sys

WORLD, ATTENTION = 4, 2


def rank_main(rank: int) -> None:
    import torch

    import xccl

    topo = xccl.Topology(ATTENTION, WORLD - ATTENTION, num_experts=8)
    cfg = xccl.Config(hidden=256, dtype=torch.float32, topk=2, max_tokens_per_rank=16)
    uid = xccl.UniqueId.from_env()
    with xccl.Communicator.init(topo, cfg, unique_id=uid, rank=rank, world_size=WORLD) as comm:
        if comm.role == "attention":
            x = torch.randn(16, 256)
            w, idx = torch.rand(16, 8).topk(2)
            w = w / w.sum(dim=1, keepdim=True)
            y = torch.from_dlpack(comm.e2a_recv(comm.a2e_send(x, idx, w)))
            # Identity experts, weights summing to 1: y is x (up to rounding).
            assert torch.allclose(y, x, atol=1e-5), (y - x).abs().max()
            print(f"rank {rank}: round trip ok", flush=True)
        else:
            batch = comm.a2e_recv()
            comm.e2a_send(batch, batch.rows)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]))
        return 0
    import xccl

    uid = xccl.UniqueId.new()  # the root runs here, while this process waits for the ranks
    env = {**os.environ, "XCCL_UNIQUE_ID": uid.hex()}
    ranks = [
        subprocess.Popen([sys.executable, __file__, "--rank", str(r)], env=env)
        for r in range(WORLD)
    ]
    codes = [p.wait(timeout=120) for p in ranks]
    print(f"launcher: ranks exited {codes}")
    return 0 if not any(codes) else 1


if __name__ == "__main__":
    sys.exit(main())
