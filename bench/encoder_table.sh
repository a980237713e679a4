#!/usr/bin/env bash
# The whole-encoder table of docs/performance.md: for each preset and dtype, in one run and
# interleaved, OpenBLAS's GEMM at 1024 x 3072 x 768 (the "large-GEMM rate" the ratios are taken
# against), `teo bench` on the simd and blas backends, and PyTorch's encoder
# (bench/pytorch_bench.py, 1 and 2 threads, the better one kept).
# Every teo figure is forward+backward GFLOP/s on 2 threads; ratios are taken within one round.
#
# Usage: bench/encoder_table.sh [build-dir] [rounds]     (default: build, 2)
# Needs a Release build (scripts/build.sh) and, for the PyTorch column, Debian's python3-torch.
set -euo pipefail
build=${1:-build}
rounds=${2:-2}
teo="$build/teo"
micro="$build/bench/teo_microbench"
[[ -x "$teo" && -x "$micro" ]] || { echo "encoder_table.sh: build $build first (scripts/build.sh)" >&2; exit 2; }
have_torch=0
/usr/bin/python3 -c 'import torch' 2>/dev/null && have_torch=1

gflops() { /usr/bin/python3 -c 'import json,sys; print("%.1f" % json.loads(sys.stdin.readline())["gflops_fwd_bwd"])'; }
openblas() {  # $1: F32 | F64
  local lower
  lower=$(echo "$1" | tr F f)
  "$micro" --benchmark_filter="BM_OpenBlas$1/openblas_${lower}_NT/m:1024/n:3072/k:768/threads:2" \
    --benchmark_repetitions=3 --benchmark_report_aggregates_only=true --benchmark_format=csv 2>/dev/null |
    grep median | awk -F, '{printf "%.1f\n", $NF / 1e9}'
}

printf '| round | preset | dtype | OpenBLAS GEMM | teo simd | teo blas | PyTorch | simd / OpenBLAS GEMM | simd / PyTorch |\n'
printf '| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n'
for round in $(seq 1 "$rounds"); do
  for preset in bert-base small; do
    for dtype in float32 float64; do
      ref=$(openblas "$([[ $dtype == float32 ]] && echo F32 || echo F64)")
      simd=$("$teo" bench --preset "$preset" --dtype "$dtype" --backend simd --threads 2 --json | gflops)
      blas=$("$teo" bench --preset "$preset" --dtype "$dtype" --backend blas --threads 2 --json | gflops)
      torch="-"
      if [[ $have_torch == 1 ]]; then
        t1=$(/usr/bin/python3 bench/pytorch_bench.py --preset "$preset" --dtype "$dtype" --threads 1 | gflops)
        t2=$(/usr/bin/python3 bench/pytorch_bench.py --preset "$preset" --dtype "$dtype" --threads 2 | gflops)
        torch=$(/usr/bin/python3 -c "print(max($t1, $t2))")
      fi
      ratio_ref=$(/usr/bin/python3 -c "print('%.2f' % ($simd / $ref))")
      ratio_torch="-"
      [[ $torch != "-" ]] && ratio_torch=$(/usr/bin/python3 -c "print('%.2f' % ($simd / $torch))")
      printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' "$round" "$preset" "$dtype" "$ref" \
        "$simd" "$blas" "$torch" "$ratio_ref" "$ratio_torch"
    done
  done
done
