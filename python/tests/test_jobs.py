"""Jobs of real processes (2 to 5 ranks) through the package: every join, dtype and receive
path, bit for bit against the independent reference of reference.py; misuse, a killed rank,
Ctrl-C."""

import os
import secrets
import signal
import subprocess
import sys

import harness

BASE = {"H": 64, "topk": 3, "E": 8, "max_tokens": 16, "seed": 7}


def roundtrip(tmp_path, world, cases, *, rounds=4, tokens=((5, 0, 16), (0, 3, 1)), **kw):
    """Runs ``cases`` (each: ``m``, ``n`` with ``m + n == world``, dtype, paths) one after the
    other in one job of ``world`` processes; checks every attention rank's results bit for bit
    (INT8 cases within their stated bound) and that every expert rank answered every call."""
    args = {**BASE, "rounds": rounds, "tokens": [list(t) for t in tokens], **kw}
    results = harness.run("roundtrip", world, tmp_path, timeout=240, cases=cases, **args)
    for i, case in enumerate(cases):
        c = {**args, **case}
        roles = c.get("role_of") or ["attention"] * c["m"] + ["expert"] * c["n"]
        for r, res in enumerate(results):
            got = res["cases"][i]
            assert got["role"] == roles[r], (case, r, got)
            if got["role"] == "attention":
                assert got["mismatches"] == [], f"{case} rank {r}: {got['mismatches']}"
            else:
                assert got["calls"] >= 2 * c["rounds"], (case, r, got)
    return results


def test_every_dtype_and_path_is_combined_bit_for_bit_in_jobs_of_five_ranks(tmp_path):
    # Token counts per round and attention rank include 0 and the maximum; expert ranks
    # alternate expert-major and token-major receives; attention ranks alternate torch and
    # numpy inputs (bfloat16 as ml_dtypes'), int64 and int32 expert ids.
    roundtrip(
        tmp_path,
        5,
        [
            # 3A:2E, two microbatches in flight, results into caller tensors (out=).
            {"m": 3, "n": 2, "dtype": "f32", "inflight": 2, "out": True},
            # 2A:3E, the registered input (zero copy), refusing exports after its send.
            {"m": 2, "n": 3, "dtype": "bf16", "registered": True},
            # 3A:2E through a relay, token-major receives only.
            {"m": 3, "n": 2, "dtype": "f16", "relays": 1, "token_major": True},
            # 4A:1E in two DP domains (one call in flight).
            {"m": 4, "n": 1, "dtype": "bf16", "domains": 2, "max_in_flight": 1},
            # INT8 on the wire both ways, then INT8 rows kept on the expert ranks: inexact by
            # design, each result within 3% of its row's magnitude.
            {"m": 2, "n": 3, "dtype": "bf16", "a2e_quant": "int8", "e2a_quant": "int8"},
            {"m": 3, "n": 2, "dtype": "bf16", "keep_int8": True, "rounds": 2},
        ],
    )


def test_join_from_launcher_environment(tmp_path):
    roundtrip(tmp_path, 3, [{"m": 1, "n": 2, "dtype": "f32"}], rounds=2, join="env")


def test_join_from_torchrun_variables(tmp_path):
    roundtrip(tmp_path, 3, [{"m": 2, "n": 1, "dtype": "bf16"}], rounds=2, join="torchrun")


def test_join_from_a_torch_distributed_gloo_group_with_explicit_roles(tmp_path):
    # Ranks state their roles at init: the expert ranks are 0 and 2, not the last ones.
    roles = ["expert", "attention", "expert", "attention"]
    roundtrip(
        tmp_path, 4, [{"m": 2, "n": 2, "dtype": "bf16", "role_of": roles}], rounds=2, join="torch"
    )


def test_xccl_debug_sends_the_library_log_to_python_logging(tmp_path):
    # Rank 0 runs with XCCL_DEBUG=info, rank 1 with the default (warn).
    results = roundtrip(
        tmp_path,
        2,
        [{"m": 1, "n": 1, "dtype": "f32"}],
        rounds=1,
        capture_logs=True,
        rank_env={0: {"XCCL_DEBUG": "info"}, 1: {"XCCL_DEBUG": ""}},
    )
    loud, quiet = results[0]["logs"], results[1]["logs"]
    assert any(n.startswith("xccl") and "communicator ready" in m for n, _, m in loud), loud
    assert not any(level == "INFO" for _, level, _ in quiet), quiet


def test_every_misuse_is_a_clear_error_that_changes_nothing(tmp_path):
    results = harness.run(
        "misuse", 2, tmp_path, m=1, n=1, H=8, topk=2, E=4, max_tokens=4, dtype="f32"
    )
    for res in results:
        assert res["failures"] == [], res["failures"]


def test_a_rank_killed_mid_call_is_named_by_every_survivor_who_then_shrink_past_it(tmp_path):
    results = harness.start(
        "kill", 4, tmp_path, m=2, n=2, H=16, topk=2, E=4, max_tokens=4, dtype="f32"
    ).wait(240)
    assert results[3]["exit"] == -signal.SIGKILL
    for r in range(3):
        res = results[r]
        assert res["exit"] == 0, res
        assert res["error"] == "PeerFailedError" and res["peer"] == 3, res
        assert res["poisoned"] and res["comm_poisoned"], res
        # Then every survivor shrinks past it and a round runs on the new communicator.
        assert res["closed_after_shrink"] and res["new_world"] == 3, res
        assert res["new_rank"] == r and res["shrunk_past"] == [3], res
        assert res["after_shrink_ok"], res
    assert results[0]["dropped"] == 1 and results[1]["dropped"] == 1, results[:2]


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
    attention, expert = job.wait(240)
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


SMALL = {"m": 1, "n": 1, "H": 8, "topk": 2, "E": 4, "max_tokens": 4, "dtype": "f32"}


def test_abort_from_another_thread_ends_the_blocked_call_and_tells_the_peers(tmp_path):
    attention, expert = harness.run("abort_thread", 2, tmp_path, **SMALL)
    assert expert["error"] == "AbortedError" and expert["by"] == 1, expert
    assert expert["reason"].startswith("watchdog: the expert gives up"), expert
    assert expert["poisoned"] and expert["comm_poisoned"], expert
    # Prompt: the fabric's abort wakes the wait (allow for a busy machine).
    assert expert["after_abort"] < 0.5, expert
    assert attention["error"] == "AbortedError" and attention["by"] == 1, attention


def interrupt_rank0(tmp_path, scenario, waiting_file):
    """Starts ``scenario``, sends SIGINT to rank 0 once it waits; returns both results and the
    time the signal was sent."""
    import time

    job = harness.start(scenario, 2, tmp_path, **SMALL)
    job.wait_for_file(waiting_file)
    time.sleep(0.3)  # inside the wait by now
    sent = job.signal(0)
    results = job.wait(240)
    for r, res in enumerate(results):
        assert res["exit"] == 0, (r, res)
    return results, sent


def test_ctrl_c_interrupts_a_blocked_init_and_the_job_is_aborted(tmp_path):
    (first, second), sent = interrupt_rank0(tmp_path, "sigint_join", "joining")
    assert first["first"] == "KeyboardInterrupt", first
    assert first["caught_at"] - sent < 0.5, first["caught_at"] - sent
    # The peer that joins later learns of it: at its init or at its first call.
    assert second["error"] == "AbortedError" and second["by"] == 0, second


def test_ctrl_c_interrupts_a_blocked_shrink_and_the_new_job_is_aborted(tmp_path):
    (first, second), sent = interrupt_rank0(tmp_path, "sigint_shrink", "shrinking")
    assert first["first"] == "KeyboardInterrupt" and first["closed"], first
    assert first["caught_at"] - sent < 0.5, first["caught_at"] - sent
    assert second["error"] == "AbortedError" and second["by"] == 0, second


def test_a_call_writes_into_the_storage_it_was_given_even_if_another_thread_swaps_it(tmp_path):
    # Before: the call kept only the Python object; the swapped-out storage was freed (and
    # unmapped) while e2a_recv wrote it: the attention rank crashed (SIGSEGV).
    attention, _ = harness.run("swap_out", 2, tmp_path, **SMALL)
    assert attention["returned_out"] and attention["numel_after"] == 0, attention


def test_dropping_an_unreplied_batch_aborts_the_job_at_once_naming_rank_and_epoch(tmp_path):
    # Before: the batch went to the spare pool, the attention rank waited out its timeout
    # (TimeoutError), and the abort came at the expert's next receive (its refill).
    attention, expert = harness.run("drop_unreplied", 2, tmp_path, call_timeout=8.0, **SMALL)
    assert attention["error"] == "AbortedError" and attention["by"] == 1, attention
    assert f"epoch {expert['epoch']}" in attention["message"], attention
    assert "without replying" in attention["message"], attention
    # At once, not at the 8 s timeout (allow for a busy machine).
    assert attention["after"] < 4, attention
    assert expert["next"] == "AbortedError", expert


def test_a_panic_inside_a_call_is_an_xccl_error_and_aborts_the_job_at_once(tmp_path):
    attention, expert = harness.run("panic_call", 2, tmp_path, **SMALL)
    assert attention["error"] == "XcclError", attention
    assert "panicked" in attention["message"] and attention["poisoned"], attention
    assert "unusable" in attention["next"], attention
    assert expert["error"] == "AbortedError" and expert["by"] == 0, expert
    assert "panicked" in expert["message"], expert
    assert expert["after"] < 5, expert


def test_no_string_the_package_produces_in_a_failing_job_carries_the_key(tmp_path):
    job = harness.start("secret", 2, tmp_path, env={"XCCL_DEBUG": "trace"}, **SMALL)
    results = job.wait(240)
    # The id's bytes 40..72 are the key (xccl::bootstrap::UniqueId's layout).
    key = job.uid[80:144]
    for r, res in enumerate(results):
        strings = [res["stderr"], *res.get("texts", []), *res.get("logs", [])]
        assert res.get("texts"), (r, res)
        for s in strings:
            assert key not in s.lower(), (r, s)
    # The peer was told why: the exception, with the id left out.
    assert "RuntimeError" in " ".join(results[1]["texts"]), results[1]


def test_an_idle_expert_waits_without_deadline_while_its_peers_live(tmp_path):
    # Before: a2e_recv took no timeout; the idle expert raised TimeoutError (and logged a
    # warning) at every 1 s call timeout.
    _, expert = harness.run("idle_expert", 2, tmp_path, call_timeout=1.0, **SMALL)
    assert expert["waited"] > 1.5 and expert["warnings_while_idle"] == [], expert
    # A receive's own timeout, not the config's.
    assert expert["short"] == "TimeoutError" and expert["short_retryable"], expert
    assert 0.25 < expert["short_after"] < 0.8, expert
    # The peer left the job: the wait ends naming it.
    assert expert["after_leave"] == "PeerFailedError" and expert["peer"] == 0, expert


def readme_quickstart() -> str:
    """The first ``python`` block under "## Quickstart" in python/README.md."""
    text = (harness.HERE.parent / "README.md").read_text()
    section = text[text.index("## Quickstart") :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("```", start)]


def test_the_readme_quickstart_runs_as_written_under_the_real_torchrun(tmp_path):
    # Before: rank 0 tried to bind the rendezvous root to MASTER_PORT, where torchrun's own
    # agent store listens ("Address already in use"), on every run.
    script = tmp_path / "quickstart.py"
    script.write_text(readme_quickstart())
    env = {**os.environ, "XCCL_JOB_KEY": secrets.token_hex(32)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4"]
    # Any free port for torchrun's store (the README leaves torchrun's default).
    cmd += ["--master-port", str(harness.free_port()), str(script)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]


def test_a_launcher_hands_the_unique_id_to_its_children_in_their_environment():
    example = harness.HERE.parent / "examples" / "launcher.py"
    out = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=240, check=False
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert out.stdout.count("round trip ok") == 2, out.stdout


def test_close_leaves_the_job_while_a_tensor_of_the_registered_input_lives(tmp_path):
    # Before: the buffer kept the whole communicator: no departure mark, the expert waited
    # out its 20 s timeout.
    attention, expert = harness.run("close_with_input_alive", 2, tmp_path, **SMALL)
    assert attention["sum"] == SMALL["max_tokens"] * SMALL["H"], attention
    assert attention["export"] == "InvalidArgumentError", attention
    assert expert["error"] == "PeerFailedError" and expert["peer"] == 0, expert
    assert expert["after"] < 5, expert
