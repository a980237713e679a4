// The fp8 recipe's keys in an op spec or a model case (docs/fp8.md, "Emulated passes").
#include <cmath>
#include <string>

#include "golden/golden_internal.hpp"
#include "teo/errors.hpp"
#include "teo/fp8.hpp"

namespace teo::golden::detail {

namespace {

index_t int_key(const nlohmann::json& v, const std::string& name, index_t min, index_t max) {
  if (!v.is_number_integer() || v.get<std::int64_t>() < min || v.get<std::int64_t>() > max) {
    throw ConfigError(name + " must be an integer from " + std::to_string(min) + " to " +
                      std::to_string(max) + ", got " + v.dump());
  }
  return v.get<std::int64_t>();
}

std::string string_key(const nlohmann::json& v, const std::string& name) {
  if (!v.is_string()) throw ConfigError(name + " must be a string, got " + v.dump());
  return v.get<std::string>();
}

bool bool_key(const nlohmann::json& v, const std::string& name) {
  if (!v.is_boolean()) throw ConfigError(name + " must be true or false, got " + v.dump());
  return v.get<bool>();
}

}  // namespace

const std::vector<std::string>& fp8_keys() {
  static const std::vector<std::string> keys = {
      "fp8_format",     "fp8_scaling",       "fp8_block_k",       "fp8_weight_block",
      "fp8_accumulate", "fp8_mantissa_bits", "fp8_promote_every", "fp8_saturate",
      "fp8_attention",  "fp8_scales"};
  return keys;
}

bool read_fp8_keys(const nlohmann::json& j, Fp8Recipe& r, const std::string& where) {
  bool any = false;
  for (const auto& key : fp8_keys()) {
    if (!j.contains(key)) continue;
    any = true;
    const auto& v = j.at(key);
    const std::string name = where + "." + key;
    if (key == "fp8_format") {
      set_fp8_format(r, string_key(v, name), name);
    } else if (key == "fp8_scaling") {
      r.scaling = parse_fp8_scaling(string_key(v, name), name);
    } else if (key == "fp8_block_k") {
      r.block_k = int_key(v, name, 1, 1 << 20);
    } else if (key == "fp8_weight_block") {
      r.weight_block = int_key(v, name, 1, 1 << 20);
    } else if (key == "fp8_accumulate") {
      const std::string a = string_key(v, name);
      if (a != "fp32" && a != "limited") {
        throw ConfigError(name + " must be fp32 or limited, got \"" + a + "\"");
      }
      r.accumulate.limited = a == "limited";
    } else if (key == "fp8_mantissa_bits") {
      r.accumulate.mantissa_bits = static_cast<int>(int_key(v, name, 1, 23));
    } else if (key == "fp8_promote_every") {
      r.accumulate.promote_every = int_key(v, name, 0, 1 << 30);
    } else if (key == "fp8_saturate") {
      r.saturate = bool_key(v, name);
    } else if (key == "fp8_attention") {
      r.attention = bool_key(v, name);
    } else if (key == "fp8_scales") {
      const std::string a = string_key(v, name);
      if (a != "current" && a != "delayed") {
        throw ConfigError(name + " must be current or delayed, got \"" + a + "\"");
      }
      r.delayed = a == "delayed";
    }
  }
  validate(r, where);
  return any;
}

template <class Json>
void write_fp8_keys(Json& j, const Fp8Recipe& r) {
  j["fp8_format"] = fp8_format_name(r);
  j["fp8_scaling"] = to_string(r.scaling);
  j["fp8_block_k"] = r.block_k;
  j["fp8_weight_block"] = r.weight_block;
  j["fp8_accumulate"] = r.accumulate.limited ? "limited" : "fp32";
  j["fp8_mantissa_bits"] = r.accumulate.mantissa_bits;
  j["fp8_promote_every"] = r.accumulate.promote_every;
  j["fp8_saturate"] = r.saturate;
  if (r.attention) j["fp8_attention"] = true;  // absent: attention's products in bf16
  if (r.delayed) j["fp8_scales"] = "delayed";  // absent: current scaling
}
template void write_fp8_keys(nlohmann::json&, const Fp8Recipe&);
template void write_fp8_keys(nlohmann::ordered_json&, const Fp8Recipe&);

}  // namespace teo::golden::detail
