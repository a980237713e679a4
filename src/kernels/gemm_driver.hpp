// The BLIS-style GEMM driver: the outer loops (jc over NC; B packed for every KC block of the
// panel; then ic over MC row blocks, each walking pc over KC with its own packed A) around the two
// inner loops and micro-kernel of an ISA's table (simd/isa.hpp). Free of threading: the caller
// supplies the loop executor, so the same code runs parallel under oneTBB (simd_gemm.cpp) and
// serially in the standalone cross-ISA self-test.
#pragma once

#include <algorithm>
#include <vector>

#include "simd/isa.hpp"
#include "teo/kernels.hpp"
#include "teo/tensor.hpp"

namespace teo::detail {

template <class Real>
using Buffer = std::vector<Real, AlignedAllocator<Real>>;

// How a product with this beta starts its accumulators (C is never read when beta is 0).
template <class Real>
simd::Start start_of(Real beta) {
  return beta == Real(0)   ? simd::Start::zero
         : beta == Real(1) ? simd::Start::c
                           : simd::Start::beta_c;
}

// The scratch the small-product path (GemmKernel::small) needs for C (., n) over k.
template <class Real>
index_t small_scratch_size(const simd::GemmKernel<Real>& kern, index_t n, index_t k) {
  return k * ((n + kern.nr - 1) / kern.nr * kern.nr + kern.mr);
}

// Packs op(A)[i0 : i0 + mc, p0 : p0 + kc] into MR-row slivers, k-major, zero-padded, each value
// multiplied by alpha (skipped when alpha is 1, so that value is exact). Row i of op(A) is
// contiguous when A is not transposed: the slivers are then its transpose.
template <class Real>
void pack_a(const simd::GemmKernel<Real>& kern, Real* dst, Trans ta, const Real* a, index_t lda,
            index_t i0, index_t mc, index_t p0, index_t kc, Real alpha) {
  if (ta == Trans::no)
    kern.pack_a(true, dst, a + i0 * lda + p0, lda, mc, kc, alpha);
  else
    kern.pack_a(false, dst, a + p0 * lda + i0, lda, mc, kc, alpha);
}

// Packs the NR-column slivers of op(B)[p0 : p0 + kc, j0 : j0 + nb], k-major, zero-padded.
template <class Real>
void pack_b(const simd::GemmKernel<Real>& kern, Real* d, Trans tb, const Real* b, index_t ldb,
            index_t p0, index_t kc, index_t j0, index_t nb) {
  if (tb == Trans::no)
    kern.pack_b(false, d, b + p0 * ldb + j0, ldb, nb, kc, Real(1));
  else
    kern.pack_b(true, d, b + j0 * ldb + p0, ldb, nb, kc, Real(1));
}

// C = alpha op(A) op(B) + beta C (see teo/kernels.hpp for the rounding). for_each(n, f) runs f(i)
// for i < n, serially or in parallel; a_buffer() gives the running task its own A buffer; bpack
// holds the shared B panel. `threads` only balances the row blocks.
template <class Real, class ForEach, class ABuffer>
void gemm_blocked(const simd::GemmKernel<Real>& kern, Trans ta, Trans tb, index_t m, index_t n,
                  index_t k, Real alpha, const Real* a, index_t lda, const Real* b, index_t ldb,
                  Real beta, Real* c, index_t ldc, index_t threads, Buffer<Real>& bpack,
                  ForEach&& for_each, ABuffer&& a_buffer) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0 || alpha == Real(0)) {
    // C = beta * C; with beta == 0, C is written without being read.
    for (index_t i = 0; i < m; ++i)
      for (index_t j = 0; j < n; ++j)
        c[i * ldc + j] = beta == Real(0) ? Real(0) : beta * c[i * ldc + j];
    return;
  }
  const int mr = kern.mr, nr = kern.nr;
  const index_t kc_max = kern.kc, mc_max = kern.mc;
  // The number of row blocks is a multiple of the thread count and the MR-row tiles are spread
  // evenly over them, so every thread gets the same work. MC changes only which task computes a
  // tile, never the order of any sum.
  const index_t tiles = (m + mr - 1) / mr;
  const index_t max_tiles = std::max<index_t>(1, mc_max / mr);
  const index_t want_blocks = threads * ((tiles + threads * max_tiles - 1) / (threads * max_tiles));
  const index_t mc = ((tiles + want_blocks - 1) / want_blocks) * mr;
  const index_t ic_blocks = (m + mc - 1) / mc;

  // The B panel holds every k block of NC columns at once, so each task walks all of K for its
  // row block without waiting for the others: one barrier per NC panel instead of two per KC
  // block. NC shrinks so that the panel stays within kPanelBytes (a share of L3), and the panels
  // of one product are of equal width.
  const index_t kPanelBytes = index_t{16} << 20;
  const index_t nc_cap = std::max<index_t>(
      nr, std::min<index_t>(kern.nc, kPanelBytes / static_cast<index_t>(sizeof(Real)) /
                                         std::max<index_t>(k, 1) / nr * nr));
  const index_t panels = (n + nc_cap - 1) / nc_cap;
  const index_t nc_max = ((n + panels - 1) / panels + nr - 1) / nr * nr;
  const index_t kblocks = (k + kc_max - 1) / kc_max;
  for (index_t jc = 0; jc < n; jc += nc_max) {
    const index_t nc = std::min<index_t>(nc_max, n - jc);
    const index_t slivers = (nc + nr - 1) / nr;
    // Panel layout: k block pb holds `slivers` slivers of kc x NR, at offset pc * slivers * NR.
    bpack.resize(static_cast<std::size_t>(slivers * nr * k));
    Real* panel = bpack.data();
    // Packing tasks of up to kGroup slivers each, so that a row of B is read a few cache lines
    // at a time.
    constexpr index_t kGroup = 4;
    const index_t groups = (slivers + kGroup - 1) / kGroup;
    for_each(kblocks * groups, [&](index_t t) {
      const index_t pb = t / groups, s0 = (t % groups) * kGroup;
      const index_t pc = pb * kc_max, kc = std::min<index_t>(kc_max, k - pc);
      pack_b(kern, panel + pc * slivers * nr + s0 * kc * nr, tb, b, ldb, pc, kc, jc + s0 * nr,
             std::min<index_t>(kGroup * nr, nc - s0 * nr));
    });
    for_each(ic_blocks, [&](index_t ib) {
      const index_t ic = ib * mc;
      const index_t mb = std::min<index_t>(mc, m - ic);
      Buffer<Real>& ap = a_buffer();
      for (index_t pc = 0; pc < k; pc += kc_max) {
        const index_t kc = std::min<index_t>(kc_max, k - pc);
        // The first k block starts from zero or beta * C; later ones continue the same chains
        // from the partial sums stored in C, so KC never changes a result.
        const simd::Start start = pc > 0 ? simd::Start::c : start_of(beta);
        ap.resize(static_cast<std::size_t>((mb + mr - 1) / mr * mr * kc));
        pack_a(kern, ap.data(), ta, a, lda, ic, mb, pc, kc, alpha);
        kern.macro(mb, nc, kc, ap.data(), panel + pc * slivers * nr, c + ic * ldc + jc, ldc, start,
                   beta);
      }
    });
  }
}

}  // namespace teo::detail
