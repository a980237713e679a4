// Google Benchmark: dequantizing a 4096 x 4096 weight (teo::dequantize, GGUF's block types) to
// float32 on two threads, against a memcpy of the same float32 bytes in the same run. GB/s counts
// the packed bytes read and the float32 bytes written; values/s is the rate a streamed linear
// would be fed at. The dequantization is the scalar definition on each block for now (no xsimd
// kernel yet): docs/performance.md, "Quantized weights".
// The quantized linear (QuantLinear: dequantize the 4096 x 4096 weight, then y = x W^T in float32,
// as teo's linear op case computes it) against the dense float32 linear (DenseLinear) on the same
// shapes, for 1 and 512 rows of x.
// Run: build/bench/teo_microbench --benchmark_filter='Dequant|Linear'

#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "teo/backend.hpp"
#include "teo/dequant.hpp"
#include "teo/layers/linear.hpp"
#include "teo/quant.hpp"

namespace {

constexpr std::int64_t kValues = std::int64_t{4096} * 4096;

void BM_Dequant(benchmark::State& state, teo::quant::GgmlType t) {
  teo::ScopedSettings restore;
  teo::set_backend(teo::Backend::simd);
  teo::set_num_threads(2);
  std::vector<float> w(static_cast<std::size_t>(kValues));
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  for (auto& x : w) x = normal(rng);
  const auto shape = teo::quant::block_shape(t);
  std::vector<std::uint8_t> packed(static_cast<std::size_t>(kValues / shape.values * shape.bytes));
  teo::quantize(t, w.data(), kValues, packed.data());
  for (auto _ : state) {
    teo::dequantize(t, packed.data(), kValues, w.data());
    benchmark::DoNotOptimize(w.data());
    benchmark::ClobberMemory();
  }
  const auto bytes = static_cast<double>(packed.size() + w.size() * sizeof(float));
  state.counters["GB/s"] =
      benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["Gvalues/s"] = benchmark::Counter(static_cast<double>(kValues) * 1e-9,
                                                   benchmark::Counter::kIsIterationInvariantRate);
}

void BM_DequantMemcpy(benchmark::State& state) {
  std::vector<float> a(static_cast<std::size_t>(kValues), 1.0f), b(a.size());
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), a.size() * sizeof(float));
    benchmark::DoNotOptimize(b.data());
    benchmark::ClobberMemory();
  }
  state.counters["GB/s"] =
      benchmark::Counter(2.0 * static_cast<double>(a.size() * sizeof(float)) * 1e-9,
                         benchmark::Counter::kIsIterationInvariantRate);
}

constexpr teo::index_t kDim = 4096;

std::vector<float> normal_values(std::size_t n, unsigned seed, float sd) {
  std::vector<float> v(n);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, sd);
  for (auto& x : v) x = normal(rng);
  return v;
}

// y (rows, 4096) = x W^T with W dequantized from type t first (a quantized linear), or with W
// float32 already (t = f32: the dense linear).
void BM_Linear(benchmark::State& state, teo::quant::GgmlType t) {
  teo::ScopedSettings restore;
  teo::set_backend(teo::Backend::simd);
  teo::set_num_threads(2);
  const auto rows = static_cast<teo::index_t>(state.range(0));
  auto w = normal_values(static_cast<std::size_t>(kValues), 1, 0.02f);
  const auto x = normal_values(static_cast<std::size_t>(rows * kDim), 2, 1.0f);
  std::vector<float> y(static_cast<std::size_t>(rows * kDim));
  const bool dense = t == teo::quant::GgmlType::f32;
  std::vector<std::uint8_t> packed;
  if (!dense) {
    const auto shape = teo::quant::block_shape(t);
    packed.resize(static_cast<std::size_t>(kValues / shape.values * shape.bytes));
    teo::quantize(t, w.data(), kValues, packed.data());
  }
  for (auto _ : state) {
    if (!dense) teo::dequantize(t, packed.data(), kValues, w.data());
    teo::linear_forward<float>(y.data(), x.data(), w.data(), nullptr, rows, kDim, kDim);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * static_cast<double>(rows) * static_cast<double>(kValues) * 1e-9,
                         benchmark::Counter::kIsIterationInvariantRate);
}

using teo::quant::GgmlType;
BENCHMARK_CAPTURE(BM_Linear, DenseLinear_f32, GgmlType::f32)
    ->Arg(1)
    ->Arg(512)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_Linear, QuantLinear_q4_k, GgmlType::q4_k)
    ->Arg(1)
    ->Arg(512)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_Linear, QuantLinear_nvfp4, GgmlType::nvfp4)
    ->Arg(1)
    ->Arg(512)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_Dequant, q8_0, GgmlType::q8_0)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Dequant, q4_0, GgmlType::q4_0)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Dequant, q4_k, GgmlType::q4_k)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Dequant, q6_k, GgmlType::q6_k)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Dequant, mxfp4, GgmlType::mxfp4)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Dequant, nvfp4, GgmlType::nvfp4)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_DequantMemcpy)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
