// Internal: the mixture-of-experts keys of ModelConfig (config_moe.cpp), which config_json.cpp
// (their JSON) and config.cpp (their validation and sizes) call.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "teo/config.hpp"

namespace teo::detail {

// Reads `key` into m when it is one of MoeConfig's keys, and says whether it was; ConfigError
// naming the key for a wrong type or value.
bool read_moe_key(MoeConfig& m, const std::string& key, const nlohmann::json& v);
// MoeConfig's keys, for the suggestion when a key is misspelled.
const std::vector<std::string>& moe_keys();
// Writes the MoE keys of c (ffn "moe" only; the group keys only with router_groups > 1).
void moe_to_json(const ModelConfig& c, nlohmann::json& j);
// ConfigError naming the first invalid MoE key, or an MoE key set without ffn "moe".
void validate_moe(const ModelConfig& c);
// The parameters of all MoE layers together; ShapeError when a count overflows 64 bits or an
// expert tensor has more elements than the limit.
index_t moe_param_count(const ModelConfig& c);
// The values one MoE layer's forward keeps for `tokens` tokens (0 without ffn "moe").
index_t moe_activation_values(const ModelConfig& c, index_t tokens);

}  // namespace teo::detail
