// The BLIS-style GEMM driver: the outer three loops (jc over NC, pc over KC, ic over MC), packing,
// and threads. The two inner loops and the micro-kernel come from the ISA's table (simd/isa.hpp).
#include <algorithm>
#include <vector>

#include <tbb/enumerable_thread_specific.h>

#include "kernels_internal.hpp"
#include "parallel.hpp"
#include "teo/tensor.hpp"

namespace teo::detail {

namespace {

template <class Real>
using Buffer = std::vector<Real, AlignedAllocator<Real>>;

// op(A)(i, p) and op(B)(p, j) for row-major storage.
template <class Real>
inline Real at_a(Trans ta, const Real* a, index_t lda, index_t i, index_t p) {
  return ta == Trans::no ? a[i * lda + p] : a[p * lda + i];
}
template <class Real>
inline Real at_b(Trans tb, const Real* b, index_t ldb, index_t p, index_t j) {
  return tb == Trans::no ? b[p * ldb + j] : b[j * ldb + p];
}

// Packs op(A)[i0 : i0 + mc, p0 : p0 + kc] into MR-row slivers, k-major, zero-padded, each value
// multiplied by alpha (skipped when alpha is 1, so that value is exact).
template <class Real>
void pack_a(Real* dst, Trans ta, const Real* a, index_t lda, index_t i0, index_t mc, index_t p0,
            index_t kc, int mr, Real alpha) {
  for (index_t ir = 0; ir < mc; ir += mr) {
    const index_t mb = std::min<index_t>(mr, mc - ir);
    Real* d = dst + (ir / mr) * kc * mr;
    for (index_t p = 0; p < kc; ++p) {
      for (index_t i = 0; i < mb; ++i) {
        const Real v = at_a(ta, a, lda, i0 + ir + i, p0 + p);
        d[p * mr + i] = alpha == Real(1) ? v : alpha * v;
      }
      for (index_t i = mb; i < mr; ++i) d[p * mr + i] = Real(0);
    }
  }
}

// Packs one NR-column sliver of op(B)[p0 : p0 + kc, j0 : j0 + nb], k-major, zero-padded.
template <class Real>
void pack_b_sliver(Real* d, Trans tb, const Real* b, index_t ldb, index_t p0, index_t kc,
                   index_t j0, index_t nb, int nr) {
  for (index_t p = 0; p < kc; ++p) {
    for (index_t j = 0; j < nb; ++j) d[p * nr + j] = at_b(tb, b, ldb, p0 + p, j0 + j);
    for (index_t j = nb; j < nr; ++j) d[p * nr + j] = Real(0);
  }
}

// Below this many multiply-adds a GEMM runs on the calling thread: the attention's per-head
// products are parallelised by their caller, and forking costs more than it saves here.
constexpr index_t kSerialWork = index_t{1} << 18;

}  // namespace

template <class Real>
void simd_gemm(const simd::GemmKernel<Real>& kern, Trans ta, Trans tb, index_t m, index_t n,
               index_t k, Real alpha, const Real* a, index_t lda, const Real* b, index_t ldb,
               Real beta, Real* c, index_t ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0 || alpha == Real(0)) {
    // C = beta * C; with beta == 0, C is written without being read.
    for (index_t i = 0; i < m; ++i)
      for (index_t j = 0; j < n; ++j)
        c[i * ldc + j] = beta == Real(0) ? Real(0) : beta * c[i * ldc + j];
    return;
  }
  const int mr = kern.mr, nr = kern.nr;
  const bool serial = m * n * k <= kSerialWork || num_threads() == 1 || in_parallel_region();
  // MC adapts to the thread count so that every thread gets whole row blocks; it changes only
  // which task computes a tile, never the order of any sum.
  // The number of row blocks is a multiple of the thread count and the MR-row tiles are spread
  // evenly over them, so every thread gets the same work.
  const index_t threads = serial ? 1 : num_threads();
  const index_t tiles = (m + mr - 1) / mr;
  const index_t max_tiles = std::max<index_t>(1, kern.mc / mr);
  const index_t want_blocks = threads * ((tiles + threads * max_tiles - 1) / (threads * max_tiles));
  const index_t mc = ((tiles + want_blocks - 1) / want_blocks) * mr;
  const index_t ic_blocks = (m + mc - 1) / mc;

  // Packing buffers. A serial call makes no TBB call, so no other work can run on this thread
  // while it uses its thread_local buffers. A parallel call owns its B panel (its calling thread
  // may pick up other tasks while it waits), and each task packs A into its worker's own buffer,
  // which nothing else touches until that task returns.
  thread_local Buffer<Real> serial_a, serial_b;
  static tbb::enumerable_thread_specific<Buffer<Real>> worker_a;
  Buffer<Real> parallel_b;
  Buffer<Real>& bpack = serial ? serial_b : parallel_b;

  for (index_t jc = 0; jc < n; jc += kern.nc) {
    const index_t nc = std::min<index_t>(kern.nc, n - jc);
    const index_t slivers = (nc + nr - 1) / nr;
    for (index_t pc = 0; pc < k; pc += kern.kc) {
      const index_t kc = std::min<index_t>(kern.kc, k - pc);
      // The first k block starts from zero or beta * C; later ones continue the same chains from
      // the partial sums stored in C, so KC never changes a result.
      const simd::Start start = pc > 0            ? simd::Start::c
                                : beta == Real(0) ? simd::Start::zero
                                : beta == Real(1) ? simd::Start::c
                                                  : simd::Start::beta_c;
      bpack.resize(static_cast<std::size_t>(slivers * kc * nr));
      Real* bp = bpack.data();
      auto pack_sliver = [&](index_t s) {
        pack_b_sliver(bp + s * kc * nr, tb, b, ldb, pc, kc, jc + s * nr,
                      std::min<index_t>(nr, nc - s * nr), nr);
      };
      auto block = [&](index_t ib) {
        const index_t ic = ib * mc;
        const index_t mb = std::min<index_t>(mc, m - ic);
        Buffer<Real>& ap = serial ? serial_a : worker_a.local();
        ap.resize(static_cast<std::size_t>((mb + mr - 1) / mr * mr * kc));
        pack_a(ap.data(), ta, a, lda, ic, mb, pc, kc, mr, alpha);
        kern.macro(mb, nc, kc, ap.data(), bp, c + ic * ldc + jc, ldc, start, beta);
      };
      if (serial) {
        for (index_t s = 0; s < slivers; ++s) pack_sliver(s);
        for (index_t ib = 0; ib < ic_blocks; ++ib) block(ib);
      } else {
        parallel_for_each(slivers, pack_sliver);
        parallel_for_each(ic_blocks, block);
      }
    }
  }
}

template void simd_gemm<float>(const simd::GemmKernel<float>&, Trans, Trans, index_t, index_t,
                               index_t, float, const float*, index_t, const float*, index_t, float,
                               float*, index_t);
template void simd_gemm<double>(const simd::GemmKernel<double>&, Trans, Trans, index_t, index_t,
                                index_t, double, const double*, index_t, const double*, index_t,
                                double, double*, index_t);

}  // namespace teo::detail
