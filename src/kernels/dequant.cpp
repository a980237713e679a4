// Whole rows of quantized blocks (teo/dequant.hpp), cut into fixed runs of blocks over the threads.
#include "teo/dequant.hpp"

#include <exception>
#include <mutex>
#include <string>

#include "kernels/parallel.hpp"
#include "teo/errors.hpp"

namespace teo {

namespace {

// Blocks per task: about 64 KiB of values.
constexpr index_t kValuesPerTask = 16384;

index_t block_count(quant::GgmlType t, std::int64_t values, const char* what) {
  const auto shape = quant::block_shape(t);
  if (values < 0 || values % shape.values != 0) {
    throw ShapeError(std::string(what) + ": " + std::to_string(values) + " values are not whole " +
                     quant::to_string(t) + " blocks of " + std::to_string(shape.values));
  }
  return values / shape.values;
}

}  // namespace

void dequantize(quant::GgmlType t, const std::uint8_t* bytes, std::int64_t values, float* out) {
  const auto shape = quant::block_shape(t);
  const index_t blocks = block_count(t, values, "dequantize");
  const index_t grain = std::max<index_t>(1, kValuesPerTask / shape.values);
  detail::for_blocks(blocks, grain, [&](index_t b0, index_t b1) {
    for (index_t b = b0; b < b1; ++b)
      quant::dequantize_block(t, bytes + b * shape.bytes, out + b * shape.values);
  });
}

void quantize(quant::GgmlType t, const float* in, std::int64_t values, std::uint8_t* out) {
  const auto shape = quant::block_shape(t);
  const index_t blocks = block_count(t, values, "quantize");
  const index_t grain = std::max<index_t>(1, kValuesPerTask / shape.values);
  // The error of the first failing block in order, whichever thread met it.
  std::mutex m;
  index_t first = blocks;
  std::exception_ptr error;
  detail::for_blocks(blocks, grain, [&](index_t b0, index_t b1) {
    for (index_t b = b0; b < b1; ++b) {
      try {
        quant::quantize_block(t, in + b * shape.values, out + b * shape.bytes);
      } catch (...) {
        const std::lock_guard<std::mutex> lock(m);
        if (b < first) {
          first = b;
          error = std::current_exception();
        }
        return;
      }
    }
  });
  if (error) std::rethrow_exception(error);
}

}  // namespace teo
