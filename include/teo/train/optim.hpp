// Optimisation with PyTorch's semantics: AdamW, the warmup + inverse-sqrt schedule, global-norm
// gradient clipping, and an exponential moving average of the weights.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "teo/model.hpp"

namespace teo::train {

struct OptimOptions {
  double lr = 4e-3;  // the peak learning rate
  index_t warmup_steps = 300;
  double weight_decay = 0.1;  // decoupled; matrices only
  double beta1 = 0.9, beta2 = 0.999, adam_eps = 1e-8;
  double clip_norm = 1.0;  // 0: no clipping
};

// lr at optimizer step n (1-based): lr * min(n / warmup, sqrt(warmup / n)).
double learning_rate(const OptimOptions& o, index_t step);

// Whether AdamW decays a parameter: every matrix (2-D), never a bias or a norm (1-D).
template <class Real>
bool decays(const Tensor<Real>& t) {
  return t.shape().rank() >= 2;
}

// The global L2 norm of every gradient (accumulated in double, parameters in canonical order).
template <class Real>
double global_norm(const Params<Real>& grads);

// torch.nn.utils.clip_grad_norm_: coef = min(max_norm / (norm + 1e-6), 1); grads *= coef.
template <class Real>
void clip_by_norm(Params<Real>& grads, double norm, double max_norm);

// torch.optim.AdamW, one step: p *= 1 - lr*wd (matrices only); m = b1 m + (1-b1) g;
// v = b2 v + (1-b2) g^2; p -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
template <class Real>
struct AdamW {
  Params<Real> m, v;
  index_t step = 0;
  static AdamW zeros(const ModelConfig& cfg);
  void update(Params<Real>& params, const Params<Real>& grads, const OptimOptions& o, double lr);
};

// Calls f(a_tensor, b_tensor) for every parameter of `a` and the same-named one of `b`, in
// canonical order; ShapeError naming `what` when the two do not have the same tensors and shapes.
template <class Real, class F>
void for_each_pair(Params<Real>& a, const Params<Real>& b, const std::string& what, F&& f) {
  std::vector<const Tensor<Real>*> bs;
  b.visit([&](const std::string&, const Tensor<Real>& t) { bs.push_back(&t); });
  std::vector<std::pair<std::string, Tensor<Real>*>> as;
  a.visit([&](const std::string& name, Tensor<Real>& t) { as.emplace_back(name, &t); });
  if (as.size() != bs.size()) {
    throw ShapeError(what + ": " + std::to_string(as.size()) + " tensors against " +
                     std::to_string(bs.size()));
  }
  for (std::size_t k = 0; k < as.size(); ++k) {
    if (!(as[k].second->shape() == bs[k]->shape())) {
      throw ShapeError(what + ": " + as[k].first + " has shape " + as[k].second->shape().str() +
                       " against " + bs[k]->shape().str());
    }
  }
  for (std::size_t k = 0; k < as.size(); ++k) f(*as[k].second, *bs[k]);
}

// An exponential moving average of the parameters, updated after every optimizer step and used
// for evaluation: it averages out the step-to-step noise that a learning rate decaying only as
// 1/sqrt(step) leaves in the last iterate. The decay at optimizer step n (1-based) is
// min(decay, (1 + n) / (10 + n)), so the average forgets the initialisation quickly.
double ema_decay(double decay, index_t step);

// avg += (1 - decay) * (params - avg), element by element, in Real.
template <class Real>
void ema_update(Params<Real>& avg, const Params<Real>& params, double decay);

}  // namespace teo::train
