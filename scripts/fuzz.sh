#!/usr/bin/env bash
# Builds the libFuzzer harnesses with clang (ASan + UBSan + libFuzzer) into build-fuzz/, through
# ccache (scripts/cache.sh), and runs each one from its seed corpus for SECONDS (default 60), as
# many at once as there are cores (each harness is single-threaded). New inputs go to
# build-fuzz/corpus/, crashes to build-fuzz/crashes/<harness>/; any crash makes the script fail.
# The same sanitized build also holds the unit tests (scripts/test.sh runs them there).
# Usage: scripts/fuzz.sh [SECONDS] [HARNESS...]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/cache.sh
seconds=${1:-60}
shift || true
harnesses=("$@")
if ((${#harnesses[@]} == 0)); then harnesses=(safetensors config shape golden_check op_spec gguf); fi
cxx=$(command -v clang++ || command -v clang++-14)
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi
cmake -S . -B build-fuzz "${generator[@]}" "${ccache_launcher[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_COMPILER="$cxx" -DTEO_FUZZ=ON -DTEO_BUILD_TESTS=ON -DTEO_BUILD_BENCH=OFF \
  -DTEO_BUILD_PYTHON=OFF -DTEO_WERROR=ON > build-fuzz.log
cmake --build build-fuzz -j"$(nproc)" >> build-fuzz.log || {
  tail -n 40 build-fuzz.log
  echo "fuzz: the sanitizer build failed; see build-fuzz.log" >&2
  exit 1
}
if [ "${FUZZ_BUILD_ONLY:-0}" = 1 ]; then exit 0; fi
# One harness: its log in build-fuzz/<harness>.log, its summary line in build-fuzz/<harness>.result
# and, when it failed, the log's tail after that line.
run_harness() {  # HARNESS
  local h=$1 dict=fuzz/config.dict rc=0
  if [ "$h" = safetensors ] || [ "$h" = golden_check ]; then dict=fuzz/safetensors.dict; fi
  if [ "$h" = op_spec ]; then dict=fuzz/op_spec.dict; fi
  if [ "$h" = gguf ]; then dict=fuzz/gguf.dict; fi
  mkdir -p "build-fuzz/corpus/$h" "build-fuzz/crashes/$h"
  # Each harness runs single-threaded; TEO_NUM_THREADS=1 keeps the model's own threads out of it.
  # fuzz/lsan.supp: the GEMM's per-worker packing buffers, which LeakSanitizer cannot see held.
  LSAN_OPTIONS="suppressions=$PWD/fuzz/lsan.supp${LSAN_OPTIONS:+:$LSAN_OPTIONS}" \
    TEO_NUM_THREADS=1 "build-fuzz/fuzz/teo_fuzz_$h" -max_total_time="$seconds" -dict="$dict" \
    -rss_limit_mb=4096 -max_len=65536 -print_final_stats=1 \
    -artifact_prefix="build-fuzz/crashes/$h/" "build-fuzz/corpus/$h" "fuzz/corpus/$h" \
    > "build-fuzz/$h.log" 2>&1 || rc=$?
  local runs rate crashes
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "build-fuzz/$h.log" | grep -o '[0-9]*$' || echo 0)
  rate=$(grep -o 'exec/s: [0-9]*' "build-fuzz/$h.log" | tail -n 1 | grep -o '[0-9]*$' || echo 0)
  # libFuzzer also writes slow-unit-* files for inputs that merely took long; they are not crashes.
  crashes=$(find "build-fuzz/crashes/$h" -type f ! -name 'slow-unit-*' | wc -l)
  {
    if [ $rc != 0 ]; then
      echo "fuzz: $h FAILED; see build-fuzz/$h.log and build-fuzz/crashes/$h/"
      tail -n 30 "build-fuzz/$h.log"
    fi
    echo "fuzz: $h: ${seconds}s, $runs runs, ~$rate exec/s, crashes: $crashes"
  } > "build-fuzz/$h.result"
  return $rc
}
for h in "${harnesses[@]}"; do
  while (($(jobs -rp | wc -l) >= $(nproc))); do wait -n || true; done
  run_harness "$h" &
done
wait
status=0
for h in "${harnesses[@]}"; do
  cat "build-fuzz/$h.result"
  grep -q "^fuzz: $h FAILED" "build-fuzz/$h.result" && status=1
done
exit $status
