// The routed experts at a Qwen3-30B-A3B-shaped layer (E 128, k 8, D 2048, moe_d_ff 768) in
// float, against the one GEMM that would do the same expert work if every pair went to one
// expert (the grouped layout's ideal: one product of T k rows), on the simd backend.
// docs/performance.md has the figures and the command.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "teo/backend.hpp"
#include "teo/layers/linear.hpp"
#include "teo/layers/moe.hpp"
#include "teo/rng.hpp"

namespace {

constexpr teo::index_t kE = 128, kK = 8, kD = 2048, kF = 768;

std::vector<float> draw(teo::index_t n, double amp, std::uint64_t stream) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < v.size(); ++i)
    v[i] = static_cast<float>(amp * (2 * teo::rng::uniform01(7, stream, i) - 1));
  return v;
}

struct Layer {
  teo::MoeSpec spec;
  std::vector<float> gate, w_gate, w_up, w_down;
  Layer() {
    spec.router.experts = kE;
    spec.router.top_k = kK;
    spec.router.norm_topk_prob = true;
    spec.d_model = kD;
    spec.d_ff = kF;
    gate = draw(kE * kD, 0.05, 1);
    w_gate = draw(kE * kF * kD, 0.02, 2);
    w_up = draw(kE * kF * kD, 0.02, 3);
    w_down = draw(kE * kD * kF, 0.03, 4);
  }
  teo::MoeWeights<float> weights() const {
    return {gate.data(), nullptr, nullptr, w_gate.data(), w_up.data(), w_down.data()};
  }
};

const Layer& layer() {
  static const Layer l;
  return l;
}

// The experts' flops: three products of (T k, D) by (D, F) or (F, D).
double expert_flops(teo::index_t T) {
  return 6.0 * static_cast<double>(T * kK) * kD * kF;
}

void BM_MoeForward(benchmark::State& state) {
  teo::ScopedSettings keep;
  teo::set_backend(teo::Backend::simd);
  const teo::index_t T = state.range(0);
  const auto x = draw(T * kD, 1, 5);
  layer();  // drawn once, outside the timing
  teo::MoeActs<float> a;
  for (auto _ : state) {
    teo::moe_forward(layer().spec, layer().weights(), x.data(), T, nullptr, a);
    benchmark::DoNotOptimize(a.y.data());
  }
  state.counters["expert_GFLOPs"] = benchmark::Counter(
      expert_flops(T) * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

void BM_MoeBackward(benchmark::State& state) {
  teo::ScopedSettings keep;
  teo::set_backend(teo::Backend::simd);
  const teo::index_t T = state.range(0);
  const auto x = draw(T * kD, 1, 5);
  const auto dy = draw(T * kD, 1, 6);
  teo::MoeActs<float> a;
  teo::moe_forward(layer().spec, layer().weights(), x.data(), T, nullptr, a);
  std::vector<float> gg(layer().gate.size()), gwg(layer().w_gate.size()), gwu(gwg.size()),
      gwd(layer().w_down.size()), dx(x.size());
  teo::MoeGrads<float> g{gg.data(), nullptr, gwg.data(), gwu.data(), gwd.data()};
  for (auto _ : state) {
    teo::moe_backward(layer().spec, layer().weights(), x.data(), T, a, dy.data(), 0.0f, 0.0f,
                      dx.data(), g);
    benchmark::DoNotOptimize(dx.data());
  }
  // the backward's products are twice the forward's
  state.counters["expert_GFLOPs"] = benchmark::Counter(
      2 * expert_flops(T) * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

// The same expert work as one GEMM per projection over all T k rows (one expert's weights).
void BM_MoeGroupedIdeal(benchmark::State& state) {
  teo::ScopedSettings keep;
  teo::set_backend(teo::Backend::simd);
  const teo::index_t T = state.range(0), N = T * kK;
  const auto in = draw(N * kD, 1, 5);
  std::vector<float> g(static_cast<std::size_t>(N * kF)), u(g.size()), y(in.size());
  for (auto _ : state) {
    teo::linear_forward<float>(g.data(), in.data(), layer().w_gate.data(), nullptr, N, kD, kF);
    teo::linear_forward<float>(u.data(), in.data(), layer().w_up.data(), nullptr, N, kD, kF);
    teo::linear_forward<float>(y.data(), g.data(), layer().w_down.data(), nullptr, N, kF, kD);
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["expert_GFLOPs"] = benchmark::Counter(
      expert_flops(T) * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

BENCHMARK(BM_MoeForward)->Arg(256)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_MoeBackward)->Arg(256)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_MoeGroupedIdeal)->Arg(256)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
