// Rounding float32 to E4M3 and E5M2 (saturating or not): every ISA's kernel against an
// integer-arithmetic reference written differently (decode, count quanta with round to nearest
// even, re-encode), exhaustively over all 2^32 float bit patterns; E8M0 scales over every class
// of input; widening over all 256 bytes; against ml_dtypes' float8_e4m3fn and float8_e5m2 on a
// committed sample; known values, the overflow flag and the names.
#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernels/float_sweep.hpp"
#include "kernels/kernels_internal.hpp"
#include "support.hpp"
#include "teo/fp8.hpp"
#include "teo/rounding.hpp"
#include "teo/safetensors.hpp"

namespace teo {
namespace {

struct RefFormat {
  int m;     // mantissa bits
  int emin;  // exponent of the smallest normal
  int bias;
  int max_code;  // the largest finite value's code (without the sign)
  bool has_inf;
};
constexpr RefFormat kE4M3{3, -6, 7, 0x7E, false};
constexpr RefFormat kE5M2{2, -14, 15, 0x7B, true};
const RefFormat& ref_format(Fp8Format f) {
  return f == Fp8Format::e4m3 ? kE4M3 : kE5M2;
}

// float -> fp8 byte: the float as an integer significand times a power of two, the count of fp8
// quanta (2^(e - m) in the normal range, 2^(emin - m) below it) rounded to nearest even, encoded.
// The code may lie past the largest finite one (see ref_fp8); infinities give 0x100, NaNs their
// byte.
int ref_code(std::uint32_t u, const RefFormat& F) {
  const std::uint32_t exp_field = (u >> 23) & 0xFFu;
  const std::uint32_t frac = u & 0x7FFFFFu;
  if (exp_field == 0xFFu) {
    if (frac == 0) return 0x100;
    return F.has_inf ? 0x7E | ((frac >> 21) & 1u) : 0x7F;
  }
  if (exp_field == 0 && frac == 0) return 0;
  const std::uint64_t sig = exp_field ? (frac | 0x800000u) : frac;
  const int e2 = exp_field ? static_cast<int>(exp_field) - 150 : -149;
  const int e_val = e2 + (63 - std::countl_zero(sig));
  const bool normal = e_val >= F.emin;
  const int q = normal ? e_val - F.m : F.emin - F.m;
  const int shift = q - e2;
  std::uint64_t n;
  if (shift <= 0) {
    n = sig << -shift;
  } else if (shift >= 64) {
    n = 0;
  } else {
    n = sig >> shift;
    const std::uint64_t rem = sig & ((std::uint64_t{1} << shift) - 1);
    const std::uint64_t half = std::uint64_t{1} << (shift - 1);
    if (rem > half || (rem == half && (n & 1u))) ++n;
  }
  if (!normal) return static_cast<int>(n);  // 2^m is the smallest normal's code
  int e = e_val;
  if (n == (std::uint64_t{2} << F.m)) {
    n >>= 1;
    ++e;
  }
  return std::min(0x100, (e + F.bias) << F.m | static_cast<int>(n - (std::uint64_t{1} << F.m)));
}

// The byte: a NaN's code as it is; a code past the largest finite one (infinities included)
// saturates or overflows (inf for E5M2, NaN for E4M3).
std::uint8_t ref_fp8(std::uint32_t u, int code, const RefFormat& F, bool saturate) {
  const auto sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  if (!nan && code > F.max_code) code = saturate ? F.max_code : (F.has_inf ? 0x7C : 0x7F);
  return static_cast<std::uint8_t>(sign | code);
}

// fp8 byte -> float bits, by value; NaN quiet (E5M2 keeps its low mantissa bit as payload).
std::uint32_t ref_fp8_to_float(std::uint8_t b, const RefFormat& F) {
  const std::uint32_t sign = static_cast<std::uint32_t>(b & 0x80u) << 24;
  const int c = b & 0x7F;
  const int e = c >> F.m;
  const int mant = c & ((1 << F.m) - 1);
  if (!F.has_inf && c == 0x7F) return sign | 0x7FC00000u;
  if (F.has_inf && c == 0x7C) return sign | 0x7F800000u;
  if (F.has_inf && c > 0x7C)
    return sign | 0x7FC00000u | (static_cast<std::uint32_t>(mant & 1) << 21);
  const double v =
      e == 0 ? std::ldexp(mant, F.emin - F.m) : std::ldexp((1 << F.m) + mant, e - F.bias - F.m);
  return sign | std::bit_cast<std::uint32_t>(static_cast<float>(v));
}

// float -> E8M0 byte: the exponent of the value's leading bit (from the significand's bit length,
// so subnormals count too), plus one when `up` and more than that bit is set, less offset; clamped
// to -127 .. 127.
std::uint8_t ref_e8m0(std::uint32_t u, bool up, int offset) {
  const std::uint32_t a = u & 0x7FFFFFFFu;
  if (a >= 0x7F800000u || ((u >> 31) && a != 0)) return 0xFF;
  if (a == 0) return 0;
  const std::uint32_t exp_field = a >> 23;
  const std::uint32_t sig = exp_field ? (a & 0x7FFFFFu) | 0x800000u : a;
  const int e2 = exp_field ? static_cast<int>(exp_field) - 150 : -149;
  const int lead = e2 + 31 - std::countl_zero(sig);
  const int log2 = up && (sig & (sig - 1)) != 0 ? lead + 1 : lead;
  return static_cast<std::uint8_t>(std::clamp(log2 + 127 - offset, 0, 254));
}

// Each ISA's narrow_fp8 and round_fp8 against the reference on the float bit patterns `patterns`
// (every one when null; float_sweep.hpp). Each format's code is computed once per pattern, then
// read saturating and not; the values come from a 256-entry table of ref_fp8_to_float.
void sweep(const std::vector<std::uint32_t>* patterns) {
  ScopedSettings keep;
  set_backend(Backend::simd);
  constexpr std::int64_t kChunk = 1 << 16;
  std::atomic<std::int64_t> mismatches{0};
  std::atomic<int> printed{0};
  const auto isas = supported_isas();
  std::uint32_t value[2][256];
  for (int i = 0; i < 256; ++i) {
    value[0][i] = ref_fp8_to_float(static_cast<std::uint8_t>(i), kE4M3);
    value[1][i] = ref_fp8_to_float(static_cast<std::uint8_t>(i), kE5M2);
  }
  test::for_float_chunks(patterns, [&](const std::uint32_t* in, std::int64_t n) {
    thread_local std::vector<std::uint32_t> want_value(kChunk);
    thread_local std::vector<int> code(kChunk);
    thread_local std::vector<std::uint8_t> want(kChunk), got8(kChunk);
    thread_local std::vector<float> got(kChunk);
    const float* x = reinterpret_cast<const float*>(in);
    const auto report = [&](const char* who, const std::string& what, std::int64_t i,
                            std::uint32_t g, std::uint32_t w) {
      ++mismatches;
      if (printed++ < 10) {
        ADD_FAILURE() << who << " " << what << " of 0x" << std::hex << in[i] << ": got 0x" << g
                      << ", want 0x" << w;
      }
    };
    for (Fp8Format f : {Fp8Format::e4m3, Fp8Format::e5m2}) {
      const RefFormat& F = ref_format(f);
      for (std::int64_t i = 0; i < n; ++i) code[i] = ref_code(in[i], F);
      for (bool sat : {false, true}) {
        for (std::int64_t i = 0; i < n; ++i) {
          want[i] = ref_fp8(in[i], code[i], F, sat);
          want_value[i] = value[f == Fp8Format::e5m2][want[i]];
        }
        const std::string what = std::string(to_string(f)) + (sat ? " saturating" : "");
        for (Isa isa : isas) {
          const auto& k = detail::isa_kernels(isa).rounding;
          k.narrow_fp8(got8.data(), x, n, f, sat);
          if (std::memcmp(got8.data(), want.data(), n) != 0) {
            for (std::int64_t i = 0; i < n; ++i)
              if (got8[i] != want[i]) report(to_string(isa), what + " bits", i, got8[i], want[i]);
          }
          k.round_fp8(got.data(), x, n, f, sat);
          if (std::memcmp(got.data(), want_value.data(), n * sizeof(float)) != 0) {
            for (std::int64_t i = 0; i < n; ++i) {
              const auto g = std::bit_cast<std::uint32_t>(got[i]);
              if (g != want_value[i]) report(to_string(isa), what, i, g, want_value[i]);
            }
          }
        }
        // Core's scalar definitions (teo/fp8.hpp), which the kernels' tails call.
        for (std::int64_t i = 0; i < n; ++i) {
          const std::uint8_t b = to_fp8_bits(f, sat, x[i]);
          if (b != want[i]) report("core scalar", what + " bits", i, b, want[i]);
          const auto g = std::bit_cast<std::uint32_t>(round_to_fp8(f, sat, x[i]));
          if (g != want_value[i]) report("core scalar", what, i, g, want_value[i]);
        }
      }
    }
  });
  EXPECT_EQ(mismatches.load(), 0);
}

// Every float bit pattern (label exhaustive: scripts/test.sh --full).
TEST(Fp8Rounding, EveryFloatRoundsAsTheIntegerReferenceOnEveryIsa) {
  sweep(nullptr);
}

// What CI runs instead: every rounding boundary of every format and 2^24 fresh random floats.
TEST(Fp8Rounding, BoundaryAndRandomFloatsRoundAsTheIntegerReferenceOnEveryIsa) {
  const auto patterns = test::boundary_and_random_floats(test::sweep_seed());
  sweep(&patterns);
}

// E8M0 depends only on a float's sign and exponent and on whether its mantissa is 0, or for a
// subnormal above 2^-127's: every sign and exponent with the mantissas at those boundaries covers
// every case, with offset 0 (to_e8m0) and each format's emax (mx_scale), rounding down and up.
TEST(Fp8Rounding, E8m0OfEverySignExponentAndMantissaClassOnEveryIsa) {
  std::vector<float> x;
  for (std::uint32_t top = 0; top < 512; ++top)
    for (std::uint32_t mant : {0u, 1u, 0x3FFFFFu, 0x400000u, 0x400001u, 0x7FFFFEu, 0x7FFFFFu})
      x.push_back(std::bit_cast<float>(top << 23 | mant));
  std::vector<std::uint8_t> got(x.size());
  for (Isa isa : supported_isas()) {
    for (int offset : {0, fp8_emax(Fp8Format::e4m3), fp8_emax(Fp8Format::e5m2)}) {
      for (bool up : {false, true}) {
        detail::isa_kernels(isa).rounding.to_e8m0(got.data(), x.data(),
                                                  static_cast<index_t>(x.size()), offset, up);
        for (std::size_t i = 0; i < x.size(); ++i) {
          const std::uint8_t want = ref_e8m0(std::bit_cast<std::uint32_t>(x[i]), up, offset);
          ASSERT_EQ(got[i], want) << to_string(isa) << " offset " << offset << (up ? " up" : "")
                                  << " 0x" << std::hex << std::bit_cast<std::uint32_t>(x[i]);
        }
      }
    }
  }
  for (float a : x) {
    for (bool up : {false, true}) {
      EXPECT_EQ(to_e8m0(a, up ? E8m0Rounding::up : E8m0Rounding::down),
                ref_e8m0(std::bit_cast<std::uint32_t>(a), up, 0))
          << "core scalar 0x" << std::hex << std::bit_cast<std::uint32_t>(a);
    }
    if (!(std::isfinite(a) && a >= 0)) continue;
    for (Fp8Format f : {Fp8Format::e4m3, Fp8Format::e5m2}) {
      EXPECT_EQ(mx_scale(a, f), ref_e8m0(std::bit_cast<std::uint32_t>(a), false, fp8_emax(f)));
    }
  }
}

TEST(Fp8Rounding, EveryByteWidensExactlyAndNarrowsBackOnEveryIsa) {
  std::vector<std::uint8_t> b(256);
  for (int i = 0; i < 256; ++i) b[i] = static_cast<std::uint8_t>(i);
  std::vector<float> out(256);
  std::vector<std::uint8_t> back(256);
  for (Isa isa : supported_isas()) {
    const auto& k = detail::isa_kernels(isa).rounding;
    for (Fp8Format f : {Fp8Format::e4m3, Fp8Format::e5m2}) {
      k.widen_fp8(out.data(), b.data(), 256, f);
      for (int i = 0; i < 256; ++i) {
        ASSERT_EQ(std::bit_cast<std::uint32_t>(out[i]), ref_fp8_to_float(b[i], ref_format(f)))
            << to_string(isa) << " " << to_string(f) << " 0x" << std::hex << i;
        ASSERT_EQ(std::bit_cast<std::uint32_t>(from_fp8_bits(f, b[i])),
                  ref_fp8_to_float(b[i], ref_format(f)))
            << "core scalar " << to_string(f) << " 0x" << std::hex << i;
      }
      // Every byte comes back, but E5M2's signalling NaNs, which come back quiet.
      k.narrow_fp8(back.data(), out.data(), 256, f, false);
      for (int i = 0; i < 256; ++i) {
        const bool e5m2_nan = f == Fp8Format::e5m2 && (i & 0x7F) > 0x7C;
        ASSERT_EQ(back[i], e5m2_nan ? (i | 0x02) : i) << to_string(f) << " 0x" << std::hex << i;
      }
    }
  }
}

// ml_dtypes' casts (tests/interop/fp8_sample.py, committed with its output; they do not
// saturate): the same bytes on 16384 values, uniform and at the hard places. NaN against NaN
// counts as equal.
TEST(Fp8Rounding, AgreesWithMlDtypesOnTheCommittedSample) {
  const auto file =
      safetensors::read(std::string(TEO_SOURCE_DIR) + "/tests/interop/fp8_sample.safetensors");
  const auto x = file.find("input")->values<float>();
  ASSERT_EQ(x.size(), 16384u);
  for (Fp8Format f : {Fp8Format::e4m3, Fp8Format::e5m2}) {
    const auto& t = *file.find(to_string(f));
    ASSERT_EQ(t.bytes.size(), x.size());
    for (Isa isa : supported_isas()) {
      std::vector<std::uint8_t> got(x.size());
      detail::isa_kernels(isa).rounding.narrow_fp8(got.data(), x.data(),
                                                   static_cast<index_t>(x.size()), f, false);
      int bad = 0;
      for (std::size_t i = 0; i < x.size(); ++i) {
        const auto want = static_cast<std::uint8_t>(t.bytes[i]);
        const bool both_nan =
            std::isnan(from_fp8_bits(f, got[i])) && std::isnan(from_fp8_bits(f, want));
        if (got[i] == want || both_nan) continue;
        if (bad++ < 5) {
          ADD_FAILURE() << to_string(isa) << " " << to_string(f) << " of 0x" << std::hex
                        << std::bit_cast<std::uint32_t>(x[i]) << ": teo 0x" << int{got[i]}
                        << ", ml_dtypes 0x" << int{want};
        }
      }
      EXPECT_EQ(bad, 0) << to_string(isa) << " " << to_string(f);
    }
  }
}

TEST(Fp8Rounding, KnownValuesTiesRangeAndNaN) {
  constexpr auto e4 = Fp8Format::e4m3;
  constexpr auto e5 = Fp8Format::e5m2;
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(fp8_max(e4), 448.0f);
  EXPECT_EQ(fp8_max(e5), 57344.0f);
  // ties to even: 1 + 2^-4 lies half way between E4M3's 1 and 1.125
  EXPECT_EQ(round_to_fp8(e4, false, 1.0f + 0x1p-4f), 1.0f);
  EXPECT_EQ(round_to_fp8(e4, false, 1.0f + 3 * 0x1p-4f), 1.25f);
  EXPECT_EQ(round_to_fp8(e5, false, 1.0f + 0x1p-3f), 1.0f);
  // E4M3's top: 464 is the tie between 448 and (unrepresentable) 480
  EXPECT_EQ(round_to_fp8(e4, false, 464.0f), 448.0f);
  EXPECT_TRUE(std::isnan(round_to_fp8(e4, false, 464.5f)));
  EXPECT_EQ(round_to_fp8(e4, true, 464.5f), 448.0f);
  EXPECT_EQ(round_to_fp8(e4, true, -inf), -448.0f);
  EXPECT_TRUE(std::isnan(round_to_fp8(e4, false, inf)));
  // E5M2's: 61440 is the tie between 57344 and 65536 (inf), and goes to even (inf)
  EXPECT_EQ(round_to_fp8(e5, false, 61439.0f), 57344.0f);
  EXPECT_EQ(round_to_fp8(e5, false, 61440.0f), inf);
  EXPECT_EQ(round_to_fp8(e5, true, 61440.0f), 57344.0f);
  EXPECT_EQ(round_to_fp8(e5, false, -inf), -inf);
  EXPECT_EQ(round_to_fp8(e5, true, inf), 57344.0f);
  // subnormals: E4M3 steps of 2^-9, E5M2 of 2^-16; the tie at half a step goes to 0
  EXPECT_EQ(round_to_fp8(e4, false, 0x1p-10f), 0.0f);
  EXPECT_EQ(round_to_fp8(e4, false, 0x1.8p-10f), 0x1p-9f);
  EXPECT_EQ(round_to_fp8(e4, false, 0x1.cp-7f), 0x1.cp-7f);  // 7 steps: the largest subnormal
  EXPECT_EQ(round_to_fp8(e5, false, 0x1p-16f), 0x1p-16f);
  EXPECT_EQ(round_to_fp8(e5, false, 0x1p-17f), 0.0f);
  // bytes
  EXPECT_EQ(to_fp8_bits(e4, false, 1.0f), 0x38);
  EXPECT_EQ(to_fp8_bits(e4, false, -448.0f), 0xFE);
  EXPECT_EQ(to_fp8_bits(e4, false, 0x1p-9f), 0x01);
  EXPECT_EQ(to_fp8_bits(e5, false, 1.0f), 0x3C);
  EXPECT_EQ(to_fp8_bits(e5, false, -inf), 0xFC);
  EXPECT_EQ(from_fp8_bits(e4, 0x7E), 448.0f);
  EXPECT_EQ(from_fp8_bits(e5, 0x7B), 57344.0f);
  EXPECT_TRUE(std::isnan(from_fp8_bits(e4, 0xFF)));
  EXPECT_EQ(from_fp8_bits(e5, 0x7C), inf);
  // NaN stays NaN with its sign, quiet, saturating or not
  const float snan = std::bit_cast<float>(0xFF800001u);
  for (Fp8Format f : {e4, e5}) {
    for (bool sat : {false, true}) {
      const float r = round_to_fp8(f, sat, snan);
      EXPECT_TRUE(std::isnan(r) && std::signbit(r)) << to_string(f);
      EXPECT_TRUE(std::bit_cast<std::uint32_t>(r) & 0x00400000u) << to_string(f);
    }
  }
  EXPECT_DOUBLE_EQ(unit_roundoff(e4), 1.0 / 16);
  EXPECT_DOUBLE_EQ(unit_roundoff(e5), 1.0 / 8);
}

TEST(Fp8Rounding, OverflowIsReportedOnlyForAFiniteValueThatBecomesInfOrNaN) {
  std::vector<float> v = {1.0f, 448.0f, std::numeric_limits<float>::infinity(), NAN};
  EXPECT_FALSE(round_to_fp8(Fp8Format::e4m3, false, v.data(), 2));
  std::vector<float> w(100, 1.0f);
  w[37] = 500.0f;  // in the vector body, not only the scalar tail
  std::vector<float> w2 = w;
  EXPECT_TRUE(round_to_fp8(Fp8Format::e4m3, false, w.data(), 100));
  EXPECT_TRUE(std::isnan(w[37]));
  EXPECT_FALSE(round_to_fp8(Fp8Format::e4m3, true, w2.data(), 100));
  EXPECT_EQ(w2[37], 448.0f);
  std::vector<float> big(3, 1e5f);
  EXPECT_TRUE(round_to_fp8(Fp8Format::e5m2, false, big.data(), 3));     // the scalar tail
  EXPECT_FALSE(round_to_fp8(Fp8Format::e5m2, false, v.data() + 2, 2));  // inf and NaN were so
}

TEST(Fp8Rounding, E8m0ScalesAndTheMxRule) {
  EXPECT_EQ(to_e8m0(1.0f, E8m0Rounding::down), 127);
  EXPECT_EQ(to_e8m0(3.0f, E8m0Rounding::down), 128);
  EXPECT_EQ(to_e8m0(3.0f, E8m0Rounding::up), 129);
  EXPECT_EQ(to_e8m0(4.0f, E8m0Rounding::up), 129);
  EXPECT_EQ(to_e8m0(0.0f, E8m0Rounding::up), 0);
  EXPECT_EQ(to_e8m0(-0.0f, E8m0Rounding::down), 0);
  EXPECT_EQ(to_e8m0(-1.0f, E8m0Rounding::down), 0xFF);
  EXPECT_EQ(to_e8m0(std::numeric_limits<float>::max(), E8m0Rounding::up), 254);  // clamped
  EXPECT_EQ(to_e8m0(0x1p-127f, E8m0Rounding::up), 0);
  EXPECT_EQ(to_e8m0(0x1.8p-127f, E8m0Rounding::up), 1);
  EXPECT_EQ(e8m0_value(127), 1.0f);
  EXPECT_EQ(e8m0_value(0), 0x1p-127f);
  EXPECT_EQ(e8m0_value(254), 0x1p127f);
  EXPECT_TRUE(std::isnan(e8m0_value(0xFF)));
  // OCP: X = 2^(floor(log2 amax) - emax); amax / X then lies in [2^emax, 2^(emax + 1))
  EXPECT_EQ(e8m0_value(mx_scale(1.0f, Fp8Format::e4m3)), 0x1p-8f);
  EXPECT_EQ(e8m0_value(mx_scale(500.0f, Fp8Format::e4m3)), 1.0f);  // 500 / 1 saturates to 448
  EXPECT_EQ(e8m0_value(mx_scale(512.0f, Fp8Format::e4m3)), 2.0f);
  EXPECT_EQ(e8m0_value(mx_scale(1.0f, Fp8Format::e5m2)), 0x1p-15f);
  EXPECT_EQ(mx_scale(0.0f, Fp8Format::e4m3), 0);
  EXPECT_EQ(mx_scale(NAN, Fp8Format::e4m3), 0xFF);
}

TEST(Fp8Rounding, NamesParse) {
  for (Fp8Format f : {Fp8Format::e4m3, Fp8Format::e5m2})
    EXPECT_EQ(parse_fp8_format(to_string(f), "fp8_format"), f);
  for (Fp8Scaling s : {Fp8Scaling::tensor, Fp8Scaling::block, Fp8Scaling::mx})
    EXPECT_EQ(parse_fp8_scaling(to_string(s), "fp8_scaling"), s);
  test::expect_throw<ConfigError>([] { parse_fp8_format("e4m3fn", "fp8_format"); },
                                  "fp8_format must be e4m3 or e5m2, got \"e4m3fn\"");
  test::expect_throw<ConfigError>([] { parse_fp8_scaling("row", "fp8_scaling"); },
                                  "fp8_scaling must be tensor, block or mx, got \"row\"");
}

}  // namespace
}  // namespace teo
