// Softmax cross-entropy averaged over the batch, with PyTorch's label smoothing.
#pragma once

#include <cstdint>
#include <vector>

#include "teo/errors.hpp"

namespace teo {

// A label that counts for nothing (PyTorch's ignore_index default): its row's probs are still
// written, it adds nothing to the loss or the count, and its gradient is 0.
inline constexpr std::int64_t kIgnoreIndex = -100;

// A decoder's targets (B * S) for tokens (B, S): position t of sequence b predicts its token t + 1
// when t + 1 < lengths[b]; every other position (the last real one, the padding) is kIgnoreIndex.
std::vector<std::int64_t> next_token_targets(const std::int64_t* tokens,
                                             const std::int64_t* lengths, index_t batch,
                                             index_t seq_len);

// With eps = smoothing and C classes, per example b:
//   logp = log_softmax(logits[b]);  loss_b = -(1 - eps) logp[y_b] - (eps / C) sum_c logp[c]
// Returns the mean of loss_b over the rows whose label is not kIgnoreIndex, 0 when there are none.
// probs (B, C) are saved.
template <class Real>
Real cross_entropy_forward(Real* probs, const Real* logits, const std::int64_t* labels,
                           index_t batch, index_t classes, Real smoothing);

// Accumulates dlogits[b, c] += (probs[b, c] - (1 - eps) [c == y_b] - eps / C) * (dloss / n) over
// the n counted rows; an ignored row's dlogits are not written.
template <class Real>
void cross_entropy_backward(Real* dlogits, const Real* probs, const std::int64_t* labels,
                            index_t batch, index_t classes, Real smoothing, Real dloss);

}  // namespace teo
