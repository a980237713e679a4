#!/usr/bin/env bash
# Runs .clusterfuzzlite/build.sh the way ClusterFuzzLite and OSS-Fuzz run it (clang, ASan with
# fuzzer-no-link in CFLAGS/CXXFLAGS, LIB_FUZZING_ENGINE=-fsanitize=fuzzer, fresh OUT and WORK),
# checks that $OUT holds the five fuzzers with their seed corpora and dictionaries, and runs each
# fuzzer for SECONDS (default 3) from its unzipped seed corpus. Exit 0 when all of that holds.
# The compiles go through ccache (scripts/cache.sh; CMake reads CMAKE_CXX_COMPILER_LAUNCHER from
# the environment, so the build script itself is what the engines run) unless TEO_CCACHE=0.
# Usage: fuzz/clusterfuzzlite_test.sh WORK_DIR [SECONDS]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="$1"
seconds="${2:-3}"
if ! command -v clang++ >/dev/null || ! command -v zip >/dev/null || ! command -v unzip >/dev/null; then
  echo "clusterfuzzlite_test: clang++, zip or unzip not found (apt-get install clang zip unzip)"
  if [ "${CI:-}" = true ]; then exit 1; fi
  exit 77
fi
rm -rf "$dir"
mkdir -p "$dir/out" "$dir/work"
source "$root/scripts/cache.sh"
if ((${#ccache_launcher[@]})); then
  export CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_C_COMPILER_LAUNCHER=ccache
else
  unset CMAKE_CXX_COMPILER_LAUNCHER CMAKE_C_COMPILER_LAUNCHER
fi
export CC=clang CXX=clang++
export CFLAGS="-O1 -fno-omit-frame-pointer -gline-tables-only -fsanitize=address -fsanitize-address-use-after-scope -fsanitize=fuzzer-no-link"
export CXXFLAGS="$CFLAGS"
export LIB_FUZZING_ENGINE="-fsanitize=fuzzer"
export OUT="$dir/out" WORK="$dir/work" SRC="$root/.."
"$root/.clusterfuzzlite/build.sh" > "$dir/build.log" 2>&1 || { tail -n 30 "$dir/build.log"; exit 1; }
status=0
for h in safetensors config shape golden_check op_spec gguf; do
  f="teo_fuzz_$h"
  for need in "$f" "${f}_seed_corpus.zip" "$f.dict"; do
    if [ ! -s "$OUT/$need" ]; then echo "FAIL: $OUT/$need is missing"; status=1; fi
  done
  [ -x "$OUT/$f" ] || continue
  corpus="$dir/corpus/$h"
  mkdir -p "$corpus"
  unzip -q -o "$OUT/${f}_seed_corpus.zip" -d "$corpus"
  seeds=$(ls "$corpus" | wc -l)
  # The runner's environment: nothing but $OUT (the harness finds its libraries and golden there).
  if (cd "$OUT" && TEO_NUM_THREADS=1 "./$f" -max_total_time="$seconds" -dict="$f.dict" \
        -rss_limit_mb=4096 "$corpus") > "$dir/$h.log" 2>&1; then
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*\|Done [0-9]* runs' "$dir/$h.log" | tail -n 1)
    echo "ok: $f ran ${seconds}s from $seeds seeds ($runs)"
  else
    echo "FAIL: $f"; tail -n 20 "$dir/$h.log"; status=1
  fi
done
exit $status
