// A model config's quantized weights and their packed tensors in the contract
// (teo/contract.hpp, docs/quantization.md "Quantized models").
#include <fnmatch.h>

#include <algorithm>
#include <stdexcept>

#include "teo/contract.hpp"

namespace teo::contract {

namespace {

// A linear weight of the layers, which a quantization may store packed: a matrix (or the experts'
// stack of matrices) of attention, the FFN, the experts or the shared experts; not the router's
// or the shared experts' gate (they choose, and checkpoints keep them dense), nor a norm's.
bool quantizable(const TensorSpec& p) {
  std::string tail;
  for (const char* prefix : {"layers.", "decoder.layers."}) {
    const std::string pre(prefix);
    if (!p.name.starts_with(pre)) continue;
    const auto dot = p.name.find('.', pre.size());
    if (dot != std::string::npos) tail = p.name.substr(dot + 1);
  }
  if (tail.empty()) return false;
  if (tail.starts_with("moe.experts.w_")) return p.shape.size() == 3;
  if (tail.starts_with("moe.gate.") || tail.starts_with("moe.shared_gate.")) return false;
  return p.shape.size() == 2 && tail.ends_with(".weight") && tail.find("norm") == std::string::npos;
}

bool matches(const std::string& glob, const std::string& name) {
  return fnmatch(glob.c_str(), name.c_str(), 0) == 0;
}

contract::DTypeRule rule_of(safetensors::DType d) {
  using D = safetensors::DType;
  switch (d) {
    case D::I8:
      return DTypeRule::i8;
    case D::I32:
      return DTypeRule::i32;
    case D::F16:
      return DTypeRule::f16;
    case D::F32:
      return DTypeRule::f32;
    case D::U8:
      return DTypeRule::u8;
    case D::F8_E4M3:
      return DTypeRule::f8_e4m3;
    default:
      throw std::logic_error("a packed part of an unexpected dtype");
  }
}

}  // namespace

std::vector<QuantizedWeight> quantized(const ModelConfig& cfg) {
  std::vector<QuantizedWeight> out;
  if (!cfg.quantization) return out;
  const QuantizationConfig& q = *cfg.quantization;
  std::vector<bool> used(q.targets.size(), false);
  for (const auto& p : params(cfg)) {
    if (!quantizable(p)) continue;
    bool chosen = q.targets.empty();
    for (std::size_t g = 0; g < q.targets.size(); ++g) {
      if (matches(q.targets[g], p.name)) chosen = true, used[g] = true;
    }
    if (!chosen) continue;
    QuantizedWeight w{p.name, p.shape.size() == 3 ? p.shape[0] : 0, p.shape[p.shape.size() - 2],
                      p.shape.back()};
    const std::string why = quant::weight_shape_problem(q.format, w.rows, w.cols, p.name);
    if (!why.empty())
      throw ConfigError("quantization.weight_format " + q.format.name() + ": " + why);
    out.push_back(std::move(w));
  }
  for (std::size_t g = 0; g < q.targets.size(); ++g) {
    if (!used[g]) {
      throw ConfigError("quantization.targets \"" + q.targets[g] +
                        "\" names no linear weight of the layers (attention, FFN or experts) " +
                        "of this config");
    }
  }
  if (out.empty()) throw ConfigError("quantization: this config has no linear weight to quantize");
  return out;
}

std::vector<std::string> quantizable(const ModelConfig& cfg) {
  std::vector<std::string> out;
  for (const auto& p : params(cfg))
    if (quantizable(p)) out.push_back(p.name);
  return out;
}

bool is_quantized(const ModelConfig& cfg, const std::string& name) {
  if (!cfg.quantization) return false;
  const auto q = quantized(cfg);
  return std::any_of(q.begin(), q.end(), [&](const QuantizedWeight& w) { return w.name == name; });
}

std::vector<TensorSpec> packed(const ModelConfig& cfg) {
  std::vector<TensorSpec> out;
  for (const auto& w : quantized(cfg)) {
    const quant::WeightFormat& f = cfg.quantization->format;
    for (auto& part : quant::weight_parts(f, w.rows, w.cols)) {
      if (w.lead > 0) part.shape.insert(part.shape.begin(), w.lead);
      TensorSpec t{"quant." + quant::weight_part_name(f, w.name, part.role),
                   Role::packed,
                   rule_of(part.dtype),
                   {},
                   part.shape};
      for (const auto d : part.shape) t.dims.push_back(std::to_string(d));
      out.push_back(std::move(t));
    }
  }
  return out;
}

}  // namespace teo::contract
