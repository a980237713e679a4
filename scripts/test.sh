#!/usr/bin/env bash
# The test job: install, build, and run the whole suite through ctest; then the same unit tests
# under AddressSanitizer and UndefinedBehaviorSanitizer (build-asan/), and each libFuzzer harness
# for FUZZ_SECONDS (default 60) from its seed corpus (build-fuzz/). Any failure or crash fails.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
scripts/build.sh
ctest --test-dir build --output-on-failure -j"$(nproc)"

# ASan + UBSan: the unit tests (gcc). The qemu NEON self-test and the PyTorch runs are left to
# the normal build above: they test numerics, not memory safety, and are slow under ASan.
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi
cmake -S . -B build-asan "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DTEO_SANITIZE=ON \
  -DTEO_BUILD_BENCH=OFF -DTEO_WERROR=ON > build-asan.log
cmake --build build-asan -j"$(nproc)" >> build-asan.log
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j"$(nproc)" -E "IsaSelftest.NeonUnderQemu|Interop\."

scripts/fuzz.sh "${FUZZ_SECONDS:-60}"
