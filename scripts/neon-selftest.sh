#!/usr/bin/env bash
# Cross-compiles the per-ISA kernel self-test for AArch64 (NEON) and runs it under qemu-aarch64.
# Usage: scripts/neon-selftest.sh [BUILD_DIR]   (needs g++-aarch64-linux-gnu and qemu-user)
set -euo pipefail
missing=()
for tool in aarch64-linux-gnu-g++ qemu-aarch64; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
if ((${#missing[@]})); then
  echo "neon-selftest: ${missing[*]} not found (apt-get install g++-aarch64-linux-gnu qemu-user)"
  # In CI a missing tool is a failure; locally, a skip that ctest lists (exit 77).
  if [ "${CI:-}" = true ]; then exit 1; fi
  exit 77
fi
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/build/aarch64}"
mkdir -p "$out/include"
# Only xsimd from the host's headers: the rest of /usr/include belongs to the host's libc.
ln -sfn /usr/include/xsimd "$out/include/xsimd"
flags=(-std=c++20 -O2 -g0 -ffp-contract=off -static -Wall -Wextra
       -I"$root/include" -I"$root/src" -isystem "$out/include")
# One compile per source, through ccache where scripts/cache.sh finds it, then the link.
source "$root/scripts/cache.sh"
cc=(aarch64-linux-gnu-g++)
if ((${#ccache_launcher[@]})); then cc=(ccache aarch64-linux-gnu-g++); fi
objects=()
for src in tests/kernels/isa_selftest.cpp src/kernels/simd/neon.cpp src/kernels/simd/scalar.cpp \
    src/core/memory.cpp; do
  obj="$out/$(basename "$src" .cpp).o"
  "${cc[@]}" "${flags[@]}" -c -o "$obj" "$root/$src" &
  objects+=("$obj")
done
wait_all=0
for job in $(jobs -p); do wait "$job" || wait_all=1; done
if [ $wait_all != 0 ]; then echo "neon-selftest: a compile failed"; exit 1; fi
aarch64-linux-gnu-g++ "${flags[@]}" -o "$out/isa_selftest" "${objects[@]}"
qemu-aarch64 "$out/isa_selftest"
