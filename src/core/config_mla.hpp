// Internal: the multi-head latent attention keys of ModelConfig (config_mla.cpp), which
// config_json.cpp (their JSON) and config.cpp (their validation and sizes) call.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "teo/config.hpp"

namespace teo::detail {

// Reads `key` into a when it is one of the MLA keys, and says whether it was; ConfigError naming
// the key for a wrong type.
bool read_mla_key(AttentionConfig& a, const std::string& key, const nlohmann::json& v);
// The MLA keys, for the suggestion when a key is misspelled.
const std::vector<std::string>& mla_keys();
// Writes the MLA keys of c (kv_lora_rank set only).
void mla_to_json(const ModelConfig& c, nlohmann::json& j);
// ConfigError naming the first invalid MLA key, or an MLA key set without kv_lora_rank.
void validate_mla(const ModelConfig& c);
// The MLA projections' parameters of all layers together (0 without MLA); ShapeError on overflow.
index_t mla_param_count(const ModelConfig& c);
// The values one MLA layer's forward keeps beyond q, k, v for `tokens` tokens (0 without MLA).
index_t mla_activation_values(const ModelConfig& c, index_t tokens);

}  // namespace teo::detail
