// The mixture-of-experts router: the choice (tie rule, groups, correction bias, replay), the
// weights (scoring, order, renormalisation, scaling), the margins, and the exact backward of the
// weights and of the two auxiliary losses against central differences.
#include "teo/layers/moe_router.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "support.hpp"

namespace {

using teo::GroupScore;
using teo::index_t;
using teo::RouterOrder;
using teo::RouterScoring;
using teo::RouterSpec;
using teo::Routing;

RouterSpec spec_of(index_t E, index_t k, RouterScoring s = RouterScoring::softmax,
                   RouterOrder o = RouterOrder::score_then_topk) {
  RouterSpec r;
  r.experts = E;
  r.top_k = k;
  r.scoring = s;
  r.order = o;
  return r;
}

Routing<double> routed(const RouterSpec& s, const std::vector<double>& logits,
                       const std::vector<double>* correction = nullptr,
                       const std::vector<std::int32_t>* replay = nullptr) {
  Routing<double> r;
  const auto T = static_cast<index_t>(logits.size()) / s.experts;
  teo::route(s, logits.data(), correction ? correction->data() : nullptr,
             replay ? replay->data() : nullptr, T, r);
  return r;
}

TEST(MoeRouter, SoftmaxTopKChoosesTheLargestAndWeighsThemByTheirScores) {
  const std::vector<double> l = {0.5, 2.0, -1.0, 1.0};
  const auto r = routed(spec_of(4, 2), l);
  EXPECT_EQ(r.ids, (std::vector<std::int32_t>{1, 3}));
  double sum = 0;
  for (double x : l) sum += std::exp(x);
  EXPECT_DOUBLE_EQ(r.scores[1], std::exp(2.0) / sum);
  EXPECT_DOUBLE_EQ(r.weights[0], r.scores[1]);
  EXPECT_DOUBLE_EQ(r.weights[1], r.scores[3]);
  // the margin: the smaller of the 1st score minus the 2nd and the 2nd minus the 3rd, in score
  // units
  EXPECT_DOUBLE_EQ(r.margin[0], std::min(r.scores[1] - r.scores[3], r.scores[3] - r.scores[0]));
  // renormalised and scaled: weights over the two chosen, times 2.5
  RouterSpec n = spec_of(4, 2);
  n.norm_topk_prob = true;
  n.routed_scaling_factor = 2.5;
  const auto rn = routed(n, l);
  EXPECT_NEAR(rn.weights[0] + rn.weights[1], 2.5, 1e-15);
  EXPECT_DOUBLE_EQ(rn.weights[0], 2.5 * (r.scores[1] / (r.scores[1] + r.scores[3])));
}

TEST(MoeRouter, EqualScoresGoToTheLowerExpertFirstWithMarginZero) {
  const auto r = routed(spec_of(4, 2), {1.0, 3.0, 3.0, 3.0});
  EXPECT_EQ(r.ids, (std::vector<std::int32_t>{1, 2}));
  EXPECT_EQ(r.margin[0], 0.0);
  // k equal to E: nothing is left to choose, only the order of the chosen
  const auto all = routed(spec_of(3, 3), {0.1, 0.2, 0.3});
  EXPECT_EQ(all.ids, (std::vector<std::int32_t>{2, 1, 0}));
  EXPECT_DOUBLE_EQ(all.margin[0],
                   std::min(all.scores[2] - all.scores[1], all.scores[1] - all.scores[0]));
  // and with one expert, nothing to order either
  EXPECT_EQ(routed(spec_of(1, 1), {0.4}).margin[0], std::numeric_limits<double>::infinity());
}

// DeepSeek-V3: sigmoid scores, the correction bias chooses but never weighs, 4 groups choose 2 by
// the sum of their top two, and a token's best expert can sit in a group that is not chosen.
TEST(MoeRouter, GroupsAndTheCorrectionBiasChooseAndOnlyTheScoresWeigh) {
  RouterSpec s = spec_of(8, 2, RouterScoring::sigmoid);
  s.groups = 4;
  s.topk_groups = 2;
  //                          g0         g1          g2         g3
  const std::vector<double> l = {3.0, -4.0, 1.0, 0.95, 0.9, 0.9, -3.0, -3.0};
  const auto r = routed(s, l);
  // group scores (sigmoid sums): g0 0.971, g1 1.452, g2 1.422, g3 0.095: g1 and g2 are chosen,
  // and expert 0, the best single score, is not eligible
  EXPECT_EQ(r.ids, (std::vector<std::int32_t>{2, 3}));
  const auto sg = [](double x) { return 1 / (1 + std::exp(-x)); };
  EXPECT_DOUBLE_EQ(r.weights[0], sg(1.0));
  // the smallest gap: expert 2 against 3 (their order), 3 against 4 (the k-th against the next),
  // the group margin (g2 against g0)
  EXPECT_NEAR(
      r.margin[0],
      std::min({sg(1.0) - sg(0.95), sg(0.95) - sg(0.9), 2 * sg(0.9) - (sg(3.0) + sg(-4.0))}),
      1e-15);
  // V2's group score (the max) chooses g0 and g1
  s.group_score = GroupScore::max;
  EXPECT_EQ(routed(s, l).ids, (std::vector<std::int32_t>{0, 2}));
  // a correction bias large enough to change the choice: the weights stay the scores
  s.group_score = GroupScore::top2_sum;
  const std::vector<double> bias = {0, 0, 0, 0, 0.5, 0, 0, 0};
  const auto b = routed(s, l, &bias);
  EXPECT_EQ(b.ids, (std::vector<std::int32_t>{4, 2}));
  EXPECT_DOUBLE_EQ(b.weights[0], sg(0.9));
  EXPECT_DOUBLE_EQ(b.weights[1], sg(1.0));
}

TEST(MoeRouter, TopkThenScoreScoresTheChosenOnly) {
  // gpt-oss: softmax over the top k logits
  const std::vector<double> l = {0.5, 2.0, -1.0, 1.0};
  const auto r = routed(spec_of(4, 2, RouterScoring::softmax, RouterOrder::topk_then_score), l);
  EXPECT_EQ(r.ids, (std::vector<std::int32_t>{1, 3}));
  EXPECT_DOUBLE_EQ(r.weights[0], 1 / (1 + std::exp(-1.0)));
  EXPECT_EQ(r.scores[0], 0.0);
  EXPECT_EQ(r.scores[1], r.weights[0]);
  EXPECT_DOUBLE_EQ(r.margin[0], 1.0 - 0.5);  // in logit units
  // Llama 4: top-1, then the chosen logit's sigmoid
  const auto t1 = routed(spec_of(4, 1, RouterScoring::sigmoid, RouterOrder::topk_then_score), l);
  EXPECT_EQ(t1.ids, (std::vector<std::int32_t>{1}));
  EXPECT_DOUBLE_EQ(t1.weights[0], 1 / (1 + std::exp(-2.0)));
  // with renormalisation, softmax's two orders agree to rounding
  std::mt19937_64 rng(7);
  std::normal_distribution<double> n;
  std::vector<double> many(64 * 16);
  for (double& x : many) x = n(rng);
  RouterSpec a = spec_of(16, 4),
             b = spec_of(16, 4, RouterScoring::softmax, RouterOrder::topk_then_score);
  a.norm_topk_prob = b.norm_topk_prob = true;
  const auto ra = routed(a, many), rb = routed(b, many);
  EXPECT_EQ(ra.ids, rb.ids);
  for (std::size_t i = 0; i < ra.weights.size(); ++i)
    EXPECT_NEAR(ra.weights[i], rb.weights[i], 1e-15) << i;
}

TEST(MoeRouter, ReplayedRoutingIsTheOwnRoutingBitForBit) {
  std::mt19937_64 rng(11);
  std::normal_distribution<double> n;
  std::vector<double> l(32 * 8);
  for (double& x : l) x = n(rng);
  RouterSpec s = spec_of(8, 2, RouterScoring::sigmoid);
  s.groups = 2;
  s.norm_topk_prob = true;
  const auto own = routed(s, l);
  const auto again = routed(s, l, nullptr, &own.ids);
  EXPECT_EQ(again.ids, own.ids);
  EXPECT_EQ(again.weights, own.weights);
  EXPECT_EQ(again.margin, own.margin);
  // another choice, replayed: its weights are its experts', and its margin is negative
  std::vector<std::int32_t> other = own.ids;
  std::swap(other[0], other[1]);
  const auto swapped = routed(s, l, nullptr, &other);
  EXPECT_EQ(swapped.weights[0], own.weights[1]);
  // one group of two is eligible: another expert of it in place of the second choice
  std::vector<std::int32_t> worse = own.ids;
  ASSERT_EQ(own.ids[0] / 4, own.ids[1] / 4);
  std::int32_t e = own.ids[0] / 4 * 4;
  while (e == own.ids[0] || e == own.ids[1]) ++e;
  worse[1] = e;
  EXPECT_LT(routed(s, l, nullptr, &worse).margin[0], 0);
  // a replayed id that is no expert, or twice the same
  std::vector<std::int32_t> bad = own.ids;
  bad[0] = 8;
  EXPECT_THROW(routed(s, l, nullptr, &bad), teo::ConfigError);
  bad[0] = bad[1];
  EXPECT_THROW(routed(s, l, nullptr, &bad), teo::ConfigError);
}

TEST(MoeRouter, BadSpecsAndLogitsAreNamedErrors) {
  const auto fails = [](RouterSpec s, const std::string& msg) {
    teo::test::expect_throw<teo::ConfigError>([&] { s.validate(); }, msg);
  };
  fails(spec_of(0, 1), "num_experts");
  fails(spec_of(4, 5), "num_experts_per_tok");
  RouterSpec g = spec_of(6, 2);
  g.groups = 4;
  fails(g, "router_groups");
  g.groups = 3;
  g.topk_groups = 4;
  fails(g, "topk_groups");
  g.topk_groups = 1;
  g.top_k = 3;
  fails(g, "num_experts_per_tok");  // one group of 2 is eligible
  g.top_k = 2;
  EXPECT_NO_THROW(g.validate());
  RouterSpec one = spec_of(4, 1);
  one.groups = 4;
  fails(one, "two experts per group");
  one.routed_scaling_factor = 0;
  one.groups = 1;
  fails(one, "routed_scaling_factor");
  EXPECT_THROW(routed(spec_of(2, 1), {0.0, std::nan("")}), teo::RangeError);
}

// The gradient of sum(c * weights) + a aux + b z by central differences, for every scoring,
// order, renormalisation and scaling, on logits whose margins are far from a change of choice.
TEST(MoeRouter, TheBackwardIsTheGradientAwayFromTies) {
  std::mt19937_64 rng(3);
  std::normal_distribution<double> n;
  const index_t T = 6, E = 8, k = 3;
  int variants = 0;
  for (RouterScoring sc : {RouterScoring::softmax, RouterScoring::sigmoid}) {
    for (RouterOrder o : {RouterOrder::score_then_topk, RouterOrder::topk_then_score}) {
      for (bool norm : {false, true}) {
        RouterSpec s = spec_of(E, k, sc, o);
        s.norm_topk_prob = norm;
        s.routed_scaling_factor = norm ? 2.5 : 1.0;
        if (o == RouterOrder::score_then_topk && norm) {
          s.groups = 4;
          s.topk_groups = 2;
        }
        std::vector<double> l(T * E), c(T * k);
        // redraw until every margin is above 1e-3: a step of 1e-6 then never changes the choice
        for (;;) {
          for (double& x : l) x = 1.5 * n(rng);
          const auto m = routed(s, l).margin;
          if (*std::min_element(m.begin(), m.end()) > 1e-3) break;
        }
        for (double& x : c) x = n(rng);
        const double a = 0.7, b = 0.3;
        const auto objective = [&](const std::vector<double>& x) {
          const auto r = routed(s, x);
          double f = 0;
          for (std::size_t i = 0; i < c.size(); ++i) f += c[i] * r.weights[i];
          return f + a * teo::load_balancing_loss(x.data(), r.ids.data(), T, E, k) +
                 b * teo::router_z_loss(x.data(), T, E);
        };
        const auto r = routed(s, l);
        std::vector<double> g(T * E);
        teo::route_backward(s, r, c.data(), T, g.data());
        teo::load_balancing_loss_backward(l.data(), r.ids.data(), T, E, k, a, g.data());
        teo::router_z_loss_backward(l.data(), T, E, b, g.data());
        for (std::size_t i = 0; i < l.size(); ++i) {
          std::vector<double> up = l, down = l;
          up[i] += 1e-6;
          down[i] -= 1e-6;
          const double fd = (objective(up) - objective(down)) / 2e-6;
          EXPECT_NEAR(g[i], fd, 1e-7 * (1 + std::abs(fd))) << "variant " << variants << " at " << i;
        }
        ++variants;
      }
    }
  }
  EXPECT_EQ(variants, 8);
}

// Hugging Face's load_balancing_loss_func: E * sum_e f_e P_e with f over (token, slot) pairs;
// uniform routing over balanced experts gives k (the loss's minimum for top-k).
TEST(MoeRouter, TheLoadBalancingLossIsHuggingFacesAndTheZLossItsDefinition) {
  // every token's probabilities (0.4, 0.4, 0.1, 0.1)
  std::vector<double> favour;
  for (int t = 0; t < 4; ++t) favour.insert(favour.end(), {std::log(4.0), std::log(4.0), 0, 0});
  const std::vector<std::int32_t> balanced = {0, 1, 2, 3, 0, 1, 2, 3};  // T 4, k 2
  EXPECT_NEAR(teo::load_balancing_loss(favour.data(), balanced.data(), 4, 4, 2), 2.0, 1e-15);
  // f_0 = f_1 = 1: every token sends a pair to each
  const std::vector<std::int32_t> skewed = {0, 1, 0, 1, 0, 1, 0, 1};
  EXPECT_NEAR(teo::load_balancing_loss(favour.data(), skewed.data(), 4, 4, 2), 3.2, 1e-15);
  const std::vector<double> flat(4 * 4, 0.0);
  EXPECT_DOUBLE_EQ(teo::router_z_loss(flat.data(), 4, 4), std::log(4.0) * std::log(4.0));
  EXPECT_EQ(teo::load_balancing_loss(flat.data(), balanced.data(), 0, 4, 2), 0.0);
  EXPECT_EQ(teo::router_z_loss(flat.data(), 0, 4), 0.0);
}

}  // namespace
