#!/usr/bin/env bash
# Creates the Python venv that python/'s tests, example and benchmark use, outside the clone:
# ${XCCL_PY_CACHE:-$HOME/.cache/xccl}/py, with exactly the packages pinned in
# ci/python-requirements.txt. Idempotent: when the venv holds a marker with the hash of that
# file (and of the interpreter's version) it returns at once; a changed pin reinstalls.
# Prints the venv's python on stdout (everything else goes to stderr), so callers do
#   PY=$(ci/python-env.sh)
# The interpreter is ${XCCL_PYTHON:-python3} (3.9 or newer). A fresh install is 5.7 GB (torch
# comes with its CUDA libraries from PyPI): 2 min 33 s to 8 min 22 s on this 2-core machine
# (2026-12-01; the longer one with no pip cache, at load 8).
set -euo pipefail
cd "$(dirname "$0")/.."

cache="${XCCL_PY_CACHE:-$HOME/.cache/xccl}"
venv="$cache/py"
req="ci/python-requirements.txt"
marker="$venv/.xccl-requirements.sha256"
base="${XCCL_PYTHON:-python3}"

if ! command -v "$base" >/dev/null 2>&1; then
  echo "ci/python-env.sh: $base not found (set XCCL_PYTHON to a python 3.9 or newer)" >&2
  exit 1
fi
if ! "$base" -c 'import sys; sys.exit(sys.version_info < (3, 9))'; then
  echo "ci/python-env.sh: $base is $("$base" --version 2>&1); python 3.9 or newer is needed" >&2
  exit 1
fi
want=$( { cat "$req"; "$base" -c 'import sys; print(sys.version)'; } | sha256sum | cut -d' ' -f1)

if [ -x "$venv/bin/python" ] && [ "$(cat "$marker" 2>/dev/null || true)" = "$want" ]; then
  echo "$venv/bin/python"
  exit 0
fi

mkdir -p "$cache"
# One installer at a time (parallel CI jobs or helpers share the cache).
exec 9>"$cache/.py.lock"
flock 9
if [ -x "$venv/bin/python" ] && [ "$(cat "$marker" 2>/dev/null || true)" = "$want" ]; then
  echo "$venv/bin/python"
  exit 0
fi

if ! "$base" -m venv --help >/dev/null 2>&1 || ! "$base" -c 'import ensurepip' 2>/dev/null; then
  echo "ci/python-env.sh: installing python3-venv" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq python3-venv >&2
fi
start=$(date +%s)
if [ ! -x "$venv/bin/python" ]; then
  echo "ci/python-env.sh: creating $venv" >&2
  "$base" -m venv "$venv" >&2
fi
echo "ci/python-env.sh: installing $req into $venv (a fresh machine downloads about 5 GB)" >&2
rm -f "$marker"
"$venv/bin/python" -m pip install --disable-pip-version-check -q -r "$req" >&2
echo "$want" >"$marker"
echo "ci/python-env.sh: ready in $(( $(date +%s) - start )) s" >&2
echo "$venv/bin/python"
