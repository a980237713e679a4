// rapidcheck properties of the mixture-of-experts layers over random shapes and variants,
// reaching the edges: no token, one expert, k = E, one feature, every backend.
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "rc_support.hpp"
#include "teo/backend.hpp"
#include "teo/layers/moe.hpp"

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
  for (std::size_t i = 0; i < dy.size(); ++i)
    dy[i] = std::ldexp(static_cast<double>(i % 7) - 3, -2);
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

}  // namespace
}  // namespace teo
