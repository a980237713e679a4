#!/usr/bin/env bash
# Runs the "Testing one kernel" walkthrough of docs/golden-format.md exactly as written (the sh
# block after its marker), with `teo` the built binary and the work directory a fresh temporary
# one, and checks what the text promises: the good kernel passes, the bf16 kernel passes within
# its budget, and the kernel without the scale fails with exit 1 at output.scores.
# Usage: tests/docs_walkthrough.sh TEO_BINARY
set -euo pipefail
teo_bin=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/bin"
ln -s "$teo_bin" "$work/bin/teo"
ln -s /usr/bin/python3 "$work/bin/python3"
script=$(awk '/<!-- walkthrough: testing one kernel -->/ {found = 1; next}
              found && /^```sh/ {inside = 1; next}
              inside && /^```/ {exit}
              inside {print}' "$root/docs/golden-format.md")
[ -n "$script" ] || { echo "walkthrough block not found in docs/golden-format.md"; exit 1; }
script=${script//\/tmp\/teo-kernel/$work\/kernel}
out=$(cd "$work" && PATH="$work/bin:$PATH" TEO="$root" bash -euo pipefail -c "$script" 2>&1) || {
  echo "$out"
  echo "the walkthrough failed"
  exit 1
}
echo "$out"
fail=0
expect() {
  if ! grep -qF -- "$1" <<<"$out"; then
    echo "walkthrough: expected \"$1\" in the output"
    fail=1
  fi
}
expect "writes output.context (2, 4, 64, 32)"
expect "total: 1 case(s), 0 failing"
expect "judged as bf16"
expect "first divergence: output.scores"
[ "$(tail -n 1 <<<"$out")" = "exit 1" ] || { echo "walkthrough: the mutant check did not exit 1"; fail=1; }
exit $fail
