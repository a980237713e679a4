// rapidcheck properties of the mixture-of-experts layers over random shapes and variants,
// reaching the edges: no token, one expert, k = E, one feature, every backend.
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include <nlohmann/json.hpp>

#include "rc_support.hpp"
#include "teo/backend.hpp"
#include "teo/golden_ops.hpp"
#include "teo/layers/feed_forward.hpp"
#include "teo/layers/linear.hpp"
#include "teo/layers/moe.hpp"
#include "teo/safetensors.hpp"

namespace teo {
namespace {

struct Case {
  MoeSpec spec;
  index_t T = 0;
  std::vector<double> x, gate, gate_bias, w_gate, w_up, w_down, b_gate, b_up, b_down;
  MoeWeights<double> weights() const {
    return {gate.data(),   gate_bias.data(), nullptr,     w_gate.data(), w_up.data(),
            w_down.data(), b_gate.data(),    b_up.data(), b_down.data()};
  }
};

std::vector<double> gen_values(index_t n, double amp) {
  // multiples of 2^-6: exact in every format, and ties in the router are possible
  const auto ints =
      *rc::gen::container<std::vector<int>>(static_cast<std::size_t>(n), rc::gen::inRange(-64, 65));
  std::vector<double> v(ints.size());
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = amp * ints[i] / 64.0;
  return v;
}

Case gen_case() {
  Case c;
  RouterSpec& r = c.spec.router;
  r.experts = *rc::gen::inRange<index_t>(1, 9);
  r.top_k = *rc::gen::inRange<index_t>(1, r.experts + 1);
  r.scoring = *rc::gen::element(RouterScoring::softmax, RouterScoring::sigmoid);
  r.order = *rc::gen::element(RouterOrder::score_then_topk, RouterOrder::topk_then_score);
  r.norm_topk_prob = *rc::gen::arbitrary<bool>();
  r.routed_scaling_factor = *rc::gen::element(1.0, 2.5);
  c.spec.kind = *rc::gen::element(ExpertKind::swiglu, ExpertKind::clamped_swiglu);
  c.spec.limit = 1.0;
  c.spec.weight_at_input = *rc::gen::arbitrary<bool>();
  c.spec.d_model = *rc::gen::inRange<index_t>(1, 7);
  c.spec.d_ff = *rc::gen::inRange<index_t>(1, 6);
  c.T = *rc::gen::inRange<index_t>(0, 13);
  const index_t E = r.experts, D = c.spec.d_model, F = c.spec.d_ff;
  c.x = gen_values(c.T * D, 1);
  c.gate = gen_values(E * D, 1);
  c.gate_bias = gen_values(E, 0.5);
  c.w_gate = gen_values(E * F * D, 1);
  c.w_up = gen_values(E * F * D, 1);
  c.w_down = gen_values(E * D * F, 1);
  c.b_gate = gen_values(E * F, 0.5);
  c.b_up = gen_values(E * F, 0.5);
  c.b_down = gen_values(E * D, 0.5);
  return c;
}

MoeActs<double> forward(const Case& c, const std::vector<double>& x,
                        const std::int32_t* replay = nullptr) {
  MoeActs<double> a;
  moe_forward(c.spec, c.weights(), x.data(), static_cast<index_t>(x.size()) / c.spec.d_model,
              replay, a);
  return a;
}

// The upstream gradient dy[i] of y[i] that backward() uses and objective() weighs y by.
double upstream(std::size_t i) {
  return std::ldexp(static_cast<double>(i % 7) - 3, -2);
}

// The gradients of one backward, x's first.
std::vector<std::vector<double>> backward(const Case& c, const MoeActs<double>& a) {
  std::vector<std::vector<double>> g = {
      std::vector<double>(c.x.size()),         std::vector<double>(c.gate.size()),
      std::vector<double>(c.gate_bias.size()), std::vector<double>(c.w_gate.size()),
      std::vector<double>(c.w_up.size()),      std::vector<double>(c.w_down.size()),
      std::vector<double>(c.b_gate.size()),    std::vector<double>(c.b_up.size()),
      std::vector<double>(c.b_down.size())};
  MoeGrads<double> grads{g[1].data(), g[2].data(), g[3].data(), g[4].data(),
                         g[5].data(), g[6].data(), g[7].data(), g[8].data()};
  std::vector<double> dy(a.y.size());
  for (std::size_t i = 0; i < dy.size(); ++i) dy[i] = upstream(i);
  moe_backward(c.spec, c.weights(), c.x.data(), c.T, a, dy.data(), 0.25, 0.125, g[0].data(), grads);
  return g;
}

RC_GTEST_PROP(MoeProperties, PermutingTokensPermutesEveryOutput, ()) {
  const auto keep = test::gen_backend();
  const Case c = gen_case();
  const index_t D = c.spec.d_model, k = c.spec.router.top_k;
  const auto order = *rc::gen::unique<std::vector<index_t>>(static_cast<std::size_t>(c.T),
                                                            rc::gen::inRange<index_t>(0, c.T));
  std::vector<double> px(c.x.size());
  for (index_t t = 0; t < c.T; ++t)
    std::copy_n(c.x.begin() + order[static_cast<std::size_t>(t)] * D, D, px.begin() + t * D);
  const auto a = forward(c, c.x), pa = forward(c, px);
  for (index_t t = 0; t < c.T; ++t) {
    const index_t s = order[static_cast<std::size_t>(t)];
    for (index_t d = 0; d < D; ++d)
      RC_ASSERT(pa.y[static_cast<std::size_t>(t * D + d)] ==
                a.y[static_cast<std::size_t>(s * D + d)]);
    for (index_t j = 0; j < k; ++j)
      RC_ASSERT(pa.routing.ids[static_cast<std::size_t>(t * k + j)] ==
                a.routing.ids[static_cast<std::size_t>(s * k + j)]);
  }
}

RC_GTEST_PROP(MoeProperties, ReplayedRoutingIsOwnRoutingBitForBit, ()) {
  const auto keep = test::gen_backend();
  const Case c = gen_case();
  const auto a = forward(c, c.x);
  const auto r = forward(c, c.x, a.routing.ids.data());
  RC_ASSERT(r.y == a.y);
  RC_ASSERT(r.routing.weights == a.routing.weights);
  RC_ASSERT(backward(c, r) == backward(c, a));
}

RC_GTEST_PROP(MoeProperties, RenormalisedWeightsSumToTheScalingFactor, ()) {
  Case c = gen_case();
  c.spec.router.norm_topk_prob = true;
  const auto a = forward(c, c.x);
  const index_t k = c.spec.router.top_k;
  for (index_t t = 0; t < c.T; ++t) {
    double sum = 0;
    for (index_t j = 0; j < k; ++j) sum += a.routing.weights[static_cast<std::size_t>(t * k + j)];
    RC_ASSERT(std::abs(sum - c.spec.router.routed_scaling_factor) <=
              1e-15 * static_cast<double>(k) * 4);
  }
  // and every row of the grouped layout is one pair, once
  std::vector<std::int32_t> rows = a.source_rows;
  std::sort(rows.begin(), rows.end());
  for (std::size_t i = 0; i < rows.size(); ++i) RC_ASSERT(rows[i] == static_cast<std::int32_t>(i));
  RC_ASSERT(a.offsets.back() == static_cast<std::int32_t>(c.T * k));
}

// Forward and backward give the same bits on one and two threads, on every backend; no token,
// or an expert without one, gives zeros, never NaN.
RC_GTEST_PROP(MoeProperties, TheSameBitsOnOneAndTwoThreadsAndNoNaN, ()) {
  const auto keep = test::gen_backend();
  const Case c = gen_case();
  set_num_threads(1);
  const auto a1 = forward(c, c.x);
  const auto g1 = backward(c, a1);
  set_num_threads(2);
  const auto a2 = forward(c, c.x);
  const auto g2 = backward(c, a2);
  RC_ASSERT(a1.y == a2.y);
  RC_ASSERT(g1 == g2);
  for (const auto& g : g1)
    for (double v : g) RC_ASSERT(std::isfinite(v));
}

// One expert, top-1, weight 1 (softmax over one logit is exactly 1): the block is the dense gated
// FFN, bit for bit, on every backend.
RC_GTEST_PROP(MoeProperties, OneExpertTopOneIsTheDenseGatedFfnBitForBit, ()) {
  const auto keep = test::gen_backend();
  Case c = gen_case();
  RouterSpec& r = c.spec.router;
  r.experts = 1;
  r.top_k = 1;
  r.scoring = RouterScoring::softmax;
  r.routed_scaling_factor = 1;
  c.spec.kind = ExpertKind::swiglu;
  const index_t D = c.spec.d_model, F = c.spec.d_ff, T = c.T;
  // the tensors were drawn for E experts: keep expert 0's
  c.gate.resize(static_cast<std::size_t>(D));
  c.gate_bias.resize(1);
  c.w_gate.resize(static_cast<std::size_t>(F * D));
  c.w_up.resize(static_cast<std::size_t>(F * D));
  c.w_down.resize(static_cast<std::size_t>(D * F));
  c.b_gate.resize(static_cast<std::size_t>(F));
  c.b_up.resize(static_cast<std::size_t>(F));
  c.b_down.resize(static_cast<std::size_t>(D));
  const auto a = forward(c, c.x);
  const auto n = static_cast<std::size_t>(T * F);
  std::vector<double> g(n), u(n), h(n), y(static_cast<std::size_t>(T * D));
  linear_forward(g.data(), c.x.data(), c.w_gate.data(), c.b_gate.data(), T, D, F);
  linear_forward(u.data(), c.x.data(), c.w_up.data(), c.b_up.data(), T, D, F);
  gated_forward(h.data(), g.data(), u.data(), T * F, Activation::silu);
  linear_forward(y.data(), h.data(), c.w_down.data(), c.b_down.data(), T, F, D);
  if (c.spec.weight_at_input) RC_TAG("weight at the input");
  RC_ASSERT(a.y == y);
}

// Softmax scored before or after the top k chooses the same experts (away from ties) and, with
// the k renormalised, gives the same weights and output to rounding: softmax over the k chosen
// logits is the renormalised softmax over all E.
RC_GTEST_PROP(MoeProperties, ScoreThenTopkAndTopkThenScoreAgreeToRoundingForSoftmax, ()) {
  const auto keep = test::gen_backend();
  Case c = gen_case();
  c.spec.router.scoring = RouterScoring::softmax;
  c.spec.router.norm_topk_prob = true;
  // values off the 2^-6 grid, so that no two logits tie
  for (auto* v : {&c.x, &c.gate, &c.gate_bias})
    for (std::size_t i = 0; i < v->size(); ++i) (*v)[i] += 1e-3 * std::sin(1.0 + 7.0 * i);
  c.spec.router.order = RouterOrder::score_then_topk;
  const auto a = forward(c, c.x);
  c.spec.router.order = RouterOrder::topk_then_score;
  const auto b = forward(c, c.x);
  const index_t k = c.spec.router.top_k, D = c.spec.d_model;
  for (index_t t = 0; t < c.T; ++t) {
    if (a.routing.margin[static_cast<std::size_t>(t)] < 1e-9) continue;  // a near tie
    for (index_t j = 0; j < k; ++j) {
      const auto p = static_cast<std::size_t>(t * k + j);
      RC_ASSERT(a.routing.ids[p] == b.routing.ids[p]);
      RC_ASSERT(std::abs(a.routing.weights[p] - b.routing.weights[p]) <=
                16 * static_cast<double>(c.spec.router.experts) * 0x1p-52);
    }
    for (index_t d = 0; d < D; ++d) {
      const auto i = static_cast<std::size_t>(t * D + d);
      RC_ASSERT(std::abs(a.y[i] - b.y[i]) <= 1e-12 * (1 + std::abs(a.y[i])));
    }
  }
}

// The sum dy . y + 0.25 aux + 0.125 z, as backward() differentiates it.
double objective(const Case& c, const std::vector<double>& x) {
  const auto a = forward(c, x);
  double f = 0;
  for (std::size_t i = 0; i < a.y.size(); ++i) f += upstream(i) * a.y[i];
  const index_t E = c.spec.router.experts, k = c.spec.router.top_k;
  return f + 0.25 * load_balancing_loss(a.logits.data(), a.routing.ids.data(), c.T, E, k) +
         0.125 * router_z_loss(a.logits.data(), c.T, E);
}

// Central differences of the whole block (routed experts, router, both aux losses) agree with
// the backward, for every input and parameter, away from ties and kinks. The rule: a step h in
// one value moves a logit, or a pre-activation, by at most h max(|x|, |w|, 1) <= 3 h, and a score
// by no more than its logit; every margin and every pre-activation's distance to a clamp must
// exceed 400 h, a hundred times that.
RC_GTEST_PROP(MoeProperties, FiniteDifferencesOfTheWholeBlockAwayFromTies, ()) {
  Case c = gen_case();
  c.T = std::min<index_t>(c.T, 6);
  c.x.resize(static_cast<std::size_t>(c.T * c.spec.d_model));
  for (auto* v :
       {&c.x, &c.gate, &c.gate_bias, &c.w_gate, &c.w_up, &c.w_down, &c.b_gate, &c.b_up, &c.b_down})
    for (std::size_t i = 0; i < v->size(); ++i) (*v)[i] += 1e-2 * std::sin(3.0 + 5.0 * i);
  const double h = 1e-6, clear = 400 * h;
  const auto a = forward(c, c.x);
  for (double m : a.routing.margin) RC_PRE(m > clear);
  if (c.spec.kind == ExpertKind::clamped_swiglu) {
    for (double v : a.gate_pre) RC_PRE(std::abs(v - c.spec.limit) > clear);
    for (double v : a.up_pre) RC_PRE(std::abs(std::abs(v) - c.spec.limit) > clear);
  }
  const auto g = backward(c, a);
  std::vector<std::vector<double>*> values = {
      &c.x, &c.gate, &c.gate_bias, &c.w_gate, &c.w_up, &c.w_down, &c.b_gate, &c.b_up, &c.b_down};
  for (std::size_t t = 0; t < values.size(); ++t) {
    std::vector<double>& v = *values[t];
    for (std::size_t i = 0; i < v.size(); ++i) {
      const double keep_v = v[i];
      v[i] = keep_v + h;
      const double up = objective(c, c.x);
      v[i] = keep_v - h;
      const double down = objective(c, c.x);
      v[i] = keep_v;
      const double fd = (up - down) / (2 * h);
      RC_ASSERT(std::abs(fd - g[t][i]) <= 1e-6 * (1 + std::abs(g[t][i])));
    }
  }
}

// Forced loads are met exactly: the op's drawn gate gives expert e exactly expert_loads[e] of the
// (token, slot) pairs, whatever the loads (each in [0, T], summing to T k), the scoring, the order
// and the dtype.
RC_GTEST_PROP(MoeProperties, ForcedLoadsAreMetExactly, ()) {
  const auto E = *rc::gen::inRange<std::int64_t>(1, 7);
  const auto k = *rc::gen::inRange<std::int64_t>(1, E + 1);
  const auto T = *rc::gen::inRange<std::int64_t>(1, 11);
  // loads in [0, T] summing to T k: start from T k dealt evenly, then move pairs at random
  std::vector<std::int64_t> loads(static_cast<std::size_t>(E), 0);
  for (std::int64_t n = 0; n < T * k; ++n) ++loads[static_cast<std::size_t>(n % E)];
  const auto moves = *rc::gen::container<std::vector<std::pair<int, int>>>(
      rc::gen::pair(rc::gen::inRange<int>(0, static_cast<int>(E)),
                    rc::gen::inRange<int>(0, static_cast<int>(E))));
  for (const auto& [from, to] : moves) {
    auto& f = loads[static_cast<std::size_t>(from)];
    auto& t = loads[static_cast<std::size_t>(to)];
    if (from != to && f > 0 && t < T) --f, ++t;
  }
  nlohmann::json spec = {
      {"op", "moe"},
      {"tokens", T},
      {"d_model", E + *rc::gen::inRange<std::int64_t>(0, 3)},
      {"num_experts", E},
      {"num_experts_per_tok", k},
      {"moe_d_ff", *rc::gen::inRange<std::int64_t>(1, 4)},
      {"router_scoring", *rc::gen::element<std::string>("softmax", "sigmoid")},
      {"router_order", *rc::gen::element<std::string>("score_then_topk", "topk_then_score")},
      {"expert_loads", loads},
      {"dtype", *rc::gen::element<std::string>("float32", "float64")},
      {"seed", *rc::gen::inRange<std::int64_t>(0, 1000)}};
  // the loads are the point, not float32's conditioning, which a drawn case may lack
  const safetensors::File f =
      golden::make_op(golden::OpCase::from_json(spec), /*allow_ill_conditioned=*/true);
  const auto offsets = f.find("act.moe.expert_offsets")->int_values();
  RC_ASSERT(offsets.size() == static_cast<std::size_t>(E + 1));
  for (std::int64_t e = 0; e < E; ++e) {
    const auto i = static_cast<std::size_t>(e);
    RC_ASSERT(offsets[i + 1] - offsets[i] == loads[i]);
  }
}

}  // namespace
}  // namespace teo
