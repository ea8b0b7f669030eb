#!/usr/bin/env bash
# Installs xccl's C ABI under a prefix: include/xccl.h, lib/libxccl.so, lib/libxccl.a and
# lib/pkgconfig/xccl.pc.  Usage: ci/install-capi.sh [PREFIX]   (default /usr/local)
set -euo pipefail
cd "$(dirname "$0")/.."
prefix="${1:-/usr/local}"
# XCCL_LIB_DIR: take the libraries from there instead of building (the tests use it).
libs="${XCCL_LIB_DIR:-}"
if [ -z "$libs" ]; then
  cargo build -p xccl --release --quiet
  libs=target/release
fi
install -Dm644 include/xccl.h "$prefix/include/xccl.h"
install -Dm755 "$libs/libxccl.so" "$prefix/lib/libxccl.so"
install -Dm644 "$libs/libxccl.a" "$prefix/lib/libxccl.a"
mkdir -p "$prefix/lib/pkgconfig"
sed "s|@PREFIX@|$prefix|" xccl.pc.in > "$prefix/lib/pkgconfig/xccl.pc"
echo "installed xccl's C ABI under $prefix"
