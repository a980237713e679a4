// The routing of the mixture-of-experts op cases (docs/golden-format.md, "Routing"): the corpus
// exercises what each router variant exists for and keeps every drawn choice clear of its
// precision's tolerance; a backend that routes a near tie otherwise is reported ambiguous (by
// token, in every report format) and never failed, while a wrong expert, an implausible choice at
// a near tie or any change of a replayed routing fails at output.topk_ids; router replay judges
// the same backend's experts in full; and no backend emulated in bf16, fp16, tf32 or fp8 is ever
// told it chose a wrong expert.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "check_support.hpp"
#include "golden/golden_internal.hpp"
#include "golden/routing.hpp"
#include "teo/golden.hpp"
#include "teo/golden_ops.hpp"
#include "teo/layers/moe_router.hpp"
#include "teo/precision.hpp"
#include "teo/safetensors.hpp"
#include "test_paths.hpp"

namespace {

namespace fs = std::filesystem;
namespace st = teo::safetensors;
namespace golden = teo::golden;
using json = nlohmann::json;
using teo::Precision;
using teo::golden::CaseReport;
using teo::golden::CheckOptions;
using teo::golden::Status;
using teo::golden::test_support::result;

st::File router_case(json spec) {
  spec["op"] = "moe_router";
  return golden::make_op(golden::OpCase::from_json(spec));
}

json qwen_like(bool replay) {
  return {{"tokens", 96},           {"d_model", 16},
          {"num_experts", 16},      {"num_experts_per_tok", 8},
          {"norm_topk_prob", true}, {"replay_routing", replay},
          {"dtype", "float32"},     {"seed", 5}};
}

// A candidate from teo's own run of g emulating p: with `own_routing`, the run routes by itself
// (a backend in p, whose near ties may fall otherwise); else on the golden's routing.
st::File emulated_candidate(const st::File& g, Precision p, bool own_routing) {
  st::File in = g;
  if (own_routing) {
    std::erase_if(in.tensors, [](const st::Tensor& t) { return t.name == "output.topk_ids"; });
  }
  st::File c;
  for (const auto& [name, v] : golden::run_op(in, p)) {
    const auto* t = g.find(name);
    if (!t) continue;
    if (t->dtype == st::DType::I32) {
      const std::vector<std::int32_t> ids(v.begin(), v.end());
      c.add<std::int32_t>(name, t->shape, ids.data(), ids.size());
    } else {
      const std::vector<float> f(v.begin(), v.end());
      c.add<float>(name, t->shape, f.data(), f.size());
    }
  }
  return c;
}

// Every result of the golden: a perfect candidate.
st::File results_of(const st::File& g) {
  st::File c;
  for (const auto& t : g.tensors)
    if (golden::detail::is_judged(t.name, true)) c.tensors.push_back(t);
  return c;
}

std::vector<std::int32_t>& ids_of(st::File& c, std::vector<std::int32_t>& store) {
  store = c.find("output.topk_ids")->values<std::int32_t>();
  return store;
}

void set_ids(st::File& c, const std::vector<std::int32_t>& ids) {
  const auto t = std::find_if(c.tensors.begin(), c.tensors.end(),
                              [](const st::Tensor& x) { return x.name == "output.topk_ids"; });
  ASSERT_EQ(t->bytes.size(), ids.size() * sizeof(std::int32_t));
  std::memcpy(t->bytes.data(), ids.data(), t->bytes.size());
}

CheckOptions judged_as(Precision p) {
  CheckOptions o;
  o.precision = p;
  return o;
}

// The bf16 tolerance of each token of g.
std::vector<double> tolerance(const st::File& g, Precision p) {
  const auto rc = golden::detail::routed_case(g);
  const auto x = g.find("input.x")->float_values();
  const auto w = g.find("param.gate.weight")->float_values();
  const auto* b = g.find("param.gate.bias");
  const auto bv = b ? b->float_values() : std::vector<double>();
  return golden::detail::routing_tolerance(rc->router, x.data(), w.data(), b ? bv.data() : nullptr,
                                           rc->tokens, rc->d_model, p);
}

std::vector<double> truth(const st::File& g, const std::string& name) {
  const auto* r = g.find("ref64." + name);
  return (r ? r : g.find(name))->float_values();
}

TEST(Routing, TheCorpusExercisesEachRouterVariantAndKeepsItsChoicesClear) {
  const fs::path dir = fs::path(TEO_SOURCE_DIR) / "golden" / "ops";
  int files = 0, corrected = 0, outside_groups = 0, tied = 0, replayed = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (!name.starts_with("moe_router_")) continue;
    SCOPED_TRACE(name);
    ++files;
    const st::File g = st::read(e.path().string());
    const auto c = golden::op_case_of(g);
    const auto rc = golden::detail::routed_case(g);
    ASSERT_TRUE(rc.has_value());
    const auto T = rc->tokens, k = rc->router.top_k;
    const auto margin = truth(g, "output.selection_margin");
    const auto tol = tolerance(g, c.precision.value_or(Precision::fp32));
    const bool ties = c.spec.value("ties", false);
    const auto ids = g.find("output.topk_ids")->int_values();
    for (std::int64_t t = 0; t < T; ++t) {
      const auto i = static_cast<std::size_t>(t);
      if (ties && margin[i] == 0) {
        // the tie: experts 0 and 1 side by side, the lower first
        const auto row = std::vector<std::int64_t>(ids.begin() + t * k, ids.begin() + (t + 1) * k);
        const auto at0 = std::find(row.begin(), row.end(), 0),
                   at1 = std::find(row.begin(), row.end(), 1);
        if (at0 != row.end() && at1 != row.end()) {
          EXPECT_EQ(at1 - at0, 1) << "token " << t;
          ++tied;
        }
        continue;
      }
      EXPECT_GT(margin[i], 2 * tol[i]) << "token " << t << " is within twice its tolerance";
    }
    if (const auto* given = g.find("input.moe.topk_ids")) {
      EXPECT_EQ(given->int_values(), ids);
      ++replayed;
    }
    const auto logits = truth(g, "output.logits");
    if (g.find("param.gate.e_score_correction_bias")) {
      // the correction bias changes some choices
      teo::Routing<double> without;
      teo::route(rc->router, logits.data(), static_cast<const double*>(nullptr), nullptr, T,
                 without);
      std::vector<std::int64_t> plain(without.ids.begin(), without.ids.end());
      corrected += plain != ids;
      EXPECT_NE(plain, ids) << "the correction bias changes no choice";
    }
    if (rc->router.groups > 1) {
      // a token whose best expert sits in a group that is not chosen
      const auto* corr = g.find("param.gate.e_score_correction_bias");
      const auto bias = corr ? corr->float_values() : std::vector<double>();
      const auto E = rc->router.experts;
      for (std::int64_t t = 0; t < T; ++t) {
        const auto* l = logits.data() + t * E;
        // softmax is monotone: its best is the best logit's
        std::int64_t best = 0;
        double top = -INFINITY;
        for (std::int64_t x = 0; x < E; ++x) {
          const auto i = static_cast<std::size_t>(x);
          const double s = rc->router.scoring == teo::RouterScoring::sigmoid
                               ? 1 / (1 + std::exp(-l[x])) + (bias.empty() ? 0.0 : bias[i])
                               : l[x];
          if (s > top) top = s, best = x;
        }
        const auto row = std::vector<std::int64_t>(ids.begin() + t * k, ids.begin() + (t + 1) * k);
        outside_groups += std::find(row.begin(), row.end(), best) == row.end();
      }
    }
  }
  EXPECT_GE(files, 11);
  EXPECT_GE(corrected, 1);
  EXPECT_GE(outside_groups, 1) << "no token's best expert sits in a group not chosen";
  EXPECT_GE(tied, 1);
  EXPECT_GE(replayed, 1);
}

TEST(Routing, ANearTieRoutedOtherwiseIsAmbiguousInEveryReportAndReplayJudgesTheExperts) {
  const st::File g = router_case(qwen_like(false));
  // a bf16 backend that routes by itself: its near ties fall otherwise
  const st::File own = emulated_candidate(g, Precision::bf16, /*own_routing=*/true);
  const CaseReport r = golden::check(g, own, judged_as(Precision::bf16));
  ASSERT_FALSE(r.ambiguous_tokens.empty()) << "no near tie fell otherwise: a larger case?";
  EXPECT_EQ(r.failed, 0);
  EXPECT_EQ(result(r, "output.topk_ids").status, Status::ambiguous);
  EXPECT_EQ(result(r, "output.topk_weights").status, Status::pass);
  EXPECT_NE(result(r, "output.topk_weights")
                .excluded.find(std::to_string(r.ambiguous_tokens.front().token)),
            std::string::npos);
  for (const char* whole : {"output.aux_loss", "grad.input.x", "grad.param.gate.weight"})
    EXPECT_EQ(result(r, whole).status, Status::ambiguous) << whole;
  EXPECT_EQ(result(r, "output.z_loss").status, Status::pass);
  EXPECT_EQ(result(r, "output.logits").status, Status::pass);
  for (const auto& a : r.ambiguous_tokens) EXPECT_LE(a.margin, a.tolerance);
  // counted, never passed: a warning, and a failure with --require-all
  EXPECT_EQ(golden::verdict({r}, false).exit_code, 0);
  EXPECT_NE(golden::verdict({r}, false).reason.find("ambiguous"), std::string::npos);
  EXPECT_EQ(golden::verdict({r}, true).exit_code, 1);
  // in every report format, by token
  const std::string token = std::to_string(r.ambiguous_tokens.front().token);
  std::ostringstream text;
  golden::print_text({r}, text);
  EXPECT_NE(text.str().find("ambiguous routing"), std::string::npos);
  EXPECT_NE(text.str().find("token " + token + ":"), std::string::npos);
  const json j = json::parse(golden::json_report({r}));
  EXPECT_EQ(j["ambiguous"], r.ambiguous);
  EXPECT_EQ(j["cases"][0]["ambiguous_tokens"][0]["token"], r.ambiguous_tokens.front().token);
  const std::string junit = golden::junit_xml({r});
  EXPECT_NE(junit.find("name=\"ambiguous_token\" value=\"token " + token), std::string::npos);
  EXPECT_NE(junit.find("<skipped"), std::string::npos);

  // an implausible choice at that near tie (its experts in reverse) is a wrong one
  {
    st::File bad = own;
    std::vector<std::int32_t> ids;
    ids_of(bad, ids);
    const auto t = r.ambiguous_tokens.front().token, k = std::int64_t{8};
    std::reverse(ids.begin() + t * k, ids.begin() + (t + 1) * k);
    set_ids(bad, ids);
    const CaseReport b = golden::check(g, bad, judged_as(Precision::bf16));
    EXPECT_EQ(result(b, "output.topk_ids").status, Status::fail);
    EXPECT_EQ(b.first_divergence, "output.topk_ids");
  }
  // a wrong expert where the choice is clear fails, by name
  {
    st::File bad = results_of(g);
    std::vector<std::int32_t> ids;
    ids_of(bad, ids);
    const auto margin = truth(g, "output.selection_margin");
    const auto tol = tolerance(g, Precision::bf16);
    std::int64_t t = 0;
    while (t < 96 && margin[static_cast<std::size_t>(t)] <= tol[static_cast<std::size_t>(t)]) ++t;
    ASSERT_LT(t, 96) << "no token's choice is clear";
    // the last slot's expert swapped for one not chosen
    std::vector<bool> chosen(16, false);
    for (std::int64_t j = 0; j < 8; ++j) chosen[static_cast<std::size_t>(ids[t * 8 + j])] = true;
    ids[static_cast<std::size_t>(t * 8 + 7)] =
        static_cast<std::int32_t>(std::find(chosen.begin(), chosen.end(), false) - chosen.begin());
    set_ids(bad, ids);
    const CaseReport b = golden::check(g, bad, judged_as(Precision::bf16));
    EXPECT_EQ(result(b, "output.topk_ids").status, Status::fail);
    EXPECT_NE(result(b, "output.topk_ids").message.find("wrong expert"), std::string::npos);
    EXPECT_EQ(b.first_divergence, "output.topk_ids");
    EXPECT_TRUE(b.ambiguous_tokens.empty());
  }

  // router replay: the same backend fed the golden's routing passes in full
  const st::File gr = router_case(qwen_like(true));
  const st::File fed = emulated_candidate(gr, Precision::bf16, /*own_routing=*/false);
  const CaseReport rr = golden::check(gr, fed, judged_as(Precision::bf16));
  EXPECT_TRUE(rr.ambiguous_tokens.empty());
  EXPECT_EQ(rr.ambiguous, 0);
  EXPECT_EQ(golden::verdict({rr}, true).exit_code, 0) << golden::verdict({rr}, true).reason;
  // and a replayed routing changed at a near tie fails: it was given
  {
    st::File bad = fed;
    std::vector<std::int32_t> ids;
    ids_of(bad, ids);
    const auto t = r.ambiguous_tokens.front().token;
    std::swap(ids[static_cast<std::size_t>(t * 8)], ids[static_cast<std::size_t>(t * 8 + 1)]);
    set_ids(bad, ids);
    const CaseReport b = golden::check(gr, bad, judged_as(Precision::bf16));
    EXPECT_EQ(result(b, "output.topk_ids").status, Status::fail);
    EXPECT_NE(result(b, "output.topk_ids").message.find("given"), std::string::npos);
  }
}

// The moe cases do what they exist for: forced loads are met exactly (the block edges kernels
// tile by), gpt-oss's clamps are active for gate and up values, and every moe case's layout is
// a stable counting sort of its choice.
TEST(Routing, TheMoeCorpusMeetsItsLoadsAndActivatesTheClamps) {
  const fs::path dir = fs::path(TEO_SOURCE_DIR) / "golden" / "ops";
  int cases = 0, loads = 0, clamped = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (!name.starts_with("moe_") || name.starts_with("moe_router_")) continue;
    SCOPED_TRACE(name);
    ++cases;
    const st::File g = st::read(e.path().string());
    const auto spec = golden::op_case_of(g).spec;
    const auto ids = g.find("output.topk_ids")->int_values();
    const auto offsets = g.find("act.moe.expert_offsets")->int_values();
    const auto rows = g.find("act.moe.source_rows")->int_values();
    const std::int64_t E = spec["num_experts"];
    // the layout: expert e's rows hold its pairs, in increasing pair index
    std::vector<std::int64_t> want;
    std::vector<std::int64_t> count(static_cast<std::size_t>(E + 1), 0);
    for (std::int64_t x = 0; x < E; ++x) {
      for (std::size_t p = 0; p < ids.size(); ++p)
        if (ids[p] == x) want.push_back(static_cast<std::int64_t>(p));
      count[static_cast<std::size_t>(x + 1)] = static_cast<std::int64_t>(want.size());
    }
    EXPECT_EQ(rows, want);
    EXPECT_EQ(offsets, count);
    if (spec.contains("expert_loads")) {
      for (std::int64_t x = 0; x < E; ++x) {
        const auto i = static_cast<std::size_t>(x);
        EXPECT_EQ(offsets[i + 1] - offsets[i], spec["expert_loads"][i].get<std::int64_t>());
      }
      ++loads;
    }
    if (spec["expert_kind"] == "clamped_swiglu") {
      // the pre-activations, row by row from expert_in: some gate above the limit, some up
      // beyond it either way
      const double limit = spec["swiglu_limit"];
      const auto in = g.find("act.moe.expert_in")->float_values();
      const auto wg = g.find("param.experts.w_gate")->float_values();
      const auto wu = g.find("param.experts.w_up")->float_values();
      const auto bg = g.find("param.experts.b_gate")->float_values();
      const auto bu = g.find("param.experts.b_up")->float_values();
      const std::int64_t D = spec["d_model"], F = spec["moe_d_ff"];
      int gate_over = 0, up_over = 0;
      for (std::int64_t x = 0; x < E; ++x)
        for (auto r = offsets[static_cast<std::size_t>(x)];
             r < offsets[static_cast<std::size_t>(x + 1)]; ++r)
          for (std::int64_t f = 0; f < F; ++f) {
            double gs = bg[static_cast<std::size_t>(x * F + f)],
                   us = bu[static_cast<std::size_t>(x * F + f)];
            for (std::int64_t d = 0; d < D; ++d) {
              const double v = in[static_cast<std::size_t>(r * D + d)];
              gs += v * wg[static_cast<std::size_t>((x * F + f) * D + d)];
              us += v * wu[static_cast<std::size_t>((x * F + f) * D + d)];
            }
            gate_over += gs > limit;
            up_over += std::abs(us) > limit;
          }
      EXPECT_GT(gate_over, 0);
      EXPECT_GT(up_over, 0);
      ++clamped;
    }
  }
  EXPECT_GE(cases, 10);
  EXPECT_GE(loads, 1);
  EXPECT_GE(clamped, 1);
}

// A real-size router (k 8 of 16 at D 2048) cannot keep its margins clear: the routing tolerance
// grows with D faster than the gaps between the chosen experts, and the draw is refused. With
// replay_routing and clear_margins false the draw stays as it is, some margin inside the
// tolerance, and the replayed routing is judged exactly: a bf16 backend fed it passes, a change of
// it fails. clear_margins false without replay is refused by name.
TEST(Routing, AReplayedRealSizeRouterKeepsItsDrawAndIsJudgedExactly) {
  json spec = {{"tokens", 8},
               {"d_model", 2048},
               {"num_experts", 16},
               {"num_experts_per_tok", 8},
               {"norm_topk_prob", true},
               {"dtype", "float32"},
               {"seed", 1}};
  EXPECT_THROW(router_case(spec), teo::ConfigError);
  spec["replay_routing"] = true;
  EXPECT_THROW(router_case(spec), teo::ConfigError);  // replay alone keeps the redraw
  spec["clear_margins"] = false;
  const st::File g = router_case(spec);
  EXPECT_EQ(golden::op_case_of(g).spec.at("clear_margins"), false);
  const auto margins = truth(g, "output.selection_margin");
  const auto tol = tolerance(g, Precision::fp32);
  bool inside = false;
  for (std::size_t t = 0; t < margins.size(); ++t) inside = inside || margins[t] <= 2 * tol[t];
  EXPECT_TRUE(inside) << "every margin is clear: the case shows nothing";
  EXPECT_EQ(g.find("input.moe.topk_ids")->int_values(), g.find("output.topk_ids")->int_values());
  st::File c = emulated_candidate(g, Precision::bf16, /*own_routing=*/false);
  const CaseReport ok = golden::check(g, c, judged_as(Precision::bf16));
  EXPECT_EQ(ok.failed, 0);
  EXPECT_TRUE(ok.ambiguous_tokens.empty());
  std::vector<std::int32_t> store;
  std::vector<std::int32_t> ids = ids_of(c, store);
  std::swap(ids[0], ids[1]);
  set_ids(c, ids);
  const CaseReport bad = golden::check(g, c, judged_as(Precision::bf16));
  EXPECT_EQ(result(bad, "output.topk_ids").status, Status::fail);
  json unreplayed = spec;
  unreplayed["replay_routing"] = false;
  EXPECT_THROW(router_case(unreplayed), teo::ConfigError);
}

// The tolerance is a bound, not a guess: a backend emulated in bf16, fp16, tf32 or fp8 that routes
// by itself is never told it chose a wrong expert, for every scoring, order and group rule.
TEST(Routing, NoEmulatedBackendIsEverToldItChoseAWrongExpert) {
  const std::vector<json> variants = {
      {{"num_experts", 16}, {"num_experts_per_tok", 8}, {"norm_topk_prob", true}},
      {{"num_experts", 16},
       {"num_experts_per_tok", 4},
       {"router_scoring", "sigmoid"},
       {"selection_bias", true},
       {"router_groups", 4},
       {"topk_groups", 2},
       {"routed_scaling_factor", 2.5}},
      {{"num_experts", 16},
       {"num_experts_per_tok", 4},
       {"router_groups", 4},
       {"topk_groups", 2},
       {"group_score", "max"}},
      {{"num_experts", 8},
       {"num_experts_per_tok", 4},
       {"router_order", "topk_then_score"},
       {"router_bias", true}},
      {{"num_experts", 8},
       {"num_experts_per_tok", 1},
       {"router_scoring", "sigmoid"},
       {"router_order", "topk_then_score"}}};
  int ambiguous = 0;
  for (std::size_t v = 0; v < variants.size(); ++v) {
    json spec = variants[v];
    spec.update({{"tokens", 128},
                 {"d_model", 32},
                 {"dtype", "float32"},
                 {"seed", static_cast<int>(40 + v)}});
    SCOPED_TRACE(spec.dump());
    const st::File g = router_case(spec);
    for (Precision p : {Precision::bf16, Precision::fp16, Precision::tf32, Precision::fp8}) {
      const CaseReport r =
          golden::check(g, emulated_candidate(g, p, /*own_routing=*/true), judged_as(p));
      EXPECT_NE(result(r, "output.topk_ids").status, Status::fail)
          << teo::to_string(p) << ": " << result(r, "output.topk_ids").message;
      ambiguous += static_cast<int>(r.ambiguous_tokens.size());
    }
  }
  EXPECT_GT(ambiguous, 0) << "no near tie fell otherwise: the test shows nothing";
  std::cout << "emulated backends: " << ambiguous << " token(s) routed otherwise, all ambiguous\n";
}

}  // namespace
