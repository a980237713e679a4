#include "teo/model.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string_view>
#include <type_traits>
#include <utility>

#include "kernels/parallel.hpp"
#include "model_internal.hpp"
#include "teo/contract.hpp"
#include "teo/layers/attention.hpp"
#include "teo/layers/cross_entropy.hpp"
#include "teo/layers/dropout.hpp"
#include "teo/layers/embedding.hpp"
#include "teo/layers/feed_forward.hpp"
#include "teo/layers/layer_norm.hpp"
#include "teo/layers/linear.hpp"
#include "teo/layers/pooling.hpp"
#include "teo/layers/positional.hpp"
#include "teo/layers/rope.hpp"
#include "teo/precision.hpp"
#include "teo/profile.hpp"
#include "teo/rng.hpp"

namespace teo {

using profile::Stage;

// ---------------------------------------------------------------------------------------------
// Forward and backward

namespace {

struct Dims {
  index_t B, S, D, H, Dh, F, C, N;  // N = B * S rows
  index_t K, Dkv;                   // K/V heads, and their width K * Dh
  bool rope;                        // q and k are rotated (q_rot, k_rot)
};

Dims dims_of(const EncoderConfig& c, const Batch& b) {
  return {b.batch,
          b.seq_len,
          c.d_model,
          c.num_heads,
          c.d_head(),
          c.d_ff,
          c.num_classes,
          b.batch * b.seq_len,
          c.kv_heads(),
          c.kv_heads() * c.d_head(),
          c.positional == Positional::rope};
}

// RoPE's cos and sin tables (S, r / 2) for cfg and a sequence length.
template <class Real>
struct RopeTables {
  std::vector<Real> cos, sin;
  RopeTables(const EncoderConfig& cfg, index_t seq_len)
      : cos(static_cast<std::size_t>(seq_len * (cfg.rotary() / 2))), sin(cos.size()) {
    rope_table(cos.data(), sin.data(), cfg, seq_len);
  }
};

constexpr index_t kElementGrain = 16384;

// The emulated precision of a pass (docs/semantics.md, "Reduced precision"): checks that it suits
// Real, sets it for gemm() and the attention kernels for the pass's duration, and rounds named
// tensors to the storage format (bf16, fp16) where they are produced. With no reduced precision
// every call is a no-op.
template <class Real>
class Emulation {
 public:
  Emulation(std::optional<Precision> p, const char* kind)
      : p_(p.value_or(std::is_same_v<Real, float> ? Precision::fp32 : Precision::fp64)),
        kind_(kind),
        scope_(std::is_same_v<Real, float> ? p_ : Precision::fp32) {
    const bool ok = std::is_same_v<Real, float> ? p_ != Precision::fp64 : p_ == Precision::fp64;
    if (!ok) {
      throw ConfigError(std::string("precision ") + to_string(p_) + " cannot run in " +
                        (std::is_same_v<Real, float> ? "float" : "double") +
                        " (a float pass emulates fp32, tf32, bf16 or fp16; a double pass is fp64)");
    }
  }
  // True when named tensors are rounded: bf16 and fp16.
  bool stores_reduced() const { return p_ == Precision::bf16 || p_ == Precision::fp16; }

  // Rounds data (n values), named prefix + name, to the storage format.
  void operator()(Real* data, index_t n, std::string_view prefix, const char* name) const {
    if constexpr (std::is_same_v<Real, float>) {
      if (stores_reduced() && round_to(p_, data, n)) {
        throw RangeError(std::string(kind_) + std::string(prefix) + name + ": " +
                         overflow_message(p_));
      }
    }
  }
  void operator()(Tensor<Real>& t, std::string_view prefix, const char* name) const {
    (*this)(t.data(), t.numel(), prefix, name);
  }
  // Runs fn (an attention kernel, which rounds its score and probability rows itself), naming the
  // layer in an overflow it reports.
  template <class F>
  void named(std::string_view prefix, F&& fn) const {
    try {
      fn();
    } catch (const RangeError& e) {
      throw RangeError(std::string(kind_) + std::string(prefix) + e.what());
    }
  }

 private:
  Precision p_;
  const char* kind_;  // "" for activations, "the gradient of " for gradients
  detail::EmulationScope scope_;
};

template <class Real>
void copy(Real* dst, const Real* src, index_t n) {
  detail::for_blocks(n, kElementGrain,
                     [&](index_t i0, index_t i1) { std::copy(src + i0, src + i1, dst + i0); });
}

template <class Real>
void add(Real* dst, const Real* src, index_t n) {
  detail::for_blocks(n, kElementGrain, [=](index_t i0, index_t i1) {
    Real* __restrict d = dst + i0;
    const Real* __restrict x = src + i0;
    for (index_t i = 0; i < i1 - i0; ++i) d[i] += x[i];
  });
}

// dst = 0 + src: add() into a buffer that is not read, with the bits of adding into zeros (a -0
// in src gives +0).
template <class Real>
void assign_sum(Real* dst, const Real* src, index_t n) {
  detail::for_blocks(n, kElementGrain, [=](index_t i0, index_t i1) {
    Real* __restrict d = dst + i0;
    const Real* __restrict x = src + i0;
    for (index_t i = 0; i < i1 - i0; ++i) d[i] = Real(0) + x[i];
  });
}

// out = a + b, element-wise.
template <class Real>
void add3(Real* out, const Real* a, const Real* b, index_t n) {
  detail::for_blocks(n, kElementGrain, [=](index_t i0, index_t i1) {
    Real* __restrict o = out + i0;
    const Real* __restrict x = a + i0;
    const Real* __restrict y = b + i0;
    for (index_t i = 0; i < i1 - i0; ++i) o[i] = x[i] + y[i];
  });
}

// Where a pass's dropout masks come from: drawn from the seed, or replayed (ForwardOptions::masks).
struct MaskSource {
  std::uint64_t seed = 0;
  const std::map<std::string, std::vector<std::uint8_t>>* replay = nullptr;

  // mask (n) for `site`: the replayed one (1 where nonzero), else drawn with probability p.
  void draw(std::uint8_t* mask, index_t n, const std::string& site, double p) const {
    const auto it = replay ? replay->find(site) : decltype(replay->end()){};
    if (!replay || it == replay->end()) {
      dropout_mask(mask, n, seed, site, p);
      return;
    }
    if (static_cast<index_t>(it->second.size()) != n) {
      throw ShapeError("mask " + site + " has " + std::to_string(it->second.size()) +
                       " elements, expected " + std::to_string(n));
    }
    for (index_t i = 0; i < n; ++i) mask[i] = it->second[static_cast<std::size_t>(i)] ? 1 : 0;
  }
};

// ConfigError unless every replayed mask names a dropout site of cfg (the contract's) and dropout
// applies; ShapeError unless each has its site's element count. Called before anything changes.
void check_replayed_masks(const EncoderConfig& cfg, const Batch& batch,
                          const ForwardOptions& opts) {
  if (!opts.masks || opts.masks->empty()) return;
  if (!opts.train || cfg.dropout <= 0.0) {
    throw ConfigError(
        "dropout masks were given, but no dropout applies (train is off or the "
        "config's dropout is 0)");
  }
  const auto sites = contract::masks(cfg, {batch.batch, batch.seq_len});
  for (const auto& entry : *opts.masks) {
    const std::string& site = entry.first;
    const auto& m = entry.second;
    const auto it = std::find_if(sites.begin(), sites.end(),
                                 [&](const contract::TensorSpec& t) { return t.name == site; });
    if (it == sites.end())
      throw ConfigError("\"" + site + "\" is not a dropout site of this config");
    const index_t n = Shape(it->shape).numel();
    if (static_cast<index_t>(m.size()) != n) {
      throw ShapeError("mask " + site + " has " + std::to_string(m.size()) +
                       " elements, expected " + std::to_string(n) + " " + it->symbolic());
    }
  }
}

// Records the mask (n) of dropout site `site` when active and returns it; clears it and returns
// null when inactive.
const std::uint8_t* record_mask(std::vector<std::uint8_t>& mask, index_t n, const std::string& site,
                                double p, bool active, const MaskSource& masks) {
  if (!active) {
    mask.clear();
    return nullptr;
  }
  mask.assign(static_cast<std::size_t>(n), 0);
  masks.draw(mask.data(), n, site, p);
  return mask.data();
}

// Applies dropout site `site` to in (n), recording its mask, and returns where the result is:
// out (which may alias in) when active; in itself, untouched and uncopied, when inactive.
template <class Real>
const Real* apply_dropout(Real* out, const Real* in, std::vector<std::uint8_t>& mask, index_t n,
                          const std::string& site, double p, bool active, const MaskSource& masks) {
  record_mask(mask, n, site, p, active, masks);
  if (!active) return in;
  dropout_forward(out, in, mask.data(), n, dropout_scale<Real>(p));
  return out;
}

// Writes din = 0 + dropout'(dout), masked and scaled, or passed through when the site was
// inactive (an empty mask); din is not read. Every dropout site's gradient has this one writer.
template <class Real>
void dropout_grad(Real* din, const Real* dout, const std::vector<std::uint8_t>& mask, index_t n,
                  double p) {
  if (!mask.empty()) {
    dropout_backward(din, dout, mask.data(), n, dropout_scale<Real>(p), GradWrite::overwrite);
  } else {
    assign_sum(din, dout, n);
  }
}

// The three projections as one Linear of D + 2 Dkv outputs: where each starts, how many outputs
// it has, and into how many heads it splits.
struct QkvLayout {
  index_t width;  // D + 2 Dkv
  index_t at[3], rows[3], heads[3];
  explicit QkvLayout(const Dims& d)
      : width(d.D + 2 * d.Dkv),
        at{0, d.D, d.D + d.Dkv},
        rows{d.D, d.Dkv, d.Dkv},
        heads{d.H, d.K, d.K} {}
};

// [Wq; Wk; Wv] (D + 2 Dkv, D) and [bq; bk; bv] (D + 2 Dkv).
template <class Real>
void stack_qkv(Real* w, Real* b, const LayerParams<Real>& P, const QkvLayout& l, index_t dm) {
  const Tensor<Real>* ws[3] = {&P.q_weight, &P.k_weight, &P.v_weight};
  const Tensor<Real>* bs[3] = {&P.q_bias, &P.k_bias, &P.v_bias};
  for (int i = 0; i < 3; ++i) {
    copy(w + l.at[i] * dm, ws[i]->data(), l.rows[i] * dm);
    copy(b + l.at[i], bs[i]->data(), l.rows[i]);
  }
}

// Tensors to be zero-filled together, split over the threads (zero_fill).
template <class Real>
using ZeroList = std::vector<Tensor<Real>*>;

// Gives t its shape, keeping its buffer when that is large enough, without filling it; when
// `zero` is not null (gradients, which accumulate), t is added to the tensors to zero-fill. The
// forward pass passes null: it writes every element of its activations.
template <class Real>
void shape_as(Tensor<Real>& t, Shape shape, std::type_identity_t<ZeroList<Real>>* zero) {
  t.reset_for_overwrite(std::move(shape));
  if (zero) zero->push_back(&t);
}

// Zero-fills every tensor of the list, in pieces of 64 Ki values spread over the threads (it is
// all memory traffic, and one thread does not saturate it).
template <class Real>
void zero_fill(const ZeroList<Real>& tensors) {
  constexpr index_t kPiece = index_t{1} << 16;
  std::vector<std::pair<Real*, index_t>> pieces;
  for (Tensor<Real>* t : tensors)
    for (index_t at = 0; at < t->numel(); at += kPiece)
      pieces.emplace_back(t->data() + at, std::min(kPiece, t->numel() - at));
  detail::for_blocks(static_cast<index_t>(pieces.size()), 1, [&](index_t i0, index_t i1) {
    for (index_t i = i0; i < i1; ++i) {
      const auto [p, n] = pieces[static_cast<std::size_t>(i)];
      std::memset(p, 0, static_cast<std::size_t>(n) * sizeof(Real));
    }
  });
}

// In the backward pass only the gradients of the LayerNorm statistics, which nothing writes, are
// zero-filled: layer_backward's first writer of every other gradient overwrites it (dL.output is
// the next layer's dx, or the head's, which allocate() zero-fills).
template <class Real>
void allocate_layer(LayerActs<Real>& l, const Dims& d, ZeroList<Real>* zero) {
  for (Tensor<Real>* t :
       {&l.norm1, &l.attn_out, &l.residual1, &l.norm2, &l.ffn_out, &l.residual2, &l.output})
    shape_as(*t, {d.B, d.S, d.D}, nullptr);
  for (Tensor<Real>* t : {&l.norm1_mean, &l.norm1_rstd, &l.norm2_mean, &l.norm2_rstd})
    shape_as(*t, {d.N}, zero);
  shape_as(l.context, {d.B, d.S, d.D}, nullptr);
  shape_as(l.q, {d.B, d.H, d.S, d.Dh}, nullptr);
  for (Tensor<Real>* t : {&l.k, &l.v}) shape_as(*t, {d.B, d.K, d.S, d.Dh}, nullptr);
  if (d.rope) {
    // written whole by RoPE in the forward pass and by attention_backward in the backward pass
    shape_as(l.q_rot, {d.B, d.H, d.S, d.Dh}, nullptr);
    shape_as(l.k_rot, {d.B, d.K, d.S, d.Dh}, nullptr);
  } else {
    l.q_rot = l.k_rot = Tensor<Real>();
  }
  for (Tensor<Real>* t : {&l.scores, &l.probs}) shape_as(*t, {d.B, d.H, d.S, d.S}, nullptr);
  for (Tensor<Real>* t : {&l.ffn_pre, &l.ffn_hidden}) shape_as(*t, {d.B, d.S, d.F}, nullptr);
  for (auto* m : {&l.masks.attn, &l.masks.residual1, &l.masks.ffn, &l.masks.residual2}) m->clear();
}

// Shapes every named activation of `acts` for this config and batch, with empty masks, reusing
// the buffers of a previous pass where they are large enough. The forward pass (zero == null)
// overwrites them all. For gradients, those that accumulate are added to `zero` for zero_fill:
// the top of the stack (which pooling scatters into), the positional gradient, and the
// statistics' gradients. backward() overwrites the rest.
template <class Real>
void allocate(Activations<Real>& a, const EncoderConfig& cfg, const Dims& d, ZeroList<Real>* zero,
              bool layers_whole = true) {
  a.norm_first = cfg.norm_first;
  a.rotary = d.rope;
  shape_as(a.embedding, {d.B, d.S, d.D}, nullptr);  // the input's dropout gradient overwrites it
  shape_as(a.positional, {d.S, d.D}, zero);
  // The gradient of a layer's input is overwritten by the layer; the top one accumulates.
  shape_as(a.input, {d.B, d.S, d.D}, cfg.num_layers == 0 ? zero : nullptr);
  a.input_mask.clear();
  a.layers.resize(static_cast<std::size_t>(cfg.num_layers));
  for (auto& l : a.layers) {
    if (layers_whole) {
      allocate_layer(l, d, zero);
    } else {
      l = LayerActs<Real>();
      shape_as(l.output, {d.B, d.S, d.D}, nullptr);
    }
  }
  if (zero && !a.layers.empty()) zero->push_back(&a.layers.back().output);
  if (cfg.norm_first) {
    shape_as(a.final_norm, {d.B, d.S, d.D}, zero);
    shape_as(a.final_norm_mean, {d.N}, zero);
    shape_as(a.final_norm_rstd, {d.N}, zero);
  } else {
    a.final_norm = a.final_norm_mean = a.final_norm_rstd = Tensor<Real>();
  }
  a.pooled.reset({d.B, d.D});
  a.pool_argmax.clear();
  if (cfg.pooling == Pooling::max) a.pool_argmax.assign(static_cast<std::size_t>(d.B * d.D), -1);
  a.logits.reset({d.B, d.C});
  a.class_probs.reset({d.B, d.C});
  a.loss.reset(Shape(std::vector<index_t>{}));
}

template <class Real>
void layer_forward(const EncoderConfig& cfg, const LayerParams<Real>& P, LayerActs<Real>& L,
                   const Real* x, const Batch& batch, const Dims& d, const std::string& prefix,
                   bool drop, const MaskSource& seed, const Emulation<Real>& store) {
  const index_t nd = d.N * d.D;
  const std::string_view name = std::string_view(prefix).substr(8);  // "layers.{i}."

  const Real eps = static_cast<Real>(cfg.layer_norm_eps);
  const double p = cfg.dropout;
  // (B, S, D) scratch for a dropped residual branch; without dropout the branch is used as is.
  // Scratch that is overwritten entirely before it is read.
  Tensor<Real> tmp = drop ? Tensor<Real>::for_overwrite({d.B, d.S, d.D}) : Tensor<Real>();

  const Real* attn_in = x;
  if (cfg.norm_first) {
    {
      profile::Scope stage(Stage::layer_norm);
      layer_norm_forward(L.norm1.data(), L.norm1_mean.data(), L.norm1_rstd.data(), x,
                         P.norm1_weight.data(), P.norm1_bias.data(), d.N, d.D, eps);
      store(L.norm1, name, "norm1");
    }
    attn_in = L.norm1.data();
  }
  // q (B, H, S, Dh), k, v (B, Hkv, S, Dh) = split(attn_in * W^T + b), as one GEMM against
  // [Wq; Wk; Wv]. Each output element is the same dot product as with three separate products.
  {
    profile::Scope stage(Stage::qkv_proj);
    const QkvLayout lay(d);
    auto wqkv = Tensor<Real>::for_overwrite({lay.width, d.D});
    auto bqkv = Tensor<Real>::for_overwrite({lay.width});
    stack_qkv(wqkv.data(), bqkv.data(), P, lay, d.D);
    auto qkv = Tensor<Real>::for_overwrite({d.B, d.S, lay.width});  // (B, S, D + 2 Dkv)
    // The bias is added while splitting (the same rounding as linear_forward's), which saves a
    // pass over the (B, S, D + 2 Dkv) product.
    linear_forward(qkv.data(), attn_in, wqkv.data(), static_cast<const Real*>(nullptr), d.N, d.D,
                   lay.width);
    Tensor<Real>* heads[3] = {&L.q, &L.k, &L.v};
    // With B = 0 the buffers are empty (null): nothing to split, and no pointer arithmetic on null.
    if (qkv.numel() > 0) {
      for (int i = 0; i < 3; ++i)
        split_heads(heads[i]->data(), qkv.data() + lay.at[i], d.B, d.S, lay.heads[i], d.Dh,
                    lay.width, bqkv.data() + lay.at[i]);
    }
    store(L.q, name, "q");
    store(L.k, name, "k");
    store(L.v, name, "v");
    if (d.rope) {
      // q_rot, k_rot = RoPE(q), RoPE(k)
      const RopeTables<Real> t(cfg, d.S);
      rope_forward(L.q_rot.data(), L.q.data(), t.cos.data(), t.sin.data(), d.B * d.H, d.S, d.Dh,
                   cfg.rotary(), cfg.rope_style);
      rope_forward(L.k_rot.data(), L.k.data(), t.cos.data(), t.sin.data(), d.B * d.K, d.S, d.Dh,
                   cfg.rotary(), cfg.rope_style);
      store(L.q_rot, name, "q_rot");
      store(L.k_rot, name, "k_rot");
    }
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
    // context (B, S, D) is written with its heads merged, in place.
    AttentionArgs<Real> args =
        detail::attention_args(cfg, d.B, d.S, batch.lengths.data(), P.sinks.data());
    args.drop_mask = drop_attn ? L.masks.attn.data() : nullptr;
    args.drop_scale = dropout_scale<Real>(p);
    args.merged_context = true;
    store.named(name, [&] {
      attention_forward(args, {.context = L.context.data(),
                               .scores = L.scores.data(),
                               .probs = L.probs.data(),
                               .q = (d.rope ? L.q_rot : L.q).data(),
                               .k = (d.rope ? L.k_rot : L.k).data(),
                               .v = L.v.data()});
    });
    store(L.context, name, "context");
  }
  {
    profile::Scope stage(Stage::out_proj);
    linear_forward(L.attn_out.data(), L.context.data(), P.o_weight.data(), P.o_bias.data(), d.N,
                   d.D, d.D);
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

  const Real* ffn_in;  // the FFN's input, and the second residual's base
  {
    profile::Scope norm_scope(Stage::layer_norm);
    if (cfg.norm_first) {
      layer_norm_forward(L.norm2.data(), L.norm2_mean.data(), L.norm2_rstd.data(),
                         L.residual1.data(), P.norm2_weight.data(), P.norm2_bias.data(), d.N, d.D,
                         eps);
      store(L.norm2, name, "norm2");
      ffn_in = L.norm2.data();
    } else {
      layer_norm_forward(L.norm1.data(), L.norm1_mean.data(), L.norm1_rstd.data(),
                         L.residual1.data(), P.norm1_weight.data(), P.norm1_bias.data(), d.N, d.D,
                         eps);
      store(L.norm1, name, "norm1");
      ffn_in = L.norm1.data();
    }
  }
  const Real* base = cfg.norm_first ? L.residual1.data() : L.norm1.data();

  // ffn_out = fc2(dropout(act(fc1(ffn_in)))). fc1's bias, the activation and the dropout run as
  // one pass (ffn_hidden_forward, the same bits), unless each result is to be rounded to a reduced
  // storage format before the next step reads it.
  const bool fused = !store.stores_reduced();
  {
    profile::Scope stage(Stage::ffn_fc1);
    linear_forward(L.ffn_pre.data(), ffn_in, P.fc1_weight.data(),
                   fused ? nullptr : P.fc1_bias.data(), d.N, d.D, d.F);
    if (!fused) store(L.ffn_pre, name, "ffn_pre");
  }
  Tensor<Real> dropped_buf = drop ? Tensor<Real>::for_overwrite({d.B, d.S, d.F}) : Tensor<Real>();
  const Real* hidden_dropped = nullptr;  // dropout(ffn_hidden): the buffer, or ffn_hidden itself
  {
    profile::Scope stage(Stage::activation);
    const index_t nh = L.ffn_hidden.numel();
    if (fused) {
      const std::uint8_t* mask = record_mask(L.masks.ffn, nh, prefix + "ffn", p, drop, seed);
      ffn_hidden_forward(L.ffn_pre.data(), L.ffn_hidden.data(), dropped_buf.data(),
                         P.fc1_bias.data(), mask, dropout_scale<Real>(p), d.N, d.F, cfg.activation);
      hidden_dropped = drop ? dropped_buf.data() : L.ffn_hidden.data();
    } else {
      activation_forward(L.ffn_hidden.data(), L.ffn_pre.data(), nh, cfg.activation);
      store(L.ffn_hidden, name, "ffn_hidden");
      hidden_dropped = apply_dropout(dropped_buf.data(), L.ffn_hidden.data(), L.masks.ffn, nh,
                                     prefix + "ffn", p, drop, seed);
      // The product reads the dropped hidden in the format: rounded (and checked) here, by name.
      if (drop) store(dropped_buf, name, "ffn_hidden after dropout");
    }
  }
  {
    profile::Scope stage(Stage::ffn_fc2);
    linear_forward(L.ffn_out.data(), hidden_dropped, P.fc2_weight.data(), P.fc2_bias.data(), d.N,
                   d.F, d.D);
    store(L.ffn_out, name, "ffn_out");
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

  if (cfg.norm_first) {
    {
      profile::Scope stage(Stage::residual);
      copy(L.output.data(), L.residual2.data(), nd);
    }
  } else {
    {
      profile::Scope stage(Stage::layer_norm);
      layer_norm_forward(L.norm2.data(), L.norm2_mean.data(), L.norm2_rstd.data(),
                         L.residual2.data(), P.norm2_weight.data(), P.norm2_bias.data(), d.N, d.D,
                         eps);
      store(L.norm2, name, "norm2");
      copy(L.output.data(), L.norm2.data(), nd);
    }
  }
}

// Writes dx (B, S, D), the gradient through one layer, given dL.output: dx is overwritten, not
// read. Writes every other named gradient of dL, each by its first writer without reading it (so
// none needs a zero-fill), and accumulates the parameter gradients into G.
template <class Real>
void layer_backward(const EncoderConfig& cfg, const LayerParams<Real>& P, const LayerActs<Real>& L,
                    LayerParams<Real>& G, LayerActs<Real>& dL, Real* dx, const Real* x,
                    const std::int64_t* lengths, const Dims& d, std::string_view name,
                    const Emulation<Real>& store) {
  const index_t nd = d.N * d.D;
  const double p = cfg.dropout;
  const Real scale = dropout_scale<Real>(p);

  // in the forward pass this was: output = LN2(residual2) (post) or residual2 (pre)
  {
    profile::Scope stage(Stage::bwd_layer_norm);
    if (cfg.norm_first) {
      copy(dL.residual2.data(), dL.output.data(), nd);
    } else {
      copy(dL.norm2.data(), dL.output.data(), nd);
      layer_norm_backward(dL.residual2.data(), G.norm2_weight.data(), G.norm2_bias.data(),
                          dL.norm2.data(), L.residual2.data(), P.norm2_weight.data(),
                          L.norm2_mean.data(), L.norm2_rstd.data(), d.N, d.D, GradWrite::overwrite);
      store(dL.residual2, name, "residual2");
    }
  }
  // residual2 = base + dropout(ffn_out); base = residual1 (pre) or norm1 (post)
  Real* dbase = cfg.norm_first ? dL.residual1.data() : dL.norm1.data();
  {
    profile::Scope stage(Stage::bwd_residual);
    dropout_grad(dL.ffn_out.data(), dL.residual2.data(), L.masks.residual2, nd, p);
    store(dL.ffn_out, name, "ffn_out");
    assign_sum(dbase, dL.residual2.data(), nd);  // its first writer
  }

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
                    G.fc2_weight.data(), G.fc2_bias.data(), dL.ffn_out.data(),
                    ffn_dropped ? hidden_dropped.data() : L.ffn_hidden.data(), P.fc2_weight.data(),
                    d.N, d.F, d.D, GradWrite::overwrite);
  }
  // dL.ffn_pre is overwritten too: the activation is its only writer. The dropout's and the
  // activation's gradients run as one pass (ffn_hidden_backward) unless dL.ffn_hidden is rounded
  // in between.
  {
    profile::Scope stage(Stage::bwd_activation);
    const std::uint8_t* mask = ffn_dropped ? L.masks.ffn.data() : nullptr;
    if (!store.stores_reduced()) {
      ffn_hidden_backward(dL.ffn_pre.data(), dL.ffn_hidden.data(), dhidden_dropped.data(), mask,
                          scale, L.ffn_pre.data(), d.N, d.F, cfg.activation);
    } else {
      if (mask) {
        dropout_backward(dL.ffn_hidden.data(), dhidden_dropped.data(), mask, dL.ffn_hidden.numel(),
                         scale, GradWrite::overwrite);
      }
      store(dL.ffn_hidden, name, "ffn_hidden");
      activation_backward(dL.ffn_pre.data(), dL.ffn_hidden.data(), L.ffn_pre.data(),
                          L.ffn_pre.numel(), cfg.activation, GradWrite::overwrite);
    }
    store(dL.ffn_pre, name, "ffn_pre");
  }
  // ffn_pre = fc1(ffn_in); ffn_in = norm2 (pre), its only reader, or norm1 (post), also the
  // second residual's base
  const Real* ffn_in = cfg.norm_first ? L.norm2.data() : L.norm1.data();
  Real* dffn_in = cfg.norm_first ? dL.norm2.data() : dL.norm1.data();
  {
    profile::Scope stage(Stage::bwd_ffn_fc1);
    linear_backward(dffn_in, G.fc1_weight.data(), G.fc1_bias.data(), dL.ffn_pre.data(), ffn_in,
                    P.fc1_weight.data(), d.N, d.D, d.F,
                    cfg.norm_first ? GradWrite::overwrite : GradWrite::accumulate);
    store(dffn_in, nd, name, cfg.norm_first ? "norm2" : "norm1");
  }

  // the norm between the two residuals: LN2(residual1) (pre) or LN1(residual1) (post)
  {
    profile::Scope stage(Stage::bwd_layer_norm);
    if (cfg.norm_first) {
      layer_norm_backward(dL.residual1.data(), G.norm2_weight.data(), G.norm2_bias.data(),
                          dL.norm2.data(), L.residual1.data(), P.norm2_weight.data(),
                          L.norm2_mean.data(), L.norm2_rstd.data(), d.N, d.D);
    } else {
      layer_norm_backward(dL.residual1.data(), G.norm1_weight.data(), G.norm1_bias.data(),
                          dL.norm1.data(), L.residual1.data(), P.norm1_weight.data(),
                          L.norm1_mean.data(), L.norm1_rstd.data(), d.N, d.D, GradWrite::overwrite);
    }
    store(dL.residual1, name, "residual1");
  }
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
    linear_backward(dL.context.data(), G.o_weight.data(), G.o_bias.data(), dL.attn_out.data(),
                    L.context.data(), P.o_weight.data(), d.N, d.D, d.D, GradWrite::overwrite);
    store(dL.context, name, "context");
  }
  // dcontext is read in its merged (B, S, D) layout, head by head.
  {
    profile::Scope stage(Stage::bwd_attention);
    AttentionArgs<Real> args =
        detail::attention_args(cfg, d.B, d.S, lengths, P.sinks.data(), G.sinks.data());
    args.drop_mask = L.masks.attn.empty() ? nullptr : L.masks.attn.data();
    args.drop_scale = scale;
    args.merged_context = true;
    args.qkv_write = GradWrite::overwrite;
    store.named(name, [&] {
      attention_backward(args, {.dq = (d.rope ? dL.q_rot : dL.q).data(),
                                .dk = (d.rope ? dL.k_rot : dL.k).data(),
                                .dv = dL.v.data(),
                                .dprobs = dL.probs.data(),
                                .dscores = dL.scores.data(),
                                .dcontext = dL.context.data(),
                                .q = (d.rope ? L.q_rot : L.q).data(),
                                .k = (d.rope ? L.k_rot : L.k).data(),
                                .v = L.v.data(),
                                .probs = L.probs.data()});
    });
    if (d.rope) {
      // in the forward pass this was: q_rot, k_rot = RoPE(q), RoPE(k)
      store(dL.q_rot, name, "q_rot");
      store(dL.k_rot, name, "k_rot");
      const RopeTables<Real> t(cfg, d.S);
      rope_backward(dL.q.data(), dL.q_rot.data(), t.cos.data(), t.sin.data(), d.B * d.H, d.S, d.Dh,
                    cfg.rotary(), cfg.rope_style);
      rope_backward(dL.k.data(), dL.k_rot.data(), t.cos.data(), t.sin.data(), d.B * d.K, d.S, d.Dh,
                    cfg.rotary(), cfg.rope_style);
    }
    store(dL.q, name, "q");
    store(dL.k, name, "k");
    store(dL.v, name, "v");
  }
  // q, k, v = split(attn_in * W^T + b); attn_in = LN1(x) (pre) or x (post)
  const Real* attn_in = cfg.norm_first ? L.norm1.data() : x;
  Real* dattn_in = dx;
  if (cfg.norm_first) dattn_in = dL.norm1.data();
  {
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
    linear_backward(dattn_in, gw.data(), gb.data(), dqkv.data(), attn_in, wqkv.data(), d.N, d.D,
                    lay.width, cfg.norm_first ? GradWrite::overwrite : GradWrite::accumulate);
    Tensor<Real>* gws[3] = {&G.q_weight, &G.k_weight, &G.v_weight};
    Tensor<Real>* gbs[3] = {&G.q_bias, &G.k_bias, &G.v_bias};
    for (int i = 0; i < 3; ++i) {
      add(gws[i]->data(), gw.data() + lay.at[i] * d.D, lay.rows[i] * d.D);
      add(gbs[i]->data(), gb.data() + lay.at[i], lay.rows[i]);
    }
  }
  if (cfg.norm_first) {
    profile::Scope stage(Stage::bwd_layer_norm);
    store(dL.norm1, name, "norm1");
    layer_norm_backward(dx, G.norm1_weight.data(), G.norm1_bias.data(), dL.norm1.data(), x,
                        P.norm1_weight.data(), L.norm1_mean.data(), L.norm1_rstd.data(), d.N, d.D);
  }
}

}  // namespace

namespace {
template <class Real>
void run_encoder(const Params<Real>& params, const Batch& batch, Activations<Real>& acts,
                 const ForwardOptions& opts, const Emulation<Real>& store);
}  // namespace

template <class Real>
void forward(const Params<Real>& params, const Batch& batch, Activations<Real>& acts,
             const ForwardOptions& opts) {
  const EncoderConfig& cfg = params.config;
  validate_params(params);
  validate_batch(cfg, batch, sizeof(Real));
  check_replayed_masks(cfg, batch, opts);
  const Dims d = dims_of(cfg, batch);
  const Emulation<Real> store(opts.precision, "");
  allocate(acts, cfg, d, static_cast<ZeroList<Real>*>(nullptr));

  {
    profile::Scope stage(Stage::embedding);
    const Real scale =
        cfg.embed_scale ? static_cast<Real>(std::sqrt(static_cast<double>(d.D))) : Real(1);
    embedding_forward(acts.embedding.data(), batch.tokens.data(), params.embedding_weight.data(),
                      d.N, d.D, scale);
    store(acts.embedding, "", "embedding");
    // rope, alibi and none add nothing here: their table is 0
    if (cfg.positional == Positional::sinusoidal) {
      sinusoidal_table(acts.positional.data(), d.S, d.D, cfg.position_offset);
    } else if (cfg.positional == Positional::learned) {
      copy(acts.positional.data(), params.pos_embedding_weight.data() + cfg.position_offset * d.D,
           d.S * d.D);
    } else {
      acts.positional.zero();
    }
    store(acts.positional, "", "positional");
    // input = dropout(embedding + positional), the dropout applied in place
    add_positional_forward(acts.input.data(), acts.embedding.data(), acts.positional.data(), d.B,
                           d.S, d.D);
    apply_dropout(acts.input.data(), acts.input.data(), acts.input_mask, d.N * d.D, "dropout.input",
                  cfg.dropout, opts.train && cfg.dropout > 0.0,
                  MaskSource{opts.dropout_seed, opts.masks});
    store(acts.input, "", "input");
  }
  run_encoder(params, batch, acts, opts, store);
}

namespace {

// The stack, pooling, head and loss from acts.input; the caller has validated everything.
template <class Real>
void run_encoder(const Params<Real>& params, const Batch& batch, Activations<Real>& acts,
                 const ForwardOptions& opts, const Emulation<Real>& store) {
  const EncoderConfig& cfg = params.config;
  const Dims d = dims_of(cfg, batch);
  const bool drop = opts.train && cfg.dropout > 0.0;
  const Real* x = acts.input.data();
  for (std::size_t i = 0; i < acts.layers.size(); ++i) {
    layer_forward(cfg, params.layers[i], acts.layers[i], x, batch, d,
                  "dropout.layers." + std::to_string(i) + ".", drop,
                  MaskSource{opts.dropout_seed, opts.masks}, store);
    x = acts.layers[i].output.data();
  }
  profile::Scope stage(Stage::head);
  if (cfg.norm_first) {
    layer_norm_forward(acts.final_norm.data(), acts.final_norm_mean.data(),
                       acts.final_norm_rstd.data(), x, params.final_norm_weight.data(),
                       params.final_norm_bias.data(), d.N, d.D,
                       static_cast<Real>(cfg.layer_norm_eps));
    store(acts.final_norm, "", "final_norm");
    x = acts.final_norm.data();
  }
  if (cfg.pooling == Pooling::max) acts.pool_argmax.assign(static_cast<std::size_t>(d.B * d.D), -1);
  pooling_forward(acts.pooled.data(), acts.pool_argmax.data(), x, batch.lengths.data(), d.B, d.S,
                  d.D, cfg.pooling);
  store(acts.pooled, "", "pooled");
  linear_forward(acts.logits.data(), acts.pooled.data(), params.head_weight.data(),
                 params.head_bias.data(), d.B, d.D, d.C);
  store(acts.logits, "", "logits");
  acts.loss[0] =
      cross_entropy_forward(acts.class_probs.data(), acts.logits.data(), batch.labels.data(), d.B,
                            d.C, static_cast<Real>(cfg.label_smoothing));
  store(acts.loss, "", "loss");
}

}  // namespace

template <class Real>
void encoder_forward(const Params<Real>& params, const Batch& batch, Activations<Real>& acts,
                     const ForwardOptions& opts) {
  validate_params(params);
  validate_batch(params.config, batch, sizeof(Real));
  validate_activations(params.config, batch, acts);
  check_replayed_masks(params.config, batch, opts);
  run_encoder(params, batch, acts, opts, Emulation<Real>(opts.precision, ""));
}

template <class Real>
void backward(const Params<Real>& params, const Batch& batch, const Activations<Real>& acts,
              Params<Real>& grads, Activations<Real>& dacts, const BackwardOptions& opts) {
  const EncoderConfig& cfg = params.config;
  validate_params(params);
  validate_batch(cfg, batch, sizeof(Real));
  validate_activations(cfg, batch, acts);
  const Dims d = dims_of(cfg, batch);
  const Emulation<Real> store(opts.precision, "the gradient of ");
  {
    // The gradients that accumulate from the start begin at zero (Params::zeros, with the fill
    // done by zero_fill): every parameter's, and the few activation gradients allocate() lists.
    // The first writer of every other one overwrites it.
    profile::Scope stage(Stage::bwd_zero_fill);
    ZeroList<Real> zero;
    grads = Params<Real>();
    grads.config = cfg;
    grads.layers.resize(static_cast<std::size_t>(cfg.num_layers));
    for (auto& l : grads.layers) l.has_sinks = cfg.attn_sinks;
    grads.visit([&](const std::string& name, Tensor<Real>& t) {
      shape_as(t, detail::param_shape(cfg, name), &zero);
    });
    allocate(dacts, cfg, d, &zero, opts.layer_activation_grads);
    zero_fill(zero);
  }

  // loss = cross_entropy(logits); logits = pooled * head^T + b
  {
    profile::Scope stage(Stage::bwd_head);
    dacts.loss[0] = Real(1);
    cross_entropy_backward(dacts.logits.data(), acts.class_probs.data(), batch.labels.data(), d.B,
                           d.C, static_cast<Real>(cfg.label_smoothing), dacts.loss[0]);
    store(dacts.logits, "", "logits");
    linear_backward(dacts.pooled.data(), grads.head_weight.data(), grads.head_bias.data(),
                    dacts.logits.data(), acts.pooled.data(), params.head_weight.data(), d.B, d.D,
                    d.C);
    store(dacts.pooled, "", "pooled");
    // pooled = pool(top); top = final_norm(last) (pre) or last
    Tensor<Real>& dlast = cfg.num_layers > 0 ? dacts.layers.back().output : dacts.input;
    const Real* last = cfg.num_layers > 0 ? acts.layers.back().output.data() : acts.input.data();
    Real* dtop = cfg.norm_first ? dacts.final_norm.data() : dlast.data();
    pooling_backward(dtop, dacts.pooled.data(), acts.pool_argmax.data(), batch.lengths.data(), d.B,
                     d.S, d.D, cfg.pooling);
    if (cfg.norm_first) {
      store(dacts.final_norm, "", "final_norm");
      layer_norm_backward(dlast.data(), grads.final_norm_weight.data(),
                          grads.final_norm_bias.data(), dacts.final_norm.data(), last,
                          params.final_norm_weight.data(), acts.final_norm_mean.data(),
                          acts.final_norm_rstd.data(), d.N, d.D);
    }
    const std::string last_name =
        cfg.num_layers > 0 ? "layers." + std::to_string(cfg.num_layers - 1) + ".output" : "input";
    store(dlast, "", last_name.c_str());
  }
  LayerActs<Real> scratch;  // the layer's activation gradients when they are not all kept
  for (std::size_t i = acts.layers.size(); i-- > 0;) {
    Real* dx = i > 0 ? dacts.layers[i - 1].output.data() : dacts.input.data();
    const Real* x = i > 0 ? acts.layers[i - 1].output.data() : acts.input.data();
    const std::string name = "layers." + std::to_string(i) + ".";
    LayerActs<Real>& dL = opts.layer_activation_grads ? dacts.layers[i] : scratch;
    if (!opts.layer_activation_grads) {
      // as allocate() would give them, around the layer's kept output gradient
      ZeroList<Real> zero;
      allocate_layer(scratch, d, &zero);
      zero_fill(zero);
      std::swap(scratch.output, dacts.layers[i].output);
    }
    layer_backward(cfg, params.layers[i], acts.layers[i], grads.layers[i], dL, dx, x,
                   batch.lengths.data(), d, name, store);
    if (!opts.layer_activation_grads) std::swap(scratch.output, dacts.layers[i].output);
    // dx is complete: the gradient of the layer's input
    store(dx, d.N * d.D, "",
          i > 0 ? ("layers." + std::to_string(i - 1) + ".output").c_str() : "input");
  }
  // input = dropout(embedding + positional)
  profile::Scope stage(Stage::bwd_embedding);
  // d(embedding + positional) is the gradient of the embedding itself, written here first
  dropout_grad(dacts.embedding.data(), dacts.input.data(), acts.input_mask, d.N * d.D, cfg.dropout);
  store(dacts.embedding, "", "embedding");
  add_positional_backward(dacts.positional.data(), dacts.embedding.data(), d.B, d.S, d.D);
  store(dacts.positional, "", "positional");
  if (cfg.positional == Positional::learned) {
    add(grads.pos_embedding_weight.data() + cfg.position_offset * d.D, dacts.positional.data(),
        d.S * d.D);
  }
  const Real scale =
      cfg.embed_scale ? static_cast<Real>(std::sqrt(static_cast<double>(d.D))) : Real(1);
  embedding_backward(grads.embedding_weight.data(), dacts.embedding.data(), batch.tokens.data(),
                     d.N, d.D, scale);
  if (store.stores_reduced()) {
    grads.visit([&](const std::string& name, Tensor<Real>& g) { store(g, "", name.c_str()); });
  }
}

namespace {

// Checks the arguments of a single-layer pass (ShapeError) and returns its dimensions.
template <class Real>
Dims layer_dims(const EncoderConfig& cfg, const LayerParams<Real>& P, const Tensor<Real>& x,
                const std::vector<std::int64_t>& lengths, Batch& batch) {
  cfg.validate();
  if (x.shape().rank() != 3 || x.dim(2) != cfg.d_model ||
      x.dim(0) != static_cast<index_t>(lengths.size())) {
    throw ShapeError("encoder layer: x is " + x.shape().str() + ", expected (" +
                     std::to_string(lengths.size()) + ", S, " + std::to_string(cfg.d_model) + ")");
  }
  if (P.has_sinks != cfg.attn_sinks) {
    throw ShapeError(std::string("encoder layer: parameter attn.sinks is ") +
                     (cfg.attn_sinks ? "missing" : "present") + ", but attn_sinks is " +
                     (cfg.attn_sinks ? "true" : "false"));
  }
  P.visit([&](const std::string& name, const Tensor<Real>& t) {
    const Shape want = detail::param_shape(cfg, "layers.0." + name);
    if (!(t.shape() == want)) {
      throw ShapeError("encoder layer: parameter " + name + " is " + t.shape().str() +
                       ", expected " + want.str());
    }
  });
  batch.batch = x.dim(0);
  batch.seq_len = x.dim(1);
  batch.lengths = lengths;
  for (auto len : lengths) {
    if (len < 0 || len > batch.seq_len) {
      throw ShapeError("encoder layer: length " + std::to_string(len) + " is outside [0, " +
                       std::to_string(batch.seq_len) + "]");
    }
  }
  return dims_of(cfg, batch);
}

}  // namespace

template <class Real>
void encoder_layer_forward(const EncoderConfig& cfg, const LayerParams<Real>& P,
                           const Tensor<Real>& x, const std::vector<std::int64_t>& lengths,
                           LayerActs<Real>& L, const ForwardOptions& opts) {
  Batch batch;
  const Dims d = layer_dims(cfg, P, x, lengths, batch);
  check_replayed_masks(cfg, batch, opts);
  const Emulation<Real> store(opts.precision, "");
  allocate_layer(L, d, static_cast<ZeroList<Real>*>(nullptr));
  layer_forward(cfg, P, L, x.data(), batch, d, "dropout.layers.0.", opts.train && cfg.dropout > 0.0,
                MaskSource{opts.dropout_seed, opts.masks}, store);
}

template <class Real>
void encoder_layer_backward(const EncoderConfig& cfg, const LayerParams<Real>& P,
                            const Tensor<Real>& x, const std::vector<std::int64_t>& lengths,
                            const LayerActs<Real>& L, const Tensor<Real>& dy, Tensor<Real>& dx,
                            LayerParams<Real>& G, LayerActs<Real>& dL,
                            const BackwardOptions& opts) {
  Batch batch;
  const Dims d = layer_dims(cfg, P, x, lengths, batch);
  if (!(dy.shape() == x.shape()) || !(L.output.shape() == x.shape())) {
    throw ShapeError("encoder layer: dy is " + dy.shape().str() + " and the kept output " +
                     L.output.shape().str() + ", expected " + x.shape().str());
  }
  const Emulation<Real> store(opts.precision, "the gradient of ");
  ZeroList<Real> zero;
  G.has_sinks = cfg.attn_sinks;
  G.visit([&](const std::string& name, Tensor<Real>& t) {
    shape_as(t, detail::param_shape(cfg, "layers.0." + name), &zero);
  });
  allocate_layer(dL, d, &zero);
  shape_as(dx, x.shape(), nullptr);  // layer_backward overwrites it
  zero_fill(zero);
  copy(dL.output.data(), dy.data(), dy.numel());
  layer_backward(cfg, P, L, G, dL, dx.data(), x.data(), batch.lengths.data(), d, "layers.0.",
                 store);
  store(dx, "", "x");
  if (store.stores_reduced()) {
    G.visit([&](const std::string& name, Tensor<Real>& g) { store(g, "layers.0.", name.c_str()); });
  }
}

#define TEO_INSTANTIATE(Real)                                                                      \
  template void encoder_layer_forward<Real>(const EncoderConfig&, const LayerParams<Real>&,        \
                                            const Tensor<Real>&, const std::vector<std::int64_t>&, \
                                            LayerActs<Real>&, const ForwardOptions&);              \
  template void encoder_layer_backward<Real>(                                                      \
      const EncoderConfig&, const LayerParams<Real>&, const Tensor<Real>&,                         \
      const std::vector<std::int64_t>&, const LayerActs<Real>&, const Tensor<Real>&,               \
      Tensor<Real>&, LayerParams<Real>&, LayerActs<Real>&, const BackwardOptions&);                \
  template void forward<Real>(const Params<Real>&, const Batch&, Activations<Real>&,               \
                              const ForwardOptions&);                                              \
  template void encoder_forward<Real>(const Params<Real>&, const Batch&, Activations<Real>&,       \
                                      const ForwardOptions&);                                      \
  template void backward<Real>(const Params<Real>&, const Batch&, const Activations<Real>&,        \
                               Params<Real>&, Activations<Real>&, const BackwardOptions&);
TEO_INSTANTIATE(float)
TEO_INSTANTIATE(double)

}  // namespace teo
