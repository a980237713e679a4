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
  std::optional<index_t> window{};
  // c > 0: each scaled score s becomes c tanh(s / c), before the bias and the mask.
  std::optional<double> softcap{};
  // ALiBi with this maximum bias: head h adds -slope_h (i - j) (causal) or -slope_h |i - j|.
  std::optional<double> alibi_max_bias{};
  // (H) learned sink logits: probs = softmax([scores, sink]) without the sink's column.
  const Real* sinks = nullptr;
  // (H), backward only: the sinks' gradient is accumulated here (required when sinks is set).
  Real* dsinks = nullptr;
};

// ALiBi's slopes for `heads` heads (Press et al.), in float64: with m = 2^floor(log2 heads), head
// h < m gets 2^(-max_bias (h + 1) / m) and head m + k gets 2^(-max_bias (2k + 1) / (2m)).
std::vector<double> alibi_slopes(index_t heads, double max_bias);

// Where a causal mask's diagonal lies when a sequence has fewer queries than keys
// (docs/semantics.md, "Queries and keys of different lengths"): bottom-right puts the last query on
// the last key (FlashAttention 2.1 and later, decode and chunked prefill), top-left the first on
// the first (PyTorch's is_causal). They agree when a sequence has as many queries as keys.
enum class CausalAlign { bottom_right, top_left };

// What an attention call is: its sizes, mask, scale, variant and options, field by field, so that
// no two of them can be swapped. Sequence b has Lq = lengths[b] queries and Lk = kv_lengths[b]
// keys; query i sits at position p = i + (Lk - Lq) (bottom-right) or p = i (top-left). Key j is
// visible from it iff j < Lk and (!causal or j <= p) (and within the variant's window of p, whose
// ALiBi distance is p - j). With kv_lengths null, Lk = Lq and p = i: the encoder's attention.
// The rows of k and v past Lk enter the products with weight 0, so they must be finite (the op
// cases zero them first, so that an uninitialised buffer's NaN reaches no result).
template <class Real>
struct AttentionArgs {
  index_t batch = 0;                      // B
  index_t heads = 0;                      // H, query heads (the variant's kv_heads gives Hkv)
  index_t seq_len = 0;                    // S, the query rows Sq
  index_t d_head = 0;                     // Dh, of q and k
  const std::int64_t* lengths = nullptr;  // (B); required
  // The key rows Skv (unset: seq_len), the keys of each sequence (B) (null: lengths), and the
  // value head size Dv (0: d_head): k is (B, Hkv, Skv, Dh), v (B, Hkv, Skv, Dv), context
  // (B, H, Sq, Dv), scores and probs (B, H, Sq, Skv).
  std::optional<index_t> kv_len{};
  const std::int64_t* kv_lengths = nullptr;
  index_t d_head_v = 0;
  CausalAlign causal_align = CausalAlign::bottom_right;
  bool causal = false;
  // The score scale: 1 / sqrt(Dh) unless given, computed in double and rounded to Real.
  std::optional<double> scale{};
  AttentionVariant<Real> variant{};
  // The materialised path only: dropout on probs, (B, H, S, S) with 1 = kept, or null for none;
  // a kept probability is multiplied by drop_scale.
  const std::uint8_t* drop_mask = nullptr;
  Real drop_scale = 1;
  // The materialised path only: context and dcontext are (B, S, H * Dh), heads merged as the
  // output projection reads them (the same values, without a separate merge_heads pass).
  bool merged_context = false;
  // The row-blocked path only: query rows per block (0: about 2^20 score entries per block).
  index_t block_rows = 0;
  // Backward: dq, dk, dv accumulated, or overwritten without being read (the bits of accumulating
  // into zeros).
  GradWrite qkv_write = GradWrite::accumulate;
};

// The tensors of a forward call: outputs, then inputs. q (B, H, Sq, Dh); k (B, Hkv, Skv, Dh);
// v (B, Hkv, Skv, Dv); context (B, H, Sq, Dv) (or merged, above); scores and probs
// (B, H, Sq, Skv), the materialised path's.
template <class Real>
struct AttentionForward {
  Real* context = nullptr;
  Real* scores = nullptr;
  Real* probs = nullptr;
  // (B, H, Sq), optional on either path: each row's log-sum-exp of its final logits (the sink's
  // included), log of the softmax's denominator, so that probs = exp(scores - lse); -inf for a
  // row with nothing visible.
  Real* lse = nullptr;
  const Real* q = nullptr;
  const Real* k = nullptr;
  const Real* v = nullptr;
};

// The tensors of a backward call: the gradients written, then what it reads. dq like q; dk, dv like
// k; dprobs, dscores (B, H, S, S) and probs are the materialised path's.
template <class Real>
struct AttentionBackward {
  Real* dq = nullptr;
  Real* dk = nullptr;
  Real* dv = nullptr;
  Real* dprobs = nullptr;
  Real* dscores = nullptr;
  const Real* dcontext = nullptr;
  const Real* q = nullptr;
  const Real* k = nullptr;
  const Real* v = nullptr;
  const Real* probs = nullptr;
  // (B, H, Sq), or null: the upstream gradient of the forward's lse (a split-KV kernel's backward
  // through its merge). Its derivative is each row's probabilities (and the sink's share): it
  // adds probs * dlse to dscores.
  const Real* dlse = nullptr;
};

//   scores = scale q k^T, soft-capped and biased by the variant, on visible keys; -inf elsewhere;
//   probs  = softmax over keys (and the sink); a row with no visible key is all 0 (never NaN);
//   context = dropout(probs) v.
// ShapeError for arguments that do not fit together (a missing tensor, kv_heads that do not divide
// heads, a non-finite variant parameter), before anything is written.
template <class Real>
void attention_forward(const AttentionArgs<Real>& a, const AttentionForward<Real>& t);

// Accumulates (or overwrites, a.qkv_write) dq, dk, dv. dprobs and dscores are overwritten with the
// gradients of the loss with respect to probs (before dropout) and scores. dscores is exactly 0 at
// every masked position, so dq, dk, dv receive exactly 0 through masked entries; dprobs there is
// the formal derivative dcontext . v (times the dropout factor), which the softmax then discards.
// The mask is carried by probs, whose masked entries are exactly 0; with a soft-cap or sinks, each
// head's scores are recomputed from q and k (with the lengths and causal flag): dscores stays the
// gradient of the final logits, the cap's derivative 1 - tanh^2 applies on the way to q and k.
// With sinks, their gradient is accumulated into a.variant.dsinks (required then).
template <class Real>
void attention_backward(const AttentionArgs<Real>& a, const AttentionBackward<Real>& t);

// The row-blocked path for long sequences, without dropout (a.drop_mask must be null) and with
// context (B, H, S, Dh) (a.merged_context false): the same values as attention_forward and
// attention_backward, computed a.block_rows query rows at a time, so that (B, H, S, S) is never
// held; per task it holds four (block_rows, S) buffers, and scores, probs, dprobs and dscores are
// not used. Backward recomputes the scores and probabilities of each block from q and k. On the
// simd backend the results are bitwise those of the materialised functions for any block_rows
// (every GEMM element is one fused chain over k; dk and dv continue their chains across blocks);
// the reference and blas backends sum in another order across blocks.
template <class Real>
void attention_forward_rows(const AttentionArgs<Real>& a, const AttentionForward<Real>& t);
template <class Real>
void attention_backward_rows(const AttentionArgs<Real>& a, const AttentionBackward<Real>& t);

}  // namespace teo
