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

// Number of keys visible from query i: keys [0, visible) are visible, the rest masked.
index_t visible_keys(index_t i, index_t length, bool causal) {
  return causal ? std::min(length, i + 1) : length;
}

template <class Real>
Real scale_of(std::optional<double> scale, index_t d_head) {
  return static_cast<Real>(scale ? *scale : 1.0 / std::sqrt(static_cast<double>(d_head)));
}

// Query rows [i0, i1) of head bh: scores (rows, S) = alpha q k^T with masked keys -inf, and probs
// (rows, S) their softmax, each rounded where it is stored under bf16 or fp16 emulation. The
// materialised and the row-blocked paths both compute every row here, so they agree bit for bit.
template <class Real>
void score_rows(Real* sc, Real* pr, const Real* qh, const Real* kh, index_t len, index_t i0,
                index_t i1, index_t seq_len, index_t d_head, bool causal, Real alpha) {
  const Real neg_inf = -std::numeric_limits<Real>::infinity();
  // scores (rows, S) = q (rows, Dh) * k^T (Dh, S) * alpha
  gemm<Real>(Trans::no, Trans::yes, i1 - i0, seq_len, d_head, alpha, qh + i0 * d_head, d_head, kh,
             d_head, Real(0), sc, seq_len);
  for (index_t i = i0; i < i1; ++i) {
    Real* srow = sc + (i - i0) * seq_len;
    const index_t nv = visible_keys(i, len, causal);
    for (index_t j = nv; j < seq_len; ++j) srow[j] = neg_inf;
    store_rows(srow, seq_len, "scores");
    softmax_forward(pr + (i - i0) * seq_len, srow, &nv, 1, seq_len);
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

// Query rows per block of the row-blocked path: about 2^20 score entries per buffer.
index_t rows_per_block(index_t seq_len, index_t block_rows) {
  if (block_rows > 0) return std::min(block_rows, std::max<index_t>(seq_len, 1));
  return std::clamp<index_t>((index_t{1} << 20) / std::max<index_t>(seq_len, 1), 1,
                             std::max<index_t>(seq_len, 1));
}

}  // namespace

template <class Real>
void attention_forward(Real* context, Real* scores, Real* probs, const Real* q, const Real* k,
                       const Real* v, const std::int64_t* lengths, const std::uint8_t* drop_mask,
                       Real drop_scale, index_t batch, index_t heads, index_t seq_len,
                       index_t d_head, bool causal, bool merged_context,
                       std::optional<double> scale) {
  const Real alpha = scale_of<Real>(scale, d_head);
  const index_t ss = seq_len * seq_len;
  // Each (batch, head) block is one task's: its scores, probs and context rows are its own.
  detail::for_blocks(batch * heads, 1, [&](index_t bh0, index_t bh1) {
    std::vector<Real> dropped(static_cast<std::size_t>(drop_mask ? ss : 0));  // (S, S)
    for (index_t bh = bh0; bh < bh1; ++bh) {
      const index_t len = lengths[bh / heads];
      const Real* qh = q + bh * seq_len * d_head;  // (S, Dh)
      const Real* kh = k + bh * seq_len * d_head;  // (S, Dh)
      const Real* vh = v + bh * seq_len * d_head;  // (S, Dh)
      Real* sc = scores + bh * ss;                 // (S, S)
      Real* pr = probs + bh * ss;                  // (S, S)
      score_rows(sc, pr, qh, kh, len, 0, seq_len, seq_len, d_head, causal, alpha);
      const Real* pv = pr;
      if (drop_mask) {
        const std::uint8_t* m = drop_mask + bh * ss;
        for (index_t j = 0; j < ss; ++j) dropped[j] = m[j] ? pr[j] * drop_scale : Real(0);
        pv = dropped.data();
      }
      // context (S, Dh) = dropout(probs) (S, S) * v (S, Dh); the strides change no value
      const auto [ch, ldc] = head_block(context, bh, heads, seq_len, d_head, merged_context);
      gemm<Real>(Trans::no, Trans::no, seq_len, d_head, seq_len, Real(1), pv, seq_len, vh, d_head,
                 Real(0), ch, ldc);
    }
  });
}

template <class Real>
void attention_backward(Real* dq, Real* dk, Real* dv, Real* dprobs, Real* dscores,
                        const Real* dcontext, const Real* q, const Real* k, const Real* v,
                        const Real* probs, const std::uint8_t* drop_mask, Real drop_scale,
                        index_t batch, index_t heads, index_t seq_len, index_t d_head,
                        bool merged_context, GradWrite qkv_write, std::optional<double> scale) {
  const Real alpha = scale_of<Real>(scale, d_head);
  const index_t ss = seq_len * seq_len;
  // Each head's dq, dk and dv are written by one product each: beta = 0 overwrites them.
  const Real beta = qkv_write == GradWrite::overwrite ? Real(0) : Real(1);
  detail::for_blocks(batch * heads, 1, [&](index_t bh0, index_t bh1) {
    std::vector<Real> dropped(static_cast<std::size_t>(drop_mask ? ss : 0));  // (S, S)
    for (index_t bh = bh0; bh < bh1; ++bh) {
      const index_t off = bh * seq_len * d_head;
      // this head's dcontext (S, Dh) and its row stride
      const auto [dc, ldc] = head_block(dcontext, bh, heads, seq_len, d_head, merged_context);
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
                 beta, dv + off, d_head);
      score_grad_rows(dp, ds, pr, dc, ldc, v + off, m, drop_scale, seq_len, seq_len, d_head);
      // in the forward pass this was: scores = alpha * q * k^T
      // dq (S, Dh) += alpha * dscores (S, S) * k (S, Dh)
      gemm<Real>(Trans::no, Trans::no, seq_len, d_head, seq_len, alpha, ds, seq_len, k + off,
                 d_head, beta, dq + off, d_head);
      // dk (S, Dh) += alpha * dscores^T (S, S) * q (S, Dh)
      gemm<Real>(Trans::yes, Trans::no, seq_len, d_head, seq_len, alpha, ds, seq_len, q + off,
                 d_head, beta, dk + off, d_head);
    }
  });
}

template <class Real>
void attention_forward_rows(Real* context, const Real* q, const Real* k, const Real* v,
                            const std::int64_t* lengths, index_t batch, index_t heads,
                            index_t seq_len, index_t d_head, bool causal,
                            std::optional<double> scale, index_t block_rows) {
  const Real alpha = scale_of<Real>(scale, d_head);
  const index_t rb = rows_per_block(seq_len, block_rows);
  detail::for_blocks(batch * heads, 1, [&](index_t bh0, index_t bh1) {
    std::vector<Real> sc(static_cast<std::size_t>(rb * seq_len));  // (rows, S)
    std::vector<Real> pr(static_cast<std::size_t>(rb * seq_len));  // (rows, S)
    for (index_t bh = bh0; bh < bh1; ++bh) {
      const index_t off = bh * seq_len * d_head;
      for (index_t i0 = 0; i0 < seq_len; i0 += rb) {
        const index_t i1 = std::min(seq_len, i0 + rb);
        score_rows(sc.data(), pr.data(), q + off, k + off, lengths[bh / heads], i0, i1, seq_len,
                   d_head, causal, alpha);
        // context rows (rows, Dh) = probs (rows, S) * v (S, Dh)
        gemm<Real>(Trans::no, Trans::no, i1 - i0, d_head, seq_len, Real(1), pr.data(), seq_len,
                   v + off, d_head, Real(0), context + off + i0 * d_head, d_head);
      }
    }
  });
}

template <class Real>
void attention_backward_rows(Real* dq, Real* dk, Real* dv, const Real* dcontext, const Real* q,
                             const Real* k, const Real* v, const std::int64_t* lengths,
                             index_t batch, index_t heads, index_t seq_len, index_t d_head,
                             bool causal, GradWrite qkv_write, std::optional<double> scale,
                             index_t block_rows) {
  const Real alpha = scale_of<Real>(scale, d_head);
  const Real beta = qkv_write == GradWrite::overwrite ? Real(0) : Real(1);
  const index_t rb = rows_per_block(seq_len, block_rows);
  detail::for_blocks(batch * heads, 1, [&](index_t bh0, index_t bh1) {
    std::vector<Real> sc(static_cast<std::size_t>(rb * seq_len));  // (rows, S)
    std::vector<Real> pr(static_cast<std::size_t>(rb * seq_len));  // (rows, S)
    std::vector<Real> dp(static_cast<std::size_t>(rb * seq_len));  // (rows, S)
    std::vector<Real> ds(static_cast<std::size_t>(rb * seq_len));  // (rows, S)
    for (index_t bh = bh0; bh < bh1; ++bh) {
      const index_t off = bh * seq_len * d_head;
      for (index_t i0 = 0; i0 < seq_len; i0 += rb) {
        const index_t i1 = std::min(seq_len, i0 + rb), rows = i1 - i0;
        // The first block starts dk and dv from beta; later ones continue the same fused chains
        // over the query rows, so every element is the materialised product's chain.
        const Real b = i0 == 0 ? beta : Real(1);
        const Real* dc = dcontext + off + i0 * d_head;  // (rows, Dh)
        score_rows(sc.data(), pr.data(), q + off, k + off, lengths[bh / heads], i0, i1, seq_len,
                   d_head, causal, alpha);
        // dv (S, Dh) += probs^T (S, rows) * dcontext (rows, Dh)
        gemm<Real>(Trans::yes, Trans::no, seq_len, d_head, rows, Real(1), pr.data(), seq_len, dc,
                   d_head, b, dv + off, d_head);
        score_grad_rows(dp.data(), ds.data(), pr.data(), dc, d_head, v + off,
                        static_cast<const std::uint8_t*>(nullptr), Real(1), rows, seq_len, d_head);
        // dq rows (rows, Dh) += alpha * dscores (rows, S) * k (S, Dh)
        gemm<Real>(Trans::no, Trans::no, rows, d_head, seq_len, alpha, ds.data(), seq_len, k + off,
                   d_head, beta, dq + off + i0 * d_head, d_head);
        // dk (S, Dh) += alpha * dscores^T (S, rows) * q (rows, Dh)
        gemm<Real>(Trans::yes, Trans::no, seq_len, d_head, rows, alpha, ds.data(), seq_len,
                   q + off + i0 * d_head, d_head, b, dk + off, d_head);
      }
    }
  });
}

#define TEO_INSTANTIATE(Real)                                                                      \
  template void split_heads<Real>(Real*, const Real*, index_t, index_t, index_t, index_t, index_t, \
                                  const Real*);                                                    \
  template void merge_heads<Real>(Real*, const Real*, index_t, index_t, index_t, index_t,          \
                                  index_t);                                                        \
  template void attention_forward<Real>(Real*, Real*, Real*, const Real*, const Real*,             \
                                        const Real*, const std::int64_t*, const std::uint8_t*,     \
                                        Real, index_t, index_t, index_t, index_t, bool, bool,      \
                                        std::optional<double>);                                    \
  template void attention_backward<Real>(Real*, Real*, Real*, Real*, Real*, const Real*,           \
                                         const Real*, const Real*, const Real*, const Real*,       \
                                         const std::uint8_t*, Real, index_t, index_t, index_t,     \
                                         index_t, bool, GradWrite, std::optional<double>);         \
  template void attention_forward_rows<Real>(Real*, const Real*, const Real*, const Real*,         \
                                             const std::int64_t*, index_t, index_t, index_t,       \
                                             index_t, bool, std::optional<double>, index_t);       \
  template void attention_backward_rows<Real>(Real*, Real*, Real*, const Real*, const Real*,       \
                                              const Real*, const Real*, const std::int64_t*,       \
                                              index_t, index_t, index_t, index_t, bool, GradWrite, \
                                              std::optional<double>, index_t);
TEO_INSTANTIATE(float)
TEO_INSTANTIATE(double)

}  // namespace teo
