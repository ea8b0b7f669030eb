"""In-process checks of the package itself: version, errors, config parsing, buffers."""

import os
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


def test_unique_id_round_trips_through_its_hex():
    u = xccl.UniqueId.new()
    s = u.hex()
    assert len(s) == 256 and xccl.UniqueId.from_string(s).hex() == s
    with pytest.raises(xccl.BootstrapError):
        xccl.UniqueId.from_string("zz")


def test_unique_id_repr_and_str_show_the_job_and_root_but_never_the_key():
    u = xccl.UniqueId.new()
    key = u.hex()[80:144]  # bytes 40..72 of the id
    for text in (repr(u), str(u), f"{u}", format(u)):
        assert key not in text and u.hex() not in text, text
        assert f"{u.job_id:016x}" in text and u.root in text, text


def test_unique_id_from_env_reads_what_a_launcher_put_in_the_childs_environment():
    u = xccl.UniqueId.new()
    code = "import xccl; print(xccl.UniqueId.from_env().hex())"
    env = {**os.environ, "XCCL_UNIQUE_ID": u.hex()}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert out.stdout.strip() == u.hex(), out.stderr
    env.pop("XCCL_UNIQUE_ID")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert "BootstrapError" in out.stderr and "XCCL_UNIQUE_ID is not set" in out.stderr


@pytest.mark.parametrize("timeout", [1e20, 1e19, float("inf"), float("nan"), 0.0, -1.0])
def test_a_timeout_out_of_range_is_a_value_error_naming_the_limit(timeout):
    # Before: Config(timeout=1e20) raised PanicException; init(timeout=1e19) panicked on its
    # helper thread and the caller waited forever.
    with pytest.raises(ValueError, match=r"timeout must be in \(0, 31536000\] seconds"):
        xccl.Config(8, "f32", 2, 4, timeout=timeout)
    topo, cfg = xccl.Topology(1, 1, 4), xccl.Config(8, "f32", 2, 4)
    u = xccl.UniqueId.new()
    with pytest.raises(ValueError, match=r"timeout must be in \(0, 31536000\] seconds"):
        xccl.Communicator.init(topo, cfg, unique_id=u, rank=0, world_size=2, timeout=timeout)


def test_a_panic_on_the_init_thread_is_an_xccl_error_not_a_wait_forever():
    topo, cfg = xccl.Topology(1, 1, 4), xccl.Config(8, "f32", 2, 4)
    u = xccl.UniqueId.new()
    xccl._xccl._inject_panic("helper")
    with pytest.raises(xccl.XcclError, match="the init thread panicked") as e:
        xccl.Communicator.init(topo, cfg, unique_id=u, rank=0, world_size=2, timeout=5)
    assert not e.value.poisoned


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


def test_help_and_stubs_say_that_a_dropped_handle_aborts_and_shrink_closes():
    import ast

    def pydoc(obj):
        import pydoc

        return pydoc.render_doc(obj, renderer=pydoc.plaintext)

    stub = ast.parse((Path(xccl.__file__).parent / "_xccl.pyi").read_text())
    classes = {n.name: n for n in stub.body if isinstance(n, ast.ClassDef)}
    shrink_stub = next(
        f for f in classes["Communicator"].body if getattr(f, "name", "") == "shrink"
    )
    for text in (pydoc(xccl.A2eHandle), ast.get_docstring(classes["A2eHandle"])):
        assert "aborts the job" in " ".join(text.split()), text
    for text in (pydoc(xccl.ExpertBatch), ast.get_docstring(classes["ExpertBatch"])):
        assert "aborts the job" in " ".join(text.split()), text
    for text in (pydoc(xccl.Communicator.shrink), ast.get_docstring(shrink_stub)):
        assert "This communicator is closed by the call" in " ".join(text.split()), text


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


def test_a_receive_loop_refills_one_replied_batch_as_a_rust_loop_does():
    # Before: `batch = comm.a2e_recv()` received into a second batch while the replied one was
    # still referenced, so a loop alternated two (twice the memory written and read per call:
    # +0.6 ms per a2e_recv at T=128, H=7168). Now a replied batch that no buffer views gives its
    # memory to the next receive, and reading it afterwards says so.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from overhead import joined_pair

    topo, cfg = xccl.Topology(1, 1, 4), xccl.Config(8, "f32", 2, 4)
    attention, expert = pair = joined_pair(topo, cfg)
    with attention, expert:
        x = torch.ones((2, 8))
        idx = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
        w = torch.full((2, 2), 0.5)
        h = attention.a2e_send(x, idx, w)
        first = expert.a2e_recv()
        expert.e2a_send(first, first.rows)
        attention.e2a_recv(h)
        h = attention.a2e_send(x, idx, w)
        second = expert.a2e_recv()
        with pytest.raises(xccl.InvalidArgumentError, match="a later receive reused its memory"):
            first.rows  # noqa: B018
        assert "recycled" in repr(first)
        # A batch a buffer still views is never taken, even with no other reference left:
        # the view keeps its rows (ones; the next call sends twos).
        rows = np.from_dlpack(second.rows)
        expert.e2a_send(second, second.rows)
        attention.e2a_recv(h)
        del second
        h = attention.a2e_send(2 * x, idx, w)
        third = expert.a2e_recv()
        assert np.array_equal(rows, np.ones((4, 8), np.float32)), rows
        expert.e2a_send(third, third.rows)
        attention.e2a_recv(h)
    del pair
