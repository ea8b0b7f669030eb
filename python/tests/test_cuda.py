"""The cuda fabric through the package, on the stand-in CUDA driver (no GPU here): jobs of real
processes whose tensors are CUDA tensors (``cuda_tensor.DeviceTensor``: device memory of the
stand-in, exported through DLPack as kDLCUDA), checked bit for bit against the same job on host
tensors over shm and against the reference; wrong devices, CUDA buffer exports and the DLPack
stream protocol on both sides."""

import sys
from pathlib import Path

import harness

BASE = {"H": 48, "topk": 3, "E": 8, "max_tokens": 16, "seed": 11, "call_timeout": 30.0}


def standin_left(env) -> list:
    """The stand-in's shared-memory segments still in /dev/shm."""
    prefix = env["CUDA_STANDIN_SHM_PREFIX"]
    return [p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(prefix)]


def device_job(tmp_path, env, world, fabric, scenario="device_rounds", **kw):
    args = {**BASE, "rounds": 5, "tokens": [[5, 0, 16], [1, 16, 3]], **kw}
    out = tmp_path / fabric
    out.mkdir()
    results = harness.run(scenario, world, out, env=env, fabric=fabric, **args)
    assert standin_left(env) == []
    return results


def same_results_on_device_and_host(tmp_path, env, m, n, dtype, major="expert"):
    kw = {"m": m, "n": n, "dtype": dtype, "major": major}
    cuda = device_job(tmp_path, env, m + n, "cuda", **kw)
    host = device_job(tmp_path, env, m + n, "shm", **kw)
    for r in range(m):
        assert cuda[r]["mismatches"] == [], cuda[r]["mismatches"]
        assert host[r]["mismatches"] == [], host[r]["mismatches"]
        assert cuda[r]["digests"] == host[r]["digests"], f"rank {r}: device and host differ"
        assert len(cuda[r]["digests"]) == 5
    for r, res in enumerate(cuda):
        assert res["device"] == f"cuda:{r % 2}", res["device"]
        # No torch CUDA here: xccl asks producers for the legacy default stream (DLPack's 1).
        assert res["streams"] and set(res["streams"]) == {1}, res["streams"]


def test_cuda_tensors_1a_1e_give_the_host_jobs_bits(tmp_path, cuda_standin):
    same_results_on_device_and_host(tmp_path, cuda_standin, 1, 1, "bf16")


def test_cuda_tensors_2a_3e_on_two_devices_give_the_host_jobs_bits(tmp_path, cuda_standin):
    same_results_on_device_and_host(tmp_path, cuda_standin, 2, 3, "f32")


def test_token_major_cuda_tensors_2a_3e_give_the_host_jobs_bits(tmp_path, cuda_standin):
    # Expert ranks receive with a2e_recv_tokens (rows: a CUDA buffer of their device) and
    # reply with e2a_send_tokens from CUDA tensors; the attention ranks' results match the
    # shm job's (token-major there too) and the reference bit for bit.
    same_results_on_device_and_host(tmp_path, cuda_standin, 2, 3, "bf16", major="token")


def test_expert_and_token_major_rounds_alternate_on_cuda_bit_for_bit(tmp_path, cuda_standin):
    # Odd rounds token-major: the recycled batches and their device rows of both kinds are
    # reused across the switches.
    same_results_on_device_and_host(tmp_path, cuda_standin, 1, 2, "f16", major="alternate")


def test_afd_connector_both_sides_on_cuda_tensors_give_the_host_jobs_bits(tmp_path, cuda_standin):
    # The FFN side receives token-major into device memory: hidden_states a view of it, the
    # metadata copied to the device, the reply a CUDA tensor; every rank's digests (results,
    # received rows, expert ids, weights, seq_lens) equal the shm job's.
    kw = {"m": 2, "n": 2, "dtype": "bf16", "scenario": "afd_rounds"}
    cuda = device_job(tmp_path, cuda_standin, 4, "cuda", **kw)
    host = device_job(tmp_path, cuda_standin, 4, "shm", **kw)
    for r in range(4):
        assert cuda[r]["mismatches"] == [], cuda[r]["mismatches"]
        assert host[r]["mismatches"] == [], host[r]["mismatches"]
        assert cuda[r]["digests"] == host[r]["digests"], f"rank {r}: device and host differ"
        assert len(cuda[r]["digests"]) == 5


def test_cuda_misuse_is_refused_naming_both_devices_and_sends_nothing(tmp_path, cuda_standin):
    args = {**BASE, "m": 1, "n": 1, "dtype": "f16"}
    results = harness.run("device_misuse", 2, tmp_path, env=cuda_standin, **args)
    for r, res in enumerate(results):
        assert res["failures"] == [], f"rank {r}: {res['failures']}"
    assert standin_left(cuda_standin) == []


def test_a_cuda_tensor_on_a_host_communicator_is_refused_naming_its_device(tmp_path, cuda_standin):
    args = {**BASE, "m": 1, "n": 1, "dtype": "f32"}
    results = harness.run("cuda_tensor_on_host_comm", 2, tmp_path, env=cuda_standin, **args)
    for r, res in enumerate(results):
        assert res["failures"] == [], f"rank {r}: {res['failures']}"


def test_low_latency_buffer_dispatches_and_combines_cuda_tensors(tmp_path, cuda_standin):
    args = {**BASE, "m": 1, "n": 1, "dtype": "bf16", "rounds": 3, "tokens": [[4], [0], [16]]}
    results = harness.run("low_latency_attention_on_cuda", 2, tmp_path, env=cuda_standin, **args)
    assert results[0]["mismatches"] == [], results[0]["mismatches"]
    assert standin_left(cuda_standin) == []


def test_the_current_stream_is_torchs_once_torch_uses_cuda_else_the_legacy_default(monkeypatch):
    import types

    import xccl._cuda

    asked = []

    class Stream:
        def __init__(self, device):
            asked.append(device)
            self.cuda_stream = 0x7F00 + device

    cuda = types.SimpleNamespace(is_initialized=lambda: False, current_stream=Stream)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    # torch imported but without CUDA yet: it queued nothing; xccl does not initialise it.
    assert xccl._cuda.current_stream(1) == 0 and asked == []
    cuda.is_initialized = lambda: True
    assert xccl._cuda.current_stream(1) == 0x7F01 and asked == [1]
    monkeypatch.delitem(sys.modules, "torch")
    assert xccl._cuda.current_stream(0) == 0
