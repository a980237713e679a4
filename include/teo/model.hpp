// The whole encoder: parameters, the activations forward keeps, forward() and backward().
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "teo/config.hpp"
#include "teo/decoder_layer.hpp"
#include "teo/fp8.hpp"
#include "teo/layers/shared_experts.hpp"
#include "teo/tensor.hpp"

namespace teo {

// Token ids (B, S), one length per sequence (B) and one label per sequence (B). Positions
// s >= lengths[b] are padding: their ids must still be valid, but they influence no real output.
// A decoder reads no labels: position t's target is token t + 1 of its sequence.
struct Batch {
  index_t batch = 0;
  index_t seq_len = 0;
  std::vector<std::int64_t> tokens;   // (B, S); an encoder_decoder's source
  std::vector<std::int64_t> lengths;  // (B)
  std::vector<std::int64_t> labels;   // (B)
  // (B, S), each in [0, type_vocab_size): with type_vocab_size only, else empty
  std::vector<std::int64_t> token_types;
  // input patches: the images (B, channels, image_size, image_size), in place of tokens (which
  // stay empty); every length is seq_len = 1 + patches
  std::vector<double> pixels;
  // An encoder_decoder's target (teacher forcing): tgt_tokens (B, T), tgt_lengths (B); position t
  // predicts target token t + 1. Empty (T = 0) for the other architectures.
  index_t tgt_len = 0;
  std::vector<std::int64_t> tgt_tokens;
  std::vector<std::int64_t> tgt_lengths;

  // A batch whose tokens and labels (none for a decoder) are drawn from `seed` with the
  // counter-based generator; lengths default to seq_len.
  static Batch random(const ModelConfig& cfg, index_t batch, index_t seq_len, std::uint64_t seed,
                      std::vector<std::int64_t> lengths = {});
  // An encoder_decoder's: sources of seq_len tokens (ids in [0, vocab_size)) and targets of
  // tgt_len (ids in [0, target_vocab())), each with its lengths (default: full).
  static Batch random_seq2seq(const ModelConfig& cfg, index_t batch, index_t seq_len,
                              index_t tgt_len, std::uint64_t seed,
                              std::vector<std::int64_t> lengths = {},
                              std::vector<std::int64_t> tgt_lengths = {});
};

// Checks every size against the config (ShapeError) and every id and label (InputError), before
// anything is allocated. forward() and backward() call it first.
void validate_batch(const ModelConfig& cfg, const Batch& batch, std::size_t real_size);

template <class Real>
struct LayerParams {
  Tensor<Real> q_weight, q_bias, o_weight, o_bias;  // (D, D), (D)
  Tensor<Real> k_weight, k_bias, v_weight, v_bias;  // (Hkv Dh, D), (Hkv Dh)
  Tensor<Real> sinks;                               // (H); attn_sinks only
  Tensor<Real> q_norm_weight, k_norm_weight;        // (Dh); qk_norm only
  // Multi-head latent attention's (kv_lora_rank; docs/semantics.md, 14.12), in place of k's and
  // v's: q_a (Rq, D), its RMSNorm (Rq) and q_b (H Dh, Rq) with q_lora_rank (without it q_weight
  // (H Dh, D)); kv_a (Rkv + Dr, D), its RMSNorm (Rkv) and kv_b (H (Dn + Dv), Rkv).
  Tensor<Real> q_a_weight, q_a_norm_weight, q_b_weight;
  Tensor<Real> kv_a_weight, kv_norm_weight, kv_b_weight;
  Tensor<Real> norm1_weight, norm1_bias, norm2_weight, norm2_bias;  // (D)
  Tensor<Real> gate_weight, gate_bias;                              // (F, D), (F); gated only
  Tensor<Real> fc1_weight, fc1_bias;                                // (F, D), (F)
  Tensor<Real> fc2_weight, fc2_bias;                                // (D, F), (D)
  // An MoE layer's, in place of the FFN's (docs/semantics.md, section 19): the router's gate
  // (E, D), its bias (E; router_bias) and DeepSeek-V3's selection bias (E; selection_bias), which
  // gets no gradient; the experts' (E, Fe, D), (E, Fe, D), (E, D, Fe) and biases (E, Fe), (E, Fe),
  // (E, D) (expert_bias); the shared experts' SwiGLU (Fs, D), (Fs, D), (D, Fs) and their sigmoid
  // gate (1, D) (shared_expert_gate).
  Tensor<Real> router_weight, router_bias, router_correction;
  Tensor<Real> experts_w_gate, experts_w_up, experts_w_down;
  Tensor<Real> experts_b_gate, experts_b_up, experts_b_down;
  Tensor<Real> shared_gate_weight, shared_fc1_weight, shared_fc2_weight, shared_expert_gate;
  // Which parameters are present: the config's attn_sinks, attn_bias (and attn_out_bias), norm
  // (layernorm: the norms have biases), ffn (gated: the gate) and ffn_bias; for an MoE layer (moe)
  // the MoE keys. A bias that is absent stays empty.
  bool has_sinks = false;
  bool has_qk_norm = false;
  bool has_mla = false, has_q_lora = false;
  bool has_attn_bias = true;
  bool has_out_bias = true;  // attn.o.bias: attn_bias unless attn_out_bias says otherwise
  bool has_norm_bias = true;
  bool gated = false;
  bool has_ffn_bias = true;
  bool moe = false;
  bool has_router_bias = false, has_correction = false, has_expert_bias = false;
  bool has_shared = false, has_shared_gate = false;

  // Sets the presence flags from a config, for its layer `layer` (which decides whether the FFN
  // is a mixture of experts).
  void configure(const ModelConfig& c, index_t layer) {
    has_sinks = c.attention.attn_sinks;
    has_qk_norm = c.attention.qk_norm;
    has_mla = c.attention.mla();
    has_q_lora = has_mla && c.attention.q_lora_rank.has_value();
    has_attn_bias = c.attention.attn_bias;
    has_out_bias = c.attention.out_bias();
    has_norm_bias = c.norms.norm == Norm::layernorm;
    gated = c.gated();
    has_ffn_bias = c.ffn.ffn_bias;
    moe = c.moe_layer(layer);
    const MoeConfig& m = c.ffn.moe;
    has_router_bias = moe && m.router_bias;
    has_correction = moe && m.selection_bias;
    has_expert_bias = moe && m.expert_bias;
    has_shared = moe && m.shared_d_ff > 0;
    has_shared_gate = has_shared && m.shared_expert_gate;
  }
  // Whether the flags are those of c's layer `layer`.
  bool configured_for(const ModelConfig& c, index_t layer) const {
    LayerParams<Real> want;
    want.configure(c, layer);
    return has_sinks == want.has_sinks && has_qk_norm == want.has_qk_norm &&
           has_mla == want.has_mla && has_q_lora == want.has_q_lora &&
           has_attn_bias == want.has_attn_bias && has_out_bias == want.has_out_bias &&
           has_norm_bias == want.has_norm_bias && gated == want.gated &&
           has_ffn_bias == want.has_ffn_bias && moe == want.moe &&
           has_router_bias == want.has_router_bias && has_correction == want.has_correction &&
           has_expert_bias == want.has_expert_bias && has_shared == want.has_shared &&
           has_shared_gate == want.has_shared_gate;
  }

  // Calls f(name, tensor) for every parameter, named as in the model without "layers.{i}.".
  template <class F>
  void visit(F&& f) {
    visit_impl(*this, f);
  }
  template <class F>
  void visit(F&& f) const {
    visit_impl(*this, f);
  }

 private:
  template <class Self, class F>
  static void visit_impl(Self& l, F& f) {
    const bool ab = l.has_attn_bias, nb = l.has_norm_bias, fb = l.has_ffn_bias;
    if (l.has_mla) {
      // MLA has no biases (attn_bias false)
      if (l.has_q_lora) {
        f("attn.q_a.weight", l.q_a_weight);
        f("attn.q_a_norm.weight", l.q_a_norm_weight);
        f("attn.q_b.weight", l.q_b_weight);
      } else {
        f("attn.q.weight", l.q_weight);
      }
      f("attn.kv_a.weight", l.kv_a_weight);
      f("attn.kv_norm.weight", l.kv_norm_weight);
      f("attn.kv_b.weight", l.kv_b_weight);
      f("attn.o.weight", l.o_weight);
    }
    if (!l.has_mla) f("attn.q.weight", l.q_weight);
    if (!l.has_mla) {
      if (ab) f("attn.q.bias", l.q_bias);
      f("attn.k.weight", l.k_weight);
      if (ab) f("attn.k.bias", l.k_bias);
      f("attn.v.weight", l.v_weight);
      if (ab) f("attn.v.bias", l.v_bias);
      f("attn.o.weight", l.o_weight);
      if (l.has_out_bias) f("attn.o.bias", l.o_bias);
    }
    if (l.has_qk_norm) {
      f("attn.q_norm.weight", l.q_norm_weight);
      f("attn.k_norm.weight", l.k_norm_weight);
    }
    if (l.has_sinks) f("attn.sinks", l.sinks);
    f("norm1.weight", l.norm1_weight);
    if (nb) f("norm1.bias", l.norm1_bias);
    f("norm2.weight", l.norm2_weight);
    if (nb) f("norm2.bias", l.norm2_bias);
    if (l.moe) {
      f("moe.gate.weight", l.router_weight);
      if (l.has_router_bias) f("moe.gate.bias", l.router_bias);
      if (l.has_correction) f("moe.gate.e_score_correction_bias", l.router_correction);
      f("moe.experts.w_gate", l.experts_w_gate);
      if (l.has_expert_bias) f("moe.experts.b_gate", l.experts_b_gate);
      f("moe.experts.w_up", l.experts_w_up);
      if (l.has_expert_bias) f("moe.experts.b_up", l.experts_b_up);
      f("moe.experts.w_down", l.experts_w_down);
      if (l.has_expert_bias) f("moe.experts.b_down", l.experts_b_down);
      if (l.has_shared) {
        f("moe.shared.gate.weight", l.shared_gate_weight);
        f("moe.shared.fc1.weight", l.shared_fc1_weight);
        f("moe.shared.fc2.weight", l.shared_fc2_weight);
        if (l.has_shared_gate) f("moe.shared_gate.weight", l.shared_expert_gate);
      }
      return;
    }
    if (l.gated) {
      f("ffn.gate.weight", l.gate_weight);
      if (fb) f("ffn.gate.bias", l.gate_bias);
    }
    f("ffn.fc1.weight", l.fc1_weight);
    if (fb) f("ffn.fc1.bias", l.fc1_bias);
    f("ffn.fc2.weight", l.fc2_weight);
    if (fb) f("ffn.fc2.bias", l.fc2_bias);
  }
};

// Every parameter of a config, named by the paths in docs/semantics.md. The same type holds the
// gradients.
template <class Real>
struct Params {
  ModelConfig config;
  Tensor<Real> embedding_weight;  // (V, D); input tokens only
  // input patches only: the patch projection (D, Ch, P, P) as Conv2d lays it out, its bias (D)
  // and the [CLS] token (D)
  Tensor<Real> patch_embedding_weight, patch_embedding_bias, cls_token;
  Tensor<Real> pos_embedding_weight;                        // (max_len, D); learned positional only
  Tensor<Real> token_type_embedding_weight;                 // (Tv, D); type_vocab_size only
  Tensor<Real> embedding_norm_weight, embedding_norm_bias;  // (D); embedding_norm only
  std::vector<LayerParams<Real>> layers;
  Tensor<Real> final_norm_weight, final_norm_bias;  // (D); pre-norm only, the bias layernorm only
  Tensor<Real> pooler_weight, pooler_bias;          // (D, D), (D); pooler dense_tanh only
  Tensor<Real> head_weight, head_bias;              // (C, D), (C); the bias head_bias only
  Tensor<Real> lm_head_weight, lm_head_bias;        // LM head: (Vt, D) unless tied, (Vt) head_bias
  // An encoder_decoder's decoder (semantics 17.5): its own embedding (with decoder_vocab_size),
  // learned positions, layers (each with cross-attention) and final norm (pre-norm).
  Tensor<Real> decoder_embedding_weight, decoder_pos_embedding_weight;
  std::vector<DecoderLayerParams<Real>> decoder_layers;
  Tensor<Real> decoder_final_norm_weight, decoder_final_norm_bias;

  // Every parameter present for this config, all zero. Validates the config first.
  static Params zeros(const ModelConfig& cfg);
  // The deterministic initialisation from `seed` (docs/semantics.md, "Initialisation").
  static Params init(const ModelConfig& cfg, std::uint64_t seed);

  // Calls f(name, tensor) for every present parameter in canonical order.
  template <class F>
  void visit(F&& f) {
    visit_impl(*this, f);
  }
  template <class F>
  void visit(F&& f) const {
    visit_impl(*this, f);
  }
  index_t count() const {
    index_t n = 0;
    visit([&](const std::string&, const Tensor<Real>& t) { n += t.numel(); });
    return n;
  }

 private:
  template <class Self, class F>
  static void visit_impl(Self& self, F& f) {
    if (self.config.patches_input()) {
      f("patch_embedding.weight", self.patch_embedding_weight);
      f("patch_embedding.bias", self.patch_embedding_bias);
      f("cls_token", self.cls_token);
    } else {
      f("embedding.weight", self.embedding_weight);
    }
    if (self.config.embeddings.positional == Positional::learned)
      f("pos_embedding.weight", self.pos_embedding_weight);
    if (self.config.embeddings.type_vocab_size)
      f("token_type_embedding.weight", self.token_type_embedding_weight);
    if (self.config.embeddings.embedding_norm) {
      f("embedding_norm.weight", self.embedding_norm_weight);
      if (self.config.norms.norm == Norm::layernorm)
        f("embedding_norm.bias", self.embedding_norm_bias);
    }
    for (std::size_t i = 0; i < self.layers.size(); ++i) {
      const std::string p = "layers." + std::to_string(i) + ".";
      self.layers[i].visit([&](const std::string& n, auto& t) { f(p + n, t); });
    }
    if (self.config.norms.norm_first) {
      f("final_norm.weight", self.final_norm_weight);
      if (self.config.norms.norm == Norm::layernorm) f("final_norm.bias", self.final_norm_bias);
    }
    if (self.config.encoder_decoder()) {
      if (self.config.embeddings.decoder_vocab_size)
        f("decoder.embedding.weight", self.decoder_embedding_weight);
      if (self.config.dec_positional() == Positional::learned)
        f("decoder.pos_embedding.weight", self.decoder_pos_embedding_weight);
      for (std::size_t i = 0; i < self.decoder_layers.size(); ++i) {
        const std::string p = "decoder.layers." + std::to_string(i) + ".";
        self.decoder_layers[i].visit(self.config.norms.norm_first,
                                     [&](const std::string& n, auto& t) { f(p + n, t); });
      }
      if (self.config.norms.norm_first) {
        f("decoder.final_norm.weight", self.decoder_final_norm_weight);
        if (self.config.norms.norm == Norm::layernorm)
          f("decoder.final_norm.bias", self.decoder_final_norm_bias);
      }
    }
    if (self.config.lm()) {
      if (!self.config.head.tie_embeddings) f("lm_head.weight", self.lm_head_weight);
      if (self.config.head.head_bias) f("lm_head.bias", self.lm_head_bias);
      return;
    }
    if (self.config.head.pooler == Pooler::dense_tanh) {
      f("pooler.weight", self.pooler_weight);
      f("pooler.bias", self.pooler_bias);
    }
    f("head.weight", self.head_weight);
    if (self.config.head.head_bias) f("head.bias", self.head_bias);
  }
};

// Dropout masks (1 = kept), present only when dropout is applied.
struct LayerMasks {
  std::vector<std::uint8_t> attn;       // (B, H, S, S)
  std::vector<std::uint8_t> residual1;  // (B, S, D), on attn_out
  std::vector<std::uint8_t> ffn;        // (B, S, F), on ffn_hidden
  std::vector<std::uint8_t> residual2;  // (B, S, D), on ffn_out
};

template <class Real>
struct LayerActs {
  Tensor<Real> norm1, norm1_mean, norm1_rstd;  // (B, S, D), (B*S), (B*S)
  Tensor<Real> q, k, v;                        // (B, H, S, Dh); k (B, Hkv, S, Dh), v (.., Dv)
  // q and k normalised per head (their rstd (B*H*S), (B*Hkv*S)); qk_norm only
  Tensor<Real> q_norm, k_norm, q_norm_rstd, k_norm_rstd;
  // MLA's latents (docs/semantics.md, 14.12): q_a and its norm (B, S, Rq) with q_lora_rank, kv_a
  // (B, S, Rkv + Dr) and the norm of its first Rkv (B, S, Rkv), with their rstd (B*S). With MLA k
  // is (B, H, S, Dh), each head's k_nope and the shared RoPE key, and v (B, H, S, Dv).
  Tensor<Real> q_a, q_a_norm, q_a_rstd, kv_a, kv_norm, kv_rstd;
  Tensor<Real> q_rot, k_rot;   // q and k (their norms with qk_norm) after RoPE; rope only
  Tensor<Real> scores, probs;  // (B, H, S, S); the final logits, masked -inf
  Tensor<Real> context;        // (B, S, H Dv), heads concatenated
  Tensor<Real> attn_out;       // (B, S, D), after the output projection
  Tensor<Real> residual1;      // (B, S, D)
  Tensor<Real> norm2, norm2_mean, norm2_rstd;  // (B, S, D), (B*S), (B*S)
  Tensor<Real> ffn_gate;                       // (B, S, F), gate(x); gated only
  Tensor<Real> ffn_pre;                        // (B, S, F), fc1(x): the activation's input, or
                                               // the up projection of a gated FFN
  Tensor<Real> ffn_hidden;                     // (B, S, F), act(ffn_pre) or act(gate) * ffn_pre
  Tensor<Real> ffn_out;                        // (B, S, D)
  Tensor<Real> residual2;                      // (B, S, D)
  Tensor<Real> output;                         // (B, S, D)
  LayerMasks masks;
  // An MoE layer's, in place of ffn_gate, ffn_pre and ffn_hidden (docs/golden-format.md, "The
  // grouped layout"), for the N = B S tokens, every position routed: the router's logits (B, S, E)
  // and weights (B, S, k), the N k (token, slot) rows sorted by expert, the experts' input
  // (N k, D), middle (N k, Fe) and output (N k, D), and the shared experts' output (B, S, D; with
  // shared_d_ff). Empty in a dense layer.
  Tensor<Real> moe_logits, moe_topk_weights;
  Tensor<Real> moe_expert_in, moe_expert_hidden, moe_expert_out, moe_shared_out;
  // What the forward pass keeps for backward: the routing (ids (N, k), weights, margins), the
  // grouped layout's offsets (E + 1) and source rows (N k), and the experts' two projections; and
  // the shared experts' (teo/layers/shared_experts.hpp). Not named: the integer tensors are the
  // golden's act.layers.{i}.moe.topk_ids, .expert_offsets and .source_rows.
  MoeActs<Real> moe;
  SharedExpertActs<Real> shared;
};

// What forward keeps. The same type holds the gradients of the loss with respect to each named
// activation; there the masks and pool_argmax are empty and the saved statistics (*_mean, *_rstd,
// class_probs) are allocated but stay 0, since they are not differentiated.
template <class Real>
struct Activations {
  bool norm_first = false;
  bool rotary = false;               // positional "rope": q_rot and k_rot are kept
  bool qk_norm = false;              // qk_norm: q_norm and k_norm are kept
  bool mla = false, q_lora = false;  // kv_lora_rank: kv_a, kv_norm (q_lora_rank: q_a, q_a_norm)
  bool gated = false;                // a gated FFN: ffn_gate is kept
  bool decoder = false;              // an LM head: lm_logits, not pooled and logits
  bool encoder_decoder = false;      // the decoder.* activations follow the encoder's
  bool token_types = false;          // type_vocab_size: token_type is kept
  bool embedding_norm = false;       // embedding_norm: embedding_norm and its statistics
  bool pooler = false;               // pooler dense_tanh: pooler is kept
  // ffn "moe": which layers are MoE layers (one flag per layer), whether they have shared
  // experts (moe.shared_out), and whether the loss has the router terms (moe_aux_loss,
  // moe_z_loss)
  std::vector<bool> moe_layers;
  bool moe_shared = false, moe_aux = false, moe_z = false;
  Tensor<Real> embedding;   // (B, S, D), scaled token embeddings
  Tensor<Real> positional;  // (S, D), the positional table rows used
  Tensor<Real> token_type;  // (B, S, D), the token-type table rows used
  // (B, S, D), norm(embedding + positional + token_type); statistics (B*S)
  Tensor<Real> embedding_norm_out, embedding_norm_mean, embedding_norm_rstd;
  // (B, S, D), dropout of embedding_norm, or of embedding + positional (+ token_type)
  Tensor<Real> input;
  std::vector<std::uint8_t> input_mask;  // (B, S, D)
  std::vector<LayerActs<Real>> layers;
  Tensor<Real> final_norm, final_norm_mean, final_norm_rstd;  // pre-norm only
  Tensor<Real> pooled;                                        // (B, D)
  Tensor<Real> pooler_out;                                    // (B, D), tanh(pooled W^T + b)
  std::vector<std::int64_t> pool_argmax;                      // (B, D), max pooling only
  Tensor<Real> logits;                                        // (B, C)
  Tensor<Real> class_probs;  // (B, C), softmax(logits), saved for backward
  // An encoder_decoder's decoder: the target's embedding, positions and input (B, T, D), (T, D),
  // (B, T, D), its layers and final norm (pre-norm).
  Tensor<Real> decoder_embedding, decoder_positional, decoder_input;
  std::vector<DecoderLayerActs<Real>> decoder_layers;
  Tensor<Real> decoder_final_norm, decoder_final_norm_mean, decoder_final_norm_rstd;
  Tensor<Real> lm_logits;  // an LM head: (B, S, V) (an encoder_decoder: (B, T, Vt))
  Tensor<Real> lm_probs;   // softmax(lm_logits), saved for backward
  // ffn "moe" with router_aux_loss_coef (router_z_loss_coef) nonzero: the load-balancing loss
  // (z-loss) over every MoE layer's real tokens, [] each; loss includes coef times each.
  Tensor<Real> moe_aux_loss, moe_z_loss;
  Tensor<Real> loss;  // [] (a scalar)

  // Calls f(name, tensor) for every named activation in pipeline order: embedding, positional,
  // input, layers.{i}.{...} in the order they are computed, final_norm, pooled, logits (a decoder:
  // lm_logits), loss.
  // The flags above as the config sets them (Activations::visit names the tensors by them).
  void configure(const ModelConfig& c) {
    norm_first = c.norms.norm_first;
    rotary = c.embeddings.positional == Positional::rope;
    qk_norm = c.attention.qk_norm;
    mla = c.attention.mla();
    q_lora = mla && c.attention.q_lora_rank.has_value();
    gated = c.gated();
    decoder = c.lm();
    encoder_decoder = c.encoder_decoder();
    token_types = c.embeddings.type_vocab_size.has_value();
    embedding_norm = c.embeddings.embedding_norm;
    pooler = c.head.pooler == Pooler::dense_tanh;
    moe_layers.assign(static_cast<std::size_t>(c.moe() ? std::max<index_t>(c.num_layers, 0) : 0),
                      false);
    for (std::size_t i = 0; i < moe_layers.size(); ++i)
      moe_layers[i] = c.moe_layer(static_cast<index_t>(i));
    moe_shared = c.moe() && c.ffn.moe.shared_d_ff > 0;
    moe_aux = c.moe() && c.ffn.moe.router_aux_loss_coef != 0;
    moe_z = c.moe() && c.ffn.moe.router_z_loss_coef != 0;
  }
  bool configured_for(const ModelConfig& c) const {
    Activations<Real> want;
    want.configure(c);
    return norm_first == want.norm_first && rotary == want.rotary && qk_norm == want.qk_norm &&
           mla == want.mla && q_lora == want.q_lora && gated == want.gated &&
           decoder == want.decoder && encoder_decoder == want.encoder_decoder &&
           token_types == want.token_types && embedding_norm == want.embedding_norm &&
           pooler == want.pooler && moe_layers == want.moe_layers &&
           moe_shared == want.moe_shared && moe_aux == want.moe_aux && moe_z == want.moe_z;
  }
  // Whether layer i is an MoE layer.
  bool moe_layer(std::size_t i) const { return i < moe_layers.size() && moe_layers[i]; }

  template <class F>
  void visit(F&& f) {
    visit_impl(*this, f);
  }
  template <class F>
  void visit(F&& f) const {
    visit_impl(*this, f);
  }

 private:
  template <class Self, class F>
  static void visit_impl(Self& self, F& f) {
    f("embedding", self.embedding);
    f("positional", self.positional);
    if (self.token_types) f("token_type", self.token_type);
    if (self.embedding_norm) f("embedding_norm", self.embedding_norm_out);
    f("input", self.input);
    for (std::size_t i = 0; i < self.layers.size(); ++i) {
      auto& l = self.layers[i];
      const std::string p = "layers." + std::to_string(i) + ".";
      if (self.norm_first) f(p + "norm1", l.norm1);
      if (self.q_lora) {
        f(p + "q_a", l.q_a);
        f(p + "q_a_norm", l.q_a_norm);
      }
      f(p + "q", l.q);
      if (self.mla) {
        f(p + "kv_a", l.kv_a);
        f(p + "kv_norm", l.kv_norm);
      }
      f(p + "k", l.k);
      f(p + "v", l.v);
      if (self.qk_norm) {
        f(p + "q_norm", l.q_norm);
        f(p + "k_norm", l.k_norm);
      }
      if (self.rotary) {
        f(p + "q_rot", l.q_rot);
        f(p + "k_rot", l.k_rot);
      }
      f(p + "scores", l.scores);
      f(p + "probs", l.probs);
      f(p + "context", l.context);
      f(p + "attn_out", l.attn_out);
      f(p + "residual1", l.residual1);
      if (!self.norm_first) f(p + "norm1", l.norm1);
      if (self.norm_first) f(p + "norm2", l.norm2);
      if (self.moe_layer(i)) {
        f(p + "moe.logits", l.moe_logits);
        f(p + "moe.topk_weights", l.moe_topk_weights);
        f(p + "moe.expert_in", l.moe_expert_in);
        f(p + "moe.expert_hidden", l.moe_expert_hidden);
        f(p + "moe.expert_out", l.moe_expert_out);
        if (self.moe_shared) f(p + "moe.shared_out", l.moe_shared_out);
      } else {
        if (self.gated) f(p + "ffn_gate", l.ffn_gate);
        f(p + "ffn_pre", l.ffn_pre);
        f(p + "ffn_hidden", l.ffn_hidden);
      }
      f(p + "ffn_out", l.ffn_out);
      f(p + "residual2", l.residual2);
      if (!self.norm_first) f(p + "norm2", l.norm2);
      f(p + "output", l.output);
    }
    if (self.norm_first) f("final_norm", self.final_norm);
    if (self.encoder_decoder) {
      f("decoder.embedding", self.decoder_embedding);
      f("decoder.positional", self.decoder_positional);
      f("decoder.input", self.decoder_input);
      for (std::size_t i = 0; i < self.decoder_layers.size(); ++i)
        visit_decoder_layer(self.decoder_layers[i], self.norm_first, self.gated,
                            "decoder.layers." + std::to_string(i) + ".", f);
      if (self.norm_first) f("decoder.final_norm", self.decoder_final_norm);
    }
    if (self.decoder) {
      f("lm_logits", self.lm_logits);
    } else {
      f("pooled", self.pooled);
      if (self.pooler) f("pooler", self.pooler_out);
      f("logits", self.logits);
    }
    if (self.moe_aux) f("moe_aux_loss", self.moe_aux_loss);
    if (self.moe_z) f("moe_z_loss", self.moe_z_loss);
    f("loss", self.loss);
  }

  // One decoder layer's named activations in the order they are computed (each block's norm
  // before it, pre-norm, or after its residual, post-norm).
  template <class L, class F>
  static void visit_decoder_layer(L& l, bool pre, bool gated, const std::string& p, F& f) {
    const auto block = [&](const char* name, auto& a, const char* norm, auto& n, auto& residual) {
      const std::string b = p + name + ".";
      if (pre) f(p + norm, n);
      f(b + "q", a.q);
      f(b + "k", a.k);
      f(b + "v", a.v);
      f(b + "scores", a.scores);
      f(b + "probs", a.probs);
      f(b + "context", a.context);
      f(b + "out", a.out);
      f(p + (std::string(norm) == "norm1" ? "residual1" : "residual2"), residual);
      if (!pre) f(p + norm, n);
    };
    block("self_attn", l.self_attn, "norm1", l.norm1, l.residual1);
    block("cross_attn", l.cross_attn, "norm2", l.norm2, l.residual2);
    if (pre) f(p + "norm3", l.norm3);
    if (gated) f(p + "ffn_gate", l.ffn_gate);
    f(p + "ffn_pre", l.ffn_pre);
    f(p + "ffn_hidden", l.ffn_hidden);
    f(p + "ffn_out", l.ffn_out);
    f(p + "residual3", l.residual3);
    if (!pre) f(p + "norm3", l.norm3);
    f(p + "output", l.output);
  }
};

// Throws ShapeError naming the first parameter whose presence or shape disagrees with
// params.config (after validating the config). forward() and backward() call it first.
template <class Real>
void validate_params(const Params<Real>& params);

// Throws ShapeError naming the first kept activation, statistic or mask whose shape disagrees with
// what forward() produces for this config and batch. encoder_forward() and backward() call it.
template <class Real>
void validate_activations(const ModelConfig& cfg, const Batch& batch,
                          const Activations<Real>& acts);

struct ForwardOptions {
  // Dropout is applied when train is true and config.dropout > 0 (PyTorch's train mode);
  // otherwise every dropout site is the identity and no mask is kept.
  bool train = true;
  std::uint64_t dropout_seed = 0;
  // The precision to emulate (docs/semantics.md, "Reduced precision"): unset runs in Real. A float
  // pass takes fp32, tf32, bf16, fp16 or fp8; a double pass only fp64 (else ConfigError). Under
  // bf16, fp16 and fp8 (stored as bf16) every named activation is rounded to the format where it
  // is produced, and an fp16 overflow throws RangeError naming the tensor; the parameters are used
  // as given (see round_params). fp8 runs every linear product under the recipe `fp8`.
  std::optional<Precision> precision = std::nullopt;
  // The fp8 recipe (teo/fp8.hpp), read under Precision::fp8 (under any other precision a recipe
  // is a ConfigError): unset is the thread's, which is the default Fp8Recipe (E4M3, one scale per
  // tensor, float32 accumulation) outside an op case.
  std::optional<Fp8Recipe> fp8 = std::nullopt;
  // Dropout masks to replay instead of drawing them from dropout_seed, by site (the golden names:
  // "dropout.input", "dropout.layers.{i}.attn", ".residual1", ".ffn", ".residual2"); a site not
  // given is drawn. Each must have its site's element count (ShapeError), nonzero meaning kept; a
  // name that is no site of this config, or masks when no dropout applies, is a ConfigError.
  const std::map<std::string, std::vector<std::uint8_t>>* masks = nullptr;
  // Router replay (docs/semantics.md, 19.4): the experts an MoE layer's positions choose instead
  // of its router's own choice, by layer index, B * S * k ids in (b, s, slot) order (a golden's
  // act.layers.{i}.moe.topk_ids); a layer not given routes itself. The weights are still the
  // router's, of the given experts. A layer that is not an MoE layer is a ConfigError, a wrong
  // count a ShapeError, an id out of range or repeated within a position a ConfigError.
  const std::map<index_t, std::vector<std::int32_t>>* routing = nullptr;
};

struct BackwardOptions {
  // As ForwardOptions::precision; under bf16 and fp16 every named gradient, of activations and
  // parameters, is rounded where it is complete.
  std::optional<Precision> precision = std::nullopt;
  std::optional<Fp8Recipe> fp8 = std::nullopt;  // as ForwardOptions::fp8
  // false: of each layer's activation gradients keep only dacts.layers[i].output (the golden
  // contract's); the others live in one layer's scratch, reused down the stack, and are left
  // empty. The bits of everything kept are the same; the memory of a deep model's backward pass
  // is about halved.
  bool layer_activation_grads = true;
};

// Rounds every parameter to p's storage format (bf16 or fp16; other precisions change nothing),
// as a backend that stores its weights in that format holds them.
void round_params(Params<float>& params, Precision p);

// Validates, allocates and runs the whole forward pass into acts.
template <class Real>
void forward(const Params<Real>& params, const Batch& batch, Activations<Real>& acts,
             const ForwardOptions& opts = {});

// Runs the encoder stack, pooling, head and loss from acts.input, which the caller may have
// changed; acts must come from forward() on the same params and batch.
template <class Real>
void encoder_forward(const Params<Real>& params, const Batch& batch, Activations<Real>& acts,
                     const ForwardOptions& opts = {});

// The exact gradient of acts.loss with respect to every parameter (grads, overwritten) and every
// named activation (dacts, overwritten), from a forward() on the same params and batch.
template <class Real>
void backward(const Params<Real>& params, const Batch& batch, const Activations<Real>& acts,
              Params<Real>& grads, Activations<Real>& dacts, const BackwardOptions& opts = {});

// One encoder layer alone, for testing a fused-layer kernel (the encoder_layer op case): the
// layer forward() runs as layer 0 of cfg (dropout masks drawn from opts.dropout_seed at the sites
// "dropout.layers.0.*", kept in L.masks) on x (B, S, D) with one length per sequence. cfg's
// num_layers, vocabulary, positions, pooling and head are not used. ShapeError when x, lengths or
// a parameter disagrees with cfg.
template <class Real>
void encoder_layer_forward(const ModelConfig& cfg, const LayerParams<Real>& P,
                           const Tensor<Real>& x, const std::vector<std::int64_t>& lengths,
                           LayerActs<Real>& L, const ForwardOptions& opts = {});

// The gradient of sum(dy * L.output) with respect to x (dx, overwritten), the layer's parameters
// (G, overwritten) and its named activations (dL, overwritten), from encoder_layer_forward on the
// same arguments.
template <class Real>
void encoder_layer_backward(const ModelConfig& cfg, const LayerParams<Real>& P,
                            const Tensor<Real>& x, const std::vector<std::int64_t>& lengths,
                            const LayerActs<Real>& L, const Tensor<Real>& dy, Tensor<Real>& dx,
                            LayerParams<Real>& G, LayerActs<Real>& dL,
                            const BackwardOptions& opts = {});

}  // namespace teo
