#include "teo/golden.hpp"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

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

std::string read_text(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) throw FileError(path + ": no such file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw FileError(path + ": cannot open for reading");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

json parse_json(const std::string& text, const std::string& path) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw ConfigError(path + ": not valid JSON: " + e.what());
  }
}

}  // namespace

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
  const json j = parse_json(read_text(path), path);
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
    safetensors::write_file_atomic((fs::path(dir) / file).string(), bytes, /*overwrite=*/true);
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
  safetensors::write_file_atomic((fs::path(dir) / "manifest.json").string(),
                                 manifest.dump(2) + "\n", /*overwrite=*/true);
  log << entries.size() << " cases, " << total << " bytes\n";
}

// ---- checking ----------------------------------------------------------------------------------

std::string stage_name(const std::string& n) {
  if (n.starts_with("act.")) return n.substr(4);
  return n;
}

namespace {

std::vector<double> as_doubles(const safetensors::Tensor& t) {
  if (t.dtype == DType::F64) return t.values<double>();
  if (t.dtype == DType::F32) {
    const auto v = t.values<float>();
    return {v.begin(), v.end()};
  }
  throw FormatError("tensor " + t.name + " has dtype " + safetensors::dtype_name(t.dtype) +
                    ", not a float type");
}

std::string index_str(std::int64_t flat, const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> idx(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    idx[d] = shape[d] ? flat % shape[d] : 0;
    flat = shape[d] ? flat / shape[d] : 0;
  }
  std::string s = "[";
  for (std::size_t d = 0; d < idx.size(); ++d) s += (d ? "," : "") + std::to_string(idx[d]);
  return s + "]";
}

std::string num(double v) {
  std::ostringstream os;
  os << std::setprecision(17) << v;
  return os.str();
}

bool same_nonfinite(double g, double c) {
  if (std::isnan(g)) return std::isnan(c);
  return g == c;  // +-inf must match exactly
}

TensorResult check_tensor(const File& golden, const safetensors::Tensor& g,
                          const safetensors::Tensor* c, bool f32, const CheckOptions& opts) {
  TensorResult r;
  r.name = g.name;
  if (!c) {
    r.status = Status::not_checked;
    r.message = "not in the candidate";
    return r;
  }
  if (c->dtype != g.dtype) {
    r.status = Status::fail;
    r.message = std::string("dtype mismatch: candidate ") + safetensors::dtype_name(c->dtype) +
                ", golden " + safetensors::dtype_name(g.dtype);
    return r;
  }
  if (c->shape != g.shape) {
    r.status = Status::fail;
    r.message = "shape mismatch: candidate " + c->shape_str() + ", golden " + g.shape_str();
    return r;
  }
  const auto gv = as_doubles(g);
  const auto cv = as_doubles(*c);
  std::vector<double> ref = gv;
  if (f32) {
    const auto* rt = golden.find("ref64." + g.name);
    if (!rt || rt->dtype != DType::F64 || rt->shape != g.shape) {
      throw FormatError("the float32 golden has no float64 ref64." + g.name + " of shape " +
                        g.shape_str());
    }
    ref = rt->values<double>();
  }
  // A bias gradient sums the same per-row output gradients as its weight's gradient (which
  // weights them by inputs of order 1), so their rounding noise has the same scale. The key bias
  // gradient is 0 in exact arithmetic (softmax ignores a per-row shift) and holds nothing but
  // that noise, so its scale comes from the weight gradient.
  double scale = 0;
  if (g.name.starts_with("grad.") && g.name.ends_with(".bias")) {
    const std::string w = g.name.substr(0, g.name.size() - 4) + "weight";
    if (const auto* wt = golden.find(f32 ? "ref64." + w : w)) {
      for (double x : as_doubles(*wt)) {
        if (std::isfinite(x)) scale = std::max(scale, std::abs(x));
      }
    }
  }
  double max_ref = 0, teo_err = 0, max_abs = 0;
  std::int64_t worst = -1, nonfinite_at = -1, nonfinite_count = 0;
  for (std::size_t i = 0; i < gv.size(); ++i) {
    if (!std::isfinite(gv[i]) || !std::isfinite(ref[i]) || !std::isfinite(cv[i])) {
      if (!same_nonfinite(gv[i], cv[i]) || std::isfinite(gv[i]) != std::isfinite(cv[i])) {
        if (nonfinite_at < 0) nonfinite_at = static_cast<std::int64_t>(i);
        ++nonfinite_count;
      }
      continue;
    }
    max_ref = std::max(max_ref, std::abs(ref[i]));
    teo_err = std::max(teo_err, std::abs(gv[i] - ref[i]));
    const double e = std::abs(cv[i] - ref[i]);
    if (e > max_abs || worst < 0) {
      if (e > max_abs) max_abs = e;
      worst = static_cast<std::int64_t>(i);
    }
  }
  r.max_abs = max_abs;
  r.max_rel = max_ref > 0 ? max_abs / max_ref : (max_abs > 0 ? INFINITY : 0);
  scale = std::max(scale, max_ref);
  r.bound =
      f32 ? opts.k * teo_err + opts.floor_eps * FLT_EPSILON * scale : opts.rtol * scale + opts.atol;
  r.ratio = r.bound > 0 ? max_abs / r.bound : (max_abs > 0 ? INFINITY : 0);
  const bool ok = nonfinite_count == 0 && max_abs <= r.bound;
  r.status = ok ? Status::pass : Status::fail;
  if (nonfinite_count > 0) {
    const auto i = static_cast<std::size_t>(nonfinite_at);
    r.message = std::to_string(nonfinite_count) + " NaN/Inf mismatch(es), first at " +
                index_str(nonfinite_at, g.shape) + ": candidate " + num(cv[i]) + ", golden " +
                num(gv[i]);
  } else if (!ok && worst >= 0) {
    const auto i = static_cast<std::size_t>(worst);
    r.message = "worst at " + index_str(worst, g.shape) + ": candidate " + num(cv[i]) +
                ", reference " + num(ref[i]);
  }
  return r;
}

bool wanted(const std::string& name, Only only) {
  const bool fwd = name.starts_with("act.");
  const bool bwd = name.starts_with("grad.");
  if (only == Only::forward) return fwd;
  if (only == Only::backward) return bwd;
  return fwd || bwd;
}

// Throws FormatError when `golden` is not a teo golden; returns whether it is a float32 case.
bool golden_is_f32(const File& golden) {
  const std::string* fmt = golden.meta("format");
  if (!fmt || *fmt != kFormat) {
    throw FormatError(std::string("not a teo golden file: __metadata__.format is ") +
                      (fmt ? "\"" + *fmt + "\"" : "missing") + ", expected \"" + kFormat + "\"");
  }
  const std::string* cs = golden.meta("case");
  if (!cs) throw FormatError("the golden has no __metadata__.case");
  json cj;
  try {
    cj = json::parse(*cs);
  } catch (const json::exception&) {
    throw FormatError("the golden's __metadata__.case is not valid JSON");
  }
  if (!cj.is_object() || !cj.contains("dtype") || !cj["dtype"].is_string()) {
    throw FormatError("the golden's __metadata__.case has no dtype");
  }
  const auto d = cj["dtype"].get<std::string>();
  if (d != "float32" && d != "float64") throw FormatError("the golden's dtype is " + d);
  return d == "float32";
}

CaseReport not_checked_report(const File& golden, const CheckOptions& opts,
                              const std::string& why) {
  golden_is_f32(golden);
  CaseReport rep;
  for (const auto& t : golden.tensors) {
    if (!wanted(t.name, opts.only)) continue;
    TensorResult r;
    r.name = t.name;
    r.message = why;
    rep.tensors.push_back(r);
    ++rep.not_checked;
  }
  return rep;
}

template <class Fn>
auto with_path(const std::string& path, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const FormatError& e) {
    const std::string msg = e.what();
    if (msg.starts_with(path)) throw;
    throw FormatError(path + ": " + msg);
  }
}

}  // namespace

CaseReport check(const File& golden, const File& candidate, const CheckOptions& opts) {
  const bool f32 = golden_is_f32(golden);
  CaseReport rep;
  for (const auto& g : golden.tensors) {
    if (!wanted(g.name, opts.only)) continue;
    rep.tensors.push_back(check_tensor(golden, g, candidate.find(g.name), f32, opts));
    const auto& r = rep.tensors.back();
    if (r.status == Status::pass) ++rep.passed;
    if (r.status == Status::fail) {
      ++rep.failed;
      if (rep.first_divergence.empty()) rep.first_divergence = stage_name(r.name);
    }
    if (r.status == Status::not_checked) ++rep.not_checked;
  }
  return rep;
}

std::vector<CaseReport> check_paths(const std::string& golden, const std::string& candidate,
                                    const CheckOptions& opts) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(golden, ec)) throw FileError(golden + ": no such file or directory");
  if (!fs::exists(candidate, ec)) throw FileError(candidate + ": no such file or directory");
  std::vector<std::pair<std::string, std::string>> pairs;  // golden file, candidate file
  if (fs::is_directory(golden, ec)) {
    if (!fs::is_directory(candidate, ec)) {
      throw FileError(candidate + ": is a file, but the golden " + golden +
                      " is a directory; give a candidate directory");
    }
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(golden, ec)) {
      if (e.is_regular_file() && e.path().extension() == ".safetensors") {
        names.push_back(e.path().filename().string());
      }
    }
    if (ec) throw FileError(golden + ": cannot list the directory: " + ec.message());
    std::sort(names.begin(), names.end());
    if (names.empty()) throw FileError(golden + ": holds no .safetensors files");
    for (const auto& n : names) {
      pairs.emplace_back((fs::path(golden) / n).string(), (fs::path(candidate) / n).string());
    }
  } else {
    std::string c = candidate;
    if (fs::is_directory(candidate, ec))
      c = (fs::path(candidate) / fs::path(golden).filename()).string();
    pairs.emplace_back(golden, c);
  }
  std::vector<CaseReport> reports;
  for (const auto& [gp, cp] : pairs) {
    const File g = safetensors::read(gp);
    CaseReport rep;
    if (!fs::exists(cp, ec)) {
      rep = with_path(gp, [&] { return not_checked_report(g, opts, "no candidate file"); });
    } else {
      const File c = safetensors::read(cp);
      rep = with_path(gp, [&] { return check(g, c, opts); });
    }
    rep.name = fs::path(gp).filename().string();
    rep.golden_path = gp;
    rep.candidate_path = cp;
    reports.push_back(std::move(rep));
  }
  return reports;
}

namespace {

const char* status_str(Status s) {
  switch (s) {
    case Status::pass:
      return "pass";
    case Status::fail:
      return "FAIL";
    case Status::not_checked:
      return "not checked";
  }
  return "?";
}

std::string sci(double v) {
  std::ostringstream os;
  os << std::scientific << std::setprecision(2) << v;
  return os.str();
}

std::string xml_escape(const std::string& s) {
  std::string o;
  for (char ch : s) {
    switch (ch) {
      case '&':
        o += "&amp;";
        break;
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '"':
        o += "&quot;";
        break;
      case '\'':
        o += "&apos;";
        break;
      default:
        o += ch;
    }
  }
  return o;
}

}  // namespace

void print_text(const std::vector<CaseReport>& reports, std::ostream& out) {
  int passed = 0, failed = 0, not_checked = 0, cases_failed = 0;
  for (const auto& rep : reports) {
    out << "case " << rep.name << "  (golden " << rep.golden_path << ", candidate "
        << rep.candidate_path << ")\n";
    const bool no_file = !rep.tensors.empty() &&
                         rep.not_checked == static_cast<int>(rep.tensors.size()) &&
                         rep.tensors.front().message == "no candidate file";
    if (no_file) {
      out << "  no candidate file: " << rep.not_checked << " tensors not checked\n\n";
      not_checked += rep.not_checked;
      continue;
    }
    out << "  " << std::left << std::setw(44) << "tensor" << std::right << std::setw(11)
        << "max_abs" << std::setw(11) << "max_rel" << std::setw(11) << "err/bound"
        << "  result\n";
    for (const auto& t : rep.tensors) {
      out << "  " << std::left << std::setw(44) << t.name << std::right;
      if (t.status == Status::not_checked) {
        out << std::setw(11) << "-" << std::setw(11) << "-" << std::setw(11) << "-";
      } else {
        out << std::setw(11) << sci(t.max_abs) << std::setw(11) << sci(t.max_rel) << std::setw(11)
            << sci(t.ratio);
      }
      out << "  " << status_str(t.status);
      if (!t.message.empty() && t.status != Status::pass) out << "  (" << t.message << ")";
      out << "\n";
    }
    if (!rep.first_divergence.empty())
      out << "  first divergence: " << rep.first_divergence << "\n";
    out << "  summary: " << rep.passed << " passed, " << rep.failed << " failed, "
        << rep.not_checked << " not checked\n\n";
    passed += rep.passed;
    failed += rep.failed;
    not_checked += rep.not_checked;
    cases_failed += rep.failed > 0;
  }
  out << "total: " << reports.size() << " case(s), " << cases_failed
      << " failing; tensors: " << passed << " passed, " << failed << " failed, " << not_checked
      << " not checked\n";
}

std::string junit_xml(const std::vector<CaseReport>& reports) {
  std::ostringstream o;
  int tests = 0, failures = 0, skipped = 0;
  for (const auto& r : reports) {
    tests += static_cast<int>(r.tensors.size());
    failures += r.failed;
    skipped += r.not_checked;
  }
  o << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  o << "<testsuites name=\"teo golden check\" tests=\"" << tests << "\" failures=\"" << failures
    << "\" skipped=\"" << skipped << "\">\n";
  for (const auto& r : reports) {
    o << "  <testsuite name=\"" << xml_escape(r.name) << "\" tests=\"" << r.tensors.size()
      << "\" failures=\"" << r.failed << "\" skipped=\"" << r.not_checked << "\">\n";
    if (!r.first_divergence.empty()) {
      o << "    <properties><property name=\"first_divergence\" value=\""
        << xml_escape(r.first_divergence) << "\"/></properties>\n";
    }
    for (const auto& t : r.tensors) {
      o << "    <testcase classname=\"" << xml_escape(r.name) << "\" name=\"" << xml_escape(t.name)
        << "\">";
      const std::string detail = "max_abs=" + sci(t.max_abs) + " max_rel=" + sci(t.max_rel) +
                                 " bound=" + sci(t.bound) + " err/bound=" + sci(t.ratio);
      if (t.status == Status::fail) {
        o << "<failure message=\"" << xml_escape(t.message.empty() ? detail : t.message) << "\">"
          << xml_escape(detail) << "</failure>";
      } else if (t.status == Status::not_checked) {
        o << "<skipped message=\"" << xml_escape(t.message) << "\"/>";
      }
      o << "</testcase>\n";
    }
    o << "  </testsuite>\n";
  }
  o << "</testsuites>\n";
  return o.str();
}

std::string json_report(const std::vector<CaseReport>& reports) {
  nlohmann::ordered_json cases = nlohmann::ordered_json::array();
  int passed = 0, failed = 0, not_checked = 0;
  // Non-finite numbers are not JSON; an infinite ratio is written as null.
  auto number = [](double v) {
    return std::isfinite(v) ? nlohmann::ordered_json(v) : nlohmann::ordered_json(nullptr);
  };
  for (const auto& r : reports) {
    nlohmann::ordered_json c;
    c["name"] = r.name;
    c["golden"] = r.golden_path;
    c["candidate"] = r.candidate_path;
    c["first_divergence"] = r.first_divergence.empty() ? nlohmann::ordered_json(nullptr)
                                                       : nlohmann::ordered_json(r.first_divergence);
    c["passed"] = r.passed;
    c["failed"] = r.failed;
    c["not_checked"] = r.not_checked;
    auto ts = nlohmann::ordered_json::array();
    for (const auto& t : r.tensors) {
      nlohmann::ordered_json tj;
      tj["name"] = t.name;
      tj["status"] = t.status == Status::pass   ? "pass"
                     : t.status == Status::fail ? "fail"
                                                : "not_checked";
      if (t.status != Status::not_checked) {
        tj["max_abs"] = number(t.max_abs);
        tj["max_rel"] = number(t.max_rel);
        tj["bound"] = number(t.bound);
        tj["ratio"] = number(t.ratio);
      }
      if (!t.message.empty()) tj["message"] = t.message;
      ts.push_back(std::move(tj));
    }
    c["tensors"] = std::move(ts);
    cases.push_back(std::move(c));
    passed += r.passed;
    failed += r.failed;
    not_checked += r.not_checked;
  }
  nlohmann::ordered_json j;
  j["format"] = "teo-golden-check/1";
  j["passed"] = passed;
  j["failed"] = failed;
  j["not_checked"] = not_checked;
  j["cases"] = std::move(cases);
  return j.dump(2) + "\n";
}

}  // namespace teo::golden
