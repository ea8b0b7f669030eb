"""The exceptions of xccl: one class per kind of :class:`xccl::Error` of the Rust library.

Every exception carries

- ``message``: the same text as the Rust error's ``Display`` (also ``str(e)``);
- ``peer``: the rank the error names (the peer waited for, the dead rank, the rank whose data
  was bad), or ``None``;
- ``poisoned``: whether the communicator the call ran on is now poisoned (the job was aborted,
  every later call raises the first error again);
- ``retryable``: ``not poisoned`` -- the failed call published nothing to any peer, so it may be
  called again once the cause is fixed (handles and batches stay valid).

A ``KeyboardInterrupt`` raised by Ctrl-C during a blocked call follows the same rule; check
:attr:`xccl.Communicator.poisoned` after catching it.
"""

from __future__ import annotations

import builtins

__all__ = [
    "AbortedError",
    "BootstrapError",
    "ExpertLostError",
    "FabricUnavailableError",
    "InterruptedError",
    "InvalidArgumentError",
    "OsError",
    "PeerFailedError",
    "ProtocolError",
    "TimeoutError",
    "WrongRoleError",
    "XcclError",
]


class XcclError(Exception):
    """Base class of every error xccl raises."""

    message: str
    peer: int | None
    poisoned: bool
    retryable: bool

    def __init__(self, message: str, peer: int | None = None, poisoned: bool = False):
        super().__init__(message)
        self.message = message
        self.peer = peer
        self.poisoned = poisoned
        self.retryable = not poisoned


class InvalidArgumentError(XcclError, ValueError):
    """An argument is out of range or inconsistent (dtype, shape, expert id, weight, handle...).

    Nothing was sent to any peer: fix the argument and call again."""


class WrongRoleError(XcclError):
    """A call was made on a rank whose role does not allow it (A2E send on an expert rank...)."""


class TimeoutError(XcclError, builtins.TimeoutError):
    """A wait passed the call's deadline; ``peer`` is the rank it waited for.

    ``retryable`` says whether the call had published nothing (then it may be called again)."""


class PeerFailedError(XcclError):
    """A peer process is gone (exited, killed, or declared failed); ``peer`` is that rank.

    The communicator is poisoned; survivors may continue with :meth:`Communicator.shrink`."""


class AbortedError(XcclError):
    """The job was aborted: ``by`` is the rank that aborted it, ``reason`` its reason."""

    by: int
    reason: str


class ProtocolError(XcclError):
    """A peer (``peer``) sent data that breaks the wire protocol, or addressed memory outside
    the region it may write."""


class BootstrapError(XcclError):
    """The rendezvous between the ranks failed (wrong job id or size, duplicate rank...)."""


class FabricUnavailableError(XcclError):
    """The fabric asked for (``fabric``) cannot be used here; the message says why."""

    fabric: str


class ExpertLostError(XcclError):
    """A shrink left ``expert`` without a replica on a surviving rank (its ``ranks`` died)."""

    expert: int
    ranks: list


class InterruptedError(XcclError):
    """A wait was interrupted by the communicator's interrupt check (Ctrl-C arrives as
    ``KeyboardInterrupt`` instead)."""


class OsError(XcclError, OSError):
    """The operating system or a native runtime library refused something."""
