#include "teo/layers/attention.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/kernels_internal.hpp"
#include "kernels/parallel.hpp"
#include "teo/kernels.hpp"
#include "teo/layers/softmax.hpp"
#include "teo/precision.hpp"

namespace teo {

namespace {

// The one head transpose: (B, S, H * Dh) with row stride ld <-> (B, H, S, Dh); splitting adds
// bias (H * Dh) when it is not null.
template <bool ToHeads, class Real>
void transpose_heads(Real* out, const Real* in, index_t batch, index_t seq_len, index_t heads,
                     index_t d_head, index_t row_stride, const Real* bias) {
  const index_t ld = row_stride ? row_stride : heads * d_head;
  detail::for_blocks(batch, 1, [&](index_t b0, index_t b1) {
    for (index_t b = b0; b < b1; ++b)
      for (index_t s = 0; s < seq_len; ++s)
        for (index_t h = 0; h < heads; ++h) {
          const index_t rows = (b * seq_len + s) * ld + h * d_head;        // (B, S, H*Dh) side
          const index_t split = ((b * heads + h) * seq_len + s) * d_head;  // (B, H, S, Dh) side
          for (index_t c = 0; c < d_head; ++c) {
            if constexpr (ToHeads) {
              out[split + c] = bias ? in[rows + c] + bias[h * d_head + c] : in[rows + c];
            } else {
              out[rows + c] = in[split + c];
            }
          }
        }
  });
}

}  // namespace

template <class Real>
void split_heads(Real* out, const Real* in, index_t batch, index_t seq_len, index_t heads,
                 index_t d_head, index_t row_stride, const Real* bias) {
  transpose_heads<true>(out, in, batch, seq_len, heads, d_head, row_stride, bias);
}

template <class Real>
void merge_heads(Real* out, const Real* in, index_t batch, index_t seq_len, index_t heads,
                 index_t d_head, index_t row_stride) {
  transpose_heads<false>(out, in, batch, seq_len, heads, d_head, row_stride,
                         static_cast<const Real*>(nullptr));
}

namespace {

// Head bh's (S, Dh) block of a context-shaped tensor, and its row stride: (B, H, S, Dh), or
// (B, S, H * Dh) when merged.
template <class P>
std::pair<P, index_t> head_block(P base, index_t bh, index_t heads, index_t seq_len, index_t d_head,
                                 bool merged) {
  if (!merged) return {base + bh * seq_len * d_head, d_head};
  return {base + (bh / heads) * seq_len * heads * d_head + (bh % heads) * d_head, heads * d_head};
}

// Under bf16 or fp16 emulation (docs/semantics.md, "Reduced precision"), rounds the n stored
// values at p to the format, as a backend that keeps scores and probabilities in it does;
// RangeError naming `what` on an fp16 overflow. A no-op otherwise, and for double.
template <class Real>
void store_rows(Real* p, index_t n, const char* what) {
  if constexpr (std::is_same_v<Real, float>) {
    const Precision e = detail::emulation();
    if ((e == Precision::bf16 || e == Precision::fp16) &&
        detail::isa_kernels().rounding.round(p, p, n, e)) {
      throw RangeError(std::string(what) + ": " + overflow_message(e));
    }
  }
}

// How one head scores its rows: the scale, the mask and the variant's terms.
template <class Real>
struct HeadRule {
  Real alpha = 1;
  bool causal = false;
  index_t window = 0;  // 0: none
  bool capped = false;
  Real cap = 0;
  bool biased = false;
  double slope = 0;  // ALiBi
  bool sunk = false;
  Real sink = 0;
};

// The rules of a call: per head, from the variant.
template <class Real>
class Rules {
 public:
  Rules(const AttentionVariant<Real>& v, index_t heads, index_t d_head, bool causal,
        std::optional<double> scale)
      : v_(v), heads_(heads) {
    base_.alpha = static_cast<Real>(scale ? *scale : 1.0 / std::sqrt(static_cast<double>(d_head)));
    base_.causal = causal;
    base_.window = v.window.value_or(0);
    base_.capped = v.softcap.has_value();
    base_.cap = static_cast<Real>(v.softcap.value_or(0.0));
    base_.biased = v.alibi_max_bias.has_value();
    base_.sunk = v.sinks != nullptr;
    if (base_.biased) slopes_ = alibi_slopes(heads, *v.alibi_max_bias);
    if (v.kv_heads < 0 || heads < 0) throw ShapeError("attention: negative head count");
    const index_t kv = v.kv_heads > 0 ? v.kv_heads : heads;
    if (heads > 0 && (kv > heads || heads % kv != 0)) {
      throw ShapeError("attention: kv_heads " + std::to_string(kv) + " does not divide heads " +
                       std::to_string(heads));
    }
    if (v.alibi_max_bias && !(std::isfinite(*v.alibi_max_bias) && *v.alibi_max_bias > 0.0)) {
      throw ShapeError("attention: alibi_max_bias must be finite and > 0");
    }
    if (v.softcap && !(std::isfinite(*v.softcap) && *v.softcap > 0.0)) {
      throw ShapeError("attention: softcap must be finite and > 0");
    }
    if (v.window && *v.window < 1) throw ShapeError("attention: window must be >= 1");
    kv_heads_ = std::max<index_t>(kv, 1);  // with no heads there is nothing to group
  }
  HeadRule<Real> operator()(index_t h) const {
    HeadRule<Real> r = base_;
    if (r.biased) r.slope = slopes_[static_cast<std::size_t>(h)];
    if (r.sunk) r.sink = v_.sinks[h];
    return r;
  }
  Real alpha() const { return base_.alpha; }
  index_t kv_heads() const { return kv_heads_; }
  index_t group() const { return heads_ / kv_heads_; }  // 0 when there are no heads
  // The backward recomputes the scores when it needs the raw ones (the cap) or the sinks' shares.
  bool recompute() const { return base_.capped || base_.sunk; }
  bool capped() const { return base_.capped; }
  bool sunk() const { return base_.sunk; }
  // Calls fn(bg, hg, h, bh) for the (batch, K/V head) blocks bg of [bg0, bg1) and, in each, its
  // group's query heads in order: hg-th of the group, head h, (batch, head) index bh.
  template <class F>
  void each_head(index_t bg0, index_t bg1, F&& fn) const {
    const index_t g = group();
    for (index_t bg = bg0; bg < bg1; ++bg)
      for (index_t hg = 0; hg < g; ++hg) {
        const index_t h = (bg % kv_heads_) * g + hg;
        fn(bg, hg, h, (bg / kv_heads_) * heads_ + h);
      }
  }

 private:
  const AttentionVariant<Real>& v_;
  index_t heads_, kv_heads_ = 1;
  HeadRule<Real> base_;
  std::vector<double> slopes_;
};

// Keys [lo, hi) are visible from query i; the range is empty (lo == hi) when none is.
std::pair<index_t, index_t> visible_keys(index_t i, index_t length, bool causal, index_t window) {
  index_t hi = causal ? std::min(length, i + 1) : length;
  index_t lo = 0;
  if (window > 0) {
    lo = std::max<index_t>(0, i - window + 1);
    // i + window only when it may bind: a window of up to 2^63 - 1 must not overflow
    if (!causal && window < length) hi = std::min(hi, i + window);
  }
  return {lo, std::max(lo, hi)};
}

// Scratch for the rows of one task: a sink's extended row (in and out), S + 1 each.
template <class Real>
struct SinkRow {
  std::vector<Real> in, out;
  explicit SinkRow(bool used, index_t seq_len)
      : in(static_cast<std::size_t>(used ? seq_len + 1 : 0)),
        out(static_cast<std::size_t>(used ? seq_len + 1 : 0)) {}
};

// Query rows [i0, i1) of one head: scores (rows, S) = the final logits (alpha q k^T, capped,
// biased, masked keys -inf) and probs (rows, S) their softmax (with the sink), each rounded where
// it is stored under bf16 or fp16 emulation; raw (rows, S), when not null, gets alpha q k^T before
// the cap, and psink (rows), when not null, the sink's share of each row. The materialised and the
// row-blocked paths both compute every row here, so they agree bit for bit.
template <class Real>
void score_rows(Real* sc, Real* pr, Real* raw, Real* psink, const Real* qh, const Real* kh,
                index_t len, index_t i0, index_t i1, index_t seq_len, index_t d_head,
                const HeadRule<Real>& rule, SinkRow<Real>& ext) {
  const Real neg_inf = -std::numeric_limits<Real>::infinity();
  // scores (rows, S) = q (rows, Dh) * k^T (Dh, S) * alpha
  gemm<Real>(Trans::no, Trans::yes, i1 - i0, seq_len, d_head, rule.alpha, qh + i0 * d_head, d_head,
             kh, d_head, Real(0), sc, seq_len);
  if (raw) std::copy(sc, sc + (i1 - i0) * seq_len, raw);
  for (index_t i = i0; i < i1; ++i) {
    Real* srow = sc + (i - i0) * seq_len;
    Real* prow = pr + (i - i0) * seq_len;
    const auto [lo, hi] = visible_keys(i, len, rule.causal, rule.window);
    const index_t n = hi - lo;
    for (index_t j = lo; j < hi; ++j) {
      if (rule.capped) srow[j] = rule.cap * std::tanh(srow[j] / rule.cap);
      if (rule.biased) {
        const index_t dist = rule.causal ? i - j : (i > j ? i - j : j - i);
        srow[j] += static_cast<Real>(-rule.slope * static_cast<double>(dist));
      }
    }
    for (index_t j = 0; j < lo; ++j) srow[j] = neg_inf;
    for (index_t j = hi; j < seq_len; ++j) srow[j] = neg_inf;
    store_rows(srow, seq_len, "scores");
    if (rule.sunk) {
      // softmax over [visible scores, sink]; the sink's column is dropped
      std::copy(srow + lo, srow + hi, ext.in.begin());
      ext.in[static_cast<std::size_t>(n)] = rule.sink;
      const index_t n1 = n + 1;
      softmax_forward(ext.out.data(), ext.in.data(), &n1, 1, n1);
      std::fill(prow, prow + seq_len, Real(0));
      std::copy(ext.out.begin(), ext.out.begin() + n, prow + lo);
      psink[i - i0] = ext.out[static_cast<std::size_t>(n)];
    } else {
      std::fill(prow, prow + lo, Real(0));
      softmax_forward(prow + lo, srow + lo, &n, 1, seq_len - lo);
    }
  }
  store_rows(pr, (i1 - i0) * seq_len, "probs");
}

// dscores (rows, S) for query rows whose probs (rows, S) are pr, from dcontext rows dc (stride
// ldc): dprobs = dcontext v^T (through the dropout when there is one), then the softmax's backward.
template <class Real>
void score_grad_rows(Real* dp, Real* ds, const Real* pr, const Real* dc, index_t ldc,
                     const Real* vh, const std::uint8_t* m, Real drop_scale, index_t rows,
                     index_t seq_len, index_t d_head) {
  // dpv (rows, S) = dcontext (rows, Dh) * v^T (Dh, S); then through the dropout
  gemm<Real>(Trans::no, Trans::yes, rows, seq_len, d_head, Real(1), dc, ldc, vh, d_head, Real(0),
             dp, seq_len);
  if (m) {
    for (index_t j = 0; j < rows * seq_len; ++j) dp[j] = m[j] ? dp[j] * drop_scale : Real(0);
  }
  store_rows(dp, rows * seq_len, "probs");
  // in the forward pass this was: probs = softmax(scores)
  // dscores = probs * (dprobs - sum_j probs * dprobs); 0 wherever probs is 0 (masked).
  softmax_backward(ds, dp, pr, rows, seq_len);
  store_rows(ds, rows * seq_len, "scores");
}

// The variant's part of the backward for `rows` rows: adds the sinks' gradient of these rows to
// *dsink (the sink's dprobs is 0, so each row gives -psink * sum_j probs dprobs), and returns the
// gradient of the scaled scores before the cap: dscores (1 - tanh^2(raw / c)) in dsr, or dscores
// itself without a cap.
template <class Real>
const Real* variant_grad_rows(Real* dsr, Real* dsink, const Real* ds, const Real* dp,
                              const Real* pr, const Real* raw, const Real* psink, index_t rows,
                              index_t seq_len, const HeadRule<Real>& rule) {
  if (rule.sunk) {
    for (index_t i = 0; i < rows; ++i) {
      Real dot = 0;
      for (index_t j = 0; j < seq_len; ++j) dot += pr[i * seq_len + j] * dp[i * seq_len + j];
      *dsink -= psink[i] * dot;
    }
  }
  if (!rule.capped) return ds;
  for (index_t j = 0; j < rows * seq_len; ++j) {
    if (ds[j] == Real(0)) {
      dsr[j] = Real(0);  // masked (raw may be anything there)
      continue;
    }
    const Real t = std::tanh(raw[j] / rule.cap);
    dsr[j] = ds[j] * (Real(1) - t * t);
  }
  store_rows(dsr, rows * seq_len, "scores");
  return dsr;
}

// Query rows per block of the row-blocked path: about 2^20 score entries per buffer.
index_t rows_per_block(index_t seq_len, index_t block_rows) {
  if (block_rows > 0) return std::min(block_rows, std::max<index_t>(seq_len, 1));
  return std::clamp<index_t>((index_t{1} << 20) / std::max<index_t>(seq_len, 1), 1,
                             std::max<index_t>(seq_len, 1));
}

template <class Real>
std::vector<Real> buffer(bool used, index_t n) {
  return std::vector<Real>(static_cast<std::size_t>(used ? n : 0));
}

// Adds the per-(batch, head) sink gradients to dsinks (H), batch by batch: the same sums for any
// split of the heads over threads.
template <class Real>
void add_sink_grads(Real* dsinks, const std::vector<Real>& part, index_t batch, index_t heads) {
  for (index_t h = 0; h < heads; ++h)
    for (index_t b = 0; b < batch; ++b) dsinks[h] += part[static_cast<std::size_t>(b * heads + h)];
}

// ShapeError unless the arguments fit together: sizes >= 0, lengths given when there is a batch,
// and the row-blocked path without dropout or merged heads. (The lengths' values are the caller's
// to check: the model and the op cases check them against the sequence.)
template <class Real>
void check_args(const AttentionArgs<Real>& a, const char* what, bool rows) {
  if (a.batch < 0 || a.heads < 0 || a.seq_len < 0 || a.d_head < 0) {
    throw ShapeError(std::string(what) + ": negative size (batch " + std::to_string(a.batch) +
                     ", heads " + std::to_string(a.heads) + ", seq_len " +
                     std::to_string(a.seq_len) + ", d_head " + std::to_string(a.d_head) + ")");
  }
  if (a.batch > 0 && !a.lengths) throw ShapeError(std::string(what) + ": lengths are required");
  if (rows && (a.drop_mask || a.merged_context)) {
    throw ShapeError(std::string(what) +
                     ": the row-blocked path takes no dropout mask and no merged context");
  }
}

// ShapeError naming the tensors `which` unless `present`, when the call has any element.
template <class Real>
void require(bool present, const AttentionArgs<Real>& a, const char* what, const char* which) {
  if (!present && a.batch > 0 && a.heads > 0 && a.seq_len > 0) {
    throw ShapeError(std::string(what) + " needs " + which);
  }
}

}  // namespace

std::vector<double> alibi_slopes(index_t heads, double max_bias) {
  index_t m = 1;
  while (m * 2 <= heads) m *= 2;
  std::vector<double> s(static_cast<std::size_t>(std::max<index_t>(heads, 0)));
  for (index_t h = 0; h < heads; ++h) {
    const double e = h < m ? static_cast<double>(h + 1) / static_cast<double>(m)
                           : static_cast<double>(2 * (h - m) + 1) / static_cast<double>(2 * m);
    s[static_cast<std::size_t>(h)] = std::exp2(-max_bias * e);
  }
  return s;
}

template <class Real>
void attention_forward(const AttentionArgs<Real>& a, const AttentionForward<Real>& t) {
  check_args(a, "attention_forward", /*rows=*/false);
  require(t.context && t.scores && t.probs && t.q && t.k && t.v, a, "attention_forward",
          "context, scores, probs, q, k and v");
  const index_t batch = a.batch, heads = a.heads, seq_len = a.seq_len, d_head = a.d_head;
  const std::int64_t* lengths = a.lengths;
  const std::uint8_t* drop_mask = a.drop_mask;
  const Real drop_scale = a.drop_scale;
  Real *context = t.context, *scores = t.scores, *probs = t.probs;
  const Real *q = t.q, *k = t.k, *v = t.v;
  const Rules<Real> rules(a.variant, heads, d_head, a.causal, a.scale);
  const index_t ss = seq_len * seq_len, kv = rules.kv_heads();
  // Each (batch, K/V head) block is one task's: its query heads' scores, probs and context rows
  // are its own.
  detail::for_blocks(batch * kv, 1, [&](index_t bg0, index_t bg1) {
    std::vector<Real> dropped = buffer<Real>(drop_mask, ss);        // (S, S)
    std::vector<Real> psink = buffer<Real>(rules.sunk(), seq_len);  // (S)
    SinkRow<Real> ext(rules.sunk(), seq_len);
    rules.each_head(bg0, bg1, [&](index_t bg, index_t, index_t h, index_t bh) {
      const Real* kh = k + bg * seq_len * d_head;  // (S, Dh)
      const Real* vh = v + bg * seq_len * d_head;  // (S, Dh)
      const Real* qh = q + bh * seq_len * d_head;  // (S, Dh)
      Real* sc = scores + bh * ss;                 // (S, S)
      Real* pr = probs + bh * ss;                  // (S, S)
      score_rows(sc, pr, static_cast<Real*>(nullptr), psink.data(), qh, kh, lengths[bh / heads], 0,
                 seq_len, seq_len, d_head, rules(h), ext);
      const Real* pv = pr;
      if (drop_mask) {
        const std::uint8_t* m = drop_mask + bh * ss;
        for (index_t j = 0; j < ss; ++j) dropped[j] = m[j] ? pr[j] * drop_scale : Real(0);
        pv = dropped.data();
      }
      // context (S, Dh) = dropout(probs) (S, S) * v (S, Dh); the strides change no value
      const auto [ch, ldc] = head_block(context, bh, heads, seq_len, d_head, a.merged_context);
      gemm<Real>(Trans::no, Trans::no, seq_len, d_head, seq_len, Real(1), pv, seq_len, vh, d_head,
                 Real(0), ch, ldc);
    });
  });
}

template <class Real>
void attention_backward(const AttentionArgs<Real>& a, const AttentionBackward<Real>& t) {
  check_args(a, "attention_backward", /*rows=*/false);
  require(
      t.dq && t.dk && t.dv && t.dprobs && t.dscores && t.dcontext && t.q && t.k && t.v && t.probs,
      a, "attention_backward", "dq, dk, dv, dprobs, dscores, dcontext, q, k, v and probs");
  const index_t batch = a.batch, heads = a.heads, seq_len = a.seq_len, d_head = a.d_head;
  const std::int64_t* lengths = a.lengths;
  const std::uint8_t* drop_mask = a.drop_mask;
  const Real drop_scale = a.drop_scale;
  Real *dq = t.dq, *dk = t.dk, *dv = t.dv, *dprobs = t.dprobs, *dscores = t.dscores;
  const Real *dcontext = t.dcontext, *q = t.q, *k = t.k, *v = t.v, *probs = t.probs;
  const AttentionVariant<Real>& variant = a.variant;
  const Rules<Real> rules(variant, heads, d_head, a.causal, a.scale);
  const Real alpha = rules.alpha();
  const index_t ss = seq_len * seq_len, kv = rules.kv_heads();
  if (rules.sunk() && !variant.dsinks) {
    throw ShapeError("attention_backward: sinks need dsinks");
  }
  // Each query head's dq is written by one product: beta = 0 overwrites it. A K/V head's dk and dv
  // are one fused chain over its group's query heads in order, the first starting from beta.
  const Real beta = a.qkv_write == GradWrite::overwrite ? Real(0) : Real(1);
  std::vector<Real> sink_part = buffer<Real>(rules.sunk(), batch * heads);  // (B, H)
  detail::for_blocks(batch * kv, 1, [&](index_t bg0, index_t bg1) {
    std::vector<Real> dropped = buffer<Real>(drop_mask, ss);  // (S, S)
    // the recomputed scores and probs, with the raw scores and the sinks' shares
    std::vector<Real> sc = buffer<Real>(rules.recompute(), ss), pr2 = sc;
    std::vector<Real> raw = buffer<Real>(rules.capped(), ss), dsr = raw;
    std::vector<Real> psink = buffer<Real>(rules.sunk(), seq_len);
    SinkRow<Real> ext(rules.sunk(), seq_len);
    rules.each_head(bg0, bg1, [&](index_t bg, index_t hg, index_t h, index_t bh) {
      const index_t koff = bg * seq_len * d_head;
      const index_t off = bh * seq_len * d_head;
      const Real bkv = hg == 0 ? beta : Real(1);
      const HeadRule<Real> rule = rules(h);
      // this head's dcontext (S, Dh) and its row stride
      const auto [dc, ldc] = head_block(dcontext, bh, heads, seq_len, d_head, a.merged_context);
      const Real* pr = probs + bh * ss;  // (S, S)
      Real* dp = dprobs + bh * ss;       // (S, S)
      Real* ds = dscores + bh * ss;      // (S, S)
      const std::uint8_t* m = drop_mask ? drop_mask + bh * ss : nullptr;
      const Real* pv = pr;
      if (m) {
        for (index_t j = 0; j < ss; ++j) dropped[j] = m[j] ? pr[j] * drop_scale : Real(0);
        pv = dropped.data();
      }
      // in the forward pass this was: context = pv * v, with pv = dropout(probs)
      // dv (S, Dh) += pv^T (S, S) * dcontext (S, Dh)
      gemm<Real>(Trans::yes, Trans::no, seq_len, d_head, seq_len, Real(1), pv, seq_len, dc, ldc,
                 bkv, dv + koff, d_head);
      score_grad_rows(dp, ds, pr, dc, ldc, v + koff, m, drop_scale, seq_len, seq_len, d_head);
      if (rules.recompute()) {
        score_rows(sc.data(), pr2.data(), rule.capped ? raw.data() : nullptr, psink.data(), q + off,
                   k + koff, lengths[bh / heads], 0, seq_len, seq_len, d_head, rule, ext);
      }
      Real dsink = 0;
      const Real* dsq = variant_grad_rows(dsr.data(), &dsink, ds, dp, pr, raw.data(), psink.data(),
                                          seq_len, seq_len, rule);
      if (rule.sunk) sink_part[static_cast<std::size_t>(bh)] = dsink;
      // in the forward pass this was: scores = alpha * q * k^T
      // dq (S, Dh) += alpha * dscores (S, S) * k (S, Dh)
      gemm<Real>(Trans::no, Trans::no, seq_len, d_head, seq_len, alpha, dsq, seq_len, k + koff,
                 d_head, beta, dq + off, d_head);
      // dk (S, Dh) += alpha * dscores^T (S, S) * q (S, Dh)
      gemm<Real>(Trans::yes, Trans::no, seq_len, d_head, seq_len, alpha, dsq, seq_len, q + off,
                 d_head, bkv, dk + koff, d_head);
    });
  });
  if (rules.sunk()) add_sink_grads(variant.dsinks, sink_part, batch, heads);
}

template <class Real>
void attention_forward_rows(const AttentionArgs<Real>& a, const AttentionForward<Real>& t) {
  check_args(a, "attention_forward_rows", /*rows=*/true);
  require(t.context && t.q && t.k && t.v, a, "attention_forward_rows", "context, q, k and v");
  const index_t batch = a.batch, heads = a.heads, seq_len = a.seq_len, d_head = a.d_head;
  const std::int64_t* lengths = a.lengths;
  Real* context = t.context;
  const Real *q = t.q, *k = t.k, *v = t.v;
  const Rules<Real> rules(a.variant, heads, d_head, a.causal, a.scale);
  const index_t rb = rows_per_block(seq_len, a.block_rows), kv = rules.kv_heads();
  detail::for_blocks(batch * kv, 1, [&](index_t bg0, index_t bg1) {
    std::vector<Real> sc(static_cast<std::size_t>(rb * seq_len));  // (rows, S)
    std::vector<Real> pr(static_cast<std::size_t>(rb * seq_len));  // (rows, S)
    std::vector<Real> psink = buffer<Real>(rules.sunk(), rb);      // (rows)
    SinkRow<Real> ext(rules.sunk(), seq_len);
    rules.each_head(bg0, bg1, [&](index_t bg, index_t, index_t h, index_t bh) {
      const index_t koff = bg * seq_len * d_head;
      const index_t off = bh * seq_len * d_head;
      const HeadRule<Real> rule = rules(h);
      for (index_t i0 = 0; i0 < seq_len; i0 += rb) {
        const index_t i1 = std::min(seq_len, i0 + rb);
        score_rows(sc.data(), pr.data(), static_cast<Real*>(nullptr), psink.data(), q + off,
                   k + koff, lengths[bh / heads], i0, i1, seq_len, d_head, rule, ext);
        // context rows (rows, Dh) = probs (rows, S) * v (S, Dh)
        gemm<Real>(Trans::no, Trans::no, i1 - i0, d_head, seq_len, Real(1), pr.data(), seq_len,
                   v + koff, d_head, Real(0), context + off + i0 * d_head, d_head);
      }
    });
  });
}

template <class Real>
void attention_backward_rows(const AttentionArgs<Real>& a, const AttentionBackward<Real>& t) {
  check_args(a, "attention_backward_rows", /*rows=*/true);
  require(t.dq && t.dk && t.dv && t.dcontext && t.q && t.k && t.v, a, "attention_backward_rows",
          "dq, dk, dv, dcontext, q, k and v");
  const index_t batch = a.batch, heads = a.heads, seq_len = a.seq_len, d_head = a.d_head;
  const std::int64_t* lengths = a.lengths;
  Real *dq = t.dq, *dk = t.dk, *dv = t.dv;
  const Real *dcontext = t.dcontext, *q = t.q, *k = t.k, *v = t.v;
  const AttentionVariant<Real>& variant = a.variant;
  const Rules<Real> rules(variant, heads, d_head, a.causal, a.scale);
  const Real alpha = rules.alpha();
  const Real beta = a.qkv_write == GradWrite::overwrite ? Real(0) : Real(1);
  const index_t rb = rows_per_block(seq_len, a.block_rows), kv = rules.kv_heads();
  if (rules.sunk() && !variant.dsinks) {
    throw ShapeError("attention_backward_rows: sinks need dsinks");
  }
  std::vector<Real> sink_part = buffer<Real>(rules.sunk(), batch * heads);  // (B, H)
  detail::for_blocks(batch * kv, 1, [&](index_t bg0, index_t bg1) {
    std::vector<Real> sc(static_cast<std::size_t>(rb * seq_len));  // (rows, S)
    std::vector<Real> pr(static_cast<std::size_t>(rb * seq_len));  // (rows, S)
    std::vector<Real> dp(static_cast<std::size_t>(rb * seq_len));  // (rows, S)
    std::vector<Real> ds(static_cast<std::size_t>(rb * seq_len));  // (rows, S)
    std::vector<Real> raw = buffer<Real>(rules.capped(), rb * seq_len), dsr = raw;
    std::vector<Real> psink = buffer<Real>(rules.sunk(), rb);  // (rows)
    SinkRow<Real> ext(rules.sunk(), seq_len);
    rules.each_head(bg0, bg1, [&](index_t bg, index_t hg, index_t h, index_t bh) {
      const index_t koff = bg * seq_len * d_head;
      const index_t off = bh * seq_len * d_head;
      const HeadRule<Real> rule = rules(h);
      Real dsink = 0;
      for (index_t i0 = 0; i0 < seq_len; i0 += rb) {
        const index_t i1 = std::min(seq_len, i0 + rb), rows = i1 - i0;
        // The first block of the group's first head starts dk and dv from beta; later ones
        // continue the same fused chains, so every element is the materialised product's chain.
        const Real b = hg == 0 && i0 == 0 ? beta : Real(1);
        const Real* dc = dcontext + off + i0 * d_head;  // (rows, Dh)
        score_rows(sc.data(), pr.data(), rule.capped ? raw.data() : nullptr, psink.data(), q + off,
                   k + koff, lengths[bh / heads], i0, i1, seq_len, d_head, rule, ext);
        // dv (S, Dh) += probs^T (S, rows) * dcontext (rows, Dh)
        gemm<Real>(Trans::yes, Trans::no, seq_len, d_head, rows, Real(1), pr.data(), seq_len, dc,
                   d_head, b, dv + koff, d_head);
        score_grad_rows(dp.data(), ds.data(), pr.data(), dc, d_head, v + koff,
                        static_cast<const std::uint8_t*>(nullptr), Real(1), rows, seq_len, d_head);
        const Real* dsq = variant_grad_rows(dsr.data(), &dsink, ds.data(), dp.data(), pr.data(),
                                            raw.data(), psink.data(), rows, seq_len, rule);
        // dq rows (rows, Dh) += alpha * dscores (rows, S) * k (S, Dh)
        gemm<Real>(Trans::no, Trans::no, rows, d_head, seq_len, alpha, dsq, seq_len, k + koff,
                   d_head, beta, dq + off + i0 * d_head, d_head);
        // dk (S, Dh) += alpha * dscores^T (S, rows) * q (rows, Dh)
        gemm<Real>(Trans::yes, Trans::no, seq_len, d_head, rows, alpha, dsq, seq_len,
                   q + off + i0 * d_head, d_head, b, dk + koff, d_head);
      }
      if (rule.sunk) sink_part[static_cast<std::size_t>(bh)] = dsink;
    });
  });
  if (rules.sunk()) add_sink_grads(variant.dsinks, sink_part, batch, heads);
}

#define TEO_INSTANTIATE(Real)                                                                      \
  template void split_heads<Real>(Real*, const Real*, index_t, index_t, index_t, index_t, index_t, \
                                  const Real*);                                                    \
  template void merge_heads<Real>(Real*, const Real*, index_t, index_t, index_t, index_t,          \
                                  index_t);                                                        \
  template void attention_forward<Real>(const AttentionArgs<Real>&,                                \
                                        const AttentionForward<Real>&);                            \
  template void attention_backward<Real>(const AttentionArgs<Real>&,                               \
                                         const AttentionBackward<Real>&);                          \
  template void attention_forward_rows<Real>(const AttentionArgs<Real>&,                           \
                                             const AttentionForward<Real>&);                       \
  template void attention_backward_rows<Real>(const AttentionArgs<Real>&,                          \
                                              const AttentionBackward<Real>&);
TEO_INSTANTIATE(float)
TEO_INSTANTIATE(double)

}  // namespace teo
