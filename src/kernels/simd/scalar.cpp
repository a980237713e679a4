// The portable fallback: one lane, std::fma, the same blocking logic as the vector ISAs.
#include "fp8_kernels.hpp"
#include "gemm_kernel.hpp"
#include "vector_kernels.hpp"

namespace teo::simd {

const IsaKernels& kernels_scalar() {
  static const IsaKernels k = one_tile_isa(
      "scalar", make_gemm<float, scalar_arch, 4, 4>(256, 64, 1024),
      make_gemm<double, scalar_arch, 4, 4>(256, 64, 1024), Kernels<float, scalar_arch>::table(),
      Kernels<double, scalar_arch>::table(), rounding_table<scalar_arch>());
  return k;
}

}  // namespace teo::simd
