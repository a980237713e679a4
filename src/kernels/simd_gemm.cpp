// The simd backend's GEMM: gemm_driver.hpp under oneTBB.
#include <tbb/enumerable_thread_specific.h>

#include "gemm_driver.hpp"
#include "kernels_internal.hpp"
#include "parallel.hpp"

namespace teo::detail {

namespace {

// Below this many multiply-adds a GEMM runs on the calling thread: forking costs more than it
// saves. Inside a parallel region (an attention head) every GEMM runs on its task's thread.
constexpr index_t kSerialWork = index_t{1} << 18;
// At or below this many multiply-adds a GEMM skips the blocked driver and packs at most a
// transposed B and the edges (small_gemm in simd/gemm_kernel.hpp). That covers the small preset's
// per-head products (64 x 64 x 32), which it ran 20 to 30% faster than the packed path in
// teo_microbench (docs/kernels.md).
constexpr index_t kSmallWork = index_t{1} << 18;
// ... and when its scratch (a transposed B and the edges) holds at most this many values.
constexpr index_t kSmallScratch = index_t{1} << 16;

}  // namespace

template <class Real>
void simd_gemm(const simd::GemmKernel<Real>& kern, Trans ta, Trans tb, index_t m, index_t n,
               index_t k, Real alpha, const Real* a, index_t lda, const Real* b, index_t ldb,
               Real beta, Real* c, index_t ldc) {
  // Packing buffers, kept per thread so that their pages are faulted in once. A serial call makes
  // no TBB call, so no other work can run on this thread while it uses its buffers; in a parallel
  // call each task packs into its worker's own buffers, which nothing else touches until the task
  // returns (the task makes no TBB call).
  thread_local PackBuffers<Real> serial_buffers;
  thread_local Buffer<Real> serial_b;
  // The scratch bound keeps long, thin products (m = n = 1, k = 2^18) off this path, whose scratch
  // would hold k * (NR + MR) values for the rest of the thread's life.
  const index_t scratch_size = small_scratch_size(kern, n, k);
  if (m > 0 && n > 0 && k > 0 && alpha != Real(0) && m * n * k <= kSmallWork &&
      scratch_size <= kSmallScratch) {
    // Small products (attention's per-head GEMMs): no blocking, A and B read in place.
    thread_local Buffer<Real> scratch;
    scratch.resize(static_cast<std::size_t>(scratch_size));
    kern.small(ta == Trans::yes, tb == Trans::yes, m, n, k, alpha, a, lda, b, ldb, c, ldc,
               start_of(beta), beta, scratch.data());
    return;
  }
  static tbb::enumerable_thread_specific<PackBuffers<Real>> worker;
  const bool serial = m * n * k <= kSerialWork || num_threads() == 1 || in_parallel_region();
  if (serial) {
    gemm_blocked(
        kern, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, 1, serial_b,
        [](index_t count, auto&& f) {
          for (index_t i = 0; i < count; ++i) f(i);
        },
        [&]() -> PackBuffers<Real>& { return serial_buffers; });
  } else {
    // A parallel GEMM is only ever started outside a parallel region (nested ones run serially),
    // so no other call can reach this thread's panel while this one waits for its tasks.
    thread_local Buffer<Real> parallel_b;
    gemm_blocked(
        kern, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, num_threads(), parallel_b,
        [](index_t count, auto&& f) { parallel_for_each(count, f); },
        [&]() -> PackBuffers<Real>& { return worker.local(); });
  }
}

template void simd_gemm<float>(const simd::GemmKernel<float>&, Trans, Trans, index_t, index_t,
                               index_t, float, const float*, index_t, const float*, index_t, float,
                               float*, index_t);
template void simd_gemm<double>(const simd::GemmKernel<double>&, Trans, Trans, index_t, index_t,
                                index_t, double, const double*, index_t, const double*, index_t,
                                double, double*, index_t);

}  // namespace teo::detail
