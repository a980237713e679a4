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
# Each ctest run writes a JUnit report beside its log; a failure is summarised at the end (below),
# with each failed test's own output, so that the last screen of a CI log explains it.
failed=0
failed_dirs=()
run_ctest() {  # DIR [ctest args...]; the environment given with `env` before it is the tests'
  local dir=$1
  shift
  set +o pipefail
  ctest --test-dir "$dir" --output-on-failure --output-junit ctest-junit.xml -j"$(nproc)" "$@" 2>&1 |
    tee "$dir/ctest.log"
  local rc=${PIPESTATUS[0]}
  set -o pipefail
  if [ "$rc" -ne 0 ]; then
    failed=1
    failed_dirs+=("$dir")
  fi
}
summarise_failures() {  # DIR
  local list="$1/Testing/Temporary/LastTestsFailed.log"
  [ -s "$list" ] || return 0
  echo "==== failed in $1 (JUnit report: $1/ctest-junit.xml) ===="
  while IFS=: read -r num name; do
    echo "---- $name: its output ----"
    # its verdict line, then what --output-on-failure printed, up to the next test's line
    awk -v n="$num" '$0 ~ ("Test +#" n ": ") {on=1; print; next}
                     on && (/^ *[0-9]+\/[0-9]+ Test +#/ || /^ +Start +[0-9]+: /) {exit}
                     on {print; if (++k > 200) exit}' "$1/ctest.log"
  done < "$list"
}
run_ctest build

# ASan + UBSan: one clang build (build-fuzz/) holds the unit tests and the libFuzzer harnesses.
# The unit tests run there under both sanitizers, except the qemu NEON self-test, the PyTorch
# comparisons and the exhaustive rounding test, which test numerics rather than memory safety and
# are slow under ASan, and the package test, whose consumer is built without the sanitizers'
# runtime; then each harness runs for FUZZ_SECONDS (default 60) from its seed corpus.
FUZZ_BUILD_ONLY=1 scripts/fuzz.sh
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
run_ctest build-fuzz -E "IsaSelftest.NeonUnderQemu|Interop\.|Package\.|Rounding\.EveryFloat"
unset ASAN_OPTIONS UBSAN_OPTIONS
scripts/fuzz.sh "${FUZZ_SECONDS:-60}" || failed=1
# What did not run here (a missing tool or ISA), listed last so that no skip goes unseen.
skipped=$(grep -E '\*\*\*Skipped|Skipped ' build/ctest.log build-fuzz/ctest.log 2>/dev/null || true)
if [ -n "$skipped" ]; then echo "skipped tests:"; echo "$skipped"; fi
if [ "$failed" != 0 ]; then
  for d in "${failed_dirs[@]}"; do summarise_failures "$d"; done
  echo "scripts/test.sh: FAILED"
  exit 1
fi
