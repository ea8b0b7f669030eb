#!/usr/bin/env bash
# The check of xccl's CUDA path on a real GPU (an H200 lent to the session), in two halves:
#
#   ci/device-check.sh --pack DIR   here (Rust toolchain, no GPU): builds what the GPU machine
#                                   needs into DIR (stripped test binaries, xccl-bench, the
#                                   Python wheel; under 40 MiB)
#   ci/device-check.sh --run DIR    there (CUDA 13, torch, transformers, pytest; no Rust, no
#                                   network), from the repo root: probes the driver and CUDA IPC,
#                                   runs the checks on the real device, writes DIR/report.json
#                                   (and copies it and the bench's JSON to $OUT when OUT is set);
#                                   the steps' limits add up to 7 min 25 s
#
# What --run checks (docs/device.md):
# - probe: the GPU (nvidia-smi), torch's NVRTC, and whether the runtime allows CUDA IPC between
#   two processes (it may not under gVisor): a two-process torch probe. Where IPC is refused the
#   process steps are skipped and the threads mode (ranks as threads of one process) runs;
# - the data plane's kernels, compiled by NVRTC for the device and run on it, against the host
#   backend bit for bit, and the NVRTC compile check;
# - the cuda fabric's tests against the real driver (XCCL_TEST_REAL_CUDA=1): conformance of two
#   processes sharing the GPU, the plane between two processes' windows, and the device-buffer
#   calls against the reference bit for bit (tests/tests/cuda.rs `device_buffer_*`, all of
#   tests/tests/cuda_device.rs: the cases that need two devices or the stand-in's counters skip);
#   the threads mode's conformance and device-buffer calls;
# - Python: torch CUDA tensors on a busy stream against the CPU job bit for bit
#   (python/tests/test_cuda_gpu.py) and the transformers example with `--device cuda`;
# - `xccl-bench --fabric cuda` on its default shape (H=7168 bf16, top-8 of 64 experts), 1A:1E and
#   2A:2E, T=128 and 4096, checked, beside the device-to-device copy of the same bytes: the
#   issue's targets (round trip at T=128 within 60 us; at T=4096 at least 0.6x the copy).
# Each step's exit code, seconds and last lines go into the report; the script's exit code is
# the first failing step's.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { echo "usage: ci/device-check.sh --pack DIR | --run DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
mode=$1 dir=$2

# The test binary of `cargo test --no-run $@` (its path, from cargo's JSON messages).
test_binary() {
  cargo test --release --no-run --message-format=json "$@" 2>/dev/null |
    python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        print(m["executable"])' | tail -1
}

if [ "$mode" = --pack ]; then
  mkdir -p "$dir/bin" "$dir/wheel"
  unit=$(test_binary -p xccl --lib)
  [ -n "$unit" ] || { echo "device-check: building xccl's unit tests failed" >&2; exit 1; }
  strip -o "$dir/bin/xccl-unit" "$unit"
  for t in cuda cuda_device; do
    bin=$(test_binary -p xccl-tests --test "$t" || true)
    [ -n "$bin" ] || { echo "device-check: building tests/$t failed" >&2; exit 1; }
    strip -o "$dir/bin/$t" "$bin"
  done
  cargo build --release -p xccl-bench >/dev/null 2>&1 &&
    strip -o "$dir/bin/xccl-bench" target/release/xccl-bench
  # The Python package (abi3: any CPython >= 3.9, as the GPU image's 3.12), unpacked there.
  venv=${XCCL_PY_VENV:-$HOME/.cache/xccl/py}
  PATH="$venv/bin:$PATH" maturin build --release -q -m python/Cargo.toml -o "$dir/wheel" \
    >/dev/null 2>&1 || { echo "device-check: building the Python wheel failed" >&2; exit 1; }
  size=$(du -sm "$dir" | cut -f1)
  echo "device-check: packed $(ls "$dir/bin" "$dir/wheel" | tr '\n' ' ')into $dir ($size MiB)"
  [ "$size" -lt 40 ] || { echo "device-check: $dir is $size MiB, over 40" >&2; exit 1; }
  exit 0
fi

[ "$mode" = --run ] || usage
report="$dir/report.json"
steps=()
first_fail=0

# Runs step NAME (a command line) with a time limit, recording its result.
step() {
  local name=$1 limit=$2; shift 2
  local start end rc log="$dir/$name.log"
  start=$(date +%s.%N)
  timeout "$limit" "$@" >"$log" 2>&1
  rc=$?
  end=$(date +%s.%N)
  echo "== $name: exit $rc ($(python3 -c "print(round($end - $start, 1))") s)"
  tail -n 15 "$log"
  steps+=("$(python3 - "$name" "$rc" "$start" "$end" "$log" <<'PY'
import json, sys
name, rc, start, end, log = sys.argv[1:]
tail = open(log, errors="replace").read().splitlines()[-30:]
print(json.dumps({"step": name, "exit": int(rc), "seconds": round(float(end) - float(start), 2),
                  "tail": tail}))
PY
)")
  if [ "$rc" -ne 0 ] && [ "$first_fail" -eq 0 ]; then first_fail=$rc; fi
}

# torch's NVRTC (the image's CUDA may have its own too).
nvrtc=$(python3 - <<'PY'
import glob, os
try:
    import nvidia
    roots = list(nvidia.__path__)
except Exception:
    roots = []
roots += ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"]
hits = sorted(h for r in roots for h in glob.glob(os.path.join(r, "**", "libnvrtc.so.1[0-9]*"), recursive=True)
              if "builtins" not in h)
print(hits[-1] if hits else "")
PY
)
export XCCL_NVRTC_LIBRARY=$nvrtc XCCL_TEST_REAL_CUDA=1

step probe-gpu 20 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv
# A probe informs; its failure does not fail the check (it decides which steps run).
saved_fail=$first_fail
step probe-ipc 40 python3 - <<'PY'
# Two processes: the parent allocates on the GPU and shares it by CUDA IPC (torch's
# multiprocessing uses cudaIpcGetMemHandle); the child writes through it.
import torch, torch.multiprocessing as mp

def child(t):
    t.fill_(7.0)
    torch.cuda.synchronize()

if __name__ == "__main__":
    mp.set_start_method("spawn")
    t = torch.zeros(1024, device="cuda")
    p = mp.Process(target=child, args=(t,))
    p.start(); p.join(40)
    ok = p.exitcode == 0 and bool((t == 7.0).all())
    print("cuda ipc between processes:", "works" if ok else f"refused (exit {p.exitcode})")
    raise SystemExit(0 if ok else 1)
PY
ipc_rc=$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['exit'])" "${steps[-1]}")
first_fail=$saved_fail
if [ -n "$nvrtc" ]; then
  step dataplane 40 "$dir/bin/xccl-unit" --test-threads 1 \
    moe::dataplane::tests::the_cuda_plane moe::dataplane::tests::the_kernels_compile \
    moe::dataplane::tests::scatter_and_gather
else
  echo "device-check: no libnvrtc found (torch's nvidia-cuda-nvrtc or /usr/local/cuda)" >&2
  first_fail=${first_fail:-1}
fi
# The tests re-run their binary as ranks: paths free of CARGO_TARGET_TMPDIR only.
if [ "$ipc_rc" -eq 0 ]; then
  step cuda-fabric 60 "$dir/bin/cuda" --test-threads 1 \
    cuda_conformance_with_2_processes_sharing_one_device cuda_plane_ \
    cuda_one_attention_one_expert_matches_reference device_buffer_calls_
  step cuda-device 50 "$dir/bin/cuda_device" --test-threads 1
else
  echo "== CUDA IPC refused: the process steps are skipped, the threads mode runs"
fi
step cuda-threads 25 "$dir/bin/cuda" --test-threads 1 \
  cuda_conformance_with_3_threads device_buffer_calls_in_the_threads_mode

# Python: the wheel unpacked (a wheel is a zip), the GPU test and the example.
site="$dir/site"
rm -rf "$site" && mkdir -p "$site"
for w in "$dir"/wheel/*.whl; do python3 -m zipfile -e "$w" "$site"; done
if [ "$ipc_rc" -eq 0 ]; then
  step python-gpu 50 env PYTHONPATH="$site:python/tests" python3 -m pytest -q -p no:cacheprovider \
    python/tests/test_cuda_gpu.py
  step example-cuda 50 env PYTHONPATH="$site" python3 python/examples/deepseek_moe_disagg.py \
    --device cuda --timeout 45
fi

if [ -x "$dir/bin/xccl-bench" ] && [ "$ipc_rc" -eq 0 ]; then
  # The default shape (H=7168 bf16, top-8 of 64 experts), the device-buffer calls, checked,
  # beside the device-to-device copy of the same bytes measured in the same run.
  for shape in "1 1" "2 2"; do
    set -- $shape
    step "bench-cuda-${1}a${2}e" $((40 + 10 * $1)) "$dir/bin/xccl-bench" --fabric cuda \
      -a "$1" -e "$2" -t 128,4096 --iters 30 --check --json "$dir/bench-cuda-${1}a${2}e.json"
    if [ -n "${OUT:-}" ] && [ -f "$dir/bench-cuda-${1}a${2}e.json" ]; then
      cp "$dir/bench-cuda-${1}a${2}e.json" "$OUT/"
    fi
  done
fi

python3 - "$report" "${steps[@]}" <<'PY'
import json, sys, subprocess
out = {"nvrtc": __import__("os").environ.get("XCCL_NVRTC_LIBRARY", ""),
       "steps": [json.loads(s) for s in sys.argv[2:]]}
json.dump(out, open(sys.argv[1], "w"), indent=1)
PY
if [ -n "${OUT:-}" ]; then cp "$report" "$OUT/report.json"; fi
echo "device-check: report in $report"
exit "$first_fail"
