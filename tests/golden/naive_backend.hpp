// A second, independent forward and backward pass written from docs/semantics.md with plain double
// loops: it reads a golden file's inputs, parameters and dropout masks and writes a candidate with
// every act.* tensor and, for naive_candidate, every grad.* and grad.act.* tensor the golden holds.
// It shares no code with the model, so it is both a worked example of reading a golden in C++ and,
// with a Mutation, the source of the deliberately broken candidates that prove `teo golden check`
// finds a bug at the stage where it lives.
#pragma once

#include <string>

#include "teo/safetensors.hpp"

namespace teo::testing {

enum class Mutation {
  none,
  // forward
  no_score_scale,              // scores not divided by sqrt(d_head)
  layer_norm_unbiased,         // LayerNorm variance divided by D - 1
  layer_norm_eps_outside,      // (x - m) / (sqrt(var) + eps)
  pe_sin_cos_swapped,          // cos on even columns, sin on odd
  pe_frequency_off_by_one,     // 10000^((2i + 2) / D)
  mask_ignores_padding,        // keys beyond the length stay visible
  softmax_wrong_axis,          // normalised over queries instead of keys
  tanh_gelu_for_exact,         // the tanh approximation where exact GELU is configured
  transposed_weight,           // q = x Wq instead of x Wq^T
  dropout_scale_missing,       // kept values not multiplied by 1 / (1 - p)
  label_smoothing_ignored,     // plain cross-entropy
  mean_pool_includes_padding,  // the mean over all S positions
  kv_heads_tiled,              // query head h reads K/V head h % Hkv instead of h / (H / Hkv)
  rope_other_convention,       // neox pairs where interleaved is configured, and back
  rope_bf16_positions,         // positions rounded to bf16 before the angles
  window_one_wider,            // a sliding window of W + 1 keys
  alibi_sign_flipped,          // +slope (i - j) instead of -slope (i - j)
  softcap_after_mask,          // the cap applied after the bias and the mask: -inf becomes -c
  sink_column_kept,            // the extended row sliced one column late: the sink's share kept
  decoder_not_causal,          // a decoder's self-attention without its causal mask
  labels_not_shifted,          // a decoder's position t predicts token t, not t + 1
  // a generation step's token at position lengths[b] + t + 1 (learned, sinusoidal or RoPE
  // positions; the prompt's are right)
  generation_position_off_by_one,
  token_types_ignored,           // the token-type rows not added to the embedding sum
  embedding_norm_after_dropout,  // norm(dropout(sum)) instead of dropout(norm(sum))
  pooler_without_tanh,           // the pooler's dense layer without its tanh
  patches_hwc_flattened,         // ViT's patches flattened in (P, P, C) order, not (C, P, P)
  cls_token_appended,            // ViT's [CLS] after the patches instead of before them
  // backward (the forward is untouched)
  layer_norm_backward_no_mean,  // gx = (dn - n * mean(dn * n)) * rstd: no "- mean(dn)" term
  softmax_backward_no_row_sum,  // gscores = probs * gprobs: no "- sum_j probs * gprobs" term
  tied_head_grad_dropped,       // a tied LM head's weight gradient not added to the embedding's
};

const char* mutation_name(Mutation m);

// The candidate for `golden` (act.* tensors only, in the golden's dtype).
safetensors::File naive_forward(const safetensors::File& golden, Mutation m = Mutation::none);

// The candidate for `golden` with the act.* tensors of naive_forward and, from an independent
// backward pass of the mean loss, every grad.<param> and grad.act.* tensor the golden holds (in
// the golden's dtype). Forward mutations change the forward only; the backward then differentiates
// the documented formulas at the (mutated) saved values.
safetensors::File naive_candidate(const safetensors::File& golden, Mutation m = Mutation::none);

}  // namespace teo::testing
