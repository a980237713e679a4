#!/usr/bin/env bash
# Training exactness: `teo train` runs 20 AdamW steps in float64 (train_exactness.json) and writes a
# trace of every micro-batch, loss, lr and gradient norm; train_exactness.py replays the run with
# torch.optim.AdamW, LambdaLR and clip_grad_norm_ and requires agreement to 1e-9 at every step and
# in the final parameters. Usage: train_exactness.sh TEO_BINARY WORK_DIR
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: $0 TEO_BINARY WORK_DIR" >&2
  exit 2
fi
teo=$1 work=$2
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work" && mkdir -p "$work"
"$teo" train --config "$here/train_exactness.json" --trace "$work/trace.safetensors" \
  --out "$work/run" > "$work/train.log" 2>&1 || {
  status=$?
  echo "teo train failed (exit $status):" >&2
  tail -n 20 "$work/train.log" >&2
  exit "$status"
}
# Debian's interpreter, which is where python3-torch installs; one torch thread on a shared box.
OMP_NUM_THREADS=1 /usr/bin/python3 "$here/train_exactness.py" "$work/trace.safetensors"
