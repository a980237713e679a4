// Attention with queries and keys of different lengths (docs/semantics.md, "Queries and keys of
// different lengths"): chunked prefill equals one pass, the log-sum-exp is the softmax's
// normaliser, and the two alignments agree where they must.
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include "rc_support.hpp"
#include "support.hpp"
#include "teo/backend.hpp"
#include "teo/layers/attention.hpp"

namespace teo {
namespace {

// A random attention problem: sizes, lengths, variant, and q, k, v drawn uniform in [-1, 1).
struct Problem {
  index_t b = 1, h = 1, hkv = 1, sq = 1, skv = 1, dh = 1, dv = 1;
  std::vector<std::int64_t> q_len, kv_len;
  bool causal = false;
  std::optional<index_t> window;
  std::optional<double> softcap, alibi;
  std::vector<double> sinks;
  std::vector<double> q, k, v;
};

std::vector<double> draw(std::size_t n, std::uint64_t seed, const char* what) {
  return test::uniform_vector<double>(static_cast<index_t>(n), seed, what);
}

// The sizes and variant of a problem (the caller sets the rows and lengths).
Problem gen_variant() {
  Problem p;
  p.hkv = *rc::gen::inRange<index_t>(1, 3);
  p.h = p.hkv * *rc::gen::inRange<index_t>(1, 4);
  p.b = *rc::gen::inRange<index_t>(1, 4);
  p.dh = *rc::gen::inRange<index_t>(1, 7);
  p.dv = *rc::gen::element(p.dh, index_t{1}, index_t{5});
  p.causal = *rc::gen::arbitrary<bool>();
  if (*rc::gen::element(false, false, true)) p.window = *rc::gen::inRange<index_t>(1, 6);
  if (*rc::gen::element(false, false, true)) p.softcap = 1.5;
  if (*rc::gen::element(false, false, true)) p.alibi = 4.0;
  if (*rc::gen::element(false, false, true)) p.sinks = draw(static_cast<std::size_t>(p.h), 7, "s");
  return p;
}

void fill(Problem& p, std::uint64_t seed) {
  const auto n = [](index_t a, index_t b, index_t c, index_t d) {
    return static_cast<std::size_t>(a * b * c * d);
  };
  p.q = draw(n(p.b, p.h, p.sq, p.dh), seed, "q");
  p.k = draw(n(p.b, p.hkv, p.skv, p.dh), seed, "k");
  p.v = draw(n(p.b, p.hkv, p.skv, p.dv), seed, "v");
}

struct Out {
  std::vector<double> context, scores, probs, lse;
};

// attention_forward (materialised) or attention_forward_rows on p, with the given alignment.
Out run(const Problem& p, CausalAlign align, bool rows, bool split = true) {
  AttentionArgs<double> a;
  a.batch = p.b;
  a.heads = p.h;
  a.seq_len = p.sq;
  a.d_head = p.dh;
  a.lengths = p.q_len.data();
  if (split) {
    a.kv_len = p.skv;
    a.kv_lengths = p.kv_len.data();
  }
  a.d_head_v = p.dv;
  a.causal_align = align;
  a.causal = p.causal;
  a.variant.kv_heads = p.hkv;
  a.variant.window = p.window;
  a.variant.softcap = p.softcap;
  a.variant.alibi_max_bias = p.alibi;
  a.variant.sinks = p.sinks.empty() ? nullptr : p.sinks.data();
  const auto n = static_cast<std::size_t>(p.b * p.h);
  Out o;
  o.context.assign(n * static_cast<std::size_t>(p.sq * p.dv), -7);
  o.lse.assign(n * static_cast<std::size_t>(p.sq), -7);
  AttentionForward<double> t{.context = o.context.data(),
                             .lse = o.lse.data(),
                             .q = p.q.data(),
                             .k = p.k.data(),
                             .v = p.v.data()};
  if (rows) {
    a.block_rows = 2;
    attention_forward_rows(a, t);
  } else {
    o.scores.assign(n * static_cast<std::size_t>(p.sq * p.skv), -7);
    o.probs = o.scores;
    t.scores = o.scores.data();
    t.probs = o.probs.data();
    attention_forward(a, t);
  }
  return o;
}

using test::gen_backend;

// A sequence run in one pass, and its last rows run again as a chunk against all its keys
// (bottom-right): the chunk's rows are the pass's rows, bitwise on simd and reference (every
// product element is the same chain over the same keys), to rounding on blas.
RC_GTEST_PROP(InferenceAttention, AChunkOfQueriesGivesTheRowsOfOnePass, ()) {
  const auto keep = gen_backend();
  Problem full = gen_variant();
  full.sq = full.skv = *rc::gen::inRange<index_t>(1, 12);
  full.q_len.clear();
  for (index_t b = 0; b < full.b; ++b)
    full.q_len.push_back(*rc::gen::inRange<index_t>(0, full.sq + 1));
  full.kv_len = full.q_len;
  fill(full, *rc::gen::arbitrary<std::uint32_t>());
  const index_t c = *rc::gen::inRange<index_t>(0, full.sq);  // the chunk is rows [c, S)
  Problem chunk = full;
  chunk.sq = full.sq - c;
  for (index_t b = 0; b < full.b; ++b) {
    const auto i = static_cast<std::size_t>(b);
    chunk.q_len[i] = std::max<std::int64_t>(0, full.q_len[i] - c);
  }
  chunk.q.clear();
  for (index_t bh = 0; bh < full.b * full.h; ++bh)
    for (index_t i = c; i < full.sq; ++i)
      for (index_t d = 0; d < full.dh; ++d)
        chunk.q.push_back(full.q[static_cast<std::size_t>((bh * full.sq + i) * full.dh + d)]);
  const bool rows = *rc::gen::arbitrary<bool>();
  const Out one = run(full, CausalAlign::bottom_right, rows, /*split=*/false);
  const Out part = run(chunk, CausalAlign::bottom_right, rows);
  const bool bitwise = backend() != Backend::blas;
  for (index_t b = 0; b < full.b; ++b)
    for (index_t h = 0; h < full.h; ++h)
      for (index_t i = c; i < full.q_len[static_cast<std::size_t>(b)]; ++i) {
        const index_t bh = b * full.h + h, r = i - c;
        const auto at = [](index_t x) { return static_cast<std::size_t>(x); };
        const double l1 = one.lse[at(bh * full.sq + i)], l2 = part.lse[at(bh * chunk.sq + r)];
        if (bitwise)
          RC_ASSERT(l1 == l2 || (std::isinf(l1) && l1 == l2));
        else
          RC_ASSERT(l1 == l2 || std::abs(l1 - l2) <= 1e-12 * (1 + std::abs(l1)));
        for (index_t d = 0; d < full.dv; ++d) {
          const double x = one.context[at((bh * full.sq + i) * full.dv + d)];
          const double y = part.context[at((bh * chunk.sq + r) * full.dv + d)];
          if (bitwise)
            RC_ASSERT(x == y);
          else
            RC_ASSERT(std::abs(x - y) <= 1e-12);
        }
      }
}

// lse = log(sum over visible keys of exp(score) (+ exp(sink))), recomputed in float64 from the
// stored scores; -inf exactly where a row sees nothing; the same on the row-blocked path.
RC_GTEST_PROP(InferenceAttention, TheLogSumExpIsTheSoftmaxNormaliser, ()) {
  const auto keep = gen_backend();
  Problem p = gen_variant();
  p.sq = *rc::gen::inRange<index_t>(1, 9);
  p.skv = *rc::gen::inRange<index_t>(1, 13);
  for (index_t b = 0; b < p.b; ++b) {
    p.q_len.push_back(*rc::gen::inRange<index_t>(0, p.sq + 1));
    p.kv_len.push_back(*rc::gen::inRange<index_t>(0, p.skv + 1));
  }
  fill(p, *rc::gen::arbitrary<std::uint32_t>());
  const CausalAlign align = *rc::gen::element(CausalAlign::bottom_right, CausalAlign::top_left);
  const Out o = run(p, align, /*rows=*/false);
  const Out r = run(p, align, /*rows=*/true);
  for (index_t bh = 0; bh < p.b * p.h; ++bh)
    for (index_t i = 0; i < p.sq; ++i) {
      const auto row = static_cast<std::size_t>(bh * p.sq + i);
      double m = p.sinks.empty() ? -INFINITY : p.sinks[static_cast<std::size_t>(bh % p.h)];
      for (index_t j = 0; j < p.skv; ++j) m = std::max(m, o.scores[row * p.skv + j]);
      double sum = p.sinks.empty() ? 0 : std::exp(p.sinks[static_cast<std::size_t>(bh % p.h)] - m);
      for (index_t j = 0; j < p.skv; ++j) {
        const double s = o.scores[row * p.skv + j];
        if (std::isfinite(s)) sum += std::exp(s - m);
      }
      const double want = std::isinf(m) ? m : m + std::log(sum);
      const double got = o.lse[row];
      if (std::isinf(want))
        RC_ASSERT(got == want);
      else
        RC_ASSERT(std::abs(got - want) <= 1e-13 * (1 + std::abs(want)));
      RC_ASSERT(r.lse[row] == got || backend() == Backend::blas);
      // probs = exp(scores - lse) on visible keys
      for (index_t j = 0; j < p.skv; ++j) {
        const double s = o.scores[row * p.skv + j];
        if (std::isfinite(s))
          RC_ASSERT(std::abs(o.probs[row * p.skv + j] - std::exp(s - got)) <= 1e-13);
      }
    }
}

// Where every sequence has as many queries as keys, the alignments agree bitwise, and the split
// arguments give the bits of the encoder's attention.
RC_GTEST_PROP(InferenceAttention, AlignmentsAgreeWhenQueriesAndKeysMatch, ()) {
  const auto keep = gen_backend();
  Problem p = gen_variant();
  p.sq = p.skv = *rc::gen::inRange<index_t>(1, 10);
  for (index_t b = 0; b < p.b; ++b) p.q_len.push_back(*rc::gen::inRange<index_t>(0, p.sq + 1));
  p.kv_len = p.q_len;
  fill(p, *rc::gen::arbitrary<std::uint32_t>());
  const Out br = run(p, CausalAlign::bottom_right, false);
  const Out tl = run(p, CausalAlign::top_left, false);
  const Out plain = run(p, CausalAlign::bottom_right, false, /*split=*/false);
  RC_ASSERT(br.context == tl.context);
  RC_ASSERT(br.scores == tl.scores);
  RC_ASSERT(br.context == plain.context);
  RC_ASSERT(br.probs == plain.probs);
}

// Decode by hand: one query on keys 0..L-1, bottom-right causal, sees all L keys; top-left, only
// key 0.
TEST(InferenceAttention, BottomRightDecodeSeesEveryKeyTopLeftOnlyTheFirst) {
  Problem p;
  p.sq = 1;
  p.skv = 6;
  p.dh = p.dv = 2;
  p.q_len = {1};
  p.kv_len = {5};
  p.causal = true;
  fill(p, 3);
  const Out br = run(p, CausalAlign::bottom_right, false);
  const Out tl = run(p, CausalAlign::top_left, false);
  for (index_t j = 0; j < 6; ++j) {
    EXPECT_EQ(std::isfinite(br.scores[static_cast<std::size_t>(j)]), j < 5) << j;
    EXPECT_EQ(std::isfinite(tl.scores[static_cast<std::size_t>(j)]), j == 0) << j;
  }
  EXPECT_EQ(tl.probs[0], 1.0);
  EXPECT_EQ(tl.lse[0], tl.scores[0]);
  // a query with more queries than keys before it sees nothing: context 0, lse -inf
  p.q_len = {1};
  p.kv_len = {0};
  const Out none = run(p, CausalAlign::bottom_right, false);
  EXPECT_EQ(none.lse[0], -std::numeric_limits<double>::infinity());
  EXPECT_EQ(none.context[0], 0.0);
  EXPECT_EQ(none.context[1], 0.0);
}

}  // namespace
}  // namespace teo
