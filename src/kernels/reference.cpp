// The plain loops: the oracle of the oracle. Clarity over speed.
#include "kernels_internal.hpp"

namespace teo::detail {

template <class Real>
void reference_gemm(Trans ta, Trans tb, index_t m, index_t n, index_t k, Real alpha, const Real* a,
                    index_t lda, const Real* b, index_t ldb, Real beta, Real* c, index_t ldc) {
  for (index_t i = 0; i < m; ++i) {
    for (index_t j = 0; j < n; ++j) {
      Real acc = 0;
      for (index_t p = 0; p < k; ++p) {
        const Real av = ta == Trans::no ? a[i * lda + p] : a[p * lda + i];
        const Real bv = tb == Trans::no ? b[p * ldb + j] : b[j * ldb + p];
        acc += av * bv;
      }
      Real& out = c[i * ldc + j];
      out = beta == Real(0) ? alpha * acc : alpha * acc + beta * out;
    }
  }
}

template void reference_gemm<float>(Trans, Trans, index_t, index_t, index_t, float, const float*,
                                    index_t, const float*, index_t, float, float*, index_t);
template void reference_gemm<double>(Trans, Trans, index_t, index_t, index_t, double, const double*,
                                     index_t, const double*, index_t, double, double*, index_t);

}  // namespace teo::detail
