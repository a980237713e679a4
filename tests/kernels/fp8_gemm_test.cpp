// Quantizing operands to fp8 (per tensor, per block, OCP MX) and the fp8 product: scales as the
// recipes define them, results against plain loops written here from docs/fp8.md's model, the
// same bits on every thread count and ISA, the limited-precision accumulator's effect at large k,
// and the errors.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "support.hpp"
#include "teo/backend.hpp"
#include "teo/fp8.hpp"
#include "teo/rounding.hpp"

namespace teo {
namespace {

using test::uniform_vector;

Fp8Quantization recipe(Fp8Scaling s, index_t block_rows = 1, Fp8Format f = Fp8Format::e4m3) {
  Fp8Quantization q;
  q.format = f;
  q.scaling = s;
  q.block_rows = block_rows;
  q.block_k = 128;
  return q;
}

float block_amax(const std::vector<float>& x, index_t k, index_t r0, index_t r1, index_t p0,
                 index_t p1) {
  float m = 0;
  for (index_t r = r0; r < r1; ++r)
    for (index_t p = p0; p < p1; ++p) m = std::max(m, std::fabs(x[r * k + p]));
  return m;
}

TEST(Fp8Quantize, TensorScalingMapsTheAmaxTo448AndRoundsEveryValue) {
  const index_t rows = 7, k = 45;
  auto x = uniform_vector<float>(rows * k, 1, "x", -3, 3);
  x[17] = -9.5f;
  const auto o = quantize_fp8(x.data(), rows, k, k, false, recipe(Fp8Scaling::tensor), "x");
  ASSERT_EQ(o.scale.size(), 1u);
  EXPECT_EQ(o.scale[0], 9.5f / 448.0f);
  EXPECT_EQ(o.q[17], -448.0f);
  for (index_t i = 0; i < rows * k; ++i) {
    EXPECT_EQ(round_to_fp8(Fp8Format::e4m3, false, o.q[i]), o.q[i]);  // an E4M3 value
    // within half an ulp of E4M3 (2^-4 relative) or half a subnormal step (2^-10), scaled
    const double err = std::fabs(double(o.q[i]) * o.scale[0] - x[i]);
    EXPECT_LE(err, std::fabs(x[i]) / 16 * 1.0001 + 0x1p-10 * o.scale[0]) << i;
  }
}

// An amax so small that 448 / amax overflows float (below 448 / FLT_MAX, about 1.3e-36, a normal
// float): the multiplier is clamped and the scale is its reciprocal, so q * scale stays x.
TEST(Fp8Quantize, ATinyAmaxKeepsQTimesScaleEqualToTheValue) {
  for (const float amax : {1e-37f, 1e-39f, 1e-40f}) {
    const std::vector<float> x = {amax, -amax / 2, 0.0f};
    const auto o = quantize_fp8(x.data(), 1, 3, 3, false, recipe(Fp8Scaling::tensor), "x");
    ASSERT_EQ(o.scale.size(), 1u);
    EXPECT_GT(o.scale[0], 0.0f) << amax;
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double back = double(o.q[i]) * o.scale[0];
      EXPECT_LE(std::fabs(back - x[i]), std::fabs(x[i]) / 16 * 1.0001) << amax << " " << i;
    }
  }
}

TEST(Fp8Quantize, BlockScalingScalesEachBlockByItsOwnAmax) {
  const index_t rows = 5, k = 300;  // blocks of 2 x 128: 3 x 3, the last ones partial
  auto x = uniform_vector<float>(rows * k, 2, "x");
  for (index_t p = 128; p < 256; ++p) x[0 * k + p] = x[1 * k + p] = 0;  // a block of zeros
  x[4 * k + 299] = 40.0f;
  const auto o = quantize_fp8(x.data(), rows, k, k, false, recipe(Fp8Scaling::block, 2), "x");
  ASSERT_EQ(o.scale.size(), 9u);
  for (index_t br = 0; br < 3; ++br) {
    for (index_t bk = 0; bk < 3; ++bk) {
      const float amax = block_amax(x, k, br * 2, std::min(rows, br * 2 + 2), bk * 128,
                                    std::min(k, bk * 128 + 128));
      EXPECT_EQ(o.scale[br * 3 + bk], amax > 0 ? amax / 448.0f : 1.0f) << br << "," << bk;
    }
  }
  EXPECT_EQ(o.q[4 * k + 299], 448.0f);
  EXPECT_EQ(o.q[0 * k + 130], 0.0f);
  // Transposed storage quantizes the same operand.
  std::vector<float> xt(x.size());
  for (index_t r = 0; r < rows; ++r)
    for (index_t p = 0; p < k; ++p) xt[p * rows + r] = x[r * k + p];
  const auto t = quantize_fp8(xt.data(), rows, k, rows, true, recipe(Fp8Scaling::block, 2), "x");
  EXPECT_EQ(t.q, o.q);
  EXPECT_EQ(t.scale, o.scale);
}

TEST(Fp8Quantize, MxScalesArePowersOfTwoPerThirtyTwoValuesAndSaturate) {
  const index_t rows = 3, k = 70;
  auto x = uniform_vector<float>(rows * k, 3, "x", -1, 1);
  x[5] = 1.99f;  // block (0, 0): X = 2^(0 - 8); 1.99 / X = 509.4 saturates to 448
  const auto o = quantize_fp8(x.data(), rows, k, k, false, recipe(Fp8Scaling::mx), "x");
  EXPECT_EQ(o.block_rows, 1);
  EXPECT_EQ(o.block_k, 32);
  ASSERT_EQ(o.scale.size(), 9u);
  for (index_t r = 0; r < rows; ++r) {
    for (index_t b = 0; b < 3; ++b) {
      const float amax = block_amax(x, k, r, r + 1, b * 32, std::min(k, b * 32 + 32));
      int e = 0;
      std::frexp(amax, &e);  // floor(log2 amax) = e - 1
      EXPECT_EQ(o.scale[r * 3 + b], std::ldexp(1.0f, e - 1 - 8)) << r << "," << b;
    }
  }
  EXPECT_EQ(o.q[5], 448.0f);
}

TEST(Fp8Quantize, DelayedScalesAreUsedAsGivenAndBadOnesAreNamed) {
  const index_t rows = 2, k = 4;
  std::vector<float> x = {1, 2, 3, 4, -5, 6, 7, 8};
  auto how = recipe(Fp8Scaling::tensor);
  const auto o = quantize_fp8(x.data(), rows, k, k, false, how, {0.5f}, "x");
  EXPECT_EQ(o.q[4], -10.0f);
  test::expect_throw<ConfigError>(
      [&] {
        quantize_fp8(x.data(), rows, k, k, false, how, {1.0f, 1.0f}, "layers.0.x");
      },
      "layers.0.x: 1 fp8 scale(s) needed (1 x 1 blocks), got 2");
  test::expect_throw<ConfigError>(
      [&] { quantize_fp8(x.data(), rows, k, k, false, how, {-1.0f}, "x"); }, "fp8 scale 0 is -1");
  how.saturate = false;
  test::expect_throw<RangeError>(
      [&] { quantize_fp8(x.data(), rows, k, k, false, how, {0.01f}, "layers.0.x"); },
      "layers.0.x: a scaled value overflowed e4m3");
  how.saturate = true;
  EXPECT_EQ(quantize_fp8(x.data(), rows, k, k, false, how, {0.01f}, "x").q[7], 448.0f);
  x[3] = NAN;
  test::expect_throw<RangeError>(
      [&] { quantize_fp8(x.data(), rows, k, k, false, how, "grad.layers.0.h"); },
      "grad.layers.0.h: holds a non-finite value");
  test::expect_throw<ConfigError>(
      [&] { quantize_fp8(x.data(), rows, k, k, false, recipe(Fp8Scaling::block, 0), "x"); },
      "an fp8 scale block must be at least 1 x 1, got 0 x 128");
}

// The product by docs/fp8.md's model, plainly: per k block, a float32 chain of the products
// q_a * q_b, times fl(s_a * s_b), summed in float32; mx: one chain of (q_a 2^e_a) (q_b 2^e_b).
std::vector<float> model_product(const Fp8Operand& a, const Fp8Operand& b) {
  const index_t m = a.rows, n = b.rows, k = a.k;
  std::vector<float> c(static_cast<std::size_t>(m * n));
  const bool mx = a.scaling == Fp8Scaling::mx;
  const index_t bk = mx ? k : a.block_k;
  for (index_t i = 0; i < m; ++i) {
    for (index_t j = 0; j < n; ++j) {
      float total = 0;
      for (index_t k0 = 0; k0 < k; k0 += bk) {
        float sum = 0;
        for (index_t p = k0; p < std::min(k, k0 + bk); ++p) {
          float x = a.q[i * k + p], y = b.q[j * k + p];
          if (mx) {
            x *= a.scale[i * a.scale_cols() + p / 32];
            y *= b.scale[j * b.scale_cols() + p / 32];
          }
          sum = std::fma(x, y, sum);
        }
        if (!mx) {
          sum *= a.scale[(i / a.block_rows) * a.scale_cols() + k0 / bk] *
                 b.scale[(j / b.block_rows) * b.scale_cols() + k0 / bk];
        }
        total = k0 == 0 ? sum : total + sum;
      }
      c[i * n + j] = total;
    }
  }
  return c;
}

struct Operands {
  Fp8Operand a, b;
};
Operands operands(Fp8Scaling s, index_t m, index_t n, index_t k, std::uint64_t seed, double lo = -1,
                  double hi = 1) {
  const auto x = uniform_vector<float>(m * k, seed, "a", lo, hi);
  const auto w = uniform_vector<float>(n * k, seed, "b", lo, hi);
  return {quantize_fp8(x.data(), m, k, k, false, recipe(s, 1), "a"),
          quantize_fp8(w.data(), n, k, k, false, recipe(s, 128), "b")};
}

std::vector<float> product(const Operands& o, const Fp8Accumulation& acc) {
  std::vector<float> c(static_cast<std::size_t>(o.a.rows * o.b.rows), NAN);
  fp8_gemm(o.a, o.b, c.data(), o.b.rows, acc);
  return c;
}

bool same_bits(const std::vector<float>& x, const std::vector<float>& y) {
  return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
}

TEST(Fp8Gemm, Float32AccumulationIsTheModelsSumBitForBit) {
  for (Fp8Scaling s : {Fp8Scaling::tensor, Fp8Scaling::block, Fp8Scaling::mx}) {
    const auto o = operands(s, 13, 9, 300, 4);
    EXPECT_TRUE(same_bits(product(o, {}), model_product(o.a, o.b))) << to_string(s);
  }
}

TEST(Fp8Gemm, SameBitsOnEveryThreadCountAndIsa) {
  for (Fp8Scaling s : {Fp8Scaling::tensor, Fp8Scaling::block, Fp8Scaling::mx}) {
    for (bool limited : {false, true}) {
      const auto o = operands(s, 37, 21, 260, 5);
      Fp8Accumulation acc;
      acc.limited = limited;
      std::vector<float> first;
      for (Isa isa : supported_isas()) {
        for (int threads : {1, 2, 3}) {
          ScopedSettings keep;
          set_isa(isa);
          set_num_threads(threads);
          const auto c = product(o, acc);
          if (first.empty()) first = c;
          EXPECT_TRUE(same_bits(c, first)) << to_string(s) << (limited ? " limited " : " fp32 ")
                                           << to_string(isa) << " " << threads << " thread(s)";
        }
      }
    }
  }
}

TEST(Fp8Gemm, LimitedAccumulationPromotedAfterEveryProductIsTheFloat32Sum) {
  // Each partial sum is one exact fp8 product, so the float32 accumulator sees what the fp32 path
  // sums, in the same order.
  for (Fp8Scaling s : {Fp8Scaling::tensor, Fp8Scaling::block, Fp8Scaling::mx}) {
    const auto o = operands(s, 6, 5, 333, 6);
    Fp8Accumulation every;
    every.limited = true;
    every.promote_every = 1;
    EXPECT_TRUE(same_bits(product(o, every), product(o, {}))) << to_string(s);
  }
}

// The limited model written with frexp and ldexp instead of bit masks.
double ref_chop(double v, int bits) {
  if (v == 0) return 0;
  int e = 0;
  const double f = std::frexp(v, &e);
  return std::ldexp(std::trunc(std::ldexp(f, bits + 1)), e - bits - 1);
}

TEST(Fp8Gemm, LimitedAccumulationTruncatesAsTheModelSays) {
  const auto o = operands(Fp8Scaling::block, 4, 3, 700, 7);
  for (index_t promote : {0, 64, 128, 200}) {
    Fp8Accumulation acc{true, 10, promote};
    const auto c = product(o, acc);
    const index_t k = o.a.k;
    for (index_t i = 0; i < 4; ++i) {
      for (index_t j = 0; j < 3; ++j) {
        float total = 0;
        for (index_t k0 = 0; k0 < k; k0 += 128) {
          const index_t k1 = std::min(k, k0 + 128), seg = promote ? promote : 128;
          float block = 0;
          for (index_t s0 = k0; s0 < k1; s0 += seg) {
            double part = 0;
            for (index_t p = s0; p < std::min(k1, s0 + seg); ++p)
              part = ref_chop(part + double(o.a.q[i * k + p]) * o.b.q[j * k + p], 10);
            block += static_cast<float>(part);
          }
          const float v = block * (o.a.scale[i * o.a.scale_cols() + k0 / 128] *
                                   o.b.scale[0 * o.b.scale_cols() + k0 / 128]);
          total = k0 == 0 ? v : total + v;
        }
        EXPECT_EQ(c[i * 3 + j], total) << "promote " << promote << " (" << i << "," << j << ")";
      }
    }
  }
}

// DeepSeek-V3's finding, reproduced: with a 14-bit accumulator and positive products, a sum over
// k = 4096 without promotion loses about 2^-15 of the sum at every step; promoting every 128
// products bounds that to 128 steps.
TEST(Fp8Gemm, WithoutPromotionALimitedAccumulatorFailsAtLargeK) {
  const index_t m = 4, n = 4, k = 4096;
  const auto o = operands(Fp8Scaling::tensor, m, n, k, 8, 0.0, 1.0);
  // The truth: the exact sum of the quantized operands' products, in double.
  std::vector<double> exact(static_cast<std::size_t>(m * n));
  for (index_t i = 0; i < m; ++i)
    for (index_t j = 0; j < n; ++j) {
      double s = 0;
      for (index_t p = 0; p < k; ++p) s += double(o.a.q[i * k + p]) * o.b.q[j * k + p];
      exact[i * n + j] = s * o.a.scale[0] * o.b.scale[0];
    }
  const auto rel_err = [&](const std::vector<float>& c) {
    double worst = 0;
    for (std::size_t i = 0; i < c.size(); ++i)
      worst = std::max(worst, std::fabs(c[i] - exact[i]) / std::fabs(exact[i]));
    return worst;
  };
  const double fp32 = rel_err(product(o, {}));
  const double promoted = rel_err(product(o, {true, 14, 128}));
  const double never = rel_err(product(o, {true, 14, 0}));
  std::printf("k 4096: relative error fp32 %.2e, limited promoted every 128 %.2e, never %.2e\n",
              fp32, promoted, never);
  EXPECT_LT(fp32, 1e-5);
  EXPECT_LT(promoted, 4e-3);
  EXPECT_GT(never, 2e-2);
  EXPECT_GT(never, 10 * promoted);
}

TEST(Fp8Gemm, MismatchedOperandsAndSettingsAreNamedErrors) {
  const auto o = operands(Fp8Scaling::block, 2, 2, 64, 9);
  const auto t = operands(Fp8Scaling::tensor, 2, 2, 64, 9);
  const auto short_k = operands(Fp8Scaling::block, 2, 2, 32, 9);
  float c[4];
  test::expect_throw<ShapeError>([&] { fp8_gemm(o.a, short_k.b, c, 2, {}); },
                                 "the operands' k differ (64 and 32)");
  test::expect_throw<ConfigError>([&] { fp8_gemm(o.a, t.b, c, 2, {}); },
                                  "one operand is scaled by block, the other by tensor");
  auto b64 = o.b;
  b64.block_k = 64;
  test::expect_throw<ShapeError>([&] { fp8_gemm(o.a, b64, c, 2, {}); },
                                 "scale blocks span 128 and 64 values of k");
  test::expect_throw<ConfigError>(
      [&] {
        fp8_gemm(o.a, o.b, c, 2, {true, 0, 128});
      },
      "keeps 1 to 23 mantissa bits, got 0");
  // k = 0: every output is 0
  const auto empty = operands(Fp8Scaling::tensor, 2, 2, 0, 9);
  std::fill(c, c + 4, NAN);
  fp8_gemm(empty.a, empty.b, c, 2, {});
  for (float v : c) EXPECT_EQ(v, 0.0f);
}

// A caller-built operand that quantize_fp8 could not have built is a named error before any
// value is read: without the checks each of these read past q or the scales, or divided by 0.
TEST(Fp8Gemm, AMalformedOperandIsANamedErrorBeforeAnyRead) {
  const auto o = operands(Fp8Scaling::block, 2, 3, 200, 9);  // b: 128 x 128 blocks, 1 x 2
  const auto mx = operands(Fp8Scaling::mx, 2, 3, 64, 9);
  const auto t = operands(Fp8Scaling::tensor, 2, 3, 64, 9);
  float c[6];
  const auto expect = [&](const Fp8Operand& a, const Fp8Operand& b, const std::string& needle,
                          bool config = false) {
    if (config) {
      test::expect_throw<ConfigError>([&] { fp8_gemm(a, b, c, 3, {}); }, needle);
    } else {
      test::expect_throw<ShapeError>([&] { fp8_gemm(a, b, c, 3, {}); }, needle);
    }
  };
  auto bad = o.a;
  bad.q.pop_back();
  expect(bad, o.b, "operand a holds 399 values; its rows x k is 2 x 200");
  bad = o.b;
  bad.scale.pop_back();
  expect(o.a, bad, "operand b holds 1 scale(s); its 1 x 2 blocks need 2");
  bad = o.a;
  bad.block_rows = 0;
  expect(bad, o.b, "operand a's scale block is 0 x 128; a block is at least 1 x 1");
  bad = mx.b;
  bad.block_k = 16;
  bad.scale.resize(bad.scale.size() * 2, 1.0f);
  expect(mx.a, bad, "operand b's scale block is 1 x 16; under mx scaling it is 1 x 32");
  bad = t.a;
  bad.block_k = 32;
  bad.scale.resize(2, 1.0f);
  expect(bad, t.b, "operand a is scaled per tensor, but its scale block 2 x 32 does not cover");
  bad = o.b;
  bad.scale[1] = 0.0f;
  expect(o.a, bad, "operand b's scale 1 is 0.000000; a scale must be finite and positive", true);
  bad = o.a;
  bad.scale[0] = NAN;
  expect(bad, o.b, "operand a's scale 0 is nan", true);
  bad = t.b;
  bad.rows = -1;
  expect(t.a, bad, "operand b has a negative size, -1 x 64");
  // The well-formed operands still multiply.
  EXPECT_NO_THROW(fp8_gemm(o.a, o.b, c, 3, {}));
}

}  // namespace
}  // namespace teo
