#!/usr/bin/env bash
# Checks the C ABI against its header (include/xccl.h is written by hand):
# - every function the header declares is exported by libxccl.so and defined in libxccl.a;
# - every exported xccl* symbol is declared in the header;
# - XCCL_MAJOR/MINOR/PATCH and xccl.pc.in's Version equal the crate version in Cargo.toml.
# Run from ci/test.sh after the tests; exits non-zero naming every mismatch.
set -euo pipefail
cd "$(dirname "$0")/.."
header=include/xccl.h
# XCCL_LIB_DIR: check the libraries there (ci/test.sh passes target/release/deps, where the
# test build just put them) instead of building target/release/libxccl.so.
libs="${XCCL_LIB_DIR:-}"
if [ -z "$libs" ]; then
  cargo build -p xccl --release --quiet
  libs=target/release
fi
so=$libs/libxccl.so
ar=$libs/libxccl.a

fail=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Declarations: a line starting with a return type and `xcclName(`.
grep -oE '^(const )?[A-Za-z_][A-Za-z0-9_]*\*? ?\*?(xccl[A-Za-z0-9_]+)\(' "$header" \
  | grep -oE 'xccl[A-Za-z0-9_]+\($' | tr -d '(' | sort -u > "$tmp/declared"
nm -D --defined-only "$so" | awk '$2 == "T" && $3 ~ /^xccl/ {print $3}' | sort -u > "$tmp/exported"
nm --defined-only "$ar" 2>/dev/null | awk '$2 == "T" && $3 ~ /^xccl/ {print $3}' | sort -u > "$tmp/static"

if [ ! -s "$tmp/declared" ]; then
  echo "check-capi: no function declarations found in $header" >&2
  exit 1
fi
for f in $(comm -23 "$tmp/declared" "$tmp/exported"); do
  echo "check-capi: $header declares $f but $so does not export it" >&2
  fail=1
done
for f in $(comm -13 "$tmp/declared" "$tmp/exported"); do
  echo "check-capi: $so exports $f but $header does not declare it" >&2
  fail=1
done
for f in $(comm -23 "$tmp/declared" "$tmp/static"); do
  echo "check-capi: $header declares $f but $ar does not define it" >&2
  fail=1
done

# Layouts: every struct as a binding computes it from the header alone (ci/capi-layout.py,
# ctypes field by field) against the C compiler's sizeof/offsetof of the same header. (The
# library's own #[repr(C)] structs are checked against the compiled header by the unit test
# capi::tests::rust_structs_have_the_layout_the_header_compiles_to.)
python3 ci/capi-layout.py "$header" > "$tmp/binding"
{
  echo '#include <stddef.h>'
  echo '#include <stdio.h>'
  echo '#include "xccl.h"'
  echo 'int main(void) {'
  awk '$2 == "sizeof" { printf "  printf(\"%s sizeof %%zu\\n\", sizeof(%s));\n", $1, $1; next }
       { printf "  printf(\"%s %s %%zu %%zu\\n\", offsetof(%s, %s), sizeof(((%s*)0)->%s));\n", $1, $2, $1, $2, $1, $2 }' "$tmp/binding"
  echo '  return 0;'
  echo '}'
} > "$tmp/layout.c"
if ! cc -std=c11 -Wall -Werror -I include -o "$tmp/layout" "$tmp/layout.c"; then
  echo "check-capi: the layout program generated from $header does not compile" >&2
  fail=1
elif ! "$tmp/layout" > "$tmp/compiled" || ! diff -u "$tmp/binding" "$tmp/compiled" >&2; then
  echo "check-capi: a struct's layout computed from $header (binding) differs from the compiler's" >&2
  fail=1
fi
structs=$(grep -c sizeof "$tmp/binding")

version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' Cargo.toml)
IFS=. read -r major minor patch <<< "${version%%-*}"
for part in MAJOR:$major MINOR:$minor PATCH:$patch; do
  name=${part%%:*}
  want=${part#*:}
  got=$(sed -n "s/^#define XCCL_${name} \([0-9]*\)$/\1/p" "$header")
  if [ "$got" != "$want" ]; then
    echo "check-capi: $header has XCCL_${name} ${got:-(missing)}, Cargo.toml's version $version says $want" >&2
    fail=1
  fi
done
pc=$(sed -n 's/^Version: *//p' xccl.pc.in)
if [ "$pc" != "$version" ]; then
  echo "check-capi: xccl.pc.in has Version $pc, Cargo.toml says $version" >&2
  fail=1
fi

if [ "$fail" -ne 0 ]; then
  exit 1
fi
echo "check-capi: $(wc -l < "$tmp/declared") functions declared and exported; $structs struct layouts agree; version $version"
