// Multi-head latent attention's projections (DeepSeek-V2/V3; docs/semantics.md, 14.12), forward
// and backward: the q latent, the compressed k/v latent with its shared RoPE key, the expansion
// of each head's k and v, and RoPE on the last Dr dimensions of every head's q and k.
#include "model/mla.hpp"

#include <algorithm>

#include "teo/layers/attention.hpp"
#include "teo/layers/linear.hpp"
#include "teo/layers/rms_norm.hpp"
#include "teo/layers/rope.hpp"
#include "teo/profile.hpp"

namespace teo::detail {

using profile::Stage;

namespace {

// Rotates (or, backward, inverse-rotates) x (B * per_b rows of S positions, Dr wide) into out:
// row (b, ., s) at table row s, or with pos (S = 1) at pos[b].
template <class Real>
void rotate(Real* out, const Real* x, const Real* cos, const Real* sin, const Dims& d,
            index_t per_b, const std::int64_t* pos, RopeStyle style, bool backward) {
  const index_t Dr = d.Dr, half = d.Dr / 2;
  const auto run = [&](Real* o, const Real* in, index_t at, index_t rows, index_t seq) {
    if (backward) {
      rope_backward(o, in, cos + at, sin + at, rows, seq, Dr, Dr, style);
    } else {
      rope_forward(o, in, cos + at, sin + at, rows, seq, Dr, Dr, style);
    }
  };
  if (!pos) {
    if (d.B * per_b * d.S > 0) run(out, x, 0, d.B * per_b, d.S);
    return;
  }
  for (index_t b = 0; b < d.B; ++b)
    run(out + b * per_b * Dr, x + b * per_b * Dr, pos[b] * half, per_b, 1);
}

// The last `tail` of each of `rows` rows `width` wide: gathered from x into t (rows, tail), or
// scattered from t into x.
template <class Real>
void gather(Real* t, const Real* x, index_t rows, index_t width, index_t tail) {
  for (index_t r = 0; r < rows; ++r)
    std::copy(x + r * width + width - tail, x + (r + 1) * width, t + r * tail);
}
template <class Real>
void scatter(Real* x, const Real* t, index_t rows, index_t width, index_t tail) {
  for (index_t r = 0; r < rows; ++r)
    std::copy(t + r * tail, t + (r + 1) * tail, x + r * width + width - tail);
}

// The first Rkv of each kv_a row: the latent c (N, Rkv).
template <class Real>
Tensor<Real> latent(const Tensor<Real>& kv_a, const Dims& d) {
  auto c = Tensor<Real>::for_overwrite({d.N, d.Rkv});
  const index_t A = d.Rkv + d.Dr;
  for (index_t n = 0; n < d.N; ++n)
    std::copy(kv_a.data() + n * A, kv_a.data() + n * A + d.Rkv, c.data() + n * d.Rkv);
  return c;
}

// out (B, H, S, Dh) = x with the last Dr of every row rotated (or inverse-rotated).
template <class Real>
void rotate_tails(Real* out, const Real* x, const Real* cos, const Real* sin, const Dims& d,
                  const std::int64_t* pos, RopeStyle style, bool backward) {
  const index_t rows = d.B * d.H * d.S;
  auto t = Tensor<Real>::for_overwrite({rows, d.Dr});
  auto r = Tensor<Real>::for_overwrite({rows, d.Dr});
  gather(t.data(), x, rows, d.Dh, d.Dr);
  rotate(r.data(), t.data(), cos, sin, d, d.H, pos, style, backward);
  std::copy(x, x + rows * d.Dh, out);
  scatter(out, r.data(), rows, d.Dh, d.Dr);
}

}  // namespace

template <class Real>
void mla_forward(const ModelConfig& cfg, const LayerParams<Real>& P, LayerActs<Real>& L,
                 const Real* attn_in, const Dims& d, const Real* cos, const Real* sin,
                 const std::int64_t* pos, std::string_view name, const Emulation<Real>& store) {
  profile::Scope stage(Stage::qkv_proj);
  const index_t N = d.N, D = d.D, H = d.H, Dh = d.Dh, Dn = d.Dn, Dr = d.Dr, Dv = d.Dv;
  const index_t A = d.Rkv + Dr, W = Dn + Dv;  // kv_a's width; a head's share of kv_b
  const Real eps = static_cast<Real>(cfg.norms.layer_norm_eps);
  const Real* none = nullptr;
  // q = split(RMSNorm(attn_in Wqa^T) Wqb^T), or split(attn_in Wq^T) without q_lora_rank
  auto qfull = Tensor<Real>::for_overwrite({N, H * Dh});
  if (d.Rq > 0) {
    linear_forward(L.q_a.data(), attn_in, P.q_a_weight.data(), none, N, D, d.Rq);
    store(L.q_a, name, "q_a");
    rms_norm_forward(L.q_a_norm.data(), L.q_a_rstd.data(), L.q_a.data(), P.q_a_norm_weight.data(),
                     N, d.Rq, eps);
    store(L.q_a_norm, name, "q_a_norm");
    linear_forward(qfull.data(), L.q_a_norm.data(), P.q_b_weight.data(), none, N, d.Rq, H * Dh);
  } else {
    linear_forward(qfull.data(), attn_in, P.q_weight.data(), none, N, D, H * Dh);
  }
  if (N > 0) split_heads(L.q.data(), qfull.data(), d.B, d.S, H, Dh);
  store(L.q, name, "q");
  // kv_a = [c | k_pe] = attn_in Wkva^T; kv_norm = RMSNorm(c)
  linear_forward(L.kv_a.data(), attn_in, P.kv_a_weight.data(), none, N, D, A);
  store(L.kv_a, name, "kv_a");
  const Tensor<Real> c = latent(L.kv_a, d);
  rms_norm_forward(L.kv_norm.data(), L.kv_rstd.data(), c.data(), P.kv_norm_weight.data(), N, d.Rkv,
                   eps);
  store(L.kv_norm, name, "kv_norm");
  // [k_nope | v] of head h = columns h W .. (h + 1) W of kv_norm Wkvb^T; k = [k_nope | k_pe]
  auto kvb = Tensor<Real>::for_overwrite({N, H * W});
  linear_forward(kvb.data(), L.kv_norm.data(), P.kv_b_weight.data(), none, N, d.Rkv, H * W);
  for (index_t b = 0; b < d.B; ++b)
    for (index_t h = 0; h < H; ++h)
      for (index_t s = 0; s < d.S; ++s) {
        const index_t n = b * d.S + s, row = (b * H + h) * d.S + s;
        const Real* src = kvb.data() + n * H * W + h * W;
        const Real* pe = L.kv_a.data() + n * A + d.Rkv;
        std::copy(src, src + Dn, L.k.data() + row * Dh);
        std::copy(pe, pe + Dr, L.k.data() + row * Dh + Dn);
        std::copy(src + Dn, src + W, L.v.data() + row * Dv);
      }
  store(L.k, name, "k");
  store(L.v, name, "v");
  // q_rot = q with each head's last Dr rotated; k_rot = k with k_pe rotated once, in every head
  const RopeStyle style = cfg.attention.rope_style;
  rotate_tails(L.q_rot.data(), L.q.data(), cos, sin, d, pos, style, false);
  auto pe = Tensor<Real>::for_overwrite({N, Dr});
  auto pe_rot = Tensor<Real>::for_overwrite({N, Dr});
  gather(pe.data(), L.kv_a.data(), N, A, Dr);
  rotate(pe_rot.data(), pe.data(), cos, sin, d, 1, pos, style, false);
  std::copy(L.k.data(), L.k.data() + L.k.numel(), L.k_rot.data());
  for (index_t b = 0; b < d.B; ++b)
    for (index_t h = 0; h < H; ++h)
      for (index_t s = 0; s < d.S; ++s) {
        const Real* src = pe_rot.data() + (b * d.S + s) * Dr;
        std::copy(src, src + Dr, L.k_rot.data() + ((b * H + h) * d.S + s) * Dh + Dn);
      }
  store(L.q_rot, name, "q_rot");
  store(L.k_rot, name, "k_rot");
}

template <class Real>
void mla_forward(const ModelConfig& cfg, const LayerParams<Real>& P, LayerActs<Real>& L,
                 const Real* attn_in, const Dims& d, std::string_view name,
                 const Emulation<Real>& store) {
  const RopeTables<Real> t(cfg, d.S);
  mla_forward(cfg, P, L, attn_in, d, t.cos.data(), t.sin.data(), nullptr, name, store);
}

template <class Real>
void mla_backward(const ModelConfig& cfg, const LayerParams<Real>& P, const LayerActs<Real>& L,
                  LayerParams<Real>& G, LayerActs<Real>& dL, Real* dattn_in, const Real* attn_in,
                  const Dims& d, std::string_view name, const Emulation<Real>& store) {
  const index_t N = d.N, D = d.D, H = d.H, Dh = d.Dh, Dn = d.Dn, Dr = d.Dr, Dv = d.Dv;
  const index_t A = d.Rkv + Dr, W = Dn + Dv;
  {
    // in the forward pass: q_rot, k_rot = q, k with each head's last Dr rotated
    profile::Scope stage(Stage::bwd_attention);
    store(dL.q_rot, name, "q_rot");
    store(dL.k_rot, name, "k_rot");
    const RopeTables<Real> t(cfg, d.S);
    const RopeStyle style = cfg.attention.rope_style;
    rotate_tails(dL.q.data(), dL.q_rot.data(), t.cos.data(), t.sin.data(), d, nullptr, style, true);
    rotate_tails(dL.k.data(), dL.k_rot.data(), t.cos.data(), t.sin.data(), d, nullptr, style, true);
    store(dL.q, name, "q");
    store(dL.k, name, "k");
    store(dL.v, name, "v");
  }
  profile::Scope stage(Stage::bwd_qkv_proj);
  const GradWrite first = cfg.norms.norm_first ? GradWrite::overwrite : GradWrite::accumulate;
  // k = [k_nope | k_pe] per head, [k_nope | v] = split(kv_norm Wkvb^T): k_pe's gradient is the
  // sum over the heads (in head order), the others gather into the product's (N, H W)
  auto dkvb = Tensor<Real>::for_overwrite({N, H * W});
  for (index_t b = 0; b < d.B; ++b)
    for (index_t s = 0; s < d.S; ++s) {
      const index_t n = b * d.S + s;
      Real* dpe = dL.kv_a.data() + n * A + d.Rkv;
      for (index_t h = 0; h < H; ++h) {
        const index_t row = (b * H + h) * d.S + s;
        const Real* dk = dL.k.data() + row * Dh;
        Real* dst = dkvb.data() + n * H * W + h * W;
        std::copy(dk, dk + Dn, dst);
        std::copy(dL.v.data() + row * Dv, dL.v.data() + (row + 1) * Dv, dst + Dn);
        for (index_t j = 0; j < Dr; ++j)
          dpe[j] = h == 0 ? Real(0) + dk[Dn + j] : dpe[j] + dk[Dn + j];
      }
    }
  linear_backward(dL.kv_norm.data(), G.kv_b_weight.data(), static_cast<Real*>(nullptr), dkvb.data(),
                  L.kv_norm.data(), P.kv_b_weight.data(), N, d.Rkv, H * W, GradWrite::overwrite);
  store(dL.kv_norm, name, "kv_norm");
  // kv_norm = RMSNorm(c), c the first Rkv of kv_a
  {
    const Tensor<Real> c = latent(L.kv_a, d);
    auto dc = Tensor<Real>::for_overwrite({N, d.Rkv});
    rms_norm_backward(dc.data(), G.kv_norm_weight.data(), dL.kv_norm.data(), c.data(),
                      P.kv_norm_weight.data(), L.kv_rstd.data(), N, d.Rkv, GradWrite::overwrite);
    for (index_t n = 0; n < N; ++n)
      std::copy(dc.data() + n * d.Rkv, dc.data() + (n + 1) * d.Rkv, dL.kv_a.data() + n * A);
  }
  store(dL.kv_a, name, "kv_a");
  // kv_a = attn_in Wkva^T
  linear_backward(dattn_in, G.kv_a_weight.data(), static_cast<Real*>(nullptr), dL.kv_a.data(),
                  attn_in, P.kv_a_weight.data(), N, D, A, first);
  // q = split(q_a_norm Wqb^T), q_a_norm = RMSNorm(q_a), q_a = attn_in Wqa^T; or attn_in Wq^T
  auto dq = Tensor<Real>::for_overwrite({N, H * Dh});
  if (N > 0) merge_heads(dq.data(), dL.q.data(), d.B, d.S, H, Dh);
  if (d.Rq > 0) {
    linear_backward(dL.q_a_norm.data(), G.q_b_weight.data(), static_cast<Real*>(nullptr), dq.data(),
                    L.q_a_norm.data(), P.q_b_weight.data(), N, d.Rq, H * Dh, GradWrite::overwrite);
    store(dL.q_a_norm, name, "q_a_norm");
    rms_norm_backward(dL.q_a.data(), G.q_a_norm_weight.data(), dL.q_a_norm.data(), L.q_a.data(),
                      P.q_a_norm_weight.data(), L.q_a_rstd.data(), N, d.Rq, GradWrite::overwrite);
    store(dL.q_a, name, "q_a");
    linear_backward(dattn_in, G.q_a_weight.data(), static_cast<Real*>(nullptr), dL.q_a.data(),
                    attn_in, P.q_a_weight.data(), N, D, d.Rq, GradWrite::accumulate);
  } else {
    linear_backward(dattn_in, G.q_weight.data(), static_cast<Real*>(nullptr), dq.data(), attn_in,
                    P.q_weight.data(), N, D, H * Dh, GradWrite::accumulate);
  }
}

#define TEO_INSTANTIATE(Real)                                                                     \
  template void mla_forward<Real>(const ModelConfig&, const LayerParams<Real>&, LayerActs<Real>&, \
                                  const Real*, const Dims&, const Real*, const Real*,             \
                                  const std::int64_t*, std::string_view, const Emulation<Real>&); \
  template void mla_forward<Real>(const ModelConfig&, const LayerParams<Real>&, LayerActs<Real>&, \
                                  const Real*, const Dims&, std::string_view,                     \
                                  const Emulation<Real>&);                                        \
  template void mla_backward<Real>(const ModelConfig&, const LayerParams<Real>&,                  \
                                   const LayerActs<Real>&, LayerParams<Real>&, LayerActs<Real>&,  \
                                   Real*, const Real*, const Dims&, std::string_view,             \
                                   const Emulation<Real>&);
TEO_INSTANTIATE(float)
TEO_INSTANTIATE(double)
#undef TEO_INSTANTIATE

}  // namespace teo::detail
