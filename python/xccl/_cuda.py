"""The CUDA stream a call on a ``cuda`` communicator orders after.

xccl is a DLPack consumer of the CUDA tensors it is given: it asks their producers to make the
data ready on this stream (``__dlpack__(stream=...)``) and orders its own work after the work
queued on it. That is torch's current stream of the device when torch has been imported and has
initialised CUDA (the stream torch's kernels producing the tensors ran on), else the legacy
default stream (``0``). xccl never imports torch itself.
"""

from __future__ import annotations

import sys


def current_stream(device: int) -> int:
    """The raw ``CUstream`` of the stream xccl's next call on CUDA device ``device`` orders
    after: ``torch.cuda.current_stream(device).cuda_stream``, or 0 (the legacy default
    stream) without torch or before torch initialised CUDA."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_initialized():
        return 0
    return int(cuda.current_stream(device).cuda_stream)
