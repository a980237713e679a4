// The logistic sigmoid the MoE layers share (the router's scores, the clamped SwiGLU's gate),
// computed from exp of a non-positive value only, so that it never overflows.
#pragma once

#include <cmath>

namespace teo::detail {

template <class Real>
Real sigmoid(Real x) {
  if (x >= 0) return Real(1) / (Real(1) + std::exp(-x));
  const Real e = std::exp(x);
  return e / (Real(1) + e);
}

}  // namespace teo::detail
