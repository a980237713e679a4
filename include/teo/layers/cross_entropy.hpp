// Softmax cross-entropy averaged over the batch, with PyTorch's label smoothing.
#pragma once

#include <cstdint>

#include "teo/errors.hpp"

namespace teo {

// With eps = smoothing and C classes, per example b:
//   logp = log_softmax(logits[b]);  loss_b = -(1 - eps) logp[y_b] - (eps / C) sum_c logp[c]
// Returns the mean of loss_b over the batch, 0 for an empty batch. probs (B, C) are saved.
template <class Real>
Real cross_entropy_forward(Real* probs, const Real* logits, const std::int64_t* labels,
                           index_t batch, index_t classes, Real smoothing);

// Accumulates dlogits[b, c] += dloss * (probs[b, c] - (1 - eps) [c == y_b] - eps / C) / B.
template <class Real>
void cross_entropy_backward(Real* dlogits, const Real* probs, const std::int64_t* labels,
                            index_t batch, index_t classes, Real smoothing, Real dloss);

}  // namespace teo
