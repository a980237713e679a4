// An encoder_decoder's decoder side (docs/semantics.md, section 17.5), forward and backward: the
// target's embedding and positions, the decoder layers over the encoder's output (the memory),
// the decoder's final norm, the LM head and the next-token loss over the target.
#include <cmath>

#include "model/model_internal.hpp"
#include "model/pass.hpp"
#include "teo/layers/cross_entropy.hpp"
#include "teo/layers/embedding.hpp"
#include "teo/layers/linear.hpp"
#include "teo/layers/positional.hpp"
#include "teo/model.hpp"

namespace teo::detail {

namespace {

// The target's embedding matrix (Vt, D): the decoder's own, or the encoder's (shared).
template <class Real>
const Tensor<Real>& target_embedding(const Params<Real>& p) {
  return p.config.embeddings.decoder_vocab_size ? p.decoder_embedding_weight : p.embedding_weight;
}

template <class Real>
Tensor<Real>& target_embedding_grad(Params<Real>& g) {
  return g.config.embeddings.decoder_vocab_size ? g.decoder_embedding_weight : g.embedding_weight;
}

// The LM head's weight (Vt, D): its own, or the target's embedding matrix when tied.
template <class Real>
const Tensor<Real>& head_weight(const Params<Real>& p) {
  return p.config.head.tie_embeddings ? target_embedding(p) : p.lm_head_weight;
}

// The decoder's layers all take the memory's lengths (the source padding mask).
ModelConfig decoder_config(const ModelConfig& cfg) {
  ModelConfig c = cfg;
  c.attention.causal = true;  // the decoder's self-attention is masked, whatever the encoder's
  return c;
}

}  // namespace

template <class Real>
void seq2seq_forward(const Params<Real>& params, const Batch& batch, Activations<Real>& acts,
                     const Tensor<Real>& memory) {
  const ModelConfig& cfg = params.config;
  const ModelConfig dcfg = decoder_config(cfg);
  const index_t B = batch.batch, T = batch.tgt_len, D = cfg.d_model, N = B * T;
  const index_t V = cfg.target_vocab();
  const Real scale =
      cfg.embeddings.embed_scale ? static_cast<Real>(std::sqrt(static_cast<double>(D))) : Real(1);
  acts.decoder_embedding = Tensor<Real>::for_overwrite({B, T, D});
  acts.decoder_positional = Tensor<Real>({T, D});
  acts.decoder_input = Tensor<Real>::for_overwrite({B, T, D});
  embedding_forward(acts.decoder_embedding.data(), batch.tgt_tokens.data(),
                    target_embedding(params).data(), N, D, scale);
  if (cfg.dec_positional() == Positional::sinusoidal) {
    sinusoidal_table(acts.decoder_positional.data(), T, D, cfg.embeddings.position_offset);
  } else if (cfg.dec_positional() == Positional::learned) {
    copy(acts.decoder_positional.data(),
         params.decoder_pos_embedding_weight.data() + cfg.embeddings.position_offset * D, T * D);
  }
  add_positional_forward(acts.decoder_input.data(), acts.decoder_embedding.data(),
                         acts.decoder_positional.data(), B, T, D);
  acts.decoder_layers.resize(params.decoder_layers.size());
  const Tensor<Real>* x = &acts.decoder_input;
  for (std::size_t i = 0; i < params.decoder_layers.size(); ++i) {
    decoder_layer_forward(dcfg, params.decoder_layers[i], *x, batch.tgt_lengths, memory,
                          batch.lengths, acts.decoder_layers[i]);
    x = &acts.decoder_layers[i].output;
  }
  if (cfg.norms.norm_first) {
    acts.decoder_final_norm = Tensor<Real>::for_overwrite({B, T, D});
    acts.decoder_final_norm_mean = Tensor<Real>({N});
    acts.decoder_final_norm_rstd = Tensor<Real>({N});
    if (N > 0)
      norm_forward(cfg, acts.decoder_final_norm.data(), acts.decoder_final_norm_mean.data(),
                   acts.decoder_final_norm_rstd.data(), x->data(),
                   params.decoder_final_norm_weight.data(),
                   data_or_null(params.decoder_final_norm_bias), N, D);
    x = &acts.decoder_final_norm;
  } else {
    acts.decoder_final_norm = acts.decoder_final_norm_mean = acts.decoder_final_norm_rstd =
        Tensor<Real>();
  }
  // lm_logits = top W^T + b; the loss: each target position against the next target token
  linear_forward(acts.lm_logits.data(), x->data(), head_weight(params).data(),
                 data_or_null(params.lm_head_bias), N, D, V);
  const auto targets = next_token_targets(batch.tgt_tokens.data(), batch.tgt_lengths.data(), B, T);
  acts.loss[0] = cross_entropy_forward(acts.lm_probs.data(), acts.lm_logits.data(), targets.data(),
                                       N, V, static_cast<Real>(cfg.head.label_smoothing));
}

template <class Real>
void seq2seq_backward(const Params<Real>& params, const Batch& batch, const Activations<Real>& acts,
                      const Tensor<Real>& memory, Params<Real>& grads, Activations<Real>& dacts,
                      Real* dmemory) {
  const ModelConfig& cfg = params.config;
  const ModelConfig dcfg = decoder_config(cfg);
  const index_t B = batch.batch, T = batch.tgt_len, D = cfg.d_model, N = B * T;
  const index_t V = cfg.target_vocab();
  const auto targets = next_token_targets(batch.tgt_tokens.data(), batch.tgt_lengths.data(), B, T);
  cross_entropy_backward(dacts.lm_logits.data(), acts.lm_probs.data(), targets.data(), N, V,
                         static_cast<Real>(cfg.head.label_smoothing), dacts.loss[0]);
  const std::size_t L = params.decoder_layers.size();
  const Tensor<Real>& last = L > 0 ? acts.decoder_layers.back().output : acts.decoder_input;
  // the gradient of the head's input: the final norm's output (pre-norm) or the last layer's
  Tensor<Real> dtop({B, T, D});
  // a tied head's weight gradient goes into the target embedding's, before its lookup's
  Real* dw =
      cfg.head.tie_embeddings ? target_embedding_grad(grads).data() : grads.lm_head_weight.data();
  linear_backward(dtop.data(), dw, data_or_null(grads.lm_head_bias), dacts.lm_logits.data(),
                  cfg.norms.norm_first ? acts.decoder_final_norm.data() : last.data(),
                  head_weight(params).data(), N, D, V, GradWrite::overwrite);
  Tensor<Real> dy;
  if (cfg.norms.norm_first) {
    dy = Tensor<Real>({B, T, D});
    if (N > 0)
      norm_backward(cfg, dy.data(), grads.decoder_final_norm_weight.data(),
                    data_or_null(grads.decoder_final_norm_bias), dtop.data(), last.data(),
                    params.decoder_final_norm_weight.data(), acts.decoder_final_norm_mean.data(),
                    acts.decoder_final_norm_rstd.data(), N, D, GradWrite::overwrite);
    dacts.decoder_final_norm = std::move(dtop);
  } else {
    dacts.decoder_final_norm = Tensor<Real>();
    dy = std::move(dtop);
  }
  // the layers, last to first: each gives its input's gradient and adds its memory's
  dacts.decoder_layers.assign(L, DecoderLayerActs<Real>());
  for (std::size_t i = L; i-- > 0;) {
    const Tensor<Real>& x = i > 0 ? acts.decoder_layers[i - 1].output : acts.decoder_input;
    Tensor<Real> dx, dmem;
    decoder_layer_backward(dcfg, params.decoder_layers[i], x, batch.tgt_lengths, memory,
                           batch.lengths, acts.decoder_layers[i], dy, dx, dmem,
                           grads.decoder_layers[i]);
    if (dmem.numel() > 0) add(dmemory, dmem.data(), dmem.numel());
    dacts.decoder_layers[i].output = std::move(dy);
    dy = std::move(dx);
  }
  // input = embedding + positional
  dacts.decoder_input = dy;
  dacts.decoder_embedding = std::move(dy);
  dacts.decoder_positional = Tensor<Real>({T, D});
  add_positional_backward(dacts.decoder_positional.data(), dacts.decoder_embedding.data(), B, T, D);
  if (cfg.dec_positional() == Positional::learned) {
    add(grads.decoder_pos_embedding_weight.data() + cfg.embeddings.position_offset * D,
        dacts.decoder_positional.data(), T * D);
  }
  const Real scale =
      cfg.embeddings.embed_scale ? static_cast<Real>(std::sqrt(static_cast<double>(D))) : Real(1);
  embedding_backward(target_embedding_grad(grads).data(), dacts.decoder_embedding.data(),
                     batch.tgt_tokens.data(), N, D, scale);
}

#define TEO_INSTANTIATE(Real)                                                                \
  template void seq2seq_forward<Real>(const Params<Real>&, const Batch&, Activations<Real>&, \
                                      const Tensor<Real>&);                                  \
  template void seq2seq_backward<Real>(const Params<Real>&, const Batch&,                    \
                                       const Activations<Real>&, const Tensor<Real>&,        \
                                       Params<Real>&, Activations<Real>&, Real*);
TEO_INSTANTIATE(float)
TEO_INSTANTIATE(double)
#undef TEO_INSTANTIATE

}  // namespace teo::detail
