#!/usr/bin/env bash
# Issue 51's mutants of the independent PyTorch MoE (tests/interop/torch_backend.py, written from
# Hugging Face's documented router and expert behaviour) on the committed MoE model cases: each
# single-bug mutant fails `teo golden check`, first at its tensor. The unmutated backend passes
# every case in Interop.PyTorchCandidatesPassTheGoldenCheck. Usage: moe_models.sh TEO GOLDEN WORK
set -euo pipefail
teo=$1 golden=$2 work=$3
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work" && mkdir -p "$work"
# Each mutant of the list in issue 51 that these cases can show fails, first at its tensor.
while read -r mutant name first; do
  mkdir -p "$work/mutants/$mutant"
  OMP_NUM_THREADS=1 /usr/bin/python3 "$here/torch_backend.py" --mutant "$mutant" \
    --golden "$golden/$name.safetensors" --out "$work/mutants/$mutant" > /dev/null
  if "$teo" golden check --golden "$golden/$name.safetensors" --no-progress \
      --candidate "$work/mutants/$mutant/$name.safetensors" > "$work/mutants/$mutant.txt"; then
    echo "mutant $mutant passed $name"
    exit 1
  fi
  got=$(sed -n 's/^  first divergence: //p' "$work/mutants/$mutant.txt" | head -n 1)
  if [ "$got" != "$first" ]; then
    echo "mutant $mutant on $name: first divergence '$got', expected '$first'"
    exit 1
  fi
  echo "mutant $mutant fails at $first"
done <<'LIST'
moe_correction_in_weights moe_deepseek_v3_f64 layers.1.moe.topk_weights
moe_norm_topk_ignored moe_qwen3_f64 layers.0.moe.topk_weights
moe_softmax_over_all moe_gpt_oss_f64 layers.0.moe.topk_weights
moe_group_max moe_deepseek_v3_f64 layers.1.moe.topk_ids
moe_shared_fed_output moe_qwen2_shared_f64 layers.1.moe.shared_out
moe_unpermute_wrong moe_mixtral_f64 layers.0.ffn_out
moe_weight_at_output moe_llama4_f64 layers.0.moe.expert_in
moe_aux_per_token moe_mixtral_f64 moe_aux_loss
LIST
