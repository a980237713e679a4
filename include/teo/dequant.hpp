// The array forms of teo/quant.hpp: whole rows of blocks dequantized and quantized over the
// threads, each block by the scalar definition, so that the thread count changes no bit.
#pragma once

#include <cstdint>

#include "teo/quant.hpp"

namespace teo {

// out[0, values) = the values of the blocks at `bytes` (values / block_shape(t).values of them),
// as quant::dequantize_block gives them. ShapeError unless values is a multiple of the block.
void dequantize(quant::GgmlType t, const std::uint8_t* bytes, std::int64_t values, float* out);

// The blocks of in[0, values), as quant::quantize_block makes them; its InputError for the first
// block (in order) that cannot be quantized. ShapeError unless values is a multiple of the block.
void quantize(quant::GgmlType t, const float* in, std::int64_t values, std::uint8_t* out);

}  // namespace teo
