"""Jobs of real processes (2 to 5 ranks) through the package: every join, dtype and receive
path, bit for bit against the independent reference of reference.py; misuse, a killed rank,
Ctrl-C."""

import signal

import harness
import pytest

BASE = {"H": 64, "topk": 3, "E": 8, "max_tokens": 16, "seed": 7}


def roundtrip(tmp_path, m, n, *, rounds=4, tokens=((5, 0, 16), (0, 3, 1)), **kw):
    args = {**BASE, "m": m, "n": n, "rounds": rounds, "tokens": [list(t) for t in tokens], **kw}
    results = harness.run("roundtrip", m + n, tmp_path, **args)
    roles = kw.get("role_of") or ["attention"] * m + ["expert"] * n
    merged = {}
    for r, res in enumerate(results):
        assert res["role"] == roles[r], (r, res)
        if res["role"] == "attention":
            assert res["mismatches"] == [], f"rank {r}: {res['mismatches']}"
        else:
            assert res["calls"] >= 2 * rounds, res
        merged.update(res)
    return results


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_every_dtype_is_combined_bit_for_bit_both_receive_paths_and_zero_token_rounds(
    tmp_path, dtype
):
    # 2A:2E; expert ranks alternate expert-major and token-major receives; token counts per
    # round and rank include 0 and the maximum.
    roundtrip(tmp_path, 2, 2, dtype=dtype)


def test_three_attention_two_expert_ranks_with_two_microbatches_in_flight_and_out_tensors(
    tmp_path,
):
    roundtrip(tmp_path, 3, 2, dtype="bf16", rounds=4, inflight=2, out=True)


def test_join_from_launcher_environment(tmp_path):
    roundtrip(tmp_path, 1, 2, dtype="f32", rounds=2, join="env")


def test_join_from_torchrun_variables(tmp_path):
    roundtrip(tmp_path, 2, 1, dtype="bf16", rounds=2, join="torchrun")


def test_join_from_a_torch_distributed_gloo_group_with_explicit_roles(tmp_path):
    # Ranks state their roles at init: the expert ranks are 0 and 2, not the last ones.
    roundtrip(
        tmp_path,
        2,
        2,
        dtype="bf16",
        rounds=2,
        join="torch",
        role_of=["expert", "attention", "expert", "attention"],
    )


def test_registered_input_is_zero_copy_and_refuses_exports_after_its_send(tmp_path):
    roundtrip(tmp_path, 2, 1, dtype="bf16", rounds=3, registered=True)


def test_token_major_only_through_relays(tmp_path):
    roundtrip(tmp_path, 2, 2, dtype="f32", rounds=2, relays=1, token_major=True)


def test_int8_on_the_wire_and_keep_int8(tmp_path):
    # INT8 is inexact by design: each result is checked to within 3% of its row's magnitude.
    roundtrip(tmp_path, 1, 2, dtype="bf16", rounds=2, a2e_quant="int8", e2a_quant="int8")
    roundtrip(tmp_path, 1, 2, dtype="bf16", rounds=2, keep_int8=True)


def test_dp_domains(tmp_path):
    roundtrip(tmp_path, 2, 1, dtype="f32", rounds=4, domains=2, max_in_flight=1)


def test_xccl_debug_sends_the_library_log_to_python_logging(tmp_path):
    loud = roundtrip(
        tmp_path, 1, 1, dtype="f32", rounds=1, capture_logs=True, env={"XCCL_DEBUG": "info"}
    )
    quiet = roundtrip(tmp_path, 1, 1, dtype="f32", rounds=1, capture_logs=True, env={})
    for res in loud:
        assert any(
            name.startswith("xccl") and "communicator ready" in msg for name, _, msg in res["logs"]
        ), res["logs"]
    for res in quiet:
        assert not any(level == "INFO" for _, level, _ in res["logs"]), res["logs"]


def test_every_misuse_is_a_clear_error_that_changes_nothing(tmp_path):
    results = harness.run(
        "misuse", 2, tmp_path, m=1, n=1, H=8, topk=2, E=4, max_tokens=4, dtype="f32"
    )
    for res in results:
        assert res["failures"] == [], res["failures"]


def test_a_rank_killed_mid_call_is_named_by_every_survivor(tmp_path):
    results = harness.start(
        "kill", 4, tmp_path, m=2, n=2, H=16, topk=2, E=4, max_tokens=4, dtype="f32"
    ).wait(60)
    assert results[3]["exit"] == -signal.SIGKILL
    for r in range(3):
        res = results[r]
        assert res["exit"] == 0, res
        assert res["error"] == "PeerFailedError" and res["peer"] == 3, res
        assert res["poisoned"] and res["comm_poisoned"], res


def test_ctrl_c_interrupts_a_blocked_call_within_the_bound(tmp_path):
    job = harness.start(
        "sigint", 2, tmp_path, m=1, n=1, H=8, topk=2, E=4, max_tokens=4, dtype="f32"
    )
    job.wait_for_file("expert-waiting")
    import time

    time.sleep(0.3)  # the expert is inside a2e_recv by now
    sent = job.signal(1)
    job.wait_for_file("attention-waiting")
    time.sleep(0.3)
    sent_attention = job.signal(0)
    attention, expert = job.wait(60)
    assert expert["exit"] == 0 and attention["exit"] == 0, (expert, attention)
    # Nothing published: KeyboardInterrupt, not poisoned, and the retried receive worked.
    assert expert["first"] == "KeyboardInterrupt", expert
    assert not expert["poisoned_after_first"], expert
    # The bound: the interrupt check runs every 20 ms; allow for a busy machine.
    assert expert["caught_at"] - sent < 0.5, expert["caught_at"] - sent
    assert attention["round_ok"], attention
    # The barrier had signalled its peer: KeyboardInterrupt, poisoned, and the peer aborted.
    assert attention["barrier"] == "KeyboardInterrupt", attention
    assert attention["caught_at"] - sent_attention < 0.5
    assert attention["poisoned"], attention
    assert expert["after_poison"] == "AbortedError" and expert["after_poison_by"] == 0, expert
