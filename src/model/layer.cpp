// One encoder layer, forward and backward, stage by stage: the attention block (the pre-norm's
// norm1, the fused q/k/v projection, RoPE, attention, the output projection, residual1) and the
// FFN block (the norm before the FFN, fc1, the activation and dropout, fc2, residual2, the
// output). The backward pass walks back through the same stages in reverse.
#include <cstdint>
#include <string>
#include <string_view>

#include "model/mla.hpp"
#include "model/model_internal.hpp"
#include "model/moe_block.hpp"
#include "model/pass.hpp"
#include "teo/layers/attention.hpp"
#include "teo/layers/dropout.hpp"
#include "teo/layers/feed_forward.hpp"
#include "teo/layers/linear.hpp"
#include "teo/layers/rope.hpp"
#include "teo/profile.hpp"

namespace teo::detail {

using profile::Stage;

// In the backward pass only the gradients of the LayerNorm statistics, which nothing writes, are
// zero-filled: layer_backward's first writer of every other gradient overwrites it (dL.output is
// the next layer's dx, or the head's, which allocate() zero-fills).
template <class Real>
void allocate_layer(LayerActs<Real>& l, const Dims& d, ZeroList<Real>* zero, bool moe) {
  for (Tensor<Real>* t :
       {&l.norm1, &l.attn_out, &l.residual1, &l.norm2, &l.ffn_out, &l.residual2, &l.output})
    shape_as(*t, {d.B, d.S, d.D}, nullptr);
  for (Tensor<Real>* t : {&l.norm1_mean, &l.norm1_rstd, &l.norm2_mean, &l.norm2_rstd})
    shape_as(*t, {d.N}, zero);
  shape_as(l.context, {d.B, d.S, d.Dc}, nullptr);
  shape_as(l.q, {d.B, d.H, d.S, d.Dh}, nullptr);
  shape_as(l.k, {d.B, d.K, d.S, d.Dh}, nullptr);
  shape_as(l.v, {d.B, d.K, d.S, d.Dv}, nullptr);
  l.q_a = l.q_a_norm = l.q_a_rstd = l.kv_a = l.kv_norm = l.kv_rstd = Tensor<Real>();
  if (d.mla) {
    // written whole by the forward pass and by their one writer in the backward pass; the rstd
    // gradients, which nothing writes, zero-filled
    if (d.Rq > 0) {
      shape_as(l.q_a, {d.B, d.S, d.Rq}, nullptr);
      shape_as(l.q_a_norm, {d.B, d.S, d.Rq}, nullptr);
      shape_as(l.q_a_rstd, {d.N}, zero);
    }
    shape_as(l.kv_a, {d.B, d.S, d.Rkv + d.Dr}, nullptr);
    shape_as(l.kv_norm, {d.B, d.S, d.Rkv}, nullptr);
    shape_as(l.kv_rstd, {d.N}, zero);
  }
  if (d.qk_norm) {
    // written whole by the norms in the forward pass, and by RoPE's backward (or attention's)
    // in the backward pass; their statistics' gradients, which nothing writes, zero-filled
    shape_as(l.q_norm, {d.B, d.H, d.S, d.Dh}, nullptr);
    shape_as(l.k_norm, {d.B, d.K, d.S, d.Dh}, nullptr);
    shape_as(l.q_norm_rstd, {d.B * d.H * d.S}, zero);
    shape_as(l.k_norm_rstd, {d.B * d.K * d.S}, zero);
  } else {
    l.q_norm = l.k_norm = l.q_norm_rstd = l.k_norm_rstd = Tensor<Real>();
  }
  if (d.rope) {
    // written whole by RoPE in the forward pass and by attention_backward in the backward pass
    shape_as(l.q_rot, {d.B, d.H, d.S, d.Dh}, nullptr);
    shape_as(l.k_rot, {d.B, d.K, d.S, d.Dh}, nullptr);
  } else {
    l.q_rot = l.k_rot = Tensor<Real>();
  }
  for (Tensor<Real>* t : {&l.scores, &l.probs}) shape_as(*t, {d.B, d.H, d.S, d.S}, nullptr);
  for (Tensor<Real>* t : {&l.moe_logits, &l.moe_topk_weights, &l.moe_expert_in,
                          &l.moe_expert_hidden, &l.moe_expert_out, &l.moe_shared_out})
    *t = Tensor<Real>();
  if (moe) {
    // an MoE layer: its moe.* tensors in place of the dense FFN's, each written whole (forward)
    // or by its one writer (backward)
    l.ffn_pre = l.ffn_hidden = l.ffn_gate = Tensor<Real>();
    const index_t rows = d.N * d.Kt;
    shape_as(l.moe_logits, {d.B, d.S, d.E}, nullptr);
    shape_as(l.moe_topk_weights, {d.B, d.S, d.Kt}, nullptr);
    shape_as(l.moe_expert_in, {rows, d.D}, nullptr);
    shape_as(l.moe_expert_hidden, {rows, d.Fe}, nullptr);
    shape_as(l.moe_expert_out, {rows, d.D}, nullptr);
    if (d.Fs > 0) shape_as(l.moe_shared_out, {d.B, d.S, d.D}, nullptr);
  } else {
    for (Tensor<Real>* t : {&l.ffn_pre, &l.ffn_hidden}) shape_as(*t, {d.B, d.S, d.F}, nullptr);
    if (d.gated) {
      shape_as(l.ffn_gate, {d.B, d.S, d.F}, nullptr);
    } else {
      l.ffn_gate = Tensor<Real>();
    }
  }
  for (auto* m : {&l.masks.attn, &l.masks.residual1, &l.masks.ffn, &l.masks.residual2}) m->clear();
}

// ---------------------------------------------------------------------------------------------
// Forward

namespace {

// What attention reads of q (or k): its rotation (rope), else its norm (qk_norm), else q itself.
template <class T>
T& attended(const Dims& d, T& plain, T& normed, T& rotated) {
  if (d.rope) return rotated;
  return d.qk_norm ? normed : plain;
}

// What every stage of one layer's forward pass reads, and the scratch the two residuals share.
template <class Real>
struct LayerForward {
  const ModelConfig& cfg;
  index_t layer;  // its index in the stack (its attention: ModelConfig::window)
  const LayerParams<Real>& P;
  LayerActs<Real>& L;  // the layer's activations, written stage by stage
  const Batch& batch;
  const Dims& d;
  const std::string& prefix;  // "dropout.layers.{i}.", naming the dropout sites
  std::string_view name;      // "layers.{i}.", naming the rounded tensors
  bool drop;                  // dropout applies
  const MaskSource& seed;
  const Emulation<Real>& store;
  const std::int32_t* routing;  // an MoE layer's replayed choice (N * k), or null
  index_t nd;                   // N * D
  double p;                     // the dropout probability
  Tensor<Real>& tmp;            // (B, S, D) scratch for a dropped residual branch, or empty

  // its stages: the attention block (which runs qkv_forward), then the FFN block (ffn_forward)
  void qkv_forward(const Real* attn_in) const;
  void attention_block_forward(const Real* x) const;
  void ffn_forward(const Real* ffn_in) const;
  void ffn_block_forward() const;
};

// q (B, H, S, Dh), k, v (B, Hkv, S, Dh) = split(attn_in * W^T + b), as one GEMM against
// [Wq; Wk; Wv]. Each output element is the same dot product as with three separate products.
template <class Real>
void LayerForward<Real>::qkv_forward(const Real* attn_in) const {
  profile::Scope stage(Stage::qkv_proj);
  const QkvLayout lay(d);
  auto wqkv = Tensor<Real>::for_overwrite({lay.width, d.D});
  auto bqkv = Tensor<Real>::for_overwrite({lay.width});
  stack_qkv(wqkv.data(), bqkv.data(), P, lay, d.D);
  auto qkv = Tensor<Real>::for_overwrite({d.B, d.S, lay.width});  // (B, S, Dq + 2 Dkv)
  // The bias is added while splitting (the same rounding as linear_forward's), which saves a
  // pass over the (B, S, Dq + 2 Dkv) product.
  linear_forward(qkv.data(), attn_in, wqkv.data(), static_cast<const Real*>(nullptr), d.N, d.D,
                 lay.width);
  Tensor<Real>* heads[3] = {&L.q, &L.k, &L.v};
  // With B = 0 the buffers are empty (null): nothing to split, and no pointer arithmetic on null.
  if (qkv.numel() > 0) {
    for (int i = 0; i < 3; ++i)
      split_heads(heads[i]->data(), qkv.data() + lay.at[i], d.B, d.S, lay.heads[i], d.Dh, lay.width,
                  P.has_attn_bias ? bqkv.data() + lay.at[i] : nullptr);
  }
  store(L.q, name, "q");
  store(L.k, name, "k");
  store(L.v, name, "v");
  if (d.qk_norm) {
    // q_norm, k_norm = RMSNorm(q), RMSNorm(k), each head's row of Dh on its own
    const Real eps = static_cast<Real>(cfg.norms.layer_norm_eps);
    rms_norm_forward(L.q_norm.data(), L.q_norm_rstd.data(), L.q.data(), P.q_norm_weight.data(),
                     d.B * d.H * d.S, d.Dh, eps);
    rms_norm_forward(L.k_norm.data(), L.k_norm_rstd.data(), L.k.data(), P.k_norm_weight.data(),
                     d.B * d.K * d.S, d.Dh, eps);
    store(L.q_norm, name, "q_norm");
    store(L.k_norm, name, "k_norm");
  }
  if (d.rope) {
    // q_rot, k_rot = RoPE(q), RoPE(k) (of their norms with qk_norm)
    const RopeTables<Real> t(cfg, d.S);
    rope_forward(L.q_rot.data(), (d.qk_norm ? L.q_norm : L.q).data(), t.cos.data(), t.sin.data(),
                 d.B * d.H, d.S, d.Dh, cfg.rotary(), cfg.attention.rope_style);
    rope_forward(L.k_rot.data(), (d.qk_norm ? L.k_norm : L.k).data(), t.cos.data(), t.sin.data(),
                 d.B * d.K, d.S, d.Dh, cfg.rotary(), cfg.attention.rope_style);
    store(L.q_rot, name, "q_rot");
    store(L.k_rot, name, "k_rot");
  }
}

// The attention block, from the layer's input x (B, S, D) to L.residual1: norm1 (pre-norm), the
// q/k/v projection, RoPE, attention, the output projection and the first residual.
template <class Real>
void LayerForward<Real>::attention_block_forward(const Real* x) const {
  const Real* attn_in = x;
  if (cfg.norms.norm_first) {
    {
      profile::Scope stage(Stage::layer_norm);
      norm_forward(cfg, L.norm1.data(), L.norm1_mean.data(), L.norm1_rstd.data(), x,
                   P.norm1_weight.data(), data_or_null(P.norm1_bias), d.N, d.D);
      store(L.norm1, name, "norm1");
    }
    attn_in = L.norm1.data();
  }
  if (d.mla) {
    mla_forward(cfg, P, L, attn_in, d, name, store);
  } else {
    qkv_forward(attn_in);
  }
  {
    profile::Scope attention_scope(Stage::attention);
    const bool drop_attn = drop;
    if (drop_attn) {
      L.masks.attn.assign(static_cast<std::size_t>(L.probs.numel()), 0);
      seed.draw(L.masks.attn.data(), L.probs.numel(), prefix + "attn", p);
    } else {
      L.masks.attn.clear();
    }
    // context (B, S, Dq) is written with its heads merged, in place.
    AttentionArgs<Real> args =
        detail::attention_args(cfg, d.B, d.S, batch.lengths.data(), P.sinks.data());
    args.variant.window = cfg.window(layer);
    args.drop_mask = drop_attn ? L.masks.attn.data() : nullptr;
    args.drop_scale = dropout_scale<Real>(p);
    args.merged_context = true;
    store.named(name, [&] {
      attention_forward(args, {.context = L.context.data(),
                               .scores = L.scores.data(),
                               .probs = L.probs.data(),
                               .q = attended(d, L.q, L.q_norm, L.q_rot).data(),
                               .k = attended(d, L.k, L.k_norm, L.k_rot).data(),
                               .v = L.v.data()});
    });
    store(L.context, name, "context");
  }
  {
    profile::Scope stage(Stage::out_proj);
    linear_forward(L.attn_out.data(), L.context.data(), P.o_weight.data(), data_or_null(P.o_bias),
                   d.N, d.Dc, d.D);
    store(L.attn_out, name, "attn_out");
  }
  // residual1 = x + dropout(attn_out)
  {
    profile::Scope stage(Stage::residual);
    add3(L.residual1.data(), x,
         apply_dropout(tmp.data(), L.attn_out.data(), L.masks.residual1, nd, prefix + "residual1",
                       p, drop, seed),
         nd);
    store(L.residual1, name, "residual1");
  }
}

// ffn_out = fc2(dropout(act(fc1(ffn_in)))). fc1's bias, the activation and the dropout run as
// one pass (ffn_hidden_forward, the same bits), unless each result is to be rounded to a reduced
// storage format before the next step reads it.
template <class Real>
void LayerForward<Real>::ffn_forward(const Real* ffn_in) const {
  // A gated FFN runs its steps as separate passes: gate and fc1 with their biases, then
  // act(gate) * fc1 and the dropout.
  const bool fused = !store.stores_reduced() && !d.gated;
  const Real* fc1_bias = data_or_null(P.fc1_bias);
  {
    profile::Scope stage(Stage::ffn_fc1);
    if (d.gated) {
      linear_forward(L.ffn_gate.data(), ffn_in, P.gate_weight.data(), data_or_null(P.gate_bias),
                     d.N, d.D, d.F);
      store(L.ffn_gate, name, "ffn_gate");
    }
    linear_forward(L.ffn_pre.data(), ffn_in, P.fc1_weight.data(), fused ? nullptr : fc1_bias, d.N,
                   d.D, d.F);
    if (!fused) store(L.ffn_pre, name, "ffn_pre");
  }
  Tensor<Real> dropped_buf = drop ? Tensor<Real>::for_overwrite({d.B, d.S, d.F}) : Tensor<Real>();
  const Real* hidden_dropped = nullptr;  // dropout(ffn_hidden): the buffer, or ffn_hidden itself
  {
    profile::Scope stage(Stage::activation);
    const index_t nh = L.ffn_hidden.numel();
    if (fused) {
      const std::uint8_t* mask = record_mask(L.masks.ffn, nh, prefix + "ffn", p, drop, seed);
      ffn_hidden_forward(L.ffn_pre.data(), L.ffn_hidden.data(), dropped_buf.data(), fc1_bias, mask,
                         dropout_scale<Real>(p), d.N, d.F, cfg.ffn_activation());
      hidden_dropped = drop ? dropped_buf.data() : L.ffn_hidden.data();
    } else {
      if (d.gated) {
        gated_forward(L.ffn_hidden.data(), L.ffn_gate.data(), L.ffn_pre.data(), nh,
                      cfg.ffn_activation());
      } else {
        activation_forward(L.ffn_hidden.data(), L.ffn_pre.data(), nh, cfg.ffn_activation());
      }
      store(L.ffn_hidden, name, "ffn_hidden");
      hidden_dropped = apply_dropout(dropped_buf.data(), L.ffn_hidden.data(), L.masks.ffn, nh,
                                     prefix + "ffn", p, drop, seed);
      // The product reads the dropped hidden in the format: rounded (and checked) here, by name.
      if (drop) store(dropped_buf, name, "ffn_hidden after dropout");
    }
  }
  {
    profile::Scope stage(Stage::ffn_fc2);
    linear_forward(L.ffn_out.data(), hidden_dropped, P.fc2_weight.data(), data_or_null(P.fc2_bias),
                   d.N, d.F, d.D);
    store(L.ffn_out, name, "ffn_out");
  }
}

// The FFN block, from L.residual1 to L.output: the norm before the FFN (norm2 pre-norm, norm1
// post-norm), the FFN, the second residual and the output (post-norm: through norm2).
template <class Real>
void LayerForward<Real>::ffn_block_forward() const {
  const Real* ffn_in;  // the FFN's input, and the second residual's base
  {
    profile::Scope norm_scope(Stage::layer_norm);
    if (cfg.norms.norm_first) {
      norm_forward(cfg, L.norm2.data(), L.norm2_mean.data(), L.norm2_rstd.data(),
                   L.residual1.data(), P.norm2_weight.data(), data_or_null(P.norm2_bias), d.N, d.D);
      store(L.norm2, name, "norm2");
      ffn_in = L.norm2.data();
    } else {
      norm_forward(cfg, L.norm1.data(), L.norm1_mean.data(), L.norm1_rstd.data(),
                   L.residual1.data(), P.norm1_weight.data(), data_or_null(P.norm1_bias), d.N, d.D);
      store(L.norm1, name, "norm1");
      ffn_in = L.norm1.data();
    }
  }
  const Real* base = cfg.norms.norm_first ? L.residual1.data() : L.norm1.data();

  if (P.moe) {
    profile::Scope stage(Stage::ffn_fc1);
    moe_block_forward(cfg, P, L, ffn_in, d.N, routing, name, store);
  } else {
    ffn_forward(ffn_in);
  }
  // residual2 = base + dropout(ffn_out)
  {
    profile::Scope stage(Stage::residual);
    add3(L.residual2.data(), base,
         apply_dropout(tmp.data(), L.ffn_out.data(), L.masks.residual2, nd, prefix + "residual2", p,
                       drop, seed),
         nd);
    store(L.residual2, name, "residual2");
  }

  if (cfg.norms.norm_first) {
    {
      profile::Scope stage(Stage::residual);
      copy(L.output.data(), L.residual2.data(), nd);
    }
  } else {
    {
      profile::Scope stage(Stage::layer_norm);
      norm_forward(cfg, L.norm2.data(), L.norm2_mean.data(), L.norm2_rstd.data(),
                   L.residual2.data(), P.norm2_weight.data(), data_or_null(P.norm2_bias), d.N, d.D);
      store(L.norm2, name, "norm2");
      copy(L.output.data(), L.norm2.data(), nd);
    }
  }
}

}  // namespace

template <class Real>
void layer_forward(const ModelConfig& cfg, index_t layer, const LayerParams<Real>& P,
                   LayerActs<Real>& L, const Real* x, const Batch& batch, const Dims& d,
                   const std::string& prefix, bool drop, const MaskSource& seed,
                   const Emulation<Real>& store, const std::int32_t* routing) {
  const index_t nd = d.N * d.D;
  const std::string_view name = std::string_view(prefix).substr(8);  // "layers.{i}."

  const double p = cfg.dropout;
  // (B, S, D) scratch for a dropped residual branch; without dropout the branch is used as is.
  // Scratch that is overwritten entirely before it is read.
  Tensor<Real> tmp = drop ? Tensor<Real>::for_overwrite({d.B, d.S, d.D}) : Tensor<Real>();

  const LayerForward<Real> s{.cfg = cfg,
                             .layer = layer,
                             .P = P,
                             .L = L,
                             .batch = batch,
                             .d = d,
                             .prefix = prefix,
                             .name = name,
                             .drop = drop,
                             .seed = seed,
                             .store = store,
                             .routing = routing,
                             .nd = nd,
                             .p = p,
                             .tmp = tmp};
  s.attention_block_forward(x);
  s.ffn_block_forward();
}

// ---------------------------------------------------------------------------------------------
// Backward

namespace {

// What every stage of one layer's backward pass reads.
template <class Real>
struct LayerBackward {
  const ModelConfig& cfg;
  index_t layer;
  const LayerParams<Real>& P;
  const LayerActs<Real>& L;     // the forward pass's activations
  LayerParams<Real>& G;         // the parameter gradients, accumulated into
  LayerActs<Real>& dL;          // the activation gradients, each overwritten by its first writer
  const std::int64_t* lengths;  // (B)
  const Dims& d;
  std::string_view name;  // "layers.{i}.", naming the rounded tensors
  const Emulation<Real>& store;
  index_t nd;               // N * D
  double p;                 // the dropout probability
  Real scale;               // the dropout's scale
  const Real* moe_dlogits;  // an MoE layer's loss-term gradient of its logits, or null

  // its stages: the attention block (which runs qkv_forward), then the FFN block (ffn_forward)
  void ffn_backward(Real* dffn_in, const Real* ffn_in) const;
  void ffn_block_backward() const;
  void qkv_backward(Real* dattn_in, const Real* attn_in) const;
  void attention_block_backward(Real* dx, const Real* x) const;
};

// dL.ffn_pre and the gradients of fc1 and fc2 from dL.ffn_out; dffn_in (B, S, D) is overwritten
// (pre-norm: norm2, its only reader) or accumulated into (post-norm: norm1, also the second
// residual's base).
template <class Real>
void LayerBackward<Real>::ffn_backward(Real* dffn_in, const Real* ffn_in) const {
  // ffn_out = fc2(hidden_dropped); hidden_dropped = dropout(ffn_hidden). Without a mask the
  // dropout is the identity: fc2 reads ffn_hidden and writes its gradient straight into
  // dL.ffn_hidden, overwriting it. With one, both go through a scratch buffer, and the dropout's
  // gradient overwrites dL.ffn_hidden.
  const bool ffn_dropped = !L.masks.ffn.empty();
  Tensor<Real> hidden_dropped =
      ffn_dropped ? Tensor<Real>::for_overwrite({d.B, d.S, d.F}) : Tensor<Real>();
  Tensor<Real> dhidden_dropped =
      ffn_dropped ? Tensor<Real>::for_overwrite({d.B, d.S, d.F}) : Tensor<Real>();
  {
    profile::Scope stage(Stage::bwd_ffn_fc2);
    if (ffn_dropped) {
      dropout_forward(hidden_dropped.data(), L.ffn_hidden.data(), L.masks.ffn.data(),
                      L.ffn_hidden.numel(), scale);
    }
    linear_backward(ffn_dropped ? dhidden_dropped.data() : dL.ffn_hidden.data(),
                    G.fc2_weight.data(), data_or_null(G.fc2_bias), dL.ffn_out.data(),
                    ffn_dropped ? hidden_dropped.data() : L.ffn_hidden.data(), P.fc2_weight.data(),
                    d.N, d.F, d.D, GradWrite::overwrite);
  }
  // dL.ffn_pre is overwritten too: the activation is its only writer. The dropout's and the
  // activation's gradients run as one pass (ffn_hidden_backward) unless dL.ffn_hidden is rounded
  // in between.
  {
    profile::Scope stage(Stage::bwd_activation);
    const std::uint8_t* mask = ffn_dropped ? L.masks.ffn.data() : nullptr;
    if (d.gated) {
      if (mask) {
        dropout_backward(dL.ffn_hidden.data(), dhidden_dropped.data(), mask, dL.ffn_hidden.numel(),
                         scale, GradWrite::overwrite);
      }
      store(dL.ffn_hidden, name, "ffn_hidden");
      gated_backward(dL.ffn_gate.data(), dL.ffn_pre.data(), dL.ffn_hidden.data(), L.ffn_gate.data(),
                     L.ffn_pre.data(), L.ffn_pre.numel(), cfg.ffn_activation());
      store(dL.ffn_gate, name, "ffn_gate");
    } else if (!store.stores_reduced()) {
      ffn_hidden_backward(dL.ffn_pre.data(), dL.ffn_hidden.data(), dhidden_dropped.data(), mask,
                          scale, L.ffn_pre.data(), d.N, d.F, cfg.ffn_activation());
    } else {
      if (mask) {
        dropout_backward(dL.ffn_hidden.data(), dhidden_dropped.data(), mask, dL.ffn_hidden.numel(),
                         scale, GradWrite::overwrite);
      }
      store(dL.ffn_hidden, name, "ffn_hidden");
      activation_backward(dL.ffn_pre.data(), dL.ffn_hidden.data(), L.ffn_pre.data(),
                          L.ffn_pre.numel(), cfg.ffn_activation(), GradWrite::overwrite);
    }
    store(dL.ffn_pre, name, "ffn_pre");
  }
  // ffn_pre = fc1(ffn_in), and ffn_gate = gate(ffn_in): the gate's term first
  {
    profile::Scope stage(Stage::bwd_ffn_fc1);
    GradWrite write = cfg.norms.norm_first ? GradWrite::overwrite : GradWrite::accumulate;
    if (d.gated) {
      linear_backward(dffn_in, G.gate_weight.data(), data_or_null(G.gate_bias), dL.ffn_gate.data(),
                      ffn_in, P.gate_weight.data(), d.N, d.D, d.F, write);
      write = GradWrite::accumulate;
    }
    linear_backward(dffn_in, G.fc1_weight.data(), data_or_null(G.fc1_bias), dL.ffn_pre.data(),
                    ffn_in, P.fc1_weight.data(), d.N, d.D, d.F, write);
    store(dffn_in, nd, name, cfg.norms.norm_first ? "norm2" : "norm1");
  }
}

// The FFN block in reverse, from dL.output to dL.residual1: the output, the second residual, the
// FFN and the norm before it.
template <class Real>
void LayerBackward<Real>::ffn_block_backward() const {
  // in the forward pass this was: output = LN2(residual2) (post) or residual2 (pre)
  {
    profile::Scope stage(Stage::bwd_layer_norm);
    if (cfg.norms.norm_first) {
      copy(dL.residual2.data(), dL.output.data(), nd);
    } else {
      copy(dL.norm2.data(), dL.output.data(), nd);
      norm_backward(cfg, dL.residual2.data(), G.norm2_weight.data(), data_or_null(G.norm2_bias),
                    dL.norm2.data(), L.residual2.data(), P.norm2_weight.data(), L.norm2_mean.data(),
                    L.norm2_rstd.data(), d.N, d.D, GradWrite::overwrite);
      store(dL.residual2, name, "residual2");
    }
  }
  // residual2 = base + dropout(ffn_out); base = residual1 (pre) or norm1 (post)
  Real* dbase = cfg.norms.norm_first ? dL.residual1.data() : dL.norm1.data();
  {
    profile::Scope stage(Stage::bwd_residual);
    dropout_grad(dL.ffn_out.data(), dL.residual2.data(), L.masks.residual2, nd, p);
    store(dL.ffn_out, name, "ffn_out");
    assign_sum(dbase, dL.residual2.data(), nd);  // its first writer
  }

  // ffn_pre = fc1(ffn_in); ffn_in = norm2 (pre), its only reader, or norm1 (post), also the
  // second residual's base
  const Real* ffn_in = cfg.norms.norm_first ? L.norm2.data() : L.norm1.data();
  Real* dffn_in = cfg.norms.norm_first ? dL.norm2.data() : dL.norm1.data();
  if (P.moe) {
    profile::Scope stage(Stage::bwd_ffn_fc1);
    moe_block_backward(cfg, P, L, G, dL, ffn_in, dffn_in,
                       cfg.norms.norm_first ? GradWrite::overwrite : GradWrite::accumulate, d.N,
                       moe_dlogits, name, store);
    store(dffn_in, nd, name, cfg.norms.norm_first ? "norm2" : "norm1");
  } else {
    ffn_backward(dffn_in, ffn_in);
  }

  // the norm between the two residuals: LN2(residual1) (pre) or LN1(residual1) (post)
  {
    profile::Scope stage(Stage::bwd_layer_norm);
    if (cfg.norms.norm_first) {
      norm_backward(cfg, dL.residual1.data(), G.norm2_weight.data(), data_or_null(G.norm2_bias),
                    dL.norm2.data(), L.residual1.data(), P.norm2_weight.data(), L.norm2_mean.data(),
                    L.norm2_rstd.data(), d.N, d.D);
    } else {
      norm_backward(cfg, dL.residual1.data(), G.norm1_weight.data(), data_or_null(G.norm1_bias),
                    dL.norm1.data(), L.residual1.data(), P.norm1_weight.data(), L.norm1_mean.data(),
                    L.norm1_rstd.data(), d.N, d.D, GradWrite::overwrite);
    }
    store(dL.residual1, name, "residual1");
  }
}

// q, k, v = split(attn_in * W^T + b): dattn_in (B, S, D) is overwritten (pre-norm: norm1) or
// accumulated into (post-norm: dx, which the first residual wrote), and the gradients of the
// three projections accumulate.
template <class Real>
void LayerBackward<Real>::qkv_backward(Real* dattn_in, const Real* attn_in) const {
  // One product against [Wq; Wk; Wv] as in the forward pass: d attn_in sums over all 3D outputs
  // in one dot product; the weight and bias gradients are the same sums as per projection.
  profile::Scope stage(Stage::bwd_qkv_proj);
  const QkvLayout lay(d);
  auto wqkv = Tensor<Real>::for_overwrite({lay.width, d.D});
  auto bqkv = Tensor<Real>::for_overwrite({lay.width});
  stack_qkv(wqkv.data(), bqkv.data(), P, lay, d.D);
  auto dqkv = Tensor<Real>::for_overwrite({d.B, d.S, lay.width});  // merged whole
  const Tensor<Real>* dheads[3] = {&dL.q, &dL.k, &dL.v};
  if (dqkv.numel() > 0) {
    for (int i = 0; i < 3; ++i)
      merge_heads(dqkv.data() + lay.at[i], dheads[i]->data(), d.B, d.S, lay.heads[i], d.Dh,
                  lay.width);
  }
  Tensor<Real> gw({lay.width, d.D}), gb({lay.width});
  linear_backward(dattn_in, gw.data(), P.has_attn_bias ? gb.data() : nullptr, dqkv.data(), attn_in,
                  wqkv.data(), d.N, d.D, lay.width,
                  cfg.norms.norm_first ? GradWrite::overwrite : GradWrite::accumulate);
  Tensor<Real>* gws[3] = {&G.q_weight, &G.k_weight, &G.v_weight};
  Tensor<Real>* gbs[3] = {&G.q_bias, &G.k_bias, &G.v_bias};
  for (int i = 0; i < 3; ++i) {
    add(gws[i]->data(), gw.data() + lay.at[i] * d.D, lay.rows[i] * d.D);
    if (P.has_attn_bias) add(gbs[i]->data(), gb.data() + lay.at[i], lay.rows[i]);
  }
}

// The attention block in reverse, from dL.residual1 to dx (B, S, D), the gradient of the layer's
// input x: the first residual, the output projection, attention, RoPE, the q/k/v projection and
// norm1 (pre-norm).
template <class Real>
void LayerBackward<Real>::attention_block_backward(Real* dx, const Real* x) const {
  // residual1 = x + dropout(attn_out)
  {
    profile::Scope stage(Stage::bwd_residual);
    assign_sum(dx, dL.residual1.data(), nd);  // its first writer
    dropout_grad(dL.attn_out.data(), dL.residual1.data(), L.masks.residual1, nd, p);
    store(dL.attn_out, name, "attn_out");
  }
  // attn_out = context * Wo^T + bo
  {
    profile::Scope stage(Stage::bwd_out_proj);
    linear_backward(dL.context.data(), G.o_weight.data(), data_or_null(G.o_bias),
                    dL.attn_out.data(), L.context.data(), P.o_weight.data(), d.N, d.Dc, d.D,
                    GradWrite::overwrite);
    store(dL.context, name, "context");
  }
  // dcontext is read in its merged (B, S, Dq) layout, head by head.
  {
    profile::Scope stage(Stage::bwd_attention);
    AttentionArgs<Real> args =
        detail::attention_args(cfg, d.B, d.S, lengths, P.sinks.data(), G.sinks.data());
    args.variant.window = cfg.window(layer);
    args.drop_mask = L.masks.attn.empty() ? nullptr : L.masks.attn.data();
    args.drop_scale = scale;
    args.merged_context = true;
    args.qkv_write = GradWrite::overwrite;
    store.named(name, [&] {
      attention_backward(args, {.dq = attended(d, dL.q, dL.q_norm, dL.q_rot).data(),
                                .dk = attended(d, dL.k, dL.k_norm, dL.k_rot).data(),
                                .dv = dL.v.data(),
                                .dprobs = dL.probs.data(),
                                .dscores = dL.scores.data(),
                                .dcontext = dL.context.data(),
                                .q = attended(d, L.q, L.q_norm, L.q_rot).data(),
                                .k = attended(d, L.k, L.k_norm, L.k_rot).data(),
                                .v = L.v.data(),
                                .probs = L.probs.data()});
    });
  }
  // q, k, v = split(attn_in * W^T + b); attn_in = LN1(x) (pre) or x (post)
  const Real* attn_in = cfg.norms.norm_first ? L.norm1.data() : x;
  Real* dattn_in = dx;
  if (cfg.norms.norm_first) dattn_in = dL.norm1.data();
  if (d.mla) {
    // MLA's RoPE, expansion and latents in reverse, into dattn_in as qkv_backward's
    mla_backward(cfg, P, L, G, dL, dattn_in, attn_in, d, name, store);
  } else {
    profile::Scope stage(Stage::bwd_attention);
    if (d.rope) {
      // in the forward pass this was: q_rot, k_rot = RoPE(q), RoPE(k)
      store(dL.q_rot, name, "q_rot");
      store(dL.k_rot, name, "k_rot");
      const RopeTables<Real> t(cfg, d.S);
      rope_backward((d.qk_norm ? dL.q_norm : dL.q).data(), dL.q_rot.data(), t.cos.data(),
                    t.sin.data(), d.B * d.H, d.S, d.Dh, cfg.rotary(), cfg.attention.rope_style);
      rope_backward((d.qk_norm ? dL.k_norm : dL.k).data(), dL.k_rot.data(), t.cos.data(),
                    t.sin.data(), d.B * d.K, d.S, d.Dh, cfg.rotary(), cfg.attention.rope_style);
    }
    if (d.qk_norm) {
      // in the forward pass: q_norm, k_norm = RMSNorm(q), RMSNorm(k) per head
      store(dL.q_norm, name, "q_norm");
      store(dL.k_norm, name, "k_norm");
      rms_norm_backward(dL.q.data(), G.q_norm_weight.data(), dL.q_norm.data(), L.q.data(),
                        P.q_norm_weight.data(), L.q_norm_rstd.data(), d.B * d.H * d.S, d.Dh,
                        GradWrite::overwrite);
      rms_norm_backward(dL.k.data(), G.k_norm_weight.data(), dL.k_norm.data(), L.k.data(),
                        P.k_norm_weight.data(), L.k_norm_rstd.data(), d.B * d.K * d.S, d.Dh,
                        GradWrite::overwrite);
    }
    store(dL.q, name, "q");
    store(dL.k, name, "k");
    store(dL.v, name, "v");
  }
  if (!d.mla) qkv_backward(dattn_in, attn_in);
  if (cfg.norms.norm_first) {
    profile::Scope stage(Stage::bwd_layer_norm);
    store(dL.norm1, name, "norm1");
    norm_backward(cfg, dx, G.norm1_weight.data(), data_or_null(G.norm1_bias), dL.norm1.data(), x,
                  P.norm1_weight.data(), L.norm1_mean.data(), L.norm1_rstd.data(), d.N, d.D);
  }
}

}  // namespace

template <class Real>
void layer_backward(const ModelConfig& cfg, index_t layer, const LayerParams<Real>& P,
                    const LayerActs<Real>& L, LayerParams<Real>& G, LayerActs<Real>& dL, Real* dx,
                    const Real* x, const std::int64_t* lengths, const Dims& d,
                    std::string_view name, const Emulation<Real>& store, const Real* moe_dlogits) {
  const index_t nd = d.N * d.D;
  const double p = cfg.dropout;
  const Real scale = dropout_scale<Real>(p);

  const LayerBackward<Real> s{.cfg = cfg,
                              .layer = layer,
                              .P = P,
                              .L = L,
                              .G = G,
                              .dL = dL,
                              .lengths = lengths,
                              .d = d,
                              .name = name,
                              .store = store,
                              .nd = nd,
                              .p = p,
                              .scale = scale,
                              .moe_dlogits = moe_dlogits};
  s.ffn_block_backward();
  s.attention_block_backward(dx, x);
}

#define TEO_INSTANTIATE(Real)                                                                      \
  template void allocate_layer<Real>(LayerActs<Real>&, const Dims&, ZeroList<Real>*, bool);        \
  template void layer_forward<Real>(const ModelConfig&, index_t, const LayerParams<Real>&,         \
                                    LayerActs<Real>&, const Real*, const Batch&, const Dims&,      \
                                    const std::string&, bool, const MaskSource&,                   \
                                    const Emulation<Real>&, const std::int32_t*);                  \
  template void layer_backward<Real>(const ModelConfig&, index_t, const LayerParams<Real>&,        \
                                     const LayerActs<Real>&, LayerParams<Real>&, LayerActs<Real>&, \
                                     Real*, const Real*, const std::int64_t*, const Dims&,         \
                                     std::string_view, const Emulation<Real>&, const Real*);
TEO_INSTANTIATE(float)
TEO_INSTANTIATE(double)
#undef TEO_INSTANTIATE

}  // namespace teo::detail
