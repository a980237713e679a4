// The OpenBLAS backend: cblas_sgemm / cblas_dgemm for GEMM-shaped work.
#include <cblas.h>

#include <algorithm>
#include <limits>
#include <string>

#include "kernels_internal.hpp"

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

}  // namespace

template <>
void blas_gemm<float>(Trans ta, Trans tb, index_t m, index_t n, index_t k, float alpha,
                      const float* a, index_t lda, const float* b, index_t ldb, float beta,
                      float* c, index_t ldc) {
  if (m <= 0 || n <= 0) return;
  cblas_sgemm(CblasRowMajor, tr(ta), tr(tb), to_blasint(m, "m"), to_blasint(n, "n"),
              to_blasint(k, "k"), alpha, a, to_blasint(std::max<index_t>(lda, 1), "lda"), b,
              to_blasint(std::max<index_t>(ldb, 1), "ldb"), beta, c, to_blasint(ldc, "ldc"));
}

template <>
void blas_gemm<double>(Trans ta, Trans tb, index_t m, index_t n, index_t k, double alpha,
                       const double* a, index_t lda, const double* b, index_t ldb, double beta,
                       double* c, index_t ldc) {
  if (m <= 0 || n <= 0) return;
  cblas_dgemm(CblasRowMajor, tr(ta), tr(tb), to_blasint(m, "m"), to_blasint(n, "n"),
              to_blasint(k, "k"), alpha, a, to_blasint(std::max<index_t>(lda, 1), "lda"), b,
              to_blasint(std::max<index_t>(ldb, 1), "ldb"), beta, c, to_blasint(ldc, "ldc"));
}

void blas_set_threads(int n) {
  openblas_set_num_threads(n);
}

}  // namespace teo::detail
