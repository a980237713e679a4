// Attention's forward products in fp8 (attention_fp8.hpp, docs/fp8.md "Attention").
#include "layers/attention_fp8.hpp"

#include <algorithm>
#include <vector>

#include "kernels/parallel.hpp"
#include "teo/precision.hpp"

namespace teo::detail {

namespace {

// FA3's Max_offset: a row's largest probability becomes 2^8 before the cast.
constexpr float kProbOffset = 256.0f;

// One scale for a whole (rows, k) operand, as a block spanning it: the product's two operands
// then share the scaling kind and their block spans all of k.
Fp8Quantization whole(const Fp8Recipe& r, index_t rows, index_t k) {
  Fp8Quantization how;
  how.format = r.forward;
  how.scaling = Fp8Scaling::block;
  how.block_rows = std::max<index_t>(rows, 1);
  how.block_k = std::max<index_t>(k, 1);
  how.saturate = r.saturate;
  return how;
}

}  // namespace

bool fp8_attention() {
  return emulation() == Precision::fp8 && fp8_recipe().attention;
}

Fp8AttentionHeads quantize_heads(const float* q, index_t q_rows, const float* k, const float* v,
                                 index_t skv, index_t dh, index_t dv) {
  const Fp8Recipe& r = fp8_recipe();
  return {quantize_fp8(q, q_rows, dh, dh, false, whole(r, q_rows, dh), "attention q"),
          quantize_fp8(k, skv, dh, dh, false, whole(r, skv, dh), "attention k"),
          quantize_fp8(v, dv, skv, dv, true, whole(r, dv, skv), "attention v")};
}

void fp8_scores(const Fp8AttentionHeads& h, index_t row0, index_t rows, float alpha, float* sc) {
  Fp8Operand a;
  a.format = h.q.format;
  a.scaling = h.q.scaling;
  a.rows = rows;
  a.k = h.q.k;
  a.block_rows = h.q.block_rows;  // spans the group: one scale
  a.block_k = h.q.block_k;
  a.q.assign(h.q.q.begin() + row0 * a.k, h.q.q.begin() + (row0 + rows) * a.k);
  a.scale = h.q.scale;
  const index_t skv = h.k.rows;
  fp8_gemm(a, h.k, sc, skv, fp8_recipe().accumulate);
  for (index_t j = 0; j < rows * skv; ++j) sc[j] *= alpha;
}

void fp8_context(const Fp8AttentionHeads& h, const float* p, index_t rows, float* context,
                 index_t ldc) {
  const Fp8Recipe& r = fp8_recipe();
  const index_t skv = h.vt.k;
  if (skv == 0) {  // no keys: an empty sum
    for (index_t i = 0; i < rows; ++i)
      std::fill(context + i * ldc, context + i * ldc + h.vt.rows, 0.0f);
    return;
  }
  std::vector<float> scales(static_cast<std::size_t>(rows));
  for (index_t i = 0; i < rows; ++i) {
    const float* row = p + i * skv;
    float top = 0.0f;
    for (index_t j = 0; j < skv; ++j) top = std::max(top, row[j]);
    scales[static_cast<std::size_t>(i)] = top > 0.0f ? top / kProbOffset : 1.0f;
  }
  Fp8Quantization how = whole(r, 1, skv);
  const Fp8Operand pq = quantize_fp8(p, rows, skv, skv, false, how, scales, "attention probs");
  fp8_gemm(pq, h.vt, context, ldc, r.accumulate);
}

}  // namespace teo::detail
