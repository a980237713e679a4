// AVX-512 (Zen 4, Skylake-SP and later), compiled with -mavx512f -mavx512dq -mavx512vl -mfma.
#include "gemm_kernel.hpp"
#include "round_kernels.hpp"
#include "vector_kernels.hpp"

namespace teo::simd {

// 32 zmm registers: a 12 x 2-vector tile keeps 24 accumulators, 2 B vectors and 1 broadcast in
// flight; 2 FMA pipes x 4-cycle latency need at least 8 independent chains, and 24 hide the loads.
// KC x NR of B (384 x 32 floats or 384 x 16 doubles = 48 KiB) streams from L1/L2; MC x KC of A
// (144 x 384 = 216 KiB in float, 432 KiB in double) stays in the 1 MiB L2; NC bounds the B panel
// for the shared L3. Both KCs come from teo_blocking_sweep (docs/performance.md).
const IsaKernels& kernels_avx512() {
  static const IsaKernels k =
      one_tile_isa("avx512", make_gemm<float, xsimd::avx512f, 12, 2>(384, 144, 3072),
                   make_gemm<double, xsimd::avx512f, 12, 2>(384, 144, 3072),
                   Kernels<float, xsimd::avx512f>::table(),
                   Kernels<double, xsimd::avx512f>::table(), Rounding<xsimd::avx512f>::table());
  return k;
}

}  // namespace teo::simd
