// Internal: the typed readers of a config's JSON values, each naming its key in the ConfigError
// (config_json.cpp, config_moe.cpp).
#pragma once

#include <cstdint>
#include <limits>
#include <string>

#include <nlohmann/json.hpp>

#include "teo/errors.hpp"

namespace teo::detail {

inline index_t get_int(const nlohmann::json& v, const std::string& key) {
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

inline double get_real(const nlohmann::json& v, const std::string& key) {
  if (!v.is_number()) {
    throw ConfigError(key + " must be a number, got " + std::string(v.type_name()) + " " +
                      v.dump());
  }
  return v.get<double>();
}

inline bool get_bool(const nlohmann::json& v, const std::string& key) {
  if (!v.is_boolean()) {
    throw ConfigError(key + " must be true or false, got " + std::string(v.type_name()) + " " +
                      v.dump());
  }
  return v.get<bool>();
}

inline std::string get_string(const nlohmann::json& v, const std::string& key) {
  if (!v.is_string()) {
    throw ConfigError(key + " must be a string, got " + std::string(v.type_name()) + " " +
                      v.dump());
  }
  return v.get<std::string>();
}

}  // namespace teo::detail
