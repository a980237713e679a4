// AVX-512 (Zen 4, Skylake-SP and later), compiled with -mavx512f -mavx512dq -mavx512vl -mfma.
#include "gemm_kernel.hpp"
#include "round_kernels.hpp"
#include "vector_kernels.hpp"

namespace teo::simd {

// 32 zmm registers: a 12 x 2-vector tile keeps 24 accumulators, 2 B vectors and 1 broadcast in
// flight; 2 FMA pipes x 4-cycle latency need at least 8 independent chains, and 24 hide the loads.
// Double uses 8 x 3 vectors, also 24 accumulators (the tile BLIS gives Zen 4): on Zen 4 its GEMMs
// ran 5-10% faster than with 12 x 2, while 8 x 3 in float lost on the small preset, whose 256
// outputs are not a multiple of its 48 columns. KC x NR of B (384 x 32 floats = 48 KiB, 384 x 24
// doubles = 72 KiB) streams from L1/L2; MC x KC of A (144 x 384 = 216 KiB in float, 432 KiB in
// double) stays in the 1 MiB L2; NC bounds the B panel for the shared L3. The tiles and KCs come
// from teo_blocking_sweep and teo bench runs recorded in docs/performance.md.
const IsaKernels& kernels_avx512() {
  static const IsaKernels k =
      one_tile_isa("avx512", make_gemm<float, xsimd::avx512f, 12, 2>(384, 144, 3072),
                   make_gemm<double, xsimd::avx512f, 8, 3>(384, 144, 3072),
                   Kernels<float, xsimd::avx512f>::table(),
                   Kernels<double, xsimd::avx512f>::table(), Rounding<xsimd::avx512f>::table());
  return k;
}

}  // namespace teo::simd
