// One decoder layer, forward and backward: self-attention, cross-attention to the memory and the
// FFN, each with its residual and norm (docs/semantics.md, section 17.4). It is built from the
// layer functions the encoder layer uses (linear, attention with queries and keys of different
// lengths, the norms, the FFN's middle), in the same operation order per block.
#include "teo/decoder_layer.hpp"

#include <initializer_list>
#include <string>
#include <tuple>

#include "model/pass.hpp"
#include "teo/errors.hpp"
#include "teo/layers/attention.hpp"
#include "teo/layers/feed_forward.hpp"
#include "teo/layers/linear.hpp"

namespace teo {

namespace {

using detail::data_or_null;

// The sizes of one call: B sequences of T target rows, Se memory rows.
struct Sizes {
  index_t B, T, Se, D, H, K, Dh, F;
  index_t N() const { return B * T; }
};

// Each tensor of a's block, made by make(shape).
template <class Real, class Make>
void block_of(AttentionParams<Real>& a, const ModelConfig& cfg, const Make& make) {
  const index_t D = cfg.d_model, Dkv = cfg.kv_heads() * cfg.d_head();
  a.q_weight = make({D, D});
  a.k_weight = make({Dkv, D});
  a.v_weight = make({Dkv, D});
  a.o_weight = make({D, D});
  if (cfg.attention.attn_bias) {
    a.q_bias = make({D});
    a.k_bias = make({Dkv});
    a.v_bias = make({Dkv});
  }
  if (cfg.attention.out_bias()) a.o_bias = make({D});
}

// The layer's tensors for cfg, each made by make(shape).
template <class Real, class Make>
DecoderLayerParams<Real> layer_of(const ModelConfig& cfg, bool cross, const Make& make) {
  DecoderLayerParams<Real> p;
  const index_t D = cfg.d_model, F = cfg.ffn.d_ff;
  block_of(p.self_attn, cfg, make);
  if (cross) block_of(p.cross_attn, cfg, make);
  const bool ln = cfg.norms.norm == Norm::layernorm;
  for (auto [w, b, on] : {std::tuple{&p.norm1_weight, &p.norm1_bias, true},
                          std::tuple{&p.norm2_weight, &p.norm2_bias, cross},
                          std::tuple{&p.norm3_weight, &p.norm3_bias, true}}) {
    if (!on) continue;
    *w = make({D});
    if (ln) *b = make({D});
  }
  if (cfg.gated()) p.gate_weight = make({F, D});
  p.fc1_weight = make({F, D});
  p.fc2_weight = make({D, F});
  if (cfg.ffn.ffn_bias) {
    if (cfg.gated()) p.gate_bias = make({F});
    p.fc1_bias = make({F});
    p.fc2_bias = make({D});
  }
  return p;
}

void expect_shape(const Shape& got, const Shape& want, const char* what) {
  if (!(got == want)) {
    throw ShapeError(std::string("decoder layer: ") + what + " is " + got.str() + ", expected " +
                     want.str());
  }
}

void expect_lengths(const std::vector<std::int64_t>& len, index_t B, index_t max,
                    const char* what) {
  if (static_cast<index_t>(len.size()) != B) {
    throw ShapeError(std::string("decoder layer: ") + what + " has " + std::to_string(len.size()) +
                     " entries for batch " + std::to_string(B));
  }
  for (auto l : len) {
    if (l < 0 || l > max) {
      throw ShapeError(std::string("decoder layer: ") + what + " holds " + std::to_string(l) +
                       ", outside [0, " + std::to_string(max) + "]");
    }
  }
}

// The sizes of x and memory, checked against cfg, P and the lengths.
template <class Real>
Sizes check(const ModelConfig& cfg, const DecoderLayerParams<Real>& P, const Tensor<Real>& x,
            const std::vector<std::int64_t>& lengths, const Tensor<Real>& memory,
            const std::vector<std::int64_t>& memory_lengths) {
  cfg.validate();
  if (cfg.dropout > 0)
    throw ConfigError("decoder layer: dropout is not applied here (eval mode); set dropout 0");
  if (x.shape().rank() != 3) throw ShapeError("decoder layer: x must be (B, T, D)");
  Sizes s{x.shape()[0],   x.shape()[1], 0,           cfg.d_model, cfg.attention.num_heads,
          cfg.kv_heads(), cfg.d_head(), cfg.ffn.d_ff};
  expect_shape(x.shape(), Shape({s.B, s.T, s.D}), "x");
  expect_lengths(lengths, s.B, s.T, "lengths");
  const auto want = DecoderLayerParams<Real>::zeros(cfg, P.cross());
  std::vector<Shape> shapes;
  want.visit(cfg.norms.norm_first,
             [&](const std::string&, const Tensor<Real>& t) { shapes.push_back(t.shape()); });
  std::size_t k = 0;
  P.visit(cfg.norms.norm_first, [&](const std::string& n, const Tensor<Real>& t) {
    if (k >= shapes.size() || !(t.shape() == shapes[k]))
      throw ShapeError("decoder layer: parameter " + n + " is " + t.shape().str() +
                       ", not of cfg's shapes");
    ++k;
  });
  if (k != shapes.size()) throw ShapeError("decoder layer: the parameters are not cfg's");
  if (P.cross()) {
    if (memory.shape().rank() != 3) throw ShapeError("decoder layer: memory must be (B, Se, D)");
    s.Se = memory.shape()[1];
    expect_shape(memory.shape(), Shape({s.B, s.Se, s.D}), "memory");
    expect_lengths(memory_lengths, s.B, s.Se, "memory_lengths");
  } else if (memory.numel() > 0 || !memory_lengths.empty()) {
    throw ShapeError("decoder layer: a memory without cross-attention parameters");
  }
  return s;
}

// The attention call of one block: T queries per sequence (lengths), over Skv keys (kv_lengths,
// or the queries' own with self-attention).
template <class Real>
AttentionArgs<Real> block_args(const ModelConfig& cfg, const Sizes& s, bool cross,
                               const std::vector<std::int64_t>& lengths,
                               const std::vector<std::int64_t>& memory_lengths) {
  AttentionArgs<Real> a;
  a.batch = s.B;
  a.heads = s.H;
  a.seq_len = s.T;
  a.d_head = s.Dh;
  a.lengths = lengths.data();
  a.causal = cross ? false : cfg.attention.causal;
  a.variant.kv_heads = s.K;
  a.merged_context = true;
  if (cross) {
    a.kv_len = s.Se;
    a.kv_lengths = memory_lengths.data();
  }
  return a;
}

// One attention block: queries from qin (B T, D), keys and values from kvin (B Skv, D).
template <class Real>
void block_forward(const AttentionArgs<Real>& args, const AttentionParams<Real>& P,
                   AttentionBlockActs<Real>& A, const Sizes& s, index_t Skv, const Real* qin,
                   const Real* kvin) {
  const index_t N = s.N(), Nkv = s.B * Skv, Dkv = s.K * s.Dh;
  A.q = Tensor<Real>::for_overwrite({s.B, s.H, s.T, s.Dh});
  A.k = Tensor<Real>::for_overwrite({s.B, s.K, Skv, s.Dh});
  A.v = Tensor<Real>::for_overwrite({s.B, s.K, Skv, s.Dh});
  A.scores = Tensor<Real>::for_overwrite({s.B, s.H, s.T, Skv});
  A.probs = Tensor<Real>::for_overwrite({s.B, s.H, s.T, Skv});
  A.context = Tensor<Real>({s.B, s.T, s.D});
  A.out = Tensor<Real>::for_overwrite({s.B, s.T, s.D});
  auto proj = Tensor<Real>::for_overwrite({std::max(N, Nkv), std::max(s.D, Dkv)});
  if (N > 0) {
    linear_forward(proj.data(), qin, P.q_weight.data(), data_or_null(P.q_bias), N, s.D, s.D);
    split_heads(A.q.data(), proj.data(), s.B, s.T, s.H, s.Dh);
  }
  if (Nkv > 0) {
    linear_forward(proj.data(), kvin, P.k_weight.data(), data_or_null(P.k_bias), Nkv, s.D, Dkv);
    split_heads(A.k.data(), proj.data(), s.B, Skv, s.K, s.Dh);
    linear_forward(proj.data(), kvin, P.v_weight.data(), data_or_null(P.v_bias), Nkv, s.D, Dkv);
    split_heads(A.v.data(), proj.data(), s.B, Skv, s.K, s.Dh);
  }
  // With no key rows every query sees nothing: its context stays 0.
  if (N > 0 && Skv > 0) {
    attention_forward(args, {.context = A.context.data(),
                             .scores = A.scores.data(),
                             .probs = A.probs.data(),
                             .q = A.q.data(),
                             .k = A.k.data(),
                             .v = A.v.data()});
  }
  if (N > 0)
    linear_forward(A.out.data(), A.context.data(), P.o_weight.data(), data_or_null(P.o_bias), N,
                   s.D, s.D);
}

// Its backward from dout (B T, D): dqin and dkvin accumulated into (the same buffer for
// self-attention), G's gradients accumulated into.
template <class Real>
void block_backward(const AttentionArgs<Real>& args, const AttentionParams<Real>& P,
                    const AttentionBlockActs<Real>& A, AttentionParams<Real>& G, const Sizes& s,
                    index_t Skv, const Real* dout, const Real* qin, const Real* kvin, Real* dqin,
                    Real* dkvin) {
  const index_t N = s.N(), Nkv = s.B * Skv, Dkv = s.K * s.Dh;
  if (N == 0) return;
  auto dcontext = Tensor<Real>::for_overwrite({s.B, s.T, s.D});
  linear_backward(dcontext.data(), G.o_weight.data(), data_or_null(G.o_bias), dout,
                  A.context.data(), P.o_weight.data(), N, s.D, s.D, GradWrite::overwrite);
  Tensor<Real> dq({s.B, s.H, s.T, s.Dh}), dk({s.B, s.K, Skv, s.Dh}), dv({s.B, s.K, Skv, s.Dh});
  if (Skv > 0) {
    auto dprobs = Tensor<Real>::for_overwrite({s.B, s.H, s.T, Skv});
    auto dscores = Tensor<Real>::for_overwrite({s.B, s.H, s.T, Skv});
    attention_backward(args, {.dq = dq.data(),
                              .dk = dk.data(),
                              .dv = dv.data(),
                              .dprobs = dprobs.data(),
                              .dscores = dscores.data(),
                              .dcontext = dcontext.data(),
                              .q = A.q.data(),
                              .k = A.k.data(),
                              .v = A.v.data(),
                              .probs = A.probs.data()});
  }
  auto merged = Tensor<Real>::for_overwrite({std::max(N, Nkv), std::max(s.D, Dkv)});
  merge_heads(merged.data(), dq.data(), s.B, s.T, s.H, s.Dh);
  linear_backward(dqin, G.q_weight.data(), data_or_null(G.q_bias), merged.data(), qin,
                  P.q_weight.data(), N, s.D, s.D);
  if (Nkv == 0) return;
  merge_heads(merged.data(), dk.data(), s.B, Skv, s.K, s.Dh);
  linear_backward(dkvin, G.k_weight.data(), data_or_null(G.k_bias), merged.data(), kvin,
                  P.k_weight.data(), Nkv, s.D, Dkv);
  merge_heads(merged.data(), dv.data(), s.B, Skv, s.K, s.Dh);
  linear_backward(dkvin, G.v_weight.data(), data_or_null(G.v_bias), merged.data(), kvin,
                  P.v_weight.data(), Nkv, s.D, Dkv);
}

template <class Real>
void norm_fwd(const ModelConfig& cfg, Tensor<Real>& out, Tensor<Real>& mean, Tensor<Real>& rstd,
              const Real* x, const Tensor<Real>& w, const Tensor<Real>& b, const Sizes& s) {
  out = Tensor<Real>::for_overwrite({s.B, s.T, s.D});
  mean = Tensor<Real>({s.N()});
  rstd = Tensor<Real>({s.N()});
  if (s.N() > 0)
    detail::norm_forward(cfg, out.data(), mean.data(), rstd.data(), x, w.data(), data_or_null(b),
                         s.N(), s.D);
}

}  // namespace

template <class Real>
DecoderLayerParams<Real> DecoderLayerParams<Real>::zeros(const ModelConfig& cfg, bool cross) {
  return layer_of<Real>(cfg, cross,
                        [](std::initializer_list<index_t> dims) { return Tensor<Real>(dims); });
}

template <class Real>
DecoderLayerParams<Real> DecoderLayerParams<Real>::markers(const ModelConfig& cfg, bool cross) {
  return layer_of<Real>(cfg, cross,
                        [](std::initializer_list<index_t>) { return Tensor<Real>({1}); });
}

template <class Real>
void decoder_layer_forward(const ModelConfig& cfg, const DecoderLayerParams<Real>& P,
                           const Tensor<Real>& x, const std::vector<std::int64_t>& lengths,
                           const Tensor<Real>& memory,
                           const std::vector<std::int64_t>& memory_lengths,
                           DecoderLayerActs<Real>& A) {
  const Sizes s = check(cfg, P, x, lengths, memory, memory_lengths);
  const bool pre = cfg.norms.norm_first, cross = P.cross();
  const index_t N = s.N(), nd = N * s.D;
  const auto block = [&](bool is_cross, const Tensor<Real>& w, const Tensor<Real>& b,
                         Tensor<Real>& norm, Tensor<Real>& mean, Tensor<Real>& rstd,
                         Tensor<Real>& residual, const Real* in) -> const Real* {
    // pre: residual = in + block(norm(in)); post: norm(residual = in + block(in))
    const Real* q_in = in;
    if (pre) {
      norm_fwd(cfg, norm, mean, rstd, in, w, b, s);
      q_in = norm.data();
    }
    const auto& args = block_args<Real>(cfg, s, is_cross, lengths, memory_lengths);
    auto& acts = is_cross ? A.cross_attn : A.self_attn;
    block_forward(args, is_cross ? P.cross_attn : P.self_attn, acts, s, is_cross ? s.Se : s.T, q_in,
                  is_cross ? memory.data() : q_in);
    residual = Tensor<Real>::for_overwrite({s.B, s.T, s.D});
    if (nd > 0) detail::add3(residual.data(), in, acts.out.data(), nd);
    if (pre) return residual.data();
    norm_fwd(cfg, norm, mean, rstd, residual.data(), w, b, s);
    return norm.data();
  };
  const Real* h = block(false, P.norm1_weight, P.norm1_bias, A.norm1, A.norm1_mean, A.norm1_rstd,
                        A.residual1, x.data());
  if (cross) {
    h = block(true, P.norm2_weight, P.norm2_bias, A.norm2, A.norm2_mean, A.norm2_rstd, A.residual2,
              h);
  } else {
    A.cross_attn = {};
    A.norm2 = A.norm2_mean = A.norm2_rstd = A.residual2 = Tensor<Real>();
  }
  // the FFN block
  const Real* ffn_in = h;
  if (pre) {
    norm_fwd(cfg, A.norm3, A.norm3_mean, A.norm3_rstd, h, P.norm3_weight, P.norm3_bias, s);
    ffn_in = A.norm3.data();
  }
  A.ffn_pre = Tensor<Real>::for_overwrite({s.B, s.T, s.F});
  A.ffn_hidden = Tensor<Real>::for_overwrite({s.B, s.T, s.F});
  A.ffn_gate = cfg.gated() ? Tensor<Real>::for_overwrite({s.B, s.T, s.F}) : Tensor<Real>();
  A.ffn_out = Tensor<Real>::for_overwrite({s.B, s.T, s.D});
  A.residual3 = Tensor<Real>::for_overwrite({s.B, s.T, s.D});
  if (N > 0) {
    linear_forward(A.ffn_pre.data(), ffn_in, P.fc1_weight.data(), data_or_null(P.fc1_bias), N, s.D,
                   s.F);
    if (cfg.gated()) {
      linear_forward(A.ffn_gate.data(), ffn_in, P.gate_weight.data(), data_or_null(P.gate_bias), N,
                     s.D, s.F);
      gated_forward(A.ffn_hidden.data(), A.ffn_gate.data(), A.ffn_pre.data(), N * s.F,
                    cfg.ffn_activation());
    } else {
      activation_forward(A.ffn_hidden.data(), A.ffn_pre.data(), N * s.F, cfg.ffn_activation());
    }
    linear_forward(A.ffn_out.data(), A.ffn_hidden.data(), P.fc2_weight.data(),
                   data_or_null(P.fc2_bias), N, s.F, s.D);
    detail::add3(A.residual3.data(), h, A.ffn_out.data(), nd);
  }
  if (pre) {
    A.output = A.residual3;
  } else {
    norm_fwd(cfg, A.norm3, A.norm3_mean, A.norm3_rstd, A.residual3.data(), P.norm3_weight,
             P.norm3_bias, s);
    A.output = A.norm3;
  }
}

template <class Real>
void decoder_layer_backward(const ModelConfig& cfg, const DecoderLayerParams<Real>& P,
                            const Tensor<Real>& x, const std::vector<std::int64_t>& lengths,
                            const Tensor<Real>& memory,
                            const std::vector<std::int64_t>& memory_lengths,
                            const DecoderLayerActs<Real>& A, const Tensor<Real>& dy,
                            Tensor<Real>& dx, Tensor<Real>& dmemory, DecoderLayerParams<Real>& G) {
  const Sizes s = check(cfg, P, x, lengths, memory, memory_lengths);
  expect_shape(dy.shape(), x.shape(), "dy");
  const bool pre = cfg.norms.norm_first, cross = P.cross();
  const index_t N = s.N(), nd = N * s.D;
  G = DecoderLayerParams<Real>::zeros(cfg, cross);
  dx = Tensor<Real>({s.B, s.T, s.D});
  dmemory = cross ? Tensor<Real>({s.B, s.Se, s.D}) : Tensor<Real>();
  if (N == 0) return;
  const auto norm_bwd = [&](Real* din, Tensor<Real>& dw, Tensor<Real>& db, const Real* dout,
                            const Real* in, const Tensor<Real>& w, const Tensor<Real>& mean,
                            const Tensor<Real>& rstd, GradWrite write) {
    detail::norm_backward(cfg, din, dw.data(), data_or_null(db), dout, in, w.data(), mean.data(),
                          rstd.data(), N, s.D, write);
  };
  // The stream entering each block: x, then the self-attention block's result h1, then (with
  // cross-attention) h2; post-norm's are the norms' outputs, pre-norm's the residuals.
  const Real* h1 = pre ? A.residual1.data() : A.norm1.data();
  const Real* h2 = cross ? (pre ? A.residual2.data() : A.norm2.data()) : h1;

  // The FFN block, from dy to dh (the gradient of h2).
  Tensor<Real> dh({s.B, s.T, s.D});
  const Real* dres3 = dy.data();
  if (!pre) {
    norm_bwd(dh.data(), G.norm3_weight, G.norm3_bias, dy.data(), A.residual3.data(), P.norm3_weight,
             A.norm3_mean, A.norm3_rstd, GradWrite::overwrite);
    dres3 = dh.data();
  } else {
    detail::copy(dh.data(), dy.data(), nd);
  }
  {
    const Real* ffn_in = pre ? A.norm3.data() : h2;
    auto dhidden = Tensor<Real>::for_overwrite({s.B, s.T, s.F});
    auto dpre = Tensor<Real>::for_overwrite({s.B, s.T, s.F});
    linear_backward(dhidden.data(), G.fc2_weight.data(), data_or_null(G.fc2_bias), dres3,
                    A.ffn_hidden.data(), P.fc2_weight.data(), N, s.F, s.D, GradWrite::overwrite);
    Tensor<Real> dffn_in = pre ? Tensor<Real>({s.B, s.T, s.D}) : Tensor<Real>();
    Real* dffn = pre ? dffn_in.data() : dh.data();  // post: the FFN's input is h2 itself
    if (cfg.gated()) {
      auto dgate = Tensor<Real>::for_overwrite({s.B, s.T, s.F});
      gated_backward(dgate.data(), dpre.data(), dhidden.data(), A.ffn_gate.data(), A.ffn_pre.data(),
                     N * s.F, cfg.ffn_activation());
      linear_backward(dffn, G.gate_weight.data(), data_or_null(G.gate_bias), dgate.data(), ffn_in,
                      P.gate_weight.data(), N, s.D, s.F);
    } else {
      activation_backward(dpre.data(), dhidden.data(), A.ffn_pre.data(), N * s.F,
                          cfg.ffn_activation(), GradWrite::overwrite);
    }
    linear_backward(dffn, G.fc1_weight.data(), data_or_null(G.fc1_bias), dpre.data(), ffn_in,
                    P.fc1_weight.data(), N, s.D, s.F);
    if (pre)
      norm_bwd(dh.data(), G.norm3_weight, G.norm3_bias, dffn_in.data(), h2, P.norm3_weight,
               A.norm3_mean, A.norm3_rstd, GradWrite::accumulate);
  }
  // An attention block, from dh (the gradient of its result) to the gradient of its input, in dh.
  const auto block = [&](bool is_cross, const Tensor<Real>& w, Tensor<Real>& dw, Tensor<Real>& db,
                         const Tensor<Real>& norm, const Tensor<Real>& mean,
                         const Tensor<Real>& rstd, const Tensor<Real>& residual, const Real* in) {
    const auto& args = block_args<Real>(cfg, s, is_cross, lengths, memory_lengths);
    const auto& acts = is_cross ? A.cross_attn : A.self_attn;
    auto& g = is_cross ? G.cross_attn : G.self_attn;
    const auto& p = is_cross ? P.cross_attn : P.self_attn;
    const index_t Skv = is_cross ? s.Se : s.T;
    Tensor<Real> dres({s.B, s.T, s.D});  // the gradient of the residual
    if (pre) {
      detail::copy(dres.data(), dh.data(), nd);
      Tensor<Real> dnorm({s.B, s.T, s.D});
      const Real* q_in = norm.data();
      block_backward(args, p, acts, g, s, Skv, dres.data(), q_in, is_cross ? memory.data() : q_in,
                     dnorm.data(), is_cross ? dmemory.data() : dnorm.data());
      norm_bwd(dh.data(), dw, db, dnorm.data(), in, w, mean, rstd, GradWrite::accumulate);
    } else {
      norm_bwd(dres.data(), dw, db, dh.data(), residual.data(), w, mean, rstd,
               GradWrite::overwrite);
      detail::copy(dh.data(), dres.data(), nd);
      block_backward(args, p, acts, g, s, Skv, dres.data(), in, is_cross ? memory.data() : in,
                     dh.data(), is_cross ? dmemory.data() : dh.data());
    }
  };
  if (cross)
    block(true, P.norm2_weight, G.norm2_weight, G.norm2_bias, A.norm2, A.norm2_mean, A.norm2_rstd,
          A.residual2, h1);
  block(false, P.norm1_weight, G.norm1_weight, G.norm1_bias, A.norm1, A.norm1_mean, A.norm1_rstd,
        A.residual1, x.data());
  dx = std::move(dh);
}

#define TEO_INSTANTIATE(Real)                                                                      \
  template struct DecoderLayerParams<Real>;                                                        \
  template void decoder_layer_forward<Real>(const ModelConfig&, const DecoderLayerParams<Real>&,   \
                                            const Tensor<Real>&, const std::vector<std::int64_t>&, \
                                            const Tensor<Real>&, const std::vector<std::int64_t>&, \
                                            DecoderLayerActs<Real>&);                              \
  template void decoder_layer_backward<Real>(                                                      \
      const ModelConfig&, const DecoderLayerParams<Real>&, const Tensor<Real>&,                    \
      const std::vector<std::int64_t>&, const Tensor<Real>&, const std::vector<std::int64_t>&,     \
      const DecoderLayerActs<Real>&, const Tensor<Real>&, Tensor<Real>&, Tensor<Real>&,            \
      DecoderLayerParams<Real>&);
TEO_INSTANTIATE(float)
TEO_INSTANTIATE(double)
#undef TEO_INSTANTIATE

}  // namespace teo
