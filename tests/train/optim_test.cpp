// teo/train/optim.hpp: the schedule, clipping, AdamW and the averaged weights against their
// formulas (PyTorch's semantics).
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "teo/train/optim.hpp"

namespace {

namespace fs = std::filesystem;
namespace tr = teo::train;

double test_named_max_diff(const teo::Params<double>& a, const teo::Params<double>& b) {
  std::vector<const teo::Tensor<double>*> tb;
  b.visit([&](const std::string&, const teo::Tensor<double>& t) { tb.push_back(&t); });
  double worst = 0;
  std::size_t k = 0;
  a.visit([&](const std::string&, const teo::Tensor<double>& t) {
    for (teo::index_t i = 0; i < t.numel(); ++i)
      worst = std::max(worst, std::abs(t[i] - (*tb[k])[i]));
    ++k;
  });
  return worst;
}

TEST(TrainOptim, ScheduleWarmsUpLinearlyThenDecaysAsInverseSqrt) {
  tr::OptimOptions o;
  o.lr = 1e-3;
  o.warmup_steps = 100;
  EXPECT_DOUBLE_EQ(tr::learning_rate(o, 1), 1e-5);
  EXPECT_DOUBLE_EQ(tr::learning_rate(o, 50), 5e-4);
  EXPECT_DOUBLE_EQ(tr::learning_rate(o, 100), 1e-3);
  EXPECT_DOUBLE_EQ(tr::learning_rate(o, 400), 5e-4);
  EXPECT_DOUBLE_EQ(tr::learning_rate(o, 10000), 1e-4);
}

TEST(TrainOptim, ClippingMatchesTorchSemantics) {
  teo::ModelConfig cfg;
  cfg.num_layers = 1;
  auto g = teo::Params<double>::init(cfg, 3);
  const double norm = tr::global_norm(g);
  ASSERT_GT(norm, 1.0);
  auto clipped = g;
  tr::clip_by_norm(clipped, norm, 1.0);
  EXPECT_NEAR(tr::global_norm(clipped), 1.0 * norm / (norm + 1e-6), 1e-12);
  auto same = g;
  tr::clip_by_norm(same, norm, 2 * norm);
  EXPECT_EQ(same.embedding_weight[5], g.embedding_weight[5]) << "coef clamps to 1";
  tr::clip_by_norm(same, norm, 0);
  EXPECT_EQ(same.head_bias[0], g.head_bias[0]) << "max_norm 0 is off";
}

TEST(TrainOptim, AdamWFollowsTorchsUpdateRule) {
  teo::ModelConfig cfg;
  cfg.num_layers = 1;
  auto p = teo::Params<double>::init(cfg, 1);
  const auto p0 = p;
  auto g = teo::Params<double>::init(cfg, 2);
  tr::OptimOptions o;
  o.weight_decay = 0.1;
  auto adam = tr::AdamW<double>::zeros(cfg);
  const double lr = 0.01;
  adam.update(p, g, o, lr);
  adam.update(p, g, o, lr);
  // Two steps with the same gradient, by hand: m_t = (1 - b1^t) g, v_t = (1 - b2^t) g^2, so
  // m_hat = g and v_hat = g^2 at both steps.
  auto expect = [&](double x0, double gi, bool decay) {
    double x = x0;
    for (int t = 1; t <= 2; ++t) {
      if (decay) x *= 1 - lr * o.weight_decay;
      const double m = (1 - std::pow(o.beta1, t)) * gi, v = (1 - std::pow(o.beta2, t)) * gi * gi;
      x -= lr / (1 - std::pow(o.beta1, t)) * m /
           (std::sqrt(v) / std::sqrt(1 - std::pow(o.beta2, t)) + o.adam_eps);
    }
    return x;
  };
  const auto& w = p.layers[0].q_weight;
  EXPECT_NEAR(w[7], expect(p0.layers[0].q_weight[7], g.layers[0].q_weight[7], true), 1e-15);
  EXPECT_NEAR(p.layers[0].q_bias[3], expect(p0.layers[0].q_bias[3], g.layers[0].q_bias[3], false),
              1e-15);
  EXPECT_NEAR(p.layers[0].norm1_weight[0],
              expect(p0.layers[0].norm1_weight[0], g.layers[0].norm1_weight[0], false), 1e-15)
      << "norms are not decayed";
  EXPECT_EQ(adam.step, 2);
}

TEST(TrainOptim, AveragedWeightsFollowTheirFormula) {
  EXPECT_DOUBLE_EQ(tr::ema_decay(0.999, 1), 2.0 / 11.0);
  EXPECT_DOUBLE_EQ(tr::ema_decay(0.999, 80), 0.9);
  EXPECT_DOUBLE_EQ(tr::ema_decay(0.999, 1000000), 0.999);
  EXPECT_DOUBLE_EQ(tr::ema_decay(0.1, 1), 0.1) << "the cap applies from the first step";
  teo::ModelConfig cfg;
  cfg.num_layers = 1;
  auto avg = teo::Params<double>::init(cfg, 1);
  const auto a0 = avg;
  const auto p = teo::Params<double>::init(cfg, 2);
  tr::ema_update(avg, p, 0.75);
  EXPECT_DOUBLE_EQ(
      avg.layers[0].v_weight[5],
      a0.layers[0].v_weight[5] + 0.25 * (p.layers[0].v_weight[5] - a0.layers[0].v_weight[5]));
  EXPECT_DOUBLE_EQ(avg.head_bias[1], a0.head_bias[1] + 0.25 * (p.head_bias[1] - a0.head_bias[1]));
  tr::ema_update(avg, p, 0.0);
  EXPECT_LE(test_named_max_diff(avg, p), 1e-15) << "decay 0 copies the parameters (to rounding)";
  cfg.num_layers = 2;
  auto other = teo::Params<double>::init(cfg, 3);
  EXPECT_THROW(tr::ema_update(avg, other, 0.5), teo::ShapeError);
}

}  // namespace
