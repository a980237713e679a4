#include "teo/layers/feed_forward.hpp"

#include <cmath>
#include <numbers>

#include "kernels/kernels_internal.hpp"
#include "kernels/parallel.hpp"

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
      }
      din[i] = (accumulate ? din[i] : Real(0)) + g * dout[i];
    }
  });
}

#define TEO_INSTANTIATE(Real)                                                                   \
  template void activation_forward<Real>(Real*, const Real*, index_t, Activation);              \
  template void activation_backward<Real>(Real*, const Real*, const Real*, index_t, Activation, \
                                          GradWrite);
TEO_INSTANTIATE(float)
TEO_INSTANTIATE(double)

}  // namespace teo
