// A model case: its JSON (the config keys plus "case"), read with every key checked, written back
// with every default spelled out, and the batch it runs on.
#include <algorithm>
#include <cstdint>

#include <nlohmann/json.hpp>

#include "golden/golden_internal.hpp"
#include "teo/contract.hpp"
#include "teo/files.hpp"
#include "teo/golden.hpp"

namespace teo::golden {

namespace {

using nlohmann::json;

std::int64_t case_int(const json& v, const std::string& key) {
  if (!v.is_number_integer()) {
    throw ConfigError("case." + key + " must be an integer, got " + v.dump());
  }
  if (v.is_number_unsigned() && v.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX)) {
    throw ConfigError("case." + key + " is too large: " + v.dump());
  }
  return v.get<std::int64_t>();
}

}  // namespace

Case Case::from_file(const std::string& path) {
  const json j = read_json_file(path);
  try {
    return from_json(j);
  } catch (const ConfigError& e) {
    throw ConfigError(path + ": " + e.what());
  } catch (const ShapeError& e) {
    throw ShapeError(path + ": " + e.what());
  }
}

Case Case::from_json(const json& j) {
  if (!j.is_object()) throw ConfigError("a case file must be a JSON object");
  if (!j.contains("case")) throw ConfigError("the case file has no \"case\" object");
  json cfg_json = j;
  cfg_json.erase("case");
  Case c;
  c.config = ModelConfig::from_json(cfg_json);
  const json& cj = j.at("case");
  if (!cj.is_object()) throw ConfigError("\"case\" must be an object");
  bool have_batch = false, have_seq = false, have_dtype = false, have_seed = false;
  for (const auto& [key, v] : cj.items()) {
    if (key == "batch") {
      c.batch = case_int(v, key);
      have_batch = true;
    } else if (key == "seq_len") {
      c.seq_len = case_int(v, key);
      have_seq = true;
    } else if (key == "lengths") {
      if (!v.is_array()) throw ConfigError("case.lengths must be an array, got " + v.dump());
      c.lengths.clear();
      for (const auto& x : v) c.lengths.push_back(case_int(x, "lengths[]"));
    } else if (key == "dtype") {
      if (!v.is_string() || (v != "float32" && v != "float64")) {
        throw ConfigError("case.dtype must be \"float32\" or \"float64\", got " + v.dump());
      }
      c.dtype = v.get<std::string>();
      have_dtype = true;
    } else if (key == "precision") {
      if (!v.is_string()) throw ConfigError("case.precision must be a string, got " + v.dump());
      c.precision = parse_precision(v.get<std::string>(), "case.precision");
    } else if (key == "seed") {
      if (!v.is_number_unsigned()) {
        throw ConfigError("case.seed must be a non-negative integer, got " + v.dump());
      }
      c.seed = v.get<std::uint64_t>();
      have_seed = true;
    } else if (key == "tgt_len") {
      c.tgt_len = case_int(v, key);
    } else if (key == "tgt_lengths") {
      if (!v.is_array()) throw ConfigError("case.tgt_lengths must be an array, got " + v.dump());
      c.tgt_lengths.clear();
      for (const auto& x : v) c.tgt_lengths.push_back(case_int(x, "tgt_lengths[]"));
    } else if (key == "replay_routing") {
      if (!v.is_boolean()) throw ConfigError("case.replay_routing must be true or false");
      c.replay_routing = v.get<bool>();
      if (c.replay_routing && !c.config.moe())
        throw ConfigError("case.replay_routing needs ffn \"moe\": a dense model routes nothing");
    } else if (key == "drawn_norms") {
      if (!v.is_boolean()) throw ConfigError("case.drawn_norms must be true or false");
      c.drawn_norms = v.get<bool>();
    } else if (key == "generate") {
      if (!v.is_object()) throw ConfigError("case.generate must be an object, got " + v.dump());
      for (const auto& [gk, gv] : v.items()) {
        if (gk != "steps") {
          throw ConfigError("case.generate has the unknown key \"" + gk +
                            "\" (it takes \"steps\"; the prompts are the case's lengths)");
        }
        c.steps = case_int(gv, "generate.steps");
      }
      if (!v.contains("steps")) throw ConfigError("case.generate needs \"steps\"");
      if (c.steps < 1) {
        throw ConfigError("case.generate.steps must be at least 1, got " + std::to_string(c.steps));
      }
    } else if (std::ranges::find(detail::fp8_keys(), key) == detail::fp8_keys().end()) {
      // the fp8 keys are read below
      if (key == "fp8_outlier") {
        throw ConfigError(
            "case.fp8_outlier is an op case's key: a model case's activations come from its "
            "embeddings, with no outlier channels drawn (docs/fp8.md)");
      }
      throw ConfigError("case has the unknown key \"" + key + "\"");
    }
  }
  if (c.config.patches_input()) {
    // the sequence is [CLS] and the patches; an image has no padding
    const index_t S = 1 + c.config.patches();
    if (have_seq && c.seq_len != S) {
      throw ShapeError("case.seq_len " + std::to_string(c.seq_len) + " is not 1 + patches = " +
                       std::to_string(S) + " (input \"patches\"; it may be left out)");
    }
    c.seq_len = S;
    have_seq = true;
    for (auto len : c.lengths) {
      if (len != S) {
        throw ShapeError("case.lengths has " + std::to_string(len) +
                         ": an image has no padding, every length is " + std::to_string(S));
      }
    }
  }
  if (!have_batch || !have_seq || !have_dtype || !have_seed) {
    throw ConfigError("case needs batch, seq_len, dtype and seed");
  }
  if (c.precision && (c.dtype != "float32" || *c.precision == Precision::fp32 ||
                      *c.precision == Precision::fp64)) {
    throw ConfigError("case.precision must be tf32, bf16, fp16 or fp8, in a float32 case");
  }
  if (detail::read_fp8_keys(cj, c.fp8, "case") && c.precision != Precision::fp8) {
    throw ConfigError("case: the fp8_* keys need \"precision\": \"fp8\" (docs/fp8.md)");
  }
  if (c.fp8.delayed) {
    throw ConfigError(
        "case.fp8_scales: delayed scales are inputs of the linear op case only (docs/fp8.md); "
        "a model case computes its scales");
  }
  if (c.config.quantization) {
    // a precision rounds the parameters, and a quantized weight's values are its packing's
    if (c.precision) {
      throw ConfigError("case.precision: a quantized model (quantization." +
                        c.config.quantization->format.name() +
                        ") computes with its weights' exact values, in full precision only");
    }
    (void)contract::quantized(c.config);  // every target packs (ConfigError naming it)
  }
  const std::size_t real = c.dtype == "float32" ? sizeof(float) : sizeof(double);
  if (c.config.encoder_decoder()) {
    if (c.tgt_len == 0) throw ConfigError("an encoder_decoder's case needs tgt_len (its target)");
    if (c.precision) {
      throw ConfigError("case.precision: an encoder_decoder runs in full precision only");
    }
    if (!c.tgt_lengths.empty() && static_cast<index_t>(c.tgt_lengths.size()) != c.batch) {
      throw ShapeError("case.tgt_lengths has " + std::to_string(c.tgt_lengths.size()) +
                       " entries for batch " + std::to_string(c.batch));
    }
    for (auto len : c.tgt_lengths) {
      if (len < 0 || len > c.tgt_len) {
        throw ShapeError("case.tgt_lengths has " + std::to_string(len) + ", outside [0, tgt_len " +
                         std::to_string(c.tgt_len) + "]");
      }
    }
  } else if (c.tgt_len != 0 || !c.tgt_lengths.empty()) {
    throw ConfigError(
        "case.tgt_len and tgt_lengths apply only to architecture \"encoder_decoder\"");
  }
  validate_batch_shape(c.config, {c.batch, c.seq_len, c.tgt_len}, real);
  if (!c.lengths.empty() && static_cast<index_t>(c.lengths.size()) != c.batch) {
    throw ShapeError("case.lengths has " + std::to_string(c.lengths.size()) +
                     " entries for batch " + std::to_string(c.batch));
  }
  for (auto len : c.lengths) {
    if (len < 0 || len > c.seq_len) {
      throw ShapeError("case.lengths has " + std::to_string(len) + ", outside [0, seq_len " +
                       std::to_string(c.seq_len) + "]");
    }
  }
  if (c.steps > 0) {
    if (!c.config.decoder())
      throw ConfigError("case.generate needs a decoder (architecture \"decoder\")");
    const index_t longest =
        c.lengths.empty() ? c.seq_len : *std::max_element(c.lengths.begin(), c.lengths.end());
    if (c.steps > c.config.embeddings.max_len - longest) {
      throw ShapeError("case.generate.steps " + std::to_string(c.steps) +
                       " after a prompt of length " + std::to_string(longest) +
                       " runs past max_len " + std::to_string(c.config.embeddings.max_len));
    }
  }
  return c;
}

json Case::case_json() const {
  std::vector<std::int64_t> lens =
      lengths.empty() ? std::vector<std::int64_t>(static_cast<std::size_t>(batch), seq_len)
                      : lengths;
  json j = json::object();
  j["batch"] = batch;
  j["seq_len"] = seq_len;
  j["lengths"] = lens;
  j["dtype"] = dtype;
  j["seed"] = seed;
  if (precision) j["precision"] = to_string(*precision);
  if (precision == Precision::fp8) detail::write_fp8_keys(j, fp8);
  if (steps > 0) j["generate"] = {{"steps", steps}};
  if (replay_routing) j["replay_routing"] = true;
  if (drawn_norms) j["drawn_norms"] = true;
  if (config.encoder_decoder()) {
    j["tgt_len"] = tgt_len;
    j["tgt_lengths"] = tgt_lengths.empty()
                           ? std::vector<std::int64_t>(static_cast<std::size_t>(batch), tgt_len)
                           : tgt_lengths;
  }
  return j;
}

Batch Case::make_batch() const {
  if (config.encoder_decoder())
    return Batch::random_seq2seq(config, batch, seq_len, tgt_len, seed, lengths, tgt_lengths);
  return Batch::random(config, batch, seq_len, seed, lengths);
}

}  // namespace teo::golden
