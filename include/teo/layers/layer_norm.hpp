// LayerNorm over the last dimension, biased variance, eps inside the square root.
#pragma once

#include "teo/errors.hpp"
#include "teo/kernels.hpp"

namespace teo {

// out, in (rows, cols); weight, bias (cols); mean, rstd (rows) are saved for backward.
//   mean = sum(x) / cols;  var = sum((x - mean)^2) / cols;  rstd = 1 / sqrt(var + eps)
//   out = (x - mean) * rstd * weight + bias
template <class Real>
void layer_norm_forward(Real* out, Real* mean, Real* rstd, const Real* in, const Real* weight,
                        const Real* bias, index_t rows, index_t cols, Real eps);

// Accumulates into din (rows, cols), dweight (cols), dbias (cols). din may be null. With
// din_write == overwrite, din = 0 + its term (din is never read); the weight and bias gradients
// always accumulate.
template <class Real>
void layer_norm_backward(Real* din, Real* dweight, Real* dbias, const Real* dout, const Real* in,
                         const Real* weight, const Real* mean, const Real* rstd, index_t rows,
                         index_t cols, GradWrite din_write = GradWrite::accumulate);

}  // namespace teo
