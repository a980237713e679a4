// RMSNorm over the last dimension (LLaMA, T5): no mean subtraction and no bias, eps inside the
// square root.
#pragma once

#include "teo/errors.hpp"
#include "teo/kernels.hpp"

namespace teo {

// out, in (rows, cols); weight (cols); rstd (rows) is saved for backward.
//   ms = sum(x^2) / cols;  rstd = 1 / sqrt(ms + eps);  out = x * rstd * weight
// Every row is one sum in column order, on every backend and thread count.
template <class Real>
void rms_norm_forward(Real* out, Real* rstd, const Real* in, const Real* weight, index_t rows,
                      index_t cols, Real eps);

// Accumulates into din (rows, cols) and dweight (cols), summed over the rows in order:
//   norm = x * rstd;  dnorm = dout * weight;  din += (dnorm - norm * mean(dnorm * norm)) * rstd
//   dweight += sum over rows of dout * norm
// With din_write == overwrite, din = +0 + that term instead (din is never read).
template <class Real>
void rms_norm_backward(Real* din, Real* dweight, const Real* dout, const Real* in,
                       const Real* weight, const Real* rstd, index_t rows, index_t cols,
                       GradWrite din_write = GradWrite::accumulate);

}  // namespace teo
