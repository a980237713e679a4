// Reading an op spec key by key (golden/ops/op.hpp's Reader): sizes, flags, lengths, numbers,
// choices and the model-config keys, each error naming its key.
#include <algorithm>
#include <cmath>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "golden/ops/op.hpp"
#include "teo/suggest.hpp"

namespace teo::golden::ops {

index_t Reader::size(const char* key, index_t min) {
  used_.insert(key);
  if (!j_.contains(key)) missing(key);
  const json& v = j_.at(key);
  if (!v.is_number_integer()) {
    throw ConfigError(std::string("spec.") + key + " must be an integer, got " + v.dump());
  }
  const auto x = v.get<std::int64_t>();
  if ((v.is_number_unsigned() && v.get<std::uint64_t>() > static_cast<std::uint64_t>(kMaxDim)) ||
      x < min || x > kMaxDim) {
    throw ConfigError(std::string("spec.") + key + " must be an integer in [" +
                      std::to_string(min) + ", 2^31], got " + v.dump());
  }
  return x;
}

bool Reader::flag(const char* key, bool def) {
  used_.insert(key);
  if (!j_.contains(key)) return def;
  if (!j_.at(key).is_boolean()) {
    throw ConfigError(std::string("spec.") + key + " must be true or false, got " +
                      j_.at(key).dump());
  }
  return j_.at(key).get<bool>();
}

std::vector<std::int64_t> Reader::prefix_lengths(const char* key, index_t n, index_t max,
                                                 std::optional<std::pair<index_t, index_t>>& full) {
  used_.insert(key);
  if (!j_.contains(key)) {
    full = std::pair{n, max};
    return {};
  }
  const json& v = j_.at(key);
  if (!v.is_array()) throw ConfigError(std::string("spec.") + key + " must be an array");
  if (static_cast<index_t>(v.size()) != n) {
    throw ShapeError(std::string("spec.") + key + " has " + std::to_string(v.size()) +
                     " entries for " + std::to_string(n));
  }
  std::vector<std::int64_t> out;
  for (const auto& x : v) {
    if (!x.is_number_integer()) {
      throw ConfigError(std::string("spec.") + key + " must hold integers, got " + x.dump());
    }
    if (x.get<std::int64_t>() < 0 || x.get<std::int64_t>() > max ||
        (x.is_number_unsigned() && x.get<std::uint64_t>() > static_cast<std::uint64_t>(max))) {
      throw ShapeError(std::string("spec.") + key + " has " + x.dump() + ", outside [0, " +
                       std::to_string(max) + "]");
    }
    out.push_back(x.get<std::int64_t>());
  }
  return out;
}

std::optional<double> Reader::number(const char* key) {
  used_.insert(key);
  if (!j_.contains(key) || j_.at(key).is_null()) return std::nullopt;
  const json& v = j_.at(key);
  // Bounded, so that scale * (q . k) stays finite in float for any Dh the spec allows.
  if (!v.is_number() || !(v.get<double>() > 0) || !(v.get<double>() <= 1e4)) {
    throw ConfigError(std::string("spec.") + key + " must be a number in (0, 1e4], got " +
                      v.dump());
  }
  return v.get<double>();
}

ModelConfig Reader::config(const std::vector<const char*>& keys, const json& base) {
  json sub = base;
  for (const char* k : keys) {
    used_.insert(k);
    if (j_.contains(k)) sub[k] = j_.at(k);
  }
  try {
    return ModelConfig::from_json(sub);
  } catch (const ConfigError& e) {
    throw ConfigError(std::string("spec: ") + e.what());
  }
}

ModelConfig Reader::op_config() {
  if (!def_) throw std::logic_error("Reader::op_config before for_op");
  ModelConfig c = config(def_->config_keys, def_->base_config);
  // the layer ops take a dense FFN; a mixture of experts is the moe op's
  if (c.moe())
    throw ConfigError(std::string("spec.ffn \"moe\" is the moe op's; the ") + def_->name +
                      " op takes \"mlp\", \"swiglu\" or \"geglu\"");
  return c;
}

Lengths Reader::lengths(const char* key, index_t n, index_t max) {
  Lengths l;
  l.values = prefix_lengths(key, n, max, l.full);
  return l;
}

std::string Reader::choice(const char* key, const std::vector<std::string>& options,
                           const std::string& def) {
  used_.insert(key);
  if (!j_.contains(key)) return def;
  const json& v = j_.at(key);
  std::string all;
  for (const auto& o : options) all += (all.empty() ? "\"" : ", \"") + o + "\"";
  if (v.is_string()) {
    for (const auto& o : options)
      if (v.get<std::string>() == o) return o;
    throw ConfigError(std::string("spec.") + key + " must be one of " + all + ", got " + v.dump() +
                      did_you_mean(v.get<std::string>(), options));
  }
  throw ConfigError(std::string("spec.") + key + " must be one of " + all + ", got " + v.dump());
}

void Reader::missing(const char* key) const {
  // a key of the spec the op does not know may be the one misspelled
  std::set<std::string> known;
  if (def_) {
    for (auto& k : op_spec_keys(def_->name)) known.insert(std::move(k));
  }
  std::vector<std::string> unread;
  for (const auto& [k, v] : j_.items())
    if (!used_.contains(k) && !known.contains(k)) unread.push_back(k);
  const std::string near = closest_match(key, unread);
  throw ConfigError(std::string("the spec needs \"") + key + "\"" +
                    (near.empty() ? "" : " (it has \"" + near + "\": is that it?)"));
}

void Reader::finish() const {
  // the keys the op read, less those the spec already holds: what a stray key may misspell
  std::vector<std::string> known;
  for (const auto& k : used_)
    if (!j_.contains(k)) known.push_back(k);
  for (const auto& [key, v] : j_.items()) {
    if (!used_.contains(key)) {
      throw ConfigError("the spec has the unknown key \"" + key + "\"" + did_you_mean(key, known));
    }
  }
}

}  // namespace teo::golden::ops
