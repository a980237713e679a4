// Reduced precision: the formats teo emulates, their names, and rounding to them
// (docs/semantics.md, "Reduced precision"). Every function here gives the same bits on every ISA
// and thread count.
#pragma once

#include <cstdint>
#include <string>

#include "teo/types.hpp"

namespace teo {

const char* to_string(Precision p);
// ConfigError naming `what` unless name is fp64, fp32, tf32, bf16, fp16 or fp8.
Precision parse_precision(const std::string& name, const std::string& what);

// The unit roundoff of the format a precision rounds to: 2^-53 (fp64), 2^-24 (fp32), 2^-11 (tf32,
// the rounding of a product's operands; fp16), 2^-8 (bf16), 2^-4 (fp8: E4M3, the linear products'
// operands; teo/fp8.hpp).
double unit_roundoff(Precision p);

// The format a precision stores its named tensors in: bf16 for fp8 (only the linear products'
// operands are fp8, teo/fp8.hpp's Fp8Recipe), p itself otherwise.
Precision storage_format(Precision p);
// Whether named tensors are rounded when stored: bf16, fp16 and fp8 (to bf16).
bool stores_reduced(Precision p);

// data (n floats) rounded in place to p's storage format, to nearest with ties to even: bf16 and
// tf32 keep float's exponent range, fp16 has subnormals and overflows to +-inf at 65520; NaN stays
// a (quiet) NaN. fp32 and fp64 leave data alone. Returns whether a finite value became infinite.
bool round_to(Precision p, float* data, index_t n);
float round_to(Precision p, float x);

// "a finite value overflowed fp16 (its largest finite value is 65504)", and for bf16 and tf32
// (float's range): the message of a RangeError.
std::string overflow_message(Precision p);

// The bf16 or fp16 bit patterns of in (rounded as round_to does), and back; the widening is exact.
// Any other precision is a ConfigError.
void to_bits(Precision p, std::uint16_t* out, const float* in, index_t n);
void from_bits(Precision p, float* out, const std::uint16_t* in, index_t n);
std::uint16_t to_bits(Precision p, float x);
float from_bits(Precision p, std::uint16_t h);

}  // namespace teo
