// Greedy generation with a KV cache (teo/generate.hpp): the prompt through forward(), then one
// token per step through each layer's cached keys and values, with the layer functions and the
// operation order of the full forward pass (layer.cpp) on rows of one token.
#include "teo/generate.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "model/mla.hpp"
#include "model/model_internal.hpp"
#include "model/moe_block.hpp"
#include "model/pass.hpp"
#include "teo/layers/attention.hpp"
#include "teo/layers/embedding.hpp"
#include "teo/layers/feed_forward.hpp"
#include "teo/layers/linear.hpp"
#include "teo/layers/positional.hpp"
#include "teo/layers/rope.hpp"

namespace teo {

namespace {

using detail::data_or_null;
using detail::Dims;

// The first largest of z[0 .. n).
template <class Real>
std::int64_t first_argmax(const Real* z, index_t n) {
  index_t best = 0;
  for (index_t c = 1; c < n; ++c) best = z[c] > z[best] ? c : best;
  return best;
}

// One layer's keys (after RoPE) and values for every sequence: (B, Hkv, L, Dh), rows past a
// sequence's cached length 0; and its stacked q/k/v projection [Wq; Wk; Wv], [bq; bk; bv], built
// once for every step.
template <class Real>
struct LayerCache {
  Tensor<Real> k, v;
  Tensor<Real> wqkv, bqkv;
};

// What one decode step reads: the config, the sizes, each sequence's position and cached keys
// (position + 1), and RoPE's tables over every position of the run.
template <class Real>
struct StepContext {
  const ModelConfig& cfg;
  Dims d;                                // B sequences of S = 1 token
  index_t L;                             // cache rows per sequence
  std::vector<std::int64_t> pos;         // (B)
  std::vector<std::int64_t> kv_len;      // (B): pos + 1
  std::vector<std::int64_t> ones;        // (B): one query each
  const detail::RopeTables<Real>* rope;  // null without RoPE
};

template <class Real>
void ffn_step(const Dims& d, const LayerParams<Real>& P, const Real* ffn_in, Activation act,
              Tensor<Real>& ffn_out);

// The step's q, k and v from attn_in (B, D), rotated as the cache holds them: one product
// against the stacked [Wq; Wk; Wv], qk_norm's per-head norms and RoPE at each sequence's
// position; or MLA's latents, expanded and rotated (mla_forward).
template <class Real>
void step_qkv(const StepContext<Real>& c, const LayerParams<Real>& P, const LayerCache<Real>& cache,
              const Real* attn_in, Tensor<Real>& q, Tensor<Real>& k, Tensor<Real>& v) {
  const ModelConfig& cfg = c.cfg;
  const Dims& d = c.d;
  const index_t B = d.B, D = d.D;
  if (d.mla) {
    LayerActs<Real> A;
    detail::allocate_layer(A, d, static_cast<detail::ZeroList<Real>*>(nullptr), false);
    const detail::Emulation<Real> full(std::nullopt, "");
    detail::mla_forward(cfg, P, A, attn_in, d, c.rope->cos.data(), c.rope->sin.data(), c.pos.data(),
                        "", full);
    q = std::move(A.q_rot);
    k = std::move(A.k_rot);
    v = std::move(A.v);
    return;
  }
  q = Tensor<Real>({B, d.H, 1, d.Dh});
  k = Tensor<Real>({B, d.K, 1, d.Dh});
  v = Tensor<Real>({B, d.K, 1, d.Dv});
  const detail::QkvLayout lay(d);
  Tensor<Real> qkv({B, lay.width});
  linear_forward(qkv.data(), attn_in, cache.wqkv.data(), static_cast<const Real*>(nullptr), B, D,
                 lay.width);
  Tensor<Real>* heads[3] = {&q, &k, &v};
  if (B > 0) {
    for (int i = 0; i < 3; ++i)
      split_heads(heads[i]->data(), qkv.data() + lay.at[i], B, 1, lay.heads[i], d.Dh, lay.width,
                  P.has_attn_bias ? cache.bqkv.data() + lay.at[i] : nullptr);
  }
  if (cfg.attention.qk_norm) {
    // each head's row normalised, as the full pass normalises every position's
    const Real eps = static_cast<Real>(cfg.norms.layer_norm_eps);
    Tensor<Real> q_norm({B, d.H, 1, d.Dh}), k_norm({B, d.K, 1, d.Dh});
    Tensor<Real> q_rstd({B * d.H}), k_rstd({B * d.K});
    rms_norm_forward(q_norm.data(), q_rstd.data(), q.data(), P.q_norm_weight.data(), B * d.H, d.Dh,
                     eps);
    rms_norm_forward(k_norm.data(), k_rstd.data(), k.data(), P.k_norm_weight.data(), B * d.K, d.Dh,
                     eps);
    q = std::move(q_norm);
    k = std::move(k_norm);
  }
  if (c.rope) {
    const index_t half = cfg.rotary() / 2;
    Tensor<Real> q_rot({B, d.H, 1, d.Dh}), k_rot({B, d.K, 1, d.Dh});
    for (index_t b = 0; b < B; ++b) {
      const std::size_t at = static_cast<std::size_t>(c.pos[static_cast<std::size_t>(b)] * half);
      const Real* cs = c.rope->cos.data() + at;
      const Real* sn = c.rope->sin.data() + at;
      rope_forward(q_rot.data() + b * d.H * d.Dh, q.data() + b * d.H * d.Dh, cs, sn, d.H, 1, d.Dh,
                   cfg.rotary(), cfg.attention.rope_style);
      rope_forward(k_rot.data() + b * d.K * d.Dh, k.data() + b * d.K * d.Dh, cs, sn, d.K, 1, d.Dh,
                   cfg.rotary(), cfg.attention.rope_style);
    }
    q = std::move(q_rot);
    k = std::move(k_rot);
  }
}

// Layer `layer` on the step's rows h (B, D), in place, appending to its cache.
template <class Real>
void layer_step(const StepContext<Real>& c, index_t layer, const LayerParams<Real>& P,
                LayerCache<Real>& cache, Tensor<Real>& h) {
  const ModelConfig& cfg = c.cfg;
  const Dims& d = c.d;
  const index_t B = d.B, D = d.D;
  Tensor<Real> mean({B}), rstd({B});
  // attention block: norm1 (pre-norm), q/k/v as one product, RoPE, attention over the cache
  Tensor<Real> norm1({B, D});
  const Real* attn_in = h.data();
  if (cfg.norms.norm_first) {
    detail::norm_forward(cfg, norm1.data(), mean.data(), rstd.data(), h.data(),
                         P.norm1_weight.data(), data_or_null(P.norm1_bias), B, D);
    attn_in = norm1.data();
  }
  Tensor<Real> q, k, v;  // rotated as they are cached: (B, H, 1, Dh), (B, Hkv, 1, Dh), (.., Dv)
  step_qkv(c, P, cache, attn_in, q, k, v);
  // append: row pos[b] of every K/V head of sequence b
  for (index_t b = 0; b < B; ++b) {
    const index_t p = c.pos[static_cast<std::size_t>(b)];
    for (index_t g = 0; g < d.K; ++g) {
      const index_t src = (b * d.K + g) * d.Dh, dst = ((b * d.K + g) * c.L + p) * d.Dh;
      std::copy(k.data() + src, k.data() + src + d.Dh, cache.k.data() + dst);
      const index_t vsrc = (b * d.K + g) * d.Dv, vdst = ((b * d.K + g) * c.L + p) * d.Dv;
      std::copy(v.data() + vsrc, v.data() + vsrc + d.Dv, cache.v.data() + vdst);
    }
  }
  Tensor<Real> context({B, d.Dc}), scores({B, d.H, 1, c.L}), probs({B, d.H, 1, c.L});
  AttentionArgs<Real> args = detail::attention_args(cfg, B, 1, c.ones.data(), P.sinks.data());
  args.variant.window = cfg.window(layer);
  args.kv_len = c.L;
  args.kv_lengths = c.kv_len.data();
  args.merged_context = true;
  attention_forward(args, {.context = context.data(),
                           .scores = scores.data(),
                           .probs = probs.data(),
                           .q = q.data(),
                           .k = cache.k.data(),
                           .v = cache.v.data()});
  Tensor<Real> attn_out({B, D}), residual1({B, D});
  linear_forward(attn_out.data(), context.data(), P.o_weight.data(), data_or_null(P.o_bias), B,
                 d.Dc, D);
  detail::add3(residual1.data(), h.data(), attn_out.data(), B * D);
  // FFN block: the norm before it, the FFN (fc1's bias, the activation: one pass, as the model's
  // fused middle; a gated FFN's steps apart), the second residual, post-norm's norm2
  Tensor<Real> norm2({B, D});
  Tensor<Real>& ffn_in_t = cfg.norms.norm_first ? norm2 : norm1;
  detail::norm_forward(cfg, ffn_in_t.data(), mean.data(), rstd.data(), residual1.data(),
                       (cfg.norms.norm_first ? P.norm2_weight : P.norm1_weight).data(),
                       data_or_null(cfg.norms.norm_first ? P.norm2_bias : P.norm1_bias), B, D);
  const Real* ffn_in = ffn_in_t.data();
  const Real* base = cfg.norms.norm_first ? residual1.data() : ffn_in;
  const Activation act = cfg.ffn_activation();
  Tensor<Real> ffn_out({B, D}), residual2({B, D});
  if (P.moe) {
    // an MoE layer routes each new token as the full pass routes every position
    LayerActs<Real> A;
    detail::allocate_layer(A, d, static_cast<detail::ZeroList<Real>*>(nullptr), true);
    const detail::Emulation<Real> full(std::nullopt, "");
    detail::moe_block_forward(cfg, P, A, ffn_in, B, nullptr, "", full);
    ffn_out = std::move(A.ffn_out);
  } else {
    ffn_step(d, P, ffn_in, act, ffn_out);
  }
  detail::add3(residual2.data(), base, ffn_out.data(), B * D);
  if (cfg.norms.norm_first) {
    h = std::move(residual2);
  } else {
    detail::norm_forward(cfg, h.data(), mean.data(), rstd.data(), residual2.data(),
                         P.norm2_weight.data(), data_or_null(P.norm2_bias), B, D);
  }
}

// A dense FFN on the step's rows: fc1's bias and the activation as one pass, as the model's fused
// middle; a gated FFN's steps apart.
template <class Real>
void ffn_step(const Dims& d, const LayerParams<Real>& P, const Real* ffn_in, Activation act,
              Tensor<Real>& ffn_out) {
  const index_t B = d.B, D = d.D;
  Tensor<Real> pre({B, d.F}), hidden({B, d.F});
  if (d.gated) {
    Tensor<Real> gate({B, d.F});
    linear_forward(gate.data(), ffn_in, P.gate_weight.data(), data_or_null(P.gate_bias), B, D, d.F);
    linear_forward(pre.data(), ffn_in, P.fc1_weight.data(), data_or_null(P.fc1_bias), B, D, d.F);
    gated_forward(hidden.data(), gate.data(), pre.data(), B * d.F, act);
  } else {
    linear_forward(pre.data(), ffn_in, P.fc1_weight.data(), static_cast<const Real*>(nullptr), B, D,
                   d.F);
    ffn_hidden_forward(pre.data(), hidden.data(), static_cast<Real*>(nullptr),
                       data_or_null(P.fc1_bias), static_cast<const std::uint8_t*>(nullptr), Real(1),
                       B, d.F, act);
  }
  linear_forward(ffn_out.data(), hidden.data(), P.fc2_weight.data(), data_or_null(P.fc2_bias), B,
                 d.F, D);
}

}  // namespace

template <class Real>
Generation<Real> generate(const Params<Real>& params, const Batch& prompt,
                          const GenerateOptions& opts) {
  const ModelConfig& cfg = params.config;
  validate_params(params);
  if (!cfg.decoder()) throw ConfigError("generate needs a decoder (architecture \"decoder\")");
  if (cfg.embeddings.positional == Positional::rope &&
      cfg.attention.rope_scaling.type == RopeScalingType::ntk) {
    throw ConfigError(
        "generate: rope_scaling \"ntk\" rotates by frequencies of the sequence's end, which a KV "
        "cache's earlier keys do not follow");
  }
  if (opts.steps < 0) throw ConfigError("generate: steps must be >= 0");
  validate_batch(cfg, prompt, sizeof(Real));
  if (opts.feed) {
    if (static_cast<index_t>(opts.feed->size()) != opts.steps) {
      throw ShapeError("generate: feed has " + std::to_string(opts.feed->size()) +
                       " steps, expected steps = " + std::to_string(opts.steps));
    }
    for (std::size_t t = 0; t < opts.feed->size(); ++t) {
      const auto& row = (*opts.feed)[t];
      if (static_cast<index_t>(row.size()) != prompt.batch) {
        throw ShapeError("generate: feed[" + std::to_string(t) + "] has " +
                         std::to_string(row.size()) +
                         " tokens, expected batch = " + std::to_string(prompt.batch));
      }
      for (std::size_t b = 0; b < row.size(); ++b) {
        if (row[b] < 0 || row[b] >= cfg.embeddings.vocab_size) {
          throw InputError("generate: feed[" + std::to_string(t) + "][" + std::to_string(b) +
                           "] = " + std::to_string(row[b]) + " is outside [0, vocab_size = " +
                           std::to_string(cfg.embeddings.vocab_size) + ")");
        }
      }
    }
  }
  if (opts.start_token < 0 || opts.start_token >= cfg.embeddings.vocab_size) {
    throw InputError("generate: start_token " + std::to_string(opts.start_token) +
                     " is outside [0, vocab_size = " + std::to_string(cfg.embeddings.vocab_size) +
                     ")");
  }
  const index_t B = prompt.batch, V = cfg.embeddings.vocab_size;
  std::int64_t longest = 0;
  for (auto len : prompt.lengths) longest = std::max(longest, len);
  const index_t L = longest + opts.steps;  // cache rows: every position of the run
  if (L > cfg.embeddings.max_len || (cfg.embeddings.positional == Positional::learned &&
                                     cfg.embeddings.position_offset + L > cfg.embeddings.max_len)) {
    throw ShapeError("generate: a prompt of " + std::to_string(longest) + " tokens and " +
                     std::to_string(opts.steps) + " steps reach position " + std::to_string(L) +
                     ", past max_len " + std::to_string(cfg.embeddings.max_len));
  }
  Generation<Real> out;
  if (opts.steps == 0) return out;

  // The prompt: the full forward pass; its keys and values fill the caches.
  Activations<Real> acts;
  forward(params, prompt, acts, {.train = false});
  Batch one;
  one.batch = B;
  one.seq_len = 1;
  StepContext<Real> c{.cfg = cfg,
                      .d = detail::dims_of(cfg, one),
                      .L = L,
                      .pos = prompt.lengths,
                      .kv_len = {},
                      .ones = std::vector<std::int64_t>(static_cast<std::size_t>(B), 1),
                      .rope = nullptr};
  const Dims& d = c.d;
  const index_t S = prompt.seq_len;
  std::vector<LayerCache<Real>> caches(static_cast<std::size_t>(cfg.num_layers));
  for (std::size_t l = 0; l < caches.size(); ++l) {
    LayerCache<Real>& lc = caches[l];
    lc.k = Tensor<Real>({B, d.K, L, d.Dh});
    lc.v = Tensor<Real>({B, d.K, L, d.Dv});
    if (!d.mla) {
      // MLA's step runs its own projections (mla_forward)
      const detail::QkvLayout lay(d);
      lc.wqkv = Tensor<Real>::for_overwrite({lay.width, d.D});
      lc.bqkv = Tensor<Real>({lay.width});
      detail::stack_qkv(lc.wqkv.data(), lc.bqkv.data(), params.layers[l], lay, d.D);
    }
    const LayerActs<Real>& la = acts.layers[l];
    const Tensor<Real>& k = d.rope ? la.k_rot : d.qk_norm ? la.k_norm : la.k;
    for (index_t b = 0; b < B; ++b) {
      const index_t len = prompt.lengths[static_cast<std::size_t>(b)];
      for (index_t g = 0; g < d.K; ++g) {
        const index_t src = (b * d.K + g) * S * d.Dh, dst = (b * d.K + g) * L * d.Dh;
        std::copy(k.data() + src, k.data() + src + len * d.Dh, lc.k.data() + dst);
        const index_t vsrc = (b * d.K + g) * S * d.Dv, vdst = (b * d.K + g) * L * d.Dv;
        std::copy(la.v.data() + vsrc, la.v.data() + vsrc + len * d.Dv, lc.v.data() + vdst);
      }
    }
  }
  std::optional<detail::RopeTables<Real>> rope;
  if (d.rope) {
    rope.emplace(cfg, L);
    c.rope = &*rope;
  }
  // Positions 0 .. L - 1 of the sinusoidal table (from position_offset).
  Tensor<Real> table;
  if (cfg.embeddings.positional == Positional::sinusoidal) {
    table = Tensor<Real>({L, d.D});
    sinusoidal_table(table.data(), L, d.D, cfg.embeddings.position_offset);
  }
  // Step 0 feeds the prompt's greedy next token (the start token after an empty prompt).
  std::vector<std::int64_t> next(static_cast<std::size_t>(B), opts.start_token);
  for (index_t b = 0; b < B; ++b) {
    const index_t len = prompt.lengths[static_cast<std::size_t>(b)];
    if (len > 0)
      next[static_cast<std::size_t>(b)] =
          first_argmax(acts.lm_logits.data() + (b * S + len - 1) * V, V);
  }
  acts = Activations<Real>();
  const Real escale =
      cfg.embeddings.embed_scale ? static_cast<Real>(std::sqrt(static_cast<double>(d.D))) : Real(1);
  const Tensor<Real>& lm_w =
      cfg.head.tie_embeddings ? params.embedding_weight : params.lm_head_weight;
  for (index_t t = 0; t < opts.steps; ++t) {
    if (opts.feed) next = (*opts.feed)[static_cast<std::size_t>(t)];
    c.kv_len.assign(c.pos.begin(), c.pos.end());
    for (auto& x : c.kv_len) x += 1;
    // h = embedding(token) + positional(position)
    Tensor<Real> h({B, d.D});
    embedding_forward(h.data(), next.data(), params.embedding_weight.data(), B, d.D, escale);
    for (index_t b = 0; b < B; ++b) {
      const index_t p = c.pos[static_cast<std::size_t>(b)];
      const Real* row =
          cfg.embeddings.positional == Positional::sinusoidal ? table.data() + p * d.D
          : cfg.embeddings.positional == Positional::learned
              ? params.pos_embedding_weight.data() + (cfg.embeddings.position_offset + p) * d.D
              : nullptr;
      if (row)
        add_positional_forward(h.data() + b * d.D, h.data() + b * d.D, row, index_t{1}, index_t{1},
                               d.D);
    }
    for (std::size_t l = 0; l < caches.size(); ++l)
      layer_step(c, static_cast<index_t>(l), params.layers[l], caches[l], h);
    const Real* top = h.data();
    Tensor<Real> fin({B, d.D}), mean({B}), rstd({B});
    if (cfg.norms.norm_first) {
      detail::norm_forward(cfg, fin.data(), mean.data(), rstd.data(), h.data(),
                           params.final_norm_weight.data(), data_or_null(params.final_norm_bias), B,
                           d.D);
      top = fin.data();
    }
    Tensor<Real> logits({B, V});
    linear_forward(logits.data(), top, lm_w.data(), data_or_null(params.lm_head_bias), B, d.D, V);
    out.tokens.push_back(next);
    for (index_t b = 0; b < B; ++b)
      next[static_cast<std::size_t>(b)] = first_argmax(logits.data() + b * V, V);
    out.logits.push_back(std::move(logits));
    for (auto& p : c.pos) p += 1;
  }
  return out;
}

template Generation<float> generate<float>(const Params<float>&, const Batch&,
                                           const GenerateOptions&);
template Generation<double> generate<double>(const Params<double>&, const Batch&,
                                             const GenerateOptions&);

}  // namespace teo
