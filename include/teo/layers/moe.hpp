// A mixture-of-experts block's routed experts (docs/semantics.md, 19.2): the router's choice, the
// (token, slot) pairs in the grouped layout the fused kernels use, each expert's gated FFN over
// its rows through teo's GEMM, the combine, and the exact backward of all of it, the router's
// gradient included. Shared experts are the dense FFN beside it (the caller's).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "teo/config.hpp"
#include "teo/errors.hpp"
#include "teo/layers/moe_router.hpp"

namespace teo {

struct MoeSpec {
  RouterSpec router;
  ExpertKind kind = ExpertKind::swiglu;
  index_t d_model = 0, d_ff = 0;  // D, and each expert's F (moe_d_ff)
  double alpha = 1.702, limit = 7.0;
  // Where the routing weight multiplies: the expert's output (everyone), or its input (Llama 4,
  // which is not the same through the nonlinear expert).
  bool weight_at_input = false;
  // ConfigError naming the key.
  void validate() const;
};

// The block's spec of a model's MoE keys (ffn "moe"), for d_model D.
MoeSpec moe_spec(const MoeConfig& m, index_t d_model);

// The block's parameters, not owned. Shapes: gate (E, D), gate_bias (E), correction (E);
// w_gate, w_up (E, F, D), w_down (E, D, F); b_gate, b_up (E, F), b_down (E, D). Every bias and
// the correction may be null. Expert weights are read through expert() only, so that a
// quantized format can plug in there.
template <class Real>
struct MoeWeights {
  const Real *gate = nullptr, *gate_bias = nullptr, *correction = nullptr;
  const Real *w_gate = nullptr, *w_up = nullptr, *w_down = nullptr;
  const Real *b_gate = nullptr, *b_up = nullptr, *b_down = nullptr;
};

// Their gradients, accumulated (+=), each the shape of its weight; null where the weight is.
template <class Real>
struct MoeGrads {
  Real *gate = nullptr, *gate_bias = nullptr;
  Real *w_gate = nullptr, *w_up = nullptr, *w_down = nullptr;
  Real *b_gate = nullptr, *b_up = nullptr, *b_down = nullptr;
};

// The forward's results, in the grouped layout: the N = T k (token, slot) pairs sorted by expert,
// stably by their index t k + j.
template <class Real>
struct MoeActs {
  std::vector<Real> logits;  // (T, E)
  Routing<Real> routing;
  std::vector<std::int32_t> offsets;      // (E + 1): expert e's rows are [offsets[e], offsets[e+1])
  std::vector<std::int32_t> source_rows;  // (N): the pair t k + j each row holds
  std::vector<Real> expert_in;            // (N, D): x[t], times its weight with weight_at_input
  std::vector<Real> gate_pre, up_pre;     // (N, F): the two projections, biases added
  std::vector<Real> hidden;               // (N, F): the expert's middle, h
  std::vector<Real> expert_out;           // (N, D): h W_down^T + b_down, before any weight
  std::vector<Real> y;                    // (T, D)
};

// Where a backend stores a stage, a reduced-precision emulation rounds it: store(stage, data, n)
// is called on each stage once it is complete ("logits", "topk_weights", "expert_in", "gate_pre",
// "up_pre", "expert_hidden", "expert_out", "y"; backward: "grad.expert_out",
// "grad.expert_hidden", "grad.gate_pre", "grad.up_pre", "grad.expert_in", "grad.logits"), and
// the stages after it read what it left. Empty: nothing is rounded.
template <class Real>
using MoeStore = std::function<void(const char* stage, Real* data, index_t n)>;

// y[t] = sum over slots j = 0, 1, ..., k-1, in that order, of w_tj * expert_out[row of (t, j)]
// (weight at the output), or of expert_out[row of (t, j)] (at the input). replay (T, k) or null:
// the routing given (router::route's replay).
template <class Real>
void moe_forward(const MoeSpec& spec, const MoeWeights<Real>& w, const Real* x, index_t tokens,
                 const std::int32_t* replay, MoeActs<Real>& acts, const MoeStore<Real>& store = {});

// dx (T, D), written: the gradient of sum(dy * y) + aux_coef * aux + z_coef * z, with aux and z
// the router's load-balancing and z losses; the parameters' into g. Each expert's weight
// gradients sum its rows in row order; an expert with no row has zero gradients. dlogits_extra
// (T, E) or null: a gradient of the logits from elsewhere (a model's losses over all its MoE
// layers at once), added to the router's before the gate's backward. The stage
// "grad.topk_weights" (T, k), the routing weights' gradient, is passed to store too, for a
// caller that keeps it; the op and the model do not round it (it stays in Real).
template <class Real>
void moe_backward(const MoeSpec& spec, const MoeWeights<Real>& w, const Real* x, index_t tokens,
                  const MoeActs<Real>& acts, const Real* dy, Real aux_coef, Real z_coef, Real* dx,
                  MoeGrads<Real>& g, const MoeStore<Real>& store = {},
                  const Real* dlogits_extra = nullptr);

}  // namespace teo
