// The fp8 formats and E8M0 scales: names, constants, and rounding through the ISA's kernels
// (simd/fp8_kernels.hpp). Quantization and the product are in kernels/fp8_gemm.cpp.
#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <limits>

#include "kernels/kernels_internal.hpp"
#include "kernels/parallel.hpp"
#include "teo/errors.hpp"
#include "teo/fp8.hpp"

namespace teo {

namespace {
// Element-wise work is cut into blocks of this many values over the threads.
constexpr index_t kGrain = 16384;
}  // namespace

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

bool round_to_fp8(Fp8Format f, bool saturate, float* data, index_t n) {
  const auto& round = detail::isa_kernels().rounding.round_fp8;
  std::atomic<bool> over{false};
  detail::for_blocks(n, kGrain, [&](index_t i0, index_t i1) {
    if (round(data + i0, data + i0, i1 - i0, f, saturate))
      over.store(true, std::memory_order_relaxed);
  });
  return over.load();
}

float round_to_fp8(Fp8Format f, bool saturate, float x) {
  round_to_fp8(f, saturate, &x, 1);
  return x;
}

void to_fp8_bits(Fp8Format f, bool saturate, std::uint8_t* out, const float* in, index_t n) {
  const auto& narrow = detail::isa_kernels().rounding.narrow_fp8;
  detail::for_blocks(
      n, kGrain, [&](index_t i0, index_t i1) { narrow(out + i0, in + i0, i1 - i0, f, saturate); });
}

void from_fp8_bits(Fp8Format f, float* out, const std::uint8_t* in, index_t n) {
  const auto& widen = detail::isa_kernels().rounding.widen_fp8;
  detail::for_blocks(n, kGrain,
                     [&](index_t i0, index_t i1) { widen(out + i0, in + i0, i1 - i0, f); });
}

std::uint8_t to_fp8_bits(Fp8Format f, bool saturate, float x) {
  std::uint8_t b = 0;
  to_fp8_bits(f, saturate, &b, &x, 1);
  return b;
}

float from_fp8_bits(Fp8Format f, std::uint8_t b) {
  float x = 0;
  from_fp8_bits(f, &x, &b, 1);
  return x;
}

void to_e8m0(std::uint8_t* out, const float* in, index_t n, E8m0Rounding r) {
  const auto& k = detail::isa_kernels().rounding.to_e8m0;
  detail::for_blocks(n, kGrain, [&](index_t i0, index_t i1) {
    k(out + i0, in + i0, i1 - i0, 0, r == E8m0Rounding::up);
  });
}

std::uint8_t to_e8m0(float x, E8m0Rounding r) {
  std::uint8_t b = 0;
  to_e8m0(&b, &x, 1, r);
  return b;
}

float e8m0_value(std::uint8_t b) {
  if (b == 0xFF) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(b) - 127);  // 2^-127 is a float subnormal: exact
}

std::uint8_t mx_scale(float amax, Fp8Format f) {
  // floor(log2 amax) - emax, from the exponent field; a non-finite amax has no scale.
  if (!std::isfinite(amax)) return 0xFF;
  std::uint8_t b = 0;
  const float a = std::fabs(amax);
  detail::isa_kernels().rounding.to_e8m0(&b, &a, 1, fp8_emax(f), false);
  return b;
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
