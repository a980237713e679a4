#!/usr/bin/env bash
# Runs a walkthrough of docs/golden-format.md exactly as written (the sh block after its marker),
# with `teo` the built binary and the work directory a fresh temporary one, and checks what the
# text promises: the good kernel passes, the bf16 kernel passes within its budget, and the
# mutated kernel fails with exit 1 at the tensor the text names.
# Usage: tests/docs_walkthrough.sh TEO_BINARY ["testing one kernel" | "testing a decode kernel"]
set -euo pipefail
teo_bin=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
name=${2:-testing one kernel}
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/bin"
ln -s "$teo_bin" "$work/bin/teo"
ln -s /usr/bin/python3 "$work/bin/python3"
script=$(awk -v marker="<!-- walkthrough: $name -->" '$0 == marker {found = 1; next}
              found && /^```sh/ {inside = 1; next}
              inside && /^```/ {exit}
              inside {print}' "$root/docs/golden-format.md")
[ -n "$script" ] || { echo "walkthrough \"$name\" not found in docs/golden-format.md"; exit 1; }
script=${script//\/tmp\/teo-kernel/$work\/kernel}
script=${script//\/tmp\/teo-decode/$work\/decode}
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
case $name in
  "testing one kernel")
    expect "writes output.context (2, 4, 64, 32)"
    expect "first divergence: output.scores"
    ;;
  "testing a decode kernel")
    expect "reads  input.block_table (3, 19) I32"
    expect '"num_pages":23'
    expect "writes output.k_pages (23, 16, 2, 64)"
    expect "first divergence: output.k_pages"
    ;;
  *)
    echo "unknown walkthrough \"$name\""
    exit 2
    ;;
esac
expect "total: 1 case(s), 0 failing"
expect "judged as bf16"
[ "$(tail -n 1 <<<"$out")" = "exit 1" ] || { echo "walkthrough: the mutant check did not exit 1"; fail=1; }
exit $fail
