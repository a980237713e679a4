// A weight's storage format, as an op case's spec or a model config's "quantization" names it
// (docs/quantization.md): dense, one of the safetensors formats of teo/quant_formats.hpp, or a
// GGUF block type of teo/quant.hpp; and the packed tensors a weight of that format is stored as.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "teo/quant.hpp"
#include "teo/quant_formats.hpp"
#include "teo/safetensors.hpp"

namespace teo::quant {

struct WeightFormat {
  enum class Kind { dense, tensor, gguf };
  Kind kind = Kind::dense;
  TensorFormat tensor = TensorFormat::int8;  // kind tensor
  GgmlType gguf = GgmlType::q8_0;            // kind gguf
  index_t group_size = 128;                  // gptq, awq: input columns a group
  bool act_order = false;                    // gptq: g_idx, a permutation
  int zero_offset = 1;                       // gptq: 1 (v1) or 0 (gptq_v2)

  bool dense() const { return kind == Kind::dense; }
  // gptq or awq: scales by groups of input columns.
  bool grouped() const;
  // "int8", "gptq", "awq", "mxfp4", "nvfp4", or "gguf:" and a ggml type name ("gguf:Q4_K").
  std::string name() const;
  bool operator==(const WeightFormat&) const = default;
};

// The format named `name` (WeightFormat::name's spellings), its keys at their defaults;
// ConfigError naming `what` for another name.
WeightFormat parse_weight_format(const std::string& name, const std::string& what);
// Every name parse_weight_format reads.
std::vector<std::string> weight_format_names();

// One packed tensor of a weight: its role ("qweight", "scales", ...; a GGUF weight's one part is
// "weight"), dtype and shape.
struct WeightPart {
  std::string role;
  safetensors::DType dtype;
  std::vector<std::int64_t> shape;
};

// The parts of a weight (rows, cols) in f as teo's quantizer writes them (gptq with its g_idx).
std::vector<WeightPart> weight_parts(const WeightFormat& f, index_t rows, index_t cols);
// The name of a part of the weight whose dense name is `name`: the module (`name` less ".weight")
// and "." role, mxfp4's `name`_role, a GGUF weight's `name` itself.
std::string weight_part_name(const WeightFormat& f, const std::string& name,
                             const std::string& role);
// The values a block of f holds along a row (int8: the whole row; gptq, awq: a group).
index_t weight_block(const WeightFormat& f, index_t cols);
// An empty string when a weight (rows, cols) packs in f (whole blocks, groups and 32-bit words),
// else why not, naming `what`.
std::string weight_shape_problem(const WeightFormat& f, index_t rows, index_t cols,
                                 const std::string& what);

}  // namespace teo::quant
