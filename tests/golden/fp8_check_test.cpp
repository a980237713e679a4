// fp8 op cases (docs/fp8.md): the spec's recipe keys, the emulated linear products, and the
// checker's fp8 rule: the emulated run passes; an independent linear that follows the recipe
// passes; each recipe mutant fails at its tensor.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "check_support.hpp"
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

json linear_spec(const std::string& scaling, index_t k = 256) {
  return {{"op", "linear"},     {"rows", 33}, {"in_features", k},   {"out_features", 24},
          {"dtype", "float32"}, {"seed", 7},  {"precision", "fp8"}, {"fp8_scaling", scaling}};
}

// The golden's op run again under the recipe `spec` names (the golden's inputs, another recipe):
// what a backend following that recipe computes.
std::map<std::string, std::vector<double>> run_as(const File& golden, const json& spec) {
  File f = golden;
  for (auto& [k, v] : f.metadata)
    if (k == "spec") v = OpCase::from_json(spec).spec.dump();
  return run_op(f, Precision::fp8);
}

// A candidate of the results given, as float32; `only` keeps one tensor.
File candidate(const File& golden, const std::map<std::string, std::vector<double>>& r,
               const std::string& only = "") {
  File c;
  for (const auto& [name, v] : r) {
    if (!only.empty() && name != only) continue;
    const std::vector<float> f(v.begin(), v.end());
    c.add<float>(name, golden.find(name)->shape, f.data(), f.size());
  }
  return c;
}

using test_support::fp8;
using test_support::result;

TEST(Fp8OpCase, TheRecipeIsSpelledOutAndNeedsAnFp8Case) {
  const OpCase c = OpCase::from_json(linear_spec("block"));
  EXPECT_EQ(c.spec["fp8_format"], "e4m3");
  EXPECT_EQ(c.spec["fp8_block_k"], 128);
  EXPECT_EQ(c.spec["fp8_weight_block"], 128);
  EXPECT_EQ(c.spec["fp8_accumulate"], "fp32");
  EXPECT_EQ(c.spec["fp8_saturate"], true);
  EXPECT_EQ(c.fp8.scaling, Fp8Scaling::block);
  json hybrid = linear_spec("mx");
  hybrid["fp8_format"] = "hybrid";
  const OpCase h = OpCase::from_json(hybrid);
  EXPECT_EQ(h.fp8.forward, Fp8Format::e4m3);
  EXPECT_EQ(h.fp8.backward, Fp8Format::e5m2);
  EXPECT_EQ(h.spec["fp8_format"], "hybrid");
  auto bad = [](json j, const char* key, json v, const std::string& msg) {
    j[key] = v;
    test::expect_throw<ConfigError>([&] { OpCase::from_json(j); }, msg);
  };
  bad(linear_spec("block"), "fp8_format", "e4m4", "spec.fp8_format must be e4m3, e5m2 or hybrid");
  bad(linear_spec("block"), "fp8_scaling", "row", "spec.fp8_scaling must be tensor, block or mx");
  bad(linear_spec("block"), "fp8_block_k", 0, "spec.fp8_block_k must be an integer from 1");
  bad(linear_spec("block"), "fp8_accumulate", "fp16", "spec.fp8_accumulate must be fp32 or");
  bad(linear_spec("block"), "fp8_mantissa_bits", 30, "spec.fp8_mantissa_bits must be an integer");
  bad(linear_spec("block"), "fp8_saturate", 1, "spec.fp8_saturate must be true or false");
  bad(linear_spec("block"), "fp8_outlier", 0.5, "spec.fp8_outlier must be a number from 1");
  json bf16 = linear_spec("block");
  bf16["precision"] = "bf16";
  test::expect_throw<ConfigError>([&] { OpCase::from_json(bf16); },
                                  "spec.fp8_scaling applies to an fp8 case only");
}

TEST(Fp8Check, TheEmulatedRunPassesOnEveryScalingAndItsRecipeDistanceIsZero) {
  for (const char* scaling : {"tensor", "block", "mx"}) {
    const File g = make_op(OpCase::from_json(linear_spec(scaling)));
    const File c = candidate(g, run_op(g, Precision::fp8));
    const CaseReport r = check(g, c, fp8());
    EXPECT_EQ(r.precision, "fp8");
    EXPECT_TRUE(r.budget);
    EXPECT_EQ(r.failed, 0) << scaling << ": " << r.first_divergence;
    EXPECT_EQ(r.passed, 4) << scaling;
    for (const auto& t : r.tensors) {
      EXPECT_EQ(t.recipe_distance, 0) << scaling << " " << t.name;
      // fp8's error, not float's, on every tensor (the bias gradient sums fp8's errors in dY)
      EXPECT_GT(t.emulated_err, 1e-3) << scaling << " " << t.name;
    }
  }
}

// The forward product written from the recipe's definition, independently of fp8_gemm: scales as
// 448 / amax multiplied in (as Transformer Engine applies them), rounding by ml_dtypes' rule
// (round_to_fp8), the sum in double; bias added, output rounded to bf16.
std::vector<double> independent_forward(const File& g, bool block) {
  const auto x = g.find("input.x")->float_values();
  const auto w = g.find("param.weight")->float_values();
  const auto bias = g.find("param.bias")->float_values();
  const index_t rows = 33, k = 256, out = 24, bk = block ? 128 : k;
  auto quantize = [&](const std::vector<double>& v, index_t n, index_t tile_rows) {
    std::vector<double> q(v.size()), d(v.size());
    for (index_t r0 = 0; r0 < n; r0 += tile_rows)
      for (index_t k0 = 0; k0 < k; k0 += bk) {
        double amax = 0;
        const index_t r1 = block ? std::min(n, r0 + tile_rows) : n;
        for (index_t r = r0; r < r1; ++r)
          for (index_t p = k0; p < k0 + bk; ++p) amax = std::max(amax, std::abs(v[r * k + p]));
        const float s = 448.0f / static_cast<float>(amax);
        for (index_t r = r0; r < r1; ++r)
          for (index_t p = k0; p < k0 + bk; ++p) {
            q[r * k + p] =
                round_to_fp8(Fp8Format::e4m3, true, static_cast<float>(v[r * k + p]) * s);
            d[r * k + p] = 1.0 / static_cast<double>(s);
          }
        if (!block) return std::pair{q, d};
      }
    return std::pair{q, d};
  };
  const auto [qx, dx] = quantize(x, rows, 1);
  const auto [qw, dw] = quantize(w, out, 128);
  std::vector<double> y(static_cast<std::size_t>(rows * out));
  for (index_t r = 0; r < rows; ++r)
    for (index_t o = 0; o < out; ++o) {
      double s = 0;
      for (index_t p = 0; p < k; ++p)
        s += qx[r * k + p] * dx[r * k + p] * qw[o * k + p] * dw[o * k + p];
      y[r * out + o] = round_to(
          Precision::bf16, static_cast<float>(static_cast<float>(s) + static_cast<float>(bias[o])));
    }
  return y;
}

TEST(Fp8Check, AnIndependentLinearThatFollowsTheRecipePasses) {
  for (bool block : {false, true}) {
    const File g = make_op(OpCase::from_json(linear_spec(block ? "block" : "tensor")));
    std::map<std::string, std::vector<double>> r{{"output.y", independent_forward(g, block)}};
    const CaseReport rep = check(g, candidate(g, r), fp8());
    const auto& t = result(rep, "output.y");
    EXPECT_EQ(t.status, Status::pass) << block << ": " << t.message;
    EXPECT_LT(t.recipe_distance, 0.25) << block;
  }
}

TEST(Fp8Check, RecipeMutantsFailAtTheirTensor) {
  struct Mutant {
    const char* what;
    json golden, as;
  };
  json e5m2 = linear_spec("block");
  e5m2["fp8_format"] = "e5m2";
  json block32 = linear_spec("block");  // MX's blocks with amax / 448 scales: not powers of two
  block32["fp8_block_k"] = 32;
  block32["fp8_weight_block"] = 1;
  json limited = linear_spec("tensor", 4096);
  limited["fp8_accumulate"] = "limited";
  json never = limited;
  never["fp8_promote_every"] = 0;
  const std::vector<Mutant> mutants = {
      {"E5M2 where E4M3 is asked", linear_spec("block"), e5m2},
      {"amax over the whole tensor where blocks are asked", linear_spec("block"),
       linear_spec("tensor")},
      {"an MX scale not rounded to a power of two", linear_spec("mx"), block32},
      {"no promotion at K = 4096 under limited accumulation", limited, never},
  };
  for (const auto& m : mutants) {
    const File g = make_op(OpCase::from_json(m.golden));
    const CaseReport r = check(g, candidate(g, run_as(g, m.as), "output.y"), fp8());
    const auto& t = result(r, "output.y");
    EXPECT_EQ(t.status, Status::fail) << m.what << ": distance " << t.recipe_distance;
    EXPECT_EQ(r.first_divergence, "output.y") << m.what;
    std::cout << m.what << ": ratio " << t.ratio << ", recipe distance " << t.recipe_distance
              << "\n";  // docs/fp8.md's table
  }
}

// Delayed scaling (fp8_scales "delayed"): the scales are the case's inputs input.fp8_scale.*, the
// emulated run quantizes x, W and dY by them and passes at recipe distance 0, and a backend that
// computes current scales instead fails at output.y. The key's errors are named.
TEST(Fp8Check, DelayedScalesAreTheCasesInputsAndABackendIgnoringThemFails) {
  json spec = linear_spec("tensor");
  spec["fp8_format"] = "hybrid";
  spec["fp8_scales"] = "delayed";
  const OpCase c = OpCase::from_json(spec);
  EXPECT_EQ(c.spec["fp8_scales"], "delayed");
  EXPECT_FALSE(OpCase::from_json(linear_spec("tensor")).spec.contains("fp8_scales"));
  const File g = make_op(c);
  // each scale lies between its tensor's current scale, amax / fp8_max, and twice that
  const std::vector<std::tuple<const char*, const char*, double>> scales = {
      {"input.fp8_scale.x", "input.x", 448},
      {"input.fp8_scale.weight", "param.weight", 448},
      {"input.fp8_scale.grad_y", "grad.output.y", 57344}};  // hybrid: E5M2 gradients
  for (const auto& [name, of, top] : scales) {
    const auto* t = g.find(name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(t->shape, std::vector<std::int64_t>{1}) << name;
    double amax = 0;
    for (double v : g.find(of)->float_values()) amax = std::max(amax, std::fabs(v));
    const double d = t->float_values()[0];
    EXPECT_GE(d, amax / top * 0.99) << name;
    EXPECT_LE(d, 2 * amax / top * 1.01) << name;
  }
  const CaseReport own = check(g, candidate(g, run_op(g, Precision::fp8)), fp8());
  EXPECT_TRUE(own.recipe_rule);
  EXPECT_EQ(own.failed, 0) << own.first_divergence;
  for (const auto& t : own.tensors) EXPECT_EQ(t.recipe_distance, 0) << t.name;

  json current = spec;
  current.erase("fp8_scales");
  const CaseReport r = check(g, candidate(g, run_as(g, current), "output.y"), fp8());
  const auto& t = result(r, "output.y");
  EXPECT_EQ(t.status, Status::fail) << "distance " << t.recipe_distance;
  EXPECT_EQ(r.first_divergence, "output.y");
  std::cout << "current scales where delayed ones are given: ratio " << t.ratio
            << ", recipe distance " << t.recipe_distance << "\n";  // docs/fp8.md

  json blocks = spec;
  blocks["fp8_scaling"] = "block";
  test::expect_throw<ConfigError>([&] { OpCase::from_json(blocks); },
                                  "spec.fp8_scales: delayed scales are one per tensor");
  json history = spec;
  history["fp8_scales"] = "history";
  test::expect_throw<ConfigError>([&] { OpCase::from_json(history); },
                                  "spec.fp8_scales must be current or delayed");
  const json ffn = {
      {"op", "ffn"},        {"rows", 4}, {"d_model", 8},       {"d_ff", 8},
      {"dtype", "float32"}, {"seed", 1}, {"precision", "fp8"}, {"fp8_scales", "delayed"}};
  test::expect_throw<ConfigError>(
      [&] { OpCase::from_json(ffn); },
      "delayed scales are inputs of the linear op case only, not of ffn");
  json ffn_attention = ffn;
  ffn_attention.erase("fp8_scales");
  ffn_attention["fp8_attention"] = true;
  test::expect_throw<ConfigError>([&] { OpCase::from_json(ffn_attention); },
                                  "spec.fp8_attention: the ffn op has no attention");
}

TEST(Fp8Check, AScaleFromTheWrongBlockFailsAtTheOutput) {
  const File g = make_op(OpCase::from_json(linear_spec("block")));
  const auto x = g.find("input.x")->float_values();
  const auto w = g.find("param.weight")->float_values();
  const auto bias = g.find("param.bias")->float_values();
  const std::vector<float> xf(x.begin(), x.end()), wf(w.begin(), w.end());
  Fp8Quantization act{.scaling = Fp8Scaling::block, .block_rows = 1, .block_k = 128};
  Fp8Quantization wt{.scaling = Fp8Scaling::block, .block_rows = 128, .block_k = 128};
  Fp8Operand a = quantize_fp8(xf.data(), 33, 256, 256, false, act, "x");
  const Fp8Operand b = quantize_fp8(wf.data(), 24, 256, 256, false, wt, "w");
  // each row's second k block dequantized with its first block's scale
  for (index_t r = 0; r < 33; ++r) a.scale[r * 2 + 1] = a.scale[r * 2];
  std::vector<float> y(33 * 24);
  fp8_gemm(a, b, y.data(), 24, {});
  std::vector<double> out(y.size());
  for (std::size_t i = 0; i < y.size(); ++i)
    out[i] = round_to(Precision::bf16, y[i] + static_cast<float>(bias[i % 24]));
  const CaseReport r = check(g, candidate(g, {{"output.y", out}}), fp8());
  EXPECT_EQ(result(r, "output.y").status, Status::fail) << result(r, "output.y").recipe_distance;
}

// A layer's pass inside an op case keeps the case's recipe: the encoder layer under its 1 x 32
// blocks and under one scale per tensor gives different outputs, and a BF16 candidate (fp8's
// storage format) is judged as fp8.
TEST(Fp8Check, AnEncoderLayerRunsUnderItsCasesRecipeAndBf16CandidatesAreFp8s) {
  json spec = {{"op", "encoder_layer"},
               {"batch", 2},
               {"seq_len", 8},
               {"lengths", {8, 5}},
               {"d_model", 32},
               {"num_heads", 2},
               {"d_ff", 64},
               {"norm_first", true},
               {"dtype", "float32"},
               {"seed", 3},
               {"precision", "fp8"},
               {"fp8_scaling", "block"},
               {"fp8_block_k", 16},
               {"fp8_weight_block", 16}};
  const File g = make_op(OpCase::from_json(spec));
  const auto block = run_op(g, Precision::fp8);
  spec["fp8_scaling"] = "tensor";
  const auto tensor = run_as(g, spec);
  EXPECT_NE(block.at("output.y"), tensor.at("output.y"));
  File c;
  for (const auto& [name, v] : block) {
    std::vector<float> f(v.begin(), v.end());
    std::vector<std::uint16_t> h(f.size());
    to_bits(Precision::bf16, h.data(), f.data(), static_cast<index_t>(f.size()));
    c.add(name, DType::BF16, g.find(name)->shape, h.data(), h.size() * sizeof(std::uint16_t));
  }
  const CaseReport r = check(g, c, fp8());
  EXPECT_EQ(r.precision, "fp8");
  EXPECT_EQ(r.failed, 0) << r.first_divergence;
  EXPECT_GT(r.passed, 10);
  CheckOptions loose = fp8();
  loose.fp8_recipe_k = std::numeric_limits<double>::infinity();
  EXPECT_EQ(check(g, c, loose).failed, 0);
}

// F8_E4M3 / F8_E5M2 candidate tensors imply fp8, BF16 ones beside them are its storage format, and
// F16 beside them is a conflict.
TEST(Fp8Check, F8CandidateTensorsImplyFp8) {
  const File g = make_op(OpCase::from_json(linear_spec("tensor")));
  const auto emu = run_op(g, Precision::fp8);
  const auto add = [&](File& c, const std::string& name, DType dtype) {
    const auto& v = emu.at(name);
    const std::vector<float> f(v.begin(), v.end());
    const auto n = static_cast<index_t>(f.size());
    if (dtype == DType::F8_E4M3 || dtype == DType::F8_E5M2) {
      std::vector<std::uint8_t> b(f.size());
      to_fp8_bits(dtype == DType::F8_E4M3 ? Fp8Format::e4m3 : Fp8Format::e5m2, true, b.data(),
                  f.data(), n);
      c.add(name, dtype, g.find(name)->shape, b.data(), b.size());
    } else {
      std::vector<std::uint16_t> h(f.size());
      to_bits(dtype == DType::BF16 ? Precision::bf16 : Precision::fp16, h.data(), f.data(), n);
      c.add(name, dtype, g.find(name)->shape, h.data(), h.size() * sizeof(std::uint16_t));
    }
  };
  for (const DType f8 : {DType::F8_E4M3, DType::F8_E5M2}) {
    File c;
    add(c, "output.y", f8);
    add(c, "grad.input.x", DType::BF16);
    const CaseReport r = check(g, c, CheckOptions{});
    EXPECT_EQ(r.precision, "fp8");
    EXPECT_EQ(result(r, "grad.input.x").status, Status::pass);
    EXPECT_TRUE(result(r, "output.y").compared);
  }
  File mixed;
  add(mixed, "output.y", DType::F8_E4M3);
  add(mixed, "grad.input.x", DType::F16);
  test::expect_throw<ConfigError>([&] { check(g, mixed, CheckOptions{}); },
                                  "one candidate is judged in one precision");
  CheckOptions bf16;
  bf16.precision = Precision::bf16;
  File f8;
  add(f8, "output.y", DType::F8_E4M3);
  test::expect_throw<ConfigError>([&] { check(g, f8, bf16); }, "which implies fp8");
}

}  // namespace
}  // namespace teo::golden
