#include "teo/precision.hpp"

#include <atomic>
#include <cmath>

#include "kernels/kernels_internal.hpp"
#include "kernels/parallel.hpp"
#include "teo/errors.hpp"

namespace teo {

namespace {

constexpr Precision kAll[] = {Precision::fp64, Precision::fp32, Precision::tf32,
                              Precision::bf16, Precision::fp16, Precision::fp8};

void require_16_bit(Precision p, const char* what) {
  if (p != Precision::bf16 && p != Precision::fp16) {
    throw ConfigError(std::string(what) + ": precision " + to_string(p) +
                      " has no 16-bit format (bf16 or fp16 only)");
  }
}

// Element-wise work is cut into blocks of this many values over the threads.
constexpr index_t kGrain = 16384;

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

bool round_to(Precision p, float* data, index_t n) {
  p = storage_format(p);
  if (p == Precision::fp32 || p == Precision::fp64) return false;
  const auto& round = detail::isa_kernels().rounding.round;
  std::atomic<bool> over{false};
  detail::for_blocks(n, kGrain, [&](index_t i0, index_t i1) {
    if (round(data + i0, data + i0, i1 - i0, p)) over.store(true, std::memory_order_relaxed);
  });
  return over.load();
}

float round_to(Precision p, float x) {
  round_to(p, &x, 1);
  return x;
}

void to_bits(Precision p, std::uint16_t* out, const float* in, index_t n) {
  require_16_bit(p, "to_bits");
  const auto& narrow = detail::isa_kernels().rounding.narrow;
  detail::for_blocks(n, kGrain,
                     [&](index_t i0, index_t i1) { narrow(out + i0, in + i0, i1 - i0, p); });
}

void from_bits(Precision p, float* out, const std::uint16_t* in, index_t n) {
  require_16_bit(p, "from_bits");
  const auto& widen = detail::isa_kernels().rounding.widen;
  detail::for_blocks(n, kGrain,
                     [&](index_t i0, index_t i1) { widen(out + i0, in + i0, i1 - i0, p); });
}

std::uint16_t to_bits(Precision p, float x) {
  std::uint16_t h = 0;
  to_bits(p, &h, &x, 1);
  return h;
}

float from_bits(Precision p, std::uint16_t h) {
  float x = 0;
  from_bits(p, &x, &h, 1);
  return x;
}

}  // namespace teo
