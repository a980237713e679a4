// Internal: what model.cpp (forward, backward) and params.cpp (parameters, validation) share.
#pragma once

#include <cmath>
#include <string>

#include "teo/config.hpp"
#include "teo/layers/attention.hpp"
#include "teo/layers/rope.hpp"
#include "teo/model.hpp"
#include "teo/tensor.hpp"

namespace teo::detail {

// The shape of parameter `name` (a contract name such as "layers.0.fc1.weight") under `c`.
Shape param_shape(const ModelConfig& c, const std::string& name);

// The attention variant of cfg (docs/semantics.md section 14): its K/V heads, window, soft-cap and
// ALiBi, with the sinks (H) and where their gradient goes (null unless attn_sinks).
template <class Real>
AttentionVariant<Real> attention_variant(const ModelConfig& cfg, const Real* sinks,
                                         Real* dsinks = nullptr) {
  AttentionVariant<Real> v;
  v.kv_heads = cfg.kv_heads();
  v.window = cfg.attention.sliding_window;
  v.softcap = cfg.attention.attn_logit_softcap;
  if (cfg.embeddings.positional == Positional::alibi)
    v.alibi_max_bias = cfg.attention.alibi_max_bias;
  if (cfg.attention.attn_sinks) {
    v.sinks = sinks;
    v.dsinks = dsinks;
  }
  return v;
}

// The attention call of cfg's layer on a batch of `batch` sequences of seq_len with these lengths:
// its sizes, mask, variant and default scale; the caller sets the path's options.
template <class Real>
AttentionArgs<Real> attention_args(const ModelConfig& cfg, index_t batch, index_t seq_len,
                                   const std::int64_t* lengths, const Real* sinks,
                                   Real* dsinks = nullptr) {
  AttentionArgs<Real> a;
  a.batch = batch;
  a.heads = cfg.attention.num_heads;
  a.seq_len = seq_len;
  a.d_head = cfg.d_head();
  a.d_head_v = cfg.v_head();
  // DeepSeek's YaRN score factor (semantics 14.12); unset otherwise, the plain 1 / sqrt(Dh)
  if (const double m = attention_mscale(cfg); m != 1.0)
    a.scale = 1.0 / std::sqrt(static_cast<double>(cfg.d_head())) * m;
  a.lengths = lengths;
  a.causal = cfg.attention.causal;
  a.variant = attention_variant(cfg, sinks, dsinks);
  return a;
}

// An encoder_decoder's decoder side (seq2seq.cpp), after the encoder: forward from the memory (the
// encoder's output) to acts' decoder.* activations, lm_logits, lm_probs and the loss (lm_logits
// and lm_probs allocated by the caller); backward from acts.loss to the decoder's gradients,
// dacts' decoder.* and lm_logits (zero-filled by the caller), adding the memory's gradient into
// dmemory (B, S, D).
template <class Real>
void seq2seq_forward(const Params<Real>& params, const Batch& batch, Activations<Real>& acts,
                     const Tensor<Real>& memory);
template <class Real>
void seq2seq_backward(const Params<Real>& params, const Batch& batch, const Activations<Real>& acts,
                      const Tensor<Real>& memory, Params<Real>& grads, Activations<Real>& dacts,
                      Real* dmemory);

}  // namespace teo::detail
