// Batches, parameters and the checks of what callers hand back: everything of model.hpp except
// forward() and backward(), which live in model.cpp.
#include <algorithm>
#include <cmath>
#include <limits>

#include "model/model_internal.hpp"
#include "teo/contract.hpp"
#include "teo/model.hpp"
#include "teo/precision.hpp"
#include "teo/rng.hpp"
#include "teo/rounding.hpp"

namespace teo {

// ---------------------------------------------------------------------------------------------
// Batches

namespace {

// One length per sequence, each in [0, seq_len].
void validate_lengths(const std::vector<std::int64_t>& lengths, index_t batch, index_t seq_len) {
  if (lengths.size() != static_cast<std::size_t>(batch)) {
    throw ShapeError("lengths has " + std::to_string(lengths.size()) +
                     " elements, expected batch = " + std::to_string(batch));
  }
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    if (lengths[i] < 0 || lengths[i] > seq_len) {
      throw ShapeError("lengths[" + std::to_string(i) + "] = " + std::to_string(lengths[i]) +
                       " is outside [0, seq_len = " + std::to_string(seq_len) + "]");
    }
  }
}

// input patches: seq_len is 1 + patches, every length is full, the pixels are (B, Ch, Img, Img)
// and finite.
void validate_pixels(const ModelConfig& cfg, const Batch& b, std::size_t real_size) {
  const index_t S = 1 + cfg.patches();
  if (b.seq_len != S) {
    throw ShapeError("seq_len " + std::to_string(b.seq_len) +
                     " is not 1 + patches = " + std::to_string(S) +
                     ": with input \"patches\" the sequence is [CLS] and the " + "image's patches");
  }
  const index_t want =
      b.batch * cfg.embeddings.channels * cfg.embeddings.image_size * cfg.embeddings.image_size;
  if (static_cast<index_t>(b.pixels.size()) != want) {
    throw ShapeError(
        "pixels has " + std::to_string(b.pixels.size()) +
        " elements, expected batch x channels x image_size x image_size = " + std::to_string(want));
  }
  for (std::size_t i = 0; i < b.lengths.size(); ++i) {
    if (b.lengths[i] != S) {
      throw InputError("lengths[" + std::to_string(i) + "] = " + std::to_string(b.lengths[i]) +
                       ": an image has no padding, every length is " + std::to_string(S));
    }
  }
  for (std::size_t i = 0; i < b.pixels.size(); ++i) {
    if (!std::isfinite(b.pixels[i]))
      throw InputError("pixels[" + std::to_string(i) + "] is not finite");
    // a float pass reads them as float: one beyond its range would become inf
    if (real_size == sizeof(float) &&
        std::abs(b.pixels[i]) > static_cast<double>(std::numeric_limits<float>::max())) {
      throw InputError("pixels[" + std::to_string(i) + "] = " + std::to_string(b.pixels[i]) +
                       " is beyond float32's range");
    }
  }
}

}  // namespace

Batch Batch::random(const ModelConfig& cfg, index_t batch, index_t seq_len, std::uint64_t seed,
                    std::vector<std::int64_t> lengths) {
  cfg.validate();
  if (cfg.encoder_decoder())
    throw ConfigError("an encoder_decoder's batch has a target: use Batch::random_seq2seq");
  validate_batch_shape(cfg, {batch, seq_len}, sizeof(double));
  if (!lengths.empty()) validate_lengths(lengths, batch, seq_len);
  Batch b;
  b.batch = batch;
  b.seq_len = seq_len;
  b.lengths = lengths.empty() ? std::vector<std::int64_t>(static_cast<std::size_t>(batch), seq_len)
                              : std::move(lengths);
  b.tokens.resize(cfg.patches_input() ? 0 : static_cast<std::size_t>(batch * seq_len));
  b.labels.resize(cfg.decoder() ? 0 : static_cast<std::size_t>(batch));  // a decoder has none
  if (cfg.patches_input()) {
    // multiples of 2^-8 in [-1, 1): exact in every format down to bf16 and fp16
    b.pixels.resize(static_cast<std::size_t>(
        batch * cfg.embeddings.channels * cfg.embeddings.image_size * cfg.embeddings.image_size));
    const auto pix_stream = rng::stream_id("input.pixels");
    for (std::size_t i = 0; i < b.pixels.size(); ++i)
      b.pixels[i] = static_cast<double>(
                        static_cast<std::int64_t>(rng::bits(seed, pix_stream, i) % 512) - 256) /
                    256.0;
  }
  const auto tok_stream = rng::stream_id("input.tokens");
  const auto lab_stream = rng::stream_id("input.labels");
  for (std::size_t i = 0; i < b.tokens.size(); ++i)
    b.tokens[i] = static_cast<std::int64_t>(rng::bits(seed, tok_stream, i) %
                                            static_cast<std::uint64_t>(cfg.embeddings.vocab_size));
  // a padded position holds the pad token, as a real batch's does (BERT's and RoBERTa's
  // padding_idx), so that a backend that embeds it or learns its row is caught
  if (cfg.embeddings.padding_idx && !b.tokens.empty()) {
    for (index_t r = 0; r < batch; ++r)
      for (index_t s = b.lengths[static_cast<std::size_t>(r)]; s < seq_len; ++s)
        b.tokens[static_cast<std::size_t>(r * seq_len + s)] = *cfg.embeddings.padding_idx;
  }
  for (std::size_t i = 0; i < b.labels.size(); ++i)
    b.labels[i] = static_cast<std::int64_t>(rng::bits(seed, lab_stream, i) %
                                            static_cast<std::uint64_t>(cfg.head.num_classes));
  if (cfg.embeddings.type_vocab_size) {
    // every position, padding included, as the tokens; a stream of its own, so the tokens and
    // labels are those of the same seed without token types
    b.token_types.resize(b.tokens.size());
    const auto type_stream = rng::stream_id("input.token_types");
    for (std::size_t i = 0; i < b.token_types.size(); ++i)
      b.token_types[i] =
          static_cast<std::int64_t>(rng::bits(seed, type_stream, i) %
                                    static_cast<std::uint64_t>(*cfg.embeddings.type_vocab_size));
  }
  validate_batch(cfg, b, sizeof(double));
  return b;
}

Batch Batch::random_seq2seq(const ModelConfig& cfg, index_t batch, index_t seq_len, index_t tgt_len,
                            std::uint64_t seed, std::vector<std::int64_t> lengths,
                            std::vector<std::int64_t> tgt_lengths) {
  cfg.validate();
  if (!cfg.encoder_decoder())
    throw ConfigError("Batch::random_seq2seq needs architecture \"encoder_decoder\"");
  validate_batch_shape(cfg, {batch, seq_len, tgt_len}, sizeof(double));
  if (!lengths.empty()) validate_lengths(lengths, batch, seq_len);
  if (!tgt_lengths.empty()) validate_lengths(tgt_lengths, batch, tgt_len);
  Batch b;
  b.batch = batch;
  b.seq_len = seq_len;
  b.tgt_len = tgt_len;
  const auto full = [&](std::vector<std::int64_t>& v, index_t len) {
    return v.empty() ? std::vector<std::int64_t>(static_cast<std::size_t>(batch), len)
                     : std::move(v);
  };
  b.lengths = full(lengths, seq_len);
  b.tgt_lengths = full(tgt_lengths, tgt_len);
  const auto draw = [&](std::vector<std::int64_t>& v, index_t n, const char* stream, index_t hi) {
    v.resize(static_cast<std::size_t>(n));
    const auto id = rng::stream_id(stream);
    for (std::size_t i = 0; i < v.size(); ++i)
      v[i] = static_cast<std::int64_t>(rng::bits(seed, id, i) % static_cast<std::uint64_t>(hi));
  };
  draw(b.tokens, batch * seq_len, "input.src_tokens", cfg.embeddings.vocab_size);
  draw(b.tgt_tokens, batch * tgt_len, "input.tgt_tokens", cfg.target_vocab());
  validate_batch(cfg, b, sizeof(double));
  return b;
}

void validate_batch(const ModelConfig& cfg, const Batch& b, std::size_t real_size) {
  validate_batch_shape(cfg, {b.batch, b.seq_len, cfg.encoder_decoder() ? b.tgt_len : 0}, real_size);
  if (cfg.encoder_decoder()) {
    const auto nt = static_cast<std::size_t>(b.batch * b.tgt_len);
    if (b.tgt_tokens.size() != nt) {
      throw ShapeError("tgt_tokens has " + std::to_string(b.tgt_tokens.size()) +
                       " elements, expected batch x tgt_len = " + std::to_string(nt));
    }
    validate_lengths(b.tgt_lengths, b.batch, b.tgt_len);
    for (std::size_t i = 0; i < nt; ++i) {
      if (b.tgt_tokens[i] < 0 || b.tgt_tokens[i] >= cfg.target_vocab()) {
        throw InputError(
            "tgt_tokens[" + std::to_string(i / b.tgt_len) + "][" + std::to_string(i % b.tgt_len) +
            "] = " + std::to_string(b.tgt_tokens[i]) +
            " is outside [0, decoder vocabulary = " + std::to_string(cfg.target_vocab()) + ")");
      }
    }
  } else if (b.tgt_len != 0 || !b.tgt_tokens.empty() || !b.tgt_lengths.empty()) {
    throw ShapeError("a target (tgt_tokens) applies only to architecture \"encoder_decoder\"");
  }
  if (cfg.patches_input()) {
    validate_pixels(cfg, b, real_size);
  } else if (!b.pixels.empty()) {
    throw ShapeError("pixels apply only to input \"patches\": the config reads tokens");
  }
  const auto n = static_cast<std::size_t>(cfg.patches_input() ? 0 : b.batch * b.seq_len);
  if (b.tokens.size() != n) {
    throw ShapeError("tokens has " + std::to_string(b.tokens.size()) + " elements, expected " +
                     (cfg.patches_input() ? std::string("none: input \"patches\" reads pixels")
                                          : "batch x seq_len = " + std::to_string(n)));
  }
  if (!cfg.lm() && b.labels.size() != static_cast<std::size_t>(b.batch)) {
    throw ShapeError("labels has " + std::to_string(b.labels.size()) +
                     " elements, expected batch = " + std::to_string(b.batch));
  }
  validate_lengths(b.lengths, b.batch, b.seq_len);
  for (std::size_t i = 0; i < n; ++i) {
    if (b.tokens[i] < 0 || b.tokens[i] >= cfg.embeddings.vocab_size) {
      throw InputError("tokens[" + std::to_string(i / b.seq_len) + "][" +
                       std::to_string(i % b.seq_len) + "] = " + std::to_string(b.tokens[i]) +
                       " is outside [0, vocab_size = " + std::to_string(cfg.embeddings.vocab_size) +
                       ")");
    }
  }
  const auto types = static_cast<std::size_t>(cfg.embeddings.type_vocab_size ? n : 0);
  if (b.token_types.size() != types) {
    throw ShapeError(
        "token_types has " + std::to_string(b.token_types.size()) + " elements, expected " +
        (cfg.embeddings.type_vocab_size ? "batch x seq_len = " + std::to_string(n)
                                        : std::string("none: the config has no type_vocab_size")));
  }
  for (std::size_t i = 0; i < types; ++i) {
    if (b.token_types[i] < 0 || b.token_types[i] >= *cfg.embeddings.type_vocab_size) {
      throw InputError("token_types[" + std::to_string(i / b.seq_len) + "][" +
                       std::to_string(i % b.seq_len) + "] = " + std::to_string(b.token_types[i]) +
                       " is outside [0, type_vocab_size = " +
                       std::to_string(*cfg.embeddings.type_vocab_size) + ")");
    }
  }
  for (std::size_t i = 0; i < (cfg.lm() ? 0 : b.labels.size()); ++i) {
    if (b.labels[i] < 0 || b.labels[i] >= cfg.head.num_classes) {
      throw InputError("labels[" + std::to_string(i) + "] = " + std::to_string(b.labels[i]) +
                       " is outside [0, num_classes = " + std::to_string(cfg.head.num_classes) +
                       ")");
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Parameters

namespace detail {

// The shape of parameter `name` under config c, from the contract's symbolic shape.
Shape param_shape(const ModelConfig& c, const std::string& name) {
  return Shape(contract::shape(contract::param_dims(name), c, {}));
}

}  // namespace detail

template <class Real>
Params<Real> Params<Real>::zeros(const ModelConfig& cfg) {
  cfg.validate();
  Params p;
  p.config = cfg;
  p.layers.resize(static_cast<std::size_t>(cfg.num_layers));
  for (std::size_t i = 0; i < p.layers.size(); ++i)
    p.layers[i].configure(cfg, static_cast<index_t>(i));
  if (cfg.encoder_decoder()) {
    p.decoder_layers.assign(static_cast<std::size_t>(cfg.dec_layers()),
                            DecoderLayerParams<Real>::markers(cfg, /*cross=*/true));
  }
  p.visit([&](const std::string& name, Tensor<Real>& t) {
    t = Tensor<Real>(detail::param_shape(cfg, name));
  });
  return p;
}

template <class Real>
Params<Real> Params<Real>::init(const ModelConfig& cfg, std::uint64_t seed) {
  Params p = zeros(cfg);
  p.visit([&](const std::string& name, Tensor<Real>& t) {
    const bool is_norm = name.find("norm") != std::string::npos;
    if (is_norm) {
      t.fill(name.ends_with(".weight") ? Real(1) : Real(0));
      return;
    }
    double bound;
    if (name.starts_with("patch_embedding.")) {
      // Conv2d's default bound, 1 / sqrt(fan_in), fan_in = Ch P P, for weight and bias alike
      bound =
          1.0 / std::sqrt(static_cast<double>(cfg.embeddings.channels * cfg.embeddings.patch_size *
                                              cfg.embeddings.patch_size));
    } else if (name.ends_with("embedding.weight") || name == "cls_token") {
      bound = std::sqrt(3.0);  // variance 1, like PyTorch's N(0, 1) embedding
    } else if (name.ends_with(".attn.sinks")) {
      bound = 1.0;  // sink logits of the order of the scores
    } else if (name.find(".moe.experts.") != std::string::npos) {
      // each expert a Linear: w_down and b_down read moe_d_ff, the others d_model
      const bool down = name.ends_with("w_down") || name.ends_with("b_down");
      bound = 1.0 / std::sqrt(static_cast<double>(down ? cfg.ffn.moe.moe_d_ff : cfg.d_model));
    } else {
      // Linear: PyTorch's default bound 1 / sqrt(in_features) for weight and bias alike.
      const index_t in_features = name.ends_with(".weight")               ? t.dim(1)
                                  : name.find("fc2") != std::string::npos ? cfg.ffn.d_ff
                                  : name.ends_with("attn.o.bias")         ? cfg.context_width()
                                                                          : cfg.d_model;
      bound = 1.0 / std::sqrt(static_cast<double>(in_features));
    }
    const std::uint64_t stream = rng::stream_id(name);
    for (index_t i = 0; i < t.numel(); ++i) {
      const double u = rng::uniform01(seed, stream, static_cast<std::uint64_t>(i));
      t[i] = static_cast<Real>((2.0 * u - 1.0) * bound);
    }
  });
  return p;
}

// ---------------------------------------------------------------------------------------------
// Validation of what callers hand back to us

namespace {

void expect_shape(const std::string& what, const Shape& got, const Shape& want) {
  if (!(got == want)) {
    throw ShapeError(what + " has shape " + got.str() + ", expected " + want.str());
  }
}

template <class T>
void expect_size(const std::string& what, const std::vector<T>& v, index_t want, bool optional) {
  if (optional && v.empty()) return;
  if (static_cast<index_t>(v.size()) != want) {
    throw ShapeError(what + " has " + std::to_string(v.size()) + " elements, expected " +
                     std::to_string(want));
  }
}

}  // namespace

template <class Real>
void validate_params(const Params<Real>& p) {
  const ModelConfig& c = p.config;
  c.validate();
  if (p.layers.size() != static_cast<std::size_t>(c.num_layers)) {
    throw ShapeError("params has " + std::to_string(p.layers.size()) +
                     " layers, config.num_layers is " + std::to_string(c.num_layers));
  }
  for (std::size_t i = 0; i < p.layers.size(); ++i) {
    if (p.layers[i].has_sinks != c.attention.attn_sinks) {
      throw ShapeError("parameter layers." + std::to_string(i) + ".attn.sinks is " +
                       (c.attention.attn_sinks ? "missing" : "present") +
                       ", but config.attn_sinks is " + (c.attention.attn_sinks ? "true" : "false"));
    }
    if (!p.layers[i].configured_for(c, static_cast<index_t>(i))) {
      throw ShapeError("the parameters of layers." + std::to_string(i) +
                       " are not those of the config (its attn_bias, norm, ffn, ffn_bias or "
                       "MoE keys): build them with Params::zeros or LayerParams::configure");
    }
  }
  const auto want_decoder = c.encoder_decoder() ? c.dec_layers() : 0;
  if (p.decoder_layers.size() != static_cast<std::size_t>(want_decoder)) {
    throw ShapeError("params has " + std::to_string(p.decoder_layers.size()) +
                     " decoder layers, the config " + std::to_string(want_decoder));
  }
  for (std::size_t i = 0; i < p.decoder_layers.size(); ++i) {
    // each holds exactly the tensors the config's decoder layer has (names checked by count)
    std::size_t have = 0, want = 0;
    p.decoder_layers[i].visit(c.norms.norm_first,
                              [&](const std::string&, const Tensor<Real>&) { ++have; });
    DecoderLayerParams<Real>::markers(c, true).visit(
        c.norms.norm_first, [&](const std::string&, const Tensor<Real>&) { ++want; });
    if (have != want || !p.decoder_layers[i].cross()) {
      throw ShapeError("the parameters of decoder.layers." + std::to_string(i) +
                       " are not those of the config: build them with Params::zeros");
    }
  }
  p.visit([&](const std::string& name, const Tensor<Real>& t) {
    expect_shape("parameter " + name, t.shape(), detail::param_shape(c, name));
  });
}

template <class Real>
void validate_activations(const ModelConfig& c, const Batch& b, const Activations<Real>& a) {
  const index_t B = b.batch, S = b.seq_len, D = c.d_model, N = B * S;
  if (!a.configured_for(c) || a.layers.size() != static_cast<std::size_t>(c.num_layers) ||
      a.decoder_layers.size() !=
          static_cast<std::size_t>(c.encoder_decoder() ? c.dec_layers() : 0)) {
    throw ShapeError(
        "activations were produced for a different config (architecture, norm_first, rope, ffn, "
        "type_vocab_size, embedding_norm, pooler or num_layers)");
  }
  const contract::Sizes sizes{B, S, 0, b.tgt_len};
  const auto shape_of = [&](const std::vector<std::string>& dims) {
    return Shape(contract::shape(dims, c, sizes));
  };
  a.visit([&](const std::string& name, const Tensor<Real>& t) {
    expect_shape("activation " + name, t.shape(), shape_of(contract::act_dims(name)));
  });
  for (std::size_t i = 0; i < a.layers.size(); ++i) {
    const auto& l = a.layers[i];
    const std::string p = "layers." + std::to_string(i) + ".";
    for (const auto* t : {&l.norm1_mean, &l.norm1_rstd, &l.norm2_mean, &l.norm2_rstd})
      expect_shape("statistic " + p + "norm mean/rstd", t->shape(), Shape({N}));
    const std::string site = "dropout.layers." + std::to_string(i) + ".";
    for (const auto& [n, m] :
         {std::pair{"attn", &l.masks.attn}, std::pair{"residual1", &l.masks.residual1},
          std::pair{"ffn", &l.masks.ffn}, std::pair{"residual2", &l.masks.residual2}})
      expect_size("mask " + site + n, *m, shape_of(contract::mask_dims(site + n)).numel(), true);
  }
  expect_size("mask dropout.input", a.input_mask,
              shape_of(contract::mask_dims("dropout.input")).numel(), true);
  if (c.embeddings.embedding_norm) {
    expect_shape("statistic embedding_norm mean", a.embedding_norm_mean.shape(), Shape({N}));
    expect_shape("statistic embedding_norm rstd", a.embedding_norm_rstd.shape(), Shape({N}));
  }
  if (c.norms.norm_first) {
    expect_shape("statistic final_norm mean", a.final_norm_mean.shape(), Shape({N}));
    expect_shape("statistic final_norm rstd", a.final_norm_rstd.shape(), Shape({N}));
  }
  if (c.lm()) {
    expect_shape("lm_probs", a.lm_probs.shape(),
                 Shape({B, c.encoder_decoder() ? b.tgt_len : S, c.target_vocab()}));
    return;
  }
  expect_shape("class_probs", a.class_probs.shape(), Shape({B, c.head.num_classes}));
  if (c.head.pooling == Pooling::max) {
    expect_size("pool_argmax", a.pool_argmax, B * D, false);
    // The only activation that indexes memory: backward adds into position argmax of each real
    // sequence, so every entry must be a real position of this batch (rows of length 0 are not
    // read). Activations from another batch with the same B and S fail here, not out of bounds.
    for (index_t bi = 0; bi < B; ++bi) {
      const std::int64_t len = b.lengths[static_cast<std::size_t>(bi)];
      if (len == 0) continue;
      for (index_t ci = 0; ci < D; ++ci) {
        const std::int64_t at = a.pool_argmax[static_cast<std::size_t>(bi * D + ci)];
        if (at < 0 || at >= len) {
          throw ShapeError("pool_argmax[" + std::to_string(bi) + ", " + std::to_string(ci) +
                           "] is " + std::to_string(at) + ", outside sequence " +
                           std::to_string(bi) + "'s length " + std::to_string(len) +
                           ": the activations are not from this batch's forward pass");
        }
      }
    }
  }
}

#define TEO_INSTANTIATE(Real)                                                \
  template struct Params<Real>;                                              \
  template void validate_params<Real>(const Params<Real>&);                  \
  template void validate_activations<Real>(const ModelConfig&, const Batch&, \
                                           const Activations<Real>&);
TEO_INSTANTIATE(float)
TEO_INSTANTIATE(double)
#undef TEO_INSTANTIATE

void round_params(Params<float>& params, Precision p) {
  if (!stores_reduced(p)) return;
  params.visit([&](const std::string& name, Tensor<float>& t) {
    if (round_to(p, t.data(), t.numel())) {
      throw RangeError("parameter " + name + ": " + overflow_message(p));
    }
  });
}

}  // namespace teo
