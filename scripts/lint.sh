#!/usr/bin/env bash
# Style and static checks: clang-format (the repo's .clang-format) on every C++ file, then
# clang-tidy (the repo's .clang-tidy) on the library's own sources, with build/'s compile
# commands. Any finding fails. clang-tidy's clean verdicts are cached per source, keyed by the
# preprocessed text, the flags and the checks (scripts/tidy.py), in ccache's folder; a source is
# analysed again whenever anything it reads changes. Usage: scripts/lint.sh [BUILD_DIR]
# (default build/); TEO_TIDY_CACHE=0 analyses every source.
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
mapfile -t files < <(git ls-files '*.cpp' '*.hpp')
clang-format --dry-run --Werror "${files[@]}"
echo "lint: clang-format: ${#files[@]} files formatted"
# The library: src/ without the per-ISA kernel units (xsimd templates instantiated per
# architecture flags), which the ISA self-test and the kernel tests cover instead.
mapfile -t lib < <(git ls-files 'src/*.cpp' | grep -v '^src/kernels/simd/')
python3 scripts/tidy.py "$build" "${lib[@]}" || {
  echo "lint: clang-tidy found problems (above)" >&2
  exit 1
}
echo "lint: clang-tidy: ${#lib[@]} library sources clean"
