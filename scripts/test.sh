#!/usr/bin/env bash
# The test job: install, build, check formatting and clang-tidy (scripts/lint.sh), and run the
# whole suite through ctest; then the same unit tests
# under AddressSanitizer and UndefinedBehaviorSanitizer (build-fuzz/), and each libFuzzer harness
# for FUZZ_SECONDS (default 60) from its seed corpus (build-fuzz/). Any failure or crash fails.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
scripts/build.sh
scripts/lint.sh build
ctest --test-dir build --output-on-failure -j"$(nproc)" 2>&1 | tee build/ctest.log

# ASan + UBSan: one clang build (build-fuzz/) holds the unit tests and the libFuzzer harnesses.
# The unit tests run there under both sanitizers, except the qemu NEON self-test, the PyTorch
# comparisons and the exhaustive rounding test, which test numerics rather than memory safety and
# are slow under ASan, and the package test, whose consumer is built without the sanitizers'
# runtime; then each harness runs for FUZZ_SECONDS (default 60) from its seed corpus.
FUZZ_BUILD_ONLY=1 scripts/fuzz.sh
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-fuzz --output-on-failure -j"$(nproc)" -E "IsaSelftest.NeonUnderQemu|Interop\.|Package\.|Rounding\.EveryFloat" 2>&1 | tee build-fuzz/ctest.log
scripts/fuzz.sh "${FUZZ_SECONDS:-60}"
# What did not run here (a missing tool or ISA), listed last so that no skip goes unseen.
skipped=$(grep -E '\*\*\*Skipped|Skipped ' build/ctest.log build-fuzz/ctest.log 2>/dev/null || true)
if [ -n "$skipped" ]; then echo "skipped tests:"; echo "$skipped"; fi
