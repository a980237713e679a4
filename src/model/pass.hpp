// Internal: what one layer's passes (layer.cpp) and the whole model's (model.cpp) share: the
// dimensions of a pass, its emulated precision, the element-wise helpers, the dropout sites and
// the fused q/k/v projection's layout.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/parallel.hpp"
#include "teo/errors.hpp"
#include "teo/layers/dropout.hpp"
#include "teo/layers/layer_norm.hpp"
#include "teo/layers/rms_norm.hpp"
#include "teo/layers/rope.hpp"
#include "teo/model.hpp"
#include "teo/precision.hpp"
#include "teo/rounding.hpp"

namespace teo::detail {

struct Dims {
  index_t B, S, D, H, Dh, F, C, N;        // N = B * S rows
  index_t K, Dkv;                         // K/V heads, and their width K * Dh
  bool rope;                              // q and k are rotated (q_rot, k_rot)
  bool gated;                             // the FFN is gated (ffn_gate)
  index_t E = 0, Kt = 0, Fe = 0, Fs = 0;  // ffn "moe": experts, per token, their width, shared
  bool qk_norm = false;                   // q and k are normalised per head (q_norm, k_norm)
  index_t Dq = 0;                         // q's width H * Dh (head_dim; else D)
  index_t Dv = 0, Dc = 0;                 // v's head width, and the context's H * Dv
  // multi-head latent attention (kv_lora_rank; semantics 14.12): the latents' widths (Rq 0
  // without q_lora_rank) and the heads' parts
  bool mla = false;
  index_t Rq = 0, Rkv = 0, Dn = 0, Dr = 0;
};

inline Dims dims_of(const ModelConfig& c, const Batch& b) {
  return {b.batch,
          b.seq_len,
          c.d_model,
          c.attention.num_heads,
          c.d_head(),
          c.ffn.d_ff,
          c.head.num_classes,
          b.batch * b.seq_len,
          c.kv_heads(),
          c.kv_heads() * c.d_head(),
          c.embeddings.positional == Positional::rope,
          c.gated(),
          c.moe() ? c.ffn.moe.num_experts : 0,
          c.moe() ? c.ffn.moe.num_experts_per_tok : 0,
          c.moe() ? c.ffn.moe.moe_d_ff : 0,
          c.moe() ? c.ffn.moe.shared_d_ff : 0,
          c.attention.qk_norm,
          c.attn_width(),
          c.v_head(),
          c.context_width(),
          c.attention.mla(),
          c.attention.q_lora_rank.value_or(0),
          c.attention.kv_lora_rank.value_or(0),
          c.attention.qk_nope_head_dim,
          c.attention.qk_rope_head_dim};
}

// A parameter that may be absent (an optional bias): its data, or null when it is empty.
template <class Real>
Real* data_or_null(Tensor<Real>& t) {
  return t.numel() > 0 ? t.data() : nullptr;
}
template <class Real>
const Real* data_or_null(const Tensor<Real>& t) {
  return t.numel() > 0 ? t.data() : nullptr;
}

// RoPE's cos and sin tables (S, r / 2) for cfg and a sequence length.
template <class Real>
struct RopeTables {
  std::vector<Real> cos, sin;
  RopeTables(const ModelConfig& cfg, index_t seq_len)
      : cos(static_cast<std::size_t>(seq_len * (cfg.rotary() / 2))), sin(cos.size()) {
    rope_table(cos.data(), sin.data(), cfg, seq_len);
  }
};

inline constexpr index_t kElementGrain = 16384;

// The emulated precision of a pass (docs/semantics.md, "Reduced precision"): checks that it suits
// Real, sets it for gemm() and the attention kernels for the pass's duration, and rounds named
// tensors to the storage format (bf16, fp16) where they are produced. With no reduced precision
// every call is a no-op.
template <class Real>
class Emulation {
 public:
  // fp8: the recipe under Precision::fp8 (ConfigError under any other); unset keeps the thread's.
  Emulation(std::optional<Precision> p, const char* kind,
            const std::optional<Fp8Recipe>& fp8 = std::nullopt)
      : p_(p.value_or(std::is_same_v<Real, float> ? Precision::fp32 : Precision::fp64)),
        kind_(kind),
        scope_(std::is_same_v<Real, float> ? p_ : Precision::fp32,
               fp8.value_or(detail::fp8_recipe())) {
    if (fp8 && p_ != Precision::fp8) {
      throw ConfigError(std::string("an fp8 recipe (the pass options' fp8) is read under precision "
                                    "fp8 only; this pass emulates ") +
                        to_string(p_));
    }
    if (fp8 && fp8->delayed) {
      throw ConfigError(
          "the fp8 recipe's delayed scales (fp8_scales) are inputs of the linear op case; a "
          "pass computes its scales from each operand's amax");
    }
    const bool ok = std::is_same_v<Real, float> ? p_ != Precision::fp64 : p_ == Precision::fp64;
    if (!ok) {
      throw ConfigError(
          std::string("precision ") + to_string(p_) + " cannot run in " +
          (std::is_same_v<Real, float> ? "float" : "double") +
          " (a float pass emulates fp32, tf32, bf16, fp16 or fp8; a double pass is fp64)");
    }
  }
  // True when named tensors are rounded: bf16 and fp16.
  bool stores_reduced() const { return teo::stores_reduced(p_); }

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

// Records the mask (n) of dropout site `site` when active and returns it; clears it and returns
// null when inactive.
inline const std::uint8_t* record_mask(std::vector<std::uint8_t>& mask, index_t n,
                                       const std::string& site, double p, bool active,
                                       const MaskSource& masks) {
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

// The config's norm over N rows of D: LayerNorm, or RMSNorm (which writes no mean and has no bias:
// b and db are not read).
template <class Real>
void norm_forward(const ModelConfig& cfg, Real* out, Real* mean, Real* rstd, const Real* x,
                  const Real* w, const Real* b, index_t N, index_t D) {
  const Real eps = static_cast<Real>(cfg.norms.layer_norm_eps);
  if (cfg.norms.norm == Norm::rmsnorm) {
    rms_norm_forward(out, rstd, x, w, N, D, eps);
  } else {
    layer_norm_forward(out, mean, rstd, x, w, b, N, D, eps);
  }
}

// Its backward: dx accumulated into (or overwritten), dw and db accumulated into.
template <class Real>
void norm_backward(const ModelConfig& cfg, Real* dx, Real* dw, Real* db, const Real* dy,
                   const Real* x, const Real* w, const Real* mean, const Real* rstd, index_t N,
                   index_t D, GradWrite write = GradWrite::accumulate) {
  if (cfg.norms.norm == Norm::rmsnorm) {
    rms_norm_backward(dx, dw, dy, x, w, rstd, N, D, write);
  } else {
    layer_norm_backward(dx, dw, db, dy, x, w, mean, rstd, N, D, write);
  }
}

// The three projections as one Linear of D + 2 Dkv outputs: where each starts, how many outputs
// it has, and into how many heads it splits.
struct QkvLayout {
  index_t width;  // Dq + 2 Dkv (Dq = H Dh)
  index_t at[3], rows[3], heads[3];
  explicit QkvLayout(const Dims& d)
      : width(d.Dq + 2 * d.Dkv),
        at{0, d.Dq, d.Dq + d.Dkv},
        rows{d.Dq, d.Dkv, d.Dkv},
        heads{d.H, d.K, d.K} {}
};

// [Wq; Wk; Wv] (Dq + 2 Dkv, D) and [bq; bk; bv] (Dq + 2 Dkv); b is not written without attn_bias.
template <class Real>
void stack_qkv(Real* w, Real* b, const LayerParams<Real>& P, const QkvLayout& l, index_t dm) {
  const Tensor<Real>* ws[3] = {&P.q_weight, &P.k_weight, &P.v_weight};
  const Tensor<Real>* bs[3] = {&P.q_bias, &P.k_bias, &P.v_bias};
  for (int i = 0; i < 3; ++i) {
    copy(w + l.at[i] * dm, ws[i]->data(), l.rows[i] * dm);
    if (P.has_attn_bias) copy(b + l.at[i], bs[i]->data(), l.rows[i]);
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

// Shapes one layer's activations (or, with `zero`, its activation gradients) for d, as allocate()
// does for each layer of the stack.
template <class Real>
void allocate_layer(LayerActs<Real>& l, const Dims& d, ZeroList<Real>* zero, bool moe);

// Layer `layer`'s forward pass: writes every activation of L from its input x (B, S, D); `prefix`
// ("dropout.layers.{i}.") names its dropout sites, whose masks come from `seed` when `drop`.
// routing (N * k) or null: an MoE layer's replayed choice (ForwardOptions::routing). The index
// chooses the layer's attention (ModelConfig::window).
template <class Real>
void layer_forward(const ModelConfig& cfg, index_t layer, const LayerParams<Real>& P,
                   LayerActs<Real>& L, const Real* x, const Batch& batch, const Dims& d,
                   const std::string& prefix, bool drop, const MaskSource& seed,
                   const Emulation<Real>& store, const std::int32_t* routing = nullptr);

// Writes dx (B, S, D), the gradient through one layer, given dL.output: dx is overwritten, not
// read. moe_dlogits (N, E) or null: an MoE layer's loss-term gradient of its router logits. Writes
// every other named gradient of dL, each by its first writer without reading it (so none needs a
// zero-fill), and accumulates the parameter gradients into G.
template <class Real>
void layer_backward(const ModelConfig& cfg, index_t layer, const LayerParams<Real>& P,
                    const LayerActs<Real>& L, LayerParams<Real>& G, LayerActs<Real>& dL, Real* dx,
                    const Real* x, const std::int64_t* lengths, const Dims& d,
                    std::string_view name, const Emulation<Real>& store,
                    const Real* moe_dlogits = nullptr);

}  // namespace teo::detail
