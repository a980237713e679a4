#include "teo/layers/softmax.hpp"

#include <algorithm>
#include <cmath>

#include "kernels/kernels_internal.hpp"
#include "kernels/parallel.hpp"

namespace teo {

namespace {

// Rows per task: a row is cheap, and attention calls these one row at a time inside its own task.
constexpr index_t kRowGrain = 16;

}  // namespace

template <class Real>
void softmax_forward(Real* y, const Real* x, const index_t* visible, index_t rows, index_t cols) {
  // The simd and blas backends use the vector kernels; the reference its loops.
  const simd::VectorKernels<Real>* vk =
      backend() == Backend::reference ? nullptr : &detail::vector_kernels<Real>();
  detail::for_blocks(rows, kRowGrain, [&](index_t r0, index_t r1) {
    for (index_t r = r0; r < r1; ++r) {
      const Real* xr = x + r * cols;  // (cols)
      Real* yr = y + r * cols;        // (cols)
      const index_t nv = visible ? std::clamp<index_t>(visible[r], 0, cols) : cols;
      if (vk) {
        vk->softmax_forward_row(yr, xr, nv, cols);
        continue;
      }
      for (index_t j = 0; j < cols; ++j) yr[j] = Real(0);
      if (nv == 0) continue;  // fully masked row: stays exactly 0
      Real mx = xr[0];
      for (index_t j = 1; j < nv; ++j) mx = std::max(mx, xr[j]);
      Real sum = 0;
      for (index_t j = 0; j < nv; ++j) {
        yr[j] = std::exp(xr[j] - mx);
        sum += yr[j];
      }
      const Real inv = Real(1) / sum;
      for (index_t j = 0; j < nv; ++j) yr[j] *= inv;
    }
  });
}

template <class Real>
void softmax_backward(Real* dx, const Real* dy, const Real* y, index_t rows, index_t cols) {
  const simd::VectorKernels<Real>* vk =
      backend() == Backend::reference ? nullptr : &detail::vector_kernels<Real>();
  detail::for_blocks(rows, kRowGrain, [&](index_t r0, index_t r1) {
    for (index_t r = r0; r < r1; ++r) {
      const Real* yr = y + r * cols;    // (cols)
      const Real* dyr = dy + r * cols;  // (cols)
      Real* dxr = dx + r * cols;        // (cols)
      if (vk) {
        vk->softmax_backward_row(dxr, yr, dyr, cols);
        continue;
      }
      // in the forward pass this was: y = exp(x - m) / sum exp(x - m)
      Real dot = 0;
      for (index_t j = 0; j < cols; ++j) dot += yr[j] * dyr[j];
      for (index_t j = 0; j < cols; ++j)
        dxr[j] = yr[j] == Real(0) ? Real(0) : yr[j] * (dyr[j] - dot);
    }
  });
}

#define TEO_INSTANTIATE(Real)                                                                \
  template void softmax_forward<Real>(Real*, const Real*, const index_t*, index_t, index_t); \
  template void softmax_backward<Real>(Real*, const Real*, const Real*, index_t, index_t);
TEO_INSTANTIATE(float)
TEO_INSTANTIATE(double)

}  // namespace teo
