"""The cuda fabric with real torch CUDA tensors, on a GPU (skipped where torch sees none, as on
CI machines; ``test_cuda.py`` covers the stand-in there): what the stand-in cannot show, torch's
DLPack exchange API on CUDA, ``torch.from_dlpack`` of xccl's CUDA buffers, and xccl ordering
its work after a busy current stream. Results are compared bit for bit with the same job on CPU
tensors over shm. Run on a GPU machine with the package installed and `XCCL_NVRTC_LIBRARY` naming
NVRTC: `pytest python/tests/test_cuda_gpu.py`."""

import os

import harness
import pytest
import torch
from test_cuda import BASE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_torch_cuda_tensors_on_a_busy_stream_give_the_host_jobs_bits(tmp_path):
    # The real driver: no stand-in in the ranks' environment.
    env = {k: v for k, v in os.environ.items() if k != "XCCL_CUDA_LIBRARY"}
    kw = {**BASE, "m": 2, "n": 2, "dtype": "bf16", "rounds": 6, "tokens": [[5, 0], [16, 3]]}
    (tmp_path / "gpu").mkdir()
    (tmp_path / "host").mkdir()
    gpu = harness.run("torch_cuda_rounds", 4, tmp_path / "gpu", env=env, **kw)
    host = harness.run("device_rounds", 4, tmp_path / "host", env=env, fabric="shm", **kw)
    for r in range(2):
        assert gpu[r]["mismatches"] == [], gpu[r]["mismatches"]
        assert gpu[r]["digests"] == host[r]["digests"], f"rank {r}: GPU and host differ"


def test_afd_connector_on_torch_cuda_tensors_gives_the_host_jobs_bits(tmp_path):
    # Both sides of AFDConnector with torch CUDA tensors: the FFN side's hidden_states is
    # torch.from_dlpack of the device rows, its metadata moved to the GPU by torch.
    env = {k: v for k, v in os.environ.items() if k != "XCCL_CUDA_LIBRARY"}
    kw = {**BASE, "m": 2, "n": 2, "dtype": "bf16", "rounds": 5, "tokens": [[5, 0], [16, 3]]}
    runs = {}
    for fabric in ("cuda", "shm"):
        (tmp_path / fabric).mkdir()
        runs[fabric] = harness.run("afd_rounds", 4, tmp_path / fabric, env=env, fabric=fabric, **kw)
    for r in range(4):
        assert runs["cuda"][r]["mismatches"] == [], runs["cuda"][r]["mismatches"]
        assert runs["cuda"][r]["digests"] == runs["shm"][r]["digests"], f"rank {r} differs"
