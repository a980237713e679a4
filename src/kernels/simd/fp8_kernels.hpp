// Rounding float32 to the OCP 8-bit formats E4M3 and E5M2, widening them back, and converting
// scales to E8M0, over the same 32-bit integer lanes as round_kernels.hpp: every ISA runs the same
// integer operations (and exact float additions for the subnormals), so every ISA gives the scalar
// twin's bits. Only for inclusion by the per-ISA translation units.
#pragma once

#include <cstdint>

#include "round_kernels.hpp"

namespace teo::simd {
namespace {

constexpr std::int32_t kQuietNaN = 0x7FC00000;

template <class Arch>
struct Fp8Rounding {
  using L = Lanes<Arch>;
  using I = typename L::I;

  // A format's constants, as float bit patterns where they are values.
  struct Format {
    int m;                    // explicit mantissa bits
    std::int32_t min_normal;  // the smallest normal value, 2^emin
    std::int32_t max;         // the largest finite value
    std::int32_t magic;       // 2^(emin - m + 23), whose ulp is the subnormal step 2^(emin - m)
    std::int32_t rebias;      // (127 - bias) << m: float's exponent-and-mantissa field less fp8's
    bool has_inf;
  };
  static constexpr Format format(Fp8Format f) {
    // E4M3: emin -6, 448 = 1.75 * 2^8, step 2^-9. E5M2: emin -14, 57344 = 1.75 * 2^15, step 2^-16.
    return f == Fp8Format::e4m3 ? Format{3, 0x3C800000, 0x43E00000, 0x46800000, 120 << 3, false}
                                : Format{2, 0x38800000, 0x47600000, 0x43000000, 112 << 2, true};
  }

  // The fp8 value of the float bits x, as float bits: to nearest, ties to even; in the normal
  // range by dropping 23 - m mantissa bits, below it by one exact-sum-then-round float addition
  // (magic + |x|, whose ulp is the subnormal step). Past the largest finite value: that value when
  // saturating (infinities too), else inf for E5M2 and NaN for E4M3. NaN stays a quiet NaN with its
  // sign (E5M2 keeps one payload bit, as the top byte of an fp16 NaN does).
  static I round_bits(const I& x, const Format& F, bool saturate) {
    const I a = x & L::set(kAbs);
    const auto nan = a > L::set(kInf);
    const I normal = Rounding<Arch>::round_drop(x, 23 - F.m) & L::set(kAbs);
    const auto tiny = a < L::set(F.min_normal);
    const I small = L::select(tiny, a, L::set(0));
    const I magic = L::set(F.magic);
    const I sub = L::bits((L::real(small) + L::real(magic)) - L::real(magic));
    I r = L::select(tiny, sub, normal);
    const I beyond = L::set(saturate ? F.max : (F.has_inf ? kInf : kQuietNaN));
    r = L::select(r > L::set(F.max), beyond, r);
    const I q = F.has_inf ? L::set(kQuietNaN) | (x & L::set(0x00200000)) : L::set(kQuietNaN);
    return (x & L::set(kSign)) | L::select(nan, q, r);
  }

  // The fp8 byte (low 8 bits) of y, a value round_bits returned.
  static I code(const I& y, const Format& F) {
    const I ay = y & L::set(kAbs);
    const I magic = L::set(F.magic);
    const I normal = (ay >> (23 - F.m)) - L::set(F.rebias);
    const I sub = L::bits(L::real(ay) + L::real(magic)) - magic;  // exact: a multiple of the step
    I c = L::select(ay < L::set(F.min_normal), sub, normal);
    c = L::select(ay == L::set(kInf), L::set(0x7C), c);  // only E5M2 has infinities
    const I nan = F.has_inf ? L::set(0x7E) | ((y >> 21) & L::set(1)) : L::set(0x7F);
    c = L::select(ay > L::set(kInf), nan, c);
    return ((y >> 24) & L::set(0x80)) | c;
  }

  // The float bits of the fp8 byte h (low 8 bits): exact; NaN is quiet.
  static I widen_bits(const I& h, const Format& F) {
    const I sign = L::shl(h & L::set(0x80), 24);
    const I c = h & L::set(0x7F);
    const I magic = L::set(F.magic);
    const I normal = L::shl(c + L::set(F.rebias), 23 - F.m);
    const I sub = L::bits(L::real(magic | c) - L::real(magic));  // c steps, exactly
    I v = L::select(c < L::set(1 << F.m), sub, normal);
    if (F.has_inf) {
      const I special =
          L::select(c == L::set(0x7C), L::set(kInf), L::set(kQuietNaN) | L::shl(c & L::set(1), 21));
      v = L::select(c >= L::set(0x7C), special, v);
    } else {
      v = L::select(c == L::set(0x7F), L::set(kQuietNaN), v);
    }
    return sign | v;
  }

  // The E8M0 byte of the float bits x (see RoundKernels::to_e8m0).
  static I e8m0(const I& x, int offset, bool up) {
    const I a = x & L::set(kAbs);
    const I e = a >> 23;  // the biased exponent: floor(log2 |x|) + 127 for a normal x
    const I mant = a & L::set(0x7FFFFF);
    I b = e - L::set(offset);
    if (up) {
      // Not a power of two: the ceiling is one more. A subnormal is above 2^-127 (byte 0) when its
      // mantissa is above 2^-127's.
      const I one = L::set(1), zero = L::set(0);
      const I inc = L::select(e == zero, L::select(mant > L::set(0x400000), one, zero),
                              L::select(mant == zero, zero, one));
      b = b + inc;
    }
    b = L::select(b < L::set(0), L::set(0), L::select(b > L::set(254), L::set(254), b));
    // Zero (of either sign) is 0x00; a negative, infinite or NaN value has no scale.
    const I negative = L::select(a == L::set(0), L::set(0), (x >> 31) & L::set(1));
    const I bad = L::select(a >= L::set(kInf), L::set(1), negative);
    return L::select(bad == L::set(1), L::set(0xFF), L::select(a == L::set(0), L::set(0), b));
  }

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
    using S = Fp8Rounding<scalar_arch>;
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
    using S = Fp8Rounding<scalar_arch>;
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
    using S = Fp8Rounding<scalar_arch>;
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
      out[i] = static_cast<std::uint8_t>(Fp8Rounding<scalar_arch>::e8m0(src[i], offset, up));
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
