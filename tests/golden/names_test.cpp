// Checkpoint name maps (include/teo/names.hpp): the built-in families' maps against committed
// goldens, the layout of fused and transposed tensors, the round trip import -> export, and the
// named errors of a checkpoint or config.json that does not fit.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "teo/contract.hpp"
#include "teo/golden.hpp"
#include "teo/layers/rope.hpp"
#include "teo/names.hpp"
#include "teo/precision.hpp"
#include "teo/rounding.hpp"
#include "test_paths.hpp"

namespace {

namespace fs = std::filesystem;
namespace st = teo::safetensors;
namespace golden = teo::golden;
namespace names = teo::names;
using nlohmann::json;

const st::File& committed(const std::string& name) {
  static std::map<std::string, st::File> cache;
  auto it = cache.find(name);
  if (it == cache.end()) {
    const fs::path p = fs::path(TEO_SOURCE_DIR) / "golden" / (name + ".safetensors");
    it = cache.emplace(name, st::read(p.string())).first;
  }
  return it->second;
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const teo::Error& e) {
    return e.what();
  }
  return "";
}

// The golden's parameters, through the family's checkpoint and back.
template <class Real>
teo::Params<Real> through_checkpoint(const st::File& g, const names::NameMap& map) {
  const auto cfg = golden::case_of(g).config;
  const st::File ckpt = st::parse(st::serialize(names::checkpoint_of(g, map)), "checkpoint");
  return names::params_from_checkpoint(ckpt, map, cfg, teo::Params<Real>::zeros(cfg));
}

struct Family {
  const char* map;
  const char* golden;
};

class BuiltinMap : public ::testing::TestWithParam<Family> {};

// Export then import gives every parameter bit for bit, the exported checkpoint is the same bytes
// again, and config.json reads back as the golden's config.
TEST_P(BuiltinMap, RoundTripsTheGoldensParametersAndConfig) {
  const auto map = names::NameMap::load(GetParam().map);
  const st::File& g = committed(GetParam().golden);
  const auto cfg = golden::case_of(g).config;
  const bool f32 = golden::case_of(g).dtype == "float32";
  const auto check = [&](const auto& params) {
    params.visit([&](const std::string& n, const auto& t) {
      const auto* want = g.find("param." + n);
      ASSERT_NE(want, nullptr) << n;
      ASSERT_EQ(want->data().size(), t.numel() * sizeof(t[0])) << n;
      EXPECT_EQ(std::memcmp(want->data().data(), t.data(), want->data().size()), 0) << n;
    });
  };
  if (f32)
    check(through_checkpoint<float>(g, map));
  else
    check(through_checkpoint<double>(g, map));
  const json hf = names::hf_config_of(cfg, map);
  json back = names::config_from_hf(hf, map);
  EXPECT_EQ(teo::ModelConfig::from_json(back), cfg) << hf.dump();
  // the golden's parameters back through the checkpoint give the same checkpoint bytes
  const st::File ckpt = names::checkpoint_of(g, map);
  st::File again;
  again.metadata = g.metadata;
  const auto add_params = [&](const auto& params) {
    params.visit([&](const std::string& n, const auto& t) {
      again.add("param." + n, t.shape().dims(), t.data(), static_cast<std::size_t>(t.numel()));
    });
  };
  if (f32)
    add_params(through_checkpoint<float>(g, map));
  else
    add_params(through_checkpoint<double>(g, map));
  EXPECT_TRUE(st::serialize(names::checkpoint_of(again, map)) == st::serialize(ckpt));
}

INSTANTIATE_TEST_SUITE_P(
    Families, BuiltinMap,
    ::testing::Values(Family{"hf-bert", "bert_f64"}, Family{"hf-bert", "bert_f32"},
                      Family{"hf-roberta", "roberta_f64"}, Family{"hf-gpt2", "gpt2_pre_tied_f64"},
                      Family{"hf-llama", "llama_block_f32"}, Family{"hf-vit", "vit_f64"},
                      Family{"hf-vit", "vit_f32"}, Family{"hf-mixtral", "moe_mixtral_f64"},
                      Family{"hf-mixtral", "moe_mixtral_f32"},
                      Family{"hf-qwen2-moe", "moe_qwen2_shared_f64"},
                      Family{"hf-qwen3-moe", "moe_qwen3_qk_norm_f64"},
                      Family{"hf-gpt-oss", "moe_gpt_oss_layers_f64"},
                      Family{"hf-deepseek-v3", "moe_deepseek_v3_mla_f64"}),
    [](const auto& info) {
      std::string s = std::string(info.param.map) + "_" + info.param.golden;
      for (char& c : s)
        if (c == '-') c = '_';
      return s;
    });

// GPT-2's c_attn is one Conv1D (x W + b, W stored (D, 3D)): q, k and v are its column thirds,
// transposed.
TEST(Names, Gpt2FusedQkvIsTheTransposedColumnThirds) {
  const auto map = names::NameMap::load("hf-gpt2");
  const st::File& g = committed("gpt2_pre_tied_f64");
  const st::File ckpt = names::checkpoint_of(g, map);
  const auto* fused = ckpt.find("transformer.h.1.attn.c_attn.weight");
  ASSERT_NE(fused, nullptr);
  const std::int64_t D = golden::case_of(g).config.d_model;
  ASSERT_EQ(fused->shape, (std::vector<std::int64_t>{D, 3 * D}));
  const auto w = fused->float_values();
  const char* parts[] = {"q", "k", "v"};
  for (int part = 0; part < 3; ++part) {
    const auto t = g.find(std::string("param.layers.1.attn.") + parts[part] + ".weight");
    const auto v = t->float_values();  // (D out, D in)
    for (std::int64_t r = 0; r < D; ++r)
      for (std::int64_t c = 0; c < D; ++c)
        ASSERT_EQ(w[static_cast<std::size_t>(c * 3 * D + part * D + r)],
                  v[static_cast<std::size_t>(r * D + c)])
            << parts[part] << " " << r << " " << c;
  }
  EXPECT_EQ(ckpt.find("lm_head.weight"), nullptr) << "GPT-2's head is tied: not written";
}

// Mixtral stores each expert's Linear layers on their own ({e}): expert e's w1, w3 and w2 are
// slice e of teo's stacked w_gate, w_up and w_down; a candidate's per-expert gradients are stacked
// back, and one with an expert missing leaves the parameter's gradient missing, not partly zero.
TEST(Names, MixtralExpertsAreTheStacksSlices) {
  const auto map = names::NameMap::load("hf-mixtral");
  const st::File& g = committed("moe_mixtral_f64");
  const auto cfg = golden::case_of(g).config;
  const st::File ckpt = names::checkpoint_of(g, map);
  const std::int64_t E = cfg.ffn.moe.num_experts, Fe = cfg.ffn.moe.moe_d_ff, D = cfg.d_model;
  const std::pair<const char*, const char*> stacks[] = {
      {"w_gate", "w1"}, {"w_up", "w3"}, {"w_down", "w2"}};
  for (const auto& [teo_name, hf] : stacks) {
    const auto stack = g.find(std::string("param.layers.1.moe.experts.") + teo_name);
    ASSERT_NE(stack, nullptr) << teo_name;
    const auto v = stack->float_values();
    for (std::int64_t e = 0; e < E; ++e) {
      const auto* t = ckpt.find("model.layers.1.block_sparse_moe.experts." + std::to_string(e) +
                                "." + hf + ".weight");
      ASSERT_NE(t, nullptr) << hf << " " << e;
      EXPECT_EQ(t->numel(), Fe * D);
      const auto w = t->float_values();
      for (std::int64_t n = 0; n < Fe * D; ++n)
        ASSERT_EQ(w[static_cast<std::size_t>(n)], v[static_cast<std::size_t>(e * Fe * D + n)])
            << hf << " " << e << " " << n;
    }
  }
  // a candidate's gradients under the checkpoint's names, as transformers names them
  st::File cand;
  for (const auto& t : ckpt.tensors)
    cand.add("grad." + t.name, t.dtype, t.shape, t.data().data(), t.data().size());
  const st::File renamed = names::candidate_in_teo_names(cand, map, cfg);
  const auto* w_up = renamed.find("grad.layers.1.moe.experts.w_up");
  ASSERT_NE(w_up, nullptr);
  EXPECT_EQ(w_up->shape, (std::vector<std::int64_t>{E, Fe, D}));
  EXPECT_EQ(w_up->float_values(), g.find("param.layers.1.moe.experts.w_up")->float_values());
  st::File partial;
  for (const auto& t : cand.tensors)
    if (t.name != "grad.model.layers.1.block_sparse_moe.experts.2.w3.weight")
      partial.add(t.name, t.dtype, t.shape, t.data().data(), t.data().size());
  const st::File some = names::candidate_in_teo_names(partial, map, cfg);
  EXPECT_EQ(some.find("grad.layers.1.moe.experts.w_up"), nullptr);
  EXPECT_NE(some.find("grad.layers.1.moe.experts.w_gate"), nullptr);
}

// gpt-oss stores its experts whole: gate_up_proj (E, D, 2F), each expert's matrix transposed
// against nn.Linear with gate at the even columns and up at the odd ones, gate_up_proj_bias (E, 2F)
// likewise, down_proj (E, F, D) transposed. Every element lands where the map says; interleave
// without a split is refused by name.
TEST(Names, GptOssStackedInterleavedExpertsAreTheStacksColumns) {
  const auto map = names::NameMap::load("hf-gpt-oss");
  const st::File& g = committed("moe_gpt_oss_layers_f64");
  const st::File ckpt = names::checkpoint_of(g, map);
  const std::string e = "model.layers.1.mlp.experts.";
  const auto* gate_up = ckpt.find(e + "gate_up_proj");
  const auto* gate_up_bias = ckpt.find(e + "gate_up_proj_bias");
  const auto* down = ckpt.find(e + "down_proj");
  ASSERT_TRUE(gate_up && gate_up_bias && down);
  const auto w_gate = g.find("param.layers.1.moe.experts.w_gate");  // (E, F, D)
  const std::int64_t E = w_gate->shape[0], F = w_gate->shape[1], D = w_gate->shape[2];
  ASSERT_EQ(gate_up->shape, (std::vector<std::int64_t>{E, D, 2 * F}));
  ASSERT_EQ(down->shape, (std::vector<std::int64_t>{E, F, D}));
  const auto gu = gate_up->float_values(), gub = gate_up_bias->float_values(),
             dn = down->float_values();
  const auto wg = w_gate->float_values(),
             wu = g.find("param.layers.1.moe.experts.w_up")->float_values(),
             bg = g.find("param.layers.1.moe.experts.b_gate")->float_values(),
             bu = g.find("param.layers.1.moe.experts.b_up")->float_values(),
             wd = g.find("param.layers.1.moe.experts.w_down")->float_values();
  const auto at = [](std::int64_t i) { return static_cast<std::size_t>(i); };
  for (std::int64_t x = 0; x < E; ++x) {
    for (std::int64_t f = 0; f < F; ++f) {
      EXPECT_EQ(gub[at(x * 2 * F + 2 * f)], bg[at(x * F + f)]);
      EXPECT_EQ(gub[at(x * 2 * F + 2 * f + 1)], bu[at(x * F + f)]);
      for (std::int64_t d = 0; d < D; ++d) {
        const std::int64_t teo = (x * F + f) * D + d;
        EXPECT_EQ(gu[at((x * D + d) * 2 * F + 2 * f)], wg[at(teo)]) << x << " " << f << " " << d;
        EXPECT_EQ(gu[at((x * D + d) * 2 * F + 2 * f + 1)], wu[at(teo)])
            << x << " " << f << " " << d;
        EXPECT_EQ(dn[at((x * F + f) * D + d)], wd[at((x * D + d) * F + f)]);
      }
    }
  }
  std::ifstream in(std::string(TEO_SOURCE_DIR) + "/src/golden/names/hf-gpt-oss.json");
  json m = json::parse(in);
  for (auto& rule : m.at("params"))
    if (rule[0] == "layers.{i}.moe.experts.b_down") rule.push_back(json{{"interleave", true}});
  EXPECT_NE(error_of([&] { names::NameMap::from_json(m, "x.json"); }).find("needs a split"),
            std::string::npos);
}

// ViT's cls_token (1, 1, D) and position_embeddings (1, S, D) carry leading dimensions of size 1
// (leading_ones); the convolution's weight (D, Ch, P, P) is teo's as it is.
TEST(Names, VitLeadingOnesAndConvWeightKeepTheirValues) {
  const auto map = names::NameMap::load("hf-vit");
  const st::File& g = committed("vit_f64");
  const auto cfg = golden::case_of(g).config;
  const st::File ckpt = names::checkpoint_of(g, map);
  const std::int64_t D = cfg.d_model, S = 1 + cfg.patches();
  const struct {
    const char* teo;
    const char* hf;
    std::vector<std::int64_t> shape;
  } want[] = {
      {"cls_token", "vit.embeddings.cls_token", {1, 1, D}},
      {"pos_embedding.weight", "vit.embeddings.position_embeddings", {1, S, D}},
      {"patch_embedding.weight",
       "vit.embeddings.patch_embeddings.projection.weight",
       {D, cfg.embeddings.channels, cfg.embeddings.patch_size, cfg.embeddings.patch_size}},
  };
  for (const auto& w : want) {
    const auto* t = ckpt.find(w.hf);
    ASSERT_NE(t, nullptr) << w.hf;
    EXPECT_EQ(t->shape, w.shape) << w.hf;
    EXPECT_EQ(t->float_values(), g.find(std::string("param.") + w.teo)->float_values()) << w.hf;
  }
  // a checkpoint whose cls_token lacks the leading ones is refused by name
  st::File bad = ckpt;
  for (auto& t : bad.tensors)
    if (t.name == "vit.embeddings.cls_token") t.shape = {D};
  const std::string err = error_of(
      [&] { names::params_from_checkpoint(bad, map, cfg, teo::Params<double>::zeros(cfg)); });
  EXPECT_NE(err.find("vit.embeddings.cls_token has shape (12)"), std::string::npos) << err;
}

// Checkpoint tensors in BF16 (or F16) widen exactly into a float32 case; float64 values float32
// cannot hold are refused by name.
TEST(Names, NarrowCheckpointsWidenExactlyAndF64IsNotRounded) {
  const auto map = names::NameMap::load("hf-bert");
  const st::File& g = committed("bert_f32");
  const auto cfg = golden::case_of(g).config;
  st::File ckpt = names::checkpoint_of(g, map);
  st::File bf16;
  for (auto& t : ckpt.tensors) {
    auto v = t.values<float>();
    std::vector<std::uint16_t> bits(v.size());
    teo::to_bits(teo::Precision::bf16, bits.data(), v.data(), static_cast<teo::index_t>(v.size()));
    bf16.add(t.name, st::DType::BF16, t.shape, bits.data(), bits.size() * 2);
  }
  const auto p = names::params_from_checkpoint(bf16, map, cfg, teo::Params<float>::zeros(cfg));
  const auto w = p.embedding_weight;
  const auto src = g.find("param.embedding.weight")->values<float>();
  for (std::size_t i = 0; i < src.size(); ++i) {
    float r = src[i];
    teo::round_to(teo::Precision::bf16, &r, 1);
    ASSERT_EQ(w[static_cast<teo::index_t>(i)], r) << i;
  }
  st::File f64;
  for (const auto& t : ckpt.tensors) {
    auto v = t.float_values();
    if (t.name == "bert.pooler.dense.bias") v[0] += 1e-12;
    f64.add<double>(t.name, t.shape, v.data(), v.size());
  }
  EXPECT_NE(error_of([&] {
              names::params_from_checkpoint(f64, map, cfg, teo::Params<float>::zeros(cfg));
            }).find("bert.pooler.dense.bias"),
            std::string::npos);
}

// Before anything is converted: a missing tensor, one no rule reads, a wrong shape, each named.
TEST(Names, CheckpointErrorsNameTheTensor) {
  const auto map = names::NameMap::load("hf-bert");
  const st::File& g = committed("bert_f64");
  const auto cfg = golden::case_of(g).config;
  const st::File ckpt = names::checkpoint_of(g, map);
  const auto with = [&](auto&& edit) {
    st::File f;
    for (const auto& t : ckpt.tensors) edit(f, t);
    return error_of(
        [&] { names::params_from_checkpoint(f, map, cfg, teo::Params<double>::zeros(cfg)); });
  };
  const auto copy = [](st::File& f, const st::Tensor& t, const std::string& name) {
    f.add(name, t.dtype, t.shape, t.data().data(), t.data().size());
  };
  EXPECT_NE(with([&](st::File& f, const st::Tensor& t) {
              if (t.name != "bert.encoder.layer.1.output.dense.bias") copy(f, t, t.name);
            }).find("has no tensor bert.encoder.layer.1.output.dense.bias"),
            std::string::npos);
  EXPECT_NE(with([&](st::File& f, const st::Tensor& t) {
              copy(f, t, t.name);
              if (t.name == "bert.pooler.dense.bias") copy(f, t, "bert.pooler.extra.bias");
            }).find("bert.pooler.extra.bias is read by no teo parameter"),
            std::string::npos);
  EXPECT_NE(with([&](st::File& f, const st::Tensor& t) {
              if (t.name == "bert.pooler.dense.weight") {
                f.add(t.name, t.dtype, {t.shape[0] / 2, t.shape[1] * 2}, t.data().data(),
                      t.data().size());
              } else {
                copy(f, t, t.name);
              }
            }).find("bert.pooler.dense.weight has shape (6, 24), the config gives (12, 12)"),
            std::string::npos);
  // a base model's checkpoint: no "bert." prefix and no classifier (the head keeps the seed's)
  st::File base;
  for (const auto& t : ckpt.tensors)
    if (t.name.starts_with("bert.")) copy(base, t, t.name.substr(5));
  const auto seeded = teo::Params<double>::init(cfg, 7);
  const auto p = names::params_from_checkpoint(base, map, cfg, seeded);
  EXPECT_EQ(p.head_weight[0], seeded.head_weight[0]);
  EXPECT_EQ(p.pooler_weight[3], g.find("param.pooler.weight")->values<double>()[3]);
}

TEST(Names, ConfigJsonKeysAreMappedOrRefusedByName) {
  const auto map = names::NameMap::load("hf-bert");
  const auto cfg = golden::case_of(committed("bert_f64")).config;
  const json hf = names::hf_config_of(cfg, map);
  EXPECT_EQ(hf.at("hidden_size"), 12);
  EXPECT_EQ(hf.at("model_type"), "bert");
  const auto err = [&](const std::string& key, const json& value) {
    json h = hf;
    h[key] = value;
    return error_of([&] { names::config_from_hf(h, map); });
  };
  EXPECT_NE(err("hiden_size", 12).find("\"hiden_size\" is neither mapped nor ignored"),
            std::string::npos);
  EXPECT_NE(err("hiden_size", 12).find("hidden_size"), std::string::npos) << "a suggestion";
  EXPECT_NE(err("attention_probs_dropout_prob", 0.2).find("are both teo's dropout"),
            std::string::npos);
  EXPECT_NE(err("position_embedding_type", "relative_key").find("no teo counterpart"),
            std::string::npos);
  EXPECT_NE(err("hidden_act", "tanh").find("hidden_act"), std::string::npos);
  // a config the family cannot express is refused by its keys
  auto pre = cfg;
  pre.norms.norm_first = true;
  EXPECT_NE(error_of([&] { names::hf_config_of(pre, map); }).find("norm_first"), std::string::npos);
  // GPT-2's n_inner null is 4 n_embd
  const auto gpt2 = names::NameMap::load("hf-gpt2");
  json g2 = names::hf_config_of(golden::case_of(committed("gpt2_pre_tied_f64")).config, gpt2);
  g2["n_embd"] = 8;
  g2["n_inner"] = nullptr;
  EXPECT_EQ(names::config_from_hf(g2, gpt2).at("d_ff"), 32);
}

// Qwen3-30B-A3B's config.json as released reads as that model: 32 heads of 128 over a width of
// 2048 (head_dim apart from hidden_size), q and k norms, 128 experts of 768, top 8 renormalised;
// its parameters then have Qwen3's shapes. A transformers 5 config.json (rope_parameters) and a
// sliding window are refused by name.
// DeepSeek-V3's released config.json (its 671 billion parameters, FP8 weights aside) reads as that
// model: latent attention with heads of 128 + 64 for q and k and 128 for v, YaRN whose
// mscale_all_dim scales the scores, three dense layers, sigmoid routing in 8 groups choose 4 with
// the correction bias, and one shared expert of moe_intermediate_size.
TEST(Names, DeepSeekV3ReleasedConfigReadsAsThatModel) {
  const auto map = names::NameMap::load("hf-deepseek-v3");
  const json hf = json::parse(R"({
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": false,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1,
    "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": true, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "seq_aux": true, "tie_word_embeddings": false, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "transformers_version": "4.33.1", "use_cache": true,
    "v_head_dim": 128, "vocab_size": 129280})");
  // its parameters need more than 5 TB in float64: validated without that limit
  const teo::MemoryLimits limits = teo::memory_limits();
  teo::set_memory_limits({.max_tensor_elements = limits.max_tensor_elements,
                          .max_total_bytes = teo::index_t{1} << 44});
  const auto cfg = teo::ModelConfig::from_json(names::config_from_hf(hf, map));
  teo::set_memory_limits(limits);
  EXPECT_TRUE(cfg.attention.mla());
  EXPECT_EQ(cfg.d_head(), 192);
  EXPECT_EQ(cfg.v_head(), 128);
  EXPECT_EQ(cfg.rotary(), 64);
  EXPECT_EQ(cfg.attention.rope_style, teo::RopeStyle::interleaved);
  EXPECT_EQ(cfg.attention.rope_scaling.mscale_all_dim, 1.0);
  const double m = 0.1 * std::log(40.0) + 1.0;
  EXPECT_DOUBLE_EQ(teo::attention_mscale(cfg), m * m);
  EXPECT_EQ(cfg.ffn.moe.first_dense_layers, 3);
  EXPECT_FALSE(cfg.moe_layer(2));
  EXPECT_TRUE(cfg.moe_layer(3));
  EXPECT_EQ(cfg.ffn.moe.router_groups, 8);
  EXPECT_EQ(cfg.ffn.moe.topk_groups, 4);
  EXPECT_EQ(cfg.ffn.moe.router_scoring, teo::RouterScoring::sigmoid);
  EXPECT_TRUE(cfg.ffn.moe.selection_bias);
  EXPECT_EQ(cfg.ffn.moe.shared_d_ff, 2048);
  EXPECT_EQ(cfg.ffn.moe.routed_scaling_factor, 2.5);
  const auto shape = [&](const std::string& name) {
    return teo::contract::shape(teo::contract::param_dims(name), cfg, {});
  };
  EXPECT_EQ(shape("layers.0.attn.q_a.weight"), (std::vector<teo::index_t>{1536, 7168}));
  EXPECT_EQ(shape("layers.0.attn.q_b.weight"), (std::vector<teo::index_t>{24576, 1536}));
  EXPECT_EQ(shape("layers.0.attn.kv_a.weight"), (std::vector<teo::index_t>{576, 7168}));
  EXPECT_EQ(shape("layers.0.attn.kv_b.weight"), (std::vector<teo::index_t>{32768, 512}));
  EXPECT_EQ(shape("layers.0.attn.o.weight"), (std::vector<teo::index_t>{7168, 16384}));
  // the shared experts' width is n_shared_experts whole experts: 1 of the corpus case's width 4
  // is exported as 1, and a width that is not a multiple cannot be expressed
  const auto cased = golden::case_of(committed("moe_deepseek_v3_mla_f64")).config;
  EXPECT_EQ(names::hf_config_of(cased, map).at("n_shared_experts"), 1);
  auto odd = cased;
  odd.ffn.moe.shared_d_ff = 6;
  EXPECT_NE(error_of([&] { names::hf_config_of(odd, map); }).find("shared_d_ff"),
            std::string::npos);
  // transformers 4.50-4.57 rotate by max_position_embeddings / original_max_position_embeddings:
  // a factor that is not that ratio is refused by name
  json stretched = hf;
  stretched["max_position_embeddings"] = 32768;
  EXPECT_NE(error_of([&] {
              names::config_from_hf(stretched, map);
            }).find("max_position_embeddings / original_max_position_embeddings"),
            std::string::npos);
  // V2-Lite's form (q from x) without groups exports and reads back as itself: q_lora_rank null
  // and n_group 1 are written, not left to DeepseekV3Config's defaults (1536 and 8)
  auto lite = cased;
  lite.attention.q_lora_rank.reset();
  lite.ffn.moe.router_groups = lite.ffn.moe.topk_groups = 1;
  const json lite_hf = names::hf_config_of(lite, map);
  EXPECT_TRUE(lite_hf.at("q_lora_rank").is_null());
  EXPECT_EQ(lite_hf.at("n_group"), 1);
  EXPECT_EQ(teo::ModelConfig::from_json(names::config_from_hf(lite_hf, map)), lite);
  // its latent norms take RMSNorm's default eps whatever rms_norm_eps says: only 1e-6 is read
  json eps = hf;
  eps["rms_norm_eps"] = 1e-5;
  EXPECT_NE(error_of([&] { names::config_from_hf(eps, map); }).find("rms_norm_eps"),
            std::string::npos);
  json no_shared = hf;
  no_shared["n_shared_experts"] = nullptr;
  EXPECT_NE(error_of([&] { names::config_from_hf(no_shared, map); }).find("n_shared_experts"),
            std::string::npos);
  // V2's group-limited greedy choice (no correction bias) is refused by name
  json v2 = hf;
  v2["topk_method"] = "group_limited_greedy";
  EXPECT_NE(error_of([&] { names::config_from_hf(v2, map); }).find("topk_method"),
            std::string::npos);
}

TEST(Names, Qwen3MoeReleasedConfigReadsAsThatModel) {
  const auto map = names::NameMap::load("hf-qwen3-moe");
  const json hf = json::parse(R"({
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": true, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": false, "rms_norm_eps": 1e-06, "rope_scaling": null,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": null,
    "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})");
  // its 30.5 billion parameters need more than 200 GB in float64: validated without that limit
  const teo::MemoryLimits limits = teo::memory_limits();
  teo::set_memory_limits({.max_tensor_elements = limits.max_tensor_elements,
                          .max_total_bytes = teo::index_t{1} << 42});
  const auto cfg = teo::ModelConfig::from_json(names::config_from_hf(hf, map));
  teo::set_memory_limits(limits);
  EXPECT_EQ(cfg.d_model, 2048);
  EXPECT_EQ(cfg.d_head(), 128);
  EXPECT_EQ(cfg.attn_width(), 4096);
  EXPECT_EQ(cfg.kv_heads(), 4);
  EXPECT_TRUE(cfg.attention.qk_norm);
  EXPECT_FALSE(cfg.attention.attn_bias);
  EXPECT_EQ(cfg.ffn.moe.num_experts, 128);
  EXPECT_EQ(cfg.ffn.moe.num_experts_per_tok, 8);
  EXPECT_EQ(cfg.ffn.moe.moe_d_ff, 768);
  EXPECT_TRUE(cfg.ffn.moe.norm_topk_prob);
  EXPECT_EQ(cfg.attention.rope_base, 1000000.0);
  const auto shape = [&](const std::string& name) {
    return teo::contract::shape(teo::contract::param_dims(name), cfg, {});
  };
  EXPECT_EQ(shape("layers.0.attn.q.weight"), (std::vector<teo::index_t>{4096, 2048}));
  EXPECT_EQ(shape("layers.0.attn.k.weight"), (std::vector<teo::index_t>{512, 2048}));
  EXPECT_EQ(shape("layers.0.attn.o.weight"), (std::vector<teo::index_t>{2048, 4096}));
  EXPECT_EQ(shape("layers.47.attn.k_norm.weight"), (std::vector<teo::index_t>{128}));
  json v5 = hf;
  v5.erase("rope_theta");
  v5["rope_parameters"] = {{"rope_theta", 1000000.0}, {"rope_type", "default"}};
  EXPECT_NE(error_of([&] { names::config_from_hf(v5, map); }).find("\"rope_parameters\""),
            std::string::npos);
  json sliding = hf;
  sliding["use_sliding_window"] = true;
  EXPECT_NE(error_of([&] { names::config_from_hf(sliding, map); }).find("use_sliding_window"),
            std::string::npos);
}

// What transformers' save_pretrained leaves out is its config class's default: a 2-label
// classifier without id2label, BERT's 2 token types; so a config without token types has no
// hf-bert form, and exporting it is refused rather than loaded with fresh random types.
TEST(Names, ConfigJsonDefaultsAreTheConfigClasss) {
  const auto map = names::NameMap::load("hf-bert");
  const auto cfg = golden::case_of(committed("bert_f64")).config;
  json hf = names::hf_config_of(cfg, map);
  hf.erase("id2label");
  hf.erase("type_vocab_size");
  const json back = names::config_from_hf(hf, map);
  EXPECT_EQ(back.at("num_classes"), 2);
  EXPECT_EQ(back.at("type_vocab_size"), 2);
  auto no_types = cfg;
  no_types.embeddings.type_vocab_size.reset();
  EXPECT_NE(error_of([&] { names::hf_config_of(no_types, map); }).find("type_vocab_size"),
            std::string::npos);
  hf["classifier_dropout"] = 0.5;
  EXPECT_NE(error_of([&] { names::config_from_hf(hf, map); }).find("classifier_dropout"),
            std::string::npos);
}

// Every field of a map file is checked: a misspelled or mistyped one is a ConfigError naming it,
// never a JSON library error, and parameters that share a checkpoint tensor must be its equal
// slices.
TEST(Names, MalformedMapsAreNamedErrors) {
  const auto text = [](const std::string& params, const std::string& config) {
    return json::parse(R"({"format": "teo-names/1", "family": "m", "params": )" + params +
                       R"(, "config": )" + config + "}");
  };
  const std::string one = R"([["embedding.weight", "w"]])";
  const auto err = [&](const std::string& params, const std::string& config) {
    return error_of([&] { names::NameMap::from_json(text(params, config), "m.json"); });
  };
  EXPECT_NE(err(one, R"({"keys": {"hidden_size": 5}})").find("config.keys.hidden_size"),
            std::string::npos);
  EXPECT_NE(err(one, R"({"keys": {"n_inner": {"key": "d_ff", "null_times": "x"}}})")
                .find("null_times must be"),
            std::string::npos);
  EXPECT_NE(err(one, R"({"keys": {"a": {"kye": "activation", "map": {"x": "gelu"}}}})")
                .find("unknown field \"kye\""),
            std::string::npos);
  EXPECT_NE(err(one, R"({"fixed": [1]})").find("config.fixed must be an object"),
            std::string::npos);
  EXPECT_NE(err(one, R"({"keys": {"a": {"key": "b", "count": "yes"}}})").find("count"),
            std::string::npos);
  EXPECT_NE(err(R"([["embedding.weight", "w"], ["embedding.weight", "v"]])", "{}")
                .find("embedding.weight has two rules"),
            std::string::npos);
  EXPECT_NE(err(R"([["embedding.weight", "w", null]])", "{}").find("must be an object"),
            std::string::npos);
  // a map without a config section still exports parameters, and refuses config.json keys
  const auto m = names::NameMap::from_json(
      json::parse(R"({"format": "teo-names/1", "family": "m", "params": [["x", "y"]]})"), "m");
  EXPECT_NE(error_of([&] {
              names::config_from_hf(json{{"hidden_size", 8}}, m);
            }).find("\"hidden_size\" is neither mapped nor ignored"),
            std::string::npos);
  // two parameters on one checkpoint tensor that are not its equal slices
  auto bad = names::NameMap::load("hf-bert");
  for (auto& r : bad.rules)
    if (r.teo == "layers.{i}.attn.q.weight") r.checkpoint = "bert.embeddings.LayerNorm.weight";
  EXPECT_NE(error_of([&] {
              names::checkpoint_of(committed("bert_f64"), bad);
            }).find("share checkpoint tensor bert.embeddings.LayerNorm.weight"),
            std::string::npos);
}

TEST(Names, MapFilesAreCheckedAndUnknownFamiliesSuggested) {
  EXPECT_NE(error_of([] { names::NameMap::load("hf-bret"); }).find("hf-bert"), std::string::npos);
  EXPECT_NE(error_of([] {
              names::NameMap::from_json(json::parse(R"({"format": "teo-names/1", "family": "x",
                "params": [["embedding.weight", "w", {"transpos": true}]]})"),
                                        "m.json");
            }).find("unknown option \"transpos\""),
            std::string::npos);
  EXPECT_NE(error_of([] {
              names::NameMap::from_json(json::parse(R"({"family": "x"})"), "m.json");
            }).find("m.json: \"format\""),
            std::string::npos);
  const auto fams = names::NameMap::builtin_families();
  EXPECT_EQ(fams, (std::vector<std::string>{"hf-bert", "hf-roberta", "hf-gpt2", "hf-llama",
                                            "hf-vit", "hf-mixtral", "hf-qwen2-moe", "hf-qwen3-moe",
                                            "hf-gpt-oss", "hf-deepseek-v3"}));
}

// A candidate may name its parameter gradients by the checkpoint's names (with or without the
// base prefix); a misspelled one still fails as a name the golden does not have.
TEST(Names, CheckReadsCandidateGradientsUnderCheckpointNames) {
  const st::File& g = committed("gpt2_pre_tied_f64");
  const auto map = std::make_shared<names::NameMap>(names::NameMap::load("hf-gpt2"));
  // the golden's own values, its grad.* renamed as a checkpoint's
  st::File grads;
  for (const auto& t : g.tensors)
    if (t.name.starts_with("grad.") && !t.name.starts_with("grad.act."))
      grads.add("param." + t.name.substr(5), t.dtype, t.shape, t.data().data(), t.data().size());
  grads.metadata = g.metadata;
  const st::File as_ckpt = names::checkpoint_of(grads, *map);
  st::File candidate;
  for (const auto& t : g.tensors)
    if (t.name.starts_with("act.") || t.name.starts_with("grad.act."))
      candidate.add(t.name, t.dtype, t.shape, t.data().data(), t.data().size());
  for (const auto& t : as_ckpt.tensors) {
    const std::string n = t.name.starts_with("transformer.") ? t.name.substr(12) : t.name;
    candidate.add("grad." + n, t.dtype, t.shape, t.data().data(), t.data().size());
  }
  golden::CheckOptions opts;
  opts.names = map;
  auto rep = golden::check(g, candidate, opts);
  EXPECT_EQ(rep.failed, 0) << rep.first_divergence;
  EXPECT_EQ(rep.not_checked, 0);
  // without the map the checkpoint names are unknown tensors
  EXPECT_GT(golden::check(g, candidate, {}).failed, 0);
  candidate.tensors.back().name = "grad.h.0.attn.c_atn.weight";
  rep = golden::check(g, candidate, opts);
  EXPECT_GT(rep.failed, 0);
}

}  // namespace
