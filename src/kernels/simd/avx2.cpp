// AVX2 with FMA3 (Haswell and later), compiled with -mavx2 -mfma.
#include "gemm_kernel.hpp"
#include "vector_kernels.hpp"

namespace teo::simd {

// 16 ymm registers: BLIS's Haswell shape, 6 x 2 vectors = 12 accumulators + 2 B + 1 broadcast.
const IsaKernels& kernels_avx2() {
  static const IsaKernels k{"avx2",
                            make_gemm<float, xsimd::fma3<xsimd::avx2>, 6, 2>(256, 144, 3072),
                            make_gemm<double, xsimd::fma3<xsimd::avx2>, 6, 2>(256, 96, 3072),
                            Kernels<float, xsimd::fma3<xsimd::avx2>>::table(),
                            Kernels<double, xsimd::fma3<xsimd::avx2>>::table()};
  return k;
}

}  // namespace teo::simd
