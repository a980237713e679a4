#!/usr/bin/env bash
# Style and static checks: clang-format (the repo's .clang-format) on every C++ file, then
# clang-tidy (the repo's .clang-tidy) on the library's own sources, with build/'s compile
# commands. Any finding fails. Usage: scripts/lint.sh [BUILD_DIR]   (default build/)
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
mapfile -t files < <(git ls-files '*.cpp' '*.hpp')
clang-format --dry-run --Werror "${files[@]}"
echo "lint: clang-format: ${#files[@]} files formatted"
# The library: src/ without the per-ISA kernel units (xsimd templates instantiated per
# architecture flags), which the ISA self-test and the kernel tests cover instead.
mapfile -t lib < <(git ls-files 'src/*.cpp' | grep -v '^src/kernels/simd/')
printf '%s\n' "${lib[@]}" | xargs -P "$(nproc)" -n 4 clang-tidy -p "$build" --quiet \
  --warnings-as-errors='*' 2> "$build/clang-tidy.log" > "$build/clang-tidy.out" || {
  grep -E 'warning:|error:' "$build/clang-tidy.out" | head -n 40
  echo "lint: clang-tidy found problems; see $build/clang-tidy.out" >&2
  exit 1
}
echo "lint: clang-tidy: ${#lib[@]} library sources clean"
