// Token embedding: out[t, :] = scale * weight[tokens[t], :].
#pragma once

#include <cstdint>

#include "teo/errors.hpp"

namespace teo {

// out (n, D); tokens (n) already validated to lie in [0, V); weight (V, D).
template <class Real>
void embedding_forward(Real* out, const std::int64_t* tokens, const Real* weight, index_t n,
                       index_t d, Real scale);

// Accumulates: dweight[tokens[t], :] += scale * dout[t, :], in increasing t, except for tokens
// equal to padding_idx, whose row gets no gradient (PyTorch's nn.Embedding(padding_idx); -1:
// none).
template <class Real>
void embedding_backward(Real* dweight, const Real* dout, const std::int64_t* tokens, index_t n,
                        index_t d, Real scale, std::int64_t padding_idx = -1);

}  // namespace teo
