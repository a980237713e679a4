// Internal: the backends' GEMM entry points, behind teo::gemm().
#pragma once

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
