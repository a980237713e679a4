#include "teo/layers/cross_entropy.hpp"

#include <algorithm>
#include <cmath>

namespace teo {

std::vector<std::int64_t> next_token_targets(const std::int64_t* tokens,
                                             const std::int64_t* lengths, index_t batch,
                                             index_t seq_len) {
  std::vector<std::int64_t> y(static_cast<std::size_t>(batch * seq_len), kIgnoreIndex);
  for (index_t b = 0; b < batch; ++b) {
    for (index_t t = 0; t + 1 < lengths[b]; ++t)
      y[static_cast<std::size_t>(b * seq_len + t)] = tokens[b * seq_len + t + 1];
  }
  return y;
}

template <class Real>
Real cross_entropy_forward(Real* probs, const Real* logits, const std::int64_t* labels,
                           index_t batch, index_t classes, Real smoothing) {
  Real total = 0;
  index_t counted = 0;
  const Real on_target = Real(1) - smoothing;
  const Real uniform = smoothing / static_cast<Real>(classes);
  for (index_t b = 0; b < batch; ++b) {
    const Real* z = logits + b * classes;  // (C)
    Real* p = probs + b * classes;         // (C)
    Real mx = z[0];
    for (index_t c = 1; c < classes; ++c) mx = std::max(mx, z[c]);
    Real sum = 0;
    for (index_t c = 0; c < classes; ++c) {
      p[c] = std::exp(z[c] - mx);
      sum += p[c];
    }
    const Real log_sum = std::log(sum);
    const Real inv = Real(1) / sum;
    Real sum_logp = 0;
    for (index_t c = 0; c < classes; ++c) {
      p[c] *= inv;
      sum_logp += z[c] - mx - log_sum;
    }
    if (labels[b] == kIgnoreIndex) continue;
    const Real logp_y = z[labels[b]] - mx - log_sum;
    total += -on_target * logp_y - uniform * sum_logp;
    ++counted;
  }
  return counted == 0 ? Real(0) : total / static_cast<Real>(counted);
}

template <class Real>
void cross_entropy_backward(Real* dlogits, const Real* probs, const std::int64_t* labels,
                            index_t batch, index_t classes, Real smoothing, Real dloss) {
  // in the forward pass this was: loss = mean_b [-(1 - eps) logp[y] - eps / C sum_c logp[c]]
  const Real on_target = Real(1) - smoothing;
  const Real uniform = smoothing / static_cast<Real>(classes);
  index_t counted = 0;
  for (index_t b = 0; b < batch; ++b) counted += labels[b] != kIgnoreIndex;
  const Real scale = counted == 0 ? Real(0) : dloss / static_cast<Real>(counted);
  for (index_t b = 0; b < batch; ++b) {
    if (labels[b] == kIgnoreIndex) continue;
    for (index_t c = 0; c < classes; ++c) {
      const Real target = (c == labels[b] ? on_target : Real(0)) + uniform;
      dlogits[b * classes + c] += (probs[b * classes + c] - target) * scale;
    }
  }
}

#define TEO_INSTANTIATE(Real)                                                                  \
  template Real cross_entropy_forward<Real>(Real*, const Real*, const std::int64_t*, index_t,  \
                                            index_t, Real);                                    \
  template void cross_entropy_backward<Real>(Real*, const Real*, const std::int64_t*, index_t, \
                                             index_t, Real, Real);
TEO_INSTANTIATE(float)
TEO_INSTANTIATE(double)

}  // namespace teo
