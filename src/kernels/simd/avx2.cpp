// AVX2 with FMA3 (Haswell and later), compiled with -mavx2 -mfma.
#include "fp8_kernels.hpp"
#include "gemm_kernel.hpp"
#include "vector_kernels.hpp"

namespace teo::simd {

// 16 ymm registers: 4 x 3 vectors = 12 accumulators + 3 B + 1 broadcast. Against BLIS's Haswell
// shape (6 x 2), one more load and two fewer broadcasts per 12 fused multiply-adds; in alternating
// runs on this project's Zen machine it came 4 to 10% closer to OpenBLAS (docs/kernels.md). The
// 6 x 2 tile stays as the second one, for products whose width 24 (12) would pad (attention's).
// MC is 512 rows, more than fits L2 (512 x 256 doubles is 1 MiB), so that each thread walks the
// B panel in L3 fewer times: in teo_blocking_sweep on the bert-base shapes, the double GEMM reaches
// 0.99-1.14 of OpenBLAS with MC 512 against 0.89-1.04 with MC 96; in float, MC 512 and MC 144 are
// within noise of each other (docs/kernels.md).
const IsaKernels& kernels_avx2() {
  static const IsaKernels k{"avx2",
                            make_gemm<float, xsimd::fma3<xsimd::avx2>, 4, 3>(256, 512, 3072),
                            make_gemm<double, xsimd::fma3<xsimd::avx2>, 4, 3>(256, 512, 3072),
                            make_gemm<float, xsimd::fma3<xsimd::avx2>, 6, 2>(256, 512, 3072),
                            make_gemm<double, xsimd::fma3<xsimd::avx2>, 6, 2>(256, 512, 3072),
                            Kernels<float, xsimd::fma3<xsimd::avx2>>::table(),
                            Kernels<double, xsimd::fma3<xsimd::avx2>>::table(),
                            rounding_table<xsimd::fma3<xsimd::avx2>>()};
  return k;
}

}  // namespace teo::simd
