// The fp8 formats and E8M0 scales: names, constants, and the scalar rounding (core/float_bits.hpp;
// the array forms are kernels/convert.cpp). Quantization and the product are in
// kernels/fp8_gemm.cpp.
#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>

#include "core/float_bits.hpp"
#include "teo/errors.hpp"
#include "teo/fp8.hpp"

namespace teo {

const char* to_string(Fp8Format f) {
  return f == Fp8Format::e4m3 ? "e4m3" : "e5m2";
}

Fp8Format parse_fp8_format(const std::string& name, const std::string& what) {
  if (name == "e4m3") return Fp8Format::e4m3;
  if (name == "e5m2") return Fp8Format::e5m2;
  throw ConfigError(what + " must be e4m3 or e5m2, got \"" + name + "\"");
}

float fp8_max(Fp8Format f) {
  return f == Fp8Format::e4m3 ? 448.0f : 57344.0f;
}

int fp8_emax(Fp8Format f) {
  return f == Fp8Format::e4m3 ? 8 : 15;
}

double unit_roundoff(Fp8Format f) {
  return f == Fp8Format::e4m3 ? 0.0625 : 0.125;
}

float round_to_fp8(Fp8Format f, bool saturate, float x) {
  using B = bits::ScalarFp8;
  return std::bit_cast<float>(
      B::round_bits(std::bit_cast<std::int32_t>(x), B::format(f), saturate));
}

std::uint8_t to_fp8_bits(Fp8Format f, bool saturate, float x) {
  using B = bits::ScalarFp8;
  const auto F = B::format(f);
  const std::int32_t c = B::code(B::round_bits(std::bit_cast<std::int32_t>(x), F, saturate), F);
  return static_cast<std::uint8_t>(c & 0xFF);
}

float from_fp8_bits(Fp8Format f, std::uint8_t b) {
  using B = bits::ScalarFp8;
  return std::bit_cast<float>(B::widen_bits(b, B::format(f)));
}

std::uint8_t to_e8m0(float x, E8m0Rounding r) {
  return static_cast<std::uint8_t>(
      bits::ScalarFp8::e8m0(std::bit_cast<std::int32_t>(x), 0, r == E8m0Rounding::up));
}

float e8m0_value(std::uint8_t b) {
  if (b == 0xFF) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(b) - 127);  // 2^-127 is a float subnormal: exact
}

std::uint8_t mx_scale(float amax, Fp8Format f) {
  // floor(log2 amax) - emax, from the exponent field; a non-finite amax has no scale.
  if (!std::isfinite(amax)) return 0xFF;
  const float a = std::fabs(amax);
  return static_cast<std::uint8_t>(
      bits::ScalarFp8::e8m0(std::bit_cast<std::int32_t>(a), fp8_emax(f), false));
}

const char* to_string(Fp8Scaling s) {
  switch (s) {
    case Fp8Scaling::tensor:
      return "tensor";
    case Fp8Scaling::block:
      return "block";
    case Fp8Scaling::mx:
      return "mx";
  }
  return "?";
}

Fp8Scaling parse_fp8_scaling(const std::string& name, const std::string& what) {
  for (Fp8Scaling s : {Fp8Scaling::tensor, Fp8Scaling::block, Fp8Scaling::mx})
    if (name == to_string(s)) return s;
  throw ConfigError(what + " must be tensor, block or mx, got \"" + name + "\"");
}

std::string fp8_format_name(const Fp8Recipe& r) {
  if (r.forward == r.backward) return to_string(r.forward);
  if (r.forward == Fp8Format::e4m3 && r.backward == Fp8Format::e5m2) return "hybrid";
  return std::string(to_string(r.forward)) + "/" + to_string(r.backward);
}

void set_fp8_format(Fp8Recipe& r, const std::string& name, const std::string& what) {
  if (name == "hybrid") {
    r.forward = Fp8Format::e4m3;
    r.backward = Fp8Format::e5m2;
    return;
  }
  if (name != "e4m3" && name != "e5m2") {
    throw ConfigError(what + " must be e4m3, e5m2 or hybrid, got \"" + name + "\"");
  }
  r.forward = r.backward = parse_fp8_format(name, what);
}

void validate(const Fp8Recipe& r, const std::string& what) {
  auto positive = [&](index_t v, const char* key) {
    if (v < 1) {
      throw ConfigError(what + "." + key + " must be at least 1, got " + std::to_string(v));
    }
  };
  positive(r.block_k, "fp8_block_k");
  if (r.delayed && r.scaling != Fp8Scaling::tensor) {
    throw ConfigError(what +
                      ".fp8_scales: delayed scales are one per tensor, as Transformer "
                      "Engine's delayed scaling keeps them: give \"fp8_scaling\": \"tensor\"");
  }
  positive(r.weight_block, "fp8_weight_block");
  if (r.accumulate.mantissa_bits < 1 || r.accumulate.mantissa_bits > 23) {
    throw ConfigError(what + ".fp8_mantissa_bits must be 1 to 23, got " +
                      std::to_string(r.accumulate.mantissa_bits));
  }
  if (r.accumulate.promote_every < 0) {
    throw ConfigError(what + ".fp8_promote_every must be 0 (never) or more, got " +
                      std::to_string(r.accumulate.promote_every));
  }
}

Fp8Quantization fp8_quantization(const Fp8Recipe& r, bool gradient, bool weight) {
  Fp8Quantization q;
  q.format = gradient ? r.backward : r.forward;
  q.scaling = r.scaling;
  q.block_rows = weight ? r.weight_block : 1;
  q.block_k = r.block_k;
  q.saturate = r.saturate;
  return q;
}

Fp8Block fp8_block(const Fp8Quantization& how, index_t rows, index_t k) {
  switch (how.scaling) {
    case Fp8Scaling::tensor:
      return {std::max<index_t>(rows, 1), std::max<index_t>(k, 1)};
    case Fp8Scaling::block:
      return {how.block_rows, how.block_k};
    case Fp8Scaling::mx:
      return {1, 32};  // OCP MX: 32 values share one scale
  }
  return {};
}

}  // namespace teo
