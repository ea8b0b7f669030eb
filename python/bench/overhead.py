"""The Python layer's cost: the round trip through the package against the same loop in Rust.

Both sides run one attention and one expert rank over shared memory: H=7168 bf16, top-8 of 64
experts (all on the expert rank), room for 128 tokens per call, expert-major receive and the
identity expert (the expert replies with the rows it got), the attention rank timing each
iteration from before ``a2e_send`` to after ``e2a_recv``. The Rust side is
``target/release/examples/roundtrip`` (``cargo build --release -p xccl --example roundtrip``);
this script runs the same loop through ``xccl`` with torch tensors (``topk_idx`` int32, the
receive into a preallocated ``out``). Runs alternate Rust / Python for every repeat, and each
repeat's p50 difference is one sample of the added cost.

    PYTHONPATH=<where xccl is installed> python python/bench/overhead.py --repeats 5

On a loaded machine (more runnable processes than cores) a woken rank waits for a core and
the round trip measures the scheduler; ``chrt -f 10 python ...`` runs both sides (every rank
inherits it) at a real-time priority above the load, the same for Rust and Python.

Four Python calls are on the path of one round trip (a2e_send, a2e_recv, e2a_send, e2a_recv);
"per direction" is the added round trip divided by 2 (A2E and E2A).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HIDDEN = 7168
TOPK = 8
EXPERTS = 64
MAX_TOKENS = 128


def iterations(iters: int, tokens: int) -> tuple[int, int]:
    """(warmup, measured) at `tokens`, as the Rust example's `iterations`."""
    n = max(iters * 8 // (tokens + 7), 50)
    return min(n, 100), n


def routing(tokens: int):
    """The Rust example's routing: 8 distinct experts per token."""
    import torch

    idx = [
        [(((t * 37 + 11) % EXPERTS) + j * 5) % EXPERTS for j in range(TOPK)] for t in range(tokens)
    ]
    return torch.tensor(idx, dtype=torch.int32)


def rank_main(rank: int, iters: int, counts: list[int]) -> None:
    """One rank of the Python job; the unique id comes on stdin."""
    import torch

    import xccl

    uid = sys.stdin.readline().strip()
    topo = xccl.Topology(1, 1, EXPERTS)
    cfg = xccl.Config(HIDDEN, torch.bfloat16, TOPK, MAX_TOKENS)
    with xccl.Communicator.init(topo, cfg, unique_id=uid, rank=rank, world_size=2) as comm:
        for tokens in counts:
            warmup, measured = iterations(iters, tokens)
            if comm.role == "attention":
                x = ((torch.arange(tokens * HIDDEN) % 251).float() / 251.0).to(torch.bfloat16)
                x = x.reshape(tokens, HIDDEN)
                idx = routing(tokens)
                w = torch.full((tokens, TOPK), 1.0 / TOPK)
                out = torch.empty(tokens, HIDDEN, dtype=torch.bfloat16)
                times = []
                clock = time.perf_counter_ns  # CLOCK_MONOTONIC, as Rust's Instant
                for i in range(warmup + measured):
                    start = clock()
                    handle = comm.a2e_send(x, idx, w)
                    comm.e2a_recv(handle, out=out)
                    if i >= warmup:
                        times.append(clock() - start)
                times.sort()
                print(
                    f"ROUNDTRIP_NS tokens={tokens} p50={times[len(times) // 2]} "
                    f"min={times[0]} iters={measured}",
                    flush=True,
                )
            else:
                for _ in range(warmup + measured):
                    batch = comm.a2e_recv()
                    comm.e2a_send(batch, batch.rows)


def parse(out: str) -> dict[int, dict[str, int]]:
    """{tokens: {"p50": ns, "min": ns}} from ROUNDTRIP_NS lines."""
    res = {}
    for line in out.splitlines():
        if line.startswith("ROUNDTRIP_NS "):
            kv = dict(f.split("=") for f in line.split()[1:])
            res[int(kv["tokens"])] = {"p50": int(kv["p50"]), "min": int(kv["min"])}
    return res


def run_rust(exe: str, iters: int, counts: list[int]) -> dict:
    out = subprocess.run(
        [exe, str(iters), *map(str, counts)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode != 0:
        raise SystemExit(f"{exe}: exit {out.returncode}: {out.stderr}")
    return parse(out.stdout)


def run_python(iters: int, counts: list[int]) -> dict:
    import xccl

    root = xccl.UniqueId.new()  # the rendezvous root lives as long as this object
    uid = str(root)
    procs = []
    for rank in range(2):
        cmd = [sys.executable, os.path.abspath(__file__), "--rank", str(rank)]
        cmd += ["--iters", str(iters), "--tokens", *map(str, counts)]
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        p.stdin.write(uid + "\n")
        p.stdin.flush()  # communicate() closes it
        procs.append(p)
    outs = []
    for rank, p in enumerate(procs):
        out, _ = p.communicate(timeout=300)
        if p.returncode != 0:
            raise SystemExit(f"python rank {rank}: exit {p.returncode}")
        outs.append(out)
    return parse(outs[0])


def span(xs: list[float]) -> str:
    return f"{min(xs):.2f} .. {max(xs):.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iters", type=int, default=2000, help="measured iterations at T=1")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 128])
    ap.add_argument("--rust", default="target/release/examples/roundtrip")
    ap.add_argument("--json", help="write every sample here")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.iters, args.tokens)
        return 0
    samples = []
    for r in range(args.repeats):
        # Alternate which side goes first, so a drift in load hits both alike.
        order = ("rust", "python") if r % 2 == 0 else ("python", "rust")
        got = {}
        for side in order:
            if side == "rust":
                got[side] = run_rust(args.rust, args.iters, args.tokens)
            else:
                got[side] = run_python(args.iters, args.tokens)
        samples.append(got)
        line = [f"repeat {r}:"]
        for t in args.tokens:
            rs, py = got["rust"][t]["p50"], got["python"][t]["p50"]
            line.append(f"T={t} rust {rs / 1e3:.2f} us python {py / 1e3:.2f} us")
        print(" ".join(line), flush=True)
    policy = {os.SCHED_OTHER: "normal", os.SCHED_FIFO: "SCHED_FIFO", os.SCHED_RR: "SCHED_RR"}
    sched = policy.get(os.sched_getscheduler(0), "other")
    print(f"load: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs, scheduling {sched}")
    for t in args.tokens:
        rs = [s["rust"][t]["p50"] / 1e3 for s in samples]
        py = [s["python"][t]["p50"] / 1e3 for s in samples]
        added = [p - q for p, q in zip(py, rs)]
        added_min = [(s["python"][t]["min"] - s["rust"][t]["min"]) / 1e3 for s in samples]
        print(
            f"T={t}: round trip p50 rust {span(rs)} us, python {span(py)} us; added per round "
            f"trip (p50) {span(added)} us, per direction {span([a / 2 for a in added])} us; "
            f"added (min) {span(added_min)} us"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "samples": samples}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
