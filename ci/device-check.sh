#!/usr/bin/env bash
# The check of xccl's CUDA path on a real GPU (an H200 lent to the session), in two halves:
#
#   ci/device-check.sh --pack DIR   here (Rust toolchain, no GPU): builds what the GPU machine
#                                   needs into DIR (stripped test binaries; under 40 MiB)
#   ci/device-check.sh --run DIR    there (CUDA 13, torch, no Rust, no network), from the repo
#                                   root: probes the driver and CUDA IPC, runs the checks on the
#                                   real device, writes DIR/report.json (and $OUT/report.json
#                                   when OUT is set); the steps' limits add up to 7.5 minutes
#
# What --run checks today (the device path's first stages; docs/device.md):
# - probe: the GPU (nvidia-smi), libcuda, torch's NVRTC, and whether the runtime allows CUDA IPC
#   between two processes (it may not under gVisor): a two-process torch probe;
# - the data plane's kernels, compiled by NVRTC for the device and run on it, against the host
#   backend bit for bit (`moe::dataplane::tests::the_cuda_plane_*`, XCCL_TEST_REAL_CUDA=1), and
#   the NVRTC compile check;
# - the cuda fabric's tests that hold on one real GPU, against the real driver
#   (`XCCL_TEST_REAL_CUDA=1`): conformance of two processes sharing the GPU, the data plane
#   copying and summing rows between two processes' device windows through CUDA IPC, and 1A:1E
#   A2E/E2A against the reference;
# - `xccl-bench --fabric cuda` (1A:1E, T=1, 128, 4096, checked) with the device-to-device copy of
#   the same bytes as its limit, its JSON beside the report.
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
  mkdir -p "$dir/bin"
  unit=$(test_binary -p xccl --lib)
  [ -n "$unit" ] || { echo "device-check: building xccl's unit tests failed" >&2; exit 1; }
  strip -o "$dir/bin/xccl-unit" "$unit"
  cuda=$(test_binary -p xccl-tests --test cuda || true)
  if [ -n "$cuda" ]; then strip -o "$dir/bin/cuda-fabric" "$cuda"; fi
  cargo build --release -p xccl-bench >/dev/null 2>&1 &&
    strip -o "$dir/bin/xccl-bench" target/release/xccl-bench
  size=$(du -sm "$dir" | cut -f1)
  echo "device-check: packed $(ls "$dir/bin" | tr '\n' ' ')into $dir ($size MiB)"
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

step probe-gpu 30 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv
# A probe informs; its failure does not fail the check (the steps that need IPC fail instead).
saved_fail=$first_fail
step probe-ipc 60 python3 - <<'PY'
# Two processes: the parent allocates on the GPU and shares it by CUDA IPC (torch's
# multiprocessing uses cudaIpcGetMemHandle); the child writes through it. Refused IPC (gVisor)
# shows as an error here, and the IPC-dependent steps below are then expected to fail.
import torch, torch.multiprocessing as mp

def child(t):
    t.fill_(7.0)
    torch.cuda.synchronize()

if __name__ == "__main__":
    mp.set_start_method("spawn")
    t = torch.zeros(1024, device="cuda")
    p = mp.Process(target=child, args=(t,))
    p.start(); p.join(60)
    ok = p.exitcode == 0 and bool((t == 7.0).all())
    print("cuda ipc between processes:", "works" if ok else f"refused (exit {p.exitcode})")
    raise SystemExit(0 if ok else 1)
PY
first_fail=$saved_fail
if [ -n "$nvrtc" ]; then
  step dataplane 90 "$dir/bin/xccl-unit" --test-threads 1 \
    moe::dataplane::tests::the_cuda_plane moe::dataplane::tests::the_kernels_compile
else
  echo "device-check: no libnvrtc found (torch's nvidia-cuda-nvrtc or /usr/local/cuda)" >&2
  first_fail=${first_fail:-1}
fi
if [ -x "$dir/bin/cuda-fabric" ]; then
  # The tests that hold on one real GPU (the others inject stand-in failures or want 2 devices).
  # They re-run the binary as ranks, so CARGO_TARGET_TMPDIR-free paths only.
  step cuda-fabric 120 "$dir/bin/cuda-fabric" --test-threads 1 \
    cuda_conformance_with_2_processes_sharing_one_device cuda_plane_ \
    cuda_one_attention_one_expert_matches_reference
else
  echo "== cuda-fabric: absent from the pack"
fi

if [ -x "$dir/bin/xccl-bench" ]; then
  # The cuda fabric with host buffers over device windows (the calls' device buffers are not
  # there yet), beside the device-to-device copy of the same bytes measured in the same run.
  step bench-cuda 150 "$dir/bin/xccl-bench" --fabric cuda -a 1 -e 1 -t 1,128,4096 \
    --iters 50 --check --json "$dir/bench-cuda.json"
  if [ -n "${OUT:-}" ] && [ -f "$dir/bench-cuda.json" ]; then cp "$dir/bench-cuda.json" "$OUT/"; fi
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
