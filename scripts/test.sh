#!/usr/bin/env bash
# The test job: install, build, check formatting and clang-tidy (scripts/lint.sh), and run the
# suite through ctest; then the tests that exercise memory (ctest label `memory`) under
# AddressSanitizer and UndefinedBehaviorSanitizer (build-fuzz/), and each libFuzzer harness for
# FUZZ_SECONDS (default 60) from its seed corpus (build-fuzz/), two at a time on two cores. Any
# failure or crash fails. Builds go through ccache (scripts/cache.sh) and clang-tidy's verdicts
# are cached, so a run after a build of the same sources recompiles nothing.
#
# Usage: scripts/test.sh [--full]
#   (none)  what CI runs (.ci/run): the exhaustive sweeps (label `exhaustive`) are left to
#           --full, and their sampled versions run instead;
#   --full  everything: the exhaustive sweeps too, and under the sanitizers every test but those
#           labelled `nosan` (docs/testing.md says when it must be run).
# At the end it prints the wall time of every stage and the ten slowest tests of each ctest run,
# and fails when a test took over 60 s and is not in docs/testing.md's list of long tests.
set -euo pipefail
cd "$(dirname "$0")/.."
full=0
case "${1:-}" in
  --full) full=1 ;;
  "") ;;
  *) echo "usage: scripts/test.sh [--full]" >&2; exit 2 ;;
esac
source scripts/cache.sh

# Stage times, printed however the run ends.
stage_rows=()
ctest_dirs=()
stage() {  # NAME COMMAND...: runs COMMAND, records its wall time and exit status
  local name=$1 t0=$SECONDS rc=0
  shift
  "$@" || rc=$?
  stage_rows+=("$(printf '%-34s %4d:%02d  %s' "$name" $(((SECONDS - t0) / 60)) \
    $(((SECONDS - t0) % 60)) "$([ $rc = 0 ] && echo ok || echo "FAILED ($rc)")")")
  return $rc
}
# The tests of a ctest log, slowest first, from ctest's own timings: "seconds name". With N, the
# first N only; awk reads its input to the end, so sort never writes into a closed pipe (a `head`
# here let sort die of SIGPIPE under pipefail, and the run exit 141 after every test had passed).
test_times() {  # LOG [N]
  sed -nE 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: ([^ ]+) .* ([0-9.]+) sec$/\2 \1/p' "$1" | sort -rn |
    awk -v n="${2:-0}" 'n == 0 || NR <= n'
}
print_summary() {
  echo
  echo "==== stage times (scripts/test.sh$([ $full = 1 ] && echo " --full")) ===="
  printf '%s\n' "${stage_rows[@]}"
  if [ -n "$ccache_at_start" ]; then
    read -r h0 m0 <<< "$ccache_at_start"
    read -r h1 m1 <<< "$(ccache_counts)"
    echo "ccache: $((h1 - h0)) hits, $((m1 - m0)) misses in this run ($CCACHE_DIR)"
  fi
  echo "total                              $((SECONDS / 60)):$(printf '%02d' $((SECONDS % 60)))"
  for d in "${ctest_dirs[@]}"; do
    [ -s "$d/ctest.log" ] || continue
    echo "---- the ten slowest tests in $d (seconds) ----"
    test_times "$d/ctest.log" 10
  done
}
# ccache's hit and miss counters, to report this run's share.
ccache_counts() {
  ccache --print-stats 2>/dev/null |
    awk '$1 ~ /^(direct|preprocessed)_cache_hit$/ {h += $2} $1 == "cache_miss" {m += $2}
         END {print h+0, m+0}'
}
ccache_at_start=""
if ((${#ccache_launcher[@]})); then ccache_at_start=$(ccache_counts); fi
# The summary never changes the run's exit status: it is what the run did, printed.
trap 'rc=$?; print_summary || echo "scripts/test.sh: the summary failed ($?)"; exit $rc' EXIT

# Each ctest run writes a JUnit report beside its log; a failure is summarised at the end (below),
# with each failed test's own output, so that the last screen of a CI log explains it.
failed=0
failed_dirs=()
run_ctest() {  # DIR [ctest args...]; the environment given with `env` before it is the tests'
  local dir=$1
  shift
  ctest_dirs+=("$dir")
  set +o pipefail
  ctest --test-dir "$dir" --output-on-failure --output-junit ctest-junit.xml -j"$(nproc)" "$@" 2>&1 |
    tee "$dir/ctest.log"
  local rc=${PIPESTATUS[0]}
  set -o pipefail
  if [ "$rc" -ne 0 ]; then
    failed=1
    failed_dirs+=("$dir")
  fi
  return "$rc"
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
# A test over 60 s must be in the table under "Tests over a minute" in docs/testing.md, with its
# reason; anything else that slow fails the run, so that the CI budget cannot creep back.
check_long_tests() {
  local allowed slow=0
  allowed=$(awk '/^## Tests over a minute/ {on=1; next} on && /^## / {exit}
                 on && /^\| `/ {split($0, f, "`"); print f[2]}' docs/testing.md)
  for d in "${ctest_dirs[@]}"; do
    [ -s "$d/ctest.log" ] || continue
    while read -r secs name; do
      if awk -v s="$secs" 'BEGIN {exit !(s > 60)}' && ! grep -qxF "$name" <<< "$allowed"; then
        echo "scripts/test.sh: $name took ${secs} s in $d, over 60 s, and is not in the list of" \
          "long tests in docs/testing.md (\"Tests over a minute\"); make it faster, or list it there" \
          "with its reason"
        slow=1
      fi
    done < <(test_times "$d/ctest.log")
  done
  return $slow
}

stage "setup (scripts/setup.sh --test)" scripts/setup.sh --test
stage "build (Release, build/)" scripts/build.sh
stage "lint (clang-format, clang-tidy)" scripts/lint.sh build
if [ $full = 1 ]; then
  stage "ctest build/ (everything)" run_ctest build || true
else
  stage "ctest build/ (-LE exhaustive)" run_ctest build -LE exhaustive || true
fi

# ASan + UBSan: one clang build (build-fuzz/) holds the unit tests and the libFuzzer harnesses.
# The tests labelled `memory` run there under both sanitizers (--full: all but `nosan`); then
# each harness runs for FUZZ_SECONDS (default 60) from its seed corpus.
stage "sanitizer build (build-fuzz/)" env FUZZ_BUILD_ONLY=1 scripts/fuzz.sh
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
if [ $full = 1 ]; then
  stage "ctest build-fuzz/ (-LE nosan)" run_ctest build-fuzz -LE "nosan|exhaustive" || true
else
  stage "ctest build-fuzz/ (-L memory)" run_ctest build-fuzz -L memory || true
fi
unset ASAN_OPTIONS UBSAN_OPTIONS
stage "fuzz (${FUZZ_SECONDS:-60} s each)" scripts/fuzz.sh "${FUZZ_SECONDS:-60}" || failed=1
check_long_tests || failed=1
# What did not run here (a missing tool or ISA), listed last so that no skip goes unseen.
skipped=$(grep -E '\*\*\*Skipped|Skipped ' build/ctest.log build-fuzz/ctest.log 2>/dev/null || true)
if [ -n "$skipped" ]; then echo "skipped tests:"; echo "$skipped"; fi
if [ "$failed" != 0 ]; then
  for d in "${failed_dirs[@]}"; do summarise_failures "$d"; done
  echo "scripts/test.sh: FAILED"
  exit 1
fi
