#include "teo/layers/dropout.hpp"

#include <bit>
#include <cmath>
#include <type_traits>

#include "kernels/parallel.hpp"
#include "teo/rng.hpp"

namespace teo {

void dropout_mask(std::uint8_t* mask, index_t n, std::uint64_t seed, std::string_view site,
                  double p) {
  // uniform01(seed, stream, i) >= p, computed in integers: uniform01 is u * 2^-53 with u the top
  // 53 bits of bits(seed, stream, i) = mix64(key + i), and u * 2^-53 >= p exactly when
  // u >= ceil(p * 2^53) (both scalings by 2^53 are exact). The key is computed once.
  const std::uint64_t key = rng::mix64(seed ^ rng::mix64(rng::stream_id(site)));
  const auto threshold = static_cast<std::uint64_t>(std::ceil(p * 0x1.0p53));
  detail::for_blocks(n, 8192, [&](index_t i0, index_t i1) {
    for (index_t i = i0; i < i1; ++i)
      mask[i] = (rng::mix64(key + static_cast<std::uint64_t>(i)) >> 11) >= threshold ? 1 : 0;
  });
}

template <class Real>
Real dropout_scale(double p) {
  return static_cast<Real>(1.0 / (1.0 - p));
}

// m != 0 ? kept : dropped, as a bit-mask select rather than a branch. With trapping math the
// compiler may not turn a branch into a blend, but it vectorises this; and it gives exactly the
// branch's bits (a dropped element is +0 even when the input is Inf or NaN).
template <class Real>
inline Real select_kept(std::uint8_t m, Real kept, Real dropped) {
  using Bits = std::conditional_t<sizeof(Real) == 4, std::uint32_t, std::uint64_t>;
  const Bits keep = Bits{0} - Bits{m != 0};  // all ones or all zeros
  return std::bit_cast<Real>((std::bit_cast<Bits>(kept) & keep) |
                             (std::bit_cast<Bits>(dropped) & ~keep));
}

// The element loops take their pointers as __restrict locals, so that a store cannot alias a
// pointer captured by reference (which would force a reload per element and block vectorising).
template <class Real>
void dropout_forward(Real* out, const Real* in, const std::uint8_t* mask, index_t n, Real scale) {
  detail::for_blocks(n, 8192, [=](index_t i0, index_t i1) {
    Real* __restrict o = out + i0;
    const Real* __restrict x = in + i0;
    const std::uint8_t* __restrict m = mask + i0;
    for (index_t i = 0; i < i1 - i0; ++i) o[i] = select_kept(m[i], x[i] * scale, Real(0));
  });
}

template <class Real>
void dropout_backward(Real* din, const Real* dout, const std::uint8_t* mask, index_t n, Real scale,
                      GradWrite write) {
  // in the forward pass this was: out = mask ? in * scale : 0; so din += dout * scale where kept.
  // Overwriting starts from +0 instead of din: the bits of accumulating into zeros.
  const bool accumulate = write == GradWrite::accumulate;
  detail::for_blocks(n, 8192, [=](index_t i0, index_t i1) {
    Real* __restrict d = din + i0;
    const Real* __restrict g = dout + i0;
    const std::uint8_t* __restrict m = mask + i0;
    if (accumulate) {
      for (index_t i = 0; i < i1 - i0; ++i) d[i] = select_kept(m[i], d[i] + g[i] * scale, d[i]);
    } else {
      for (index_t i = 0; i < i1 - i0; ++i)
        d[i] = select_kept(m[i], Real(0) + g[i] * scale, Real(0));
    }
  });
}

#define TEO_INSTANTIATE(Real)                                                                  \
  template Real dropout_scale<Real>(double);                                                   \
  template void dropout_forward<Real>(Real*, const Real*, const std::uint8_t*, index_t, Real); \
  template void dropout_backward<Real>(Real*, const Real*, const std::uint8_t*, index_t, Real, \
                                       GradWrite);
TEO_INSTANTIATE(float)
TEO_INSTANTIATE(double)

}  // namespace teo
