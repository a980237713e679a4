// Internal: the backends' GEMM entry points, behind teo::gemm().
#pragma once

#include <type_traits>

#include "simd/isa.hpp"
#include "teo/backend.hpp"
#include "teo/kernels.hpp"

namespace teo::detail {

template <class Real>
void reference_gemm(Trans ta, Trans tb, index_t m, index_t n, index_t k, Real alpha, const Real* a,
                    index_t lda, const Real* b, index_t ldb, Real beta, Real* c, index_t ldc);

template <class Real>
void simd_gemm(const simd::GemmKernel<Real>& kern, Trans ta, Trans tb, index_t m, index_t n,
               index_t k, Real alpha, const Real* a, index_t lda, const Real* b, index_t ldb,
               Real beta, Real* c, index_t ldc);

// The register tile to use for C (m, n): the second of the two an ISA offers only when it pads C
// at least 5% less than the first (the first is the faster tile where both fit).
template <class Real>
const simd::GemmKernel<Real>& pick_tile(const simd::GemmKernel<Real>& first,
                                        const simd::GemmKernel<Real>& second, index_t m,
                                        index_t n) {
  const auto padded = [&](const simd::GemmKernel<Real>& g) {
    return (m + g.mr - 1) / g.mr * g.mr * ((n + g.nr - 1) / g.nr * g.nr);
  };
  return padded(second) * 20 < padded(first) * 19 ? second : first;
}

// The tile teo::gemm uses for C (m, n) from an ISA's table. A copy with other kc or mc computes the
// same bits (blocking never reorders a sum), which the GEMM tests and bench/blocking_sweep.cpp use.
template <class Real>
const simd::GemmKernel<Real>& gemm_tile(const simd::IsaKernels& t, index_t m, index_t n) {
  if constexpr (std::is_same_v<Real, float>)
    return pick_tile(t.sgemm, t.sgemm_alt, m, n);
  else
    return pick_tile(t.dgemm, t.dgemm_alt, m, n);
}

template <class Real>
void blas_gemm(Trans ta, Trans tb, index_t m, index_t n, index_t k, Real alpha, const Real* a,
               index_t lda, const Real* b, index_t ldb, Real beta, Real* c, index_t ldc);

// The vector kernels of the ISA currently selected (for the simd and blas backends).
template <class Real>
const simd::VectorKernels<Real>& vector_kernels();

// The kernel table of the ISA currently selected.
const simd::IsaKernels& isa_kernels();
const simd::IsaKernels& isa_kernels(Isa isa);

}  // namespace teo::detail
