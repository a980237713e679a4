// Google Benchmark: GEMM at the encoder's shapes, teo's simd kernel and OpenBLAS in the same run.
// Run: build/bench/teo_microbench --benchmark_repetitions=5 --benchmark_report_aggregates_only
#include <benchmark/benchmark.h>

#include <vector>

#include "teo/backend.hpp"
#include "teo/kernels.hpp"
#include "teo/rng.hpp"

namespace {

template <class Real>
void BM_Gemm(benchmark::State& state, teo::Backend backend, teo::Trans ta, teo::Trans tb) {
  const teo::index_t m = state.range(0), n = state.range(1), k = state.range(2);
  teo::ScopedSettings restore;
  teo::set_backend(backend);
  teo::set_num_threads(static_cast<int>(state.range(3)));
  std::vector<Real> a(m * k), b(k * n), c(m * n);
  for (std::size_t i = 0; i < a.size(); ++i)
    a[i] = static_cast<Real>(teo::rng::uniform01(1, 1, i) - 0.5);
  for (std::size_t i = 0; i < b.size(); ++i)
    b[i] = static_cast<Real>(teo::rng::uniform01(1, 2, i) - 0.5);
  const teo::index_t lda = ta == teo::Trans::no ? k : m, ldb = tb == teo::Trans::no ? n : k;
  for (auto _ : state) {
    teo::gemm<Real>(ta, tb, m, n, k, Real(1), a.data(), lda, b.data(), ldb, Real(0), c.data(), n);
    benchmark::DoNotOptimize(c.data());
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] = benchmark::Counter(
      2.0 * m * n * k, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}

void shapes(benchmark::internal::Benchmark* b) {
  for (long threads : {1, 2}) {
    b->Args({1024, 768, 768, threads});
    b->Args({1024, 3072, 768, threads});
    b->Args({1024, 768, 3072, threads});
  }
  b->ArgNames({"m", "n", "k", "threads"})->UseRealTime()->Unit(benchmark::kMillisecond);
}

void BM_GemmF32(benchmark::State& s, teo::Backend b, teo::Trans ta, teo::Trans tb) {
  BM_Gemm<float>(s, b, ta, tb);
}
void BM_GemmF64(benchmark::State& s, teo::Backend b, teo::Trans ta, teo::Trans tb) {
  BM_Gemm<double>(s, b, ta, tb);
}

using teo::Backend;
using teo::Trans;
BENCHMARK_CAPTURE(BM_GemmF32, simd_f32_NT, Backend::simd, Trans::no, Trans::yes)->Apply(shapes);
BENCHMARK_CAPTURE(BM_GemmF32, blas_f32_NT, Backend::blas, Trans::no, Trans::yes)->Apply(shapes);
BENCHMARK_CAPTURE(BM_GemmF64, simd_f64_NT, Backend::simd, Trans::no, Trans::yes)->Apply(shapes);
BENCHMARK_CAPTURE(BM_GemmF64, blas_f64_NT, Backend::blas, Trans::no, Trans::yes)->Apply(shapes);
BENCHMARK_CAPTURE(BM_GemmF32, simd_f32_NN, Backend::simd, Trans::no, Trans::no)->Apply(shapes);
BENCHMARK_CAPTURE(BM_GemmF32, blas_f32_NN, Backend::blas, Trans::no, Trans::no)->Apply(shapes);
BENCHMARK_CAPTURE(BM_GemmF32, simd_f32_TN, Backend::simd, Trans::yes, Trans::no)->Apply(shapes);
BENCHMARK_CAPTURE(BM_GemmF32, blas_f32_TN, Backend::blas, Trans::yes, Trans::no)->Apply(shapes);

}  // namespace

BENCHMARK_MAIN();
