// AVX-512 (Zen 4, Skylake-SP and later), compiled with -mavx512f -mavx512dq -mavx512vl -mfma.
#include "fp8_kernels.hpp"
#include "gemm_kernel.hpp"
#include "vector_kernels.hpp"

namespace teo::simd {

// 32 zmm registers: a 12 x 2-vector tile keeps 24 accumulators, 2 B vectors and 1 broadcast in
// flight; 2 FMA pipes x 4-cycle latency need at least 8 independent chains, and 24 hide the loads.
// Double uses 8 x 3 vectors, also 24 accumulators (the tile BLIS gives Zen 4): on Zen 4 its GEMMs
// ran 5-10% faster than with 12 x 2, while 8 x 3 in float lost on the small preset, whose 256
// outputs are not a multiple of its 48 columns.
//
// Blocking on AMD Zen 4 (and any vendor not named): KC x NR of B (384 x 32 floats = 48 KiB, 384 x
// 24 doubles = 72 KiB) streams from L1/L2; MC x KC of A (144 x 384 = 216 KiB in float, 432 KiB in
// double) stays in the 1 MiB L2; NC bounds the shared B panel for L3. The tiles and KCs come from
// teo_blocking_sweep and teo bench runs recorded in docs/performance.md.
//
// Intel (Sapphire and Emerald Rapids: 2 MiB L2 and 48 KiB L1d per core, an L3 far away on the
// mesh): Split::owned, each thread owning a band of C and packing its own KC x NC blocks of B (NC
// 768: 1.2 MiB in float, 2.3 MiB in double) and keeping its packed A, so that no packed panel
// crosses cores. In teo_blocking_sweep on bert-base's shapes its ratio to OpenBLAS was 0.77-1.03
// in float and 0.87-1.15 in double, against 0.75-0.95 and 0.60-1.09 with the shared panel; other
// KC, MC and NC gained nothing beyond noise (docs/performance.md, "Intel Xeon").
const IsaKernels& kernels_avx512(CpuVendor vendor) {
  static const IsaKernels other =
      one_tile_isa("avx512", make_gemm<float, xsimd::avx512f, 12, 2>(384, 144, 3072),
                   make_gemm<double, xsimd::avx512f, 8, 3>(384, 144, 3072),
                   Kernels<float, xsimd::avx512f>::table(),
                   Kernels<double, xsimd::avx512f>::table(), rounding_table<xsimd::avx512f>());
  static const IsaKernels intel =
      one_tile_isa("avx512", make_gemm<float, xsimd::avx512f, 12, 2>(384, 144, 768, Split::owned),
                   make_gemm<double, xsimd::avx512f, 8, 3>(384, 144, 768, Split::owned),
                   Kernels<float, xsimd::avx512f>::table(),
                   Kernels<double, xsimd::avx512f>::table(), rounding_table<xsimd::avx512f>());
  return vendor == CpuVendor::intel ? intel : other;
}

}  // namespace teo::simd
