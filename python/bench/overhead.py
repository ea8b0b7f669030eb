"""The Python layer's cost: the same calls through the package and from Rust, in one run.

Both sides run one attention and one expert rank over shared memory: H=7168 bf16, top-8 of 64
experts (all on the expert rank), room for 512 tokens per call, expert-major receive and the
identity expert (the expert replies with the rows it got). The Rust side is
``target/release/examples/roundtrip`` (``cargo build --release -p xccl --example roundtrip``);
this script runs the same loops through ``xccl`` with torch tensors (``topk_idx`` int32, the
receive into a preallocated ``out``; ``--inputs numpy`` for numpy arrays instead).

Two measurements, each alternating Rust and Python runs (the side going first alternates too,
so a drift in load hits both alike) and reporting, per run, the Python figure minus the Rust
one of the same repetition; the summary gives the median and the minimum of those paired
deltas over the repetitions, with the load:

- ``per-call`` (the binding's own cost): every call is timed alone, with no peer wait inside
  it: the attention rank times ``a2e_send``, polls ``e2a_ready`` (untimed) and times
  ``e2a_recv``; the expert polls ``a2e_ready`` (untimed) and times ``a2e_recv`` and
  ``e2a_send``. A woken rank's scheduling delay is outside every timed region, so the delta
  (Python p50 minus Rust p50 of the same call, the cost of an empty ``perf_counter_ns`` pair
  subtracted) resolves tens of nanoseconds even on a loaded machine.
- ``roundtrip``: the attention rank times ``a2e_send`` start to ``e2a_recv`` end, the
  expert's receive and reply inside it; four Python calls are on its path. It includes two
  wake-ups of a waiting rank, so on a shared machine it needs many repetitions.

    PYTHONPATH=<where xccl is installed> python python/bench/overhead.py --repeats 10

On a loaded machine (more runnable processes than cores) ``chrt -f 10 python ...`` runs both
sides (every rank inherits it) at a real-time priority above the load, the same for Rust and
Python.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HIDDEN = 7168
TOPK = 8
EXPERTS = 64
MAX_TOKENS = 512
POLL_SLEEP = 20e-6  # between untimed readiness polls, as the Rust example's POLL_SLEEP
CALLS = ("a2e_send", "a2e_recv", "e2a_send", "e2a_recv")


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


def timer_cost(clock) -> int:
    """Median of an empty timed region (two back-to-back clock reads), in ns."""
    samples = []
    for _ in range(20001):
        t0 = clock()
        t1 = clock()
        samples.append(t1 - t0)
    return int(statistics.median(samples))


def keep(*samples) -> None:
    """Appends each ``(list, ns)`` sample to its list."""
    for times, ns in samples:
        times.append(ns)


def report(tokens: int, name: str, times: list[int], empty: int) -> None:
    times.sort()
    p50, low = times[len(times) // 2] - empty, times[0] - empty
    print(
        f"PER_CALL_NS tokens={tokens} call={name} p50={p50} min={low} iters={len(times)}",
        flush=True,
    )


def workload(tokens: int, inputs: str):
    """The attention rank's x, topk_idx, topk_weights and out, as the Rust example's."""
    import torch

    x = ((torch.arange(tokens * HIDDEN) % 251).float() / 251.0).to(torch.bfloat16)
    x = x.reshape(tokens, HIDDEN)
    idx = routing(tokens)
    w = torch.full((tokens, TOPK), 1.0 / TOPK)
    out = torch.empty(tokens, HIDDEN, dtype=torch.bfloat16)
    if inputs == "numpy":
        import ml_dtypes

        x = x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        idx, w = idx.numpy(), w.numpy()
        out = out.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x, idx, w, out


def joined_pair(topo, cfg):
    """The attention and the expert communicator of a 1A:1E job, both in this process (joined
    on two threads). Also used by the package's tests."""
    import threading

    import xccl

    root = xccl.UniqueId.new()
    comms = [None, None]

    def join(rank):
        comms[rank] = xccl.Communicator.init(topo, cfg, unique_id=root, rank=rank, world_size=2)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return comms


def one_thread_main(iters: int, counts: list[int], inputs: str) -> None:
    """``--mode one-thread``: both ranks in this process (joined on two threads), then this
    thread makes every call of both in turn, so no call waits for a peer, timing each."""
    import torch

    import xccl

    topo = xccl.Topology(1, 1, EXPERTS)
    cfg = xccl.Config(HIDDEN, torch.bfloat16, TOPK, MAX_TOKENS)
    attention, expert = joined_pair(topo, cfg)
    clock = time.perf_counter_ns
    empty = timer_cost(clock)
    with attention, expert:
        for tokens in counts:
            warmup, measured = iterations(iters, tokens)
            x, idx, w, out = workload(tokens, inputs)
            times = ([], [], [], [])
            batch = None
            for i in range(warmup + measured):
                t0 = clock()
                handle = attention.a2e_send(x, idx, w)
                t1 = clock()
                batch = expert.a2e_recv()
                t2 = clock()
                expert.e2a_send(batch, batch.rows)
                t3 = clock()
                attention.e2a_recv(handle, out=out)
                t4 = clock()
                if i >= warmup:
                    for k, (a, b) in enumerate(((t0, t1), (t1, t2), (t2, t3), (t3, t4))):
                        times[k].append(b - a)
            del batch
            for name, t in zip(CALLS, times):
                report(tokens, name, t, empty)


def rank_main(rank: int, iters: int, counts: list[int], mode: str, inputs: str) -> None:
    """One rank of the Python job; the unique id comes on stdin."""
    import torch

    import xccl

    uid = sys.stdin.readline().strip()
    topo = xccl.Topology(1, 1, EXPERTS)
    cfg = xccl.Config(HIDDEN, torch.bfloat16, TOPK, MAX_TOKENS)
    clock = time.perf_counter_ns  # CLOCK_MONOTONIC, as Rust's Instant
    empty = timer_cost(clock) if mode == "per-call" else 0
    with xccl.Communicator.init(topo, cfg, unique_id=uid, rank=rank, world_size=2) as comm:
        for tokens in counts:
            warmup, measured = iterations(iters, tokens)
            if comm.role == "attention":
                x, idx, w, out = workload(tokens, inputs)
                if mode == "per-call":
                    send, recv = [], []
                    for i in range(warmup + measured):
                        t0 = clock()
                        handle = comm.a2e_send(x, idx, w)
                        t1 = clock()
                        while not comm.e2a_ready(handle):
                            time.sleep(POLL_SLEEP)
                        t2 = clock()
                        comm.e2a_recv(handle, out=out)
                        t3 = clock()
                        if i >= warmup:
                            keep((send, t1 - t0), (recv, t3 - t2))
                    report(tokens, "a2e_send", send, empty)
                    report(tokens, "e2a_recv", recv, empty)
                    continue
                times = []
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
            elif mode == "per-call":
                recv, send = [], []
                batch = None
                for i in range(warmup + measured):
                    while not comm.a2e_ready():
                        time.sleep(POLL_SLEEP)
                    t0 = clock()
                    batch = comm.a2e_recv()
                    t1 = clock()
                    comm.e2a_send(batch, batch.rows)
                    t2 = clock()
                    if i >= warmup:
                        keep((recv, t1 - t0), (send, t2 - t1))
                report(tokens, "a2e_recv", recv, empty)
                report(tokens, "e2a_send", send, empty)
                del batch
            else:
                for _ in range(warmup + measured):
                    batch = comm.a2e_recv()
                    comm.e2a_send(batch, batch.rows)


def parse(out: str) -> dict:
    """{tokens: {"roundtrip"|call: {"p50": ns, "min": ns}}} from the ranks' lines."""
    res: dict = {}
    for line in out.splitlines():
        for tag in ("ROUNDTRIP_NS ", "PER_CALL_NS "):
            if line.startswith(tag):
                kv = dict(f.split("=") for f in line.split()[1:])
                name = kv.get("call", "roundtrip")
                res.setdefault(int(kv["tokens"]), {})[name] = {
                    "p50": int(kv["p50"]),
                    "min": int(kv["min"]),
                }
    return res


def run_rust(exe: str, iters: int, counts: list[int], mode: str) -> dict:
    flag = {"per-call": ["--per-call"], "one-thread": ["--one-thread"]}.get(mode, [])
    out = subprocess.run(
        [exe, *flag, str(iters), *map(str, counts)],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0:
        raise SystemExit(f"{exe}: exit {out.returncode}: {out.stderr}")
    return parse(out.stdout)


def run_python(iters: int, counts: list[int], mode: str, inputs: str) -> dict:
    import xccl

    if mode == "one-thread":
        cmd = [sys.executable, os.path.abspath(__file__), "--rank", "0", "--mode", mode]
        cmd += ["--inputs", inputs, "--iters", str(iters), "--tokens", *map(str, counts)]
        out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise SystemExit(f"python one-thread: exit {out.returncode}: {out.stderr}")
        return parse(out.stdout)

    root = xccl.UniqueId.new()  # the rendezvous root lives as long as this object
    uid = root.hex()
    procs = []
    for rank in range(2):
        cmd = [sys.executable, os.path.abspath(__file__), "--rank", str(rank), "--mode", mode]
        cmd += ["--inputs", inputs, "--iters", str(iters), "--tokens", *map(str, counts)]
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        p.stdin.write(uid + "\n")
        p.stdin.flush()  # communicate() closes it
        procs.append(p)
    merged: dict = {}
    for rank, p in enumerate(procs):
        out, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            raise SystemExit(f"python rank {rank}: exit {p.returncode}")
        for t, calls in parse(out).items():
            merged.setdefault(t, {}).update(calls)
    return merged


def us(ns: float) -> str:
    return f"{ns / 1e3:.2f}"


def summary(samples: list, tokens: list[int], names: tuple, loads: list[float]) -> None:
    policy = {os.SCHED_OTHER: "normal", os.SCHED_FIFO: "SCHED_FIFO", os.SCHED_RR: "SCHED_RR"}
    sched = policy.get(os.sched_getscheduler(0), "other")
    print(
        f"load (1 min) {min(loads):.2f} .. {max(loads):.2f} over {len(samples)} repeats, "
        f"{os.cpu_count()} CPUs, scheduling {sched}"
    )
    for t in tokens:
        for name in names:
            rs = [s["rust"][t][name]["p50"] for s in samples]
            py = [s["python"][t][name]["p50"] for s in samples]
            d50 = [p - q for p, q in zip(py, rs)]
            dmin = [s["python"][t][name]["min"] - s["rust"][t][name]["min"] for s in samples]
            print(
                f"T={t} {name}: p50 rust {us(min(rs))} .. {us(max(rs))} us, python "
                f"{us(min(py))} .. {us(max(py))} us; added (python p50 - rust p50 per repeat) "
                f"median {us(statistics.median(d50))} us, min {us(min(d50))}, max "
                f"{us(max(d50))}; added (min - min) median {us(statistics.median(dmin))} us"
            )
        if names == CALLS:
            total = [
                sum(s["python"][t][n]["p50"] - s["rust"][t][n]["p50"] for n in CALLS)
                for s in samples
            ]
            print(
                f"T={t} the four calls of a round trip: added median {us(statistics.median(total))}"
                f" us (min {us(min(total))}, max {us(max(total))}), per call "
                f"{us(statistics.median(total) / 4)} us"
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("one-thread", "per-call", "roundtrip"), default="one-thread")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--iters", type=int, default=2000, help="measured iterations at T=1")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 128])
    ap.add_argument("--inputs", choices=("torch", "numpy"), default="torch")
    ap.add_argument("--rust", default="target/release/examples/roundtrip")
    ap.add_argument("--json", help="write every sample here")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None and args.mode == "one-thread":
        one_thread_main(args.iters, args.tokens, args.inputs)
        return 0
    if args.rank is not None:
        rank_main(args.rank, args.iters, args.tokens, args.mode, args.inputs)
        return 0
    names = ("roundtrip",) if args.mode == "roundtrip" else CALLS
    samples, loads = [], []
    for r in range(args.repeats):
        order = ("rust", "python") if r % 2 == 0 else ("python", "rust")
        got = {}
        for side in order:
            loads.append(os.getloadavg()[0])
            if side == "rust":
                got[side] = run_rust(args.rust, args.iters, args.tokens, args.mode)
            else:
                got[side] = run_python(args.iters, args.tokens, args.mode, args.inputs)
        samples.append(got)
        line = [f"repeat {r} (load {loads[-1]:.1f}):"]
        for t in args.tokens:
            for name in names:
                rs, py = got["rust"][t][name]["p50"], got["python"][t][name]["p50"]
                line.append(f"T={t} {name} {us(rs)}/{us(py)}")
        print(" ".join(line) + "  (rust/python p50, us)", flush=True)
    summary(samples, args.tokens, names, loads)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": args.mode, "tokens": args.tokens, "samples": samples}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
