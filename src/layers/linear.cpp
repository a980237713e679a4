#include "teo/layers/linear.hpp"

#include <algorithm>

#include <type_traits>

#include "kernels/fp8_product.hpp"
#include "kernels/parallel.hpp"
#include "teo/kernels.hpp"

namespace teo {

namespace {

// Under fp8 emulation the three products quantize their operands (kernels/fp8_product.hpp):
// activations and output gradients in 1 x block_k tiles along the contraction, weights in
// weight_block x block_k blocks; the output gradient takes the recipe's backward format.
template <class Real>
bool in_fp8() {
  return std::is_same_v<Real, float> && detail::emulation() == Precision::fp8;
}

}  // namespace

template <class Real>
void linear_forward(Real* out, const Real* in, const Real* weight, const Real* bias, index_t rows,
                    index_t in_f, index_t out_f) {
  // out (rows, out_f) = in (rows, in_f) * weight^T (in_f, out_f)
  if constexpr (std::is_same_v<Real, float>) {
    if (in_fp8<Real>()) {
      detail::fp8_product(
          {.x = in, .ld = in_f, .what = "a linear layer's input", .kept = "y.x"},
          {.x = weight, .ld = in_f, .weight = true, .what = "a linear weight", .kept = "y.weight"},
          rows, out_f, in_f, false, out, out_f);
      if (bias) add_bias(out, bias, rows, out_f);
      return;
    }
  }
  gemm<Real>(Trans::no, Trans::yes, rows, out_f, in_f, Real(1), in, in_f, weight, in_f, Real(0),
             out, out_f);
  if (bias) add_bias(out, bias, rows, out_f);
}

template <class Real>
void add_bias(Real* out, const Real* bias, index_t rows, index_t out_f) {
  detail::for_blocks(rows, 64, [=](index_t r0, index_t r1) {
    const Real* __restrict bv = bias;
    for (index_t r = r0; r < r1; ++r) {
      Real* __restrict y = out + r * out_f;
      for (index_t o = 0; o < out_f; ++o) y[o] += bv[o];
    }
  });
}

template <class Real>
void linear_backward(Real* din, Real* dweight, Real* dbias, const Real* dout, const Real* in,
                     const Real* weight, index_t rows, index_t in_f, index_t out_f,
                     GradWrite din_write) {
  // in the forward pass this was: out = in * weight^T + bias
  bool fp8 = false;
  if constexpr (std::is_same_v<Real, float>) fp8 = in_fp8<Real>();
  if (din) {
    // din (rows, in_f) += dout (rows, out_f) * weight (out_f, in_f); beta = 0 never reads din
    const Real beta = din_write == GradWrite::overwrite ? Real(0) : Real(1);
    if constexpr (std::is_same_v<Real, float>) {
      if (fp8) {
        const detail::Fp8Side g{.x = dout,
                                .ld = out_f,
                                .gradient = true,
                                .what = "a linear layer's output gradient",
                                .kept = "grad_x.grad_y"};
        const detail::Fp8Side w{.x = weight,
                                .ld = in_f,
                                .transposed = true,
                                .weight = true,
                                .what = "a linear weight",
                                .kept = "grad_x.weight"};
        detail::fp8_product(g, w, rows, in_f, out_f, beta != 0, din, in_f);
      }
    }
    if (!fp8) {
      gemm<Real>(Trans::no, Trans::no, rows, in_f, out_f, Real(1), dout, out_f, weight, in_f, beta,
                 din, in_f);
    }
  }
  // dweight (out_f, in_f) += dout^T (out_f, rows) * in (rows, in_f)
  if constexpr (std::is_same_v<Real, float>) {
    if (fp8) {
      const detail::Fp8Side g{.x = dout,
                              .ld = out_f,
                              .transposed = true,
                              .gradient = true,
                              .what = "a linear layer's output gradient",
                              .kept = "grad_weight.grad_y"};
      const detail::Fp8Side x{.x = in,
                              .ld = in_f,
                              .transposed = true,
                              .what = "a linear layer's input",
                              .kept = "grad_weight.x"};
      detail::fp8_product(g, x, out_f, in_f, rows, true, dweight, in_f);
    }
  }
  if (!fp8) {
    gemm<Real>(Trans::yes, Trans::no, out_f, in_f, rows, Real(1), dout, out_f, in, in_f, Real(1),
               dweight, in_f);
  }
  if (dbias) {
    // Each task owns a range of up to kCols columns and sums its rows in increasing order: the
    // serial loop's bits on any thread count. The running sums of the whole range live in a small
    // array (L1), so that each row's piece, kCols contiguous values, is read in one sweep (sixteen
    // columns at a time read every row eight times as often, a cache line or two per visit); each
    // sum still starts from dbias and adds the rows in order, so the bits are the plain loop's.
    // (A task may get more than kCols columns: the reference backend runs one task for all.)
    constexpr index_t kCols = 64;
    detail::for_blocks(out_f, kCols, [=](index_t b0, index_t b1) {
      for (index_t o0 = b0; o0 < b1; o0 += kCols) {
        const index_t nc = std::min(kCols, b1 - o0);
        alignas(64) Real acc[kCols];
        for (index_t c = 0; c < nc; ++c) acc[c] = dbias[o0 + c];
        for (index_t r = 0; r < rows; ++r) {
          const Real* __restrict g = dout + r * out_f + o0;
          for (index_t c = 0; c < nc; ++c) acc[c] += g[c];
        }
        for (index_t c = 0; c < nc; ++c) dbias[o0 + c] = acc[c];
      }
    });
  }
}

#define TEO_INSTANTIATE(Real)                                                                     \
  template void linear_forward<Real>(Real*, const Real*, const Real*, const Real*, index_t,       \
                                     index_t, index_t);                                           \
  template void add_bias<Real>(Real*, const Real*, index_t, index_t);                             \
  template void linear_backward<Real>(Real*, Real*, Real*, const Real*, const Real*, const Real*, \
                                      index_t, index_t, index_t, GradWrite);
TEO_INSTANTIATE(float)
TEO_INSTANTIATE(double)

}  // namespace teo
