// A candidate's tensors back in teo's names, and a quantized model's weights in a family's
// checkpoint (docs/quantization.md, "Quantized
// models"): each weight's packed tensors under its dense name's module (quant::weight_part_name),
// the experts stacked or one tensor each as the map's rule says, a fused tensor's parts split by
// output rows; and the Hugging Face quantization_config of each format.
#include <cstring>

#include <nlohmann/json.hpp>

#include "golden/names_internal.hpp"
#include "teo/contract.hpp"

namespace teo::names::detail {

namespace st = safetensors;

namespace {

// One part of a placed quantized weight: the golden's tensor name, the checkpoint's, the part's
// shape for one matrix, and where the slice lies.
struct PartPlace {
  std::string golden, checkpoint;
  quant::WeightPart part;    // of one matrix (rows, cols)
  std::int64_t lead = 0;     // the golden's stack (E), 0 for a matrix
  std::int64_t expert = -1;  // a per-expert rule's expert, else -1 (the whole stack)
  std::int64_t parts = 1, index = 0;
  bool interleave = false;
};

std::int64_t numel(const std::vector<std::int64_t>& s) {
  std::int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

std::vector<PartPlace> part_places(const NameMap& map, const ModelConfig& cfg,
                                   const std::vector<Placed>& placed) {
  std::map<std::string, contract::QuantizedWeight> q;
  for (const auto& w : contract::quantized(cfg)) q[w.name] = w;
  const quant::WeightFormat f = cfg.quantization ? cfg.quantization->format : quant::WeightFormat{};
  if (!q.empty() && f.kind == quant::WeightFormat::Kind::gguf) {
    throw ConfigError("name map " + map.family + ": " + f.name() +
                      " weights are GGUF blocks, which a safetensors checkpoint does not hold");
  }
  std::vector<PartPlace> out;
  for (const auto& p : placed) {
    const auto it = q.find(p.teo);
    if (it == q.end()) continue;
    const auto& w = it->second;
    const Rule& r = *p.rule;
    const bool per_expert = w.lead > 0 && p.shape.size() == 2;
    if (r.parts > 1) {
      // a packed weight is (out, in): only a split of the output rows moves whole packed rows
      const bool rows = r.transpose ? r.dim == 1 : r.dim == 0;
      const bool row_major =
          f.kind == quant::WeightFormat::Kind::gguf || f.tensor == quant::TensorFormat::int8 ||
          f.tensor == quant::TensorFormat::mxfp4 || f.tensor == quant::TensorFormat::nvfp4;
      if (!rows || !row_major) {
        throw ConfigError("name map " + map.family + " fuses " + p.teo + " into " + p.checkpoint +
                          (rows ? "" : " along its input dimension") + ", which " + f.name() +
                          " cannot split: its packing is not by output rows");
      }
    }
    const std::int64_t e = per_expert ? p.offset / p.count : -1;
    for (const auto& part : quant::weight_parts(f, w.rows, w.cols)) {
      out.push_back({"quant." + quant::weight_part_name(f, w.name, part.role),
                     quant::weight_part_name(f, p.checkpoint, part.role), part, w.lead, e, r.parts,
                     r.part, r.interleave});
    }
  }
  return out;
}

// The checkpoint tensor's shape: the part's, its rows times the parts, the stack first unless
// each expert has its own tensor.
std::vector<std::int64_t> checkpoint_part_shape(const PartPlace& pp) {
  std::vector<std::int64_t> s = pp.part.shape;
  if (pp.parts > 1 && !s.empty()) s[0] *= pp.parts;
  if (pp.lead > 0 && pp.expert < 0) s.insert(s.begin(), pp.lead);
  return s;
}

// Calls run(golden offset, checkpoint offset, bytes) for each run of the slice's bytes in the
// golden's tensor (the whole stack) and the checkpoint's. A fused part's row r is the
// checkpoint's r * parts + index (interleaved) or index * rows + r; a scalar (NVFP4's global
// scale) is every part's.
template <class Run>
void for_each_run(const PartPlace& pp, std::size_t size, Run&& run) {
  const std::int64_t matrices = pp.lead > 0 && pp.expert < 0 ? pp.lead : 1;
  const std::int64_t per = numel(pp.part.shape) * static_cast<std::int64_t>(size);
  const std::int64_t rows = pp.part.shape.empty() ? 1 : pp.part.shape[0];
  const std::int64_t row = rows > 0 ? per / rows : 0;
  for (std::int64_t m = 0; m < matrices; ++m) {
    const std::int64_t g = (pp.expert >= 0 ? pp.expert : m) * per;
    if (pp.part.shape.empty()) {
      run(g, m * per, per);
      continue;
    }
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t cr = pp.interleave ? r * pp.parts + pp.index : pp.index * rows + r;
      run(g + r * row, m * per * pp.parts + cr * row, row);
    }
  }
}

}  // namespace

void read_packed(const st::File& checkpoint, const NameMap& map, const ModelConfig& cfg,
                 const std::vector<Placed>& placed,
                 std::map<std::string, std::vector<unsigned char>>& packed,
                 std::set<std::string>& read) {
  for (const auto& pp : part_places(map, cfg, placed)) {
    const st::Tensor* t = find_in(checkpoint, map, pp.checkpoint);
    if (!t) {
      throw FormatError("the checkpoint has no tensor " + pp.checkpoint + " (" +
                        cfg.quantization->format.name() + "'s " + pp.part.role + " of teo's " +
                        pp.golden.substr(6) + ", " + map.family + ")");
    }
    if (t->dtype != pp.part.dtype || t->shape != checkpoint_part_shape(pp)) {
      throw FormatError("checkpoint tensor " + t->name + " is " + st::dtype_name(t->dtype) + " " +
                        shape_str(t->shape) + ", the config's " + cfg.quantization->format.name() +
                        " gives " + st::dtype_name(pp.part.dtype) + " " +
                        shape_str(checkpoint_part_shape(pp)));
    }
    read.insert(t->name);
    const std::size_t size = st::dtype_size(t->dtype);
    auto& g = packed[pp.golden];
    g.resize(static_cast<std::size_t>(numel(pp.part.shape) * std::max<std::int64_t>(pp.lead, 1)) *
             size);
    const auto c = t->data();
    for_each_run(pp, size, [&](std::int64_t go, std::int64_t co, std::int64_t n) {
      std::memcpy(g.data() + go, c.data() + co, static_cast<std::size_t>(n));
    });
  }
}

void write_packed(const st::File& golden, const NameMap& map, const ModelConfig& cfg,
                  const std::vector<Placed>& placed, st::File& out) {
  std::vector<std::string> order;
  struct Out {
    st::DType dtype;
    std::vector<std::int64_t> shape;
    std::vector<unsigned char> bytes;
    std::vector<bool> set;  // a scalar part's: written once, equal for every part
  };
  std::map<std::string, Out> outs;
  for (const auto& pp : part_places(map, cfg, placed)) {
    const st::Tensor* t = golden.find(pp.golden);
    if (!t) throw FormatError("the golden has no " + pp.golden);
    const std::size_t size = st::dtype_size(t->dtype);
    auto [it, fresh] = outs.try_emplace(pp.checkpoint);
    Out& o = it->second;
    if (fresh) {
      order.push_back(pp.checkpoint);
      o.dtype = t->dtype;
      o.shape = checkpoint_part_shape(pp);
      o.bytes.assign(static_cast<std::size_t>(numel(o.shape)) * size, 0);
    }
    const auto g = t->data();
    if (pp.part.shape.empty() && !fresh) {
      // a fused weight has one global scale: its parts' must agree
      bool same = true;
      for_each_run(pp, size, [&](std::int64_t go, std::int64_t co, std::int64_t n) {
        same = same &&
               std::memcmp(g.data() + go, o.bytes.data() + co, static_cast<std::size_t>(n)) == 0;
      });
      if (!same) {
        throw FormatError("the fused tensor " + pp.checkpoint + " has one " + pp.part.role +
                          ", but its parts' differ (" + pp.golden +
                          "): " + cfg.quantization->format.name() + " cannot store them fused");
      }
      continue;
    }
    for_each_run(pp, size, [&](std::int64_t go, std::int64_t co, std::int64_t n) {
      std::memcpy(o.bytes.data() + co, g.data() + go, static_cast<std::size_t>(n));
    });
  }
  for (const auto& n : order) {
    const Out& o = outs.at(n);
    out.add(n, o.dtype, o.shape, o.bytes.data(), o.bytes.size());
  }
}

}  // namespace teo::names::detail

namespace teo::names::detail {

namespace {

std::string lower(std::string s) {
  for (auto& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

}  // namespace

nlohmann::json hf_quantization_config(const QuantizationConfig& q) {
  const quant::WeightFormat& f = q.format;
  if (f.kind == quant::WeightFormat::Kind::tensor) {
    switch (f.tensor) {
      case quant::TensorFormat::gptq:
        return {{"quant_method", "gptq"},
                {"bits", 4},
                {"group_size", f.group_size},
                {"desc_act", f.act_order},
                {"sym", false},
                {"checkpoint_format", f.zero_offset == 1 ? "gptq" : "gptq_v2"}};
      case quant::TensorFormat::awq:
        return {{"quant_method", "awq"},
                {"bits", 4},
                {"group_size", f.group_size},
                {"version", "gemm"},
                {"zero_point", true}};
      case quant::TensorFormat::mxfp4:
        return {{"quant_method", "mxfp4"}};
      case quant::TensorFormat::nvfp4:
        return {{"quant_method", "modelopt"}, {"quant_algo", "NVFP4"}, {"group_size", 16}};
      case quant::TensorFormat::int8:
        break;
    }
  }
  throw ConfigError("no Hugging Face quantization_config reads " + f.name() +
                    " weights as teo stores them (gptq, awq, mxfp4 and nvfp4 have one)");
}

nlohmann::json quantization_from_hf(const nlohmann::json& qc) {
  const auto fail = [](const std::string& why) {
    throw ConfigError("config.json quantization_config: " + why);
  };
  if (!qc.is_object() || !qc.contains("quant_method") || !qc.at("quant_method").is_string())
    fail("must be an object with a quant_method");
  const std::string method = lower(qc.at("quant_method").get<std::string>());
  const auto get = [&](const char* k, const nlohmann::json& dflt) {
    return qc.contains(k) ? qc.at(k) : dflt;
  };
  nlohmann::json out;
  if (method == "gptq" || method == "awq") {
    if (get("bits", 4) != 4) fail(method + " with bits " + get("bits", 4).dump() + ": teo reads 4");
    const nlohmann::json g = get("group_size", 128);
    if (!g.is_number_integer() || g.get<std::int64_t>() < 1)
      fail("group_size " + g.dump() + ": teo reads groups of a positive size");
    out = {{"weight_format", method}, {"group_size", g}};
    if (method == "gptq") {
      out["act_order"] = get("desc_act", false).is_boolean() && get("desc_act", false).get<bool>();
      const std::string cf = lower(get("checkpoint_format", "gptq").get<std::string>());
      if (cf != "gptq" && cf != "gptq_v2")
        fail("checkpoint_format \"" + cf + "\" is not gptq or gptq_v2");
      out["zero_offset"] = cf == "gptq" ? 1 : 0;
    } else {
      if (lower(get("version", "gemm").get<std::string>()) != "gemm")
        fail("awq version " + get("version", "gemm").dump() + ": teo reads AutoAWQ's GEMM layout");
      if (get("zero_point", true) != true) fail("awq without zero_point is not read");
    }
  } else if (method == "mxfp4") {
    out = {{"weight_format", "mxfp4"}};
  } else if (method == "modelopt") {
    if (get("quant_algo", "") != "NVFP4")
      fail("modelopt's quant_algo " + get("quant_algo", "").dump() + ": teo reads NVFP4");
    if (get("group_size", 16) != 16)
      fail("NVFP4's group_size is 16, got " + get("group_size", 16).dump());
    out = {{"weight_format", "nvfp4"}};
  } else {
    fail("quant_method \"" + method + "\" is not read (gptq, awq, mxfp4, modelopt NVFP4)");
  }
  return out;
}

}  // namespace teo::names::detail

namespace teo::names {

namespace st = safetensors;
using detail::checkpoint_index;
using detail::checkpoint_shape;
using detail::find_in;
using detail::place;
using detail::shape_str;

st::File candidate_in_teo_names(const st::File& candidate, const NameMap& map,
                                const ModelConfig& cfg) {
  const auto placed = place(map, cfg);
  st::File out;
  out.metadata = candidate.metadata;
  std::set<std::string> used;
  // role + teo name -> the parameter assembled from its slices (one, or one per expert)
  struct Assembled {
    std::string teo;  // the parameter's name
    st::DType dtype;
    std::vector<std::int64_t> shape;
    std::vector<unsigned char> bytes;
    std::int64_t parts = 0;
  };
  std::vector<std::string> order;
  std::map<std::string, Assembled> assembled;
  std::map<std::string, std::int64_t> slices;  // teo name -> its placed slices
  for (const auto& p : placed) ++slices[p.teo];
  for (const auto& p : placed) {
    for (const char* role : {"grad.", "param."}) {
      const st::Tensor* t = find_in(candidate, map, p.checkpoint, role);
      if (!t) continue;
      if (t->shape != checkpoint_shape(p)) {
        throw FormatError("candidate tensor " + t->name + " has shape " + shape_str(t->shape) +
                          ", expected " + shape_str(checkpoint_shape(p)) + " (teo's " + role +
                          p.teo + ")");
      }
      used.insert(t->name);
      const std::size_t size = st::dtype_size(t->dtype);
      const std::string name = role + p.teo;
      auto [it, fresh] = assembled.try_emplace(name);
      Assembled& a = it->second;
      if (fresh) {
        order.push_back(name);
        a.teo = p.teo;
        a.dtype = t->dtype;
        a.shape = p.full;
        a.bytes.assign(static_cast<std::size_t>(Shape(p.full).numel()) * size, 0);
      } else if (a.dtype != t->dtype) {
        throw FormatError("candidate tensor " + t->name + " is " + st::dtype_name(t->dtype) +
                          ", another expert's slice of teo's " + name + " is " +
                          st::dtype_name(a.dtype));
      }
      ++a.parts;
      const auto src = t->data();
      for (std::int64_t e = 0; e < p.count; ++e) {
        std::memcpy(a.bytes.data() + static_cast<std::size_t>(p.offset + e) * size,
                    src.data() + static_cast<std::size_t>(checkpoint_index(p, e)) * size, size);
      }
    }
  }
  for (const auto& name : order) {
    const Assembled& a = assembled.at(name);
    // a parameter some of whose experts the candidate lacks is missing, not partly zero
    if (a.parts == slices.at(a.teo))
      out.add(name, a.dtype, a.shape, a.bytes.data(), a.bytes.size());
  }
  for (const auto& t : candidate.tensors)
    if (!used.contains(t.name)) out.add(t.name, t.dtype, t.shape, t.data().data(), t.data().size());
  return out;
}

nlohmann::json with_checkpoint_targets(const safetensors::File& checkpoint, const NameMap& map,
                                       nlohmann::json config) {
  if (!config.contains("quantization") || !config.at("quantization").is_object() ||
      config.at("quantization").contains("targets"))
    return config;
  // the model without its quantization: which of its linear weights does the checkpoint pack?
  nlohmann::json model = config;
  model.erase("quantization");
  model.erase("case");
  model.erase("name");
  model.erase("description");
  const ModelConfig cfg = ModelConfig::from_json(model);
  const quant::WeightFormat f = quant::parse_weight_format(
      config["quantization"].value("weight_format", ""), "quantization.weight_format");
  std::set<std::string> all, present;
  for (const auto& w : contract::quantizable(cfg)) all.insert(w);
  // the first part's name
  const std::string role = f.kind == quant::WeightFormat::Kind::gguf ? "weight"
                           : f.grouped()                             ? "qweight"
                           : f.tensor == quant::TensorFormat::mxfp4  ? "blocks"
                                                                     : "weight";
  for (const auto& p : detail::place(map, cfg)) {
    if (!all.contains(p.teo)) continue;
    // NVFP4's and int8's packed values keep the dense name, in an integer dtype
    const safetensors::Tensor* t =
        detail::find_in(checkpoint, map, quant::weight_part_name(f, p.checkpoint, role));
    if (t && !safetensors::is_float(t->dtype)) present.insert(p.teo);
  }
  if (present.empty()) {
    throw FormatError("the config says " + f.name() + ", but the checkpoint has no weight packed " +
                      "so under " + map.family + "'s names");
  }
  if (present != all) config["quantization"]["targets"] = present;
  return config;
}

}  // namespace teo::names
