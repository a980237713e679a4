#!/usr/bin/env bash
# The at-scale MoE op case of docs/performance.md: one Qwen3-30B-A3B layer (128 experts, top 8,
# D 2048, moe_d_ff 768) on 4096 tokens in float64, generated on 2 threads and on 1 (the two files
# must be the same bytes), then checked against itself; wall, user and system time and peak RSS
# of each step, from /usr/bin/time -v.
#
# Usage: bench/moe_op_case.sh [build-dir] [scratch-dir]     (default: build, a fresh mktemp -d)
# Needs about 15 GB of memory and 11.3 GB of disk in scratch-dir (the 11.2 GB file, written
# twice, one after the other); what it writes there is removed at the end.
set -euo pipefail
build=${1:-build}
teo="$build/teo"
[[ -x "$teo" ]] || { echo "moe_op_case.sh: build $build first (scripts/build.sh)" >&2; exit 2; }
[[ -x /usr/bin/time ]] || { echo "moe_op_case.sh: needs /usr/bin/time (apt-get install time)" >&2; exit 2; }
if [[ -n "${2:-}" ]]; then
  dir=$2
  mkdir -p "$dir"
  # only what this script writes there, and an interrupted run's temporary files
  trap 'rm -f "$dir"/e128.json "$dir"/e128.safetensors "$dir"/e128_t1.safetensors \
    "$dir"/gen1.time "$dir"/gen2.time "$dir"/check.time "$dir"/.e128*.safetensors.tmp-*' EXIT
else
  dir=$(mktemp -d)
  trap 'rm -rf "$dir"' EXIT
fi
cat > "$dir/e128.json" <<'SPEC'
{"op": "moe", "tokens": 4096, "d_model": 2048, "num_experts": 128, "num_experts_per_tok": 8,
 "moe_d_ff": 768, "norm_topk_prob": true, "replay_routing": true, "clear_margins": false,
 "dtype": "float64", "seed": 1}
SPEC

row() {  # $1: the step's name; $2: its /usr/bin/time -v output
  awk -F': ' -v step="$1" '
    /Elapsed \(wall clock\)/ { n = split($2, p, ":"); wall = (n == 3 ? p[1] * 3600 + p[2] * 60 + p[3] : p[1] * 60 + p[2]) }
    /User time/ { user = $2 } /System time/ { sys = $2 } /Maximum resident/ { rss = $2 }
    END { printf "| %s | %.1f s | %.1f s | %.1f s | %.2f GB |\n", step, wall, user, sys, rss * 1024 / 1e9 }' "$2"
}

echo "$(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2; exit}'), $(nproc) cores, $(date -u +%F)"
printf '| step | wall | user | system | peak RSS |\n| --- | --- | --- | --- | --- |\n'
/usr/bin/time -v -o "$dir/gen2.time" "$teo" golden op --spec "$dir/e128.json" \
  --out "$dir/e128.safetensors" --backend simd --threads 2 --force > /dev/null
row "generate, 2 threads" "$dir/gen2.time"
/usr/bin/time -v -o "$dir/check.time" "$teo" golden check --golden "$dir/e128.safetensors" \
  --candidate "$dir/e128.safetensors" > /dev/null
row "check against itself" "$dir/check.time"
sum2=$(sha256sum "$dir/e128.safetensors" | cut -d' ' -f1)
rm -f "$dir/e128.safetensors"
/usr/bin/time -v -o "$dir/gen1.time" "$teo" golden op --spec "$dir/e128.json" \
  --out "$dir/e128_t1.safetensors" --backend simd --threads 1 --force > /dev/null
row "generate, 1 thread" "$dir/gen1.time"
sum1=$(sha256sum "$dir/e128_t1.safetensors" | cut -d' ' -f1)
size=$(stat -c %s "$dir/e128_t1.safetensors")
echo "file: $size bytes, sha256 $sum2 (2 threads), $sum1 (1 thread)"
[[ "$sum1" == "$sum2" ]] || { echo "moe_op_case.sh: the thread counts gave different bytes" >&2; exit 1; }
