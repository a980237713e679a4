#include "teo/layers/layer_norm.hpp"

#include <cmath>

#include "kernels/kernels_internal.hpp"
#include "kernels/parallel.hpp"

namespace teo {

template <class Real>
void layer_norm_forward(Real* out, Real* mean, Real* rstd, const Real* in, const Real* weight,
                        const Real* bias, index_t rows, index_t cols, Real eps) {
  if (backend() != Backend::reference) {
    const auto& vk = detail::vector_kernels<Real>();
    detail::for_blocks(rows, 16, [&](index_t r0, index_t r1) {
      for (index_t r = r0; r < r1; ++r)
        vk.layer_norm_forward_row(out + r * cols, mean + r, rstd + r, in + r * cols, weight, bias,
                                  cols, eps);
    });
    return;
  }
  detail::for_blocks(rows, 16, [&](index_t r0, index_t r1) {
    for (index_t r = r0; r < r1; ++r) {
      const Real* x = in + r * cols;  // (cols)
      Real* y = out + r * cols;       // (cols)
      Real m = 0;
      for (index_t c = 0; c < cols; ++c) m += x[c];
      m = m / static_cast<Real>(cols);
      Real v = 0;
      for (index_t c = 0; c < cols; ++c) {
        const Real xm = x[c] - m;
        v += xm * xm;
      }
      v = v / static_cast<Real>(cols);
      const Real s = Real(1) / std::sqrt(v + eps);
      for (index_t c = 0; c < cols; ++c) y[c] = (x[c] - m) * s * weight[c] + bias[c];
      mean[r] = m;
      rstd[r] = s;
    }
  });
}

template <class Real>
void layer_norm_backward(Real* din, Real* dweight, Real* dbias, const Real* dout, const Real* in,
                         const Real* weight, const Real* mean, const Real* rstd, index_t rows,
                         index_t cols, GradWrite din_write) {
  // in the forward pass this was: y = norm * weight + bias, with norm = (x - mean) * rstd.
  // dnorm = g * weight; dx = rstd * (dnorm - mean(dnorm) - norm * mean(dnorm * norm))
  // Overwriting adds the term to +0 instead of to din: the bits of accumulating into zeros.
  const bool accumulate = din_write == GradWrite::accumulate;
  if (backend() != Backend::reference) {
    const auto& vk = detail::vector_kernels<Real>();
    if (din) {
      detail::for_blocks(rows, 16, [&](index_t r0, index_t r1) {
        for (index_t r = r0; r < r1; ++r)
          vk.layer_norm_backward_row(din + r * cols, dout + r * cols, in + r * cols, weight,
                                     mean[r], rstd[r], cols, accumulate);
      });
    }
    // Column blocks: each owns its columns and sums them over the rows in order.
    detail::for_blocks(cols, 64, [&](index_t c0, index_t c1) {
      vk.layer_norm_param_grads(dweight, dbias, dout, in, mean, rstd, rows, cols, c0, c1);
    });
    return;
  }
  if (din) {
    detail::for_blocks(rows, 16, [&](index_t r0, index_t r1) {
      for (index_t r = r0; r < r1; ++r) {
        const Real* x = in + r * cols;
        const Real* g = dout + r * cols;
        const Real m = mean[r];
        const Real s = rstd[r];
        Real dnorm_mean = 0;
        Real dnorm_norm_mean = 0;
        for (index_t c = 0; c < cols; ++c) {
          const Real norm = (x[c] - m) * s;
          const Real dnorm = g[c] * weight[c];
          dnorm_mean += dnorm;
          dnorm_norm_mean += dnorm * norm;
        }
        dnorm_mean = dnorm_mean / static_cast<Real>(cols);
        dnorm_norm_mean = dnorm_norm_mean / static_cast<Real>(cols);
        for (index_t c = 0; c < cols; ++c) {
          const Real norm = (x[c] - m) * s;
          const Real dnorm = g[c] * weight[c];
          Real& dx = din[r * cols + c];
          dx = (accumulate ? dx : Real(0)) + (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
        }
      }
    });
  }
  // The weight and bias gradients sum over rows: in increasing r, whatever the thread count.
  for (index_t r = 0; r < rows; ++r) {
    const Real* x = in + r * cols;
    const Real* g = dout + r * cols;
    const Real m = mean[r];
    const Real s = rstd[r];
    for (index_t c = 0; c < cols; ++c) {
      dweight[c] += g[c] * ((x[c] - m) * s);
      dbias[c] += g[c];
    }
  }
}

#define TEO_INSTANTIATE(Real)                                                                      \
  template void layer_norm_forward<Real>(Real*, Real*, Real*, const Real*, const Real*,            \
                                         const Real*, index_t, index_t, Real);                     \
  template void layer_norm_backward<Real>(Real*, Real*, Real*, const Real*, const Real*,           \
                                          const Real*, const Real*, const Real*, index_t, index_t, \
                                          GradWrite);
TEO_INSTANTIATE(float)
TEO_INSTANTIATE(double)

}  // namespace teo
