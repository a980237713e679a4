// AVX2 with FMA3 (Haswell and later), compiled with -mavx2 -mfma.
#include "gemm_kernel.hpp"
#include "vector_kernels.hpp"

namespace teo::simd {

// 16 ymm registers: 4 x 3 vectors = 12 accumulators + 3 B + 1 broadcast. Against BLIS's Haswell
// shape (6 x 2), one more load and two fewer broadcasts per 12 fused multiply-adds; in alternating
// runs on this project's Zen machine it came 4 to 10% closer to OpenBLAS (docs/kernels.md). The
// 6 x 2 tile stays as the second one, for products whose width 24 (12) would pad (attention's).
// MC is 512 rows, more than fits L2 (512 x 256 doubles is 1 MiB): on the Zen machine, in one
// process alternating with OpenBLAS, MC 512 against 96 (double) or 144 (float) rows raised the
// ratio to OpenBLAS on every encoder shape, from 0.83-1.09 to 1.03-1.16 in double and from
// 0.90-1.10 to 1.03-1.17 in float (docs/kernels.md). Fewer row blocks mean fewer passes over the
// B panel, which lives in L3, per A block; the A slivers stream from L2/L3 well enough.
const IsaKernels& kernels_avx2() {
  static const IsaKernels k{"avx2",
                            make_gemm<float, xsimd::fma3<xsimd::avx2>, 4, 3>(256, 512, 3072),
                            make_gemm<double, xsimd::fma3<xsimd::avx2>, 4, 3>(256, 512, 3072),
                            make_gemm<float, xsimd::fma3<xsimd::avx2>, 6, 2>(256, 512, 3072),
                            make_gemm<double, xsimd::fma3<xsimd::avx2>, 6, 2>(256, 512, 3072),
                            Kernels<float, xsimd::fma3<xsimd::avx2>>::table(),
                            Kernels<double, xsimd::fma3<xsimd::avx2>>::table()};
  return k;
}

}  // namespace teo::simd
