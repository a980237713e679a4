// The array forms of the rounding (teo/rounding.hpp): core/float_bits.hpp's definitions through the
// ISA's kernels (simd/round_kernels.hpp, simd/fp8_kernels.hpp), cut into fixed blocks over the
// threads, so that neither the ISA nor the thread count changes a bit.
#include "teo/rounding.hpp"

#include <atomic>

#include "kernels/kernels_internal.hpp"
#include "kernels/parallel.hpp"
#include "teo/errors.hpp"

namespace teo {

namespace {
// Element-wise work is cut into blocks of this many values over the threads.
constexpr index_t kGrain = 16384;
}  // namespace

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

bool round_to_fp8(Fp8Format f, bool saturate, float* data, index_t n) {
  const auto& round = detail::isa_kernels().rounding.round_fp8;
  std::atomic<bool> over{false};
  detail::for_blocks(n, kGrain, [&](index_t i0, index_t i1) {
    if (round(data + i0, data + i0, i1 - i0, f, saturate))
      over.store(true, std::memory_order_relaxed);
  });
  return over.load();
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

void to_e8m0(std::uint8_t* out, const float* in, index_t n, E8m0Rounding r) {
  const auto& k = detail::isa_kernels().rounding.to_e8m0;
  detail::for_blocks(n, kGrain, [&](index_t i0, index_t i1) {
    k(out + i0, in + i0, i1 - i0, 0, r == E8m0Rounding::up);
  });
}

}  // namespace teo
