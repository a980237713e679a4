#!/usr/bin/env bash
# The test job: install, build, and run the whole suite through ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
scripts/build.sh
ctest --test-dir build --output-on-failure -j"$(nproc)"
