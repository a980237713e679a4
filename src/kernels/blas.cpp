// The OpenBLAS backend: cblas_sgemm / cblas_dgemm for GEMM-shaped work.
#include <cblas.h>

#include <algorithm>
#include <limits>
#include <string>

#include <type_traits>

#include "kernels_internal.hpp"
#include "parallel.hpp"

namespace teo::detail {

namespace {

CBLAS_TRANSPOSE tr(Trans t) {
  return t == Trans::no ? CblasNoTrans : CblasTrans;
}

// Debian's OpenBLAS takes 32-bit sizes.
blasint to_blasint(index_t v, const char* what) {
  if (v > static_cast<index_t>(std::numeric_limits<blasint>::max())) {
    throw ShapeError(std::string("blas backend: ") + what + " = " + std::to_string(v) +
                     " exceeds OpenBLAS's 32-bit size limit");
  }
  return static_cast<blasint>(v);
}

template <class Real>
void call(Trans ta, Trans tb, index_t m, index_t n, index_t k, Real alpha, const Real* a,
          index_t lda, const Real* b, index_t ldb, Real beta, Real* c, index_t ldc) {
  const blasint M = to_blasint(m, "m"), N = to_blasint(n, "n"), K = to_blasint(k, "k");
  const blasint LDA = to_blasint(std::max<index_t>(lda, 1), "lda");
  const blasint LDB = to_blasint(std::max<index_t>(ldb, 1), "ldb");
  const blasint LDC = to_blasint(ldc, "ldc");
  if constexpr (std::is_same_v<Real, float>) {
    cblas_sgemm(CblasRowMajor, tr(ta), tr(tb), M, N, K, alpha, a, LDA, b, LDB, beta, c, LDC);
  } else {
    cblas_dgemm(CblasRowMajor, tr(ta), tr(tb), M, N, K, alpha, a, LDA, b, LDB, beta, c, LDC);
  }
}

// OpenBLAS's threads split the work by thread count, and its result changes with it. So OpenBLAS
// always runs on one thread here, and teo cuts C into fixed 256 x 256 blocks, one call each, spread
// over teo's own threads: the blocks, and so the bits, are the same for any thread count.
constexpr index_t kBlock = 256;

}  // namespace

template <class Real>
void blas_gemm(Trans ta, Trans tb, index_t m, index_t n, index_t k, Real alpha, const Real* a,
               index_t lda, const Real* b, index_t ldb, Real beta, Real* c, index_t ldc) {
  if (m <= 0 || n <= 0) return;
  const index_t mb = (m + kBlock - 1) / kBlock, nb = (n + kBlock - 1) / kBlock;
  parallel_for_each(mb * nb, [&](index_t blk) {
    const index_t i0 = (blk / nb) * kBlock, j0 = (blk % nb) * kBlock;
    const index_t bm = std::min(kBlock, m - i0), bn = std::min(kBlock, n - j0);
    // With k = 0, A and B may be empty (null): no offsets then (they would not be read anyway).
    const Real* ab = k == 0 ? a : ta == Trans::no ? a + i0 * lda : a + i0;
    const Real* bb = k == 0 ? b : tb == Trans::no ? b + j0 : b + j0 * ldb;
    call(ta, tb, bm, bn, k, alpha, ab, lda, bb, ldb, beta, c + i0 * ldc + j0, ldc);
  });
}

template void blas_gemm<float>(Trans, Trans, index_t, index_t, index_t, float, const float*,
                               index_t, const float*, index_t, float, float*, index_t);
template void blas_gemm<double>(Trans, Trans, index_t, index_t, index_t, double, const double*,
                                index_t, const double*, index_t, double, double*, index_t);

void blas_set_threads(int n) {
  openblas_set_num_threads(n);
}

}  // namespace teo::detail

namespace teo {

std::string openblas_core() {
  const char* name = openblas_get_corename();
  return name ? name : "unknown";
}

}  // namespace teo
