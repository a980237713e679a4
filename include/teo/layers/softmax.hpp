// Softmax over the last dimension with a visible prefix per row: the attention probabilities.
#pragma once

#include "teo/errors.hpp"

namespace teo {

// y, x (rows, cols); visible (rows) or null (every entry visible). Entries j >= visible[r] are
// masked: x there is ignored (-inf by convention) and y is exactly 0.
//   y[r, j] = exp(x[r, j] - m) / sum over visible j' of exp(x[r, j'] - m), m = max over visible;
// a row with no visible entry is all 0, never NaN.
template <class Real>
void softmax_forward(Real* y, const Real* x, const index_t* visible, index_t rows, index_t cols);

// Writes dx (rows, cols) without reading it: dx = y * (dy - sum_j y * dy), exactly 0 where y is
// 0 (masked entries among them).
template <class Real>
void softmax_backward(Real* dx, const Real* dy, const Real* y, index_t rows, index_t cols);

}  // namespace teo
