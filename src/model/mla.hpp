// Internal: multi-head latent attention's projections (DeepSeek-V2/V3; docs/semantics.md, 14.12),
// from a layer's attention input to q, k, v and their rotations, and back (mla.cpp). The
// attention itself, the output projection and the residual are the layer's (layer.cpp).
#pragma once

#include <cstdint>
#include <string_view>

#include "model/pass.hpp"

namespace teo::detail {

// L.q_a, L.q_a_norm (q_lora_rank), L.q, L.kv_a, L.kv_norm, L.k, L.v, L.q_rot and L.k_rot (and
// the norms' rstd) from attn_in (B, S, D), each written whole:
//   q_a = attn_in Wqa^T;  q = split(RMSNorm(q_a) Wqb^T)          (without q_lora_rank: attn_in
//   Wq^T) kv_a = attn_in Wkva^T = [c (Rkv) | k_pe (Dr)];  kv_norm = RMSNorm(c) [k_nope | v] per
//   head = split(kv_norm Wkvb^T);  k = [k_nope | k_pe] per head q_rot, k_rot = q and k with their
//   last Dr rotated (k_pe once, shared by every head)
// Row (b, s) sits at position s of the tables cos and sin (S, Dr / 2), or with pos (B) (a decode
// step, S = 1) at pos[b].
template <class Real>
void mla_forward(const ModelConfig& cfg, const LayerParams<Real>& P, LayerActs<Real>& L,
                 const Real* attn_in, const Dims& d, const Real* cos, const Real* sin,
                 const std::int64_t* pos, std::string_view name, const Emulation<Real>& store);

// The full pass's: the tables of positions 0 .. S - 1.
template <class Real>
void mla_forward(const ModelConfig& cfg, const LayerParams<Real>& P, LayerActs<Real>& L,
                 const Real* attn_in, const Dims& d, std::string_view name,
                 const Emulation<Real>& store);

// From dL.q_rot, dL.k_rot and dL.v (attention_backward's) back to attn_in: overwrites dL.q, dL.k,
// dL.kv_a, dL.kv_norm, dL.q_a, dL.q_a_norm; accumulates the MLA weights' gradients into G; and
// writes dattn_in (B, S, D), overwritten under pre-norm (norm1 its only reader) and accumulated
// into under post-norm (dx, which the first residual wrote).
template <class Real>
void mla_backward(const ModelConfig& cfg, const LayerParams<Real>& P, const LayerActs<Real>& L,
                  LayerParams<Real>& G, LayerActs<Real>& dL, Real* dattn_in, const Real* attn_in,
                  const Dims& d, std::string_view name, const Emulation<Real>& store);

}  // namespace teo::detail
