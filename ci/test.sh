#!/usr/bin/env bash
# Runs every check xccl has, installing what the tests need first (Debian packages).
# This is the README's test command; .ci/run calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v cc >/dev/null 2>&1 || need+=(gcc)
command -v g++ >/dev/null 2>&1 || need+=(g++)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
command -v python3 >/dev/null 2>&1 || need+=(python3)
command -v nm >/dev/null 2>&1 || need+=(binutils)
# libfabric for the ofi fabric (its tests use the real tcp provider), clang for bindgen.
[ -f /usr/include/rdma/fabric.h ] || need+=(libfabric-dev)
command -v fi_info >/dev/null 2>&1 || need+=(libfabric-bin)
ls /usr/lib/llvm-*/lib/libclang.so* >/dev/null 2>&1 || need+=(libclang-dev)
if [ ${#need[@]} -gt 0 ]; then
  echo "ci/test.sh: installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need[@]}"
fi
rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy rustfmt

echo "== ofi bindings"
ci/gen-ofi-bindings.sh --check
echo "== acl bindings"
# The committed bindgen output must match the header it is generated from (installs bindgen-cli
# and libclang-dev when missing).
bash ci/gen-acl-bindings.sh --check
echo "== fmt"
cargo fmt --all -- --check
echo "== clippy"
cargo clippy --workspace --all-targets -- -D warnings
echo "== doc"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet
echo "== loom models (bound 2; ci/loom.sh runs bound 3 and the mutants)"
# Keeps the `--cfg loom` build compiling and its models passing on every run.
LOOM_MAX_PREEMPTIONS=2 bash ci/loom.sh
echo "== python venv"
# Made before the Rust tests: torch's nvidia-cuda-nvrtc is the real NVRTC that compiles the CUDA
# kernels for sm_80 and sm_90 in `the_kernels_compile_with_nvrtc_for_sm_80_and_sm_90`.
py=$(ci/python-env.sh)
if [ -z "${XCCL_NVRTC_LIBRARY:-}" ]; then
  XCCL_NVRTC_LIBRARY=$(find "$(dirname "$py")/../lib" -name 'libnvrtc.so.1[0-9]' 2>/dev/null | sort | tail -1)
  export XCCL_NVRTC_LIBRARY
fi
echo "NVRTC: ${XCCL_NVRTC_LIBRARY:-not found}"
echo "== tests"
cargo test --workspace --release 2>&1 | tee target/test-output.txt
echo "== C ABI symbols"
XCCL_LIB_DIR=target/release/deps ci/check-capi.sh
echo "== python"
# The package from ./python, installed into target/python-site (never into the cached venv),
# checked with ruff, tested with pytest and run on the transformers example. The venv (torch,
# transformers, ...) lives outside the clone; ci/python-env.sh created it above.
# The venv's tools first (pip's maturin build backend runs `maturin` from PATH).
export PATH="$(dirname "$py"):$PATH" PYTHONDONTWRITEBYTECODE=1
site=target/python-site
rm -rf "$site"
"$py" -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation \
  --target "$site" ./python
# Python sources and stubs (ruff also formats code blocks in Markdown; the docs keep theirs).
"$py" -m ruff format --check --exclude "*.md" python/
"$py" -m ruff check python/
set +e
PYTHONPATH="$site" timeout 900 "$py" -m pytest python/tests -q -p no:cacheprovider \
  --junitxml=target/pytest.xml 2>&1 | tee target/pytest-output.txt
pytest_rc=${PIPESTATUS[0]}
set -e
# Exit 5 is pytest's "collected no tests": a suite that ran nothing fails here.
[ "$pytest_rc" -ne 5 ] || echo "ci/test.sh: pytest collected no tests in python/tests" >&2
py_counts=$("$py" - target/pytest.xml <<'PY'
import sys
import xml.etree.ElementTree as ET

try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print(0, 1)
    raise SystemExit
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
t = sum(int(s.get("tests", 0)) for s in suites)
bad = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
skipped = sum(int(s.get("skipped", 0)) for s in suites)
print(t - bad - skipped, bad)
PY
)
echo "== python example (DeepseekV3MoE disaggregated)"
set +e
PYTHONPATH="$site" timeout 120 "$py" python/examples/deepseek_moe_disagg.py
example_rc=$?
set -e
echo "== leftovers"
left=$(ls /dev/shm | grep -i '^xccl' || true)
if [ -n "$left" ]; then
  echo "ci/test.sh: /dev/shm holds xccl segments after the tests: $left" >&2
  exit 1
fi
left=$(ip netns list 2>/dev/null | grep '^xccl-' || true)
if [ -n "$left" ]; then
  echo "ci/test.sh: network namespaces of the ofi tests left behind: $left" >&2
  exit 1
fi
passed=$(grep -E '^test result:' target/test-output.txt | awk '{p+=$4; f+=$6} END {print p+0, f+0}')
set -- $passed $py_counts
# The example counts as one test.
ex_pass=$((example_rc == 0)) ex_fail=$((example_rc != 0))
[ "$pytest_rc" -eq 0 ] || [ "$4" -gt 0 ] || set -- "$1" "$2" "$3" 1
echo "cargo: $1 passed, $2 failed; pytest: $3 passed, $4 failed; example: exit $example_rc"
echo "summary: $(($1 + $3 + ex_pass)) passed, $(($2 + $4 + ex_fail)) failed"
[ "$pytest_rc" -eq 0 ] && [ "$example_rc" -eq 0 ]
