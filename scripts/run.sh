#!/usr/bin/env bash
# The main job: install, build, and run `teo shapes` on the default config.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
./build/teo shapes "$@"
