// The routed experts: the grouped layout, the dense FFN as its one-expert case, permutation and
// replay, empty experts, and the exact backward (every parameter, the router's included) against
// central differences for both expert kinds and both places of the weight.
#include "teo/layers/moe.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "teo/layers/feed_forward.hpp"
#include "teo/layers/linear.hpp"

namespace {

using teo::ExpertKind;
using teo::index_t;
using teo::MoeSpec;

// A block's parameters and their gradients, owned.
struct Block {
  MoeSpec spec;
  std::vector<double> gate, gate_bias, w_gate, w_up, w_down, b_gate, b_up, b_down;
  teo::MoeWeights<double> weights() const {
    return {gate.data(),   gate_bias.data(), nullptr,     w_gate.data(), w_up.data(),
            w_down.data(), b_gate.data(),    b_up.data(), b_down.data()};
  }
  std::vector<std::vector<double>*> all() {
    return {&gate, &gate_bias, &w_gate, &w_up, &w_down, &b_gate, &b_up, &b_down};
  }
};

Block block(index_t E, index_t k, index_t D, index_t F, std::uint64_t seed, double amp = 0.5) {
  Block b;
  b.spec.router.experts = E;
  b.spec.router.top_k = k;
  b.spec.d_model = D;
  b.spec.d_ff = F;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-amp, amp);
  const auto draw = [&](std::vector<double>& v, index_t n) {
    v.resize(static_cast<std::size_t>(n));
    for (double& x : v) x = u(rng);
  };
  draw(b.gate, E * D);
  draw(b.gate_bias, E);
  draw(b.w_gate, E * F * D);
  draw(b.w_up, E * F * D);
  draw(b.w_down, E * D * F);
  draw(b.b_gate, E * F);
  draw(b.b_up, E * F);
  draw(b.b_down, E * D);
  return b;
}

std::vector<double> tokens(index_t T, index_t D, std::uint64_t seed, double amp = 1) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-amp, amp);
  std::vector<double> x(static_cast<std::size_t>(T * D));
  for (double& v : x) v = u(rng);
  return x;
}

teo::MoeActs<double> forward(const Block& b, const std::vector<double>& x,
                             const std::vector<std::int32_t>* replay = nullptr) {
  teo::MoeActs<double> a;
  teo::moe_forward(b.spec, b.weights(), x.data(), static_cast<index_t>(x.size()) / b.spec.d_model,
                   replay ? replay->data() : nullptr, a);
  return a;
}

TEST(Moe, ThePairsAreGroupedByExpertStablyAndCombinedInSlotOrder) {
  Block b = block(3, 2, 4, 3, 1);
  const auto x = tokens(3, 4, 2);
  const std::vector<std::int32_t> ids = {2, 0, 0, 1, 2, 1};
  const auto a = forward(b, x, &ids);
  EXPECT_EQ(a.offsets, (std::vector<std::int32_t>{0, 2, 4, 6}));
  EXPECT_EQ(a.source_rows, (std::vector<std::int32_t>{1, 2, 3, 5, 0, 4}));
  // row 4 holds pair 0 (token 0, slot 0): its input is token 0
  for (index_t d = 0; d < 4; ++d)
    EXPECT_EQ(a.expert_in[static_cast<std::size_t>(4 * 4 + d)], x[static_cast<std::size_t>(d)]);
  // y[0] = w00 out[row 4] + w01 out[row 0], in that order
  for (index_t d = 0; d < 4; ++d) {
    const auto i = static_cast<std::size_t>(d);
    double want = 0;
    want += a.routing.weights[0] * a.expert_out[4 * 4 + i];
    want += a.routing.weights[1] * a.expert_out[0 * 4 + i];
    EXPECT_EQ(a.y[i], want);
  }
}

// One expert chosen with weight 1 is the dense SwiGLU FFN, bit for bit.
TEST(Moe, OneExpertIsTheDenseGatedFfnBitForBit) {
  Block b = block(1, 1, 6, 5, 3);
  const auto x = tokens(7, 6, 4);
  const auto a = forward(b, x);
  std::vector<double> g(7 * 5), u(7 * 5), h(7 * 5), y(7 * 6);
  teo::linear_forward(g.data(), x.data(), b.w_gate.data(), b.b_gate.data(), 7, 6, 5);
  teo::linear_forward(u.data(), x.data(), b.w_up.data(), b.b_up.data(), 7, 6, 5);
  teo::gated_forward(h.data(), g.data(), u.data(), 35, teo::Activation::silu);
  teo::linear_forward(y.data(), h.data(), b.w_down.data(), b.b_down.data(), 7, 5, 6);
  EXPECT_EQ(a.y, y);
}

TEST(Moe, PermutingTokensPermutesEveryOutputAndReplayIsOwnRouting) {
  Block b = block(6, 2, 5, 4, 5);
  const index_t T = 9;
  const auto x = tokens(T, 5, 6);
  const auto a = forward(b, x);
  std::vector<index_t> perm(static_cast<std::size_t>(T));
  for (index_t t = 0; t < T; ++t) perm[static_cast<std::size_t>(t)] = (t * 4 + 1) % T;
  std::vector<double> px(x.size());
  for (index_t t = 0; t < T; ++t)
    std::copy_n(x.begin() + perm[static_cast<std::size_t>(t)] * 5, 5, px.begin() + t * 5);
  const auto pa = forward(b, px);
  for (index_t t = 0; t < T; ++t) {
    const auto s = static_cast<std::size_t>(perm[static_cast<std::size_t>(t)]);
    for (index_t d = 0; d < 5; ++d)
      EXPECT_EQ(pa.y[static_cast<std::size_t>(t * 5 + d)],
                a.y[s * 5 + static_cast<std::size_t>(d)]);
  }
  const auto replayed = forward(b, x, &a.routing.ids);
  EXPECT_EQ(replayed.y, a.y);
  EXPECT_EQ(replayed.source_rows, a.source_rows);
}

TEST(Moe, AnExpertWithNoTokenHasZeroGradientsNeverNaN) {
  Block b = block(3, 1, 4, 3, 7);
  const auto x = tokens(4, 4, 8);
  const std::vector<std::int32_t> ids = {0, 1, 0, 1};  // expert 2 gets nothing
  const auto a = forward(b, x, &ids);
  EXPECT_EQ(a.offsets[2], a.offsets[3]);
  std::vector<double> dy(16, 1.0), dx(16);
  Block g = b;
  for (auto* v : g.all()) std::fill(v->begin(), v->end(), 0.0);
  teo::MoeGrads<double> grads{g.gate.data(), g.gate_bias.data(), g.w_gate.data(),
                              g.w_up.data(), g.w_down.data(),    g.b_gate.data(),
                              g.b_up.data(), g.b_down.data()};
  teo::moe_backward(b.spec, b.weights(), x.data(), 4, a, dy.data(), 0.0, 0.0, dx.data(), grads);
  for (index_t i = 2 * 3 * 4; i < 3 * 3 * 4; ++i) {
    EXPECT_EQ(g.w_gate[static_cast<std::size_t>(i)], 0.0);
    EXPECT_EQ(g.w_down[static_cast<std::size_t>(i)], 0.0);
  }
  for (double v : dx) EXPECT_TRUE(std::isfinite(v));
}

// sum(c * y) + 0.3 aux + 0.2 z by central differences in x and every parameter, away from a
// change of routing (every margin above 1e-3 against steps of 1e-6).
TEST(Moe, TheBackwardIsTheGradientOfEveryParameter) {
  int variants = 0;
  for (ExpertKind kind : {ExpertKind::swiglu, ExpertKind::clamped_swiglu}) {
    for (bool at_input : {false, true}) {
      const index_t T = 5, D = 4, F = 3, E = 4, k = at_input ? 1 : 2;
      // the clamped kind with weights large enough that the clamp at 1.5 is active
      Block b;
      std::vector<double> x;
      for (std::uint64_t seed = 10;; ++seed) {
        b = block(E, k, D, F, seed, kind == ExpertKind::clamped_swiglu ? 1.5 : 0.5);
        b.spec.kind = kind;
        b.spec.limit = 1.5;
        b.spec.weight_at_input = at_input;
        b.spec.router.scoring =
            at_input ? teo::RouterScoring::sigmoid : teo::RouterScoring::softmax;
        b.spec.router.norm_topk_prob = !at_input;
        x = tokens(T, D, seed + 100);
        const auto a = forward(b, x);
        if (*std::min_element(a.routing.margin.begin(), a.routing.margin.end()) < 1e-3) continue;
        if (kind == ExpertKind::clamped_swiglu) {
          const bool clamped =
              std::any_of(a.gate_pre.begin(), a.gate_pre.end(), [](double v) { return v > 1.5; }) &&
              std::any_of(a.up_pre.begin(), a.up_pre.end(),
                          [](double v) { return std::abs(v) > 1.5; });
          if (!clamped) continue;
        }
        break;
      }
      const auto c = tokens(T, D, 999);
      const auto objective = [&](const Block& bb, const std::vector<double>& xx) {
        const auto a = forward(bb, xx);
        double f = 0;
        for (std::size_t i = 0; i < c.size(); ++i) f += c[i] * a.y[i];
        return f + 0.3 * teo::load_balancing_loss(a.logits.data(), a.routing.ids.data(), T, E, k) +
               0.2 * teo::router_z_loss(a.logits.data(), T, E);
      };
      const auto a = forward(b, x);
      Block g = b;
      for (auto* v : g.all()) std::fill(v->begin(), v->end(), 0.0);
      teo::MoeGrads<double> grads{g.gate.data(), g.gate_bias.data(), g.w_gate.data(),
                                  g.w_up.data(), g.w_down.data(),    g.b_gate.data(),
                                  g.b_up.data(), g.b_down.data()};
      std::vector<double> dx(x.size());
      teo::moe_backward(b.spec, b.weights(), x.data(), T, a, c.data(), 0.3, 0.2, dx.data(), grads);
      const auto check = [&](std::vector<double>& v, const std::vector<double>& grad,
                             const std::function<double()>& f, const std::string& what) {
        for (std::size_t i = 0; i < v.size(); ++i) {
          const double keep = v[i];
          v[i] = keep + 1e-6;
          const double up = f();
          v[i] = keep - 1e-6;
          const double down = f();
          v[i] = keep;
          const double fd = (up - down) / 2e-6;
          EXPECT_NEAR(grad[i], fd, 1e-6 * (1 + std::abs(fd)))
              << what << "[" << i << "], variant " << variants;
        }
      };
      check(
          x, dx, [&] { return objective(b, x); }, "x");
      const auto params = b.all();
      const auto grads_of = g.all();
      const char* names[] = {"gate",   "gate_bias", "w_gate", "w_up",
                             "w_down", "b_gate",    "b_up",   "b_down"};
      for (std::size_t p = 0; p < params.size(); ++p)
        check(
            *params[p], *grads_of[p], [&] { return objective(b, x); }, names[p]);
      ++variants;
    }
  }
  EXPECT_EQ(variants, 4);
}

}  // namespace
