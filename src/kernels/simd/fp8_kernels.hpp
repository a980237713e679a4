// Rounding float32 arrays to the OCP 8-bit formats E4M3 and E5M2, widening them back, and
// converting scales to E8M0: the bit definitions of core/float_bits.hpp over the same lanes as
// round_kernels.hpp, with core's scalar definitions for the tails, so every ISA gives the scalar
// bits. Only for inclusion by the per-ISA translation units.
#pragma once

#include <cstdint>

#include "round_kernels.hpp"

namespace teo::simd {
namespace {

template <class Arch>
struct Fp8Rounding : bits::Fp8Bits<Lanes<Arch>> {
  using L = Lanes<Arch>;
  using I = typename L::I;
  using B = bits::Fp8Bits<L>;
  using B::code;
  using B::e8m0;
  using B::format;
  using B::round_bits;
  using B::widen_bits;
  using typename B::Format;

  static bool round(float* out, const float* in, index_t n, Fp8Format f, bool saturate) {
    const Format F = format(f);
    typename L::M over = typename L::M(false);
    const auto* src = reinterpret_cast<const std::int32_t*>(in);
    auto* dst = reinterpret_cast<std::int32_t*>(out);
    constexpr index_t W = static_cast<index_t>(L::size);
    const index_t full = n - n % W;
    for (index_t i = 0; i < full; i += W) {
      const I x = L::load(src + i);
      const I y = round_bits(x, F, saturate);
      over = L::or_and(over, (x & L::set(kAbs)) < L::set(kInf), (y & L::set(kAbs)) >= L::set(kInf));
      L::store(dst + i, y);
    }
    bool tail_over = false;
    using S = bits::ScalarFp8;
    for (index_t i = full; i < n; ++i) {
      const std::int32_t x = src[i];
      const std::int32_t y = S::round_bits(x, S::format(f), saturate);
      tail_over = tail_over || ((x & kAbs) < kInf && (y & kAbs) >= kInf);
      dst[i] = y;
    }
    return L::any(over) || tail_over;
  }

  static void narrow(std::uint8_t* out, const float* in, index_t n, Fp8Format f, bool saturate) {
    const Format F = format(f);
    constexpr index_t W = static_cast<index_t>(L::size);
    alignas(64) std::int32_t lanes[W];
    const auto* src = reinterpret_cast<const std::int32_t*>(in);
    index_t i = 0;
    for (; i + W <= n; i += W) {
      L::store(lanes, code(round_bits(L::load(src + i), F, saturate), F));
      for (index_t j = 0; j < W; ++j) out[i + j] = static_cast<std::uint8_t>(lanes[j] & 0xFF);
    }
    using S = bits::ScalarFp8;
    for (; i < n; ++i) {
      const auto G = S::format(f);
      out[i] = static_cast<std::uint8_t>(S::code(S::round_bits(src[i], G, saturate), G) & 0xFF);
    }
  }

  static void widen(float* out, const std::uint8_t* in, index_t n, Fp8Format f) {
    const Format F = format(f);
    constexpr index_t W = static_cast<index_t>(L::size);
    alignas(64) std::int32_t lanes[W];
    auto* dst = reinterpret_cast<std::int32_t*>(out);
    index_t i = 0;
    for (; i + W <= n; i += W) {
      for (index_t j = 0; j < W; ++j) lanes[j] = in[i + j];
      L::store(dst + i, widen_bits(L::load(lanes), F));
    }
    using S = bits::ScalarFp8;
    for (; i < n; ++i) dst[i] = S::widen_bits(in[i], S::format(f));
  }

  static void to_e8m0(std::uint8_t* out, const float* in, index_t n, int offset, bool up) {
    constexpr index_t W = static_cast<index_t>(L::size);
    alignas(64) std::int32_t lanes[W];
    const auto* src = reinterpret_cast<const std::int32_t*>(in);
    index_t i = 0;
    for (; i + W <= n; i += W) {
      L::store(lanes, e8m0(L::load(src + i), offset, up));
      for (index_t j = 0; j < W; ++j) out[i + j] = static_cast<std::uint8_t>(lanes[j]);
    }
    for (; i < n; ++i)
      out[i] = static_cast<std::uint8_t>(bits::ScalarFp8::e8m0(src[i], offset, up));
  }
};

// The rounding table of an ISA: the 16-bit formats and tf32 (round_kernels.hpp), and fp8.
template <class Arch>
constexpr RoundKernels rounding_table() {
  using R = Rounding<Arch>;
  using F = Fp8Rounding<Arch>;
  return RoundKernels{&R::round,  &R::narrow, &R::widen,  &F::round,
                      &F::narrow, &F::widen,  &F::to_e8m0};
}

}  // namespace
}  // namespace teo::simd
