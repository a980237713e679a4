// Scaled dot-product attention over heads, with key-padding and causal masks.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "teo/errors.hpp"
#include "teo/kernels.hpp"

namespace teo {

// (B, S, H * Dh) -> (B, H, S, Dh) and back. out and in must not alias. row_stride is the distance
// between consecutive (b, s) rows of the (B, S, H * Dh) side (0: H * Dh), so that q, k and v can
// be read from, or written into, one (B, S, 3 D) buffer. Splitting adds bias (H * Dh) when it is
// not null, as linear_forward would have (out = in + bias, rounded once), in the same pass.
template <class Real>
void split_heads(Real* out, const Real* in, index_t batch, index_t seq_len, index_t heads,
                 index_t d_head, index_t row_stride = 0, const Real* bias = nullptr);
template <class Real>
void merge_heads(Real* out, const Real* in, index_t batch, index_t seq_len, index_t heads,
                 index_t d_head, index_t row_stride = 0);

// The attention variants (docs/semantics.md, "Attention variants"). The defaults are the plain
// layer, with the plain layer's bits.
template <class Real>
struct AttentionVariant {
  // K/V heads (0: one per query head); must divide heads. Query head h reads K/V head
  // h / (heads / kv_heads): contiguous groups. k, v, dk and dv are (B, kv_heads, S, Dh).
  index_t kv_heads = 0;
  // W >= 1: causal, key j is visible from query i iff i - j < W as well; otherwise iff |i - j| < W.
  std::optional<index_t> window;
  // c > 0: each scaled score s becomes c tanh(s / c), before the bias and the mask.
  std::optional<double> softcap;
  // ALiBi with this maximum bias: head h adds -slope_h (i - j) (causal) or -slope_h |i - j|.
  std::optional<double> alibi_max_bias;
  // (H) learned sink logits: probs = softmax([scores, sink]) without the sink's column.
  const Real* sinks = nullptr;
  // (H), backward only: the sinks' gradient is accumulated here (required when sinks is set).
  Real* dsinks = nullptr;
};

// ALiBi's slopes for `heads` heads (Press et al.), in float64: with m = 2^floor(log2 heads), head
// h < m gets 2^(-max_bias (h + 1) / m) and head m + k gets 2^(-max_bias (2k + 1) / (2m)).
std::vector<double> alibi_slopes(index_t heads, double max_bias);

// Key j is visible from query i of sequence b iff j < lengths[b] and (!causal or j <= i) (and
// within the variant's window).
//   scores = scale q k^T, soft-capped and biased by the variant, on visible keys; -inf elsewhere
//            (scale: 1 / sqrt(Dh) unless given, computed in double and rounded to Real);
//   probs  = softmax over keys (and the sink); a row with no visible key is all 0 (never NaN);
//   context = dropout(probs) v.
// context (B, H, S, Dh), or (B, S, H * Dh) with merged_context (heads merged, as the output
// projection reads it: the same values, written in place of a separate merge_heads pass); scores,
// probs (B, H, S, S); q, k, v (B, H, S, Dh); lengths (B); drop_mask (B, H, S, S) or null when no
// dropout.
template <class Real>
void attention_forward(Real* context, Real* scores, Real* probs, const Real* q, const Real* k,
                       const Real* v, const std::int64_t* lengths, const std::uint8_t* drop_mask,
                       Real drop_scale, index_t batch, index_t heads, index_t seq_len,
                       index_t d_head, bool causal, bool merged_context = false,
                       std::optional<double> scale = std::nullopt,
                       const AttentionVariant<Real>& variant = {});

// Accumulates dq, dk, dv (B, H, S, Dh). dprobs and dscores (B, H, S, S) are overwritten with the
// gradients of the loss with respect to probs (before dropout) and scores. dscores is exactly 0 at
// every masked position, so dq, dk, dv receive exactly 0 through masked entries; dprobs there is
// the formal derivative dcontext . v (times the dropout factor), which the softmax then discards.
// The mask needs no lengths here: it is carried by probs, whose masked entries are exactly 0. With
// a soft-cap or sinks, each head's scores are recomputed from q and k (so `causal` and `lengths`
// are needed then; they are ignored otherwise): dscores stays the gradient of the final logits,
// the cap's derivative 1 - tanh^2 applies on the way to q and k.
// dcontext is (B, H, S, Dh), or (B, S, H * Dh) with merged_context. With qkv_write == overwrite,
// dq, dk and dv are written without being read (the bits of accumulating into zeros).
template <class Real>
void attention_backward(Real* dq, Real* dk, Real* dv, Real* dprobs, Real* dscores,
                        const Real* dcontext, const Real* q, const Real* k, const Real* v,
                        const Real* probs, const std::uint8_t* drop_mask, Real drop_scale,
                        index_t batch, index_t heads, index_t seq_len, index_t d_head,
                        bool merged_context = false, GradWrite qkv_write = GradWrite::accumulate,
                        std::optional<double> scale = std::nullopt,
                        const AttentionVariant<Real>& variant = {},
                        const std::int64_t* lengths = nullptr, bool causal = false);

// The row-blocked path for long sequences, without dropout: the same values as
// attention_forward and attention_backward, computed `block_rows` query rows at a time (0: about
// 2^20 score entries per block), so that (B, H, S, S) is never held; per task it holds four
// (block_rows, S) buffers. context, dcontext, dq, dk, dv are (B, H, S, Dh). Backward recomputes
// the scores and probabilities of each block from q and k. On the simd backend the results are
// bitwise those of the materialised functions for any block_rows (every GEMM element is one fused
// chain over k; dk and dv continue their chains across blocks); the reference and blas backends
// sum in another order across blocks.
template <class Real>
void attention_forward_rows(Real* context, const Real* q, const Real* k, const Real* v,
                            const std::int64_t* lengths, index_t batch, index_t heads,
                            index_t seq_len, index_t d_head, bool causal,
                            std::optional<double> scale = std::nullopt, index_t block_rows = 0,
                            const AttentionVariant<Real>& variant = {});
template <class Real>
void attention_backward_rows(Real* dq, Real* dk, Real* dv, const Real* dcontext, const Real* q,
                             const Real* k, const Real* v, const std::int64_t* lengths,
                             index_t batch, index_t heads, index_t seq_len, index_t d_head,
                             bool causal, GradWrite qkv_write = GradWrite::accumulate,
                             std::optional<double> scale = std::nullopt, index_t block_rows = 0,
                             const AttentionVariant<Real>& variant = {});

}  // namespace teo
