// Pooling over the sequence, restricted to real (non-padded) tokens.
#pragma once

#include <cstdint>

#include "teo/config.hpp"

namespace teo {

// out (B, D); in (B, S, D); lengths (B); argmax (B, D) records, for max pooling, the position of
// the first maximum (-1 when the sequence is empty); it may be null for mean and cls.
//   mean: sum over s < len of in[b, s, :] / len; 0 when len == 0.
//   cls:  in[b, 0, :]; 0 when len == 0.
//   max:  max over s < len; ties go to the smallest s; 0 when len == 0.
template <class Real>
void pooling_forward(Real* out, std::int64_t* argmax, const Real* in, const std::int64_t* lengths,
                     index_t batch, index_t seq_len, index_t d, Pooling kind);

// Accumulates din (B, S, D) from dout (B, D). Padded positions receive exactly 0.
template <class Real>
void pooling_backward(Real* din, const Real* dout, const std::int64_t* argmax,
                      const std::int64_t* lengths, index_t batch, index_t seq_len, index_t d,
                      Pooling kind);

}  // namespace teo
