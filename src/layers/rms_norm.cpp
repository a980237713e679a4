#include "teo/layers/rms_norm.hpp"

#include <cmath>

#include "kernels/parallel.hpp"

namespace teo {

template <class Real>
void rms_norm_forward(Real* out, Real* rstd, const Real* in, const Real* weight, index_t rows,
                      index_t cols, Real eps) {
  detail::for_blocks(rows, 16, [&](index_t r0, index_t r1) {
    for (index_t r = r0; r < r1; ++r) {
      const Real* x = in + r * cols;  // (cols)
      Real* y = out + r * cols;       // (cols)
      Real ms = 0;
      for (index_t c = 0; c < cols; ++c) ms += x[c] * x[c];
      ms = ms / static_cast<Real>(cols);
      const Real s = Real(1) / std::sqrt(ms + eps);
      for (index_t c = 0; c < cols; ++c) y[c] = x[c] * s * weight[c];
      rstd[r] = s;
    }
  });
}

template <class Real>
void rms_norm_backward(Real* din, Real* dweight, const Real* dout, const Real* in,
                       const Real* weight, const Real* rstd, index_t rows, index_t cols,
                       GradWrite din_write) {
  const bool accumulate = din_write == GradWrite::accumulate;
  // in the forward pass this was: y = norm * weight, with norm = x * rstd
  detail::for_blocks(rows, 16, [&](index_t r0, index_t r1) {
    for (index_t r = r0; r < r1; ++r) {
      const Real* x = in + r * cols;
      const Real* g = dout + r * cols;
      const Real s = rstd[r];
      Real dnorm_norm_mean = 0;
      for (index_t c = 0; c < cols; ++c) dnorm_norm_mean += (g[c] * weight[c]) * (x[c] * s);
      dnorm_norm_mean = dnorm_norm_mean / static_cast<Real>(cols);
      for (index_t c = 0; c < cols; ++c) {
        const Real norm = x[c] * s;
        Real& d = din[r * cols + c];
        d = (accumulate ? d : Real(0)) + (g[c] * weight[c] - norm * dnorm_norm_mean) * s;
      }
    }
  });
  // The weight's gradient sums over rows: in increasing r, whatever the thread count.
  for (index_t r = 0; r < rows; ++r) {
    const Real* x = in + r * cols;
    const Real* g = dout + r * cols;
    for (index_t c = 0; c < cols; ++c) dweight[c] += g[c] * (x[c] * rstd[r]);
  }
}

#define TEO_INSTANTIATE(Real)                                                                    \
  template void rms_norm_forward<Real>(Real*, Real*, const Real*, const Real*, index_t, index_t, \
                                       Real);                                                    \
  template void rms_norm_backward<Real>(Real*, Real*, const Real*, const Real*, const Real*,     \
                                        const Real*, index_t, index_t, GradWrite);
TEO_INSTANTIATE(float)
TEO_INSTANTIATE(double)

}  // namespace teo
