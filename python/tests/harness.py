"""Runs a job of real processes for the tests: every rank is ``python worker.py`` with its
rank, the scenario and its arguments; returns each rank's result (the JSON it printed last) or
the exit status of the ranks that did not finish."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """A started job: ``procs[r]`` is rank ``r``'s process."""

    def __init__(self, procs, tmp, uid=None):
        self.procs = procs
        self.tmp = tmp
        # The unique id the ranks joined with (its hex), for a ``join="uid"`` job.
        self.uid = uid

    def wait(self, timeout: float = 240.0) -> list:
        """Each rank's result dict, or ``{"exit": code, "stderr": ...}`` for a rank that printed
        none."""
        deadline = time.monotonic() + timeout
        out = []
        for p in self.procs:
            try:
                stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in self.procs:
                    q.kill()
                raise AssertionError(f"rank {self.procs.index(p)} did not finish in {timeout} s")
            result = {"exit": p.returncode, "stderr": stderr[-4000:]}
            for line in stdout.splitlines():
                if line.startswith("RESULT "):
                    result.update(json.loads(line[len("RESULT ") :]))
            out.append(result)
        return out

    def signal(self, rank: int, sig=signal.SIGINT) -> float:
        """Sends ``sig`` to ``rank``; returns the monotonic time it was sent."""
        t = time.monotonic()
        self.procs[rank].send_signal(sig)
        return t

    def wait_for_file(self, name: str, timeout: float = 60.0) -> Path:
        path = Path(self.tmp) / name
        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} did not appear in {timeout} s")
            if any(p.poll() not in (None, 0) for p in self.procs):
                raise AssertionError(
                    f"a rank exited while waiting for {name}: "
                    + str([p.poll() for p in self.procs])
                )
            time.sleep(0.005)
        return path


def start(
    scenario: str, world: int, tmp, join: str = "uid", env=None, rank_env=None, **args
) -> Job:
    """Starts ``world`` ranks of ``scenario``. ``join``: ``"uid"`` (a unique id made here),
    ``"env"`` (``XCCL_RANK``/``XCCL_SIZE``/``XCCL_ROOT``), ``"torchrun"`` (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), or ``"torch"`` (a torch.distributed gloo
    group, then ``xccl.init_from_process_group``)."""
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    common = {"scenario": scenario, "world": world, "join": join, "tmp": str(tmp), **args}
    if join == "uid":
        import xccl

        common["uid"] = xccl.UniqueId.new().hex()
        common["uids"] = [xccl.UniqueId.new().hex() for _ in args.get("cases") or []]
    port = free_port()
    # Launcher joins authenticate with a key every rank's environment holds (never argv).
    key = secrets.token_hex(32)
    procs = []
    for rank in range(world):
        e = dict(env)
        e.update((rank_env or {}).get(rank, {}))
        if join == "env":
            e.update(
                XCCL_RANK=str(rank),
                XCCL_SIZE=str(world),
                XCCL_ROOT=f"127.0.0.1:{port}",
                XCCL_JOB_KEY=key,
            )
        elif join in ("torchrun", "torch"):
            e.update(
                XCCL_JOB_KEY=key,
                RANK=str(rank),
                WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
        e["XCCL_TEST_ARGS"] = json.dumps({**common, "rank": rank})
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER)],
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return Job(procs, tmp, common.get("uid"))


def run(scenario: str, world: int, tmp, timeout: float = 240.0, **args) -> list:
    """Starts the job and waits for every rank; fails naming a rank that exited non-zero."""
    results = start(scenario, world, tmp, **args).wait(timeout)
    for r, res in enumerate(results):
        assert res["exit"] == 0, f"rank {r} exited {res['exit']}: {res['stderr']}"
    return results
