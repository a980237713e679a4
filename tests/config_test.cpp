#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "support.hpp"
#include "teo/config.hpp"
#include "teo/model.hpp"

namespace teo {
namespace {

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
static_assert(std::is_same_v<EncoderConfig, ModelConfig>, "the former name is the same type");
#pragma GCC diagnostic pop

// The flat JSON keys land in the sections the model has, and a section compares on its own.
TEST(Config, EachKeyLivesInItsSection) {
  const ModelConfig c = ModelConfig::from_json(nlohmann::json{{"vocab_size", 9},
                                                              {"d_model", 12},
                                                              {"num_heads", 3},
                                                              {"d_ff", 7},
                                                              {"norm", "rmsnorm"},
                                                              {"num_classes", 5},
                                                              {"ffn", "geglu"}});
  EXPECT_EQ(c.embeddings.vocab_size, 9);
  EXPECT_EQ(c.d_model, 12);
  EXPECT_EQ(c.attention.num_heads, 3);
  EXPECT_EQ(c.ffn.d_ff, 7);
  EXPECT_EQ(c.ffn.kind, FfnKind::geglu);
  EXPECT_EQ(c.norms.norm, Norm::rmsnorm);
  EXPECT_EQ(c.head.num_classes, 5);
  ModelConfig other = c;
  other.head.num_classes = 6;
  EXPECT_EQ(other.attention, c.attention);
  EXPECT_NE(other.head, c.head);
  EXPECT_NE(other, c);
}

TEST(Config, JsonRoundTripPreservesEveryField) {
  ModelConfig c;
  c.embeddings.vocab_size = 1000;
  c.embeddings.max_len = 77;
  c.d_model = 48;
  c.attention.num_heads = 6;
  c.ffn.d_ff = 100;
  c.num_layers = 3;
  c.norms.norm_first = true;
  c.ffn.activation = Activation::gelu_tanh;
  c.norms.layer_norm_eps = 1e-6;
  c.embeddings.positional = Positional::learned;
  c.embeddings.embed_scale = true;
  c.head.pooling = Pooling::max;
  c.head.num_classes = 7;
  c.dropout = 0.125;
  c.head.label_smoothing = 0.05;
  c.attention.causal = true;
  const auto j = c.to_json();
  EXPECT_EQ(j.size(), 16u);
  EXPECT_EQ(ModelConfig::from_json(j), c);
  EXPECT_EQ(ModelConfig::from_json_text(j.dump()), c);
}

TEST(Config, VariantKeysRoundTripAndAppearOnlyWhenUsed) {
  ModelConfig c;
  c.attention.num_heads = 4;
  c.attention.num_kv_heads = 2;
  c.embeddings.positional = Positional::rope;
  c.attention.rope_style = RopeStyle::interleaved;
  c.attention.rotary_dim = 2;
  c.attention.rope_base = 500000.0;
  c.attention.rope_scaling = {.type = RopeScalingType::yarn,
                              .factor = 8.0,
                              .original_max_len = 16,
                              .beta_fast = 16.0,
                              .beta_slow = 2.0};
  c.embeddings.position_offset = 123456;
  c.attention.sliding_window = 5;
  c.attention.attn_logit_softcap = 30.0;
  c.attention.attn_sinks = true;
  c.attention.qk_norm = true;
  c.attention.head_dim = 6;  // H Dh = 24, apart from d_model 16
  c.attention.layer_types = {LayerAttention::full, LayerAttention::sliding};
  c.attention.rope_scaling.truncate = false;
  EXPECT_EQ(c.to_json().at("layer_types"),
            nlohmann::json::parse(R"(["full_attention", "sliding_attention"])"));
  EXPECT_EQ(c.to_json().at("rope_scaling").at("truncate"), false);
  EXPECT_EQ(c.window(0), std::nullopt);
  EXPECT_EQ(c.window(1), 5);
  EXPECT_EQ(c.to_json().at("head_dim"), 6);
  EXPECT_EQ(c.to_json().at("qk_norm"), true);
  EXPECT_EQ(ModelConfig::from_json(c.to_json()), c);
  EXPECT_EQ(c.d_head(), 6);
  EXPECT_EQ(c.attn_width(), 24);
  EXPECT_EQ(ModelConfig{}.attn_width(), ModelConfig{}.d_model);
  ModelConfig a;
  a.embeddings.positional = Positional::alibi;
  a.attention.alibi_max_bias = 4.0;
  EXPECT_EQ(ModelConfig::from_json(a.to_json()), a);
  EXPECT_EQ(ModelConfig{}.to_json().size(), 16u);  // a plain config reads as it always has
  EXPECT_EQ(ModelConfig::from_json_text(
                R"({"sliding_window": null, "attn_logit_softcap": null, "head_dim": null})"),
            ModelConfig{});
  // with head_dim, d_model need not divide by num_heads (gpt-oss: 2880 and 64 heads of 64)
  EXPECT_NO_THROW(ModelConfig::from_json_text(R"({"d_model": 15, "num_heads": 4, "head_dim": 4})"));
}

void expect_config_error(const std::string& text, const std::string& needle);

// Multi-head latent attention's keys appear with kv_lora_rank only, read back as they were, and
// set the heads' widths: q and k Dn + Dr, v Dv, RoPE on the last Dr; d_model need not divide.
TEST(Config, MlaKeysRoundTripAndSetTheHeadWidths) {
  ModelConfig c;
  c.d_model = 10;
  c.attention.num_heads = 3;
  c.embeddings.positional = Positional::rope;
  c.attention.attn_bias = false;
  c.attention.kv_lora_rank = 4;
  c.attention.q_lora_rank = 6;
  c.attention.qk_nope_head_dim = 2;
  c.attention.qk_rope_head_dim = 4;
  c.attention.v_head_dim = 5;
  c.attention.rope_scaling = {
      .type = RopeScalingType::yarn, .factor = 4.0, .mscale = 0.707, .mscale_all_dim = 0.707};
  c.validate();
  EXPECT_EQ(ModelConfig::from_json(c.to_json()), c);
  EXPECT_EQ(c.to_json().at("kv_lora_rank"), 4);
  EXPECT_EQ(c.to_json().at("rope_scaling").at("mscale_all_dim"), 0.707);
  EXPECT_EQ(c.d_head(), 6);
  EXPECT_EQ(c.v_head(), 5);
  EXPECT_EQ(c.attn_width(), 18);
  EXPECT_EQ(c.context_width(), 15);
  EXPECT_EQ(c.rotary(), 4);
  c.attention.q_lora_rank.reset();
  EXPECT_FALSE(c.to_json().contains("q_lora_rank"));
  EXPECT_EQ(ModelConfig::from_json(c.to_json()), c);
  EXPECT_FALSE(ModelConfig{}.to_json().contains("kv_lora_rank"));
  EXPECT_EQ(ModelConfig::from_json_text(R"({"kv_lora_rank": null, "q_lora_rank": null})"),
            ModelConfig{});
}

// Every MLA key that is out of range, set without kv_lora_rank, or combined with what MLA replaces
// is refused by name.
TEST(Config, InvalidMlaKeysAreNamedErrors) {
  const std::string m =
      R"({"positional": "rope", "attn_bias": false, "kv_lora_rank": 4, "qk_nope_head_dim": 2,
          "qk_rope_head_dim": 2, "v_head_dim": 2, )";
  EXPECT_NO_THROW(ModelConfig::from_json_text(m + R"("q_lora_rank": 3})"));
  expect_config_error(R"({"qk_rope_head_dim": 2})", "need kv_lora_rank");
  expect_config_error(R"({"q_lora_rank": 2})", "need kv_lora_rank");
  expect_config_error(m + R"("q_lora_rank": 0})", "q_lora_rank");
  expect_config_error(m + R"("kv_lora_rank": 0})", "kv_lora_rank");
  expect_config_error(m + R"("kv_lora_rank": 4.5})", "kv_lora_rank");
  expect_config_error(m + R"("qk_rope_head_dim": 3})", "even");
  expect_config_error(m + R"("qk_rope_head_dim": 0})", "qk_rope_head_dim");
  expect_config_error(m + R"("v_head_dim": 0})", "v_head_dim");
  expect_config_error(m + R"("qk_nope_head_dim": -1})", "qk_nope_head_dim");
  expect_config_error(m + R"("num_heads": 1048576})", "num_heads x");
  expect_config_error(m + R"("positional": "alibi"})", "positional must be");
  expect_config_error(m + R"("head_dim": 4})", "head_dim and rotary_dim");
  expect_config_error(m + R"("rotary_dim": 2})", "head_dim and rotary_dim");
  expect_config_error(m + R"("num_kv_heads": 1})", "num_kv_heads");
  expect_config_error(m + R"("qk_norm": true})", "qk_norm");
  expect_config_error(m + R"("attn_bias": true})", "attn_bias must be false");
  expect_config_error(m + R"("attn_out_bias": true})", "attn_bias must be false");
  expect_config_error(m + R"("architecture": "encoder_decoder"})", "encoder_decoder");
  expect_config_error(m + R"("rope_scaling": {"type": "linear", "factor": 2, "mscale": 1}})",
                      "apply only to yarn");
  expect_config_error(m + R"("rope_scaling": {"type": "yarn", "factor": 2, "mscale_all_dim": -1}})",
                      "mscale_all_dim");
}

TEST(Config, InvalidVariantValuesAreNamedErrors) {
  expect_config_error(R"({"num_heads": 4, "d_model": 8, "num_kv_heads": 3})", "num_kv_heads");
  expect_config_error(R"({"num_kv_heads": 0})", "num_kv_heads");
  expect_config_error(R"({"num_kv_heads": 4})", "num_kv_heads");
  expect_config_error(R"({"sliding_window": 0})", "sliding_window");
  expect_config_error(R"({"sliding_window": -2})", "sliding_window");
  expect_config_error(R"({"sliding_window": 2.5})", "sliding_window");
  expect_config_error(R"({"attn_logit_softcap": 0})", "attn_logit_softcap");
  expect_config_error(R"({"attn_logit_softcap": -1})", "attn_logit_softcap");
  expect_config_error(R"({"attn_logit_softcap": 1e400})", "JSON");
  expect_config_error(R"({"attn_sinks": 1})", "attn_sinks");
  expect_config_error(R"({"qk_norm": 1})", "qk_norm");
  expect_config_error(R"({"sliding_window": 2, "layer_types": ["full_attention"]})",
                      "one per layer");
  expect_config_error(R"({"layer_types": ["sliding_attention", "full_attention"]})",
                      "sliding_window is null");
  expect_config_error(R"({"sliding_window": 2, "layer_types": ["sliding", "full_attention"]})",
                      "layer_types[]");
  expect_config_error(R"({"sliding_window": 2, "layer_types": "full_attention"})",
                      "layer_types must be an array");
  expect_config_error(
      R"({"positional": "rope", "rope_scaling": {"type": "linear", "factor": 2, "truncate": false}})",
      "truncate");
  expect_config_error(
      R"({"positional": "rope", "rope_scaling": {"type": "yarn", "factor": 2, "truncate": 0}})",
      "truncate");
  expect_config_error(R"({"head_dim": 0})", "head_dim");
  expect_config_error(R"({"head_dim": 2.5})", "head_dim");
  expect_config_error(R"({"head_dim": 2000000})", "head_dim");
  expect_config_error(R"({"num_heads": 2048, "d_model": 2048, "head_dim": 1024})",
                      "num_heads x head_dim");
  expect_config_error(R"({"d_model": 15, "num_heads": 4})", "head_dim set");
  expect_config_error(R"({"positional": "rope", "head_dim": 4, "rotary_dim": 6})", "rotary_dim");
  expect_config_error(R"({"position_offset": -1})", "position_offset");
  expect_config_error(R"({"position_offset": 2000000000000})", "position_offset");
  expect_config_error(R"({"positional": "rope", "rotary_dim": 3})", "rotary_dim");
  expect_config_error(R"({"positional": "rope", "rotary_dim": 10})", "rotary_dim");
  expect_config_error(R"({"positional": "rope", "rotary_dim": -2})", "rotary_dim");
  expect_config_error(R"({"positional": "rope", "rope_base": 1})", "rope_base");
  expect_config_error(R"({"positional": "rope", "rope_style": "gptj"})", "rope_style");
  expect_config_error(R"({"rope_base": 500})", "apply only to positional \"rope\"");
  expect_config_error(R"({"rotary_dim": 2})", "apply only");
  expect_config_error(R"({"alibi_max_bias": 4})", "alibi_max_bias");
  expect_config_error(R"({"positional": "alibi", "alibi_max_bias": 0})", "alibi_max_bias");
  expect_config_error(R"({"positional": "rope", "rope_scaling": {"factor": 2}})", "type");
  expect_config_error(R"({"positional": "rope", "rope_scaling": {"type": "dynamic"}})", "dynamic");
  expect_config_error(
      R"({"positional": "rope", "rope_scaling": {"type": "linear", "factor": 0.5}})", "factor");
  expect_config_error(
      R"({"positional": "rope", "rope_scaling": {"type": "linear", "beta_fast": 4}})", "beta_fast");
  expect_config_error(R"({"positional": "rope", "rope_scaling": {"type": "yarn", "beta_slow": 0}})",
                      "beta_slow");
  expect_config_error(
      R"({"positional": "rope", "rope_scaling": {"type": "yarn", "beta_fast": 1e-320}})",
      "beta_fast");
  expect_config_error(
      R"({"positional": "rope", "rope_scaling": {"type": "yarn", "beta_fast": 1, "beta_slow": 2}})",
      "beta_fast > beta_slow");
  expect_config_error(R"({"positional": "rope", "rope_scaling": {"type": "none", "factor": 2}})",
                      "none");
  expect_config_error(R"({"positional": "rope", "rope_scaling": {"type": "ntk", "factor": 2,
                          "original_max_len": 0}})",
                      "original_max_len");
  expect_config_error(R"({"positional": "rope", "rope_scaling": {"type": "yarn", "scale": 2}})",
                      "scale");
  expect_config_error(R"({"positional": "rope", "rope_scaling": 2})", "rope_scaling");
  expect_config_error(R"({"d_model": 4, "num_heads": 1, "positional": "rope", "rotary_dim": 2,
                          "rope_scaling": {"type": "ntk", "factor": 2}})",
                      "ntk");
}

// The block variants and decoders: their keys round-trip, appear only when used, and a decoder is
// causal unless its JSON says otherwise (which is refused).
TEST(Config, BlockAndDecoderKeysRoundTripAndAppearOnlyWhenUsed) {
  ModelConfig c;
  c.norms.norm = Norm::rmsnorm;
  c.ffn.kind = FfnKind::swiglu;
  c.ffn.activation = Activation::silu;
  c.ffn.ffn_bias = c.attention.attn_bias = c.head.head_bias = false;
  EXPECT_EQ(ModelConfig::from_json(c.to_json()), c);
  c.architecture = Architecture::decoder;
  c.attention.causal = true;
  c.head.tie_embeddings = true;
  EXPECT_EQ(ModelConfig::from_json(c.to_json()), c);
  EXPECT_FALSE(c.to_json().contains("pooling"));
  EXPECT_FALSE(c.to_json().contains("num_classes"));
  EXPECT_FALSE(ModelConfig{}.to_json().contains("architecture"));
  EXPECT_TRUE(ModelConfig::from_json_text(R"({"architecture": "decoder"})").attention.causal);
  EXPECT_EQ(ModelConfig::from_json_text(R"({"ffn": "geglu", "activation": "gelu_tanh"})")
                .ffn_activation(),
            Activation::gelu_tanh);
  EXPECT_EQ(ModelConfig::from_json_text(R"({"ffn": "swiglu"})").ffn_activation(), Activation::silu);
}

// attn_out_bias: unset, the output projection follows attn_bias and the key is not written; set,
// it is the output projection's alone (Qwen2: q, k and v biases, none on o), and round-trips.
TEST(Config, AttnOutBiasFollowsAttnBiasUnlessSet) {
  ModelConfig c;
  EXPECT_TRUE(c.attention.out_bias());
  EXPECT_FALSE(c.to_json().contains("attn_out_bias"));
  c.attention.attn_bias = false;
  EXPECT_FALSE(c.attention.out_bias());
  const auto qwen2 = ModelConfig::from_json_text(R"({"attn_out_bias": false})");
  EXPECT_TRUE(qwen2.attention.attn_bias);
  EXPECT_FALSE(qwen2.attention.out_bias());
  EXPECT_EQ(qwen2.to_json().at("attn_out_bias"), false);
  EXPECT_EQ(ModelConfig::from_json(qwen2.to_json()), qwen2);
  const auto params = teo::Params<double>::zeros(qwen2);
  std::vector<std::string> names;
  params.visit([&](const std::string& n, const auto&) { names.push_back(n); });
  const auto has = [&](const std::string& n) {
    return std::find(names.begin(), names.end(), n) != names.end();
  };
  EXPECT_TRUE(has("layers.0.attn.q.bias"));
  EXPECT_TRUE(has("layers.0.attn.v.bias"));
  EXPECT_FALSE(has("layers.0.attn.o.bias"));
  expect_config_error(R"({"attn_out_bias": "no"})", "attn_out_bias");
}

TEST(Config, InvalidBlockAndDecoderValuesAreNamedErrors) {
  expect_config_error(R"({"norm": "batchnorm"})", "norm");
  expect_config_error(R"({"ffn": "mixture"})", "ffn");
  expect_config_error(R"({"ffn": "moe"})", "num_experts");
  expect_config_error(R"({"ffn": "swiglu", "activation": "relu"})", "silu");
  expect_config_error(R"({"ffn": "geglu", "activation": "silu"})", "gelu_tanh");
  expect_config_error(R"({"ffn_bias": 0})", "ffn_bias");
  expect_config_error(R"({"architecture": "encoder_only"})", "architecture");
  expect_config_error(R"({"architecture": "decoder", "causal": false})", "causal");
  expect_config_error(R"({"architecture": "decoder", "num_classes": 7})", "num_classes");
  expect_config_error(R"({"architecture": "decoder", "pooling": "cls"})", "pooling");
  expect_config_error(R"({"tie_embeddings": true})", "tie_embeddings");
}

// input "patches" (ViT, semantics 18.5): its keys round-trip, max_len follows from the sizes, and
// what an image has not (token ids, their keys) is a named error.
TEST(Config, PatchesInputKeysRoundTripAndTheirLimitsAreNamed) {
  const auto c = ModelConfig::from_json_text(
      R"({"input": "patches", "image_size": 8, "patch_size": 4, "channels": 3})");
  EXPECT_EQ(c.patches(), 4);
  EXPECT_EQ(c.embeddings.max_len, 5);  // [CLS] and 4 patches
  EXPECT_FALSE(c.to_json().contains("vocab_size"));
  EXPECT_EQ(ModelConfig::from_json(c.to_json()), c);
  EXPECT_FALSE(ModelConfig{}.to_json().contains("input"));
  const std::string vit = R"("input": "patches", "image_size": 8, "patch_size": 4, "channels": 3)";
  expect_config_error(R"({"input": "pixels"})", "input");
  expect_config_error(R"({"image_size": 8})", "image_size");
  expect_config_error(R"({"input": "patches", "image_size": 8, "patch_size": 3, "channels": 3})",
                      "multiple of patch_size");
  expect_config_error(R"({"input": "patches", "image_size": 8, "patch_size": 4})", "channels");
  expect_config_error("{" + vit + R"(, "max_len": 6})", "max_len must be 5");
  expect_config_error("{" + vit + R"(, "vocab_size": 10})", "vocab_size");
  expect_config_error("{" + vit + R"(, "embed_scale": true})", "embed_scale");
  expect_config_error("{" + vit + R"(, "padding_idx": 0})", "padding_idx");
  expect_config_error("{" + vit + R"(, "architecture": "decoder"})", "architecture");
  // the images count against the memory limits before anything is allocated
  const auto big = ModelConfig::from_json_text(
      R"({"input": "patches", "image_size": 32, "patch_size": 8, "channels": 1, "d_model": 16,
          "num_heads": 1, "d_ff": 8})");
  try {
    validate_batch_shape(big, {index_t{1} << 23, 17}, sizeof(double));  // 2^33 pixels
    ADD_FAILURE() << "2^23 images of 32 x 32 were accepted";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("input.pixels"), std::string::npos) << e.what();
  }
}

// An encoder_decoder's keys round-trip and appear only when set; they belong to it alone, and its
// decoder's limits (positions in the embeddings, no variants, no dropout) are named errors.
TEST(Config, EncoderDecoderKeysRoundTripAndItsLimitsAreNamed) {
  ModelConfig c;
  c.architecture = Architecture::encoder_decoder;
  EXPECT_EQ(ModelConfig::from_json(c.to_json()), c);
  EXPECT_FALSE(c.to_json().contains("decoder_layers"));
  EXPECT_EQ(c.dec_layers(), c.num_layers);
  EXPECT_EQ(c.target_vocab(), c.embeddings.vocab_size);
  EXPECT_FALSE(c.attention.causal);  // the encoder's; the decoder's self-attention is always masked
  c.decoder_layers = 3;
  c.embeddings.decoder_vocab_size = 7;
  c.embeddings.decoder_positional = Positional::learned;
  c.head.tie_embeddings = true;
  EXPECT_EQ(ModelConfig::from_json(c.to_json()), c);
  EXPECT_EQ(c.target_vocab(), 7);
  EXPECT_EQ(c.dec_positional(), Positional::learned);
  for (const char* key : {"decoder_layers", "decoder_vocab_size"})
    expect_config_error(std::string(R"({")") + key + R"(": 2})", key);
  expect_config_error(R"({"decoder_positional": "learned"})", "decoder_positional");
  const std::string ed = R"({"architecture": "encoder_decoder", )";
  expect_config_error(ed + R"("decoder_positional": "rope"})", "decoder_positional");
  expect_config_error(ed + R"("decoder_layers": -1})", "decoder_layers");
  expect_config_error(ed + R"("decoder_vocab_size": 0})", "decoder_vocab_size");
  expect_config_error(ed + R"("positional": "rope"})", "positional");
  expect_config_error(ed + R"("attn_sinks": true})", "attn_sinks");
  expect_config_error(ed + R"("qk_norm": true})", "qk_norm");
  expect_config_error(ed + R"("head_dim": 4})", "head_dim");
  expect_config_error(ed + R"("layer_types": ["full_attention", "full_attention"]})",
                      "layer_types");
  expect_config_error(ed + R"("dropout": 0.1})", "dropout");
  expect_config_error(ed + R"("pooling": "max"})", "pooling");
}

TEST(Config, LearnedPositionsWithAnOffsetMustFitTheTable) {
  ModelConfig c;
  c.embeddings.positional = Positional::learned;
  c.embeddings.max_len = 10;
  c.embeddings.position_offset = 4;
  EXPECT_NO_THROW(validate_batch_shape(c, {2, 6}, 8));
  EXPECT_THROW(validate_batch_shape(c, {2, 7}, 8), ShapeError);
  c.embeddings.positional = Positional::sinusoidal;
  EXPECT_NO_THROW(validate_batch_shape(c, {2, 10}, 8));
}

TEST(Config, AbsentKeysKeepDefaults) {
  EXPECT_EQ(ModelConfig::from_json_text("{}"), ModelConfig{});
}

void expect_config_error(const std::string& text, const std::string& needle) {
  try {
    ModelConfig::from_json_text(text);
    ADD_FAILURE() << "accepted: " << text;
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message \"" << e.what() << "\" does not name \"" << needle << "\"";
  }
}

TEST(Config, RejectsUnknownKeysWrongTypesAndBadValuesWithNamedError) {
  expect_config_error(R"({"d_modle": 16})", "d_modle");
  expect_config_error(R"({"d_model": "16"})", "d_model");
  expect_config_error(R"({"d_model": 16.5})", "d_model");
  expect_config_error(R"({"num_layers": true})", "num_layers");
  expect_config_error(R"({"norm_first": 1})", "norm_first");
  expect_config_error(R"({"activation": "swish"})", "swish");
  expect_config_error(R"({"positional": "rotary"})", "rotary");
  expect_config_error(R"({"pooling": "sum"})", "sum");
  expect_config_error(R"({"d_model": 0})", "d_model");
  expect_config_error(R"({"vocab_size": -3})", "-3");
  expect_config_error(R"({"num_heads": 0})", "num_heads");
  expect_config_error(R"({"d_model": 10, "num_heads": 4})", "divisible");
  expect_config_error(R"({"num_layers": -1})", "num_layers");
  expect_config_error(R"({"layer_norm_eps": 0})", "layer_norm_eps");
  expect_config_error(R"({"layer_norm_eps": 1e-50})", "layer_norm_eps");  // 0 in float32
  expect_config_error(R"({"layer_norm_eps": 1e300})", "layer_norm_eps");  // inf in float32
  expect_config_error(R"({"dropout": 1.0})", "dropout");
  expect_config_error(R"({"dropout": -0.1})", "dropout");
  expect_config_error(R"({"label_smoothing": 1.5})", "label_smoothing");
  expect_config_error(R"({"max_len": 18446744073709551615})", "max_len");
  expect_config_error(R"([1, 2])", "object");
  expect_config_error(R"({"d_model": 16,)", "JSON");
}

TEST(Config, RejectsSizesWhoseByteCountOverflows) {
  ModelConfig c;
  c.embeddings.vocab_size = index_t{1} << 40;
  c.d_model = index_t{1} << 30;
  c.attention.num_heads = 1;
  EXPECT_THROW(c.validate(), ShapeError);
  ModelConfig ok;
  EXPECT_NO_THROW(ok.validate());
  ModelConfig huge;  // no 64-bit overflow, but 2^53 bytes of parameters
  huge.embeddings.vocab_size = index_t{1} << 46;
  EXPECT_THROW(huge.validate(), ShapeError);
}

TEST(Config, BatchShapeValidation) {
  ModelConfig c;
  EXPECT_NO_THROW(validate_batch_shape(c, {0, 1}, 8));
  EXPECT_THROW(validate_batch_shape(c, {-1, 4}, 8), ShapeError);
  EXPECT_THROW(validate_batch_shape(c, {2, 0}, 8), ShapeError);
  EXPECT_THROW(validate_batch_shape(c, {2, c.embeddings.max_len + 1}, 8), ShapeError);
  c.embeddings.max_len = index_t{1} << 40;
  EXPECT_THROW(validate_batch_shape(c, {index_t{1} << 30, index_t{1} << 30}, 8), ShapeError);
}

}  // namespace
}  // namespace teo

namespace {

// Restores the memory limits in force when it was made.
struct KeepLimits {
  teo::MemoryLimits saved = teo::memory_limits();
  ~KeepLimits() { teo::set_memory_limits(saved); }
};

TEST(MemoryLimits, OversizedRequestsGetANamedErrorBeforeAnyAllocation) {
  KeepLimits keep;
  const teo::MemoryLimits defaults = teo::memory_limits();
  EXPECT_GE(defaults.max_total_bytes, 1);
  EXPECT_EQ(defaults.max_tensor_elements, teo::index_t{1} << 32);
  teo::ModelConfig cfg;
  teo::set_memory_limits({.max_tensor_elements = 1000, .max_total_bytes = 1 << 30});
  cfg.embeddings.vocab_size = 1000;  // embedding 1000 x 16 elements
  try {
    cfg.validate();
    FAIL() << "no error";
  } catch (const teo::ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("TEO_MAX_TENSOR_ELEMENTS"), std::string::npos) << e.what();
  }
  cfg.embeddings.vocab_size = 10;
  EXPECT_NO_THROW(cfg.validate());
  try {
    teo::validate_batch_shape(cfg, {.batch = 100, .seq_len = 32}, sizeof(float));
    FAIL() << "no error";
  } catch (const teo::ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("elements"), std::string::npos) << e.what();
  }
  teo::set_memory_limits({.max_tensor_elements = 1 << 30, .max_total_bytes = 100000});
  try {
    teo::validate_batch_shape(cfg, {.batch = 100, .seq_len = 32}, sizeof(float));
    FAIL() << "no error";
  } catch (const teo::ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("TEO_MAX_BYTES"), std::string::npos) << e.what();
  }
  EXPECT_THROW(teo::Batch::random(cfg, 100, 32, 1), teo::ShapeError);
  EXPECT_THROW(teo::set_memory_limits({.max_tensor_elements = 0, .max_total_bytes = 1}),
               teo::ConfigError);
}

}  // namespace
