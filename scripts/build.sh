#!/usr/bin/env bash
# Configures and builds teo into build/ (Release, warnings as errors).
set -euo pipefail
cd "$(dirname "$0")/.."
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi
cmake -S . -B build "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DTEO_WERROR=ON
cmake --build build -j"$(nproc)"
