// The portable fallback: one lane, std::fma, the same blocking logic as the vector ISAs.
#include "gemm_kernel.hpp"

namespace teo::simd {

const IsaKernels& kernels_scalar() {
  static const IsaKernels k{"scalar", make_gemm<float, scalar_arch, 4, 4>(256, 64, 1024),
                            make_gemm<double, scalar_arch, 4, 4>(256, 64, 1024)};
  return k;
}

}  // namespace teo::simd
