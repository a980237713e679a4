// Checkpoint name maps (docs/models.md): how a model family's checkpoints name teo's parameters,
// and the conversions between a checkpoint (with its config.json) and a golden's parameters.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "teo/config.hpp"
#include "teo/model.hpp"
#include "teo/safetensors.hpp"

namespace teo::names {

// One teo parameter (its name with {i} for a layer index) and where a checkpoint holds it.
struct Rule {
  std::string teo;         // "layers.{i}.attn.q.weight"
  std::string checkpoint;  // "bert.encoder.layer.{i}.attention.self.query.weight"
  // The checkpoint stores the matrix transposed (GPT-2's Conv1D keeps W^T).
  bool transpose = false;
  // A fused tensor: this parameter is slice `part` of `parts` equal slices of the checkpoint
  // tensor along dimension `dim` (taken before the transposition).
  int dim = 0, part = 0, parts = 1;
  // The parts are interleaved along `dim` (gpt-oss's gate_up_proj: gate at the even columns, up
  // at the odd ones): element c of part p is the checkpoint's c * parts + p, not p * n + c.
  bool interleave = false;
  // Absent from some checkpoints (a base model has no classifier): the golden then keeps the
  // seed's initialisation of it.
  bool optional = false;
  // The checkpoint's tensor has this many leading dimensions of size 1 that teo's has not (ViT's
  // cls_token (1, 1, D) and position_embeddings (1, S, D)); the values are the same.
  int leading_ones = 0;
};

struct NameMap {
  std::string family;       // "hf-bert"
  std::string base_prefix;  // "bert.": the base model's tensors may be saved with or without it
  std::vector<Rule> rules;
  std::vector<std::string> ignore;  // checkpoint tensors (globs) no teo parameter reads
  // config.json's mapping: {"keys": {hf key: teo key or {"key", "map", "count", "plus"}},
  // "fixed": {teo key: value}, "free": [teo keys a checkpoint does not set], "ignored": [hf
  // keys], "export": {hf key: value written by export}} (docs/models.md, "Name maps").
  nlohmann::json config;

  // A file of this format ("teo-names/1"); ConfigError naming the path and the field at fault.
  static NameMap from_json(const nlohmann::json& j, const std::string& source);
  // One of builtin_families() ("hf-bert", ...), else a map file's path.
  static NameMap load(const std::string& family_or_path);
  static std::vector<std::string> builtin_families();
};

// teo's parameters for `cfg` from a checkpoint: every parameter of the contract read from the
// tensor its rule names (with or without base_prefix; widened exactly from BF16, F16 or F32;
// a float32 case refuses F64 values float32 cannot hold), the optional ones left as `seeded`
// holds them. Before anything is converted: a missing tensor, a checkpoint tensor no rule and no
// ignore pattern covers, or a shape that disagrees with the config is a FormatError naming it.
//
// A config with quantization reads its quantized weights' packed tensors (their checkpoint names:
// quant::weight_part_name of the dense name) into `packed` under the golden's names (contract::
// packed), the experts' stacked and a fused tensor's rows split as the map says; their values in
// the result are the seed's, for the caller to dequantize.
template <class Real>
Params<Real> params_from_checkpoint(
    const safetensors::File& checkpoint, const NameMap& map, const ModelConfig& cfg,
    Params<Real> seeded, std::map<std::string, std::vector<unsigned char>>* packed = nullptr);

// A case's or config's JSON with its quantization's targets the weights the checkpoint stores
// packed, when config.json's quantization_config (which reads as every linear weight of the
// layers) leaves some of them dense (gpt-oss quantizes its experts only); the JSON as it is when
// it has no quantization or names its targets. FormatError when the checkpoint packs none.
nlohmann::json with_checkpoint_targets(const safetensors::File& checkpoint, const NameMap& map,
                                       nlohmann::json config);

// The teo config keys a checkpoint's config.json gives under `map` (its "fixed" keys, then each
// mapped key); ConfigError naming an hf key the map neither maps nor ignores, or a value it
// cannot express.
nlohmann::json config_from_hf(const nlohmann::json& hf, const NameMap& map);
// config.json for `cfg` under `map` (its "export" keys and each mapped key); ConfigError naming
// a teo key whose value the family cannot express.
nlohmann::json hf_config_of(const ModelConfig& cfg, const NameMap& map);

// A golden's parameters (param.*) under the checkpoint's names, fused and transposed as the map
// says, in the golden's dtype: what the family's loader reads.
safetensors::File checkpoint_of(const safetensors::File& golden, const NameMap& map);

// The candidate with every tensor "grad.<checkpoint name>" (or "param." for "grad.") renamed to
// teo's "grad.<name>", split and transposed back as the map says; other tensors as they are.
safetensors::File candidate_in_teo_names(const safetensors::File& candidate, const NameMap& map,
                                         const ModelConfig& cfg);

}  // namespace teo::names
