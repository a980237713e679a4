// An fp8 linear op case's stored operands (`--keep fp8.*`, docs/golden-format.md, "fp8
// operands"): what is stored and when, that a product of the stored operands alone is the case's
// emulated result bit for bit, and the named errors of a bad request or a bad file.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support.hpp"
#include "teo/errors.hpp"
#include "teo/fp8.hpp"
#include "teo/golden.hpp"
#include "teo/golden_ops.hpp"
#include "teo/precision.hpp"
#include "teo/rounding.hpp"

namespace teo::golden {
namespace {

using nlohmann::json;
using safetensors::DType;
using safetensors::File;

// Block scales with partial blocks along k (136 = 128 + 8) and along the weight's rows, hybrid
// formats, a bias.
json hybrid_block_spec() {
  return {{"op", "linear"},        {"rows", 9}, {"in_features", 136}, {"out_features", 40},
          {"dtype", "float32"},    {"seed", 3}, {"precision", "fp8"}, {"fp8_format", "hybrid"},
          {"fp8_scaling", "block"}};
}

struct Expected {
  const char* name;
  DType dtype;
  std::vector<std::int64_t> shape, scale_shape;
  bool gradient, weight;
};

// The six operands of hybrid_block_spec, as docs/golden-format.md lists them.
const std::vector<Expected>& expected() {
  static const std::vector<Expected> e = {
      {"y.x", DType::F8_E4M3, {9, 136}, {9, 2}, false, false},
      {"y.weight", DType::F8_E4M3, {40, 136}, {1, 2}, false, true},
      {"grad_x.grad_y", DType::F8_E5M2, {9, 40}, {9, 1}, true, false},
      {"grad_x.weight", DType::F8_E4M3, {136, 40}, {2, 1}, false, true},
      {"grad_weight.grad_y", DType::F8_E5M2, {40, 9}, {40, 1}, true, false},
      {"grad_weight.x", DType::F8_E4M3, {136, 9}, {136, 1}, false, false}};
  return e;
}

// The stored operand `name` of f as fp8_gemm takes it.
Fp8Operand stored(const File& f, const OpCase& c, const Expected& e) {
  const auto* q = f.find(std::string("fp8.") + e.name);
  const auto* d = f.find(std::string("fp8.") + e.name + ".scale");
  if (!q || !d) throw std::runtime_error(std::string("no fp8.") + e.name);
  Fp8Operand o;
  const Fp8Quantization how = fp8_quantization(c.fp8, e.gradient, e.weight);
  o.format = how.format;
  o.scaling = how.scaling;
  o.rows = q->shape[0];
  o.k = q->shape[1];
  const Fp8Block b = fp8_block(how, o.rows, o.k);
  o.block_rows = b.rows;
  o.block_k = b.k;
  for (double v : q->float_values()) o.q.push_back(static_cast<float>(v));
  o.scale = d->values<float>();
  return o;
}

TEST(Fp8Operands, KeepStoresEachProductsOperandsWithItsScalesInItsFormat) {
  const OpCase c = OpCase::from_json(hybrid_block_spec());
  const File f = make_op(c, false, "*");
  EXPECT_NO_THROW(validate(f));
  ASSERT_NE(f.meta("kept"), nullptr);
  EXPECT_EQ(*f.meta("kept"), "*");
  for (const Expected& e : expected()) {
    SCOPED_TRACE(e.name);
    const auto* q = f.find(std::string("fp8.") + e.name);
    const auto* d = f.find(std::string("fp8.") + e.name + ".scale");
    ASSERT_NE(q, nullptr);
    ASSERT_NE(d, nullptr);
    EXPECT_EQ(q->dtype, e.dtype);
    EXPECT_EQ(q->shape, e.shape);
    EXPECT_EQ(d->dtype, DType::F32);
    EXPECT_EQ(d->shape, e.scale_shape);
    // every value is within the format's range (saturating recipe), and not all are zero
    const Fp8Format fmt = e.dtype == DType::F8_E4M3 ? Fp8Format::e4m3 : Fp8Format::e5m2;
    double amax = 0;
    for (double v : q->float_values()) amax = std::max(amax, std::fabs(v));
    EXPECT_LE(amax, fp8_max(fmt));
    EXPECT_GT(amax, fp8_max(fmt) / 2) << "current scaling maps a block's amax to the top";
  }
  // everything else is the case without operands
  const File plain = make_op(c);
  for (const auto& t : plain.tensors) {
    const auto* k = f.find(t.name);
    ASSERT_NE(k, nullptr) << t.name;
    EXPECT_TRUE(std::ranges::equal(k->data(), t.data())) << t.name;
  }
  EXPECT_EQ(f.tensors.size(), plain.tensors.size() + 12);
}

// A backend fed the stored operands computes the case's emulated results from them alone: each
// product of two stored operands is the emulated run's, bit for bit.
TEST(Fp8Operands, TheStoredOperandsAloneGiveTheEmulatedProducts) {
  const OpCase c = OpCase::from_json(hybrid_block_spec());
  const File f = make_op(c, false, "*");
  const auto emulated = run_op(f, Precision::fp8);
  const auto& ops = expected();
  const auto product = [&](std::size_t a, std::size_t b) {
    const Fp8Operand qa = stored(f, c, ops[a]), qb = stored(f, c, ops[b]);
    std::vector<float> out(static_cast<std::size_t>(qa.rows * qb.rows));
    fp8_gemm(qa, qb, out.data(), qb.rows, c.fp8.accumulate);
    return out;
  };
  std::vector<float> y = product(0, 1);
  const auto bias = f.find("param.bias")->values<float>();
  for (std::size_t i = 0; i < y.size(); ++i) y[i] += bias[i % bias.size()];
  const std::vector<float> dx = product(2, 3), dw = product(4, 5);
  const auto same = [&](const std::vector<float>& got, const std::string& name) {
    const auto& want = emulated.at(name);
    ASSERT_EQ(got.size(), want.size()) << name;
    std::size_t differ = 0;
    for (std::size_t i = 0; i < got.size(); ++i)
      differ += round_to(Precision::bf16, got[i]) == static_cast<float>(want[i]) ? 0 : 1;
    EXPECT_EQ(differ, 0u) << name;
  };
  same(y, "output.y");
  same(dx, "grad.input.x");
  same(dw, "grad.param.weight");
}

TEST(Fp8Operands, AreStoredOnlyWhenAGlobAsksForThem) {
  const OpCase c = OpCase::from_json(hybrid_block_spec());
  const auto fp8_names = [](const File& f) {
    std::vector<std::string> n;
    for (const auto& t : f.tensors)
      if (t.name.starts_with("fp8.")) n.push_back(t.name);
    return n;
  };
  EXPECT_TRUE(fp8_names(make_op(c)).empty());
  EXPECT_TRUE(fp8_names(make_op(c, false, "output.*,grad.*")).empty());
  const File fwd = make_op(c, false, "fp8.y.*");
  EXPECT_EQ(fp8_names(fwd), (std::vector<std::string>{"fp8.y.x", "fp8.y.x.scale", "fp8.y.weight",
                                                      "fp8.y.weight.scale"}));
  EXPECT_EQ(fwd.find("output.y"), nullptr) << "a computed tensor no glob names is left out";
  EXPECT_NE(fwd.find("input.x"), nullptr) << "inputs always stay";
  EXPECT_NO_THROW(validate(fwd));
  // keep_only on a file that holds them: a scale follows its operand
  File all = make_op(c, false, "*");
  keep_only(all, "output.*,fp8.grad_x.weight");
  EXPECT_EQ(fp8_names(all),
            (std::vector<std::string>{"fp8.grad_x.weight", "fp8.grad_x.weight.scale"}));
  EXPECT_NO_THROW(validate(all));
}

TEST(Fp8Operands, AGlobForThemOutsideAnFp8LinearCaseIsANamedError) {
  json bf16 = {{"op", "linear"},     {"rows", 4},           {"in_features", 8}, {"out_features", 4},
               {"dtype", "float32"}, {"precision", "bf16"}, {"seed", 1}};
  test::expect_throw<ConfigError>(
      [&] { make_op(OpCase::from_json(bf16), false, "output.*,fp8.*"); },
      "--keep pattern \"fp8.*\" matches no computed tensor of this case (output.*, "
      "grad.input.*, grad.param.*; fp8.* in an fp8 linear case)");
  const json ffn = {{"op", "ffn"},        {"rows", 4},          {"d_model", 8},     {"d_ff", 16},
                    {"dtype", "float32"}, {"precision", "fp8"}, {"fp8_outlier", 1}, {"seed", 1}};
  test::expect_throw<ConfigError>([&] { make_op(OpCase::from_json(ffn), true, "fp8.*"); },
                                  "--keep pattern \"fp8.*\" matches no computed tensor");
  test::expect_throw<ConfigError>(
      [&] { make_op(OpCase::from_json(hybrid_block_spec()), false, "fp8.y.bias"); },
      "--keep pattern \"fp8.y.bias\" matches no computed tensor");
}

TEST(Fp8Operands, AFileWithABadOperandIsRefusedNamingIt) {
  const File good = make_op(OpCase::from_json(hybrid_block_spec()), false, "*");
  const auto edit = [&](auto change) {
    File f = good;
    change(f);
    return f;
  };
  const auto find = [](File& f, const std::string& n) -> safetensors::Tensor& {
    for (auto& t : f.tensors)
      if (t.name == n) return t;
    throw std::runtime_error("no " + n);
  };
  test::expect_throw<FormatError>(
      [&] {
        validate(edit([](File& f) {
          std::erase_if(f.tensors, [](const auto& t) { return t.name == "fp8.y.x.scale"; });
        }));
      },
      "the op case holds fp8.y.x without fp8.y.x.scale");
  test::expect_throw<FormatError>(
      [&] {
        validate(edit([&](File& f) {
          std::erase_if(f.tensors, [](const auto& t) { return t.name == "fp8.grad_x.weight"; });
        }));
      },
      "the op case holds fp8.grad_x.weight.scale without fp8.grad_x.weight");
  test::expect_throw<FormatError>(
      [&] {
        validate(edit([&](File& f) { find(f, "fp8.grad_x.grad_y").dtype = DType::F8_E4M3; }));
      },
      "the op case's fp8.grad_x.grad_y is F8_E4M3, its contract's dtype is F8_E5M2");
  test::expect_throw<FormatError>(
      [&] {
        validate(edit([&](File& f) {
          auto& t = find(f, "fp8.y.weight.scale");
          t.shape = {2, 1};
        }));
      },
      "the op case's fp8.y.weight.scale has shape [2, 1]");
  test::expect_throw<FormatError>(
      [&] {
        validate(edit([&](File& f) {
          auto& t = find(f, "fp8.y.x.scale");
          const float zero = 0;
          std::memcpy(t.bytes.data() + 4, &zero, 4);
        }));
      },
      "the op case's fp8.y.x.scale[1] is 0.000000; an fp8 scale is finite and positive");
}

}  // namespace
}  // namespace teo::golden
