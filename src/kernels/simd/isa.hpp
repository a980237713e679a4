// The interface between the ISA-neutral drivers and the per-ISA translation units. Each of
// avx512.cpp, avx2.cpp, neon.cpp and scalar.cpp is compiled with its own flags and exports one
// table of plain functions; nothing else in it is visible. The drivers (threads, packing, blocking)
// are compiled for the baseline and call through the table, so no inline function compiled for a
// wide ISA can leak into code that runs on a narrower CPU.
#pragma once

#include <cstdint>

#include "teo/types.hpp"

namespace teo::simd {

// How the micro-kernel starts its accumulators: from zero (C is never read), from C, or from
// beta * C.
enum class Start : int { zero = 0, c = 1, beta_c = 2 };

// How the blocked driver (gemm_driver.hpp) shares a product among threads. Neither changes a bit.
enum class Split : int {
  // Row blocks, a multiple of the thread count; each NC-column B panel is packed once, by all
  // threads together, and read by all of them.
  shared_panel = 0,
  // Each thread owns a band of C (rows or columns, cutting the larger dimension) and packs its own
  // blocks of B and A: no panel crosses cores and no thread waits for another until the product
  // ends.
  owned = 1,
};

template <class Real>
struct GemmKernel {
  int mr;              // rows of the register tile
  int nr;              // columns of the register tile (a multiple of the vector width)
  index_t kc, mc, nc;  // cache blocking: KC for L1 (B sliver), MC for the A block, NC for L3
  // C (mc, nc) = start(C) + Ap * Bp over kc, one MR x NR tile at a time (jr outer, ir inner).
  // Ap: ceil(mc / MR) slivers, each kc x MR (k-major); Bp: ceil(nc / NR) slivers, each kc x NR.
  // Every C element is one fused multiply-add chain in increasing k, so the result depends on
  // neither MR, NR nor the vector width.
  void (*macro)(index_t mc, index_t nc, index_t kc, const Real* ap, const Real* bp, Real* c,
                index_t ldc, Start start, Real beta);
  // The whole product on the same tiles without the blocked driver, for small products (see
  // small_gemm in gemm_kernel.hpp): the same chains, so the same bits. `scratch` holds
  // k * (round_up(n, nr) + mr) values.
  void (*small)(bool ta, bool tb, index_t m, index_t n, index_t k, Real alpha, const Real* a,
                index_t lda, const Real* b, index_t ldb, Real* c, index_t ldc, Start start,
                Real beta, Real* scratch);
  // Packed panels of ceil(rows / width) slivers, width MR (pack_a) or NR (pack_b); see pack_panel
  // in gemm_kernel.hpp. Sliver s at d + s * kc * width holds d[p * width + i] =
  // alpha * op(S)(s * width + i, p), zero past `rows`; op(S)(i, p) = src[i * ld + p] when
  // transposed, src[p * ld + i] otherwise.
  void (*pack_a)(bool transposed, Real* d, const Real* src, index_t ld, index_t rows, index_t kc,
                 Real alpha);
  void (*pack_b)(bool transposed, Real* d, const Real* src, index_t ld, index_t rows, index_t kc,
                 Real alpha);
  Split split = Split::shared_panel;
  // Split::owned keeps a task's packed A for all of k, across its NC panels, when that takes at
  // most this many bytes; beyond, each A block is packed again for every panel.
  index_t keep_a_bytes = index_t{16} << 20;
};

// The non-GEMM stages' kernels (simd/vector_kernels.hpp), per row or per element range.
template <class Real>
struct VectorKernels {
  void (*activation_forward)(Real* out, const Real* in, index_t n, Activation act);
  // din = (accumulate ? din : +0) + act'(in) * dout
  void (*activation_backward)(Real* din, const Real* dout, const Real* in, index_t n,
                              Activation act, bool accumulate);
  void (*softmax_forward_row)(Real* prow, const Real* srow, index_t visible, index_t n);
  void (*softmax_backward_row)(Real* dsrow, const Real* prow, const Real* dprow, index_t n);
  void (*layer_norm_forward_row)(Real* y, Real* mean, Real* rstd, const Real* x, const Real* w,
                                 const Real* b, index_t cols, Real eps);
  void (*layer_norm_backward_row)(Real* dx, const Real* g, const Real* x, const Real* w, Real mean,
                                  Real rstd, index_t cols, bool accumulate);
  void (*layer_norm_param_grads)(Real* dw, Real* db, const Real* g, const Real* x, const Real* mean,
                                 const Real* rstd, index_t rows, index_t cols, index_t c0,
                                 index_t c1);
  // The elementary functions themselves, for testing their accuracy.
  void (*math)(Real* out, const Real* in, index_t n, MathFn fn);
  // The FMA peak probe (teo::bench::fma_peak): `iters` steps of kPeakChains independent fused
  // multiply-add chains, each on one vector of `lanes` values; returns their sum, so that none is
  // optimised away.
  Real (*fma_chains)(std::int64_t iters);
  int lanes;
};

// Independent FMA chains in the peak probe: at least pipes x latency (2 x 4 on Zen 4 and 5, and on
// Intel cores since Skylake) to keep every FMA pipe busy, and few enough for AVX2's 16 registers
// with the two constants.
inline constexpr int kPeakChains = 12;

// Rounding float32 to the reduced formats (simd/round_kernels.hpp), bitwise the same on every ISA.
struct RoundKernels {
  // out = in rounded to p (bf16, fp16 or tf32) to nearest even, as floats; out may be in. Returns
  // whether a finite value became infinite.
  bool (*round)(float* out, const float* in, index_t n, Precision p);
  // The bf16 or fp16 bits of in, rounded to nearest even; and back (exact).
  void (*narrow)(std::uint16_t* out, const float* in, index_t n, Precision p);
  void (*widen)(float* out, const std::uint16_t* in, index_t n, Precision p);
  // out = in rounded to the fp8 format f to nearest even, as floats; out may be in. Beyond the
  // largest finite value: that value when saturating, else inf (E5M2) or NaN (E4M3). Returns
  // whether a finite value became inf or NaN.
  bool (*round_fp8)(float* out, const float* in, index_t n, Fp8Format f, bool saturate);
  // The fp8 bytes of in, rounded as round_fp8 does; and back (exact).
  void (*narrow_fp8)(std::uint8_t* out, const float* in, index_t n, Fp8Format f, bool saturate);
  void (*widen_fp8)(float* out, const std::uint8_t* in, index_t n, Fp8Format f);
  // The E8M0 bytes (2^(byte - 127); 0xFF is NaN) of in: floor(log2 |x|), or its ceiling when `up`,
  // less `offset`, clamped to 0 .. 254. Zero gives 0; a negative, infinite or NaN value gives 0xFF.
  void (*to_e8m0)(std::uint8_t* out, const float* in, index_t n, int offset, bool up);
};

struct IsaKernels {
  const char* name;
  GemmKernel<float> sgemm;
  GemmKernel<double> dgemm;
  // A second register tile, for products the first pads badly (attention's 64- and 32-wide ones
  // against a 24-wide tile): pick_tile takes it when it pads C 5% less. Both compute the same
  // chains, so the choice never changes a bit. The first one where an ISA has a single tile.
  GemmKernel<float> sgemm_alt;
  GemmKernel<double> dgemm_alt;
  VectorKernels<float> svec;
  VectorKernels<double> dvec;
  RoundKernels rounding;
};

// The table of an ISA with one register tile per type: the second tile is the first.
inline IsaKernels one_tile_isa(const char* name, const GemmKernel<float>& sgemm,
                               const GemmKernel<double>& dgemm, const VectorKernels<float>& svec,
                               const VectorKernels<double>& dvec, const RoundKernels& rounding) {
  return IsaKernels{name, sgemm, dgemm, sgemm, dgemm, svec, dvec, rounding};
}

const IsaKernels& kernels_scalar();
#if defined(__x86_64__) || defined(_M_X64)
const IsaKernels& kernels_avx2();
// The AVX-512 table of a vendor: the same register tiles and vector kernels, the GEMM blocking and
// split tuned for the vendor's cores (Intel: private L2 of 2 MiB, 48 KiB L1d; others: AMD Zen 4's).
enum class CpuVendor { other, intel };
const IsaKernels& kernels_avx512(CpuVendor vendor);
#endif
#if defined(__aarch64__)
const IsaKernels& kernels_neon();
#endif

}  // namespace teo::simd
