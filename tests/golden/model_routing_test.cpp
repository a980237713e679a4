// The routing of the mixture-of-experts model cases (docs/golden-format.md, "Routing"): the corpus
// exercises what each family's router exists for and keeps every position's choice clear of its
// precision's tolerance; a wrong expert fails at its layer's act.layers.{i}.moe.topk_ids, as do
// the mutants a backend ships (a correction bias ignored, norm_topk_prob ignored, the weight at
// the wrong end); a backend that routes a near tie otherwise is reported ambiguous by layer and
// position, in every report format, with everything computed from that routing not judged; router
// replay judges the same backend in full; and no backend emulated in bf16, fp16, tf32 or fp8 is
// ever told it chose a wrong expert.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "check_support.hpp"
#include "golden/check_routing.hpp"
#include "golden/golden_internal.hpp"
#include "teo/golden.hpp"
#include "teo/layers/moe.hpp"
#include "teo/model.hpp"
#include "teo/precision.hpp"
#include "teo/safetensors.hpp"
#include "test_paths.hpp"

namespace {

namespace fs = std::filesystem;
namespace st = teo::safetensors;
namespace golden = teo::golden;
using json = nlohmann::json;
using teo::index_t;
using teo::ModelConfig;
using teo::Precision;
using teo::golden::CaseReport;
using teo::golden::CheckOptions;
using teo::golden::Status;
using teo::golden::test_support::result;

using Routing = std::map<index_t, std::vector<std::int32_t>>;

// The committed MoE model cases (golden/cases.json's with ffn "moe": the families' shapes, a
// generation stream, a replay case, bf16 and fp8 precision cases), read once, by name.
const std::map<std::string, st::File>& moe_corpus() {
  static const std::map<std::string, st::File> out = [] {
    std::map<std::string, st::File> m;
    const fs::path root = fs::path(TEO_SOURCE_DIR) / "golden";
    std::ifstream in(root / "cases.json");
    const json all = json::parse(in);
    for (const json& c : all.at("cases")) {
      if (c.value("ffn", "") != "moe") continue;
      const std::string name = c.at("name");
      m.emplace(name, st::read((root / (name + ".safetensors")).string()));
    }
    return m;
  }();
  return out;
}

// The golden's routing, by layer (act.layers.{i}.moe.topk_ids).
Routing routing_of(const st::File& g, const ModelConfig& cfg) {
  Routing r;
  for (index_t i = 0; i < cfg.num_layers; ++i) {
    if (const auto* t = g.find("act.layers." + std::to_string(i) + ".moe.topk_ids")) {
      const auto v = t->int_values();
      r[i].assign(v.begin(), v.end());
    }
  }
  return r;
}

teo::Batch batch_of(const st::File& g, const golden::Case& c) {
  teo::Batch b;
  b.batch = c.batch;
  b.seq_len = c.seq_len;
  b.tokens = g.find("input.tokens")->values<std::int64_t>();
  b.lengths = g.find("input.lengths")->values<std::int64_t>();
  return b;
}

template <class Real>
teo::Params<Real> params_of(const st::File& g, const ModelConfig& cfg) {
  auto p = teo::Params<Real>::zeros(cfg);
  p.visit([&](const std::string& n, teo::Tensor<Real>& t) {
    const auto v = g.find("param." + n)->float_values();
    for (index_t i = 0; i < t.numel(); ++i)
      t[i] = static_cast<Real>(v[static_cast<std::size_t>(i)]);
  });
  return p;
}

// A backend's candidate: teo's own run of g's case in precision p (float32; fp64: float64) under
// `cfg` (the golden's, or a mutant's), routing by itself, or fed `given`. `edit` changes the
// parameters first.
template <class Edit>
st::File candidate(const st::File& g, Precision p, const ModelConfig& cfg, const Routing* given,
                   Edit edit) {
  const golden::Case c = golden::case_of(g);
  const teo::Batch b = batch_of(g, c);
  golden::RunOptions o;
  o.routing = given;
  if (p == Precision::fp64) {
    auto params = params_of<double>(g, cfg);
    edit(params);
    return golden::run_tensors(params, b, o);
  }
  auto params = params_of<float>(g, cfg);
  edit(params);
  teo::round_params(params, p);
  o.precision = p;
  return golden::run_tensors(params, b, o);
}
st::File candidate(const st::File& g, Precision p, const Routing* given = nullptr) {
  return candidate(g, p, golden::case_of(g).config, given, [](auto&) {});
}

CheckOptions judged_as(Precision p) {
  CheckOptions o;
  o.precision = p;
  return o;
}

void set_ids(st::File& c, const std::string& name, const std::vector<std::int32_t>& ids) {
  auto* t = const_cast<st::Tensor*>(c.find(name));
  ASSERT_NE(t, nullptr) << name;
  ASSERT_EQ(t->bytes.size(), ids.size() * sizeof(std::int32_t));
  std::memcpy(t->bytes.data(), ids.data(), t->bytes.size());
}

// Every MoE layer's choice is clear of its case's precision, its grouped layout is the stable
// counting sort of that choice, and each family's case exercises what its variant exists for.
TEST(ModelRouting, TheDrawnCasesKeepTheirRoutingClearAndExerciseTheirVariants) {
  const auto& corpus = moe_corpus();
  ASSERT_GE(corpus.size(), 11u);
  int replayed = 0, generation = 0, precision = 0;
  for (const auto& [name, g] : corpus) {
    SCOPED_TRACE(name);
    const golden::Case c = golden::case_of(g);
    const ModelConfig& cfg = c.config;
    const bool f32 = c.dtype == "float32";
    const Precision p = c.precision.value_or(Precision::fp32);
    const bool budget = !(p == Precision::fp32 && f32);
    const auto emu = budget ? golden::emulate(g, p) : std::map<std::string, std::vector<double>>();
    const auto unclear = golden::detail::unclear_routing(g, cfg, f32, p, emu);
    EXPECT_TRUE(unclear.empty()) << unclear.size() << " position(s), first " << unclear[0].position
                                 << " of layer " << unclear[0].layer;
    const index_t E = cfg.ffn.moe.num_experts, k = cfg.ffn.moe.num_experts_per_tok;
    for (const auto& [layer, ids] : routing_of(g, cfg)) {
      const std::string n = "act.layers." + std::to_string(layer) + ".moe.";
      const auto offsets = g.find(n + "expert_offsets")->int_values();
      const auto rows = g.find(n + "source_rows")->int_values();
      ASSERT_EQ(offsets.size(), static_cast<std::size_t>(E + 1));
      ASSERT_EQ(rows.size(), ids.size());
      // expert e's rows are the (position, slot) pairs that chose it, in pair order
      std::int64_t at = 0;
      for (index_t e = 0; e < E; ++e) {
        EXPECT_EQ(offsets[static_cast<std::size_t>(e)], at);
        for (std::size_t pair = 0; pair < ids.size(); ++pair)
          if (ids[pair] == e) {
            EXPECT_EQ(rows[static_cast<std::size_t>(at++)], std::int64_t(pair));
          }
      }
      EXPECT_EQ(offsets.back(), static_cast<std::int64_t>(ids.size()));
      if (c.replay_routing) {
        const auto given = g.find("input.layers." + std::to_string(layer) + ".moe.topk_ids");
        ASSERT_NE(given, nullptr);
        EXPECT_EQ(given->int_values(), std::vector<std::int64_t>(ids.begin(), ids.end()));
        ++replayed;
      }
    }
    generation += c.steps > 0;
    precision += c.precision.has_value();
    const auto& m = cfg.ffn.moe;
    if (m.selection_bias && m.router_groups > 1) {
      // DeepSeek-V3: the dense first layer, a correction that changes choices, and positions
      // whose best expert lies in a group the group limit leaves out
      ASSERT_GE(m.first_dense_layers, 1);
      EXPECT_NE(g.find("param.layers.0.ffn.fc1.weight"), nullptr);
      EXPECT_EQ(g.find("param.layers.0.moe.gate.weight"), nullptr);
      const index_t L = m.first_dense_layers;
      const std::string n = "act.layers." + std::to_string(L) + ".moe.";
      const auto logits = g.find(n + "logits")->float_values();
      const auto corr =
          g.find("param.layers." + std::to_string(L) + ".moe.gate.e_score_correction_bias")
              ->float_values();
      const auto spec = teo::moe_spec(m, cfg.d_model).router;
      const index_t N = static_cast<index_t>(logits.size()) / E;
      teo::Routing<double> with, without;
      teo::route(spec, logits.data(), corr.data(), nullptr, N, with);
      teo::route(spec, logits.data(), static_cast<const double*>(nullptr), nullptr, N, without);
      EXPECT_NE(with.ids, without.ids) << "the correction bias changes no choice";
      int outside = 0;
      const index_t per = E / m.router_groups;
      for (index_t t = 0; t < N; ++t) {
        index_t best = 0;
        for (index_t e = 1; e < E; ++e) {
          const auto s = [&](index_t x) {
            const double l = logits[static_cast<std::size_t>(t * E + x)];
            return 1 / (1 + std::exp(-l)) + corr[static_cast<std::size_t>(x)];
          };
          if (s(e) > s(best)) best = e;
        }
        bool chosen_group = false;
        for (index_t j = 0; j < k; ++j)
          chosen_group |= with.ids[static_cast<std::size_t>(t * k + j)] / per == best / per;
        outside += !chosen_group;
      }
      EXPECT_GT(outside, 0) << "no position's best expert sits in a group left out";
    }
    if (m.expert_kind == teo::ExpertKind::clamped_swiglu) {
      // gpt-oss: the clamp at `limit` is active for some gate and some up values, not all
      auto params = params_of<double>(g, cfg);
      teo::Activations<double> acts;
      teo::forward(params, batch_of(g, c), acts, {.train = false});
      int gate_over = 0, up_over = 0, inside = 0;
      for (const auto& l : acts.layers) {
        for (double v : l.moe.gate_pre) gate_over += v > m.swiglu_limit;
        for (double v : l.moe.up_pre) up_over += std::abs(v) > m.swiglu_limit;
        for (double v : l.moe.up_pre) inside += std::abs(v) < m.swiglu_limit;
      }
      EXPECT_GT(gate_over, 0);
      EXPECT_GT(up_over, 0);
      EXPECT_GT(inside, 0);
    }
  }
  EXPECT_GT(replayed, 0);
  EXPECT_GT(generation, 0);
  EXPECT_GE(precision, 2);
}

// A wrong expert at a clear choice fails at its layer's topk_ids, by name; so do the mutants.
TEST(ModelRouting, AWrongExpertAndEachMutantFailWhereNamed) {
  const auto& corpus = moe_corpus();
  {
    const st::File& g = corpus.at("moe_qwen3_f64");
    const ModelConfig cfg = golden::case_of(g).config;
    st::File c = candidate(g, Precision::fp64);
    const CaseReport ok = golden::check(g, c, {});
    EXPECT_EQ(ok.failed, 0);
    EXPECT_EQ(ok.ambiguous, 0);
    EXPECT_EQ(result(ok, "act.layers.1.moe.topk_ids").status, Status::pass);
    EXPECT_EQ(result(ok, "act.layers.1.moe.source_rows").status, Status::pass);
    // position 3's last slot given an expert it did not choose
    auto ids = c.find("act.layers.1.moe.topk_ids")->values<std::int32_t>();
    const index_t k = cfg.ffn.moe.num_experts_per_tok;
    std::vector<bool> chosen(16, false);
    for (index_t j = 0; j < k; ++j) chosen[static_cast<std::size_t>(ids[3 * k + j])] = true;
    ids[static_cast<std::size_t>(3 * k + k - 1)] =
        static_cast<std::int32_t>(std::find(chosen.begin(), chosen.end(), false) - chosen.begin());
    set_ids(c, "act.layers.1.moe.topk_ids", ids);
    const CaseReport bad = golden::check(g, c, {});
    EXPECT_EQ(result(bad, "act.layers.1.moe.topk_ids").status, Status::fail);
    EXPECT_NE(result(bad, "act.layers.1.moe.topk_ids").message.find("wrong expert"),
              std::string::npos);
    EXPECT_NE(result(bad, "act.layers.1.moe.topk_ids").message.find("position 3"),
              std::string::npos);
    EXPECT_EQ(bad.first_divergence, "layers.1.moe.topk_ids");
    EXPECT_TRUE(bad.ambiguous_tokens.empty());
    // norm_topk_prob ignored: the routing stands, its weights fail
    ModelConfig mutant = cfg;
    mutant.ffn.moe.norm_topk_prob = false;
    const CaseReport r =
        golden::check(g, candidate(g, Precision::fp64, mutant, nullptr, [](auto&) {}), {});
    EXPECT_EQ(result(r, "act.layers.0.moe.topk_ids").status, Status::pass);
    EXPECT_EQ(result(r, "act.layers.0.moe.topk_weights").status, Status::fail);
    EXPECT_EQ(r.first_divergence, "layers.0.moe.topk_weights");
  }
  {
    // DeepSeek-V3's correction bias ignored in the choice: a wrong expert at the first MoE layer
    const st::File& g = corpus.at("moe_deepseek_v3_f64");
    const ModelConfig cfg = golden::case_of(g).config;
    const CaseReport r =
        golden::check(g,
                      candidate(g, Precision::fp64, cfg, nullptr,
                                [](auto& p) { p.layers[1].router_correction.zero(); }),
                      {});
    EXPECT_EQ(result(r, "act.layers.1.moe.topk_ids").status, Status::fail);
    EXPECT_EQ(r.first_divergence, "layers.1.moe.topk_ids");
  }
  {
    // Llama 4's weight applied at the expert's output instead of its input
    const st::File& g = corpus.at("moe_llama4_f64");
    ModelConfig mutant = golden::case_of(g).config;
    mutant.ffn.moe.weight_at_input = false;
    const CaseReport r =
        golden::check(g, candidate(g, Precision::fp64, mutant, nullptr, [](auto&) {}), {});
    EXPECT_EQ(result(r, "act.layers.0.moe.topk_ids").status, Status::pass);
    EXPECT_EQ(result(r, "act.layers.0.moe.expert_in").status, Status::fail);
    EXPECT_EQ(r.first_divergence, "layers.0.moe.expert_in");
  }
  {
    // gpt-oss without its clamp
    const st::File& g = corpus.at("moe_gpt_oss_f64");
    ModelConfig mutant = golden::case_of(g).config;
    mutant.ffn.moe.swiglu_limit = 1e300;
    const CaseReport r =
        golden::check(g, candidate(g, Precision::fp64, mutant, nullptr, [](auto&) {}), {});
    EXPECT_EQ(result(r, "act.layers.0.moe.expert_in").status, Status::pass);
    EXPECT_EQ(result(r, "act.layers.0.moe.expert_hidden").status, Status::fail);
    EXPECT_EQ(r.first_divergence, "layers.0.moe.expert_hidden");
  }
}

golden::Case near_tie_case(bool replay) {
  // Qwen3-style top-8 of 16, cleared for float32 only: in bf16 its near ties fall otherwise
  json j = {{"architecture", "decoder"},
            {"vocab_size", 16},
            {"max_len", 16},
            {"d_model", 16},
            {"num_heads", 2},
            {"num_layers", 2},
            {"d_ff", 16},
            {"norm", "rmsnorm"},
            {"norm_first", true},
            {"positional", "rope"},
            {"ffn", "moe"},
            {"activation", "silu"},
            {"tie_embeddings", false},
            {"num_experts", 16},
            {"num_experts_per_tok", 8},
            {"moe_d_ff", 2},
            {"norm_topk_prob", true}};
  j["case"] = {{"batch", 4},
               {"seq_len", 12},
               {"dtype", "float32"},
               {"seed", 11u},
               {"replay_routing", replay}};
  return golden::Case::from_json(j);
}

TEST(ModelRouting, ANearTieIsAmbiguousByLayerAndPositionAndReplayJudgesTheExperts) {
  const st::File g = golden::make(near_tie_case(false));
  const ModelConfig cfg = golden::case_of(g).config;
  // a bf16 backend that routes by itself
  const st::File own = candidate(g, Precision::bf16);
  const CaseReport r = golden::check(g, own, judged_as(Precision::bf16));
  ASSERT_FALSE(r.ambiguous_tokens.empty()) << "no near tie fell otherwise: a larger case?";
  EXPECT_EQ(r.failed, 0);
  const auto& a = r.ambiguous_tokens.front();
  ASSERT_TRUE(a.layer == "layers.0" || a.layer == "layers.1") << a.layer;
  const std::string L = a.layer.substr(7);
  for (const auto& t : r.ambiguous_tokens) {
    EXPECT_EQ(t.layer, a.layer);
    EXPECT_LE(t.margin, t.tolerance);
  }
  EXPECT_EQ(result(r, "act.layers." + L + ".moe.topk_ids").status, Status::ambiguous);
  // what the routing computes is not judged; what comes before it is
  for (const std::string& whole : std::vector<std::string>{
           "act.layers." + L + ".moe.topk_weights", "act.layers." + L + ".moe.expert_out",
           "act.layers.1.output", "act.lm_logits", "act.loss", "grad.layers.0.attn.q.weight"})
    EXPECT_EQ(result(r, whole).status, Status::ambiguous) << whole;
  for (const std::string& before : std::vector<std::string>{
           "act.layers." + L + ".moe.logits", "act.layers.0.probs", "act.layers." + L + ".norm2"})
    EXPECT_EQ(result(r, before).status, Status::pass) << before;
  // counted, never passed: a warning, and a failure with --require-all
  EXPECT_EQ(golden::verdict({r}, false).exit_code, 0);
  EXPECT_NE(golden::verdict({r}, false).reason.find("ambiguous"), std::string::npos);
  EXPECT_EQ(golden::verdict({r}, true).exit_code, 1);
  // in every report format, by layer and position
  const std::string pos = std::to_string(a.token);
  std::ostringstream text;
  golden::print_text({r}, text);
  EXPECT_NE(text.str().find("ambiguous routing"), std::string::npos);
  EXPECT_NE(text.str().find(a.layer), std::string::npos);
  const json j = json::parse(golden::json_report({r}));
  EXPECT_EQ(j["ambiguous"], r.ambiguous);
  EXPECT_EQ(j["cases"][0]["ambiguous_tokens"][0]["token"], a.token);
  EXPECT_EQ(j["cases"][0]["ambiguous_tokens"][0]["layer"], a.layer);
  const std::string junit = golden::junit_xml({r});
  EXPECT_NE(junit.find("name=\"ambiguous_token\""), std::string::npos);
  EXPECT_NE(junit.find(a.layer), std::string::npos);
  EXPECT_NE(junit.find("<skipped"), std::string::npos);
  // an implausible choice at that near tie (its experts in reverse) is a wrong one
  {
    st::File bad = own;
    const std::string n = "act.layers." + L + ".moe.topk_ids";
    auto ids = bad.find(n)->values<std::int32_t>();
    std::reverse(ids.begin() + a.token * 8, ids.begin() + (a.token + 1) * 8);
    set_ids(bad, n, ids);
    const CaseReport b = golden::check(g, bad, judged_as(Precision::bf16));
    EXPECT_EQ(result(b, n).status, Status::fail);
    EXPECT_EQ(b.first_divergence, n.substr(4));
  }

  // router replay: the same backend fed the golden's routing passes in full
  const st::File gr = golden::make(near_tie_case(true));
  const Routing given = routing_of(gr, cfg);
  const st::File fed = candidate(gr, Precision::bf16, &given);
  const CaseReport rr = golden::check(gr, fed, judged_as(Precision::bf16));
  EXPECT_TRUE(rr.ambiguous_tokens.empty());
  EXPECT_EQ(rr.failed, 0);
  EXPECT_EQ(golden::verdict({rr}, false).exit_code, 0) << golden::verdict({rr}, false).reason;
  // and the same backend routing by itself where the routing was given fails at the change
  const CaseReport rb =
      golden::check(gr, candidate(gr, Precision::bf16), judged_as(Precision::bf16));
  EXPECT_GT(rb.failed, 0);
  EXPECT_TRUE(rb.ambiguous_tokens.empty());
  EXPECT_NE(rb.first_divergence.find("moe.topk_ids"), std::string::npos) << rb.first_divergence;
}

TEST(ModelRouting, NoEmulatedBackendIsEverToldItChoseAWrongExpert) {
  int ambiguous = 0, judged = 0;
  for (const auto& [name, g] : moe_corpus()) {
    const golden::Case c = golden::case_of(g);
    for (Precision p : {Precision::bf16, Precision::fp16, Precision::tf32, Precision::fp8}) {
      SCOPED_TRACE(name + " as " + teo::to_string(p));
      const CaseReport r = golden::check(g, candidate(g, p), judged_as(p));
      for (index_t i = 0; i < c.config.num_layers; ++i) {
        const std::string n = "act.layers." + std::to_string(i) + ".moe.topk_ids";
        if (!g.find(n)) continue;
        ++judged;
        EXPECT_NE(result(r, n).status, Status::fail) << result(r, n).message;
      }
      ambiguous += static_cast<int>(r.ambiguous_tokens.size());
    }
  }
  EXPECT_GT(judged, 0);
  std::cout << "emulated backends: " << ambiguous
            << " position(s) routed otherwise over the MoE corpus, all ambiguous\n";
}

}  // namespace
