// EncoderConfig's JSON I/O: from_json (every key read, typed and named), to_json (the keys in
// use), and the file and text readers. Validation lives in config.cpp.
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "teo/config.hpp"
#include "teo/suggest.hpp"

namespace teo {

namespace {
index_t get_int(const nlohmann::json& v, const std::string& key) {
  if (v.is_number_integer()) {
    if (v.is_number_unsigned() &&
        v.get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<index_t>::max())) {
      throw ConfigError(key + " is out of the 64-bit signed range: " + v.dump());
    }
    return v.get<index_t>();
  }
  throw ConfigError(key + " must be an integer, got " + std::string(v.type_name()) + " " +
                    v.dump());
}

double get_real(const nlohmann::json& v, const std::string& key) {
  if (!v.is_number()) {
    throw ConfigError(key + " must be a number, got " + std::string(v.type_name()) + " " +
                      v.dump());
  }
  return v.get<double>();
}

bool get_bool(const nlohmann::json& v, const std::string& key) {
  if (!v.is_boolean()) {
    throw ConfigError(key + " must be true or false, got " + std::string(v.type_name()) + " " +
                      v.dump());
  }
  return v.get<bool>();
}

std::string get_string(const nlohmann::json& v, const std::string& key) {
  if (!v.is_string()) {
    throw ConfigError(key + " must be a string, got " + std::string(v.type_name()) + " " +
                      v.dump());
  }
  return v.get<std::string>();
}

// rope_scaling: {"type": ..., "factor": ..., "original_max_len": ..., "beta_fast": ...,
// "beta_slow": ...}.
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
  }
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
                                   "rope_style",
                                   "rotary_dim",
                                   "rope_base",
                                   "rope_scaling",
                                   "alibi_max_bias",
                                   "position_offset",
                                   "sliding_window",
                                   "attn_logit_softcap",
                                   "attn_sinks",
                                   "norm",
                                   "ffn",
                                   "ffn_bias",
                                   "attn_bias",
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
                                   "channels"};
}  // namespace

std::string EncoderConfig::architecture_of(const nlohmann::json& j) {
  const auto it = j.find("architecture");
  return it != j.end() && it->is_string() ? it->get<std::string>() : "encoder";
}

EncoderConfig EncoderConfig::from_json(const nlohmann::json& j) {
  if (!j.is_object()) {
    throw ConfigError("config must be a JSON object, got " + std::string(j.type_name()));
  }
  EncoderConfig c;
  for (const auto& [key, v] : j.items()) {
    if (key == "vocab_size")
      c.vocab_size = get_int(v, key);
    else if (key == "max_len")
      c.max_len = get_int(v, key);
    else if (key == "d_model")
      c.d_model = get_int(v, key);
    else if (key == "num_heads")
      c.num_heads = get_int(v, key);
    else if (key == "d_ff")
      c.d_ff = get_int(v, key);
    else if (key == "num_layers")
      c.num_layers = get_int(v, key);
    else if (key == "num_classes")
      c.num_classes = get_int(v, key);
    else if (key == "norm_first")
      c.norm_first = get_bool(v, key);
    else if (key == "embed_scale")
      c.embed_scale = get_bool(v, key);
    else if (key == "causal")
      c.causal = get_bool(v, key);
    else if (key == "layer_norm_eps")
      c.layer_norm_eps = get_real(v, key);
    else if (key == "dropout")
      c.dropout = get_real(v, key);
    else if (key == "label_smoothing")
      c.label_smoothing = get_real(v, key);
    else if (key == "activation") {
      const std::string s = get_string(v, key);
      if (s == "relu")
        c.activation = Activation::relu;
      else if (s == "gelu")
        c.activation = Activation::gelu;
      else if (s == "gelu_tanh")
        c.activation = Activation::gelu_tanh;
      else if (s == "silu")
        c.activation = Activation::silu;
      else
        throw ConfigError(
            "activation must be \"relu\", \"gelu\", \"gelu_tanh\" or \"silu\", got \"" + s + "\"");
    } else if (key == "positional") {
      const std::string s = get_string(v, key);
      if (s == "sinusoidal")
        c.positional = Positional::sinusoidal;
      else if (s == "learned")
        c.positional = Positional::learned;
      else if (s == "none")
        c.positional = Positional::none;
      else if (s == "rope")
        c.positional = Positional::rope;
      else if (s == "alibi")
        c.positional = Positional::alibi;
      else
        throw ConfigError(
            "positional must be \"sinusoidal\", \"learned\", \"none\", \"rope\" or \"alibi\", "
            "got \"" +
            s + "\"");
    } else if (key == "pooling") {
      const std::string s = get_string(v, key);
      if (s == "mean")
        c.pooling = Pooling::mean;
      else if (s == "cls")
        c.pooling = Pooling::cls;
      else if (s == "max")
        c.pooling = Pooling::max;
      else
        throw ConfigError("pooling must be \"mean\", \"cls\" or \"max\", got \"" + s + "\"");
    } else if (key == "num_kv_heads") {
      c.num_kv_heads = get_int(v, key);
    } else if (key == "rope_style") {
      const std::string s = get_string(v, key);
      if (s == "neox")
        c.rope_style = RopeStyle::neox;
      else if (s == "interleaved")
        c.rope_style = RopeStyle::interleaved;
      else
        throw ConfigError("rope_style must be \"neox\" or \"interleaved\", got \"" + s + "\"");
    } else if (key == "rotary_dim") {
      c.rotary_dim = get_int(v, key);
    } else if (key == "rope_base") {
      c.rope_base = get_real(v, key);
    } else if (key == "rope_scaling") {
      c.rope_scaling = rope_scaling_from_json(v);
    } else if (key == "alibi_max_bias") {
      c.alibi_max_bias = get_real(v, key);
    } else if (key == "position_offset") {
      c.position_offset = get_int(v, key);
    } else if (key == "sliding_window") {
      if (v.is_null())
        c.sliding_window.reset();
      else
        c.sliding_window = get_int(v, key);
    } else if (key == "attn_logit_softcap") {
      if (v.is_null())
        c.attn_logit_softcap.reset();
      else
        c.attn_logit_softcap = get_real(v, key);
    } else if (key == "attn_sinks") {
      c.attn_sinks = get_bool(v, key);
    } else if (key == "norm") {
      const std::string s = get_string(v, key);
      if (s == "layernorm")
        c.norm = Norm::layernorm;
      else if (s == "rmsnorm")
        c.norm = Norm::rmsnorm;
      else
        throw ConfigError("norm must be \"layernorm\" or \"rmsnorm\", got \"" + s + "\"");
    } else if (key == "ffn") {
      const std::string s = get_string(v, key);
      if (s == "mlp")
        c.ffn = FfnKind::mlp;
      else if (s == "swiglu")
        c.ffn = FfnKind::swiglu;
      else if (s == "geglu")
        c.ffn = FfnKind::geglu;
      else
        throw ConfigError("ffn must be \"mlp\", \"swiglu\" or \"geglu\", got \"" + s + "\"");
    } else if (key == "ffn_bias") {
      c.ffn_bias = get_bool(v, key);
    } else if (key == "attn_bias") {
      c.attn_bias = get_bool(v, key);
    } else if (key == "head_bias") {
      c.head_bias = get_bool(v, key);
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
      c.tie_embeddings = get_bool(v, key);
    } else if (key == "decoder_layers") {
      c.decoder_layers = get_int(v, key);
    } else if (key == "decoder_vocab_size") {
      c.decoder_vocab_size = get_int(v, key);
    } else if (key == "type_vocab_size") {
      c.type_vocab_size = get_int(v, key);
    } else if (key == "padding_idx") {
      if (!v.is_null()) c.padding_idx = get_int(v, key);
    } else if (key == "embedding_norm") {
      c.embedding_norm = get_bool(v, key);
    } else if (key == "pooler") {
      const std::string s = get_string(v, key);
      if (s == "none")
        c.pooler = Pooler::none;
      else if (s == "dense_tanh")
        c.pooler = Pooler::dense_tanh;
      else
        throw ConfigError("pooler must be \"none\" or \"dense_tanh\", got \"" + s + "\"");
    } else if (key == "input") {
      const std::string s = get_string(v, key);
      if (s == "tokens")
        c.input = InputKind::tokens;
      else if (s == "patches")
        c.input = InputKind::patches;
      else
        throw ConfigError("input must be \"tokens\" or \"patches\", got \"" + s + "\"");
    } else if (key == "image_size") {
      c.image_size = get_int(v, key);
    } else if (key == "patch_size") {
      c.patch_size = get_int(v, key);
    } else if (key == "channels") {
      c.channels = get_int(v, key);
    } else if (key == "decoder_positional") {
      const std::string s = get_string(v, key);
      if (s == "sinusoidal")
        c.decoder_positional = Positional::sinusoidal;
      else if (s == "learned")
        c.decoder_positional = Positional::learned;
      else if (s == "none")
        c.decoder_positional = Positional::none;
      else
        throw ConfigError(
            "decoder_positional must be \"sinusoidal\", \"learned\" or \"none\", got \"" + s +
            "\"");
    } else {
      const std::vector<std::string> keys(std::begin(kConfigKeys), std::end(kConfigKeys));
      throw ConfigError("unknown config key \"" + key + "\"" + did_you_mean(key, keys));
    }
  }
  // A decoder is causal unless the config says otherwise (which validate() refuses).
  if (c.decoder() && !j.contains("causal")) c.causal = true;
  if (c.patches_input()) {
    // images have no token ids; the sequence length follows from the sizes
    if (j.contains("vocab_size"))
      throw ConfigError(
          "vocab_size applies only to input \"tokens\": input \"patches\" has no ids");
    if (!j.contains("max_len") && c.patches() > 0) c.max_len = 1 + c.patches();
  }
  // SwiGLU's gate is silu: an activation that says otherwise is refused by name, and one left out
  // is silu, so that a written spec says what the gate computes
  if (c.ffn == FfnKind::swiglu) {
    if (j.contains("activation") && c.activation != Activation::silu) {
      throw ConfigError(std::string("ffn \"swiglu\" gates with silu: activation must be left out "
                                    "or \"silu\", got \"") +
                        to_string(c.activation) + "\"");
    }
    c.activation = Activation::silu;
  }
  c.validate();
  return c;
}

EncoderConfig EncoderConfig::from_json_text(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    // parse_error, and out_of_range for a number beyond double's range
    throw ConfigError(std::string("config is not valid JSON: ") + e.what());
  }
  return from_json(j);
}

EncoderConfig EncoderConfig::from_file(const std::string& path) {
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

nlohmann::json EncoderConfig::to_json() const {
  nlohmann::json j{
      {"vocab_size", vocab_size},
      {"max_len", max_len},
      {"d_model", d_model},
      {"num_heads", num_heads},
      {"d_ff", d_ff},
      {"num_layers", num_layers},
      {"norm_first", norm_first},
      // SwiGLU gates with silu, whatever a C++ caller left in `activation`
      {"activation", to_string(ffn == FfnKind::swiglu ? Activation::silu : activation)},
      {"layer_norm_eps", layer_norm_eps},
      {"positional", to_string(positional)},
      {"embed_scale", embed_scale},
      {"pooling", to_string(pooling)},
      {"num_classes", num_classes},
      {"dropout", dropout},
      {"label_smoothing", label_smoothing},
      {"causal", causal}};
  if (lm()) {
    j["architecture"] = to_string(architecture);
    j.erase("pooling");
    j.erase("num_classes");
  }
  if (decoder_layers) j["decoder_layers"] = *decoder_layers;
  if (decoder_vocab_size) j["decoder_vocab_size"] = *decoder_vocab_size;
  if (decoder_positional) j["decoder_positional"] = to_string(*decoder_positional);
  // The variants' keys appear only when they are in use, so a plain config reads as before.
  if (num_kv_heads) j["num_kv_heads"] = *num_kv_heads;
  if (positional == Positional::rope) {
    j["rope_style"] = to_string(rope_style);
    if (rotary_dim) j["rotary_dim"] = *rotary_dim;
    j["rope_base"] = rope_base;
    j["rope_scaling"] = rope_scaling_to_json(rope_scaling);
  }
  if (positional == Positional::alibi) j["alibi_max_bias"] = alibi_max_bias;
  if (position_offset != 0) j["position_offset"] = position_offset;
  if (sliding_window) j["sliding_window"] = *sliding_window;
  if (attn_logit_softcap) j["attn_logit_softcap"] = *attn_logit_softcap;
  if (attn_sinks) j["attn_sinks"] = true;
  if (norm != Norm::layernorm) j["norm"] = to_string(norm);
  if (ffn != FfnKind::mlp) j["ffn"] = to_string(ffn);
  if (!ffn_bias) j["ffn_bias"] = false;
  if (!attn_bias) j["attn_bias"] = false;
  if (!head_bias) j["head_bias"] = false;
  if (tie_embeddings) j["tie_embeddings"] = true;
  if (type_vocab_size) j["type_vocab_size"] = *type_vocab_size;
  if (embedding_norm) j["embedding_norm"] = true;
  if (pooler != Pooler::none) j["pooler"] = to_string(pooler);
  if (padding_idx) j["padding_idx"] = *padding_idx;
  if (patches_input()) {
    j.erase("vocab_size");
    j["input"] = to_string(input);
    j["image_size"] = image_size;
    j["patch_size"] = patch_size;
    j["channels"] = channels;
  }
  return j;
}

}  // namespace teo
