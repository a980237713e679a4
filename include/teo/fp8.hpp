// FP8: the OCP 8-bit formats E4M3 and E5M2, their E8M0 scales, the recipes that scale an operand
// before rounding it (one scale per tensor, per block, or per 32 values as OCP microscaling
// defines), and the product an fp8 tensor core computes from scaled operands, with float32 or
// limited-precision accumulation (docs/fp8.md). Every function gives the same bits on every ISA and
// thread count.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "teo/types.hpp"

namespace teo {

const char* to_string(Fp8Format f);
// ConfigError naming `what` unless name is e4m3 or e5m2.
Fp8Format parse_fp8_format(const std::string& name, const std::string& what);

// The largest finite value: 448 (E4M3), 57344 (E5M2).
float fp8_max(Fp8Format f);
// The exponent of the largest power of two the format holds (OCP's emax): 8 (E4M3), 15 (E5M2).
int fp8_emax(Fp8Format f);
// The unit roundoff in the normal range: 2^-4 (E4M3, 3 mantissa bits), 2^-3 (E5M2, 2).
double unit_roundoff(Fp8Format f);

// x rounded to f, to nearest with ties to even, with the format's subnormals (steps of 2^-9 for
// E4M3, 2^-16 for E5M2). A value beyond the largest finite one becomes that value when `saturate`
// (infinities too), else inf (E5M2) or NaN (E4M3, which has no infinity). NaN stays a quiet NaN
// with its sign. The array forms of this and of the byte conversions below, through the ISA's
// kernels, are in teo/rounding.hpp.
float round_to_fp8(Fp8Format f, bool saturate, float x);

// The fp8 byte of x (rounded as round_to_fp8 does), and back; the widening is exact. NaN is 0x7F
// (E4M3) or 0x7E / 0x7F (E5M2), with the sign bit.
std::uint8_t to_fp8_bits(Fp8Format f, bool saturate, float x);
float from_fp8_bits(Fp8Format f, std::uint8_t b);

// E8M0, the microscaling formats' scale: a byte b is 2^(b - 127), 0xFF is NaN; no sign, no zero.
// to_e8m0 gives the power of two at or below |x| (down), or at or above it (up), clamped to
// 2^-127 .. 2^127; 0 gives 0x00; a negative, infinite or NaN value gives 0xFF.
enum class E8m0Rounding { down, up };
std::uint8_t to_e8m0(float x, E8m0Rounding r);
float e8m0_value(std::uint8_t b);
// The OCP MX shared scale of a block whose largest magnitude is amax:
// 2^(floor(log2 amax) - emax(f)), clamped to E8M0's range; 0xFF for a non-finite amax.
std::uint8_t mx_scale(float amax, Fp8Format f);

// How a recipe scales an operand before rounding it:
// - tensor: one scale for the whole operand (Transformer Engine's current scaling);
// - block:  one per block of `block_rows` x `block_k` values (DeepSeek-V3: 1 x 128 tiles of
//           activations and gradients, 128 x 128 blocks of weights);
// - mx:     one E8M0 power of two per 32 consecutive values along k (OCP MXFP8).
enum class Fp8Scaling { tensor, block, mx };
const char* to_string(Fp8Scaling s);
Fp8Scaling parse_fp8_scaling(const std::string& name, const std::string& what);

// One operand of a product, quantized along its contraction dimension k: `q` holds the fp8 values
// (exact, as floats), row-major (rows, k); `scale` holds the dequantization scales, row-major
// (ceil(rows / block_rows), ceil(k / block_k)), so that x ~ q * scale of its block. With tensor
// scaling the block is the whole operand; with mx it is 1 x 32.
struct Fp8Operand {
  Fp8Format format = Fp8Format::e4m3;
  Fp8Scaling scaling = Fp8Scaling::tensor;
  index_t rows = 0, k = 0;
  index_t block_rows = 1, block_k = 1;
  std::vector<float> q;      // (rows, k)
  std::vector<float> scale;  // (ceil(rows / block_rows), ceil(k / block_k))
  index_t scale_cols() const { return (k + block_k - 1) / block_k; }
};

// How to quantize: the format, the recipe, a block's size for `block` scaling (rows of the
// operand by values along k; 1 x 128 for activations and gradients, 128 x 128 for weights), and
// saturation.
struct Fp8Quantization {
  Fp8Format format = Fp8Format::e4m3;
  Fp8Scaling scaling = Fp8Scaling::tensor;
  index_t block_rows = 1, block_k = 128;
  bool saturate = true;
};

// The operand op(X) of (rows, k) values, where op(X)(r, p) = x[r * ld + p], or x[p * ld + r] when
// `transposed`, quantized with current scaling: each block's scale is d = amax / fp8_max (float
// division; 1 for a block of zeros), or for mx the E8M0 power of two mx_scale(amax); q =
// round_to_fp8(x * m), m = fp8_max / amax (float division, at most float's largest value,
// and then d = 1 / m, so that q * d still gives x; 1 / d
// for mx, exactly), as Transformer Engine, torchao and DeepGEMM's reference casts quantize. A
// non-finite value is a RangeError naming `what`.
Fp8Operand quantize_fp8(const float* x, index_t rows, index_t k, index_t ld, bool transposed,
                        const Fp8Quantization& how, const std::string& what);
// The same with the scales given (delayed scaling; `scales` holds one per block, row-major), and
// q = round_to_fp8(x / d): each must be finite and positive, else a ConfigError naming `what`.
Fp8Operand quantize_fp8(const float* x, index_t rows, index_t k, index_t ld, bool transposed,
                        const Fp8Quantization& how, const std::vector<float>& scales,
                        const std::string& what);

// How a product accumulates. fp32: every output is one float32 chain of fused multiply-adds in
// increasing k. limited: an accumulator that keeps `mantissa_bits` explicit mantissa bits,
// truncating toward zero after every addition (the H800's about 14 bits, DeepSeek-V3 report,
// section 3.3.2), whose partial sum is added to a float32 accumulator every `promote_every`
// products (0: never) and at every scale block's end.
struct Fp8Accumulation {
  bool limited = false;
  int mantissa_bits = 14;
  index_t promote_every = 128;
  bool operator==(const Fp8Accumulation&) const = default;
};

// c (m, n, leading dimension ldc) = the product of a (m, k) and b (n, k) as an fp8 tensor core
// computes it (docs/fp8.md, "The product"): per k block, the sum of q_a * q_b times the two blocks'
// scales, summed in float32; with mx the power-of-two scales apply to each product. The operands'
// k, and their block_k where both are scaled by blocks, must agree (ShapeError otherwise). An
// operand built by hand must be one quantize_fp8 could build: q of rows x k values, a block of at
// least 1 x 1 (1 x 32 under mx, the whole operand under tensor scaling) and one scale per block
// (ShapeError otherwise), each finite and positive (ConfigError otherwise).
void fp8_gemm(const Fp8Operand& a, const Fp8Operand& b, float* c, index_t ldc,
              const Fp8Accumulation& acc);

// The recipe a Precision::fp8 pass emulates (docs/fp8.md, "Emulated passes"): every linear layer's
// three products (forward, input gradient, weight gradient) quantize both operands along their
// contraction and multiply with fp8_gemm; every other tensor is stored in bf16.
// - forward / backward: the format of forward operands, and of the output gradient in the two
//   backward products (its partner keeps `forward`); "hybrid" is E4M3 forward, E5M2 backward;
// - scaling, with `block`'s tiles: activations and gradients 1 x block_k along the contraction,
//   weights weight_block x block_k;
// - saturate: overflow after scaling saturates (else it is a RangeError naming the tensor);
// - accumulate: the products' accumulator;
// - attention: attention's forward products (q k^T and p v) in fp8 too, as FlashAttention 3's fp8
//   forward computes them (docs/fp8.md, "Attention"); otherwise attention's products round their
//   operands to bf16, as every other product of the pass;
// - delayed: the operands' scales are given (Transformer Engine's delayed scaling: one scale per
//   tensor, from an amax history), not computed from their amax; the linear op case reads them
//   from its inputs input.fp8_scale.* (docs/fp8.md, "Delayed scaling").
struct Fp8Recipe {
  Fp8Format forward = Fp8Format::e4m3;
  Fp8Format backward = Fp8Format::e4m3;
  Fp8Scaling scaling = Fp8Scaling::tensor;
  index_t block_k = 128;
  index_t weight_block = 128;
  bool saturate = true;
  Fp8Accumulation accumulate;
  bool attention = false;
  bool delayed = false;
  bool operator==(const Fp8Recipe&) const = default;
};
// "e4m3", "e5m2" or "hybrid" (forward E4M3, backward E5M2); any other pair is "e4m3/e5m2" style.
std::string fp8_format_name(const Fp8Recipe& r);
// Sets forward and backward from e4m3, e5m2 or hybrid; a ConfigError naming `what` otherwise.
void set_fp8_format(Fp8Recipe& r, const std::string& name, const std::string& what);
// ConfigError naming `what` (as what.key) for a block size below 1, mantissa bits outside 1..23,
// or a negative promote_every.
void validate(const Fp8Recipe& r, const std::string& what);

// The quantization of one product operand under r: `gradient` picks the backward format,
// `weight` the weight_block x block_k tiles (else 1 x block_k).
Fp8Quantization fp8_quantization(const Fp8Recipe& r, bool gradient, bool weight);

// The block of an operand of (rows, k) values that one scale covers under `how`: the whole operand
// (at least 1 x 1) for tensor scaling, block_rows x block_k for block, 1 x 32 for mx; its scales
// then form a (ceil(rows / block_rows), ceil(k / block_k)) grid, as Fp8Operand::scale holds them.
struct Fp8Block {
  index_t rows = 1, k = 1;
};
Fp8Block fp8_block(const Fp8Quantization& how, index_t rows, index_t k);

}  // namespace teo
