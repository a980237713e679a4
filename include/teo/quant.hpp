// Quantized weight formats, defined bit for bit as the ecosystem stores them
// (docs/quantization.md). Each format has its packed layout, an exact dequantization (every
// dequantized value is a float32 computed by the format's own float32 arithmetic, and that float32
// is the weight's exact value, in float64 cases too), a check of its fields, and teo's quantizer,
// which makes valid blocks for cases and exports (it is not llama.cpp's quantizer and is not
// judged). These are the scalar definitions; the array forms over the threads are in
// teo/dequant.hpp.
//
// GGUF's block types (ggml_type), byte for byte as llama.cpp's block structs (ggml-common.h):
//   Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (32 values a block), Q4_K, Q5_K, Q6_K (256 values a superblock),
//   MXFP4 (llama.cpp's: 32 E2M1 values under one E8M0 scale) and NVFP4 (llama.cpp's: 64 values, an
//   unsigned E4M3 scale per 16, no global scale; not ModelOpt's NVFP4), and the plain F32, F16 and
//   BF16.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "teo/types.hpp"

namespace teo::quant {

// ggml's type numbers, as GGUF files store them.
enum class GgmlType : std::uint32_t {
  f32 = 0,
  f16 = 1,
  q4_0 = 2,
  q4_1 = 3,
  q5_0 = 6,
  q5_1 = 7,
  q8_0 = 8,
  q4_k = 12,
  q5_k = 13,
  q6_k = 14,
  bf16 = 30,
  mxfp4 = 39,
  nvfp4 = 40,
};

// A block: `values` consecutive values of a row in `bytes` bytes (1 value for the float types).
struct BlockShape {
  int values;
  int bytes;
};

// Every type teo reads and writes, in ggml's order.
const std::vector<GgmlType>& ggml_types();
// ggml's name ("Q4_K", "F32"), and back; a ConfigError naming `what` and the supported names.
const char* to_string(GgmlType t);
GgmlType parse_ggml_type(const std::string& name, const std::string& what);
// The type of ggml number `number`, or false when teo does not support it; the name ggml gives an
// unsupported number ("IQ2_XXS"), or "" when ggml has none.
bool ggml_type_of(std::uint32_t number, GgmlType& t);
const char* ggml_type_name(std::uint32_t number);

BlockShape block_shape(GgmlType t);
// Whether t packs values in blocks with scales (every type but F32, F16 and BF16).
bool is_block_type(GgmlType t);
// The bytes of a row of `values` values: ShapeError naming `what` unless values is a positive
// multiple of the block.
std::uint64_t row_bytes(GgmlType t, std::int64_t values, const std::string& what);

// The values of one block (block_shape(t).values of them), exactly: llama.cpp's float32
// arithmetic (its dequantize_row_* functions), operation for operation.
void dequantize_block(GgmlType t, const std::uint8_t* block, float* out);

// Why block `block` is not a valid block of t, or "" when it is: a scale that is not finite (an
// F16 scale of inf or NaN, E8M0 0xFF) or not an unsigned E4M3 value (NVFP4: 0x7F or the sign bit
// set); an MXFP4 value past float32's range (E8M0 253 or 254 with a large code); for F32, F16 and
// BF16 a value that is not finite.
std::string check_block(GgmlType t, const std::uint8_t* block);
// The index of the first invalid block of `blocks` blocks back to back, with check_block's reason
// in `why`; -1 when every block is valid.
std::int64_t first_invalid_block(GgmlType t, const std::uint8_t* bytes, std::int64_t blocks,
                                 std::string& why);

// A block of t holding in (block_shape(t).values finite values), by teo's quantizer
// (docs/quantization.md): Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 as llama.cpp's reference quantizers,
// the K types by one pass of min and max per sub-block, MXFP4 and NVFP4 by the nearest E2M1 value
// under the block's scale (saturating). InputError for a value that is not finite, or a scale
// beyond F16's range (the Q types, F16 and BF16).
void quantize_block(GgmlType t, const float* in, std::uint8_t* block);

// The E2M1 value of a 4-bit code (OCP: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; code 8 is
// -0), and its double, as llama.cpp's tables hold it (code 8 is +0 there).
float e2m1_value(int code);
int e2m1_twice(int code);
// The E2M1 code nearest to v, ties to the even code, beyond 6 saturating; 0 (never -0) for values
// that round to zero.
int nearest_e2m1(double v);

}  // namespace teo::quant
