// One decoder layer of an encoder-decoder Transformer (docs/semantics.md, section 17.4): masked
// self-attention over the target stream, cross-attention from it to the encoder's output (the
// memory), and the FFN, each with a residual and a norm (after it, post-norm; before it,
// pre-norm). Without a memory it is a decoder-only layer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "teo/config.hpp"
#include "teo/tensor.hpp"

namespace teo {

// One attention block's projections: q (D, D), k and v (Hkv Dh, D), o (D, D), each bias absent
// (empty) without attn_bias.
template <class Real>
struct AttentionParams {
  Tensor<Real> q_weight, q_bias, k_weight, k_bias, v_weight, v_bias, o_weight, o_bias;
};

template <class Real>
struct DecoderLayerParams {
  AttentionParams<Real> self_attn, cross_attn;  // cross_attn empty in a layer without a memory
  // norm1 after (post) or before (pre) the self-attention, norm2 the cross-attention's (with a
  // memory only), norm3 the FFN's; the biases absent with rmsnorm.
  Tensor<Real> norm1_weight, norm1_bias, norm2_weight, norm2_bias, norm3_weight, norm3_bias;
  // the FFN: gate (a gated ffn only), fc1 (its up projection), fc2; biases with ffn_bias
  Tensor<Real> gate_weight, gate_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias;

  // Zeros of cfg's shapes, with the cross-attention block and norm2 when `cross`.
  static DecoderLayerParams zeros(const ModelConfig& cfg, bool cross);
  // The same tensors present, each of one element: what visit() lists, without the memory.
  static DecoderLayerParams markers(const ModelConfig& cfg, bool cross);
  bool cross() const { return cross_attn.q_weight.numel() > 0; }

  // Every parameter present, in the order the layer uses them: "self_attn.q.weight",
  // "self_attn.q.bias", ... "self_attn.o.bias", "norm1.weight", "norm1.bias", "cross_attn.*",
  // "norm2.*", "ffn.gate.*", "ffn.fc1.*", "ffn.fc2.*", "norm3.*" (pre-norm puts each norm before
  // its block: norm1, self_attn, norm2, cross_attn, norm3, ffn).
  template <class F>
  void visit(bool norm_first, F&& f) {
    visit_impl(*this, norm_first, f);
  }
  template <class F>
  void visit(bool norm_first, F&& f) const {
    visit_impl(*this, norm_first, f);
  }

 private:
  template <class Self, class F>
  static void visit_impl(Self& p, bool norm_first, F& f) {
    const auto one = [&](const char* n, auto& t) {
      if (t.numel() > 0) f(std::string(n), t);
    };
    const auto attn = [&](const std::string& b, auto& a) {
      for (auto [n, t] : {std::pair{".q.weight", &a.q_weight}, std::pair{".q.bias", &a.q_bias},
                          std::pair{".k.weight", &a.k_weight}, std::pair{".k.bias", &a.k_bias},
                          std::pair{".v.weight", &a.v_weight}, std::pair{".v.bias", &a.v_bias},
                          std::pair{".o.weight", &a.o_weight}, std::pair{".o.bias", &a.o_bias}})
        if (t->numel() > 0) f(b + n, *t);
    };
    const auto norm = [&](int i, auto& w, auto& b) {
      const std::string n = "norm" + std::to_string(i);
      if (w.numel() > 0) f(n + ".weight", w);
      if (b.numel() > 0) f(n + ".bias", b);
    };
    const auto ffn = [&] {
      one("ffn.gate.weight", p.gate_weight);
      one("ffn.gate.bias", p.gate_bias);
      one("ffn.fc1.weight", p.fc1_weight);
      one("ffn.fc1.bias", p.fc1_bias);
      one("ffn.fc2.weight", p.fc2_weight);
      one("ffn.fc2.bias", p.fc2_bias);
    };
    if (norm_first) norm(1, p.norm1_weight, p.norm1_bias);
    attn("self_attn", p.self_attn);
    if (!norm_first) norm(1, p.norm1_weight, p.norm1_bias);
    if (norm_first) norm(2, p.norm2_weight, p.norm2_bias);
    attn("cross_attn", p.cross_attn);
    if (!norm_first) norm(2, p.norm2_weight, p.norm2_bias);
    if (norm_first) norm(3, p.norm3_weight, p.norm3_bias);
    ffn();
    if (!norm_first) norm(3, p.norm3_weight, p.norm3_bias);
  }
};

// One attention block's activations: q (B, H, T, Dh), k and v (B, Hkv, Skv, Dh), scores and
// probs (B, H, T, Skv), context (B, T, D) (heads merged), out (B, T, D) (the output projection).
template <class Real>
struct AttentionBlockActs {
  Tensor<Real> q, k, v, scores, probs, context, out;
};

template <class Real>
struct DecoderLayerActs {
  AttentionBlockActs<Real> self_attn, cross_attn;
  // each norm's output and statistics (B, T, D), (B T), (B T); mean unused with rmsnorm
  Tensor<Real> norm1, norm1_mean, norm1_rstd, norm2, norm2_mean, norm2_rstd, norm3, norm3_mean,
      norm3_rstd;
  // residual1 = x + self_attn.out; residual2 = (its stream) + cross_attn.out; residual3 = (its
  // stream) + ffn_out
  Tensor<Real> residual1, residual2, residual3;
  Tensor<Real> ffn_gate, ffn_pre, ffn_hidden, ffn_out;  // (B, T, F), ..., (B, T, D)
  Tensor<Real> output;                                  // (B, T, D)
};

// The decoder layer on x (B, T, D), target lengths (B) (positions past them are padding: no query
// sees them as keys), and, when P has cross-attention, the memory (B, Se, D) with its lengths (B)
// (the encoder's padding mask: memory rows past them are no query's keys; a length of 0 gives a
// cross-attention context of 0). The self-attention is causal (cfg.causal), the cross-attention
// never. Eval mode: no dropout (ConfigError when cfg.dropout > 0). ShapeError for shapes that do
// not fit P, cfg or each other.
template <class Real>
void decoder_layer_forward(const ModelConfig& cfg, const DecoderLayerParams<Real>& P,
                           const Tensor<Real>& x, const std::vector<std::int64_t>& lengths,
                           const Tensor<Real>& memory,
                           const std::vector<std::int64_t>& memory_lengths,
                           DecoderLayerActs<Real>& A);

// Its backward from dy (B, T, D): dx and dmemory (B, Se, D; empty without cross-attention) are
// overwritten, G is overwritten with the parameter gradients (the shapes of P).
template <class Real>
void decoder_layer_backward(const ModelConfig& cfg, const DecoderLayerParams<Real>& P,
                            const Tensor<Real>& x, const std::vector<std::int64_t>& lengths,
                            const Tensor<Real>& memory,
                            const std::vector<std::int64_t>& memory_lengths,
                            const DecoderLayerActs<Real>& A, const Tensor<Real>& dy,
                            Tensor<Real>& dx, Tensor<Real>& dmemory, DecoderLayerParams<Real>& G);

}  // namespace teo
