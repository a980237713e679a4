// What the checker's tests share: a report's row by name, a file's tensor to change, options
// judging as fp8, and an ill-conditioned case.
#pragma once

#include <stdexcept>
#include <string>

#include "teo/golden.hpp"
#include "teo/precision.hpp"
#include "teo/safetensors.hpp"

namespace teo::golden::test_support {

// The report's row of tensor `name`; std::runtime_error when it has none.
inline const TensorResult& result(const CaseReport& r, const std::string& name) {
  for (const auto& t : r.tensors)
    if (t.name == name) return t;
  throw std::runtime_error("no tensor " + name);
}

// The tensor `name` of f, to change in place, or null.
inline safetensors::Tensor* find_mut(safetensors::File& f, const std::string& name) {
  for (auto& t : f.tensors)
    if (t.name == name) return &t;
  return nullptr;
}

// Check options judging the candidate as fp8, every other option at its default.
inline CheckOptions fp8() {
  CheckOptions o;
  o.precision = Precision::fp8;
  return o;
}

// `base` made ill-conditioned in float32: post-norm with d_model 2, so every LayerNorm output is
// +-1 and max pooling ties. Generation refuses it without --allow-ill-conditioned.
inline Case ill_conditioned(Case base) {
  base.config.d_model = 2;
  base.config.attention.num_heads = 1;
  base.config.attention.num_kv_heads.reset();
  base.config.norms.norm_first = false;
  base.config.head.pooling = Pooling::max;
  base.dtype = "float32";
  base.precision.reset();
  return base;
}

}  // namespace teo::golden::test_support
