// The kernel entry point. Every matrix product in teo goes through gemm(), which dispatches on the
// backend (teo/backend.hpp): the reference loops, the cache-blocked SIMD kernels or OpenBLAS.
#pragma once

#include "teo/errors.hpp"

namespace teo {

enum class Trans { no, yes };

// How a backward function writes an input gradient: added to what the buffer holds, or written
// whole without reading it (the buffer may hold anything, NaN included). Overwriting gives the
// bits of accumulating into a zero-filled buffer, so a caller that skips the zero-fill changes no
// result.
enum class GradWrite { accumulate, overwrite };

// C = alpha * op(A) * op(B) + beta * C, row-major, with op(A) (m, k), op(B) (k, n), C (m, n).
// A is (m, k) with leading dimension lda when ta == no, and (k, m) when ta == yes; B likewise.
// With beta == 0, C is never read (it may hold NaN). The backend (teo/backend.hpp) decides the
// rounding, and each is deterministic:
//   reference: acc = sum over increasing k of a * b (separate multiply and add, in Real), then
//              C = alpha * acc (+ beta * C);
//   simd:      C = fma chain over increasing k of (alpha * a) * b, starting from 0 (beta == 0), C
//              (beta == 1) or beta * C: bitwise identical for every ISA, blocking and thread count;
//   blas:      OpenBLAS's own order.
template <class Real>
void gemm(Trans ta, Trans tb, index_t m, index_t n, index_t k, Real alpha, const Real* a,
          index_t lda, const Real* b, index_t ldb, Real beta, Real* c, index_t ldc);

extern template void gemm<float>(Trans, Trans, index_t, index_t, index_t, float, const float*,
                                 index_t, const float*, index_t, float, float*, index_t);
extern template void gemm<double>(Trans, Trans, index_t, index_t, index_t, double, const double*,
                                  index_t, const double*, index_t, double, double*, index_t);

}  // namespace teo
