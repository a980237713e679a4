// Internal: what model.cpp (forward, backward) and params.cpp (parameters, validation) share.
#pragma once

#include <string>

#include "teo/config.hpp"
#include "teo/tensor.hpp"

namespace teo::detail {

// The shape of parameter `name` (a contract name such as "layers.0.fc1.weight") under `c`.
Shape param_shape(const EncoderConfig& c, const std::string& name);

}  // namespace teo::detail
