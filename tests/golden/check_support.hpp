// What the checker's tests share: a report's row by name, and options judging as fp8.
#pragma once

#include <stdexcept>
#include <string>

#include "teo/golden.hpp"
#include "teo/precision.hpp"

namespace teo::golden::test_support {

// The report's row of tensor `name`; std::runtime_error when it has none.
inline const TensorResult& result(const CaseReport& r, const std::string& name) {
  for (const auto& t : r.tensors)
    if (t.name == name) return t;
  throw std::runtime_error("no tensor " + name);
}

// Check options judging the candidate as fp8, every other option at its default.
inline CheckOptions fp8() {
  CheckOptions o;
  o.precision = Precision::fp8;
  return o;
}

}  // namespace teo::golden::test_support
