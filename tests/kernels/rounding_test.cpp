// Rounding float32 to bf16, fp16 and tf32: every ISA's kernel against an integer-arithmetic
// reference written differently (decode, compare the remainder with half a quantum, re-encode),
// exhaustively over all 2^32 float bit patterns; against PyTorch's conversions on a committed
// sample; widening over all 2^16 patterns; and the public functions' overflow flag, NaN handling
// and errors.
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
#include "teo/precision.hpp"
#include "teo/rounding.hpp"
#include "teo/safetensors.hpp"

namespace teo {
namespace {

bool is_nan_bits(std::uint32_t u) {
  return (u & 0x7FFFFFFFu) > 0x7F800000u;
}

// Drops the low `drop` bits of u by round to nearest, ties to even, comparing the remainder with
// half of the dropped quantum. NaN: quiet, with the kept payload bits.
std::uint32_t ref_drop(std::uint32_t u, int drop) {
  const std::uint32_t quantum = 1u << drop;
  if (is_nan_bits(u)) return (u | 0x00400000u) & ~(quantum - 1);
  std::uint32_t kept = u >> drop;
  const std::uint32_t rem = u & (quantum - 1);
  if (rem > quantum / 2 || (rem == quantum / 2 && (kept & 1u))) ++kept;  // may carry into inf
  return kept << drop;
}

// float -> fp16 bits: decode the float into an integer significand and a power of two, count
// fp16 quanta (2^(e - 10) in the normal range, 2^-24 below it) with round to nearest even, and
// encode; past 65504 the rounded value is inf.
std::uint16_t ref_fp16(std::uint32_t u) {
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t exp_field = (u >> 23) & 0xFFu;
  const std::uint32_t frac = u & 0x7FFFFFu;
  if (exp_field == 0xFFu) {
    if (frac == 0) return sign | 0x7C00u;                                         // inf
    return static_cast<std::uint16_t>(sign | 0x7E00u | ((frac >> 13) & 0x3FFu));  // quiet NaN
  }
  if (exp_field == 0 && frac == 0) return sign;
  // value = sig * 2^e2 exactly
  const std::uint64_t sig = exp_field ? (frac | 0x800000u) : frac;
  const int e2 = exp_field ? static_cast<int>(exp_field) - 150 : -149;
  // the value's binary exponent: floor(log2(value))
  int top = 63 - std::countl_zero(sig);
  const int e_val = e2 + top;
  const int q = e_val >= -14 ? e_val - 10 : -24;  // log2 of the fp16 quantum there
  const int shift = q - e2;                       // quanta = sig / 2^shift
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
  if (q == -24) return static_cast<std::uint16_t>(sign | n);  // subnormal; 1024 is 2^-14 exactly
  int e = e_val;
  if (n == 2048) {  // rounded up to the next power of two
    n = 1024;
    ++e;
  }
  if (e > 15) return sign | 0x7C00u;
  return static_cast<std::uint16_t>(sign | static_cast<std::uint32_t>(e + 15) << 10 | (n - 1024));
}

// fp16 bits -> float bits, by value: m * 2^-24 or (1024 + m) * 2^(e - 25); NaN quiet.
std::uint32_t ref_fp16_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const int e = (h >> 10) & 0x1F;
  const std::uint32_t m = h & 0x3FFu;
  if (e == 31) return sign | 0x7F800000u | (m << 13) | (m ? 0x00400000u : 0u);
  const double v = e == 0 ? std::ldexp(static_cast<double>(m), -24)
                          : std::ldexp(static_cast<double>(1024 + m), e - 25);
  return sign | std::bit_cast<std::uint32_t>(static_cast<float>(v));
}

std::uint32_t ref_bf16_to_float(std::uint16_t h) {
  const std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  return is_nan_bits(u) ? u | 0x00400000u : u;
}

// Each ISA's round and narrow (to bits, and to float) against the reference on the float bit
// patterns `patterns` (every one when null; float_sweep.hpp); the first few mismatches are
// printed.
void sweep(const std::vector<std::uint32_t>* patterns) {
  ScopedSettings keep;
  set_backend(Backend::simd);
  constexpr std::int64_t kChunk = 1 << 16;
  std::atomic<std::int64_t> mismatches{0};
  std::atomic<int> printed{0};
  const auto isas = supported_isas();
  test::for_float_chunks(patterns, [&](const std::uint32_t* in, std::int64_t n) {
    // one set of buffers per thread, reused by its chunks
    thread_local std::vector<std::uint32_t> want_bf16(kChunk), want_fp16(kChunk), want_tf32(kChunk);
    thread_local std::vector<std::uint16_t> bits_bf16(kChunk), bits_fp16(kChunk), got16(kChunk);
    thread_local std::vector<float> got(kChunk);
    for (std::int64_t i = 0; i < n; ++i) {
      const std::uint32_t u = in[i];
      bits_bf16[i] = static_cast<std::uint16_t>(ref_drop(u, 16) >> 16);
      bits_fp16[i] = ref_fp16(u);
      want_bf16[i] = ref_bf16_to_float(bits_bf16[i]);
      want_fp16[i] = ref_fp16_to_float(bits_fp16[i]);
      want_tf32[i] = ref_drop(u, 13);
    }
    const float* x = reinterpret_cast<const float*>(in);
    const auto report = [&](const char* who, const char* what, std::int64_t i, std::uint32_t g,
                            std::uint32_t w) {
      ++mismatches;
      if (printed++ < 10) {
        ADD_FAILURE() << who << " " << what << " of 0x" << std::hex << in[i] << ": got 0x" << g
                      << ", want 0x" << w;
      }
    };
    for (Isa isa : isas) {
      const auto& k = detail::isa_kernels(isa).rounding;
      for (auto [p, want] :
           {std::pair{Precision::bf16, &bits_bf16}, std::pair{Precision::fp16, &bits_fp16}}) {
        k.narrow(got16.data(), x, n, p);
        if (std::memcmp(got16.data(), want->data(), n * sizeof(std::uint16_t)) == 0) continue;
        for (std::int64_t i = 0; i < n; ++i)
          if (got16[i] != (*want)[i]) report(to_string(isa), to_string(p), i, got16[i], (*want)[i]);
      }
      for (auto [p, want] :
           {std::pair{Precision::bf16, &want_bf16}, std::pair{Precision::fp16, &want_fp16},
            std::pair{Precision::tf32, &want_tf32}}) {
        k.round(got.data(), x, n, p);
        if (std::memcmp(got.data(), want->data(), n * sizeof(float)) == 0) continue;
        for (std::int64_t i = 0; i < n; ++i) {
          const auto g = std::bit_cast<std::uint32_t>(got[i]);
          if (g != (*want)[i]) report(to_string(isa), to_string(p), i, g, (*want)[i]);
        }
      }
    }
    // Core's scalar definitions (teo/precision.hpp), which the kernels' tails call.
    for (std::int64_t i = 0; i < n; ++i) {
      for (auto [p, want] :
           {std::pair{Precision::bf16, &bits_bf16}, std::pair{Precision::fp16, &bits_fp16}}) {
        const std::uint16_t g = to_bits(p, x[i]);
        if (g != (*want)[i]) report("core scalar", to_string(p), i, g, (*want)[i]);
      }
      for (auto [p, want] :
           {std::pair{Precision::bf16, &want_bf16}, std::pair{Precision::fp16, &want_fp16},
            std::pair{Precision::tf32, &want_tf32}}) {
        const auto g = std::bit_cast<std::uint32_t>(round_to(p, x[i]));
        if (g != (*want)[i]) report("core scalar", to_string(p), i, g, (*want)[i]);
      }
    }
  });
  EXPECT_EQ(mismatches.load(), 0);
}

// Every float bit pattern (label exhaustive: scripts/test.sh --full).
TEST(Rounding, EveryFloatRoundsAsTheIntegerReferenceOnEveryIsa) {
  sweep(nullptr);
}

// What CI runs instead: every rounding boundary of every format and 2^24 fresh random floats.
TEST(Rounding, BoundaryAndRandomFloatsRoundAsTheIntegerReferenceOnEveryIsa) {
  const auto patterns = test::boundary_and_random_floats(test::sweep_seed());
  sweep(&patterns);
}

TEST(Rounding, EveryHalfPatternWidensExactlyOnEveryIsa) {
  std::vector<std::uint16_t> h(1 << 16);
  for (std::size_t i = 0; i < h.size(); ++i) h[i] = static_cast<std::uint16_t>(i);
  std::vector<float> out(h.size());
  for (Isa isa : supported_isas()) {
    const auto& k = detail::isa_kernels(isa).rounding;
    for (Precision p : {Precision::bf16, Precision::fp16}) {
      k.widen(out.data(), h.data(), static_cast<index_t>(h.size()), p);
      for (std::size_t i = 0; i < h.size(); ++i) {
        const std::uint32_t want =
            p == Precision::bf16 ? ref_bf16_to_float(h[i]) : ref_fp16_to_float(h[i]);
        ASSERT_EQ(std::bit_cast<std::uint32_t>(out[i]), want)
            << to_string(isa) << " " << to_string(p) << " 0x" << std::hex << h[i];
        ASSERT_EQ(std::bit_cast<std::uint32_t>(from_bits(p, h[i])), want)
            << "core scalar " << to_string(p) << " 0x" << std::hex << h[i];
      }
      // Widening then narrowing gives every pattern back, NaNs quietened.
      std::vector<std::uint16_t> back(h.size());
      k.narrow(back.data(), out.data(), static_cast<index_t>(h.size()), p);
      for (std::size_t i = 0; i < h.size(); ++i) {
        const std::uint16_t quiet = p == Precision::bf16 ? 0x0040 : 0x0200;
        const bool nan = std::isnan(out[i]);
        ASSERT_EQ(back[i], nan ? h[i] | quiet : h[i]) << to_string(p) << " 0x" << std::hex << h[i];
      }
    }
  }
}

// PyTorch's own conversions (tests/interop/rounding_sample.py, committed with its output): the
// same bits on 16384 values, uniform and at the hard places; NaN against NaN counts as equal
// (payloads of signalling NaNs are the hardware's business).
TEST(Rounding, AgreesWithPyTorchOnTheCommittedSample) {
  const auto f =
      safetensors::read(std::string(TEO_SOURCE_DIR) + "/tests/interop/rounding_sample.safetensors");
  const auto x = f.find("input")->values<float>();
  for (auto [name, p] : {std::pair{"bf16", Precision::bf16}, std::pair{"fp16", Precision::fp16}}) {
    const auto& t = *f.find(name);
    ASSERT_EQ(t.bytes.size(), 2 * x.size());
    for (Isa isa : supported_isas()) {
      std::vector<std::uint16_t> got(x.size());
      detail::isa_kernels(isa).rounding.narrow(got.data(), x.data(), static_cast<index_t>(x.size()),
                                               p);
      std::vector<float> gw(x.size()), tw(x.size());
      std::vector<std::uint16_t> want(x.size());
      std::memcpy(want.data(), t.bytes.data(), t.bytes.size());
      from_bits(p, gw.data(), got.data(), static_cast<index_t>(x.size()));
      from_bits(p, tw.data(), want.data(), static_cast<index_t>(x.size()));
      int bad = 0;
      for (std::size_t i = 0; i < x.size(); ++i) {
        if (got[i] == want[i] || (std::isnan(gw[i]) && std::isnan(tw[i]))) continue;
        if (bad++ < 5) {
          ADD_FAILURE() << to_string(isa) << " " << name << " of 0x" << std::hex
                        << std::bit_cast<std::uint32_t>(x[i]) << ": teo 0x" << got[i]
                        << ", torch 0x" << want[i];
        }
      }
      EXPECT_EQ(bad, 0) << to_string(isa) << " " << name;
    }
  }
}

TEST(Rounding, KnownValuesTiesAndRange) {
  // ties go to even: 1 + 2^-8 lies half way between bf16's 1 and 1 + 2^-7
  EXPECT_EQ(round_to(Precision::bf16, 1.0f + 0x1p-8f), 1.0f);
  EXPECT_EQ(round_to(Precision::bf16, 1.0f + 3 * 0x1p-8f), 1.0f + 0x1p-6f);
  EXPECT_EQ(round_to(Precision::tf32, 1.0f + 0x1p-11f), 1.0f);
  EXPECT_EQ(round_to(Precision::tf32, 1.0f + 3 * 0x1p-11f), 1.0f + 0x1p-9f);
  EXPECT_EQ(round_to(Precision::fp16, 65504.0f), 65504.0f);
  EXPECT_EQ(round_to(Precision::fp16, 65519.0f), 65504.0f);
  EXPECT_EQ(round_to(Precision::fp16, -65520.0f), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(round_to(Precision::fp16, 0x1p-24f), 0x1p-24f);  // smallest subnormal
  EXPECT_EQ(round_to(Precision::fp16, 0x1p-25f), 0.0f);      // the tie goes to even (0)
  EXPECT_EQ(round_to(Precision::fp16, 0x1.8p-25f), 0x1p-24f);
  EXPECT_EQ(to_bits(Precision::bf16, 1.0f), 0x3F80);
  EXPECT_EQ(to_bits(Precision::fp16, -2.0f), 0xC000);
  EXPECT_EQ(from_bits(Precision::fp16, 0x0001), 0x1p-24f);
  EXPECT_EQ(from_bits(Precision::bf16, 0xC040), -3.0f);
  // NaN stays NaN, quiet, in every format; the sign is kept
  const float snan = std::bit_cast<float>(0xFF800001u);
  for (Precision p : {Precision::bf16, Precision::fp16, Precision::tf32}) {
    const float r = round_to(p, snan);
    EXPECT_TRUE(std::isnan(r)) << to_string(p);
    EXPECT_TRUE(std::bit_cast<std::uint32_t>(r) & 0x00400000u) << to_string(p);
    EXPECT_TRUE(std::signbit(r)) << to_string(p);
  }
  // fp32 and fp64 leave values alone
  EXPECT_EQ(round_to(Precision::fp32, 1.0f + 0x1p-20f), 1.0f + 0x1p-20f);
}

TEST(Rounding, OverflowIsReportedOnlyForAFiniteValueThatBecomesInfinite) {
  std::vector<float> v = {1.0f, 65504.0f, std::numeric_limits<float>::infinity(), NAN};
  EXPECT_FALSE(round_to(Precision::fp16, v.data(), static_cast<index_t>(v.size())));
  // long enough that the vector body, not only the scalar tail, sees the overflow
  std::vector<float> w(100, 1.0f);
  w[37] = 70000.0f;
  EXPECT_TRUE(round_to(Precision::fp16, w.data(), static_cast<index_t>(w.size())));
  EXPECT_EQ(w[37], std::numeric_limits<float>::infinity());
  std::vector<float> big(100, std::numeric_limits<float>::max());
  EXPECT_FALSE(round_to(Precision::fp16, v.data(), 0));
  EXPECT_TRUE(round_to(Precision::bf16, big.data(), static_cast<index_t>(big.size())));
}

TEST(Rounding, NamesParseAndSixteenBitFormatsAreChecked) {
  for (Precision p : {Precision::fp64, Precision::fp32, Precision::tf32, Precision::bf16,
                      Precision::fp16, Precision::fp8})
    EXPECT_EQ(parse_precision(to_string(p), "--precision"), p);
  test::expect_throw<ConfigError>([] { parse_precision("bfloat16", "--precision"); },
                                  "--precision must be fp64, fp32, tf32, bf16, fp16 or fp8, got "
                                  "\"bfloat16\"");
  float x = 1;
  std::uint16_t h = 0;
  test::expect_throw<ConfigError>([&] { to_bits(Precision::tf32, &h, &x, 1); }, "no 16-bit format");
  EXPECT_DOUBLE_EQ(unit_roundoff(Precision::bf16), 1.0 / 256);
}

}  // namespace
}  // namespace teo
