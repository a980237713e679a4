#include "teo/layers/feed_forward.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "kernels/kernels_internal.hpp"
#include "kernels/parallel.hpp"
#include "teo/layers/dropout.hpp"
#include "teo/layers/linear.hpp"

namespace teo {

namespace {

template <class Real>
Real gelu_tanh_inner(Real x) {
  const Real k0 = static_cast<Real>(0.79788456080286535588);  // sqrt(2 / pi)
  const Real k1 = static_cast<Real>(0.044715);
  return k0 * (x + k1 * x * x * x);
}

}  // namespace

template <class Real>
void activation_forward(Real* out, const Real* in, index_t n, Activation act) {
  if (backend() != Backend::reference) {
    const auto& vk = detail::vector_kernels<Real>();
    detail::for_blocks(n, 4096, [&](index_t i0, index_t i1) {
      vk.activation_forward(out + i0, in + i0, i1 - i0, act);
    });
    return;
  }
  const Real half = Real(0.5);
  const Real inv_sqrt2 = static_cast<Real>(std::numbers::sqrt2 / 2);
  detail::for_blocks(n, 4096, [&](index_t i0, index_t i1) {
    for (index_t i = i0; i < i1; ++i) {
      const Real x = in[i];
      switch (act) {
        case Activation::relu:
          out[i] = std::isnan(x) ? x : (x > Real(0) ? x : Real(0));
          break;
        case Activation::gelu:
          out[i] = half * x * (Real(1) + std::erf(x * inv_sqrt2));
          break;
        case Activation::gelu_tanh:
          out[i] = half * x * (Real(1) + std::tanh(gelu_tanh_inner(x)));
          break;
        case Activation::silu:
          out[i] = x / (Real(1) + std::exp(-x));
          break;
      }
    }
  });
}

template <class Real>
void activation_backward(Real* din, const Real* dout, const Real* in, index_t n, Activation act,
                         GradWrite write) {
  // Overwriting adds the term to +0 instead of to din[i]: the bits of accumulating into zeros.
  const bool accumulate = write == GradWrite::accumulate;
  if (backend() != Backend::reference) {
    const auto& vk = detail::vector_kernels<Real>();
    detail::for_blocks(n, 4096, [&](index_t i0, index_t i1) {
      vk.activation_backward(din + i0, dout + i0, in + i0, i1 - i0, act, accumulate);
    });
    return;
  }
  const Real half = Real(0.5);
  const Real inv_sqrt2 = static_cast<Real>(std::numbers::sqrt2 / 2);
  const Real inv_sqrt2pi = static_cast<Real>(0.5 * std::numbers::inv_sqrtpi * std::numbers::sqrt2);
  const Real k0 = static_cast<Real>(0.79788456080286535588);
  const Real k1 = static_cast<Real>(3 * 0.044715);
  detail::for_blocks(n, 4096, [&](index_t i0, index_t i1) {
    for (index_t i = i0; i < i1; ++i) {
      const Real x = in[i];
      Real g = 0;
      switch (act) {
        case Activation::relu:
          g = x > Real(0) ? Real(1) : Real(0);
          break;
        case Activation::gelu:
          // d/dx [x Phi(x)] = Phi(x) + x phi(x)
          g = half * (Real(1) + std::erf(x * inv_sqrt2)) +
              x * inv_sqrt2pi * std::exp(-half * x * x);
          break;
        case Activation::gelu_tanh: {
          const Real t = std::tanh(gelu_tanh_inner(x));
          g = half * (Real(1) + t) + half * x * (Real(1) - t * t) * k0 * (Real(1) + k1 * x * x);
          break;
        }
        case Activation::silu: {
          // d/dx [x s(x)] = s(x) (1 + x (1 - s(x))), s the logistic sigmoid
          const Real sig = Real(1) / (Real(1) + std::exp(-x));
          g = sig * (Real(1) + x * (Real(1) - sig));
          break;
        }
      }
      din[i] = (accumulate ? din[i] : Real(0)) + g * dout[i];
    }
  });
}

template <class Real>
void gated_forward(Real* hidden, const Real* gate, const Real* up, index_t n, Activation act) {
  detail::for_blocks(n, 4096, [=](index_t i0, index_t i1) {
    activation_forward(hidden + i0, gate + i0, i1 - i0, act);
    for (index_t i = i0; i < i1; ++i) hidden[i] = hidden[i] * up[i];
  });
}

template <class Real>
void gated_backward(Real* dgate, Real* dup, const Real* dhidden, const Real* gate, const Real* up,
                    index_t n, Activation act) {
  detail::for_blocks(n, 4096, [=](index_t i0, index_t i1) {
    for (index_t i = i0; i < i1; ++i) dgate[i] = dhidden[i] * up[i];
    // in place: element i of the upstream gradient is read before element i is written
    activation_backward(dgate + i0, dgate + i0, gate + i0, i1 - i0, act, GradWrite::overwrite);
    activation_forward(dup + i0, gate + i0, i1 - i0, act);
    for (index_t i = i0; i < i1; ++i) dup[i] = dup[i] * dhidden[i];
  });
}

namespace {
// Rows per task of the fused passes: one block per thread, so the pass forks and joins once
// instead of once per step. Inside a block the steps run in turn on the calling thread (nested
// kernels do not fork); at the small preset's shape that ran faster than blocks of 8 to 128 rows,
// for ReLU (memory-bound) as for GELU. The block size depends on the thread count, the bits do not:
// every step is element-wise.
index_t fused_rows(index_t rows) {
  const auto threads = static_cast<index_t>(std::max(1, num_threads()));
  return std::max<index_t>(1, (rows + threads - 1) / threads);
}
}  // namespace

template <class Real>
void ffn_hidden_forward(Real* pre, Real* hidden, Real* dropped, const Real* bias,
                        const std::uint8_t* mask, Real scale, index_t rows, index_t cols,
                        Activation act) {
  detail::for_blocks(rows, fused_rows(rows), [=](index_t r0, index_t r1) {
    const index_t at = r0 * cols, n = (r1 - r0) * cols;
    if (bias) add_bias(pre + at, bias, r1 - r0, cols);
    activation_forward(hidden + at, pre + at, n, act);
    if (mask) dropout_forward(dropped + at, hidden + at, mask + at, n, scale);
  });
}

template <class Real>
void ffn_hidden_backward(Real* dpre, Real* dhidden, const Real* ddropped, const std::uint8_t* mask,
                         Real scale, const Real* pre, index_t rows, index_t cols, Activation act) {
  detail::for_blocks(rows, fused_rows(rows), [=](index_t r0, index_t r1) {
    const index_t at = r0 * cols, n = (r1 - r0) * cols;
    if (mask) {
      dropout_backward(dhidden + at, ddropped + at, mask + at, n, scale, GradWrite::overwrite);
    }
    activation_backward(dpre + at, dhidden + at, pre + at, n, act, GradWrite::overwrite);
  });
}

#define TEO_INSTANTIATE(Real)                                                                      \
  template void activation_forward<Real>(Real*, const Real*, index_t, Activation);                 \
  template void activation_backward<Real>(Real*, const Real*, const Real*, index_t, Activation,    \
                                          GradWrite);                                              \
  template void gated_forward<Real>(Real*, const Real*, const Real*, index_t, Activation);         \
  template void gated_backward<Real>(Real*, Real*, const Real*, const Real*, const Real*, index_t, \
                                     Activation);                                                  \
  template void ffn_hidden_forward<Real>(Real*, Real*, Real*, const Real*, const std::uint8_t*,    \
                                         Real, index_t, index_t, Activation);                      \
  template void ffn_hidden_backward<Real>(Real*, Real*, const Real*, const std::uint8_t*, Real,    \
                                          const Real*, index_t, index_t, Activation);
TEO_INSTANTIATE(float)
TEO_INSTANTIATE(double)

}  // namespace teo
