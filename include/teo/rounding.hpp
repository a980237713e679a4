// The array forms of teo/precision.hpp's and teo/fp8.hpp's rounding: the same bits as the scalar
// functions there (core/float_bits.hpp defines both), computed by the ISA's kernels over the
// threads. Every function gives the same bits on every ISA and thread count.
#pragma once

#include <cstdint>

#include "teo/fp8.hpp"
#include "teo/precision.hpp"
#include "teo/types.hpp"

namespace teo {

// data (n floats) rounded in place as round_to(p, x) rounds each value. Returns whether a finite
// value became infinite.
bool round_to(Precision p, float* data, index_t n);

// The bf16 or fp16 bit patterns of in, and back, as to_bits and from_bits of one value. Any other
// precision is a ConfigError.
void to_bits(Precision p, std::uint16_t* out, const float* in, index_t n);
void from_bits(Precision p, float* out, const std::uint16_t* in, index_t n);

// data (n floats) rounded in place as round_to_fp8(f, saturate, x) rounds each value. Returns
// whether a finite value became inf or NaN.
bool round_to_fp8(Fp8Format f, bool saturate, float* data, index_t n);

// The fp8 bytes of in, and back, as to_fp8_bits and from_fp8_bits of one value.
void to_fp8_bits(Fp8Format f, bool saturate, std::uint8_t* out, const float* in, index_t n);
void from_fp8_bits(Fp8Format f, float* out, const std::uint8_t* in, index_t n);

// The E8M0 bytes of in, as to_e8m0 of one value.
void to_e8m0(std::uint8_t* out, const float* in, index_t n, E8m0Rounding r);

}  // namespace teo
