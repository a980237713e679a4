// The shared experts of a mixture-of-experts block (docs/semantics.md, 19.3): one SwiGLU MLP of
// width Fs without biases on every token, always applied, times Qwen2-MoE's sigmoid gate when it
// has one; forward and exact backward. The moe op and the model's MoE layers both run it.
#pragma once

#include <vector>

#include "teo/layers/moe.hpp"

namespace teo {

// Not owned: gate, up (Fs, D), down (D, Fs), expert_gate (1, D) or null (no gate).
template <class Real>
struct SharedExpertWeights {
  const Real *gate = nullptr, *up = nullptr, *down = nullptr, *expert_gate = nullptr;
};

// Their gradients, accumulated (+=); expert_gate null where the weight is.
template <class Real>
struct SharedExpertGrads {
  Real *gate = nullptr, *up = nullptr, *down = nullptr, *expert_gate = nullptr;
};

// What the forward keeps: the two projections and the middle (T, Fs), the output before the gate
// (raw, (T, D)), the gate's sigmoid (T; empty without a gate), and the output (T, D).
template <class Real>
struct SharedExpertActs {
  std::vector<Real> gate, up, hidden, raw, g, out;
};

// out = sigmoid(x . w_g) * raw (or raw), raw = (silu(x W_gate^T) * x W_up^T) W_down^T, for T rows
// of x (T, D). store(stage, data, n) is called on each stage once it is complete ("shared.gate",
// "shared.up", "shared.hidden", "shared.raw", "shared.expert_gate", "shared_out"), as
// moe_forward's stages are.
template <class Real>
void shared_experts_forward(const SharedExpertWeights<Real>& w, const Real* x, index_t tokens,
                            index_t d_model, index_t d_ff, SharedExpertActs<Real>& a,
                            const MoeStore<Real>& store = {});

// Adds the gradient of sum(dy * out) to dx (T, D) and the weights' to g; stages
// "grad.shared.expert_gate", "grad.shared.raw" (with a gate), "grad.shared.hidden",
// "grad.shared.gate", "grad.shared.up".
template <class Real>
void shared_experts_backward(const SharedExpertWeights<Real>& w, const Real* x, index_t tokens,
                             index_t d_model, index_t d_ff, const SharedExpertActs<Real>& a,
                             const Real* dy, Real* dx, SharedExpertGrads<Real>& g,
                             const MoeStore<Real>& store = {});

}  // namespace teo
