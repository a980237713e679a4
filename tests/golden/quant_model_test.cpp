// Quantized models (docs/quantization.md, "Quantized models"): a decoder case whose linear weights
// are stored packed computes with their exact dequantized values and has no gradient for them; a
// family's checkpoint of such a model (GPTQ, AWQ, ModelOpt NVFP4, gpt-oss MXFP4) reads through the
// name map and exports back byte for byte, with its config.json's quantization_config; what does
// not fit is a named error.
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "teo/contract.hpp"
#include "teo/golden.hpp"
#include "teo/names.hpp"
#include "teo/quant_formats.hpp"
#include "test_paths.hpp"

namespace {

namespace fs = std::filesystem;
namespace st = teo::safetensors;
namespace golden = teo::golden;
namespace names = teo::names;
namespace quant = teo::quant;
using nlohmann::json;

// LLaMA's block of the corpus (llama_block_f64) with its linears in `q`.
json llama(const json& q, const std::string& dtype = "float64") {
  json j = {
      {"architecture", "decoder"},
      {"vocab_size", 16},
      {"max_len", 10},
      {"d_model", 16},
      {"num_heads", 4},
      {"d_ff", 32},
      {"num_layers", 2},
      {"norm_first", true},
      {"norm", "rmsnorm"},
      {"ffn", "swiglu"},
      {"attn_bias", false},
      {"ffn_bias", false},
      {"head_bias", false},
      {"positional", "rope"},
      {"num_kv_heads", 2},
      {"embed_scale", false},
      {"case",
       {{"batch", 3}, {"seq_len", 6}, {"lengths", {6, 6, 2}}, {"dtype", dtype}, {"seed", 3004u}}}};
  if (!q.is_null()) j["quantization"] = q;
  return j;
}

// gpt-oss's layers (moe_gpt_oss_layers_f64) widened to 32 so that MXFP4's blocks fit, with its
// experts in `q`.
json gpt_oss(const json& q) {
  json j = {
      {"architecture", "decoder"},
      {"vocab_size", 16},
      {"max_len", 256},
      {"d_model", 32},
      {"num_heads", 4},
      {"num_kv_heads", 2},
      {"head_dim", 4},
      {"d_ff", 32},
      {"num_layers", 2},
      {"norm_first", true},
      {"norm", "rmsnorm"},
      {"ffn", "moe"},
      {"attn_bias", true},
      {"ffn_bias", false},
      {"head_bias", false},
      {"embed_scale", false},
      {"positional", "rope"},
      {"rope_base", 100.0},
      {"sliding_window", 3},
      {"layer_types", {"sliding_attention", "full_attention"}},
      {"attn_sinks", true},
      {"num_experts", 4},
      {"num_experts_per_tok", 2},
      {"moe_d_ff", 32},
      {"router_order", "topk_then_score"},
      {"router_bias", true},
      {"expert_bias", true},
      {"expert_kind", "clamped_swiglu"},
      {"swiglu_limit", 0.05},
      {"case",
       {{"batch", 2}, {"seq_len", 6}, {"lengths", {6, 4}}, {"dtype", "float64"}, {"seed", 3312u}}}};
  if (!q.is_null()) j["quantization"] = q;
  return j;
}

golden::Case case_of(const json& j) {
  return golden::Case::from_json(j);
}

std::vector<unsigned char> bytes(const st::File& f, const std::string& name) {
  const st::Tensor* t = f.find(name);
  if (!t) return {};
  const auto d = t->data();
  return {d.begin(), d.end()};
}

// The golden generated from `ckpt` under `map`, as `teo golden generate --weights` does.
st::File through(const golden::Case& c, const st::File& ckpt, const std::string& family) {
  const fs::path p = fs::path(::testing::TempDir()) / ("quant_model_" + family + ".safetensors");
  golden::GenerateOptions o;
  o.overwrite = true;
  o.checkpoint = &ckpt;
  o.names = std::make_shared<names::NameMap>(names::NameMap::load(family));
  golden::generate_file(c, p.string(), o);
  st::File f = st::read(p.string());
  fs::remove(p);
  return f;
}

TEST(QuantizedModel, ParametersAreTheExactValuesOfTheirPackingAndHaveNoGradient) {
  const json q = {{"weight_format", "gptq"}, {"group_size", 8}, {"act_order", true}};
  const golden::Case c = case_of(llama(q));
  const st::File g = golden::make(c);
  const st::File dense = golden::make(case_of(llama(nullptr)));
  const auto weights = teo::contract::quantized(c.config);
  ASSERT_EQ(weights.size(), 14u);  // q, k, v, o, gate, up, down of two layers
  for (const auto& w : weights) {
    quant::Packed p;
    p.format = quant::TensorFormat::gptq;
    for (const char* role : {"qweight", "qzeros", "scales", "g_idx"}) {
      const std::string module = w.name.substr(0, w.name.size() - 7);
      const st::Tensor* t = g.find("quant." + module + "." + role);
      ASSERT_NE(t, nullptr) << w.name << " " << role;
      p.parts[role] = *t;
    }
    const auto exact = quant::dequantize(p, w.name);
    EXPECT_EQ(g.find("param." + w.name)->float_values(), exact) << w.name;
    // quantized: not the dense case's drawn values, and no gradient
    EXPECT_NE(dense.find("param." + w.name)->float_values(), exact) << w.name;
    EXPECT_EQ(g.find("grad." + w.name), nullptr) << w.name;
    EXPECT_NE(dense.find("grad." + w.name), nullptr) << w.name;
  }
  // the rest as the dense case draws them, with their gradients
  for (const char* n : {"param.embedding.weight", "param.layers.0.norm1.weight",
                        "grad.layers.1.norm2.weight", "grad.embedding.weight"}) {
    ASSERT_NE(g.find(n), nullptr) << n;
  }
  EXPECT_EQ(bytes(g, "param.embedding.weight"), bytes(dense, "param.embedding.weight"));
  golden::validate(g);
  EXPECT_EQ(golden::case_of(g).config, c.config);
}

// A candidate that computes with the dense weights the quantizer started from, not the packing's,
// fails: the golden judges the quantized model.
TEST(QuantizedModel, TheDenseModelFailsTheQuantizedGolden) {
  const st::File g = golden::make(case_of(llama({{"weight_format", "awq"}, {"group_size", 8}})));
  const st::File dense = golden::make(case_of(llama(nullptr)));
  const auto r = golden::check(g, dense, {});
  EXPECT_GT(r.failed, 0);
  EXPECT_EQ(r.first_divergence.rfind("layers.0.", 0), 0u) << r.first_divergence;
  EXPECT_EQ(golden::check(g, g, {}).failed, 0);
}

struct Round {
  const char* name;
  json config;
  const char* family;
};

class QuantizedCheckpoint : public ::testing::TestWithParam<Round> {};

// golden -> export -> generate --weights gives the same packing, parameters and verdict, and
// exports the same checkpoint bytes again; config.json's quantization_config reads back as the
// config's quantization.
TEST_P(QuantizedCheckpoint, ReadsThroughTheMapAndExportsBackByteForByte) {
  const golden::Case c = case_of(GetParam().config);
  const st::File g = golden::make(c);
  const auto map = names::NameMap::load(GetParam().family);
  const st::File ckpt = st::parse(st::serialize(names::checkpoint_of(g, map)), "checkpoint");
  const json hf = names::hf_config_of(c.config, map);
  ASSERT_TRUE(hf.contains("quantization_config")) << hf.dump();
  // a LLaMA's projections are all packed: none of them is dense in the checkpoint
  if (std::string(GetParam().family) == "hf-llama") {
    for (const auto& t : ckpt.tensors)
      EXPECT_FALSE(t.name.ends_with("_proj.weight") && st::is_float(t.dtype)) << t.name;
  }
  json j = names::config_from_hf(hf, map);
  j["case"] = GetParam().config["case"];
  const golden::Case from_hf =
      golden::Case::from_json(names::with_checkpoint_targets(ckpt, map, j));
  const st::File back = through(from_hf, ckpt, GetParam().family);
  for (const auto& t : g.tensors) {
    if (t.name.starts_with("quant.") || t.name.starts_with("param.")) {
      EXPECT_EQ(bytes(back, t.name), bytes(g, t.name)) << t.name;
    }
  }
  EXPECT_EQ(golden::check(g, back, {}).failed, 0);
  EXPECT_TRUE(st::serialize(names::checkpoint_of(back, map)) == st::serialize(ckpt));
}

INSTANTIATE_TEST_SUITE_P(
    Formats, QuantizedCheckpoint,
    ::testing::Values(
        Round{"gptq_v1_act_order",
              llama({{"weight_format", "gptq"}, {"group_size", 8}, {"act_order", true}}),
              "hf-llama"},
        Round{"gptq_v2", llama({{"weight_format", "gptq"}, {"group_size", 16}, {"zero_offset", 0}}),
              "hf-llama"},
        Round{"awq", llama({{"weight_format", "awq"}, {"group_size", 8}}), "hf-llama"},
        Round{"nvfp4", llama({{"weight_format", "nvfp4"}}), "hf-llama"},
        Round{"mxfp4_experts",
              gpt_oss({{"weight_format", "mxfp4"}, {"targets", {"layers.*.moe.experts.*"}}}),
              "hf-gpt-oss"}),
    [](const auto& info) { return std::string(info.param.name); });

// gpt-oss's gate_up_proj_blocks hold each expert's gate at the even rows and up at the odd ones.
TEST(QuantizedModel, GptOssGateAndUpAreTheInterleavedRowsOfOneMxfp4Tensor) {
  const golden::Case c =
      case_of(gpt_oss({{"weight_format", "mxfp4"}, {"targets", {"layers.*.moe.experts.*"}}}));
  const st::File g = golden::make(c);
  const st::File ckpt = names::checkpoint_of(g, names::NameMap::load("hf-gpt-oss"));
  const auto fused = bytes(ckpt, "model.layers.1.mlp.experts.gate_up_proj_blocks");
  const auto gate = bytes(g, "quant.layers.1.moe.experts.w_gate_blocks");
  const auto up = bytes(g, "quant.layers.1.moe.experts.w_up_blocks");
  ASSERT_EQ(fused.size(), gate.size() * 2);
  const std::size_t row = 16, rows = 32;  // one block of 32 values a row, 32 rows an expert
  for (std::size_t e = 0; e < 4; ++e) {
    for (std::size_t r = 0; r < rows; ++r) {
      const auto at = [&](const std::vector<unsigned char>& v, std::size_t i) {
        return std::vector<unsigned char>(v.begin() + static_cast<std::ptrdiff_t>(i * row),
                                          v.begin() + static_cast<std::ptrdiff_t>((i + 1) * row));
      };
      EXPECT_EQ(at(fused, e * 2 * rows + 2 * r), at(gate, e * rows + r)) << e << " " << r;
      EXPECT_EQ(at(fused, e * 2 * rows + 2 * r + 1), at(up, e * rows + r)) << e << " " << r;
    }
  }
  // the attention stays dense: gpt-oss quantizes its experts only
  EXPECT_NE(ckpt.find("model.layers.0.self_attn.q_proj.weight"), nullptr);
}

TEST(QuantizedModel, WhatDoesNotFitIsANamedError) {
  const auto error_of = [](const auto& f) -> std::string {
    try {
      f();
    } catch (const std::exception& e) {
      return e.what();
    }
    return "no error";
  };
  // NVFP4's F32 global scale makes values float32 does not hold
  EXPECT_NE(error_of([] {
              golden::make(case_of(llama({{"weight_format", "nvfp4"}}, "float32")));
            }).find("float32 cannot hold"),
            std::string::npos);
  // a precision rounds the parameters
  json bf16 = llama({{"weight_format", "awq"}, {"group_size", 8}}, "float32");
  bf16["case"]["precision"] = "bf16";
  EXPECT_NE(error_of([&] { case_of(bf16); }).find("full precision only"), std::string::npos);
  // blocks that do not divide, a target that names nothing, a key of another format
  EXPECT_NE(error_of([] {
              case_of(llama({{"weight_format", "mxfp4"}}));
            }).find("blocks of 32"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              case_of(llama({{"weight_format", "int8"}, {"targets", {"layers.*.attn.x.*"}}}));
            }).find("names no linear weight"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              case_of(llama({{"weight_format", "awq"}, {"act_order", true}}));
            }).find("applies to a weight_format of gptq"),
            std::string::npos);
  // no quantization_config expresses teo's int8, and GGUF blocks are not safetensors
  const auto llama_map = names::NameMap::load("hf-llama");
  EXPECT_NE(error_of([&] {
              names::hf_config_of(case_of(llama({{"weight_format", "int8"}})).config, llama_map);
            }).find("no Hugging Face quantization_config"),
            std::string::npos);
  const st::File q8 = golden::make(
      case_of(gpt_oss({{"weight_format", "gguf:Q8_0"}, {"targets", {"layers.*.moe.experts.*"}}})));
  EXPECT_NE(error_of([&] {
              names::checkpoint_of(q8, names::NameMap::load("hf-gpt-oss"));
            }).find("GGUF blocks"),
            std::string::npos);
  // gptq packs 8 rows in a word of qzeros: gpt-oss's interleaved gate and up do not split
  const st::File gptq = golden::make(case_of(gpt_oss(
      {{"weight_format", "gptq"}, {"group_size", 32}, {"targets", {"layers.*.moe.experts.*"}}})));
  EXPECT_NE(error_of([&] {
              names::checkpoint_of(gptq, names::NameMap::load("hf-gpt-oss"));
            }).find("cannot split"),
            std::string::npos);
  // a checkpoint missing a part, or with a dense weight where the config says packed
  const golden::Case c = case_of(llama({{"weight_format", "awq"}, {"group_size", 8}}));
  const st::File g = golden::make(c);
  const st::File ckpt = names::checkpoint_of(g, llama_map);
  st::File missing;
  for (const auto& t : ckpt.tensors)
    if (t.name != "model.layers.1.mlp.down_proj.scales") missing.tensors.push_back(t);
  EXPECT_NE(error_of([&] {
              through(c, missing, "hf-llama");
            }).find("no tensor model.layers.1.mlp.down_proj.scales"),
            std::string::npos);
  const st::File dense = names::checkpoint_of(golden::make(case_of(llama(nullptr))), llama_map);
  EXPECT_NE(error_of([&] { through(c, dense, "hf-llama"); }).find("is dense"), std::string::npos);
  EXPECT_NE(error_of([&] {
              names::with_checkpoint_targets(dense, llama_map, llama({{"weight_format", "awq"}}));
            }).find("packed so under"),
            std::string::npos);
  // a quantization_config teo does not read
  EXPECT_NE(error_of([&] {
              json hf = names::hf_config_of(c.config, llama_map);
              hf["quantization_config"]["bits"] = 8;
              names::config_from_hf(hf, llama_map);
            }).find("bits 8"),
            std::string::npos);
}

}  // namespace
