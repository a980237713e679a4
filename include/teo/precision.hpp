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

// x rounded to p's storage format, to nearest with ties to even: bf16 and tf32 keep float's
// exponent range, fp16 has subnormals and overflows to +-inf at 65520; NaN stays a (quiet) NaN.
// fp32 and fp64 leave x alone. The array forms, through the ISA's kernels, are in teo/rounding.hpp.
float round_to(Precision p, float x);

// "a finite value overflowed fp16 (its largest finite value is 65504)", and for bf16 and tf32
// (float's range): the message of a RangeError.
std::string overflow_message(Precision p);

// A ConfigError naming `what` unless p is bf16 or fp16.
void require_16_bit(Precision p, const char* what);

// The bf16 or fp16 bit pattern of x (rounded as round_to does), and back; the widening is exact.
// Any other precision is a ConfigError.
std::uint16_t to_bits(Precision p, float x);
float from_bits(Precision p, std::uint16_t h);

}  // namespace teo
