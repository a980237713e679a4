// Mixtures of experts in the model (docs/semantics.md, 19.4): the config's keys and their named
// errors, Hugging Face's layer rule, one expert being the dense SwiGLU model bit for bit, padding
// that changes nothing real, and the loss terms over the real tokens. The whole model's gradients
// are in gradient_test.cpp, generation in generate_test.cpp.
#include <cstring>
#include <map>

#include <nlohmann/json.hpp>

#include "support.hpp"
#include "teo/golden.hpp"

namespace teo {
namespace {

ModelConfig decoder(index_t layers) {
  ModelConfig c;
  c.architecture = Architecture::decoder;
  c.attention.causal = true;
  c.norms.norm_first = true;
  c.norms.norm = Norm::rmsnorm;
  c.ffn.activation = Activation::silu;
  c.attention.attn_bias = c.ffn.ffn_bias = c.head.head_bias = false;
  c.embeddings.positional = Positional::rope;
  c.embeddings.vocab_size = 13;
  c.embeddings.max_len = 8;
  c.d_model = 8;
  c.ffn.d_ff = 12;
  c.num_layers = layers;
  return c;
}

ModelConfig moe(index_t layers) {
  ModelConfig c = decoder(layers);
  c.ffn.kind = FfnKind::moe;
  c.ffn.moe.num_experts = 4;
  c.ffn.moe.num_experts_per_tok = 2;
  c.ffn.moe.moe_d_ff = 6;
  return c;
}

TEST(MoeConfig, KeysRoundTripFlatAndMoeLayersFollowHuggingFacesRule) {
  const auto c = ModelConfig::from_json_text(R"({"architecture": "decoder", "ffn": "moe",
      "norm": "rmsnorm", "norm_first": true, "positional": "rope", "num_layers": 6,
      "num_experts": 8, "num_experts_per_tok": 2, "moe_d_ff": 6, "router_scoring": "sigmoid",
      "router_groups": 4, "topk_groups": 2, "selection_bias": true, "norm_topk_prob": true,
      "routed_scaling_factor": 2.5, "shared_d_ff": 12, "first_dense_layers": 1, "moe_every": 2,
      "router_aux_loss_coef": 0.01})");
  EXPECT_EQ(c.ffn.kind, FfnKind::moe);
  EXPECT_EQ(c.ffn.moe.num_experts, 8);
  EXPECT_EQ(c.ffn.moe.router_scoring, RouterScoring::sigmoid);
  EXPECT_EQ(c.ffn.moe.routed_scaling_factor, 2.5);
  EXPECT_EQ(c.ffn_activation(), Activation::silu);  // the dense layers' SwiGLU
  EXPECT_EQ(ModelConfig::from_json(c.to_json()), c);
  // i >= first_dense_layers and (i + 1) % moe_every == 0: layers 1, 3, 5
  for (index_t i = 0; i < 6; ++i) EXPECT_EQ(c.moe_layer(i), i % 2 == 1) << i;
  // the model's parameters follow: layer 0 is dense, layer 1 routed
  const auto p = Params<double>::zeros(c);
  EXPECT_FALSE(p.layers[0].moe);
  EXPECT_EQ(p.layers[0].gate_weight.shape(), Shape({c.ffn.d_ff, c.d_model}));
  EXPECT_TRUE(p.layers[1].moe);
  EXPECT_EQ(p.layers[1].experts_w_down.shape(), Shape({8, c.d_model, 6}));
  EXPECT_EQ(p.layers[1].router_correction.shape(), Shape({8}));
  EXPECT_TRUE(p.layers[1].fc1_weight.empty());
  // a dense model's JSON has no MoE key
  EXPECT_FALSE(decoder(2).to_json().contains("num_experts"));
}

TEST(MoeConfig, BadKeysAreNamedErrors) {
  const auto err = [](const std::string& extra, const std::string& needle) {
    test::expect_throw<ConfigError>(
        [&] {
          ModelConfig::from_json_text(
              R"({"architecture": "decoder", "ffn": "moe", "num_experts": 4, "moe_d_ff": 6)" +
              extra + "}");
        },
        needle);
  };
  err(R"(, "num_experts_per_tok": 5)", "num_experts_per_tok");
  err(R"(, "router_scoring": "tanh")", "router_scoring");
  err(R"(, "router_groups": 3)", "router_groups");
  err(R"(, "topk_groups": 2)", "topk_groups");
  err(R"(, "swiglu_limit": 3)", "swiglu_limit");
  err(R"(, "shared_expert_gate": true)", "shared_expert_gate");
  err(R"(, "moe_every": 0)", "moe_every");
  err(R"(, "router_aux_loss_coef": -1)", "router_aux_loss_coef");
  err(R"(, "dropout": 0.1)", "dropout");
  err(R"(, "activation": "gelu")", "silu");
  err(R"(, "num_expert": 4)", "did you mean \"num_experts\"");
  test::expect_throw<ConfigError>(
      [] { ModelConfig::from_json_text(R"({"architecture": "decoder", "ffn": "moe"})"); },
      "num_experts");
  test::expect_throw<ConfigError>([] { ModelConfig::from_json_text(R"({"num_experts": 4})"); },
                                  "ffn \"moe\"");
  test::expect_throw<ConfigError>(
      [] {
        ModelConfig::from_json_text(R"({"architecture": "encoder_decoder", "ffn": "moe",
            "num_experts": 4, "moe_d_ff": 6})");
      },
      "encoder_decoder");
  // a model case takes replay_routing, a boolean, with ffn "moe" only
  nlohmann::json j = moe(2).to_json();
  j["case"] = {{"batch", 1}, {"seq_len", 4}, {"dtype", "float64"}, {"seed", 1u}};
  EXPECT_FALSE(golden::Case::from_json(j).replay_routing);
  j["case"]["replay_routing"] = true;
  const auto c = golden::Case::from_json(j);
  EXPECT_TRUE(c.replay_routing);
  EXPECT_EQ(c.case_json().at("replay_routing"), true);
  j["case"]["replay_routing"] = 1;
  test::expect_throw<ConfigError>([&] { golden::Case::from_json(j); }, "true or false");
  nlohmann::json dense = ModelConfig{}.to_json();
  dense["case"] = {
      {"batch", 1}, {"seq_len", 4}, {"dtype", "float64"}, {"seed", 1u}, {"replay_routing", true}};
  test::expect_throw<ConfigError>([&] { golden::Case::from_json(dense); }, "ffn \"moe\"");
}

// The dense model's FFN weights as expert 0 of a one-expert top-1 model.
template <class Real>
Params<Real> as_one_expert(const Params<Real>& dense, const ModelConfig& cfg) {
  Params<Real> p = Params<Real>::zeros(cfg);
  std::map<std::string, const Tensor<Real>*> by_name;
  dense.visit([&](const std::string& n, const Tensor<Real>& t) { by_name[n] = &t; });
  p.visit([&](const std::string& n, Tensor<Real>& t) {
    std::string from = n;
    for (const auto& [moe_name, dense_name] : {std::pair{"moe.experts.w_gate", "ffn.gate.weight"},
                                               std::pair{"moe.experts.w_up", "ffn.fc1.weight"},
                                               std::pair{"moe.experts.w_down", "ffn.fc2.weight"}}) {
      if (const auto at = n.find(moe_name); at != std::string::npos)
        from = n.substr(0, at) + dense_name;
    }
    if (n.ends_with("moe.gate.weight")) return;  // the router: any gate gives weight 1
    ASSERT_TRUE(by_name.count(from)) << n;
    std::copy(by_name[from]->begin(), by_name[from]->end(), t.data());
  });
  return p;
}

template <class Real>
class MoeModel : public ::testing::Test {};
TYPED_TEST_SUITE(MoeModel, test::Dtypes);

// One expert chosen with weight 1 (softmax over one logit) is the dense SwiGLU FFN: the same
// products on the same rows, so the loss, every activation both have and every gradient of the
// shared parameters are the same bits.
TYPED_TEST(MoeModel, OneExpertTopOneIsTheDenseSwigluModelBitForBit) {
  using Real = TypeParam;
  ModelConfig dense = decoder(2);
  dense.ffn.kind = FfnKind::swiglu;
  ModelConfig one = decoder(2);
  one.ffn.kind = FfnKind::moe;
  one.ffn.moe.num_experts = 1;
  one.ffn.moe.num_experts_per_tok = 1;
  one.ffn.moe.moe_d_ff = dense.ffn.d_ff;
  auto pd = Params<double>::init(dense, 5);
  test::randomise(pd, 5);
  const auto dense_p = test::convert_params<Real>(pd);
  const auto one_p = as_one_expert(dense_p, one);
  const Batch batch = Batch::random(dense, 3, 6, 7, {6, 2, 0});
  Activations<Real> ad, am;
  forward(dense_p, batch, ad, {.train = false});
  forward(one_p, batch, am, {.train = false});
  EXPECT_EQ(std::memcmp(ad.loss.data(), am.loss.data(), sizeof(Real)), 0);
  EXPECT_EQ(std::memcmp(ad.lm_logits.data(), am.lm_logits.data(),
                        sizeof(Real) * static_cast<std::size_t>(ad.lm_logits.numel())),
            0);
  for (const auto& l : am.layers)
    for (index_t i = 0; i < l.moe_topk_weights.numel(); ++i) ASSERT_EQ(l.moe_topk_weights[i], 1);
  Params<Real> gd, gm;
  Activations<Real> dd, dm;
  backward(dense_p, batch, ad, gd, dd);
  backward(one_p, batch, am, gm, dm);
  EXPECT_EQ(std::memcmp(dd.input.data(), dm.input.data(),
                        sizeof(Real) * static_cast<std::size_t>(dd.input.numel())),
            0);
  const auto named = test::named(gm);
  const auto want = test::named(gd);
  for (const auto& [n, g] : named) {
    std::string from = n;
    for (const auto& [moe_name, dense_name] : {std::pair{"moe.experts.w_gate", "ffn.gate.weight"},
                                               std::pair{"moe.experts.w_up", "ffn.fc1.weight"},
                                               std::pair{"moe.experts.w_down", "ffn.fc2.weight"}})
      if (const auto at = n.find(moe_name); at != std::string::npos)
        from = n.substr(0, at) + dense_name;
    if (n.ends_with("moe.gate.weight")) {
      // one expert's weight is 1 whatever its logit: no gradient reaches the gate
      for (double v : g) EXPECT_EQ(v, 0.0) << n;
      continue;
    }
    ASSERT_TRUE(want.count(from)) << n;
    EXPECT_EQ(g, want.at(from)) << n << " is not " << from << "'s gradient, bit for bit";
  }
}

// Every position is routed, but a padded one reaches nothing real: changing the padded tokens
// leaves the loss, the loss terms and every real row of the layers' outputs the same bits.
TYPED_TEST(MoeModel, PaddingReachesNothingRealAndTheLossTermsCountRealTokens) {
  using Real = TypeParam;
  ModelConfig c = moe(2);
  c.ffn.moe.router_aux_loss_coef = 0.5;
  c.ffn.moe.router_z_loss_coef = 0.25;
  c.ffn.moe.shared_d_ff = 4;
  const auto p = test::convert_params<Real>(Params<double>::init(c, 3));
  Batch a = Batch::random(c, 2, 6, 9, {6, 3});
  Batch b = a;
  for (index_t s = 3; s < 6; ++s) b.tokens[static_cast<std::size_t>(6 + s)] = (s * 5) % 13;
  ASSERT_NE(a.tokens, b.tokens);
  Activations<Real> xa, xb;
  forward(p, a, xa, {.train = false});
  forward(p, b, xb, {.train = false});
  EXPECT_EQ(xa.loss[0], xb.loss[0]);
  EXPECT_EQ(xa.moe_aux_loss[0], xb.moe_aux_loss[0]);
  EXPECT_EQ(xa.moe_z_loss[0], xb.moe_z_loss[0]);
  EXPECT_GT(xa.moe_aux_loss[0], 0);
  for (std::size_t i = 0; i < xa.layers.size(); ++i) {
    for (index_t row : {0, 1, 2, 3, 4, 5, 6, 7, 8}) {
      for (index_t d = 0; d < c.d_model; ++d) {
        EXPECT_EQ(xa.layers[i].output[row * c.d_model + d],
                  xb.layers[i].output[row * c.d_model + d])
            << "layer " << i << " row " << row;
      }
    }
  }
  // the loss terms are those of the real rows alone: the z-loss is their mean logsumexp^2
  double z = 0;
  index_t n = 0;
  for (const auto& l : xa.layers) {
    for (index_t row : {0, 1, 2, 3, 4, 5, 6, 7, 8}) {
      double m = -INFINITY, sum = 0;
      for (index_t e = 0; e < 4; ++e) m = std::max(m, double(l.moe_logits[row * 4 + e]));
      for (index_t e = 0; e < 4; ++e) sum += std::exp(double(l.moe_logits[row * 4 + e]) - m);
      z += (m + std::log(sum)) * (m + std::log(sum));
      ++n;
    }
  }
  EXPECT_NEAR(xa.moe_z_loss[0], z / static_cast<double>(n), 1e-5 * z / static_cast<double>(n));
  // and the padded rows' backward reaches no real gradient: the input's padded rows get 0
  Params<Real> g;
  Activations<Real> d;
  backward(p, a, xa, g, d);
  for (index_t s = 3; s < 6; ++s)
    for (index_t k = 0; k < c.d_model; ++k) EXPECT_EQ(d.input[(6 + s) * c.d_model + k], 0);
}

// Router replay (ForwardOptions::routing): a model fed its own routing computes the same bits;
// fed another, its experts follow it; a bad routing is a named error that changes nothing.
TEST(MoeReplay, ReplayedRoutingIsOwnRoutingBitForBitAndBadRoutingIsNamed) {
  ModelConfig c = moe(3);
  c.ffn.moe.first_dense_layers = 1;  // layer 0 is dense
  const auto p = Params<double>::init(c, 5);
  const Batch b = Batch::random(c, 2, 5, 6, {5, 3});
  Activations<double> own, fed;
  forward(p, b, own, {.train = false});
  std::map<index_t, std::vector<std::int32_t>> r;
  for (index_t i : {1, 2}) r[i] = own.layers[static_cast<std::size_t>(i)].moe.routing.ids;
  forward(p, b, fed, {.train = false, .routing = &r});
  own.visit([&](const std::string& n, const Tensor<double>& t) {
    const Tensor<double>* f = nullptr;
    fed.visit([&](const std::string& m, const Tensor<double>& u) {
      if (m == n) f = &u;
    });
    ASSERT_NE(f, nullptr) << n;
    ASSERT_EQ(t.numel(), f->numel()) << n;
    EXPECT_EQ(
        std::memcmp(t.data(), f->data(), static_cast<std::size_t>(t.numel()) * sizeof(double)), 0)
        << n;
  });
  // another routing is followed: position 0 of layer 2 sent to the experts it did not choose
  auto other = r;
  auto& ids = other[2];
  std::vector<std::int32_t> unchosen;
  for (std::int32_t e = 0; e < 4; ++e)
    if (e != ids[0] && e != ids[1]) unchosen.push_back(e);
  ids[0] = unchosen[0];
  ids[1] = unchosen[1];
  Activations<double> moved;
  forward(p, b, moved, {.train = false, .routing = &other});
  EXPECT_EQ(moved.layers[2].moe.routing.ids, ids);
  EXPECT_NE(moved.layers[2].output[0], own.layers[2].output[0]);
  EXPECT_EQ(moved.layers[1].output[0], own.layers[1].output[0]);
  // named errors, and the activations as they were
  const auto refused = [&](std::map<index_t, std::vector<std::int32_t>> bad, auto error,
                           const char* says) {
    Activations<double> kept = moved;
    test::expect_throw<decltype(error)>(
        [&] { forward(p, b, kept, {.train = false, .routing = &bad}); }, says);
    EXPECT_EQ(kept.layers[2].output[0], moved.layers[2].output[0]);
  };
  refused({{0, r[1]}}, ConfigError(""), "not an MoE layer");
  refused({{7, r[1]}}, ConfigError(""), "not an MoE layer");
  refused({{1, std::vector<std::int32_t>(3, 0)}}, ShapeError(""), "B*S*k");
  auto out_of_range = r;
  out_of_range[1][4] = 4;
  refused(out_of_range, ConfigError(""), "not in [0, 4)");
  auto twice = r;
  twice[1][1] = twice[1][0];
  refused(twice, ConfigError(""), "twice");
}

}  // namespace
}  // namespace teo
