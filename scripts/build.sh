#!/usr/bin/env bash
# Configures and builds teo into build/ (Release, warnings as errors), through ccache when it is
# installed (scripts/cache.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/cache.sh
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi
cmake -S . -B build "${generator[@]}" "${ccache_launcher[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DTEO_WERROR=ON
cmake --build build -j"$(nproc)"
