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
#include "layers/attention_fp8.hpp"
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

// Under bf16, fp16 or fp8 emulation (docs/semantics.md, "Reduced precision"), rounds the n stored
// values at p to the format, as a backend that keeps scores and probabilities in it does;
// RangeError naming `what` on an fp16 overflow. A no-op otherwise, and for double.
template <class Real>
void store_rows(Real* p, index_t n, const char* what) {
  if constexpr (std::is_same_v<Real, float>) {
    const Precision e = detail::emulation();
    if (stores_reduced(e) && detail::isa_kernels().rounding.round(p, p, n, storage_format(e))) {
      throw RangeError(std::string(what) + ": " + overflow_message(e));
    }
  }
}

// Where attention runs its forward products in fp8 (attention_fp8.hpp): the quantized operands of
// the (batch, K/V head) block a head belongs to, and the head's first query row among them. Null
// heads: the products are gemm()'s.
struct Fp8Rows {
  const detail::Fp8AttentionHeads* heads = nullptr;
  index_t row0 = 0;
};

// One task's fp8 operands, quantized at the first head of each (batch, K/V head) block, before any
// of its rows, so that the materialised and the row-blocked paths multiply the same values.
template <class Real>
class Fp8Group {
 public:
  Fp8Group() {
    if constexpr (std::is_same_v<Real, float>) used_ = detail::fp8_attention();
  }
  // q: the group's first query head, whose G * Sq rows are the group's.
  void start(index_t hg, const Real* q, index_t q_rows, const Real* k, const Real* v, index_t skv,
             index_t dh, index_t dv) {
    if constexpr (std::is_same_v<Real, float>) {
      if (used_ && hg == 0) heads_ = detail::quantize_heads(q, q_rows, k, v, skv, dh, dv);
    }
  }
  Fp8Rows rows(index_t hg, index_t sq) const { return {used_ ? &heads_ : nullptr, hg * sq}; }

 private:
  bool used_ = false;
  detail::Fp8AttentionHeads heads_;
};

// scores rows [i0, i1) (rows, Skv) = alpha * q (rows, Dh) * k^T (Dh, Skv): in fp8 where f8 says
// so.
template <class Real>
void score_product(const Fp8Rows& f8, const Real* qh, const Real* kh, index_t i0, index_t i1,
                   index_t skv, index_t d_head, Real alpha, Real* sc) {
  if constexpr (std::is_same_v<Real, float>) {
    if (f8.heads) return detail::fp8_scores(*f8.heads, f8.row0 + i0, i1 - i0, alpha, sc);
  }
  gemm<Real>(Trans::no, Trans::yes, i1 - i0, skv, d_head, alpha, qh + i0 * d_head, d_head, kh,
             d_head, Real(0), sc, skv);
}

// context rows (rows, Dv; stride ldc) = p (rows, Skv) * v (Skv, Dv): in fp8 where f8 says so.
template <class Real>
void context_rows(const Fp8Rows& f8, const Real* p, index_t rows, index_t skv, const Real* vh,
                  index_t d_v, Real* ch, index_t ldc) {
  if constexpr (std::is_same_v<Real, float>) {
    if (f8.heads) return detail::fp8_context(*f8.heads, p, rows, ch, ldc);
  }
  gemm<Real>(Trans::no, Trans::no, rows, d_v, skv, Real(1), p, skv, vh, d_v, Real(0), ch, ldc);
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

// Keys [lo, hi) of the `length` keys are visible from the query at position p (negative for a
// bottom-right query before the first key); the range is empty (lo == hi) when none is.
std::pair<index_t, index_t> visible_keys(index_t p, index_t length, bool causal, index_t window) {
  index_t hi = causal ? std::min(length, p + 1) : length;
  index_t lo = 0;
  if (window > 0) {
    lo = std::max<index_t>(0, p - window + 1);
    // p + window only when it may bind: a window of up to 2^63 - 1 must not overflow
    if (!causal && window < length) hi = std::min(hi, p + window);
  }
  lo = std::min(lo, std::max<index_t>(length, 0));
  return {lo, std::max(lo, hi)};
}

// One sequence of a call: its keys, and the position of its query 0 (docs/semantics.md).
struct SeqRule {
  index_t keys = 0;
  index_t shift = 0;
};

// The sizes of a call: query rows, key rows, the q/k and the v head sizes.
struct Sizes {
  index_t sq = 0, skv = 0, dh = 0, dv = 0;
};

template <class Real>
Sizes sizes_of(const AttentionArgs<Real>& a) {
  return {a.seq_len, a.kv_len.value_or(a.seq_len), a.d_head,
          a.d_head_v > 0 ? a.d_head_v : a.d_head};
}

template <class Real>
SeqRule seq_rule(const AttentionArgs<Real>& a, index_t b) {
  const index_t lq = a.lengths[b], lk = a.kv_lengths ? a.kv_lengths[b] : lq;
  return {lk, a.causal_align == CausalAlign::bottom_right ? lk - lq : 0};
}

// Scratch for the rows of one task: a sink's extended row (in and out), Skv + 1 each.
template <class Real>
struct SinkRow {
  std::vector<Real> in, out;
  explicit SinkRow(bool used, index_t skv)
      : in(static_cast<std::size_t>(used ? skv + 1 : 0)),
        out(static_cast<std::size_t>(used ? skv + 1 : 0)) {}
};

// log(sum_j exp(s_j) + exp(sink)) over the n visible logits s of a row (the sink when the rule has
// one), from their maximum, in one order; -inf when there is nothing to sum.
template <class Real>
Real log_sum_exp(const Real* s, index_t n, const HeadRule<Real>& rule) {
  Real m = rule.sunk ? rule.sink : -std::numeric_limits<Real>::infinity();
  for (index_t j = 0; j < n; ++j) m = std::max(m, s[j]);
  if (m == -std::numeric_limits<Real>::infinity()) return m;
  Real sum = rule.sunk ? std::exp(rule.sink - m) : Real(0);
  for (index_t j = 0; j < n; ++j) sum += std::exp(s[j] - m);
  return m + std::log(sum);
}

// Query rows [i0, i1) of one head: scores (rows, Skv) = the final logits (alpha q k^T, capped,
// biased, masked keys -inf) and probs (rows, Skv) their softmax (with the sink), each rounded
// where it is stored under bf16 or fp16 emulation; raw (rows, Skv), when not null, gets alpha q k^T
// before the cap, psink (rows), when not null, the sink's share of each row, and lse (rows), when
// not null, each row's log-sum-exp; q k^T is an fp8 product where f8 says so. The materialised and
// the row-blocked paths both compute every row here, so they agree bit for bit.
template <class Real>
void score_rows(Real* sc, Real* pr, Real* raw, Real* psink, Real* lse, const Real* qh,
                const Real* kh, SeqRule seq, index_t i0, index_t i1, index_t skv, index_t d_head,
                const HeadRule<Real>& rule, SinkRow<Real>& ext, const Fp8Rows& f8) {
  const Real neg_inf = -std::numeric_limits<Real>::infinity();
  score_product(f8, qh, kh, i0, i1, skv, d_head, rule.alpha, sc);
  if (raw) std::copy(sc, sc + (i1 - i0) * skv, raw);
  for (index_t i = i0; i < i1; ++i) {
    Real* srow = sc + (i - i0) * skv;
    Real* prow = pr + (i - i0) * skv;
    const index_t p = i + seq.shift;  // the query's position among the keys
    const auto [lo, hi] = visible_keys(p, seq.keys, rule.causal, rule.window);
    const index_t n = hi - lo;
    for (index_t j = lo; j < hi; ++j) {
      if (rule.capped) srow[j] = rule.cap * std::tanh(srow[j] / rule.cap);
      if (rule.biased) {
        const index_t dist = rule.causal ? p - j : (p > j ? p - j : j - p);
        srow[j] += static_cast<Real>(-rule.slope * static_cast<double>(dist));
      }
    }
    for (index_t j = 0; j < lo; ++j) srow[j] = neg_inf;
    for (index_t j = hi; j < skv; ++j) srow[j] = neg_inf;
    store_rows(srow, skv, "scores");
    if (lse) lse[i - i0] = log_sum_exp(srow + lo, n, rule);
    if (rule.sunk) {
      // softmax over [visible scores, sink]; the sink's column is dropped
      std::copy(srow + lo, srow + hi, ext.in.begin());
      ext.in[static_cast<std::size_t>(n)] = rule.sink;
      const index_t n1 = n + 1;
      softmax_forward(ext.out.data(), ext.in.data(), &n1, 1, n1);
      std::fill(prow, prow + skv, Real(0));
      std::copy(ext.out.begin(), ext.out.begin() + n, prow + lo);
      psink[i - i0] = ext.out[static_cast<std::size_t>(n)];
    } else {
      std::fill(prow, prow + lo, Real(0));
      softmax_forward(prow + lo, srow + lo, &n, 1, skv - lo);
    }
  }
  store_rows(pr, (i1 - i0) * skv, "probs");
}

// dscores (rows, Skv) for query rows whose probs (rows, Skv) are pr, from dcontext rows dc (stride
// ldc): dprobs = dcontext v^T (through the dropout when there is one), then the softmax's backward,
// plus probs * dlse when the rows' lse has an upstream gradient dlse (rows).
template <class Real>
void score_grad_rows(Real* dp, Real* ds, const Real* pr, const Real* dc, index_t ldc,
                     const Real* vh, const std::uint8_t* m, Real drop_scale, index_t rows,
                     index_t skv, index_t d_v, const Real* dlse) {
  // dpv (rows, Skv) = dcontext (rows, Dv) * v^T (Dv, Skv); then through the dropout
  gemm<Real>(Trans::no, Trans::yes, rows, skv, d_v, Real(1), dc, ldc, vh, d_v, Real(0), dp, skv);
  if (m) {
    for (index_t j = 0; j < rows * skv; ++j) dp[j] = m[j] ? dp[j] * drop_scale : Real(0);
  }
  store_rows(dp, rows * skv, "probs");
  // in the forward pass this was: probs = softmax(scores)
  // dscores = probs * (dprobs - sum_j probs * dprobs); 0 wherever probs is 0 (masked).
  softmax_backward(ds, dp, pr, rows, skv);
  // and lse = log sum exp(scores): dscores += probs * dlse (0 where masked)
  if (dlse) {
    for (index_t i = 0; i < rows; ++i)
      for (index_t j = 0; j < skv; ++j) ds[i * skv + j] += pr[i * skv + j] * dlse[i];
  }
  store_rows(ds, rows * skv, "scores");
}

// The variant's part of the backward for `rows` rows: adds the sinks' gradient of these rows to
// *dsink (the sink's dprobs is 0, so each row gives -psink * sum_j probs dprobs, and psink * dlse
// through the lse when dlse is not null), and returns the
// gradient of the scaled scores before the cap: dscores (1 - tanh^2(raw / c)) in dsr, or dscores
// itself without a cap.
template <class Real>
const Real* variant_grad_rows(Real* dsr, Real* dsink, const Real* ds, const Real* dp,
                              const Real* pr, const Real* raw, const Real* psink, index_t rows,
                              index_t cols, const HeadRule<Real>& rule, const Real* dlse) {
  if (rule.sunk) {
    for (index_t i = 0; i < rows; ++i) {
      Real dot = 0;
      for (index_t j = 0; j < cols; ++j) dot += pr[i * cols + j] * dp[i * cols + j];
      *dsink -= psink[i] * dot;
      if (dlse) *dsink += psink[i] * dlse[i];  // the sink is in lse's sum
    }
  }
  if (!rule.capped) return ds;
  for (index_t j = 0; j < rows * cols; ++j) {
    if (ds[j] == Real(0)) {
      dsr[j] = Real(0);  // masked (raw may be anything there)
      continue;
    }
    const Real t = std::tanh(raw[j] / rule.cap);
    dsr[j] = ds[j] * (Real(1) - t * t);
  }
  store_rows(dsr, rows * cols, "scores");
  return dsr;
}

// Query rows per block of the row-blocked path: about 2^20 score entries per buffer.
index_t rows_per_block(index_t sq, index_t skv, index_t block_rows) {
  if (block_rows > 0) return std::min(block_rows, std::max<index_t>(sq, 1));
  return std::clamp<index_t>((index_t{1} << 20) / std::max<index_t>(skv, 1), 1,
                             std::max<index_t>(sq, 1));
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
  if (a.batch < 0 || a.heads < 0 || a.seq_len < 0 || a.d_head < 0 || a.kv_len.value_or(0) < 0 ||
      a.d_head_v < 0) {
    throw ShapeError(std::string(what) + ": negative size (batch " + std::to_string(a.batch) +
                     ", heads " + std::to_string(a.heads) + ", seq_len " +
                     std::to_string(a.seq_len) + ", kv_len " +
                     std::to_string(a.kv_len.value_or(a.seq_len)) + ", d_head " +
                     std::to_string(a.d_head) + ", d_head_v " + std::to_string(a.d_head_v) + ")");
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
  if (!present && a.batch > 0 && a.heads > 0 && (a.seq_len > 0 || a.kv_len.value_or(0) > 0)) {
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
  const Sizes z = sizes_of(a);  // (named: a lambda may not capture a structured binding)
  const index_t sq = z.sq, skv = z.skv, dh = z.dh, d_v = z.dv;
  const index_t heads = a.heads;
  const std::uint8_t* drop_mask = a.drop_mask;
  const Real drop_scale = a.drop_scale;
  Real *context = t.context, *scores = t.scores, *probs = t.probs;
  const Real *q = t.q, *k = t.k, *v = t.v;
  const Rules<Real> rules(a.variant, heads, dh, a.causal, a.scale);
  const index_t ss = sq * skv, kv = rules.kv_heads();
  // Each (batch, K/V head) block is one task's: its query heads' scores, probs and context rows
  // are its own.
  detail::for_blocks(a.batch * kv, 1, [&](index_t bg0, index_t bg1) {
    std::vector<Real> dropped = buffer<Real>(drop_mask, ss);   // (Sq, Skv)
    std::vector<Real> psink = buffer<Real>(rules.sunk(), sq);  // (Sq)
    SinkRow<Real> ext(rules.sunk(), skv);
    Fp8Group<Real> f8;
    rules.each_head(bg0, bg1, [&](index_t bg, index_t hg, index_t h, index_t bh) {
      const Real* kh = k + bg * skv * dh;   // (Skv, Dh)
      const Real* vh = v + bg * skv * d_v;  // (Skv, Dv)
      const Real* qh = q + bh * sq * dh;    // (Sq, Dh)
      Real* sc = scores + bh * ss;          // (Sq, Skv)
      Real* pr = probs + bh * ss;           // (Sq, Skv)
      f8.start(hg, qh, rules.group() * sq, kh, vh, skv, dh, d_v);
      score_rows(sc, pr, static_cast<Real*>(nullptr), psink.data(),
                 t.lse ? t.lse + bh * sq : nullptr, qh, kh, seq_rule(a, bh / heads), 0, sq, skv, dh,
                 rules(h), ext, f8.rows(hg, sq));
      const Real* pv = pr;
      if (drop_mask) {
        const std::uint8_t* m = drop_mask + bh * ss;
        for (index_t j = 0; j < ss; ++j) dropped[j] = m[j] ? pr[j] * drop_scale : Real(0);
        pv = dropped.data();
      }
      // context (Sq, Dv) = dropout(probs) (Sq, Skv) * v (Skv, Dv); the strides change no value
      const auto [ch, ldc] = head_block(context, bh, heads, sq, d_v, a.merged_context);
      context_rows(f8.rows(hg, sq), pv, sq, skv, vh, d_v, ch, ldc);
    });
  });
}

template <class Real>
void attention_backward(const AttentionArgs<Real>& a, const AttentionBackward<Real>& t) {
  check_args(a, "attention_backward", /*rows=*/false);
  require(
      t.dq && t.dk && t.dv && t.dprobs && t.dscores && t.dcontext && t.q && t.k && t.v && t.probs,
      a, "attention_backward", "dq, dk, dv, dprobs, dscores, dcontext, q, k, v and probs");
  const Sizes z = sizes_of(a);  // (named: a lambda may not capture a structured binding)
  const index_t sq = z.sq, skv = z.skv, dh = z.dh, d_v = z.dv;
  const index_t batch = a.batch, heads = a.heads;
  const std::uint8_t* drop_mask = a.drop_mask;
  const Real drop_scale = a.drop_scale;
  Real *dq = t.dq, *dk = t.dk, *dv = t.dv, *dprobs = t.dprobs, *dscores = t.dscores;
  const Real *dcontext = t.dcontext, *q = t.q, *k = t.k, *v = t.v, *probs = t.probs;
  const AttentionVariant<Real>& variant = a.variant;
  const Rules<Real> rules(variant, heads, dh, a.causal, a.scale);
  const Real alpha = rules.alpha();
  const index_t ss = sq * skv, kv = rules.kv_heads();
  if (rules.sunk() && !variant.dsinks) {
    throw ShapeError("attention_backward: sinks need dsinks");
  }
  // Each query head's dq is written by one product: beta = 0 overwrites it. A K/V head's dk and dv
  // are one fused chain over its group's query heads in order, the first starting from beta.
  const Real beta = a.qkv_write == GradWrite::overwrite ? Real(0) : Real(1);
  std::vector<Real> sink_part = buffer<Real>(rules.sunk(), batch * heads);  // (B, H)
  detail::for_blocks(batch * kv, 1, [&](index_t bg0, index_t bg1) {
    std::vector<Real> dropped = buffer<Real>(drop_mask, ss);  // (Sq, Skv)
    // the recomputed scores and probs, with the raw scores and the sinks' shares
    std::vector<Real> sc = buffer<Real>(rules.recompute(), ss), pr2 = sc;
    std::vector<Real> raw = buffer<Real>(rules.capped(), ss), dsr = raw;
    std::vector<Real> psink = buffer<Real>(rules.sunk(), sq);
    SinkRow<Real> ext(rules.sunk(), skv);
    Fp8Group<Real> f8;
    rules.each_head(bg0, bg1, [&](index_t bg, index_t hg, index_t h, index_t bh) {
      const index_t koff = bg * skv * dh, voff = bg * skv * d_v, off = bh * sq * dh;
      const Real bkv = hg == 0 ? beta : Real(1);
      const HeadRule<Real> rule = rules(h);
      // this head's dcontext (Sq, Dv) and its row stride
      const auto [dc, ldc] = head_block(dcontext, bh, heads, sq, d_v, a.merged_context);
      const Real* pr = probs + bh * ss;  // (Sq, Skv)
      Real* dp = dprobs + bh * ss;       // (Sq, Skv)
      Real* ds = dscores + bh * ss;      // (Sq, Skv)
      const std::uint8_t* m = drop_mask ? drop_mask + bh * ss : nullptr;
      const Real* pv = pr;
      if (m) {
        for (index_t j = 0; j < ss; ++j) dropped[j] = m[j] ? pr[j] * drop_scale : Real(0);
        pv = dropped.data();
      }
      // in the forward pass this was: context = pv * v, with pv = dropout(probs)
      // dv (Skv, Dv) += pv^T (Skv, Sq) * dcontext (Sq, Dv)
      gemm<Real>(Trans::yes, Trans::no, skv, d_v, sq, Real(1), pv, skv, dc, ldc, bkv, dv + voff,
                 d_v);
      const Real* dl = t.dlse ? t.dlse + bh * sq : nullptr;  // (Sq)
      score_grad_rows(dp, ds, pr, dc, ldc, v + voff, m, drop_scale, sq, skv, d_v, dl);
      if (rules.recompute()) {
        f8.start(hg, q + off, rules.group() * sq, k + koff, v + voff, skv, dh, d_v);
        score_rows(sc.data(), pr2.data(), rule.capped ? raw.data() : nullptr, psink.data(),
                   static_cast<Real*>(nullptr), q + off, k + koff, seq_rule(a, bh / heads), 0, sq,
                   skv, dh, rule, ext, f8.rows(hg, sq));
      }
      Real dsink = 0;
      const Real* dsq = variant_grad_rows(dsr.data(), &dsink, ds, dp, pr, raw.data(), psink.data(),
                                          sq, skv, rule, dl);
      if (rule.sunk) sink_part[static_cast<std::size_t>(bh)] = dsink;
      // in the forward pass this was: scores = alpha * q * k^T
      // dq (Sq, Dh) += alpha * dscores (Sq, Skv) * k (Skv, Dh)
      gemm<Real>(Trans::no, Trans::no, sq, dh, skv, alpha, dsq, skv, k + koff, dh, beta, dq + off,
                 dh);
      // dk (Skv, Dh) += alpha * dscores^T (Skv, Sq) * q (Sq, Dh)
      gemm<Real>(Trans::yes, Trans::no, skv, dh, sq, alpha, dsq, skv, q + off, dh, bkv, dk + koff,
                 dh);
    });
  });
  if (rules.sunk()) add_sink_grads(variant.dsinks, sink_part, batch, heads);
}

template <class Real>
void attention_forward_rows(const AttentionArgs<Real>& a, const AttentionForward<Real>& t) {
  check_args(a, "attention_forward_rows", /*rows=*/true);
  require(t.context && t.q && t.k && t.v, a, "attention_forward_rows", "context, q, k and v");
  const Sizes z = sizes_of(a);  // (named: a lambda may not capture a structured binding)
  const index_t sq = z.sq, skv = z.skv, dh = z.dh, d_v = z.dv;
  const index_t heads = a.heads;
  Real* context = t.context;
  const Real *q = t.q, *k = t.k, *v = t.v;
  const Rules<Real> rules(a.variant, heads, dh, a.causal, a.scale);
  const index_t rb = rows_per_block(sq, skv, a.block_rows), kv = rules.kv_heads();
  detail::for_blocks(a.batch * kv, 1, [&](index_t bg0, index_t bg1) {
    std::vector<Real> sc(static_cast<std::size_t>(rb * skv));  // (rows, Skv)
    std::vector<Real> pr(static_cast<std::size_t>(rb * skv));  // (rows, Skv)
    std::vector<Real> psink = buffer<Real>(rules.sunk(), rb);  // (rows)
    SinkRow<Real> ext(rules.sunk(), skv);
    Fp8Group<Real> f8;
    rules.each_head(bg0, bg1, [&](index_t bg, index_t hg, index_t h, index_t bh) {
      const index_t koff = bg * skv * dh, voff = bg * skv * d_v, off = bh * sq * dh;
      const HeadRule<Real> rule = rules(h);
      f8.start(hg, q + off, rules.group() * sq, k + koff, v + voff, skv, dh, d_v);
      for (index_t i0 = 0; i0 < sq; i0 += rb) {
        const index_t i1 = std::min(sq, i0 + rb);
        score_rows(sc.data(), pr.data(), static_cast<Real*>(nullptr), psink.data(),
                   t.lse ? t.lse + bh * sq + i0 : nullptr, q + off, k + koff,
                   seq_rule(a, bh / heads), i0, i1, skv, dh, rule, ext, f8.rows(hg, sq));
        // context rows (rows, Dv) = probs (rows, Skv) * v (Skv, Dv)
        context_rows(f8.rows(hg, sq), pr.data(), i1 - i0, skv, v + voff, d_v,
                     context + bh * sq * d_v + i0 * d_v, d_v);
      }
    });
  });
}

template <class Real>
void attention_backward_rows(const AttentionArgs<Real>& a, const AttentionBackward<Real>& t) {
  check_args(a, "attention_backward_rows", /*rows=*/true);
  require(t.dq && t.dk && t.dv && t.dcontext && t.q && t.k && t.v, a, "attention_backward_rows",
          "dq, dk, dv, dcontext, q, k and v");
  const Sizes z = sizes_of(a);  // (named: a lambda may not capture a structured binding)
  const index_t sq = z.sq, skv = z.skv, dh = z.dh, d_v = z.dv;
  const index_t batch = a.batch, heads = a.heads;
  Real *dq = t.dq, *dk = t.dk, *dv = t.dv;
  const Real *dcontext = t.dcontext, *q = t.q, *k = t.k, *v = t.v;
  const AttentionVariant<Real>& variant = a.variant;
  const Rules<Real> rules(variant, heads, dh, a.causal, a.scale);
  const Real alpha = rules.alpha();
  const Real beta = a.qkv_write == GradWrite::overwrite ? Real(0) : Real(1);
  const index_t rb = rows_per_block(sq, skv, a.block_rows), kv = rules.kv_heads();
  if (rules.sunk() && !variant.dsinks) {
    throw ShapeError("attention_backward_rows: sinks need dsinks");
  }
  std::vector<Real> sink_part = buffer<Real>(rules.sunk(), batch * heads);  // (B, H)
  detail::for_blocks(batch * kv, 1, [&](index_t bg0, index_t bg1) {
    std::vector<Real> sc(static_cast<std::size_t>(rb * skv));  // (rows, Skv)
    std::vector<Real> pr(static_cast<std::size_t>(rb * skv));  // (rows, Skv)
    std::vector<Real> dp(static_cast<std::size_t>(rb * skv));  // (rows, Skv)
    std::vector<Real> ds(static_cast<std::size_t>(rb * skv));  // (rows, Skv)
    std::vector<Real> raw = buffer<Real>(rules.capped(), rb * skv), dsr = raw;
    std::vector<Real> psink = buffer<Real>(rules.sunk(), rb);  // (rows)
    SinkRow<Real> ext(rules.sunk(), skv);
    Fp8Group<Real> f8;
    rules.each_head(bg0, bg1, [&](index_t bg, index_t hg, index_t h, index_t bh) {
      const index_t koff = bg * skv * dh, voff = bg * skv * d_v, off = bh * sq * dh;
      const HeadRule<Real> rule = rules(h);
      f8.start(hg, q + off, rules.group() * sq, k + koff, v + voff, skv, dh, d_v);
      Real dsink = 0;
      for (index_t i0 = 0; i0 < sq; i0 += rb) {
        const index_t i1 = std::min(sq, i0 + rb), rows = i1 - i0;
        // The first block of the group's first head starts dk and dv from beta; later ones
        // continue the same fused chains, so every element is the materialised product's chain.
        const Real b = hg == 0 && i0 == 0 ? beta : Real(1);
        const Real* dc = dcontext + bh * sq * d_v + i0 * d_v;  // (rows, Dv)
        score_rows(sc.data(), pr.data(), rule.capped ? raw.data() : nullptr, psink.data(),
                   static_cast<Real*>(nullptr), q + off, k + koff, seq_rule(a, bh / heads), i0, i1,
                   skv, dh, rule, ext, f8.rows(hg, sq));
        // dv (Skv, Dv) += probs^T (Skv, rows) * dcontext (rows, Dv)
        gemm<Real>(Trans::yes, Trans::no, skv, d_v, rows, Real(1), pr.data(), skv, dc, d_v, b,
                   dv + voff, d_v);
        const Real* dl = t.dlse ? t.dlse + bh * sq + i0 : nullptr;  // (rows)
        score_grad_rows(dp.data(), ds.data(), pr.data(), dc, d_v, v + voff,
                        static_cast<const std::uint8_t*>(nullptr), Real(1), rows, skv, d_v, dl);
        const Real* dsq = variant_grad_rows(dsr.data(), &dsink, ds.data(), dp.data(), pr.data(),
                                            raw.data(), psink.data(), rows, skv, rule, dl);
        // dq rows (rows, Dh) += alpha * dscores (rows, Skv) * k (Skv, Dh)
        gemm<Real>(Trans::no, Trans::no, rows, dh, skv, alpha, dsq, skv, k + koff, dh, beta,
                   dq + off + i0 * dh, dh);
        // dk (Skv, Dh) += alpha * dscores^T (Skv, rows) * q (rows, Dh)
        gemm<Real>(Trans::yes, Trans::no, skv, dh, rows, alpha, dsq, skv, q + off + i0 * dh, dh, b,
                   dk + koff, dh);
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
