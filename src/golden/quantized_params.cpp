// A quantized model's weights (docs/quantization.md, "Quantized models"): packed by teo's quantizer
// from the drawn parameters, or read from a checkpoint's packing, and the parameters set to the
// exact dequantized values that the golden computes with.
#include "golden/quantized_params.hpp"

#include <cmath>

#include "teo/contract.hpp"
#include "teo/rng.hpp"

namespace teo::golden::detail {

namespace {

template <class Real>
std::map<std::string, Tensor<Real>*> by_name(Params<Real>& params) {
  std::map<std::string, Tensor<Real>*> out;
  params.visit([&](const std::string& n, Tensor<Real>& t) { out[n] = &t; });
  return out;
}

}  // namespace

template <class Real>
void dequantize_params(Params<Real>& params, const ops::Packed& packed, const std::string& where) {
  const ModelConfig& cfg = params.config;
  auto tensors = by_name(params);
  for (const auto& w : contract::quantized(cfg)) {
    const auto x = ops::dequantize_weight(cfg.quantization->format, "quant." + w.name, w.rows,
                                          w.cols, packed, w.lead, where);
    Tensor<Real>& t = *tensors.at(w.name);
    if (static_cast<index_t>(x.size()) != t.numel())
      throw std::logic_error("a quantized weight of another size than its parameter");
    for (index_t i = 0; i < t.numel(); ++i) {
      const double v = x[static_cast<std::size_t>(i)];
      const Real r = static_cast<Real>(v);
      if (static_cast<double>(r) != v) {
        throw ConfigError("quantization " + cfg.quantization->format.name() + ": " + w.name +
                          " dequantizes to " + std::to_string(v) + " (element " +
                          std::to_string(i) +
                          "), which float32 cannot hold exactly: make the case float64");
      }
      t[i] = r;
    }
  }
}

template <class Real>
ops::Packed quantize_params(Params<Real>& params, std::uint64_t seed) {
  const ModelConfig& cfg = params.config;
  auto tensors = by_name(params);
  ops::Packed packed;
  for (const auto& w : contract::quantized(cfg)) {
    const Tensor<Real>& t = *tensors.at(w.name);
    std::vector<double> x(static_cast<std::size_t>(t.numel()));
    for (index_t i = 0; i < t.numel(); ++i) x[static_cast<std::size_t>(i)] = t[i];
    // an act-order permutation of its own for each weight
    ops::pack_weight(cfg.quantization->format, "quant." + w.name, w.rows, w.cols, x,
                     seed ^ rng::stream_id("quant." + w.name), packed, w.lead);
  }
  dequantize_params(params, packed, "teo's quantizer");
  return packed;
}

template void dequantize_params(Params<float>&, const ops::Packed&, const std::string&);
template void dequantize_params(Params<double>&, const ops::Packed&, const std::string&);
template ops::Packed quantize_params(Params<float>&, std::uint64_t);
template ops::Packed quantize_params(Params<double>&, std::uint64_t);

}  // namespace teo::golden::detail
