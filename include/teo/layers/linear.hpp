// Linear layer with PyTorch's layout: weight (out_f, in_f), y = x * weight^T + bias.
#pragma once

#include "teo/errors.hpp"
#include "teo/kernels.hpp"

namespace teo {

// out (rows, out_f); in (rows, in_f); weight (out_f, in_f); bias (out_f) or null.
template <class Real>
void linear_forward(Real* out, const Real* in, const Real* weight, const Real* bias, index_t rows,
                    index_t in_f, index_t out_f);

// out (rows, out_f) += bias (out_f) on every row: linear_forward's bias, as its own pass.
template <class Real>
void add_bias(Real* out, const Real* bias, index_t rows, index_t out_f);

// Accumulates din += dout * weight, dweight += dout^T * in, dbias += column sums of dout; with
// din_write == overwrite, din = dout * weight instead (never read). din and dbias may be null.
template <class Real>
void linear_backward(Real* din, Real* dweight, Real* dbias, const Real* dout, const Real* in,
                     const Real* weight, index_t rows, index_t in_f, index_t out_f,
                     GradWrite din_write = GradWrite::accumulate);

}  // namespace teo
