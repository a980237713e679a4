// ModelConfig's JSON I/O: from_json (every key read, typed and named), to_json (the keys in
// use), and the file and text readers. Validation lives in config.cpp.
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/config_mla.hpp"
#include "core/config_moe.hpp"
#include "core/json_get.hpp"
#include "teo/config.hpp"
#include "teo/suggest.hpp"

namespace teo {

namespace {

using detail::get_bool;
using detail::get_int;
using detail::get_real;
using detail::get_string;

// rope_scaling: {"type": ..., "factor": ..., "original_max_len": ..., "beta_fast": ...,
// "beta_slow": ..., "truncate": ...}.
RopeScaling rope_scaling_from_json(const nlohmann::json& j) {
  if (!j.is_object()) {
    throw ConfigError("rope_scaling must be an object, got " + std::string(j.type_name()) + " " +
                      j.dump());
  }
  RopeScaling s;
  bool typed = false;
  for (const auto& [key, v] : j.items()) {
    const std::string k = "rope_scaling." + key;
    if (key == "type") {
      const std::string t = get_string(v, k);
      typed = true;
      if (t == "none")
        s.type = RopeScalingType::none;
      else if (t == "linear")
        s.type = RopeScalingType::linear;
      else if (t == "ntk")
        s.type = RopeScalingType::ntk;
      else if (t == "yarn")
        s.type = RopeScalingType::yarn;
      else
        throw ConfigError(
            "rope_scaling.type must be \"none\", \"linear\", \"ntk\" or \"yarn\", got \"" + t +
            "\"");
    } else if (key == "factor") {
      s.factor = get_real(v, k);
    } else if (key == "original_max_len") {
      s.original_max_len = get_int(v, k);
    } else if (key == "beta_fast") {
      s.beta_fast = get_real(v, k);
    } else if (key == "beta_slow") {
      s.beta_slow = get_real(v, k);
    } else if (key == "truncate") {
      s.truncate = get_bool(v, k);
    } else if (key == "mscale") {
      s.mscale = get_real(v, k);
    } else if (key == "mscale_all_dim") {
      s.mscale_all_dim = get_real(v, k);
    } else {
      throw ConfigError("unknown rope_scaling key \"" + key + "\"");
    }
  }
  if (!typed) throw ConfigError("rope_scaling needs a \"type\"");
  return s;
}

nlohmann::json rope_scaling_to_json(const RopeScaling& s) {
  nlohmann::json j{{"type", to_string(s.type)}};
  if (s.type == RopeScalingType::none) return j;
  j["factor"] = s.factor;
  if (s.original_max_len) j["original_max_len"] = *s.original_max_len;
  if (s.type == RopeScalingType::yarn) {
    j["beta_fast"] = s.beta_fast;
    j["beta_slow"] = s.beta_slow;
    if (!s.truncate) j["truncate"] = false;
    if (s.mscale) j["mscale"] = *s.mscale;
    if (s.mscale_all_dim) j["mscale_all_dim"] = *s.mscale_all_dim;
  }
  return j;
}

// quantization: {"weight_format": ..., "group_size": ..., "act_order": ..., "zero_offset": ...,
// "targets": [globs]}, the keys of its format only (as an op case's spec takes them).
QuantizationConfig read_quantization(const nlohmann::json& j) {
  if (!j.is_object()) {
    throw ConfigError("quantization must be an object, got " + std::string(j.type_name()) + " " +
                      j.dump());
  }
  if (!j.contains("weight_format")) throw ConfigError("quantization needs a \"weight_format\"");
  QuantizationConfig q;
  q.format =
      quant::parse_weight_format(get_string(j.at("weight_format"), "quantization.weight_format"),
                                 "quantization.weight_format");
  const bool gptq = q.format.kind == quant::WeightFormat::Kind::tensor &&
                    q.format.tensor == quant::TensorFormat::gptq;
  for (const auto& [key, v] : j.items()) {
    const std::string k = "quantization." + key;
    const auto only = [&](bool ok, const char* formats) {
      if (!ok)
        throw ConfigError(k + " applies to a weight_format of " + formats + ", not " +
                          q.format.name());
    };
    if (key == "weight_format") {
      continue;
    } else if (key == "group_size") {
      only(q.format.grouped(), "gptq or awq");
      q.format.group_size = get_int(v, k);
      if (q.format.group_size < 1) throw ConfigError(k + " must be at least 1, got " + v.dump());
    } else if (key == "act_order") {
      only(gptq, "gptq");
      q.format.act_order = get_bool(v, k);
    } else if (key == "zero_offset") {
      only(gptq, "gptq");
      const index_t z = get_int(v, k);
      if (z != 0 && z != 1)
        throw ConfigError(k + " must be 1 (a v1 gptq checkpoint) or 0 (gptq_v2), got " + v.dump());
      q.format.zero_offset = static_cast<int>(z);
    } else if (key == "targets") {
      if (!v.is_array() || v.empty())
        throw ConfigError(k + " must be a non-empty array of globs over teo's parameter names");
      for (const auto& g : v) q.targets.push_back(get_string(g, k));
    } else {
      throw ConfigError("unknown quantization key \"" + key +
                        "\" (weight_format, group_size, act_order, zero_offset, targets)");
    }
  }
  return q;
}

nlohmann::json quantization_json(const QuantizationConfig& q) {
  nlohmann::json j{{"weight_format", q.format.name()}};
  if (q.format.grouped()) j["group_size"] = q.format.group_size;
  if (q.format.kind == quant::WeightFormat::Kind::tensor &&
      q.format.tensor == quant::TensorFormat::gptq) {
    j["act_order"] = q.format.act_order;
    j["zero_offset"] = q.format.zero_offset;
  }
  if (!q.targets.empty()) j["targets"] = q.targets;
  return j;
}

}  // namespace

namespace {
// Every key from_json reads, for the suggestion when a key is misspelled.
const char* const kConfigKeys[] = {"vocab_size",
                                   "max_len",
                                   "d_model",
                                   "num_heads",
                                   "d_ff",
                                   "num_layers",
                                   "num_classes",
                                   "norm_first",
                                   "embed_scale",
                                   "causal",
                                   "layer_norm_eps",
                                   "dropout",
                                   "label_smoothing",
                                   "activation",
                                   "positional",
                                   "pooling",
                                   "num_kv_heads",
                                   "head_dim",
                                   "rope_style",
                                   "rotary_dim",
                                   "rope_base",
                                   "rope_scaling",
                                   "alibi_max_bias",
                                   "position_offset",
                                   "sliding_window",
                                   "layer_types",
                                   "attn_logit_softcap",
                                   "attn_sinks",
                                   "qk_norm",
                                   "norm",
                                   "ffn",
                                   "ffn_bias",
                                   "attn_bias",
                                   "attn_out_bias",
                                   "head_bias",
                                   "architecture",
                                   "tie_embeddings",
                                   "decoder_layers",
                                   "decoder_vocab_size",
                                   "decoder_positional",
                                   "type_vocab_size",
                                   "embedding_norm",
                                   "pooler",
                                   "padding_idx",
                                   "input",
                                   "image_size",
                                   "patch_size",
                                   "channels",
                                   "quantization"};
}  // namespace

std::string ModelConfig::architecture_of(const nlohmann::json& j) {
  const auto it = j.find("architecture");
  return it != j.end() && it->is_string() ? it->get<std::string>() : "encoder";
}

ModelConfig ModelConfig::from_json(const nlohmann::json& j) {
  if (!j.is_object()) {
    throw ConfigError("config must be a JSON object, got " + std::string(j.type_name()));
  }
  ModelConfig c;
  for (const auto& [key, v] : j.items()) {
    if (key == "vocab_size")
      c.embeddings.vocab_size = get_int(v, key);
    else if (key == "max_len")
      c.embeddings.max_len = get_int(v, key);
    else if (key == "d_model")
      c.d_model = get_int(v, key);
    else if (key == "num_heads")
      c.attention.num_heads = get_int(v, key);
    else if (key == "d_ff")
      c.ffn.d_ff = get_int(v, key);
    else if (key == "num_layers")
      c.num_layers = get_int(v, key);
    else if (key == "num_classes")
      c.head.num_classes = get_int(v, key);
    else if (key == "norm_first")
      c.norms.norm_first = get_bool(v, key);
    else if (key == "embed_scale")
      c.embeddings.embed_scale = get_bool(v, key);
    else if (key == "causal")
      c.attention.causal = get_bool(v, key);
    else if (key == "layer_norm_eps")
      c.norms.layer_norm_eps = get_real(v, key);
    else if (key == "dropout")
      c.dropout = get_real(v, key);
    else if (key == "label_smoothing")
      c.head.label_smoothing = get_real(v, key);
    else if (key == "activation") {
      const std::string s = get_string(v, key);
      if (s == "relu")
        c.ffn.activation = Activation::relu;
      else if (s == "gelu")
        c.ffn.activation = Activation::gelu;
      else if (s == "gelu_tanh")
        c.ffn.activation = Activation::gelu_tanh;
      else if (s == "silu")
        c.ffn.activation = Activation::silu;
      else
        throw ConfigError(
            "activation must be \"relu\", \"gelu\", \"gelu_tanh\" or \"silu\", got \"" + s + "\"");
    } else if (key == "positional") {
      const std::string s = get_string(v, key);
      if (s == "sinusoidal")
        c.embeddings.positional = Positional::sinusoidal;
      else if (s == "learned")
        c.embeddings.positional = Positional::learned;
      else if (s == "none")
        c.embeddings.positional = Positional::none;
      else if (s == "rope")
        c.embeddings.positional = Positional::rope;
      else if (s == "alibi")
        c.embeddings.positional = Positional::alibi;
      else
        throw ConfigError(
            "positional must be \"sinusoidal\", \"learned\", \"none\", \"rope\" or \"alibi\", "
            "got \"" +
            s + "\"");
    } else if (key == "pooling") {
      const std::string s = get_string(v, key);
      if (s == "mean")
        c.head.pooling = Pooling::mean;
      else if (s == "cls")
        c.head.pooling = Pooling::cls;
      else if (s == "max")
        c.head.pooling = Pooling::max;
      else
        throw ConfigError("pooling must be \"mean\", \"cls\" or \"max\", got \"" + s + "\"");
    } else if (key == "num_kv_heads") {
      c.attention.num_kv_heads = get_int(v, key);
    } else if (key == "rope_style") {
      const std::string s = get_string(v, key);
      if (s == "neox")
        c.attention.rope_style = RopeStyle::neox;
      else if (s == "interleaved")
        c.attention.rope_style = RopeStyle::interleaved;
      else
        throw ConfigError("rope_style must be \"neox\" or \"interleaved\", got \"" + s + "\"");
    } else if (key == "rotary_dim") {
      c.attention.rotary_dim = get_int(v, key);
    } else if (key == "rope_base") {
      c.attention.rope_base = get_real(v, key);
    } else if (key == "rope_scaling") {
      c.attention.rope_scaling = rope_scaling_from_json(v);
    } else if (key == "alibi_max_bias") {
      c.attention.alibi_max_bias = get_real(v, key);
    } else if (key == "position_offset") {
      c.embeddings.position_offset = get_int(v, key);
    } else if (key == "sliding_window") {
      if (v.is_null())
        c.attention.sliding_window.reset();
      else
        c.attention.sliding_window = get_int(v, key);
    } else if (key == "layer_types") {
      if (!v.is_array()) throw ConfigError("layer_types must be an array, got " + v.dump());
      c.attention.layer_types.clear();
      for (const auto& t : v) {
        const std::string s = get_string(t, "layer_types[]");
        if (s == "sliding_attention")
          c.attention.layer_types.push_back(LayerAttention::sliding);
        else if (s == "full_attention")
          c.attention.layer_types.push_back(LayerAttention::full);
        else
          throw ConfigError(
              "layer_types[] must be \"sliding_attention\" or \"full_attention\", got \"" + s +
              "\"");
      }
    } else if (key == "attn_logit_softcap") {
      if (v.is_null())
        c.attention.attn_logit_softcap.reset();
      else
        c.attention.attn_logit_softcap = get_real(v, key);
    } else if (key == "attn_sinks") {
      c.attention.attn_sinks = get_bool(v, key);
    } else if (key == "qk_norm") {
      c.attention.qk_norm = get_bool(v, key);
    } else if (key == "head_dim") {
      if (v.is_null())
        c.attention.head_dim.reset();
      else
        c.attention.head_dim = get_int(v, key);
    } else if (key == "norm") {
      const std::string s = get_string(v, key);
      if (s == "layernorm")
        c.norms.norm = Norm::layernorm;
      else if (s == "rmsnorm")
        c.norms.norm = Norm::rmsnorm;
      else
        throw ConfigError("norm must be \"layernorm\" or \"rmsnorm\", got \"" + s + "\"");
    } else if (key == "ffn") {
      const std::string s = get_string(v, key);
      if (s == "mlp")
        c.ffn.kind = FfnKind::mlp;
      else if (s == "swiglu")
        c.ffn.kind = FfnKind::swiglu;
      else if (s == "geglu")
        c.ffn.kind = FfnKind::geglu;
      else if (s == "moe")
        c.ffn.kind = FfnKind::moe;
      else
        throw ConfigError("ffn must be \"mlp\", \"swiglu\", \"geglu\" or \"moe\", got \"" + s +
                          "\"");
    } else if (key == "ffn_bias") {
      c.ffn.ffn_bias = get_bool(v, key);
    } else if (key == "attn_bias") {
      c.attention.attn_bias = get_bool(v, key);
    } else if (key == "attn_out_bias") {
      c.attention.attn_out_bias = get_bool(v, key);
    } else if (key == "head_bias") {
      c.head.head_bias = get_bool(v, key);
    } else if (key == "architecture") {
      const std::string s = get_string(v, key);
      if (s == "encoder")
        c.architecture = Architecture::encoder;
      else if (s == "decoder")
        c.architecture = Architecture::decoder;
      else if (s == "encoder_decoder")
        c.architecture = Architecture::encoder_decoder;
      else
        throw ConfigError(
            "architecture must be \"encoder\", \"decoder\" or \"encoder_decoder\", got \"" + s +
            "\"");
    } else if (key == "tie_embeddings") {
      c.head.tie_embeddings = get_bool(v, key);
    } else if (key == "decoder_layers") {
      c.decoder_layers = get_int(v, key);
    } else if (key == "decoder_vocab_size") {
      c.embeddings.decoder_vocab_size = get_int(v, key);
    } else if (key == "type_vocab_size") {
      c.embeddings.type_vocab_size = get_int(v, key);
    } else if (key == "padding_idx") {
      if (!v.is_null()) c.embeddings.padding_idx = get_int(v, key);
    } else if (key == "embedding_norm") {
      c.embeddings.embedding_norm = get_bool(v, key);
    } else if (key == "pooler") {
      const std::string s = get_string(v, key);
      if (s == "none")
        c.head.pooler = Pooler::none;
      else if (s == "dense_tanh")
        c.head.pooler = Pooler::dense_tanh;
      else
        throw ConfigError("pooler must be \"none\" or \"dense_tanh\", got \"" + s + "\"");
    } else if (key == "input") {
      const std::string s = get_string(v, key);
      if (s == "tokens")
        c.embeddings.input = InputKind::tokens;
      else if (s == "patches")
        c.embeddings.input = InputKind::patches;
      else
        throw ConfigError("input must be \"tokens\" or \"patches\", got \"" + s + "\"");
    } else if (key == "image_size") {
      c.embeddings.image_size = get_int(v, key);
    } else if (key == "patch_size") {
      c.embeddings.patch_size = get_int(v, key);
    } else if (key == "channels") {
      c.embeddings.channels = get_int(v, key);
    } else if (key == "decoder_positional") {
      const std::string s = get_string(v, key);
      if (s == "sinusoidal")
        c.embeddings.decoder_positional = Positional::sinusoidal;
      else if (s == "learned")
        c.embeddings.decoder_positional = Positional::learned;
      else if (s == "none")
        c.embeddings.decoder_positional = Positional::none;
      else
        throw ConfigError(
            "decoder_positional must be \"sinusoidal\", \"learned\" or \"none\", got \"" + s +
            "\"");
    } else if (key == "quantization") {
      c.quantization = read_quantization(v);
    } else if (detail::read_mla_key(c.attention, key, v) ||
               detail::read_moe_key(c.ffn.moe, key, v)) {
      // a latent attention key (config_mla.cpp) or a mixture of experts' (config_moe.cpp)
    } else {
      std::vector<std::string> keys(std::begin(kConfigKeys), std::end(kConfigKeys));
      keys.insert(keys.end(), detail::moe_keys().begin(), detail::moe_keys().end());
      keys.insert(keys.end(), detail::mla_keys().begin(), detail::mla_keys().end());
      throw ConfigError("unknown config key \"" + key + "\"" + did_you_mean(key, keys));
    }
  }
  // A decoder is causal unless the config says otherwise (which validate() refuses).
  if (c.decoder() && !j.contains("causal")) c.attention.causal = true;
  if (c.patches_input()) {
    // images have no token ids; the sequence length follows from the sizes
    if (j.contains("vocab_size"))
      throw ConfigError(
          "vocab_size applies only to input \"tokens\": input \"patches\" has no ids");
    if (!j.contains("max_len") && c.patches() > 0) c.embeddings.max_len = 1 + c.patches();
  }
  // SwiGLU's gate is silu: an activation that says otherwise is refused by name, and one left out
  // is silu, so that a written spec says what the gate computes
  if (c.ffn.kind == FfnKind::swiglu || c.moe()) {
    if (j.contains("activation") && c.ffn.activation != Activation::silu) {
      throw ConfigError(std::string("ffn \"") + to_string(c.ffn.kind) +
                        "\" gates with silu: activation must be left out or \"silu\", got \"" +
                        to_string(c.ffn.activation) + "\"");
    }
    c.ffn.activation = Activation::silu;
  }
  c.validate();
  return c;
}

ModelConfig ModelConfig::from_json_text(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    // parse_error, and out_of_range for a number beyond double's range
    throw ConfigError(std::string("config is not valid JSON: ") + e.what());
  }
  return from_json(j);
}

ModelConfig ModelConfig::from_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError("cannot open config file \"" + path + "\"");
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return from_json_text(ss.str());
  } catch (const ConfigError& e) {
    throw ConfigError(path + ": " + e.what());
  }
}

nlohmann::json ModelConfig::to_json() const {
  nlohmann::json j{{"vocab_size", embeddings.vocab_size},
                   {"max_len", embeddings.max_len},
                   {"d_model", d_model},
                   {"num_heads", attention.num_heads},
                   {"d_ff", ffn.d_ff},
                   {"num_layers", num_layers},
                   {"norm_first", norms.norm_first},
                   // SwiGLU gates with silu, whatever a C++ caller left in `activation`
                   {"activation", to_string(ffn.kind == FfnKind::swiglu || moe() ? Activation::silu
                                                                                 : ffn.activation)},
                   {"layer_norm_eps", norms.layer_norm_eps},
                   {"positional", to_string(embeddings.positional)},
                   {"embed_scale", embeddings.embed_scale},
                   {"pooling", to_string(head.pooling)},
                   {"num_classes", head.num_classes},
                   {"dropout", dropout},
                   {"label_smoothing", head.label_smoothing},
                   {"causal", attention.causal}};
  if (lm()) {
    j["architecture"] = to_string(architecture);
    j.erase("pooling");
    j.erase("num_classes");
  }
  if (decoder_layers) j["decoder_layers"] = *decoder_layers;
  if (embeddings.decoder_vocab_size) j["decoder_vocab_size"] = *embeddings.decoder_vocab_size;
  if (embeddings.decoder_positional)
    j["decoder_positional"] = to_string(*embeddings.decoder_positional);
  // The variants' keys appear only when they are in use, so a plain config reads as before.
  if (attention.num_kv_heads) j["num_kv_heads"] = *attention.num_kv_heads;
  if (attention.head_dim) j["head_dim"] = *attention.head_dim;
  if (embeddings.positional == Positional::rope) {
    j["rope_style"] = to_string(attention.rope_style);
    if (attention.rotary_dim) j["rotary_dim"] = *attention.rotary_dim;
    j["rope_base"] = attention.rope_base;
    j["rope_scaling"] = rope_scaling_to_json(attention.rope_scaling);
  }
  if (embeddings.positional == Positional::alibi) j["alibi_max_bias"] = attention.alibi_max_bias;
  if (embeddings.position_offset != 0) j["position_offset"] = embeddings.position_offset;
  if (attention.sliding_window) j["sliding_window"] = *attention.sliding_window;
  if (!attention.layer_types.empty()) {
    nlohmann::json t = nlohmann::json::array();
    for (LayerAttention a : attention.layer_types) t.push_back(to_string(a));
    j["layer_types"] = t;
  }
  if (attention.attn_logit_softcap) j["attn_logit_softcap"] = *attention.attn_logit_softcap;
  if (attention.attn_sinks) j["attn_sinks"] = true;
  if (attention.qk_norm) j["qk_norm"] = true;
  detail::mla_to_json(*this, j);
  if (norms.norm != Norm::layernorm) j["norm"] = to_string(norms.norm);
  if (ffn.kind != FfnKind::mlp) j["ffn"] = to_string(ffn.kind);
  if (!ffn.ffn_bias) j["ffn_bias"] = false;
  detail::moe_to_json(*this, j);
  if (quantization) j["quantization"] = quantization_json(*quantization);
  if (!attention.attn_bias) j["attn_bias"] = false;
  if (attention.attn_out_bias) j["attn_out_bias"] = *attention.attn_out_bias;
  if (!head.head_bias) j["head_bias"] = false;
  if (head.tie_embeddings) j["tie_embeddings"] = true;
  if (embeddings.type_vocab_size) j["type_vocab_size"] = *embeddings.type_vocab_size;
  if (embeddings.embedding_norm) j["embedding_norm"] = true;
  if (head.pooler != Pooler::none) j["pooler"] = to_string(head.pooler);
  if (embeddings.padding_idx) j["padding_idx"] = *embeddings.padding_idx;
  if (patches_input()) {
    j.erase("vocab_size");
    j["input"] = to_string(embeddings.input);
    j["image_size"] = embeddings.image_size;
    j["patch_size"] = embeddings.patch_size;
    j["channels"] = embeddings.channels;
  }
  return j;
}

}  // namespace teo
