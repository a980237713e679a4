// Internal to the op cases: values quantized in the case's own arithmetic (a float32 case:
// float32 operations on float32 values; a float64 case: float64), as a quantized KV cache's append
// and W8A8's activations define them (docs/golden-format.md), and the other rounding a faithful
// kernel may take at a near tie (OpDef::alternates).
#pragma once

#include <algorithm>
#include <cmath>

#include "golden/ops/op.hpp"
#include "teo/fp8.hpp"

namespace teo::golden::ops {

// x rounded to fp8 format f from a double, to nearest with ties to even, saturating at the
// format's largest value, with no rounding on the way.
inline double round_fp8(Fp8Format f, double x) {
  if (x == 0) return x;
  const int min_exp = f == Fp8Format::e4m3 ? -6 : -14, mbits = f == Fp8Format::e4m3 ? 3 : 2;
  int e = 0;
  std::frexp(x, &e);
  const double step = std::ldexp(1.0, std::max(e - 1, min_exp) - mbits);
  const double r = std::nearbyint(std::abs(x) / step) * step;
  return std::copysign(std::min(r, static_cast<double>(fp8_max(f))), x);
}

// The fp8 code of x under scale s: x / s in the case's arithmetic, rounded to f, saturating.
inline double fp8_code(Fp8Format f, double x, float s, bool f32) {
  return round_fp8(f, f32 ? static_cast<double>(static_cast<float>(x) / s) : x / s);
}

// int8: the scale of n values, amax / 127 in the case's arithmetic, stored as float32.
template <class T>
float int8_scale(const T* x, index_t n, bool f32) {
  double amax = 0;
  for (index_t i = 0; i < n; ++i) amax = std::max(amax, std::abs(static_cast<double>(x[i])));
  return f32 ? static_cast<float>(amax) / 127.0f : static_cast<float>(amax / 127.0);
}

// ... and a value's code: x / s in the case's arithmetic, to nearest with ties to even, clamped to
// [-127, 127]; 0 under a scale of 0 (all zeros).
inline double int8_code(double x, float s, bool f32) {
  if (!(s > 0)) return 0;
  const double q = f32 ? static_cast<double>(static_cast<float>(x) / s) : x / s;
  return std::clamp(std::nearbyint(q), -127.0, 127.0);
}

// The other of the two codes around quotient q (the exact quotient, in float64; `step` apart from
// `lo` up) where q lies within kTieTolerance of their midpoint, else NaN. `code` is the golden's
// (the rounding of the quotient in the case's arithmetic, which at a midpoint may be either).
inline double other_rounding_between(double q, double lo, double step, double code) {
  const double a = std::abs(q);
  if (std::abs(a - (lo + step / 2)) > kTieTolerance * a) return NAN;
  return std::copysign(std::abs(code) == lo ? lo + step : lo, q);
}

// fp8: the other code of exact quotient q at a near tie, NaN elsewhere (and where it saturates).
inline double other_fp8_rounding(Fp8Format f, double q, double code) {
  const double a = std::abs(q);
  if (a >= fp8_max(f) || a == 0) return NAN;
  const int min_exp = f == Fp8Format::e4m3 ? -6 : -14, mbits = f == Fp8Format::e4m3 ? 3 : 2;
  int e = 0;
  std::frexp(a, &e);
  const double step = std::ldexp(1.0, std::max(e - 1, min_exp) - mbits);
  return other_rounding_between(q, std::floor(a / step) * step, step, code);
}

// int8: the other integer of exact quotient q at a near tie, NaN elsewhere (and beyond +-127).
inline double other_int8_rounding(double q, double code) {
  const double a = std::abs(q);
  if (a >= 127) return NAN;
  return other_rounding_between(q, std::floor(a), 1.0, code);
}

}  // namespace teo::golden::ops
