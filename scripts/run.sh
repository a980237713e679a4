#!/usr/bin/env bash
# The main job: install, build, and run the training demo (`teo train`; extra arguments are
# passed on, e.g. --epochs 1 or --dtype float64). Results land in train-out/.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
./build/teo train "$@"
