// Quantized weights as safetensors checkpoints ship them (docs/quantization.md): each format's
// tensors under their checkpoint names, their exact dequantization, and teo's quantizer. A weight
// here is a matrix (rows, cols) in PyTorch's nn.Linear order (out_features, in_features), or for
// MXFP4 any leading dimensions over (rows, cols) as gpt-oss stacks its experts.
//
//   int8   per output channel, symmetric: `weight` I8 (rows, cols), `weight_scale` (rows) or
//          (rows, 1), F32, BF16 or F16. w = q * s.
//   gptq   AutoGPTQ / Hugging Face `gptq`, 4 bits: `qweight` I32 (cols / 8, rows) packed along the
//          input dimension, `qzeros` I32 (groups, rows / 8), `scales` F16 (groups, rows), `g_idx`
//          I32 (cols), optional. w = s * (q - (z + zero_offset)), zero_offset 1 for v1
//          checkpoints ("checkpoint_format": "gptq") and 0 for "gptq_v2".
//   awq    AutoAWQ's GEMM layout, 4 bits: `qweight` I32 (cols, rows / 8) packed along the output
//          dimension in AWQ's interleaved nibble order, `qzeros` I32 (groups, rows / 8) likewise,
//          `scales` F16 (groups, rows). w = s * (q - z).
//   mxfp4  OCP Microscaling as gpt-oss ships it: `NAME_blocks` U8 (..., rows, cols / 32, 16), two
//          E2M1 values a byte (low nibble first), `NAME_scales` U8 (..., rows, cols / 32), E8M0.
//          w = e2m1 * 2^(scale - 127).
//   nvfp4  NVIDIA ModelOpt: `weight` U8 (rows, cols / 2), two E2M1 values a byte (low nibble
//          first), `weight_scale` F8_E4M3 (rows, cols / 16), `weight_scale_2` F32 (a scalar: the
//          global scale), `input_scale` F32 (a scalar, the activations' global scale; optional).
//          w = e2m1 * s * s2.
//
// Every dequantized value is the exact product, which a float64 holds. gptq's and awq's (F16
// scales), int8's with a 16-bit scale and mxfp4's within float32's range are also exact in float32;
// nvfp4's, with its F32 global scale, in general are not.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "teo/safetensors.hpp"

namespace teo::quant {

enum class TensorFormat { int8, gptq, awq, mxfp4, nvfp4 };
const char* to_string(TensorFormat f);
TensorFormat parse_tensor_format(const std::string& name, const std::string& what);

// The tensors of one quantized weight, by role ("weight", "weight_scale", "qweight", "qzeros",
// "scales", "g_idx", "blocks", "weight_scale_2", "input_scale").
struct Packed {
  TensorFormat format = TensorFormat::int8;
  std::map<std::string, safetensors::Tensor> parts;
};

struct Dequantize {
  int zero_offset = 1;  // gptq: 1 (v1 checkpoints) or 0 (gptq_v2)
  // gptq without g_idx, awq: the quantization config's group_size (groups of that many input
  // columns, the last one shorter); 0: the columns divided evenly over the scales' groups.
  index_t group_size = 0;
};

// The roles a format needs, and those it may have.
std::vector<std::string> required_roles(TensorFormat f);
std::vector<std::string> optional_roles(TensorFormat f);
// The checkpoint name of a role of the weight `prefix`: "PREFIX.ROLE", or for mxfp4 "PREFIX_ROLE".
std::string tensor_name(TensorFormat f, const std::string& prefix, const std::string& role);

// The weights of `file` in format f, by prefix: each prefix with every required role present.
// FormatError naming the tensor when a weight has some of its roles but not all, or for int8 a
// weight_zero_point (asymmetric int8 is not read).
std::map<std::string, Packed> find_packed(const safetensors::File& file, TensorFormat f);

// The dequantized weight's shape: (rows, cols), or mxfp4's (..., rows, cols).
std::vector<std::int64_t> dequantized_shape(const Packed& p, const std::string& what);

// The exact values, row-major in dequantized_shape's order. FormatError naming `what` and the rule
// for a missing role, a wrong dtype or shape, a group size that does not divide, a g_idx outside
// the groups, a scale that is not finite (an F16 inf, E8M0 0xFF, E4M3 NaN), a gptq zero_offset
// other than 0 or 1, a stored zero of 15 in a v1 gptq checkpoint (ambiguous between AutoGPTQ and
// exllama), a non-scalar global scale, a tensor whose bytes do not fill its shape. Only 4-bit gptq
// and awq are read: another width's qweight does not match g_idx or the scales.
std::vector<double> dequantize(const Packed& p, const std::string& what, const Dequantize& d = {});

struct Quantize {
  index_t group_size = 128;  // gptq, awq: input columns per group (-1: one group)
  bool act_order = false;    // gptq: groups by a permutation of the columns (g_idx), seeded
  std::uint64_t seed = 0;
  int zero_offset = 1;  // gptq: as Dequantize
};

// A weight (rows, cols) (mxfp4: with `lead` leading dimensions' sizes first) in format f by teo's
// quantizer (docs/quantization.md), every value finite. ShapeError for cols or rows that the
// format's packing does not divide.
Packed quantize(TensorFormat f, const std::vector<double>& w,
                const std::vector<std::int64_t>& shape, const Quantize& q = {});

// CUTLASS's swizzled layout of a scale matrix (rows, cols) (NVFP4's weight_scale, read by its
// block-scaled GEMMs): padded to multiples of 128 rows and 4 columns, with element (r, c) at
// (r / 128) * (128 * padded_cols) + (c / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + c % 4;
// padding is 0. unswizzle gives the rows x cols matrix back.
std::vector<std::uint8_t> swizzle_128x4(const std::vector<std::uint8_t>& scales, index_t rows,
                                        index_t cols);
std::vector<std::uint8_t> unswizzle_128x4(const std::vector<std::uint8_t>& swizzled, index_t rows,
                                          index_t cols);

// AWQ's nibble order: the column (within 8) packed at nibble k, and the nibble holding column j.
int awq_column_at_nibble(int k);
int awq_nibble_of_column(int j);

}  // namespace teo::quant
