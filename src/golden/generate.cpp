#include "teo/golden.hpp"

#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "teo/files.hpp"
#include "teo/model.hpp"
#include "teo/sha256.hpp"

namespace teo::golden {

namespace {

using nlohmann::json;
using safetensors::DType;
using safetensors::File;

std::int64_t case_int(const json& v, const std::string& key) {
  if (!v.is_number_integer()) {
    throw ConfigError("case." + key + " must be an integer, got " + v.dump());
  }
  if (v.is_number_unsigned() && v.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX)) {
    throw ConfigError("case." + key + " is too large: " + v.dump());
  }
  return v.get<std::int64_t>();
}

std::vector<std::int64_t> dims_of(const Shape& s) {
  return s.dims();
}

template <class Real>
void add_tensor(File& f, const std::string& name, const Tensor<Real>& t) {
  f.add<Real>(name, dims_of(t.shape()), t.data(), static_cast<std::size_t>(t.numel()));
}

// The activation names of the golden contract, in pipeline order (the model also keeps ffn_pre
// and residual2, which the contract leaves out).
template <class Real>
std::vector<std::pair<std::string, const Tensor<Real>*>> contract_acts(const Activations<Real>& a) {
  std::vector<std::pair<std::string, const Tensor<Real>*>> out;
  a.visit([&](const std::string& name, const Tensor<Real>& t) {
    if (name.ends_with(".ffn_pre") || name.ends_with(".residual2")) return;
    out.emplace_back("act." + name, &t);
  });
  return out;
}

// Parameter names of layer i in the order backward produces their gradients: the reverse of the
// order in which forward uses them.
std::vector<std::string> layer_params_backward(const EncoderConfig& cfg, index_t i) {
  const std::string p = "layers." + std::to_string(i) + ".";
  std::vector<std::string> used =
      cfg.norm_first ? std::vector<std::string>{"norm1",  "attn.q", "attn.k",  "attn.v",
                                                "attn.o", "norm2",  "ffn.fc1", "ffn.fc2"}
                     : std::vector<std::string>{"attn.q", "attn.k",  "attn.v",  "attn.o",
                                                "norm1",  "ffn.fc1", "ffn.fc2", "norm2"};
  std::vector<std::string> out;
  for (auto it = used.rbegin(); it != used.rend(); ++it) {
    out.push_back(p + *it + ".weight");
    out.push_back(p + *it + ".bias");
  }
  return out;
}

// The gradient tensors of the contract, in the order backward computes them.
template <class Real>
std::vector<std::pair<std::string, const Tensor<Real>*>> contract_grads(
    const EncoderConfig& cfg, const Params<Real>& grads, const Activations<Real>& dacts) {
  std::map<std::string, const Tensor<Real>*> by_name;
  grads.visit([&](const std::string& n, const Tensor<Real>& t) { by_name[n] = &t; });
  std::vector<std::pair<std::string, const Tensor<Real>*>> out;
  auto param = [&](const std::string& n) { out.emplace_back("grad." + n, by_name.at(n)); };
  out.emplace_back("grad.act.logits", &dacts.logits);
  param("head.weight");
  param("head.bias");
  out.emplace_back("grad.act.pooled", &dacts.pooled);
  if (cfg.norm_first) {
    param("final_norm.weight");
    param("final_norm.bias");
  }
  for (index_t i = cfg.num_layers - 1; i >= 0; --i) {
    out.emplace_back("grad.act.layers." + std::to_string(i) + ".output",
                     &dacts.layers[static_cast<std::size_t>(i)].output);
    for (const auto& n : layer_params_backward(cfg, i)) param(n);
  }
  out.emplace_back("grad.act.input", &dacts.input);
  if (cfg.positional == Positional::learned) param("pos_embedding.weight");
  param("embedding.weight");
  return out;
}

void add_mask(File& f, const std::string& name, std::vector<std::int64_t> shape,
              const std::vector<std::uint8_t>& m) {
  f.add<std::uint8_t>(name, std::move(shape), m.data(), m.size());
}

template <class Real>
struct Run {
  Activations<Real> acts, dacts;
  Params<Real> grads;
};

template <class Real>
Run<Real> run_case(const Params<Real>& params, const Batch& batch, std::uint64_t seed) {
  Run<Real> r;
  ForwardOptions opts;
  opts.train = true;
  opts.dropout_seed = seed;
  forward(params, batch, r.acts, opts);
  backward(params, batch, r.acts, r.grads, r.dacts);
  return r;
}

template <class Real>
File make_typed(const Case& c) {
  const EncoderConfig& cfg = c.config;
  const auto params = Params<Real>::init(cfg, c.seed);
  const Batch batch = Batch::random(cfg, c.batch, c.seq_len, c.seed, c.lengths);
  const auto run = run_case(params, batch, c.seed);

  File f;
  f.metadata.emplace_back("format", kFormat);
  f.metadata.emplace_back("config", cfg.to_json().dump());
  f.metadata.emplace_back("case", c.case_json().dump());
  f.metadata.emplace_back("teo_version", TEO_VERSION);

  const index_t B = c.batch, S = c.seq_len, D = cfg.d_model, H = cfg.num_heads, F = cfg.d_ff;
  f.add<std::int64_t>("input.tokens", {B, S}, batch.tokens.data(), batch.tokens.size());
  f.add<std::int64_t>("input.lengths", {B}, batch.lengths.data(), batch.lengths.size());
  f.add<std::int64_t>("input.labels", {B}, batch.labels.data(), batch.labels.size());
  params.visit(
      [&](const std::string& n, const Tensor<Real>& t) { add_tensor(f, "param." + n, t); });
  if (cfg.dropout > 0) {
    add_mask(f, "dropout.input", {B, S, D}, run.acts.input_mask);
    for (index_t i = 0; i < cfg.num_layers; ++i) {
      const auto& m = run.acts.layers[static_cast<std::size_t>(i)].masks;
      const std::string p = "dropout.layers." + std::to_string(i) + ".";
      add_mask(f, p + "attn", {B, H, S, S}, m.attn);
      add_mask(f, p + "residual1", {B, S, D}, m.residual1);
      add_mask(f, p + "ffn", {B, S, F}, m.ffn);
      add_mask(f, p + "residual2", {B, S, D}, m.residual2);
    }
  }
  for (const auto& [n, t] : contract_acts(run.acts)) add_tensor(f, n, *t);
  for (const auto& [n, t] : contract_grads(cfg, run.grads, run.dacts)) add_tensor(f, n, *t);

  if constexpr (std::is_same_v<Real, float>) {
    // The same case in float64 from the same float32-valued parameters: the reference against
    // which both the golden's and a candidate's float32 errors are measured.
    auto p64 = Params<double>::zeros(cfg);
    std::vector<const Tensor<float>*> src;
    params.visit([&](const std::string&, const Tensor<float>& t) { src.push_back(&t); });
    std::size_t k = 0;
    p64.visit([&](const std::string&, Tensor<double>& t) {
      const Tensor<float>& s = *src[k++];
      for (index_t i = 0; i < t.numel(); ++i) t[i] = static_cast<double>(s[i]);
    });
    const auto r64 = run_case(p64, batch, c.seed);
    for (const auto& [n, t] : contract_acts(r64.acts)) add_tensor(f, "ref64." + n, *t);
    for (const auto& [n, t] : contract_grads(cfg, r64.grads, r64.dacts)) {
      add_tensor(f, "ref64." + n, *t);
    }
  }
  return f;
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

std::string symbolic_shape(const std::string& tensor_name) {
  std::string n = tensor_name;
  for (const char* prefix : {"grad.act.", "act.", "grad.", "param."}) {
    if (n.starts_with(prefix)) {
      const bool act = std::string(prefix).find("act.") != std::string::npos;
      n = n.substr(std::string(prefix).size());
      if (act) {
        if (n == "positional") return "(S, D)";
        if (n == "pooled") return "(B, D)";
        if (n == "logits" || n == "class_probs") return "(B, C)";
        if (n == "loss") return "()";
        if (n.ends_with(".q") || n.ends_with(".k") || n.ends_with(".v")) return "(B, H, S, Dh)";
        if (n.ends_with(".scores") || n.ends_with(".probs")) return "(B, H, S, S)";
        if (n.ends_with(".ffn_pre") || n.ends_with(".ffn_hidden")) return "(B, S, F)";
        if (n.ends_with("_mean") || n.ends_with("_rstd")) return "(B*S)";
        return "(B, S, D)";
      }
      break;
    }
  }
  if (n == "embedding.weight") return "(V, D)";
  if (n == "pos_embedding.weight") return "(max_len, D)";
  if (n == "head.weight") return "(C, D)";
  if (n == "head.bias") return "(C)";
  if (n.ends_with("fc1.weight")) return "(F, D)";
  if (n.ends_with("fc1.bias")) return "(F)";
  if (n.ends_with("fc2.weight")) return "(D, F)";
  if (n.ends_with(".weight") && n.find("attn") != std::string::npos) return "(D, D)";
  return "(D)";
}

Case Case::from_json(const json& j) {
  if (!j.is_object()) throw ConfigError("a case file must be a JSON object");
  if (!j.contains("case")) throw ConfigError("the case file has no \"case\" object");
  json cfg_json = j;
  cfg_json.erase("case");
  Case c;
  c.config = EncoderConfig::from_json(cfg_json);
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
    } else if (key == "seed") {
      if (!v.is_number_unsigned()) {
        throw ConfigError("case.seed must be a non-negative integer, got " + v.dump());
      }
      c.seed = v.get<std::uint64_t>();
      have_seed = true;
    } else {
      throw ConfigError("case has the unknown key \"" + key + "\"");
    }
  }
  if (!have_batch || !have_seq || !have_dtype || !have_seed) {
    throw ConfigError("case needs batch, seq_len, dtype and seed");
  }
  const std::size_t real = c.dtype == "float32" ? sizeof(float) : sizeof(double);
  validate_batch_shape(c.config, {c.batch, c.seq_len}, real);
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
  return j;
}

File make(const Case& c) {
  return c.dtype == "float32" ? make_typed<float>(c) : make_typed<double>(c);
}

std::vector<CorpusEntry> read_corpus_cases(const std::string& path) {
  const json j = read_json_file(path);
  if (!j.is_object() || !j.contains("cases") || !j["cases"].is_array()) {
    throw ConfigError(path + ": needs an object with a \"cases\" array");
  }
  std::vector<CorpusEntry> out;
  for (const auto& e : j["cases"]) {
    if (!e.is_object() || !e.contains("name") || !e["name"].is_string()) {
      throw ConfigError(path + ": every case needs a \"name\" string");
    }
    CorpusEntry ce;
    ce.name = e["name"].get<std::string>();
    if (ce.name.empty() || ce.name.find_first_of("/\\") != std::string::npos || ce.name[0] == '.') {
      throw ConfigError(path + ": case name \"" + ce.name + "\" is not a plain file name");
    }
    for (const auto& prev : out) {
      if (prev.name == ce.name) throw ConfigError(path + ": case name \"" + ce.name + "\" repeats");
    }
    json spec = e;
    spec.erase("name");
    if (spec.contains("description")) {
      if (!spec["description"].is_string()) {
        throw ConfigError(path + ": case " + ce.name + ": description must be a string");
      }
      ce.description = spec["description"].get<std::string>();
      spec.erase("description");
    }
    try {
      ce.spec = Case::from_json(spec);
    } catch (const ConfigError& err) {
      throw ConfigError(path + ": case " + ce.name + ": " + err.what());
    } catch (const ShapeError& err) {
      throw ShapeError(path + ": case " + ce.name + ": " + err.what());
    }
    out.push_back(std::move(ce));
  }
  return out;
}

void generate_corpus(const std::string& dir, std::ostream& log, bool overwrite) {
  namespace fs = std::filesystem;
  const auto entries = read_corpus_cases((fs::path(dir) / "cases.json").string());
  if (!overwrite) {
    std::error_code ec;
    const fs::path manifest = fs::path(dir) / "manifest.json";
    if (fs::exists(manifest, ec)) {
      throw FileError(manifest.string() +
                      ": already exists (pass --force to regenerate the corpus)");
    }
    for (const auto& e : entries) {
      const fs::path f = fs::path(dir) / (e.name + ".safetensors");
      if (fs::exists(f, ec)) {
        throw FileError(f.string() + ": already exists (pass --force to regenerate the corpus)");
      }
    }
  }
  nlohmann::ordered_json files = nlohmann::ordered_json::array();
  std::uint64_t total = 0;
  for (const auto& e : entries) {
    const std::string bytes = safetensors::serialize(make(e.spec));
    const std::string file = e.name + ".safetensors";
    write_file_atomic((fs::path(dir) / file).string(), bytes, /*overwrite=*/true);
    nlohmann::ordered_json m;
    m["file"] = file;
    m["sha256"] = sha256_hex(bytes);
    m["bytes"] = bytes.size();
    m["description"] = e.description;
    files.push_back(std::move(m));
    total += bytes.size();
    log << file << "  " << bytes.size() << " bytes\n";
  }
  nlohmann::ordered_json manifest;
  manifest["format"] = "teo-golden-manifest/1";
  manifest["teo_version"] = TEO_VERSION;
  manifest["total_bytes"] = total;
  manifest["files"] = std::move(files);
  write_file_atomic((fs::path(dir) / "manifest.json").string(), manifest.dump(2) + "\n",
                    /*overwrite=*/true);
  log << entries.size() << " cases, " << total << " bytes\n";
}

}  // namespace teo::golden
