#include "teo/layers/linear.hpp"

#include "kernels/parallel.hpp"
#include "teo/kernels.hpp"

namespace teo {

template <class Real>
void linear_forward(Real* out, const Real* in, const Real* weight, const Real* bias, index_t rows,
                    index_t in_f, index_t out_f) {
  // out (rows, out_f) = in (rows, in_f) * weight^T (in_f, out_f)
  gemm<Real>(Trans::no, Trans::yes, rows, out_f, in_f, Real(1), in, in_f, weight, in_f, Real(0),
             out, out_f);
  if (bias) {
    detail::for_blocks(rows, 64, [=](index_t r0, index_t r1) {
      const Real* __restrict bv = bias;
      for (index_t r = r0; r < r1; ++r) {
        Real* __restrict y = out + r * out_f;
        for (index_t o = 0; o < out_f; ++o) y[o] += bv[o];
      }
    });
  }
}

template <class Real>
void linear_backward(Real* din, Real* dweight, Real* dbias, const Real* dout, const Real* in,
                     const Real* weight, index_t rows, index_t in_f, index_t out_f,
                     GradWrite din_write) {
  // in the forward pass this was: out = in * weight^T + bias
  if (din) {
    // din (rows, in_f) += dout (rows, out_f) * weight (out_f, in_f); beta = 0 never reads din
    const Real beta = din_write == GradWrite::overwrite ? Real(0) : Real(1);
    gemm<Real>(Trans::no, Trans::no, rows, in_f, out_f, Real(1), dout, out_f, weight, in_f, beta,
               din, in_f);
  }
  // dweight (out_f, in_f) += dout^T (out_f, rows) * in (rows, in_f)
  gemm<Real>(Trans::yes, Trans::no, out_f, in_f, rows, Real(1), dout, out_f, in, in_f, Real(1),
             dweight, in_f);
  if (dbias) {
    // Each task owns a range of columns and sums its rows in increasing order: the serial loop's
    // bits on any thread count.
    // Sixteen columns at a time keep their running sums in registers; each is still added to in
    // row order, starting from dbias, so the bits are the plain loop's.
    detail::for_blocks(out_f, 64, [=](index_t o0, index_t o1) {
      constexpr index_t kCols = 16;
      index_t o = o0;
      for (; o + kCols <= o1; o += kCols) {
        Real acc[kCols];
        for (index_t c = 0; c < kCols; ++c) acc[c] = dbias[o + c];
        for (index_t r = 0; r < rows; ++r) {
          const Real* __restrict g = dout + r * out_f + o;
          for (index_t c = 0; c < kCols; ++c) acc[c] += g[c];
        }
        for (index_t c = 0; c < kCols; ++c) dbias[o + c] = acc[c];
      }
      for (; o < o1; ++o) {
        Real acc = dbias[o];
        for (index_t r = 0; r < rows; ++r) acc += dout[r * out_f + o];
        dbias[o] = acc;
      }
    });
  }
}

#define TEO_INSTANTIATE(Real)                                                                     \
  template void linear_forward<Real>(Real*, const Real*, const Real*, const Real*, index_t,       \
                                     index_t, index_t);                                           \
  template void linear_backward<Real>(Real*, Real*, Real*, const Real*, const Real*, const Real*, \
                                      index_t, index_t, index_t, GradWrite);
TEO_INSTANTIATE(float)
TEO_INSTANTIATE(double)

}  // namespace teo
