"""The rendezvous port under torchrun: rank 0's xccl root listens on a port the OS picks, and
the other ranks read it from torchrun's agent store (the ``TCPStore`` on ``MASTER_ADDR:MASTER_PORT``
every worker of a torchrun job can reach). Only the port goes through the store, which is not
authenticated; the job's key stays in each rank's environment (``XCCL_JOB_KEY``).

Called by ``Communicator.from_env`` (the extension); not a public API.
"""

from __future__ import annotations

import os
from datetime import timedelta


def _store(timeout: float):
    from torch.distributed import TCPStore

    return TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout),
    )


def _key(store, rank: int) -> str:
    """The store key of this rank's next join: every rank of a job joins its communicators in
    the same order, so the n-th join of each names the same key."""
    prefix = "/".join(
        (
            "xccl",
            os.environ.get("TORCHELASTIC_RUN_ID", ""),
            os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
            os.environ.get("XCCL_JOB_ID", ""),
        )
    )
    n = store.add(f"{prefix}/joins/{rank}", 1)
    return f"{prefix}/root-port/{n}"


def publish_root_port(port: int, timeout: float) -> None:
    """Rank 0: the port its root listens on."""
    store = _store(timeout)
    store.set(_key(store, 0), str(port))


def root_port(rank: int, timeout: float) -> int:
    """Any other rank: the port rank 0 published (waits for it up to ``timeout`` seconds)."""
    store = _store(timeout)
    return int(store.get(_key(store, rank)))
