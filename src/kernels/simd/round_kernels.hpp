// Rounding float32 arrays to bf16, fp16 and tf32, and widening bf16 and fp16 arrays back to
// float32: the bit definitions of core/float_bits.hpp over the ISA's 32-bit integer lanes, with
// core's scalar definitions for the tails. Every ISA runs the same integer operations (and one
// exact float addition for fp16's subnormals), so every ISA gives the scalar bits. Only for
// inclusion by the per-ISA translation units.
#pragma once

#include <bit>
#include <cstdint>

#include "core/float_bits.hpp"
#include "isa.hpp"
#include "vec.hpp"

namespace teo::simd {
namespace {

// The lane operations the rounding needs (core/float_bits.hpp): 32-bit integer vectors (I) holding
// a float's bits, and float vectors (F) for the exact float additions. The scalar twin is core's
// ScalarLanes.
template <class Arch>
struct Lanes {
  using F = xsimd::batch<float, Arch>;
  using I = xsimd::batch<std::int32_t, Arch>;
  using M = xsimd::batch_bool<std::int32_t, Arch>;
  static constexpr std::size_t size = F::size;
  static I set(std::int32_t v) { return I(v); }
  static I bits(const F& f) { return xsimd::bitwise_cast<I>(f); }
  static F real(const I& i) { return xsimd::bitwise_cast<F>(i); }
  static I select(const M& m, const I& a, const I& b) { return xsimd::select(m, a, b); }
  static bool any(const M& m) { return xsimd::any(m); }
  static I load(const std::int32_t* p) { return I::load_unaligned(p); }
  static void store(std::int32_t* p, const I& v) { v.store_unaligned(p); }
  static I shl(const I& v, int s) { return v << s; }
  // a or (b and c), lane by lane
  static M or_and(const M& a, const M& b, const M& c) { return a | (b & c); }
};

template <>
struct Lanes<scalar_arch> : bits::ScalarLanes {};

using bits::kAbs;
using bits::kInf;

template <class Arch>
struct Rounding : bits::FloatBits<Lanes<Arch>> {
  using L = Lanes<Arch>;
  using I = typename L::I;
  using B = bits::FloatBits<L>;
  using B::from_bf16;
  using B::from_fp16;
  using B::round_drop;
  using B::round_fp16;
  using B::to_fp16;

  // out = the value of in rounded to p, as a float; out may be in. Returns whether a finite value
  // became infinite.
  static bool round(float* out, const float* in, index_t n, Precision p) {
    typename L::M over = typename L::M(false);
    const auto one = [&](const I& x) {
      I y;
      if (p == Precision::bf16) {
        y = round_drop(x, 16);
      } else if (p == Precision::tf32) {
        y = round_drop(x, 13);
      } else {
        y = round_fp16(x);
      }
      over = L::or_and(over, (x & L::set(kAbs)) < L::set(kInf), (y & L::set(kAbs)) == L::set(kInf));
      return y;
    };
    const auto* src = reinterpret_cast<const std::int32_t*>(in);
    auto* dst = reinterpret_cast<std::int32_t*>(out);
    constexpr index_t W = static_cast<index_t>(L::size);
    const index_t full = n - n % W;
    for (index_t i = 0; i < full; i += W) L::store(dst + i, one(L::load(src + i)));
    bool tail_over = false;
    for (index_t i = full; i < n; ++i) {
      const std::int32_t y = round_one(src[i], p);
      tail_over = tail_over || ((src[i] & kAbs) < kInf && (y & kAbs) == kInf);
      dst[i] = y;
    }
    return L::any(over) || tail_over;
  }

  static std::int32_t round_one(std::int32_t x, Precision p) {
    if (p == Precision::bf16) return bits::Scalar::round_drop(x, 16);
    if (p == Precision::tf32) return bits::Scalar::round_drop(x, 13);
    return bits::Scalar::round_fp16(x);
  }

  // out = the bf16 or fp16 bits of in, rounded to nearest even.
  static void narrow(std::uint16_t* out, const float* in, index_t n, Precision p) {
    constexpr index_t W = static_cast<index_t>(L::size);
    alignas(64) std::int32_t lanes[W];
    const auto* src = reinterpret_cast<const std::int32_t*>(in);
    index_t i = 0;
    for (; i + W <= n; i += W) {
      const I x = L::load(src + i);
      L::store(lanes, p == Precision::bf16 ? round_drop(x, 16) >> 16 : to_fp16(x));
      for (index_t j = 0; j < W; ++j) out[i + j] = static_cast<std::uint16_t>(lanes[j] & 0xFFFF);
    }
    for (; i < n; ++i) {
      const std::int32_t x = src[i];
      const std::int32_t h =
          p == Precision::bf16 ? bits::Scalar::round_drop(x, 16) >> 16 : bits::Scalar::to_fp16(x);
      out[i] = static_cast<std::uint16_t>(h & 0xFFFF);
    }
  }

  // out = the float value of the bf16 or fp16 bits in (exact).
  static void widen(float* out, const std::uint16_t* in, index_t n, Precision p) {
    constexpr index_t W = static_cast<index_t>(L::size);
    alignas(64) std::int32_t lanes[W];
    auto* dst = reinterpret_cast<std::int32_t*>(out);
    index_t i = 0;
    for (; i + W <= n; i += W) {
      for (index_t j = 0; j < W; ++j) lanes[j] = in[i + j];
      const I h = L::load(lanes);
      L::store(dst + i, p == Precision::bf16 ? from_bf16(h) : from_fp16(h));
    }
    for (; i < n; ++i) {
      const std::int32_t h = in[i];
      dst[i] = p == Precision::bf16 ? bits::Scalar::from_bf16(h) : bits::Scalar::from_fp16(h);
    }
  }
};

}  // namespace
}  // namespace teo::simd
