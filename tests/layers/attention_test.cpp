#include <cmath>
#include <cstring>
#include <limits>

#include "support.hpp"
#include "teo/backend.hpp"
#include "teo/layers/attention.hpp"
#include "teo/layers/dropout.hpp"

namespace teo {
namespace {

struct Case {
  index_t b = 3, h = 2, s = 5, dh = 3;
  std::vector<std::int64_t> len = {5, 2, 0};
};

template <class Real>
struct Run {
  std::vector<Real> ctx, scores, probs;
};

// The attention call of case c: its sizes and lengths, the mask and dropout given.
template <class Real>
AttentionArgs<Real> args_of(const Case& c, bool causal, const std::uint8_t* drop_mask,
                            Real drop_scale, bool merged = false,
                            GradWrite w = GradWrite::accumulate) {
  AttentionArgs<Real> a;
  a.batch = c.b;
  a.heads = c.h;
  a.seq_len = c.s;
  a.d_head = c.dh;
  a.lengths = c.len.data();
  a.causal = causal;
  a.drop_mask = drop_mask;
  a.drop_scale = drop_scale;
  a.merged_context = merged;
  a.qkv_write = w;
  return a;
}

template <class Real>
Run<Real> run_forward(const Case& c, const std::vector<Real>& q, const std::vector<Real>& k,
                      const std::vector<Real>& v, bool causal, const std::uint8_t* mask,
                      Real scale) {
  Run<Real> r;
  r.ctx.assign(c.b * c.h * c.s * c.dh, Real(-7));
  r.scores.assign(c.b * c.h * c.s * c.s, Real(-7));
  r.probs.assign(c.b * c.h * c.s * c.s, Real(-7));
  attention_forward(args_of(c, causal, mask, scale), {.context = r.ctx.data(),
                                                      .scores = r.scores.data(),
                                                      .probs = r.probs.data(),
                                                      .q = q.data(),
                                                      .k = k.data(),
                                                      .v = v.data()});
  return r;
}

// Random q, k, v and a dcontext g (B, H, S, Dh) for case c, and a 30% attention dropout mask with
// its scale.
template <class Real>
struct Inputs {
  explicit Inputs(const Case& c)
      : n(c.b * c.h * c.s * c.dh),
        nss(c.b * c.h * c.s * c.s),
        q(test::uniform_vector<Real>(n, 1, "q")),
        k(test::uniform_vector<Real>(n, 2, "k")),
        v(test::uniform_vector<Real>(n, 3, "v")),
        g(test::uniform_vector<Real>(n, 4, "g")),
        mask(static_cast<std::size_t>(nss)),
        scale(dropout_scale<Real>(0.3)) {
    dropout_mask(mask.data(), nss, 9, "attn", 0.3);
  }
  index_t n, nss;
  std::vector<Real> q, k, v, g;
  std::vector<std::uint8_t> mask;
  Real scale;
};

template <class Real>
class Attention : public ::testing::Test {};
TYPED_TEST_SUITE(Attention, test::Dtypes);

TYPED_TEST(Attention, MaskedScoresAreMinusInfAndRowsSumToOne) {
  using Real = TypeParam;
  const Case c;
  const index_t n = c.b * c.h * c.s * c.dh;
  const auto q = test::uniform_vector<Real>(n, 1, "q"), k = test::uniform_vector<Real>(n, 2, "k"),
             v = test::uniform_vector<Real>(n, 3, "v");
  for (bool causal : {false, true}) {
    const auto r = run_forward(c, q, k, v, causal, nullptr, Real(1));
    for (index_t b = 0; b < c.b; ++b)
      for (index_t h = 0; h < c.h; ++h)
        for (index_t i = 0; i < c.s; ++i) {
          const index_t row = ((b * c.h + h) * c.s + i) * c.s;
          double sum = 0;
          for (index_t j = 0; j < c.s; ++j) {
            const bool visible = j < c.len[b] && (!causal || j <= i);
            if (!visible) {
              EXPECT_EQ(r.scores[row + j], -std::numeric_limits<Real>::infinity());
              EXPECT_EQ(r.probs[row + j], Real(0));
            } else {
              double dot = 0;
              for (index_t x = 0; x < c.dh; ++x)
                dot += static_cast<double>(q[((b * c.h + h) * c.s + i) * c.dh + x]) *
                       k[((b * c.h + h) * c.s + j) * c.dh + x];
              EXPECT_NEAR(r.scores[row + j], dot / std::sqrt(3.0), 10 * test::Tol<Real>::rel);
            }
            sum += r.probs[row + j];
          }
          const bool any = c.len[b] > 0;
          EXPECT_NEAR(sum, any ? 1.0 : 0.0, 10 * test::Tol<Real>::rel);
        }
  }
}

TYPED_TEST(Attention, FullyMaskedRowsGiveExactZeroAndNoNaN) {
  using Real = TypeParam;
  Case c;
  c.len = {0, 0, 0};
  const index_t n = c.b * c.h * c.s * c.dh;
  const auto q = test::uniform_vector<Real>(n, 1, "q"), k = test::uniform_vector<Real>(n, 2, "k"),
             v = test::uniform_vector<Real>(n, 3, "v");
  const auto r = run_forward(c, q, k, v, false, nullptr, Real(1));
  for (Real x : r.ctx) EXPECT_EQ(x, Real(0));
  for (Real x : r.probs) EXPECT_EQ(x, Real(0));
  const auto g = test::uniform_vector<Real>(n, 4, "g");
  std::vector<Real> dq(n, Real(0)), dk(n, Real(0)), dv(n, Real(0));
  std::vector<Real> dp(r.probs.size()), ds(r.probs.size());
  attention_backward(args_of(c, false, nullptr, Real(1)), {.dq = dq.data(),
                                                           .dk = dk.data(),
                                                           .dv = dv.data(),
                                                           .dprobs = dp.data(),
                                                           .dscores = ds.data(),
                                                           .dcontext = g.data(),
                                                           .q = q.data(),
                                                           .k = k.data(),
                                                           .v = v.data(),
                                                           .probs = r.probs.data()});
  for (const auto* t : {&dq, &dk, &dv, &ds})
    for (Real x : *t) EXPECT_EQ(x, Real(0));
}

TEST(Attention, BackwardMatchesFiniteDifferences) {
  const Case c;
  const index_t n = c.b * c.h * c.s * c.dh, nss = c.b * c.h * c.s * c.s;
  auto q = test::uniform_vector<double>(n, 1, "q", -1.5, 1.5);
  auto k = test::uniform_vector<double>(n, 2, "k", -1.5, 1.5);
  auto v = test::uniform_vector<double>(n, 3, "v", -1.5, 1.5);
  const auto rc = test::uniform_vector<double>(n, 4, "r");
  std::vector<std::uint8_t> mask(nss);
  dropout_mask(mask.data(), nss, 9, "attn", 0.3);
  for (bool causal : {false, true}) {
    for (bool drop : {false, true}) {
      const std::uint8_t* m = drop ? mask.data() : nullptr;
      const double scale = dropout_scale<double>(0.3);
      const auto r = run_forward(c, q, k, v, causal, m, scale);
      std::vector<double> dq(n, 0.0), dk(n, 0.0), dv(n, 0.0), dp(nss), ds(nss);
      attention_backward(args_of(c, causal, m, scale), {.dq = dq.data(),
                                                        .dk = dk.data(),
                                                        .dv = dv.data(),
                                                        .dprobs = dp.data(),
                                                        .dscores = ds.data(),
                                                        .dcontext = rc.data(),
                                                        .q = q.data(),
                                                        .k = k.data(),
                                                        .v = v.data(),
                                                        .probs = r.probs.data()});
      auto loss = [&] { return test::dot(run_forward(c, q, k, v, causal, m, scale).ctx, rc); };
      const std::string what =
          std::string(causal ? "causal" : "padding") + (drop ? "+dropout" : "");
      test::expect_gradient("dq " + what, q.data(), dq, loss);
      test::expect_gradient("dk " + what, k.data(), dk, loss);
      test::expect_gradient("dv " + what, v.data(), dv, loss);
      // keys past a sequence's length get exactly zero gradient
      for (index_t h = 0; h < c.h; ++h)
        for (index_t j = 2; j < c.s; ++j)
          for (index_t x = 0; x < c.dh; ++x) {
            EXPECT_EQ(dk[((1 * c.h + h) * c.s + j) * c.dh + x], 0.0);
            EXPECT_EQ(dv[((1 * c.h + h) * c.s + j) * c.dh + x], 0.0);
          }
    }
  }
}

// The merged layout is the same values in (B, S, H * Dh): forward writes exactly merge_heads of the
// per-head context, and backward from a merged dcontext gives the same bits as from the split one.
TYPED_TEST(Attention, MergedContextLayoutGivesTheSameBits) {
  using Real = TypeParam;
  const Case c;
  const Inputs<Real> in(c);
  const index_t n = in.n, nss = in.nss;
  const auto &q = in.q, &k = in.k, &v = in.v, &g = in.g;
  const auto& mask = in.mask;
  const Real scale = in.scale;
  for (bool causal : {false, true})
    for (const std::uint8_t* m : {static_cast<const std::uint8_t*>(nullptr),
                                  static_cast<const std::uint8_t*>(mask.data())}) {
      const auto split = run_forward(c, q, k, v, causal, m, scale);
      std::vector<Real> merged(n, Real(-7)), scores(nss), probs(nss), want(n);
      attention_forward(args_of(c, causal, m, scale, /*merged=*/true), {.context = merged.data(),
                                                                        .scores = scores.data(),
                                                                        .probs = probs.data(),
                                                                        .q = q.data(),
                                                                        .k = k.data(),
                                                                        .v = v.data()});
      merge_heads(want.data(), split.ctx.data(), c.b, c.s, c.h, c.dh);
      EXPECT_EQ(merged, want);
      EXPECT_EQ(probs, split.probs);

      std::vector<Real> g_merged(n);
      merge_heads(g_merged.data(), g.data(), c.b, c.s, c.h, c.dh);
      std::vector<std::vector<Real>> grads[2];
      for (int layout = 0; layout < 2; ++layout) {
        std::vector<Real> dq(n, Real(0.5)), dk(n, Real(0.25)), dv(n, Real(-1)), dp(nss), ds(nss);
        attention_backward(args_of(c, causal, m, scale, /*merged=*/layout == 1),
                           {.dq = dq.data(),
                            .dk = dk.data(),
                            .dv = dv.data(),
                            .dprobs = dp.data(),
                            .dscores = ds.data(),
                            .dcontext = layout ? g_merged.data() : g.data(),
                            .q = q.data(),
                            .k = k.data(),
                            .v = v.data(),
                            .probs = split.probs.data()});
        grads[layout] = {dq, dk, dv, dp, ds};
      }
      EXPECT_EQ(grads[0], grads[1]);
    }
}

// GradWrite::overwrite writes dq, dk and dv without reading them (they start as NaN) and gives
// the bits of accumulating into zeros, on every backend, with and without the causal mask and the
// dropout mask, for a full, a partial and an empty sequence.
TYPED_TEST(Attention, OverwritingDqDkDvGivesTheBitsOfAccumulatingIntoZeros) {
  using Real = TypeParam;
  const Case c;
  const Inputs<Real> in(c);
  const index_t n = in.n, nss = in.nss;
  const auto &q = in.q, &k = in.k, &v = in.v, &g = in.g;
  const auto& mask = in.mask;
  const Real scale = in.scale;
  ScopedSettings restore;
  for (Backend be : {Backend::reference, Backend::simd, Backend::blas}) {
    set_backend(be);
    for (bool causal : {false, true})
      for (const std::uint8_t* m : {static_cast<const std::uint8_t*>(nullptr),
                                    static_cast<const std::uint8_t*>(mask.data())}) {
        const auto fwd = run_forward(c, q, k, v, causal, m, scale);
        std::vector<std::vector<Real>> grads[2];
        for (GradWrite w : {GradWrite::accumulate, GradWrite::overwrite}) {
          const Real start =
              w == GradWrite::overwrite ? std::numeric_limits<Real>::quiet_NaN() : Real(0);
          std::vector<Real> dq(n, start), dk(n, start), dv(n, start), dp(nss), ds(nss);
          attention_backward(args_of(c, causal, m, scale, false, w), {.dq = dq.data(),
                                                                      .dk = dk.data(),
                                                                      .dv = dv.data(),
                                                                      .dprobs = dp.data(),
                                                                      .dscores = ds.data(),
                                                                      .dcontext = g.data(),
                                                                      .q = q.data(),
                                                                      .k = k.data(),
                                                                      .v = v.data(),
                                                                      .probs = fwd.probs.data()});
          grads[w == GradWrite::overwrite] = {dq, dk, dv, dp, ds};
        }
        for (std::size_t t = 0; t < 5; ++t)
          EXPECT_EQ(std::memcmp(grads[0][t].data(), grads[1][t].data(),
                                grads[0][t].size() * sizeof(Real)),
                    0)
              << to_string(be) << " causal " << causal << " dropout " << (m != nullptr)
              << " tensor " << t;
      }
  }
}

TYPED_TEST(Attention, SplitAndMergeHeadsAreInverse) {
  using Real = TypeParam;
  const index_t b = 2, s = 3, h = 4, dh = 5;
  const auto x = test::uniform_vector<Real>(b * s * h * dh, 1, "x");
  std::vector<Real> split(x.size()), back(x.size());
  split_heads(split.data(), x.data(), b, s, h, dh);
  merge_heads(back.data(), split.data(), b, s, h, dh);
  EXPECT_EQ(back, x);
  // element (b=1, s=2, head 3, c=4) lands at [1, 3, 2, 4]
  EXPECT_EQ(split[((1 * h + 3) * s + 2) * dh + 4], x[((1 * s + 2) * h + 3) * dh + 4]);
}

// Splitting with a bias (what the model does for q, k, v, out of one (B, S, 3D) product with row
// stride 3D) is the split of x + bias, element by element, rounded once: the bits of
// linear_forward's bias add followed by a plain split.
TYPED_TEST(Attention, SplitHeadsWithBiasIsTheSplitOfTheBiasedRows) {
  using Real = TypeParam;
  const index_t b = 2, s = 3, h = 4, dh = 5, d = h * dh, ld = 3 * d;
  const auto x = test::uniform_vector<Real>(b * s * ld, 1, "x");
  const auto bias = test::uniform_vector<Real>(ld, 2, "bias");
  for (index_t part = 0; part < 3; ++part) {
    std::vector<Real> biased(x.size()), want(static_cast<std::size_t>(b * s * d));
    for (index_t r = 0; r < b * s; ++r)
      for (index_t c = 0; c < ld; ++c) biased[r * ld + c] = x[r * ld + c] + bias[c];
    split_heads(want.data(), biased.data() + part * d, b, s, h, dh, ld);
    std::vector<Real> got(want.size());
    split_heads(got.data(), x.data() + part * d, b, s, h, dh, ld, bias.data() + part * d);
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(Real)), 0) << part;
  }
}

}  // namespace
// Arguments that do not fit together are refused by name before anything is written.
TEST(Attention, ArgumentsThatDoNotFitAreRefusedByName) {
  const Case c;
  const Inputs<double> in(c);
  std::vector<double> ctx(in.n, 5.0), sc(in.nss), pr(in.nss);
  const AttentionForward<double> t{.context = ctx.data(),
                                   .scores = sc.data(),
                                   .probs = pr.data(),
                                   .q = in.q.data(),
                                   .k = in.k.data(),
                                   .v = in.v.data()};
  const auto refused = [&](AttentionArgs<double> a, AttentionForward<double> f, bool rows,
                           const std::string& why) {
    try {
      rows ? attention_forward_rows(a, f) : attention_forward(a, f);
      ADD_FAILURE() << why;
    } catch (const ShapeError& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
    for (double x : ctx) EXPECT_EQ(x, 5.0);
  };
  AttentionArgs<double> no_lengths = args_of(c, false, nullptr, 1.0);
  no_lengths.lengths = nullptr;
  refused(no_lengths, t, false, "lengths are required");
  AttentionForward<double> no_probs = t;
  no_probs.probs = nullptr;
  refused(args_of(c, false, nullptr, 1.0), no_probs, false, "needs context, scores, probs");
  refused(args_of(c, false, in.mask.data(), in.scale), t, true, "takes no dropout mask");
  refused(args_of(c, false, nullptr, 1.0, /*merged=*/true), t, true, "no merged context");
  AttentionArgs<double> bad_kv = args_of(c, false, nullptr, 1.0);
  bad_kv.variant.kv_heads = 3;
  refused(bad_kv, t, false, "does not divide heads");
}

}  // namespace teo
