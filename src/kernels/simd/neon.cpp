// NEON on AArch64 (Advanced SIMD is mandatory there; no extra flags).
#include "fp8_kernels.hpp"
#include "gemm_kernel.hpp"
#include "vector_kernels.hpp"

namespace teo::simd {

// 32 q registers: 8 x 3 vectors = 24 accumulators + 3 B + 1 broadcast.
const IsaKernels& kernels_neon() {
  static const IsaKernels k =
      one_tile_isa("neon", make_gemm<float, xsimd::neon64, 8, 3>(256, 128, 3072),
                   make_gemm<double, xsimd::neon64, 8, 3>(256, 128, 3072),
                   Kernels<float, xsimd::neon64>::table(), Kernels<double, xsimd::neon64>::table(),
                   rounding_table<xsimd::neon64>());
  return k;
}

}  // namespace teo::simd
