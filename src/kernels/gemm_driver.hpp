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

// The packing buffers of one task: its A block and, under Split::owned, its own B block.
template <class Real>
struct PackBuffers {
  Buffer<Real> a, b;
};

// `count` pieces of `total` units, as equal as whole units allow: piece q is
// [total * q / count, total * (q + 1) / count).
inline index_t piece_start(index_t total, index_t count, index_t q) {
  return total * q / count;
}

// Split::owned (see simd/isa.hpp): `threads` tasks each own a band of C, whole MR-row tiles or
// whole NR-column slivers, and pack their own operands: for every NC panel of the band and every
// KC block of k, the task packs that KC x NC block of B, then walks its rows in MC blocks, running
// the macro-kernel on each A block, packed on the first panel and kept for the others (up to the
// kernel's keep_a_bytes). Every C element still sums its k blocks in order, continuing from C, so
// the bits are those of the shared-panel split.
template <class Real, class ForEach, class Buffers>
void gemm_owned(const simd::GemmKernel<Real>& kern, Trans ta, Trans tb, index_t m, index_t n,
                index_t k, Real alpha, const Real* a, index_t lda, const Real* b, index_t ldb,
                Real beta, Real* c, index_t ldc, index_t threads, ForEach&& for_each,
                Buffers&& buffers) {
  const index_t mr = kern.mr, nr = kern.nr;
  const index_t tiles = (m + mr - 1) / mr, slivers = (n + nr - 1) / nr;
  // Every task packs all of the operand its band does not cut (B under bands of rows, A under
  // bands of columns), so the bands cut the larger one.
  const bool by_columns = slivers * nr > tiles * mr;
  const index_t bands = std::max<index_t>(1, std::min(threads, by_columns ? slivers : tiles));
  for_each(bands, [&](index_t band) {
    const index_t t0 = by_columns ? 0 : piece_start(tiles, bands, band);
    const index_t t1 = by_columns ? tiles : piece_start(tiles, bands, band + 1);
    const index_t s0 = by_columns ? piece_start(slivers, bands, band) : 0;
    const index_t s1 = by_columns ? piece_start(slivers, bands, band + 1) : slivers;
    const index_t r0 = t0 * mr, r1 = std::min(m, t1 * mr);
    const index_t c0 = s0 * nr, c1 = std::min(n, s1 * nr);
    if (r0 >= r1 || c0 >= c1) return;
    PackBuffers<Real>& buf = buffers();
    // Equal panels and equal row blocks within the band, each at most NC columns and MC rows.
    const index_t band_slivers = s1 - s0, band_tiles = t1 - t0;
    const index_t panels = (band_slivers * nr + kern.nc - 1) / kern.nc;
    const index_t nc_max = (band_slivers + panels - 1) / panels * nr;
    const index_t max_tiles = std::max<index_t>(1, kern.mc / mr);
    const index_t blocks = (band_tiles + max_tiles - 1) / max_tiles;
    const index_t mc = (band_tiles + blocks - 1) / blocks * mr;
    // Kept A: the KC block at k offset pc holds the band's slivers at pc * band_tiles * MR, so the
    // MC block at row ic starts (ic - r0) / MR slivers further.
    const bool keep_a =
        panels > 1 && band_tiles * mr * k * static_cast<index_t>(sizeof(Real)) <= kern.keep_a_bytes;
    buf.a.resize(static_cast<std::size_t>(keep_a ? band_tiles * mr * k : mc * kern.kc));
    for (index_t jc = c0; jc < c1; jc += nc_max) {
      const index_t nc = std::min(nc_max, c1 - jc);
      for (index_t pc = 0; pc < k; pc += kern.kc) {
        const index_t kc = std::min<index_t>(kern.kc, k - pc);
        buf.b.resize(static_cast<std::size_t>((nc + nr - 1) / nr * nr * kc));
        pack_b(kern, buf.b.data(), tb, b, ldb, pc, kc, jc, nc);
        // The first k block starts from zero or beta * C; later ones continue from C.
        const simd::Start start = pc > 0 ? simd::Start::c : start_of(beta);
        for (index_t ic = r0; ic < r1; ic += mc) {
          const index_t mb = std::min(mc, r1 - ic);
          Real* ap = keep_a ? buf.a.data() + pc * band_tiles * mr + (ic - r0) * kc : buf.a.data();
          if (!keep_a || jc == c0) pack_a(kern, ap, ta, a, lda, ic, mb, pc, kc, alpha);
          kern.macro(mb, nc, kc, ap, buf.b.data(), c + ic * ldc + jc, ldc, start, beta);
        }
      }
    }
  });
}

// C = alpha op(A) op(B) + beta C (see teo/kernels.hpp for the rounding), split among `threads`
// tasks as the kernel's table says (simd/isa.hpp, Split). for_each(n, f) runs f(i) for i < n,
// serially or in parallel; buffers() gives the running task its own PackBuffers; bpack holds the
// B panel that Split::shared_panel shares among the tasks.
template <class Real, class ForEach, class Buffers>
void gemm_blocked(const simd::GemmKernel<Real>& kern, Trans ta, Trans tb, index_t m, index_t n,
                  index_t k, Real alpha, const Real* a, index_t lda, const Real* b, index_t ldb,
                  Real beta, Real* c, index_t ldc, index_t threads, Buffer<Real>& bpack,
                  ForEach&& for_each, Buffers&& buffers) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0 || alpha == Real(0)) {
    // C = beta * C; with beta == 0, C is written without being read.
    for (index_t i = 0; i < m; ++i)
      for (index_t j = 0; j < n; ++j)
        c[i * ldc + j] = beta == Real(0) ? Real(0) : beta * c[i * ldc + j];
    return;
  }
  if (kern.split == simd::Split::owned)
    return gemm_owned(kern, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, threads, for_each,
                      buffers);
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
      Buffer<Real>& ap = buffers().a;
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
