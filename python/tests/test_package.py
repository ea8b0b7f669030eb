"""In-process checks of the package itself: version, errors, config parsing, buffers."""

import re
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

import xccl


def test_version_is_the_crate_version():
    cargo = (Path(__file__).resolve().parents[2] / "Cargo.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', cargo, re.MULTILINE).group(1)
    assert xccl.__version__ == version


def test_errors_mirror_the_rust_error_kinds():
    assert issubclass(xccl.InvalidArgumentError, ValueError)
    assert issubclass(xccl.TimeoutError, TimeoutError)
    for cls in (
        xccl.InvalidArgumentError,
        xccl.WrongRoleError,
        xccl.TimeoutError,
        xccl.PeerFailedError,
        xccl.AbortedError,
        xccl.ProtocolError,
        xccl.BootstrapError,
        xccl.FabricUnavailableError,
        xccl.ExpertLostError,
        xccl.InterruptedError,
        xccl.OsError,
    ):
        assert issubclass(cls, xccl.XcclError), cls
    with pytest.raises(xccl.InvalidArgumentError) as e:
        xccl.Config(8, "f64", 2, 4)
    assert str(e.value) == 'invalid argument: unknown dtype "f64" (expected f32, f16 or bf16)'
    assert e.value.message == str(e.value)
    assert e.value.peer is None and e.value.retryable and not e.value.poisoned


@pytest.mark.parametrize(
    "dtype,name",
    [
        ("bf16", "bf16"),
        (torch.bfloat16, "bf16"),
        (torch.float16, "f16"),
        (torch.float32, "f32"),
        (np.float32, "f32"),
        (np.dtype(np.float16), "f16"),
        (np.dtype(ml_dtypes.bfloat16), "bf16"),
    ],
)
def test_config_takes_torch_numpy_and_named_dtypes(dtype, name):
    assert xccl.Config(16, dtype, 2, 8).dtype == name


def test_topology_with_explicit_roles_and_bad_roles():
    t = xccl.Topology(2, 1, 4, roles=["expert", "attention", "attention"])
    assert t.attention_ranks == [1, 2] and t.expert_ranks == [0]
    assert t.local_experts(0) == [0, 1, 2, 3]
    with pytest.raises(xccl.InvalidArgumentError, match="1 attention and 2 expert"):
        xccl.Topology(2, 1, 4, roles=["expert", "attention", "expert"])
    with pytest.raises(xccl.InvalidArgumentError, match="unknown role"):
        xccl.Topology(1, 1, 4, roles=["expert", "cook"])


def test_unique_id_round_trips_through_its_string():
    u = xccl.UniqueId.new()
    s = str(u)
    assert len(s) == 256 and str(xccl.UniqueId.from_string(s)) == s
    with pytest.raises(xccl.BootstrapError):
        xccl.UniqueId.from_string("zz")


def test_every_public_name_has_a_docstring():
    for name in xccl.__all__:
        obj = getattr(xccl, name)
        if isinstance(obj, str):
            continue
        assert (obj.__doc__ or "").strip(), name
        for attr, member in vars(obj).items() if isinstance(obj, type) else []:
            if attr.startswith("_") or not callable(member) and not isinstance(member, property):
                continue
            assert (getattr(member, "__doc__", "") or "").strip(), f"{name}.{attr}"


def test_help_of_communicator_reads_like_the_rust_docs():
    text = subprocess.run(
        [sys.executable, "-c", "import xccl; help(xccl.Communicator)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for words in ("a2e_send", "poisoned", "KeyboardInterrupt", "e2a_recv(self, /, handle"):
        assert words in text, words


def test_the_stub_file_names_every_public_member_of_the_extension():
    import ast

    import xccl._xccl as ext

    stub_path = Path(xccl.__file__).parent / "_xccl.pyi"
    tree = ast.parse(stub_path.read_text())
    stub = {
        n.name: {f.name for f in n.body if isinstance(f, ast.FunctionDef)}
        for n in tree.body
        if isinstance(n, ast.ClassDef)
    }
    classes = {a for a in dir(ext) if isinstance(getattr(ext, a), type)}
    assert classes == set(stub), classes ^ set(stub)
    for name, members in stub.items():
        real = {a for a in dir(getattr(ext, name)) if not a.startswith("_")}
        assert {m for m in members if not m.startswith("_")} == real, (name, real ^ members)
