// The shared experts (include/teo/layers/shared_experts.hpp): teo's linear layers and the gated
// activation, then the per-token gate in plain loops, in a fixed order.
#include "teo/layers/shared_experts.hpp"

#include <algorithm>

#include "layers/logistic.hpp"
#include "teo/layers/feed_forward.hpp"
#include "teo/layers/linear.hpp"

namespace teo {

namespace {

std::size_t at(index_t i) {
  return static_cast<std::size_t>(i);
}

}  // namespace

template <class Real>
void shared_experts_forward(const SharedExpertWeights<Real>& w, const Real* x, index_t T, index_t D,
                            index_t Fs, SharedExpertActs<Real>& a, const MoeStore<Real>& store) {
  const auto stored = [&](const char* stage, std::vector<Real>& v) {
    if (store) store(stage, v.data(), static_cast<index_t>(v.size()));
  };
  const Real* none = nullptr;
  a.gate.assign(at(T * Fs), Real(0));
  a.up.assign(at(T * Fs), Real(0));
  a.hidden.assign(at(T * Fs), Real(0));
  a.raw.assign(at(T * D), Real(0));
  linear_forward(a.gate.data(), x, w.gate, none, T, D, Fs);
  linear_forward(a.up.data(), x, w.up, none, T, D, Fs);
  stored("shared.gate", a.gate);
  stored("shared.up", a.up);
  gated_forward(a.hidden.data(), a.gate.data(), a.up.data(), T * Fs, Activation::silu);
  stored("shared.hidden", a.hidden);
  linear_forward(a.raw.data(), a.hidden.data(), w.down, none, T, Fs, D);
  stored("shared.raw", a.raw);
  a.out = a.raw;
  a.g.clear();
  if (w.expert_gate) {
    a.g.assign(at(T), Real(0));
    linear_forward(a.g.data(), x, w.expert_gate, none, T, D, index_t{1});
    for (index_t t = 0; t < T; ++t) a.g[at(t)] = detail::sigmoid(a.g[at(t)]);
    stored("shared.expert_gate", a.g);
    for (index_t t = 0; t < T; ++t)
      for (index_t i = 0; i < D; ++i) a.out[at(t * D + i)] = a.g[at(t)] * a.raw[at(t * D + i)];
  }
  stored("shared_out", a.out);
}

template <class Real>
void shared_experts_backward(const SharedExpertWeights<Real>& w, const Real* x, index_t T,
                             index_t D, index_t Fs, const SharedExpertActs<Real>& a, const Real* dy,
                             Real* dx, SharedExpertGrads<Real>& g, const MoeStore<Real>& store) {
  const auto stored = [&](const char* stage, std::vector<Real>& v) {
    if (store) store(stage, v.data(), static_cast<index_t>(v.size()));
  };
  Real* none = nullptr;
  std::vector<Real> draw(dy, dy + T * D);
  if (w.expert_gate) {
    // out = g raw, g = sigmoid(x . w_g): d raw = g dy, d logit = (dy . raw) g (1 - g)
    std::vector<Real> dlogit(at(T));
    for (index_t t = 0; t < T; ++t) {
      Real dot = 0;
      const Real gt = a.g[at(t)];
      for (index_t i = 0; i < D; ++i) {
        dot += dy[t * D + i] * a.raw[at(t * D + i)];
        draw[at(t * D + i)] = gt * dy[t * D + i];
      }
      dlogit[at(t)] = dot * gt * (Real(1) - gt);
    }
    stored("grad.shared.expert_gate", dlogit);
    stored("grad.shared.raw", draw);
    linear_backward(dx, g.expert_gate, none, dlogit.data(), x, w.expert_gate, T, D, index_t{1},
                    GradWrite::accumulate);
  }
  std::vector<Real> dh(at(T * Fs)), dg(at(T * Fs)), du(at(T * Fs));
  linear_backward(dh.data(), g.down, none, draw.data(), a.hidden.data(), w.down, T, Fs, D,
                  GradWrite::overwrite);
  stored("grad.shared.hidden", dh);
  gated_backward(dg.data(), du.data(), dh.data(), a.gate.data(), a.up.data(), T * Fs,
                 Activation::silu);
  stored("grad.shared.gate", dg);
  stored("grad.shared.up", du);
  linear_backward(dx, g.gate, none, dg.data(), x, w.gate, T, D, Fs, GradWrite::accumulate);
  linear_backward(dx, g.up, none, du.data(), x, w.up, T, D, Fs, GradWrite::accumulate);
}

#define TEO_SHARED(Real)                                                                         \
  template void shared_experts_forward<Real>(const SharedExpertWeights<Real>&, const Real*,      \
                                             index_t, index_t, index_t, SharedExpertActs<Real>&, \
                                             const MoeStore<Real>&);                             \
  template void shared_experts_backward<Real>(const SharedExpertWeights<Real>&, const Real*,     \
                                              index_t, index_t, index_t,                         \
                                              const SharedExpertActs<Real>&, const Real*, Real*, \
                                              SharedExpertGrads<Real>&, const MoeStore<Real>&);
TEO_SHARED(float)
TEO_SHARED(double)
#undef TEO_SHARED

}  // namespace teo
