#include "teo/layers/dropout.hpp"

#include "kernels/parallel.hpp"
#include "teo/rng.hpp"

namespace teo {

void dropout_mask(std::uint8_t* mask, index_t n, std::uint64_t seed, std::string_view site,
                  double p) {
  const std::uint64_t stream = rng::stream_id(site);
  detail::for_blocks(n, 8192, [&](index_t i0, index_t i1) {
    for (index_t i = i0; i < i1; ++i)
      mask[i] = rng::uniform01(seed, stream, static_cast<std::uint64_t>(i)) >= p ? 1 : 0;
  });
}

template <class Real>
Real dropout_scale(double p) {
  return static_cast<Real>(1.0 / (1.0 - p));
}

template <class Real>
void dropout_forward(Real* out, const Real* in, const std::uint8_t* mask, index_t n, Real scale) {
  detail::for_blocks(n, 8192, [&](index_t i0, index_t i1) {
    for (index_t i = i0; i < i1; ++i) out[i] = mask[i] ? in[i] * scale : Real(0);
  });
}

template <class Real>
void dropout_backward(Real* din, const Real* dout, const std::uint8_t* mask, index_t n,
                      Real scale) {
  // in the forward pass this was: out = mask ? in * scale : 0
  detail::for_blocks(n, 8192, [&](index_t i0, index_t i1) {
    for (index_t i = i0; i < i1; ++i)
      if (mask[i]) din[i] += dout[i] * scale;
  });
}

#define TEO_INSTANTIATE(Real)                                                                  \
  template Real dropout_scale<Real>(double);                                                   \
  template void dropout_forward<Real>(Real*, const Real*, const std::uint8_t*, index_t, Real); \
  template void dropout_backward<Real>(Real*, const Real*, const std::uint8_t*, index_t, Real);
TEO_INSTANTIATE(float)
TEO_INSTANTIATE(double)

}  // namespace teo
