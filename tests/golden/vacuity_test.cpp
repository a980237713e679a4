// The checker's verdict must be able to fail: a bound as large as the truth is vacuous, never a
// pass; a bias gradient is judged on its own scale, fp8 outliers or not; a precision case is judged
// in its own precision unless the candidate's dtypes say otherwise, and the report says so; an
// ill-conditioned golden says so, and does not judge its ill-conditioned tensors; the decoder's key
// bias gradients are judged as the noise they are. Then the review's smaller findings: the decoder
// layer's precision, SwiGLU's activation, BERT's pad token.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "check_support.hpp"
#include "golden/golden_internal.hpp"
#include "support.hpp"
#include "teo/config.hpp"
#include "teo/errors.hpp"
#include "teo/golden.hpp"
#include "teo/golden_ops.hpp"
#include "teo/precision.hpp"
#include "teo/rounding.hpp"
#include "teo/safetensors.hpp"
#include "test_paths.hpp"

namespace {

namespace fs = std::filesystem;
namespace st = teo::safetensors;
using teo::Precision;
using teo::golden::CaseReport;
using teo::golden::CheckOptions;
using teo::golden::Status;
using teo::golden::test_support::result;

const fs::path kCorpus = fs::path(TEO_SOURCE_DIR) / "golden";

bool f32_golden(const st::File& g) {
  return teo::golden::is_op_file(g) ? teo::golden::op_case_of(g).dtype == "float32"
                                    : teo::golden::case_of(g).dtype == "float32";
}

// A candidate holding the float64 truth of every judged tensor (in the golden's dtype, or as
// `as`), with `edit` applied to each tensor's values by name.
st::File truth_candidate(
    const st::File& g,
    const std::function<void(const std::string&, std::vector<double>&)>& edit = {},
    st::DType as = st::DType::F64) {
  const bool op = teo::golden::is_op_file(g);
  const bool f32 = f32_golden(g);
  st::File c;
  for (const auto& t : g.tensors) {
    if (!teo::golden::detail::is_judged(t.name, op)) continue;
    auto v = teo::golden::detail::truth_of(g, t, f32);
    if (edit) edit(t.name, v);
    const st::DType d = as != st::DType::F64 ? as : t.dtype;
    if (d == st::DType::F64) {
      c.add<double>(t.name, t.shape, v.data(), v.size());
    } else if (d == st::DType::F32) {
      const std::vector<float> f(v.begin(), v.end());
      c.add<float>(t.name, t.shape, f.data(), f.size());
    } else {
      // bf16 or f16: the values rounded to the format, stored as its bit patterns
      std::vector<std::uint16_t> bits(v.size());
      for (std::size_t i = 0; i < v.size(); ++i) {
        bits[i] = teo::to_bits(d == st::DType::BF16 ? Precision::bf16 : Precision::fp16,
                               static_cast<float>(v[i]));
      }
      c.add(t.name, d, t.shape, bits.data(), bits.size() * 2);
    }
  }
  return c;
}

using Edit = std::function<void(const std::string&, std::vector<double>&)>;

Edit zero_of(const std::string& which) {
  return [which](const std::string& n, std::vector<double>& v) {
    if (n == which)
      for (double& x : v) x = std::isfinite(x) ? 0 : x;
  };
}
Edit negated_of(const std::string& which) {
  return [which](const std::string& n, std::vector<double>& v) {
    if (n == which)
      for (double& x : v) x = -x;
  };
}

// ---- a bound as large as the truth --------------------------------------------------------------

// Every rule's bound made at least the truth by its own option: a zero candidate is then vacuous
// on every tensor with a nonzero truth, never a pass; just under, it fails.
TEST(Vacuity, ABoundAsLargeAsTheTruthIsVacuousInEveryRule) {
  struct Rule {
    const char* golden;
    std::function<void(CheckOptions&, double)> widen;  // the bound, in units of the scale
  };
  const std::vector<Rule> rules = {
      {"bert_f64.safetensors", [](CheckOptions& o, double f) { o.rtol = f; }},
      {"bert_f32.safetensors", [](CheckOptions& o, double f) { o.floor_eps = f / FLT_EPSILON; }},
      {"bf16_pre_gelu_mean.safetensors",
       [](CheckOptions& o, double f) { o.budget_floor = f / std::ldexp(1.0, -8); }},
  };
  for (const auto& rule : rules) {
    const st::File g = st::read((kCorpus / rule.golden).string());
    const st::File zero = truth_candidate(g, [](const std::string&, std::vector<double>& v) {
      for (double& x : v) x = std::isfinite(x) ? 0 : x;
    });
    for (double f : {1.0, 0.9}) {
      CheckOptions o;
      rule.widen(o, f);
      const CaseReport r = teo::golden::check(g, zero, o);
      int judged = 0;
      for (const auto& t : r.tensors) {
        if (t.max_abs == 0 || teo::golden::detail::noise_terms(g, t.name) > 0) continue;
        ++judged;
        if (f == 1.0) {
          // scale = max |truth| here (no bias borrows another's): the bound covers the truth
          EXPECT_EQ(t.status, Status::vacuous) << rule.golden << " " << t.name << ": " << t.message;
          if (t.status == Status::vacuous) {
            EXPECT_NE(t.message.find("so a zero would pass"), std::string::npos) << t.message;
          }
        } else {
          EXPECT_NE(t.status, Status::pass) << rule.golden << " " << t.name;
        }
      }
      EXPECT_GT(judged, 10) << rule.golden;
      // the rest pass: the key bias gradients' noise, which a zero is right for
      if (f == 1.0) {
        EXPECT_EQ(r.vacuous, judged) << rule.golden;
      }
    }
  }
}

// ---- bias gradients on their own scale ----------------------------------------------------------

// The review's cases: fp8 op cases draw one input channel in 16 at 100 times the rest, so the
// weight gradient is about 100 times the bias gradient. Judged on the weight gradient's scale, a
// zero bias gradient passed; on its own, it fails, recipe rule or not.
TEST(Vacuity, AnFp8BiasGradientIsJudgedOnItsOwnScale) {
  const st::File ffn = st::read((kCorpus / "ops" / "ffn_fp8_block.safetensors").string());
  ASSERT_EQ(teo::golden::check(ffn, truth_candidate(ffn), {}).failed, 0);
  for (const Edit& edit : {zero_of("grad.param.fc1.bias"), negated_of("grad.param.fc1.bias")}) {
    const CaseReport r = teo::golden::check(ffn, truth_candidate(ffn, edit), {});
    EXPECT_EQ(r.precision, "fp8");
    EXPECT_EQ(result(r, "grad.param.fc1.bias").status, Status::fail)
        << result(r, "grad.param.fc1.bias").message;
    EXPECT_EQ(r.failed, 1);
  }
  CheckOptions off_recipe;
  off_recipe.fp8_recipe_k = INFINITY;
  int cases = 0;
  for (const auto& e : fs::directory_iterator(kCorpus / "ops")) {
    const std::string name = e.path().filename().string();
    if (!name.starts_with("linear_fp8_") || e.path().extension() != ".safetensors") continue;
    ++cases;
    const st::File g = st::read(e.path().string());
    ASSERT_EQ(teo::golden::check(g, truth_candidate(g), off_recipe).failed, 0) << name;
    for (const Edit& edit : {zero_of("grad.param.bias"), negated_of("grad.param.bias")}) {
      const CaseReport r = teo::golden::check(g, truth_candidate(g, edit), off_recipe);
      const auto& b = result(r, "grad.param.bias");
      EXPECT_EQ(b.status, Status::fail) << name << ": " << b.message << " ratio " << b.ratio;
      EXPECT_EQ(teo::golden::verdict({r}, true).exit_code, 1) << name;
    }
  }
  EXPECT_GE(cases, 6);
}

// ---- the golden's own precision -----------------------------------------------------------------

TEST(Vacuity, APrecisionCaseIsJudgedInItsOwnPrecisionByDefault) {
  // bf16's emulated run, upcast to F32: judged as bf16, the case's precision, and passes
  const st::File kv = st::read((kCorpus / "ops" / "kvcache_decode_bf16.safetensors").string());
  const auto emu = teo::golden::run_op(kv, Precision::bf16);
  st::File up;
  for (const auto& [name, v] : emu) {
    const std::vector<float> f(v.begin(), v.end());
    up.add<float>(name, kv.find(name)->shape, f.data(), f.size());
  }
  CaseReport r = teo::golden::check(kv, up, {});
  EXPECT_EQ(r.precision, "bf16");
  EXPECT_TRUE(r.notes.empty());
  EXPECT_EQ(r.failed, 0) << r.first_divergence;
  EXPECT_GT(r.passed, 0);
  // as fp32, which the golden is not, the same candidate fails: the old default
  CheckOptions fp32;
  fp32.precision = Precision::fp32;
  EXPECT_GT(teo::golden::check(kv, up, fp32).failed, 0);

  // an fp8 golden with a BF16 candidate (fp8's storage format): fp8
  const st::File lin = st::read((kCorpus / "ops" / "linear_fp8_tensor.safetensors").string());
  r = teo::golden::check(lin, truth_candidate(lin, {}, st::DType::BF16), {});
  EXPECT_EQ(r.precision, "fp8");
  EXPECT_TRUE(r.notes.empty());

  // F16 against a bf16 golden: judged as fp16, as the dtypes imply, and the first line says why
  const st::File bf = st::read((kCorpus / "bf16_pre_gelu_mean.safetensors").string());
  ASSERT_EQ(teo::golden::case_of(bf).precision, Precision::bf16);
  r = teo::golden::check(bf, truth_candidate(bf, {}, st::DType::F16), {});
  EXPECT_EQ(r.precision, "fp16");
  ASSERT_EQ(r.notes.size(), 1u);
  EXPECT_NE(r.notes[0].find("judged as fp16"), std::string::npos) << r.notes[0];
  EXPECT_NE(r.notes[0].find("the golden is a bf16 case"), std::string::npos) << r.notes[0];
  std::ostringstream text;
  teo::golden::print_text({r}, text);
  std::string second;
  std::istringstream lines(text.str());
  std::getline(lines, second);
  std::getline(lines, second);
  EXPECT_EQ(second, "  note: " + r.notes[0]);
  EXPECT_NE(teo::golden::json_report({r}).find("\"notes\""), std::string::npos);
}

// ---- an ill-conditioned golden ------------------------------------------------------------------

TEST(Vacuity, AnIllConditionedGoldenSaysSoAndDoesNotJudgeItsIllConditionedTensors) {
  const auto cases = teo::golden::read_corpus_cases((kCorpus / "cases.json").string());
  const st::File g =
      teo::golden::make(teo::golden::test_support::ill_conditioned(cases.front().spec),
                        /*allow_ill_conditioned=*/true);
  ASSERT_NE(g.meta("ill_conditioned"), nullptr);
  const double limit = teo::golden::detail::conditioning_limit(g);
  const CaseReport zero = teo::golden::check(g,
                                             truth_candidate(g,
                                                             [](const std::string&, auto& v) {
                                                               for (double& x : v)
                                                                 x = std::isfinite(x) ? 0 : x;
                                                             }),
                                             {});
  ASSERT_FALSE(zero.notes.empty());
  EXPECT_NE(zero.notes.back().find("--allow-ill-conditioned"), std::string::npos);
  int ill_tensors = 0;
  for (const auto& t : zero.tensors) {
    const st::Tensor& gt = *g.find(t.name);
    const auto truth = teo::golden::detail::truth_of(g, gt, true);
    const double scale = teo::golden::detail::scale_of(g, t.name, truth, true);
    const double teo_err = teo::golden::detail::max_abs_diff(gt.float_values(), truth);
    if (teo_err > limit * scale) {
      ++ill_tensors;
      EXPECT_EQ(t.status, Status::vacuous) << t.name;
      EXPECT_NE(t.message.find("ill-conditioned"), std::string::npos) << t.message;
    } else if (t.max_abs > 0 && teo::golden::detail::noise_terms(g, t.name) == 0) {
      EXPECT_NE(t.status, Status::pass) << t.name;
    }
  }
  EXPECT_GT(ill_tensors, 0);
}

// ---- the decoder's key bias gradients -----------------------------------------------------------

// Each is a sum of key rows that is 0 in exact arithmetic: any order of summation is right. Its
// count of terms is the rows it sums: the target's for self-attention, the memory's for
// cross-attention.
TEST(Vacuity, DecoderKeyBiasGradientsAreNoiseOverTheRowsTheySum) {
  using teo::golden::detail::noise_terms;
  const st::File op = st::read((kCorpus / "ops" / "decoder_layer_bart_f32.safetensors").string());
  EXPECT_EQ(noise_terms(op, "grad.param.self_attn.k.bias"), 2 * 4);   // batch * seq_len
  EXPECT_EQ(noise_terms(op, "grad.param.cross_attn.k.bias"), 2 * 5);  // batch * memory_len
  EXPECT_EQ(noise_terms(op, "grad.param.self_attn.q.bias"), 0);
  const st::File seq = st::read((kCorpus / "seq2seq_bart_f32.safetensors").string());
  const auto c = teo::golden::case_of(seq);
  ASSERT_NE(c.seq_len, c.tgt_len);
  EXPECT_EQ(noise_terms(seq, "grad.decoder.layers.0.self_attn.k.bias"), c.batch * c.tgt_len);
  EXPECT_EQ(noise_terms(seq, "grad.decoder.layers.0.cross_attn.k.bias"), c.batch * c.seq_len);
  // A backend that sums the key rows in another order leaves noise of n terms' rounding: it
  // passes; a wrong key bias gradient, of the weight gradient's order, fails.
  for (const char* k : {"grad.param.self_attn.k.bias", "grad.param.cross_attn.k.bias"}) {
    const std::string w = std::string(k).substr(0, std::string(k).size() - 4) + "weight";
    double wmax = 0;
    for (double x : op.find("ref64." + w)->float_values()) wmax = std::max(wmax, std::abs(x));
    const double noise = 4 * FLT_EPSILON * wmax;  // within n * u * scale for n >= 8
    const auto shifted = [&](double by) {
      return [k, by](const std::string& n, std::vector<double>& v) {
        if (n == k)
          for (double& x : v) x += by;
      };
    };
    EXPECT_EQ(result(teo::golden::check(op, truth_candidate(op, shifted(noise)), {}), k).status,
              Status::pass)
        << k;
    EXPECT_EQ(
        result(teo::golden::check(op, truth_candidate(op, shifted(0.02 * wmax)), {}), k).status,
        Status::fail)
        << k;
  }
}

}  // namespace

// ---- the review's other findings ----------------------------------------------------------------

namespace findings {

// The decoder layer emulates no reduced precision (semantics 17.4): a precision case of it, a
// reduced-precision run of it, and a check in a reduced precision are refused by name.
TEST(ReviewFindings, TheDecoderLayerRefusesAReducedPrecisionByName) {
  nlohmann::json spec = nlohmann::json::parse(
      R"({"op": "decoder_layer", "batch": 2, "seq_len": 3, "memory_len": 4, "d_model": 4,
          "num_heads": 2, "d_ff": 6, "dtype": "float32", "seed": 1, "precision": "bf16"})");
  teo::test::expect_throw<teo::ConfigError>([&] { teo::golden::OpCase::from_json(spec); },
                                            "emulates no reduced precision");
  const st::File g = st::read((kCorpus / "ops" / "decoder_layer_bart_f32.safetensors").string());
  EXPECT_THROW(teo::golden::run_op(g, Precision::bf16), teo::ConfigError);
  CheckOptions bf16;
  bf16.precision = Precision::bf16;
  EXPECT_THROW(teo::golden::check(g, truth_candidate(g), bf16), teo::ConfigError);
  CheckOptions fp32;
  fp32.precision = Precision::fp32;
  EXPECT_EQ(teo::golden::check(g, truth_candidate(g), fp32).failed, 0);
}

// SwiGLU gates with silu: "activation": "gelu" beside it is refused, and a left-out activation is
// written as silu (the committed swiglu cases' specs say so).
TEST(ReviewFindings, SwigluWithAnotherActivationIsRefusedAndItsSpecSaysSilu) {
  auto j = nlohmann::json::parse(R"({"vocab_size": 8, "max_len": 4, "d_model": 4, "num_heads": 2,
      "d_ff": 6, "num_layers": 1, "num_classes": 2, "ffn": "swiglu"})");
  EXPECT_EQ(teo::ModelConfig::from_json(j).to_json()["activation"], "silu");
  j["activation"] = "gelu";
  EXPECT_THROW(teo::ModelConfig::from_json(j), teo::ConfigError);
  j["activation"] = "silu";
  EXPECT_NO_THROW(teo::ModelConfig::from_json(j));
  for (const char* f : {"ffn_swiglu_f64", "ffn_swiglu_bf16"}) {
    const st::File g = st::read((kCorpus / "ops" / (std::string(f) + ".safetensors")).string());
    EXPECT_EQ(teo::golden::op_case_of(g).spec.at("activation"), "silu") << f;
  }
}

// Every committed case with a padding_idx (BERT, RoBERTa) holds that pad token at its padded
// positions, and some case of each padding_idx has padded positions at all.
TEST(ReviewFindings, BertAndRobertaCasesHoldThePadTokenWherePadded) {
  int cases = 0, padded = 0;
  for (const auto& e : fs::directory_iterator(kCorpus)) {
    if (e.path().extension() != ".safetensors") continue;
    const st::File g = st::read(e.path().string());
    const auto c = teo::golden::case_of(g);
    if (!c.config.embeddings.padding_idx || !g.find("input.tokens")) continue;
    ++cases;
    const auto tokens = g.find("input.tokens")->int_values();
    const auto lengths = g.find("input.lengths")->int_values();
    for (std::int64_t b = 0; b < c.batch; ++b) {
      for (std::int64_t s = lengths[static_cast<std::size_t>(b)]; s < c.seq_len; ++s) {
        ++padded;
        EXPECT_EQ(tokens[static_cast<std::size_t>(b * c.seq_len + s)],
                  *c.config.embeddings.padding_idx)
            << e.path().filename() << " at (" << b << ", " << s << ")";
      }
    }
  }
  EXPECT_GE(cases, 7);
  EXPECT_GT(padded, 7);
}

}  // namespace findings

namespace docs {

// docs/golden-format.md's table of vacuity limits ("Vacuous budgets") is the code's.
TEST(Vacuity, TheDocsTableOfLimitsIsTheCode) {
  std::ifstream in(kCorpus.parent_path() / "docs" / "golden-format.md");
  std::string line;
  bool in_table = false;
  int rows = 0;
  while (std::getline(in, line)) {
    if (line.starts_with("| precision | vacuous above")) {
      in_table = true;
      continue;
    }
    if (!in_table || line.starts_with("|---")) continue;
    if (!line.starts_with("| `")) break;
    const auto name = line.substr(3, line.find('`', 3) - 3);
    const double limit = std::stod(line.substr(line.rfind('|', line.size() - 2) + 1));
    const bool recipe = line.find("where the recipe rule decides") != std::string::npos;
    const Precision p = teo::parse_precision(name, "the docs' table");
    EXPECT_EQ(limit, teo::golden::detail::vacuous_limit(p, recipe)) << line;
    ++rows;
  }
  EXPECT_EQ(rows, 6) << "the table under \"Vacuous budgets\" in docs/golden-format.md";
}

}  // namespace docs
