#include "teo/train/options.hpp"

#include <algorithm>
#include <cmath>

#include "teo/files.hpp"

namespace teo::train {

namespace {

using nlohmann::json;

index_t get_int(const json& v, const std::string& key) {
  if (!v.is_number_integer()) throw ConfigError(key + " must be an integer, got " + v.dump());
  if (v.is_number_unsigned() && v.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX)) {
    throw ConfigError(key + " is too large: " + v.dump());
  }
  return v.get<index_t>();
}

double get_real(const json& v, const std::string& key) {
  if (!v.is_number()) throw ConfigError(key + " must be a number, got " + v.dump());
  const double d = v.get<double>();
  if (!std::isfinite(d)) throw ConfigError(key + " must be finite");
  return d;
}

std::string get_string(const json& v, const std::string& key) {
  if (!v.is_string()) throw ConfigError(key + " must be a string, got " + v.dump());
  return v.get<std::string>();
}

}  // namespace

const std::vector<TrainKey>& train_keys() {
  static const std::vector<TrainKey> keys = {
      {"architecture", "string",
       "encoder (classify each word's language) | decoder (a character language model)"},
      {"max_len", "int", "longest input in tokens, [CLS] included; longer words are cut"},
      {"d_model", "int", "model width"},
      {"num_heads", "int", "attention heads"},
      {"d_ff", "int", "feed-forward width"},
      {"num_layers", "int", "encoder layers"},
      {"norm_first", "bool", "pre-norm (true) or post-norm (false)"},
      {"activation", "string", "relu | gelu | gelu_tanh | silu"},
      {"layer_norm_eps", "real", "LayerNorm epsilon"},
      {"positional", "string", "sinusoidal | learned | none | rope | alibi"},
      {"num_kv_heads", "int", "K/V heads for grouped-query attention (1: multi-query)"},
      {"head_dim", "int", "each head's width (default d_model / num_heads)"},
      {"rope_style", "string", "neox | interleaved (positional rope)"},
      {"rotary_dim", "int", "dimensions of each head RoPE rotates (positional rope)"},
      {"rope_base", "real", "RoPE base (positional rope)"},
      {"alibi_max_bias", "real", "ALiBi maximum bias (positional alibi)"},
      {"position_offset", "int", "first position of every sequence"},
      {"sliding_window", "int", "keys each query sees, itself included"},
      {"attn_logit_softcap", "real", "attention logits become c tanh(s / c)"},
      {"attn_sinks", "bool", "a learned sink logit per head"},
      {"qk_norm", "bool", "q and k RMS-normalised per head before RoPE (Qwen3)"},
      {"kv_lora_rank", "int", "multi-head latent attention: k and v from a latent this wide"},
      {"q_lora_rank", "int", "latent attention's q from a latent this wide (default: from x)"},
      {"qk_nope_head_dim", "int", "latent attention: each head's q and k width without RoPE"},
      {"qk_rope_head_dim", "int", "latent attention: each head's rotated width (shared key)"},
      {"v_head_dim", "int", "latent attention: each head's v width"},
      {"norm", "string", "layernorm | rmsnorm"},
      {"ffn", "string", "mlp | swiglu | geglu"},
      {"ffn_bias", "bool", "the FFN's linear maps have biases"},
      {"attn_bias", "bool", "the attention projections have biases"},
      {"attn_out_bias", "bool", "the output projection has a bias (unset: attn_bias)"},
      {"head_bias", "bool", "the head has a bias"},
      {"tie_embeddings", "bool", "a decoder's LM head is the embedding matrix"},
      {"embed_scale", "bool", "scale token embeddings by sqrt(d_model)"},
      {"pooling", "string", "mean | cls | max (an encoder's)"},
      {"dropout", "real", "dropout probability at every site"},
      {"label_smoothing", "real", "label smoothing of the cross-entropy"},
      {"causal", "bool", "causal attention mask"},
      {"dtype", "string", "float32 | float64"},
      {"epochs", "int", "passes over the training set"},
      {"max_steps", "int", "stop after this many optimizer steps (0: no limit)"},
      {"batch_size", "int", "words per micro-batch"},
      {"accum_steps", "int", "micro-batches accumulated per optimizer step"},
      {"shards", "int",
       "parts of each micro-batch computed in parallel and summed in a fixed order (the result "
       "does not depend on --threads)"},
      {"eval_batch", "int", "words per evaluation batch"},
      {"ema", "real",
       "decay of the averaged weights used for evaluation, checkpoints' predictions and the "
       "test (0: evaluate the last weights)"},
      {"lr", "real", "peak learning rate"},
      {"warmup_steps", "int", "linear warmup steps, then inverse-sqrt decay"},
      {"weight_decay", "real", "AdamW decoupled weight decay (matrices only)"},
      {"beta1", "real", "AdamW beta1"},
      {"beta2", "real", "AdamW beta2"},
      {"adam_eps", "real", "AdamW epsilon"},
      {"clip_norm", "real", "clip gradients to this global L2 norm (0: off)"},
      {"seed", "int", "initialisation, shuffling and dropout seed"},
      {"per_language", "int", "words kept per language (class balance)"},
      {"data_dir", "string", "directory holding the word lists"},
  };
  return keys;
}

std::string flag_name(const TrainKey& key) {
  std::string flag = std::string("--") + key.key;
  std::replace(flag.begin(), flag.end(), '_', '-');
  return flag;
}

std::string help_text(const TrainKey& key, const TrainOptions& defaults) {
  const json all = defaults.all_keys();
  std::string help = std::string(key.help) + " [" + key.type;
  if (const auto it = all.find(key.key); it != all.end()) {
    help += ", default " + (it->is_string() ? it->get<std::string>() : it->dump());
  }
  return help + "]";
}

json parse_flag_value(const TrainKey& key, const std::string& text) {
  const std::string flag = flag_name(key);
  const std::string type = key.type;
  try {
    std::size_t used = 0;
    if (type == "int") {
      const long long v = std::stoll(text, &used);
      if (used == text.size()) return v;
    } else if (type == "real") {
      const double v = std::stod(text, &used);
      if (used == text.size()) return v;
    } else if (type == "bool") {
      if (text == "true" || text == "1") return true;
      if (text == "false" || text == "0") return false;
    } else {
      return text;
    }
  } catch (const std::exception&) {
  }
  throw ConfigError(flag + " takes " +
                    (type == "int"    ? "an integer"
                     : type == "real" ? "a number"
                                      : "true or false") +
                    ", got \"" + text + "\"");
}

json TrainOptions::all_keys() const {
  json j = model.to_json();
  j.update(to_json());
  return j;
}

json TrainOptions::read_keys(const std::string& path) {
  json j = read_json_file(path);
  if (!j.is_object()) throw ConfigError(path + ": not a JSON object");
  return j;
}

void TrainOptions::apply_json(const json& j) {
  if (!j.is_object()) throw ConfigError("a training config must be a JSON object");
  json mj = model.to_json();
  for (const auto& [key, v] : j.items()) {
    if (key == "vocab_size" || key == "num_classes") {
      throw ConfigError(key + " is decided by the data and cannot be set");
    } else if (key == "dtype") {
      dtype = get_string(v, key);
    } else if (key == "epochs") {
      epochs = get_int(v, key);
    } else if (key == "max_steps") {
      max_steps = get_int(v, key);
    } else if (key == "batch_size") {
      batch_size = get_int(v, key);
    } else if (key == "accum_steps") {
      accum_steps = get_int(v, key);
    } else if (key == "shards") {
      shards = get_int(v, key);
    } else if (key == "eval_batch") {
      eval_batch = get_int(v, key);
    } else if (key == "ema") {
      ema = get_real(v, key);
    } else if (key == "lr") {
      optim.lr = get_real(v, key);
    } else if (key == "warmup_steps") {
      optim.warmup_steps = get_int(v, key);
    } else if (key == "weight_decay") {
      optim.weight_decay = get_real(v, key);
    } else if (key == "beta1") {
      optim.beta1 = get_real(v, key);
    } else if (key == "beta2") {
      optim.beta2 = get_real(v, key);
    } else if (key == "adam_eps") {
      optim.adam_eps = get_real(v, key);
    } else if (key == "clip_norm") {
      optim.clip_norm = get_real(v, key);
    } else if (key == "seed") {
      // A flag's value arrives as a signed integer, a JSON file's as unsigned.
      const bool ok =
          v.is_number_unsigned() || (v.is_number_integer() && v.get<std::int64_t>() >= 0);
      if (!ok) throw ConfigError("seed must be a non-negative integer, got " + v.dump());
      seed = v.get<std::uint64_t>();
    } else if (key == "per_language") {
      data.per_language = get_int(v, key);
    } else if (key == "data_dir") {
      data.dir = get_string(v, key);
    } else {
      mj[key] = v;  // ModelConfig rejects unknown keys and bad values
    }
  }
  // A decoder is causal unless the user said otherwise (which ModelConfig refuses); it has no
  // classifier, so the encoder's causal, pooling and num_classes do not carry over.
  const std::string architecture = ModelConfig::architecture_of(mj);
  if (architecture == "decoder") {
    if (!j.contains("causal")) mj["causal"] = true;
    if (!j.contains("pooling")) mj.erase("pooling");
    mj.erase("num_classes");
  }
  if (architecture == "encoder_decoder") {
    throw ConfigError(
        "teo train trains architecture \"encoder\" or \"decoder\"; an encoder_decoder has no "
        "training demo (its goldens and teo.run cover it)");
  }
  model = ModelConfig::from_json(mj);
}

json TrainOptions::to_json() const {
  return json{{"dtype", dtype},
              {"epochs", epochs},
              {"max_steps", max_steps},
              {"batch_size", batch_size},
              {"accum_steps", accum_steps},
              {"shards", shards},
              {"eval_batch", eval_batch},
              {"ema", ema},
              {"lr", optim.lr},
              {"warmup_steps", optim.warmup_steps},
              {"weight_decay", optim.weight_decay},
              {"beta1", optim.beta1},
              {"beta2", optim.beta2},
              {"adam_eps", optim.adam_eps},
              {"clip_norm", optim.clip_norm},
              {"seed", seed},
              {"per_language", data.per_language},
              {"data_dir", data.dir}};
}

void TrainOptions::validate() const {
  auto need = [](bool ok, const std::string& what) {
    if (!ok) throw ConfigError(what);
  };
  need(dtype == "float32" || dtype == "float64", "dtype must be float32 or float64, got " + dtype);
  need(epochs >= 1 && epochs <= 100000,
       "epochs must be in [1, 100000], got " + std::to_string(epochs));
  need(max_steps >= 0, "max_steps must be >= 0, got " + std::to_string(max_steps));
  need(batch_size >= 1 && batch_size <= 65536,
       "batch_size must be in [1, 65536], got " + std::to_string(batch_size));
  need(accum_steps >= 1 && accum_steps <= 1024,
       "accum_steps must be in [1, 1024], got " + std::to_string(accum_steps));
  need(shards >= 1 && shards <= 256, "shards must be in [1, 256], got " + std::to_string(shards));
  need(ema >= 0 && ema < 1, "ema must be in [0, 1), got " + std::to_string(ema));
  need(eval_batch >= 1 && eval_batch <= 65536,
       "eval_batch must be in [1, 65536], got " + std::to_string(eval_batch));
  need(optim.lr > 0 && optim.lr < 10, "lr must be in (0, 10)");
  need(optim.warmup_steps >= 1, "warmup_steps must be >= 1");
  need(optim.weight_decay >= 0 && optim.weight_decay < 1, "weight_decay must be in [0, 1)");
  need(optim.beta1 >= 0 && optim.beta1 < 1, "beta1 must be in [0, 1)");
  need(optim.beta2 >= 0 && optim.beta2 < 1, "beta2 must be in [0, 1)");
  need(optim.adam_eps > 0, "adam_eps must be > 0");
  need(optim.clip_norm >= 0, "clip_norm must be >= 0");
  need(data.per_language >= 10 && data.per_language <= 10'000'000,
       "per_language must be in [10, 10000000]");
  need(model.embeddings.max_len >= 3, "max_len must be at least 3 ([CLS], one character, [SEP])");
  need(!model.encoder_decoder(),
       "teo train trains architecture \"encoder\" or \"decoder\"; an encoder_decoder has no "
       "training demo (its goldens and teo.run cover it)");
  need(!model.embeddings.type_vocab_size,
       "teo train's data has one segment per sentence: type_vocab_size (token types) has no "
       "training demo (embedding_norm and pooler train)");
  need(!model.patches_input(),
       "teo train's data is text: input \"patches\" (images) has no training demo (its goldens "
       "and teo.run cover it)");
  model.validate();
}
}  // namespace teo::train
