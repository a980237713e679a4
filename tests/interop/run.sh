#!/usr/bin/env bash
# The PyTorch interop test: tests/interop/torch_backend.py rebuilds every golden case in PyTorch
# (Debian's python3-torch) and writes a candidate; `teo golden check --require-all` must pass on
# all of them. Usage: run.sh TEO_BINARY GOLDEN_DIR WORK_DIR
set -euo pipefail
teo=$1 golden=$2 work=$3
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work" && mkdir -p "$work/candidates"
# Debian's interpreter, which is where python3-torch installs; one torch thread on a shared box.
OMP_NUM_THREADS=1 /usr/bin/python3 "$here/torch_backend.py" --golden "$golden" --out "$work/candidates"
# The model cases only (golden/ops/, which a check of golden/ would descend into, has its own test).
mkdir -p "$work/golden"
ln -s "$(cd "$golden" && pwd)"/*.safetensors "$work/golden/"
"$teo" golden check --golden "$work/golden" --candidate "$work/candidates" --require-all \
  --junit "$work/junit.xml" --json "$work/report.json" > "$work/report.txt" || {
  status=$?
  grep -E "FAIL|first divergence|total:" "$work/report.txt" | head -50
  exit "$status"
}
tail -n 1 "$work/report.txt"
