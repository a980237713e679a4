#include "teo/train/optim.hpp"

#include <algorithm>
#include <cmath>

namespace teo::train {

double learning_rate(const OptimOptions& o, index_t step) {
  const double n = static_cast<double>(std::max<index_t>(step, 1));
  const double w = static_cast<double>(std::max<index_t>(o.warmup_steps, 1));
  return o.lr * std::min(n / w, std::sqrt(w / n));
}

template <class Real>
double global_norm(const Params<Real>& grads) {
  double sum = 0;
  grads.visit([&](const std::string&, const Tensor<Real>& g) {
    for (index_t i = 0; i < g.numel(); ++i)
      sum += static_cast<double>(g[i]) * static_cast<double>(g[i]);
  });
  return std::sqrt(sum);
}

template <class Real>
void clip_by_norm(Params<Real>& grads, double norm, double max_norm) {
  if (max_norm <= 0) return;
  const Real coef = static_cast<Real>(std::min(max_norm / (norm + 1e-6), 1.0));
  grads.visit([&](const std::string&, Tensor<Real>& g) {
    for (index_t i = 0; i < g.numel(); ++i) g[i] *= coef;
  });
}

template <class Real>
AdamW<Real> AdamW<Real>::zeros(const ModelConfig& cfg) {
  return AdamW{Params<Real>::zeros(cfg), Params<Real>::zeros(cfg), 0};
}

template <class Real>
void AdamW<Real>::update(Params<Real>& params, const Params<Real>& grads, const OptimOptions& o,
                         double lr) {
  ++step;
  std::vector<Tensor<Real>*> ps, ms, vs;
  std::vector<const Tensor<Real>*> gs;
  params.visit([&](const std::string&, Tensor<Real>& t) { ps.push_back(&t); });
  m.visit([&](const std::string&, Tensor<Real>& t) { ms.push_back(&t); });
  v.visit([&](const std::string&, Tensor<Real>& t) { vs.push_back(&t); });
  grads.visit([&](const std::string&, const Tensor<Real>& t) { gs.push_back(&t); });
  const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(o.beta2, static_cast<double>(step));
  const Real step_size = static_cast<Real>(lr / bc1);
  const Real bc2_sqrt = static_cast<Real>(std::sqrt(bc2));
  const Real b1 = static_cast<Real>(o.beta1), b2 = static_cast<Real>(o.beta2);
  const Real one_b1 = static_cast<Real>(1.0 - o.beta1), one_b2 = static_cast<Real>(1.0 - o.beta2);
  const Real eps = static_cast<Real>(o.adam_eps);
  for (std::size_t k = 0; k < ps.size(); ++k) {
    Tensor<Real>& p = *ps[k];
    const Real decay = decays(p) ? static_cast<Real>(1.0 - lr * o.weight_decay) : Real(1);
    for (index_t i = 0; i < p.numel(); ++i) {
      const Real g = (*gs[k])[i];
      Real& mi = (*ms[k])[i];
      Real& vi = (*vs[k])[i];
      p[i] *= decay;
      mi = mi * b1 + g * one_b1;
      vi = vi * b2 + (g * g) * one_b2;
      const Real denom = std::sqrt(vi) / bc2_sqrt + eps;
      p[i] += -step_size * (mi / denom);
    }
  }
}

double ema_decay(double decay, index_t step) {
  const double n = static_cast<double>(step);
  return std::min(decay, (1.0 + n) / (10.0 + n));
}

template <class Real>
void ema_update(Params<Real>& avg, const Params<Real>& params, double decay) {
  const Real rate = static_cast<Real>(1.0 - decay);
  for_each_pair(avg, params, "averaged weights", [&](Tensor<Real>& a, const Tensor<Real>& p) {
    for (index_t i = 0; i < a.numel(); ++i) a[i] += rate * (p[i] - a[i]);
  });
}

template double global_norm(const Params<float>&);
template double global_norm(const Params<double>&);
template void clip_by_norm(Params<float>&, double, double);
template void clip_by_norm(Params<double>&, double, double);
template struct AdamW<float>;
template struct AdamW<double>;
template void ema_update(Params<float>&, const Params<float>&, double);
template void ema_update(Params<double>&, const Params<double>&, double);

}  // namespace teo::train
