import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

REPO = Path(__file__).resolve().parents[2]


def _nvrtc() -> str:
    """The real NVRTC the cuda fabric's data plane compiles its kernels with: the one
    ``XCCL_NVRTC_LIBRARY`` names (ci/test.sh sets it), else torch's ``nvidia-cuda-nvrtc`` in this
    Python's environment (where ci/test.sh finds it)."""
    named = os.environ.get("XCCL_NVRTC_LIBRARY")
    if named:
        return named
    found = sorted(Path(sys.prefix).glob("lib/python*/site-packages/nvidia/**/libnvrtc.so.1[0-9]"))
    if not found:
        raise AssertionError(
            "no libnvrtc.so.1x in this Python's environment: set XCCL_NVRTC_LIBRARY "
            "(ci/python-env.sh installs torch's nvidia-cuda-nvrtc)"
        )
    return str(found[-1])


@pytest.fixture(scope="session")
def cuda_standin(tmp_path_factory):
    """The environment of a job on the cuda fabric without a GPU: the stand-in CUDA driver
    (``tests/cuda_standin/``, built once per session with the flags of
    ``xccl::testing::build_cuda_standin``) showing 2 devices, its shared-memory segments under a
    prefix of this session's (checked to be gone after each job), and NVRTC."""
    out = tmp_path_factory.mktemp("cuda-standin") / "libcuda.so.1"
    src = REPO / "tests" / "cuda_standin"
    subprocess.run(
        [
            "gcc",
            "-shared",
            "-fPIC",
            "-O1",
            "-Wall",
            "-fvisibility=hidden",
            "-ffp-contract=off",
            f"-I{REPO / 'xccl' / 'src' / 'moe' / 'dataplane'}",
            f"-I{src}",
            "-o",
            str(out),
            str(src / "cuda_standin.c"),
            str(src / "kernels.c"),
            "-lpthread",
            "-lrt",
        ],
        check=True,
    )
    return {
        "XCCL_CUDA_LIBRARY": str(out),
        "XCCL_NVRTC_LIBRARY": _nvrtc(),
        "CUDA_STANDIN_DEVICES": "2",
        "CUDA_STANDIN_SHM_PREFIX": f"xccl-pycu-{os.getpid()}",
    }
