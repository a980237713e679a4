// Internal: attention's forward products in fp8, under a Precision::fp8 pass whose recipe sets
// `attention` (docs/fp8.md, "Attention"), as FlashAttention 3's fp8 forward computes them:
// - q, k and v each have one scale per (batch, K/V head), from the block's amax (FA3's q_descale,
//   k_descale and v_descale have shape (batch, kv_heads));
// - q k^T is an fp8 product accumulated as the recipe says, then scaled by alpha;
// - the probabilities of a row are quantized with the row's largest one mapped to 2^8 (FA3's
//   Max_offset = 8: exp2 of the score minus the row maximum plus 8 lies in [0, 256]), and p v is
//   an fp8 product whose row scale also divides by that offset.
#pragma once

#include "teo/fp8.hpp"
#include "teo/types.hpp"

namespace teo::detail {

// Whether float attention on this thread computes its forward products in fp8.
bool fp8_attention();

// One (batch, K/V head) block's quantized operands: the group's query rows (G * Sq, Dh), its keys
// (Skv, Dh) and its values transposed (Dv, Skv), each with one scale.
struct Fp8AttentionHeads {
  Fp8Operand q, k, vt;
};

// q holds the group's G * Sq query rows (G * Sq, Dh), k (Skv, Dh) and v (Skv, Dv), row-major; a
// non-finite value is a RangeError naming the tensor.
Fp8AttentionHeads quantize_heads(const float* q, index_t q_rows, const float* k, const float* v,
                                 index_t skv, index_t dh, index_t dv);

// sc (rows, Skv) = alpha * q[row0, row0 + rows) k^T, the fp8 product of the quantized operands.
void fp8_scores(const Fp8AttentionHeads& h, index_t row0, index_t rows, float alpha, float* sc);

// context (rows, Dv; row stride ldc) = p (rows, Skv) v, with each row of p quantized to the
// recipe's forward format by the scale (its largest value) / 2^8 (1 for a row of zeros).
void fp8_context(const Fp8AttentionHeads& h, const float* p, index_t rows, float* context,
                 index_t ldc);

}  // namespace teo::detail
