// Google Benchmark: GEMM at the encoder's shapes, teo's simd kernel and OpenBLAS in the same run.
// Run: build/bench/teo_microbench --benchmark_repetitions=5 --benchmark_report_aggregates_only
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <chrono>
#include <cmath>
#include <map>
#include <type_traits>
#include <utility>
#include <vector>

#include "teo/backend.hpp"
#include "teo/bench.hpp"
#include "teo/kernels.hpp"
#include "teo/rng.hpp"

namespace {

// The FMA peak of the best ISA for Real on `threads` threads (teo::bench::fma_peak), measured once
// per run: the yardstick of the "of_peak" column.
template <class Real>
const teo::bench::Peak& peak(int threads) {
  static std::map<int, teo::bench::Peak> cache;
  auto it = cache.find(threads);
  if (it == cache.end()) {
    teo::ScopedSettings restore;
    teo::set_num_threads(threads);
    it = cache.emplace(threads, teo::bench::fma_peak<Real>()).first;
  }
  return it->second;
}

// GFLOP/s of a product of `flops` per iteration, and its fraction of the FMA peak from the timed
// loop's wall-clock `seconds`.
template <class Real>
void rate_counters(benchmark::State& state, double flops, int threads, double seconds) {
  state.counters["GFLOP/s"] = benchmark::Counter(
      flops, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
  const double gflops = flops * static_cast<double>(state.iterations()) / seconds / 1e9;
  // NaN where the rate is above the peak: a probe error, never a result.
  state.counters["of_peak"] =
      teo::bench::fraction_of_peak(gflops, peak<Real>(threads)).value_or(std::nan(""));
}

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
  peak<Real>(static_cast<int>(state.range(3)));  // measured before the timed loop
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    teo::gemm<Real>(ta, tb, m, n, k, Real(1), a.data(), lda, b.data(), ldb, Real(0), c.data(), n);
    benchmark::DoNotOptimize(c.data());
    benchmark::ClobberMemory();
  }
  rate_counters<Real>(state, 2.0 * m * n * k, static_cast<int>(state.range(3)),
                      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

void shapes(benchmark::internal::Benchmark* b) {
  for (long threads : {1, 2}) {
    b->Args({1024, 768, 768, threads});
    b->Args({1024, 3072, 768, threads});
    b->Args({1024, 768, 3072, threads});
  }
  // The small preset's products (B * S = 2048, D = 256, F = 1024), 2 threads: the forward
  // projections (k = 256), the second FFN product (k = 1024) and a weight gradient (k = 2048).
  b->Args({2048, 768, 256, 2});
  b->Args({2048, 1024, 256, 2});
  b->Args({2048, 256, 1024, 2});
  b->Args({1024, 256, 2048, 2});
  // Attention's per-head products, which run on one thread inside a parallel region: scores and
  // context of the small preset (S = 64, Dh = 32) and of bert-base (S = 128, Dh = 64).
  b->Args({64, 64, 32, 1});
  b->Args({64, 32, 64, 1});
  b->Args({128, 128, 64, 1});
  b->Args({128, 64, 128, 1});
  b->ArgNames({"m", "n", "k", "threads"})->UseRealTime()->Unit(benchmark::kMillisecond);
}

// OpenBLAS as its users call it: one cblas call with OpenBLAS's own threads.
template <class Real>
void BM_OpenBlas(benchmark::State& state, teo::Trans ta, teo::Trans tb) {
  const int m = static_cast<int>(state.range(0)), n = static_cast<int>(state.range(1)),
            k = static_cast<int>(state.range(2));
  openblas_set_num_threads(static_cast<int>(state.range(3)));
  std::vector<Real> a(m * k), b(k * n), c(m * n);
  for (std::size_t i = 0; i < a.size(); ++i)
    a[i] = static_cast<Real>(teo::rng::uniform01(1, 1, i) - 0.5);
  for (std::size_t i = 0; i < b.size(); ++i)
    b[i] = static_cast<Real>(teo::rng::uniform01(1, 2, i) - 0.5);
  const auto TA = ta == teo::Trans::no ? CblasNoTrans : CblasTrans;
  const auto TB = tb == teo::Trans::no ? CblasNoTrans : CblasTrans;
  const int lda = ta == teo::Trans::no ? k : m, ldb = tb == teo::Trans::no ? n : k;
  peak<Real>(static_cast<int>(state.range(3)));
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    if constexpr (std::is_same_v<Real, float>) {
      cblas_sgemm(CblasRowMajor, TA, TB, m, n, k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f,
                  c.data(), n);
    } else {
      cblas_dgemm(CblasRowMajor, TA, TB, m, n, k, 1.0, a.data(), lda, b.data(), ldb, 0.0, c.data(),
                  n);
    }
    benchmark::DoNotOptimize(c.data());
    benchmark::ClobberMemory();
  }
  openblas_set_num_threads(1);
  rate_counters<Real>(state, 2.0 * m * n * k, static_cast<int>(state.range(3)),
                      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}
void BM_OpenBlasF32(benchmark::State& s, teo::Trans ta, teo::Trans tb) {
  BM_OpenBlas<float>(s, ta, tb);
}
void BM_OpenBlasF64(benchmark::State& s, teo::Trans ta, teo::Trans tb) {
  BM_OpenBlas<double>(s, ta, tb);
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
BENCHMARK_CAPTURE(BM_OpenBlasF32, openblas_f32_NT, Trans::no, Trans::yes)->Apply(shapes);
BENCHMARK_CAPTURE(BM_GemmF64, simd_f64_NT, Backend::simd, Trans::no, Trans::yes)->Apply(shapes);
BENCHMARK_CAPTURE(BM_GemmF64, blas_f64_NT, Backend::blas, Trans::no, Trans::yes)->Apply(shapes);
BENCHMARK_CAPTURE(BM_OpenBlasF64, openblas_f64_NT, Trans::no, Trans::yes)->Apply(shapes);
BENCHMARK_CAPTURE(BM_GemmF32, simd_f32_NN, Backend::simd, Trans::no, Trans::no)->Apply(shapes);
BENCHMARK_CAPTURE(BM_OpenBlasF32, openblas_f32_NN, Trans::no, Trans::no)->Apply(shapes);
BENCHMARK_CAPTURE(BM_GemmF32, simd_f32_TN, Backend::simd, Trans::yes, Trans::no)->Apply(shapes);
BENCHMARK_CAPTURE(BM_GemmF64, simd_f64_NN, Backend::simd, Trans::no, Trans::no)->Apply(shapes);
BENCHMARK_CAPTURE(BM_OpenBlasF64, openblas_f64_NN, Trans::no, Trans::no)->Apply(shapes);
BENCHMARK_CAPTURE(BM_GemmF64, simd_f64_TN, Backend::simd, Trans::yes, Trans::no)->Apply(shapes);
BENCHMARK_CAPTURE(BM_OpenBlasF64, openblas_f64_TN, Trans::yes, Trans::no)->Apply(shapes);
BENCHMARK_CAPTURE(BM_OpenBlasF32, openblas_f32_TN, Trans::yes, Trans::no)->Apply(shapes);

}  // namespace

BENCHMARK_MAIN();
