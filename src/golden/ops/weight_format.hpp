// Internal to the op cases: a weight stored in a quantized format (docs/golden-format.md,
// "Quantized weights"), as the linear op takes it. The spec's weight_format names the format; the
// case holds the packed tensors under the names a checkpoint gives them (teo/quant_formats.hpp,
// teo/quant.hpp), drawn by quantizing a uniform weight with teo's quantizer; every run reads the
// weight's exact dequantized values from them.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "golden/ops/op.hpp"
#include "teo/quant.hpp"
#include "teo/quant_formats.hpp"
#include "teo/weight_format.hpp"

namespace teo::golden::ops {

using quant::WeightFormat;
// Packed tensors' bytes by name.
using Packed = std::map<std::string, std::vector<unsigned char>>;

// The spec's weight_format and the keys of its format (group_size, act_order, zero_offset): dense
// when absent. ConfigError for an unknown format, or a key its format does not take.
WeightFormat read_weight_format(Reader& r);
// Writes weight_format and its keys (nothing for a dense weight).
void write_weight_format(const WeightFormat& f, ojson& j);
// ConfigError naming `what` unless a weight (rows, cols) packs in f (whole blocks, groups and
// 32-bit words).
void check_weight_shape(const WeightFormat& f, index_t rows, index_t cols, const std::string& what);

// The packed tensors of the weight whose dense name is `name` (rows, cols), or with lead > 0 of
// `lead` such weights stacked (the experts' (E, rows, cols)): the checkpoint's names of its parts,
// with the module name `name` less ".weight" (mxfp4: `name`_blocks), each an input slot of role
// `role`, packed, each part of a stack with the lead as its first dimension.
std::vector<Slot> weight_slots(const WeightFormat& f, const std::string& name, index_t rows,
                               index_t cols, Role role, index_t lead = 0);
// Draws the weight `name` ((lead,) rows, cols), uniform in [-amp, amp) from the stream of `name`,
// and stores its packing by teo's quantizer (each weight of a stack on its own, act order seeded
// by seed + its index) in v.raw under weight_slots' names.
void draw_weight(const WeightFormat& f, const std::string& name, index_t rows, index_t cols,
                 double amp, std::uint64_t seed, Values& v, index_t lead = 0);
// Packs w ((lead,) rows, cols), row-major, by teo's quantizer into raw under weight_slots' names,
// as draw_weight does with the values it draws.
void pack_weight(const WeightFormat& f, const std::string& name, index_t rows, index_t cols,
                 const std::vector<double>& w, std::uint64_t seed, Packed& raw, index_t lead = 0);
// The weight's exact values ((lead,) rows, cols), row-major, from the packed tensors in v.
// FormatError naming the tensor for a packing that does not read (a scale that is not finite, an
// invalid block).
std::vector<double> dequantize_weight(const WeightFormat& f, const std::string& name, index_t rows,
                                      index_t cols, const Values& v, index_t lead = 0);
// The same from the packed tensors in raw; the errors name `where` ("the golden").
std::vector<double> dequantize_weight(const WeightFormat& f, const std::string& name, index_t rows,
                                      index_t cols, const Packed& raw, index_t lead,
                                      const std::string& where);
// Where element i of the dequantized weight ((lead,) rows, cols) lies in the packing: "(expert e,)
// row r, column c: block b of the row (columns a to b)" or its group.
std::string locate_weight(const WeightFormat& f, index_t rows, index_t cols, std::int64_t i,
                          index_t lead = 0);

}  // namespace teo::golden::ops
