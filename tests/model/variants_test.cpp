// The attention variants (docs/semantics.md, "Attention variants") against their definitions:
// properties that hold bit for bit (the plain layer is the special case), properties that hold to
// rounding (with the bound stated where it is asserted), and each variant's effect on the kept
// scores and probabilities. Gradients against finite differences are in gradient_test.cpp, the
// backends' agreement in backend_test.cpp.
#include <cmath>
#include <cstring>
#include <limits>

#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include "rc_support.hpp"
#include "support.hpp"
#include "teo/backend.hpp"
#include "teo/layers/attention.hpp"
#include "teo/layers/rope.hpp"

namespace teo {
namespace {

struct Pass {
  Activations<double> acts, dacts;
  Params<double> grads;
};

Pass run(const Params<double>& p, const Batch& b) {
  Pass r;
  forward(p, b, r.acts, {.dropout_seed = 3});
  backward(p, b, r.acts, r.grads, r.dacts);
  return r;
}

// The names two runs share, bitwise equal (activations, their gradients and the parameters').
void expect_same_bits(const Pass& a, const Pass& b) {
  for (const auto which : {&Pass::acts, &Pass::dacts}) {
    const auto x = test::named(a.*which), y = test::named(b.*which);
    for (const auto& [n, v] : x) {
      if (!y.count(n)) continue;
      RC_ASSERT(std::memcmp(v.data(), y.at(n).data(), v.size() * sizeof(double)) == 0);
    }
  }
  const auto x = test::named(a.grads), y = test::named(b.grads);
  RC_ASSERT(x.size() == y.size());
  for (const auto& [n, v] : x)
    RC_ASSERT(std::memcmp(v.data(), y.at(n).data(), v.size() * sizeof(double)) == 0);
}

// A small random config with some of the variants on, and a backend for the property.
ModelConfig gen_config() {
  ModelConfig c;
  c.attention.num_heads = *rc::gen::element<index_t>(1, 2, 4, 6);
  c.d_model = c.attention.num_heads * *rc::gen::element<index_t>(2, 4);
  c.ffn.d_ff = 7;
  c.num_layers = *rc::gen::inRange<index_t>(1, 3);
  c.embeddings.vocab_size = 13;
  c.embeddings.max_len = 9;
  c.head.num_classes = 3;
  c.norms.norm_first = *rc::gen::arbitrary<bool>();
  c.attention.causal = *rc::gen::arbitrary<bool>();
  c.dropout = *rc::gen::element(0.0, 0.25);
  c.embeddings.positional = *rc::gen::element(Positional::sinusoidal, Positional::rope,
                                              Positional::alibi, Positional::none);
  if (*rc::gen::arbitrary<bool>()) c.attention.attn_logit_softcap = *rc::gen::element(0.5, 3.0);
  c.attention.attn_sinks = *rc::gen::arbitrary<bool>();
  return c;
}

Batch gen_batch(const ModelConfig& c) {
  const index_t b = *rc::gen::inRange<index_t>(1, 4);
  const index_t s = *rc::gen::inRange<index_t>(1, c.embeddings.max_len + 1);
  std::vector<std::int64_t> len(static_cast<std::size_t>(b));
  for (auto& l : len) l = *rc::gen::inRange<index_t>(0, s + 1);
  return Batch::random(c, b, s, *rc::gen::arbitrary<std::uint32_t>(), len);
}

using test::gen_backend;

RC_GTEST_PROP(Variants, KvHeadsEqualToHeadsGiveThePlainBits, ()) {
  const auto keep = gen_backend();
  const ModelConfig plain = gen_config();
  ModelConfig gqa = plain;
  gqa.attention.num_kv_heads = plain.attention.num_heads;
  const Batch b = gen_batch(plain);
  const auto p = Params<double>::init(plain, 1);
  auto q = p;
  q.config = gqa;
  expect_same_bits(run(p, b), run(q, b));
}

RC_GTEST_PROP(Variants, RopeWithRotaryDimZeroIsPositionalNone, ()) {
  const auto keep = gen_backend();
  ModelConfig none = gen_config();
  none.embeddings.positional = Positional::none;
  ModelConfig rope = none;
  rope.embeddings.positional = Positional::rope;
  rope.attention.rotary_dim = 0;
  rope.embeddings.position_offset = *rc::gen::inRange<index_t>(0, 100000);
  const Batch b = gen_batch(none);
  const auto p = Params<double>::init(none, 2);
  auto q = p;
  q.config = rope;
  const Pass a = run(p, b), r = run(q, b);
  expect_same_bits(a, r);
  // q_rot and k_rot are q and k themselves
  for (std::size_t i = 0; i < r.acts.layers.size(); ++i) {
    const auto& l = r.acts.layers[i];
    RC_ASSERT(std::memcmp(l.q.data(), l.q_rot.data(), l.q.numel() * sizeof(double)) == 0);
    RC_ASSERT(std::memcmp(l.k.data(), l.k_rot.data(), l.k.numel() * sizeof(double)) == 0);
  }
}

RC_GTEST_PROP(Variants, AWindowOfAtLeastTheSequenceIsNoWindow, ()) {
  const auto keep = gen_backend();
  const ModelConfig plain = gen_config();
  const Batch b = gen_batch(plain);
  ModelConfig windowed = plain;
  windowed.attention.sliding_window =
      *rc::gen::oneOf(rc::gen::inRange<index_t>(b.seq_len, b.seq_len + 4),
                      rc::gen::just(std::numeric_limits<index_t>::max()));
  const auto p = Params<double>::init(plain, 3);
  auto q = p;
  q.config = windowed;
  expect_same_bits(run(p, b), run(q, b));
}

// The two RoPE conventions are one rotation up to a permutation of each head's dimensions: neox
// dimension i (< r/2) is interleaved dimension 2i, and i + r/2 is 2i + 1. Permuting the rows of
// Wq, bq, Wk and bk of an interleaved model that way gives a neox model with the same scores, so
// every later tensor agrees to rounding: the dot products over Dh are summed in another order.
// Bound: 1e-12 relative, in double.
RC_GTEST_PROP(Variants, TheRopeStylesDifferByAPermutationOfTheQkRows, ()) {
  const auto keep = gen_backend();
  ModelConfig inter = gen_config();
  inter.embeddings.positional = Positional::rope;
  inter.attention.rope_style = RopeStyle::interleaved;
  const index_t dh = inter.d_head();
  inter.attention.rotary_dim = 2 * *rc::gen::inRange<index_t>(1, dh / 2 + 1);
  inter.embeddings.position_offset = *rc::gen::inRange<index_t>(0, 1000);
  if (inter.attention.num_heads % 2 == 0 && *rc::gen::arbitrary<bool>())
    inter.attention.num_kv_heads = 2;
  ModelConfig neox = inter;
  neox.attention.rope_style = RopeStyle::neox;
  const index_t r = inter.rotary();
  // perm[n] = the interleaved dimension that neox dimension n holds
  std::vector<index_t> perm(static_cast<std::size_t>(dh));
  for (index_t n = 0; n < dh; ++n)
    perm[static_cast<std::size_t>(n)] = n >= r ? n : n < r / 2 ? 2 * n : 2 * (n - r / 2) + 1;
  const Batch b = gen_batch(inter);
  const auto p = Params<double>::init(inter, 4);
  auto q = p;
  q.config = neox;
  for (auto& l : q.layers) {
    const auto& src = p.layers[static_cast<std::size_t>(&l - q.layers.data())];
    for (auto [w, sw, bias, sb] :
         {std::tuple{&l.q_weight, &src.q_weight, &l.q_bias, &src.q_bias},
          std::tuple{&l.k_weight, &src.k_weight, &l.k_bias, &src.k_bias}}) {
      const index_t heads = w->dim(0) / dh, d = w->dim(1);
      for (index_t h = 0; h < heads; ++h)
        for (index_t n = 0; n < dh; ++n) {
          const index_t to = h * dh + n, from = h * dh + perm[static_cast<std::size_t>(n)];
          for (index_t c = 0; c < d; ++c) (*w)[to * d + c] = (*sw)[from * d + c];
          (*bias)[to] = (*sb)[from];
        }
    }
  }
  const Pass a = run(p, b), c = run(q, b);
  const auto x = test::named(a.acts), y = test::named(c.acts);
  for (const char* n : {"logits", "loss", "pooled"})
    RC_ASSERT(test::compare(y.at(n), x.at(n)) <= 1e-12);
  for (const auto& [n, v] : x)
    if (n.ends_with("scores") || n.ends_with("context"))
      RC_ASSERT(test::compare(y.at(n), v) <= 1e-12);
  // and so does the backward, wherever no permuted row is involved (relative to 1% of the
  // largest gradient: some are 0 in exact arithmetic)
  const auto gx = test::named(a.grads), gy = test::named(c.grads);
  double largest = 0;
  for (const auto& [n, v] : gx)
    for (double g : v) largest = std::max(largest, std::abs(g));
  for (const auto& [n, v] : gx)
    if (n.find("attn.q.") == std::string::npos && n.find("attn.k.") == std::string::npos)
      RC_ASSERT(test::compare(gy.at(n), v, 1e-2 * largest) <= 1e-11);
}

// RoPE makes q_i . k_j a function of i - j alone (r = Dh, no scaling): the same q and k at every
// position give scores constant along each diagonal, to rounding (bound: 1e-12 |q| |k| in double,
// positions up to 1e5 + 40).
TEST(Variants, RopeScoresDependOnlyOnTheOffsetBetweenPositions) {
  for (RopeStyle style : {RopeStyle::neox, RopeStyle::interleaved}) {
    for (index_t offset : {index_t{0}, index_t{100000}}) {
      ModelConfig c;
      c.d_model = 16;
      c.attention.num_heads = 1;
      c.embeddings.max_len = 40;
      c.embeddings.positional = Positional::rope;
      c.attention.rope_style = style;
      c.embeddings.position_offset = offset;
      const index_t s = 40, dh = 16;
      const auto q1 = test::uniform_vector<double>(dh, 1, "q"),
                 k1 = test::uniform_vector<double>(dh, 2, "k");
      std::vector<double> q(static_cast<std::size_t>(s * dh)), k(q.size()), qr(q.size()),
          kr(q.size());
      for (index_t i = 0; i < s; ++i)
        for (index_t d = 0; d < dh; ++d) {
          q[static_cast<std::size_t>(i * dh + d)] = q1[static_cast<std::size_t>(d)];
          k[static_cast<std::size_t>(i * dh + d)] = k1[static_cast<std::size_t>(d)];
        }
      std::vector<double> cs(static_cast<std::size_t>(s * dh / 2)), sn(cs.size());
      rope_table(cs.data(), sn.data(), c, s);
      rope_forward(qr.data(), q.data(), cs.data(), sn.data(), 1, s, dh, dh, style);
      rope_forward(kr.data(), k.data(), cs.data(), sn.data(), 1, s, dh, dh, style);
      auto score = [&](index_t i, index_t j) {
        double acc = 0;
        for (index_t d = 0; d < dh; ++d)
          acc +=
              qr[static_cast<std::size_t>(i * dh + d)] * kr[static_cast<std::size_t>(j * dh + d)];
        return acc;
      };
      double qn = 0, kn = 0;
      for (index_t d = 0; d < dh; ++d) {
        qn += q1[static_cast<std::size_t>(d)] * q1[static_cast<std::size_t>(d)];
        kn += k1[static_cast<std::size_t>(d)] * k1[static_cast<std::size_t>(d)];
      }
      const double bound = 1e-12 * std::sqrt(qn * kn);
      for (index_t delta = -(s - 1); delta < s; ++delta) {
        const index_t i0 = std::max<index_t>(0, delta), j0 = i0 - delta;
        const double first = score(i0, j0);
        for (index_t t = 1; i0 + t < s && j0 + t < s; ++t)
          ASSERT_NEAR(score(i0 + t, j0 + t), first, bound)
              << to_string(style) << " offset " << offset << " i - j = " << delta;
      }
    }
  }
}

// Press et al.'s get_slopes, written out as they define it: a geometric sequence from
// 2^(-8 / n) for a power of two n; otherwise the closest power of two's, then every other slope of
// twice that many heads. Equal to alibi_slopes to rounding (bound: 4 ulps).
std::vector<double> press_slopes(index_t n) {
  auto pow2 = [](index_t m) {
    const double start = std::pow(2.0, -std::pow(2.0, -(std::log2(static_cast<double>(m)) - 3)));
    std::vector<double> s;
    for (index_t i = 0; i < m; ++i) s.push_back(start * std::pow(start, static_cast<double>(i)));
    return s;
  };
  const double l = std::log2(static_cast<double>(n));
  if (l == std::floor(l)) return pow2(n);
  const auto closest = static_cast<index_t>(std::exp2(std::floor(l)));
  std::vector<double> s = pow2(closest);
  const std::vector<double> finer = press_slopes(2 * closest);
  for (index_t i = 0; static_cast<index_t>(s.size()) < n; i += 2)
    s.push_back(finer[static_cast<std::size_t>(i)]);
  return s;
}

TEST(Variants, AlibiSlopesAreThoseOfPressEtAl) {
  for (index_t h : {1, 6, 8, 12}) {
    const auto got = alibi_slopes(h, 8.0), want = press_slopes(h);
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t i = 0; i < got.size(); ++i)
      EXPECT_NEAR(got[i], want[i], 4 * std::numeric_limits<double>::epsilon() * want[i])
          << "H = " << h << " head " << i;
  }
  // the first slopes of 8 heads: 1/2, 1/4, ..., 1/256; of 12 heads the extras are 2^-0.5, 2^-1.5...
  EXPECT_EQ(alibi_slopes(8, 8.0)[0], 0.5);
  EXPECT_EQ(alibi_slopes(8, 8.0)[7], 1.0 / 256);
  EXPECT_EQ(alibi_slopes(12, 8.0)[8], std::exp2(-0.5));
  EXPECT_EQ(alibi_slopes(12, 8.0)[11], std::exp2(-3.5));
}

// One config's first-layer scores and probabilities, and those of the same parameters under
// another config (of the same parameter shapes).
struct Pair {
  Activations<double> base, variant;
};
Pair pair_of(const ModelConfig& base, const ModelConfig& variant, const Batch& b) {
  const auto p = Params<double>::init(variant, 9);
  auto q = Params<double>::zeros(base);
  std::vector<const Tensor<double>*> src;
  p.visit([&](const std::string&, const Tensor<double>& t) { src.push_back(&t); });
  std::size_t i = 0;
  q.visit([&](const std::string& n, Tensor<double>& t) {
    while (i < src.size() && !(src[i]->shape() == t.shape())) ++i;  // skips sinks
    EXPECT_LT(i, src.size()) << n;
    t = *src[i++];
  });
  Pair r;
  forward(q, b, r.base, {.train = false});
  forward(p, b, r.variant, {.train = false});
  return r;
}

ModelConfig small() {
  ModelConfig c;
  c.d_model = 12;
  c.attention.num_heads = 6;
  c.num_layers = 1;
  c.embeddings.max_len = 12;
  c.embeddings.positional = Positional::none;
  return c;
}

TEST(Variants, AlibiAddsMinusSlopeTimesDistanceToEveryVisibleScore) {
  for (bool causal : {false, true}) {
    ModelConfig plain = small();
    plain.attention.causal = causal;
    ModelConfig alibi = plain;
    alibi.embeddings.positional = Positional::alibi;
    const Batch b = Batch::random(plain, 2, 12, 5, {12, 7});
    const Pair r = pair_of(plain, alibi, b);
    const auto slopes = alibi_slopes(6, 8.0);
    const auto& s0 = r.base.layers[0].scores;
    const auto& s1 = r.variant.layers[0].scores;
    for (index_t bi = 0; bi < 2; ++bi)
      for (index_t h = 0; h < 6; ++h)
        for (index_t i = 0; i < 12; ++i)
          for (index_t j = 0; j < 12; ++j) {
            const index_t at = ((bi * 6 + h) * 12 + i) * 12 + j;
            if (std::isinf(s0[at])) {
              EXPECT_TRUE(std::isinf(s1[at]));
              continue;
            }
            const double dist =
                causal ? static_cast<double>(i - j) : std::abs(static_cast<double>(i - j));
            // 4 ulps of the larger term: the sum is rounded once
            EXPECT_NEAR(s1[at] - s0[at], -slopes[static_cast<std::size_t>(h)] * dist,
                        1e-15 * (std::abs(s0[at]) + 8 * dist))
                << "causal " << causal << " head " << h << " (" << i << ", " << j << ")";
          }
  }
}

TEST(Variants, SlidingWindowsShowExactlyTheirKeys) {
  for (bool causal : {false, true})
    for (index_t w : {1, 3, 11, 12, 15}) {
      ModelConfig c = small();
      c.attention.causal = causal;
      c.attention.sliding_window = w;
      const auto p = Params<double>::init(c, 1);
      const Batch b = Batch::random(c, 2, 12, 5, {12, 7});
      Activations<double> a;
      forward(p, b, a, {.train = false});
      const auto& pr = a.layers[0].probs;
      for (index_t bi = 0; bi < 2; ++bi)
        for (index_t h = 0; h < 6; ++h)
          for (index_t i = 0; i < 12; ++i)
            for (index_t j = 0; j < 12; ++j) {
              const bool visible = j < b.lengths[static_cast<std::size_t>(bi)] &&
                                   (causal ? j <= i && i - j < w : std::abs(i - j) < w);
              const double v = pr[((bi * 6 + h) * 12 + i) * 12 + j];
              EXPECT_EQ(v > 0, visible)
                  << "W " << w << " causal " << causal << " (" << i << ", " << j << ")";
            }
    }
}

TEST(Variants, SoftcapIsCTanhOfTheScaledScoresAndBoundsThem) {
  ModelConfig plain = small();
  ModelConfig capped = plain;
  capped.attention.attn_logit_softcap = 0.3;
  const Batch b = Batch::random(plain, 2, 12, 5, {12, 7});
  const Pair r = pair_of(plain, capped, b);
  const auto& s0 = r.base.layers[0].scores;
  const auto& s1 = r.variant.layers[0].scores;
  for (index_t i = 0; i < s0.numel(); ++i) {
    if (std::isinf(s0[i])) continue;
    EXPECT_LE(std::abs(s1[i]), 0.3);
    EXPECT_NEAR(s1[i], 0.3 * std::tanh(s0[i] / 0.3), 4e-16);
  }
}

// With sinks, each row's probabilities and the sink's share exp(sink - m) / Z sum to 1; a fully
// masked row (length 0) is all 0, never NaN, and its gradient is 0.
TEST(Variants, SinksTakeTheirShareAndAFullyMaskedRowIsZero) {
  ModelConfig c = small();
  c.attention.attn_sinks = true;
  c.attention.causal = true;
  const auto p = Params<double>::init(c, 2);
  const Batch b = Batch::random(c, 2, 12, 5, {12, 0});
  Activations<double> a, da;
  Params<double> g;
  forward(p, b, a, {.train = false});
  backward(p, b, a, g, da);
  const auto& pr = a.layers[0].probs;
  const auto& sc = a.layers[0].scores;
  const auto& sinks = p.layers[0].sinks;
  for (index_t h = 0; h < 6; ++h)
    for (index_t i = 0; i < 12; ++i) {
      const index_t row = (h * 12 + i) * 12;  // batch 0
      double m = sinks[h], z = 0, sum = 0;
      for (index_t j = 0; j <= i; ++j) m = std::max(m, sc[row + j]);
      for (index_t j = 0; j <= i; ++j) {
        z += std::exp(sc[row + j] - m);
        sum += pr[row + j];
      }
      z += std::exp(sinks[h] - m);
      EXPECT_NEAR(sum + std::exp(sinks[h] - m) / z, 1.0, 1e-14);
      EXPECT_LT(sum, 1.0);
      const index_t masked = ((6 + h) * 12 + i) * 12;  // batch 1, length 0
      for (index_t j = 0; j < 12; ++j) EXPECT_EQ(pr[masked + j], 0.0);
    }
  for (index_t i = 0; i < da.layers[0].scores.numel(); ++i)
    ASSERT_TRUE(std::isfinite(da.layers[0].scores[i]));
  // batch 1 (length 0) sends exactly 0 back through its scores and queries
  const index_t half_scores = da.layers[0].scores.numel() / 2, half_q = da.layers[0].q.numel() / 2;
  for (index_t i = half_scores; i < 2 * half_scores; ++i) ASSERT_EQ(da.layers[0].scores[i], 0.0);
  for (index_t i = half_q; i < 2 * half_q; ++i) ASSERT_EQ(da.layers[0].q[i], 0.0);
  double dsink = 0;
  for (index_t h = 0; h < 6; ++h) dsink += std::abs(g.layers[0].sinks[h]);
  EXPECT_GT(dsink, 0.0);
}

// A batch of 0 sequences (no lengths at all) runs every variant, forward and backward, on every
// backend (the shape fuzzer found the backward refusing it for a soft-cap or sinks).
TEST(Variants, AnEmptyBatchRunsEveryVariant) {
  ScopedSettings keep;
  ModelConfig c = small();
  c.attention.num_kv_heads = 2;
  c.embeddings.positional = Positional::rope;
  c.attention.sliding_window = 2;
  c.attention.attn_logit_softcap = 1.0;
  c.attention.attn_sinks = true;
  const auto p = Params<double>::init(c, 1);
  const Batch b = Batch::random(c, 0, 5, 1);
  for (Backend be : {Backend::reference, Backend::simd, Backend::blas}) {
    set_backend(be);
    const Pass r = run(p, b);
    EXPECT_EQ(r.acts.loss[0], 0.0);
    for (index_t h = 0; h < c.attention.num_heads; ++h) EXPECT_EQ(r.grads.layers[0].sinks[h], 0.0);
  }
}

// Grouped-query attention is the plain layer with each K/V head's weights repeated over its
// group's query heads (Hugging Face's repeat_kv: contiguous groups). On the reference backend the
// forward pass gives the same bits; the K/V weights' gradient is the sum of the repeated heads'.
TEST(Variants, GqaIsThePlainLayerWithContiguousGroupsRepeated) {
  ScopedSettings keep;
  for (Backend be : {Backend::reference, Backend::simd, Backend::blas})
    for (index_t kv : {1, 2, 3}) {
      set_backend(be);
      ModelConfig gqa = small();
      gqa.attention.num_kv_heads = kv;
      gqa.attention.causal = kv == 2;
      const ModelConfig plain = small();
      const index_t group = 6 / kv, dh = 2, d = 12;
      const auto p = Params<double>::init(gqa, 11);
      auto q = Params<double>::zeros(plain);
      q.visit([&](const std::string& n, Tensor<double>& t) {
        const Tensor<double>* src = nullptr;
        p.visit([&](const std::string& m, const Tensor<double>& u) {
          if (m == n) src = &u;
        });
        if (src->shape() == t.shape()) {
          t = *src;
          return;
        }
        // query head h reads K/V head h / group: repeat each K/V head's rows over its group
        const index_t cols = t.shape().rank() == 2 ? d : 1;
        for (index_t h = 0; h < 6; ++h)
          for (index_t r = 0; r < dh; ++r)
            for (index_t c = 0; c < cols; ++c)
              t[(h * dh + r) * cols + c] = (*src)[((h / group) * dh + r) * cols + c];
      });
      q.config.attention.causal = gqa.attention.causal;
      const Batch b = Batch::random(gqa, 3, 12, 5, {12, 5, 1});
      const Pass a = run(q, b), g = run(p, b);
      // the same bits on reference and simd (every product element is one chain over its inner
      // dimension); OpenBLAS may order the sums by the matrix shape: to rounding there
      for (const char* n : {"layers.0.context", "layers.0.probs", "logits", "loss"}) {
        const auto x = test::named(a.acts).at(n), y = test::named(g.acts).at(n);
        if (be == Backend::blas) {
          EXPECT_LE(test::compare(y, x), 1e-13) << n << " kv " << kv;
        } else {
          EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * sizeof(double)), 0)
              << to_string(be) << " " << n << " kv " << kv;
        }
      }
      const auto& gk = g.grads.layers[0].k_weight;
      const auto& pk = a.grads.layers[0].k_weight;
      for (index_t k = 0; k < kv; ++k)
        for (index_t r = 0; r < dh; ++r)
          for (index_t c = 0; c < d; ++c) {
            double sum = 0;
            for (index_t h = k * group; h < (k + 1) * group; ++h) sum += pk[(h * dh + r) * d + c];
            EXPECT_NEAR(gk[(k * dh + r) * d + c], sum, 1e-14) << "kv " << kv;
          }
    }
}

// The row-blocked path gives the materialised path's bits on the simd backend with every variant
// on (GQA, a window, a soft-cap, ALiBi, sinks), for any block size, on every ISA.
TEST(Variants, RowBlockedAttentionKeepsTheMaterialisedBits) {
  ScopedSettings keep;
  set_backend(Backend::simd);
  const index_t B = 2, H = 6, K = 2, S = 37, Dh = 8;
  const auto q = test::uniform_vector<double>(B * H * S * Dh, 1, "q", -2, 2);
  const auto k = test::uniform_vector<double>(B * K * S * Dh, 2, "k", -2, 2);
  const auto v = test::uniform_vector<double>(B * K * S * Dh, 3, "v");
  const auto dc = test::uniform_vector<double>(B * H * S * Dh, 4, "dc");
  const auto sinks = test::uniform_vector<double>(H, 5, "sinks");
  const std::vector<std::int64_t> len = {37, 20};
  for (Isa isa : supported_isas())
    for (bool causal : {false, true}) {
      set_isa(isa);
      std::vector<double> dsink0(H), dsink1(H);
      AttentionVariant<double> var{.kv_heads = K,
                                   .window = 9,
                                   .softcap = 1.5,
                                   .alibi_max_bias = 8.0,
                                   .sinks = sinks.data(),
                                   .dsinks = dsink0.data()};
      std::vector<double> ctx(q.size()), sc(B * H * S * S), pr(sc.size()), dp(sc.size()),
          ds(sc.size());
      std::vector<double> dq(q.size()), dk(k.size()), dvv(v.size());
      AttentionArgs<double> args{.batch = B,
                                 .heads = H,
                                 .seq_len = S,
                                 .d_head = Dh,
                                 .lengths = len.data(),
                                 .causal = causal,
                                 .variant = var,
                                 .qkv_write = GradWrite::overwrite};
      attention_forward(args, {.context = ctx.data(),
                               .scores = sc.data(),
                               .probs = pr.data(),
                               .q = q.data(),
                               .k = k.data(),
                               .v = v.data()});
      attention_backward(args, {.dq = dq.data(),
                                .dk = dk.data(),
                                .dv = dvv.data(),
                                .dprobs = dp.data(),
                                .dscores = ds.data(),
                                .dcontext = dc.data(),
                                .q = q.data(),
                                .k = k.data(),
                                .v = v.data(),
                                .probs = pr.data()});
      for (index_t rows : {1, 3, 16, 0}) {
        args.variant.dsinks = dsink1.data();
        args.block_rows = rows;
        std::fill(dsink1.begin(), dsink1.end(), 0.0);
        std::vector<double> ctx1(q.size()), dq1(q.size()), dk1(k.size()), dv1(v.size());
        attention_forward_rows(
            args, {.context = ctx1.data(), .q = q.data(), .k = k.data(), .v = v.data()});
        attention_backward_rows(args, {.dq = dq1.data(),
                                       .dk = dk1.data(),
                                       .dv = dv1.data(),
                                       .dcontext = dc.data(),
                                       .q = q.data(),
                                       .k = k.data(),
                                       .v = v.data()});
        const std::string tag = std::string(to_string(isa)) + " rows " + std::to_string(rows);
        EXPECT_EQ(std::memcmp(ctx.data(), ctx1.data(), ctx.size() * 8), 0) << tag;
        EXPECT_EQ(std::memcmp(dq.data(), dq1.data(), dq.size() * 8), 0) << tag;
        EXPECT_EQ(std::memcmp(dk.data(), dk1.data(), dk.size() * 8), 0) << tag;
        EXPECT_EQ(std::memcmp(dvv.data(), dv1.data(), dvv.size() * 8), 0) << tag;
        EXPECT_EQ(std::memcmp(dsink0.data(), dsink1.data(), H * 8), 0) << tag;
      }
    }
}

}  // namespace
}  // namespace teo
