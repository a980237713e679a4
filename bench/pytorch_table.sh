#!/usr/bin/env bash
# teo against PyTorch on both bench presets and dtypes, with PyTorch's OpenBLAS on the kernels it
# picks by itself and on those OPENBLAS_CORETYPE names, in alternating runs: each round runs, for
# every preset and dtype, `teo bench --json` (and a baseline teo binary when one is given) and
# bench/pytorch_bench.py twice, one call after the other. Every figure is forward+backward on 2
# threads; the ratios are taken within the round. The table of docs/performance.md, "Intel Xeon".
#
# Usage: bench/pytorch_table.sh [build-dir] [rounds] [coretype] [baseline-teo]
#        (defaults: build, 3, CooperLake, none)
# Needs a Release build and Debian's python3-torch. Run it on a quiet machine.
set -euo pipefail
build=${1:-build}
rounds=${2:-3}
coretype=${3:-CooperLake}
baseline=${4:-}
teo="$build/teo"
[[ -x "$teo" ]] || { echo "pytorch_table.sh: build $build first" >&2; exit 2; }
/usr/bin/python3 -c 'import torch' 2>/dev/null || { echo "pytorch_table.sh: needs python3-torch" >&2; exit 2; }

field() { /usr/bin/python3 -c "import json,sys; v = json.loads(sys.stdin.readline())['$1']; print(('%.2f' if abs(v) < 10 else '%.1f') % v if isinstance(v, float) else v)"; }
ratio() { /usr/bin/python3 -c "print('%.2f' % ($1 / $2))"; }
torch_run() {  # $1: preset, $2: dtype, $3: OPENBLAS_CORETYPE or "" for OpenBLAS's own choice
  if [[ -n $3 ]]; then
    OPENBLAS_CORETYPE=$3 /usr/bin/python3 bench/pytorch_bench.py --preset "$1" --dtype "$2" --threads 2
  else
    env -u OPENBLAS_CORETYPE /usr/bin/python3 bench/pytorch_bench.py --preset "$1" --dtype "$2" --threads 2
  fi
}

echo "CPU: $("$teo" bench --preset small --repeats 1 --warmup 0 | sed -n 's/^  CPU //p'); OpenBLAS kernels: $(torch_run small float32 "" | field openblas_core) by itself, $(torch_run small float32 "$coretype" | field openblas_core) with OPENBLAS_CORETYPE=$coretype"
printf '| round | preset | dtype | FMA peak | teo | of peak |'
[[ -n $baseline ]] && printf ' baseline teo | teo / baseline |'
printf ' PyTorch (%s) | teo / PyTorch | PyTorch (own choice) | teo / PyTorch |\n' "$coretype"
printf '| --- | --- | --- | --- | --- | --- |'
[[ -n $baseline ]] && printf ' --- | --- |'
printf ' --- | --- | --- | --- |\n'
for round in $(seq 1 "$rounds"); do
  for preset in bert-base small; do
    for dtype in float32 float64; do
      json=$("$teo" bench --preset "$preset" --dtype "$dtype" --threads 2 --json)
      t=$(echo "$json" | field gflops_fwd_bwd)
      peak=$(echo "$json" | field peak_gflops)
      [[ $(echo "$json" | field peak_reliable) == True ]] || peak="$peak (unreliable)"
      frac=$(echo "$json" | field fraction_of_peak)
      printf '| %s | %s | %s | %s | %s | %s |' "$round" "$preset" "$dtype" "$peak" "$t" "$frac"
      if [[ -n $baseline ]]; then
        b=$("$baseline" bench --preset "$preset" --dtype "$dtype" --threads 2 --json | field gflops_fwd_bwd)
        printf ' %s | %s |' "$b" "$(ratio "$t" "$b")"
      fi
      named=$(torch_run "$preset" "$dtype" "$coretype" | field gflops_fwd_bwd)
      own=$(torch_run "$preset" "$dtype" "" | field gflops_fwd_bwd)
      printf ' %s | %s | %s | %s |\n' "$named" "$(ratio "$t" "$named")" "$own" "$(ratio "$t" "$own")"
    done
  done
done
