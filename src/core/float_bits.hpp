// The bit definitions of the reduced float formats: rounding float32 to bf16, tf32, fp16 and the
// OCP 8-bit formats E4M3 and E5M2, widening them back, and E8M0 scales. Each is written once over
// "lanes" L of 32-bit integers holding a float's bits (and float lanes for the exact float
// additions of the subnormals): ScalarLanes here for one value, the ISAs' vectors in the kernels'
// array loops (src/kernels/simd/round_kernels.hpp). The same integer operations run on every ISA,
// so every ISA gives these scalar bits. The templates are in an unnamed namespace because each
// per-ISA translation unit compiles them for its own instruction set.
#pragma once

#include <bit>
#include <cstdint>

#include "teo/fp8.hpp"

namespace teo::bits {
namespace {

// One lane: plain int32_t and float. The kernels' vector lanes (simd/round_kernels.hpp) have the
// same operations over xsimd batches.
struct ScalarLanes {
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

constexpr std::int32_t kQuietNaN = 0x7FC00000;

template <class L>
struct FloatBits {
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
};

template <class L>
struct Fp8Bits {
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
    const I normal = FloatBits<L>::round_drop(x, 23 - F.m) & L::set(kAbs);
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

  // The E8M0 byte of the float bits x (2^(byte - 127); 0xFF is NaN): floor(log2 |x|), or its
  // ceiling when `up`, less `offset`, clamped to 0 .. 254. Zero gives 0; a negative, infinite or
  // NaN value gives 0xFF.
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
};

using Scalar = FloatBits<ScalarLanes>;
using ScalarFp8 = Fp8Bits<ScalarLanes>;

}  // namespace
}  // namespace teo::bits
