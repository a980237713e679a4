// Rounding float32 to bf16, fp16 and tf32, and widening bf16 and fp16 back to float32, written once
// over 32-bit integer lanes. Every ISA runs the same integer operations (and one exact float
// addition for fp16's subnormals), so every ISA gives the scalar twin's bits. Only for inclusion by
// the per-ISA translation units.
#pragma once

#include <bit>
#include <cstdint>

#include "isa.hpp"
#include "vec.hpp"

namespace teo::simd {
namespace {

// The lane operations the rounding needs: 32-bit integer vectors (I) holding a float's bits, and
// float vectors (F) for the one float addition. The scalar twin uses plain int32_t and float.
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
struct Lanes<scalar_arch> {
  using F = float;
  using I = std::int32_t;
  using M = bool;
  static constexpr std::size_t size = 1;
  static I set(std::int32_t v) { return v; }
  static I bits(F f) { return std::bit_cast<I>(f); }
  static F real(I i) { return std::bit_cast<F>(i); }
  static I select(M m, I a, I b) { return m ? a : b; }
  static bool any(M m) { return m; }
  static I load(const std::int32_t* p) { return *p; }
  static void store(std::int32_t* p, I v) { *p = v; }
  // Through unsigned, so that shifting a bit into the sign is no signed overflow.
  static I shl(I v, int s) { return std::bit_cast<I>(std::bit_cast<std::uint32_t>(v) << s); }
  static M or_and(M a, M b, M c) { return a || (b && c); }
};

constexpr std::int32_t kAbs = 0x7FFFFFFF;
constexpr std::int32_t kSign = std::bit_cast<std::int32_t>(0x80000000u);
constexpr std::int32_t kInf = 0x7F800000;
constexpr std::int32_t kQuiet = 0x00400000;  // float's quiet-NaN bit
constexpr std::int32_t kHalf = 0x3F000000;   // 0.5f: its ulp is 2^-24, fp16's smallest subnormal

template <class Arch>
struct Rounding {
  using L = Lanes<Arch>;
  using I = typename L::I;

  // Round to nearest, ties to even, of the float bits x to `drop` fewer mantissa bits, as a float's
  // bits (bf16: drop 16, tf32: drop 13). The exponent range is float's, so only an overflow past
  // the largest value (rounding up from it) gives inf. NaN becomes a quiet NaN with the kept
  // payload bits.
  static I round_drop(const I& x, int drop) {
    const I a = x & L::set(kAbs);
    const auto nan = a > L::set(kInf);
    const I keep = L::set(~((1 << drop) - 1));
    const I av = L::select(nan, L::set(0), a);  // NaN lanes take no part in the arithmetic
    const I odd = (av >> drop) & L::set(1);
    const I r = (av + L::set((1 << (drop - 1)) - 1) + odd) & keep;
    const I q = (a | L::set(kQuiet)) & keep;
    return (x & L::set(kSign)) | L::select(nan, q, r);
  }

  // The fp16 bits (in the low 16 bits of each lane) of the float bits x: round to nearest, ties to
  // even, with fp16's subnormals; values at or beyond 65520 overflow to inf; NaN becomes a quiet
  // NaN with the top payload bits.
  static I to_fp16(const I& x) {
    const I a = x & L::set(kAbs);
    const auto nan = a > L::set(kInf);
    const auto inf = a >= L::set(0x477FF000);     // 65520: half way from 65504 to 2^16, rounds up
    const auto normal = a >= L::set(0x38800000);  // 2^-14, fp16's smallest normal
    const I av = L::select(nan, L::set(0), a);
    // Normal: rebias the exponent (127 -> 15) and round away 13 mantissa bits.
    const I odd = (av >> 13) & L::set(1);
    const I hn = (av - L::set(0x38000000) + L::set(0xFFF) + odd) >> 13;
    // Subnormal: 0.5 + |x| rounds |x| to a multiple of 2^-24 (one exact-sum-then-round float
    // addition); the bits above 0.5's are the count of 2^-24 units, up to 0x400 (the smallest
    // normal, which is the right encoding when |x| rounds up to 2^-14).
    const I small = L::select(normal, L::set(0), av);
    const I hs = L::bits(L::real(small) + L::real(L::set(kHalf))) - L::set(kHalf);
    const I hq = L::set(0x7E00) | ((a >> 13) & L::set(0x3FF));
    const I h = L::select(nan, hq, L::select(inf, L::set(0x7C00), L::select(normal, hn, hs)));
    return ((x >> 16) & L::set(0x8000)) | h;
  }

  // The fp16 value of the float bits x, as float bits: the bits of from_fp16(to_fp16(x)) in fewer
  // operations. In fp16's normal range rounding keeps 11 significant bits, as tf32's does
  // (round_drop 13, which also gives fp16's quiet NaN); below 2^-14 the step is 2^-24, which
  // 0.5 + |x| - 0.5 rounds to (both float operations exact but the first's one rounding); from
  // 65520 up it is inf.
  static I round_fp16(const I& x) {
    const I a = x & L::set(kAbs);
    const I normal = round_drop(x, 13);
    const I small = L::select(a < L::set(0x38800000), a, L::set(0));
    const I sub = L::bits((L::real(small) + L::real(L::set(kHalf))) - L::real(L::set(kHalf)));
    const auto nan = a > L::set(kInf);
    const I r = L::select(a >= L::set(0x477FF000), L::set(kInf),
                          L::select(a < L::set(0x38800000), sub, normal & L::set(kAbs)));
    return L::select(nan, normal, (x & L::set(kSign)) | r);
  }

  // The float bits of the fp16 bits h (low 16 bits): exact; NaN becomes quiet.
  static I from_fp16(const I& h) {
    const I sign = L::shl(h & L::set(0x8000), 16);
    const I e = h & L::set(0x7C00);
    const I m = h & L::set(0x3FF);
    const I normal = ((h & L::set(0x7FFF)) << 13) + L::set(0x38000000);
    const I special = L::set(kInf) | (m << 13) |
                      L::select(m == L::set(0), L::set(0), L::set(kQuiet));  // inf, NaN
    // Subnormal or zero: m * 2^-24, as (0.5 + m * 2^-24) - 0.5, both steps exact.
    const I sub = L::bits(L::real(L::set(kHalf) | m) - L::real(L::set(kHalf)));
    return sign | L::select(e == L::set(0x7C00), special, L::select(e == L::set(0), sub, normal));
  }

  // The float bits of the bf16 bits h (low 16 bits): exact; NaN becomes quiet.
  static I from_bf16(const I& h) {
    const I x = L::shl(h, 16);
    const auto nan = (x & L::set(kAbs)) > L::set(kInf);
    return L::select(nan, x | L::set(kQuiet), x);
  }

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
      const std::int32_t y = Rounding<scalar_arch>::round_one(src[i], p);
      tail_over = tail_over || ((src[i] & kAbs) < kInf && (y & kAbs) == kInf);
      dst[i] = y;
    }
    return L::any(over) || tail_over;
  }

  static std::int32_t round_one(std::int32_t x, Precision p) {
    if (p == Precision::bf16) return Rounding<scalar_arch>::round_drop(x, 16);
    if (p == Precision::tf32) return Rounding<scalar_arch>::round_drop(x, 13);
    return Rounding<scalar_arch>::round_fp16(x);
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
      const std::int32_t h = p == Precision::bf16 ? Rounding<scalar_arch>::round_drop(x, 16) >> 16
                                                  : Rounding<scalar_arch>::to_fp16(x);
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
      dst[i] = p == Precision::bf16 ? Rounding<scalar_arch>::from_bf16(h)
                                    : Rounding<scalar_arch>::from_fp16(h);
    }
  }
};

}  // namespace
}  // namespace teo::simd
