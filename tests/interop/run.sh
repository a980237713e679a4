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
# PyTorch computes in float: a precision case (bf16, fp8, ...) is judged by the float32 rule
# (--precision fp32), the rest in their own dtype; each check sees only its cases' candidates.
precision_cases=$(/usr/bin/python3 - "$golden"/*.safetensors <<'PY'
import json, struct, sys
for path in sys.argv[1:]:
    with open(path, "rb") as f:
        meta = json.loads(f.read(struct.unpack("<Q", f.read(8))[0])).get("__metadata__", {})
    if json.loads(meta.get("case", "{}")).get("precision"):
        print(path.rsplit("/", 1)[-1])
PY
)
golden_abs=$(cd "$golden" && pwd)
mkdir -p "$work/golden" "$work/precision/golden" "$work/precision/candidates"
for f in "$golden_abs"/*.safetensors; do
  name=${f##*/}
  if grep -qxF "$name" <<< "$precision_cases"; then
    ln -s "$f" "$work/precision/golden/$name"
    mv "$work/candidates/$name" "$work/precision/candidates/$name"
  else
    ln -s "$f" "$work/golden/$name"
  fi
done
check() {  # GOLDEN_DIR CANDIDATE_DIR REPORT_PREFIX [flags...]
  local g=$1 c=$2 r=$3
  shift 3
  "$teo" golden check --golden "$g" --candidate "$c" --require-all "$@" \
    --junit "$r.junit.xml" --json "$r.json" > "$r.txt" || {
    status=$?
    grep -E "FAIL|first divergence|total:|not judged|vacuous" "$r.txt" | head -50
    exit "$status"
  }
  tail -n 1 "$r.txt"
}
check "$work/golden" "$work/candidates" "$work/report"
check "$work/precision/golden" "$work/precision/candidates" "$work/precision/report" \
  --precision fp32
