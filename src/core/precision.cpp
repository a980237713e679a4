#include "teo/precision.hpp"

#include <bit>
#include <cmath>

#include "core/float_bits.hpp"
#include "teo/errors.hpp"

namespace teo {

namespace {

constexpr Precision kAll[] = {Precision::fp64, Precision::fp32, Precision::tf32,
                              Precision::bf16, Precision::fp16, Precision::fp8};

}  // namespace

const char* to_string(Precision p) {
  switch (p) {
    case Precision::fp64:
      return "fp64";
    case Precision::fp32:
      return "fp32";
    case Precision::tf32:
      return "tf32";
    case Precision::bf16:
      return "bf16";
    case Precision::fp16:
      return "fp16";
    case Precision::fp8:
      return "fp8";
  }
  return "?";
}

Precision parse_precision(const std::string& name, const std::string& what) {
  for (Precision p : kAll)
    if (name == to_string(p)) return p;
  throw ConfigError(what + " must be fp64, fp32, tf32, bf16, fp16 or fp8, got \"" + name + "\"");
}

double unit_roundoff(Precision p) {
  switch (p) {
    case Precision::fp64:
      return std::ldexp(1.0, -53);
    case Precision::fp32:
      return std::ldexp(1.0, -24);
    case Precision::tf32:
    case Precision::fp16:
      return std::ldexp(1.0, -11);
    case Precision::bf16:
      return std::ldexp(1.0, -8);
    case Precision::fp8:
      return std::ldexp(1.0, -4);
  }
  return 0;
}

Precision storage_format(Precision p) {
  return p == Precision::fp8 ? Precision::bf16 : p;
}

bool stores_reduced(Precision p) {
  return p == Precision::bf16 || p == Precision::fp16 || p == Precision::fp8;
}

std::string overflow_message(Precision p) {
  p = storage_format(p);
  return std::string("a finite value overflowed ") + to_string(p) +
         " (its largest finite value is " + (p == Precision::fp16 ? "65504" : "about 3.4e38") + ")";
}

float round_to(Precision p, float x) {
  p = storage_format(p);
  const auto b = std::bit_cast<std::int32_t>(x);
  switch (p) {
    case Precision::bf16:
      return std::bit_cast<float>(bits::Scalar::round_drop(b, 16));
    case Precision::tf32:
      return std::bit_cast<float>(bits::Scalar::round_drop(b, 13));
    case Precision::fp16:
      return std::bit_cast<float>(bits::Scalar::round_fp16(b));
    default:
      return x;
  }
}

void require_16_bit(Precision p, const char* what) {
  if (p != Precision::bf16 && p != Precision::fp16) {
    throw ConfigError(std::string(what) + ": precision " + to_string(p) +
                      " has no 16-bit format (bf16 or fp16 only)");
  }
}

std::uint16_t to_bits(Precision p, float x) {
  require_16_bit(p, "to_bits");
  const auto b = std::bit_cast<std::int32_t>(x);
  const std::int32_t h =
      p == Precision::bf16 ? bits::Scalar::round_drop(b, 16) >> 16 : bits::Scalar::to_fp16(b);
  return static_cast<std::uint16_t>(h & 0xFFFF);
}

float from_bits(Precision p, std::uint16_t h) {
  require_16_bit(p, "from_bits");
  return std::bit_cast<float>(p == Precision::bf16 ? bits::Scalar::from_bf16(h)
                                                   : bits::Scalar::from_fp16(h));
}

}  // namespace teo
