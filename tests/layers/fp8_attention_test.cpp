// Attention's forward products in fp8 (Fp8Recipe::attention, docs/fp8.md "Attention"): the scores
// and the context against plain loops written here from the docs (one scale per (batch, K/V head),
// probabilities cast with the row's largest at 2^8), the same bits on both paths and on every
// thread count and ISA, the bf16 path when the recipe leaves attention out, and named errors.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "kernels/parallel.hpp"
#include "support.hpp"
#include "teo/backend.hpp"
#include "teo/errors.hpp"
#include "teo/fp8.hpp"
#include "teo/layers/attention.hpp"
#include "teo/rounding.hpp"

namespace teo {
namespace {

using test::uniform_vector;

// Two sequences of 5 and 3 queries on 11 and 6 keys (bottom-right causal), 4 query heads on 2 K/V
// heads; q and k have channels of different magnitudes, so that each block's amax matters.
struct Problem {
  index_t b = 2, h = 4, hkv = 2, sq = 5, skv = 11, dh = 6, dv = 4;
  std::vector<std::int64_t> lq{5, 3}, lk{11, 6};
  bool variants = false;  // a soft-cap and sinks: the backward recomputes the scores
  std::vector<float> q, k, v, dctx, sinks;
  explicit Problem(bool with_variants) : variants(with_variants) {
    q = uniform_vector<float>(b * h * sq * dh, 31, "q", -2, 2);
    k = uniform_vector<float>(b * hkv * skv * dh, 31, "k", -2, 2);
    v = uniform_vector<float>(b * hkv * skv * dv, 31, "v");
    dctx = uniform_vector<float>(b * h * sq * dv, 31, "dcontext");
    sinks = uniform_vector<float>(h, 31, "sinks");
    for (std::size_t i = 0; i < q.size(); ++i) q[i] *= static_cast<float>(1 + i % 3);
    for (std::size_t i = 0; i < k.size(); ++i) k[i] *= static_cast<float>(1 + i % 4);
  }
  AttentionArgs<float> args() const {
    AttentionArgs<float> a;
    a.batch = b;
    a.heads = h;
    a.seq_len = sq;
    a.kv_len = skv;
    a.d_head = dh;
    a.d_head_v = dv;
    a.lengths = lq.data();
    a.kv_lengths = lk.data();
    a.causal = true;
    a.variant.kv_heads = hkv;
    if (variants) {
      a.variant.softcap = 3.0;
      a.variant.sinks = sinks.data();
    }
    return a;
  }
};

struct Result {
  std::vector<float> context, scores, probs, lse, dq, dk, dv, dsinks;
};

Fp8Recipe with_attention(bool on = true) {
  Fp8Recipe r;
  r.attention = on;
  return r;
}

// The forward and backward of p under `emulated` (and the recipe), materialised or row-blocked.
Result run(const Problem& p, bool rows, Precision emulated = Precision::fp8,
           const Fp8Recipe& recipe = with_attention()) {
  const detail::EmulationScope scope(emulated, recipe);
  const auto n = [](index_t x) { return static_cast<std::size_t>(x); };
  Result o;
  o.context.assign(n(p.b * p.h * p.sq * p.dv), -7);
  o.lse.assign(n(p.b * p.h * p.sq), -7);
  o.dq.assign(p.q.size(), 0);
  o.dk.assign(p.k.size(), 0);
  o.dv.assign(p.v.size(), 0);
  o.dsinks.assign(n(p.h), 0);
  AttentionArgs<float> a = p.args();
  a.qkv_write = GradWrite::overwrite;
  if (p.variants) a.variant.dsinks = o.dsinks.data();
  AttentionForward<float> f{.context = o.context.data(),
                            .lse = o.lse.data(),
                            .q = p.q.data(),
                            .k = p.k.data(),
                            .v = p.v.data()};
  AttentionBackward<float> g{.dq = o.dq.data(),
                             .dk = o.dk.data(),
                             .dv = o.dv.data(),
                             .dcontext = p.dctx.data(),
                             .q = p.q.data(),
                             .k = p.k.data(),
                             .v = p.v.data()};
  if (rows) {
    a.block_rows = 2;
    attention_forward_rows(a, f);
    attention_backward_rows(a, g);
    return o;
  }
  o.scores.assign(std::max<std::size_t>(n(p.b * p.h * p.sq * p.skv), 1), -7);  // never null
  o.probs = o.scores;
  std::vector<float> dprobs(o.scores.size()), dscores(o.scores.size());
  f.scores = o.scores.data();
  f.probs = o.probs.data();
  attention_forward(a, f);
  g.dprobs = dprobs.data();
  g.dscores = dscores.data();
  g.probs = o.probs.data();
  attention_backward(a, g);
  return o;
}

bool same_bits(const std::vector<float>& x, const std::vector<float>& y) {
  return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
}

// x quantized as a whole with current scaling: the fp8 values (as floats) and the scale.
std::pair<std::vector<float>, float> quantized(const float* x, std::size_t n) {
  float amax = 0;
  for (std::size_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float mul = 448.0f / amax;
  std::vector<float> q(n);
  for (std::size_t i = 0; i < n; ++i) q[i] = round_to_fp8(Fp8Format::e4m3, true, x[i] * mul);
  return {q, amax / 448.0f};
}

TEST(Fp8Attention, ScoresAndContextAreTheFp8ProductsOfOneScalePerBatchAndKvHead) {
  const Problem p(false);
  const Result r = run(p, /*rows=*/false);
  const index_t g = p.h / p.hkv;
  const double alpha = 1.0 / std::sqrt(static_cast<double>(p.dh));
  double worst_scores = 0, worst_context = 0;
  for (index_t b = 0; b < p.b; ++b) {
    for (index_t kh = 0; kh < p.hkv; ++kh) {
      const index_t bg = b * p.hkv + kh;
      // the group's queries are contiguous: heads kh * g .. kh * g + g - 1
      const auto [q8, dq] = quantized(p.q.data() + (b * p.h + kh * g) * p.sq * p.dh,
                                      static_cast<std::size_t>(g * p.sq * p.dh));
      const auto [k8, dk] =
          quantized(p.k.data() + bg * p.skv * p.dh, static_cast<std::size_t>(p.skv * p.dh));
      const auto [v8, dv] =
          quantized(p.v.data() + bg * p.skv * p.dv, static_cast<std::size_t>(p.skv * p.dv));
      for (index_t hg = 0; hg < g; ++hg) {
        const index_t bh = b * p.h + kh * g + hg;
        for (index_t i = 0; i < p.sq; ++i) {
          const float* prow = r.probs.data() + (bh * p.sq + i) * p.skv;
          float pmax = 0;
          for (index_t j = 0; j < p.skv; ++j) pmax = std::max(pmax, prow[j]);
          const float pd = pmax > 0 ? pmax / 256 : 1;
          for (index_t j = 0; j < p.skv; ++j) {
            const float got = r.scores[static_cast<std::size_t>((bh * p.sq + i) * p.skv + j)];
            if (std::isinf(got)) continue;  // masked
            double s = 0, mass = 0;  // the sum, and the sum of magnitudes (float32's rounding)
            for (index_t c = 0; c < p.dh; ++c) {
              const double t =
                  static_cast<double>(q8[static_cast<std::size_t>((hg * p.sq + i) * p.dh + c)]) *
                  k8[static_cast<std::size_t>(j * p.dh + c)];
              s += t;
              mass += std::fabs(t);
            }
            const double unit = static_cast<double>(dq) * dk * alpha;
            s *= unit;
            // the stored scores are rounded to bf16 (8 bits), the sum to float32
            const double err = std::fabs(got - s);
            worst_scores = std::max(worst_scores, err / std::max(std::fabs(s), 1e-30));
            EXPECT_LE(err, std::ldexp(std::fabs(s), -8) + 1e-6 * mass * unit)
                << "score " << bh << "," << i << "," << j;
          }
          for (index_t c = 0; c < p.dv; ++c) {
            double ctx = 0, mass = 0;
            for (index_t j = 0; j < p.skv; ++j) {
              const double t =
                  static_cast<double>(round_to_fp8(Fp8Format::e4m3, true, prow[j] / pd)) *
                  v8[static_cast<std::size_t>(j * p.dv + c)];
              ctx += t;
              mass += std::fabs(t);
            }
            const double unit = static_cast<double>(pd) * dv;
            ctx *= unit;
            const double got = r.context[static_cast<std::size_t>((bh * p.sq + i) * p.dv + c)];
            const double err = std::fabs(got - ctx);
            worst_context = std::max(worst_context, err / std::max(mass * unit, 1e-30));
            EXPECT_LE(err, 1e-6 * mass * unit) << "context " << bh << "," << i << "," << c;
          }
        }
      }
    }
  }
  RecordProperty("worst_score_error", std::to_string(worst_scores));
  RecordProperty("worst_context_error", std::to_string(worst_context));
  // the fp8 path is taken: bf16 attention's scores are nowhere near as coarse
  const Result bf16 = run(p, false, Precision::bf16);
  double apart = 0;
  for (std::size_t i = 0; i < r.scores.size(); ++i)
    if (std::isfinite(r.scores[i]))
      apart = std::max(apart, static_cast<double>(std::fabs(r.scores[i] - bf16.scores[i])));
  EXPECT_GT(apart, 1e-2);
}

// On the simd backend, as every attention (docs/semantics.md 14.8): the row-blocked backward
// continues the materialised product's chains.
TEST(Fp8Attention, BothPathsGiveTheSameBitsOnEveryThreadCountAndIsa) {
  ScopedSettings outer;
  set_backend(Backend::simd);
  for (bool variants : {false, true}) {
    const Problem p(variants);
    const Result first = run(p, /*rows=*/false);
    for (Isa isa : supported_isas()) {
      for (int threads : {1, 2, 3}) {
        ScopedSettings keep;
        set_isa(isa);
        set_num_threads(threads);
        for (bool rows : {false, true}) {
          const Result r = run(p, rows);
          const std::string where = std::string(variants ? "soft-cap and sinks, " : "") +
                                    (rows ? "rows, " : "materialised, ") + to_string(isa) + ", " +
                                    std::to_string(threads) + " thread(s)";
          EXPECT_TRUE(same_bits(r.context, first.context)) << where;
          EXPECT_TRUE(same_bits(r.lse, first.lse)) << where;
          EXPECT_TRUE(same_bits(r.dq, first.dq)) << where;
          EXPECT_TRUE(same_bits(r.dk, first.dk)) << where;
          EXPECT_TRUE(same_bits(r.dv, first.dv)) << where;
          EXPECT_TRUE(same_bits(r.dsinks, first.dsinks)) << where;
        }
      }
    }
  }
}

TEST(Fp8Attention, ARecipeWithoutAttentionRunsItInBf16) {
  for (bool rows : {false, true}) {
    const Problem p(true);
    const Result off = run(p, rows, Precision::fp8, with_attention(false));
    const Result bf16 = run(p, rows, Precision::bf16, with_attention(false));
    EXPECT_TRUE(same_bits(off.context, bf16.context)) << rows;
    EXPECT_TRUE(same_bits(off.dq, bf16.dq)) << rows;
    EXPECT_TRUE(same_bits(off.dk, bf16.dk)) << rows;
    EXPECT_TRUE(same_bits(off.dv, bf16.dv)) << rows;
  }
}

// Degenerate sizes take the fp8 path without error: no keys give a context of zeros (and lse
// -inf), as in every precision.
TEST(Fp8Attention, NoKeysGiveAZeroContext) {
  Problem p(false);
  p.skv = 0;
  p.lk = {0, 0};
  p.k = {0.0f};  // never read; not null
  p.v = {0.0f};
  for (bool rows : {false, true}) {
    const Result r = run(p, rows);
    for (float c : r.context) EXPECT_EQ(c, 0.0f);
    for (float l : r.lse) EXPECT_EQ(l, -std::numeric_limits<float>::infinity());
    for (float d : r.dq) EXPECT_EQ(d, 0.0f);
  }
}

TEST(Fp8Attention, ANonFiniteOperandIsARangeErrorNamingIt) {
  for (const char* which : {"q", "k", "v"}) {
    Problem p(false);
    std::vector<float>& x = which[0] == 'q' ? p.q : which[0] == 'k' ? p.k : p.v;
    x[3] = std::numeric_limits<float>::quiet_NaN();
    for (bool rows : {false, true}) {
      try {
        run(p, rows);
        ADD_FAILURE() << which << " accepted";
      } catch (const RangeError& e) {
        EXPECT_NE(std::string(e.what()).find(std::string("attention ") + which), std::string::npos)
            << e.what();
      }
    }
  }
}

}  // namespace
}  // namespace teo
