// The safetensors formats of quantized weights (teo/quant_formats.hpp): weights packed here by hand
// from each format's description dequantize to the values the description gives, teo's quantizer
// round-trips within each format's step and is idempotent where the issue says it must be, every
// broken checkpoint is a named error, and the swizzled scale layout is CUTLASS's formula.
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "teo/errors.hpp"
#include "teo/quant_formats.hpp"

namespace {

namespace q = teo::quant;
using teo::safetensors::DType;
using teo::safetensors::Tensor;

template <class T>
Tensor tensor(const std::string& name, DType d, std::vector<std::int64_t> shape,
              const std::vector<T>& v) {
  Tensor t;
  t.name = name;
  t.dtype = d;
  t.shape = std::move(shape);
  t.bytes.resize(v.size() * sizeof(T));
  std::memcpy(t.bytes.data(), v.data(), t.bytes.size());
  return t;
}

std::uint16_t f16(float x) {  // exact for the small dyadic values used here
  if (x == 0.5f) return 0x3800;
  if (x == 0.25f) return 0x3400;
  return 0x3C00;  // 1.0
}

// GPTQ by hand: 8 rows (out) x 16 columns (in), 2 groups of 8 columns. q(c, r) = (c + 3r) % 16,
// stored zero z(g, r) = r + g (so v1's zero is r + g + 1), scale 0.5 in group 0 and 0.25 in 1.
q::Packed gptq_by_hand(bool g_idx_reversed) {
  std::vector<std::int32_t> qweight(2 * 8, 0), qzeros(2 * 1, 0), g_idx(16);
  for (int c = 0; c < 16; ++c) {
    for (int r = 0; r < 8; ++r) {
      const auto v = static_cast<std::uint32_t>((c + 3 * r) % 16);
      qweight[(c / 8) * 8 + r] = static_cast<std::int32_t>(
          static_cast<std::uint32_t>(qweight[(c / 8) * 8 + r]) | v << (4 * (c % 8)));
    }
    g_idx[c] = g_idx_reversed ? 1 - c / 8 : c / 8;
  }
  for (int g = 0; g < 2; ++g)
    for (int r = 0; r < 8; ++r)
      qzeros[g] = static_cast<std::int32_t>(static_cast<std::uint32_t>(qzeros[g]) |
                                            static_cast<std::uint32_t>(r + g) << (4 * r));
  std::vector<std::uint16_t> scales(2 * 8);
  for (int r = 0; r < 8; ++r) {
    scales[r] = f16(0.5f);
    scales[8 + r] = f16(0.25f);
  }
  q::Packed p;
  p.format = q::TensorFormat::gptq;
  p.parts["qweight"] = tensor("w.qweight", DType::I32, {2, 8}, qweight);
  p.parts["qzeros"] = tensor("w.qzeros", DType::I32, {2, 1}, qzeros);
  p.parts["scales"] = tensor("w.scales", DType::F16, {2, 8}, scales);
  p.parts["g_idx"] = tensor("w.g_idx", DType::I32, {16}, g_idx);
  return p;
}

TEST(QuantFormats, GptqPackedByHandDequantizesAsItsDescription) {
  for (bool reversed : {false, true}) {
    const auto p = gptq_by_hand(reversed);
    ASSERT_EQ(q::dequantized_shape(p, "w"), (std::vector<std::int64_t>{8, 16}));
    for (int offset : {1, 0}) {
      q::Dequantize d;
      d.zero_offset = offset;
      const auto w = q::dequantize(p, "w", d);
      for (int r = 0; r < 8; ++r)
        for (int c = 0; c < 16; ++c) {
          const int g = reversed ? 1 - c / 8 : c / 8;
          const double want = (g == 0 ? 0.5 : 0.25) * ((c + 3 * r) % 16 - (r + g + offset));
          EXPECT_EQ(w[r * 16 + c], want) << r << " " << c << " offset " << offset;
        }
    }
  }
}

TEST(QuantFormats, AwqPackedByHandDequantizesInItsInterleavedOrder) {
  // 8 rows x 8 columns, one group: nibble k of qweight[c] holds row 0 2 4 6 1 3 5 7 [k].
  const int order[8] = {0, 2, 4, 6, 1, 3, 5, 7};
  std::vector<std::int32_t> qweight(8, 0), qzeros(1, 0);
  for (int c = 0; c < 8; ++c)
    for (int k = 0; k < 8; ++k) {
      const int r = order[k];
      qweight[c] =
          static_cast<std::int32_t>(static_cast<std::uint32_t>(qweight[c]) |
                                    static_cast<std::uint32_t>((r * 8 + c) % 16) << (4 * k));
    }
  for (int k = 0; k < 8; ++k)
    qzeros[0] = static_cast<std::int32_t>(static_cast<std::uint32_t>(qzeros[0]) |
                                          static_cast<std::uint32_t>(order[k]) << (4 * k));
  q::Packed p;
  p.format = q::TensorFormat::awq;
  p.parts["qweight"] = tensor("w.qweight", DType::I32, {8, 1}, qweight);
  p.parts["qzeros"] = tensor("w.qzeros", DType::I32, {1, 1}, qzeros);
  p.parts["scales"] = tensor("w.scales", DType::F16, {1, 8}, std::vector<std::uint16_t>(8, 0x3800));
  const auto w = q::dequantize(p, "w");
  for (int r = 0; r < 8; ++r)
    for (int c = 0; c < 8; ++c) EXPECT_EQ(w[r * 8 + c], 0.5 * ((r * 8 + c) % 16 - r)) << r << c;
  for (int j = 0; j < 8; ++j) EXPECT_EQ(q::awq_column_at_nibble(q::awq_nibble_of_column(j)), j);
}

TEST(QuantFormats, Fp4AndInt8PackedByHandDequantizeAsTheirDescriptions) {
  // MXFP4: one block; byte 0 = codes 1 (low, value 0) and 8 (high, value 1: -0), scale 2^1.
  std::vector<std::uint8_t> blocks(16, 0), scales = {128};
  blocks[0] = 0x81;
  blocks[1] = 0x7F;  // values 2 and 3: codes 15 (-6, low) and 7 (6, high)
  q::Packed mx;
  mx.format = q::TensorFormat::mxfp4;
  mx.parts["blocks"] = tensor("e_blocks", DType::U8, {1, 1, 16}, blocks);
  mx.parts["scales"] = tensor("e_scales", DType::U8, {1, 1}, scales);
  const auto m = q::dequantize(mx, "e");
  EXPECT_EQ(m[0], 1.0);
  EXPECT_EQ(m[1], 0.0);
  EXPECT_TRUE(std::signbit(m[1])) << "E2M1 code 8 is -0";
  EXPECT_EQ(m[2], -12.0);
  EXPECT_EQ(m[3], 12.0);
  // NVFP4: byte 0x2F = codes 15 (low: -6) and 2 (high: 1); E4M3 0x38 = 1.0; global 0.375.
  std::vector<std::uint8_t> w(8, 0), s = {0x38};
  w[0] = 0x2F;
  q::Packed nv;
  nv.format = q::TensorFormat::nvfp4;
  nv.parts["weight"] = tensor("n.weight", DType::U8, {1, 8}, w);
  nv.parts["weight_scale"] = tensor("n.weight_scale", DType::F8_E4M3, {1, 1}, s);
  nv.parts["weight_scale_2"] =
      tensor("n.weight_scale_2", DType::F32, {}, std::vector<float>{0.375f});
  const auto n = q::dequantize(nv, "n");
  EXPECT_EQ(n[0], -2.25);
  EXPECT_EQ(n[1], 0.375);
  // int8: the exact product of the code and the F32 scale, in float64.
  q::Packed i8;
  i8.format = q::TensorFormat::int8;
  i8.parts["weight"] =
      tensor("i.weight", DType::I8, {2, 2}, std::vector<std::int8_t>{-127, 1, 5, 0});
  i8.parts["weight_scale"] =
      tensor("i.weight_scale", DType::F32, {2, 1}, std::vector<float>{0.1f, 3.0f});
  const auto v = q::dequantize(i8, "i");
  EXPECT_EQ(v[0], -127.0 * static_cast<double>(0.1f));
  EXPECT_EQ(v[2], 15.0);
}

std::vector<double> normal(std::size_t n, std::uint32_t seed, double scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> d(0, scale);
  std::vector<double> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

TEST(QuantFormats, QuantizeRoundTripsWithinTheStepAndIsIdempotentWhereItMustBe) {
  const std::vector<std::int64_t> shape = {16, 64};
  const auto w = normal(16 * 64, 3, 0.05);
  for (auto f : {q::TensorFormat::int8, q::TensorFormat::gptq, q::TensorFormat::awq,
                 q::TensorFormat::mxfp4, q::TensorFormat::nvfp4}) {
    q::Quantize how;
    how.group_size = 32;
    how.act_order = f == q::TensorFormat::gptq;
    const auto p = q::quantize(f, w, shape, how);
    const auto v = q::dequantize(p, "w");
    ASSERT_EQ(v.size(), w.size());
    double worst = 0, amax = 0;
    for (std::size_t i = 0; i < w.size(); ++i) {
      worst = std::max(worst, std::fabs(v[i] - w[i]));
      amax = std::max(amax, std::fabs(w[i]));
    }
    // int8's step is amax / 127; 4-bit codes' at most a quarter of their block's range.
    EXPECT_LT(worst, f == q::TensorFormat::int8 ? amax / 127 : amax / 4) << q::to_string(f);
    EXPECT_GT(worst, 0) << q::to_string(f);
    if (f == q::TensorFormat::gptq || f == q::TensorFormat::awq) continue;  // not idempotent
    const auto again = q::quantize(f, v, shape, how);
    for (const auto& [role, t] : p.parts)
      EXPECT_EQ(again.parts.at(role).bytes, t.bytes) << q::to_string(f) << " " << role;
  }
}

TEST(QuantFormats, BrokenCheckpointsAreNamedErrors) {
  const auto expect_error = [](const q::Packed& p, const std::string& what, int offset = 1) {
    try {
      q::Dequantize d;
      d.zero_offset = offset;
      q::dequantize(p, "layer.w", d);
      ADD_FAILURE() << "accepted; expected " << what;
    } catch (const teo::FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  auto p = gptq_by_hand(false);
  expect_error(p, "zero offset is 1 (v1 checkpoints) or 0", 2);
  auto bad = p;
  bad.parts.erase("qzeros");
  expect_error(bad, "gptq needs its qzeros");
  bad = p;
  bad.parts["g_idx"] = tensor("w.g_idx", DType::I32, {16}, std::vector<std::int32_t>(16, 2));
  expect_error(bad, "w.g_idx[0] is 2, outside the 2 groups");
  bad = p;
  bad.parts["scales"] =
      tensor("w.scales", DType::F16, {2, 8}, std::vector<std::uint16_t>(16, 0x7C00));
  expect_error(bad, "not a finite scale");
  bad = p;
  bad.parts["qweight"].dtype = DType::F32;
  expect_error(bad, "w.qweight is F32, expected I32");
  q::Packed mx;
  mx.format = q::TensorFormat::mxfp4;
  mx.parts["blocks"] = tensor("e_blocks", DType::U8, {1, 1, 16}, std::vector<std::uint8_t>(16));
  mx.parts["scales"] = tensor("e_scales", DType::U8, {1, 1}, std::vector<std::uint8_t>{0xFF});
  expect_error(mx, "e_scales element 0 is 0xff");
  mx.parts["scales"] = tensor("e_scales", DType::U8, {1, 2}, std::vector<std::uint8_t>{0, 0});
  expect_error(mx, "expected [1, 1]");
  mx.parts["scales"].bytes.pop_back();
  expect_error(mx, "e_scales holds 1 bytes, not the 2 elements of its shape");
  const auto nv = q::quantize(q::TensorFormat::nvfp4, normal(32, 1, 1), {1, 32});
  auto nan = nv;
  nan.parts["weight_scale"].bytes[1] = 0x7F;
  expect_error(nan, "not a finite scale");
  auto vec = nv;
  vec.parts["weight_scale_2"] = tensor("g", DType::F32, {2}, std::vector<float>{1, 1});
  expect_error(vec, "expected a scalar");
  EXPECT_THROW(q::quantize(q::TensorFormat::gptq, normal(8 * 12, 1, 1), {8, 12}), teo::ShapeError);
  EXPECT_THROW(q::quantize(q::TensorFormat::int8, {}, {4, 0}), teo::ShapeError);
  // A v1 checkpoint's stored zero of 15 (AutoGPTQ wraps 15 + 1 to 0, exllama reads 16).
  bad = p;
  bad.parts["qzeros"] = tensor("w.qzeros", DType::I32, {2, 1}, std::vector<std::int32_t>{0xF, 0});
  expect_error(bad, "stores a zero of 15, which a v1 checkpoint cannot mean");
  bad.parts["qzeros"].bytes.pop_back();
  expect_error(bad, "holds 7 bytes, not the 2 elements of its shape");
  // Without g_idx, the quantization config's group size decides the groups.
  bad = p;
  bad.parts.erase("g_idx");
  q::Dequantize d;
  d.group_size = 8;
  EXPECT_EQ(q::dequantize(bad, "w", d), q::dequantize(p, "w"));
  d.group_size = 4;
  try {
    q::dequantize(bad, "w", d);
    ADD_FAILURE() << "a group size of 4 over 16 columns is 4 groups, not 2";
  } catch (const teo::FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("are not the scales' 2 groups"), std::string::npos);
  }
  EXPECT_THROW(q::parse_tensor_format("gguf", "--format"), teo::ConfigError);
}

TEST(QuantFormats, CheckpointsAreFoundByTheirNames) {
  teo::safetensors::File f;
  const auto add = [&](const std::string& prefix, const q::Packed& p) {
    for (const auto& [role, t] : p.parts)
      f.add(q::tensor_name(p.format, prefix, role), t.dtype, t.shape, t.bytes.data(),
            t.bytes.size());
  };
  add("model.layers.0.q_proj", q::quantize(q::TensorFormat::int8, normal(64, 2, 1), {8, 8}));
  const std::vector<float> plain(4, 1.0f);
  f.add("model.norm.weight", std::vector<std::int64_t>{4}, plain.data(), plain.size());
  const auto found = q::find_packed(f, q::TensorFormat::int8);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found.begin()->first, "model.layers.0.q_proj");
  add("model.layers.1.up", q::quantize(q::TensorFormat::int8, normal(64, 2, 1), {8, 8}));
  EXPECT_EQ(q::find_packed(f, q::TensorFormat::int8).size(), 2u);
  f.add("model.layers.1.up.weight_zero_point", std::vector<std::int64_t>{4}, plain.data(), 4);
  EXPECT_THROW(q::find_packed(f, q::TensorFormat::int8), teo::FormatError);
  teo::safetensors::File partial;
  q::Quantize how;
  how.group_size = 32;
  const auto p = q::quantize(q::TensorFormat::gptq, normal(8 * 32, 2, 1), {8, 32}, how);
  partial.add("x.qweight", DType::I32, p.parts.at("qweight").shape,
              p.parts.at("qweight").bytes.data(), p.parts.at("qweight").bytes.size());
  EXPECT_THROW(q::find_packed(partial, q::TensorFormat::gptq), teo::FormatError);
  EXPECT_EQ(q::tensor_name(q::TensorFormat::mxfp4, "mlp.experts.down_proj", "blocks"),
            "mlp.experts.down_proj_blocks");
}

TEST(QuantFormats, SwizzledScalesFollowCutlasss128x4Layout) {
  const long rows = 130, cols = 6;  // padded to 256 x 8
  std::vector<std::uint8_t> s(static_cast<std::size_t>(rows * cols));
  for (std::size_t i = 0; i < s.size(); ++i) s[i] = static_cast<std::uint8_t>(1 + i % 251);
  const auto z = q::swizzle_128x4(s, rows, cols);
  ASSERT_EQ(z.size(), 256u * 8u);
  // (r, c) = (33, 5): tile row 0, column tile 1 (512), r % 32 = 1 (16), (r % 128) / 32 = 1 (4), c
  // % 4.
  EXPECT_EQ(z[512 + 16 + 4 + 1], s[33 * cols + 5]);
  // (129, 0): the second row of tiles starts at 128 * 8.
  EXPECT_EQ(z[128 * 8 + 16], s[129 * cols + 0]);
  // Independently: vLLM's swizzle_blockscale is the padded matrix reshaped (M/128, 4, 32, K/4, 4)
  // and permuted (0, 3, 2, 1, 4); walking that order gives each stored byte its (r, c).
  std::size_t at = 0;
  for (long mt = 0; mt < 2; ++mt)
    for (long kt = 0; kt < 2; ++kt)
      for (long b = 0; b < 32; ++b)
        for (long a = 0; a < 4; ++a)
          for (long c = 0; c < 4; ++c, ++at) {
            const long r = mt * 128 + a * 32 + b, col = kt * 4 + c;
            const std::uint8_t want = r < rows && col < cols ? s[r * cols + col] : 0;
            ASSERT_EQ(z[at], want) << r << " " << col;
          }
  EXPECT_EQ(q::unswizzle_128x4(z, rows, cols), s);
  std::size_t zeros = 0;
  for (auto b : z) zeros += b == 0;
  EXPECT_EQ(zeros, z.size() - s.size()) << "the padding is zeros";
  EXPECT_THROW(q::unswizzle_128x4(s, rows, cols), teo::ShapeError);
}

}  // namespace
