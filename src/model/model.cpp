#include "teo/model.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "kernels/parallel.hpp"
#include "model/model_internal.hpp"
#include "model/moe_block.hpp"
#include "model/pass.hpp"
#include "teo/contract.hpp"
#include "teo/layers/cross_entropy.hpp"
#include "teo/layers/dropout.hpp"
#include "teo/layers/embedding.hpp"
#include "teo/layers/layer_norm.hpp"
#include "teo/layers/linear.hpp"
#include "teo/layers/patch_embedding.hpp"
#include "teo/layers/pooling.hpp"
#include "teo/layers/positional.hpp"
#include "teo/precision.hpp"
#include "teo/profile.hpp"
#include "teo/rng.hpp"

namespace teo {

using detail::add;
using detail::allocate_layer;
using detail::apply_dropout;
using detail::copy;
using detail::Dims;
using detail::dims_of;
using detail::dropout_grad;
using detail::Emulation;
using detail::layer_backward;
using detail::layer_forward;
using detail::MaskSource;
using detail::shape_as;
using detail::ZeroList;
using profile::Stage;

// ---------------------------------------------------------------------------------------------
// Forward and backward

namespace {

// An encoder_decoder runs in full precision only: its decoder layer emulates no reduced one.
void full_precision_only(const ModelConfig& cfg, std::optional<Precision> p) {
  if (cfg.encoder_decoder() && p && *p != Precision::fp32 && *p != Precision::fp64) {
    throw ConfigError(
        "an encoder_decoder runs in full precision only: its decoder layer "
        "(semantics 17.4) emulates no reduced precision");
  }
}

// ConfigError unless every replayed mask names a dropout site of cfg (the contract's) and dropout
// applies; ShapeError unless each has its site's element count. Called before anything changes.
void check_replayed_masks(const ModelConfig& cfg, const Batch& batch, const ForwardOptions& opts) {
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

// ConfigError unless every replayed routing names an MoE layer of cfg and holds, at each position,
// k distinct experts in [0, E); ShapeError unless it has B * S * k ids. Called before anything
// changes.
void check_replayed_routing(const ModelConfig& cfg, const Batch& batch,
                            const ForwardOptions& opts) {
  if (!opts.routing || opts.routing->empty()) return;
  const index_t E = cfg.ffn.moe.num_experts, k = cfg.ffn.moe.num_experts_per_tok;
  for (const auto& [layer, ids] : *opts.routing) {
    const std::string name = "the routing replayed at layer " + std::to_string(layer);
    if (layer < 0 || layer >= cfg.num_layers || !cfg.moe_layer(layer))
      throw ConfigError(name + ": it is not an MoE layer of this config");
    const index_t n = batch.batch * batch.seq_len * k;
    if (static_cast<index_t>(ids.size()) != n) {
      throw ShapeError(name + " has " + std::to_string(ids.size()) + " ids, expected " +
                       std::to_string(n) + " [B*S*k]");
    }
    for (index_t t = 0; t * k < n; ++t) {
      for (index_t j = 0; j < k; ++j) {
        const std::int32_t e = ids[static_cast<std::size_t>(t * k + j)];
        const auto pos = "(position " + std::to_string(t) + ", slot " + std::to_string(j) + ")";
        if (e < 0 || e >= E) {
          throw ConfigError(name + ": expert " + std::to_string(e) + " at " + pos +
                            " is not in [0, " + std::to_string(E) + ")");
        }
        for (index_t i = 0; i < j; ++i)
          if (ids[static_cast<std::size_t>(t * k + i)] == e)
            throw ConfigError(name + ": expert " + std::to_string(e) + " twice at " + pos);
      }
    }
  }
}

// The replayed routing of layer i (ForwardOptions::routing), or null.
const std::int32_t* routing_of(const ForwardOptions& opts, std::size_t i) {
  if (!opts.routing) return nullptr;
  const auto it = opts.routing->find(static_cast<index_t>(i));
  return it == opts.routing->end() ? nullptr : it->second.data();
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

// Shapes every named activation of `acts` for this config and batch, with empty masks, reusing
// the buffers of a previous pass where they are large enough. The forward pass (zero == null)
// overwrites them all. For gradients, those that accumulate are added to `zero` for zero_fill:
// the top of the stack (which pooling scatters into), the positional gradient, and the
// statistics' gradients. backward() overwrites the rest.
template <class Real>
void allocate(Activations<Real>& a, const ModelConfig& cfg, const Dims& d, index_t tgt_len,
              ZeroList<Real>* zero, bool layers_whole = true) {
  a.configure(cfg);
  // an encoder_decoder's decoder side is shaped by seq2seq_forward and seq2seq_backward
  a.decoder_embedding = a.decoder_positional = a.decoder_input = Tensor<Real>();
  a.decoder_final_norm = a.decoder_final_norm_mean = a.decoder_final_norm_rstd = Tensor<Real>();
  a.decoder_layers.clear();
  if (cfg.encoder_decoder()) a.decoder_layers.resize(static_cast<std::size_t>(cfg.dec_layers()));
  shape_as(a.embedding, {d.B, d.S, d.D}, nullptr);  // the input's dropout gradient overwrites it
  shape_as(a.positional, {d.S, d.D}, zero);
  // the embedding extras of section 18: backward overwrites their gradients
  a.token_type = a.embedding_norm_out = a.embedding_norm_mean = a.embedding_norm_rstd =
      Tensor<Real>();
  if (cfg.embeddings.type_vocab_size) shape_as(a.token_type, {d.B, d.S, d.D}, nullptr);
  if (cfg.embeddings.embedding_norm) {
    shape_as(a.embedding_norm_out, {d.B, d.S, d.D}, nullptr);
    shape_as(a.embedding_norm_mean, {d.N}, zero);
    shape_as(a.embedding_norm_rstd, {d.N}, zero);
  }
  // The gradient of a layer's input is overwritten by the layer; the top one accumulates.
  shape_as(a.input, {d.B, d.S, d.D}, cfg.num_layers == 0 ? zero : nullptr);
  a.input_mask.clear();
  a.layers.resize(static_cast<std::size_t>(cfg.num_layers));
  for (std::size_t i = 0; i < a.layers.size(); ++i) {
    auto& l = a.layers[i];
    if (layers_whole) {
      allocate_layer(l, d, zero, cfg.moe_layer(static_cast<index_t>(i)));
    } else {
      l = LayerActs<Real>();
      shape_as(l.output, {d.B, d.S, d.D}, nullptr);
    }
  }
  if (zero && !a.layers.empty()) zero->push_back(&a.layers.back().output);
  if (cfg.norms.norm_first) {
    shape_as(a.final_norm, {d.B, d.S, d.D}, zero);
    shape_as(a.final_norm_mean, {d.N}, zero);
    shape_as(a.final_norm_rstd, {d.N}, zero);
  } else {
    a.final_norm = a.final_norm_mean = a.final_norm_rstd = Tensor<Real>();
  }
  a.pool_argmax.clear();
  if (cfg.lm()) {
    a.pooled = a.pooler_out = a.logits = a.class_probs = Tensor<Real>();
    // zero-filled: the loss's gradient accumulates into lm_logits'
    const index_t rows = cfg.encoder_decoder() ? tgt_len : d.S;
    a.lm_logits.reset({d.B, rows, cfg.target_vocab()});
    a.lm_probs.reset({d.B, rows, cfg.target_vocab()});
  } else {
    a.lm_logits = a.lm_probs = Tensor<Real>();
    a.pooled.reset({d.B, d.D});
    a.pooler_out = Tensor<Real>();
    if (cfg.head.pooler == Pooler::dense_tanh) a.pooler_out.reset({d.B, d.D});
    if (cfg.head.pooling == Pooling::max)
      a.pool_argmax.assign(static_cast<std::size_t>(d.B * d.D), -1);
    a.logits.reset({d.B, d.C});
    a.class_probs.reset({d.B, d.C});
  }
  a.moe_aux_loss = a.moe_z_loss = Tensor<Real>();
  if (a.moe_aux) a.moe_aux_loss.reset(Shape(std::vector<index_t>{}));
  if (a.moe_z) a.moe_z_loss.reset(Shape(std::vector<index_t>{}));
  a.loss.reset(Shape(std::vector<index_t>{}));
}

// A decoder's targets (B * S): the batch's next tokens (next_token_targets).
std::vector<std::int64_t> next_token_targets(const Batch& batch) {
  return teo::next_token_targets(batch.tokens.data(), batch.lengths.data(), batch.batch,
                                 batch.seq_len);
}

// The LM head's weight (V, D): its own, or the embedding matrix when tied.
template <class Real>
const Tensor<Real>& lm_head_weight(const Params<Real>& p) {
  return p.config.head.tie_embeddings ? p.embedding_weight : p.lm_head_weight;
}

template <class Real>
void run_encoder(const Params<Real>& params, const Batch& batch, Activations<Real>& acts,
                 const ForwardOptions& opts, const Emulation<Real>& store);

// The embedding sum into out (B, S, D): embedding + positional, or (embedding + token_type) +
// positional with token types, in the order BERT adds them (semantics 18.1).
template <class Real>
void embedding_sum(Real* out, const Activations<Real>& a, const Dims& d) {
  const Real* first = a.embedding.data();
  if (a.token_types) {
    copy(out, a.embedding.data(), d.N * d.D);
    add(out, a.token_type.data(), d.N * d.D);
    first = out;
  }
  add_positional_forward(out, first, a.positional.data(), d.B, d.S, d.D);
}

// The batch's pixels in Real (input patches).
template <class Real>
std::vector<Real> pixels_of(const Batch& batch) {
  return std::vector<Real>(batch.pixels.begin(), batch.pixels.end());
}

PatchDims patch_dims(const ModelConfig& cfg, const Dims& d) {
  return {d.B, cfg.embeddings.channels, cfg.embeddings.image_size, cfg.embeddings.patch_size, d.D};
}

// The encoder's output: the final norm's (pre-norm), the last layer's, or the input's.
template <class Real>
const Tensor<Real>& encoder_top(const Activations<Real>& a) {
  if (a.norm_first) return a.final_norm;
  return a.layers.empty() ? a.input : a.layers.back().output;
}
}  // namespace

template <class Real>
void forward(const Params<Real>& params, const Batch& batch, Activations<Real>& acts,
             const ForwardOptions& opts) {
  const ModelConfig& cfg = params.config;
  validate_params(params);
  validate_batch(cfg, batch, sizeof(Real));
  check_replayed_masks(cfg, batch, opts);
  check_replayed_routing(cfg, batch, opts);
  const Dims d = dims_of(cfg, batch);
  const Emulation<Real> store(opts.precision, "", opts.fp8);
  full_precision_only(cfg, opts.precision);
  allocate(acts, cfg, d, batch.tgt_len, static_cast<ZeroList<Real>*>(nullptr));

  {
    profile::Scope stage(Stage::embedding);
    if (cfg.patches_input()) {
      // [CLS], then each patch's linear map (semantics 18.5)
      const std::vector<Real> pixels = pixels_of<Real>(batch);
      patch_embedding_forward(
          acts.embedding.data(), pixels.data(), params.patch_embedding_weight.data(),
          params.patch_embedding_bias.data(), params.cls_token.data(), patch_dims(cfg, d));
    } else {
      const Real scale = cfg.embeddings.embed_scale
                             ? static_cast<Real>(std::sqrt(static_cast<double>(d.D)))
                             : Real(1);
      embedding_forward(acts.embedding.data(), batch.tokens.data(), params.embedding_weight.data(),
                        d.N, d.D, scale);
    }
    store(acts.embedding, "", "embedding");
    // rope, alibi and none add nothing here: their table is 0
    if (cfg.embeddings.positional == Positional::sinusoidal) {
      sinusoidal_table(acts.positional.data(), d.S, d.D, cfg.embeddings.position_offset);
    } else if (cfg.embeddings.positional == Positional::learned) {
      copy(acts.positional.data(),
           params.pos_embedding_weight.data() + cfg.embeddings.position_offset * d.D, d.S * d.D);
    } else {
      acts.positional.zero();
    }
    store(acts.positional, "", "positional");
    if (cfg.embeddings.type_vocab_size) {
      embedding_forward(acts.token_type.data(), batch.token_types.data(),
                        params.token_type_embedding_weight.data(), d.N, d.D, Real(1));
      store(acts.token_type, "", "token_type");
    }
    // input = dropout(sum), or dropout(norm(sum)) with embedding_norm; sum = embedding +
    // positional (+ token_type); the dropout applied in place
    embedding_sum(acts.input.data(), acts, d);
    const Real* dropped = acts.input.data();
    if (cfg.embeddings.embedding_norm) {
      detail::norm_forward(cfg, acts.embedding_norm_out.data(), acts.embedding_norm_mean.data(),
                           acts.embedding_norm_rstd.data(), acts.input.data(),
                           params.embedding_norm_weight.data(),
                           detail::data_or_null(params.embedding_norm_bias), d.N, d.D);
      store(acts.embedding_norm_out, "", "embedding_norm");
      dropped = acts.embedding_norm_out.data();
    }
    const Real* in = apply_dropout(acts.input.data(), dropped, acts.input_mask, d.N * d.D,
                                   "dropout.input", cfg.dropout, opts.train && cfg.dropout > 0.0,
                                   MaskSource{opts.dropout_seed, opts.masks});
    if (in != acts.input.data()) copy(acts.input.data(), in, d.N * d.D);  // no dropout applied
    store(acts.input, "", "input");
  }
  run_encoder(params, batch, acts, opts, store);
}

namespace {

// The stack, pooling, head and loss from acts.input; the caller has validated everything.
template <class Real>
void run_encoder(const Params<Real>& params, const Batch& batch, Activations<Real>& acts,
                 const ForwardOptions& opts, const Emulation<Real>& store) {
  const ModelConfig& cfg = params.config;
  const Dims d = dims_of(cfg, batch);
  const bool drop = opts.train && cfg.dropout > 0.0;
  const Real* x = acts.input.data();
  for (std::size_t i = 0; i < acts.layers.size(); ++i) {
    layer_forward(cfg, static_cast<index_t>(i), params.layers[i], acts.layers[i], x, batch, d,
                  "dropout.layers." + std::to_string(i) + ".", drop,
                  MaskSource{opts.dropout_seed, opts.masks}, store, routing_of(opts, i));
    x = acts.layers[i].output.data();
  }
  profile::Scope stage(Stage::head);
  if (cfg.norms.norm_first) {
    detail::norm_forward(cfg, acts.final_norm.data(), acts.final_norm_mean.data(),
                         acts.final_norm_rstd.data(), x, params.final_norm_weight.data(),
                         detail::data_or_null(params.final_norm_bias), d.N, d.D);
    store(acts.final_norm, "", "final_norm");
    x = acts.final_norm.data();
  }
  if (cfg.encoder_decoder()) {
    detail::seq2seq_forward(params, batch, acts, encoder_top(acts));
    return;
  }
  if (cfg.decoder()) {
    // lm_logits = top W^T + b; the loss: cross-entropy of each position against the next token
    const index_t V = cfg.embeddings.vocab_size;
    linear_forward(acts.lm_logits.data(), x, lm_head_weight(params).data(),
                   detail::data_or_null(params.lm_head_bias), d.N, d.D, V);
    store(acts.lm_logits, "", "lm_logits");
    acts.loss[0] = cross_entropy_forward(acts.lm_probs.data(), acts.lm_logits.data(),
                                         next_token_targets(batch).data(), d.N, V,
                                         static_cast<Real>(cfg.head.label_smoothing));
    acts.loss[0] += detail::moe_losses_forward(cfg, batch, acts);
    store(acts.loss, "", "loss");
    return;
  }
  if (cfg.head.pooling == Pooling::max)
    acts.pool_argmax.assign(static_cast<std::size_t>(d.B * d.D), -1);
  pooling_forward(acts.pooled.data(), acts.pool_argmax.data(), x, batch.lengths.data(), d.B, d.S,
                  d.D, cfg.head.pooling);
  store(acts.pooled, "", "pooled");
  const Real* head_in = acts.pooled.data();
  if (cfg.head.pooler == Pooler::dense_tanh) {
    // pooler = tanh(pooled Wp^T + bp), BERT's pooler
    linear_forward(acts.pooler_out.data(), acts.pooled.data(), params.pooler_weight.data(),
                   params.pooler_bias.data(), d.B, d.D, d.D);
    for (index_t i = 0; i < d.B * d.D; ++i) acts.pooler_out[i] = std::tanh(acts.pooler_out[i]);
    store(acts.pooler_out, "", "pooler");
    head_in = acts.pooler_out.data();
  }
  linear_forward(acts.logits.data(), head_in, params.head_weight.data(),
                 detail::data_or_null(params.head_bias), d.B, d.D, d.C);
  store(acts.logits, "", "logits");
  acts.loss[0] =
      cross_entropy_forward(acts.class_probs.data(), acts.logits.data(), batch.labels.data(), d.B,
                            d.C, static_cast<Real>(cfg.head.label_smoothing));
  acts.loss[0] += detail::moe_losses_forward(cfg, batch, acts);
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
  check_replayed_routing(params.config, batch, opts);
  full_precision_only(params.config, opts.precision);
  run_encoder(params, batch, acts, opts, Emulation<Real>(opts.precision, "", opts.fp8));
}

template <class Real>
void backward(const Params<Real>& params, const Batch& batch, const Activations<Real>& acts,
              Params<Real>& grads, Activations<Real>& dacts, const BackwardOptions& opts) {
  const ModelConfig& cfg = params.config;
  validate_params(params);
  validate_batch(cfg, batch, sizeof(Real));
  validate_activations(cfg, batch, acts);
  full_precision_only(cfg, opts.precision);
  const Dims d = dims_of(cfg, batch);
  const Emulation<Real> store(opts.precision, "the gradient of ", opts.fp8);
  {
    // The gradients that accumulate from the start begin at zero (Params::zeros, with the fill
    // done by zero_fill): every parameter's, and the few activation gradients allocate() lists.
    // The first writer of every other one overwrites it.
    profile::Scope stage(Stage::bwd_zero_fill);
    ZeroList<Real> zero;
    grads = Params<Real>();
    grads.config = cfg;
    grads.layers.resize(static_cast<std::size_t>(cfg.num_layers));
    for (std::size_t i = 0; i < grads.layers.size(); ++i)
      grads.layers[i].configure(cfg, static_cast<index_t>(i));
    if (cfg.encoder_decoder()) {
      grads.decoder_layers.assign(static_cast<std::size_t>(cfg.dec_layers()),
                                  DecoderLayerParams<Real>::markers(cfg, true));
    }
    grads.visit([&](const std::string& name, Tensor<Real>& t) {
      shape_as(t, detail::param_shape(cfg, name), &zero);
    });
    allocate(dacts, cfg, d, batch.tgt_len, &zero, opts.layer_activation_grads);
    zero_fill(zero);
  }

  // loss = cross_entropy(logits); logits = pooled * head^T + b (a decoder: loss =
  // cross_entropy(lm_logits, next tokens); lm_logits = top * W^T + b)
  {
    profile::Scope stage(Stage::bwd_head);
    dacts.loss[0] = Real(1);
    Tensor<Real>& dlast = cfg.num_layers > 0 ? dacts.layers.back().output : dacts.input;
    const Real* last = cfg.num_layers > 0 ? acts.layers.back().output.data() : acts.input.data();
    Real* dtop = cfg.norms.norm_first ? dacts.final_norm.data() : dlast.data();
    if (cfg.encoder_decoder()) {
      // the decoder side, which adds the memory's gradient into the encoder's top
      detail::seq2seq_backward(params, batch, acts, encoder_top(acts), grads, dacts, dtop);
    } else if (cfg.decoder()) {
      const index_t V = cfg.embeddings.vocab_size;
      cross_entropy_backward(dacts.lm_logits.data(), acts.lm_probs.data(),
                             next_token_targets(batch).data(), d.N, V,
                             static_cast<Real>(cfg.head.label_smoothing), dacts.loss[0]);
      store(dacts.lm_logits, "", "lm_logits");
      // a tied head's weight gradient goes into the embedding's, before the lookup's
      Real* dw =
          cfg.head.tie_embeddings ? grads.embedding_weight.data() : grads.lm_head_weight.data();
      linear_backward(dtop, dw, detail::data_or_null(grads.lm_head_bias), dacts.lm_logits.data(),
                      cfg.norms.norm_first ? acts.final_norm.data() : last,
                      lm_head_weight(params).data(), d.N, d.D, V);
    } else {
      cross_entropy_backward(dacts.logits.data(), acts.class_probs.data(), batch.labels.data(), d.B,
                             d.C, static_cast<Real>(cfg.head.label_smoothing), dacts.loss[0]);
      store(dacts.logits, "", "logits");
      if (cfg.head.pooler == Pooler::dense_tanh) {
        linear_backward(dacts.pooler_out.data(), grads.head_weight.data(),
                        detail::data_or_null(grads.head_bias), dacts.logits.data(),
                        acts.pooler_out.data(), params.head_weight.data(), d.B, d.D, d.C);
        store(dacts.pooler_out, "", "pooler");
        // d(pre-activation) = dpooler (1 - pooler^2)
        Tensor<Real> dpre({d.B, d.D});
        for (index_t i = 0; i < d.B * d.D; ++i) {
          const Real y = acts.pooler_out[i];
          dpre[i] = dacts.pooler_out[i] * (Real(1) - y * y);
        }
        linear_backward(dacts.pooled.data(), grads.pooler_weight.data(), grads.pooler_bias.data(),
                        dpre.data(), acts.pooled.data(), params.pooler_weight.data(), d.B, d.D,
                        d.D);
      } else {
        linear_backward(dacts.pooled.data(), grads.head_weight.data(),
                        detail::data_or_null(grads.head_bias), dacts.logits.data(),
                        acts.pooled.data(), params.head_weight.data(), d.B, d.D, d.C);
      }
      store(dacts.pooled, "", "pooled");
      // pooled = pool(top); top = final_norm(last) (pre) or last
      pooling_backward(dtop, dacts.pooled.data(), acts.pool_argmax.data(), batch.lengths.data(),
                       d.B, d.S, d.D, cfg.head.pooling);
    }
    if (cfg.norms.norm_first) {
      store(dacts.final_norm, "", "final_norm");
      detail::norm_backward(cfg, dlast.data(), grads.final_norm_weight.data(),
                            detail::data_or_null(grads.final_norm_bias), dacts.final_norm.data(),
                            last, params.final_norm_weight.data(), acts.final_norm_mean.data(),
                            acts.final_norm_rstd.data(), d.N, d.D);
    }
    const std::string last_name =
        cfg.num_layers > 0 ? "layers." + std::to_string(cfg.num_layers - 1) + ".output" : "input";
    store(dlast, "", last_name.c_str());
  }
  // the router's loss terms: their gradient of each MoE layer's logits
  const std::vector<std::vector<Real>> moe_dlogits =
      detail::moe_losses_backward(cfg, batch, acts, dacts.loss[0]);
  if (acts.moe_aux)
    dacts.moe_aux_loss[0] = dacts.loss[0] * static_cast<Real>(cfg.ffn.moe.router_aux_loss_coef);
  if (acts.moe_z)
    dacts.moe_z_loss[0] = dacts.loss[0] * static_cast<Real>(cfg.ffn.moe.router_z_loss_coef);
  LayerActs<Real> scratch;  // the layer's activation gradients when they are not all kept
  for (std::size_t i = acts.layers.size(); i-- > 0;) {
    Real* dx = i > 0 ? dacts.layers[i - 1].output.data() : dacts.input.data();
    const Real* x = i > 0 ? acts.layers[i - 1].output.data() : acts.input.data();
    const std::string name = "layers." + std::to_string(i) + ".";
    LayerActs<Real>& dL = opts.layer_activation_grads ? dacts.layers[i] : scratch;
    if (!opts.layer_activation_grads) {
      // as allocate() would give them, around the layer's kept output gradient
      ZeroList<Real> zero;
      allocate_layer(scratch, d, &zero, cfg.moe_layer(static_cast<index_t>(i)));
      zero_fill(zero);
      std::swap(scratch.output, dacts.layers[i].output);
    }
    layer_backward(cfg, static_cast<index_t>(i), params.layers[i], acts.layers[i], grads.layers[i],
                   dL, dx, x, batch.lengths.data(), d, name, store,
                   moe_dlogits[i].empty() ? nullptr : moe_dlogits[i].data());
    if (!opts.layer_activation_grads) std::swap(scratch.output, dacts.layers[i].output);
    // dx is complete: the gradient of the layer's input
    store(dx, d.N * d.D, "",
          i > 0 ? ("layers." + std::to_string(i - 1) + ".output").c_str() : "input");
  }
  // input = dropout(sum) or dropout(norm(sum)); sum = embedding + positional (+ token_type)
  profile::Scope stage(Stage::bwd_embedding);
  // d(sum) is the gradient of the embedding itself, written here first
  if (cfg.embeddings.embedding_norm) {
    dropout_grad(dacts.embedding_norm_out.data(), dacts.input.data(), acts.input_mask, d.N * d.D,
                 cfg.dropout);
    store(dacts.embedding_norm_out, "", "embedding_norm");
    Tensor<Real> sum;  // the norm's input, recomputed as forward computed it
    sum.reset_for_overwrite({d.B, d.S, d.D});
    embedding_sum(sum.data(), acts, d);
    detail::norm_backward(cfg, dacts.embedding.data(), grads.embedding_norm_weight.data(),
                          detail::data_or_null(grads.embedding_norm_bias),
                          dacts.embedding_norm_out.data(), sum.data(),
                          params.embedding_norm_weight.data(), acts.embedding_norm_mean.data(),
                          acts.embedding_norm_rstd.data(), d.N, d.D, GradWrite::overwrite);
  } else {
    dropout_grad(dacts.embedding.data(), dacts.input.data(), acts.input_mask, d.N * d.D,
                 cfg.dropout);
  }
  store(dacts.embedding, "", "embedding");
  if (cfg.embeddings.type_vocab_size) {
    // d(token_type) = d(sum): the rows' gradients, scattered into the table
    copy(dacts.token_type.data(), dacts.embedding.data(), d.N * d.D);
    store(dacts.token_type, "", "token_type");
    embedding_backward(grads.token_type_embedding_weight.data(), dacts.token_type.data(),
                       batch.token_types.data(), d.N, d.D, Real(1));
  }
  add_positional_backward(dacts.positional.data(), dacts.embedding.data(), d.B, d.S, d.D);
  store(dacts.positional, "", "positional");
  if (cfg.embeddings.positional == Positional::learned) {
    add(grads.pos_embedding_weight.data() + cfg.embeddings.position_offset * d.D,
        dacts.positional.data(), d.S * d.D);
  }
  if (cfg.patches_input()) {
    const std::vector<Real> pixels = pixels_of<Real>(batch);
    patch_embedding_backward(static_cast<Real*>(nullptr), grads.patch_embedding_weight.data(),
                             grads.patch_embedding_bias.data(), grads.cls_token.data(),
                             dacts.embedding.data(), pixels.data(),
                             params.patch_embedding_weight.data(), patch_dims(cfg, d));
  } else {
    const Real scale = cfg.embeddings.embed_scale
                           ? static_cast<Real>(std::sqrt(static_cast<double>(d.D)))
                           : Real(1);
    embedding_backward(grads.embedding_weight.data(), dacts.embedding.data(), batch.tokens.data(),
                       d.N, d.D, scale, cfg.embeddings.padding_idx.value_or(-1));
  }
  if (store.stores_reduced()) {
    grads.visit([&](const std::string& name, Tensor<Real>& g) { store(g, "", name.c_str()); });
  }
}

namespace {

// Checks the arguments of a single-layer pass (ShapeError) and returns its dimensions.
template <class Real>
Dims layer_dims(const ModelConfig& cfg, const LayerParams<Real>& P, const Tensor<Real>& x,
                const std::vector<std::int64_t>& lengths, Batch& batch) {
  cfg.validate();
  if (x.shape().rank() != 3 || x.dim(2) != cfg.d_model ||
      x.dim(0) != static_cast<index_t>(lengths.size())) {
    throw ShapeError("encoder layer: x is " + x.shape().str() + ", expected (" +
                     std::to_string(lengths.size()) + ", S, " + std::to_string(cfg.d_model) + ")");
  }
  if (!P.configured_for(cfg, 0)) {
    throw ShapeError(
        "encoder layer: the parameters' presence flags (has_sinks, has_attn_bias, "
        "has_norm_bias, gated, has_ffn_bias, moe, ...) are not those of the config's layer 0: "
        "call LayerParams::configure(cfg, 0)");
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
void encoder_layer_forward(const ModelConfig& cfg, const LayerParams<Real>& P,
                           const Tensor<Real>& x, const std::vector<std::int64_t>& lengths,
                           LayerActs<Real>& L, const ForwardOptions& opts) {
  Batch batch;
  const Dims d = layer_dims(cfg, P, x, lengths, batch);
  check_replayed_masks(cfg, batch, opts);
  check_replayed_routing(cfg, batch, opts);
  const Emulation<Real> store(opts.precision, "", opts.fp8);
  allocate_layer(L, d, static_cast<ZeroList<Real>*>(nullptr), cfg.moe_layer(0));
  layer_forward(cfg, 0, P, L, x.data(), batch, d, "dropout.layers.0.",
                opts.train && cfg.dropout > 0.0, MaskSource{opts.dropout_seed, opts.masks}, store,
                routing_of(opts, 0));
}

template <class Real>
void encoder_layer_backward(const ModelConfig& cfg, const LayerParams<Real>& P,
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
  const Emulation<Real> store(opts.precision, "the gradient of ", opts.fp8);
  ZeroList<Real> zero;
  G.configure(cfg, 0);
  G.visit([&](const std::string& name, Tensor<Real>& t) {
    shape_as(t, detail::param_shape(cfg, "layers.0." + name), &zero);
  });
  allocate_layer(dL, d, &zero, cfg.moe_layer(0));
  shape_as(dx, x.shape(), nullptr);  // layer_backward overwrites it
  zero_fill(zero);
  copy(dL.output.data(), dy.data(), dy.numel());
  layer_backward(cfg, 0, P, L, G, dL, dx.data(), x.data(), batch.lengths.data(), d, "layers.0.",
                 store);
  store(dx, "", "x");
  if (store.stores_reduced()) {
    G.visit([&](const std::string& name, Tensor<Real>& g) { store(g, "layers.0.", name.c_str()); });
  }
}

#define TEO_INSTANTIATE(Real)                                                                      \
  template void encoder_layer_forward<Real>(const ModelConfig&, const LayerParams<Real>&,          \
                                            const Tensor<Real>&, const std::vector<std::int64_t>&, \
                                            LayerActs<Real>&, const ForwardOptions&);              \
  template void encoder_layer_backward<Real>(                                                      \
      const ModelConfig&, const LayerParams<Real>&, const Tensor<Real>&,                           \
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
