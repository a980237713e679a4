// Internal to the golden generator: a quantized model's weights (src/golden/quantized_params.cpp).
#pragma once

#include <cstdint>
#include <string>

#include "golden/ops/weight_format.hpp"
#include "teo/model.hpp"

namespace teo::golden::detail {

// The packed tensors of params.config's quantized weights (contract::packed's names, "quant."
// and the parameter's), by teo's quantizer from the drawn values (gptq's act order seeded by seed
// and the weight's name); params are set to the packing's exact dequantized values.
template <class Real>
ops::Packed quantize_params(Params<Real>& params, std::uint64_t seed);

// params' quantized weights set to the exact values of `packed` (a checkpoint's, `where` in the
// errors). FormatError for a packing that does not read; ConfigError for a float32 case whose
// values float32 cannot hold (NVFP4's, in general).
template <class Real>
void dequantize_params(Params<Real>& params, const ops::Packed& packed, const std::string& where);

}  // namespace teo::golden::detail
