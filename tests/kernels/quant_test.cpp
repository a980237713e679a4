// GGUF's block types (teo/quant.hpp): each dequantization against a plain loop written here from
// the layout alone (each value found by its own index, not by the library's loops), the same bits
// over threads and backends, quantizing idempotent where every block scale is normal, and named
// errors for invalid blocks.
#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "support.hpp"
#include "teo/backend.hpp"
#include "teo/dequant.hpp"
#include "teo/errors.hpp"
#include "teo/precision.hpp"
#include "teo/quant.hpp"

namespace {

using teo::quant::GgmlType;

float half(const std::uint8_t* p) {
  // fp16 by its definition: sign, 5-bit exponent (bias 15), 10-bit fraction; subnormals below.
  const int h = p[0] | p[1] << 8;
  const int e = (h >> 10) & 0x1F, m = h & 0x3FF;
  const double v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return static_cast<float>((h & 0x8000) ? -v : v);
}

int nibble(const std::uint8_t* bytes, int index) {  // 4-bit field `index` of a byte array
  return (bytes[index / 2] >> (4 * (index % 2))) & 0xF;
}

int bit(const std::uint8_t* bytes, int index) {
  return (bytes[index / 8] >> (index % 8)) & 1;
}

// The 6-bit scale and min of K sub-block s: scales for 0-3 are the low 6 bits of bytes 0-3, mins
// of bytes 4-7; for 4-7 the low (scale) and high (min) nibbles of bytes 8-11 below the top 2 bits
// of bytes 0-3 (scale) and 4-7 (min).
void k_scale(const std::uint8_t* s, int sb, int& sc, int& m) {
  if (sb < 4) {
    sc = s[sb] % 64;
    m = s[sb + 4] % 64;
  } else {
    sc = s[sb + 4] % 16 + (s[sb - 4] / 64) * 16;
    m = s[sb + 4] / 16 + (s[sb] / 64) * 16;
  }
}

const int kE2m1Twice[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Value e of a block, from the layout in docs/quantization.md, in float32 arithmetic.
float reference(GgmlType t, const std::uint8_t* b, int e) {
  const auto f = [](int v) { return static_cast<float>(v); };
  switch (t) {
    case GgmlType::q4_0:  // values 0-15 the low nibbles of bytes 2-17, 16-31 the high nibbles
      return f(((b[2 + e % 16] >> (e / 16 * 4)) & 0xF) - 8) * half(b);
    case GgmlType::q4_1:
      return f((b[4 + e % 16] >> (e / 16 * 4)) & 0xF) * half(b) + half(b + 2);
    case GgmlType::q5_0:  // the fifth bit of value e is bit e of the 32-bit qh
      return f(((b[6 + e % 16] >> (e / 16 * 4)) & 0xF) + 16 * bit(b + 2, e) - 16) * half(b);
    case GgmlType::q5_1:
      return f(((b[8 + e % 16] >> (e / 16 * 4)) & 0xF) + 16 * bit(b + 4, e)) * half(b) +
             half(b + 2);
    case GgmlType::q8_0:
      return f(static_cast<std::int8_t>(b[2 + e])) * half(b);
    case GgmlType::q4_k:
    case GgmlType::q5_k: {
      // Sub-block sb = e / 32; the 32-byte group e / 64 holds sub-block 2k in its low nibbles and
      // 2k + 1 in its high ones; Q5_K's fifth bit of value e is bit sb of qh[e % 32].
      const bool five = t == GgmlType::q5_k;
      const int sb = e / 32;
      int sc = 0, m = 0;
      k_scale(b + 4, sb, sc, m);
      const std::uint8_t* qs = b + (five ? 48 : 16);
      int q = (qs[32 * (sb / 2) + e % 32] >> (4 * (sb % 2))) & 0xF;
      if (five) q += 16 * ((b[16 + e % 32] >> sb) & 1);
      return (half(b) * f(sc)) * f(q) - half(b + 2) * f(m);
    }
    case GgmlType::q6_k: {
      // Half h = e / 128; within it, quarter k = (e % 128) / 32 and l = e % 32: the low 4 bits
      // are nibble (k / 2) of ql[64h + 32(k % 2) + l], the high 2 bits are bits 2k, 2k+1 of
      // qh[32h + l]; the scale is the signed byte (e / 16) of scales.
      const int h = e / 128, k = (e % 128) / 32, l = e % 32;
      const int lo = (b[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0xF;
      const int hi = (b[128 + 32 * h + l] >> (2 * k)) & 3;
      const auto sc = static_cast<std::int8_t>(b[192 + e / 16]);
      return half(b + 208) * f(sc) * f(lo + 16 * hi - 32);
    }
    case GgmlType::mxfp4:  // 2^(e8m0 - 127) times the E2M1 value
      return static_cast<float>(
          std::ldexp(kE2m1Twice[nibble(b + 1, (e % 16) * 2 + e / 16)] * 0.5, b[0] - 127));
    case GgmlType::nvfp4: {  // sub-block s = e / 16: scale byte s, then 8 bytes of nibbles
      const int s = e / 16, j = e % 16;
      const int code = nibble(b + 4 + 8 * s, (j % 8) * 2 + j / 8);
      const int x = b[s], ex = x >> 3, man = x & 7;
      const double scale = ex == 0 ? std::ldexp(man, -9) : std::ldexp(8 + man, ex - 10);
      return static_cast<float>(kE2m1Twice[code] * 0.5 * scale);
    }
    case GgmlType::f32: {
      float v = 0;
      std::memcpy(&v, b, 4);
      return v;
    }
    case GgmlType::f16:
      return half(b);
    case GgmlType::bf16:
      return std::bit_cast<float>(static_cast<std::uint32_t>(b[0] << 16 | b[1] << 24));
  }
  return NAN;
}

// `count` random valid blocks of t: every byte drawn, the scales drawn finite.
std::vector<std::uint8_t> random_blocks(GgmlType t, int count, std::mt19937& rng) {
  const auto shape = teo::quant::block_shape(t);
  std::vector<std::uint8_t> v(static_cast<std::size_t>(count * shape.bytes));
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& x : v) x = static_cast<std::uint8_t>(byte(rng));
  for (int k = 0; k < count; ++k) {
    std::uint8_t* b = v.data() + k * shape.bytes;
    for (int tries = 0; !teo::quant::check_block(t, b).empty(); ++tries) {
      if (tries >= 1000) throw std::runtime_error("no valid block");
      for (int j = 0; j < shape.bytes; ++j) b[j] = static_cast<std::uint8_t>(byte(rng));
    }
  }
  return v;
}

TEST(GgufBlocks, EveryTypeDequantizesAsAPlainLoopWrittenFromItsLayout) {
  std::mt19937 rng(52);
  for (GgmlType t : teo::quant::ggml_types()) {
    const auto shape = teo::quant::block_shape(t);
    const int count = 400;
    const auto blocks = random_blocks(t, count, rng);
    std::vector<float> got(static_cast<std::size_t>(count * shape.values));
    teo::dequantize(t, blocks.data(), static_cast<std::int64_t>(got.size()), got.data());
    int bad = 0;
    for (int k = 0; k < count && bad < 5; ++k) {
      for (int e = 0; e < shape.values; ++e) {
        const float want = reference(t, blocks.data() + k * shape.bytes, e);
        const float g = got[static_cast<std::size_t>(k * shape.values + e)];
        if (std::bit_cast<std::uint32_t>(want) != std::bit_cast<std::uint32_t>(g)) {
          ADD_FAILURE() << teo::quant::to_string(t) << " block " << k << " value " << e << ": got "
                        << g << ", want " << want;
          if (++bad == 5) break;
        }
      }
    }
  }
}

TEST(GgufBlocks, ThreadCountsChangeNoBit) {
  teo::ScopedSettings keep;
  std::mt19937 rng(7);
  for (GgmlType t : teo::quant::ggml_types()) {
    const auto shape = teo::quant::block_shape(t);
    const int count = 3000;  // several tasks' worth
    const auto blocks = random_blocks(t, count, rng);
    const auto n = static_cast<std::int64_t>(count) * shape.values;
    std::vector<float> one(static_cast<std::size_t>(n));
    for (int k = 0; k < count; ++k) {
      teo::quant::dequantize_block(t, blocks.data() + k * shape.bytes,
                                   one.data() + static_cast<std::size_t>(k * shape.values));
    }
    // The quantizer's blocks one at a time, for comparing with the threaded run.
    std::vector<float> x(one.size());
    std::mt19937 draw(5);
    std::normal_distribution<float> normal;
    for (auto& e : x) e = normal(draw);
    std::vector<std::uint8_t> q1(blocks.size());
    for (int k = 0; k < count; ++k) {
      teo::quant::quantize_block(t, x.data() + static_cast<std::size_t>(k * shape.values),
                                 q1.data() + k * shape.bytes);
    }
    teo::set_backend(teo::Backend::simd);  // the reference backend runs one task
    for (int threads : {1, 2, 3}) {
      teo::set_num_threads(threads);
      std::vector<float> got(one.size());
      teo::dequantize(t, blocks.data(), n, got.data());
      EXPECT_EQ(std::memcmp(got.data(), one.data(), one.size() * sizeof(float)), 0)
          << teo::quant::to_string(t) << " with " << threads << " threads";
      std::vector<std::uint8_t> q(blocks.size());
      teo::quantize(t, x.data(), n, q.data());
      EXPECT_EQ(q, q1) << teo::quant::to_string(t) << " with " << threads << " threads";
    }
  }
}

// Whether every scale of block b is a normal number (or zero, for a block of zeros).
bool scales_normal(GgmlType t, const std::uint8_t* b) {
  const auto normal16 = [](const std::uint8_t* p) {
    const int h = p[0] | p[1] << 8;
    return (h & 0x7FFF) == 0 || (h & 0x7C00) != 0;
  };
  switch (t) {
    case GgmlType::q4_1:
    case GgmlType::q5_1:
      return normal16(b) && normal16(b + 2);
    case GgmlType::q4_0:
    case GgmlType::q5_0:
    case GgmlType::q8_0:
      return normal16(b);
    case GgmlType::nvfp4:
      for (int s = 0; s < 4; ++s)
        if (b[s] != 0 && (b[s] >> 3) == 0) return false;
      return true;
    default:
      return true;
  }
}

// Quantizing what a quantization gave gives the same bytes back, where every block scale is a
// normal number: the types whose quantizer is a function of the block's peak. At least 90% of the
// blocks (magnitudes 2^-2 to 2^8) have normal scales, so the property is judged on most of them.
TEST(GgufBlocks, QuantizingDequantizedValuesGivesTheSameBytes) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> scale(-2.0f, 8.0f);
  for (GgmlType t : {GgmlType::q8_0, GgmlType::q4_0, GgmlType::q4_1, GgmlType::q5_0, GgmlType::q5_1,
                     GgmlType::mxfp4, GgmlType::nvfp4, GgmlType::f16, GgmlType::bf16}) {
    const auto shape = teo::quant::block_shape(t);
    const int count = 2000;
    std::vector<float> x(static_cast<std::size_t>(count * shape.values));
    for (int k = 0; k < count; ++k) {
      const float s = std::exp2(scale(rng));  // block magnitudes from 2^-2 to 2^8
      for (int e = 0; e < shape.values; ++e) x[k * shape.values + e] = normal(rng) * s;
    }
    const auto n = static_cast<std::int64_t>(x.size());
    std::vector<std::uint8_t> q(static_cast<std::size_t>(count * shape.bytes)), again(q.size());
    std::vector<float> v(x.size());
    teo::quantize(t, x.data(), n, q.data());
    teo::dequantize(t, q.data(), n, v.data());
    teo::quantize(t, v.data(), n, again.data());
    int bad = 0, judged = 0;
    for (int k = 0; k < count && bad < 3; ++k) {
      if (!scales_normal(t, q.data() + k * shape.bytes)) continue;
      ++judged;
      if (std::memcmp(q.data() + k * shape.bytes, again.data() + k * shape.bytes, shape.bytes)) {
        ADD_FAILURE() << teo::quant::to_string(t) << ": block " << k << " changed";
        ++bad;
      }
    }
    EXPECT_GE(judged, count * 9 / 10) << teo::quant::to_string(t);
  }
}

// NVFP4's documented exception: a block whose peak is so small that its E4M3 scale is subnormal
// is not idempotent. Peak 0.01875: the scale 0.003125 rounds to 2 * 2^-9 and the peak to 4 of
// those (0.015625); quantizing that picks the scale 2^-9, under which the peak saturates at 6.
TEST(GgufBlocks, NvFp4WithASubnormalScaleIsNotIdempotent) {
  std::vector<float> x(64, 0.0f);
  x[0] = 0.01875f;
  x[1] = 0.005f;
  std::vector<std::uint8_t> q(36), again(36);
  std::vector<float> v(64), w(64);
  teo::quant::quantize_block(GgmlType::nvfp4, x.data(), q.data());
  teo::quant::dequantize_block(GgmlType::nvfp4, q.data(), v.data());
  teo::quant::quantize_block(GgmlType::nvfp4, v.data(), again.data());
  teo::quant::dequantize_block(GgmlType::nvfp4, again.data(), w.data());
  EXPECT_LT(q[0], 8) << "the scale is subnormal (exponent field 0)";
  EXPECT_NE(q[0], again[0]);
  EXPECT_NE(v[0], w[0]);
}

TEST(GgufBlocks, InvalidBlocksAndValuesAreNamed) {
  std::vector<std::uint8_t> b(34, 0);
  b[0] = 0x00;
  b[1] = 0x7C;  // +inf
  EXPECT_EQ(teo::quant::check_block(GgmlType::q8_0, b.data()),
            "its F16 scale d is 0x7c00, which is not finite");
  std::vector<std::uint8_t> k(144, 0);
  k[2] = 0x01;
  k[3] = 0xFE;  // NaN dmin
  EXPECT_NE(teo::quant::check_block(GgmlType::q4_k, k.data()).find("dmin is 0xfe01"),
            std::string::npos);
  std::vector<std::uint8_t> mx(17, 0);
  mx[0] = 0xFF;
  EXPECT_NE(teo::quant::check_block(GgmlType::mxfp4, mx.data()).find("0xff"), std::string::npos);
  std::vector<std::uint8_t> nv(36, 0);
  nv[2] = 0x7F;
  EXPECT_NE(teo::quant::check_block(GgmlType::nvfp4, nv.data()).find("scale 2 is 0x7f"),
            std::string::npos);
  nv[2] = 0x80;
  EXPECT_FALSE(teo::quant::check_block(GgmlType::nvfp4, nv.data()).empty());
  std::string why;
  std::vector<std::uint8_t> rows(34 * 3, 0);
  rows[34 * 2 + 1] = 0x7E;
  EXPECT_EQ(teo::quant::first_invalid_block(GgmlType::q8_0, rows.data(), 3, why), 2);
  std::vector<float> x(32, 1.0f);
  x[3] = NAN;
  std::vector<std::uint8_t> out(34);
  EXPECT_THROW(teo::quant::quantize_block(GgmlType::q8_0, x.data(), out.data()), teo::InputError);
  x[3] = 1e9f;  // d = 1e9 / 127 is beyond F16
  EXPECT_THROW(teo::quant::quantize_block(GgmlType::q8_0, x.data(), out.data()), teo::InputError);
  EXPECT_THROW(teo::dequantize(GgmlType::q4_k, rows.data(), 100, x.data()), teo::ShapeError);
  EXPECT_THROW(teo::quant::row_bytes(GgmlType::q4_k, 128, "w"), teo::ShapeError);
  EXPECT_EQ(teo::quant::row_bytes(GgmlType::q4_k, 512, "w"), 288u);
  EXPECT_THROW(teo::quant::parse_ggml_type("Q3_K", "--type"), teo::ConfigError);
  EXPECT_STREQ(teo::quant::ggml_type_name(16), "IQ2_XXS");
}

TEST(GgufBlocks, E2m1CodesAreOcpsAndLlamaCppsTablesDouble) {
  const float want[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int c = 0; c < 16; ++c) {
    const float v = teo::quant::e2m1_value(c);
    EXPECT_EQ(std::fabs(v), want[c % 8]) << c;
    EXPECT_EQ(std::signbit(v), c >= 8) << c << ": code 8 is -0 in OCP's E2M1";
    EXPECT_EQ(static_cast<float>(teo::quant::e2m1_twice(c)), 2 * v) << c;
  }
}

}  // namespace
