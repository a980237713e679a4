// A mixture-of-experts block's routed experts (include/teo/layers/moe.hpp). The permutation, the
// per-token combine and the clamped activation are plain loops in a fixed order; each expert's
// three products are teo's linear layers over its contiguous rows. The same bits on every thread
// count and ISA.
#include "teo/layers/moe.hpp"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>

#include "kernels/parallel.hpp"
#include "layers/logistic.hpp"

#include "teo/layers/feed_forward.hpp"
#include "teo/layers/linear.hpp"

namespace teo {

void MoeSpec::validate() const {
  router.validate();
  detail::validate_expert_keys(kind, d_model, d_ff, alpha, limit);
}

MoeSpec moe_spec(const MoeConfig& m, index_t d_model) {
  MoeSpec s;
  s.router.experts = m.num_experts;
  s.router.top_k = m.num_experts_per_tok;
  s.router.scoring = m.router_scoring;
  s.router.order = m.router_order;
  s.router.groups = m.router_groups;
  s.router.topk_groups = m.topk_groups;
  s.router.group_score = m.group_score;
  s.router.norm_topk_prob = m.norm_topk_prob;
  s.router.routed_scaling_factor = m.routed_scaling_factor;
  s.kind = m.expert_kind;
  s.d_model = d_model;
  s.d_ff = m.moe_d_ff;
  s.alpha = m.swiglu_alpha;
  s.limit = m.swiglu_limit;
  s.weight_at_input = m.weight_at_input;
  return s;
}

namespace {

std::size_t at(index_t i) {
  return static_cast<std::size_t>(i);
}

// Expert e's slice of a (E, rows, cols) weight or gradient, or null: the one place expert weights
// are read.
template <class P>
P* expert(P* w, index_t e, index_t rows, index_t cols) {
  return w ? w + e * rows * cols : nullptr;
}

using detail::sigmoid;

// The inverse of source_rows: the row that holds each pair.
std::vector<index_t> rows_of_pairs(const std::vector<std::int32_t>& source_rows) {
  std::vector<index_t> row_of(source_rows.size());
  for (std::size_t r = 0; r < source_rows.size(); ++r)
    row_of[at(source_rows[r])] = static_cast<index_t>(r);
  return row_of;
}

}  // namespace

template <class Real>
void moe_forward(const MoeSpec& spec, const MoeWeights<Real>& w, const Real* x, index_t tokens,
                 const std::int32_t* replay, MoeActs<Real>& a, const MoeStore<Real>& store) {
  const auto stored = [&](const char* stage, std::vector<Real>& v) {
    if (store) store(stage, v.data(), static_cast<index_t>(v.size()));
  };
  spec.validate();
  const index_t E = spec.router.experts, k = spec.router.top_k, D = spec.d_model, F = spec.d_ff;
  const index_t N = tokens * k;
  a.logits.assign(at(tokens * E), Real(0));
  {
    // under fp8 the gate keeps bf16, as DeepSeek-V3's fp8 recipe keeps its gating
    std::optional<detail::EmulationScope> gate;
    if (detail::emulation() == Precision::fp8) gate.emplace(Precision::bf16);
    linear_forward(a.logits.data(), x, w.gate, w.gate_bias, tokens, D, E);
  }
  stored("logits", a.logits);
  route(spec.router, a.logits.data(), w.correction, replay, tokens, a.routing);
  stored("topk_weights", a.routing.weights);
  // the grouped layout: a counting sort by expert, stable in the pair index
  a.offsets.assign(at(E + 1), 0);
  for (index_t p = 0; p < N; ++p) ++a.offsets[at(a.routing.ids[at(p)] + 1)];
  for (index_t e = 0; e < E; ++e) a.offsets[at(e + 1)] += a.offsets[at(e)];
  a.source_rows.assign(at(N), 0);
  std::vector<std::int32_t> next(a.offsets.begin(), a.offsets.end() - 1);
  for (index_t p = 0; p < N; ++p)
    a.source_rows[at(next[at(a.routing.ids[at(p)])]++)] = static_cast<std::int32_t>(p);
  a.expert_in.assign(at(N * D), Real(0));
  for (index_t r = 0; r < N; ++r) {
    const index_t p = a.source_rows[at(r)], t = p / k;
    const Real scale = spec.weight_at_input ? a.routing.weights[at(p)] : Real(1);
    for (index_t d = 0; d < D; ++d)
      a.expert_in[at(r * D + d)] = spec.weight_at_input ? scale * x[t * D + d] : x[t * D + d];
  }
  stored("expert_in", a.expert_in);
  a.gate_pre.assign(at(N * F), Real(0));
  a.up_pre.assign(at(N * F), Real(0));
  a.hidden.assign(at(N * F), Real(0));
  a.expert_out.assign(at(N * D), Real(0));
  for (index_t e = 0; e < E; ++e) {
    const index_t r0 = a.offsets[at(e)], n = a.offsets[at(e + 1)] - r0;
    if (n == 0) continue;
    const Real* in = a.expert_in.data() + r0 * D;
    Real* g = a.gate_pre.data() + r0 * F;
    Real* u = a.up_pre.data() + r0 * F;
    Real* h = a.hidden.data() + r0 * F;
    linear_forward(g, in, expert(w.w_gate, e, F, D), expert(w.b_gate, e, 1, F), n, D, F);
    linear_forward(u, in, expert(w.w_up, e, F, D), expert(w.b_up, e, 1, F), n, D, F);
    if (store) {
      store("gate_pre", g, n * F);
      store("up_pre", u, n * F);
    }
    if (spec.kind == ExpertKind::swiglu) {
      gated_forward(h, g, u, n * F, Activation::silu);
    } else {
      const auto alpha = static_cast<Real>(spec.alpha), limit = static_cast<Real>(spec.limit);
      for (index_t i = 0; i < n * F; ++i) {
        const Real gc = std::min(g[i], limit), uc = std::clamp(u[i], -limit, limit);
        h[i] = (uc + Real(1)) * (gc * sigmoid(alpha * gc));
      }
    }
    if (store) store("expert_hidden", h, n * F);
    linear_forward(a.expert_out.data() + r0 * D, h, expert(w.w_down, e, D, F),
                   expert(w.b_down, e, 1, D), n, F, D);
    if (store) store("expert_out", a.expert_out.data() + r0 * D, n * D);
  }
  // the combine: each token's slots in order
  const std::vector<index_t> row_of = rows_of_pairs(a.source_rows);
  a.y.assign(at(tokens * D), Real(0));
  for (index_t t = 0; t < tokens; ++t) {
    for (index_t j = 0; j < k; ++j) {
      const index_t p = t * k + j, r = row_of[at(p)];
      const Real wt = spec.weight_at_input ? Real(1) : a.routing.weights[at(p)];
      for (index_t d = 0; d < D; ++d) {
        const Real o = a.expert_out[at(r * D + d)];
        a.y[at(t * D + d)] += spec.weight_at_input ? o : wt * o;
      }
    }
  }
  stored("y", a.y);
}

template <class Real>
void moe_backward(const MoeSpec& spec, const MoeWeights<Real>& w, const Real* x, index_t tokens,
                  const MoeActs<Real>& a, const Real* dy, Real aux_coef, Real z_coef, Real* dx,
                  MoeGrads<Real>& g, const MoeStore<Real>& store, const Real* dlogits_extra) {
  const auto stored = [&](const char* stage, std::vector<Real>& v) {
    if (store) store(stage, v.data(), static_cast<index_t>(v.size()));
  };
  const index_t E = spec.router.experts, k = spec.router.top_k, D = spec.d_model, F = spec.d_ff;
  const index_t N = tokens * k;
  std::vector<Real> dout(at(N * D)), dweights(at(N), Real(0));
  // through the combine
  for (index_t r = 0; r < N; ++r) {
    const index_t p = a.source_rows[at(r)], t = p / k;
    const Real wt = a.routing.weights[at(p)];
    Real dot = 0;
    for (index_t d = 0; d < D; ++d) {
      const Real gy = dy[t * D + d];
      if (!spec.weight_at_input) dot += gy * a.expert_out[at(r * D + d)];
      dout[at(r * D + d)] = spec.weight_at_input ? gy : wt * gy;
    }
    if (!spec.weight_at_input) dweights[at(p)] = dot;
  }
  stored("grad.expert_out", dout);
  // through each expert
  std::vector<Real> din(at(N * D), Real(0)), dh(at(N * F)), dg(at(N * F)), du(at(N * F));
  for (index_t e = 0; e < E; ++e) {
    const index_t r0 = a.offsets[at(e)], n = a.offsets[at(e + 1)] - r0;
    if (n == 0) continue;  // its gradients stay 0
    const Real* in = a.expert_in.data() + r0 * D;
    const Real* gp = a.gate_pre.data() + r0 * F;
    const Real* up = a.up_pre.data() + r0 * F;
    Real* dhe = dh.data() + r0 * F;
    Real* dge = dg.data() + r0 * F;
    Real* due = du.data() + r0 * F;
    linear_backward(dhe, expert(g.w_down, e, D, F), expert(g.b_down, e, 1, D), dout.data() + r0 * D,
                    a.hidden.data() + r0 * F, expert(w.w_down, e, D, F), n, F, D,
                    GradWrite::overwrite);
    if (store) store("grad.expert_hidden", dhe, n * F);
    if (spec.kind == ExpertKind::swiglu) {
      gated_backward(dge, due, dhe, gp, up, n * F, Activation::silu);
    } else {
      const auto alpha = static_cast<Real>(spec.alpha), limit = static_cast<Real>(spec.limit);
      for (index_t i = 0; i < n * F; ++i) {
        const Real gc = std::min(gp[i], limit), uc = std::clamp(up[i], -limit, limit);
        const Real s = sigmoid(alpha * gc), glu = gc * s;
        const Real dglu = dhe[i] * (uc + Real(1));
        // the clamps pass the gradient where the value is within them, as torch.clamp does
        dge[i] = gp[i] <= limit ? dglu * (s + alpha * gc * s * (Real(1) - s)) : Real(0);
        due[i] = up[i] >= -limit && up[i] <= limit ? dhe[i] * glu : Real(0);
      }
    }
    if (store) {
      store("grad.gate_pre", dge, n * F);
      store("grad.up_pre", due, n * F);
    }
    Real* dine = din.data() + r0 * D;
    linear_backward(dine, expert(g.w_gate, e, F, D), expert(g.b_gate, e, 1, F), dge, in,
                    expert(w.w_gate, e, F, D), n, D, F, GradWrite::overwrite);
    linear_backward(dine, expert(g.w_up, e, F, D), expert(g.b_up, e, 1, F), due, in,
                    expert(w.w_up, e, F, D), n, D, F, GradWrite::accumulate);
    if (store) store("grad.expert_in", dine, n * D);
  }
  // back to the tokens, slots in order; with the weight at the input, its gradient too
  const std::vector<index_t> row_of = rows_of_pairs(a.source_rows);
  std::fill(dx, dx + tokens * D, Real(0));
  for (index_t t = 0; t < tokens; ++t) {
    for (index_t j = 0; j < k; ++j) {
      const index_t p = t * k + j, r = row_of[at(p)];
      const Real wt = a.routing.weights[at(p)];
      Real dot = 0;
      for (index_t d = 0; d < D; ++d) {
        const Real gi = din[at(r * D + d)];
        if (spec.weight_at_input) {
          dot += gi * x[t * D + d];
          dx[t * D + d] += wt * gi;
        } else {
          dx[t * D + d] += gi;
        }
      }
      if (spec.weight_at_input) dweights[at(p)] = dot;
    }
  }
  // through the router and its losses to the logits, then the gate
  stored("grad.topk_weights", dweights);
  std::vector<Real> dlogits(at(tokens * E));
  route_backward(spec.router, a.routing, dweights.data(), tokens, dlogits.data());
  if (dlogits_extra)
    for (index_t i = 0; i < tokens * E; ++i) dlogits[at(i)] += dlogits_extra[i];
  if (aux_coef != Real(0)) {
    load_balancing_loss_backward(a.logits.data(), a.routing.ids.data(), tokens, E, k, aux_coef,
                                 dlogits.data());
  }
  if (z_coef != Real(0)) router_z_loss_backward(a.logits.data(), tokens, E, z_coef, dlogits.data());
  stored("grad.logits", dlogits);
  std::optional<detail::EmulationScope> gate;
  if (detail::emulation() == Precision::fp8) gate.emplace(Precision::bf16);
  linear_backward(dx, g.gate, g.gate_bias, dlogits.data(), x, w.gate, tokens, D, E,
                  GradWrite::accumulate);
}

#define TEO_MOE(Real)                                                                             \
  template void moe_forward<Real>(const MoeSpec&, const MoeWeights<Real>&, const Real*, index_t,  \
                                  const std::int32_t*, MoeActs<Real>&, const MoeStore<Real>&);    \
  template void moe_backward<Real>(const MoeSpec&, const MoeWeights<Real>&, const Real*, index_t, \
                                   const MoeActs<Real>&, const Real*, Real, Real, Real*,          \
                                   MoeGrads<Real>&, const MoeStore<Real>&, const Real*);
TEO_MOE(float)
TEO_MOE(double)
#undef TEO_MOE

}  // namespace teo
