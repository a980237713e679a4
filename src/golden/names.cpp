// Checkpoint name maps: reading them, and moving parameters and configs between a family's
// checkpoint and teo's names (include/teo/names.hpp, docs/models.md).
#include "teo/names.hpp"

#include "golden/names_internal.hpp"

#include <fnmatch.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <regex>
#include <set>

#include "teo/contract.hpp"
#include "teo/files.hpp"
#include "teo/suggest.hpp"
#include "teo/tensor.hpp"

namespace teo::names {

// The built-in maps, src/golden/names/*.json as the build embeds them.
const std::vector<std::pair<std::string, std::string>>& builtin_maps();

namespace st = safetensors;
using nlohmann::json;

namespace detail {

std::string need_string(const json& j, const std::string& what) {
  if (!j.is_string()) throw ConfigError(what + " must be a string, got " + j.dump());
  return j.get<std::string>();
}

// "layers.3.attn.q.weight" -> {"layers.{i}.attn.q.weight", "3"}; other names as they are.
std::pair<std::string, std::string> generic(const std::string& name) {
  static const std::regex layer(R"(^((?:decoder\.)?layers\.)(\d+)(\..*)$)");
  std::smatch m;
  if (std::regex_match(name, m, layer)) return {m[1].str() + "{i}" + m[3].str(), m[2].str()};
  return {name, ""};
}

std::string with_index(std::string pattern, const std::string& i, const char* field = "{i}") {
  const auto at = pattern.find(field);
  if (at != std::string::npos) pattern.replace(at, 3, i);
  return pattern;
}

std::vector<Placed> place(const NameMap& map, const ModelConfig& cfg) {
  std::map<std::string, const Rule*> by_teo;
  for (const auto& r : map.rules) by_teo[r.teo] = &r;
  std::vector<Placed> out;
  for (const auto& spec : contract::params(cfg)) {
    const auto [pattern, i] = generic(spec.name);
    const auto it = by_teo.find(pattern);
    if (it == by_teo.end()) {
      throw ConfigError("name map " + map.family + " has no rule for teo's parameter " + spec.name +
                        ": this config is not a " + map.family + " model");
    }
    const std::string checkpoint = with_index(it->second->checkpoint, i);
    // "{e}": a checkpoint tensor per expert, each the parameter's slice e along dimension 0
    const bool per_expert = checkpoint.find("{e}") != std::string::npos;
    if (per_expert && spec.shape.size() < 2) {
      throw ConfigError("name map " + map.family + " reads " + spec.name +
                        " per expert ({e}), but it is not a stack of the experts' tensors");
    }
    const std::vector<std::int64_t> slice(spec.shape.begin() + (per_expert ? 1 : 0),
                                          spec.shape.end());
    // checkpoint_index moves matrices and vectors, and a stack of matrices (three dimensions) as
    // matrix after matrix; a transposed or split tensor of more dimensions is refused
    const bool moved = it->second->transpose || it->second->parts > 1;
    if (slice.size() > 3 && moved) {
      throw ConfigError("name map " + map.family + " transposes or splits " + spec.name +
                        ", which has " + std::to_string(slice.size()) +
                        " dimensions: only a matrix, a vector or a stack of matrices can be");
    }
    // a stack (gpt-oss's experts (E, D, 2F), read whole) splits each matrix along dim
    const std::size_t matrix_dims = slice.size() == 3 && moved ? 2 : slice.size();
    if (static_cast<std::size_t>(it->second->dim) >= matrix_dims) {
      throw ConfigError("name map " + map.family + " splits " + spec.name + " along dimension " +
                        std::to_string(it->second->dim) + ", which it does not have");
    }
    const std::int64_t count = Shape(slice).numel();
    if (!per_expert) {
      out.push_back({spec.name, slice, it->second, checkpoint, 0, count, spec.shape});
      continue;
    }
    for (std::int64_t e = 0; e < spec.shape[0]; ++e) {
      out.push_back({spec.name, slice, it->second, with_index(checkpoint, std::to_string(e), "{e}"),
                     e * count, count, spec.shape});
    }
  }
  // The parameters that share a checkpoint tensor are its equal slices, each once: the same
  // shape, transposition, dimension and number of parts, and every part 0 .. parts - 1.
  std::map<std::string, std::vector<const Placed*>> by_checkpoint;
  for (const auto& p : out) by_checkpoint[p.checkpoint].push_back(&p);
  for (const auto& [name, group] : by_checkpoint) {
    const Rule& first = *group.front()->rule;
    std::set<int> parts;
    for (const Placed* p : group) {
      const Rule& r = *p->rule;
      if (p->shape != group.front()->shape || r.transpose != first.transpose ||
          r.dim != first.dim || r.parts != first.parts || r.leading_ones != first.leading_ones ||
          r.interleave != first.interleave || !parts.insert(r.part).second) {
        throw ConfigError("name map " + map.family + ": " + group.front()->teo + " and " + p->teo +
                          " share checkpoint tensor " + name +
                          " but are not equal slices of it (split [dim, part, parts])");
      }
    }
    if (static_cast<int>(parts.size()) != first.parts) {
      throw ConfigError("name map " + map.family + ": checkpoint tensor " + name + " has " +
                        std::to_string(first.parts) + " parts, but " +
                        std::to_string(parts.size()) + " of them are mapped");
    }
  }
  return out;
}

// The checkpoint tensor's shape for one placed parameter: teo's, transposed, times parts (each
// matrix of a stack so).
std::vector<std::int64_t> checkpoint_shape(const Placed& p) {
  const std::size_t at = p.shape.size() == 3 && (p.rule->transpose || p.rule->parts > 1) ? 1 : 0;
  std::vector<std::int64_t> s = p.shape;
  if (p.rule->transpose && s.size() - at == 2) std::swap(s[at], s[at + 1]);
  if (p.rule->parts > 1) s[at + static_cast<std::size_t>(p.rule->dim)] *= p.rule->parts;
  s.insert(s.begin(), static_cast<std::size_t>(p.rule->leading_ones), 1);
  return s;
}

std::string shape_str(const std::vector<std::int64_t>& s) {
  std::string out = "(";
  for (std::size_t k = 0; k < s.size(); ++k) out += (k ? ", " : "") + std::to_string(s[k]);
  return out + ")";
}

// Index of element `e` (row-major) of a teo matrix (rows, cols) or, with rows 0, vector (cols)
// in its checkpoint tensor under `rule`.
std::int64_t moved_index(const Rule& rule, std::int64_t rows, std::int64_t cols, std::int64_t e) {
  const bool matrix = rows > 0;
  std::int64_t r = 0, c = e;
  if (matrix) r = e / cols, c = e % cols;
  // (r, c) in teo's matrix -> (r', c') in the unfused checkpoint slice
  std::int64_t cr = r, cc = c, ccols = cols;
  if (rule.transpose && matrix) cr = c, cc = r, ccols = rows;
  if (rule.parts > 1) {
    const std::int64_t part = rule.part, parts = rule.parts;
    if (!matrix) return rule.interleave ? e * parts + part : part * cols + e;
    if (rule.dim == 0) {
      const std::int64_t crows = rule.transpose ? cols : rows;
      cr = rule.interleave ? cr * parts + part : cr + part * crows;
    } else {
      cc = rule.interleave ? cc * parts + part : cc + part * ccols;
      ccols *= parts;
    }
  }
  return matrix ? cr * ccols + cc : cc;
}

// Index of teo element `e` (row-major in teo's shape) in the checkpoint tensor.
std::int64_t checkpoint_index(const Placed& p, std::int64_t e) {
  const auto& s = p.shape;
  if (s.size() == 3 && (p.rule->transpose || p.rule->parts > 1)) {
    // a stack: matrix e / n of n elements, moved as a matrix, in a checkpoint matrix of n parts
    const std::int64_t n = s[1] * s[2];
    return (e / n) * n * p.rule->parts + moved_index(*p.rule, s[1], s[2], e % n);
  }
  if (s.size() == 2) return moved_index(*p.rule, s[0], s[1], e);
  return moved_index(*p.rule, 0, s.empty() ? 1 : s[0], e);
}

bool ignored(const NameMap& map, const std::string& name) {
  return std::any_of(map.ignore.begin(), map.ignore.end(), [&](const std::string& g) {
    return fnmatch(g.c_str(), name.c_str(), 0) == 0;
  });
}

// The file's tensor `role` + name, the name with or without the base prefix.
const st::Tensor* find_in(const st::File& f, const NameMap& map, const std::string& name,
                          const std::string& role) {
  if (const auto* t = f.find(role + name)) return t;
  if (!map.base_prefix.empty() && name.starts_with(map.base_prefix))
    return f.find(role + name.substr(map.base_prefix.size()));
  return nullptr;
}

// cfg's JSON with every key a map may read spelled out, defaults included (to_json leaves out
// the keys not in use), so that an export writes what a checkpoint's loader would otherwise
// default differently.
json effective_json(const ModelConfig& cfg) {
  json j = cfg.to_json();
  j["architecture"] = to_string(cfg.architecture);
  j["attn_bias"] = cfg.attention.attn_bias;
  j["attn_out_bias"] = cfg.attention.out_bias();
  j["ffn_bias"] = cfg.ffn.ffn_bias;
  j["head_bias"] = cfg.head.head_bias;
  j["tie_embeddings"] = cfg.head.tie_embeddings;
  j["norm"] = to_string(cfg.norms.norm);
  j["ffn"] = to_string(cfg.ffn.kind);
  j["num_kv_heads"] = cfg.kv_heads();
  j["position_offset"] = cfg.embeddings.position_offset;
  j["attn_sinks"] = cfg.attention.attn_sinks;
  // every layer's attention spelled out: windowed ones when sliding_window is set and layer_types
  // is empty (teo's default), full ones without a window
  json types = json::array();
  for (index_t i = 0; i < cfg.num_layers; ++i)
    types.push_back(cfg.window(i) ? "sliding_attention" : "full_attention");
  j["layer_types"] = types;
  j["embedding_norm"] = cfg.embeddings.embedding_norm;
  j["pooler"] = to_string(cfg.head.pooler);
  j["padding_idx"] = cfg.embeddings.padding_idx ? json(*cfg.embeddings.padding_idx) : json(nullptr);
  return j;
}

}  // namespace detail

using detail::checkpoint_index;
using detail::checkpoint_shape;
using detail::effective_json;
using detail::find_in;
using detail::ignored;
using detail::need_string;
using detail::place;
using detail::Placed;
using detail::shape_str;

namespace {

// The "config" section's shape, every field named in its error: a misspelled rule field must not
// quietly set nothing.
void validate_config_section(const json& c, const std::string& source) {
  const auto fail = [&](const std::string& what) {
    throw ConfigError(source + ": config." + what);
  };
  for (const auto& [k, v] : c.items()) {
    if (k == "keys" || k == "fixed" || k == "export" || k == "defaults") {
      if (!v.is_object()) fail(k + " must be an object");
    } else if (k == "free" || k == "ignored") {
      if (!v.is_array() ||
          !std::all_of(v.begin(), v.end(), [](const json& x) { return x.is_string(); }))
        fail(k + " must be an array of strings");
    } else {
      fail(k + " is not a field (keys, fixed, defaults, free, ignored, export)");
    }
  }
  const json keys = c.value("keys", json::object());
  for (const auto& [hk, rules] : keys.items()) {
    const json list = rules.is_array() ? rules : json::array({rules});
    for (const auto& r : list) {
      const std::string where = "keys." + hk;
      if (r.is_string()) continue;
      if (!r.is_object()) fail(where + " must be a teo key, an object or a list of them");
      bool all_null = r.contains("map") && r.at("map").is_object();
      for (const auto& [f, fv] : r.items()) {
        if (f == "key") {
          if (!fv.is_string()) fail(where + ".key must be a string");
        } else if (f == "map") {
          if (!fv.is_object()) fail(where + ".map must be an object");
          for (const auto& [mk, mv] : fv.items()) all_null = all_null && mv.is_null();
        } else if (f == "count") {
          if (!fv.is_boolean()) fail(where + ".count must be true or false");
        } else if (f == "plus") {
          if (!fv.is_number_integer()) fail(where + ".plus must be an integer");
        } else if (f == "rope_scaling" || f == "required") {
          if (!fv.is_boolean()) fail(where + "." + f + " must be true or false");
        } else if (f == "null_times") {
          if (!fv.is_array() || fv.size() != 2 || !fv[0].is_string() || !fv[1].is_number_integer())
            fail(where + ".null_times must be [a config.json key, an integer]");
        } else if (f == "absent") {
          // any value: what an export writes when cfg leaves the teo key out
        } else if (f == "times") {
          if (!fv.is_array() || fv.size() != 2 || !fv[0].is_string() || !fv[1].is_string())
            fail(where + ".times must be [a config.json key, the teo key it sets]");
        } else {
          fail(where + " has the unknown field \"" + f +
               "\" (key, map, count, plus, null_times, times, absent, rope_scaling, required)");
        }
      }
      if (!r.contains("key") && !all_null)
        fail(where + " needs a \"key\" (only a map whose values are all null sets nothing)");
    }
  }
}

}  // namespace

NameMap NameMap::from_json(const json& j, const std::string& source) {
  const auto fail = [&](const std::string& what) { throw ConfigError(source + ": " + what); };
  if (!j.is_object()) fail("a name map must be a JSON object");
  if (j.value("format", json()) != "teo-names/1")
    fail("\"format\" must be \"teo-names/1\", got " + j.value("format", json()).dump());
  NameMap m;
  for (const auto& [key, v] : j.items()) {
    if (key == "format" || key == "description") continue;
    if (key == "family") {
      m.family = need_string(v, source + ": family");
    } else if (key == "base_prefix") {
      m.base_prefix = need_string(v, source + ": base_prefix");
    } else if (key == "params") {
      if (!v.is_array()) fail("\"params\" must be an array of [teo, checkpoint, {options}]");
      for (const auto& e : v) {
        if (!e.is_array() || e.size() < 2 || e.size() > 3)
          fail("each params entry is [teo name, checkpoint name, {options}], got " + e.dump());
        Rule r;
        r.teo = need_string(e[0], source + ": a teo name");
        r.checkpoint = need_string(e[1], source + ": a checkpoint name");
        if (e.size() == 3) {
          if (!e[2].is_object()) fail("the options of " + r.teo + " must be an object");
          for (const auto& [ok, ov] : e[2].items()) {
            if (ok == "transpose" && ov.is_boolean()) {
              r.transpose = ov.get<bool>();
            } else if (ok == "optional" && ov.is_boolean()) {
              r.optional = ov.get<bool>();
            } else if (ok == "interleave" && ov.is_boolean()) {
              r.interleave = ov.get<bool>();
            } else if (ok == "leading_ones" && ov.is_number_integer()) {
              const auto n = ov.get<std::int64_t>();
              if (n < 0 || n > 4)
                fail("leading_ones of " + r.teo + " must be in [0, 4], got " + ov.dump());
              r.leading_ones = static_cast<int>(n);
            } else if (ok == "split" && ov.is_array() && ov.size() == 3 &&
                       std::all_of(ov.begin(), ov.end(),
                                   [](const json& x) { return x.is_number_integer(); })) {
              const auto dim = ov[0].get<std::int64_t>(), part = ov[1].get<std::int64_t>(),
                         parts = ov[2].get<std::int64_t>();
              if (dim < 0 || dim > 1 || parts < 1 || parts > 64 || part < 0 || part >= parts)
                fail("split of " + r.teo + " must be [dim 0 or 1, part, parts <= 64], got " +
                     ov.dump());
              r.dim = static_cast<int>(dim), r.part = static_cast<int>(part);
              r.parts = static_cast<int>(parts);
            } else {
              fail("unknown option \"" + ok + "\": " + ov.dump() + " of " + r.teo +
                   " (transpose, optional, leading_ones, split: [dim, part, parts], interleave)");
            }
          }
          if (r.interleave && r.parts < 2) fail("interleave of " + r.teo + " needs a split");
        }
        m.rules.push_back(std::move(r));
      }
    } else if (key == "ignore") {
      if (!v.is_array()) fail("\"ignore\" must be an array of globs");
      for (const auto& g : v) m.ignore.push_back(need_string(g, source + ": an ignore glob"));
    } else if (key == "config") {
      if (!v.is_object()) fail("\"config\" must be an object");
      validate_config_section(v, source);
      m.config = v;
    } else {
      fail("unknown key \"" + key + "\"");
    }
  }
  if (m.family.empty()) fail("\"family\" is missing");
  if (m.rules.empty()) fail("\"params\" is missing or empty");
  if (!m.config.is_object()) m.config = json::object();
  std::set<std::string> teo_names;
  for (const auto& r : m.rules)
    if (!teo_names.insert(r.teo).second) fail("teo's " + r.teo + " has two rules");
  return m;
}

std::vector<std::string> NameMap::builtin_families() {
  std::vector<std::string> out;
  for (const auto& [name, text] : builtin_maps()) out.push_back(name);
  return out;
}

NameMap NameMap::load(const std::string& family_or_path) {
  for (const auto& [name, text] : builtin_maps())
    if (name == family_or_path) return from_json(json::parse(text), name);
  if (family_or_path.find('/') == std::string::npos && !family_or_path.ends_with(".json")) {
    std::string known;
    for (const auto& f : builtin_families()) known += (known.empty() ? "" : ", ") + f;
    throw ConfigError("unknown name map \"" + family_or_path + "\"" +
                      did_you_mean(family_or_path, builtin_families()) + " (built in: " + known +
                      "; or a map file's path)");
  }
  return from_json(read_json_file(family_or_path), family_or_path);
}

template <class Real>
Params<Real> params_from_checkpoint(const st::File& checkpoint, const NameMap& map,
                                    const ModelConfig& cfg, Params<Real> seeded,
                                    std::map<std::string, std::vector<unsigned char>>* packed) {
  const auto placed = place(map, cfg);
  std::set<std::string> quantized;
  for (const auto& w : contract::quantized(cfg)) quantized.insert(w.name);
  if (!quantized.empty() && !packed)
    throw std::logic_error("params_from_checkpoint of a quantized config without `packed`");
  // Every check before any value moves: presence, shape, and no tensor left unread.
  std::set<std::string> read;
  std::vector<const st::Tensor*> found;  // each placed parameter's tensor, or null (optional)
  for (const auto& p : placed) {
    const bool dense = !quantized.contains(p.teo);
    const st::Tensor* t = dense ? find_in(checkpoint, map, p.checkpoint) : nullptr;
    found.push_back(t);
    if (!dense) {
      // a quantized weight is its packing, read below; a dense one in its place is an error
      const st::Tensor* d = find_in(checkpoint, map, p.checkpoint);
      if (d && st::is_float(d->dtype)) {
        throw FormatError("checkpoint tensor " + d->name + " is dense, but the config's " +
                          "quantization stores teo's " + p.teo + " in " +
                          cfg.quantization->format.name());
      }
      continue;
    }
    if (!t) {
      // an optional parameter is read whole or not at all: never some experts of it
      const bool some_read = std::any_of(placed.begin(), placed.end(), [&](const Placed& q) {
        return q.teo == p.teo && find_in(checkpoint, map, q.checkpoint) != nullptr;
      });
      if (p.rule->optional && !some_read) continue;
      throw FormatError("the checkpoint has no tensor " + p.checkpoint + " (teo's " + p.teo + ", " +
                        map.family + ")");
    }
    if (!st::is_float(t->dtype))
      throw FormatError("checkpoint tensor " + t->name + " is " + st::dtype_name(t->dtype) +
                        ", not a float type");
    if (t->shape != checkpoint_shape(p)) {
      throw FormatError("checkpoint tensor " + t->name + " has shape " + shape_str(t->shape) +
                        ", the config gives " + shape_str(checkpoint_shape(p)) + " (teo's " +
                        p.teo + ")");
    }
    read.insert(t->name);
  }
  if (!quantized.empty()) detail::read_packed(checkpoint, map, cfg, placed, *packed, read);
  for (const auto& t : checkpoint.tensors) {
    if (!read.contains(t.name) && !ignored(map, t.name)) {
      throw FormatError("checkpoint tensor " + t.name + " is read by no teo parameter of this " +
                        "config under " + map.family + " (a tensor of another model, or a " +
                        "config that leaves out what the checkpoint has)");
    }
  }
  std::map<std::string, Tensor<Real>*> by_name;
  seeded.visit([&](const std::string& n, Tensor<Real>& t) { by_name[n] = &t; });
  std::map<std::string, std::vector<double>> widened;  // once per tensor, fused ones included
  for (std::size_t k = 0; k < placed.size(); ++k) {
    const Placed& p = placed[k];
    const st::Tensor* t = found[k];
    if (!t) continue;
    auto it = widened.find(t->name);
    if (it == widened.end()) it = widened.emplace(t->name, t->float_values()).first;
    const std::vector<double>& v = it->second;
    Tensor<Real>& dst = *by_name.at(p.teo);
    for (std::int64_t e = 0; e < p.count; ++e) {
      const double x = v[static_cast<std::size_t>(checkpoint_index(p, e))];
      const Real r = static_cast<Real>(x);
      if (static_cast<double>(r) != x && !std::isnan(x)) {
        throw FormatError("checkpoint tensor " + t->name + " holds " + std::to_string(x) +
                          ", which float32 cannot hold exactly: make the case float64");
      }
      dst[p.offset + e] = r;
    }
  }
  return seeded;
}

namespace {

// config.json's rope_scaling (Hugging Face's modeling_rope_utils form) as teo's (semantics
// 14.3): null or "default" sets nothing; linear and yarn move key by key; any other type or key is
// refused by name.
json rope_scaling_from_hf(const std::string& hk, const json& hv, const json& hf,
                          const NameMap& map) {
  if (hv.is_null()) return nullptr;
  if (!hv.is_object()) throw ConfigError("config.json " + hk + " must be an object or null");
  const json type = hv.contains("rope_type") ? hv.at("rope_type") : hv.value("type", json());
  if (type == "default") return nullptr;
  if (type != "linear" && type != "yarn") {
    throw ConfigError("config.json " + hk + " of type " + type.dump() +
                      " has no teo counterpart (" + map.family +
                      " takes null, \"default\", \"linear\" and \"yarn\")");
  }
  json out{{"type", type}};
  for (const auto& [k, v] : hv.items()) {
    if (k == "rope_type" || k == "type") continue;
    const bool yarn = type == "yarn";
    if (k == "factor") {
      out["factor"] = v;
    } else if (yarn && k == "original_max_position_embeddings") {
      out["original_max_len"] = v;
    } else if (yarn && (k == "beta_fast" || k == "beta_slow" || k == "truncate" || k == "mscale" ||
                        k == "mscale_all_dim")) {
      out[k] = v;
    } else {
      throw ConfigError("config.json " + hk + "." + k + " (of type " + type.dump() +
                        ") has no teo counterpart");
    }
  }
  // transformers 4.50 to 4.57 (the rope_scaling form) rotate by YaRN's factor
  // max_position_embeddings / original_max_position_embeddings whenever the latter is given,
  // whatever `factor` says: a config.json whose two differ would be another model in teo
  if (type == "yarn" && hv.contains("original_max_position_embeddings") &&
      hf.contains("max_position_embeddings")) {
    const json& orig = hv.at("original_max_position_embeddings");
    const json& len = hf.at("max_position_embeddings");
    const json& factor = hv.value("factor", json());
    if (orig.is_number() && len.is_number() && factor.is_number() && orig.get<double>() > 0 &&
        len.get<double>() / orig.get<double>() != factor.get<double>()) {
      throw ConfigError(
          "config.json " + hk + ".factor " + factor.dump() +
          " is not max_position_embeddings / original_max_position_embeddings = " + len.dump() +
          " / " + orig.dump() + ", the factor transformers 4.50 to 4.57 rotate by (" + map.family +
          " needs the two to agree)");
    }
  }
  return out;
}

// teo's rope_scaling in config.json's form: rope_scaling_from_hf reversed.
json rope_scaling_to_hf(const json& v) {
  const std::string type = v.value("type", "none");
  if (type == "none") return nullptr;
  json out{{"rope_type", type}};
  for (const auto& [k, x] : v.items()) {
    if (k == "type") continue;
    out[k == "original_max_len" ? "original_max_position_embeddings" : k] = x;
  }
  return out;
}

// One config.json value under one rule: {teo key, its value}; an empty key or a null value sets
// nothing.
std::pair<std::string, json> apply_rule(const json& rule, const std::string& hk, const json& hv,
                                        const json& hf, const NameMap& map) {
  if (rule.is_string()) return {rule.get<std::string>(), hv};
  const std::string teo_key = rule.value("key", "");
  if (rule.value("rope_scaling", false)) return {teo_key, rope_scaling_from_hf(hk, hv, hf, map)};
  if (hv.is_null() && rule.contains("null_times")) {
    // GPT-2's n_inner: null means a multiple of another key
    const json& nt = rule.at("null_times");
    const std::string of = nt.at(0).get<std::string>();
    if (!hf.contains(of) || !hf.at(of).is_number_integer())
      throw ConfigError("config.json " + hk + " is null, and " + of + " is not an integer");
    return {teo_key, hf.at(of).get<std::int64_t>() * nt.at(1).get<std::int64_t>()};
  }
  if (rule.contains("map")) {
    // string values by themselves, others (true, null) by their JSON text
    const json& m = rule.at("map");
    const std::string as_key = hv.is_string() ? hv.get<std::string>() : hv.dump();
    if (!m.contains(as_key)) {
      throw ConfigError("config.json " + hk + " = " + hv.dump() + " has no teo counterpart (" +
                        map.family + " takes " + m.dump() + ")");
    }
    return {teo_key, m.at(as_key)};
  }
  if (rule.contains("times")) {
    // DeepSeek's n_shared_experts: a count of another key's width (moe_intermediate_size)
    const std::string of = rule.at("times").at(0).get<std::string>();
    const auto small = [](const json& v) {
      return v.is_number_integer() && v.get<std::int64_t>() >= 0 &&
             v.get<std::int64_t>() <= (std::int64_t{1} << 30);
    };
    if (!small(hv) || !hf.contains(of) || !small(hf.at(of))) {
      throw ConfigError("config.json " + hk + " and " + of +
                        " must be integers in [0, 2^30] (their product is teo's " + teo_key + ")");
    }
    return {teo_key, hv.get<std::int64_t>() * hf.at(of).get<std::int64_t>()};
  }
  if (rule.value("count", false)) {
    if (!hv.is_object()) throw ConfigError("config.json " + hk + " must be an object");
    return {teo_key, hv.size()};
  }
  if (rule.contains("plus") && !hv.is_null()) {
    // RoBERTa's positions start at pad_token_id + 1
    if (!hv.is_number_integer()) throw ConfigError("config.json " + hk + " must be an integer");
    return {teo_key, hv.get<std::int64_t>() + rule.at("plus").get<std::int64_t>()};
  }
  return {teo_key, hv};
}

// A key's rules: one, or a list (RoBERTa's pad_token_id gives two teo keys).
json rules_of(const json& rule) {
  return rule.is_array() ? rule : json::array({rule});
}

}  // namespace

json config_from_hf(const json& hf, const NameMap& map) {
  if (!hf.is_object()) throw ConfigError("config.json must be a JSON object");
  const json& c = map.config;
  json out = c.value("fixed", json::object());
  std::map<std::string, std::string> set_by;  // teo key -> the hf key that set it
  const json keys = c.value("keys", json::object());
  const json ignored = c.value("ignored", json::array());
  std::vector<std::string> known;
  for (const auto& [k, v] : keys.items()) known.push_back(k);
  for (const auto& k : ignored) known.push_back(k.get<std::string>());
  // a key whose absence the family's loader fills by a rule teo does not follow (gpt-oss's
  // layer_types from the layer count) must be spelled out
  for (const auto& [hk, rule] : keys.items()) {
    for (const auto& r : rules_of(rule)) {
      if (r.is_object() && r.value("required", false) && !hf.contains(hk)) {
        throw ConfigError("config.json has no " + hk + ", which " + map.family +
                          " needs spelled out (its loader's default is not teo's)");
      }
    }
  }
  // the family's config class's defaults, for the keys its save_pretrained leaves out
  json with_defaults = hf;
  const json defaults = c.value("defaults", json::object());
  for (const auto& [k, v] : defaults.items())
    if (!with_defaults.contains(k)) with_defaults[k] = v;
  for (const auto& [hk, hv] : with_defaults.items()) {
    if (hk == "quantization_config" &&
        std::find(ignored.begin(), ignored.end(), hk) == ignored.end()) {
      out["quantization"] = detail::quantization_from_hf(hv);
      continue;
    }
    const auto rule = keys.find(hk);
    if (rule == keys.end()) {
      if (std::find(ignored.begin(), ignored.end(), hk) != ignored.end()) continue;
      throw ConfigError("config.json key \"" + hk + "\" is neither mapped nor ignored by " +
                        map.family + did_you_mean(hk, known));
    }
    for (const auto& r : rules_of(*rule)) {
      const auto [teo_key, value] = apply_rule(r, hk, hv, with_defaults, map);
      if (teo_key.empty() || value.is_null()) continue;  // an accepted value that sets nothing
      if (const auto it = set_by.find(teo_key); it != set_by.end() && out.at(teo_key) != value) {
        throw ConfigError("config.json " + it->second + " = " + out.at(teo_key).dump() + " and " +
                          hk + " = " + value.dump() + " are both teo's " + teo_key +
                          ", which is one value");
      }
      set_by[teo_key] = hk;
      out[teo_key] = value;
    }
  }
  return out;
}

json hf_config_of(const ModelConfig& cfg, const NameMap& map) {
  const json& c = map.config;
  const json teo = effective_json(cfg);
  json out = c.value("export", json::object());
  const json keys = c.value("keys", json::object());
  for (const auto& [hk, rules] : keys.items()) {
    // the first of the key's rules whose teo key cfg has writes it
    for (const auto& rule : rules_of(rules)) {
      const std::string key = rule.is_string() ? rule.get<std::string>() : rule.value("key", "");
      if (!key.empty() && !teo.contains(key) && rule.is_object() && rule.contains("absent")) {
        // teo's JSON leaves the key out at its default, which is not the family's default
        out[hk] = rule.at("absent");
        break;
      }
      if (key.empty() || !teo.contains(key)) continue;
      const json& v = teo.at(key);
      if (rule.is_object() && rule.contains("map")) {
        for (const auto& [hv, tv] : rule.at("map").items()) {
          if (tv == v) {
            // "true", "false", "null" and numbers ("1e-06") stand for those JSON values
            const json parsed = json::parse(hv, nullptr, false);
            out[hk] =
                parsed.is_boolean() || parsed.is_null() || parsed.is_number() ? parsed : json(hv);
            break;
          }
        }
      } else if (rule.is_object() && rule.value("rope_scaling", false)) {
        out[hk] = rope_scaling_to_hf(v);
      } else if (rule.is_object() && rule.contains("times")) {
        // the count whose product with the other key's teo value is v; left out (and the
        // read-back below then names the difference) when it does not divide
        const std::string per = rule.at("times").at(1).get<std::string>();
        const std::int64_t w = teo.contains(per) ? teo.at(per).get<std::int64_t>() : 0;
        if (w > 0 && v.get<std::int64_t>() % w == 0) out[hk] = v.get<std::int64_t>() / w;
      } else if (rule.is_object() && rule.contains("plus") && !v.is_null()) {
        out[hk] = v.get<std::int64_t>() - rule.at("plus").get<std::int64_t>();
      } else if (rule.is_object() && rule.value("count", false)) {
        json labels = json::object();
        for (std::int64_t k = 0; k < v.get<std::int64_t>(); ++k)
          labels[std::to_string(k)] = "LABEL_" + std::to_string(k);
        out[hk] = labels;
      } else {
        out[hk] = v;
      }
      break;
    }
  }
  if (cfg.quantization)
    out["quantization_config"] = detail::hf_quantization_config(*cfg.quantization);
  // The family expresses cfg when reading this back (with cfg's free keys, and a quantization's
  // targets, which a checkpoint's tensors give) gives cfg itself.
  json back = config_from_hf(out, map);
  if (cfg.quantization && !cfg.quantization->targets.empty())
    back["quantization"]["targets"] = cfg.quantization->targets;
  for (const auto& k : c.value("free", json::array()))
    if (teo.contains(k.get<std::string>())) back[k.get<std::string>()] = teo.at(k);
  ModelConfig again;
  try {
    again = ModelConfig::from_json(back);
  } catch (const ConfigError& e) {
    throw ConfigError(map.family + " cannot express this config: " + e.what());
  }
  if (effective_json(again) != teo) {
    const json a = effective_json(again);
    std::string diff;
    for (const auto& [k, v] : teo.items())
      if (!a.contains(k) || a.at(k) != v) diff += (diff.empty() ? "" : ", ") + k + " = " + v.dump();
    for (const auto& [k, v] : a.items())
      if (!teo.contains(k)) diff += (diff.empty() ? "" : ", ") + k + " (left out)";
    throw ConfigError(map.family + " cannot express this config's " + diff);
  }
  return out;
}

st::File checkpoint_of(const st::File& golden, const NameMap& map) {
  const auto* config = golden.meta("config");
  if (!config) throw FormatError("the golden has no config metadata");
  const ModelConfig cfg = ModelConfig::from_json_text(*config);
  const auto placed = place(map, cfg);
  // checkpoint name -> its shape, dtype and values, assembled from every part
  struct Out {
    std::vector<std::int64_t> shape;
    st::DType dtype;
    std::vector<unsigned char> bytes;
  };
  std::vector<std::string> order;
  std::map<std::string, Out> outs;
  std::set<std::string> quantized;
  for (const auto& w : contract::quantized(cfg)) quantized.insert(w.name);
  for (const auto& p : placed) {
    if (quantized.contains(p.teo)) continue;  // its packing, after the dense tensors
    const st::Tensor* t = golden.find("param." + p.teo);
    if (!t) throw FormatError("the golden has no param." + p.teo);
    const std::size_t size = st::dtype_size(t->dtype);
    auto [it, fresh] = outs.try_emplace(p.checkpoint);
    if (fresh) {
      order.push_back(p.checkpoint);
      it->second.shape = checkpoint_shape(p);
      it->second.dtype = t->dtype;
      it->second.bytes.assign(static_cast<std::size_t>(Shape(it->second.shape).numel()) * size, 0);
    }
    const auto src = t->data();
    for (std::int64_t e = 0; e < p.count; ++e) {
      std::memcpy(it->second.bytes.data() + static_cast<std::size_t>(checkpoint_index(p, e)) * size,
                  src.data() + static_cast<std::size_t>(p.offset + e) * size, size);
    }
  }
  st::File f;
  f.metadata = {{"format", "pt"}};
  for (const auto& n : order) {
    const Out& o = outs.at(n);
    f.add(n, o.dtype, o.shape, o.bytes.data(), o.bytes.size());
  }
  if (!quantized.empty()) detail::write_packed(golden, map, cfg, placed, f);
  return f;
}

template Params<float> params_from_checkpoint<float>(
    const st::File&, const NameMap&, const ModelConfig&, Params<float>,
    std::map<std::string, std::vector<unsigned char>>*);
template Params<double> params_from_checkpoint<double>(
    const st::File&, const NameMap&, const ModelConfig&, Params<double>,
    std::map<std::string, std::vector<unsigned char>>*);

}  // namespace teo::names
