// Google Benchmark: the non-GEMM stage kernels at bert-base's shapes (B*S = 1024 rows, D = 768,
// F = 3072, 12 heads of 128 x 128 scores), simd backend against the reference loops in one run;
// the FFN's middle as separate passes and fused; and one thread's memcpy of 64 MiB, the memory
// bandwidth the element-wise stages are bound by (GB/s counts the bytes read and written).
// Run: build/bench/teo_microbench --benchmark_filter=Stage
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "teo/backend.hpp"
#include "teo/layers/attention.hpp"
#include "teo/layers/dropout.hpp"
#include "teo/layers/embedding.hpp"
#include "teo/layers/feed_forward.hpp"
#include "teo/layers/layer_norm.hpp"
#include "teo/layers/linear.hpp"
#include "teo/rng.hpp"

namespace {

enum class Stage {
  gelu_fwd,
  gelu_bwd,
  layer_norm_fwd,
  layer_norm_bwd,
  attention_fwd,
  dropout,
  embedding,
  ffn_separate,  // fc1's bias, GELU and dropout as three passes over (rows, F)
  ffn_fused,     // the same as ffn_hidden_forward's one pass
  memcpy_64mib
};

// Uniform on [-r, r].
std::vector<float> data(std::size_t n, std::uint64_t stream, double r = 2) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<float>(2 * r * teo::rng::uniform01(3, stream, i) - r);
  return v;
}

void BM_Stage(benchmark::State& state, Stage stage, teo::Backend backend) {
  teo::ScopedSettings restore;
  teo::set_backend(backend);
  teo::set_num_threads(2);
  const teo::index_t rows = 1024, d = 768, f = 3072, heads = 12, s = 128, b = 8;
  // x spans [-4, 4], so that GELU meets both of erf's branches (|x| / sqrt(2) above and below 2).
  const auto x = data(rows * f, 1, 4), g = data(rows * f, 2), w = data(f, 3), bias = data(f, 4);
  std::vector<float> y(rows * f), dx(rows * f), mean(rows), rstd(rows), dw(d), db(d);
  std::vector<std::uint8_t> mask(rows * d);
  std::vector<std::int64_t> tokens(rows), lengths(b, s);
  teo::AttentionArgs<float> attn;
  attn.batch = b;
  attn.heads = heads;
  attn.seq_len = s;
  attn.d_head = 64;
  attn.lengths = lengths.data();
  for (teo::index_t i = 0; i < rows; ++i) tokens[i] = i * 7 % 1000;
  std::vector<float> q = data(b * heads * s * 64, 5), k = data(b * heads * s * 64, 6),
                     v = data(b * heads * s * 64, 7), scores(b * heads * s * s),
                     probs(b * heads * s * s), ctx(b * heads * s * 64);
  std::vector<std::uint8_t> ffn_mask(rows * f);
  teo::dropout_mask(ffn_mask.data(), rows * f, 1, "dropout.bench", 0.1);
  std::vector<float> pre(rows * f), hidden(rows * f);
  const std::size_t copy_bytes = stage == Stage::memcpy_64mib ? std::size_t{64} << 20 : 0;
  std::vector<char> from(copy_bytes, 1), to(copy_bytes);
  teo::index_t elements = 0;
  double bytes = 0;  // read and written per iteration, where it is the figure of merit
  for (auto _ : state) {
    if (stage == Stage::ffn_separate || stage == Stage::ffn_fused) {
      // both add the bias in place: fc1's product is x again on every iteration
      state.PauseTiming();
      std::copy(x.begin(), x.end(), pre.begin());
      state.ResumeTiming();
    }
    switch (stage) {
      case Stage::gelu_fwd:
        teo::activation_forward(y.data(), x.data(), rows * f, teo::Activation::gelu);
        elements = rows * f;
        break;
      case Stage::gelu_bwd:
        teo::activation_backward(dx.data(), g.data(), x.data(), rows * f, teo::Activation::gelu);
        elements = rows * f;
        break;
      case Stage::layer_norm_fwd:
        teo::layer_norm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), bias.data(),
                                rows, d, 1e-5f);
        elements = rows * d;
        break;
      case Stage::layer_norm_bwd:
        teo::layer_norm_backward(dx.data(), dw.data(), db.data(), g.data(), x.data(), w.data(),
                                 mean.data(), rstd.data(), rows, d);
        elements = rows * d;
        break;
      case Stage::attention_fwd:
        teo::attention_forward(attn, {.context = ctx.data(),
                                      .scores = scores.data(),
                                      .probs = probs.data(),
                                      .q = q.data(),
                                      .k = k.data(),
                                      .v = v.data()});
        elements = b * heads * s * s;
        break;
      case Stage::dropout:
        teo::dropout_mask(mask.data(), rows * d, 1, "dropout.bench", 0.1);
        teo::dropout_forward(y.data(), x.data(), mask.data(), rows * d, 1.0f / 0.9f);
        elements = rows * d;
        break;
      case Stage::embedding:
        teo::embedding_forward(y.data(), tokens.data(), x.data(), rows, d, 1.0f);
        elements = rows * d;
        break;
      case Stage::ffn_separate:
        teo::add_bias(pre.data(), bias.data(), rows, f);
        teo::activation_forward(hidden.data(), pre.data(), rows * f, teo::Activation::gelu);
        teo::dropout_forward(y.data(), hidden.data(), ffn_mask.data(), rows * f, 1.0f / 0.9f);
        elements = rows * f;
        break;
      case Stage::ffn_fused:
        teo::ffn_hidden_forward(pre.data(), hidden.data(), y.data(), bias.data(), ffn_mask.data(),
                                1.0f / 0.9f, rows, f, teo::Activation::gelu);
        elements = rows * f;
        break;
      case Stage::memcpy_64mib:
        std::memcpy(to.data(), from.data(), copy_bytes);
        benchmark::DoNotOptimize(to.data());
        elements = static_cast<teo::index_t>(copy_bytes / sizeof(float));
        bytes = 2.0 * static_cast<double>(copy_bytes);
        break;
    }
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  state.counters["Melem/s"] = benchmark::Counter(static_cast<double>(elements),
                                                 benchmark::Counter::kIsIterationInvariantRate);
  if (bytes > 0) {
    state.counters["GB/s"] = benchmark::Counter(
        bytes, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
  }
}

using teo::Backend;
#define TEO_STAGE_BENCH(name)                                                          \
  BENCHMARK_CAPTURE(BM_Stage, name##_simd, Stage::name, Backend::simd)->UseRealTime(); \
  BENCHMARK_CAPTURE(BM_Stage, name##_reference, Stage::name, Backend::reference)->UseRealTime();
TEO_STAGE_BENCH(gelu_fwd)
TEO_STAGE_BENCH(gelu_bwd)
TEO_STAGE_BENCH(layer_norm_fwd)
TEO_STAGE_BENCH(layer_norm_bwd)
TEO_STAGE_BENCH(attention_fwd)
TEO_STAGE_BENCH(dropout)
TEO_STAGE_BENCH(embedding)
TEO_STAGE_BENCH(ffn_separate)
TEO_STAGE_BENCH(ffn_fused)
BENCHMARK_CAPTURE(BM_Stage, memcpy_64mib, Stage::memcpy_64mib, Backend::simd)->UseRealTime();

}  // namespace
