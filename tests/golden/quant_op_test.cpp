// The linear op with a quantized weight (docs/golden-format.md, "Quantized weights"): the case
// holds the packed tensors as a checkpoint names and stores them, output.weight_dequant is the
// format's exact values and is judged with no tolerance, a dequantization bug is named at it with
// its row and block before the product, the product is x W^T + b of the dequantized weight, and
// bad specs and bad packings are refused by name.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "check_support.hpp"
#include "golden/ops/quantize_case.hpp"
#include "teo/dequant.hpp"
#include "teo/fp8.hpp"
#include "teo/golden.hpp"
#include "teo/golden_ops.hpp"
#include "teo/precision.hpp"
#include "teo/quant_formats.hpp"

namespace {

namespace st = teo::safetensors;
namespace golden = teo::golden;
using golden::Status;
using golden::test_support::result;
using nlohmann::json;
using teo::index_t;
using teo::golden::test_support::find_mut;

golden::OpCase linear(json j, const std::string& dtype = "float32") {
  j["op"] = "linear";
  j["dtype"] = dtype;
  if (!j.contains("seed")) j["seed"] = 9;
  return golden::OpCase::from_json(j);
}

// Every format, with the sizes its blocks need: (spec keys, the block a planted bug is put in,
// the words its location names).
struct Format {
  json keys;
  std::string where;
};
std::vector<Format> formats() {
  std::vector<Format> out = {
      {{{"weight_format", "int8"}}, "row 2, column 40 (the row's scale)"},
      {{{"weight_format", "gptq"}, {"group_size", 32}, {"act_order", true}},
       "row 2, column 40 (its group is g_idx[40])"},
      {{{"weight_format", "gptq"}, {"group_size", 32}, {"zero_offset", 0}},
       "row 2, column 40: group 1 of the row (columns 32 to 63)"},
      {{{"weight_format", "awq"}, {"group_size", 32}},
       "row 2, column 40: group 1 of the row (columns 32 to 63)"},
      {{{"weight_format", "mxfp4"}}, "row 2, column 40: block 1 of the row (columns 32 to 63)"},
      {{{"weight_format", "nvfp4"}}, "row 2, column 40: block 2 of the row (columns 32 to 47)"},
  };
  for (const char* t : {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4", "NVFP4"}) {
    const bool n = std::string(t) == "NVFP4";
    out.push_back({{{"weight_format", std::string("gguf:") + t}},
                   std::string("row 2, column 40: block ") + (n ? "0" : "1") + " of the row " +
                       (n ? "(columns 0 to 63)" : "(columns 32 to 63)")});
  }
  for (const char* t : {"Q4_K", "Q5_K", "Q6_K"}) {
    const bool q6 = std::string(t) == "Q6_K";
    out.push_back({{{"weight_format", std::string("gguf:") + t}, {"in_features", 256}},
                   std::string("row 2, column 40: block 0 of the row (columns 0 to 255), ") +
                       (q6 ? "sub-block 2 (columns 32 to 47)" : "sub-block 1 (columns 32 to 63)")});
  }
  for (auto& f : out) {
    f.keys["rows"] = 5;
    f.keys["out_features"] = 8;
    if (!f.keys.contains("in_features")) f.keys["in_features"] = 64;
  }
  return out;
}

void set_values(st::Tensor& t, const std::vector<double>& v) {
  if (t.dtype == st::DType::F32) {
    const std::vector<float> x(v.begin(), v.end());
    std::memcpy(t.bytes.data(), x.data(), x.size() * 4);
  } else {
    std::memcpy(t.bytes.data(), v.data(), v.size() * 8);
  }
}

// The candidate a faithful backend writes: the golden's results.
st::File results_of(const st::File& g) {
  st::File c;
  for (const auto& t : g.tensors)
    if (t.name.starts_with("output.") || t.name.starts_with("grad.input.") ||
        t.name.starts_with("grad.param."))
      c.tensors.push_back(t);
  return c;
}

TEST(QuantizedLinear, EveryFormatPassesItselfAndAWrongValueFailsAtWeightDequantNamingItsBlock) {
  for (const auto& f : formats()) {
    SCOPED_TRACE(f.keys.dump());
    const st::File g = golden::make_op(linear(f.keys));
    st::File c = results_of(g);
    auto rep = golden::check(g, c, {});
    EXPECT_EQ(rep.failed, 0);
    EXPECT_EQ(result(rep, "output.weight_dequant").status, Status::pass);
    EXPECT_EQ(golden::verdict({rep}, /*require_all=*/true).exit_code, 0);
    // One value off by its own last bit, in row 2, column 40: named there, before the product.
    st::File bad = c;
    auto* d = find_mut(bad, "output.weight_dequant");
    auto v = d->float_values();
    const std::size_t at = 2 * 64 + 40 + (f.keys["in_features"] == 256 ? 2 * 192 : 0);
    v[at] = std::nextafter(static_cast<float>(v[at]), 1.0f);
    set_values(*d, v);
    rep = golden::check(g, bad, {});
    EXPECT_EQ(rep.first_divergence, "output.weight_dequant");
    const auto& r = result(rep, "output.weight_dequant");
    EXPECT_EQ(r.status, Status::fail);
    EXPECT_NE(r.message.find("1 of "), std::string::npos) << r.message;
    EXPECT_NE(r.message.find(f.where), std::string::npos) << r.message;
    // A zero, a negation and a transposition fail.
    for (int k = 0; k < 3; ++k) {
      auto w = c.find("output.weight_dequant")->float_values();
      const auto in = static_cast<std::size_t>(f.keys["in_features"].get<int>());
      std::vector<double> m(w.size());
      for (std::size_t i = 0; i < w.size(); ++i)
        m[i] = k == 0 ? 0.0 : k == 1 ? -w[i] : w[(i % 8) * in + i / 8];
      set_values(*d, m);
      EXPECT_EQ(result(golden::check(g, bad, {}), "output.weight_dequant").status, Status::fail)
          << k;
    }
    // A fused kernel omits it: listed apart, never required.
    std::erase_if(c.tensors, [](const st::Tensor& t) { return t.name == "output.weight_dequant"; });
    rep = golden::check(g, c, {});
    EXPECT_EQ(rep.failed, 0);
    EXPECT_EQ(rep.optional_missing, std::vector<std::string>{"output.weight_dequant"});
    EXPECT_EQ(golden::verdict({rep}, /*require_all=*/true).exit_code, 0);
  }
}

TEST(QuantizedLinear, TheWeightIsTheCheckpointReadersExactValuesAndTheProductUsesThem) {
  for (const auto& f : formats()) {
    SCOPED_TRACE(f.keys.dump());
    const st::File g = golden::make_op(linear(f.keys, "float64"));
    const std::string fmt = f.keys["weight_format"];
    const auto rows = f.keys["out_features"].get<index_t>();
    const auto cols = f.keys["in_features"].get<index_t>();
    // The packed tensors read as a checkpoint's, by teo's checkpoint readers.
    std::vector<double> exact;
    if (fmt.starts_with("gguf:")) {
      const auto t = teo::quant::parse_ggml_type(fmt.substr(5), "format");
      const auto* w = g.find("param.weight");
      ASSERT_NE(w, nullptr);
      EXPECT_EQ(w->dtype, st::DType::U8);
      std::vector<float> x(static_cast<std::size_t>(rows * cols));
      teo::dequantize(t, reinterpret_cast<const std::uint8_t*>(w->data().data()), rows * cols,
                      x.data());
      exact.assign(x.begin(), x.end());
    } else {
      const auto tf = teo::quant::parse_tensor_format(fmt, "format");
      const auto found = teo::quant::find_packed(g, tf);
      ASSERT_EQ(found.size(), 1u);
      EXPECT_EQ(found.begin()->first,
                tf == teo::quant::TensorFormat::mxfp4 ? "param.weight" : "param");
      teo::quant::Dequantize how;
      how.zero_offset = f.keys.value("zero_offset", 1);
      how.group_size = f.keys.value("group_size", 0);
      exact = teo::quant::dequantize(found.begin()->second, "w", how);
    }
    const auto d = g.find("output.weight_dequant")->float_values();
    ASSERT_EQ(d.size(), exact.size());
    for (std::size_t i = 0; i < d.size(); ++i) ASSERT_EQ(d[i], exact[i]) << i;
    // No weight gradient: weight-only quantization serves.
    EXPECT_EQ(g.find("grad.param.weight"), nullptr);
    EXPECT_NE(g.find("grad.param.bias"), nullptr);
    // y = x W^T + b of those values, by a plain loop.
    const auto x = g.find("input.x")->float_values();
    const auto b = g.find("param.bias")->float_values();
    const auto y = g.find("output.y")->float_values();
    for (index_t r = 0; r < 5; ++r) {
      for (index_t o = 0; o < rows; ++o) {
        double s = b[o], mag = std::abs(b[o]);
        for (index_t k = 0; k < cols; ++k) {
          s += x[r * cols + k] * exact[o * cols + k];
          mag += std::abs(x[r * cols + k] * exact[o * cols + k]);
        }
        EXPECT_NEAR(y[r * rows + o], s, 1e-14 * mag) << r << ", " << o;
      }
    }
    // The float32 case holds the same values, each rounded once to float32.
    const st::File g32 = golden::make_op(linear(f.keys));
    const auto d32 = g32.find("output.weight_dequant")->float_values();
    for (std::size_t i = 0; i < d.size(); ++i)
      ASSERT_EQ(d32[i], static_cast<double>(static_cast<float>(exact[i]))) << i;
  }
}

TEST(QuantizedLinear, UnderAPrecisionTheExactValuesOrTheirStoredRoundingPassAndNothingElse) {
  const st::File g = golden::make_op(linear({{"rows", 6},
                                             {"in_features", 256},
                                             {"out_features", 8},
                                             {"weight_format", "gguf:Q4_K"},
                                             {"precision", "bf16"}}));
  golden::CheckOptions bf16;
  bf16.precision = teo::Precision::bf16;
  st::File c = results_of(g);
  // The float32 values, as teo's float32 run writes them.
  EXPECT_EQ(result(golden::check(g, c, bf16), "output.weight_dequant").status, Status::pass);
  auto* d = find_mut(c, "output.weight_dequant");
  auto v = d->float_values();
  auto rounded = v;
  std::size_t changed = 0;
  for (auto& e : rounded) {
    const float r = teo::round_to(teo::Precision::bf16, static_cast<float>(e));
    changed += r != e;
    e = r;
  }
  ASSERT_GT(changed, 0u) << "Q4_K's values are not all bf16 values";
  set_values(*d, rounded);
  EXPECT_EQ(result(golden::check(g, c, bf16), "output.weight_dequant").status, Status::pass);
  // Not the bf16 value on the other side, nor the plain check's float32 rule.
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (rounded[i] == v[i]) continue;
    auto other = rounded;  // the next bf16 value out
    other[i] =
        teo::from_bits(teo::Precision::bf16,
                       static_cast<std::uint16_t>(
                           teo::to_bits(teo::Precision::bf16, static_cast<float>(rounded[i])) + 1));
    set_values(*d, other);
    const auto rep = golden::check(g, c, bf16);
    EXPECT_EQ(result(rep, "output.weight_dequant").status, Status::fail);
    EXPECT_EQ(rep.first_divergence, "output.weight_dequant");
    break;
  }
  set_values(*d, rounded);
  golden::CheckOptions fp32;
  fp32.precision = teo::Precision::fp32;
  EXPECT_EQ(result(golden::check(g, c, fp32), "output.weight_dequant").status, Status::fail)
      << "judged in fp32, bf16 values are not the float32 case's";
}

void expect_refused(json j, const std::string& needle) {
  try {
    linear(std::move(j));
    ADD_FAILURE() << "accepted; expected: " << needle;
  } catch (const teo::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(QuantizedLinear, BadSpecsAndBadPackingsAreRefusedByName) {
  const json base = {{"rows", 2}, {"in_features", 64}, {"out_features", 8}};
  const auto with = [&](json extra) {
    json j = base;
    j.update(extra);
    return j;
  };
  expect_refused(with({{"weight_format", "gguf:Q3_K"}}), "spec.weight_format must be one of");
  expect_refused(with({{"weight_format", "int4"}}), "gptq");
  expect_refused(with({{"weight_format", "nvfp4"}, {"precision", "fp8"}}), "quantized already");
  expect_refused(with({{"weight_format", "gguf:Q4_K"}}), "not whole blocks of 256");
  expect_refused(with({{"weight_format", "nvfp4"}, {"in_features", 40}}), "not whole blocks of 16");
  expect_refused(with({{"weight_format", "awq"}, {"out_features", 12}}), "multiples of 8");
  expect_refused(with({{"weight_format", "gptq"}, {"group_size", 48}}),
                 "group_size 48 does not divide the 64 columns");
  expect_refused(with({{"weight_format", "gptq"}}), "group_size 128 does not divide");
  expect_refused(with({{"weight_format", "mxfp4"}, {"group_size", 32}}),
                 "spec.group_size applies to a weight_format of gptq or awq, not mxfp4");
  expect_refused(with({{"weight_format", "awq"}, {"group_size", 32}, {"act_order", true}}),
                 "spec.act_order applies to a weight_format of gptq");
  expect_refused(with({{"weight_format", "gptq"}, {"group_size", 32}, {"zero_offset", 2}}),
                 "spec.zero_offset must be 1");
  expect_refused(with({{"group_size", 32}}), "not dense");
  // A golden whose packing does not read: the tensor and its block are named.
  st::File g = golden::make_op(linear(with({{"weight_format", "gguf:Q8_0"}})));
  auto* w = find_mut(g, "param.weight");
  // row 1, block 1: its F16 scale (the block's first two bytes) made inf
  const std::size_t at = 1 * 68 + 34;
  w->bytes[at] = 0x00;
  w->bytes[at + 1] = 0x7C;
  try {
    golden::run_op(g, std::nullopt);
    ADD_FAILURE() << "an inf scale was read";
  } catch (const teo::FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("param.weight, row 1, block 1"), std::string::npos)
        << e.what();
  }
  // A packed tensor of another dtype than its checkpoint's.
  st::File h = golden::make_op(linear(with({{"weight_format", "gptq"}, {"group_size", 32}})));
  find_mut(h, "param.scales")->dtype = st::DType::BF16;
  EXPECT_THROW(golden::run_op(h, std::nullopt), teo::FormatError);
}

}  // namespace

namespace {

golden::OpCase kvcache(json j) {
  j["op"] = "attention_kvcache";
  if (!j.contains("dtype")) j["dtype"] = "float32";
  j["seed"] = 5;
  return golden::OpCase::from_json(j);
}

const json kKv = {
    {"batch", 2},  {"num_heads", 4},         {"num_kv_heads", 2}, {"q_len", 2},
    {"d_head", 8}, {"layout", "contiguous"}, {"max_len", 9},      {"cache_lengths", {5, 2}}};

TEST(QuantizedKvCache, TheAppendWritesTheCodesOfKOverItsScaleAndAWrongCodeFailsThere) {
  for (const char* fmt : {"fp8_e4m3", "fp8_e5m2"}) {
    for (const bool per_head : {false, true}) {
      SCOPED_TRACE(std::string(fmt) + (per_head ? " per head" : " per tensor"));
      json j = kKv;
      j["cache_format"] = fmt;
      j["kv_scale"] = per_head ? "per_head" : "per_tensor";
      const st::File g = golden::make_op(kvcache(j));
      const auto f = std::string(fmt) == "fp8_e4m3" ? teo::Fp8Format::e4m3 : teo::Fp8Format::e5m2;
      const auto before = g.find("input.k_cache")->float_values();
      const auto after = g.find("output.k_cache")->float_values();
      const auto k_new = g.find("input.k_new")->float_values();
      const auto scale = g.find("input.k_scale")->float_values();
      ASSERT_EQ(scale.size(), per_head ? 2u : 1u);
      // (b, g, t, d) of (2, 2, 9, 8): new token i of sequence b at row cache_lengths[b] + i
      const int lengths[2] = {5, 2};
      std::size_t appended = 0;
      for (int b = 0; b < 2; ++b)
        for (int h = 0; h < 2; ++h)
          for (int t = 0; t < 9; ++t)
            for (int d = 0; d < 8; ++d) {
              const std::size_t at = ((b * 2 + h) * 9 + t) * 8 + d;
              const int i = t - lengths[b];
              if (i < 0 || i >= 2) {
                ASSERT_EQ(after[at], before[at]) << "a slot the step does not write changed";
                continue;
              }
              const double x = k_new[((b * 2 + h) * 2 + i) * 8 + d];
              const auto s = static_cast<float>(scale[per_head ? h : 0]);
              const float q = teo::round_to_fp8(f, true, static_cast<float>(x) / s);
              ASSERT_EQ(after[at], q) << b << " " << h << " " << t << " " << d;
              ++appended;
            }
      EXPECT_EQ(appended, 2u * 2 * 2 * 8);
      st::File c = results_of(g);
      EXPECT_EQ(golden::check(g, c, {}).failed, 0);
      // one code one step off, in sequence 1's first new row: named there
      auto* k = find_mut(c, "output.k_cache");
      const std::size_t at = ((1 * 2 + 0) * 9 + 2) * 8 + 3;
      k->bytes[at] ^= 1;
      const auto rep = golden::check(g, c, {});
      EXPECT_EQ(rep.first_divergence, "output.k_cache");
      EXPECT_NE(result(rep, "output.k_cache").message.find("1 of "), std::string::npos);
    }
  }
}

TEST(QuantizedKvCache, AtANearTieOfItsRoundingEitherCodeIsRightAndNoOtherIs) {
  json j = kKv;
  j["cache_format"] = "fp8_e4m3";
  st::File g = golden::make_op(kvcache(j));
  // new token 0 of sequence 0, head 0, element 0 (cache row 5): k / s just above the midpoint
  // 1.0625 of the E4M3 values 1 and 1.125, so that the golden's code is 1.125
  const float s = static_cast<float>(g.find("input.k_scale")->float_values()[0]);
  const float x = s * 1.0625f * (1 + 0x1p-21f);
  std::memcpy(find_mut(g, "input.k_new")->bytes.data(), &x, 4);
  const std::size_t at = ((0 * 2 + 0) * 9 + 5) * 8;
  find_mut(g, "output.k_cache")->bytes[at] = teo::to_fp8_bits(teo::Fp8Format::e4m3, false, 1.125f);
  const double ref = 1.125;
  std::memcpy(find_mut(g, "ref64.output.k_cache")->bytes.data() + 8 * at, &ref, 8);
  st::File c = results_of(g);
  auto* k = find_mut(c, "output.k_cache");
  EXPECT_EQ(golden::check(g, c, {}).failed, 0);
  // a kernel that multiplies by 1 / s may round it down: accepted, and said
  k->bytes[at] = teo::to_fp8_bits(teo::Fp8Format::e4m3, false, 1.0f);
  auto rep = golden::check(g, c, {});
  EXPECT_EQ(rep.failed, 0);
  EXPECT_NE(result(rep, "output.k_cache").message.find("1 value(s) at a near tie"),
            std::string::npos)
      << result(rep, "output.k_cache").message;
  // but not a code further off, nor the other rounding where there is no tie
  k->bytes[at] = teo::to_fp8_bits(teo::Fp8Format::e4m3, false, 1.25f);
  EXPECT_EQ(golden::check(g, c, {}).first_divergence, "output.k_cache");
  k->bytes[at] = teo::to_fp8_bits(teo::Fp8Format::e4m3, false, 1.125f);
  k->bytes[at + 1] ^= 1;
  EXPECT_EQ(golden::check(g, c, {}).first_divergence, "output.k_cache");
}

TEST(QuantizedKvCache, TheOtherRoundingIsAroundTheGoldensOwnCode) {
  using teo::golden::ops::other_fp8_rounding;
  using teo::golden::ops::other_int8_rounding;
  // exact 3.49999995: float32's quotient is 3.5, rounded to 4; a kernel with 1 / s may give 3
  EXPECT_EQ(other_int8_rounding(3.49999995, 4.0), 3.0);
  EXPECT_EQ(other_int8_rounding(3.49999995, 3.0), 4.0);
  EXPECT_EQ(other_int8_rounding(-3.50000004, -4.0), -3.0);
  EXPECT_TRUE(std::isnan(other_int8_rounding(3.4, 3.0))) << "no tie: one answer";
  EXPECT_TRUE(std::isnan(other_int8_rounding(127.4, 127.0))) << "clamped: one answer";
  // E4M3 between 1.125 and 1.25 (midpoint 1.1875, ties to the even 1.25)
  EXPECT_EQ(other_fp8_rounding(teo::Fp8Format::e4m3, 1.1875 - 1e-9, 1.25), 1.125);
  EXPECT_EQ(other_fp8_rounding(teo::Fp8Format::e4m3, 1.1875 - 1e-9, 1.125), 1.25);
  EXPECT_TRUE(std::isnan(other_fp8_rounding(teo::Fp8Format::e4m3, 1.17, 1.125)));
  EXPECT_TRUE(std::isnan(other_fp8_rounding(teo::Fp8Format::e4m3, 500.0, 448.0)));
}

TEST(QuantizedKvCache, ACachedCodeThatIsNoCodeIsANamedError) {
  json j = kKv;
  j["cache_format"] = "fp8_e4m3";
  st::File g = golden::make_op(kvcache(j));
  find_mut(g, "input.v_cache")->bytes[17] = 0x7F;  // E4M3's NaN
  try {
    golden::run_op(g, std::nullopt);
    ADD_FAILURE() << "a NaN code was read";
  } catch (const teo::FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("input.v_cache[17]"), std::string::npos) << e.what();
  }
  json i8 = kKv;
  i8["cache_format"] = "int8";
  st::File h = golden::make_op(kvcache(i8));
  find_mut(h, "input.k_cache")->bytes[3] = 0x80;  // -128
  EXPECT_THROW(golden::run_op(h, std::nullopt), teo::FormatError);
}

TEST(QuantizedKvCache, Int8KeepsARowScaleOfAmaxOver127AndItsCodes) {
  json j = kKv;
  j["cache_format"] = "int8";
  for (const char* dtype : {"float32", "float64"}) {
    j["dtype"] = dtype;
    const st::File g = golden::make_op(kvcache(j));
    EXPECT_EQ(g.find("output.k_cache")->dtype, st::DType::I8);
    const auto codes = g.find("output.k_cache")->int_values();
    const auto scales = g.find("output.k_scale")->float_values();
    const auto k_new = g.find("input.k_new")->float_values();
    // sequence 0, head 1, new token 0: row 5 of its cache
    const std::size_t row = (0 * 2 + 1) * 9 + 5;
    double amax = 0;
    for (int d = 0; d < 8; ++d) amax = std::max(amax, std::abs(k_new[((0 * 2 + 1) * 2) * 8 + d]));
    const bool f32 = std::string(dtype) == "float32";
    const float s = f32 ? static_cast<float>(amax) / 127.0f : static_cast<float>(amax / 127.0);
    EXPECT_EQ(scales[row], s) << dtype;
    for (int d = 0; d < 8; ++d) {
      const double x = k_new[((0 * 2 + 1) * 2) * 8 + d];
      const double q = f32 ? static_cast<double>(static_cast<float>(x) / s) : x / s;
      EXPECT_EQ(codes[row * 8 + d], static_cast<std::int64_t>(std::nearbyint(q))) << d;
    }
    st::File c = results_of(g);
    EXPECT_EQ(golden::check(g, c, {}).failed, 0);
    auto* sc = find_mut(c, "output.k_scale");
    auto v = sc->float_values();
    v[row] *= 2;
    set_values(*sc, v);
    EXPECT_EQ(golden::check(g, c, {}).first_divergence, "output.k_scale");
  }
}

TEST(QuantizedKvCache, AMissingZeroOrNanScaleIsANamedErrorNeverADefault) {
  json j = kKv;
  j["cache_format"] = "fp8_e4m3";
  const st::File g = golden::make_op(kvcache(j));
  for (const float bad : {0.0f, NAN, -1.0f}) {
    st::File h = g;
    auto* s = find_mut(h, "input.v_scale");
    std::memcpy(s->bytes.data(), &bad, 4);
    try {
      golden::run_op(h, std::nullopt);
      ADD_FAILURE() << "a scale of " << bad << " was read";
    } catch (const teo::FormatError& e) {
      EXPECT_NE(std::string(e.what()).find("input.v_scale[0]"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("never a default"), std::string::npos) << e.what();
    }
  }
  st::File h = g;
  std::erase_if(h.tensors, [](const st::Tensor& t) { return t.name == "input.k_scale"; });
  try {
    golden::run_op(h, std::nullopt);
    ADD_FAILURE() << "a case without its k_scale ran";
  } catch (const teo::FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("input.k_scale"), std::string::npos) << e.what();
  }
  json r = j;
  r["positional"] = "rope";
  EXPECT_THROW(kvcache(r), teo::ConfigError);
  json i8 = kKv;
  i8["cache_format"] = "int8";
  i8["kv_scale"] = "per_head";
  EXPECT_THROW(kvcache(i8), teo::ConfigError);
  json p = j;
  p["precision"] = "fp8";
  EXPECT_THROW(kvcache(p), teo::ConfigError);
}

}  // namespace

namespace {

TEST(QuantizedExperts, KQuantAndMxfp4ExpertsAreTheirExactValuesAndAWrongOneIsNamedByExpert) {
  // ggml #1506: K-quant experts degenerated where only F32, F16 and Q8_0 experts were tested
  for (const char* fmt : {"gguf:Q4_K", "mxfp4", "gptq"}) {
    SCOPED_TRACE(fmt);
    const bool k = std::string(fmt) == "gguf:Q4_K";
    json j = {{"op", "moe"},
              {"tokens", 4},
              {"d_model", k ? 256 : 32},
              {"num_experts", 3},
              {"num_experts_per_tok", 2},
              {"moe_d_ff", k ? 256 : 32},
              {"weight_format", fmt},
              {"dtype", "float64"},
              {"seed", 3}};
    if (std::string(fmt) == "gptq") j["group_size"] = 16;
    const st::File g = golden::make_op(golden::OpCase::from_json(j));
    EXPECT_EQ(g.find("grad.param.experts.w_up"), nullptr) << "quantized experts have no gradient";
    // each expert's weight is its own packing's exact values
    const auto d = g.find("output.experts.w_up_dequant")->float_values();
    const auto D = j["d_model"].get<index_t>();
    if (k) {
      const auto* w = g.find("param.experts.w_up");
      ASSERT_EQ(w->shape, (std::vector<std::int64_t>{3, D, D / 256 * 144}));
      std::vector<float> x(static_cast<std::size_t>(3 * D * D));
      teo::dequantize(teo::quant::GgmlType::q4_k,
                      reinterpret_cast<const std::uint8_t*>(w->data().data()), 3 * D * D, x.data());
      for (std::size_t i = 0; i < d.size(); ++i) ASSERT_EQ(d[i], x[i]) << i;
    }
    st::File c = results_of(g);
    auto rep = golden::check(g, c, {});
    EXPECT_EQ(rep.failed, 0);
    auto* t = find_mut(c, "output.experts.w_up_dequant");
    auto v = t->float_values();
    const std::size_t at = (2 * D + 1) * D + 8;  // expert 2, row 1, column 8
    v[at] = -v[at] + 1;
    set_values(*t, v);
    rep = golden::check(g, c, {});
    EXPECT_EQ(rep.first_divergence, "output.experts.w_up_dequant");
    EXPECT_NE(result(rep, "output.experts.w_up_dequant").message.find("expert 2, row 1, column 8"),
              std::string::npos)
        << result(rep, "output.experts.w_up_dequant").message;
  }
  json bad = {{"op", "moe"},
              {"tokens", 2},
              {"d_model", 32},
              {"num_experts", 2},
              {"num_experts_per_tok", 1},
              {"moe_d_ff", 40},
              {"weight_format", "mxfp4"},
              {"dtype", "float64"},
              {"seed", 1}};
  EXPECT_THROW(golden::OpCase::from_json(bad), teo::ConfigError) << "w_down's 40 columns";
}

}  // namespace

namespace {

TEST(W8A8, TheCodesAreEachTokensAndTheInt32AccumulatorIsExact) {
  for (const char* dtype : {"float32", "float64"}) {
    SCOPED_TRACE(dtype);
    const st::File g = golden::make_op(linear({{"rows", 4},
                                               {"in_features", 64},
                                               {"out_features", 8},
                                               {"weight_format", "int8"},
                                               {"activation_format", "int8"}},
                                              dtype));
    // serving: no upstream gradient, no gradient
    for (const auto& t : g.tensors) EXPECT_FALSE(t.name.starts_with("grad.")) << t.name;
    const bool f32 = std::string(dtype) == "float32";
    const auto x = g.find("input.x")->float_values();
    const auto sx = g.find("output.x_scale")->float_values();
    const auto xq = g.find("output.x_quant")->int_values();
    const auto wq = g.find("param.weight")->int_values();
    const auto ws = g.find("param.weight_scale")->float_values();
    const auto acc = g.find("output.acc")->int_values();
    const auto y = g.find("output.y")->float_values();
    const auto b = g.find("param.bias")->float_values();
    for (int r = 0; r < 4; ++r) {
      double amax = 0;
      for (int k = 0; k < 64; ++k) amax = std::max(amax, std::abs(x[r * 64 + k]));
      const float s = f32 ? static_cast<float>(amax) / 127.0f : static_cast<float>(amax / 127.0);
      ASSERT_EQ(sx[r], s);
      for (int k = 0; k < 64; ++k) {
        const double q =
            f32 ? static_cast<double>(static_cast<float>(x[r * 64 + k]) / s) : x[r * 64 + k] / s;
        ASSERT_EQ(xq[r * 64 + k], static_cast<std::int64_t>(std::nearbyint(q)));
      }
      for (int o = 0; o < 8; ++o) {
        std::int64_t sum = 0;
        for (int k = 0; k < 64; ++k) sum += xq[r * 64 + k] * wq[o * 64 + k];
        ASSERT_EQ(acc[r * 8 + o], sum);
        const double want = static_cast<double>(sum) * sx[r] * ws[o] + b[o];
        EXPECT_NEAR(y[r * 8 + o], want, (f32 ? 1e-6 : 1e-15) * (std::abs(want) + 1));
      }
    }
    st::File c = results_of(g);
    EXPECT_EQ(golden::check(g, c, {}).failed, 0);
    // one accumulator off by one: named there, before y
    auto* a = find_mut(c, "output.acc");
    auto v = a->values<std::int32_t>();
    v[5] += 1;
    std::memcpy(a->bytes.data(), v.data(), v.size() * 4);
    const auto rep = golden::check(g, c, {});
    EXPECT_EQ(rep.first_divergence, "output.acc");
  }
  expect_refused({{"rows", 2},
                  {"in_features", 64},
                  {"out_features", 8},
                  {"weight_format", "nvfp4"},
                  {"activation_format", "int8"}},
                 "goes with weight_format \"int8\"");
}

}  // namespace
